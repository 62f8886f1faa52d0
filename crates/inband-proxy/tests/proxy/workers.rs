//! Which worker thread a client connection is served on (packing's
//! choice, workers::choose_worker in the proxy, steered by the kernel to that worker's
//! own socket), seen where an operator sees it: the per-worker gauges and
//! the hand-over count of /metrics.

use std::time::Duration;

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const W0: &str = "inband_proxy_worker_connections{worker=\"0\"}";
const W1: &str = "inband_proxy_worker_connections{worker=\"1\"}";
const HANDED_OVER: &str = "inband_proxy_connections_handed_over_total";

/// A keep-alive client served once.
async fn served_client(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: w.test\r\n\r\n").await.unwrap();
    let mut buf = vec![0; 4096];
    let mut got = Vec::new();
    while !got.ends_with(b"served") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    s
}

/// Three keep-alive clients, each served once; returns the open
/// connections on workers 0 and 1, then checks both fall to 0 once the
/// clients leave.
async fn three_clients(extra: &str) -> (f64, f64) {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], &format!("workers = 2\n{extra}")).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(served_client(p.addr).await);
    }
    let m = metrics(&p).await;
    let split = (sample(&m, W0), sample(&m, W1));
    assert_eq!(split.0 + split.1, 3.0, "{m}");
    assert_eq!(sample(&m, HANDED_OVER), 0.0, "one at a time, each was steered to its worker's socket: {m}");
    assert!(m.contains("inband_proxy_worker_busy_ratio{worker=\"1\"}"), "{m}");
    drop(clients);
    wait_for_sample(&p, W0, 0.0).await;
    wait_for_sample(&p, W1, 0.0).await;
    p.shutdown().await;
    split
}

#[tokio::test]
async fn a_few_clients_share_one_idle_worker() {
    assert_eq!(three_clients("").await, (3.0, 0.0));
}

#[tokio::test]
async fn pack_connections_zero_spreads_clients_evenly() {
    assert_eq!(three_clients("pack_connections = 0").await, (2.0, 1.0));
}

/// Clients one at a time, spread evenly: each lands on the socket of the
/// worker packing chooses for it (the kernel's hash would put half of the
/// 12 on the other worker's), so no worker hands one over.
#[tokio::test]
async fn the_kernel_steers_each_connection_to_the_chosen_workers_socket() {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], "workers = 2\npack_connections = 0").await;
    let mut clients = Vec::new();
    for _ in 0..12 {
        clients.push(served_client(p.addr).await);
    }
    let m = metrics(&p).await;
    assert_eq!((sample(&m, W0), sample(&m, W1)), (6.0, 6.0), "{m}");
    assert_eq!(sample(&m, HANDED_OVER), 0.0, "{m}");
    drop(clients);
    p.shutdown().await;
}

/// A burst of connections queued on one worker's socket before the
/// steering moved is shared out as packing says: that worker hands the
/// rest over, and no worker ends up more than the packing bound ahead.
#[tokio::test]
async fn a_burst_queued_on_one_worker_is_shared_as_packing_says() {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], "workers = 2\npack_connections = 4").await;
    let addr = p.addr;
    let clients = futures_util::future::join_all((0..40).map(|_| served_client(addr))).await;
    let m = metrics(&p).await;
    let (w0, w1) = (sample(&m, W0), sample(&m, W1));
    assert_eq!(w0 + w1, 40.0, "{m}");
    // pack_connections, and one more where both workers chose at once.
    assert!((w0 - w1).abs() <= 5.0, "{w0} and {w1} connections: {m}");
    drop(clients);
    wait_for_sample(&p, W0, 0.0).await;
    wait_for_sample(&p, W1, 0.0).await;
    p.shutdown().await;
}

/// The workers' sockets share their address with SO_REUSEPORT, which
/// would let a second proxy of the same user join them and take a share of
/// the first one's clients: it is refused, as a second listener always was.
#[tokio::test]
async fn a_second_proxy_on_the_same_address_is_refused() {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], "workers = 2").await;
    let toml = format!("listen = \"{}\"\nbackends = [\"{}\"]\nworkers = 2", p.addr, o.addr);
    let refused = inband_proxy::Proxy::start(inband_proxy::config::parse(&toml).unwrap()).await;
    let e = format!("{:#}", refused.err().expect("a second proxy on the same address started"));
    assert!(e.contains(&format!("listening on {}", p.addr)) && e.contains("in use"), "{e}");
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(served_client(p.addr).await);
    }
    let m = metrics(&p).await;
    assert_eq!(sample(&m, W0) + sample(&m, W1), 4.0, "every client on the first proxy: {m}");
    drop(clients);
    p.shutdown().await;
}

/// `max_connections` counts connections being served, whichever worker's
/// socket they arrive on: all 4 are served with two workers (an accept
/// loop waiting on a socket the kernel steers nothing to holds no slot),
/// the fifth waits until one of them leaves.
#[tokio::test]
async fn every_slot_of_max_connections_serves_a_client() {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], "workers = 2\nmax_connections = 4\n[client_limits]\nconnections = 0").await;
    let within = |d: u64| Duration::from_millis(d);
    let mut clients = Vec::new();
    for i in 0..4 {
        let c = tokio::time::timeout(within(3000), served_client(p.addr)).await;
        clients.push(c.unwrap_or_else(|_| panic!("client {} of max_connections 4 not served", i + 1)));
    }
    let mut fifth = TcpStream::connect(p.addr).await.unwrap();
    fifth.write_all(b"GET / HTTP/1.1\r\nHost: w.test\r\n\r\n").await.unwrap();
    let mut buf = vec![0; 4096];
    assert!(tokio::time::timeout(within(300), fifth.read(&mut buf)).await.is_err(), "a fifth client served beyond max_connections");
    drop(clients.pop());
    let n = tokio::time::timeout(within(3000), fifth.read(&mut buf)).await.expect("the fifth served once a slot freed").unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    drop(clients);
    p.shutdown().await;
}

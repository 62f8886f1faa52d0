//! Which worker thread a client connection is served on (the acceptor's
//! choice, server::choose_worker), seen where an operator sees it: the
//! per-worker gauges of /metrics.


use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const W0: &str = "inband_proxy_worker_connections{worker=\"0\"}";
const W1: &str = "inband_proxy_worker_connections{worker=\"1\"}";

/// Three keep-alive clients, each served once; returns the open
/// connections on workers 0 and 1, then checks both fall to 0 once the
/// clients leave.
async fn three_clients(extra: &str) -> (f64, f64) {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], &format!("workers = 2\n{extra}")).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(p.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: w.test\r\n\r\n").await.unwrap();
        let mut buf = vec![0; 4096];
        let mut got = Vec::new();
        while !got.ends_with(b"served") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        clients.push(s);
    }
    let m = metrics(&p).await;
    let split = (sample(&m, W0), sample(&m, W1));
    assert_eq!(split.0 + split.1, 3.0, "{m}");
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

//! Slow and idle clients: every connection is bounded from accept (header
//! timeout, 408 when part of a head came), between requests (idle
//! timeout) and while a response waits for a client that does not read
//! (send timeout); idle clients cannot hold the connection slots for ever.


use std::time::{Duration, Instant};

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn timeouts(m: &str, kind: &str) -> f64 {
    sample(m, &format!("inband_proxy_connection_timeouts_total{{kind=\"{kind}\"}}"))
}

/// Reads until the proxy closes; the bytes and how long it took. Bounded.
async fn until_closed(s: &mut TcpStream) -> (String, Duration) {
    let t = Instant::now();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await.expect("closed within 10 s");
    (String::from_utf8_lossy(&out).into_owned(), t.elapsed())
}

/// A GET on a kept-alive connection, read up to its body "hello".
async fn one_request(s: &mut TcpStream) -> String {
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = vec![0; 4096];
    let mut got = String::new();
    while !got.ends_with("hello") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "closed before the response: {got:?}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    got
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_at_the_header_timeout() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "client_header_timeout_ms = 300").await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let (out, took) = until_closed(&mut s).await;
    assert_eq!(out, "", "nothing to answer");
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "{took:?}");
    wait_for_sample(&p, "inband_proxy_connection_timeouts_total{kind=\"idle\"}", 1.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn a_head_that_never_completes_gets_408_from_accept() {
    let o = Origin::start(|_| ok("x")).await;
    // 1.5 s: the trickle below (27 bytes, 10 ms apart) must end before it
    // on a loaded machine too, or the proxy's close breaks the writes
    // (CI 31 overshot 400 ms).
    let p = start_proxy(&[o.addr], "client_header_timeout_ms = 1500").await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    // Trickled: each byte resets nothing, the bound runs from accept.
    for b in b"GET / HTTP/1.1\r\nHost: x\r\n" {
        s.write_all(&[*b]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (out, took) = until_closed(&mut s).await;
    assert!(out.starts_with("HTTP/1.1 408"), "{out:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert_eq!(o.hits(), 0);
    let m = metrics(&p).await;
    assert_eq!(timeouts(&m, "header"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_requests_total{class=\"4xx\"}"), 1.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn a_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let o = Origin::start(|_| ok("hello")).await;
    let p = start_proxy(&[o.addr], "client_header_timeout_ms = 5000\nidle_timeout_ms = 300").await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let got = one_request(&mut s).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    let (rest, took) = until_closed(&mut s).await;
    assert_eq!(rest, "");
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "{took:?}: the idle timeout, not the header one");
    wait_for_sample(&p, "inband_proxy_connection_timeouts_total{kind=\"idle\"}", 1.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn idle_clients_beyond_max_connections_do_not_stop_service() {
    let o = Origin::start(|_| ok("served")).await;
    // Idle clients of many addresses, as far as the proxy can tell: no
    // per-client limit (the client_limits module has one address's case).
    let p = start_proxy(&[o.addr], "max_connections = 20\nclient_header_timeout_ms = 300\n[client_limits]\nconnections = 0").await;
    let mut idle = Vec::new();
    for _ in 0..60 {
        idle.push(TcpStream::connect(p.addr).await.unwrap());
    }
    let t = Instant::now();
    let r = get(p.addr, "/").await;
    assert_eq!((r.status, r.body.as_str()), (200, "served"));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // The request waited for an idle client's slot, but not necessarily
    // behind all 60: each worker accepts from its own SO_REUSEPORT
    // socket, so its place in the line depends on the worker the kernel
    // gave it, not on when it connected.
    let m = metrics(&p).await;
    assert!(timeouts(&m, "idle") >= 1.0, "{m}");
    assert!(sample(&m, "inband_proxy_connections") <= 20.0, "{m}");
    // Every idle client is cut, each in its turn: none holds a slot for good.
    wait_for_sample(&p, "inband_proxy_connection_timeouts_total{kind=\"idle\"}", 60.0).await;
    drop(idle);
    p.shutdown().await;
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_at_the_send_timeout() {
    let big = vec![b'z'; 64 << 20];
    let o = Origin::start(move |_| Reply { status: 200, body: big.clone(), ..Default::default() }).await;
    let p = start_proxy(&[o.addr], "send_timeout_ms = 300").await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    // Never read: the socket buffers fill and the proxy's writes wait.
    wait_for_sample(&p, "inband_proxy_connection_timeouts_total{kind=\"send\"}", 1.0).await;
    assert_eq!(sample(&metrics(&p).await, "inband_proxy_connections"), 0.0);
    p.shutdown().await;
}

#[tokio::test]
async fn a_slow_second_head_on_a_keep_alive_connection_gets_408_at_the_header_timeout() {
    let o = Origin::start(|_| ok("hello")).await;
    let p = start_proxy(&[o.addr], "client_header_timeout_ms = 400\nidle_timeout_ms = 20000").await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    one_request(&mut s).await;
    // Idle a while (well under the idle timeout), then start a head and stall.
    tokio::time::sleep(Duration::from_millis(600)).await;
    s.write_all(b"GET /second HTTP/1.1\r\n").await.unwrap();
    let (out, took) = until_closed(&mut s).await;
    assert!(out.starts_with("HTTP/1.1 408"), "{out:?}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}: the header timeout from the first byte");
    assert_eq!(o.hits(), 1);
    p.shutdown().await;
}

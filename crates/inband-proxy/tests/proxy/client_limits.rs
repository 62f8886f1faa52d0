//! Per-client limits (`[client_limits]`): one address holding idle
//! connections cannot take the connection slots from everyone else, and a
//! client over its request rate is answered 429 while others are served.


use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A connection to `to` from the loopback address `from`.
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    s.connect(to).await.unwrap()
}

/// One GET on a fresh connection from `from`: the status line and headers.
async fn get_from(from: &str, to: SocketAddr) -> String {
    let mut s = connect_from(from, to).await;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await.expect("answered within 5 s").unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn one_address_holding_idle_connections_leaves_room_for_everyone_else() {
    let o = Origin::start(|_| ok("served")).await;
    // No [client_limits]: a client may hold an eighth of the 40 slots (5).
    let p = start_proxy(&[o.addr], "max_connections = 40\nclient_header_timeout_ms = 60000").await;
    let mut idle = Vec::new();
    for _ in 0..60 {
        idle.push(connect_from("127.0.0.1", p.addr).await);
    }
    wait_for_sample(&p, "inband_proxy_client_connections_refused_total", 55.0).await;
    let started = Instant::now();
    let r = get_from("127.0.0.2", p.addr).await;
    assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("served"), "{r}");
    assert!(started.elapsed() < Duration::from_secs(1), "served at once: {:?}", started.elapsed());
    // The attacker's sixth connection onwards were closed at once.
    let mut closed = 0;
    for s in &mut idle {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(50), s.read(&mut b)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 55, "all but 5 of the 60 idle connections closed");
    assert_eq!(sample(&metrics(&p).await, "inband_proxy_client_connections_refused_total"), 55.0);
    p.shutdown().await;
}

#[tokio::test]
async fn a_client_over_its_rate_gets_429_and_others_are_served() {
    let o = Origin::start(|_| ok("served")).await;
    let p = start_proxy(&[o.addr], "[client_limits]\nrequests_per_s = 1\nburst = 3").await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = get_from("127.0.0.1", p.addr).await;
        statuses.push(r[9..12].to_string());
        if r.starts_with("HTTP/1.1 429") {
            assert!(r.to_ascii_lowercase().contains("retry-after: 1"), "{r}");
        }
    }
    assert_eq!(statuses, ["200", "200", "200", "429", "429"], "the burst, then the rate");
    assert!(get_from("127.0.0.3", p.addr).await.starts_with("HTTP/1.1 200"), "another client is not limited");
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"client_rate\"}"), 2.0, "{m}");
    assert_eq!(o.hits(), 4, "refused requests never reach the origin");
    p.shutdown().await;
}

#[tokio::test]
async fn limits_out_of_range_are_refused_at_start() {
    for (extra, want) in [
        ("[client_limits]\nrequests_per_s = -1", "client_limits.requests_per_s = -1 must be 0 (no limit) or more"),
        ("[client_limits]\nrequests_per_s = 5\nburst = 0.5", "client_limits.burst = 0.5 must be at least 1"),
        ("[client_limits]\nconection = 3", "unknown field `conection`"),
    ] {
        let toml = format!("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:9\"]\n{extra}");
        let e = format!("{:#}", inband_proxy::config::parse(&toml).unwrap_err());
        assert!(e.contains(want), "{extra}: {e}");
    }
}

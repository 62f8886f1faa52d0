//! Active HTTP health checks (`[health]`): a GET of one path on each
//! backend, on a connection of its own, every interval. A backend that
//! fails `unhealthy_after` checks in a row is taken out (no slot of it is
//! claimed) until it passes `healthy_after` in a row. The pools' own
//! checks (connect, TCP state) catch a dead backend; these catch one that
//! accepts connections but answers errors.

use std::net::SocketAddrV4;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{info, warn};

use inband_proxy::health::Verdicts;

use super::config::HealthCheck;
use super::daemon::Shared;

pub async fn check(sh: Rc<Shared>, backend: u32, addr: SocketAddrV4, hc: HealthCheck) {
    let mut tick = tokio::time::interval(Duration::from_millis(hc.interval_ms));
    let (mut passing, mut verdicts) = (true, Verdicts::default());
    loop {
        tick.tick().await;
        let outcome = tokio::time::timeout(Duration::from_millis(hc.timeout_ms), probe(addr, &hc.path)).await;
        let ok = matches!(outcome, Ok(Ok(status)) if (200..400).contains(&status));
        match verdicts.record(&hc, passing, ok) {
            Some(true) => info!(%addr, "health checks pass again: backend back in"),
            Some(false) => {
                let why = match outcome {
                    Ok(Ok(status)) => format!("status {status}"),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("no answer in {} ms", hc.timeout_ms),
                };
                warn!(%addr, "health checks fail ({why}): backend taken out");
            }
            None => continue,
        }
        passing = !passing;
        sh.health.checked(&sh.dp, backend, passing);
    }
}

/// The status code of `GET path`, read from the status line.
async fn probe(addr: SocketAddrV4, path: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: inband-mesh-health\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut res = httparse::Response::new(&mut headers);
        match res.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => return Ok(res.code.unwrap_or(0)),
            Ok(httparse::Status::Partial) if buf.len() < 16 * 1024 => {}
            _ => return Err(std::io::Error::other("not an HTTP response")),
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::other("closed before the status line"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

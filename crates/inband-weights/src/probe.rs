//! One HTTP/1.1 request on a fresh connection, timed to the last byte of
//! the body: the weights controller's latency probes and the open-loop
//! generator (`inband bench openloop`) both send these. A new connection
//! per request is what a balancer sees from clients that do not reuse
//! theirs, and what makes every request a new balancing decision.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No connection (refused, unreachable).
    Connect,
    /// The exchange broke (reset, bad response) before the body ended.
    Exchange,
    Timeout,
    /// A response, but 5xx: the server could not serve it (a full queue).
    Status(u16),
}

/// GETs `path` from `addr` and returns the time to the end of the body.
pub async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Duration, Failure> {
    let started = Instant::now();
    match tokio::time::timeout(timeout, exchange(addr, path)).await {
        Ok(Ok(())) => Ok(started.elapsed()),
        Ok(Err(f)) => Err(f),
        Err(_) => Err(Failure::Timeout),
    }
}

async fn exchange(addr: SocketAddr, path: &str) -> Result<(), Failure> {
    let stream = TcpStream::connect(addr).await.map_err(|_| Failure::Connect)?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await.map_err(|_| Failure::Exchange)?;
    let driver = tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONNECTION, "close")
        .body(Empty::new())
        .map_err(|_| Failure::Exchange)?;
    let res = sender.send_request(req).await.map_err(|_| Failure::Exchange)?;
    let status = res.status().as_u16();
    res.into_body().collect().await.map_err(|_| Failure::Exchange)?;
    driver.abort();
    if status >= 500 {
        return Err(Failure::Status(status));
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handshake {
    Done,
    /// Refused, unreachable: the host or its port is gone.
    Refused,
    /// No answer in time: gone, or only too busy to accept (a full listen
    /// queue drops SYNs); told apart by how long it lasts.
    Silent,
}

/// A TCP handshake with `addr` within `timeout`: the failure detector's
/// light request, which costs the server's application nothing.
pub async fn handshake(addr: SocketAddr, timeout: Duration) -> Handshake {
    match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Handshake::Done,
        Ok(Err(_)) => Handshake::Refused,
        Err(_) => Handshake::Silent,
    }
}

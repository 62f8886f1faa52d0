//! HTTP/1.1 `Upgrade` (WebSocket and the like): the request goes to a
//! backend with the protocols it offers that are allowed, the backend's
//! 101 goes back to the client, and once hyper has let go of both
//! connections they are joined byte for byte until both ends close or a
//! timeout runs out. Nothing of it touches the cache.
//!
//! hyper does the HTTP (`hyper::upgrade::on` on both sides) and tokio the
//! copying (`copy_bidirectional`); what is ours is the clock around the
//! copy, since neither bounds a tunnel nobody speaks on or a peer that
//! stops reading.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use crate::backend::TunnelInFlight;
use crate::body::{BoxError, ProxyBody};
use crate::config::UpgradeAllow;
use crate::conn::State;
use crate::metrics::Refusal;
use crate::upgrade::{protocols, Close, Pending, Upgrade};
use crate::{forward, Shared};

/// What a request offers.
pub enum Offer {
    /// No upgrade: `Upgrade` without the `upgrade` connection option
    /// (RFC 9110 §7.8 has the sender send both) is a hop-by-hop header
    /// like any other.
    None,
    NotAllowed,
    /// The allowed protocols, as the backend is to see them.
    Allowed(HeaderValue),
}

/// For an HTTP/1.1 request with `Upgrade` (hyper attaches an `OnUpgrade`
/// only to those, and to CONNECT).
pub fn offer(allow: &UpgradeAllow, headers: &HeaderMap) -> Offer {
    let upgrade_option = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if !upgrade_option {
        return Offer::None;
    }
    let allowed: Vec<&str> = headers.get_all(header::UPGRADE).iter().flat_map(protocols).filter(|p| allow.allows(p)).collect();
    if allowed.is_empty() {
        return Offer::NotAllowed;
    }
    // Joined from parts of a valid header value.
    Offer::Allowed(HeaderValue::from_str(&allowed.join(", ")).expect("parts of a header value form one"))
}

/// Sends an upgrade request with the `offered` protocols (its own
/// hop-by-hop headers already stripped); on a 101 leaves the tunnel in
/// `conn` for the connection's task to run.
pub async fn forward(
    shared: &Shared,
    pool: &crate::routes::BackendPool,
    mut parts: request::Parts,
    body: Bytes,
    key: &[u8],
    (offered, client): (HeaderValue, OnUpgrade),
    conn: &State,
) -> Result<Response<ProxyBody>, Refusal> {
    parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    parts.headers.insert(header::UPGRADE, offered);
    let mut resp = match forward::send(shared, pool, &parts, body, key).await {
        Ok(r) => r,
        Err(r) => {
            shared.metrics.upgrade(Upgrade::Failed);
            return Err(r);
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let in_flight = resp.extensions_mut().remove::<Arc<TunnelInFlight>>();
        conn.open_tunnel(Pending { client, backend: hyper::upgrade::on(&mut resp), in_flight: in_flight.map(|g| Box::new(g) as Box<dyn Send + Sync>) });
        shared.metrics.upgrade(Upgrade::Switched);
    } else {
        shared.metrics.upgrade(Upgrade::Declined);
    }
    Ok(resp.map(|b| b.map_err(BoxError::from).boxed()))
}

/// Each direction's copy buffer. A tunnel holds two for its life, so this
/// is most of what an idle one costs in user space: nginx's 8 KiB would
/// cut a 16 KiB TLS record in two reads.
const BUF: usize = 16 << 10;

/// Runs a tunnel the backend agreed to, after the 101 has gone to the client.
/// Returns the two ends, closed when the caller drops them: after it has
/// counted the connection as ended, so a client that sees the close finds
/// it in the metrics.
pub async fn run(t: Pending, shared: &Shared, client_addr: SocketAddr) -> Option<impl Sized> {
    let idle = shared.cfg.tunnel_idle_timeout();
    let send = shared.cfg.timeouts().send;
    let start = Instant::now();
    // Both are fulfilled by now or at the next turn of their connection's
    // task; the bound is for a backend connection task that never runs.
    let Pending { client, backend, in_flight: _in_flight } = t;
    let (client, backend) = match tokio::time::timeout(idle, async { tokio::join!(client, backend) }).await {
        Ok((Ok(c), Ok(b))) => (c, b),
        Ok((c, b)) => {
            shared.metrics.tunnel_close(Close::Error);
            tracing::debug!(client = %client_addr, client_error = ?c.err(), backend_error = ?b.err(), "upgrade not handed over");
            return None;
        }
        Err(_) => {
            shared.metrics.tunnel_close(Close::Error);
            tracing::debug!(client = %client_addr, "upgrade not handed over in time");
            return None;
        }
    };
    let _open = Open::new(&shared.metrics.tunnels_open);
    let clock = Clock::new();
    let [from_client, from_backend] = &shared.metrics.tunnel_bytes;
    let mut c = Metered { io: TokioIo::new(client), clock: &clock, side: 0, read: from_client };
    let mut b = Metered { io: TokioIo::new(backend), clock: &clock, side: 1, read: from_backend };
    let close = join(&mut c, &mut b, &clock, idle, send).await;
    shared.metrics.tunnel_close(close);
    tracing::info!(target: "inband_proxy::access", client = %client_addr, reason = close.label(), ms = start.elapsed().as_secs_f64() * 1e3, "tunnel closed");
    Some((c.io, b.io))
}

/// Copies both ways until both sides have closed, or until the clock says
/// a timeout ran out; dropping the copy then closes both.
async fn join<A, B>(a: &mut A, b: &mut B, clock: &Clock, idle: Duration, send: Duration) -> Close
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let mut copy = pin!(tokio::io::copy_bidirectional_with_sizes(a, b, BUF, BUF));
    let mut sleep = pin!(tokio::time::sleep_until(clock.deadline(idle, send).0));
    // The clock is read after every poll of the copy (the same task, so
    // no wake-ups of its own), and the timer moved only when a deadline
    // comes sooner than it is set for: bytes flowing push the idle
    // deadline later at every read, and a timer that fires early just
    // looks again.
    std::future::poll_fn(|cx| loop {
        if let Poll::Ready(r) = copy.as_mut().poll(cx) {
            return Poll::Ready(if r.is_ok() { Close::Ended } else { Close::Error });
        }
        let (at, why) = clock.deadline(idle, send);
        if at <= Instant::now() {
            return Poll::Ready(why);
        }
        if at < sleep.deadline() || sleep.is_elapsed() {
            sleep.as_mut().reset(at);
        }
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
    })
    .await
}

const NONE: u64 = u64::MAX;

/// A tunnel's times, in milliseconds since `start`.
struct Clock {
    start: Instant,
    /// The last byte read or written, either side.
    last: AtomicU64,
    /// Per side, since when a write to it has been waiting; NONE while
    /// writes go through.
    blocked: [AtomicU64; 2],
}

impl Clock {
    fn new() -> Clock {
        Clock { start: Instant::now(), last: AtomicU64::new(0), blocked: [AtomicU64::new(NONE), AtomicU64::new(NONE)] }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn moved(&self) {
        self.last.store(self.now(), Ordering::Relaxed);
    }

    fn write_waits(&self, side: usize, pending: bool) {
        let b = &self.blocked[side];
        if pending {
            if b.load(Ordering::Relaxed) == NONE {
                b.store(self.now(), Ordering::Relaxed);
            }
        } else if b.load(Ordering::Relaxed) != NONE {
            b.store(NONE, Ordering::Relaxed);
        }
    }

    /// When the tunnel closes if nothing moves, and why.
    fn deadline(&self, idle: Duration, send: Duration) -> (Instant, Close) {
        let mut at = (self.last.load(Ordering::Relaxed).saturating_add(idle.as_millis() as u64), Close::Idle);
        for b in &self.blocked {
            let since = b.load(Ordering::Relaxed);
            if since != NONE {
                let blocked_until = since.saturating_add(send.as_millis() as u64);
                if blocked_until < at.0 {
                    at = (blocked_until, Close::Send);
                }
            }
        }
        (self.start + Duration::from_millis(at.0), at.1)
    }
}

/// One side of a tunnel as the copy sees it: every read and write tells
/// the clock.
struct Metered<'a, T> {
    io: T,
    clock: &'a Clock,
    side: usize,
    read: &'a Counter,
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<'_, T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.clock.moved();
            self.read.inc_by(n as u64);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> Metered<'_, T> {
    fn wrote(&self, r: &Poll<io::Result<usize>>) {
        self.clock.write_waits(self.side, r.is_pending());
        if matches!(r, Poll::Ready(Ok(n)) if *n > 0) {
            self.clock.moved();
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<'_, T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, data);
        self.wrote(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.wrote(&r);
        r
    }

    // A TLS stream's flush waits on the socket like a write.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.clock.write_waits(self.side, r.is_pending());
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.clock.write_waits(self.side, r.is_pending());
        r
    }
}

/// Counts a tunnel open for as long as it lives, shutdown included (the
/// worker's runtime drops it then).
struct Open<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> Open<'a> {
    fn new(g: &'a prometheus_client::metrics::gauge::Gauge) -> Open<'a> {
        g.inc();
        Open(g)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upgrade::switched_as_offered;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn offers() {
        let ws = UpgradeAllow::Only(vec!["websocket".into()]);
        let allowed = |o: Offer| match o {
            Offer::Allowed(v) => v.to_str().unwrap().to_string(),
            Offer::None => "none".into(),
            Offer::NotAllowed => "not allowed".into(),
        };
        assert_eq!(allowed(offer(&ws, &headers(&[("connection", "keep-alive, Upgrade"), ("upgrade", "WebSocket")]))), "WebSocket");
        assert_eq!(allowed(offer(&ws, &headers(&[("upgrade", "websocket")]))), "none");
        assert_eq!(allowed(offer(&ws, &headers(&[("connection", "upgrade"), ("upgrade", "h2c")]))), "not allowed");
        assert_eq!(allowed(offer(&ws, &headers(&[("connection", "upgrade"), ("upgrade", "h2c, websocket"), ("upgrade", "foo")]))), "websocket");
        assert_eq!(allowed(offer(&UpgradeAllow::Any, &headers(&[("connection", "upgrade"), ("upgrade", "h2c,  foo/1")]))), "h2c, foo/1");
    }

    #[test]
    fn a_101_must_switch_to_what_was_offered() {
        let v = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(switched_as_offered(Some(&v("websocket")), Some(&v("WebSocket"))));
        assert!(switched_as_offered(Some(&v("foo, websocket")), Some(&v("websocket"))));
        assert!(!switched_as_offered(Some(&v("websocket")), Some(&v("h2c"))));
        assert!(!switched_as_offered(Some(&v("websocket")), Some(&v(""))));
        assert!(!switched_as_offered(Some(&v("websocket")), None));
        assert!(!switched_as_offered(None, Some(&v("websocket"))));
    }
}

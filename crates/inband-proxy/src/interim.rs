//! Interim (1xx) responses of an HTTP/1.1 origin, relayed to the
//! HTTP/1.1 client whose request they answer (RFC 9110 §15.2: a proxy
//! forwards them; 103 Early Hints lets the client start fetching what the
//! final response will name).
//!
//! Written here because hyper's HTTP/1.1 server cannot send one: a
//! service returns a single response, and a 1xx returned is turned into a
//! 500 (hyperium/hyper#3815 would add a sender; hyper's client already
//! hands them to `hyper::ext::on_informational`). So [`RelayIo`] sits
//! between hyper and the connection (above TLS) and writes an interim
//! response's bytes itself, at a moment hyper has nothing of its own
//! unsent: after hyper's last write was flushed and before it writes
//! again, which for the request in flight is its final response's head.
//! An interim response that finds hyper mid-write (the previous response
//! of a pipelined connection still going out) is dropped, as RFC 8297
//! allows an intermediary to do, and counted. HTTP/2 clients get none:
//! hyper keeps h2's stream handle to itself (hyperium/hyper#4114).
//!
//! Why "flushed" is enough: hyper hands the connection its encoded bytes
//! in the same poll that encodes them, so after a completed flush it holds
//! none; and it reads (and starts) a pipelined request only once the
//! previous response is wholly encoded, so an interim response taken while
//! its request is current and the connection clean goes out after the
//! previous response and before its own. This needs the origin's callback
//! to run between polls of the client's connection, never inside one: it
//! runs on the backend connection's task, which is on the same worker
//! thread (each worker has its own backend pools, upstream.rs).
//!
//! State: a [`Relay`] per connection; bytes wait in it from the origin's
//! callback until the connection's next read, write or flush takes them,
//! at most [`PENDING_BYTES`]; a request's handle ([`Interim`]) is good
//! only while its request is the connection's current one.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use futures_util::task::AtomicWaker;
use http::{header, Request, StatusCode};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What became of an interim response from an origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Written to the client ahead of its final response.
    Forwarded,
    /// Not written: hyper was mid-write, the request had ended, or over
    /// [`PENDING_BYTES`] were waiting.
    Dropped,
}

impl Fate {
    pub const ALL: [Fate; 2] = [Fate::Forwarded, Fate::Dropped];

    pub fn label(self) -> &'static str {
        match self {
            Fate::Forwarded => "forwarded",
            Fate::Dropped => "dropped",
        }
    }
}

/// Interim bytes that may wait for the connection at once: a few hint
/// responses, not an origin's flood.
pub const PENDING_BYTES: usize = 16 * 1024;

/// One connection's relay, shared by its [`RelayIo`], its requests'
/// [`Interim`] handles and the origin connections' callbacks.
pub struct Relay {
    state: Mutex<Waiting>,
    /// Bytes wait in `state`: the connection's fast path reads only this.
    waiting: AtomicBool,
    /// The connection's task, woken when bytes arrive.
    waker: AtomicWaker,
    counters: [Counter; 2],
}

#[derive(Default)]
struct Waiting {
    bytes: Vec<u8>,
    /// The request interim responses are taken for (0: none).
    current: u64,
    last: u64,
    /// Responses in `bytes`, counted once their fate is known.
    responses: u64,
}

impl Relay {
    pub fn new(counters: [Counter; 2]) -> Arc<Relay> {
        Arc::new(Relay { state: Mutex::default(), waiting: AtomicBool::new(false), waker: AtomicWaker::new(), counters })
    }

    /// Makes `req` the connection's current request; its interim
    /// responses are taken until the returned guard drops (when the
    /// service has its final response, before hyper writes it).
    pub fn begin<B>(self: &Arc<Relay>, req: &mut Request<B>) -> Current {
        let mut p = self.state.lock().unwrap();
        p.last += 1;
        p.current = p.last;
        req.extensions_mut().insert(Interim { relay: self.clone(), request: p.last });
        Current(self.clone())
    }

    fn count(&self, fate: Fate, n: u64) {
        self.counters[fate as usize].inc_by(n);
    }

    /// Takes the waiting bytes (and how many responses they hold).
    fn take(&self) -> (Vec<u8>, u64) {
        let mut p = self.state.lock().unwrap();
        self.waiting.store(false, Ordering::Release);
        (std::mem::take(&mut p.bytes), std::mem::take(&mut p.responses))
    }
}

/// The current request's term; dropping it ends it.
pub struct Current(Arc<Relay>);

impl Drop for Current {
    fn drop(&mut self) {
        self.0.state.lock().unwrap().current = 0;
    }
}

/// A request's way to its client for interim responses: in the request's
/// extensions, and so on the request sent to the origin.
#[derive(Clone)]
pub struct Interim {
    relay: Arc<Relay>,
    request: u64,
}

impl Interim {
    /// Has the origin's interim responses to `req` (HTTP/1.1 origins:
    /// hyper's HTTP/2 client reads and drops them) relayed to the client.
    pub fn watch<B>(&self, req: &mut Request<B>) {
        let this = self.clone();
        hyper::ext::on_informational(req, move |res| this.relay(res.status(), res.headers()));
    }

    fn relay(&self, status: StatusCode, fields: &http::HeaderMap) {
        // 100 is hyper's to send (it answers Expect itself), 101 is final.
        if matches!(status, StatusCode::CONTINUE | StatusCode::SWITCHING_PROTOCOLS) {
            return;
        }
        let mut fields = fields.clone();
        crate::hop_by_hop::strip(&mut fields);
        fields.remove(header::CONTENT_LENGTH);
        let bytes = encode(status, &fields);
        let r = &self.relay;
        {
            let mut p = r.state.lock().unwrap();
            if p.current != self.request || p.bytes.len() + bytes.len() > PENDING_BYTES {
                drop(p);
                r.count(Fate::Dropped, 1);
                return;
            }
            p.bytes.extend_from_slice(&bytes);
            p.responses += 1;
            r.waiting.store(true, Ordering::Release);
        }
        r.waker.wake();
    }
}

/// An interim response as HTTP/1.1 writes it.
fn encode(status: StatusCode, fields: &http::HeaderMap) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + fields.len() * 32);
    b.extend_from_slice(format!("HTTP/1.1 {} {}\r\n", status.as_u16(), status.canonical_reason().unwrap_or("")).as_bytes());
    for (name, value) in fields {
        b.extend_from_slice(name.as_str().as_bytes());
        b.extend_from_slice(b": ");
        b.extend_from_slice(value.as_bytes());
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(b"\r\n");
    b
}

/// The connection beneath hyper, writing interim responses between
/// hyper's writes.
pub struct RelayIo<T> {
    io: T,
    relay: Arc<Relay>,
    /// hyper's last write has been flushed: it holds nothing unsent.
    clean: bool,
    /// Interim bytes taken and being written, and how far.
    out: Vec<u8>,
    at: usize,
}

impl<T> RelayIo<T> {
    pub fn new(io: T, relay: Arc<Relay>) -> RelayIo<T> {
        RelayIo { io, relay, clean: true, out: Vec::new(), at: 0 }
    }
}

impl<T: AsyncWrite + Unpin> RelayIo<T> {
    /// Writes what waits, if hyper holds nothing unsent, else drops it.
    /// Ready once every taken byte is with `io` (a flush is attempted,
    /// not awaited: hyper's own bytes follow in order either way).
    fn poll_relay(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.relay.waiting.load(Ordering::Acquire) {
            let (bytes, responses) = self.relay.take();
            match self.clean {
                true => {
                    self.out.extend_from_slice(&bytes);
                    self.relay.count(Fate::Forwarded, responses);
                }
                false => self.relay.count(Fate::Dropped, responses),
            }
        }
        if self.out.is_empty() {
            return Poll::Ready(Ok(()));
        }
        while self.at < self.out.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.at += n;
        }
        self.out.clear();
        self.at = 0;
        let _ = Pin::new(&mut self.io).poll_flush(cx)?;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for RelayIo<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.relay.waker.register(cx.waker());
        // hyper reads while its request waits on the origin: the moment to
        // send what the origin sent ahead. A write that cannot go on now
        // finishes before hyper's next one.
        if let Poll::Ready(Err(e)) = this.poll_relay(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for RelayIo<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_relay(cx))?;
        this.clean = false;
        Pin::new(&mut this.io).poll_write(cx, data)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_relay(cx))?;
        this.clean = false;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(Pin::new(&mut this.io).poll_flush(cx))?;
        // hyper flushes its own buffer into `io` before flushing `io`.
        this.clean = true;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.clean = false;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn relay() -> (Arc<Relay>, [Counter; 2]) {
        let counters = [Counter::default(), Counter::default()];
        (Relay::new(counters.clone()), counters)
    }

    fn hints() -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(header::LINK, "</s.css>; rel=preload".parse().unwrap());
        h.insert(header::CONNECTION, "x-private".parse().unwrap());
        h.insert("x-private", "1".parse().unwrap());
        h
    }

    const HINT: &str = "HTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\n\r\n";

    async fn read_all(mut peer: tokio::io::DuplexStream) -> String {
        let mut s = String::new();
        peer.read_to_string(&mut s).await.unwrap();
        s
    }

    /// Between hyper's flushed writes an interim response goes out at
    /// once, ahead of the final one, its hop-by-hop fields removed.
    #[tokio::test]
    async fn an_interim_response_goes_out_between_the_servers_writes() {
        let (r, counters) = relay();
        let (a, peer) = tokio::io::duplex(1 << 16);
        let mut io = RelayIo::new(a, r.clone());
        let mut req = Request::new(());
        let current = r.begin(&mut req);
        let handle = req.extensions().get::<Interim>().unwrap().clone();
        handle.relay(StatusCode::EARLY_HINTS, &hints());
        handle.relay(StatusCode::CONTINUE, &http::HeaderMap::new());
        let mut scratch = [0u8; 1];
        // A read (hyper waits on the origin) sends what waits.
        let _ = tokio::time::timeout(std::time::Duration::from_millis(5), io.read(&mut scratch)).await;
        drop(current);
        io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await.unwrap();
        io.flush().await.unwrap();
        handle.relay(StatusCode::EARLY_HINTS, &hints());
        drop(io);
        assert_eq!(read_all(peer).await, format!("{HINT}HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert_eq!((counters[0].get(), counters[1].get()), (1, 1), "forwarded, and dropped once its request ended");
    }

    /// An interim response that arrives while hyper's last write is not
    /// yet flushed (a pipelined connection's previous response) is
    /// dropped: written there it would land inside that response.
    #[tokio::test]
    async fn an_interim_response_never_lands_inside_an_unflushed_write() {
        let (r, counters) = relay();
        let (a, peer) = tokio::io::duplex(1 << 16);
        let mut io = RelayIo::new(a, r.clone());
        io.write_all(b"previous ").await.unwrap();
        let mut req = Request::new(());
        let _current = r.begin(&mut req);
        req.extensions().get::<Interim>().unwrap().relay(StatusCode::EARLY_HINTS, &hints());
        io.write_all(b"rest").await.unwrap();
        io.flush().await.unwrap();
        drop(io);
        assert_eq!(read_all(peer).await, "previous rest");
        assert_eq!((counters[0].get(), counters[1].get()), (0, 1));
    }

    /// Waiting bytes are bounded: past PENDING_BYTES the rest is dropped.
    #[tokio::test]
    async fn waiting_interim_bytes_are_bounded() {
        let (r, counters) = relay();
        let mut req = Request::new(());
        let _current = r.begin(&mut req);
        let handle = req.extensions().get::<Interim>().unwrap().clone();
        let n = PENDING_BYTES / HINT.len() + 5;
        for _ in 0..n {
            handle.relay(StatusCode::EARLY_HINTS, &hints());
        }
        let (a, peer) = tokio::io::duplex(1 << 20);
        let mut io = RelayIo::new(a, r.clone());
        io.write_all(b"final").await.unwrap();
        drop(io);
        let sent = read_all(peer).await;
        let forwarded = (PENDING_BYTES / HINT.len()) as u64;
        assert_eq!(sent.matches("103 Early Hints").count() as u64, forwarded);
        assert!(sent.ends_with("final"));
        assert_eq!((counters[0].get(), counters[1].get()), (forwarded, n as u64 - forwarded));
    }
}

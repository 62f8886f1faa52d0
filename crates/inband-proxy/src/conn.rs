//! One client connection's clocks: the timeouts hyper does not keep.
//!
//! hyper's HTTP/1 header timeout starts only once a request's first bytes
//! are parsed (behind hyper-util's protocol sniffing, not at accept), it
//! closes without a 408, and nothing bounds an idle keep-alive connection
//! or a client that stops reading. So the socket is shared between hyper
//! (through [`Io`]) and a watchdog in the connection's task, which knows
//! from [`State`] whether a request is in progress and closes the
//! connection when one of these runs out:
//!
//! - `client_header_timeout_ms`, from accept (or from the first byte of a
//!   later request) to a complete request head: a 408 when some bytes came,
//!   a silent close when none did;
//! - `idle_timeout_ms`, between a finished response and the next request's
//!   first byte on a keep-alive connection: a silent close;
//! - `send_timeout_ms`, how long a response write may wait for the client
//!   to read: the connection is closed. Over HTTP/2 a client that stops
//!   reading need not fill the socket: it leaves its flow-control window
//!   shut, and hyper stops pulling the response body instead of writing.
//!   So the body (access.rs) says when it has handed hyper a chunk and not
//!   been asked for the next, and that wait counts as a blocked write.
//!   With several such responses on a connection the clock runs from
//!   when the first began waiting or, if later, when one was last taken
//!   up: a client that keeps reading one keeps the connection.
//!
//! The request body keeps its own `client_body_timeout_ms` (server.rs).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

const NONE: u64 = u64::MAX;

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub header: Duration,
    pub idle: Duration,
    pub send: Duration,
}

/// Why the watchdog closed a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// No request head within the header timeout, some bytes of it sent.
    Header,
    /// Nothing sent: after accept (header timeout) or after a response
    /// (idle timeout).
    Idle,
    /// A response write waited for the client longer than the send timeout.
    Send,
}

impl Expiry {
    pub fn label(self) -> &'static str {
        match self {
            Expiry::Header => "header",
            Expiry::Idle => "idle",
            Expiry::Send => "send",
        }
    }
}

/// What the watchdog reads. Times are milliseconds since `start`.
///
/// The watchdog sleeps until the earliest moment something can expire and
/// then looks again, so it is woken early (`changed`) only when a deadline
/// moves before the wake it armed: when a request starts and the send
/// timeout is the shorter one, or when a response ends and the idle or
/// header timeout is. A request's first byte or a full socket never wakes
/// it, since the wake armed while waiting comes no later than a head
/// could expire, and the one armed during a request no later than a send
/// could: with the defaults a busy connection costs no extra wake-ups.
pub struct State {
    start: Instant,
    t: Timeouts,
    /// Requests whose response has not finished (HTTP/2 runs several).
    active: AtomicU32,
    /// When `active` last fell to 0, or accept.
    waiting_since: AtomicU64,
    /// First byte read while `active` was 0; NONE before it.
    first_byte: AtomicU64,
    /// A response finished on this connection: waiting is keep-alive idling.
    kept_alive: AtomicBool,
    /// When a write found the socket full; NONE while writes go through.
    write_blocked: AtomicU64,
    /// HTTP/2 responses waiting for the client's window ([`RequestGuard::waiting_for_client`]).
    stalled: AtomicU32,
    /// When the first of them began waiting or, if later, one was taken
    /// up; NONE while none waits.
    stalled_since: AtomicU64,
    /// The client opened with the HTTP/2 preface: no HTTP/1 408 for it.
    http2: AtomicBool,
    /// TLS runs over the socket: a plaintext 408 would be garbage to the
    /// client, so an expired head is a silent close.
    encrypted: bool,
    sniffed: AtomicBool,
    /// The watchdog's next wake.
    armed: AtomicU64,
    changed: Notify,
    /// The tunnel a 101 opened, run by the connection's task once hyper
    /// has written the 101 and let go of the socket.
    tunnel: std::sync::Mutex<Option<crate::upgrade::Pending>>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl State {
    fn new(t: Timeouts, encrypted: bool) -> State {
        State {
            start: Instant::now(),
            t,
            active: AtomicU32::new(0),
            waiting_since: AtomicU64::new(0),
            first_byte: AtomicU64::new(NONE),
            kept_alive: AtomicBool::new(false),
            write_blocked: AtomicU64::new(NONE),
            stalled: AtomicU32::new(0),
            stalled_since: AtomicU64::new(NONE),
            http2: AtomicBool::new(false),
            encrypted,
            sniffed: AtomicBool::new(false),
            armed: AtomicU64::new(NONE),
            changed: Notify::new(),
            tunnel: std::sync::Mutex::new(None),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn note_write_blocked(&self) {
        if self.write_blocked.load(Ordering::Acquire) == NONE {
            self.write_blocked.store(self.now(), Ordering::Release);
        }
    }

    /// A request head arrived; the guard ends it when its response has been
    /// sent (or abandoned).
    /// `http2`: the request came over HTTP/2, where its response can
    /// wait for the client's window.
    pub fn begin_request(self: &Arc<State>, http2: bool) -> RequestGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        if self.now() + ms(self.t.send) < self.armed.load(Ordering::Acquire) {
            self.changed.notify_one();
        }
        RequestGuard { state: self.clone(), http2, waiting: false }
    }

    pub fn open_tunnel(&self, t: crate::upgrade::Pending) {
        *self.tunnel.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
    }

    pub fn take_tunnel(&self) -> Option<crate::upgrade::Pending> {
        self.tunnel.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// What expires first if nothing changes, and when.
    fn deadline(&self) -> (u64, Expiry) {
        let t = &self.t;
        if self.active.load(Ordering::Acquire) > 0 {
            let blocked = self.write_blocked.load(Ordering::Acquire).min(self.stalled_since.load(Ordering::Acquire));
            return match blocked {
                NONE => (self.now() + ms(t.send), Expiry::Send),
                since => (since.saturating_add(ms(t.send)), Expiry::Send),
            };
        }
        let since = self.waiting_since.load(Ordering::Acquire);
        let kept_alive = self.kept_alive.load(Ordering::Acquire);
        match self.first_byte.load(Ordering::Acquire) {
            NONE if kept_alive => (since + ms(t.idle), Expiry::Idle),
            NONE => (since + ms(t.header), Expiry::Idle),
            // The first request's head is bounded from accept.
            _ if !kept_alive => (ms(t.header), Expiry::Header),
            first => (first + ms(t.header), Expiry::Header),
        }
    }

    /// When the watchdog must look next: the deadline, or sooner while
    /// idling on keep-alive, where a first byte may start a header clock
    /// that runs out before the idle one.
    fn wake_at(&self) -> u64 {
        let (at, kind) = self.deadline();
        if kind == Expiry::Idle && self.kept_alive.load(Ordering::Acquire) {
            return at.min(self.waiting_since.load(Ordering::Acquire) + ms(self.t.header));
        }
        at
    }
}

/// Held while a request's response is being produced and sent.
pub struct RequestGuard {
    state: Arc<State>,
    http2: bool,
    waiting: bool,
}

impl RequestGuard {
    /// The response has a chunk out that the connection has not taken up
    /// (`true`), or is asked for more (`false`). The watchdog never needs
    /// an early wake for it: one armed during a request comes no later
    /// than a send timeout from when it began.
    pub fn waiting_for_client(&mut self, waiting: bool) {
        if !self.http2 || self.waiting == waiting {
            return;
        }
        self.waiting = waiting;
        let s = &self.state;
        if waiting {
            if s.stalled.fetch_add(1, Ordering::AcqRel) == 0 {
                s.stalled_since.store(s.now(), Ordering::Release);
            }
        } else if s.stalled.fetch_sub(1, Ordering::AcqRel) == 1 {
            s.stalled_since.store(NONE, Ordering::Release);
        } else {
            s.stalled_since.store(s.now(), Ordering::Release);
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.waiting_for_client(false);
        let s = &self.state;
        if s.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            let now = s.now();
            s.first_byte.store(NONE, Ordering::Release);
            s.waiting_since.store(now, Ordering::Release);
            s.kept_alive.store(true, Ordering::Release);
            if now + ms(s.t.idle.min(s.t.header)) < s.armed.load(Ordering::Acquire) {
                s.changed.notify_one();
            }
        }
    }
}

/// The socket as hyper sees it, owned: tokio's own read path clears the
/// socket's readiness after a short read, so the read hyper makes after
/// each request head waits for epoll instead of costing a `recvfrom` that
/// returns EAGAIN (one system call of about four per keep-alive request,
/// seen with `inband trace`). The watchdog writes its 408 through the raw
/// descriptor ([`watch`]).
pub struct Io {
    sock: TcpStream,
    state: Arc<State>,
    /// Bytes read off the socket before hyper had it (a request head the
    /// TCPE path read and did not hand off: tcpe.rs), given to hyper first.
    replay: bytes::Bytes,
}

impl Io {
    /// `encrypted`: the caller runs TLS over it, and the clocks cover the
    /// handshake as part of the first request's head.
    pub fn new(sock: TcpStream, t: Timeouts, encrypted: bool) -> (Io, RawFd, Arc<State>) {
        let state = Arc::new(State::new(t, encrypted));
        let fd = sock.as_raw_fd();
        (Io { sock, state: state.clone(), replay: bytes::Bytes::new() }, fd, state)
    }

    pub fn state(&self) -> &Arc<State> {
        &self.state
    }

    /// Puts `bytes` back in front of what the socket has not given yet.
    pub fn replay(&mut self, bytes: bytes::Bytes) {
        debug_assert!(self.replay.is_empty());
        self.replay = bytes;
    }
}

/// What the transparent handoff freezes (inband-tcpe's `repair`).
impl inband_tcpe::repair::Connected for Io {
    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.sock.local_addr()
    }
    fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.sock.peer_addr()
    }
}

impl std::os::fd::AsRawFd for Io {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl std::os::fd::AsFd for Io {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl AsyncRead for Io {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        if this.replay.is_empty() {
            ready!(Pin::new(&mut this.sock).poll_read(cx, buf))?;
        } else {
            let n = this.replay.len().min(buf.remaining());
            buf.put_slice(&this.replay.split_to(n));
        }
        let read = &buf.filled()[before..];
        if !read.is_empty() {
            let s = &this.state;
            if !s.sniffed.swap(true, Ordering::AcqRel) {
                s.http2.store(read.starts_with(b"PRI "), Ordering::Release);
            }
            if s.active.load(Ordering::Acquire) == 0 && s.first_byte.load(Ordering::Acquire) == NONE {
                s.first_byte.store(s.now(), Ordering::Release);
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Io {
    /// A write when the socket takes it; a full socket starts the send clock.
    fn poll_write_with(&self, cx: &mut Context<'_>, write: impl Fn(&TcpStream) -> io::Result<usize>) -> Poll<io::Result<usize>> {
        loop {
            if self.sock.poll_write_ready(cx).is_pending() {
                self.state.note_write_blocked();
                return Poll::Pending;
            }
            match write(&self.sock) {
                Ok(n) => {
                    self.state.write_blocked.store(NONE, Ordering::Release);
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, |s| s.try_write(data))
    }

    // hyper hands a response head and a body chunk over as one vectored
    // write; without this it copies the body into its own buffer first.
    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, |s| s.try_write_vectored(bufs))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: shutdown(2) on a descriptor this Arc keeps open.
        let r = unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_WR) };
        Poll::Ready(if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) })
    }
}

const REQUEST_TIMEOUT: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 22\r\nconnection: close\r\n\r\nrequest head too slow\n";

/// Runs `conn` until it ends or a timeout expires; returns its result, or
/// the expiry that ends it (dropping `conn` then closes the socket).
/// `sock` is the descriptor of the [`Io`] inside `conn`.
pub async fn watch<F: std::future::Future>(conn: F, sock: RawFd, state: &State) -> Result<F::Output, Expiry> {
    tokio::pin!(conn);
    loop {
        let at = state.wake_at();
        state.armed.store(at, Ordering::Release);
        let wake = tokio::time::Instant::from_std(state.start + Duration::from_millis(at));
        tokio::select! {
            out = &mut conn => return Ok(out),
            _ = tokio::time::sleep_until(wake) => {}
            _ = state.changed.notified() => continue,
        }
        let (at, expiry) = state.deadline();
        if state.now() < at {
            continue;
        }
        if expiry == Expiry::Header && !state.encrypted && !state.http2.load(Ordering::Acquire) {
            // hyper is waiting for the rest of a head, so nothing else is
            // writing; best effort, the socket closes right after.
            // SAFETY: `conn`, which owns the descriptor, is alive until
            // this function returns; a send to a closed peer fails with
            // an error, not a signal.
            unsafe { libc::send(sock, REQUEST_TIMEOUT.as_ptr().cast(), REQUEST_TIMEOUT.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        }
        return Err(expiry);
    }
}

//! The TCPE client: one byte stream over a connection whose subflows the
//! balancer moves (docs/decisions.md, "TCPE handoff: moving a connection").
//!
//! It opens the first subflow with TCPE offered. While it waits for bytes
//! it looks at the socket's storage, which the sockops program fills with
//! the notifications it verified; a create-path notification makes it open
//! a subflow to that address and join it (`join`). The stream's order: the
//! bytes of the first subflow that came before the JOIN-OK, then the
//! joined subflow's, whose first bytes follow the JOIN-OK. The server
//! decides: a JOIN-OK means it took the connection, so the client reads
//! the joined subflow at once and closes the first one, without waiting
//! for the balancer's FIN there (that FIN waits for the balancer to hear
//! the server's verdict: a wake-up of the balancer, then of the client, on
//! every handoff's path). A byte already waiting on the first subflow at
//! the JOIN-OK means the balancer kept the connection (its handoff fell
//! back before the join): the joined subflow is closed and the stream
//! stays where it is. A FIN with no joined subflow is the stream's end.
//! Writes go to the current subflow, so the client
//! sends one request and reads its response before it sends the next (the
//! handoff moves a connection between requests). A connection moves once:
//! a joined subflow has no TCPE of its own.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::join::{self, Kind, JOIN_LEN};
use crate::relay::Counters;
use crate::sockops::{SockState, State, Tcpe};

pub const COUNTERS: &[(&str, &str)] = &[
    ("moved", "Streams that went on on a joined subflow"),
    ("join_failed", "Create-path notifications whose subflow did not connect or join in time"),
    ("join_refused", "Joins the server answered without a valid JOIN-OK (or with a reset)"),
    ("join_abandoned", "Joined subflows closed because the old subflow carried on"),
];
const MOVED: usize = 0;
const JOIN_FAILED: usize = 1;
const JOIN_REFUSED: usize = 2;
const JOIN_ABANDONED: usize = 3;

/// How often a reader waiting on the first subflow looks for a
/// notification besides the program's wake-up (`tcpe_paths`), which
/// another reader of the same process may have taken, or the ring, full,
/// not queued. Every millisecond for the first NOTE_SOON of a read, where
/// a handoff's notification comes, then every 5: a response slow to
/// start on the first subflow costs 200 lookups a second, not 1,000.
const NOTE_POLL_SOON: Duration = Duration::from_millis(1);
const NOTE_SOON: Duration = Duration::from_millis(20);
const NOTE_POLL: Duration = Duration::from_millis(5);

pub struct Client {
    tcpe: Arc<Tcpe>,
    cur: TcpStream,
    /// `cur` is a joined subflow.
    moved: bool,
    /// The serial of the last notification acted on.
    handled: Option<u8>,
    timeout: Duration,
    counters: Counters,
}

fn check(r: libc::c_int, what: &str) -> io::Result<libc::c_int> {
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(r)
}

/// A TCP socket that offers TCPE, connected to `addr` within `timeout`.
fn connect_offered(tcpe: &Tcpe, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let domain = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: socket(2); the descriptor is owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(check(libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0), "socket")?) };
    tcpe.offer(fd.as_fd())?;
    // SO_SNDTIMEO bounds a blocking connect(2) too.
    let s = TcpStream::from(fd);
    s.set_write_timeout(Some(timeout))?;
    s.set_read_timeout(Some(timeout))?;
    let (sa, len) = sockaddr(addr);
    // SAFETY: connect with a sockaddr_storage holding `len` valid bytes.
    check(unsafe { libc::connect(s.as_raw_fd(), (&sa as *const libc::sockaddr_storage).cast(), len) }, "connect")
        .with_context(|| format!("connecting to {addr}"))?;
    Ok(s)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeroes is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr.ip() {
        IpAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: addr.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and aligned for it.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        IpAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: addr.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: a.octets() },
                sin6_scope_id: 0,
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Waits up to `wait` for `s` to be readable (data, FIN or an error), or
/// for `paths` (a notification accepted, [`Tcpe::paths_fd`]); whether `s`
/// is readable.
fn readable(s: &TcpStream, paths: BorrowedFd, wait: Duration) -> io::Result<bool> {
    let mut p = [
        libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: paths.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    let ms = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: poll on two pollfds.
    let n = unsafe { libc::poll(p.as_mut_ptr(), 2, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(e) };
    }
    Ok(p[0].revents != 0)
}

/// Opens a subflow to `addr` and joins it to connection `s`: JOIN with the
/// client's MAC, then the server's JOIN-OK checked, within `timeout`.
fn join(s: &SockState, addr: SocketAddr, timeout: Duration) -> Result<TcpStream, (usize, anyhow::Error)> {
    let failed = |e: anyhow::Error| (JOIN_FAILED, e);
    let mut t = TcpStream::connect_timeout(&addr, timeout).map_err(|e| failed(e.into()))?;
    t.set_read_timeout(Some(timeout)).map_err(|e| failed(e.into()))?;
    t.set_write_timeout(Some(timeout)).map_err(|e| failed(e.into()))?;
    let (local, peer) = (t.local_addr().map_err(|e| failed(e.into()))?, t.peer_addr().map_err(|e| failed(e.into()))?);
    let msg = join::encode(Kind::Join, s.conn_id, join::mac(Kind::Join, &s.keys, s.conn_id, local, peer));
    t.write_all(&msg).map_err(|e| failed(e.into()))?;
    let mut b = [0u8; JOIN_LEN];
    t.read_exact(&mut b).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => failed(e.into()),
        _ => (JOIN_REFUSED, e.into()),
    })?;
    match join::decode(Kind::Ok, &b) {
        Ok((id, mac)) if id == s.conn_id && mac == join::mac(Kind::Ok, &s.keys, s.conn_id, local, peer) => Ok(t),
        Ok(_) => Err((JOIN_REFUSED, anyhow::anyhow!("the JOIN-OK from {addr} did not verify"))),
        Err(e) => Err((JOIN_REFUSED, e.into())),
    }
}

impl Client {
    /// Connects to `addr` with TCPE offered. A server that does not answer
    /// TCPE gets plain TCP: the stream works, it never moves. `timeout`
    /// bounds the connect, each join, and each read's wait for a byte.
    pub fn connect(tcpe: Arc<Tcpe>, addr: SocketAddr, timeout: Duration) -> Result<Client> {
        let cur = connect_offered(&tcpe, addr, timeout)?;
        Ok(Client { tcpe, cur, moved: false, handled: None, timeout, counters: Counters::new(COUNTERS) })
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The subflow the stream is read from now.
    pub fn current(&self) -> &TcpStream {
        &self.cur
    }

    /// The connection's TCPE state, while it is on its first subflow.
    fn capable(&self) -> Option<SockState> {
        if self.moved {
            return None;
        }
        self.tcpe.state(self.cur.as_fd()).ok().flatten().filter(|s| s.state == State::Capable)
    }

    /// Acts on a create-path notification not acted on yet: joins, and
    /// goes on on the joined subflow unless a byte waits on the first one
    /// already. A remove-path needs no action: the client leaves the first
    /// subflow as it moves.
    fn look_for_path(&mut self) -> io::Result<()> {
        let Some(s) = self.capable() else { return Ok(()) };
        let Some((path, serial)) = s.last else { return Ok(()) };
        if self.handled == Some(serial) || !path.create {
            return Ok(());
        }
        self.handled = Some(serial);
        let joined = match join(&s, path.addr, self.timeout) {
            Ok(t) => t,
            Err((c, e)) => {
                tracing::debug!("tcpe: joining {}: {e:#}", path.addr);
                self.counters.bump(c);
                return Ok(());
            }
        };
        if has_byte(&self.cur)? {
            self.counters.bump(JOIN_ABANDONED);
            return Ok(());
        }
        // Closing the first subflow sends the client's FIN: nothing waits
        // in it, and what the balancer may still send there (only a
        // fallback after the server took the join: a verdict it did not
        // hear in time) meets a reset instead of the stream.
        self.cur = joined;
        self.moved = true;
        self.counters.bump(MOVED);
        Ok(())
    }
}

/// Whether a byte waits on `s` (not a FIN, not nothing), without waiting.
fn has_byte(s: &TcpStream) -> io::Result<bool> {
    let mut b = 0u8;
    // SAFETY: recv of at most one byte into a live byte.
    let n = unsafe { libc::recv(s.as_raw_fd(), (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n >= 0 {
        return Ok(n > 0);
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock => Ok(false),
        // A reset first subflow keeps nothing the stream could stay on.
        io::ErrorKind::ConnectionReset => Ok(false),
        _ => Err(e),
    }
}

impl Read for Client {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let start = Instant::now();
        // While a notification may come, the wait is a poll on the subflow
        // and the program's wake-up; once moved, a plain read bounded by
        // the socket's receive timeout: a poll before every read of a
        // large body was a second system call per read.
        while !self.moved {
            self.look_for_path()?;
            if self.moved {
                break;
            }
            let left = self.timeout.checked_sub(start.elapsed()).ok_or(io::ErrorKind::TimedOut)?;
            let period = if start.elapsed() < NOTE_SOON { NOTE_POLL_SOON } else { NOTE_POLL };
            if readable(&self.cur, self.tcpe.paths_fd(), left.min(period))? {
                break;
            }
            self.tcpe.drain_paths();
        }
        match self.cur.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::ErrorKind::TimedOut.into()),
            r => r,
        }
    }
}

impl Write for Client {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.cur.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.cur.flush()
    }
}

/// Buffered reading of an HTTP/1.1 response off a stream.
struct Reader<'a, S: Read> {
    s: &'a mut S,
    /// Read and not consumed yet: a head, a chunk's size line, the first
    /// body bytes that came with them.
    buf: Vec<u8>,
}

/// The most a read asks for. A body with nothing buffered before it is
/// read through one buffer of this size straight to its output (one copy,
/// as curl does): 10 MiB bodies through a 64 KiB stack buffer appended
/// to `buf` came at 0.77x curl's rate on the same connection.
const READ: usize = 256 * 1024;

impl<S: Read> Reader<'_, S> {
    /// Reads more; false at the stream's end.
    fn fill(&mut self) -> io::Result<bool> {
        let at = self.buf.len();
        self.buf.resize(at + READ.min(MAX_HEAD), 0);
        let n = self.s.read(&mut self.buf[at..]);
        self.buf.truncate(at + *n.as_ref().unwrap_or(&0));
        Ok(n? > 0)
    }

    fn need_more(&mut self, what: &str) -> Result<()> {
        if !self.fill()? {
            bail!("the connection closed in the middle of the response's {what}");
        }
        Ok(())
    }

    /// Moves `n` body bytes to `out`: what is buffered, then the rest read
    /// straight through one buffer, never past the `n` bytes.
    fn copy(&mut self, mut n: u64, out: &mut impl Write) -> Result<()> {
        let k = (self.buf.len() as u64).min(n) as usize;
        out.write_all(&self.buf[..k])?;
        self.buf.drain(..k);
        n -= k as u64;
        let mut through = vec![0u8; (n as usize).min(READ)];
        while n > 0 {
            let want = (n as usize).min(through.len());
            let got = self.s.read(&mut through[..want])?;
            if got == 0 {
                bail!("the connection closed in the middle of the response's body");
            }
            out.write_all(&through[..got])?;
            n -= got as u64;
        }
        Ok(())
    }
}

const MAX_HEAD: usize = 64 * 1024;

/// Sends `GET path` for `authority` on `conn` and writes the response's
/// body to `out`; returns the status.
pub fn get(conn: &mut (impl Read + Write), authority: &str, path: &str, out: &mut impl Write) -> Result<u16> {
    request(conn, authority, path)?;
    response(conn, out)
}

/// Sends `GET path` for `authority`, in one write: a request in several
/// segments would be acknowledged piecemeal (Nagle's wait for the ACK of
/// the first), and the balancer would owe no ACK to carry the notification.
pub fn request(conn: &mut impl Write, authority: &str, path: &str) -> Result<()> {
    request_with(conn, authority, path, "")
}

/// `request` with more header lines (`extra`, each ending in CRLF).
fn request_with(conn: &mut impl Write, authority: &str, path: &str, extra: &str) -> Result<()> {
    let head = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: inband-tcpe\r\n{extra}\r\n");
    conn.write_all(head.as_bytes())?;
    conn.flush()?;
    Ok(())
}

/// Reads one response off `conn`, writes its body to `out`, returns its
/// status. The response is framed by its Content-Length, chunked encoding,
/// or the stream's end; bytes after it are an error (one request in
/// flight). httparse parses the head and the chunk sizes.
pub fn response(conn: &mut impl Read, out: &mut impl Write) -> Result<u16> {
    let mut r = Reader { s: conn, buf: Vec::new() };
    let head = read_head(&mut r)?;
    read_body(&mut r, &head.framing, out)?;
    Ok(head.status)
}

/// What the client acts on in a response head.
struct Head {
    status: u16,
    framing: Framing,
    /// What an If-Range may name: a strong ETag, else Last-Modified
    /// (RFC 9110 13.1.5: a weak ETag may not be used there).
    validator: Option<String>,
    /// Content-Range's first and last byte and complete length.
    range: Option<(u64, u64, u64)>,
}

fn read_head<S: Read>(r: &mut Reader<'_, S>) -> Result<Head> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&r.buf).context("parsing the response head")? {
            httparse::Status::Partial if r.buf.len() > MAX_HEAD => bail!("a response head over {MAX_HEAD} bytes"),
            httparse::Status::Partial => r.need_more("head")?,
            httparse::Status::Complete(used) => {
                let status = resp.code.unwrap_or(0);
                let framing = framing(status, resp.headers)?;
                let value = |name: &str| {
                    resp.headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| String::from_utf8_lossy(h.value).trim().to_string())
                };
                let validator = value("etag").filter(|e| !e.starts_with("W/")).or_else(|| value("last-modified"));
                let range = value("content-range").and_then(|v| content_range(&v));
                r.buf.drain(..used);
                // An interim response (100 Continue) precedes the real one.
                if (100..200).contains(&status) {
                    continue;
                }
                return Ok(Head { status, framing, validator, range });
            }
        }
    }
}

/// `bytes first-last/length` (RFC 9110 14.4); None for anything else.
fn content_range(v: &str) -> Option<(u64, u64, u64)> {
    let (span, len) = v.strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = span.split_once('-')?;
    Some((first.trim().parse().ok()?, last.trim().parse().ok()?, len.trim().parse().ok()?))
}

fn read_body<S: Read>(r: &mut Reader<'_, S>, framing: &Framing, out: &mut impl Write) -> Result<()> {
    match *framing {
        Framing::Length(n) => r.copy(n, out)?,
        Framing::Chunked => loop {
            let (used, size) = loop {
                match httparse::parse_chunk_size(&r.buf) {
                    Ok(httparse::Status::Complete(x)) => break x,
                    Ok(httparse::Status::Partial) => r.need_more("chunk size")?,
                    Err(_) => bail!("a malformed chunk size line"),
                }
            };
            r.buf.drain(..used);
            if size == 0 {
                // Trailers (ignored) end with an empty line.
                while !(r.buf.starts_with(b"\r\n") || r.buf.windows(4).any(|w| w == b"\r\n\r\n")) {
                    if r.buf.len() > MAX_HEAD {
                        bail!("trailers over {MAX_HEAD} bytes");
                    }
                    r.need_more("trailers")?;
                }
                let end = if r.buf.starts_with(b"\r\n") { 2 } else { r.buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4 };
                r.buf.drain(..end);
                break;
            }
            r.copy(size, out)?;
            while r.buf.len() < 2 {
                r.need_more("chunk")?;
            }
            if !r.buf.starts_with(b"\r\n") {
                bail!("a chunk not followed by CRLF");
            }
            r.buf.drain(..2);
        },
        Framing::UntilClose => {
            out.write_all(&r.buf)?;
            r.buf.clear();
            while r.fill()? {
                out.write_all(&r.buf)?;
                r.buf.clear();
            }
        }
    }
    if !r.buf.is_empty() {
        bail!("{} bytes after the response", r.buf.len());
    }
    Ok(())
}

/// The answer to a range request that was not the rest of the same
/// object: a 200 (If-Range failed: it changed) or another range.
#[derive(Debug)]
struct Changed(u64, u64, u16, Option<(u64, u64, u64)>);

impl std::fmt::Display for Changed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Changed(from, total, status, range) = self;
        write!(f, "the body was cut at {from} of {total} bytes and the range request for the rest got {status} {range:?}: the object changed or the server ignores ranges")
    }
}

impl std::error::Error for Changed {}

/// At most this many requests follow a response's cut: the request sent
/// again, or range requests for the rest.
pub const MAX_RESUMES: u32 = 3;

/// What `fetch` did, and when (CLOCK_MONOTONIC ns: the clock every
/// process of the host shares, so that a benchmark can set a client's
/// times against its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchOutcome {
    pub status: u16,
    /// The body's bytes written.
    pub bytes: u64,
    /// Connections of the fetch that went on on a joined subflow.
    pub moved: u32,
    /// Requests after a cut: the request sent again (the connection had
    /// moved and no head came), or range requests for the rest of the body.
    pub resumed: u32,
    /// The first cut came after the connection had moved: the server it
    /// was handed to (or that server's origin) went away.
    pub cut_after_move: bool,
    /// Before the first connect.
    pub connect_ns: u64,
    /// The first request written.
    pub sent_ns: u64,
    /// The first byte of the response (on the new path, if it moved).
    pub first_byte_ns: u64,
    /// The body's end.
    pub done_ns: u64,
}

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A stream that notes when its first byte arrived.
struct FirstByte<'a, S> {
    s: &'a mut S,
    at: Option<u64>,
}

impl<S: Read> Read for FirstByte<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.s.read(buf)?;
        if n > 0 && self.at.is_none() {
            self.at = Some(monotonic_ns());
        }
        Ok(n)
    }
}

/// Counts what reached `out`, and whether `out` itself failed (a failure
/// no range request can help).
struct Counted<'a, W: Write> {
    out: &'a mut W,
    n: u64,
    failed: bool,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let r = self.out.write(b);
        match &r {
            Ok(k) => self.n += *k as u64,
            Err(_) => self.failed = true,
        }
        r
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// `GET path` from the balancer at `addr` over TCPE, the body to `out`.
///
/// After a handoff the balancer is out of the connection, so the server it
/// moved to dying (or its origin) cuts the body short, as it would on any
/// direct connection, and as a proxy in the path would too: it has no
/// other copy of the bytes. What is left is the client's to ask for: a 200
/// with a Content-Length and a validator is continued by a range request
/// from the byte it stopped at (`Range` with `If-Range`, RFC 9110 14.2
/// and 13.1.5), on a new connection to the balancer, which picks a live
/// server and may hand that one off too; at most `MAX_RESUMES` times. The
/// continuation is taken only as the exact 206 asked for: a 200 means the
/// object changed since (If-Range failed), and the fetch fails rather than
/// join two versions. Chunked bodies and responses without a validator
/// cannot be continued: the cut stays an error. A server that dies before
/// the response's head leaves nothing to continue: the GET is sent again,
/// as a new connection (also within `MAX_RESUMES`).
pub fn fetch(tcpe: &Arc<Tcpe>, addr: SocketAddr, authority: &str, path: &str, timeout: Duration, out: &mut impl Write) -> Result<FetchOutcome> {
    let mut done = FetchOutcome { connect_ns: monotonic_ns(), ..Default::default() };
    let (mut c, head, buf, at) = loop {
        let mut c = Client::connect(tcpe.clone(), addr, timeout)?;
        request(&mut c, authority, path)?;
        if done.sent_ns == 0 {
            done.sent_ns = monotonic_ns();
        }
        let mut first = FirstByte { s: &mut c, at: None };
        let mut r = Reader { s: &mut first, buf: Vec::new() };
        let head = read_head(&mut r);
        let buf = std::mem::take(&mut r.buf);
        let at = first.at;
        match head {
            Ok(head) => break (c, head, buf, at),
            Err(e) if c.moved && done.resumed < MAX_RESUMES => {
                tracing::debug!("tcpe fetch {path}: no head after the move ({e:#}); sending the request again");
                done.moved += 1;
                done.cut_after_move = true;
                done.resumed += 1;
            }
            Err(e) => return Err(e),
        }
    };
    let mut first = FirstByte { s: &mut c, at };
    let mut r = Reader { s: &mut first, buf };
    done.status = head.status;
    let mut out = Counted { out, n: 0, failed: false };
    let cut = read_body(&mut r, &head.framing, &mut out);
    done.first_byte_ns = first.at.unwrap_or_else(monotonic_ns);
    done.moved += c.moved as u32;
    let finish = |mut done: FetchOutcome, n: u64| {
        done.bytes = n;
        done.done_ns = monotonic_ns();
        done
    };
    let Err(mut cut) = cut else { return Ok(finish(done, out.n)) };
    done.cut_after_move |= c.moved;
    let (200, Framing::Length(total), Some(validator), false) = (head.status, &head.framing, &head.validator, out.failed) else {
        return Err(cut.context("the body was cut short and cannot be continued (not a 200 with a Content-Length and a validator)"));
    };
    let total = *total;
    while done.resumed < MAX_RESUMES && !out.failed {
        done.resumed += 1;
        let from = out.n;
        tracing::debug!("tcpe fetch {path}: cut at {from} of {total} bytes ({cut:#}); asking for the rest");
        // A try that fails on its way (no connection, a 502 while the
        // balancer has not seen the server go, another cut) leaves the
        // next try; an answer that is not the range asked for ends it.
        let mut c = match Client::connect(tcpe.clone(), addr, timeout) {
            Ok(c) => c,
            Err(e) => {
                cut = e;
                continue;
            }
        };
        let rest = request_with(&mut c, authority, path, &format!("Range: bytes={from}-\r\nIf-Range: {validator}\r\n")).and_then(|()| {
            let mut r = Reader { s: &mut c, buf: Vec::new() };
            let head = read_head(&mut r)?;
            match (head.status, head.range) {
                (206, Some(range)) if range == (from, total - 1, total) => read_body(&mut r, &head.framing, &mut out),
                (200 | 206, range) => Err(Changed(from, total, head.status, range).into()),
                (status, _) => bail!("the range request for the rest got {status}"),
            }
        });
        done.moved += c.moved as u32;
        match rest {
            Ok(()) => return Ok(finish(done, out.n)),
            Err(e) if e.is::<Changed>() => return Err(e),
            Err(e) => cut = e,
        }
    }
    Err(cut.context(format!("the body stopped at {} of {total} bytes after {} range requests", out.n, done.resumed)))
}

enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

fn framing(code: u16, headers: &[httparse::Header]) -> Result<Framing> {
    if code == 204 || code == 304 || (100..200).contains(&code) {
        return Ok(Framing::Length(0));
    }
    let value = |name: &str| headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| String::from_utf8_lossy(h.value).trim().to_string());
    if let Some(te) = value("transfer-encoding") {
        if te.eq_ignore_ascii_case("chunked") {
            return Ok(Framing::Chunked);
        }
        bail!("transfer-encoding {te:?} is not supported");
    }
    match value("content-length") {
        Some(v) => Ok(Framing::Length(v.parse().with_context(|| format!("content-length {v:?}"))?)),
        None => Ok(Framing::UntilClose),
    }
}

/// Splits an `http://host[:port]/path` URL into the address to connect to,
/// the Host header's value and the path (http::Uri parses it).
pub fn parse_url(url: &str) -> Result<(SocketAddr, String, String)> {
    let uri: http::Uri = url.parse().with_context(|| format!("parsing the URL {url:?}"))?;
    if uri.scheme_str() != Some("http") {
        bail!("{url}: only http:// URLs (TCPE carries the TCP stream; TLS is not built in)");
    }
    let auth = uri.authority().with_context(|| format!("{url}: no host"))?;
    let port = auth.port_u16().unwrap_or(80);
    let host = auth.host().trim_start_matches('[').trim_end_matches(']');
    let addr = (host, port).to_socket_addrs().with_context(|| format!("resolving {host}"))?.next().with_context(|| format!("{host} has no address"))?;
    let path = uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into());
    Ok((addr, auth.as_str().to_string(), path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_byte_is_timed_once() {
        let mut src: &[u8] = b"";
        let mut f = FirstByte { s: &mut src, at: None };
        assert_eq!(f.read(&mut [0u8; 4]).unwrap(), 0);
        assert!(f.at.is_none(), "no byte, no time");
        let mut src: &[u8] = b"abc";
        let mut f = FirstByte { s: &mut src, at: None };
        let before = monotonic_ns();
        assert_eq!(f.read(&mut [0u8; 2]).unwrap(), 2);
        let at = f.at.unwrap();
        assert!(at >= before);
        f.read(&mut [0u8; 2]).unwrap();
        assert_eq!(f.at, Some(at), "the first byte's time stays");
    }

    /// A stream that hands out at most `step` bytes a read, and counts
    /// what it handed out.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
        taken: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let k = buf.len().min(self.step).min(self.data.len() - self.taken);
            buf[..k].copy_from_slice(&self.data[self.taken..self.taken + k]);
            self.taken += k;
            Ok(k)
        }
    }

    #[test]
    fn a_body_is_copied_whole_in_order_and_never_read_past() {
        let data: Vec<u8> = (0..3 * READ as u32 + 77).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let body = 2 * READ + 5;
        // 10 bytes came with the head; the rest in reads of odd sizes.
        let mut s = Trickle { data: &data[10..], step: 70_001, taken: 0 };
        let mut r = Reader { s: &mut s, buf: data[..10].to_vec() };
        let mut out = Vec::new();
        r.copy(body as u64, &mut out).unwrap();
        assert!(out == data[..body], "the body's bytes, in order");
        assert!(r.buf.is_empty());
        assert_eq!(s.taken + 10, body, "nothing read past the body");
        // Cut short: an error, and what came is in `out`.
        let mut s = Trickle { data: &data[..100], step: 30, taken: 0 };
        let mut r = Reader { s: &mut s, buf: Vec::new() };
        let mut out = Vec::new();
        assert!(r.copy(1000, &mut out).unwrap_err().to_string().contains("closed in the middle of the response's body"));
        assert_eq!(out, data[..100]);
    }

    #[test]
    fn a_content_range_is_read_or_refused() {
        assert_eq!(content_range("bytes 262144-1048575/1048576"), Some((262_144, 1_048_575, 1_048_576)));
        for bad in ["bytes */1048576", "bytes 1-2", "items 1-2/3", "bytes a-2/3"] {
            assert_eq!(content_range(bad), None, "{bad}");
        }
    }
}

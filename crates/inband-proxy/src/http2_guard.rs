//! HTTP/2 clients that make the proxy work without asking for anything.
//!
//! h2 keeps most of the limits itself and ends the connection with GOAWAY
//! ENHANCE_YOUR_CALM when one is crossed: too many CONTINUATION frames in
//! one header block, a header block that decodes far past
//! `max_header_bytes`, streams over `max_concurrent_streams` (each refused
//! with RST_STREAM, counted with the other stream errors it answers; 1024
//! on one connection end it), resets of streams not yet accepted, floods
//! of small DATA frames. Which one is read from the debug data of the
//! GOAWAY as it is written.
//!
//! It has no limit on frames that carry no request at all: PING and
//! SETTINGS, each of which must be answered, RST_STREAM, with which a
//! client opens and cancels streams faster than `max_concurrent_streams`
//! can see them (the "rapid reset" of CVE-2023-44487: each one starts a
//! request here), and PRIORITY. h2 answers a PING or SETTINGS before it
//! reads on, so a flood costs CPU rather than memory, but for as long as
//! the client likes, and it offers no hook to count them. So [`Guarded`]
//! follows the frame headers in the bytes hyper reads (above TLS) and ends
//! a connection whose client sends more of those than
//! `[client_http2] control_frames_per_s`. Written here because h2's codec
//! is not public, and following frames needs no more than their 9-byte
//! headers (RFC 9113 §4.1): a few instructions per frame, none per byte of
//! payload, and one comparison per read or write on an HTTP/1.1
//! connection.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Why a client's HTTP/2 connection was ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abuse {
    Ping = 1,
    Settings,
    /// RST_STREAM from the client, over our rate or h2's limit on resets
    /// of streams not yet accepted.
    Reset,
    Priority,
    /// A header block split into more CONTINUATION frames than its size
    /// needs.
    Continuation,
    /// A header block that decodes far past the advertised limit.
    HeaderList,
    /// Streams h2 had to reset: opened over `max_concurrent_streams`, or
    /// malformed.
    StreamErrors,
    /// DATA frames too small for their count.
    SmallData,
    /// An ENHANCE_YOUR_CALM from h2 this version does not name.
    Other,
}

impl Abuse {
    pub const ALL: [Abuse; 9] = [
        Abuse::Ping,
        Abuse::Settings,
        Abuse::Reset,
        Abuse::Priority,
        Abuse::Continuation,
        Abuse::HeaderList,
        Abuse::StreamErrors,
        Abuse::SmallData,
        Abuse::Other,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Abuse::Ping => "ping",
            Abuse::Settings => "settings",
            Abuse::Reset => "reset",
            Abuse::Priority => "priority",
            Abuse::Continuation => "continuation",
            Abuse::HeaderList => "header_list",
            Abuse::StreamErrors => "stream_errors",
            Abuse::SmallData => "small_data",
            Abuse::Other => "other",
        }
    }
}

/// The abuse a connection was ended for, shared between its [`Guarded`]
/// (inside hyper's connection) and its task.
#[derive(Default)]
pub struct Verdict(AtomicU8);

impl Verdict {
    pub fn get(&self) -> Option<Abuse> {
        let v = self.0.load(Ordering::Acquire);
        Abuse::ALL.into_iter().find(|a| *a as u8 == v)
    }

    fn set(&self, a: Abuse) {
        self.0.store(a as u8, Ordering::Release);
    }
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADER_LEN: usize = 9;

const PRIORITY: u8 = 0x2;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;
const ENHANCE_YOUR_CALM: [u8; 4] = 11u32.to_be_bytes();

/// The limit h2 ended a connection for, by the debug data of the GOAWAY
/// ENHANCE_YOUR_CALM it sent (h2 0.4's; its error to the server leaves the
/// debug data out). Each is crossed by a test in tests/proxy/http2.rs,
/// which would see a renamed one as `other`.
fn from_debug_data(debug: &[u8]) -> Abuse {
    match debug {
        b"too_many_continuations" => Abuse::Continuation,
        b"header_list_way_too_large" => Abuse::HeaderList,
        b"too_many_internal_resets" => Abuse::StreamErrors,
        b"too_many_resets" => Abuse::Reset,
        b"too_many_data_frames" => Abuse::SmallData,
        _ => Abuse::Other,
    }
}

/// Where a reader is in one direction's frames.
enum At {
    /// This many bytes of the client's HTTP/2 preface seen.
    Preface(usize),
    /// Part of a frame header.
    Header([u8; HEADER_LEN], usize),
    /// Payload bytes left of the current frame.
    Payload(usize),
    /// Not HTTP/2, or no longer followed.
    Off,
}

enum Step<'a> {
    /// A whole frame header: type, flags.
    Header(u8, u8),
    /// Payload bytes of the current frame; `true` with its last ones.
    Payload(&'a [u8], bool),
    /// `bytes` are used up, or this is not HTTP/2.
    Done,
}

impl At {
    const NEXT: At = At::Header([0; HEADER_LEN], 0);

    /// Takes bytes off the front of `bytes` up to the next thing to report.
    fn step<'a>(&mut self, bytes: &mut &'a [u8]) -> Step<'a> {
        while !bytes.is_empty() {
            match self {
                At::Off => return Step::Done,
                At::Preface(seen) => {
                    let want = &PREFACE[*seen..];
                    let n = want.len().min(bytes.len());
                    if bytes[..n] != want[..n] {
                        *self = At::Off;
                        return Step::Done;
                    }
                    *seen += n;
                    *bytes = &bytes[n..];
                    if *seen == PREFACE.len() {
                        *self = At::NEXT;
                    }
                }
                At::Header(head, have) => {
                    let n = (HEADER_LEN - *have).min(bytes.len());
                    head[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    *bytes = &bytes[n..];
                    if *have == HEADER_LEN {
                        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
                        let (kind, flags) = (head[3], head[4]);
                        *self = if len == 0 { At::NEXT } else { At::Payload(len) };
                        return Step::Header(kind, flags);
                    }
                }
                At::Payload(left) => {
                    let n = (*left).min(bytes.len());
                    let (taken, rest) = bytes.split_at(n);
                    *left -= n;
                    *bytes = rest;
                    let last = *left == 0;
                    if last {
                        *self = At::NEXT;
                    }
                    return Step::Payload(taken, last);
                }
            }
        }
        Step::Done
    }

    fn is_http2(&self) -> bool {
        matches!(self, At::Header(..) | At::Payload(_))
    }
}

/// A client's byte stream as hyper reads and writes it: its HTTP/2
/// control frames counted, the GOAWAY h2 sends it read.
pub struct Guarded<T> {
    io: T,
    read: At,
    /// Follows what is written once the client spoke HTTP/2.
    written: At,
    /// The payload of a GOAWAY being written, up to [`GOAWAY_KEPT`] bytes.
    goaway: Option<Vec<u8>>,
    /// Frames allowed per window; 0: no limit.
    limit: u32,
    /// Counted frames in the window that began at `window`.
    count: u32,
    window: Instant,
    verdict: Arc<Verdict>,
}

/// Last stream id, error code, and enough debug data for h2's names.
const GOAWAY_KEPT: usize = 8 + 32;

const WINDOW: Duration = Duration::from_secs(1);

impl<T> Guarded<T> {
    /// `control_frames_per_s`: the limit, 0 lets every frame through;
    /// `verdict` learns the abuse that ended the connection.
    pub fn new(io: T, control_frames_per_s: u32, verdict: Arc<Verdict>) -> Guarded<T> {
        Guarded {
            io,
            read: At::Preface(0),
            written: At::Preface(0),
            goaway: None,
            limit: control_frames_per_s,
            count: 0,
            window: Instant::now(),
            verdict,
        }
    }

    fn scan_read(&mut self, mut bytes: &[u8]) -> Result<(), Abuse> {
        loop {
            match self.read.step(&mut bytes) {
                Step::Done => return Ok(()),
                Step::Header(kind, flags) => self.count(kind, flags)?,
                Step::Payload(..) => {}
            }
        }
    }

    /// The clock is read only when a window's count is used up: either
    /// the window is over and a new one starts, or the client is over.
    fn count(&mut self, kind: u8, flags: u8) -> Result<(), Abuse> {
        let abuse = match kind {
            PING if flags & ACK == 0 => Abuse::Ping,
            SETTINGS if flags & ACK == 0 => Abuse::Settings,
            RST_STREAM => Abuse::Reset,
            PRIORITY => Abuse::Priority,
            _ => return Ok(()),
        };
        self.count += 1;
        if self.limit == 0 || self.count <= self.limit {
            return Ok(());
        }
        let now = Instant::now();
        if now.duration_since(self.window) >= WINDOW {
            self.window = now;
            self.count = 1;
            return Ok(());
        }
        Err(abuse)
    }

    /// `bytes`: what the socket took of a write.
    fn scan_written(&mut self, mut bytes: &[u8]) {
        if matches!(self.written, At::Preface(_)) {
            // The server writes only once it has read the preface, or
            // the start of an HTTP/1.1 request.
            self.written = if self.read.is_http2() { At::NEXT } else { At::Off };
        }
        loop {
            match self.written.step(&mut bytes) {
                Step::Done => return,
                Step::Header(kind, _) => self.goaway = (kind == GOAWAY).then(Vec::new),
                Step::Payload(p, last) => {
                    let Some(g) = &mut self.goaway else { continue };
                    g.extend_from_slice(&p[..p.len().min(GOAWAY_KEPT - g.len())]);
                    if last {
                        if g.len() >= 8 && g[4..8] == ENHANCE_YOUR_CALM {
                            self.verdict.set(from_debug_data(&g[8..]));
                        }
                        self.goaway = None;
                    }
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        if matches!(this.read, At::Off) {
            return Poll::Ready(Ok(()));
        }
        if let Err(abuse) = this.scan_read(&buf.filled()[before..]) {
            this.read = At::Off;
            this.verdict.set(abuse);
            // h2 ends the connection on a read error, without answering
            // what it has not read yet.
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, format!("HTTP/2 {} flood", abuse.label()))));
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.io).poll_write(cx, data))?;
        if !matches!(this.written, At::Off) {
            this.scan_written(&data[..n]);
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for b in bufs {
            if left == 0 || matches!(this.written, At::Off) {
                break;
            }
            let k = b.len().min(left);
            this.scan_written(&b[..k]);
            left -= k;
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags, 0, 0, 0, 0];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn counts_control_frames_split_anywhere_and_skips_payloads() {
        let mut wire = PREFACE.to_vec();
        wire.extend(frame(SETTINGS, 0, &[0; 6]));
        wire.extend(frame(SETTINGS, ACK, &[]));
        wire.extend(frame(0x0, 0, &[PING; 300])); // DATA whose bytes look like PINGs
        for _ in 0..3 {
            wire.extend(frame(PING, 0, &[0; 8]));
        }
        wire.extend(frame(PING, ACK, &[0; 8]));
        // One byte at a time: every field crosses a read boundary.
        let mut g = Guarded::new((), 4, Arc::<Verdict>::default());
        for b in &wire {
            g.scan_read(std::slice::from_ref(b)).unwrap();
        }
        assert_eq!(g.count, 4, "1 SETTINGS and 3 PINGs, no ACKs, nothing inside the DATA");
        assert_eq!(g.scan_read(&frame(RST_STREAM, 0, &[0; 4])), Err(Abuse::Reset));
    }

    #[test]
    fn http1_is_left_alone() {
        let mut g = Guarded::new((), 1, Arc::default());
        g.scan_read(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(matches!(g.read, At::Off));
        let mut wire = Vec::new();
        for _ in 0..10 {
            wire.extend(frame(PING, 0, &[0; 8]));
        }
        g.scan_read(&wire).unwrap();
        g.scan_written(&frame(GOAWAY, 0, b"\0\0\0\0\0\0\0\x0btoo_many_resets"));
        assert!(matches!(g.written, At::Off));
        assert_eq!(g.verdict.get(), None);
    }

    #[test]
    fn a_new_window_starts_once_a_second_has_passed() {
        let mut g = Guarded::new((), 2, Arc::default());
        g.scan_read(PREFACE).unwrap();
        g.window -= WINDOW;
        let pings: Vec<u8> = (0..5).flat_map(|_| frame(PING, 0, &[0; 8])).collect();
        // The third is over the old window's 2 and starts a new one.
        g.scan_read(&pings[..51]).unwrap();
        assert_eq!(g.count, 1);
        assert_eq!(g.scan_read(&pings[51..]), Err(Abuse::Ping));
    }

    #[test]
    fn the_goaway_h2_writes_names_the_limit() {
        let mut g = Guarded::new((), 0, Arc::default());
        g.scan_read(PREFACE).unwrap();
        let mut wire = frame(SETTINGS, 0, &[0; 12]);
        // A graceful GOAWAY (NO_ERROR) names none.
        wire.extend(frame(GOAWAY, 0, &[0; 8]));
        wire.extend(frame(0x0, 0, &[GOAWAY; 40]));
        let mut calm = vec![0, 0, 0, 1, 0, 0, 0, 11];
        calm.extend_from_slice(b"too_many_internal_resets");
        wire.extend(frame(GOAWAY, 0, &calm));
        let (a, b) = wire.split_at(wire.len() - 5);
        g.scan_written(a);
        assert_eq!(g.verdict.get(), None);
        g.scan_written(b);
        assert_eq!(g.verdict.get(), Some(Abuse::StreamErrors));
    }
}

//! The HTTP side of `inband serve`: one thread per connection (the model,
//! not the threads, limits concurrency), requests parsed with httparse.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use super::capacity::{Capacity, Draw, Model};

const MAX_HEADER_BYTES: usize = 16 * 1024;
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the accept loop looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

pub struct Shared {
    model: Model,
    capacity: Capacity,
    body: Vec<u8>,
    keep_alive: bool,
    served: AtomicU64,
    rejected: AtomicU64,
    bad_requests: AtomicU64,
    statuses: Mutex<std::collections::BTreeMap<u16, u64>>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct Stats {
    pub served: u64,
    pub in_service: usize,
    pub queued: usize,
    pub rejected: u64,
    pub bad_requests: u64,
    pub statuses: std::collections::BTreeMap<u16, u64>,
}

impl Shared {
    pub fn new(model: Model, body_bytes: usize, keep_alive: bool) -> Shared {
        // Deterministic, incompressible-looking content.
        let body = (0..body_bytes).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[(i * 7 + i / 36) % 36]).collect();
        Shared {
            capacity: Capacity::new(model.workers, model.queue),
            model,
            body,
            keep_alive,
            served: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            statuses: Mutex::new(Default::default()),
        }
    }

    pub fn stats(&self) -> Stats {
        let (in_service, queued) = self.capacity.load();
        Stats {
            served: self.served.load(Ordering::Relaxed),
            in_service,
            queued,
            rejected: self.rejected.load(Ordering::Relaxed),
            bad_requests: self.bad_requests.load(Ordering::Relaxed),
            statuses: self.statuses.lock().unwrap().clone(),
        }
    }
}

pub fn accept_loop(listener: TcpListener, state: Arc<Shared>, stop: Arc<AtomicBool>) {
    let mut p = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    while !stop.load(Ordering::Relaxed) {
        // poll(2) wakes at once for a connection, and every STOP_POLL to
        // look at the stop flag: a sleep between accepts would add up to
        // its length before every new connection's service, which the
        // benchmarks would count as the server's latency.
        // SAFETY: poll on one pollfd.
        if unsafe { libc::poll(&mut p, 1, STOP_POLL.as_millis() as libc::c_int) } <= 0 {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let state = Arc::clone(&state);
                std::thread::spawn(move || {
                    let _ = serve_connection(stream, &state);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => std::thread::sleep(STOP_POLL),
        }
    }
}

enum RequestHead {
    Request { method: String, path: String, keep_alive: bool, draw: Option<Draw>, consumed: usize },
    Incomplete,
    Bad(u16),
}

fn parse(buf: &[u8]) -> RequestHead {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(consumed)) => {
            let version = req.version.unwrap_or(0);
            let conn = req.headers.iter().find(|h| h.name.eq_ignore_ascii_case("connection")).map(|h| h.value.to_ascii_lowercase());
            let keep_alive = match conn.as_deref() {
                Some(b"close") => false,
                Some(b"keep-alive") => true,
                _ => version == 1,
            };
            let has_body = req.headers.iter().any(|h| {
                (h.name.eq_ignore_ascii_case("content-length") && h.value != b"0") || h.name.eq_ignore_ascii_case("transfer-encoding")
            });
            if has_body {
                // GET/HEAD bodies are not supported: refuse rather than misparse the stream.
                return RequestHead::Bad(400);
            }
            let draw = match req.headers.iter().find(|h| h.name.eq_ignore_ascii_case("x-service-draw")) {
                None => None,
                Some(h) => match Draw::parse(h.value) {
                    Some(d) => Some(d),
                    None => return RequestHead::Bad(400),
                },
            };
            RequestHead::Request {
                method: req.method.unwrap_or("").to_string(),
                path: req.path.unwrap_or("/").to_string(),
                keep_alive,
                draw,
                consumed,
            }
        }
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEADER_BYTES => RequestHead::Bad(431),
        Ok(httparse::Status::Partial) => RequestHead::Incomplete,
        Err(httparse::Error::TooManyHeaders) => RequestHead::Bad(431),
        Err(_) => RequestHead::Bad(400),
    }
}

fn serve_connection(mut stream: TcpStream, st: &Shared) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let (method, path, keep_alive, draw, consumed) = loop {
            match parse(&buf) {
                RequestHead::Request { method, path, keep_alive, draw, consumed } => break (method, path, keep_alive, draw, consumed),
                RequestHead::Bad(code) => {
                    st.bad_requests.fetch_add(1, Ordering::Relaxed);
                    return respond(&mut stream, st, code, b"", false, false);
                }
                RequestHead::Incomplete => {
                    let n = stream.read(&mut chunk)?;
                    if n == 0 {
                        return Ok(());
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
            }
        };
        buf.drain(..consumed);
        let keep = keep_alive && st.keep_alive;
        if method != "GET" && method != "HEAD" {
            st.bad_requests.fetch_add(1, Ordering::Relaxed);
            return respond(&mut stream, st, 405, b"", false, false);
        }
        let head_only = method == "HEAD";
        if path == "/stats" {
            // Not queued: observability must not wait behind the load.
            let body = serde_json::to_vec(&st.stats()).unwrap_or_default();
            respond(&mut stream, st, 200, &body, keep, head_only)?;
        } else {
            let started = st.capacity.started;
            let draw = draw.unwrap_or_else(|| Draw::random(&mut rand::thread_rng()));
            let admitted = st.capacity.admit(|start| st.model.service_time(start - started, draw));
            let Some(admitted) = admitted else {
                st.rejected.fetch_add(1, Ordering::Relaxed);
                return respond(&mut stream, st, 503, b"", false, head_only);
            };
            std::thread::sleep(admitted.end.saturating_duration_since(std::time::Instant::now()));
            st.served.fetch_add(1, Ordering::Relaxed);
            respond(&mut stream, st, 200, &st.body, keep, head_only)?;
        }
        if !keep {
            return Ok(());
        }
    }
}

fn respond(stream: &mut TcpStream, st: &Shared, code: u16, body: &[u8], keep: bool, head_only: bool) -> std::io::Result<()> {
    *st.statuses.lock().unwrap().entry(code).or_default() += 1;
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Length: {}\r\nContent-Type: application/octet-stream\r\nConnection: {}\r\n\r\n",
        body.len(),
        if keep { "keep-alive" } else { "close" }
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(body)?;
    }
    stream.flush()?;
    if !keep {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
    Ok(())
}

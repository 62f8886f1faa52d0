//! `inband bench churn`: many short HTTP/1.1 connections, each from a
//! client tuple of its own (the source addresses given, ports counted up,
//! never reused), each opened, answered and closed, by a few threads.
//! What a balancer must survive for a month: far more connections over its
//! life than it has SNAT ports, none of them refused. Prints JSON.
//!
//! The client closes first (it reads the whole response of a keep-alive
//! request, then closes), as a well-behaved HTTP/1.1 client does; with
//! `--server-closes` it asks `Connection: close` instead, so the server's
//! side of every connection sits in TIME_WAIT (the case where reusing a
//! SNAT port soon can cost a new connection a SYN retransmission).
//! Bounded by a connection count and by time.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::Serialize;

#[derive(clap::Args, Debug, Clone)]
pub struct ChurnArgs {
    #[arg(long)]
    pub target: SocketAddrV4,
    /// Source addresses (comma-separated, local to this namespace); each
    /// gives up to 55,000 client ports, so tuples never repeat.
    #[arg(long, value_delimiter = ',', required = true)]
    pub sources: Vec<Ipv4Addr>,
    #[arg(long, default_value_t = 10_000)]
    pub connections: u64,
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Stop after this long, whichever comes first.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 5_000)]
    pub timeout_ms: u64,
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Ask the server to close first (it then holds TIME_WAIT).
    #[arg(long)]
    pub server_closes: bool,
}

#[derive(Debug, Default, Serialize)]
pub struct ChurnResult {
    pub attempted: u64,
    pub ok: u64,
    pub failed: u64,
    /// Failures by what went wrong.
    pub errors: BTreeMap<String, u64>,
    /// The first failures, with their client tuple and start time (s from
    /// the run's start), to find them in a capture.
    pub first_failures: Vec<Failure>,
    /// Connections that took longer than 900 ms (a SYN retransmission).
    pub slower_than_900ms: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub seconds: f64,
    pub per_second: f64,
}

#[derive(Debug, Serialize)]
pub struct Failure {
    pub source: String,
    pub at_s: f64,
    pub error: String,
}

const FIRST_FAILURES: usize = 20;
const FIRST_PORT: u16 = 10_000;
const PORTS_PER_SOURCE: u64 = 55_000;

pub fn run(a: &ChurnArgs) -> Result<ChurnResult> {
    if a.connections > a.sources.len() as u64 * PORTS_PER_SOURCE {
        bail!("{} connections need more source addresses: each gives {PORTS_PER_SOURCE} distinct tuples", a.connections);
    }
    let next = Arc::new(AtomicU64::new(0));
    let times = Arc::new(Mutex::new(Vec::with_capacity(a.connections as usize)));
    let errors: Arc<Mutex<(BTreeMap<String, u64>, Vec<Failure>)>> = Arc::default();
    let start = Instant::now();
    let deadline = Duration::from_secs_f64(a.seconds);
    let threads: Vec<_> = (0..a.concurrency.max(1))
        .map(|_| {
            let (a, next, times, errors) = (a.clone(), Arc::clone(&next), Arc::clone(&times), Arc::clone(&errors));
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= a.connections || start.elapsed() >= deadline {
                    break;
                }
                let n = a.sources.len() as u64;
                let src = SocketAddrV4::new(a.sources[(i % n) as usize], FIRST_PORT + (i / n) as u16);
                let t = Instant::now();
                match one(&a, src) {
                    Ok(()) => times.lock().unwrap().push(t.elapsed()),
                    Err(e) => {
                        let mut errors = errors.lock().unwrap();
                        if errors.1.len() < FIRST_FAILURES {
                            let at_s = (t - start).as_secs_f64();
                            errors.1.push(Failure { source: src.to_string(), at_s, error: e.clone() });
                        }
                        *errors.0.entry(e).or_default() += 1;
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    let mut times = Arc::try_unwrap(times).unwrap().into_inner().unwrap();
    times.sort();
    let (errors, first_failures) = Arc::try_unwrap(errors).unwrap().into_inner().unwrap();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let pct = |p: f64| times.get(((times.len() as f64 * p) as usize).min(times.len().saturating_sub(1))).map_or(0.0, |d| ms(*d));
    let failed: u64 = errors.values().sum();
    let seconds = start.elapsed().as_secs_f64();
    Ok(ChurnResult {
        attempted: times.len() as u64 + failed,
        ok: times.len() as u64,
        failed,
        errors,
        first_failures,
        slower_than_900ms: times.iter().filter(|d| **d > Duration::from_millis(900)).count() as u64,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        max_ms: times.last().map_or(0.0, |d| ms(*d)),
        seconds,
        per_second: times.len() as f64 / seconds,
    })
}

/// One connection from `src`: request, the whole response, close. The
/// error is a short name for the tally.
fn one(a: &ChurnArgs, src: SocketAddrV4) -> Result<(), String> {
    let timeout = Duration::from_millis(a.timeout_ms);
    let sock = connect_from(src, a.target, timeout)?;
    let mut s = sock;
    s.set_read_timeout(Some(timeout)).map_err(|e| format!("setup: {}", e.kind()))?;
    let conn = if a.server_closes { "close" } else { "keep-alive" };
    let req = format!("GET {} HTTP/1.1\r\nHost: {}\r\nConnection: {conn}\r\n\r\n", a.path, a.target);
    s.write_all(req.as_bytes()).map_err(|e| format!("write: {}", e.kind()))?;
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = s.read(&mut chunk).map_err(|e| format!("read: {}", e.kind()))?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(done) = complete(&buf) {
            if !done {
                return Err("status: not 200".into());
            }
            if !a.server_closes {
                return Ok(()); // the client closes first: `s` drops here
            }
        }
    }
    match complete(&buf) {
        Some(true) => Ok(()),
        Some(false) => Err("status: not 200".into()),
        None => Err("short response".into()),
    }
}

/// Some(ok) once `buf` holds a whole response (status and Content-Length
/// body); ok = status 200.
fn complete(buf: &[u8]) -> Option<bool> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(head) = resp.parse(buf).ok()? else { return None };
    let len: usize = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())?;
    (buf.len() >= head + len).then_some(resp.code == Some(200))
}

/// A TCP connection from exactly `src` (address and port) to `dst`.
fn connect_from(src: SocketAddrV4, dst: SocketAddrV4, timeout: Duration) -> Result<TcpStream, String> {
    // std cannot bind before connecting; the socket is made by hand.
    // SAFETY: a new socket, owned by the TcpStream built from it below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error().kind()));
    }
    // SAFETY: fd is a fresh socket nothing else owns.
    let stream = unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    let sin = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: valid option and address buffers of the given sizes.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, (&one as *const libc::c_int).cast(), 4);
        if libc::bind(fd, (&sin(src) as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(format!("bind: {}", std::io::Error::last_os_error().kind()));
        }
    }
    // A bound socket is connected with the timeout std offers after the fact:
    // non-blocking connect, then wait for writability.
    stream.set_nonblocking(true).map_err(|e| format!("setup: {}", e.kind()))?;
    // SAFETY: a valid address buffer.
    let rc = unsafe { libc::connect(fd, (&sin(dst) as *const libc::sockaddr_in).cast(), len) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
        return Err(format!("connect: {}", std::io::Error::last_os_error().kind()));
    }
    let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
    if ready != 1 {
        return Err("connect: timed out".into());
    }
    if let Some(e) = stream.take_error().map_err(|e| format!("connect: {}", e.kind()))? {
        return Err(format!("connect: {}", e.kind()));
    }
    stream.set_nonblocking(false).map_err(|e| format!("setup: {}", e.kind()))?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_is_complete_with_its_whole_body() {
        assert_eq!(complete(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nab"), None);
        assert_eq!(complete(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"), Some(true));
        assert_eq!(complete(b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n"), Some(false));
        assert_eq!(complete(b"HTTP/1.1 200 OK\r\n"), None);
    }

    #[test]
    fn a_local_server_answers_every_connection_from_distinct_tuples() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let std::net::SocketAddr::V4(target) = l.local_addr().unwrap() else { unreachable!() };
        let server = std::thread::spawn(move || {
            let mut peers = std::collections::HashSet::new();
            for _ in 0..40 {
                let (mut s, peer) = l.accept().unwrap();
                peers.insert(peer);
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).unwrap();
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap();
            }
            peers.len()
        });
        let a = ChurnArgs {
            target,
            sources: vec!["127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap()],
            connections: 40,
            concurrency: 4,
            seconds: 20.0,
            timeout_ms: 5000,
            path: "/".into(),
            server_closes: false,
        };
        let r = run(&a).unwrap();
        assert_eq!((r.attempted, r.ok, r.failed), (40, 40, 0), "{r:?}");
        assert_eq!(server.join().unwrap(), 40, "every connection from its own tuple");
    }
}

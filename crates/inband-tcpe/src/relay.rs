//! Counters of the handoff's user-space parts, and the byte relay the
//! takeover server (and a proxy that keeps a connection) runs between a
//! subflow and an origin.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Named counters: each component lists its names and meanings once and
/// counts by index into that list.
pub struct Counters {
    names: &'static [(&'static str, &'static str)],
    values: Vec<AtomicU64>,
}

impl Counters {
    pub fn new(names: &'static [(&'static str, &'static str)]) -> Counters {
        Counters { names, values: names.iter().map(|_| AtomicU64::new(0)).collect() }
    }

    pub fn bump(&self, i: usize) {
        self.values[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn all(&self) -> Vec<(&'static str, u64)> {
        self.names.iter().zip(&self.values).map(|((n, _), v)| (*n, v.load(Ordering::Relaxed))).collect()
    }

    /// A counter by name; 0 for a name not in the list is a caller's bug,
    /// hence the panic rather than a silent 0.
    pub fn get(&self, name: &str) -> u64 {
        let i = self.names.iter().position(|(n, _)| *n == name).unwrap_or_else(|| panic!("no counter {name}"));
        self.values[i].load(Ordering::Relaxed)
    }
}

/// How a relay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Both directions ended with FIN.
    Closed,
    /// A side reset (or a write hit a reset peer).
    Reset,
    /// No byte moved either way for the idle time.
    Idle,
}

fn pump(src: &TcpStream, dst: &TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = (&*src).read(&mut buf)?;
        if n == 0 {
            let _ = dst.shutdown(Shutdown::Write);
            return Ok(());
        }
        (&*dst).write_all(&buf[..n])?;
    }
}

/// Copies bytes both ways between `a` and `b` until both have sent FIN, one
/// resets, or neither sends for `idle`; a FIN is passed on as a FIN. On an
/// error both sockets are shut down, so the other direction ends too.
pub fn relay(a: TcpStream, b: TcpStream, idle: Duration) -> std::io::Result<End> {
    a.set_read_timeout(Some(idle))?;
    b.set_read_timeout(Some(idle))?;
    let (a2, b2) = (a.try_clone()?, b.try_clone()?);
    let back = std::thread::spawn(move || {
        let r = pump(&b2, &a2);
        if r.is_err() {
            let _ = a2.shutdown(Shutdown::Both);
            let _ = b2.shutdown(Shutdown::Both);
        }
        r
    });
    let forth = pump(&a, &b);
    if forth.is_err() {
        let _ = a.shutdown(Shutdown::Both);
        let _ = b.shutdown(Shutdown::Both);
    }
    let back = back.join().unwrap_or_else(|_| Err(ErrorKind::Other.into()));
    let end = [forth, back].into_iter().filter_map(Result::err).fold(End::Closed, |end, e| match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => End::Reset,
        ErrorKind::WouldBlock | ErrorKind::TimedOut if end == End::Closed => End::Idle,
        _ => end,
    });
    Ok(end)
}

//! Counters of the handoff's user-space parts, and the byte relay the
//! takeover server (and a proxy that keeps a connection) runs between a
//! subflow and an origin.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
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

/// Each direction reads and writes through 256 KiB: handed-off 100 MiB
/// responses came about 1.1x faster than through 64 KiB, at 10% less of
/// the server's CPU per GB, in alternating runs of bench.handoff; a 64 KiB
/// buffer grown to 256 KiB once a read filled half of it was as slow as
/// 64 KiB (docs/decisions.md). The cost is memory: 512 KiB
/// a session, which `--max-sessions` bounds.
const BUF: usize = 256 * 1024;

fn pump(src: &TcpStream, dst: &TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; BUF];
    loop {
        let n = (&*src).read(&mut buf)?;
        if n == 0 {
            let _ = dst.shutdown(Shutdown::Write);
            return Ok(());
        }
        // What was just read is acknowledged now, not at the delayed-ACK
        // timer. Over loopback, segments of tens of KiB make one segment
        // fall short of the "more than one segment" that earns an
        // immediate ACK, and a read that empties the queue acknowledges
        // only small (pushed) segments: an origin limited by the window
        // (its response sent with the HANDOFF, queued before the join)
        // waited for the ACK of its last segment until the delayed-ACK
        // timer fired (tcpdump on a server: nothing sent between): 37 of
        // 600 handed-off 1 MiB responses took over 40 ms in the record of
        // d0d0046, none of 2,400 with this (bench/results/handoff-ab-quickack).
        let _ = crate::sockops::flush_ack(src.as_fd());
        (&*dst).write_all(&buf[..n])?;
    }
}

/// Copies bytes both ways between `a` and `b` until both have sent FIN, one
/// resets, or neither sends for `idle`; a FIN is passed on as a FIN. On an
/// error both sockets are shut down, so the other direction ends too.
/// `b` to `a` (the origin's responses to the client) runs on the calling
/// thread, so that the first response bytes do not wait for a thread to
/// start.
pub fn relay(a: TcpStream, b: TcpStream, idle: Duration) -> std::io::Result<End> {
    a.set_read_timeout(Some(idle))?;
    b.set_read_timeout(Some(idle))?;
    let (a2, b2) = (a.try_clone()?, b.try_clone()?);
    let forth = std::thread::spawn(move || {
        let r = pump(&a2, &b2);
        if r.is_err() {
            let _ = a2.shutdown(Shutdown::Both);
            let _ = b2.shutdown(Shutdown::Both);
        }
        r
    });
    let back = pump(&b, &a);
    if back.is_err() {
        let _ = a.shutdown(Shutdown::Both);
        let _ = b.shutdown(Shutdown::Both);
    }
    let forth = forth.join().unwrap_or_else(|_| Err(ErrorKind::Other.into()));
    let end = [forth, back].into_iter().filter_map(Result::err).fold(End::Closed, |end, e| match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => End::Reset,
        ErrorKind::WouldBlock | ErrorKind::TimedOut if end == End::Closed => End::Idle,
        _ => end,
    });
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::os::fd::AsRawFd;

    /// A connected pair over loopback: (the side `relay` gets, the peer).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l.accept().unwrap().0, peer)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
    }

    /// Megabytes each way arrive whole and in order, each FIN is passed
    /// on as a FIN, and the relay says both closed.
    #[test]
    fn bytes_go_both_ways_whole_and_fins_are_passed_on() {
        let ((a, client), (b, origin)) = (pair(), pair());
        let r = std::thread::spawn(move || relay(a, b, Duration::from_secs(10)));
        let (up, down) = (pattern(5 << 20, 1), pattern(9 << 20 | 12_345, 2));
        // Each peer reads while it writes: a peer that wrote all before
        // reading would wait on socket buffers the other direction fills.
        let send = |s: TcpStream, bytes: Vec<u8>| {
            std::thread::spawn(move || {
                let mut w = s.try_clone().unwrap();
                let writer = std::thread::spawn(move || {
                    w.write_all(&bytes).unwrap();
                    w.shutdown(Shutdown::Write).unwrap();
                });
                let mut got = Vec::new();
                (&s).read_to_end(&mut got).unwrap();
                writer.join().unwrap();
                got
            })
        };
        let (c, o) = (send(client, up.clone()), send(origin, down.clone()));
        assert!(o.join().unwrap() == up, "the origin got other bytes than the client sent");
        assert!(c.join().unwrap() == down, "the client got other bytes than the origin sent");
        assert_eq!(r.join().unwrap().unwrap(), End::Closed);
    }

    /// Silence on both sides for the idle time ends the relay as idle;
    /// a reset on one side ends it as reset and closes the other.
    #[test]
    fn idle_and_reset_end_the_relay() {
        let ((a, _client), (b, _origin)) = (pair(), pair());
        let t = std::time::Instant::now();
        assert_eq!(relay(a, b, Duration::from_millis(200)).unwrap(), End::Idle);
        assert!(t.elapsed() >= Duration::from_millis(200));

        let ((a, client), (b, mut origin)) = (pair(), pair());
        let r = std::thread::spawn(move || relay(a, b, Duration::from_secs(10)));
        // SO_LINGER 0: close sends RST.
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: a socket option on an open socket, with its own struct.
        unsafe {
            libc::setsockopt(client.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, (&linger as *const libc::linger).cast(), std::mem::size_of::<libc::linger>() as u32)
        };
        drop(client);
        assert_eq!(r.join().unwrap().unwrap(), End::Reset);
        origin.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 16];
        assert!(matches!(origin.read(&mut buf), Ok(0) | Err(_)), "the origin's side stayed open after the client's reset");
    }
}

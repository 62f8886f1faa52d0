//! Worker threads' loads, which of them packing gives a new connection,
//! and how the kernel is made to give it there.
//!
//! Every worker listens on a socket of its own, the sockets of one address
//! joined by SO_REUSEPORT, and the kernel puts each new connection in the
//! queue of the worker packing would choose ([`choose_worker`]):
//! a classic BPF program of one instruction, "return k", attached to the
//! group and replaced whenever the choice moves. A connection so reaches
//! the thread that serves it without a thread of its own accepting it
//! first (one wake-up and a hand-over per connection less). docs/decisions.md,
//! "Each worker accepts its own connections".

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::net::{TcpListener, TcpSocket};

/// A worker's load, kept by the worker, read by the steering and /metrics.
#[derive(Default)]
pub struct WorkerLoad {
    /// Client connections it serves.
    pub open: AtomicUsize,
    /// Of those, from the TLS listener: each counts twice toward packing
    /// ([`choose_worker`]).
    pub tls: AtomicUsize,
    /// Share of the last [`BUSY_INTERVAL`] it spent running tasks rather
    /// than waiting for events, in thousandths.
    pub busy_permille: AtomicU32,
}

impl WorkerLoad {
    pub(crate) fn opened(&self, tls: bool) {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.tls.fetch_add(usize::from(tls), Ordering::Relaxed);
    }

    pub(crate) fn closed(&self, tls: bool) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.tls.fetch_sub(usize::from(tls), Ordering::Relaxed);
    }

    /// Its connections as packing counts them: a TLS one twice.
    pub(crate) fn weight(&self) -> usize {
        self.open.load(Ordering::Relaxed) + self.tls.load(Ordering::Relaxed)
    }
}

pub const BUSY_INTERVAL: Duration = Duration::from_millis(100);

/// A worker that ran tasks for more than this share of the last interval
/// takes no packed connections.
const PACK_BUSY_PERMILLE: u32 = 500;

/// The worker a new connection goes to: the first with fewer than `pack`
/// connections more than the least loaded one that is less than half busy,
/// else the one with the fewest open.
///
/// Why pack: a worker sleeps in epoll and is woken for every event it has
/// no other work beside; a handful of connections spread one or two per
/// thread make every request pay that, where one thread serving them all
/// finds several ready at each wake-up. Measured on 2 CPUs with 8
/// keep-alive clients: spread, 1.7 sleeps and 57 µs of CPU per proxied
/// request; packed, 0.95 and 43 µs (nginx's workers end up the same way:
/// all 8 of wrk's connections on one). `pack` bounds what one worker takes
/// in a burst before the others get any, and the busy test keeps later
/// connections off a worker that is already working.
///
/// The loads count a TLS connection twice: its handshake and the
/// encryption of every byte make each of its requests dearer, and over
/// HTTP/2 it carries many at once, so a burst of them packed on one
/// worker saturates it before the busy test can see it (docs/decisions.md,
/// "The proxy's hit path over HTTP/2").
pub fn choose_worker(loads: &[(usize, u32)], pack: usize) -> usize {
    let min_open = loads.iter().map(|&(open, _)| open).min().unwrap_or(0);
    let packed = loads.iter().position(|&(open, busy)| open < min_open + pack && busy < PACK_BUSY_PERMILLE);
    packed.unwrap_or_else(|| loads.iter().enumerate().min_by_key(|(_, &(open, _))| open).map_or(0, |(i, _)| i))
}

/// `n` listening sockets on `addr` in one SO_REUSEPORT group, in worker
/// order (a group numbers its sockets in the order they listened, which is
/// what the steering program's "return k" picks by). `prepare` runs on each
/// socket before it binds, `listening` after it listens.
///
/// SO_REUSEPORT would let the group join one that another process of the
/// same user has on the address, and share its connections. The address
/// is therefore bound first without it: a listener already there refuses
/// that bind (EADDRINUSE), as it refused a single listener's. A port of 0
/// is chosen by that first bind.
pub fn bind(
    addr: SocketAddr,
    n: usize,
    prepare: impl Fn(&TcpSocket) -> Result<()>,
    listening: impl Fn(&TcpListener) -> Result<()>,
) -> Result<Vec<std::net::TcpListener>> {
    let socket = || if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() };
    let at = {
        let alone = socket()?;
        alone.set_reuseaddr(true)?;
        alone.bind(addr)?;
        alone.local_addr()?
    };
    let mut out: Vec<std::net::TcpListener> = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let s = socket()?;
        s.set_reuseaddr(true)?;
        s.set_reuseport(true)?;
        prepare(&s)?;
        s.bind(at)?;
        // tokio's TcpListener::bind uses the same backlog.
        let l = s.listen(1024)?;
        listening(&l)?;
        // Served on a worker's runtime, not this one.
        out.push(l.into_std()?);
    }
    Ok(out)
}

enum Steered {
    /// Before the first attach.
    NotYet,
    /// The worker the groups' program returns.
    Worker(usize),
    /// An attach failed: not tried again (the kernel spreads by hash, and
    /// a worker that accepts a connection packing would give another
    /// hands it over).
    Off,
}

/// Where the kernel sends new connections: the worker packing chooses,
/// kept current as loads change.
pub struct Steering {
    loads: Vec<Arc<WorkerLoad>>,
    pack: usize,
    now: Mutex<Attached>,
}

struct Attached {
    target: Steered,
    /// A copy of one socket of each group (a program attached to one is
    /// the group's); dropped by [`Steering::close`], as it keeps the
    /// address listening.
    groups: Vec<OwnedFd>,
}

impl Steering {
    /// Steering for `groups` (each the sockets [`bind`] made for one
    /// address), pointed at the worker packing chooses now.
    pub fn new(groups: &[&[std::net::TcpListener]], loads: Vec<Arc<WorkerLoad>>, pack: usize) -> Result<Steering> {
        let groups = groups
            .iter()
            .filter_map(|g| g.first())
            .map(|l| l.try_clone().map(OwnedFd::from).context("keeping a listening socket for steering"))
            .collect::<Result<Vec<_>>>()?;
        let s = Steering { loads, pack, now: Mutex::new(Attached { target: Steered::NotYet, groups }) };
        s.update();
        Ok(s)
    }

    /// The worker a connection accepted now goes to.
    pub fn choose(&self) -> usize {
        choose_worker(&self.snapshot(), self.pack)
    }

    fn snapshot(&self) -> Vec<(usize, u32)> {
        self.loads.iter().map(|l| (l.weight(), l.busy_permille.load(Ordering::Relaxed))).collect()
    }

    /// Points the groups at the worker packing chooses, if that moved.
    /// Called after every change of a load: the loads are read under the
    /// lock, so the last caller's view, which holds every change made
    /// before it was called, is the one attached.
    pub fn update(&self) {
        if self.loads.len() < 2 {
            return;
        }
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        let w = choose_worker(&self.snapshot(), self.pack);
        match now.target {
            Steered::Off => return,
            Steered::Worker(at) if at == w => return,
            _ => {}
        }
        now.target = match now.groups.iter().try_for_each(|fd| attach_return(fd, w as u32)) {
            Ok(()) => Steered::Worker(w),
            Err(e) => {
                tracing::warn!(error = %e, "could not steer new connections to a worker: the kernel spreads them by hash, and workers hand them to the one packing chooses");
                Steered::Off
            }
        };
    }

    /// Lets the listening sockets go: once the workers have dropped
    /// theirs, the addresses refuse connections.
    pub fn close(&self) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        now.groups.clear();
        now.target = Steered::Off;
    }
}

/// Attaches "return k" to `fd`'s SO_REUSEPORT group, replacing its program.
/// Written by hand: one classic BPF instruction, which needs no privilege
/// (an eBPF program would need CAP_BPF) and no library.
fn attach_return(fd: &OwnedFd, k: u32) -> std::io::Result<()> {
    const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let mut code = [libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k }];
    let prog = libc::sock_fprog { len: 1, filter: code.as_mut_ptr() };
    // SAFETY: a valid program of `len` instructions that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&prog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::choose_worker;

    /// Connections one at a time, each staying open: how many each worker gets.
    fn spread(n: usize, workers: usize, pack: usize, busy: &[u32]) -> Vec<usize> {
        let mut loads: Vec<(usize, u32)> = (0..workers).map(|i| (0, busy.get(i).copied().unwrap_or(0))).collect();
        for _ in 0..n {
            let w = choose_worker(&loads, pack);
            loads[w].0 += 1;
        }
        loads.iter().map(|&(open, _)| open).collect()
    }

    #[test]
    fn a_few_connections_share_one_worker_and_many_spread_evenly() {
        assert_eq!(spread(8, 2, 8, &[]), [8, 0]);
        assert_eq!(spread(9, 2, 8, &[]), [8, 1]);
        assert_eq!(spread(50, 2, 8, &[]), [29, 21]);
        assert_eq!(spread(500, 2, 8, &[]), [254, 246]);
        // Packs of 8 (and one more each once the last has its first).
        assert_eq!(spread(64, 8, 8, &[]), [9, 9, 9, 9, 9, 9, 9, 1]);
        let many = spread(800, 8, 8, &[]);
        assert!(many.iter().max().unwrap() - many.iter().min().unwrap() <= 8, "{many:?}");
    }

    #[test]
    fn pack_zero_always_takes_the_fewest_open() {
        assert_eq!(spread(8, 2, 0, &[]), [4, 4]);
        assert_eq!(spread(7, 3, 0, &[]), [3, 2, 2]);
    }

    #[test]
    fn a_busy_worker_is_skipped_for_packing() {
        // Worker 0 more than half busy: packing starts at worker 1.
        assert_eq!(spread(8, 3, 8, &[900, 0, 0]), [0, 8, 0]);
        // Every worker busy: the fewest open, as without packing.
        assert_eq!(spread(9, 3, 8, &[900, 700, 600]), [3, 3, 3]);
    }

    #[test]
    fn one_worker_gets_everything() {
        assert_eq!(spread(20, 1, 8, &[1000]), [20]);
    }
}

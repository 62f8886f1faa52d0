//! The TCPE sockops program as a process holds it: loaded with a fresh
//! secret, attached to one cgroup v2 for as long as the handle lives, and
//! the per-socket calls on its maps: offer TCPE before connect(), answer
//! before listen(), read a connection's state, queue a path notification.
//!
//! Sockets are named by their file descriptors in this process (socket
//! storage is keyed so). The calls on one socket must not race each other:
//! `notify` reads the queued notification to pick the next serial.

use std::fs::File;
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path as FsPath;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject, RingBuffer, RingBufferBuilder};

use crate::bpf::shared as c;
use crate::bpf::tcpe::{TcpeSkel, TcpeSkelBuilder};
use crate::wire::{Keys, Path, Role};

/// Counter names and what they count, in the order of `enum
/// inband_tcpe_counter`.
pub const COUNTERS: [(&str, &str); c::INBAND_TCPE_COUNTERS as usize] = [
    ("syn_offered", "Active SYNs that carried the offer (connection ID and key)"),
    ("syn_answered", "SYN-ACKs that carried the answer"),
    ("active_capable", "Active connections with TCPE"),
    ("passive_capable", "Passive connections whose client confirmed TCPE"),
    ("passive_not_offered", "Accepted connections whose client did not offer TCPE"),
    ("fallback_no_space", "SYNs or SYN-ACKs without room for the options"),
    ("fallback_not_answered", "Offers answered without TCPE or with another connection ID"),
    ("fallback_syn_cookie", "Offers not answered: the listener answered with a SYN cookie"),
    ("fallback_no_syn", "Accepted connections whose SYN was not saved"),
    ("fallback_no_memory", "Connections without socket storage"),
    ("fallback_bad_mac_limit", "Connections that stopped taking notifications after too many bad MACs"),
    ("fallback_listeners_full", "Listeners left plain TCP: the program's table of its own listeners was full"),
    ("confirm_written", "Third ACKs that carried the client's confirmation"),
    ("path_written", "Pure ACKs that carried a path notification"),
    ("path_no_space", "Pure ACKs without room for a queued notification (the next one carries it)"),
    ("path_bad_queued", "Queued notifications of no family or with reserved flags"),
    ("path_accepted", "Path notifications verified and exposed"),
    ("path_repeat", "Copies of the last accepted notification"),
    ("path_stale", "Notifications with a serial behind the last accepted (replays)"),
    ("path_bad_mac", "Notifications whose MAC did not verify"),
    ("path_malformed", "Path options of a wrong length or with reserved flags"),
    ("path_unauthenticated", "The seed's path option without MAC"),
    ("path_not_capable", "Path options on a connection whose handshake is not confirmed yet"),
    ("path_on_data", "Path options on segments other than pure ACKs"),
    ("path_event_lost", "Accepted notifications whose wake-up for the client's reader found tcpe_paths full (the reader's periodic look finds them)"),
];

/// Where a connection's handshake ended up (`enum inband_tcpe_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Offered,
    Unconfirmed,
    Capable,
    /// Plain TCP for its life; the counter's name says why.
    Fallback(&'static str),
}

/// A connection's TCPE state as the program keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SockState {
    pub state: State,
    pub role: Role,
    pub conn_id: u32,
    pub keys: Keys,
    /// The last notification accepted from the peer, with its serial.
    pub last: Option<(Path, u8)>,
    pub accepted: u32,
    pub repeats: u32,
    pub bad_mac: u32,
    /// Pure ACKs this side wrote a notification on, and the last serial.
    pub written: u32,
    pub written_serial: u8,
}

pub struct Tcpe {
    skel: TcpeSkel<'static>,
    _link: Link,
    /// `tcpe_paths`: a wake-up per notification accepted for one of this
    /// process's clients. Behind a lock because readers on several
    /// threads drain it.
    paths: std::sync::Mutex<RingBuffer<'static>>,
}

pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    // SAFETY: getrandom(2) writes at most N bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), N, 0) };
    if n != N as isize {
        bail!("getrandom: {}", std::io::Error::last_os_error());
    }
    Ok(b)
}

fn key(fd: BorrowedFd) -> [u8; 4] {
    fd.as_raw_fd().to_ne_bytes()
}

impl Tcpe {
    /// Loads the program with a new secret for the passive key halves and
    /// attaches it to `cgroup` (a cgroup v2 directory): sockets created by
    /// its processes may then opt in.
    pub fn attach(cgroup: &FsPath) -> Result<Tcpe> {
        let dir = File::open(cgroup).with_context(|| format!("opening the cgroup {}", cgroup.display()))?;
        let storage: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
        let open = TcpeSkelBuilder::default().open(storage).context("opening the TCPE BPF object")?;
        let skel = open.load().context(
            "loading the TCPE sockops program (the kernel needs TCP header options from BPF and socket \
             storage: Linux 5.10 or later)",
        )?;
        let s: [u8; 16] = random()?;
        let cfg = c::inband_tcpe_config {
            secret_k0: u64::from_le_bytes(s[..8].try_into().unwrap()),
            secret_k1: u64::from_le_bytes(s[8..].try_into().unwrap()),
        };
        inband_core::bpfmap::put(&skel.maps.tcpe_config, &0u32, &cfg)?;
        let link = skel
            .progs
            .tcpe_sockops
            .attach_cgroup(dir.as_raw_fd())
            .with_context(|| format!("attaching the TCPE sockops program to {}", cgroup.display()))?;
        let mut paths = RingBufferBuilder::new();
        paths.add(&skel.maps.tcpe_paths, |_: &[u8]| 0)?;
        let paths = std::sync::Mutex::new(paths.build().context("opening tcpe_paths")?);
        Ok(Tcpe { skel, _link: link, paths })
    }

    /// A descriptor that polls readable once a notification was accepted
    /// on one of this process's client connections (the ring's epoll
    /// descriptor); [`Tcpe::drain_paths`] makes it quiet again.
    pub fn paths_fd(&self) -> BorrowedFd<'_> {
        let fd = self.paths.lock().unwrap().epoll_fd();
        // SAFETY: the ring buffer, and with it its epoll descriptor, lives
        // as long as `self`.
        unsafe { BorrowedFd::borrow_raw(fd) }
    }

    /// Takes every queued wake-up: whoever drains them looks at its own
    /// connection's storage, and readers of other connections find theirs
    /// at their next periodic look.
    pub fn drain_paths(&self) {
        let _ = self.paths.lock().unwrap().consume();
    }

    fn ctl(&self, fd: BorrowedFd) -> Result<c::inband_tcpe_ctl> {
        let v = self.skel.maps.tcpe_ctl.lookup(&key(fd), MapFlags::ANY);
        match v {
            Ok(Some(b)) => Ok(inband_core::pod::Pod::from_bytes(&b)),
            Ok(None) => Ok(Default::default()),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(Default::default()),
            Err(e) => Err(e).context("reading tcpe_ctl"),
        }
    }

    fn set_ctl(&self, fd: BorrowedFd, v: &c::inband_tcpe_ctl) -> Result<()> {
        use inband_core::pod::Pod;
        self.skel.maps.tcpe_ctl.update(&key(fd), v.as_bytes(), MapFlags::ANY).context(
            "writing tcpe_ctl (the socket must be a TCP socket of this process)",
        )
    }

    /// Makes the SYN of `fd` (a TCP socket not yet connected) offer TCPE
    /// with a random connection ID and key half; returns the ID.
    pub fn offer(&self, fd: BorrowedFd) -> Result<u32> {
        let r: [u8; 12] = random()?;
        let id = u32::from_ne_bytes(r[..4].try_into().unwrap());
        let k = u64::from_ne_bytes(r[4..].try_into().unwrap());
        self.offer_with(fd, id, k)?;
        Ok(id)
    }

    /// `offer` with a given ID and key half (a later subflow of a
    /// connection reuses its ID).
    pub fn offer_with(&self, fd: BorrowedFd, conn_id: u32, key_half: u64) -> Result<()> {
        let mut v = self.ctl(fd)?;
        v.enable = 1;
        v.conn_id = conn_id;
        v.key = key_half;
        self.set_ctl(fd, &v)
    }

    /// Makes `fd` (a TCP socket not yet listening) answer offers on the
    /// connections it accepts.
    pub fn answer(&self, fd: BorrowedFd) -> Result<()> {
        let mut v = self.ctl(fd)?;
        v.enable = 1;
        self.set_ctl(fd, &v)
    }

    /// The TCPE state of connection `fd`; None if it never offered or
    /// answered TCPE.
    pub fn state(&self, fd: BorrowedFd) -> Result<Option<SockState>> {
        let b = match self.skel.maps.tcpe_sock.lookup(&key(fd), MapFlags::ANY) {
            Ok(Some(b)) => b,
            Ok(None) => return Ok(None),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).context("reading tcpe_sock"),
        };
        let s: c::inband_tcpe_sock = inband_core::pod::Pod::from_bytes(&b);
        let state = match s.state {
            c::INBAND_TCPE_STATE_OFFERED => State::Offered,
            c::INBAND_TCPE_STATE_UNCONFIRMED => State::Unconfirmed,
            c::INBAND_TCPE_STATE_CAPABLE => State::Capable,
            c::INBAND_TCPE_STATE_FALLBACK => {
                State::Fallback(COUNTERS.get(s.reason as usize).map(|(n, _)| *n).unwrap_or("unknown"))
            }
            other => bail!("tcpe_sock holds state {other}"),
        };
        let role = Role::from_number(s.role).with_context(|| format!("tcpe_sock holds role {}", s.role))?;
        Ok(Some(SockState {
            state,
            role,
            conn_id: s.conn_id,
            keys: Keys { active: s.key_active, passive: s.key_passive },
            last: Path::from_c(&s.in_)?,
            accepted: s.in_accepted,
            repeats: s.in_repeats,
            bad_mac: s.bad_mac,
            written: s.out_written,
            written_serial: s.out_serial,
        }))
    }

    /// Queues `path` for the peer of connection `fd`: every pure ACK it
    /// sends carries it, under a serial one past the last queued, until
    /// `clear` or the next `notify`. Returns the serial. `flush_ack` makes
    /// the kernel send the ACK it owes now.
    pub fn notify(&self, fd: BorrowedFd, path: &Path) -> Result<u8> {
        let mut v = self.ctl(fd)?;
        let serial = v.out.serial.wrapping_add(1);
        v.out = path.to_c(serial)?;
        self.set_ctl(fd, &v)?;
        Ok(serial)
    }

    /// Stops sending the queued notification (the serial is kept).
    pub fn clear(&self, fd: BorrowedFd) -> Result<()> {
        let mut v = self.ctl(fd)?;
        v.out.family = 0;
        self.set_ctl(fd, &v)
    }

    /// Whether this program answers TCPE for the listener bound to `addr`
    /// (its entry in tcpe_listeners, made when the listener that opted in
    /// called listen() inside the program's cgroup). False for a listener
    /// outside the cgroup, whose SYNs the program never sees, or one the
    /// full table left plain.
    pub fn answers(&self, addr: SocketAddr) -> Result<bool> {
        let ip = match addr.ip() {
            IpAddr::V4(a) if a.is_unspecified() => [0; 16],
            IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
            IpAddr::V6(a) => a.octets(),
        };
        let k = c::inband_tcpe_listener { addr: ip, port: addr.port().into() };
        let found = self.skel.maps.tcpe_listeners.lookup(inband_core::pod::Pod::as_bytes(&k), MapFlags::ANY).context("reading tcpe_listeners")?;
        Ok(found.is_some())
    }

    /// Every counter by name, summed over CPUs.
    pub fn counters(&self) -> Result<Vec<(&'static str, u64)>> {
        COUNTERS
            .iter()
            .enumerate()
            .map(|(i, (name, _))| {
                let v: Vec<u64> = inband_core::bpfmap::get_percpu(&self.skel.maps.tcpe_stats, &(i as u32))?;
                Ok((*name, v.iter().sum()))
            })
            .collect()
    }

    pub fn counter(&self, name: &str) -> Result<u64> {
        self.counters()?.into_iter().find(|(n, _)| *n == name).map(|(_, v)| v).with_context(|| format!("no counter {name}"))
    }
}

fn set_quickack(fd: BorrowedFd, on: bool) -> std::io::Result<()> {
    let v: libc::c_int = on.into();
    // SAFETY: setsockopt with a pointer to a c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_QUICKACK,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Delays the acknowledgement of what `fd` receives (TCP_QUICKACK off), so
/// that an ACK is owed when a notification is queued: set before the
/// request arrives.
pub fn hold_acks(fd: BorrowedFd) -> std::io::Result<()> {
    set_quickack(fd, false)
}

/// Sends the ACK `fd` owes now (TCP_QUICKACK on: the kernel sends a
/// scheduled delayed ACK at once); with a notification queued it carries
/// it. Nothing is sent when no ACK is owed.
pub fn flush_ack(fd: BorrowedFd) -> std::io::Result<()> {
    set_quickack(fd, true)
}

//! A TCP connection frozen on one host and recreated on another, by the
//! kernel's repair mode (`TCP_REPAIR`): the primitive of the transparent
//! handoff (docs/tcpe.md, "The transparent handoff"), where
//! a stock client's connection moves from the proxy to the server with no
//! help from the client.
//!
//! Written against the socket options directly: no crate wraps repair
//! mode (socket2 and nix stop at the options every program uses), and
//! CRIU, which does, is a whole-process checkpointer in C.
//!
//! Only a connection that has sent nothing the peer has not acknowledged
//! can be frozen (`FreezeRefused::Unacked`): what moves is the receive side,
//! the bytes the new owner's application must read first.

use std::io;
use std::mem::{size_of, size_of_val, MaybeUninit};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

// linux/tcp.h: the queue TCP_REPAIR_QUEUE selects, and the option codes
// TCP_REPAIR_OPTIONS takes (libc has the socket options, not these).
const TCP_NO_QUEUE: libc::c_int = 0;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
const TCPOPT_MSS: u32 = 2;
const TCPOPT_WINDOW: u32 = 3;
const TCPOPT_SACK_PERM: u32 = 4;
const TCPOPT_TIMESTAMP: u32 = 8;
// tcp_info.tcpi_options bits.
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
const TCP_ESTABLISHED: u8 = 1;

/// struct tcp_repair_window (linux/tcp.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RepairWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

/// struct tcp_repair_opt (linux/tcp.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct RepairOpt {
    code: u32,
    val: u32,
}

/// What a connection's new owner needs to continue it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    pub local: SocketAddr,
    /// As getpeername(2) says: for a socket under the agent's
    /// `client_address` hook that is the client, not the kernel's peer (the
    /// balancer's tuple), so a DSR server's socket is frozen from outside
    /// that cgroup.
    pub peer: SocketAddr,
    /// The next sequence number to send (everything before it acknowledged).
    pub snd_seq: u32,
    /// The peer's sequence number of `received`'s first byte.
    pub rcv_seq: u32,
    /// What the new owner's application reads first: the bytes the old
    /// owner read (the request it chose by), then those it left unread.
    pub received: Vec<u8>,
    /// The peer's MSS as the connection clamps to it (in repair mode
    /// TCP_MAXSEG reads the clamp, not the current segment size).
    pub mss: u16,
    /// The window scales both sides announced, if they agreed on scaling.
    pub wscale: Option<(u8, u8)>,
    pub sack: bool,
    /// The socket's timestamp clock at the freeze, if timestamps are on:
    /// the new socket's clock starts from it, so the peer's PAWS check
    /// sees it go on rising whatever the new host's clock says.
    pub ts_now: Option<u32>,
    pub window: RepairWindow,
}

/// Why a connection was not frozen. It is left as it was, out of repair
/// mode, for its owner to go on serving.
#[derive(Debug)]
pub enum FreezeRefused {
    /// Not established (closing, or not yet open).
    NotEstablished(u8),
    /// Bytes sent and not yet acknowledged (or not yet sent): they would
    /// have two owners.
    Unacked(u32),
    Io(io::Error),
}

impl std::fmt::Display for FreezeRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FreezeRefused::NotEstablished(state) => write!(f, "the connection is not established (TCP state {state})"),
            FreezeRefused::Unacked(n) => write!(f, "{n} bytes sent and not acknowledged"),
            FreezeRefused::Io(e) => write!(f, "repair mode: {e}"),
        }
    }
}

impl std::error::Error for FreezeRefused {}

impl From<io::Error> for FreezeRefused {
    fn from(e: io::Error) -> FreezeRefused {
        FreezeRefused::Io(e)
    }
}

/// A connected TCP socket, blocking (std) or on an event loop (tokio,
/// as `inband proxy` holds its clients): what freezing reads.
pub trait Connected: AsRawFd {
    fn local_addr(&self) -> io::Result<SocketAddr>;
    fn peer_addr(&self) -> io::Result<SocketAddr>;
}

impl Connected for TcpStream {
    fn local_addr(&self) -> io::Result<SocketAddr> {
        TcpStream::local_addr(self)
    }
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        TcpStream::peer_addr(self)
    }
}

impl Connected for tokio::net::TcpStream {
    fn local_addr(&self) -> io::Result<SocketAddr> {
        tokio::net::TcpStream::local_addr(self)
    }
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        tokio::net::TcpStream::peer_addr(self)
    }
}

/// Freezes `sock`, whose application has read `already_read` from it, and
/// returns its state; the socket stays in repair mode (it sends nothing,
/// not even an ACK) until `thaw` gives it back or `discard` closes it
/// without a FIN or RST. Segments the peer sends meanwhile must not reach
/// it (the caller drops them; the peer retransmits them to the new owner).
pub fn freeze(sock: &impl Connected, already_read: &[u8]) -> Result<Frozen, FreezeRefused> {
    let fd = sock.as_raw_fd();
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR, &1i32)?;
    let state = read_state(sock, already_read);
    if state.is_err() {
        let _ = thaw(sock);
    }
    state
}

fn read_state(sock: &impl Connected, already_read: &[u8]) -> Result<Frozen, FreezeRefused> {
    let fd = sock.as_raw_fd();
    let info: libc::tcp_info = get(fd, libc::IPPROTO_TCP, libc::TCP_INFO)?;
    if info.tcpi_state != TCP_ESTABLISHED {
        return Err(FreezeRefused::NotEstablished(info.tcpi_state));
    }
    let unacked = ioctl_len(fd, libc::TIOCOUTQ)?;
    if unacked != 0 {
        return Err(FreezeRefused::Unacked(unacked));
    }
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_SEND_QUEUE)?;
    let snd_seq: u32 = get(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_RECV_QUEUE)?;
    let rcv_nxt: u32 = get(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ)?;
    let unread = peek_queue(fd, ioctl_len(fd, libc::FIONREAD)? as usize)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_NO_QUEUE)?;
    let mss: u32 = get(fd, libc::IPPROTO_TCP, libc::TCP_MAXSEG)?;
    let timestamps = info.tcpi_options & TCPI_OPT_TIMESTAMPS != 0;
    let ts_now = if timestamps { Some(get::<u32>(fd, libc::IPPROTO_TCP, libc::TCP_TIMESTAMP)?) } else { None };
    let window: RepairWindow = get(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_WINDOW)?;
    // tcpi_snd_wscale and tcpi_rcv_wscale share a byte (4 bits each),
    // which libc's struct shows as one field.
    let scales = info.tcpi_snd_rcv_wscale;
    let mut received = already_read.to_vec();
    received.extend_from_slice(&unread);
    Ok(Frozen {
        local: sock.local_addr()?,
        peer: sock.peer_addr()?,
        snd_seq,
        rcv_seq: rcv_nxt.wrapping_sub(received.len() as u32),
        received,
        mss: u16::try_from(mss).unwrap_or(u16::MAX),
        wscale: (info.tcpi_options & TCPI_OPT_WSCALE != 0).then_some((scales & 0xf, scales >> 4)),
        sack: info.tcpi_options & TCPI_OPT_SACK != 0,
        ts_now,
        window,
    })
}

/// Takes `sock` out of repair mode: its owner goes on as if nothing
/// happened (nothing was sent or acknowledged while it was frozen).
///
/// Leaving repair mode clears the socket's SO_REUSEADDR whatever it was
/// (the kernel sets `sk_reuse` to SK_NO_REUSE), so it is set again: every
/// socket frozen here was accepted from a listener that has it, as a
/// server's listeners do. Without it the socket's TIME_WAIT refused the
/// bind of a listener restarted on its port for a minute (`inband proxy`
/// with `[tcpe.transparent]` could not restart after a refused move).
pub fn thaw(sock: &impl AsRawFd) -> io::Result<()> {
    set(sock.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_NO_QUEUE)?;
    set(sock.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_REPAIR, &0i32)?;
    set(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEADDR, &1i32)
}

/// Closes a frozen socket: in repair mode the kernel sends neither FIN
/// nor RST, so the connection lives on with its new owner.
pub fn discard(sock: TcpStream) {
    drop(sock);
}

/// The connection `f` describes, as a socket of this host: bound to
/// `f.local` (an address of this host's; the port may be a listener's,
/// as a server's service port is), established with `f.peer`,
/// `f.received` in its receive queue, having sent nothing yet. It stays in
/// repair mode, sending nothing and answering nothing, until `release`;
/// dropped before that, it goes without a word.
pub fn restore(f: &Frozen) -> io::Result<TcpStream> {
    let domain = if f.local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let raw = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw was just returned by socket(2) and is owned by nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
    let fd = owned.as_raw_fd();
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR, &1i32)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_SEND_QUEUE)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ, &f.snd_seq)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_RECV_QUEUE)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ, &f.rcv_seq)?;
    // No SO_REUSEADDR: repair mode already lets the bind share a
    // listener's port (SK_FORCE_REUSE), and setting it would take that away.
    // The MSS before connect(): connect() sizes the segments from it, and
    // the repair option set afterwards changes the clamp only, leaving the
    // socket at the 536-byte default.
    // (The kernel takes at most 32767 here; only loopback's MSS is larger.)
    set(fd, libc::IPPROTO_TCP, libc::TCP_MAXSEG, &libc::c_int::from(f.mss).min(32767))?;
    // SAFETY (both): bind(2) and connect(2) with the sockaddr sockaddr_call built.
    sockaddr_call(fd, f.local, |fd, sa, len| unsafe { libc::bind(fd, sa, len) })?;
    // In repair mode connect() sends no SYN: the socket is established.
    sockaddr_call(fd, f.peer, |fd, sa, len| unsafe { libc::connect(fd, sa, len) })?;
    let mut opts = vec![RepairOpt { code: TCPOPT_MSS, val: u32::from(f.mss) }];
    if let Some((snd, rcv)) = f.wscale {
        opts.push(RepairOpt { code: TCPOPT_WINDOW, val: u32::from(snd) | u32::from(rcv) << 16 });
    }
    if f.sack {
        opts.push(RepairOpt { code: TCPOPT_SACK_PERM, val: 0 });
    }
    if f.ts_now.is_some() {
        opts.push(RepairOpt { code: TCPOPT_TIMESTAMP, val: 0 });
    }
    set_slice(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_OPTIONS, &opts)?;
    if let Some(ts) = f.ts_now {
        set(fd, libc::IPPROTO_TCP, libc::TCP_TIMESTAMP, &ts)?;
    }
    // In repair mode a write to the receive queue queues it as received
    // (rcv_seq onwards), for the application to read.
    let mut left = &f.received[..];
    while !left.is_empty() {
        // SAFETY: send(2) from a live slice of its length.
        let n = unsafe { libc::send(fd, left.as_ptr().cast(), left.len(), 0) };
        if n <= 0 {
            return Err(if n < 0 { io::Error::last_os_error() } else { io::ErrorKind::WriteZero.into() });
        }
        left = &left[n as usize..];
    }
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &TCP_NO_QUEUE)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_WINDOW, &f.window)?;
    Ok(TcpStream::from(owned))
}

/// Takes a restored socket out of repair mode: from now on it is an
/// established connection like any other. Leaving repair mode sends a
/// window probe, so the peer learns at once that the connection answers.
/// It also clears SO_REUSEADDR (as in `thaw`), which is set: the socket
/// shares its service's port, and its TIME_WAIT must not refuse that
/// service's listener a restart.
pub fn release(sock: &TcpStream) -> io::Result<()> {
    set(sock.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_REPAIR, &0i32)?;
    set(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEADDR, &1i32)
}

fn set<T: Copy>(fd: RawFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    set_slice(fd, level, name, std::slice::from_ref(value))
}

fn set_slice<T: Copy>(fd: RawFd, level: libc::c_int, name: libc::c_int, values: &[T]) -> io::Result<()> {
    // SAFETY: setsockopt(2) with a pointer to `values` and its size in bytes.
    let rc = unsafe { libc::setsockopt(fd, level, name, values.as_ptr().cast(), size_of_val(values) as libc::socklen_t) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn get<T: Copy>(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<T> {
    let mut value = MaybeUninit::<T>::zeroed();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into a zeroed T of `len` bytes; every T here is
    // plain integers, valid for any bytes the kernel writes (or leaves 0).
    let rc = unsafe { libc::getsockopt(fd, level, name, value.as_mut_ptr().cast(), &mut len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zero-initialised and then written by the kernel: initialised.
    Ok(unsafe { value.assume_init() })
}

fn ioctl_len(fd: RawFd, request: libc::Ioctl) -> io::Result<u32> {
    let mut n: libc::c_int = 0;
    // SAFETY: the ioctl writes one int.
    if unsafe { libc::ioctl(fd, request, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as u32)
}

/// The queue TCP_REPAIR_QUEUE selected, read without consuming it.
fn peek_queue(fd: RawFd, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        // SAFETY: recv(2) into the unfilled part of `buf`.
        let n = unsafe { libc::recv(fd, buf[got..].as_mut_ptr().cast(), len - got, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    buf.truncate(got);
    Ok(buf)
}

fn sockaddr_call(
    fd: RawFd,
    addr: SocketAddr,
    call: impl FnOnce(RawFd, *const libc::sockaddr, libc::socklen_t) -> libc::c_int,
) -> io::Result<()> {
    let rc = match addr {
        SocketAddr::V4(a) => {
            let sa = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            call(fd, (&sa as *const libc::sockaddr_in).cast(), size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        SocketAddr::V6(a) => {
            let sa = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            call(fd, (&sa as *const libc::sockaddr_in6).cast(), size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connection on loopback with the MSS of a real network's (1200):
    /// a rebuilt socket's segment size is then told from the default.
    fn pair() -> (TcpListener, TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        set(l.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_MAXSEG, &1200i32).unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        (l, client, server)
    }

    fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        s.read_exact(&mut buf).unwrap();
        buf
    }

    #[test]
    fn a_frozen_connection_goes_on_from_a_socket_rebuilt_from_its_state() {
        let (l, mut client, mut old) = pair();
        let request = b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n";
        client.write_all(request).unwrap();
        client.write_all(b"and what follows").unwrap();
        let head = read_n(&mut old, request.len());
        // The rest arrives unread (loopback delivers at once; wait for it).
        while ioctl_len(old.as_raw_fd(), libc::FIONREAD).unwrap() < 16 {
            std::thread::sleep(Duration::from_millis(1));
        }

        let segment: libc::c_int = get(old.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_MAXSEG).unwrap();
        let f = freeze(&old, &head).unwrap();
        assert_eq!((f.local, f.peer), (old.local_addr().unwrap(), client.local_addr().unwrap()));
        assert_eq!(f.received, [&request[..], b"and what follows"].concat());
        assert!(f.ts_now.is_some() && f.sack && f.wscale.is_some(), "{f:?}");
        discard(old);

        // Rebuilt and dropped before its release (a move that was called
        // off): the client hears nothing.
        drop(restore(&f).unwrap());
        client.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let e = client.read(&mut [0; 8]).unwrap_err();
        assert!(matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{e}");
        client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // Rebuilt beside the listener that accepted it, as a server's
        // socket is beside its service's listener.
        let mut new = restore(&f).unwrap();
        assert_eq!((new.local_addr().unwrap(), new.peer_addr().unwrap()), (f.local, f.peer));
        release(&new).unwrap();
        // Segments of the size the old socket sent.
        assert_eq!(get::<libc::c_int>(new.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_MAXSEG).unwrap(), segment, "{f:?}");
        new.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // The new owner's application reads the request the old one chose
        // by, then what it had left.
        assert_eq!(read_n(&mut new, f.received.len()), f.received);
        // Both directions go on, on the client's unchanged socket.
        new.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").unwrap();
        drop(l);
        assert_eq!(read_n(&mut client, 40), b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        client.write_all(b"more").unwrap();
        assert_eq!(read_n(&mut new, 4), b"more");
        // The old socket went without a word: no RST reached the client,
        // and the new one's close is the FIN it sees.
        drop(new);
        assert_eq!(client.read(&mut [0; 8]).unwrap(), 0);
        drop(client);
        restarts_beside_its_time_wait(f.local);
    }

    /// `addr` has a TIME_WAIT (a socket of ours closed first), and a
    /// listener still binds it, as a restarted service's would.
    fn restarts_beside_its_time_wait(addr: SocketAddr) {
        let time_wait = std::fs::read_to_string("/proc/net/tcp").unwrap().lines().any(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            f.len() > 3 && f[3] == "06" && f[1].ends_with(&format!(":{:04X}", addr.port()))
        });
        assert!(time_wait, "no TIME_WAIT on {addr}: the test proves nothing");
        TcpListener::bind(addr).unwrap_or_else(|e| panic!("a listener on {addr}, the port of our socket's TIME_WAIT: {e}"));
    }

    /// A thawed socket that closes first leaves a TIME_WAIT on the
    /// listener's port; a listener started again on that port binds.
    #[test]
    fn a_thawed_socket_lets_its_listener_restart_on_the_port() {
        let (l, mut client, old) = pair();
        let addr = l.local_addr().unwrap();
        freeze(&old, b"").unwrap();
        thaw(&old).unwrap();
        drop(old);
        assert_eq!(client.read(&mut [0; 8]).unwrap(), 0);
        drop(client);
        drop(l);
        restarts_beside_its_time_wait(addr);
    }

    #[test]
    fn a_thawed_connection_is_as_it_was_and_unacknowledged_bytes_refuse_the_freeze() {
        let (_l, mut client, mut old) = pair();
        client.write_all(b"ping").unwrap();
        assert_eq!(read_n(&mut old, 4), b"ping");
        let f = freeze(&old, b"ping").unwrap();
        assert_eq!(f.received, b"ping");
        thaw(&old).unwrap();
        old.write_all(b"pong").unwrap();
        assert_eq!(read_n(&mut client, 4), b"pong");

        // The client stops reading: what the server writes beyond the
        // client's window waits, unsent, in the server's queue.
        old.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 65536];
        let mut written = 0usize;
        while written < 64 << 20 {
            match old.write(&chunk) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        match freeze(&old, b"") {
            Err(FreezeRefused::Unacked(n)) => assert!(n > 0),
            other => panic!("{other:?}"),
        }
        // FreezeRefused, and left as it was: every byte still reaches the client.
        old.set_nonblocking(false).unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = 0usize;
            let mut buf = vec![0u8; 65536];
            while got < written {
                got += client.read(&mut buf).unwrap();
            }
            got
        });
        assert_eq!(reader.join().unwrap(), written);
    }
}

//! Answers the balancer's polls (`dsr-polling`, `dsr-query`, and backends
//! whose path loses options; protocol in `poll_wire`) with the same score
//! a 125 would carry. One socket per family: IPv4, and IPv6 only.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tracing::{debug, warn};

use super::config::ScoreSource;
use super::maps::AgentCounter;
use super::tables::AgentMaps;
use inband_core::poll_wire;

/// Distinct untrusted senders warned about; past this they are only logged
/// at debug level, so a scan cannot flood the log.
const WARN_LIMIT: usize = 16;

/// Binds the poll port of both families: IPv4, and IPv6 only (so the two
/// can share the port). A host without IPv6 gets the first alone.
pub fn bind(port: u16) -> Result<Vec<UdpSocket>> {
    let hint = |p| format!("binding UDP port {p} for poll requests (another process uses it? set poll_port, or 0 to disable)");
    let mut out = vec![UdpSocket::bind(("0.0.0.0", port)).with_context(|| hint(port))?];
    match bind_v6_only(port) {
        Ok(s) => out.push(s),
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {}
        Err(e) => return Err(e).with_context(|| hint(port)),
    }
    Ok(out)
}

fn bind_v6_only(port: u16) -> io::Result<UdpSocket> {
    // SAFETY: a plain socket(2) call; the fd is owned by the UdpSocket below.
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own.
    let sock = unsafe { UdpSocket::from_raw_fd(fd) };
    setsockopt_on(&sock, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)?;
    let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    sa.sin6_port = port.to_be();
    // SAFETY: sa is a valid sockaddr_in6 of the stated size.
    let rc = unsafe {
        libc::bind(fd, (&sa as *const libc::sockaddr_in6).cast(), std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// How often the responder re-reads the keys from the data path's maps:
/// a SIGHUP's new `[auth]` applies to polls within this.
const KEYS_REFRESH: Duration = Duration::from_secs(1);

/// Serves `sock` until `stop` is set. Only the configured balancers get an
/// answer, like only they may send 155/124: the score tells how loaded this
/// server is. With `[auth] mode = "siphash"` a request must also carry a
/// MAC under one of the agent's keys, and the reply is signed with the
/// same key (poll_wire). Requests that are malformed, forged, from
/// elsewhere, or for a port this agent does not serve get no reply (the
/// balancer counts a missing reply as a failed poll) and are counted in
/// `agent_stats` (polls_unauthenticated, polls_refused).
pub fn serve(
    sock: &UdpSocket,
    maps: &AgentMaps,
    source: ScoreSource,
    ports: &[u16],
    balancers: &[IpAddr],
    stop: &AtomicBool,
) -> Result<()> {
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    let v6 = sock.local_addr()?.is_ipv6();
    if v6 {
        setsockopt_on(sock, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO)?;
    } else {
        setsockopt_on(sock, libc::IPPROTO_IP, libc::IP_PKTINFO)?;
    }
    let mut warned: HashSet<IpAddr> = HashSet::new();
    let mut keys = maps.poll_keys()?;
    let mut keys_read = Instant::now();
    let mut buf = [0u8; poll_wire::MAX_LEN];
    while !stop.load(Ordering::Relaxed) {
        let (n, from, to) = match recv_with_dst(sock, v6, &mut buf) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e).context("receiving poll requests"),
        };
        if keys_read.elapsed() >= KEYS_REFRESH {
            keys = maps.poll_keys()?;
            keys_read = Instant::now();
        }
        let outcome = answer(&buf[..n], from, &keys, ports, balancers, &mut warned);
        let counter = match outcome {
            Ok(req) => match poll_wire::encode_reply(&req, maps.score(req.port, source)?, &keys) {
                Some(reply) => {
                    if let Err(e) = send_from(sock, &reply, from, to) {
                        warn!(%from, error = %e, "sending a poll reply failed");
                        continue;
                    }
                    AgentCounter::PollsAnswered
                }
                // Its key was removed by a reload since it was checked.
                None => AgentCounter::PollsUnauthenticated,
            },
            Err(None) => continue,
            Err(Some(c)) => c,
        };
        maps.count(counter, 1)?;
    }
    Ok(())
}

/// The request to answer, or the counter a refused one goes to (None:
/// noise that is not this protocol, not counted).
fn answer(
    buf: &[u8],
    from: SocketAddr,
    keys: &poll_wire::Keys,
    ports: &[u16],
    balancers: &[IpAddr],
    warned: &mut HashSet<IpAddr>,
) -> Result<poll_wire::Request, Option<AgentCounter>> {
    // The sender first: a stranger's datagram is refused without spending a
    // MAC on it.
    if !balancers.contains(&from.ip()) {
        if !poll_wire::is_request(buf) {
            return Err(None);
        }
        if warned.len() < WARN_LIMIT && warned.insert(from.ip()) {
            warn!(%from, "poll request from a host that is not in `balancers`: ignored");
        } else {
            debug!(%from, "poll request from a host that is not in `balancers`: ignored");
        }
        return Err(Some(AgentCounter::PollsRefused));
    }
    let req = match poll_wire::decode_request(buf, keys) {
        Ok(r) => r,
        Err(poll_wire::Refusal::NotOurs) => {
            debug!(%from, len = buf.len(), "not a poll request: ignored");
            return Err(None);
        }
        Err(why) => {
            if warned.len() < WARN_LIMIT && warned.insert(from.ip()) {
                warn!(%from, ?why, "poll request that does not authenticate: ignored (do the balancer's and this agent's [auth] match?)");
            } else {
                debug!(%from, ?why, "poll request that does not authenticate: ignored");
            }
            return Err(Some(AgentCounter::PollsUnauthenticated));
        }
    };
    if !ports.contains(&req.port) {
        debug!(%from, port = req.port, "poll request for a port this agent does not serve: ignored");
        return Err(Some(AgentCounter::PollsRefused));
    }
    Ok(req)
}

// The socket is bound to the wildcard address, and the balancer matches a
// reply by its source address: on a server with several addresses the
// routing table may pick another one than the request went to, so the
// reply's source is set explicitly to the request's destination
// (IP_PKTINFO / IPV6_PKTINFO), as for any UDP service on the wildcard.

fn setsockopt_on(sock: &UdpSocket, level: libc::c_int, name: libc::c_int) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: valid fd and option buffer of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Room for one packet-info control message (u64 for cmsghdr alignment).
type CmsgBuf = [u64; 8];

/// A datagram, its sender, and the address it was sent to.
fn recv_with_dst(sock: &UdpSocket, v6: bool, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, IpAddr)> {
    // SAFETY: all-zero is valid for these C structs; sockaddr_in6 is large
    // enough for either family's address.
    let mut from: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    let mut cmsg: CmsgBuf = [0; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut from as *mut libc::sockaddr_in6).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of::<CmsgBuf>() as _;
    // SAFETY: msg points at live buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut dst = if v6 { IpAddr::V6(Ipv6Addr::UNSPECIFIED) } else { IpAddr::V4(Ipv4Addr::UNSPECIFIED) };
    // SAFETY: walking the control messages the kernel wrote into `cmsg`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_PKTINFO {
                let info = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>());
                dst = IpAddr::V4(Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr)));
            } else if (*c).cmsg_level == libc::IPPROTO_IPV6 && (*c).cmsg_type == libc::IPV6_PKTINFO {
                let info = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::in6_pktinfo>());
                dst = IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let from = if v6 {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::from(from.sin6_addr.s6_addr)), u16::from_be(from.sin6_port))
    } else {
        // SAFETY: an IPv4 socket filled a sockaddr_in at the start of `from`.
        let sin = unsafe { &*(&from as *const libc::sockaddr_in6).cast::<libc::sockaddr_in>() };
        SocketAddr::new(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))), u16::from_be(sin.sin_port))
    };
    Ok((n as usize, from, dst))
}

fn send_from(sock: &UdpSocket, data: &[u8], to: SocketAddr, src: IpAddr) -> io::Result<()> {
    let usable = match src {
        IpAddr::V4(a) => !(a.is_unspecified() || a.is_broadcast() || a.is_multicast()),
        IpAddr::V6(a) => !(a.is_unspecified() || a.is_multicast()),
    };
    if !usable {
        // No usable destination address (or not one to answer from): let
        // routing choose.
        return sock.send_to(data, to).map(|_| ());
    }
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let mut cmsg: CmsgBuf = [0; 8];
    // SAFETY: all-zero is valid for these C structs; every pointer set below
    // refers to a live local of the stated size, and the control message
    // fits `cmsg`.
    unsafe {
        let mut dst4: libc::sockaddr_in = std::mem::zeroed();
        let mut dst6: libc::sockaddr_in6 = std::mem::zeroed();
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        match (to, src) {
            (SocketAddr::V4(to), IpAddr::V4(src)) => {
                dst4.sin_family = libc::AF_INET as libc::sa_family_t;
                dst4.sin_port = to.port().to_be();
                dst4.sin_addr.s_addr = u32::from(*to.ip()).to_be();
                msg.msg_name = (&mut dst4 as *mut libc::sockaddr_in).cast();
                msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
                msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<libc::in_pktinfo>() as u32) as _;
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::IPPROTO_IP;
                (*c).cmsg_type = libc::IP_PKTINFO;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::in_pktinfo>() as u32) as _;
                let info = libc::in_pktinfo {
                    ipi_ifindex: 0,
                    ipi_spec_dst: libc::in_addr { s_addr: u32::from(src).to_be() },
                    ipi_addr: libc::in_addr { s_addr: 0 },
                };
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>(), info);
            }
            (SocketAddr::V6(to), IpAddr::V6(src)) => {
                dst6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                dst6.sin6_port = to.port().to_be();
                dst6.sin6_addr.s6_addr = to.ip().octets();
                msg.msg_name = (&mut dst6 as *mut libc::sockaddr_in6).cast();
                msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
                msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<libc::in6_pktinfo>() as u32) as _;
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::IPPROTO_IPV6;
                (*c).cmsg_type = libc::IPV6_PKTINFO;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::in6_pktinfo>() as u32) as _;
                let info = libc::in6_pktinfo { ipi6_addr: libc::in6_addr { s6_addr: src.octets() }, ipi6_ifindex: 0 };
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::in6_pktinfo>(), info);
            }
            _ => return sock.send_to(data, to).map(|_| ()),
        }
        if libc::sendmsg(sock.as_raw_fd(), &msg, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

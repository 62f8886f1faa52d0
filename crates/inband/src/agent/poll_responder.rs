//! Answers the balancer's `dsr-polling` requests (protocol in
//! `poll_proto`) with the same score a 125 would carry.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use tracing::{debug, warn};

use super::poll_proto;
use super::tables::AgentMaps;

/// Distinct untrusted senders warned about; past this they are only logged
/// at debug level, so a scan cannot flood the log.
const WARN_LIMIT: usize = 16;

/// Serves `sock` until `stop` is set. Only the configured balancers get an
/// answer, like only they may send 155/124: the score tells how loaded this
/// server is, and a reply is larger than the request that triggers it.
/// Requests that are malformed, from elsewhere, or for a port this agent
/// does not serve get no reply (the balancer counts a missing reply as a
/// failed poll).
pub fn serve(
    sock: &UdpSocket,
    maps: &AgentMaps,
    ports: &[u16],
    balancers: &[Ipv4Addr],
    stop: &AtomicBool,
) -> Result<()> {
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    enable_pktinfo(sock)?;
    let mut warned: HashSet<IpAddr> = HashSet::new();
    // One byte more than a request, so a longer datagram is seen as longer
    // instead of being truncated into a valid-looking request.
    let mut buf = [0u8; poll_proto::REQUEST_LEN + 1];
    while !stop.load(Ordering::Relaxed) {
        let (n, from, to) = match recv_with_dst(sock, &mut buf) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e).context("receiving poll requests"),
        };
        let Some(port) = poll_proto::decode_request(&buf[..n]) else {
            debug!(%from, len = n, "not a poll request: ignored");
            continue;
        };
        let trusted = balancers.contains(from.ip());
        if !trusted {
            if warned.len() < WARN_LIMIT && warned.insert(IpAddr::V4(*from.ip())) {
                warn!(%from, "poll request from a host that is not in `balancers`: ignored");
            } else {
                debug!(%from, "poll request from a host that is not in `balancers`: ignored");
            }
            continue;
        }
        if !ports.contains(&port) {
            debug!(%from, port, "poll request for a port this agent does not serve: ignored");
            continue;
        }
        let score = maps.score(port)?;
        if let Err(e) = send_from(sock, &poll_proto::encode_reply(port, score), from, to) {
            warn!(%from, error = %e, "sending a poll reply failed");
        }
    }
    Ok(())
}

// The socket is bound to the wildcard address, and the balancer matches a
// reply by its source address: on a server with several addresses the
// routing table may pick another one than the request went to, so the
// reply's source is set explicitly to the request's destination
// (IP_PKTINFO), as for any UDP service on 0.0.0.0.

fn enable_pktinfo(sock: &UdpSocket) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: valid fd and option buffer of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_PKTINFO,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Room for one IP_PKTINFO control message (u64 for cmsghdr alignment).
type CmsgBuf = [u64; 8];

fn recv_with_dst(sock: &UdpSocket, buf: &mut [u8]) -> io::Result<(usize, SocketAddrV4, Ipv4Addr)> {
    // SAFETY: all-zero is valid for these C structs.
    let mut from: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut cmsg: CmsgBuf = [0; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut from as *mut libc::sockaddr_in).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of::<CmsgBuf>() as _;
    // SAFETY: msg points at live buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut dst = Ipv4Addr::UNSPECIFIED;
    // SAFETY: walking the control messages the kernel wrote into `cmsg`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_PKTINFO {
                let info = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::in_pktinfo>());
                dst = Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let from = SocketAddrV4::new(Ipv4Addr::from(u32::from_be(from.sin_addr.s_addr)), u16::from_be(from.sin_port));
    Ok((n as usize, from, dst))
}

fn send_from(sock: &UdpSocket, data: &[u8], to: SocketAddrV4, src: Ipv4Addr) -> io::Result<()> {
    if src.is_unspecified() || src.is_broadcast() || src.is_multicast() {
        // No usable destination address (or not one to answer from): let
        // routing choose.
        return sock.send_to(data, SocketAddr::V4(to)).map(|_| ());
    }
    let mut dst = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: to.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*to.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let mut cmsg: CmsgBuf = [0; 8];
    // SAFETY: all-zero is a valid msghdr; every pointer set below refers to a
    // live local of the stated size, and the control message fits `cmsg`.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_name = (&mut dst as *mut libc::sockaddr_in).cast();
        msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
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
        if libc::sendmsg(sock.as_raw_fd(), &msg, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

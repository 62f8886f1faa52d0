//! Keeps `backends[id].mac` equal to the next hop's MAC, so the XDP path
//! can forward without a route lookup. Both families through rtnetlink
//! (netlink-packet-route): the route the kernel would take to the backend
//! (RTM_GETROUTE, as `ip route get` asks) names the next hop — the backend
//! itself, or its gateway — and the neighbour table (ARP or NDP,
//! RTM_GETNEIGH) its MAC. A next hop not known yet is resolved by sending
//! it one datagram; the next pass picks the answer up.

use std::collections::HashSet;
use std::net::{IpAddr, UdpSocket};

use anyhow::{bail, Context, Result};
use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use tracing::{debug, info};

use super::maps::{backend_removed, Addr};
use super::tables::{self, LbMaps};
use inband_core::bpfmap;
use inband_core::pod::ip_of;

/// A route netlink socket of this network namespace.
pub struct Rtnl {
    socket: Socket,
    seq: u32,
}

impl Rtnl {
    pub fn new() -> Result<Rtnl> {
        let mut socket = Socket::new(NETLINK_ROUTE).context("opening a route netlink socket")?;
        socket.bind_auto().context("binding the route netlink socket")?;
        socket.connect(&SocketAddr::new(0, 0)).context("connecting the route netlink socket")?;
        Ok(Rtnl { socket, seq: 0 })
    }

    /// Sends one request and collects its answers: every message of a dump,
    /// or the one reply.
    fn ask(&mut self, msg: RouteNetlinkMessage, dump: bool) -> Result<Vec<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { 0 };
        header.sequence_number = self.seq;
        let mut req = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        req.finalize();
        let mut buf = vec![0; req.header.length as usize];
        req.serialize(&mut buf);
        self.socket.send(&buf, 0).context("sending a route netlink request")?;

        let mut out = Vec::new();
        let mut rx = vec![0u8; 64 * 1024];
        loop {
            let n = self.socket.recv(&mut &mut rx[..], 0).context("reading a route netlink reply")?;
            let mut off = 0;
            while off < n {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rx[off..n])
                    .map_err(|e| anyhow::anyhow!("malformed route netlink reply: {e}"))?;
                let len = reply.header.length as usize;
                if reply.header.sequence_number == self.seq {
                    match reply.payload {
                        NetlinkPayload::Done(_) => return Ok(out),
                        NetlinkPayload::Error(e) if e.code.is_some() => bail!("route netlink: {}", e.to_io()),
                        NetlinkPayload::InnerMessage(m) => {
                            out.push(m);
                            if !dump {
                                return Ok(out);
                            }
                        }
                        _ => {}
                    }
                }
                if len == 0 {
                    break;
                }
                off += len;
            }
        }
    }

    /// The complete neighbour entries (ARP and NDP) of interface `ifindex`.
    pub fn neighbours(&mut self, ifindex: u32) -> Result<Vec<(IpAddr, [u8; 6])>> {
        let mut out = Vec::new();
        for m in self.ask(RouteNetlinkMessage::GetNeighbour(NeighbourMessage::default()), true)? {
            let RouteNetlinkMessage::NewNeighbour(n) = m else { continue };
            let complete = matches!(
                n.header.state,
                NeighbourState::Reachable
                    | NeighbourState::Stale
                    | NeighbourState::Delay
                    | NeighbourState::Probe
                    | NeighbourState::Permanent
            );
            if n.header.ifindex != ifindex || !complete {
                continue;
            }
            let mut ip = None;
            let mut mac = None;
            for a in &n.attributes {
                match a {
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => ip = Some(IpAddr::V4(*v4)),
                    NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => ip = Some(IpAddr::V6(*v6)),
                    NeighbourAttribute::LinkLayerAddress(l) if l.len() == 6 => {
                        mac = Some([l[0], l[1], l[2], l[3], l[4], l[5]]);
                    }
                    _ => {}
                }
            }
            if let (Some(ip), Some(mac)) = (ip, mac) {
                out.push((ip, mac));
            }
        }
        Ok(out)
    }

    /// The next hop toward `dst` as the kernel routes it: `dst` itself when
    /// on-link, else its gateway; with the interface the route leaves by.
    pub fn next_hop(&mut self, dst: IpAddr) -> Result<(IpAddr, u32)> {
        let mut q = RouteMessage::default();
        q.header.address_family = if dst.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
        q.header.destination_prefix_length = if dst.is_ipv4() { 32 } else { 128 };
        q.attributes.push(RouteAttribute::Destination(RouteAddress::from(dst)));
        let reply = self.ask(RouteNetlinkMessage::GetRoute(q), false)?;
        let Some(RouteNetlinkMessage::NewRoute(r)) = reply.into_iter().next() else {
            bail!("no route to {dst}");
        };
        let mut hop = dst;
        let mut oif = 0;
        for a in r.attributes {
            match a {
                RouteAttribute::Gateway(RouteAddress::Inet(g)) => hop = IpAddr::V4(g),
                RouteAttribute::Gateway(RouteAddress::Inet6(g)) => hop = IpAddr::V6(g),
                RouteAttribute::Oif(i) => oif = i,
                _ => {}
            }
        }
        Ok((hop, oif))
    }
}

/// One pass: fills or corrects every backend's MAC; for next hops the
/// kernel does not know yet, sends one datagram to the discard port so the
/// kernel starts ARP or neighbour discovery. Returns how many are missing.
pub fn refresh(maps: &LbMaps, interface: &str) -> Result<usize> {
    let ifindex = inband_core::netif::ifindex(interface)?;
    let mut rtnl = Rtnl::new()?;
    let table = rtnl.neighbours(ifindex)?;
    let mut unresolved = 0;
    // The backends the VIPs list, not all 16,384 slots: a pass runs every
    // second, and ten times a second while a next hop is missing (a dead
    // backend's host). A removed backend keeps the next hop it had for its
    // flows, and one removed before it was ever resolved has none.
    let mut seen = HashSet::new();
    for (id, mut b) in tables::read(maps)?.into_iter().flat_map(|e| e.slots) {
        if !seen.insert(id) || b.addr == Addr::default() || backend_removed(&b) {
            continue;
        }
        let dst = ip_of(&b.addr);
        let hop = match rtnl.next_hop(dst) {
            Ok((hop, oif)) if oif == ifindex => hop,
            // Routed out of another interface (or not at all): the XDP
            // path, which only sends back out of its own, cannot reach it.
            Ok(_) | Err(_) => dst,
        };
        match table.iter().find(|(a, _)| *a == hop) {
            Some((_, mac)) if *mac != b.mac => {
                info!(backend = %dst, next_hop = %hop, mac = %inband_core::netif::format_mac(mac), "backend next hop resolved");
                b.mac = *mac;
                bpfmap::put(&maps.backends, &id, &b)?;
            }
            Some(_) => {}
            None => {
                unresolved += 1;
                debug!(backend = %dst, next_hop = %hop, "next hop unknown; asking the kernel to resolve it");
                let any = if hop.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
                if let Ok(s) = UdpSocket::bind(any) {
                    let _ = s.send_to(b"", (hop, 9));
                }
            }
        }
    }
    Ok(unresolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's own answers for loopback, in any namespace: on-link
    /// through `lo`, and a neighbour dump that parses.
    #[test]
    fn asks_the_kernel_for_routes_and_neighbours() {
        let mut rtnl = Rtnl::new().unwrap();
        let lo = inband_core::netif::ifindex("lo").unwrap();
        assert_eq!(rtnl.next_hop("127.0.0.1".parse().unwrap()).unwrap(), ("127.0.0.1".parse().unwrap(), lo));
        rtnl.neighbours(lo).unwrap();
    }
}

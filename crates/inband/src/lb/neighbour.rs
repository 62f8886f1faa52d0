//! Keeps `backends[id].mac` equal to the next hop's MAC from the kernel's
//! neighbour table, so the XDP path can forward without a route lookup.
//! A backend on another subnet resolves to its gateway's MAC.

use std::net::{Ipv4Addr, UdpSocket};

use anyhow::Result;
use tracing::{debug, info};

use super::maps::{Backend, MAX_BACKENDS};
use super::tables::LbMaps;
use crate::bpfmap;
use crate::pod::addr_of;

/// The complete ARP entries of `interface` from /proc/net/arp.
pub fn arp_table(text: &str, interface: &str) -> Vec<(Ipv4Addr, [u8; 6])> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // IP address, HW type, Flags, HW address, Mask, Device; 0x2 = complete.
            if f.len() < 6 || f[5] != interface {
                return None;
            }
            let flags = u32::from_str_radix(f[2].trim_start_matches("0x"), 16).ok()?;
            if flags & 0x2 == 0 {
                return None;
            }
            Some((f[0].parse().ok()?, crate::netif::parse_mac(f[3]).ok()?))
        })
        .collect()
}

/// The gateway /proc/net/route names for `dst` on `interface`, if any
/// (longest prefix wins); `None` = on-link.
pub fn gateway_for(text: &str, interface: &str, dst: Ipv4Addr) -> Option<Ipv4Addr> {
    let hex = |s: &str| u32::from_str_radix(s, 16).ok().map(|v| Ipv4Addr::from(v.to_le_bytes()));
    let mut best: Option<(u32, Ipv4Addr)> = None;
    for l in text.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 8 || f[0] != interface {
            continue;
        }
        let (Some(net), Some(gw), Some(mask)) = (hex(f[1]), hex(f[2]), hex(f[7])) else { continue };
        let m = u32::from(mask);
        if u32::from(dst) & m == u32::from(net) && best.map_or(true, |(bm, _)| m.count_ones() > bm) {
            best = Some((m.count_ones(), gw));
        }
    }
    best.and_then(|(_, gw)| (!gw.is_unspecified()).then_some(gw))
}

/// One pass: fills or corrects every backend's MAC; for next hops the
/// kernel does not know yet, sends one datagram to the discard port so the
/// kernel starts ARP (the next pass picks the answer up).
pub fn refresh(maps: &LbMaps, interface: &str) -> Result<usize> {
    let arp = std::fs::read_to_string("/proc/net/arp")?;
    let routes = std::fs::read_to_string("/proc/net/route")?;
    let table = arp_table(&arp, interface);
    let mut unresolved = 0;
    for id in 0..MAX_BACKENDS {
        let mut b: Backend = bpfmap::get(&maps.backends, &id)?.unwrap_or_default();
        if b.addr == 0 || b.flags == 0 && b.mac != [0; 6] {
            continue;
        }
        let dst = addr_of(b.addr);
        let hop = gateway_for(&routes, interface, dst).unwrap_or(dst);
        match table.iter().find(|(a, _)| *a == hop) {
            Some((_, mac)) if *mac != b.mac => {
                info!(backend = %dst, next_hop = %hop, mac = %crate::netif::format_mac(mac), "backend next hop resolved");
                b.mac = *mac;
                bpfmap::put(&maps.backends, &id, &b)?;
            }
            Some(_) => {}
            None => {
                unresolved += 1;
                debug!(backend = %dst, next_hop = %hop, "next hop unknown; asking the kernel to resolve it");
                if let Ok(s) = UdpSocket::bind("0.0.0.0:0") {
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

    #[test]
    fn reads_complete_arp_entries_of_the_interface_only() {
        let text = "IP address       HW type     Flags       HW address            Mask     Device\n\
                    10.77.0.21       0x1         0x2         aa:bb:cc:dd:ee:01     *        eth0\n\
                    10.77.0.22       0x1         0x0         00:00:00:00:00:00     *        eth0\n\
                    10.9.0.1         0x1         0x2         aa:bb:cc:dd:ee:02     *        eth1\n";
        let t = arp_table(text, "eth0");
        assert_eq!(t, vec![("10.77.0.21".parse().unwrap(), [0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x01])]);
    }

    #[test]
    fn picks_longest_prefix_gateway() {
        // Default via 10.77.0.1; 10.88.0.0/16 via 10.77.0.5; 10.77.0.0/24 on-link.
        let text = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n\
                    eth0\t00000000\t01004D0A\t0003\t0\t0\t0\t00000000\n\
                    eth0\t0000580A\t05004D0A\t0003\t0\t0\t0\t0000FFFF\n\
                    eth0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n";
        assert_eq!(gateway_for(text, "eth0", "10.88.1.2".parse().unwrap()), Some("10.77.0.5".parse().unwrap()));
        assert_eq!(gateway_for(text, "eth0", "10.77.0.21".parse().unwrap()), None);
        assert_eq!(gateway_for(text, "eth0", "192.0.2.1".parse().unwrap()), Some("10.77.0.1".parse().unwrap()));
    }
}

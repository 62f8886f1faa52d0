//! How the balancer, the agent and the weights controller name a service
//! on the network: its transport, its name in messages and status, and
//! which addresses can be a peer at all.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// The transport a VIP balances.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
}

impl Protocol {
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
    pub fn from_number(n: u8) -> Option<Protocol> {
        [Protocol::Tcp, Protocol::Udp].into_iter().find(|p| p.number() == n)
    }
}

/// An IPv4 sender seen through a dual-stack socket (`::ffff:a.b.c.d`) is
/// IPv4: the form the poll answers are matched against.
pub fn unmapped(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

/// An address that can be a unicast peer: not unspecified, broadcast,
/// multicast, loopback, or (IPv6) link-local or IPv4-mapped.
pub fn unicast(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(a) => !(a.is_unspecified() || a.is_broadcast() || a.is_multicast() || a.is_loopback()),
        IpAddr::V6(a) => {
            !(a.is_unspecified()
                || a.is_multicast()
                || a.is_loopback()
                || a.segments()[0] & 0xffc0 == 0xfe80
                || a.to_ipv4_mapped().is_some())
        }
    }
}

/// A VIP's name in messages and status: `10.0.0.100:80`, with `/udp` for UDP.
pub fn vip_name(ep: SocketAddr, protocol: Protocol) -> String {
    match protocol {
        Protocol::Tcp => ep.to_string(),
        Protocol::Udp => format!("{ep}/udp"),
    }
}

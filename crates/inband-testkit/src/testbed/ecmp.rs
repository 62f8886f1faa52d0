//! The ECMP testbed (seed 002's setup, `TestbedSpec::ecmp`): a router `r1`
//! with a link of its own to every client and every server, reached
//! through SRv6. Its next hops for
//! the VIP are the servers, each with the VIP, or with `balancers` > 0
//! the balancer instances b1..bN (on links of their own to r1), each in
//! front of every server.
//!
//! Addresses, for subnet X (written as hex digits, as in `TestbedSpec`):
//! client i fd00:X:1::(10+i) behind r1's fd00:X:1::1; server i on the link
//! fd00:X:2i::/64 (server ::2, router ::1), balancer i on fd00:X:3i::/64
//! likewise. Next hop i (server or balancer) has the SIDs fd00:X:5i::b
//! (conditional) and fd00:X:5i::d (direct): on a server both are End.DT6
//! into the local table, where the VIP fd00:X::100 is; a balancer's XDP
//! program takes them itself. The router's shadow SID is fd00:X:5f::5.
//! The router's `router.toml` (for `inband shadow route`) lists the next
//! hops; no route to the VIP exists until that command runs.
//!
//! Every host has an IPv4 address too, for IPv4 VIPs behind balancer
//! instances (which the router carries as IPv4 in IPv6 to the same SIDs;
//! servers as next hops take IPv6 only: their End.DT6 SIDs): client i
//! 10.X.1.(10+i) behind r1's 10.X.1.1, server i 10.X.(20+i).2 and
//! balancer i 10.X.(30+i).2 with r1 at .1 on their links, the IPv4 VIP
//! 10.X.0.100 (X in decimal here). Its anchor,
//! the interface the router's nexthop objects sit on, is `inb0`: a veth
//! pair inside r1 (`inb0`, `inb0p`, both up), since this kernel has no
//! dummy driver.

use std::net::Ipv6Addr;
use std::process::Stdio;

use anyhow::Result;

use super::netns;
use inband_core::command;
use super::{add_ipv6, Node, Testbed};

pub fn hex(n: u8) -> u16 {
    u16::from_str_radix(&n.to_string(), 16).unwrap_or(u16::from(n))
}

/// Next hops (and servers) an ECMP testbed numbers: SIDs fd00:X:51.. to
/// fd00:X:5e, below the router's fd00:X:5f.
pub const MAX_HOPS: usize = 14;

pub struct Plan {
    pub subnet: u16,
}

impl Plan {
    pub fn client(&self, i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 1, 0, 0, 0, 0, hex(10 + i as u8))
    }
    fn client_gw(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 1, 0, 0, 0, 0, 1)
    }
    fn server_net(&self, i: usize) -> u16 {
        0x20 + i as u16
    }
    pub fn server(&self, i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, self.server_net(i), 0, 0, 0, 0, 2)
    }
    pub fn balancer(&self, i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 0x30 + i as u16, 0, 0, 0, 0, 2)
    }
    /// The router's address on the link to `node` (s<i> or b<i>).
    fn router_on(&self, node: &Node) -> Ipv6Addr {
        let mut o = node.address6.segments();
        o[7] = 1;
        Ipv6Addr::from(o)
    }
    pub fn sid(&self, i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 0x50 + i as u16, 0, 0, 0, 0, 0xb)
    }
    pub fn direct_sid(&self, i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 0x50 + i as u16, 0, 0, 0, 0, 0xd)
    }
    pub fn shadow_sid(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 0x5f, 0, 0, 0, 0, 5)
    }
    pub fn vip(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, self.subnet, 0, 0, 0, 0, 0, 0x100)
    }
}

fn sysctl(ns: &str, kv: &str) -> Result<()> {
    command::run(netns::in_netns(ns, &["sysctl", "-q", "-w", kv]).stdout(Stdio::null())).map(|_| ())
}

/// Builds what `Testbed::up` planned (`nodes`: r1, the clients, the
/// servers, the balancers).
pub fn build(tb: &Testbed) -> Result<()> {
    let plan = Plan { subnet: hex(tb.spec.subnet) };
    let r1 = tb.node("r1")?;
    for n in &tb.nodes {
        command::ip(&["netns", "add", &n.netns])?;
        sysctl(&n.netns, "net.ipv6.conf.default.accept_dad=0")?;
        command::ip(&["-n", &n.netns, "link", "set", "lo", "up"])?;
    }
    sysctl(&r1.netns, "net.ipv6.conf.all.forwarding=1")?;
    sysctl(&r1.netns, "net.ipv4.ip_forward=1")?;
    command::ip(&["-n", &r1.netns, "link", "add", ANCHOR, "type", "veth", "peer", "name", &format!("{ANCHOR}p")])?;
    for dev in [ANCHOR.to_string(), format!("{ANCHOR}p")] {
        command::ip(&["-n", &r1.netns, "link", "set", &dev, "up"])?;
    }
    let (mut toml, gw) = (router_toml(&plan), plan.client_gw().to_string());
    // The router's next hops for the VIP: the balancers if there are any.
    let hop = if tb.spec.balancers > 0 { 'b' } else { 's' };
    for n in tb.nodes.iter().filter(|n| n.node != "r1") {
        let i: usize = n.node[1..].parse()?;
        let (local, peer) = ("eth0", n.node.as_str());
        command::ip(&["link", "add", local, "netns", &n.netns, "type", "veth", "peer", "name", peer, "netns", &r1.netns])?;
        command::ip(&["-n", &n.netns, "link", "set", local, "up"])?;
        command::ip(&["-n", &r1.netns, "link", "set", peer, "up"])?;
        // Software checksums, as a real wire demands (see `Testbed::build`).
        command::run(netns::in_netns(&n.netns, &["ethtool", "-K", local, "tx", "off"]).stdout(Stdio::null()))?;
        command::run(netns::in_netns(&r1.netns, &["ethtool", "-K", peer, "tx", "off"]).stdout(Stdio::null()))?;
        add_ipv6(&n.netns, local, &format!("{}/64", n.address6))?;
        command::ip(&["-n", &n.netns, "addr", "add", &format!("{}/24", n.address), "dev", local])?;
        let gw4 = router_on4(n).to_string();
        if n.node.starts_with('c') {
            command::ip(&["-n", &n.netns, "-6", "route", "add", "default", "via", &gw])?;
            add_ipv6(&r1.netns, peer, &format!("{gw}/128"))?;
            command::ip(&["-n", &r1.netns, "-6", "route", "add", &format!("{}/128", n.address6), "dev", peer])?;
            command::ip(&["-n", &n.netns, "route", "add", "default", "via", &gw4])?;
            command::ip(&["-n", &r1.netns, "addr", "add", &format!("{gw4}/32"), "dev", peer])?;
            command::ip(&["-n", &r1.netns, "route", "add", &format!("{}/32", n.address), "dev", peer])?;
            continue;
        }
        add_ipv6(&r1.netns, peer, &format!("{}/64", plan.router_on(n)))?;
        command::ip(&["-n", &n.netns, "-6", "route", "add", "default", "via", &plan.router_on(n).to_string()])?;
        command::ip(&["-n", &r1.netns, "addr", "add", &format!("{gw4}/24"), "dev", peer])?;
        command::ip(&["-n", &n.netns, "route", "add", "default", "via", &gw4])?;
        if !n.node.starts_with(hop) {
            continue;
        }
        if hop == 's' {
            add_ipv6(&n.netns, "lo", &format!("{}/128", plan.vip()))?;
            // Both SIDs decapsulate into the local table, where the VIP is
            // (what FRR's bgpd would install for an L3VPN; seed 002 §V).
            sysctl(&n.netns, "net.ipv6.conf.all.seg6_enabled=1")?;
            sysctl(&n.netns, &format!("net.ipv6.conf.{local}.seg6_enabled=1"))?;
            for sid in [plan.sid(i), plan.direct_sid(i)] {
                command::ip(&[
                    "-n", &n.netns, "-6", "route", "add", &sid.to_string(), "encap", "seg6local", "action", "End.DT6", "table",
                    "local", "dev", local,
                ])?;
            }
        } else {
            // The balancer answers with XDP_TX, which a veth delivers
            // only into a peer that runs XDP.
            super::peer::attach_pass(&r1.netns, peer)?;
        }
        command::ip(&[
            "-n",
            &r1.netns,
            "-6",
            "route",
            "add",
            &format!("fd00:{:x}:{:x}::/64", plan.subnet, 0x50 + i),
            "via",
            &n.address6.to_string(),
        ])?;
        toml.push_str(&format!(
            "\n[[server]]\nname = \"{}\"\nsid = \"{}\"\ndirect_sid = \"{}\"\nvia = \"{}\"\ndev = \"{}\"\n",
            n.node,
            plan.sid(i),
            plan.direct_sid(i),
            n.address6,
            peer
        ));
    }
    std::fs::create_dir_all(router_config(tb).parent().unwrap_or(std::path::Path::new("/")))?;
    std::fs::write(router_config(tb), toml)?;
    Ok(())
}

/// The router's IPv4 address on the link to `node`.
fn router_on4(node: &Node) -> std::net::Ipv4Addr {
    let mut o = node.address.octets();
    o[3] = 1;
    std::net::Ipv4Addr::from(o)
}

/// The router's anchor interface (router.toml's `anchor`).
pub const ANCHOR: &str = "inb0";

fn router_toml(plan: &Plan) -> String {
    format!(
        "# inband shadow route --config (written by `inband testbed up --ecmp`)\nvip = \"{}\"\nanchor = \"{ANCHOR}\"\nshadow_sid = \"{}\"\n",
        plan.vip(),
        plan.shadow_sid()
    )
}

/// Where the router's config is written.
pub fn router_config(tb: &Testbed) -> std::path::PathBuf {
    super::state_path(&tb.spec.name).with_extension("router.toml")
}

/// The IPv4 VIP of an ECMP testbed on `subnet`.
pub fn vip4(subnet: u8) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(10, subnet, 0, 100)
}

/// The nodes of an ECMP testbed with `clients`, `servers` and `balancers`.
pub fn nodes(subnet: u8, clients: usize, servers: usize, balancers: usize) -> Vec<Node> {
    let plan = Plan { subnet: hex(subnet) };
    let v4 = |net: usize, host: u8| std::net::Ipv4Addr::new(10, subnet, net as u8, host);
    let node = |name: String, address, address6| Node { node: name, netns: String::new(), address, address6, bridge_port: String::new() };
    let mut v = vec![node("r1".into(), v4(1, 1), plan.client_gw())];
    v.extend((1..=clients).map(|i| node(format!("c{i}"), v4(1, 10 + i as u8), plan.client(i))));
    v.extend((1..=servers).map(|i| node(format!("s{i}"), v4(20 + i, 2), plan.server(i))));
    v.extend((1..=balancers).map(|i| node(format!("b{i}"), v4(30 + i, 2), plan.balancer(i))));
    v
}

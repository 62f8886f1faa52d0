//! Network-namespace testbeds: a bridge in a switch namespace and one
//! namespace per host (balancer, clients, real servers), each with a veth
//! `eth0` on the bridge. Used by the demo, the benchmark drivers (through
//! `inband testbed`) and the integration tests (through `Testbed`).

pub mod bgp;
pub mod ecmp;
pub mod netns;
mod peer;

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use inband_core::command;

pub use netns::in_netns;

/// What to build. Addresses: 10.<subnet>.0.0/24, balancer .2, VIP .100 (on
/// the balancer's lo), clients .10+i, servers .20+i; and the same hosts in
/// IPv6, fd00:<subnet>::/64 (the same numbers, written as hex groups: host
/// .21 is ::21), VIP fd00:<subnet>::100.
///
/// With `client_link_mtu`, the clients sit behind a router `r1` instead
/// (10.<subnet>.0.3 on the bridge; clients 10.<subnet>.1.10+i, each on its
/// own link), and r1 sends to them with that MTU while the clients' own
/// interfaces keep 1500: a smaller link somewhere on the clients' path, so
/// full-size packets toward them make r1 answer "fragmentation needed".
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TestbedSpec {
    pub name: String,
    pub clients: usize,
    pub servers: usize,
    pub subnet: u8,
    #[serde(default)]
    pub client_link_mtu: Option<u32>,
    /// Seed 002's layout instead (`ecmp.rs`): a router with a link to
    /// every client and server, the VIP on every server, no balancer.
    #[serde(default)]
    pub ecmp: bool,
    /// With `ecmp`: this many `inband lb` hosts (b1..bN) as the router's
    /// next hops, in front of the servers (docs/architecture.md).
    #[serde(default)]
    pub balancers: usize,
    /// With `balancers`: BIRD on the router and on each balancer host,
    /// the VIP announced by BGP (`bgp.rs`).
    #[serde(default)]
    pub bgp: bool,
    /// Addresses of each client (1..=CLIENT_ADDRESSES_MAX): the first is
    /// its own on the bridge, the others come from a subnet of their own
    /// (`client_addrs`), so one client namespace can be many clients.
    #[serde(default = "one")]
    pub client_addresses: usize,
}

fn one() -> usize {
    1
}

pub const CLIENT_ADDRESSES_MAX: usize = 250;

impl Default for TestbedSpec {
    fn default() -> Self {
        TestbedSpec { name: "ib".into(), clients: 1, servers: 3, subnet: 77, client_link_mtu: None, ecmp: false, balancers: 0, bgp: false, client_addresses: 1 }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Node {
    /// "lb", "c1", "s1", ...
    pub node: String,
    pub netns: String,
    pub address: Ipv4Addr,
    pub address6: Ipv6Addr,
    /// The veth peer on the bridge, in the switch namespace.
    pub bridge_port: String,
}

/// A testbed that exists; dropping it tears it down.
#[derive(Debug, Serialize, Deserialize)]
pub struct Testbed {
    pub spec: TestbedSpec,
    pub switch: String,
    pub vip: Ipv4Addr,
    pub vip6: Ipv6Addr,
    pub nodes: Vec<Node>,
    /// ECMP testbeds: the router's config for `inband shadow route`.
    #[serde(default)]
    pub router_config: Option<PathBuf>,
    #[serde(skip)]
    children: Vec<Child>,
    /// Deserialized testbeds (the CLI's) never tear down on drop.
    #[serde(skip, default = "keep_deserialized")]
    keep: bool,
}

const MAX_HOSTS: usize = 60;

fn keep_deserialized() -> bool {
    true
}

fn valid_name(name: &str) -> bool {
    (1..=8).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// i of client "ci" (1-based).
fn client_index(node: &str) -> Result<u8> {
    node.strip_prefix('c').and_then(|i| i.parse().ok()).filter(|i| *i >= 1).ok_or_else(|| anyhow::anyhow!("{node} is not a client (c1, c2, ...)"))
}

impl Testbed {
    pub fn up(spec: TestbedSpec) -> Result<Testbed> {
        if !valid_name(&spec.name) {
            bail!("testbed name {:?}: use 1-8 characters of a-z and 0-9", spec.name);
        }
        if spec.clients + spec.servers > MAX_HOSTS || spec.clients == 0 || spec.servers == 0 {
            bail!("testbed: 1..{MAX_HOSTS} clients and servers in all, at least one of each");
        }
        if !(1..=CLIENT_ADDRESSES_MAX).contains(&spec.client_addresses) {
            bail!("testbed: 1..{CLIENT_ADDRESSES_MAX} addresses per client");
        }
        if spec.client_addresses > 1 && (spec.ecmp || spec.client_link_mtu.is_some()) {
            bail!("testbed: several addresses per client are for the bridged testbed (no --ecmp, no --client-link-mtu)");
        }
        if spec.bgp && spec.balancers == 0 {
            bail!("testbed: BGP runs between the router and balancer hosts: add --balancers N");
        }
        if spec.balancers > 0 && !spec.ecmp {
            bail!("testbed: balancers behind a router are an ECMP testbed's (--ecmp)");
        }
        if spec.ecmp && (spec.balancers.max(spec.servers) > ecmp::MAX_HOPS) {
            bail!("testbed: an ECMP testbed has at most {} servers and {} balancers", ecmp::MAX_HOPS, ecmp::MAX_HOPS);
        }
        teardown(&spec.name)?;
        if spec.ecmp {
            let plan = ecmp::Plan { subnet: ecmp::hex(spec.subnet) };
            let mut nodes = ecmp::nodes(spec.subnet, spec.clients, spec.servers, spec.balancers);
            for n in nodes.iter_mut() {
                n.netns = format!("{}-{}", spec.name, n.node);
            }
            let mut tb = Testbed {
                switch: String::new(),
                vip: ecmp::vip4(spec.subnet),
                vip6: plan.vip(),
                spec,
                nodes,
                router_config: None,
                children: Vec::new(),
                keep: false,
            };
            tb.router_config = Some(ecmp::router_config(&tb));
            ecmp::build(&tb).context("building the ECMP testbed")?;
            tb.wait_ipv6_usable()?;
            if tb.spec.bgp {
                bgp::start(&tb).context("starting BGP")?;
            }
            return Ok(tb);
        }
        let base = |host: u8| Ipv4Addr::new(10, spec.subnet, 0, host);
        // The IPv4 host number read as hex digits: .21 is ::21, .100 is ::100.
        let base6 = |net: u16, host: u8| Ipv6Addr::new(0xfd00, ecmp::hex(spec.subnet), net, 0, 0, 0, 0, ecmp::hex(host));
        let node = |name: String, address, address6| Node { node: name, netns: String::new(), address, address6, bridge_port: String::new() };
        let routed = spec.client_link_mtu.is_some();
        let mut nodes = vec![node("lb".into(), base(2), base6(0, 2))];
        if routed {
            nodes.push(node("r1".into(), base(3), base6(0, 3)));
        }
        for i in 1..=spec.clients {
            let h = 10 + i as u8;
            let (a, a6) = if routed { (Ipv4Addr::new(10, spec.subnet, 1, h), base6(1, h)) } else { (base(h), base6(0, h)) };
            nodes.push(node(format!("c{i}"), a, a6));
        }
        for i in 1..=spec.servers {
            nodes.push(node(format!("s{i}"), base(20 + i as u8), base6(0, 20 + i as u8)));
        }
        for n in nodes.iter_mut() {
            n.netns = format!("{}-{}", spec.name, n.node);
            n.bridge_port = format!("p-{}", n.node);
        }
        let tb = Testbed {
            switch: format!("{}-sw", spec.name),
            vip: base(100),
            vip6: base6(0, 100),
            spec,
            nodes,
            router_config: None,
            children: Vec::new(),
            keep: false,
        };
        // From here on a failure drops `tb`, which removes what was made.
        tb.build().context("building the testbed")?;
        tb.wait_ipv6_usable()?;
        Ok(tb)
    }

    /// Returns once every node's IPv6 addresses can carry connections
    /// (`netns::wait_ipv6_usable`).
    fn wait_ipv6_usable(&self) -> Result<()> {
        for n in &self.nodes {
            netns::wait_ipv6_usable(&n.netns)?;
        }
        Ok(())
    }

    fn build(&self) -> Result<()> {
        let sw = self.switch.as_str();
        command::ip(&["netns", "add", sw])?;
        // Without multicast snooping the bridge floods neighbour
        // solicitations to every port: a host that has not yet told the
        // bridge which solicited-node groups it listens to still hears them.
        command::ip(&["-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])?;
        command::ip(&["-n", sw, "link", "set", "br0", "up"])?;
        let routed = self.spec.client_link_mtu.is_some();
        for n in &self.nodes {
            command::ip(&["netns", "add", &n.netns])?;
            // Interfaces made from here on skip duplicate address detection
            // (link-local addresses too): usable at once, unique anyway.
            command::run(netns::in_netns(&n.netns, &["sysctl", "-q", "-w", "net.ipv6.conf.default.accept_dad=0"]).stdout(Stdio::null()))?;
            if routed && n.node.starts_with('c') {
                self.link_to_router(n)?;
                continue;
            }
            command::ip(&["link", "add", "eth0", "netns", &n.netns, "type", "veth", "peer", "name", &n.bridge_port, "netns", sw])?;
            command::ip(&["-n", sw, "link", "set", &n.bridge_port, "master", "br0", "up"])?;
            command::ip(&["-n", &n.netns, "link", "set", "lo", "up"])?;
            command::ip(&["-n", &n.netns, "addr", "add", &format!("{}/24", n.address), "dev", "eth0"])?;
            add_ipv6(&n.netns, "eth0", &format!("{}/64", n.address6))?;
            command::ip(&["-n", &n.netns, "link", "set", "eth0", "up"])?;
            if n.node != "lb" {
                // veth leaves TCP checksums partial when the sender offloads
                // them, and a packet rewritten by XDP loses the "partial"
                // mark; real NICs deliver complete checksums. Hosts here
                // compute them in software, as a real wire would demand.
                command::run(netns::in_netns(&n.netns, &["ethtool", "-K", "eth0", "tx", "off"]).stdout(Stdio::null()))?;
            }
        }
        if routed {
            let r1 = self.node("r1")?;
            command::run(netns::in_netns(&r1.netns, &["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]).stdout(Stdio::null()))?;
            command::run(netns::in_netns(&r1.netns, &["sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"]).stdout(Stdio::null()))?;
            let clients = format!("10.{}.1.0/24", self.spec.subnet);
            let clients6 = format!("fd00:{}:1::/64", self.spec.subnet);
            for n in self.nodes.iter().filter(|n| n.node == "lb" || n.node.starts_with('s')) {
                command::ip(&["-n", &n.netns, "route", "add", &clients, "via", &r1.address.to_string()])?;
                command::ip(&["-n", &n.netns, "-6", "route", "add", &clients6, "via", &r1.address6.to_string()])?;
            }
        }
        if self.spec.client_addresses > 1 {
            self.extra_client_addresses()?;
        }
        let lb = self.node("lb")?;
        command::ip(&["-n", &lb.netns, "addr", "add", &format!("{}/32", self.vip), "dev", "lo"])?;
        // IPv6 neighbour discovery answers only for the receiving
        // interface's own addresses (ARP answers for any local one): an
        // on-link IPv6 VIP sits on the balancer's interface.
        add_ipv6(&lb.netns, "eth0", &format!("{}/128", self.vip6))?;
        // XDP_TX on a veth delivers into the peer only when the peer runs an
        // XDP program too (it needs the peer's NAPI ring): the balancer's
        // bridge port gets one that passes everything.
        peer::attach_pass(sw, &lb.bridge_port)?;
        Ok(())
    }

    /// Client i's extra addresses live in 10.<subnet>.(128+i).0/24 and
    /// fd00:<subnet>:(80+i)::/64, on its bridge link; every other node
    /// reaches them on-link (10.<subnet>.128.0/17, fd00:<subnet>:80::/41),
    /// so they answer ARP and neighbour solicitations themselves and a DSR
    /// server's responses go straight to them.
    fn extra_client_addresses(&self) -> Result<()> {
        let (v4, v6) = (format!("10.{}.128.0/17", self.spec.subnet), format!("fd00:{:x}:80::/41", ecmp::hex(self.spec.subnet)));
        for n in &self.nodes {
            if !n.node.starts_with('c') {
                command::ip(&["-n", &n.netns, "route", "add", &v4, "dev", "eth0"])?;
                command::ip(&["-n", &n.netns, "-6", "route", "add", &v6, "dev", "eth0"])?;
                continue;
            }
            for (a, a6) in self.client_addrs(&n.node)?.iter().zip(self.client_addrs6(&n.node)?).skip(1) {
                command::ip(&["-n", &n.netns, "addr", "add", &format!("{a}/24"), "dev", "eth0"])?;
                add_ipv6(&n.netns, "eth0", &format!("{a6}/64"))?;
            }
        }
        Ok(())
    }

    /// Client `node`'s addresses (`TestbedSpec::client_addresses` of them):
    /// its own first, then 10.<subnet>.(128+i).1, .2, ...
    pub fn client_addrs(&self, node: &str) -> Result<Vec<Ipv4Addr>> {
        let i = client_index(node)?;
        let own = self.node(node)?.address;
        Ok(std::iter::once(own).chain((1..self.spec.client_addresses).map(|k| Ipv4Addr::new(10, self.spec.subnet, 128 + i, k as u8))).collect())
    }

    /// The same in IPv6: fd00:<subnet>:(80+i)::1, ::2, ...
    pub fn client_addrs6(&self, node: &str) -> Result<Vec<Ipv6Addr>> {
        let i = client_index(node)?;
        let own = self.node(node)?.address6;
        let net = 0x80 + u16::from(i);
        Ok(std::iter::once(own)
            .chain((1..self.spec.client_addresses).map(|k| Ipv6Addr::new(0xfd00, ecmp::hex(self.spec.subnet), net, 0, 0, 0, 0, k as u16)))
            .collect())
    }

    /// A client's own link to the router: r1 sends to it with the spec's
    /// MTU, the client keeps 1500 (see `TestbedSpec`).
    fn link_to_router(&self, n: &Node) -> Result<()> {
        let r1 = self.node("r1")?;
        let mtu = self.spec.client_link_mtu.unwrap_or(1500).to_string();
        let gw = format!("10.{}.1.1", self.spec.subnet);
        let gw6 = format!("fd00:{}:1::1", self.spec.subnet);
        command::ip(&["link", "add", "eth0", "netns", &n.netns, "type", "veth", "peer", "name", &n.node, "netns", &r1.netns])?;
        command::ip(&["-n", &n.netns, "link", "set", "lo", "up"])?;
        command::ip(&["-n", &n.netns, "addr", "add", &format!("{}/24", n.address), "dev", "eth0"])?;
        add_ipv6(&n.netns, "eth0", &format!("{}/64", n.address6))?;
        command::ip(&["-n", &n.netns, "link", "set", "eth0", "up"])?;
        command::ip(&["-n", &n.netns, "route", "add", "default", "via", &gw])?;
        command::ip(&["-n", &n.netns, "-6", "route", "add", "default", "via", &gw6])?;
        command::run(netns::in_netns(&n.netns, &["ethtool", "-K", "eth0", "tx", "off"]).stdout(Stdio::null()))?;
        // One router address for every client link (a /32 route per client).
        command::ip(&["-n", &r1.netns, "addr", "add", &format!("{gw}/32"), "dev", &n.node])?;
        add_ipv6(&r1.netns, &n.node, &format!("{gw6}/128"))?;
        command::ip(&["-n", &r1.netns, "link", "set", &n.node, "mtu", &mtu, "up"])?;
        command::ip(&["-n", &r1.netns, "route", "add", &format!("{}/32", n.address), "dev", &n.node])?;
        command::ip(&["-n", &r1.netns, "-6", "route", "add", &format!("{}/128", n.address6), "dev", &n.node])?;
        command::run(netns::in_netns(&r1.netns, &["ethtool", "-K", &n.node, "tx", "off"]).stdout(Stdio::null()))?;
        Ok(())
    }

    /// Lets `node` send frames with XDP_TX (a generator's live frames):
    /// its bridge port gets the pass program, as the balancer's has.
    pub fn enable_xdp_tx(&self, node: &str) -> Result<()> {
        peer::attach_pass(&self.switch, &self.node(node)?.bridge_port)
    }

    pub fn node(&self, node: &str) -> Result<&Node> {
        self.nodes.iter().find(|n| n.node == node).ok_or_else(|| anyhow::anyhow!("testbed {} has no node {node:?}", self.spec.name))
    }

    pub fn netns(&self, node: &str) -> String {
        self.node(node).map(|n| n.netns.clone()).unwrap_or_default()
    }

    pub fn addr(&self, node: &str) -> Ipv4Addr {
        self.node(node).map(|n| n.address).unwrap_or(Ipv4Addr::UNSPECIFIED)
    }

    pub fn vip(&self) -> Ipv4Addr {
        self.vip
    }

    pub fn addr6(&self, node: &str) -> Ipv6Addr {
        self.node(node).map(|n| n.address6).unwrap_or(Ipv6Addr::UNSPECIFIED)
    }

    pub fn vip6(&self) -> Ipv6Addr {
        self.vip6
    }

    /// A command to run in `node`'s network namespace.
    pub fn command(&self, node: &str, argv: &[&str]) -> Command {
        in_netns(&self.netns(node), argv)
    }

    pub fn exec(&self, node: &str, argv: &[&str]) -> Result<Output> {
        self.command(node, argv).output().with_context(|| format!("running {argv:?} in {node}"))
    }

    /// Starts a long-running process in `node`; it is killed at teardown.
    pub fn spawn(&mut self, node: &str, argv: &[&str]) -> Result<u32> {
        let child = self.command(node, argv).spawn().with_context(|| format!("starting {argv:?} in {node}"))?;
        let pid = child.id();
        self.children.push(child);
        Ok(pid)
    }

    /// Leaves the testbed in place when dropped (the CLI's `up`).
    pub fn keep(mut self) -> Testbed {
        self.keep = true;
        self
    }

    pub fn down(mut self) -> Result<()> {
        self.kill_children();
        self.keep = true;
        teardown(&self.spec.name)
    }

    fn kill_children(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.kill_children();
        if !self.keep {
            if let Err(e) = teardown(&self.spec.name) {
                eprintln!("testbed {}: teardown: {e:#}", self.spec.name);
            }
        }
    }
}

/// An IPv6 address without duplicate address detection, which would hold
/// it "tentative" for a second or more (every address here is unique by
/// construction). It carries connections once its local route is in
/// (`netns::wait_ipv6_usable`, which `Testbed::up` runs for every node).
fn add_ipv6(ns: &str, dev: &str, cidr: &str) -> Result<()> {
    command::ip(&["-n", ns, "-6", "addr", "add", cidr, "dev", dev, "nodad"]).map(|_| ())
}

fn state_path(name: &str) -> PathBuf {
    PathBuf::from("/run/inband/testbed").join(format!("{name}.json"))
}

/// Removes every namespace of testbed `name` (and the processes in them);
/// fine if nothing exists.
pub fn teardown(name: &str) -> Result<()> {
    let prefix = format!("{name}-");
    let out = command::ip(&["netns", "list"])?;
    let mut first_err = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let ns = line.split_whitespace().next().unwrap_or("");
        if ns.strip_prefix(&prefix).is_some_and(|rest| rest == "sw" || rest == "lb" || rest == "r1" || is_host(rest)) {
            if let Err(e) = netns::delete(ns) {
                first_err.get_or_insert(e);
            }
            // Pins outlive the namespace (bpffs is the host's); a component
            // that was killed, not stopped, left its maps there.
            let pins = inband_core::bpfmap::pin_root_of(ns);
            if pins.exists() {
                if let Err(e) = std::fs::remove_dir_all(&pins) {
                    first_err.get_or_insert(anyhow::anyhow!("removing {}: {e}", pins.display()));
                }
                let _ = inband_core::bpfmap::remove_pin_dir(&pins);
            }
        }
    }
    let _ = std::fs::remove_file(state_path(name));
    let _ = std::fs::remove_file(state_path(name).with_extension("router.toml"));
    bgp::clean(name);
    first_err.map_or(Ok(()), Err)
}

fn is_host(rest: &str) -> bool {
    let (kind, num) = rest.split_at(1);
    (kind == "c" || kind == "s" || kind == "b") && !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit())
}

#[derive(clap::Subcommand)]
pub enum TestbedCommand {
    /// Build a testbed (replacing one of the same name) and leave it up.
    Up {
        /// 1-8 characters of a-z and 0-9; the namespaces are NAME-NODE
        /// (NAME-lb, NAME-c1, NAME-s1, NAME-sw), so each testbed needs a
        /// name of its own.
        #[arg(long, default_value = "ib")]
        name: String,
        #[arg(long, default_value_t = 1)]
        clients: usize,
        #[arg(long, default_value_t = 3)]
        servers: usize,
        /// Second octet of the 10.X.0.0/24 subnet.
        #[arg(long, default_value_t = 77)]
        subnet: u8,
        /// Put the clients behind a router that sends to them with this MTU.
        #[arg(long)]
        client_link_mtu: Option<u32>,
        /// Seed 002's layout: clients and servers on links of their own to
        /// a router, the VIP on every server (IPv6, SRv6), no balancer.
        /// Every host also has an IPv4 address (10.<subnet>.*), for IPv4
        /// VIPs behind --balancers.
        #[arg(long, conflicts_with = "client_link_mtu")]
        ecmp: bool,
        /// With --ecmp: this many `inband lb` hosts (b1..bN) as the
        /// router's next hops, in front of the servers.
        #[arg(long, default_value_t = 0, requires = "ecmp")]
        balancers: usize,
        /// With --balancers: BIRD on the router and each balancer host,
        /// the VIP announced by BGP into the router's table 100 (follow it
        /// with `inband shadow follow --table 100`).
        #[arg(long, requires = "balancers")]
        bgp: bool,
        /// Addresses of each client, 1-250: client i's extra ones are
        /// 10.X.(128+i).1.. and fd00:X:(80+i)::1.. (bind to them, e.g.
        /// `curl --interface ADDR`), reached on-link by every node: many
        /// distinct clients from one namespace. Bridged testbed only.
        #[arg(long, default_value_t = 1)]
        client_addresses: usize,
    },
    /// Kill every process in the testbed's namespaces and delete them.
    Down {
        #[arg(long, default_value = "ib")]
        name: String,
    },
    /// Print the testbed's state (namespaces, addresses) as JSON.
    Show {
        #[arg(long, default_value = "ib")]
        name: String,
    },
    /// Let a node send with XDP_TX (a generator such as `inband bench
    /// blast`): its bridge port gets the pass program the balancer's has.
    XdpTx {
        #[arg(long, default_value = "ib")]
        name: String,
        #[arg(long)]
        node: String,
    },
    /// Run a command in one node's network namespace.
    Exec {
        #[arg(long, default_value = "ib")]
        name: String,
        #[arg(long)]
        node: String,
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
    },
}

/// The testbed `up` left running (never torn down when dropped).
fn load_state(name: &str) -> Result<Testbed> {
    let p = state_path(name);
    let json = std::fs::read_to_string(&p).with_context(|| format!("no testbed {name} ({} missing)", p.display()))?;
    Ok(serde_json::from_str::<Testbed>(&json)?.keep())
}

pub fn run(cmd: TestbedCommand) -> Result<()> {
    match cmd {
        TestbedCommand::Up { name, clients, servers, subnet, client_link_mtu, ecmp, balancers, bgp, client_addresses } => {
            let spec = TestbedSpec { name: name.clone(), clients, servers, subnet, client_link_mtu, ecmp, balancers, bgp, client_addresses };
            let tb = Testbed::up(spec)?.keep();
            let json = serde_json::to_string_pretty(&tb)?;
            std::fs::create_dir_all("/run/inband/testbed")?;
            std::fs::write(state_path(&name), &json)?;
            println!("{json}");
            Ok(())
        }
        TestbedCommand::Down { name } => teardown(&name),
        TestbedCommand::Show { name } => {
            println!("{}", serde_json::to_string_pretty(&load_state(&name)?)?);
            Ok(())
        }
        TestbedCommand::XdpTx { name, node } => load_state(&name)?.enable_xdp_tx(&node),
        TestbedCommand::Exec { name, node, argv } => {
            let tb = load_state(&name)?;
            let args: Vec<&str> = argv.iter().map(String::as_str).collect();
            let status = tb.command(&node, &args).status()?;
            std::process::exit(status.code().unwrap_or(1));
        }
    }
}

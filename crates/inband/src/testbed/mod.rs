//! Network-namespace testbeds: a bridge in a switch namespace and one
//! namespace per host (balancer, clients, real servers), each with a veth
//! `eth0` on the bridge. Used by the demo, the benchmark drivers (through
//! `inband testbed`) and the integration tests (through `Testbed`).

mod netns;
mod peer;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub use netns::in_netns;

/// What to build. Addresses: 10.<subnet>.0.0/24, balancer .2, VIP .100 (on
/// the balancer's lo), clients .10+i, servers .20+i.
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
}

impl Default for TestbedSpec {
    fn default() -> Self {
        TestbedSpec { name: "ib".into(), clients: 1, servers: 3, subnet: 77, client_link_mtu: None }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Node {
    /// "lb", "c1", "s1", ...
    pub node: String,
    pub netns: String,
    pub address: Ipv4Addr,
    /// The veth peer on the bridge, in the switch namespace.
    pub bridge_port: String,
}

/// A testbed that exists; dropping it tears it down.
#[derive(Debug, Serialize, Deserialize)]
pub struct Testbed {
    pub spec: TestbedSpec,
    pub switch: String,
    pub vip: Ipv4Addr,
    pub nodes: Vec<Node>,
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

impl Testbed {
    pub fn up(spec: TestbedSpec) -> Result<Testbed> {
        if !valid_name(&spec.name) {
            bail!("testbed name {:?}: use 1-8 characters of a-z and 0-9", spec.name);
        }
        if spec.clients + spec.servers > MAX_HOSTS || spec.clients == 0 || spec.servers == 0 {
            bail!("testbed: 1..{MAX_HOSTS} clients and servers in all, at least one of each");
        }
        teardown(&spec.name)?;
        let base = |host: u8| Ipv4Addr::new(10, spec.subnet, 0, host);
        let routed = spec.client_link_mtu.is_some();
        let mut nodes = vec![Node { node: "lb".into(), netns: String::new(), address: base(2), bridge_port: String::new() }];
        if routed {
            nodes.push(Node { node: "r1".into(), netns: String::new(), address: base(3), bridge_port: String::new() });
        }
        for i in 1..=spec.clients {
            let address = if routed { Ipv4Addr::new(10, spec.subnet, 1, 10 + i as u8) } else { base(10 + i as u8) };
            nodes.push(Node { node: format!("c{i}"), netns: String::new(), address, bridge_port: String::new() });
        }
        for i in 1..=spec.servers {
            nodes.push(Node { node: format!("s{i}"), netns: String::new(), address: base(20 + i as u8), bridge_port: String::new() });
        }
        for n in nodes.iter_mut() {
            n.netns = format!("{}-{}", spec.name, n.node);
            n.bridge_port = format!("p-{}", n.node);
        }
        let tb = Testbed { switch: format!("{}-sw", spec.name), vip: base(100), spec, nodes, children: Vec::new(), keep: false };
        // From here on a failure drops `tb`, which removes what was made.
        tb.build().context("building the testbed")?;
        Ok(tb)
    }

    fn build(&self) -> Result<()> {
        let sw = self.switch.as_str();
        netns::ip(&["netns", "add", sw])?;
        netns::ip(&["-n", sw, "link", "add", "br0", "type", "bridge"])?;
        netns::ip(&["-n", sw, "link", "set", "br0", "up"])?;
        let routed = self.spec.client_link_mtu.is_some();
        for n in &self.nodes {
            netns::ip(&["netns", "add", &n.netns])?;
            if routed && n.node.starts_with('c') {
                self.link_to_router(n)?;
                continue;
            }
            netns::ip(&["link", "add", "eth0", "netns", &n.netns, "type", "veth", "peer", "name", &n.bridge_port, "netns", sw])?;
            netns::ip(&["-n", sw, "link", "set", &n.bridge_port, "master", "br0", "up"])?;
            netns::ip(&["-n", &n.netns, "link", "set", "lo", "up"])?;
            netns::ip(&["-n", &n.netns, "addr", "add", &format!("{}/24", n.address), "dev", "eth0"])?;
            netns::ip(&["-n", &n.netns, "link", "set", "eth0", "up"])?;
            if n.node != "lb" {
                // veth leaves TCP checksums partial when the sender offloads
                // them, and a packet rewritten by XDP loses the "partial"
                // mark; real NICs deliver complete checksums. Hosts here
                // compute them in software, as a real wire would demand.
                netns::run(netns::in_netns(&n.netns, &["ethtool", "-K", "eth0", "tx", "off"]).stdout(Stdio::null()))?;
            }
        }
        if routed {
            let r1 = self.node("r1")?;
            netns::run(netns::in_netns(&r1.netns, &["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]).stdout(Stdio::null()))?;
            let clients = format!("10.{}.1.0/24", self.spec.subnet);
            for n in self.nodes.iter().filter(|n| n.node == "lb" || n.node.starts_with('s')) {
                netns::ip(&["-n", &n.netns, "route", "add", &clients, "via", &r1.address.to_string()])?;
            }
        }
        let lb = self.node("lb")?;
        netns::ip(&["-n", &lb.netns, "addr", "add", &format!("{}/32", self.vip), "dev", "lo"])?;
        // XDP_TX on a veth delivers into the peer only when the peer runs an
        // XDP program too (it needs the peer's NAPI ring): the balancer's
        // bridge port gets one that passes everything.
        peer::attach_pass(sw, &lb.bridge_port)?;
        Ok(())
    }

    /// A client's own link to the router: r1 sends to it with the spec's
    /// MTU, the client keeps 1500 (see `TestbedSpec`).
    fn link_to_router(&self, n: &Node) -> Result<()> {
        let r1 = self.node("r1")?;
        let mtu = self.spec.client_link_mtu.unwrap_or(1500).to_string();
        let gw = format!("10.{}.1.1", self.spec.subnet);
        netns::ip(&["link", "add", "eth0", "netns", &n.netns, "type", "veth", "peer", "name", &n.node, "netns", &r1.netns])?;
        netns::ip(&["-n", &n.netns, "link", "set", "lo", "up"])?;
        netns::ip(&["-n", &n.netns, "addr", "add", &format!("{}/24", n.address), "dev", "eth0"])?;
        netns::ip(&["-n", &n.netns, "link", "set", "eth0", "up"])?;
        netns::ip(&["-n", &n.netns, "route", "add", "default", "via", &gw])?;
        netns::run(netns::in_netns(&n.netns, &["ethtool", "-K", "eth0", "tx", "off"]).stdout(Stdio::null()))?;
        // One router address for every client link (a /32 route per client).
        netns::ip(&["-n", &r1.netns, "addr", "add", &format!("{gw}/32"), "dev", &n.node])?;
        netns::ip(&["-n", &r1.netns, "link", "set", &n.node, "mtu", &mtu, "up"])?;
        netns::ip(&["-n", &r1.netns, "route", "add", &format!("{}/32", n.address), "dev", &n.node])?;
        netns::run(netns::in_netns(&r1.netns, &["ethtool", "-K", &n.node, "tx", "off"]).stdout(Stdio::null()))?;
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

fn state_path(name: &str) -> PathBuf {
    PathBuf::from("/run/inband/testbed").join(format!("{name}.json"))
}

/// Removes every namespace of testbed `name` (and the processes in them);
/// fine if nothing exists.
pub fn teardown(name: &str) -> Result<()> {
    let prefix = format!("{name}-");
    let out = netns::ip(&["netns", "list"])?;
    let mut first_err = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let ns = line.split_whitespace().next().unwrap_or("");
        if ns.strip_prefix(&prefix).is_some_and(|rest| rest == "sw" || rest == "lb" || rest == "r1" || is_host(rest)) {
            if let Err(e) = netns::delete(ns) {
                first_err.get_or_insert(e);
            }
            // Pins outlive the namespace (bpffs is the host's); a component
            // that was killed, not stopped, left its maps there.
            let pins = crate::bpfmap::pin_root_of(ns);
            if pins.exists() {
                if let Err(e) = std::fs::remove_dir_all(&pins) {
                    first_err.get_or_insert(anyhow::anyhow!("removing {}: {e}", pins.display()));
                }
                let _ = crate::bpfmap::remove_pin_dir(&pins);
            }
        }
    }
    let _ = std::fs::remove_file(state_path(name));
    first_err.map_or(Ok(()), Err)
}

fn is_host(rest: &str) -> bool {
    let (kind, num) = rest.split_at(1);
    (kind == "c" || kind == "s") && !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit())
}

#[derive(clap::Subcommand)]
pub enum TestbedCommand {
    /// Build a testbed (replacing one of the same name) and leave it up.
    Up {
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
        TestbedCommand::Up { name, clients, servers, subnet, client_link_mtu } => {
            let tb = Testbed::up(TestbedSpec { name: name.clone(), clients, servers, subnet, client_link_mtu })?.keep();
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

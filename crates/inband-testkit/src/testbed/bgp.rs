//! BGP on the ECMP testbed (`--ecmp --balancers N --bgp`): BIRD 2 on the
//! router and on every balancer host, as a fabric would run it. Each
//! instance's BIRD announces the VIP (protocol `vip`, a static route) to
//! the router over eBGP; the router's BIRD merges the equal paths and
//! installs them into kernel table [`LEARNED_TABLE`], not the main table,
//! where `inband shadow follow` picks each change up and makes it with the
//! shadow table kept (docs/architecture.md). An instance joins with
//! `birdc -s SOCKET enable vip` and leaves with `disable vip`; a BIRD that
//! dies is withdrawn when its session's hold time (3 s) runs out.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{Context, Result};

use super::{netns, Node, Testbed};
use inband_core::command;

/// The router's kernel table for the routes BGP learns.
pub const LEARNED_TABLE: u32 = 100;
const ROUTER_AS: u32 = 65000;
const INSTANCE_AS: u32 = 65001;

/// BIRD's control socket of `node` (for `birdc -s`).
pub fn socket(tb: &Testbed, node: &str) -> PathBuf {
    file(tb, node, "ctl")
}

fn file(tb: &Testbed, node: &str, ext: &str) -> PathBuf {
    PathBuf::from("/run/inband/testbed").join(format!("{}-{node}.bird.{ext}", tb.spec.name))
}

/// The router's side of the link to `n`: its address there ends in ::1.
fn router_on(n: &Node) -> std::net::Ipv6Addr {
    let mut o = n.address6.segments();
    o[7] = 1;
    o.into()
}

fn router_conf(tb: &Testbed, balancers: &[&Node]) -> String {
    let mut c = format!(
        "log \"{}\" all;\nrouter id 10.255.0.1;\nprotocol device {{ scan time 5; }}\n\
         protocol kernel learned {{\n  ipv6 {{ import none; export all; }};\n  kernel table {LEARNED_TABLE};\n  merge paths on;\n}}\n\
         template bgp balancer_host {{\n  local as {ROUTER_AS};\n  hold time 3;\n  keepalive time 1;\n  connect retry time 1;\n  error wait time 1, 5;\n  ipv6 {{ import all; export none; }};\n}}\n",
        file(tb, "r1", "log").display()
    );
    for n in balancers {
        c += &format!("protocol bgp {} from balancer_host {{ neighbor {} as {INSTANCE_AS}; }}\n", n.node, n.address6);
    }
    c
}

fn instance_conf(tb: &Testbed, n: &Node, id: usize) -> String {
    format!(
        "log \"{}\" all;\nrouter id 10.255.1.{id};\nprotocol device {{ scan time 5; }}\n\
         protocol static vip {{\n  ipv6;\n  route {}/128 blackhole;\n}}\n\
         protocol bgp r1 {{\n  local as {INSTANCE_AS};\n  neighbor {} as {ROUTER_AS};\n  hold time 3;\n  keepalive time 1;\n  connect retry time 1;\n  error wait time 1, 5;\n  ipv6 {{ import none; export where proto = \"vip\"; }};\n}}\n",
        file(tb, &n.node, "log").display(),
        tb.vip6,
        router_on(n)
    )
}

/// Writes every BIRD config and starts BIRD in the router and in each
/// balancer host (it daemonizes; the testbed's teardown kills it with
/// the namespaces).
pub fn start(tb: &Testbed) -> Result<()> {
    let balancers: Vec<&Node> = tb.nodes.iter().filter(|n| n.node.starts_with('b')).collect();
    let mut confs = vec![("r1".to_string(), router_conf(tb, &balancers))];
    for (i, n) in balancers.iter().enumerate() {
        confs.push((n.node.clone(), instance_conf(tb, n, i + 1)));
    }
    for (node, text) in confs {
        let conf = file(tb, &node, "conf");
        std::fs::write(&conf, text).with_context(|| format!("writing {}", conf.display()))?;
        let (conf, sock, pid) = (conf.display().to_string(), socket(tb, &node).display().to_string(), file(tb, &node, "pid").display().to_string());
        command::run(netns::in_netns(&tb.netns(&node), &["bird", "-c", &conf, "-s", &sock, "-P", &pid]).stdout(Stdio::null()))
            .with_context(|| format!("starting BIRD in {node} (apt install bird2)"))?;
    }
    Ok(())
}

/// Removes what `start` wrote (the daemons die with their namespaces).
pub fn clean(name: &str) {
    let dir = PathBuf::from("/run/inband/testbed");
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if f.starts_with(&format!("{name}-")) && f.contains(".bird.") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

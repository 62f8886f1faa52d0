//! The router side: the VIP's ECMP route (SRv6 encapsulation to each
//! server's conditional SID) and the shadow table that keeps the previous
//! next-hop set (to each server's direct SID), written in that order — the
//! shadow first — so no packet ever meets a new set without the old one
//! behind it. This is what seed 002's router feature does inside the
//! router; here a command does it, through iproute2 in the router's
//! namespace (no well-kept Rust netlink library speaks seg6 encap and
//! seg6local), and the routes in the kernel are the only state: the
//! current set is read back from the main table each time.

use std::collections::HashSet;
use std::net::Ipv6Addr;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use tracing::info;

use crate::testbed::netns::ip;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    pub vip: Ipv6Addr,
    /// The routing table that holds the previous next-hop set.
    #[serde(default = "default_shadow_table")]
    pub shadow_table: u32,
    /// This router's End.DT6 SID into the shadow table: servers send strays there.
    pub shadow_sid: Ipv6Addr,
    pub server: Vec<Server>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub name: String,
    /// The conditional SID (`inband shadow attach --sid`).
    pub sid: Ipv6Addr,
    /// The plain SID (`--direct-sid`), for packets from the shadow table.
    pub direct_sid: Ipv6Addr,
    /// The server's address on the link, and the router's interface to it.
    pub via: Ipv6Addr,
    pub dev: String,
}

fn default_shadow_table() -> u32 {
    200
}

impl RouterConfig {
    pub fn load(path: &Path) -> Result<RouterConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let cfg: RouterConfig = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        cfg.check().with_context(|| format!("checking {}", path.display()))?;
        Ok(cfg)
    }

    fn check(&self) -> Result<()> {
        let mut errors = Vec::new();
        if self.server.is_empty() {
            errors.push("no [[server]]: the router needs the servers it may route the VIP to".to_string());
        }
        // 253–255 are the kernel's default, main and local tables; 0 is "unspecified".
        if matches!(self.shadow_table, 0 | 253..=255) {
            errors.push(format!("shadow_table = {}: use a table of its own (1–252 or above 255)", self.shadow_table));
        }
        let (mut names, mut sids) = (HashSet::new(), HashSet::new());
        for s in &self.server {
            if !names.insert(&s.name) {
                errors.push(format!("server {:?} twice", s.name));
            }
            for sid in [s.sid, s.direct_sid] {
                if !sids.insert(sid) || sid == self.shadow_sid {
                    errors.push(format!("SID {sid} of {:?} is used twice", s.name));
                }
            }
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }

    fn server(&self, name: &str) -> Result<&Server> {
        self.server.iter().find(|s| s.name == name).with_context(|| {
            let known: Vec<&str> = self.server.iter().map(|s| s.name.as_str()).collect();
            format!("no server {name:?} in the config (it has {})", known.join(", "))
        })
    }
}

/// Points the VIP at `up`; with `shadow`, the set it pointed at until now
/// goes to the shadow table first. Without (plain ECMP, the seed's
/// baseline), the shadow table is emptied.
pub fn apply(cfg: &RouterConfig, up: &[String], shadow: bool) -> Result<()> {
    let up: Vec<&Server> = up.iter().map(|n| cfg.server(n)).collect::<Result<_>>()?;
    prepare(cfg)?;
    let vip = cfg.vip.to_string();
    let table = cfg.shadow_table.to_string();
    let current = current_set(cfg)?;
    // Writing an unchanged set would copy it over the shadow table, and
    // the connections the previous change moved would lose their way back.
    if shadow && current.iter().map(|s| &s.name).eq(up.iter().map(|s| &s.name)) {
        info!(vip = %cfg.vip, "next hops unchanged");
        return Ok(());
    }
    if !shadow {
        remove_route(&["-6", "route", "del", &vip, "table", &table])?;
    } else if !current.is_empty() {
        // The old set, to the direct SIDs: packets chained once are
        // delivered, never chained again.
        let hops: Vec<(Ipv6Addr, &Server)> = current.iter().map(|s| (s.direct_sid, *s)).collect();
        replace_route(&vip, Some(&table), &hops).context("writing the shadow table")?;
    }
    if up.is_empty() {
        remove_route(&["-6", "route", "del", &vip])?;
    } else {
        let hops: Vec<(Ipv6Addr, &Server)> = up.iter().map(|s| (s.sid, *s)).collect();
        replace_route(&vip, None, &hops).context("writing the VIP's route")?;
    }
    let names = |v: &[&Server]| v.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(",");
    info!(vip = %cfg.vip, from = names(&current), to = names(&up), shadow, "next hops changed");
    Ok(())
}

/// What the router needs whatever the set: forwarding, SRv6 accepted on
/// the next hops' links (strays come back on them), a multipath hash of
/// the 5-tuple read from the headers, and its SID into the shadow table.
///
/// The hash must be a function of the packet's 5-tuple alone, so that a
/// stray looked up again in the shadow table picks the next hop the old
/// route picked. The default (policy 0) hashes addresses only: every
/// connection of a client would go to one next hop. Policy 1 (L4) takes
/// a hash the packet already carries when there is one (skb->l4_hash):
/// over a veth that is the sending socket's random txhash, which a stray
/// re-sent by XDP no longer has, so the shadow lookup would pick another
/// next hop. Policy 3 with the five fields always reads the headers.
fn prepare(cfg: &RouterConfig) -> Result<()> {
    let mut sysctls = vec![
        ("net/ipv6/conf/all/forwarding".to_string(), "1"),
        ("net/ipv6/conf/all/seg6_enabled".to_string(), "1"),
        ("net/ipv6/fib_multipath_hash_policy".to_string(), "3"),
        // Source and destination address, protocol, source and destination port.
        ("net/ipv6/fib_multipath_hash_fields".to_string(), "0x0037"),
    ];
    for s in &cfg.server {
        sysctls.push((format!("net/ipv6/conf/{}/seg6_enabled", s.dev), "1"));
    }
    for (key, value) in sysctls {
        let path = format!("/proc/sys/{key}");
        std::fs::write(&path, value).with_context(|| format!("writing {path}"))?;
    }
    ip(&[
        "-6",
        "route",
        "replace",
        &cfg.shadow_sid.to_string(),
        "encap",
        "seg6local",
        "action",
        "End.DT6",
        "table",
        &cfg.shadow_table.to_string(),
        "dev",
        &cfg.server[0].dev,
    ])
    .context("installing the shadow SID (End.DT6 into the shadow table)")?;
    Ok(())
}

/// The servers the VIP's route in the main table goes to now, found by
/// their conditional SIDs.
fn current_set(cfg: &RouterConfig) -> Result<Vec<&Server>> {
    let out = ip(&["-6", "-j", "route", "show", &format!("{}/128", cfg.vip)])?;
    let routes: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).context("reading `ip -j route` output")?;
    let Some(route) = routes.first() else { return Ok(Vec::new()) };
    // One next hop is printed flat, several under "nexthops".
    let hops = match route["nexthops"].as_array() {
        Some(h) => h.clone(),
        None => vec![route.clone()],
    };
    hops.iter()
        .map(|h| {
            let seg = h["segs"][0].as_str().unwrap_or_default();
            cfg.server.iter().find(|s| s.sid.to_string() == seg).with_context(|| {
                format!("the VIP's route goes to {seg:?}, which is no server's SID in the config: fix the route or the config")
            })
        })
        .collect()
}

fn replace_route(vip: &str, table: Option<&str>, hops: &[(Ipv6Addr, &Server)]) -> Result<()> {
    let mut args: Vec<String> = ["-6", "route", "replace", vip].iter().map(|s| s.to_string()).collect();
    if let Some(t) = table {
        args.extend(["table".to_string(), t.to_string()]);
    }
    for (sid, s) in hops {
        args.extend(
            ["nexthop", "encap", "seg6", "mode", "encap", "segs", &sid.to_string(), "via", &s.via.to_string(), "dev", &s.dev]
                .map(String::from),
        );
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ip(&args).map(|_| ())
}

fn remove_route(args: &[&str]) -> Result<()> {
    match ip(args) {
        Ok(_) => Ok(()),
        // No such route, or the shadow table never had one.
        Err(e) if ["No such process", "FIB table does not exist"].iter().any(|m| format!("{e:#}").contains(m)) => Ok(()),
        Err(e) => Err(e),
    }
}

//! The router side: the VIP's ECMP route (SRv6 encapsulation to each
//! server's conditional SID) and the shadow tables that keep the earlier
//! next-hop sets (the oldest to each server's direct SID), written from
//! the oldest to the VIP's route, so no packet ever meets a set without
//! the older ones behind it. This is what seed 002's router feature does inside the
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
    /// The routing table that holds the previous next-hop set (the first
    /// generation); generation k's is `shadow_table + k − 1`.
    #[serde(default = "default_shadow_table")]
    pub shadow_table: u32,
    /// This router's End.DT6 SID into the first shadow table: servers send
    /// strays there. Generation k's is this one with k − 1 added to its
    /// last 16 bits (bpf/include/inband/shadow_generations.h).
    pub shadow_sid: Ipv6Addr,
    /// How many earlier next-hop sets are kept (1 to 8): a connection
    /// survives this many changes of the set while it lasts.
    #[serde(default = "default_generations")]
    pub generations: u32,
    pub server: Vec<Server>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub name: String,
    /// The conditional SID (`inband shadow attach --sid`).
    pub sid: Ipv6Addr,
    /// The plain SID (`--direct-sid`), for packets from the oldest shadow table.
    pub direct_sid: Ipv6Addr,
    /// The server's address on the link, and the router's interface to it.
    pub via: Ipv6Addr,
    pub dev: String,
}

fn default_shadow_table() -> u32 {
    200
}

fn default_generations() -> u32 {
    1
}

/// bpf/include/inband/shadow_generations.h's INBAND_SHADOW_GENERATIONS:
/// the programs accept no later generation's SID.
pub const MAX_GENERATIONS: u32 = 8;

/// Generation `k`'s SID (from 0) for the first one's: `k` added to its
/// last 16 bits, wrapping, as inband_shadow_sid() computes it.
pub fn generation_sid(first: Ipv6Addr, k: u32) -> Ipv6Addr {
    let mut s = first.segments();
    s[7] = s[7].wrapping_add(k as u16);
    Ipv6Addr::from(s)
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
        if !(1..=MAX_GENERATIONS).contains(&self.generations) {
            errors.push(format!("generations = {}: keep 1 to {MAX_GENERATIONS} earlier next-hop sets", self.generations));
        }
        // 253–255 are the kernel's default, main and local tables; 0 is "unspecified".
        let reserved = |t: u32| matches!(t, 0 | 253..=255);
        if (0..self.generations).any(|k| self.shadow_table.checked_add(k).is_none_or(reserved)) {
            errors.push(format!(
                "shadow_table = {} with generations = {}: the tables {}–{} must all be tables of their own (1–252 or above 255)",
                self.shadow_table,
                self.generations,
                self.shadow_table,
                self.shadow_table.saturating_add(self.generations.max(1) - 1)
            ));
        }
        let (mut names, mut sids) = (HashSet::new(), HashSet::new());
        for s in &self.server {
            if !names.insert(&s.name) {
                errors.push(format!("server {:?} twice", s.name));
            }
            for sid in [s.sid, s.direct_sid] {
                if !sids.insert(sid) || (0..self.generations).any(|k| self.generation(k).1 == sid) {
                    errors.push(format!("SID {sid} of {:?} is used twice (the router's shadow SIDs count)", s.name));
                }
            }
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }

    /// Generation `k`'s table and SID (from 0: the set before the last change).
    pub fn generation(&self, k: u32) -> (u32, Ipv6Addr) {
        (self.shadow_table + k, generation_sid(self.shadow_sid, k))
    }

    fn server(&self, name: &str) -> Result<&Server> {
        self.server.iter().find(|s| s.name == name).with_context(|| {
            let known: Vec<&str> = self.server.iter().map(|s| s.name.as_str()).collect();
            format!("no server {name:?} in the config (it has {})", known.join(", "))
        })
    }
}

/// Points the VIP at `up`; with `shadow`, every set kept so far moves one
/// generation older (the oldest is forgotten) and the one it pointed at
/// until now becomes the first generation. Without (plain ECMP, the
/// seed's baseline), the shadow tables are emptied.
pub fn apply(cfg: &RouterConfig, up: &[String], shadow: bool) -> Result<()> {
    let up: Vec<&Server> = up.iter().map(|n| cfg.server(n)).collect::<Result<_>>()?;
    prepare(cfg)?;
    let vip = cfg.vip.to_string();
    let current = set_in(cfg, None)?;
    // Writing an unchanged set would shift every generation, and the
    // connections the previous change moved would lose their way back.
    if shadow && current.iter().map(|s| &s.name).eq(up.iter().map(|s| &s.name)) {
        info!(vip = %cfg.vip, "next hops unchanged");
        return Ok(());
    }
    if !shadow {
        for k in 0..MAX_GENERATIONS {
            remove_route(&["-6", "route", "del", &vip, "table", &cfg.generation(k).0.to_string()])?;
        }
    } else {
        // Generation k + 1 gets generation k's set; read them all before
        // writing any. From the oldest, so each is in place before the
        // one that chains to it.
        let mut older = vec![current.clone()];
        for k in 0..cfg.generations - 1 {
            older.push(set_in(cfg, Some(cfg.generation(k).0))?);
        }
        for (k, set) in older.iter().enumerate().rev() {
            let table = cfg.generation(k as u32).0.to_string();
            if set.is_empty() {
                remove_route(&["-6", "route", "del", &vip, "table", &table])?;
            } else {
                replace_route(&vip, Some(&table), &hops(cfg, set, Some(k as u32)))
                    .with_context(|| format!("writing shadow generation {} (table {table})", k + 1))?;
            }
        }
    }
    if up.is_empty() {
        remove_route(&["-6", "route", "del", &vip])?;
    } else {
        replace_route(&vip, None, &hops(cfg, &up, None)).context("writing the VIP's route")?;
    }
    let names = |v: &[&Server]| v.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(",");
    info!(vip = %cfg.vip, from = names(&current), to = names(&up), shadow, generations = cfg.generations, "next hops changed");
    Ok(())
}

/// The segments to each server of `set` in the VIP's route (`generation`
/// None) or in shadow generation k's table: its conditional SID, where a
/// stray goes on to the first shadow SID; in a generation with an older
/// one behind it, its conditional SID and then that generation's SID
/// (the program sends a stray to the second segment); in the oldest, its
/// direct SID, never chained again.
fn hops<'a>(cfg: &RouterConfig, set: &[&'a Server], generation: Option<u32>) -> Vec<(Vec<Ipv6Addr>, &'a Server)> {
    set.iter()
        .map(|s| {
            let segs = match generation {
                None => vec![s.sid],
                Some(k) if k + 1 < cfg.generations => vec![s.sid, cfg.generation(k + 1).1],
                Some(_) => vec![s.direct_sid],
            };
            (segs, *s)
        })
        .collect()
}

/// What the router needs whatever the set: forwarding, SRv6 accepted on
/// the next hops' links (strays come back on them), a multipath hash of
/// the 5-tuple read from the headers, and its SIDs into the shadow tables.
///
/// The hash must be a function of the packet's 5-tuple alone, so that a
/// stray looked up again in a shadow table picks the next hop the old
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
    for k in 0..cfg.generations {
        let (table, sid) = cfg.generation(k);
        ip(&[
            "-6",
            "route",
            "replace",
            &sid.to_string(),
            "encap",
            "seg6local",
            "action",
            "End.DT6",
            "table",
            &table.to_string(),
            "dev",
            &cfg.server[0].dev,
        ])
        .with_context(|| format!("installing shadow SID {sid} (End.DT6 into table {table})"))?;
    }
    Ok(())
}

/// The servers the VIP's route in `table` (None: the main table) goes to
/// now, found by the first segment (a conditional or a direct SID).
fn set_in(cfg: &RouterConfig, table: Option<u32>) -> Result<Vec<&Server>> {
    let mut args = vec!["-6".to_string(), "-j".into(), "route".into(), "show".into(), format!("{}/128", cfg.vip)];
    if let Some(t) = table {
        args.extend(["table".into(), t.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = match ip(&args) {
        Ok(out) => out,
        // The kernel makes a table with its first route.
        Err(e) if format!("{e:#}").contains("table does not exist") => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let routes: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).context("reading `ip -j route` output")?;
    let Some(route) = routes.first() else { return Ok(Vec::new()) };
    // One next hop is printed flat, several under "nexthops".
    let hops = match route["nexthops"].as_array() {
        Some(h) => h.clone(),
        None => vec![route.clone()],
    };
    let place = table.map_or("the VIP's route".to_string(), |t| format!("table {t}"));
    hops.iter()
        .map(|h| {
            let seg = h["segs"][0].as_str().unwrap_or_default();
            cfg.server.iter().find(|s| s.sid.to_string() == seg || s.direct_sid.to_string() == seg).with_context(|| {
                format!("{place} goes to {seg:?}, which is no server's SID in the config: fix the route or the config")
            })
        })
        .collect()
}

fn replace_route(vip: &str, table: Option<&str>, hops: &[(Vec<Ipv6Addr>, &Server)]) -> Result<()> {
    let mut args: Vec<String> = ["-6", "route", "replace", vip].iter().map(|s| s.to_string()).collect();
    if let Some(t) = table {
        args.extend(["table".to_string(), t.to_string()]);
    }
    for (segs, s) in hops {
        let segs = segs.iter().map(Ipv6Addr::to_string).collect::<Vec<_>>().join(",");
        args.extend(["nexthop", "encap", "seg6", "mode", "encap", "segs", &segs, "via", &s.via.to_string(), "dev", &s.dev].map(String::from));
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

//! The router side: the VIP's ECMP route (SRv6 encapsulation to each
//! server's conditional SID) and the shadow tables that keep the earlier
//! next-hop sets (the oldest to each server's direct SID), written from
//! the oldest to the VIP's route, so no packet ever meets a set without
//! the older ones behind it. This is what seed 002's router feature does inside the
//! router; here a command does it, through iproute2 in the router's
//! namespace (no well-kept Rust netlink library speaks seg6 encap and
//! seg6local), and the routes in the kernel are the only state: the
//! current set is read back from the main table each time.
//!
//! Every table's route points at a nexthop group, and a change replaces
//! the group. Replacing an IPv6 multipath route itself is not one
//! change: the kernel puts its next hops in one at a time
//! (ip6_route_multipath_add), and packets forwarded meanwhile meet a set
//! of one, then two, … A connection opened in that window finds another
//! next hop on its next packet, and neither the new set's owner nor the
//! shadow table's knows it (bench.scaleout lost such downloads under CPU
//! load). A group is swapped whole.

use std::collections::HashSet;
use std::net::Ipv6Addr;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use tracing::info;

use inband_core::command::ip;

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
    /// The first of the 4,096 nexthop object ids this VIP's routes use;
    /// by default chosen by a hash of the VIP, so VIPs on one router
    /// do not meet. Set it if `route` reports a collision.
    pub nexthop_ids: Option<u32>,
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

/// The nexthop object ids of one VIP: its group in each table at
/// `first + (kind << 8)`, server i's hop in that table's group at
/// `+ 1 + i` (kind 0 the VIP's route, k + 1 generation k).
const NEXTHOP_BLOCK: u32 = 4096;
const MAX_SERVERS: usize = 255;

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
        if self.server.len() > MAX_SERVERS {
            errors.push(format!("{} [[server]]s: at most {MAX_SERVERS} (each table's group has an id block of 256)", self.server.len()));
        }
        if let Some(first) = self.nexthop_ids {
            if first == 0 || first.checked_add(NEXTHOP_BLOCK - 1).is_none() {
                errors.push(format!("nexthop_ids = {first}: the block of {NEXTHOP_BLOCK} ids must start above 0 and end below 2^32"));
            }
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

    fn first_nexthop_id(&self) -> u32 {
        self.nexthop_ids.unwrap_or_else(|| {
            // FNV-1a of the VIP's bytes, folded to 16 bits: 65,536 blocks from 0x4000_0000.
            let h = self.vip.octets().iter().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
            0x4000_0000 | (((h >> 16) ^ (h & 0xffff)) << 12)
        })
    }

    fn group_id(&self, generation: Option<u32>) -> u32 {
        self.first_nexthop_id() + (generation.map_or(0, |k| k + 1) << 8)
    }

    fn hop_id(&self, generation: Option<u32>, server: usize) -> u32 {
        self.group_id(generation) + 1 + server as u32
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
    let objects = prepare(cfg)?;
    let current = set_in(cfg, None)?;
    // Writing an unchanged set would shift every generation, and the
    // connections the previous change moved would lose their way back.
    if shadow && current.iter().map(|s| &s.name).eq(up.iter().map(|s| &s.name)) {
        info!(vip = %cfg.vip, "next hops unchanged");
        return Ok(());
    }
    if !shadow {
        for k in 0..MAX_GENERATIONS {
            remove_set(cfg, Some(k), &objects)?;
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
                remove_set(cfg, Some(k as u32), &objects)?;
            } else {
                write_set(cfg, Some(k as u32), set).with_context(|| format!("writing shadow generation {} (table {table})", k + 1))?;
            }
        }
    }
    if up.is_empty() {
        remove_set(cfg, None, &objects)?;
    } else {
        write_set(cfg, None, &up).context("writing the VIP's route")?;
    }
    let names = |v: &[&Server]| v.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(",");
    info!(vip = %cfg.vip, from = names(&current), to = names(&up), shadow, generations = cfg.generations, "next hops changed");
    Ok(())
}

/// The segments to `s` in the VIP's route (`generation` None) or in
/// shadow generation k's table: its conditional SID, where a stray goes
/// on to the first shadow SID; in a generation with an older one behind
/// it, its conditional SID and then that generation's SID (the program
/// sends a stray to the second segment); in the oldest, its direct SID,
/// never chained again.
fn segs(cfg: &RouterConfig, s: &Server, generation: Option<u32>) -> Vec<Ipv6Addr> {
    match generation {
        None => vec![s.sid],
        Some(k) if k + 1 < cfg.generations => vec![s.sid, cfg.generation(k + 1).1],
        Some(_) => vec![s.direct_sid],
    }
}

/// Every server's hop in every table's group, as a nexthop object:
/// made when missing, rewritten when the config changed it. An object
/// in this VIP's id block that goes to no SID of this config belongs to
/// someone else: refused, not overwritten. Returns the ids there are.
fn ensure_hops(cfg: &RouterConfig) -> Result<HashSet<u32>> {
    let out = ip(&["-j", "nexthop", "show"]).context("listing nexthop objects (the kernel needs CONFIG_IPV6 nexthop support, 5.3 or later)")?;
    let existing: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).context("reading `ip -j nexthop show` output")?;
    let ours: HashSet<String> =
        cfg.server.iter().flat_map(|s| [s.sid, s.direct_sid]).chain((0..MAX_GENERATIONS).map(|k| cfg.generation(k).1)).map(|a| a.to_string()).collect();
    let mut ids: HashSet<u32> = existing.iter().filter_map(|o| u32::try_from(o["id"].as_u64()?).ok()).collect();
    let first = cfg.first_nexthop_id();
    let block = first..first + NEXTHOP_BLOCK;
    let foreign = |o: &serde_json::Value| {
        anyhow!(
            "nexthop object {} is someone else's ({o}): this VIP's ids ({}–{}) collide with it; set nexthop_ids to a free block",
            o["id"],
            block.start,
            block.end - 1
        )
    };
    // A group at one of this VIP's group ids must hold only hops of the block.
    for generation in std::iter::once(None).chain((0..MAX_GENERATIONS).map(Some)) {
        let id = u64::from(cfg.group_id(generation));
        if let Some(o) = existing.iter().find(|o| o["id"].as_u64() == Some(id)) {
            let members = o["group"].as_array().map(|g| g.iter().map(|m| m["id"].as_u64().unwrap_or(0)).collect::<Vec<_>>());
            if !members.is_some_and(|m| m.iter().all(|id| block.contains(&(*id as u32)))) {
                return Err(foreign(o));
            }
        }
    }
    for generation in std::iter::once(None).chain((0..cfg.generations).map(Some)) {
        for (i, s) in cfg.server.iter().enumerate() {
            let id = cfg.hop_id(generation, i);
            let want: Vec<String> = segs(cfg, s, generation).iter().map(Ipv6Addr::to_string).collect();
            let found = existing.iter().find(|o| o["id"].as_u64() == Some(u64::from(id)));
            let verb = match found {
                None => "add",
                Some(o) => {
                    let have: Vec<&str> = o["segs"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
                    if have == want.iter().map(String::as_str).collect::<Vec<_>>()
                        && o["gateway"].as_str() == Some(&s.via.to_string())
                        && o["dev"].as_str() == Some(&s.dev)
                    {
                        continue;
                    }
                    if have.is_empty() || !have.iter().all(|h| ours.contains(*h)) {
                        return Err(foreign(o));
                    }
                    "replace"
                }
            };
            ids.insert(id);
            let (id, segs) = (id.to_string(), want.join(","));
            ip(&["nexthop", verb, "id", &id, "encap", "seg6", "mode", "encap", "segs", &segs, "via", &s.via.to_string(), "dev", &s.dev])
                .with_context(|| format!("writing nexthop object {id} (server {:?})", s.name))?;
        }
    }
    Ok(ids)
}

/// What the router needs whatever the set: forwarding, SRv6 accepted on
/// the next hops' links (strays come back on them), a multipath hash of
/// the 5-tuple read from the headers, its SIDs into the shadow tables,
/// and the next hops' nexthop objects (whose ids it returns).
///
/// The hash must be a function of the packet's 5-tuple alone, so that a
/// stray looked up again in a shadow table picks the next hop the old
/// route picked. The default (policy 0) hashes addresses only: every
/// connection of a client would go to one next hop. Policy 1 (L4) takes
/// a hash the packet already carries when there is one (skb->l4_hash):
/// over a veth that is the sending socket's random txhash, which a stray
/// re-sent by XDP no longer has, so the shadow lookup would pick another
/// next hop. Policy 3 with the five fields always reads the headers.
fn prepare(cfg: &RouterConfig) -> Result<HashSet<u32>> {
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
    let objects = ensure_hops(cfg)?;
    for k in 0..cfg.generations {
        let (table, sid) = cfg.generation(k);
        ip(&["-6", "route", "replace", &sid.to_string(), "encap", "seg6local", "action", "End.DT6", "table", &table.to_string(), "dev", &cfg.server[0].dev])
            .with_context(|| format!("installing shadow SID {sid} (End.DT6 into table {table})"))?;
    }
    Ok(objects)
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
    let Some(route) = routes.first() else {
        return Ok(Vec::new());
    };
    // One next hop is printed flat, several under "nexthops".
    let hops = match route["nexthops"].as_array() {
        Some(h) => h.clone(),
        None => vec![route.clone()],
    };
    let place = table.map_or("the VIP's route".to_string(), |t| format!("table {t}"));
    hops.iter()
        .map(|h| {
            let seg = h["segs"][0].as_str().unwrap_or_default();
            cfg.server
                .iter()
                .find(|s| s.sid.to_string() == seg || s.direct_sid.to_string() == seg)
                .with_context(|| format!("{place} goes to {seg:?}, which is no server's SID in the config: fix the route or the config"))
        })
        .collect()
}

/// Points the VIP's route in the main table (`generation` None) or in
/// generation k's table at `set`: its group is replaced in one step, then
/// the route is pointed at the group (a no-op once it is; the first time
/// it also replaces a route written as a multipath route).
fn write_set(cfg: &RouterConfig, generation: Option<u32>, set: &[&Server]) -> Result<()> {
    let members: Vec<String> = set
        .iter()
        .map(|s| {
            let i = cfg.server.iter().position(|c| c.name == s.name).expect("set holds the config's servers");
            cfg.hop_id(generation, i).to_string()
        })
        .collect();
    let group = cfg.group_id(generation).to_string();
    ip(&["nexthop", "replace", "id", &group, "group", &members.join("/")])?;
    let vip = cfg.vip.to_string();
    let mut args = vec!["-6", "route", "replace", &vip];
    let table = generation.map(|k| cfg.generation(k).0.to_string());
    if let Some(t) = &table {
        args.extend(["table", t]);
    }
    args.extend(["nhid", &group]);
    ip(&args).map(|_| ())
}

/// Removes the VIP's route from the main table (`generation` None) or
/// generation k's, then that table's group and hops of `objects` (the
/// next change that needs them makes them again).
fn remove_set(cfg: &RouterConfig, generation: Option<u32>, objects: &HashSet<u32>) -> Result<()> {
    let vip = cfg.vip.to_string();
    let table = generation.map(|k| cfg.generation(k).0.to_string());
    let mut args = vec!["-6", "route", "del", &vip];
    if let Some(t) = &table {
        args.extend(["table", t]);
    }
    remove_route(&args)?;
    let ids = std::iter::once(cfg.group_id(generation)).chain((0..cfg.server.len()).map(|i| cfg.hop_id(generation, i)));
    for id in ids.filter(|id| objects.contains(id)) {
        ip(&["nexthop", "del", "id", &id.to_string()]).with_context(|| format!("removing nexthop object {id}"))?;
    }
    Ok(())
}

fn remove_route(args: &[&str]) -> Result<()> {
    match ip(args) {
        Ok(_) => Ok(()),
        // No such route, or the shadow table never had one.
        Err(e) if ["No such process", "FIB table does not exist"].iter().any(|m| format!("{e:#}").contains(m)) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str, servers: usize) -> String {
        let mut text = format!("vip = \"fd00:81::100\"\nshadow_sid = \"fd00:81:5f::5\"\ngenerations = 8\n{extra}\n");
        for i in 0..servers {
            text += &format!(
                "[[server]]\nname = \"s{i}\"\nsid = \"fd00:82:{i:x}::b\"\ndirect_sid = \"fd00:82:{i:x}::d\"\nvia = \"fd00:81:{i:x}::2\"\ndev = \"s{i}\"\n"
            );
        }
        text
    }

    fn parse(text: &str) -> Result<RouterConfig> {
        let cfg: RouterConfig = toml::from_str(text)?;
        cfg.check()?;
        Ok(cfg)
    }

    #[test]
    fn every_table_and_hop_has_its_own_id_inside_the_vips_block() {
        let cfg = parse(&config("", MAX_SERVERS)).unwrap();
        let first = cfg.first_nexthop_id();
        let mut ids = HashSet::new();
        for generation in std::iter::once(None).chain((0..cfg.generations).map(Some)) {
            assert!(ids.insert(cfg.group_id(generation)));
            for i in 0..cfg.server.len() {
                assert!(ids.insert(cfg.hop_id(generation, i)));
            }
        }
        assert!(ids.iter().all(|id| (first..first + NEXTHOP_BLOCK).contains(id)), "{first}");
        let other = parse(&config("", 1).replace("fd00:81::100", "fd00:81::101")).unwrap();
        assert_ne!(other.first_nexthop_id(), first, "two VIPs, one block");
        assert_eq!(parse(&config("nexthop_ids = 7000", 1)).unwrap().group_id(Some(1)), 7000 + 2 * 256);
    }

    #[test]
    fn id_blocks_and_server_counts_that_do_not_fit_are_refused() {
        for (extra, servers, needle) in
            [("nexthop_ids = 0", 1, "nexthop_ids = 0"), ("nexthop_ids = 4294967000", 1, "below 2^32"), ("", MAX_SERVERS + 1, "at most 255")]
        {
            let err = format!("{:#}", parse(&config(extra, servers)).unwrap_err());
            assert!(err.contains(needle), "{err}");
        }
    }
}

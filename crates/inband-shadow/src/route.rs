//! The router side: the VIP's ECMP route (SRv6 encapsulation to each
//! server's conditional SID) and the shadow tables that keep the earlier
//! next-hop sets (the oldest to each server's direct SID), written from
//! the oldest to the VIP's route, so no packet ever meets a set without
//! the older ones behind it. This is what seed 002's router feature does inside the
//! router; here a command does it, through iproute2 in the router's
//! namespace (no well-kept Rust netlink library speaks seg6 encap and
//! seg6local), and the kernel's objects are the only state: the current
//! set is read back from the main table's group each time.
//!
//! Every table's route points at a nexthop group, and a change replaces
//! the group. Replacing an IPv6 multipath route itself is not one
//! change: the kernel puts its next hops in one at a time
//! (ip6_route_multipath_add), and packets forwarded meanwhile meet a set
//! of one, then two, … A connection opened in that window finds another
//! next hop on its next packet, and neither the new set's owner nor the
//! shadow table's knows it (bench.scaleout lost such downloads under CPU
//! load). A group is swapped whole.
//!
//! Every hop object and shadow SID sits on the `anchor` interface, not on
//! the link to its server. The seg6 encapsulation routes the packet again
//! by its new outer destination (the SID's route decides the link), so
//! the device a hop names only has to stay up. On the server's own link,
//! the kernel would delete the hop from every group the moment that link
//! lost carrier or went away: every group, the shadow ones included,
//! would shrink at once and move the surviving servers' connections, and
//! no hop could be written on that link again until it came back.
//!
//! A server that is not in the new set and whose link is down or gone is
//! dead: it keeps its place in every shadow group (so no other member's
//! share of the hash moves), but its hops there are rewritten in place to
//! a live server's direct SID, the only place its connections could still
//! be served. Its own segments come back when its link does.
//!
//! An IPv4 VIP's hops are the same seg6 encapsulations in IPv4 nexthop
//! objects (IPv4 in IPv6 to the same SIDs). Its strays come back as IPv4
//! in IPv6 to the shadow SIDs, which the kernel could unwrap into a table
//! only through End.DT4 and a VRF device this kernel lacks: the tc program
//! of [`crate::dt4`] on each next hop's link does it instead, and a
//! `fwmark` rule per generation picks the table.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use ipnet::Ipv6Net;
use serde::Deserialize;
use tracing::{info, warn};

use inband_core::command::ip;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// IPv6, or IPv4 (carried to the next hops as IPv4 in IPv6).
    pub vip: IpAddr,
    /// The interface every nexthop object and shadow SID is put on: one
    /// that never goes down (a dummy, or a veth pair with both ends up).
    /// Empty to the parser when absent, so that check() gives the reason.
    #[serde(default)]
    pub anchor: String,
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
    /// IPv4 VIPs: generation k's unwrapped strays carry this mark with
    /// its table number in the low 16 bits, which a `fwmark` rule sends
    /// to that table. Change it if the router's other software uses marks.
    #[serde(default = "default_ipv4_mark")]
    pub ipv4_mark: u32,
    /// How a server outside the set is found dead: "link" (its link has no
    /// carrier or is gone), or "echo" (also: no answer to one ICMPv6 echo
    /// at its direct SID within a second, which `inband lb` instances'
    /// programs answer themselves, so a live host whose program is gone
    /// counts as dead). Servers of seed 002's `shadow` program do not
    /// answer there: keep "link" for them.
    #[serde(default)]
    pub liveness: Liveness,
    /// The `fleet_prefix` of instances running `[scale_out] fleet = true`
    /// (a /96): routed nowhere here (`unreachable`), so that what a
    /// backend sends to a fleet address without its agent steering it is
    /// answered "no route" at the router instead of following a default
    /// route out of the site.
    pub fleet_prefix: Option<Ipv6Net>,
    pub server: Vec<Server>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    #[default]
    Link,
    Echo,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub name: String,
    /// The conditional SID (`inband shadow attach --sid`).
    pub sid: Ipv6Addr,
    /// The plain SID (`--direct-sid`), for packets from the oldest shadow table.
    pub direct_sid: Ipv6Addr,
    /// The server's address on the link (what `follow` matches learned
    /// next hops by), and the router's interface to it (whose carrier
    /// says whether the server is alive).
    pub via: Ipv6Addr,
    pub dev: String,
}

fn default_shadow_table() -> u32 {
    200
}

fn default_generations() -> u32 {
    1
}

fn default_ipv4_mark() -> u32 {
    0x1b5e_0000
}

const ANCHOR_WHY: &str = "every nexthop and shadow SID is put on it, and it must stay up: use a dummy interface \
(`ip link add inb0 type dummy`) or, where there is no dummy driver, a veth pair with both ends up";

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
        let a = &self.anchor;
        if a.is_empty() {
            errors.push(format!("anchor missing: {ANCHOR_WHY}"));
        } else if a.len() >= 16 || a.contains(['/', ' ']) {
            errors.push(format!("anchor = {a:?}: not an interface name"));
        }
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
        if self.vip.is_ipv4() && self.ipv4_mark & 0xffff != 0 {
            errors.push(format!("ipv4_mark = {:#x}: its low 16 bits must be 0 (they hold the table number)", self.ipv4_mark));
        }
        if self.vip.is_ipv4() && self.shadow_table.saturating_add(self.generations.saturating_sub(1)) > 0xffff {
            errors.push(format!(
                "shadow_table = {} with generations = {}: an IPv4 VIP's shadow tables must be below 65536 (the table is in the mark)",
                self.shadow_table, self.generations
            ));
        }
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
        if let Some(p) = self.fleet_prefix {
            if p.prefix_len() != 96 || p.network() != p.addr() {
                errors.push(format!("fleet_prefix = {p}: not a /96 starting at its first address: write the instances' `fleet_prefix` as they have it"));
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

    /// Generation `k`'s mark (IPv4 VIPs): `ipv4_mark` with its table.
    pub fn mark(&self, k: u32) -> u32 {
        self.ipv4_mark | self.generation(k).0
    }

    /// The `ip` option of the VIP's family.
    pub fn family(&self) -> &'static str {
        if self.vip.is_ipv4() {
            "-4"
        } else {
            "-6"
        }
    }

    /// The VIP as a host route's destination.
    pub fn vip_prefix(&self) -> String {
        format!("{}/{}", self.vip, if self.vip.is_ipv4() { 32 } else { 128 })
    }

    fn first_nexthop_id(&self) -> u32 {
        self.nexthop_ids.unwrap_or_else(|| {
            let bytes = match self.vip {
                IpAddr::V4(a) => a.octets().to_vec(),
                IpAddr::V6(a) => a.octets().to_vec(),
            };
            // FNV-1a of the VIP's bytes, folded to 16 bits: 65,536 blocks from 0x4000_0000.
            let h = bytes.iter().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
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
/// seed's baseline), the shadow tables are emptied. `dead` names servers
/// to treat as dead whatever their link says (a host whose link stays up
/// after it died). Every run rewrites the dead servers' shadow hops, even
/// when the set is unchanged. Returns the servers it found dead.
pub fn apply(cfg: &RouterConfig, up: &[String], shadow: bool, dead: &[String]) -> Result<BTreeSet<String>> {
    let up: Vec<&Server> = up.iter().map(|n| cfg.server(n)).collect::<Result<_>>()?;
    for d in dead {
        cfg.server(d)?;
        if up.iter().any(|s| s.name == *d) {
            bail!("{d:?} is both in --up and --dead");
        }
    }
    let (objects, dead) = prepare(cfg, &up, dead)?;
    let current = set_in(cfg, None)?;
    // Writing an unchanged set would shift every generation, and the
    // connections the previous change moved would lose their way back.
    if shadow && current.iter().map(|s| &s.name).eq(up.iter().map(|s| &s.name)) {
        info!(vip = %cfg.vip, "next hops unchanged");
        return Ok(dead);
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
            older.push(set_in(cfg, Some(k))?);
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
    Ok(dead)
}

/// The servers that are dead with `up` (names) as the VIP's set, by their
/// links (and echoes, with `liveness = "echo"`): what `follow` compares
/// between changes.
pub fn dead(cfg: &RouterConfig, up: &[String]) -> Result<BTreeSet<String>> {
    let up: Vec<&Server> = up.iter().map(|n| cfg.server(n)).collect::<Result<_>>()?;
    Ok(dead_servers(cfg, &up, &[], &links()?, &echo))
}

/// The router's interfaces and their flags (`UP`, `LOWER_UP` = carrier).
pub type Links = BTreeMap<String, Vec<String>>;

fn links() -> Result<Links> {
    let out = ip(&["-j", "link", "show"]).context("listing the router's interfaces")?;
    parse_links(&out.stdout)
}

fn parse_links(json: &[u8]) -> Result<Links> {
    let all: Vec<serde_json::Value> = serde_json::from_slice(json).context("reading `ip -j link show` output")?;
    Ok(all
        .iter()
        .filter_map(|l| {
            let flags = l["flags"].as_array()?.iter().filter_map(|f| Some(f.as_str()?.to_string())).collect();
            Some((l["ifname"].as_str()?.to_string(), flags))
        })
        .collect())
}

fn has(links: &Links, dev: &str, flag: &str) -> bool {
    links.get(dev).is_some_and(|f| f.iter().any(|x| x == flag))
}

/// Refuses an anchor that is missing, down or without carrier: the
/// kernel would refuse a hop on it, or flush the ones there.
fn check_anchor(anchor: &str, links: &Links) -> Result<()> {
    if !links.contains_key(anchor) {
        bail!("anchor = {anchor:?}: no such interface: {ANCHOR_WHY}");
    }
    if !has(links, anchor, "UP") || !has(links, anchor, "LOWER_UP") {
        bail!("anchor = {anchor:?} is down (flags {}): {ANCHOR_WHY}", links[anchor].join(","));
    }
    Ok(())
}

/// The servers outside `up` that are dead: named in `forced`, or whose
/// link to the router is down or gone, or (`liveness = "echo"`) that do
/// not `answer` at their direct SID. A server in `up` counts as alive:
/// whoever put it there (BGP, the operator) says so.
fn dead_servers(cfg: &RouterConfig, up: &[&Server], forced: &[String], links: &Links, answers: &dyn Fn(&Server) -> bool) -> BTreeSet<String> {
    cfg.server
        .iter()
        .filter(|s| !up.iter().any(|u| u.name == s.name))
        .filter(|s| forced.contains(&s.name) || !has(links, &s.dev, "LOWER_UP") || (cfg.liveness == Liveness::Echo && !answers(s)))
        .map(|s| s.name.clone())
        .collect()
}

/// One ICMPv6 echo to the server's direct SID, answered within a second:
/// an `inband lb` instance's program answers it itself.
fn echo(s: &Server) -> bool {
    std::process::Command::new("ping")
        .args(["-6", "-c", "1", "-W", "1", &s.direct_sid.to_string()])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// For each server (config order), the server whose direct SID its shadow
/// hops go to instead of its own segments. A dead server's connections
/// can be served nowhere but at a live server's direct SID (where they end
/// their chain), and its place in each group must stay, or every other
/// member's share of the hash would move: the next server after it in
/// config order that is in `up` takes it (deterministic, so a rerun
/// writes the same). None: its own segments (alive, or no server in `up`
/// to send them to).
fn substitutes(cfg: &RouterConfig, up: &[&Server], dead: &BTreeSet<String>) -> Vec<Option<usize>> {
    let n = cfg.server.len();
    (0..n)
        .map(|i| {
            if !dead.contains(&cfg.server[i].name) {
                return None;
            }
            (1..n).map(|d| (i + d) % n).find(|&j| up.iter().any(|u| u.name == cfg.server[j].name))
        })
        .collect()
}

/// The segments of server `i`'s hop in the VIP's route (`generation`
/// None) or in shadow generation k's table: its conditional SID, where a
/// stray goes on to the first shadow SID; in a generation with an older
/// one behind it, its conditional SID and then that generation's SID (the
/// program sends a stray to the second segment); in the oldest, its
/// direct SID, never chained again. A dead server's shadow hops go to its
/// substitute's direct SID.
fn segs(cfg: &RouterConfig, i: usize, generation: Option<u32>, subs: &[Option<usize>]) -> Vec<Ipv6Addr> {
    let s = &cfg.server[i];
    match (generation, subs[i]) {
        (None, _) => vec![s.sid],
        (Some(_), Some(j)) => vec![cfg.server[j].direct_sid],
        (Some(k), None) if k + 1 < cfg.generations => vec![s.sid, cfg.generation(k + 1).1],
        (Some(_), None) => vec![s.direct_sid],
    }
}

/// Every server's hop in every table's group, as a nexthop object on the
/// anchor: made when missing, rewritten in place when its segments change
/// (a death, a revival, a config change) or it is not on the anchor yet;
/// the groups holding it keep it. An object in this VIP's id block that
/// goes to no SID of this config belongs to someone else: refused, not
/// overwritten. Returns the ids there are.
fn ensure_hops(cfg: &RouterConfig, subs: &[Option<usize>]) -> Result<HashSet<u32>> {
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
    let anchor = cfg.anchor.as_str();
    for generation in std::iter::once(None).chain((0..cfg.generations).map(Some)) {
        for (i, s) in cfg.server.iter().enumerate() {
            let id = cfg.hop_id(generation, i);
            let want: Vec<String> = segs(cfg, i, generation, subs).iter().map(Ipv6Addr::to_string).collect();
            let found = existing.iter().find(|o| o["id"].as_u64() == Some(u64::from(id)));
            let verb = match found {
                None => "add",
                Some(o) => {
                    let have: Vec<&str> = o["segs"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
                    if have == want.iter().map(String::as_str).collect::<Vec<_>>() && o["gateway"].is_null() && o["dev"].as_str() == Some(anchor) {
                        continue;
                    }
                    if have.is_empty() || !have.iter().all(|h| ours.contains(*h)) {
                        return Err(foreign(o));
                    }
                    "replace"
                }
            };
            if let (Some(k), Some(j)) = (generation, subs[i]) {
                info!(server = %s.name, generation = k + 1, to = %cfg.server[j].name, "dead: its shadow hop goes to a live server's direct SID");
            }
            ids.insert(id);
            let (id, segs) = (id.to_string(), want.join(","));
            // The VIP's family: a hop with a device and no gateway is
            // IPv4 to the kernel otherwise, and an IPv6 route refuses it.
            ip(&[cfg.family(), "nexthop", verb, "id", &id, "encap", "seg6", "mode", "encap", "segs", &segs, "dev", anchor])
                .with_context(|| format!("writing nexthop object {id} (server {:?})", s.name))?;
        }
    }
    Ok(ids)
}

/// What the router needs whatever the set: forwarding, SRv6 accepted on
/// the next hops' links (strays come back on them), a multipath hash of
/// the 5-tuple read from the headers, its SIDs into the shadow tables,
/// and the next hops' nexthop objects (whose ids it returns, with the
/// servers it found dead).
///
/// The hash must be a function of the packet's 5-tuple alone, so that a
/// stray looked up again in a shadow table picks the next hop the old
/// route picked. The default (policy 0) hashes addresses only: every
/// connection of a client would go to one next hop. Policy 1 (L4) takes
/// a hash the packet already carries when there is one (skb->l4_hash):
/// over a veth that is the sending socket's random txhash, which a stray
/// re-sent by XDP no longer has, so the shadow lookup would pick another
/// next hop. Policy 3 with the five fields always reads the headers.
///
/// An IPv4 VIP needs the same of IPv4 (forwarding, the hash), no
/// seg6local SIDs (End.DT4 needs a VRF device), and instead the shadow
/// SIDs in the tc program on every next hop's link, a `fwmark` rule per
/// generation, and loose reverse-path filtering on those links: a stray
/// comes in there with the client's source, which is not reached through
/// them, and strict filtering would drop it.
fn prepare(cfg: &RouterConfig, up: &[&Server], forced: &[String]) -> Result<(HashSet<u32>, BTreeSet<String>)> {
    let links = links()?;
    check_anchor(&cfg.anchor, &links)?;
    // Source and destination address, protocol, source and destination port.
    let sysctls: &[(&str, &str)] = if cfg.vip.is_ipv4() {
        &[
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv4/fib_multipath_hash_policy", "3"),
            ("net/ipv4/fib_multipath_hash_fields", "0x0037"),
            ("net/ipv4/conf/all/rp_filter", "2"),
        ]
    } else {
        &[
            ("net/ipv6/conf/all/forwarding", "1"),
            ("net/ipv6/conf/all/seg6_enabled", "1"),
            ("net/ipv6/fib_multipath_hash_policy", "3"),
            ("net/ipv6/fib_multipath_hash_fields", "0x0037"),
        ]
    };
    for (key, value) in sysctls {
        let path = format!("/proc/sys/{key}");
        std::fs::write(&path, value).with_context(|| format!("writing {path}"))?;
    }
    for s in &cfg.server {
        let path = if cfg.vip.is_ipv4() {
            format!("/proc/sys/net/ipv4/conf/{}/rp_filter", s.dev)
        } else {
            format!("/proc/sys/net/ipv6/conf/{}/seg6_enabled", s.dev)
        };
        match std::fs::write(&path, if cfg.vip.is_ipv4() { "2" } else { "1" }) {
            // Its link is gone: the server is dead, which is no reason to
            // leave the others' routes alone.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => warn!(server = %s.name, dev = %s.dev, "no such interface"),
            r => r.with_context(|| format!("writing {path}"))?,
        }
    }
    if let Some(p) = cfg.fleet_prefix {
        ip(&["-6", "route", "replace", "unreachable", &p.to_string()]).with_context(|| format!("routing the fleet prefix {p} nowhere"))?;
    }
    let dead = dead_servers(cfg, up, forced, &links, &echo);
    let objects = ensure_hops(cfg, &substitutes(cfg, up, &dead))?;
    if cfg.vip.is_ipv4() {
        let sids: Vec<(Ipv6Addr, u32)> = (0..cfg.generations).map(|k| (generation_sid(cfg.shadow_sid, k), cfg.mark(k))).collect();
        let gone: Vec<Ipv6Addr> = (cfg.generations..MAX_GENERATIONS).map(|k| generation_sid(cfg.shadow_sid, k)).collect();
        let devs: Vec<&str> = cfg
            .server
            .iter()
            .filter(|s| {
                let there = links.contains_key(&s.dev);
                if !there {
                    warn!(server = %s.name, dev = %s.dev, "no such interface: the IPv4 shadow program is not attached there");
                }
                there
            })
            .map(|s| s.dev.as_str())
            .collect();
        crate::dt4::install(&sids, &gone, &devs).context("setting up the IPv4 shadow SIDs")?;
        ensure_rules(cfg)?;
        return Ok((objects, dead));
    }
    for k in 0..cfg.generations {
        let (table, sid) = cfg.generation(k);
        ip(&["-6", "route", "replace", &sid.to_string(), "encap", "seg6local", "action", "End.DT6", "table", &table.to_string(), "dev", &cfg.anchor])
            .with_context(|| format!("installing shadow SID {sid} (End.DT6 into table {table})"))?;
    }
    Ok((objects, dead))
}

/// The preferences of the `fwmark` rules: after the local table (0),
/// before main (32766).
const RULE_PREF: u64 = 32000;
const RULE_END_PREF: u64 = 32001;

/// An IPv4 VIP's two `fwmark` rules for each generation (made when
/// missing), and none for generations the config no longer keeps. The
/// first looks the stray up in the generation's table; the second drops
/// it when that table has no route for it (a generation without a set
/// yet): the kernel would go on to the main table, which sends it back
/// to an instance that chains it again, until its TTL runs out. End.DT6
/// ends there too. The marks hold the table, so several configs' rules
/// never meet.
fn ensure_rules(cfg: &RouterConfig) -> Result<()> {
    let out = ip(&["-4", "-j", "rule", "show"]).context("listing the router's IPv4 rules")?;
    let rules: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).context("reading `ip -j rule show` output")?;
    for k in 0..MAX_GENERATIONS {
        // check() keeps an IPv4 VIP's tables below 65536.
        let (table, mark) = (cfg.generation(k).0.to_string(), format!("{:#x}", cfg.mark(k)));
        let want = k < cfg.generations;
        for (pref, field, value, action) in
            [(RULE_PREF, "table", table.as_str(), ["lookup", table.as_str()]), (RULE_END_PREF, "action", "blackhole", ["blackhole", ""])]
        {
            let there = rules.iter().any(|r| {
                r["fwmark"].as_str() == Some(mark.as_str()) && r[field].as_str() == Some(value) && r["priority"].as_u64() == Some(pref)
            });
            if want == there {
                continue;
            }
            let verb = if want { "add" } else { "del" };
            let pref = pref.to_string();
            let mut args = vec!["-4", "rule", verb, "fwmark", &mark];
            args.extend(action.iter().filter(|a| !a.is_empty()));
            args.extend(["pref", &pref]);
            ip(&args).with_context(|| format!("{verb} a rule for shadow table {table} (fwmark {mark})"))?;
        }
    }
    Ok(())
}

/// The servers the VIP's route in the main table (`generation` None) or
/// in generation k's table goes to now, in the order of its group: read
/// from the group's member ids, since a dead server's hop names another
/// server's SID. A route not on this VIP's group (a multipath route of an
/// earlier version) is read by each hop's first segment instead.
fn set_in(cfg: &RouterConfig, generation: Option<u32>) -> Result<Vec<&Server>> {
    let mut args = vec![cfg.family().to_string(), "-j".into(), "route".into(), "show".into(), cfg.vip_prefix()];
    if let Some(k) = generation {
        args.extend(["table".into(), cfg.generation(k).0.to_string()]);
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
    let place = generation.map_or("the VIP's route".to_string(), |k| format!("table {}", cfg.generation(k).0));
    let group = cfg.group_id(generation);
    if route["nhid"].as_u64() == Some(u64::from(group)) {
        let out = ip(&["-j", "nexthop", "show", "id", &group.to_string()])?;
        let groups: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).context("reading `ip -j nexthop show` output")?;
        return members(cfg, generation, groups.first().unwrap_or(&serde_json::Value::Null)).with_context(|| format!("reading {place}"));
    }
    // One next hop is printed flat, several under "nexthops".
    let hops = match route["nexthops"].as_array() {
        Some(h) => h.clone(),
        None => vec![route.clone()],
    };
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

/// The servers of `group` (one object of `ip -j nexthop show`), the
/// group of the VIP's route (`generation` None) or of generation k's, by
/// their hops' ids.
fn members<'a>(cfg: &'a RouterConfig, generation: Option<u32>, group: &serde_json::Value) -> Result<Vec<&'a Server>> {
    let first = u64::from(cfg.hop_id(generation, 0));
    let ids = group["group"].as_array().with_context(|| format!("nexthop object {} is not a group", cfg.group_id(generation)))?;
    ids.iter()
        .map(|m| {
            let id = m["id"].as_u64().unwrap_or(0);
            id.checked_sub(first).and_then(|i| cfg.server.get(usize::try_from(i).ok()?)).with_context(|| {
                format!("its group holds nexthop object {id}, which is no server's hop in the config: fix the route or the config")
            })
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
    let mut args = vec![cfg.family(), "route", "replace", &vip];
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
    let mut args = vec![cfg.family(), "route", "del", &vip];
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
        let mut text = format!("vip = \"fd00:81::100\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:81:5f::5\"\ngenerations = 8\n{extra}\n");
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
    fn an_ipv4_vip_has_its_own_id_block_and_marks_that_name_its_tables() {
        let v4 = parse(&config("", 2).replace("fd00:81::100", "10.81.0.100")).unwrap();
        let v6 = parse(&config("", 2)).unwrap();
        assert_ne!(v4.first_nexthop_id(), v6.first_nexthop_id());
        assert_eq!((v4.family(), v4.vip_prefix(), v6.family(), v6.vip_prefix()), ("-4", "10.81.0.100/32".into(), "-6", "fd00:81::100/128".into()));
        assert_eq!((v4.mark(0), v4.mark(7)), (0x1b5e_00c8, 0x1b5e_00cf));
        let v4 = |extra: &str| parse(&config(extra, 1).replace("fd00:81::100", "10.81.0.100"));
        assert_eq!(v4("ipv4_mark = 0x70000").unwrap().mark(1), 0x7_00c9);
        for (extra, needle) in
            [("ipv4_mark = 0x70001", "its low 16 bits must be 0"), ("shadow_table = 65530", "an IPv4 VIP's shadow tables must be below 65536")]
        {
            let err = format!("{:#}", v4(extra).unwrap_err());
            assert!(err.contains(needle), "{err}");
        }
        // An IPv6 VIP's tables may be anywhere.
        parse(&config("shadow_table = 65530", 1)).unwrap();
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

    /// `ip -j link show` as the router would print it: `dev` of s0..s3 is
    /// s0..s3; the flags of each as given (None: no such interface).
    fn links_with(flags: &[(&str, Option<&str>)]) -> Links {
        let mut json = vec![r#"{"ifindex":1,"ifname":"lo","flags":["LOOPBACK","UP","LOWER_UP"],"mtu":65536}"#.to_string()];
        for (dev, f) in flags {
            if let Some(f) = f {
                let f: Vec<String> = f.split(',').map(|x| format!("{x:?}")).collect();
                json.push(format!(r#"{{"ifindex":9,"ifname":"{dev}","flags":[{}],"mtu":1500,"link_type":"ether"}}"#, f.join(",")));
            }
        }
        parse_links(format!("[{}]", json.join(",")).as_bytes()).unwrap()
    }

    const UP: Option<&str> = Some("BROADCAST,MULTICAST,UP,LOWER_UP");
    const NO_CARRIER: Option<&str> = Some("NO-CARRIER,BROADCAST,MULTICAST,UP");

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// The segments of every hop (main, generations 0 and 1) of a config of
    /// 4 servers and 2 generations, with `up` the VIP's set and `flags` the links.
    fn plan(up: &[&str], forced: &[&str], flags: &[(&str, Option<&str>)]) -> (BTreeSet<String>, Vec<[Vec<Ipv6Addr>; 3]>) {
        let cfg = parse(&config("", 4).replace("generations = 8", "generations = 2")).unwrap();
        let up: Vec<&Server> = up.iter().map(|n| cfg.server(n).unwrap()).collect();
        let dead = dead_servers(&cfg, &up, &names(forced), &links_with(flags), &|_| true);
        let subs = substitutes(&cfg, &up, &dead);
        let hops = (0..4).map(|i| [segs(&cfg, i, None, &subs), segs(&cfg, i, Some(0), &subs), segs(&cfg, i, Some(1), &subs)]).collect();
        (dead, hops)
    }

    fn sid(i: u16, kind: u16) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x82, i, 0, 0, 0, 0, kind)
    }

    /// With `liveness = "echo"`, a server outside the set whose link is up
    /// but whose program does not answer at its direct SID is dead; by
    /// default (links only) it is alive. A server in the set is never
    /// probed.
    #[test]
    fn with_echo_liveness_a_silent_program_behind_a_live_link_is_dead() {
        let flags = [("s0", UP), ("s1", UP), ("s2", UP)];
        let silent_s1 = |s: &Server| s.name != "s1";
        for (liveness, want) in [("", vec![]), ("liveness = \"echo\"", vec!["s1".to_string()])] {
            let cfg = parse(&config(liveness, 3)).unwrap();
            let up = vec![cfg.server("s0").unwrap()];
            let dead = dead_servers(&cfg, &up, &[], &links_with(&flags), &silent_s1);
            assert_eq!(dead.into_iter().collect::<Vec<_>>(), want, "{liveness:?}");
        }
        let cfg = parse(&config("liveness = \"echo\"", 3)).unwrap();
        let up = vec![cfg.server("s1").unwrap()];
        assert!(dead_servers(&cfg, &up, &[], &links_with(&flags), &silent_s1).is_empty(), "s1 is in the set: not probed");
        assert!(parse(&config("liveness = \"ping\"", 3)).is_err());
    }

    #[test]
    fn a_dead_server_keeps_its_place_but_its_shadow_hops_go_to_the_next_live_servers_direct_sid() {
        let second = "fd00:81:5f::6".parse::<Ipv6Addr>().unwrap();
        let own = |i: u16| [vec![sid(i, 0xb)], vec![sid(i, 0xb), second], vec![sid(i, 0xd)]];
        // s1 lost carrier, s3's link is gone; s3 left earlier; s0 and s2 carry the VIP.
        let (dead, hops) = plan(&["s0", "s2"], &[], &[("s0", UP), ("s1", NO_CARRIER), ("s2", UP), ("s3", None)]);
        assert_eq!(dead, names(&["s1", "s3"]).into_iter().collect());
        assert_eq!(hops[0], own(0));
        assert_eq!(hops[2], own(2));
        // Both generations: the next server in config order that is in the
        // set (s1 → s2; s3 → wraps to s0), its direct SID, never chained again.
        // The VIP's route keeps the dead server's own SID (it is not in the set).
        assert_eq!(hops[1], [vec![sid(1, 0xb)], vec![sid(2, 0xd)], vec![sid(2, 0xd)]]);
        assert_eq!(hops[3], [vec![sid(3, 0xb)], vec![sid(0, 0xd)], vec![sid(0, 0xd)]]);

        // Revived (carrier back, s3 back): their own segments again.
        let (dead, hops) = plan(&["s0", "s2"], &[], &[("s0", UP), ("s1", UP), ("s2", UP), ("s3", UP)]);
        assert!(dead.is_empty(), "{dead:?}");
        assert_eq!(hops, (0..4).map(own).collect::<Vec<_>>());

        // A server in the set is alive whatever its link says (BGP or the
        // operator put it there); --dead forces one whose link is up.
        let (dead, hops) = plan(&["s1", "s2"], &["s0"], &[("s0", UP), ("s1", None), ("s2", UP), ("s3", UP)]);
        assert_eq!(dead, names(&["s0"]).into_iter().collect());
        assert_eq!(hops[1], own(1));
        assert_eq!(hops[0][1..], [vec![sid(1, 0xd)], vec![sid(1, 0xd)]]);

        // No server in the set: nowhere to send a dead one's connections.
        let (dead, hops) = plan(&[], &[], &[("s0", UP), ("s1", NO_CARRIER), ("s2", UP), ("s3", UP)]);
        assert_eq!(dead, names(&["s1"]).into_iter().collect());
        assert_eq!(hops[1], own(1));
    }

    #[test]
    fn a_tables_set_is_read_from_its_groups_member_ids() {
        let cfg = parse(&config("", 3)).unwrap();
        let group = |ids: &[u32]| serde_json::json!({"id": cfg.group_id(Some(0)), "group": ids.iter().map(|i| serde_json::json!({"id": i})).collect::<Vec<_>>()});
        // In the group's order, whatever segments the hops have now.
        let set = members(&cfg, Some(0), &group(&[cfg.hop_id(Some(0), 2), cfg.hop_id(Some(0), 0)])).unwrap();
        assert_eq!(set.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["s2", "s0"]);
        // Another table's hop, or one past the config's servers.
        for stray in [cfg.hop_id(None, 1), cfg.hop_id(Some(0), 3), cfg.group_id(Some(0))] {
            let err = format!("{:#}", members(&cfg, Some(0), &group(&[cfg.hop_id(Some(0), 1), stray])).unwrap_err());
            assert!(err.contains(&format!("nexthop object {stray}, which is no server's hop")), "{err}");
        }
        let err = format!("{:#}", members(&cfg, None, &serde_json::json!({"id": 5, "segs": ["fd00::1"]})).unwrap_err());
        assert!(err.contains("is not a group"), "{err}");
    }

    #[test]
    fn a_fleet_prefix_must_be_the_instances_96() {
        let cfg = parse(&config("fleet_prefix = \"fd00:f1ee::/96\"", 2)).unwrap();
        assert_eq!(cfg.fleet_prefix.map(|p| p.to_string()).as_deref(), Some("fd00:f1ee::/96"));
        for (bad, why) in [("fd00:f1ee::/64", "not a /96"), ("fd00:f1ee::7/96", "not a /96"), ("fd00:f1ee::", "invalid")] {
            let e = format!("{:#}", parse(&config(&format!("fleet_prefix = \"{bad}\""), 2)).unwrap_err());
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn an_anchor_that_is_missing_or_down_is_refused() {
        let err = format!("{:#}", parse(&config("", 1).replace("anchor = \"inb0\"\n", "")).unwrap_err());
        assert!(err.contains("anchor missing: every nexthop and shadow SID is put on it") && err.contains("type dummy"), "{err}");
        for bad in ["", "a/b", "a-name-far-too-long"] {
            let err = format!("{:#}", parse(&config("", 1).replace("\"inb0\"", &format!("{bad:?}"))).unwrap_err());
            assert!(err.contains("anchor"), "{bad:?}: {err}");
        }
        for (flags, needle) in [
            (None, "anchor = \"inb0\": no such interface"),
            (NO_CARRIER, "anchor = \"inb0\" is down (flags NO-CARRIER,BROADCAST,MULTICAST,UP)"),
            (Some("BROADCAST,MULTICAST"), "is down"),
        ] {
            let err = format!("{:#}", check_anchor("inb0", &links_with(&[("inb0", flags)])).unwrap_err());
            assert!(err.contains(needle) && err.contains("veth pair with both ends up"), "{err}");
        }
        check_anchor("inb0", &links_with(&[("inb0", UP)])).unwrap();
    }
}

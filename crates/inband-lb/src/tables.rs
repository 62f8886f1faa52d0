//! The balancer's configuration as it lives in the (pinned) BPF maps: VIP
//! ids, backend ids and slots. `apply` makes the maps match a config without
//! touching flows: a removed VIP or backend drains (no new connections, its
//! established ones kept until they end or the drain deadline); `reap`
//! frees what has finished draining; `read` recovers the state after a
//! daemon restart. Every writer holds the daemon's config lock.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use anyhow::{bail, Result};
use libbpf_rs::{MapCore, MapHandle};

use super::config::{AllDown, Encap, OnDown, VipConfig};
use super::maps::*;
use inband_core::bpfmap::{self, PinDir};
use inband_core::net::Protocol;
use inband_core::pod::{be_ip, be_port, ip_of, port_of};

/// Handles on the balancer's pinned maps.
pub struct LbMaps {
    pub lb_config: MapHandle,
    pub auth_keys: MapHandle,
    pub vips: MapHandle,
    pub vip_conf: MapHandle,
    pub backends: MapHandle,
    pub vip_backends: MapHandle,
    pub vip_eligible: MapHandle,
    pub scores: MapHandle,
    pub probe_due: MapHandle,
    pub rr_cursor: MapHandle,
    pub flows: MapHandle,
    pub half_open: MapHandle,
    pub half_open_ports: MapHandle,
    pub snat: MapHandle,
    pub backend_stats: MapHandle,
    pub vip_stats: MapHandle,
    pub drops: MapHandle,
    pub events: MapHandle,
    pub gauges: MapHandle,
    pub sweep_stats: MapHandle,
    pub control_stats: MapHandle,
    pub backend_health: MapHandle,
    pub maglev: MapHandle,
    pub query_ring: MapHandle,
    pub query_done: MapHandle,
    pub choice_ring: MapHandle,
    pub peer_choices: MapHandle,
}

impl LbMaps {
    pub fn open(dir: &PinDir) -> Result<LbMaps> {
        Ok(LbMaps {
            lb_config: dir.open("lb_config")?,
            auth_keys: dir.open("auth_keys")?,
            vips: dir.open("vips")?,
            vip_conf: dir.open("vip_conf")?,
            backends: dir.open("backends")?,
            vip_backends: dir.open("vip_backends")?,
            vip_eligible: dir.open("vip_eligible")?,
            scores: dir.open("scores")?,
            probe_due: dir.open("probe_due")?,
            rr_cursor: dir.open("rr_cursor")?,
            flows: dir.open("flows")?,
            half_open: dir.open("half_open")?,
            half_open_ports: dir.open("half_open_ports")?,
            snat: dir.open("snat")?,
            backend_stats: dir.open("backend_stats")?,
            vip_stats: dir.open("vip_stats")?,
            drops: dir.open("drops")?,
            events: dir.open("events")?,
            gauges: dir.open("gauges")?,
            sweep_stats: dir.open("sweep_stats")?,
            control_stats: dir.open("control_stats")?,
            backend_health: dir.open("backend_health")?,
            maglev: dir.open("maglev")?,
            query_ring: dir.open("query_ring")?,
            query_done: dir.open("query_done")?,
            choice_ring: dir.open("choice_ring")?,
            peer_choices: dir.open("peer_choices")?,
        })
    }
}

pub fn vip_key(ep: SocketAddr, protocol: Protocol) -> VipKey {
    VipKey { addr: be_ip(ep.ip()), port: be_port(ep.port()), proto: protocol.number(), pad: 0 }
}

/// A VIP's identity: address, port and transport.
pub type VipId = (SocketAddr, Protocol);

/// One VIP as found in the maps.
#[derive(Clone, Debug)]
pub struct VipEntry {
    pub id: u32,
    pub endpoint: SocketAddr,
    pub protocol: Protocol,
    pub vip: Vip,
    /// (backend id, backend) for slots [0, backend_count).
    pub slots: Vec<(u32, Backend)>,
}

impl VipEntry {
    pub fn draining(&self) -> bool {
        self.vip.flags & VIP_DRAINING != 0
    }
    pub fn ident(&self) -> VipId {
        (self.endpoint, self.protocol)
    }
    pub fn name(&self) -> String {
        inband_core::net::vip_name(self.endpoint, self.protocol)
    }
}

pub fn backend_endpoint(b: &Backend) -> SocketAddr {
    SocketAddr::new(ip_of(&b.addr), port_of(b.port))
}

/// Reads every VIP (draining ones included) with its backends, by id.
pub fn read(maps: &LbMaps) -> Result<Vec<VipEntry>> {
    let mut out = Vec::new();
    for (k, id) in bpfmap::entries::<VipKey, u32>(&maps.vips)? {
        let vip: Vip = bpfmap::get(&maps.vip_conf, &id)?.unwrap_or_default();
        let mut slots = Vec::new();
        let ids: VipSlots = bpfmap::get(&maps.vip_backends, &id)?.unwrap_or_default();
        for bid in ids.backend.iter().take(usize::from(vip.backend_count)).map(|b| u32::from(*b)) {
            let b: Backend = bpfmap::get(&maps.backends, &bid)?.unwrap_or_default();
            slots.push((bid, b));
        }
        let protocol = Protocol::from_number(k.proto).unwrap_or_default();
        out.push(VipEntry { id, endpoint: SocketAddr::new(ip_of(&k.addr), port_of(k.port)), protocol, vip, slots });
    }
    out.sort_by_key(|v| v.id);
    Ok(out)
}

/// When something removed now stops keeping its flows: `drain_timeout_ms`
/// from now, or never (0).
fn drain_deadline(now_ns: u64, drain_timeout_ms: u64) -> u64 {
    if drain_timeout_ms == 0 {
        0
    } else {
        now_ns + drain_timeout_ms.saturating_mul(1_000_000)
    }
}

/// Makes the maps hold exactly `vips`. Backend ids of backends that stay are
/// kept (their scores, stats and flows stay valid); removed backends and
/// VIPs drain; new ids never reuse one that a flow may still name.
/// `maglev_size` is the size the Maglev tables were created with.
/// `fleet`: `[scale_out] fleet` is on (VipConfig::fleet_tuples says which
/// VIPs then take fleet tuples; those whose policy is not Maglev announce
/// their choices to the peers: peers.rs).
pub fn apply(maps: &LbMaps, vips: &[VipConfig], drain_timeout_ms: u64, maglev_size: u32, fleet: bool) -> Result<()> {
    let now = ktime_ns();
    let current = read(maps)?;
    let by_ep: HashMap<VipId, &VipEntry> = current.iter().map(|v| (v.ident(), v)).collect();
    let mut used_vip_ids: HashSet<u32> = current.iter().map(|v| v.id).collect();
    let mut live_ids: HashSet<u32> = HashSet::new();
    let mut allocator = IdAllocator::new(maps)?;
    let mut tables = MaglevTables::new(maps, &current, vips, maglev_size)?;

    for v in vips {
        let existing = by_ep.get(&(v.endpoint(), v.protocol)).copied();
        let vid = match existing {
            Some(e) => e.id,
            None => match (0..MAX_VIPS).find(|i| !used_vip_ids.contains(i)) {
                Some(i) => {
                    used_vip_ids.insert(i);
                    i
                }
                None => bail!("no free VIP id: at most {MAX_VIPS} VIPs, including removed ones still draining"),
            },
        };
        let old: HashMap<SocketAddr, u32> =
            existing.map(|e| e.slots.iter().map(|(id, b)| (backend_endpoint(b), *id)).collect()).unwrap_or_default();
        let mut slots = Vec::new();
        for b in &v.backends {
            let ep = b.endpoint();
            let id = match old.get(&ep) {
                Some(id) => *id,
                None => match allocator.tombstone(ep)? {
                    // Back after a removal: same id, so its MAC, score and
                    // counters carry on.
                    Some(id) => id,
                    None => allocator.take()?,
                },
            };
            let mut entry: Backend = bpfmap::get(&maps.backends, &id)?.unwrap_or_default();
            if backend_endpoint(&entry) != ep {
                // A fresh id: no MAC yet (the neighbour resolver fills it),
                // no stale score, and its first packet asks for one.
                entry = Backend { addr: be_ip(b.address), port: be_port(b.port), ..Default::default() };
                bpfmap::put(&maps.scores, &id, &BackendScore::default())?;
                bpfmap::put(&maps.probe_due, &id, &PROBE_DUE)?;
            }
            // OPTIONS_LOST and DOWN are the daemon's findings about the
            // path and the backend (health.rs owns DOWN): kept.
            // Weight 0 is drained: its flows go on, no new ones come.
            entry.flags = (if b.takes_new() { BACKEND_ACTIVE } else { BACKEND_DRAINING })
                | (entry.flags & (BACKEND_OPTIONS_LOST | BACKEND_DOWN))
                | if b.encap == Encap::Ipip { BACKEND_ENCAP } else { 0 };
            entry.drain_deadline_ns = 0;
            entry.quic_server_id = b.quic_server_id.unwrap_or(0);
            entry.weight = b.weight;
            bpfmap::put(&maps.backends, &id, &entry)?;
            live_ids.insert(id);
            slots.push(id);
        }
        let key = vip_key(v.endpoint(), v.protocol);
        let new = Vip {
            addr: key.addr,
            port: key.port,
            backend_count: slots.len() as u16,
            mode: v.mode as u8,
            policy: v.effective_policy() as u8,
            flags: VIP_ACTIVE
                | if v.quic { VIP_QUIC } else { 0 }
                | if v.weighted() { VIP_WEIGHTED } else { 0 }
                | if v.health.on_down == OnDown::Reset { VIP_RESET_DOWN } else { 0 }
                | if v.health.all_down == AllDown::Refuse { VIP_REFUSE_EMPTY } else { 0 }
                | if v.query_when_stale { VIP_QUERY_STALE } else { 0 }
                | if fleet && v.fleet_tuples() { VIP_FLEET } else { 0 }
                // A peer can recompute a Maglev backend; any other is announced.
                | if fleet && v.fleet_tuples() && v.effective_policy() != Policy::Maglev { VIP_ANNOUNCE } else { 0 },
            proto: key.proto,
            pad: 0,
            eligible_count: 0,
            probe_interval: v.probe_interval,
            probe_interval_max: v.probe_interval_max(),
            probe_budget: v.probe_budget,
            maglev_table: 0,
            pad1: 0,
            score_max_age_ns: v.score_max_age_ms.saturating_mul(1_000_000),
            syn_timeout_ns: v.syn_timeout_ms.saturating_mul(1_000_000),
            idle_timeout_ns: v.idle_timeout_s().saturating_mul(1_000_000_000),
            closing_timeout_ns: v.closing_timeout_ms.saturating_mul(1_000_000),
            drain_deadline_ns: 0,
        };
        // Shrink the count before rewriting slots and grow it after, so the
        // data path never reads a slot that is being rewritten as valid.
        if let Some(e) = existing {
            if usize::from(e.vip.backend_count) > slots.len() {
                bpfmap::put(&maps.vip_conf, &vid, &Vip { backend_count: slots.len() as u16, ..e.vip })?;
            }
            if e.vip.mode != new.mode {
                // Connections counted under the old mode say nothing about
                // load under the new one.
                for id in &slots {
                    let mut sc: BackendScore = bpfmap::get(&maps.scores, id)?.unwrap_or_default();
                    sc.opened = 0;
                    sc.closed = 0;
                    bpfmap::put(&maps.scores, id, &sc)?;
                }
            }
        }
        write_slots(maps, vid, &slots)?;
        // The table and the eligible set before the VIP says maglev or
        // weighted or counts them: a pick finds them filled.
        let mut new = new;
        if v.uses_maglev_table() {
            new.maglev_table = tables.of(vid)?;
            write_maglev(maps, new.maglev_table, v, maglev_size)?;
        }
        new.eligible_count = write_eligible(maps, vid, &slots)?;
        bpfmap::put(&maps.vip_conf, &vid, &new)?;
        bpfmap::put(&maps.vips, &key, &vid)?;
    }

    // VIPs no longer configured drain: their key stays so that new
    // connections are refused and counted (`vip_draining`), their flows go
    // on until they end or the deadline; `reap` removes them afterwards.
    let wanted: HashSet<VipId> = vips.iter().map(|v| (v.endpoint(), v.protocol)).collect();
    for e in &current {
        if !wanted.contains(&e.ident()) && !e.draining() {
            let v = Vip { flags: VIP_DRAINING, drain_deadline_ns: drain_deadline(now, drain_timeout_ms), ..e.vip };
            bpfmap::put(&maps.vip_conf, &e.id, &v)?;
        }
    }
    // Backends no VIP lists any more become tombstones: no new connections,
    // next hop kept for their flows until they end or the deadline.
    for e in &current {
        for (id, _) in &e.slots {
            if !live_ids.contains(id) {
                let mut b: Backend = bpfmap::get(&maps.backends, id)?.unwrap_or_default();
                if !backend_removed(&b) {
                    // Its flows keep their path's carrier and finding.
                    b.flags &= BACKEND_OPTIONS_LOST | BACKEND_ENCAP;
                    b.drain_deadline_ns = drain_deadline(now, drain_timeout_ms);
                    bpfmap::put(&maps.backends, id, &b)?;
                }
            }
        }
    }
    Ok(())
}

/// Writes VIP `vid`'s slots: backend ids in slot order, in one update.
pub fn write_slots(maps: &LbMaps, vid: u32, slots: &[u32]) -> Result<()> {
    let mut value = VipSlots::default();
    for (to, id) in value.backend.iter_mut().zip(slots) {
        *to = *id as u16;
    }
    bpfmap::put(&maps.vip_backends, &vid, &value)
}

/// Whether a VIP as written reads its Maglev table: what
/// uses_maglev_table decided when it was written. A VIP that did not has no
/// table, whatever its (zero) maglev_table says.
fn reads_maglev_table(v: &Vip) -> bool {
    let weighted = v.flags & VIP_WEIGHTED != 0;
    if v.policy == Policy::Maglev as u8 {
        true
    } else if v.policy == Policy::RoundRobin as u8 {
        weighted
    } else {
        weighted && u32::from(v.backend_count) > SCAN_MAX
    }
}

/// Rewrites VIP `vid`'s dense set of eligible slots (vip_eligible) from the
/// backends' flags: the slots whose backend is ACTIVE and not DOWN, in slot
/// order. Returns their number, for vip_conf.eligible_count. A pick that
/// meets the set half rewritten reads slots of the old set or the new one:
/// it checks what it takes.
pub fn write_eligible(maps: &LbMaps, vid: u32, slots: &[u32]) -> Result<u16> {
    let mut set = VipEligible::default();
    let mut n = 0;
    for (slot, id) in slots.iter().enumerate().take(set.slot.len()) {
        let b: Backend = bpfmap::get(&maps.backends, id)?.unwrap_or_default();
        if b.flags & (BACKEND_ACTIVE | BACKEND_DOWN) == BACKEND_ACTIVE {
            set.slot[n] = slot as u16;
            n += 1;
        }
    }
    bpfmap::put(&maps.vip_eligible, &vid, &set)?;
    Ok(n as u16)
}

/// After backends' DOWN flags changed (health.rs): rewrites the eligible
/// set of every VIP that lists one of `changed`, and its count. Under the
/// config lock, as every writer.
pub fn refresh_eligible(maps: &LbMaps, changed: &HashSet<u32>) -> Result<()> {
    if changed.is_empty() {
        return Ok(());
    }
    for e in read(maps)? {
        if e.draining() || !e.slots.iter().any(|(id, _)| changed.contains(id)) {
            continue;
        }
        let ids: Vec<u32> = e.slots.iter().map(|(id, _)| *id).collect();
        let n = write_eligible(maps, e.id, &ids)?;
        // Read again: only this field is ours to change.
        let vip: Vip = bpfmap::get(&maps.vip_conf, &e.id)?.unwrap_or_default();
        bpfmap::put(&maps.vip_conf, &e.id, &Vip { eligible_count: n, ..vip })?;
    }
    Ok(())
}

/// Hands the Maglev tables (as many as the map was created for: lb.toml
/// `maglev_tables`) to the VIPs that read one. A VIP keeps its table from
/// one apply to the next, so its connections keep their backends; tables
/// of VIPs that no longer read one, or drain, are free again.
struct MaglevTables {
    of_vip: HashMap<u32, u32>,
    free: Vec<u32>,
}

impl MaglevTables {
    fn new(maps: &LbMaps, current: &[VipEntry], vips: &[VipConfig], size: u32) -> Result<Self> {
        let count = maps.maglev.info()?.info.max_entries / size.max(1);
        let reading: HashSet<VipId> = vips.iter().filter(|v| v.uses_maglev_table()).map(|v| (v.endpoint(), v.protocol)).collect();
        let mut of_vip = HashMap::new();
        let mut taken = HashSet::new();
        for e in current {
            let t = e.vip.maglev_table;
            if reads_maglev_table(&e.vip) && !e.draining() && reading.contains(&e.ident()) && t < count && taken.insert(t) {
                of_vip.insert(e.id, t);
            }
        }
        let free = (0..count).rev().filter(|t| !taken.contains(t)).collect();
        Ok(MaglevTables { of_vip, free })
    }

    fn of(&mut self, vid: u32) -> Result<u32> {
        if let Some(t) = self.of_vip.get(&vid) {
            return Ok(*t);
        }
        let t = self.free.pop().ok_or_else(|| {
            anyhow::anyhow!("no free Maglev table: maglev_tables bounds the VIPs that read one (maglev, weighted round-robin, weighted VIPs of more than {SCAN_MAX} backends)")
        })?;
        self.of_vip.insert(vid, t);
        Ok(t)
    }
}

/// Writes Maglev table `index` (maglev.rs) of `size` entries for the VIP's
/// backends in slot order; a drained backend has weight 0 (no new
/// connections).
fn write_maglev(maps: &LbMaps, index: u32, v: &VipConfig, size: u32) -> Result<()> {
    let named: Vec<(String, u32)> =
        v.backends.iter().map(|b| (b.endpoint().to_string(), if b.takes_new() { b.weight } else { 0 })).collect();
    let table = super::maglev::table(&named, size);
    // No weight anywhere: every entry names no slot, and the data path
    // falls back to the next eligible one.
    let no_slot = MAX_BACKENDS_PER_VIP;
    let keys: Vec<u32> = (0..size).map(|i| index * size + i).collect();
    let slots: Vec<u32> = (0..size).map(|i| table.get(i as usize).copied().unwrap_or(no_slot)).collect();
    bpfmap::put_batch(&maps.maglev, &keys, &slots)
}

/// The live flows (established + closing) the last sweep counted at gauge
/// index `idx`.
pub fn gauge(maps: &LbMaps, idx: u32) -> Result<FlowGauges> {
    let st: SweepStats = bpfmap::get(&maps.sweep_stats, &0u32)?.unwrap_or_default();
    let half = (st.passes & 1) as u32;
    Ok(bpfmap::get(&maps.gauges, &(half * GAUGES + idx))?.unwrap_or_default())
}

fn live(g: &FlowGauges) -> u64 {
    g.established + g.closing
}

/// Frees draining VIPs whose flows are gone (by the last sweep). Run after
/// each sweep, under the config lock. Returns the VIPs freed.
pub fn reap(maps: &LbMaps) -> Result<Vec<String>> {
    let mut freed = Vec::new();
    for e in read(maps)? {
        if e.draining() && live(&gauge(maps, GAUGE_VIP0 + e.id)?) == 0 {
            bpfmap::delete(&maps.vips, &vip_key(e.endpoint, e.protocol))?;
            bpfmap::put(&maps.vip_conf, &e.id, &Vip::default())?;
            freed.push(e.name());
        }
    }
    Ok(freed)
}

/// Hands out backend ids: first never-used ones, then tombstones that no
/// flow refers to any more.
struct IdAllocator<'a> {
    maps: &'a LbMaps,
    free: Vec<u32>,
    /// Removed backends (flags 0) kept for their flows, by endpoint: read
    /// once, not once per new backend (16k lookups each).
    tombstones: HashMap<SocketAddr, u32>,
    reclaimed: bool,
}

impl<'a> IdAllocator<'a> {
    fn new(maps: &'a LbMaps) -> Result<Self> {
        let mut free = Vec::new();
        let mut tombstones = HashMap::new();
        for (id, b) in bpfmap::array_entries::<Backend>(&maps.backends, MAX_BACKENDS)?.into_iter().rev() {
            if b == Backend::default() {
                free.push(id);
            } else if backend_removed(&b) && b.addr != Addr::default() {
                // Lowest id wins, as the scan in id order did.
                tombstones.insert(backend_endpoint(&b), id);
            }
        }
        Ok(IdAllocator { maps, free, tombstones, reclaimed: false })
    }

    /// A removed backend (flags 0) with this endpoint, if one is kept.
    fn tombstone(&mut self, ep: SocketAddr) -> Result<Option<u32>> {
        Ok(self.tombstones.remove(&ep))
    }

    fn take(&mut self) -> Result<u32> {
        if self.free.is_empty() && !self.reclaimed {
            self.reclaimed = true;
            for id in (0..MAX_BACKENDS).rev() {
                let b: Backend = bpfmap::get(&self.maps.backends, &id)?.unwrap_or_default();
                if backend_removed(&b) && live(&gauge(self.maps, GAUGE_BACKEND0 + id)?) == 0 {
                    bpfmap::put(&self.maps.backends, &id, &Backend::default())?;
                    self.tombstones.retain(|_, t| *t != id);
                    self.free.push(id);
                }
            }
        }
        self.free
            .pop()
            .ok_or_else(|| anyhow::anyhow!("no free backend id: at most {MAX_BACKENDS} backends, including removed ones still draining"))
    }
}

/// The monotonic clock bpf_ktime_get_ns() reads, for score timestamps.
pub fn ktime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn sum_percpu<V: super::maps::Counted>(map: &dyn MapCore, key: u32) -> Result<V> {
    let mut total = V::default();
    for v in bpfmap::get_percpu::<u32, V>(map, &key)? {
        total.add(&v);
    }
    Ok(total)
}

/// The sum over CPUs of every counter in a per-CPU array of u64 (drops, events).
pub fn counters(map: &dyn MapCore, n: usize) -> Result<Vec<u64>> {
    (0..n as u32).map(|i| Ok(bpfmap::get_percpu::<u32, u64>(map, &i)?.iter().sum())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LbConfig;

    /// A VIP of three backends with weights `w` (and drained as `drain`).
    fn vip(mode: &str, policy: &str, w: [u32; 3], drain: [bool; 3]) -> VipConfig {
        let mut text = format!(
            "interface = \"eth0\"\naddress = \"10.0.0.10\"\n[auth]\nmode = \"none\"\n[[vip]]\naddress = \"10.0.0.100\"\nport = 80\nmode = \"{mode}\"\npolicy = \"{policy}\"\n"
        );
        for i in 0..3 {
            text += &format!("[[vip.backend]]\naddress = \"10.0.1.{}\"\nport = 8080\nweight = {}\ndrain = {}\n", i + 2, w[i], drain[i]);
        }
        LbConfig::parse(&text).unwrap().vips.remove(0)
    }

    #[test]
    fn a_vip_is_weighted_when_the_backends_taking_connections_differ() {
        let rr = |w, d| vip("dsr-rr", "round-robin", w, d).weighted();
        assert!(!rr([1, 1, 1], [false; 3]));
        assert!(!rr([5, 5, 5], [false; 3]), "equal weights are no weights");
        assert!(rr([1, 3, 1], [false; 3]));
        assert!(!rr([1, 3, 1], [false, true, false]), "a drained backend's weight does not count");
        assert!(!rr([2, 0, 2], [false; 3]), "weight 0 takes nothing: it does not count");
        assert!(!rr([0, 0, 0], [false; 3]));
    }

    #[test]
    fn the_maglev_table_is_written_for_maglev_and_weighted_round_robin() {
        let uses = |mode, policy, w| vip(mode, policy, w, [false; 3]).uses_maglev_table();
        assert!(uses("dsr-rr", "maglev", [1, 1, 1]));
        assert!(uses("dsr-rr", "round-robin", [1, 2, 1]));
        assert!(!uses("dsr-rr", "round-robin", [1, 1, 1]));
        // passthrough and dsr-rr run a score policy as round-robin.
        assert!(uses("passthrough", "least-score", [1, 2, 1]));
        assert!(!uses("dsr-dynamic", "least-score", [1, 2, 1]), "least-score weighs without the table");
        assert!(!uses("dsr-dynamic", "power-of-two", [1, 2, 1]));
    }
}

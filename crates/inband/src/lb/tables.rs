//! The balancer's configuration as it lives in the (pinned) BPF maps: VIP
//! ids, backend ids and slots. `apply` makes the maps match a config without
//! touching flows, so established connections survive every change; `read`
//! recovers the state after a daemon restart.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddrV4;

use anyhow::{bail, Result};
use libbpf_rs::{MapCore, MapHandle};

use super::config::VipConfig;
use super::maps::*;
use crate::bpfmap::{self, PinDir};
use crate::pod::{addr_of, be_addr, be_port, port_of};

pub const IPPROTO_TCP: u8 = 6;

/// Handles on the balancer's pinned maps.
pub struct LbMaps {
    pub lb_config: MapHandle,
    pub vips: MapHandle,
    pub backends: MapHandle,
    pub vip_backends: MapHandle,
    pub scores: MapHandle,
    pub flows: MapHandle,
    pub nat_back: MapHandle,
    pub backend_stats: MapHandle,
    pub vip_stats: MapHandle,
    pub drops: MapHandle,
    pub control_stats: MapHandle,
}

impl LbMaps {
    pub fn open(dir: &PinDir) -> Result<LbMaps> {
        Ok(LbMaps {
            lb_config: dir.open("lb_config")?,
            vips: dir.open("vips")?,
            backends: dir.open("backends")?,
            vip_backends: dir.open("vip_backends")?,
            scores: dir.open("scores")?,
            flows: dir.open("flows")?,
            nat_back: dir.open("nat_back")?,
            backend_stats: dir.open("backend_stats")?,
            vip_stats: dir.open("vip_stats")?,
            drops: dir.open("drops")?,
            control_stats: dir.open("control_stats")?,
        })
    }
}

pub fn vip_key(ep: SocketAddrV4) -> VipKey {
    VipKey { addr: be_addr(*ep.ip()), port: be_port(ep.port()), proto: IPPROTO_TCP, pad: 0 }
}

/// One VIP as found in the maps.
#[derive(Clone, Debug)]
pub struct VipEntry {
    pub endpoint: SocketAddrV4,
    pub vip: Vip,
    /// (backend id, backend) for slots [0, backend_count).
    pub slots: Vec<(u32, Backend)>,
}

pub fn backend_endpoint(b: &Backend) -> SocketAddrV4 {
    SocketAddrV4::new(addr_of(b.addr), port_of(b.port))
}

/// Reads every VIP with its backends, ordered by VIP id.
pub fn read(maps: &LbMaps) -> Result<Vec<VipEntry>> {
    let mut out = Vec::new();
    for (k, vip) in bpfmap::entries::<VipKey, Vip>(&maps.vips)? {
        let mut slots = Vec::new();
        for slot in 0..u32::from(vip.backend_count).min(MAX_BACKENDS_PER_VIP) {
            let id: u32 = bpfmap::get(&maps.vip_backends, &(vip.id * MAX_BACKENDS_PER_VIP + slot))?.unwrap_or(0);
            let b: Backend = bpfmap::get(&maps.backends, &id)?.unwrap_or_default();
            slots.push((id, b));
        }
        out.push(VipEntry { endpoint: SocketAddrV4::new(addr_of(k.addr), port_of(k.port)), vip, slots });
    }
    out.sort_by_key(|v| v.vip.id);
    Ok(out)
}

/// Makes the maps hold exactly `vips`. Backend ids of backends that stay are
/// kept (their scores, stats and flows stay valid); removed backends keep
/// their `backends` entry with flags 0 so flows still pinned to them find
/// their next hop; new ids never reuse one that a flow may still name.
pub fn apply(maps: &LbMaps, vips: &[VipConfig]) -> Result<()> {
    let current = read(maps)?;
    let mut used_vip_ids: HashSet<u32> = HashSet::new();
    let mut by_ep: HashMap<SocketAddrV4, &VipEntry> = HashMap::new();
    for v in &current {
        by_ep.insert(v.endpoint, v);
    }
    // Ids in use by a configured VIP, to allocate around them.
    let mut live_ids: HashSet<u32> = HashSet::new();
    for v in vips {
        if let Some(e) = by_ep.get(&v.endpoint()) {
            used_vip_ids.insert(e.vip.id);
        }
    }
    let mut allocator = IdAllocator::new(maps)?;

    for v in vips {
        let existing = by_ep.get(&v.endpoint()).copied();
        let vid = match existing {
            Some(e) => e.vip.id,
            None => match (0..MAX_VIPS).find(|i| !used_vip_ids.contains(i)) {
                Some(i) => {
                    used_vip_ids.insert(i);
                    i
                }
                None => bail!("no free VIP id: at most {MAX_VIPS} VIPs"),
            },
        };
        let old: HashMap<SocketAddrV4, u32> =
            existing.map(|e| e.slots.iter().map(|(id, b)| (backend_endpoint(b), *id)).collect()).unwrap_or_default();
        let mut slots = Vec::new();
        for b in &v.backends {
            let ep = SocketAddrV4::new(b.address, b.port);
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
                // A fresh id: no MAC yet (the neighbour resolver fills it) and no stale score.
                entry = Backend { addr: be_addr(b.address), port: be_port(b.port), ..Default::default() };
                bpfmap::put(&maps.scores, &id, &BackendScore::default())?;
            }
            entry.flags = if b.drain { BACKEND_DRAINING } else { BACKEND_ACTIVE };
            bpfmap::put(&maps.backends, &id, &entry)?;
            live_ids.insert(id);
            slots.push(id);
        }
        let key = vip_key(v.endpoint());
        let new = Vip {
            id: vid,
            mode: v.mode as u8,
            policy: v.effective_policy() as u8,
            backend_count: slots.len() as u16,
            probe_interval: v.probe_interval,
            pad: 0,
            score_max_age_ns: v.score_max_age_ms.saturating_mul(1_000_000),
        };
        // Shrink the count before rewriting slots and grow it after, so the
        // data path never reads a slot that is being rewritten as valid.
        let old_count = existing.map(|e| e.vip.backend_count).unwrap_or(0);
        if let Some(e) = existing {
            if usize::from(old_count) > slots.len() {
                bpfmap::put(&maps.vips, &key, &Vip { backend_count: slots.len() as u16, ..e.vip })?;
            }
        }
        if existing.is_some_and(|e| e.vip.mode != new.mode) {
            // Connections counted under the old mode say nothing about load
            // under the new one.
            for id in &slots {
                let mut sc: BackendScore = bpfmap::get(&maps.scores, id)?.unwrap_or_default();
                sc.assigned_since = 0;
                bpfmap::put(&maps.scores, id, &sc)?;
            }
        }
        for (slot, id) in slots.iter().enumerate() {
            bpfmap::put(&maps.vip_backends, &(vid * MAX_BACKENDS_PER_VIP + slot as u32), id)?;
        }
        bpfmap::put(&maps.vips, &key, &new)?;
    }

    let wanted: HashSet<SocketAddrV4> = vips.iter().map(|v| v.endpoint()).collect();
    for e in &current {
        if !wanted.contains(&e.endpoint) {
            bpfmap::delete(&maps.vips, &vip_key(e.endpoint))?;
        }
    }
    // Backends no VIP lists any more become tombstones: no new connections,
    // next hop kept for their flows.
    for e in &current {
        for (id, _) in &e.slots {
            if !live_ids.contains(id) {
                let mut b: Backend = bpfmap::get(&maps.backends, id)?.unwrap_or_default();
                b.flags = 0;
                bpfmap::put(&maps.backends, id, &b)?;
            }
        }
    }
    Ok(())
}

/// Hands out backend ids: first never-used ones, then tombstones that no
/// flow refers to any more.
struct IdAllocator<'a> {
    maps: &'a LbMaps,
    free: Vec<u32>,
    reclaimed: bool,
}

impl<'a> IdAllocator<'a> {
    fn new(maps: &'a LbMaps) -> Result<Self> {
        let mut free = Vec::new();
        for id in (0..MAX_BACKENDS).rev() {
            let b: Backend = bpfmap::get(&maps.backends, &id)?.unwrap_or_default();
            if b == Backend::default() {
                free.push(id);
            }
        }
        Ok(IdAllocator { maps, free, reclaimed: false })
    }

    /// A removed backend (flags 0) with this endpoint, if one is kept.
    fn tombstone(&mut self, ep: SocketAddrV4) -> Result<Option<u32>> {
        for id in 0..MAX_BACKENDS {
            let b: Backend = bpfmap::get(&self.maps.backends, &id)?.unwrap_or_default();
            if b.flags == 0 && b.addr != 0 && backend_endpoint(&b) == ep {
                return Ok(Some(id));
            }
        }
        Ok(None)
    }

    fn take(&mut self) -> Result<u32> {
        if self.free.is_empty() && !self.reclaimed {
            self.reclaimed = true;
            let referenced: HashSet<u32> =
                bpfmap::entries::<FlowKey, Flow>(&self.maps.flows)?.into_iter().map(|(_, f)| f.backend_id).collect();
            for id in (0..MAX_BACKENDS).rev() {
                let b: Backend = bpfmap::get(&self.maps.backends, &id)?.unwrap_or_default();
                if b.flags == 0 && !referenced.contains(&id) {
                    bpfmap::put(&self.maps.backends, &id, &Backend::default())?;
                    self.free.push(id);
                }
            }
        }
        self.free.pop().ok_or_else(|| anyhow::anyhow!("no free backend id: at most {MAX_BACKENDS} backends"))
    }
}

/// The monotonic clock bpf_ktime_get_ns() reads, for score timestamps.
pub fn ktime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn sum_percpu<V: crate::pod::Pod>(map: &dyn MapCore, key: u32, add: impl Fn(&mut V, &V)) -> Result<V> {
    let mut total = V::default();
    for v in bpfmap::get_percpu::<u32, V>(map, &key)? {
        add(&mut total, &v);
    }
    Ok(total)
}

//! `inband lb ctl flow`: which backend a client side's packets go to and
//! why (Katran's `getRealForFlow`). A flow in the tables answers by its
//! entry; for a new one the answer is what `select_backend` (select.h)
//! would pick now, read from the same maps and computed the same way
//! where the pick is a function of them (Maglev, the round-robin ticket,
//! the least loaded per weight). Nothing is written: asking does not take
//! a ticket, a port or an exploration turn.

use std::net::SocketAddr;

use anyhow::{bail, Result};

use super::maglev;
use super::maps::*;
use super::snapshot::load_estimate;
use super::tables::{self, LbMaps, VipEntry};
use inband_core::bpfmap;
use inband_core::lb_control::{FlowCandidate, FlowRoute};
use inband_core::net::Protocol;
use inband_core::pod::{be_ip, be_port, ip_of, port_of, Pod};
use inband_core::shared as c;

const SCAN_MAX: usize = c::INBAND_SCAN_MAX as usize;

pub fn route(maps: &LbMaps, vip: SocketAddr, protocol: Protocol, client: SocketAddr) -> Result<FlowRoute> {
    if vip.is_ipv4() != client.is_ipv4() {
        bail!("client {client} and VIP {vip} are of different address families");
    }
    let vips = tables::read(maps)?;
    let Some(v) = vips.iter().find(|v| v.endpoint == vip && v.protocol == protocol) else {
        bail!("no VIP {} is configured", inband_core::net::vip_name(vip, protocol));
    };
    let key = FlowKey {
        client_addr: be_ip(client.ip()),
        vip_addr: be_ip(vip.ip()),
        client_port: be_port(client.port()),
        vip_port: be_port(vip.port()),
        proto: protocol.number(),
        pad: [0; 3],
    };
    let mut route = FlowRoute {
        vip: v.name(),
        client,
        state: String::new(),
        backend: None,
        snat_port: None,
        why: String::new(),
        candidates: Vec::new(),
    };
    for (map, table) in [(&maps.flows, "the flow table"), (&maps.half_open, "the handshake table")] {
        if let Some(f) = bpfmap::get::<FlowKey, Flow>(map, &key)? {
            return Ok(existing(v, route, &f, table));
        }
    }
    route.state = "new".into();
    new_flow(maps, v, &key, &mut route)?;
    Ok(route)
}

fn existing(v: &VipEntry, mut route: FlowRoute, f: &Flow, table: &str) -> FlowRoute {
    route.state = match f.state {
        FLOW_ESTABLISHED => "established",
        FLOW_CLOSING => "closing",
        FLOW_SYN_SENT => "handshake",
        _ => "unknown",
    }
    .into();
    let backend = SocketAddr::new(ip_of(&f.backend_addr), port_of(f.backend_port));
    route.backend = Some(backend);
    route.snat_port = (f.snat_port != 0).then(|| port_of(f.snat_port));
    let mode = Mode::from_u8(f.mode).map_or("unknown", Mode::name);
    let now = v.slots.iter().find(|(id, _)| *id == u32::from(f.backend_id)).map(|(_, b)| b);
    let standing = match now {
        Some(b) if backend_removed(b) => "; the backend has been removed since: the flow ends when the backend's drain does",
        Some(b) if b.flags & BACKEND_DOWN != 0 && v.vip.flags & VIP_RESET_DOWN != 0 => {
            "; the backend is down by its health checks and on_down = \"reset\": the client's next packet gets a RST"
        }
        Some(b) if b.flags & BACKEND_DOWN != 0 => "; the backend is down by its health checks, and the flow goes on (on_down = \"keep\")",
        Some(b) if b.flags & BACKEND_DRAINING != 0 => "; the backend is draining: it keeps this flow and gets no new ones",
        _ => "",
    };
    route.why = format!("in {table} (backend id {}, chosen when it started, in {mode}): every packet of it goes there{standing}", f.backend_id);
    route
}

/// One slot of the VIP as `active_slot` (select.h) sees it.
struct Slot {
    id: u32,
    endpoint: SocketAddr,
    eligible: bool,
    weight: u32,
    estimate: u64,
    /// When it was last given a new connection: ties go to the earliest.
    picked_ns: u64,
}

fn new_flow(maps: &LbMaps, v: &VipEntry, key: &FlowKey, route: &mut FlowRoute) -> Result<()> {
    let now = tables::ktime_ns();
    let mut slots = Vec::with_capacity(v.slots.len());
    for (id, b) in &v.slots {
        let s: BackendScore = bpfmap::get(&maps.scores, id)?.unwrap_or_default();
        let eligible = b.flags & (BACKEND_ACTIVE | BACKEND_DOWN) == BACKEND_ACTIVE;
        let why_not = if b.flags & BACKEND_DOWN != 0 {
            Some("down by its health checks")
        } else if b.flags & BACKEND_ACTIVE == 0 {
            Some(if backend_removed(b) { "removed" } else { "draining or weight 0" })
        } else {
            None
        };
        let estimate = load_estimate(&s, now, v.vip.score_max_age_ns);
        let weight = b.weight.max(1);
        route.candidates.push(FlowCandidate {
            backend: tables::backend_endpoint(b),
            eligible,
            why_not: why_not.map(str::to_string),
            weight: b.weight,
            load_estimate: estimate,
        });
        slots.push(Slot { id: *id, endpoint: tables::backend_endpoint(b), eligible, weight, estimate, picked_ns: s.picked_ns });
    }
    let eligible: Vec<&Slot> = slots.iter().filter(|s| s.eligible).collect();
    if eligible.is_empty() {
        route.why = if v.vip.flags & VIP_REFUSE_EMPTY != 0 {
            "no backend can take a new connection: the SYN is answered with a RST (all_down = \"refuse\")".into()
        } else {
            "no backend can take a new connection: the packet is dropped (no_backend)".into()
        };
        return Ok(());
    }
    let mode = Mode::from_u8(v.vip.mode);
    let by_score = mode.is_some_and(Mode::scored);
    let large = slots.len() > SCAN_MAX;
    let weighted = v.vip.flags & VIP_WEIGHTED != 0;
    let explore = explorable(maps, &eligible)?;
    let (backend, why) = match Policy::from_u8(v.vip.policy) {
        Some(p @ (Policy::LeastScore | Policy::PowerOfTwo)) if by_score => {
            if let Some(s) = explore {
                (Some(s.endpoint), "its score is stale and it holds an exploration ticket: the next new connection goes there whatever the estimates say".to_string())
            } else {
                let best = lightest(&eligible);
                let how = if p == Policy::LeastScore && !large {
                    format!("least-score: the lightest of {} eligible backends by (estimate + 1) / weight; a tie goes to the one given a connection least recently", eligible.len())
                } else {
                    format!(
                        "{}: two eligible backends drawn at random{}, the lighter by (estimate + 1) / weight wins (a tie: the one given a connection least recently); the lightest of all is shown",
                        if p == Policy::LeastScore { "least-score over a large VIP" } else { "power-of-two" },
                        if weighted && large { " in proportion to weight" } else { "" }
                    )
                };
                (Some(best.endpoint), how)
            }
        }
        Some(Policy::LeastConnections) => {
            let best = lightest(&eligible);
            let how = if large {
                format!(
                    "least-connections over a large VIP: two eligible backends drawn at random{}, the one with fewer connections per weight wins; the lightest of all is shown",
                    if weighted { " in proportion to weight" } else { "" }
                )
            } else {
                format!("least-connections: the lightest of {} eligible backends by (connections opened here and not yet closed + 1) / weight; a tie goes to the one given a connection least recently", eligible.len())
            };
            (Some(best.endpoint), how)
        }
        Some(Policy::Maglev) => {
            let h = maglev::flow_hash(key.as_bytes());
            let entry = maglev_entry(maps, v.vip.maglev_table, h)?;
            match entry.and_then(|e| slots.get(e as usize)).filter(|s| s.eligible) {
                Some(s) => (Some(s.endpoint), format!("maglev: the client side hashes to entry {} of table {}, which names it", h % maglev_size(maps)?, v.vip.maglev_table)),
                None => {
                    let next = if large {
                        eligible_from(maps, v, h as u32)?
                    } else {
                        let start = entry.map_or(0, |e| e as usize + 1);
                        (0..slots.len().min(SCAN_MAX)).map(|i| &slots[(start + i) % slots.len()]).find(|s| s.eligible).map(|s| s.endpoint)
                    };
                    (next, "maglev: the client side's entry names a backend that cannot take it now, so the next eligible one takes it".into())
                }
            }
        }
        policy => {
            let cursor: u32 = bpfmap::get(&maps.rr_cursor, &v.id)?.unwrap_or(0);
            let fallback = if matches!(policy, Some(Policy::LeastScore | Policy::PowerOfTwo)) {
                format!(" ({} has no scores to rank by in this mode)", mode.map_or("this mode", Mode::name))
            } else {
                String::new()
            };
            let taken = if weighted {
                maglev_entry(maps, v.vip.maglev_table, u64::from(cursor))?.and_then(|e| slots.get(e as usize)).filter(|s| s.eligible)
            } else {
                None
            };
            let next = match taken {
                Some(s) => Some(s.endpoint),
                None if large => eligible_from(maps, v, cursor)?,
                None => (0..slots.len().min(SCAN_MAX)).map(|i| &slots[(cursor as usize + i) % slots.len()]).find(|s| s.eligible).map(|s| s.endpoint),
            };
            (next, format!("round-robin{fallback}: the next new connection takes ticket {cursor}, which names this backend; any connection before it moves the turn on"))
        }
    };
    route.backend = backend;
    route.why = why;
    if v.vip.flags & VIP_QUIC != 0 {
        route.why.push_str("; QUIC packets whose connection ID names a server go to that server instead");
    }
    Ok(())
}

/// The eligible backend with a pending exploration ticket that a walk
/// meets first (`explore` in select.h), if any.
fn explorable<'a>(maps: &LbMaps, eligible: &[&'a Slot]) -> Result<Option<&'a Slot>> {
    for s in eligible {
        if bpfmap::get::<u32, u32>(&maps.probe_due, &s.id)?.is_some_and(|d| d & c::INBAND_EXPLORE != 0) {
            return Ok(Some(s));
        }
    }
    Ok(None)
}

/// The lightest by (estimate + 1) / weight, compared as `cmp_load` does.
fn lightest<'a>(eligible: &[&'a Slot]) -> &'a Slot {
    let key = |s: &Slot| (u128::from(s.estimate) + 1, u128::from(s.weight));
    eligible
        .iter()
        .copied()
        .reduce(|best, s| {
            let ((a, wa), (b, wb)) = (key(s), key(best));
            if (a * wb, s.picked_ns) < (b * wa, best.picked_ns) {
                s
            } else {
                best
            }
        })
        .expect("called with at least one eligible backend")
}

fn maglev_size(maps: &LbMaps) -> Result<u64> {
    let cfg: DataPathConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    Ok(u64::from(cfg.maglev_size.max(1)))
}

/// The slot entry `i` of Maglev table `table` names (`maglev_entry`).
fn maglev_entry(maps: &LbMaps, table: u32, i: u64) -> Result<Option<u32>> {
    let size = maglev_size(maps)?;
    let idx = table.wrapping_mul(size as u32).wrapping_add((i % size) as u32);
    Ok(bpfmap::get::<u32, u32>(&maps.maglev, &idx)?)
}

/// Large VIPs: the first eligible entry of the dense set from `start`
/// (`eligible_step`).
fn eligible_from(maps: &LbMaps, v: &VipEntry, start: u32) -> Result<Option<SocketAddr>> {
    let n = u32::from(v.vip.eligible_count);
    let Some(set) = bpfmap::get::<u32, VipEligible>(&maps.vip_eligible, &v.id)? else { return Ok(None) };
    if n == 0 {
        return Ok(None);
    }
    for i in 0..SCAN_MAX as u32 {
        let slot = set.slot[(start.wrapping_add(i) % n) as usize] as usize;
        if let Some((_, b)) = v.slots.get(slot) {
            if b.flags & (BACKEND_ACTIVE | BACKEND_DOWN) == BACKEND_ACTIVE {
                return Ok(Some(tables::backend_endpoint(b)));
            }
        }
    }
    Ok(None)
}

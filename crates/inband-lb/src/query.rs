//! dsr-query, the seed paper's "request busyness" baseline: the balancer
//! asks the backends for their load before it forwards a new connection.
//!
//! The data path cannot hold a packet, so it hands each new SYN of a
//! dsr-query VIP to this worker through `query_ring` and drops it
//! (lb/query.h). The worker asks the VIP's active backends for their scores
//! with the polling protocol, writes the answers into `scores`, marks the
//! connection in `query_done` and runs the SYN through the attached
//! program again as a live frame received on the balancer's interface; the
//! program then balances it on the fresh scores and sends it on (XDP_TX).
//!
//! SYNs that arrive while a query is out wait for the next one: every SYN
//! is balanced on answers sent after it arrived, as the paper's baseline
//! implies, but one round of queries serves every SYN held meanwhile (the
//! paper's one-request-per-connection would only add packets and queueing
//! under load, making the baseline weaker than it has to be).
//!
//! A backend that does not answer within the VIP's `query_timeout_ms` keeps
//! its last score; the SYN goes ahead on what came (`query_timeouts`).
//!
//! A dsr-dynamic VIP with `query_when_stale` hands over only the SYNs that
//! find every score of the VIP stale (after a pause): the same worker asks
//! for them.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tracing::warn;

use super::config::LbConfig;
use super::maps::{ControlStats, Mode, QueryReq, BACKEND_ACTIVE};
use super::polling::{self, Asker};
use super::tables::{self, LbMaps};
use inband_core::bpfmap;
use inband_core::pod::Pod;

/// Who answers for one VIP, and how long its SYNs may wait.
struct VipTargets {
    targets: polling::Targets,
    wait: Duration,
}

pub fn run(maps: &LbMaps, prog: OwnedFd, interface: &str, cfg: &Arc<Mutex<LbConfig>>, stop: &AtomicBool) -> Result<()> {
    let ifindex = inband_core::netif::ifindex(interface)?;
    let asker = Asker::new(&cfg.lock().unwrap())?;
    let held: Arc<Mutex<Vec<QueryReq>>> = Arc::default();
    let mut builder = libbpf_rs::RingBufferBuilder::new();
    let sink = Arc::clone(&held);
    builder
        .add(&maps.query_ring, move |d: &[u8]| {
            sink.lock().unwrap().push(QueryReq::from_bytes(d));
            0
        })
        .context("reading query_ring")?;
    let ring = builder.build().context("reading query_ring")?;
    while !stop.load(Ordering::Relaxed) {
        ring.poll(Duration::from_millis(100)).context("polling query_ring")?;
        let batch = std::mem::take(&mut *held.lock().unwrap());
        if batch.is_empty() {
            continue;
        }
        let mut stats = ControlStats::default();
        answer(maps, &asker, &prog, ifindex, cfg, &batch, &mut stats)?;
        polling::add_control_stats(maps, &stats)?;
    }
    Ok(())
}

/// One round: asks every backend of the VIPs in `batch`, then lets each SYN
/// go on the fresh scores.
fn answer(
    maps: &LbMaps,
    asker: &Asker,
    prog: &OwnedFd,
    ifindex: u32,
    cfg: &Arc<Mutex<LbConfig>>,
    batch: &[QueryReq],
    stats: &mut ControlStats,
) -> Result<()> {
    let vip_ids: HashSet<u32> = batch.iter().map(|r| r.vip_id).collect();
    let per_vip = targets(maps, &cfg.lock().unwrap(), &vip_ids)?;
    let mut all = polling::Targets::new();
    let mut wait = Duration::ZERO;
    for t in per_vip.values() {
        for (k, ids) in &t.targets {
            all.entry(*k).or_default().extend(ids);
        }
        wait = wait.max(t.wait);
    }
    let silent: HashSet<(SocketAddr, u16)> = polling::poll_round(maps, asker, &all, wait, stats)?.into_iter().collect();
    for r in batch {
        stats.queries += 1;
        if per_vip.get(&r.vip_id).is_some_and(|t| t.targets.keys().any(|k| silent.contains(k))) {
            stats.query_timeouts += 1;
        }
        bpfmap::put(&maps.query_done, &r.key, &tables::ktime_ns())?;
        let frame = &r.frame[..(r.len as usize).min(r.frame.len())];
        if let Err(e) = inband_core::xdp_live::run(prog.as_fd(), ifindex, frame, 1) {
            // The client retransmits its SYN; the mark lets that one through.
            warn!(error = %format!("{e:#}"), "re-running a queried SYN failed");
        }
        stats.query_ns += tables::ktime_ns().saturating_sub(r.held_ns);
    }
    Ok(())
}

/// The active backends of each querying VIP among `ids` (dsr-query, or
/// dsr-dynamic with `query_when_stale`), by agent poll port, and the VIP's
/// query timeout. A VIP that no longer queries (the mode changed while its
/// SYN was queued) gets no targets: its SYN goes on at once.
fn targets(maps: &LbMaps, cfg: &LbConfig, ids: &HashSet<u32>) -> Result<HashMap<u32, VipTargets>> {
    let mut out = HashMap::new();
    for e in tables::read(maps)? {
        if !ids.contains(&e.id) {
            continue;
        }
        let Some(v) = cfg.vips.iter().find(|v| v.endpoint() == e.endpoint && v.protocol == e.protocol) else { continue };
        let mut t = VipTargets { targets: HashMap::new(), wait: Duration::from_millis(v.query_timeout_ms) };
        if v.mode == Mode::DsrQuery || v.mode == Mode::DsrDynamic && v.query_when_stale {
            for (id, b) in &e.slots {
                if b.flags & BACKEND_ACTIVE != 0 {
                    t.targets.entry((tables::backend_endpoint(b), v.poll_port)).or_default().push(*id);
                }
            }
        }
        out.insert(e.id, t);
    }
    Ok(out)
}

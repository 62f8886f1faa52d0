//! A point-in-time view of a balancer read from its pinned maps: what
//! `inband status` prints and the metrics endpoint exports. Reading needs
//! only the pins, not the daemon.

use std::collections::BTreeMap;

use anyhow::Result;
use serde::Serialize;

use super::maps::*;
use super::tables::{self, LbMaps};
use crate::bpfmap;
use crate::pod::addr_of;

#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub interface: String,
    pub address: String,
    pub flows: usize,
    pub vips: Vec<VipSnapshot>,
    pub drops: BTreeMap<&'static str, u64>,
    pub control: ControlStats,
}

#[derive(Debug, Serialize)]
pub struct VipSnapshot {
    pub vip: String,
    pub mode: &'static str,
    pub policy: &'static str,
    pub probe_interval: u32,
    pub score_max_age_ms: u64,
    pub stats: VipStats,
    pub backends: Vec<BackendSnapshot>,
}

#[derive(Debug, Serialize)]
pub struct BackendSnapshot {
    pub id: u32,
    pub backend: String,
    pub state: &'static str,
    pub mac: String,
    pub score: Option<u32>,
    /// Milliseconds since the score was measured; `None` = never.
    pub score_age_ms: Option<u64>,
    pub stale: bool,
    pub assigned_since_score: u32,
    pub stats: BackendStats,
}

fn add_backend(t: &mut BackendStats, v: &BackendStats) {
    t.packets += v.packets;
    t.bytes += v.bytes;
    t.return_packets += v.return_packets;
    t.return_bytes += v.return_bytes;
    t.new_conns += v.new_conns;
    t.probes_sent += v.probes_sent;
    t.scores_received += v.scores_received;
}

fn add_vip(t: &mut VipStats, v: &VipStats) {
    t.packets += v.packets;
    t.bytes += v.bytes;
    t.return_packets += v.return_packets;
    t.return_bytes += v.return_bytes;
    t.new_conns += v.new_conns;
}

pub fn take(interface: &str, maps: &LbMaps) -> Result<Snapshot> {
    let now = tables::ktime_ns();
    let cfg: LbConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    let mut vips = Vec::new();
    for v in tables::read(maps)? {
        let mut backends = Vec::new();
        for (id, b) in &v.slots {
            let s: BackendScore = bpfmap::get(&maps.scores, id)?.unwrap_or_default();
            let age = (s.updated_ns != 0).then(|| now.saturating_sub(s.updated_ns));
            backends.push(BackendSnapshot {
                id: *id,
                backend: tables::backend_endpoint(b).to_string(),
                state: match b.flags {
                    BACKEND_ACTIVE => "active",
                    BACKEND_DRAINING => "draining",
                    _ => "removed",
                },
                mac: crate::netif::format_mac(&b.mac),
                score: age.map(|_| s.score),
                score_age_ms: age.map(|a| a / 1_000_000),
                stale: age.map_or(true, |a| a > v.vip.score_max_age_ns),
                assigned_since_score: s.assigned_since,
                stats: tables::sum_percpu(&maps.backend_stats, *id, add_backend)?,
            });
        }
        vips.push(VipSnapshot {
            vip: v.endpoint.to_string(),
            mode: Mode::from_u8(v.vip.mode).map_or("unknown", Mode::name),
            policy: Policy::from_u8(v.vip.policy).map_or("unknown", Policy::name),
            probe_interval: v.vip.probe_interval,
            score_max_age_ms: v.vip.score_max_age_ns / 1_000_000,
            stats: tables::sum_percpu(&maps.vip_stats, v.vip.id, add_vip)?,
            backends,
        });
    }
    let mut drops = BTreeMap::new();
    for r in DropReason::ALL {
        let per_cpu: Vec<u64> = bpfmap::get_percpu(&maps.drops, &(r as u32))?;
        drops.insert(r.name(), per_cpu.iter().sum());
    }
    Ok(Snapshot {
        interface: interface.to_string(),
        address: addr_of(cfg.self_addr).to_string(),
        flows: bpfmap::count(&maps.flows),
        vips,
        drops,
        control: bpfmap::get(&maps.control_stats, &0u32)?.unwrap_or_default(),
    })
}

/// The human view: one block per VIP, one row per backend.
pub fn render_table(s: &Snapshot) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "balancer on {} ({}), {} flows in table", s.interface, s.address, s.flows);
    for v in &s.vips {
        let _ = writeln!(
            o,
            "\nVIP {}  mode {}  policy {}  probe every {} pkts  score max age {} ms  conns {}  pkts in {} / back {}",
            v.vip, v.mode, v.policy, v.probe_interval, v.score_max_age_ms, v.stats.new_conns, v.stats.packets, v.stats.return_packets
        );
        let _ = writeln!(
            o,
            "  {:<4} {:<22} {:<9} {:>6} {:>9} {:>6} {:>8} {:>10} {:>12} {:>10} {:>8} {:>7}",
            "id", "backend", "state", "score", "age ms", "stale", "conns", "pkts", "bytes", "back pkts", "probes", "scores"
        );
        for b in &v.backends {
            let _ = writeln!(
                o,
                "  {:<4} {:<22} {:<9} {:>6} {:>9} {:>6} {:>8} {:>10} {:>12} {:>10} {:>8} {:>7}",
                b.id,
                b.backend,
                b.state,
                b.score.map_or("-".into(), |x| x.to_string()),
                b.score_age_ms.map_or("-".into(), |x| x.to_string()),
                if b.stale { "yes" } else { "no" },
                b.stats.new_conns,
                b.stats.packets,
                b.stats.bytes,
                b.stats.return_packets,
                b.stats.probes_sent,
                b.stats.scores_received
            );
        }
    }
    let c = &s.control;
    let _ = writeln!(
        o,
        "\npolling: {} requests, {} replies, {} failures, {} bytes",
        c.polls_sent, c.poll_replies, c.poll_failures, c.poll_bytes
    );
    let nonzero: Vec<String> = s.drops.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k}={n}")).collect();
    let _ = writeln!(o, "drops: {}", if nonzero.is_empty() { "none".into() } else { nonzero.join(" ") });
    o
}

/// Prometheus text exposition of the same numbers.
pub fn render_prometheus(s: &Snapshot) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "# TYPE inband_flows gauge\ninband_flows{{interface=\"{}\"}} {}", s.interface, s.flows);
    let vip_counters: [(&str, fn(&VipStats) -> u64); 5] = [
        ("inband_vip_packets_total", |v| v.packets),
        ("inband_vip_bytes_total", |v| v.bytes),
        ("inband_vip_return_packets_total", |v| v.return_packets),
        ("inband_vip_return_bytes_total", |v| v.return_bytes),
        ("inband_vip_connections_total", |v| v.new_conns),
    ];
    for (name, f) in vip_counters {
        let _ = writeln!(o, "# TYPE {name} counter");
        for v in &s.vips {
            let _ = writeln!(o, "{name}{{vip=\"{}\",mode=\"{}\"}} {}", v.vip, v.mode, f(&v.stats));
        }
    }
    let be_counters: [(&str, fn(&BackendStats) -> u64); 7] = [
        ("inband_backend_packets_total", |b| b.packets),
        ("inband_backend_bytes_total", |b| b.bytes),
        ("inband_backend_return_packets_total", |b| b.return_packets),
        ("inband_backend_return_bytes_total", |b| b.return_bytes),
        ("inband_backend_connections_total", |b| b.new_conns),
        ("inband_backend_probes_total", |b| b.probes_sent),
        ("inband_backend_scores_total", |b| b.scores_received),
    ];
    for (name, f) in be_counters {
        let _ = writeln!(o, "# TYPE {name} counter");
        for v in &s.vips {
            for b in &v.backends {
                let _ = writeln!(o, "{name}{{vip=\"{}\",backend=\"{}\"}} {}", v.vip, b.backend, f(&b.stats));
            }
        }
    }
    let _ = writeln!(o, "# TYPE inband_backend_score gauge");
    for v in &s.vips {
        for b in &v.backends {
            if let Some(score) = b.score {
                let _ = writeln!(o, "inband_backend_score{{vip=\"{}\",backend=\"{}\"}} {score}", v.vip, b.backend);
            }
        }
    }
    let _ = writeln!(o, "# TYPE inband_drops_total counter");
    for (k, n) in &s.drops {
        let _ = writeln!(o, "inband_drops_total{{reason=\"{k}\"}} {n}");
    }
    let c = &s.control;
    let _ = writeln!(o, "# TYPE inband_poll_requests_total counter\ninband_poll_requests_total {}", c.polls_sent);
    let _ = writeln!(o, "# TYPE inband_poll_replies_total counter\ninband_poll_replies_total {}", c.poll_replies);
    let _ = writeln!(o, "# TYPE inband_poll_bytes_total counter\ninband_poll_bytes_total {}", c.poll_bytes);
    o
}

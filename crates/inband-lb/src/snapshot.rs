//! A point-in-time view of a balancer read from its pinned maps: what
//! `inband status` prints and the metrics endpoint exports. Reading needs
//! only the pins, not the daemon, and never walks the flow tables: flow
//! counts come from the gauges the sweeper writes each pass.

use std::collections::BTreeMap;

use anyhow::Result;
use libbpf_rs::MapCore;
use serde::Serialize;

use super::maps::*;
use super::tables::{self, LbMaps};
use inband_core::bpfmap;
use inband_core::prog_stats::{self, ProgStats};
use inband_core::pod::ip_of;

#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub interface: String,
    /// The network namespace the balancer runs in ("" = the host's).
    pub netns: String,
    pub address: String,
    pub mtu: u16,
    pub auth: &'static str,
    /// `[scale_out]`: the SIDs the router reaches this instance at and
    /// the one strays are chained to; None when it runs alone.
    pub scale_out: Option<ScaleOut>,
    /// Live established + closing flows at the last sweep.
    pub flows: u64,
    pub flow_table: FlowTable,
    pub vips: Vec<VipSnapshot>,
    pub drops: BTreeMap<&'static str, u64>,
    pub events: BTreeMap<&'static str, u64>,
    pub control: Control,
    /// Whether the kernel counts programs' run time now (`bpf_stats`).
    pub bpf_stats: bool,
    /// The balancer's programs: the XDP program attached to the interface
    /// (and, from the daemon, the sweeper), with the kernel's counts.
    pub programs: Vec<ProgStats>,
}

#[derive(Debug, Serialize)]
pub struct ScaleOut {
    pub sid: String,
    pub direct_sid: String,
    pub shadow_sid: String,
    /// Fleet tuples: the fleet's prefix (none: off).
    pub fleet_prefix: Option<String>,
    /// Strays of fleet connections adopted a second per CPU at most.
    pub adopt_per_s: u32,
}

#[derive(Debug, Serialize)]
pub struct FlowTable {
    pub established: u64,
    pub closing: u64,
    pub half_open: u64,
    /// Entries `flows` and `half_open` hold at most (`flow_table_size`
    /// and its quarter): what the counts above fill.
    pub capacity: u64,
    pub half_open_capacity: u64,
    pub snat_reservations: u64,
    pub sweeps: u64,
    /// Milliseconds since the last sweep; `None` = never swept (no daemon
    /// has run since the data path was attached).
    pub last_sweep_ms_ago: Option<u64>,
    pub last_sweep_duration_us: u64,
}

#[derive(Debug, Serialize)]
pub struct Control {
    pub polls_sent: u64,
    pub poll_replies: u64,
    pub poll_bytes: u64,
    pub poll_failures: u64,
    /// Replies refused: bad MAC, unknown key, or the other `[auth]` format.
    pub poll_unauthenticated: u64,
    /// dsr-query: SYNs held for a query, queries that timed out, and the
    /// mean time a SYN was held.
    pub queries: u64,
    pub query_timeouts: u64,
    pub query_mean_us: u64,
    /// Times a backend was found losing inband options (then polled), and
    /// times such a backend was given options again to test its path.
    pub options_lost: u64,
    pub options_retried: u64,
    /// Announced choices ([scale_out] peers).
    pub peers: PeerStats,
    /// Flow moves ([moves]).
    pub moves: MoveStats,
}

/// Announced choices: what this instance sent its peers and took from them
/// (peers.rs), and the datagrams it refused, by reason.
#[derive(Debug, Default, Serialize)]
pub struct PeerStats {
    pub datagrams_sent: u64,
    pub records_sent: u64,
    pub send_failures: u64,
    pub records_learned: u64,
    pub unknown_sender: u64,
    pub malformed: u64,
    pub bad_mac: u64,
    pub replayed: u64,
}

/// Flow moves (moves.rs): the flows moved, and the requests dropped
/// unanswered or refused, by reason.
#[derive(Debug, Default, Serialize)]
pub struct MoveStats {
    pub moved: u64,
    pub malformed: u64,
    pub bad_mac: u64,
    pub unknown_sender: u64,
    pub replayed: u64,
    pub no_flow: u64,
    pub not_owner: u64,
    pub not_a_backend: u64,
    pub port_in_use: u64,
    pub refused: u64,
}

impl MoveStats {
    /// The requests not taken, by reason as the metrics label them.
    pub fn refusals(&self) -> [(&'static str, u64); 9] {
        [
            ("malformed", self.malformed),
            ("bad_mac", self.bad_mac),
            ("unknown_sender", self.unknown_sender),
            ("replayed", self.replayed),
            ("no_flow", self.no_flow),
            ("not_owner", self.not_owner),
            ("not_a_backend", self.not_a_backend),
            ("port_in_use", self.port_in_use),
            ("refused", self.refused),
        ]
    }
}

#[derive(Debug, Serialize)]
pub struct VipSnapshot {
    pub vip: String,
    pub state: &'static str,
    /// Draining with a deadline: seconds until its remaining flows are ended.
    pub drain_left_s: Option<u64>,
    pub protocol: &'static str,
    pub quic: bool,
    pub mode: &'static str,
    pub policy: &'static str,
    /// Its active backends' weights differ (round-robin then walks the
    /// Maglev table).
    pub weighted: bool,
    pub probe_interval: u32,
    pub probe_interval_max: u32,
    /// Score requests a second per backend at most; 0 = no bound.
    pub probe_budget: u32,
    pub score_max_age_ms: u64,
    /// dsr-dynamic: a SYN that finds every score stale waits for a query.
    pub query_when_stale: bool,
    pub syn_timeout_ms: u64,
    pub idle_timeout_s: u64,
    pub closing_timeout_ms: u64,
    /// `[vip.health]`: flows of a down backend are reset (else kept), and
    /// a SYN no backend can take is refused with a RST (else dropped).
    pub on_down: &'static str,
    pub all_down: &'static str,
    pub flows: u64,
    pub stats: Counters,
    pub backends: Vec<BackendSnapshot>,
}

#[derive(Debug, Serialize)]
pub struct BackendSnapshot {
    pub id: u32,
    pub backend: String,
    pub state: &'static str,
    pub drain_left_s: Option<u64>,
    /// Its capacity relative to the VIP's other backends (0: no new
    /// connections; it shows as draining).
    pub weight: u32,
    pub mac: String,
    /// The path to it loses inband options (found by the daemon): no
    /// option is sent to it, and it is polled for its score instead.
    pub options_lost: bool,
    /// Options travel to it inside IP-in-IP (`encap = "ipip"`).
    pub encap: bool,
    pub quic_server_id: Option<u16>,
    /// dsr-dynamic: packets between score requests now (the adaptive n).
    pub probe_interval_now: u32,
    /// Score requests sent since the last score taken.
    pub unanswered_probes: u32,
    pub score: Option<u32>,
    /// Milliseconds since the score was measured; `None` = never.
    pub score_age_ms: Option<u64>,
    pub stale: bool,
    pub opened_since_score: u32,
    pub closed_since_score: u32,
    /// What least-score and power-of-two rank by (select.h).
    pub load_estimate: u64,
    pub flows: u64,
    pub health: HealthView,
    pub stats: Counters,
}

/// A backend's health as the lb daemon's checker last judged it.
#[derive(Debug, Serialize)]
pub struct HealthView {
    /// "up", "down", or "unchecked" (no verdict yet, or checks off: taken as up).
    pub state: &'static str,
    /// Why (health.rs): passing, refused, timeout, bad_status, passive_refused, ...
    pub reason: &'static str,
    /// Down, but taking connections: every backend of its VIP is down and
    /// the VIP fails open.
    pub failing_open: bool,
    /// Unix time (ms) of the last change of state; 0 = none yet.
    pub since_ms: u64,
    /// Seconds since then.
    pub for_s: Option<u64>,
    /// The HTTP status the last check saw, if any.
    pub last_status: Option<u16>,
    pub in_a_row: u32,
    pub checks_passed: u64,
    pub checks_failed: u64,
    pub transitions: u64,
    pub passive_ejections: u64,
}

impl HealthView {
    fn of(h: &BackendHealth, flags: u16, now_ms: u64) -> HealthView {
        let state = match h.state {
            HEALTH_UP => "up",
            HEALTH_DOWN => "down",
            _ => "unchecked",
        };
        HealthView {
            state,
            reason: health_reason_name(h.reason),
            failing_open: h.state == HEALTH_DOWN && flags & BACKEND_DOWN == 0 && flags & BACKEND_ACTIVE != 0,
            since_ms: h.since_ms,
            for_s: (h.since_ms != 0).then(|| now_ms.saturating_sub(h.since_ms) / 1000),
            last_status: (h.last_status != 0).then_some(h.last_status),
            in_a_row: h.in_a_row,
            checks_passed: h.checks_passed,
            checks_failed: h.checks_failed,
            transitions: h.transitions,
            passive_ejections: h.passive_ejections,
        }
    }
}

/// Named counters of a per-CPU stats struct, summed over CPUs.
pub type Counters = BTreeMap<&'static str, u64>;

/// The load estimate the data path ranks by: the report, halved for every
/// max age it is old, plus connections opened minus ended since.
pub fn load_estimate(s: &BackendScore, now: u64, max_age_ns: u64) -> u64 {
    let mut base = u64::from(s.score);
    if s.updated_ns != 0 && max_age_ns != 0 && now > s.updated_ns + max_age_ns {
        let halvings = (now - s.updated_ns) / max_age_ns;
        base = if halvings >= 32 { 0 } else { base >> halvings };
    }
    (base + u64::from(s.opened)).saturating_sub(u64::from(s.closed))
}

fn drain_left(deadline: u64, now: u64) -> Option<u64> {
    (deadline != 0).then(|| deadline.saturating_sub(now) / 1_000_000_000)
}

fn live(g: FlowGauges) -> u64 {
    g.established + g.closing
}

pub fn take(interface: &str, maps: &LbMaps) -> Result<Snapshot> {
    let now = tables::ktime_ns();
    let wall_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let cfg: DataPathConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    let mut vips = Vec::new();
    for v in tables::read(maps)? {
        let mut backends = Vec::new();
        for (id, b) in &v.slots {
            let s: BackendScore = bpfmap::get(&maps.scores, id)?.unwrap_or_default();
            let age = (s.updated_ns != 0).then(|| now.saturating_sub(s.updated_ns));
            let stats = tables::sum_percpu::<BackendStats>(&maps.backend_stats, *id)?;
            let health: BackendHealth = bpfmap::get(&maps.backend_health, id)?.unwrap_or_default();
            backends.push(BackendSnapshot {
                id: *id,
                backend: tables::backend_endpoint(b).to_string(),
                state: if b.flags & BACKEND_ACTIVE != 0 {
                    "active"
                } else if b.flags & BACKEND_DRAINING != 0 {
                    "draining"
                } else {
                    "removed"
                },
                drain_left_s: drain_left(b.drain_deadline_ns, now),
                weight: b.weight,
                mac: inband_core::netif::format_mac(&b.mac),
                options_lost: b.flags & BACKEND_OPTIONS_LOST != 0,
                encap: b.flags & BACKEND_ENCAP != 0,
                quic_server_id: (b.quic_server_id != 0).then_some(b.quic_server_id),
                probe_interval_now: if s.interval != 0 { s.interval } else { v.vip.probe_interval },
                unanswered_probes: s.unanswered,
                score: age.map(|_| s.score),
                score_age_ms: age.map(|a| a / 1_000_000),
                stale: age.map_or(true, |a| a > v.vip.score_max_age_ns),
                opened_since_score: s.opened,
                closed_since_score: s.closed,
                load_estimate: load_estimate(&s, now, v.vip.score_max_age_ns),
                flows: live(tables::gauge(maps, GAUGE_BACKEND0 + id)?),
                health: HealthView::of(&health, b.flags, wall_ms),
                stats: stats.named().into_iter().collect(),
            });
        }
        let stats = tables::sum_percpu::<VipStats>(&maps.vip_stats, v.id)?;
        vips.push(VipSnapshot {
            vip: v.name(),
            state: if v.draining() { "draining" } else { "active" },
            drain_left_s: drain_left(v.vip.drain_deadline_ns, now),
            protocol: v.protocol.name(),
            quic: v.vip.flags & VIP_QUIC != 0,
            mode: Mode::from_u8(v.vip.mode).map_or("unknown", Mode::name),
            policy: Policy::from_u8(v.vip.policy).map_or("unknown", Policy::name),
            weighted: v.vip.flags & VIP_WEIGHTED != 0,
            probe_interval: v.vip.probe_interval,
            probe_interval_max: v.vip.probe_interval_max,
            probe_budget: v.vip.probe_budget,
            score_max_age_ms: v.vip.score_max_age_ns / 1_000_000,
            query_when_stale: v.vip.flags & VIP_QUERY_STALE != 0,
            syn_timeout_ms: v.vip.syn_timeout_ns / 1_000_000,
            idle_timeout_s: v.vip.idle_timeout_ns / 1_000_000_000,
            closing_timeout_ms: v.vip.closing_timeout_ns / 1_000_000,
            on_down: if v.vip.flags & VIP_RESET_DOWN != 0 { "reset" } else { "keep" },
            all_down: if v.vip.flags & VIP_REFUSE_EMPTY != 0 { "refuse" } else { "fail-open" },
            flows: live(tables::gauge(maps, GAUGE_VIP0 + v.id)?),
            stats: stats.named().into_iter().collect(),
            backends,
        });
    }
    let named = |map, names: &'static [&'static str]| -> Result<BTreeMap<&'static str, u64>> {
        Ok(names.iter().copied().zip(tables::counters(map, names.len())?).collect())
    };
    let total = tables::gauge(maps, GAUGE_TOTAL)?;
    let sweep: SweepStats = bpfmap::get(&maps.sweep_stats, &0u32)?.unwrap_or_default();
    let control: ControlStats = bpfmap::get(&maps.control_stats, &0u32)?.unwrap_or_default();
    Ok(Snapshot {
        interface: interface.to_string(),
        netns: inband_core::bpfmap::current_netns_name().unwrap_or_default(),
        address: [cfg.self4, cfg.self6]
            .iter()
            .filter(|a| **a != Addr::default())
            .map(|a| ip_of(a).to_string())
            .collect::<Vec<_>>()
            .join(", "),
        mtu: cfg.mtu,
        auth: if u32::from(cfg.auth_mode) == inband_core::shared::INBAND_AUTH_NONE { "none (seed options)" } else { "siphash" },
        scale_out: (cfg.cond_sid != Addr::default()).then(|| ScaleOut {
            sid: ip_of(&cfg.cond_sid).to_string(),
            direct_sid: ip_of(&cfg.direct_sid).to_string(),
            shadow_sid: ip_of(&cfg.shadow_sid).to_string(),
            fleet_prefix: (cfg.fleet_prefix != Addr::default())
                .then(|| format!("{}/{}", ip_of(&cfg.fleet_prefix), crate::config::FLEET_PREFIX_LEN)),
            adopt_per_s: cfg.adopt_per_s,
        }),
        flows: live(total),
        flow_table: FlowTable {
            established: total.established,
            closing: total.closing,
            half_open: sweep.half_open,
            capacity: u64::from(maps.flows.info()?.info.max_entries),
            half_open_capacity: u64::from(maps.half_open.info()?.info.max_entries),
            snat_reservations: sweep.snat_entries,
            sweeps: sweep.passes,
            last_sweep_ms_ago: (sweep.passes > 0).then(|| now.saturating_sub(sweep.last_ns) / 1_000_000),
            last_sweep_duration_us: sweep.last_duration_ns / 1000,
        },
        vips,
        drops: named(&maps.drops, &DROP_NAMES)?,
        events: named(&maps.events, &EVENT_NAMES)?,
        control: Control {
            polls_sent: control.polls_sent,
            poll_replies: control.poll_replies,
            poll_bytes: control.poll_bytes,
            poll_failures: control.poll_failures,
            poll_unauthenticated: control.poll_unauthenticated,
            queries: control.queries,
            query_timeouts: control.query_timeouts,
            query_mean_us: control.query_ns / control.queries.max(1) / 1000,
            options_lost: control.options_lost,
            options_retried: control.options_retried,
            peers: PeerStats {
                datagrams_sent: control.peer_datagrams_sent,
                records_sent: control.peer_records_sent,
                send_failures: control.peer_send_failures,
                records_learned: control.peer_records_learned,
                unknown_sender: control.peer_unknown_sender,
                malformed: control.peer_malformed,
                bad_mac: control.peer_bad_mac,
                replayed: control.peer_replayed,
            },
            moves: MoveStats {
                moved: control.moves,
                malformed: control.move_malformed,
                bad_mac: control.move_bad_mac,
                unknown_sender: control.move_unknown_sender,
                replayed: control.move_replayed,
                no_flow: control.move_no_flow,
                not_owner: control.move_not_owner,
                not_a_backend: control.move_not_a_backend,
                port_in_use: control.move_port_in_use,
                refused: control.move_refused,
            },
        },
        bpf_stats: prog_stats::enabled(),
        programs: attached_program(interface).into_iter().collect(),
    })
}

/// The XDP program on `interface` (the balancer's, as long as nobody
/// replaced it by hand), if it can be read.
fn attached_program(interface: &str) -> Option<ProgStats> {
    let ifindex = inband_core::netif::ifindex(interface).ok()? as i32;
    let mut id = 0u32;
    // SAFETY: a plain query writing one u32.
    let rc = unsafe { libbpf_rs::libbpf_sys::bpf_xdp_query_id(ifindex, 0, &mut id) };
    (rc == 0 && id != 0).then(|| prog_stats::of_id("balancer", id).ok()).flatten()
}

/// The human view: one block per VIP, one row per backend.
pub fn render_table(s: &Snapshot) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let t = &s.flow_table;
    let ns = if s.netns.is_empty() { String::new() } else { format!(" in netns {}", s.netns) };
    let _ = writeln!(o, "balancer on {}{ns} ({}, MTU {}, options: {})", s.interface, s.address, s.mtu, s.auth);
    if let Some(so) = &s.scale_out {
        let _ = writeln!(o, "behind an ECMP router: reached at {} (chained packets at {}); strays chained to {}", so.sid, so.direct_sid, so.shadow_sid);
        if let Some(p) = &so.fleet_prefix {
            let _ = writeln!(o, "fleet tuples from {p}; strays at the direct SID adopted (maglev: its primary; other policies: the backend a peer announced), at most {} a second per CPU", so.adopt_per_s);
        }
    }
    let _ = writeln!(
        o,
        "flows: {} established, {} closing, {} half-open, {} SNAT reservations; {}",
        t.established,
        t.closing,
        t.half_open,
        t.snat_reservations,
        match t.last_sweep_ms_ago {
            Some(ms) => format!("swept {ms} ms ago in {} us", t.last_sweep_duration_us),
            None => "never swept (no daemon running?)".to_string(),
        }
    );
    for v in &s.vips {
        let drain = v.drain_left_s.map_or(String::new(), |d| format!(" ({d} s left)"));
        let _ = writeln!(
            o,
            "\nVIP {}{}  {}{drain}  mode {}  policy {}{}  probe every {} pkts{}  score max age {} ms{}  timeouts syn {} ms / idle {} s / closing {} ms  down backends: flows {}, all down {}  flows {}  conns {}",
            v.vip,
            if v.quic { " (QUIC)" } else { "" },
            v.state,
            v.mode,
            v.policy,
            if v.weighted { " (weighted)" } else { "" },
            if v.probe_interval_max > v.probe_interval {
                format!("{}-{} (adaptive)", v.probe_interval, v.probe_interval_max)
            } else {
                v.probe_interval.to_string()
            },
            if v.probe_budget > 0 { format!(", at most {}/s", v.probe_budget) } else { String::new() },
            v.score_max_age_ms,
            if v.query_when_stale { ", queried when stale" } else { "" },
            v.syn_timeout_ms,
            v.idle_timeout_s,
            v.closing_timeout_ms,
            v.on_down,
            v.all_down,
            v.flows,
            v.stats["new_conns"]
        );
        let _ = writeln!(
            o,
            "  {:<4} {:<30} {:<14} {:<32} {:>6} {:>6} {:>8} {:>5} {:>8} {:>6} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6}",
            "id", "backend", "state", "health", "weight", "score", "age ms", "stale", "estimate", "flows", "conns", "pkts", "back pkts", "probes", "scores", "n now"
        );
        for b in &v.backends {
            let mut state = match b.drain_left_s {
                Some(d) => format!("{} {d}s", b.state),
                None => b.state.to_string(),
            };
            if b.options_lost {
                state.push_str(" polled");
            }
            if b.encap {
                state.push_str(" ipip");
            }
            let backend = match b.quic_server_id {
                Some(id) => format!("{} #{id}", b.backend),
                None => b.backend.clone(),
            };
            let h = &b.health;
            let mut health = format!("{} ({})", h.state, h.reason);
            if let Some(st) = h.last_status {
                health.push_str(&format!(" {st}"));
            }
            if let Some(s) = h.for_s {
                health.push_str(&format!(" {s}s"));
            }
            if h.failing_open {
                health.push_str(" open");
            }
            let _ = writeln!(
                o,
                "  {:<4} {:<30} {:<14} {:<32} {:>6} {:>6} {:>8} {:>5} {:>8} {:>6} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6}",
                b.id,
                backend,
                state,
                health,
                b.weight,
                b.score.map_or("-".into(), |x| x.to_string()),
                b.score_age_ms.map_or("-".into(), |x| x.to_string()),
                if b.stale { "yes" } else { "no" },
                b.load_estimate,
                b.flows,
                b.stats["new_conns"],
                b.stats["packets"],
                b.stats["return_packets"],
                b.stats["probes_sent"],
                b.stats["scores_received"],
                b.probe_interval_now
            );
        }
        if v.backends.iter().any(|b| b.health.failing_open) {
            let _ = writeln!(o, "  open: every backend is down and the VIP fails open: all take connections as if up");
        }
        if v.backends.iter().any(|b| b.options_lost) {
            let _ = writeln!(o, "  polled: options do not reach that backend (dropped or stripped on the path); its score is polled");
        }
    }
    let c = &s.control;
    let _ = writeln!(
        o,
        "\npolling: {} requests, {} replies, {} failures, {} bytes, {} replies that did not authenticate",
        c.polls_sent, c.poll_replies, c.poll_failures, c.poll_bytes, c.poll_unauthenticated
    );
    if c.queries > 0 {
        let _ = writeln!(o, "queries (dsr-query): {} SYNs held, {} timed out, {} us held on average", c.queries, c.query_timeouts, c.query_mean_us);
    }
    let p = &c.peers;
    if p.datagrams_sent + p.records_learned + p.unknown_sender + p.malformed + p.bad_mac + p.replayed > 0 {
        let _ = writeln!(
            o,
            "peers: {} choices sent in {} datagrams ({} not sent), {} learned; refused: {} unknown sender, {} malformed, {} bad MAC, {} replayed",
            p.records_sent, p.datagrams_sent, p.send_failures, p.records_learned, p.unknown_sender, p.malformed, p.bad_mac, p.replayed
        );
    }
    let m = &c.moves;
    if m.moved + m.refusals().iter().map(|(_, n)| n).sum::<u64>() > 0 {
        let refused: Vec<String> = m.refusals().iter().filter(|(_, n)| *n > 0).map(|(k, n)| format!("{k}={n}")).collect();
        let refused = if refused.is_empty() { "none".to_string() } else { refused.join(" ") };
        let _ = writeln!(o, "flow moves: {} moved; not taken: {refused}", m.moved);
    }
    if c.options_lost > 0 {
        let _ = writeln!(o, "options lost on a backend's path: found {} times, options tried again {} times", c.options_lost, c.options_retried);
    }
    let nonzero = |m: &BTreeMap<&str, u64>| -> String {
        let v: Vec<String> = m.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k}={n}")).collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(" ")
        }
    };
    let _ = writeln!(o, "drops: {}", nonzero(&s.drops));
    let _ = writeln!(o, "events: {}", nonzero(&s.events));
    o
}

/// The same numbers for Prometheus (docs/configuration.md, "Metrics"): a
/// registry made per scrape around one collector of the snapshot
/// (prometheus-client's collector API). The numbers are the data path's,
/// read from the pins when scraped, not counters this process increments:
/// there is nothing for a long-lived registry to hold between scrapes.
pub fn prometheus(s: Snapshot) -> prometheus_client::registry::Registry {
    let mut r = prometheus_client::registry::Registry::with_prefix("inband");
    r.register_collector(Box::new(Exposition(s)));
    r
}

#[derive(Debug)]
struct Exposition(Snapshot);

/// The backend counters exported, by their stats field: (metric name, help).
const BACKEND_COUNTERS: [(&str, &str, &str); 13] = [
    ("packets", "backend_packets", "Client packets forwarded to the backend"),
    ("bytes", "backend_bytes", "Client bytes forwarded to the backend"),
    ("return_packets", "backend_return_packets", "Backend packets to clients through the balancer"),
    ("return_bytes", "backend_return_bytes", "Backend bytes to clients through the balancer"),
    ("new_conns", "backend_connections", "Connections given to the backend"),
    ("closed_conns", "backend_closed_connections", "Connections of the backend seen ending (FIN or RST)"),
    ("probes_sent", "backend_probes", "Score requests sent to the backend"),
    ("scores_received", "backend_scores", "Scores taken from the backend's replies"),
    ("syn_retries", "backend_syn_retries", "Retransmitted SYNs of handshakes whose SYN asked for a score"),
    ("handshakes_completed", "backend_handshakes_completed", "Handshakes through the backend the client completed"),
    ("handshakes_refused", "backend_handshakes_refused", "SYNs the backend answered with a RST"),
    ("handshakes_retried", "backend_handshakes_retried", "SYNs to the backend sent again, the first unanswered"),
    ("flows_reset", "backend_flows_reset", "Client packets answered with a RST while the backend was down (on_down = reset)"),
];

const VIP_COUNTERS: [(&str, &str, &str); 6] = [
    ("packets", "vip_packets", "Client packets to the VIP"),
    ("bytes", "vip_bytes", "Client bytes to the VIP"),
    ("return_packets", "vip_return_packets", "Backend packets of the VIP's flows through the balancer"),
    ("return_bytes", "vip_return_bytes", "Backend bytes of the VIP's flows through the balancer"),
    ("new_conns", "vip_connections", "Connections to the VIP"),
    ("closed_conns", "vip_closed_connections", "Connections to the VIP seen ending (FIN or RST)"),
];

impl prometheus_client::collector::Collector for Exposition {
    fn encode(&self, encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use inband_http::gauge_value as g;
        let s = &self.0;
        let mut f = inband_http::Families(encoder);
        let i = s.interface.as_str();
        let t = &s.flow_table;
        f.gauges(
            "flows",
            "Flows at the last sweep, by state",
            [("established", t.established), ("closing", t.closing), ("half_open", t.half_open)].map(|(state, n)| ([("interface", i), ("state", state)], g(n))),
        )?;
        f.gauges(
            "flow_table_capacity",
            "Entries each flow table holds at most (flows: established and closing; half_open: handshakes)",
            [("flows", t.capacity), ("half_open", t.half_open_capacity)].map(|(table, n)| ([("interface", i), ("table", table)], g(n))),
        )?;
        f.gauges("snat_reservations", "SNAT ports reserved at the last sweep", [([("interface", i)], g(t.snat_reservations))])?;
        f.counters("sweeps", "Passes of the flow-table sweeper", [([("interface", i)], t.sweeps)])?;
        f.gauges("sweep_duration_seconds", "How long the last sweep took", [([("interface", i)], t.last_sweep_duration_us as f64 / 1e6)])?;
        f.gauges("vip_flows", "Live flows of the VIP", s.vips.iter().map(|v| ([("vip", v.vip.as_str()), ("state", v.state)], g(v.flows))))?;
        for (field, name, help) in VIP_COUNTERS {
            f.counters(name, help, s.vips.iter().map(|v| ([("vip", v.vip.as_str()), ("mode", v.mode)], v.stats[field])))?;
        }
        let backends = || s.vips.iter().flat_map(|v| v.backends.iter().map(move |b| (v.vip.as_str(), b)));
        for (field, name, help) in BACKEND_COUNTERS {
            f.counters(name, help, backends().map(|(v, b)| ([("vip", v), ("backend", b.backend.as_str())], b.stats[field])))?;
        }
        for (name, help, value) in [
            ("backend_flows", "Live flows of the backend", (|b: &BackendSnapshot| b.flows) as fn(&BackendSnapshot) -> u64),
            ("backend_load_estimate", "What least-score and power-of-two rank the backend by", |b| b.load_estimate),
            ("backend_weight", "The backend's capacity relative to its VIP's others (0: no new connections)", |b| u64::from(b.weight)),
            ("backend_probe_interval", "Packets between score requests now (dsr-dynamic's adaptive n)", |b| u64::from(b.probe_interval_now)),
            ("backend_unanswered_probes", "Score requests sent since the last score taken", |b| u64::from(b.unanswered_probes)),
            ("backend_options_lost", "1 while the path to the backend loses inband options (its score is polled)", |b| u64::from(b.options_lost)),
        ] {
            f.gauges(name, help, backends().map(|(v, b)| ([("vip", v), ("backend", b.backend.as_str()), ("state", b.state)], g(value(b)))))?;
        }
        f.gauges(
            "backend_up",
            "1 while the backend takes new connections by its health checks (down backends of a VIP that fails open included)",
            backends().map(|(v, b)| {
                let up = b.health.state != "down" || b.health.failing_open;
                ([("vip", v), ("backend", b.backend.as_str()), ("reason", b.health.reason)], i64::from(up))
            }),
        )?;
        f.counters(
            "backend_health_checks",
            "Health checks of the backend, by result",
            backends().flat_map(|(v, b)| {
                [("passed", b.health.checks_passed), ("failed", b.health.checks_failed)]
                    .map(|(result, n)| ([("vip", v), ("backend", b.backend.as_str()), ("result", result)], n))
            }),
        )?;
        f.counters("backend_health_transitions", "Changes of the backend's health state", backends().map(|(v, b)| ([("vip", v), ("backend", b.backend.as_str())], b.health.transitions)))?;
        f.counters(
            "backend_passive_ejections",
            "Times the backend was taken down by the handshakes it refused or left unanswered",
            backends().map(|(v, b)| ([("vip", v), ("backend", b.backend.as_str())], b.health.passive_ejections)),
        )?;
        f.gauges(
            "backend_health_since_seconds",
            "Unix time of the backend's last change of health state (0: none yet)",
            backends().map(|(v, b)| ([("vip", v), ("backend", b.backend.as_str())], b.health.since_ms as f64 / 1e3)),
        )?;
        f.gauges(
            "backend_score",
            "The backend's last reported score (absent until one is taken)",
            backends().filter_map(|(v, b)| Some(([("vip", v), ("backend", b.backend.as_str())], i64::from(b.score?)))),
        )?;
        f.gauges(
            "backend_score_age_seconds",
            "How old the backend's score is (absent until one is taken)",
            backends().filter_map(|(v, b)| Some(([("vip", v), ("backend", b.backend.as_str())], b.score_age_ms? as f64 / 1e3))),
        )?;
        f.programs("balancer", s.programs.iter().map(|p| (p.program.as_str(), p.runs, p.run_time_ns)))?;
        f.counters("drops", "Packets the data path dropped, by reason", s.drops.iter().map(|(k, n)| ([("reason", *k)], *n)))?;
        f.counters("events", "Data-path events, by kind", s.events.iter().map(|(k, n)| ([("event", *k)], *n)))?;
        let c = &s.control;
        f.counter("poll_requests", "Score polls sent (dsr-polling and backends losing options)", c.polls_sent)?;
        f.counter("poll_replies", "Score polls answered", c.poll_replies)?;
        f.counter("poll_unauthenticated", "Poll replies refused: bad MAC, unknown key, or the other [auth] format", c.poll_unauthenticated)?;
        f.counter("poll_failures", "Score polls that got no reply in time or could not be sent", c.poll_failures)?;
        f.counter("poll_bytes", "Bytes of polls and their replies on the wire", c.poll_bytes)?;
        f.counter("queries", "SYNs held for a score query (dsr-query)", c.queries)?;
        f.counter("query_timeouts", "Score queries that timed out", c.query_timeouts)?;
        f.counter("options_lost", "Times a backend was found losing inband options", c.options_lost)?;
        f.counter("options_retried", "Times a backend losing options was given options again to test its path", c.options_retried)?;
        let p = &c.peers;
        f.counter("peer_records_sent", "Connections' backends announced to the peers (records, once per peer)", p.records_sent)?;
        f.counter("peer_datagrams_sent", "Datagrams of announced choices sent to the peers", p.datagrams_sent)?;
        f.counter("peer_send_failures", "Datagrams of announced choices that could not be sent", p.send_failures)?;
        f.counter("peer_records_learned", "Peers' announced choices written into peer_choices", p.records_learned)?;
        f.counters(
            "peer_refused",
            "Datagrams from the peer port refused, by reason",
            [("unknown_sender", p.unknown_sender), ("malformed", p.malformed), ("bad_mac", p.bad_mac), ("replayed", p.replayed)]
                .into_iter()
                .map(|(k, n)| ([("reason", k)], n)),
        )?;
        let m = &c.moves;
        f.counter("flow_moves", "Flows sent to another backend of their VIP at their backend's request ([moves])", m.moved)?;
        f.counters(
            "flow_moves_refused",
            "Flow move requests not taken, by reason (malformed, bad_mac and unknown_sender get no answer)",
            m.refusals().into_iter().map(|(k, n)| ([("reason", k)], n)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(id: u32, addr: &str, score: Option<u32>, health: HealthView) -> BackendSnapshot {
        let mut stats: Counters = BackendStats::default().named().into_iter().collect();
        stats.insert("new_conns", 10 + u64::from(id));
        BackendSnapshot {
            id,
            backend: addr.into(),
            state: "active",
            drain_left_s: None,
            weight: 1,
            mac: "02:00:00:00:00:01".into(),
            options_lost: false,
            encap: false,
            quic_server_id: None,
            probe_interval_now: 16,
            unanswered_probes: 0,
            score,
            score_age_ms: score.map(|_| 5),
            stale: score.is_none(),
            opened_since_score: 0,
            closed_since_score: 0,
            load_estimate: 40,
            flows: 3,
            health,
            stats,
        }
    }

    fn health(state: &'static str, reason: &'static str, failing_open: bool) -> HealthView {
        HealthView {
            state,
            reason,
            failing_open,
            since_ms: 1_500,
            for_s: Some(1),
            last_status: None,
            in_a_row: 1,
            checks_passed: 7,
            checks_failed: 2,
            transitions: 1,
            passive_ejections: 0,
        }
    }

    fn snapshot() -> Snapshot {
        let zero = |names: &[&'static str]| names.iter().map(|n| (*n, 0)).collect::<BTreeMap<_, _>>();
        let mut drops = zero(&DROP_NAMES);
        drops.insert("no_backend", 4);
        Snapshot {
            interface: "eth0".into(),
            netns: String::new(),
            address: "10.0.0.2".into(),
            mtu: 1500,
            auth: "siphash",
            scale_out: None,
            flows: 5,
            flow_table: FlowTable { established: 5, closing: 1, half_open: 2, capacity: 262_144, half_open_capacity: 65_536, snat_reservations: 0, sweeps: 9, last_sweep_ms_ago: Some(3), last_sweep_duration_us: 1500 },
            vips: vec![VipSnapshot {
                vip: "10.0.0.1:80".into(),
                state: "active",
                drain_left_s: None,
                protocol: "tcp",
                quic: false,
                mode: "dsr-dynamic",
                policy: "least-score",
                weighted: false,
                probe_interval: 16,
                probe_interval_max: 16,
                probe_budget: 0,
                score_max_age_ms: 1000,
                query_when_stale: false,
                syn_timeout_ms: 3000,
                idle_timeout_s: 300,
                closing_timeout_ms: 10_000,
                on_down: "keep",
                all_down: "fail-open",
                flows: 6,
                stats: VipStats::default().named().into_iter().collect(),
                backends: vec![
                    backend(0, "10.0.1.1:80", Some(77), health("up", "passing", false)),
                    backend(1, "10.0.1.2:80", None, health("down", "refused", false)),
                ],
            }],
            drops,
            events: zero(&EVENT_NAMES),
            control: Control { polls_sent: 4, poll_replies: 3, poll_bytes: 600, poll_failures: 1, poll_unauthenticated: 0, queries: 0, query_timeouts: 0, query_mean_us: 0, options_lost: 0, options_retried: 0, peers: PeerStats::default(), moves: MoveStats { moved: 2, not_owner: 1, ..MoveStats::default() } },
            bpf_stats: true,
            programs: vec![ProgStats { program: "balancer".into(), id: 7, runs: 1000, run_time_ns: 150_000 }],
        }
    }

    /// The exposition parses as OpenMetrics (a TYPE before every sample, a
    /// HELP for every family, counters as `_total`, `# EOF`), and keeps the
    /// names and labels the tests, bench drivers and docs read.
    #[test]
    fn the_metrics_parse_with_help_and_type_and_keep_their_names() {
        use openmetrics_parser::OpenMetricsType::{Counter, Gauge};
        let text = inband_http::encode(&prometheus(snapshot())).unwrap();
        inband_http::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        // A strict parser too (the fixture has no empty family, which it mistakes).
        let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&text).unwrap_or_else(|e| panic!("{e:?}\n{text}"));
        for (name, family) in &parsed.families {
            assert!(!family.help.is_empty(), "{name} has no HELP:\n{text}");
        }
        for (family, kind) in [
            ("inband_flows", Gauge),
            ("inband_sweeps", Counter),
            ("inband_vip_connections", Counter),
            ("inband_backend_connections", Counter),
            ("inband_backend_handshakes_refused", Counter),
            ("inband_backend_flows_reset", Counter),
            ("inband_backend_up", Gauge),
            ("inband_backend_health_checks", Counter),
            ("inband_backend_health_transitions", Counter),
            ("inband_backend_passive_ejections", Counter),
            ("inband_backend_score", Gauge),
            ("inband_backend_score_age_seconds", Gauge),
            ("inband_flow_table_capacity", Gauge),
            ("inband_drops", Counter),
            ("inband_poll_requests", Counter),
            ("inband_bpf_program_runs", Counter),
            ("inband_bpf_program_run_seconds", Counter),
        ] {
            assert_eq!(parsed.families.get(family).map(|f| f.family_type), Some(kind), "{family}:\n{text}");
        }
        for line in [
            "inband_flows{interface=\"eth0\",state=\"established\"} 5",
            "inband_sweeps_total{interface=\"eth0\"} 9",
            "inband_sweep_duration_seconds{interface=\"eth0\"} 0.0015",
            "inband_vip_flows{vip=\"10.0.0.1:80\",state=\"active\"} 6",
            "inband_backend_connections_total{vip=\"10.0.0.1:80\",backend=\"10.0.1.2:80\"} 11",
            "inband_backend_flows{vip=\"10.0.0.1:80\",backend=\"10.0.1.1:80\",state=\"active\"} 3",
            "inband_backend_up{vip=\"10.0.0.1:80\",backend=\"10.0.1.1:80\",reason=\"passing\"} 1",
            "inband_backend_up{vip=\"10.0.0.1:80\",backend=\"10.0.1.2:80\",reason=\"refused\"} 0",
            "inband_backend_health_checks_total{vip=\"10.0.0.1:80\",backend=\"10.0.1.1:80\",result=\"failed\"} 2",
            "inband_backend_health_since_seconds{vip=\"10.0.0.1:80\",backend=\"10.0.1.1:80\"} 1.5",
            "inband_backend_score{vip=\"10.0.0.1:80\",backend=\"10.0.1.1:80\"} 77",
            "inband_drops_total{reason=\"no_backend\"} 4",
            "inband_poll_requests_total 4",
            "inband_poll_failures_total 1",
            "inband_flow_moves_total 2",
            "inband_flow_moves_refused_total{reason=\"not_owner\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line}:\n{text}");
        }
        assert!(!text.contains("inband_backend_score{vip=\"10.0.0.1:80\",backend=\"10.0.1.2:80\"}"), "no score before one is taken");
    }

    #[test]
    fn the_estimate_decays_when_old_and_follows_connections() {
        let s = BackendScore { score: 64, opened: 3, closed: 1, updated_ns: 1_000, ..Default::default() };
        let max_age = 1_000_000_000;
        assert_eq!(load_estimate(&s, 1_000 + max_age, max_age), 66, "fresh: 64 + 3 - 1");
        assert_eq!(load_estimate(&s, 1_001 + max_age, max_age), 32 + 2, "just past the max age: halved once");
        assert_eq!(load_estimate(&s, 1_001 + 2 * max_age, max_age), 16 + 2, "two max ages old: halved twice");
        assert_eq!(load_estimate(&s, 1_000 + 40 * max_age, max_age), 2, "a very old report counts for nothing");
        let closed_more = BackendScore { closed: 100, ..s };
        assert_eq!(load_estimate(&closed_more, 2_000, max_age), 0, "never below zero");
        let never = BackendScore { score: 500, updated_ns: 0, opened: 2, ..Default::default() };
        assert_eq!(load_estimate(&never, 99 * max_age, max_age), 502, "no report yet: not decayed (score is 0 in practice)");
    }
}

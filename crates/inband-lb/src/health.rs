//! Health of each backend (`[vip.health]`): active checks with the shared
//! health-check client (`inband_health`), passive detection from how the
//! data path saw its handshakes end, and the verdict written where every
//! policy reads it (INBAND_BACKEND_DOWN in `backends`, select.h) and where
//! status and metrics read it (`backend_health`).
//!
//! One task per checked backend probes it; one judge owns every backend's
//! count of results in a row and is the only writer of both maps' health
//! fields, so a verdict is never written twice or out of order. A VIP whose
//! backends are all down either fails open (none is marked down: Envoy's
//! panic mode) or refuses (its SYNs are answered with a RST), as configured.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use inband_health::{Expect, Failure, FailureKind, Probe, Verdicts};
use rand::Rng;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::config::{AllDown, CheckKind, HealthConfig, LbConfig};
use super::maps::*;
use super::tables::{self, LbMaps};
use inband_core::shared as c;
use inband_core::bpfmap;

/// How often the judge looks at the configuration (backends added or
/// removed, checks changed) and at the data path's handshake counts.
const SYNC_EVERY: Duration = Duration::from_millis(1000);
const PASSIVE_EVERY: Duration = Duration::from_millis(250);

/// One backend to check, as the configuration and the maps name it.
#[derive(Clone, Debug, PartialEq)]
struct Target {
    vip: String,
    endpoint: SocketAddr,
    addr: SocketAddr,
    source: Option<IpAddr>,
    probe: Probe,
    spec: HealthConfig,
}

struct Checked {
    target: Target,
    task: tokio::task::JoinHandle<()>,
    /// The state the prober paces itself by (fast while results disagree).
    up: Arc<AtomicBool>,
    verdicts: Verdicts,
    /// The data path's handshake counts at the last look, and the refused
    /// and unanswered ones since the last completed.
    seen: (u64, u64, u64),
    suspect_refused: u64,
    suspect_unanswered: u64,
    /// Handshakes completed when the check in flight started, and since
    /// when (with how many) checks in a row were taken for busy.
    completed_at_check: u64,
    busy_since_ms: Option<u64>,
    busy_in_a_row: u32,
}

impl Drop for Checked {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Outcome = Result<inband_health::Passed, Failure>;

/// What a prober tells the judge: a check starts (the judge notes the
/// data path's count of completed handshakes), or how it ended.
enum Report {
    Started,
    Done(Outcome),
}
type Reports = mpsc::Sender<(u32, SocketAddr, Report)>;

pub fn run(maps: &LbMaps, shared: &Mutex<LbConfig>, stop: &AtomicBool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("health-check runtime")?;
    rt.block_on(judge(maps, shared, stop))
}

async fn judge(maps: &LbMaps, shared: &Mutex<LbConfig>, stop: &AtomicBool) -> Result<()> {
    let (tx, mut rx) = mpsc::channel::<(u32, SocketAddr, Report)>(1024);
    let mut checked: HashMap<u32, Checked> = HashMap::new();
    let mut sync = tokio::time::interval(SYNC_EVERY);
    let mut passive = tokio::time::interval(PASSIVE_EVERY);
    let mut panicking: HashSet<String> = HashSet::new();
    while !stop.load(Ordering::Relaxed) {
        tokio::select! {
            Some((id, endpoint, report)) = rx.recv() => {
                // A result of a prober replaced since is not this backend's.
                let Some(ch) = checked.get_mut(&id).filter(|ch| ch.target.endpoint == endpoint) else { continue };
                match report {
                    Report::Started => ch.completed_at_check = completed(maps, id)?,
                    Report::Done(outcome) => {
                        if record(maps, id, ch, outcome)? {
                            publish(maps, shared, &checked, &mut panicking)?;
                        }
                    }
                }
            }
            _ = passive.tick() => {
                let mut changed = false;
                for (id, ch) in checked.iter_mut() {
                    changed |= look_passive(maps, *id, ch)?;
                }
                if changed {
                    publish(maps, shared, &checked, &mut panicking)?;
                }
            }
            _ = sync.tick() => {
                resync(maps, shared, &mut checked, &tx)?;
                publish(maps, shared, &checked, &mut panicking)?;
            }
        }
    }
    Ok(())
}

/// Starts probers for backends that need checking, stops those of backends
/// gone or changed, and marks unchecked backends so.
fn resync(maps: &LbMaps, shared: &Mutex<LbConfig>, checked: &mut HashMap<u32, Checked>, tx: &Reports) -> Result<()> {
    let cfg = shared.lock().unwrap().clone();
    let mut wanted: HashMap<u32, Target> = HashMap::new();
    let mut unchecked = Vec::new();
    for e in tables::read(maps)? {
        let Some(v) = cfg.vips.iter().find(|v| (v.endpoint(), v.protocol) == e.ident()) else { continue };
        for (id, b) in &e.slots {
            let endpoint = tables::backend_endpoint(b);
            if backend_removed(b) {
                continue;
            }
            let kind = v.health.kind(v.protocol);
            if kind == CheckKind::None {
                unchecked.push(*id);
                continue;
            }
            let addr = SocketAddr::new(endpoint.ip(), v.health.port.unwrap_or(endpoint.port()));
            let probe = match kind {
                CheckKind::Http => Probe::Http {
                    path: v.health.path.clone(),
                    host: v.health.host.clone().unwrap_or_else(|| addr.to_string()),
                    expect: v.health.expect.clone().map_or(Expect::SuccessOrRedirect, Expect::Codes),
                },
                _ => Probe::Tcp,
            };
            let source = match endpoint.ip() {
                IpAddr::V4(_) => cfg.address.map(IpAddr::V4),
                IpAddr::V6(_) => cfg.address6.map(IpAddr::V6),
            };
            wanted.insert(*id, Target { vip: v.name(), endpoint, addr, source, probe, spec: v.health.clone() });
        }
    }
    checked.retain(|id, ch| wanted.get(id) == Some(&ch.target));
    for (id, target) in wanted {
        if checked.contains_key(&id) {
            continue;
        }
        let h: BackendHealth = bpfmap::get(&maps.backend_health, &id)?.unwrap_or_default();
        // A restarted daemon carries a down verdict on: the backend must
        // pass `rise` checks before it takes connections again.
        let up = Arc::new(AtomicBool::new(h.state != HEALTH_DOWN));
        let task = tokio::spawn(prober(id, target.clone(), Arc::clone(&up), tx.clone()));
        let stats = tables::sum_percpu::<BackendStats>(&maps.backend_stats, id)?;
        checked.insert(
            id,
            Checked {
                target,
                task,
                up,
                verdicts: Verdicts::default(),
                seen: (stats.handshakes_completed, stats.handshakes_refused, stats.handshakes_retried),
                suspect_refused: 0,
                suspect_unanswered: 0,
                completed_at_check: stats.handshakes_completed,
                busy_since_ms: None,
                busy_in_a_row: 0,
            },
        );
    }
    for id in unchecked {
        let h: BackendHealth = bpfmap::get(&maps.backend_health, &id)?.unwrap_or_default();
        if h.reason != c::INBAND_HEALTH_NOT_CHECKED as u8 || h.state != 0 {
            let since_ms = if h.state == HEALTH_DOWN { now_ms() } else { h.since_ms };
            let h = BackendHealth { state: 0, reason: c::INBAND_HEALTH_NOT_CHECKED as u8, in_a_row: 0, since_ms, ..h };
            bpfmap::put(&maps.backend_health, &id, &h)?;
        }
    }
    Ok(())
}

/// Probes one backend until aborted: every interval (with jitter), or every
/// fast interval while its results disagree with its state.
async fn prober(id: u32, t: Target, up: Arc<AtomicBool>, tx: Reports) {
    let timeout = Duration::from_millis(t.spec.timeout_ms);
    loop {
        if tx.send((id, t.endpoint, Report::Started)).await.is_err() {
            return;
        }
        let outcome = inband_health::probe(t.addr, t.source, &t.probe, timeout).await;
        let unsettled = outcome.is_ok() != up.load(Ordering::Relaxed);
        if tx.send((id, t.endpoint, Report::Done(outcome))).await.is_err() {
            return;
        }
        let base = if unsettled { t.spec.fast_interval_ms } else { t.spec.interval_ms };
        let spread = base * u64::from(t.spec.jitter_pct) / 100;
        let wait = if spread > 0 { rand::thread_rng().gen_range(base - spread..=base + spread) } else { base };
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
}

fn reason_of(f: &Failure) -> u32 {
    match f.kind {
        FailureKind::Refused => c::INBAND_HEALTH_REFUSED,
        FailureKind::Timeout => c::INBAND_HEALTH_TIMEOUT,
        FailureKind::Unreachable => c::INBAND_HEALTH_UNREACHABLE,
        FailureKind::BadStatus => c::INBAND_HEALTH_BAD_STATUS,
        FailureKind::Malformed => c::INBAND_HEALTH_MALFORMED,
        FailureKind::Closed => c::INBAND_HEALTH_CLOSED,
        FailureKind::Error => c::INBAND_HEALTH_ERROR,
    }
}

/// Records one check of backend `id`; whether its state changed.
fn record(maps: &LbMaps, id: u32, ch: &mut Checked, outcome: Outcome) -> Result<bool> {
    let mut h: BackendHealth = bpfmap::get(&maps.backend_health, &id)?.unwrap_or_default();
    let up = h.state != HEALTH_DOWN;
    let now = now_ms();
    let busy = busy(maps, id, ch, &outcome, up, now)?;
    let spec = &ch.target.spec;
    // A busy backend's check is no vote, and it breaks a run of failures:
    // the backend was seen serving between them.
    let change = if busy {
        ch.verdicts = Verdicts::default();
        None
    } else {
        ch.verdicts.record(spec.rise, spec.fall, up, outcome.is_ok())
    };
    h.last_check_ms = now;
    match &outcome {
        Ok(p) => {
            h.checks_passed += 1;
            h.last_status = p.status.unwrap_or(0);
        }
        Err(f) => {
            h.checks_failed += 1;
            h.last_status = f.status.unwrap_or(0);
        }
    }
    // A down backend keeps the reason that took it down until it is back;
    // the rest show what the last check found.
    if up || change.is_some() {
        h.reason = match &outcome {
            Ok(_) => c::INBAND_HEALTH_PASSING,
            Err(_) if busy => c::INBAND_HEALTH_BUSY,
            Err(f) => reason_of(f),
        } as u8;
    }
    h.in_a_row = if busy { ch.busy_in_a_row } else { ch.verdicts.in_a_row() };
    if h.state == 0 {
        h.state = HEALTH_UP;
        h.since_ms = h.last_check_ms;
    }
    if let Some(now_up) = change {
        h.state = if now_up { HEALTH_UP } else { HEALTH_DOWN };
        h.since_ms = h.last_check_ms;
        h.transitions += 1;
        ch.up.store(now_up, Ordering::Relaxed);
        // Passive suspicion starts again from here: a down and a return
        // within one look (250 ms, as when an application flaps) would
        // keep the refusals from before the down, and one more after the
        // return would eject the backend right after it came back.
        let s = tables::sum_percpu::<BackendStats>(&maps.backend_stats, id)?;
        ch.seen = (s.handshakes_completed, s.handshakes_refused, s.handshakes_retried);
        (ch.suspect_refused, ch.suspect_unanswered) = (0, 0);
        let t = &ch.target;
        match &outcome {
            Ok(_) => info!(vip = %t.vip, backend = %t.endpoint, rise = spec.rise, "backend up: health checks pass"),
            Err(f) => warn!(vip = %t.vip, backend = %t.endpoint, fall = spec.fall, reason = %f, "backend down: health checks fail"),
        }
    }
    bpfmap::put(&maps.backend_health, &id, &h)?;
    Ok(change.is_some())
}

fn completed(maps: &LbMaps, id: u32) -> Result<u64> {
    Ok(tables::sum_percpu::<BackendStats>(&maps.backend_stats, id)?.handshakes_completed)
}

/// Whether a check of an up backend that timed out finds it busy rather
/// than gone: clients completed handshakes with it while the check waited
/// (a full listen queue drops some SYNs, the check's among them, and takes
/// others; a host silenced before the check started completes none), for
/// at most `busy_max_ms` in a row. Refusals and errors say the port or
/// host is gone whatever clients do.
fn busy(maps: &LbMaps, id: u32, ch: &mut Checked, outcome: &Outcome, up: bool, now: u64) -> Result<bool> {
    let served = completed(maps, id)? > ch.completed_at_check;
    let max = ch.target.spec.busy_max_ms;
    let timed_out = matches!(outcome, Err(f) if f.kind == FailureKind::Timeout);
    if !(timed_out && up && served && max > 0) {
        (ch.busy_since_ms, ch.busy_in_a_row) = (None, 0);
        return Ok(false);
    }
    // The span outlives its bound: until a check passes or clients stop
    // completing handshakes, every timeout counts again.
    let since = *ch.busy_since_ms.get_or_insert(now);
    if now.saturating_sub(since) >= max {
        if ch.busy_in_a_row > 0 {
            let t = &ch.target;
            warn!(vip = %t.vip, backend = %t.endpoint, busy_max_ms = max, "checks kept timing out although clients' handshakes complete: no longer taken for busy");
            ch.busy_in_a_row = 0;
        }
        return Ok(false);
    }
    if ch.busy_in_a_row == 0 {
        let t = &ch.target;
        info!(vip = %t.vip, backend = %t.endpoint, "backend busy: a check timed out while clients' handshakes with it complete; kept up");
    }
    ch.busy_in_a_row += 1;
    Ok(true)
}

/// Passive detection: the handshakes the data path saw this backend refuse
/// (a RST to the SYN) or leave unanswered (the client sent the SYN again),
/// with none completed since, reaching `passive_fall` take it down; then
/// its active checks must pass `rise` times in a row. Whether it went down.
fn look_passive(maps: &LbMaps, id: u32, ch: &mut Checked) -> Result<bool> {
    let s = tables::sum_percpu::<BackendStats>(&maps.backend_stats, id)?;
    let (completed, refused, retried) = (s.handshakes_completed, s.handshakes_refused, s.handshakes_retried);
    let (c0, r0, u0) = ch.seen;
    ch.seen = (completed, refused, retried);
    // Suspicion counts only while the backend takes connections: a down
    // one still sees SYNs sent again on connections it had before, and
    // counted, they would take it down again the moment it came back.
    if completed > c0 || !ch.up.load(Ordering::Relaxed) {
        (ch.suspect_refused, ch.suspect_unanswered) = (0, 0);
        return Ok(false);
    }
    ch.suspect_refused += refused.saturating_sub(r0);
    ch.suspect_unanswered += retried.saturating_sub(u0);
    let fall = u64::from(ch.target.spec.passive_fall);
    if fall == 0 || ch.suspect_refused + ch.suspect_unanswered < fall {
        return Ok(false);
    }
    let reason = if ch.suspect_refused >= ch.suspect_unanswered {
        c::INBAND_HEALTH_PASSIVE_REFUSED
    } else {
        c::INBAND_HEALTH_PASSIVE_UNANSWERED
    };
    let mut h: BackendHealth = bpfmap::get(&maps.backend_health, &id)?.unwrap_or_default();
    h.state = HEALTH_DOWN;
    h.reason = reason as u8;
    h.since_ms = now_ms();
    h.transitions += 1;
    h.passive_ejections += 1;
    h.in_a_row = 0;
    bpfmap::put(&maps.backend_health, &id, &h)?;
    ch.verdicts = Verdicts::default();
    ch.up.store(false, Ordering::Relaxed);
    let t = &ch.target;
    warn!(
        vip = %t.vip, backend = %t.endpoint, refused = ch.suspect_refused, unanswered = ch.suspect_unanswered,
        "backend down: the data path saw its handshakes fail (passive); back after {} passing checks", t.spec.rise
    );
    (ch.suspect_refused, ch.suspect_unanswered) = (0, 0);
    Ok(true)
}

/// Writes the verdicts into `backends` (INBAND_BACKEND_DOWN), VIP by VIP:
/// a VIP whose takers of new connections are all down and that fails open
/// gets none marked down. Under the config lock, as every writer of the
/// configuration maps.
fn publish(maps: &LbMaps, shared: &Mutex<LbConfig>, checked: &HashMap<u32, Checked>, panicking: &mut HashSet<String>) -> Result<()> {
    let cfg = shared.lock().unwrap();
    let mut changed = HashSet::new();
    for e in tables::read(maps)? {
        let Some(v) = cfg.vips.iter().find(|v| (v.endpoint(), v.protocol) == e.ident()) else { continue };
        let down = |id: &u32| checked.get(id).is_some_and(|ch| !ch.up.load(Ordering::Relaxed));
        let takers: Vec<u32> = e.slots.iter().filter(|(_, b)| b.flags & BACKEND_ACTIVE != 0).map(|(id, _)| *id).collect();
        let panic = v.health.all_down == AllDown::FailOpen && !takers.is_empty() && takers.iter().all(down);
        let name = e.name();
        if panic && panicking.insert(name.clone()) {
            warn!(vip = %name, "every backend is down: failing open (all take connections as if up; all_down = \"refuse\" refuses instead)");
        } else if !panic && panicking.remove(&name) {
            info!(vip = %name, "a backend is up again: no longer failing open");
        }
        for (id, _) in &e.slots {
            let mut b: Backend = bpfmap::get(&maps.backends, id)?.unwrap_or_default();
            if backend_removed(&b) {
                continue;
            }
            let want = !panic && down(id);
            if (b.flags & BACKEND_DOWN != 0) != want {
                b.flags = if want { b.flags | BACKEND_DOWN } else { b.flags & !BACKEND_DOWN };
                bpfmap::put(&maps.backends, id, &b)?;
                changed.insert(*id);
            }
        }
    }
    // Large VIPs pick from their eligible sets (select.h): DOWN leaves them.
    tables::refresh_eligible(maps, &changed)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

//! The controller: learns every backend's weight→latency curve while
//! client traffic flows, solves for the weights, writes them, and re-solves
//! when the traffic, a backend's capacity or a backend's health changes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use tracing::{info, warn};

use super::apply;
use super::config::{Target, WeightsConfig};
use super::learn::{self, Curve, Point, Search, DROP_FACTOR};
use super::probe::{self, Failure};
use super::solve;
use super::status::{self, BackendState, BackendStatus, Decision, Phase, SolveRecord, Status};

/// The failure detector: this many TCP handshakes per backend every
/// `HEALTH_EVERY` (the seed's 3 requests per 100 ms); a backend fails
/// when all of one window's fail.
const HEALTH_TRIES: usize = 3;
const HEALTH_EVERY: Duration = Duration::from_millis(100);
/// A failed backend is back after this many good windows in a row (1 s):
/// one lucky handshake does not undo a failure.
const HEALTH_RECOVER: u32 = 10;
/// This many failed latency probes in a row fail a backend whose TCP stack
/// still answers (the application is gone).
const PROBES_FAILED: usize = 3;
/// A latency change is a traffic change (all curves move together) when
/// at least this share of the backends moved the same way.
const TRAFFIC_SHARE: f64 = 0.75;
/// One re-solve moves a curve by at most this factor either way.
const SHIFT_BOUNDS: (f64, f64) = (0.25, 2.0);

/// One latency probe: in flight while `outcome` is None.
struct Sample {
    sent: Instant,
    outcome: Option<Result<f64, Failure>>,
}

/// What the probe and health tasks learn about one backend.
#[derive(Default)]
struct Observed {
    samples: Mutex<VecDeque<Sample>>,
    unhealthy: AtomicBool,
}

/// A window's view of one backend's probes.
#[derive(Clone, Copy, Debug)]
struct Window {
    mean_ms: f64,
    count: usize,
    failed: bool,
}

impl Observed {
    /// Probes sent in [from, to]; one still in flight counts with its age
    /// so far, so a slow backend's unfinished probes do not leave only its
    /// fast ones in the mean.
    fn window(&self, from: Instant, to: Instant) -> Option<Window> {
        let now = Instant::now();
        let samples = self.samples.lock().unwrap();
        let (mut sum, mut count, mut failed) = (0.0, 0usize, false);
        for s in samples.iter().filter(|s| s.sent >= from && s.sent <= to) {
            match s.outcome {
                Some(Ok(ms)) => sum += ms,
                Some(Err(_)) => failed = true,
                None => sum += now.duration_since(s.sent).as_secs_f64() * 1e3,
            }
            if !matches!(s.outcome, Some(Err(_))) {
                count += 1;
            }
        }
        (count > 0 || failed).then(|| Window { mean_ms: if count > 0 { sum / count as f64 } else { f64::INFINITY }, count, failed })
    }

    /// The last `PROBES_FAILED` finished probes all failed without an
    /// HTTP answer.
    fn probes_failing(&self) -> bool {
        let samples = self.samples.lock().unwrap();
        let done: Vec<&Sample> = samples.iter().rev().filter(|s| s.outcome.is_some()).take(PROBES_FAILED).collect();
        done.len() == PROBES_FAILED && done.iter().all(|s| matches!(s.outcome, Some(Err(f)) if !matches!(f, Failure::Status(_))))
    }
}

/// Per backend: what the controller knows and decided.
struct Known {
    l0: Option<f64>,
    points: Vec<Point>,
    search: Search,
    target: f64,
    waited: u32,
    curve: Option<Curve>,
    latency: Option<f64>,
    off: u32,
    failed: bool,
}

pub struct Controller {
    cfg: WeightsConfig,
    observed: Vec<Arc<Observed>>,
    known: Vec<Known>,
    /// Weights in force (sum 1) and the integers written for them.
    weights: Vec<f64>,
    applied: Vec<u32>,
    phase: Phase,
    last_solve: Option<SolveRecord>,
    decisions: VecDeque<Decision>,
    stop: Arc<AtomicBool>,
}

impl Controller {
    pub fn new(cfg: WeightsConfig, stop: Arc<AtomicBool>) -> Controller {
        let n = cfg.backends.len();
        Controller {
            observed: (0..n).map(|_| Arc::new(Observed::default())).collect(),
            known: (0..n)
                .map(|_| Known {
                    l0: None,
                    points: Vec::new(),
                    search: Search::default(),
                    target: 1.0 / n as f64,
                    waited: 0,
                    curve: None,
                    latency: None,
                    off: 0,
                    failed: false,
                })
                .collect(),
            weights: vec![1.0 / n as f64; n],
            applied: vec![0; n],
            phase: Phase::Learning,
            last_solve: None,
            decisions: VecDeque::new(),
            stop,
            cfg,
        }
    }

    pub async fn run(mut self) -> Result<()> {
        for (i, b) in self.cfg.backends.iter().enumerate() {
            tokio::spawn(probe_loop(b.address, self.cfg.probe_path.clone(), self.cfg.clone_timing(), self.observed[i].clone(), self.stop.clone()));
            tokio::spawn(health_loop(b.address, self.observed[i].clone(), self.stop.clone()));
        }
        if self.cfg.backends.len() == 1 {
            self.decide("one backend: it takes every connection, nothing to learn".into());
            self.set(vec![1.0])?;
            self.phase = Phase::Steady;
        } else {
            self.learn().await?;
            self.resolve("curves learned")?;
            self.phase = Phase::Steady;
        }
        self.publish();
        self.steady().await
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleeps `d` unless asked to stop; false when stopping.
    async fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        while Instant::now() < until {
            if self.stopped() {
                return false;
            }
            tokio::time::sleep((until - Instant::now()).min(Duration::from_millis(100))).await;
        }
        !self.stopped()
    }

    fn decide(&mut self, what: String) {
        info!("{what}");
        if self.decisions.len() == status::DECISIONS_KEPT {
            self.decisions.pop_front();
        }
        self.decisions.push_back(Decision { unix_ms: status::unix_ms(), what });
    }

    /// Writes `weights` to the balancer; the old ones stay in force (and
    /// the error is a decision) if it refuses.
    fn set(&mut self, weights: Vec<f64>) -> Result<()> {
        match apply::write(&self.cfg.target, &self.cfg.backends, &weights) {
            Ok(ints) => {
                self.applied = ints;
                self.weights = weights;
                Ok(())
            }
            Err(e) => {
                self.decide(format!("writing weights failed, the previous ones stay: {e:#}"));
                self.publish();
                Err(e)
            }
        }
    }

    /// One measurement round at `weights`: applies them, waits, and
    /// returns each backend's window over the round's second half.
    async fn round(&mut self, weights: Vec<f64>) -> Result<Option<Vec<Option<Window>>>> {
        self.set(weights)?;
        self.publish();
        let start = Instant::now();
        let round = Duration::from_millis(self.cfg.round_ms);
        if !self.pause(round).await {
            return Ok(None);
        }
        let mid = start + round / 2;
        Ok(Some(self.observed.iter().map(|o| o.window(mid, Instant::now())).collect()))
    }

    async fn learn(&mut self) -> Result<()> {
        let n = self.cfg.backends.len();
        // The unloaded latency: a quarter of the backends at a time at
        // weight 0, the others sharing the traffic.
        let group = n.div_ceil(4);
        for chunk in (0..n).collect::<Vec<_>>().chunks(group) {
            let others = (n - chunk.len()) as f64;
            let w: Vec<f64> = (0..n).map(|i| if chunk.contains(&i) { 0.0 } else { 1.0 / others }).collect();
            let Some(win) = self.round(w.clone()).await? else { return Ok(()) };
            for i in 0..n {
                match (win[i], chunk.contains(&i)) {
                    (Some(m), true) if m.count > 0 => {
                        self.known[i].l0 = Some(m.mean_ms);
                        self.known[i].points.push(Point { weight: 0.0, latency_ms: m.mean_ms, drop: false });
                    }
                    (Some(m), false) => self.record(i, w[i], m, false),
                    _ => {}
                }
            }
        }
        for i in 0..n {
            if self.known[i].l0.is_none() {
                self.known[i].failed = true;
                self.known[i].search.done = true;
                self.decide(format!("{}: no probe answered at weight 0: left out until it answers", self.cfg.backends[i].label()));
            }
        }
        for round in 1..=self.cfg.max_rounds {
            if self.known.iter().all(|k| k.search.done) {
                break;
            }
            let wants: Vec<Want> = self
                .known
                .iter()
                .map(|k| Want { target: k.target, searching: !(k.search.done || k.failed), waited: k.waited })
                .collect();
            let (w, got) = schedule(&wants, &self.weights);
            let Some(win) = self.round(w.clone()).await? else { return Ok(()) };
            for i in 0..n {
                if let Some(m) = win[i] {
                    self.record(i, w[i], m, got[i]);
                }
                self.known[i].waited = if got[i] { 0 } else { self.known[i].waited + 1 };
            }
            let left: Vec<String> =
                (0..n).filter(|&i| !self.known[i].search.done).map(|i| self.cfg.backends[i].label()).collect();
            self.decide(format!("learning round {round}: weights {}; still searching: {}", fmt_weights(&w), if left.is_empty() { "none".into() } else { left.join(", ") }));
        }
        for i in 0..n {
            self.known[i].curve = learn::fit(&self.known[i].points);
            if self.known[i].curve.is_none() && !self.known[i].failed {
                self.known[i].failed = true;
                self.decide(format!("{}: no measurement without a drop: left out", self.cfg.backends[i].label()));
            }
        }
        Ok(())
    }

    /// Records a round's point for backend `i` at weight `w` and, if it
    /// got the weight its search asked for, takes the search's next step.
    fn record(&mut self, i: usize, w: f64, m: Window, search: bool) {
        let k = &mut self.known[i];
        let l0 = k.l0.unwrap_or(m.mean_ms);
        let p = Point { weight: w, latency_ms: m.mean_ms.min(1e6), drop: m.failed || m.mean_ms >= DROP_FACTOR * l0 };
        k.points.push(p);
        k.latency = Some(p.latency_ms);
        if search && !k.search.done && !k.failed {
            k.target = k.search.next(p, l0, self.cfg.alpha);
        }
    }

    fn resolve(&mut self, reason: &str) -> Result<()> {
        let curves: Vec<Option<Curve>> = self.known.iter().map(|k| if k.failed { None } else { k.curve }).collect();
        let solved = solve::solve(&curves, self.cfg.levels, self.cfg.objective, self.cfg.theta)?;
        self.last_solve = Some(SolveRecord {
            unix_ms: status::unix_ms(),
            reason: reason.to_string(),
            solve_ms: solved.solve_ms,
            steps: solved.steps,
            objective_ms: solved.objective_ms,
            fallback: solved.fallback.clone(),
        });
        let mut what = format!("solved ({reason}) in {:.1} ms: weights {}", solved.solve_ms, fmt_weights(&solved.weights));
        if let Some(f) = &solved.fallback {
            what += &format!(" ({f})");
        }
        self.decide(what);
        let result = self.set(solved.weights);
        for k in &mut self.known {
            k.off = 0;
        }
        self.publish();
        result
    }

    async fn steady(mut self) -> Result<()> {
        let check = Duration::from_millis(self.cfg.check_ms);
        let window = Duration::from_millis(self.cfg.window_ms);
        // Latency right after a change reflects the old weights' queues.
        let mut settled_at = Instant::now() + window;
        loop {
            let tick = Instant::now() + check;
            while Instant::now() < tick {
                if self.stopped() {
                    self.decide("stopping: the balancer keeps the last weights".into());
                    self.publish();
                    return Ok(());
                }
                if self.health_changed() {
                    // A failure is acted on at once, not at the next check.
                    if let Err(e) = self.resolve("a backend's health changed") {
                        warn!("{e:#}");
                    }
                    settled_at = Instant::now() + window;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let now = Instant::now();
            if now < settled_at {
                continue;
            }
            if let Some(reason) = self.drift(now - window, now) {
                if let Err(e) = self.resolve(&reason) {
                    warn!("{e:#}");
                }
                settled_at = Instant::now() + window;
            }
            self.publish();
        }
    }

    /// Marks backends failed or recovered; true if any changed.
    fn health_changed(&mut self) -> bool {
        let mut changed = false;
        for i in 0..self.known.len() {
            let down = self.observed[i].unhealthy.load(Ordering::Relaxed) || self.observed[i].probes_failing();
            let k = &mut self.known[i];
            if down != k.failed && (k.curve.is_some() || down) {
                k.failed = down;
                changed = true;
                let label = self.cfg.backends[i].label();
                self.decide(if down {
                    format!("{label} failed (no handshake or no HTTP answer): re-solving without it")
                } else {
                    format!("{label} is back: re-solving with its curve")
                });
            }
        }
        changed
    }

    /// Compares each backend's latency over [from, to] with its curve at
    /// its weight; after `confirm` checks off by more than `tolerance`,
    /// shifts curves (all of them for a traffic change, one for a
    /// capacity change) and returns the reason to re-solve.
    fn drift(&mut self, from: Instant, to: Instant) -> Option<String> {
        let mut moved: Vec<(usize, f64)> = Vec::new();
        let mut live = 0usize;
        for i in 0..self.known.len() {
            let Some(win) = self.observed[i].window(from, to) else { continue };
            let w = self.weights[i];
            let k = &mut self.known[i];
            let Some(curve) = k.curve.filter(|_| !k.failed) else { continue };
            if win.count < 3 {
                continue;
            }
            live += 1;
            k.latency = Some(win.mean_ms);
            let expected = curve.latency(w);
            if (win.mean_ms / expected - 1.0).abs() <= self.cfg.tolerance {
                k.off = 0;
                continue;
            }
            k.off += 1;
            if k.off >= self.cfg.confirm {
                moved.push((i, shift_for(&curve, w, win.mean_ms)));
            }
        }
        if moved.is_empty() {
            return None;
        }
        let up = moved.iter().filter(|(_, d)| *d < 1.0).count();
        let same_way = up.max(moved.len() - up);
        if live >= 2 && same_way as f64 >= TRAFFIC_SHARE * live as f64 {
            let mut deltas: Vec<f64> = moved.iter().map(|(_, d)| *d).collect();
            deltas.sort_by(f64::total_cmp);
            let delta = deltas[deltas.len() / 2];
            for k in self.known.iter_mut() {
                k.curve = k.curve.map(|c| c.shifted(delta));
            }
            let what = format!("traffic change: {} of {live} backends off their curves; every curve shifted by {delta:.3}", moved.len());
            self.decide(what.clone());
            return Some(what);
        }
        let mut names = Vec::new();
        for (i, delta) in moved {
            let w = self.weights[i];
            let k = &mut self.known[i];
            let before = k.curve.map(|c| c.latency(w)).unwrap_or(f64::NAN);
            k.curve = k.curve.map(|c| c.shifted(delta));
            let measured = k.latency.unwrap_or(f64::NAN);
            let label = self.cfg.backends[i].label();
            self.decide(format!(
                "capacity change of {label}: {measured:.2} ms measured vs {before:.2} ms on its curve at weight {w:.4}; \
                 its curve shifted by {delta:.3}"
            ));
            names.push(label);
        }
        Some(format!("capacity change of {}", names.join(", ")))
    }

    fn publish(&self) {
        let backends = self
            .cfg
            .backends
            .iter()
            .zip(&self.known)
            .enumerate()
            .map(|(i, (b, k))| BackendStatus {
                address: b.address.to_string(),
                name: b.name.clone(),
                state: if k.failed {
                    BackendState::Failed
                } else if self.phase == Phase::Learning {
                    BackendState::Learning
                } else {
                    BackendState::Ready
                },
                weight: self.weights[i],
                applied: self.applied[i],
                l0_ms: k.l0,
                w_max: k.curve.map(|c| c.w_max),
                curve: k.curve.map(|c| c.c),
                points: k.points.clone(),
                latency_ms: k.latency,
            })
            .collect();
        let s = Status {
            phase: self.phase,
            target: describe(&self.cfg.target),
            last_solve: self.last_solve.clone(),
            backends,
            decisions: self.decisions.iter().cloned().collect(),
        };
        if let Err(e) = status::write(&self.cfg.status_file, &s) {
            warn!("{e:#}");
        }
    }
}

fn describe(t: &Target) -> String {
    match t {
        Target::Inband { vip, protocol, .. } => format!("inband VIP {vip}/{}", protocol.name()),
        Target::Haproxy { backend, .. } => format!("HAProxy backend {backend}"),
    }
}

fn fmt_weights(w: &[f64]) -> String {
    w.iter().map(|w| format!("{w:.3}")).collect::<Vec<_>>().join(" ")
}

/// How far a curve must shift for `latency` to be what it gives at `w`.
fn shift_for(curve: &Curve, w: f64, latency: f64) -> f64 {
    let limit = (8.0 * curve.w_max).max(8.0 * w).max(1.0);
    let delta = match curve.weight_at(latency, limit) {
        Some(w2) if w2 > 0.0 => w / w2,
        // Faster than its curve's floor, or beyond anything it covers.
        _ if latency < curve.latency(w) => SHIFT_BOUNDS.1,
        _ => SHIFT_BOUNDS.0,
    };
    delta.clamp(SHIFT_BOUNDS.0, SHIFT_BOUNDS.1)
}

/// What one backend asks of a learning round.
#[derive(Clone, Copy, Debug)]
pub struct Want {
    /// The next weight its search wants measured.
    pub target: f64,
    pub searching: bool,
    /// Rounds since it last got its target.
    pub waited: u32,
}

/// The weights of one learning round and which backends got their target
/// (the seed's greedy scheduler): those backing off first (they are the
/// overloaded ones, and shrinking always fits), then those growing, the
/// longest-waiting first, each if its target still fits in a total of 1;
/// the others share what is left by their current weights (nothing, if
/// the scheduled ones need it all: the traffic has to go somewhere). A
/// backend that did not get its target keeps it for a later round, so a
/// large backend's search still reaches weights near 1.
pub fn schedule(wants: &[Want], current: &[f64]) -> (Vec<f64>, Vec<bool>) {
    let n = wants.len();
    let mut order: Vec<usize> = (0..n).filter(|&i| wants[i].searching).collect();
    order.sort_by_key(|&i| (wants[i].target >= current[i], std::cmp::Reverse(wants[i].waited), i));
    let mut w = vec![0.0; n];
    let mut got = vec![false; n];
    let mut left = 1.0f64;
    for i in order {
        if wants[i].target <= left + 1e-12 {
            w[i] = wants[i].target.min(left);
            got[i] = true;
            left -= w[i];
        }
    }
    let rest: Vec<usize> = (0..n).filter(|&i| !got[i]).collect();
    let held: f64 = rest.iter().map(|&i| current[i]).sum();
    for &i in &rest {
        w[i] = if held > 0.0 { left.max(0.0) * current[i] / held } else { left.max(0.0) / rest.len() as f64 };
    }
    let total: f64 = w.iter().sum();
    // Everyone scheduled and less than 1 wanted: scaled up to 1.
    let w = if total > 0.0 { w.iter().map(|x| x / total).collect() } else { vec![1.0 / n as f64; n] };
    (w, got)
}

/// The seed's latency probes: `probe_rate` a second, each on its own
/// schedule (a slow answer does not delay the next probe).
async fn probe_loop(addr: std::net::SocketAddr, path: String, t: Timing, obs: Arc<Observed>, stop: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(t.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let sent = Instant::now();
        {
            let mut s = obs.samples.lock().unwrap();
            while s.front().is_some_and(|x| sent.duration_since(x.sent) > t.keep) {
                s.pop_front();
            }
            s.push_back(Sample { sent, outcome: None });
        }
        let (obs, path) = (obs.clone(), path.clone());
        tokio::spawn(async move {
            let r = probe::get(addr, &path, t.timeout).await.map(|d| d.as_secs_f64() * 1e3);
            let mut s = obs.samples.lock().unwrap();
            if let Some(x) = s.iter_mut().rev().find(|x| x.sent == sent) {
                x.outcome = Some(r);
            }
        });
    }
}

async fn health_loop(addr: std::net::SocketAddr, obs: Arc<Observed>, stop: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(HEALTH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut good = HEALTH_RECOVER;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let tries = (0..HEALTH_TRIES).map(|_| probe::connects(addr, HEALTH_EVERY));
        let ok = futures_any(tries).await;
        good = if ok { good.saturating_add(1) } else { 0 };
        obs.unhealthy.store(good < HEALTH_RECOVER, Ordering::Relaxed);
    }
}

/// True if any of the handshakes succeeded (they run concurrently).
async fn futures_any(tries: impl Iterator<Item = impl std::future::Future<Output = bool> + Send + 'static>) -> bool {
    let handles: Vec<_> = tries.map(tokio::spawn).collect();
    let mut any = false;
    for h in handles {
        any |= h.await.unwrap_or(false);
    }
    any
}

#[derive(Clone, Copy)]
pub struct Timing {
    every: Duration,
    timeout: Duration,
    keep: Duration,
}

impl WeightsConfig {
    fn clone_timing(&self) -> Timing {
        Timing {
            every: Duration::from_secs_f64(1.0 / f64::from(self.probe_rate)),
            timeout: Duration::from_millis(self.probe_timeout_ms),
            keep: Duration::from_millis(self.window_ms.max(self.round_ms) + self.probe_timeout_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A steady controller over four backends with the curve
    /// 10 + 100·w² each at weight 0.25, whose probes all took `ms[i]`.
    fn steady_with(ms: [f64; 4]) -> Controller {
        let cfg = WeightsConfig::parse(
            "[target]\nkind = \"inband\"\nvip = \"10.0.0.100:80\"\n[[backend]]\naddress = \"10.0.1.1:80\"\n\
             [[backend]]\naddress = \"10.0.1.2:80\"\n[[backend]]\naddress = \"10.0.1.3:80\"\n[[backend]]\naddress = \"10.0.1.4:80\"\n",
        )
        .unwrap();
        let mut c = Controller::new(cfg, Arc::new(AtomicBool::new(false)));
        c.phase = Phase::Steady;
        for (i, k) in c.known.iter_mut().enumerate() {
            k.curve = Some(Curve { c: [10.0, 0.0, 100.0], w_max: 0.6 });
            let mut s = c.observed[i].samples.lock().unwrap();
            for _ in 0..10 {
                s.push_back(Sample { sent: Instant::now(), outcome: Some(Ok(ms[i])) });
            }
        }
        c
    }

    fn checks(c: &mut Controller, n: u32) -> Option<String> {
        let from = Instant::now() - Duration::from_secs(5);
        (0..n).find_map(|_| c.drift(from, Instant::now()))
    }

    #[test]
    fn latency_off_the_curve_triggers_a_re_solve_after_confirm_checks() {
        // On the curve (16.25 ms at 0.25) within 20%: nothing to do.
        let mut c = steady_with([17.0, 15.0, 16.25, 18.0]);
        assert_eq!(checks(&mut c, 10), None);

        // Every backend slower: traffic grew, every curve moves alike.
        let mut c = steady_with([30.0, 31.0, 29.0, 30.0]);
        assert_eq!(checks(&mut c, 2), None, "confirm = 3 checks");
        let why = checks(&mut c, 1).unwrap();
        assert!(why.starts_with("traffic change: 4 of 4"), "{why}");
        let shifted: Vec<f64> = c.known.iter().map(|k| k.curve.unwrap().w_max).collect();
        assert!(shifted.iter().all(|w| (w - shifted[0]).abs() < 1e-12 && *w < 0.6), "{shifted:?}");

        // One backend slower: its capacity changed, only its curve moves,
        // so that it now predicts what was measured at its weight.
        let mut c = steady_with([16.0, 16.0, 50.0, 16.0]);
        let why = checks(&mut c, 3).unwrap();
        assert_eq!(why, "capacity change of 10.0.1.3:80");
        assert!((c.known[2].curve.unwrap().latency(0.25) - 50.0).abs() < 0.01);
        assert_eq!(c.known[0].curve.unwrap().w_max, 0.6);
        assert!(c.decisions.back().unwrap().what.contains("50.00 ms measured vs 16.25 ms"));
    }

    #[test]
    fn a_failed_backend_is_noticed_and_left_out_of_the_solve() {
        let mut c = steady_with([16.0; 4]);
        assert!(!c.health_changed());
        c.observed[1].unhealthy.store(true, Ordering::Relaxed);
        assert!(c.health_changed());
        assert!(c.known[1].failed && c.decisions.back().unwrap().what.contains("10.0.1.2:80 failed"));
        let curves: Vec<Option<Curve>> = c.known.iter().map(|k| if k.failed { None } else { k.curve }).collect();
        assert_eq!(solve::solve(&curves, 10, c.cfg.objective, None).unwrap().weights[1], 0.0);
        c.observed[1].unhealthy.store(false, Ordering::Relaxed);
        assert!(c.health_changed() && !c.known[1].failed);
    }

    fn wants(v: &[(f64, bool, u32)]) -> Vec<Want> {
        v.iter().map(|&(target, searching, waited)| Want { target, searching, waited }).collect()
    }

    #[test]
    fn a_round_backs_off_first_and_never_gives_out_more_than_everything() {
        // Two backing off get their targets first; of the two growing,
        // the one that waited longer gets its target, the other what is left.
        let (w, got) = schedule(&wants(&[(0.125, true, 0), (0.125, true, 0), (0.475, true, 0), (0.5, true, 2)]), &[0.25; 4]);
        assert_eq!(w, vec![0.125, 0.125, 0.25, 0.5]);
        assert_eq!(got, vec![true, true, false, true]);
        // Done backends share the rest by their weights...
        let (w, _) = schedule(&wants(&[(0.2, true, 0), (0.9, false, 0), (0.9, false, 0)]), &[0.3, 0.2, 0.5]);
        assert!((w[0] - 0.2).abs() < 1e-12 && (w[1] - 0.8 * 0.2 / 0.7).abs() < 1e-12, "{w:?}");
        // ...and yield it all to a backend that grows into it.
        let (w, got) = schedule(&wants(&[(0.9, false, 0), (0.9, false, 0), (1.0, true, 0)]), &[0.1, 0.1, 0.8]);
        assert_eq!((w, got), (vec![0.0, 0.0, 1.0], vec![false, false, true]));
        // Everything scheduled under 1: scaled up to 1.
        let (w, _) = schedule(&wants(&[(0.1, true, 0), (0.3, true, 0)]), &[0.05, 0.05]);
        assert!((w[0] - 0.25).abs() < 1e-12 && (w[1] - 0.75).abs() < 1e-12, "{w:?}");
    }

    #[test]
    fn a_curve_shifts_so_that_it_meets_the_measured_latency() {
        let c = Curve { c: [10.0, 0.0, 100.0], w_max: 0.5 };
        let d = shift_for(&c, 0.2, c.latency(0.3));
        assert!((d - 0.2 / 0.3).abs() < 1e-6, "{d}");
        assert!((c.shifted(d).latency(0.2) - c.latency(0.3)).abs() < 1e-6);
        // Faster than its floor: the largest step up; far slower: the largest down.
        assert_eq!(shift_for(&c, 0.2, 5.0), SHIFT_BOUNDS.1);
        assert_eq!(shift_for(&c, 0.2, 1e9), SHIFT_BOUNDS.0);
    }

    #[test]
    fn a_window_counts_unfinished_probes_by_their_age_and_notices_failures() {
        let obs = Observed::default();
        let t0 = Instant::now() - Duration::from_millis(500);
        {
            let mut s = obs.samples.lock().unwrap();
            s.push_back(Sample { sent: t0, outcome: Some(Ok(10.0)) });
            s.push_back(Sample { sent: t0, outcome: None });
            s.push_back(Sample { sent: t0, outcome: Some(Err(Failure::Status(503))) });
        }
        let w = obs.window(t0, Instant::now()).unwrap();
        assert_eq!(w.count, 2);
        assert!(w.failed && w.mean_ms >= (10.0 + 500.0) / 2.0, "{w:?}");
        assert!(!obs.probes_failing(), "a 503 is an answer");
        for _ in 0..3 {
            obs.samples.lock().unwrap().push_back(Sample { sent: Instant::now(), outcome: Some(Err(Failure::Connect)) });
        }
        assert!(obs.probes_failing());
    }
}

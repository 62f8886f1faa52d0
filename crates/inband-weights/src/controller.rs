//! The controller: learns every backend's weight→latency curve while
//! client traffic flows, solves for the weights, writes them, and re-solves
//! when the traffic, a backend's capacity or a backend's health changes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use tracing::{info, warn};

use super::apply;
use super::config::{LoadAware, Target, WeightsConfig};
use super::learn::{self, adjust, schedule, Curve, Point, Search, Want};
use super::observe::{self, Observed, Window};
use super::shares::{self, Meter};
use super::solve;
use super::status::{self, BackendState, BackendStatus, Decision, Phase, SolveRecord, ControllerStatus};

/// A latency change is a traffic change (all curves move together) when
/// at least this share of the backends moved the same way.
const TRAFFIC_SHARE: f64 = 0.75;
/// A dropped backend's queue counts as drained when its probes' median is
/// within this factor of its unloaded latency.
const DRAINED: f64 = 2.0;

/// One learning round's measurements, over its second half [mid, end]:
/// per backend its probes' window and the share of new connections it got.
struct Round {
    mid: Instant,
    end: Instant,
    seen: Vec<(Option<Window>, f64)>,
}

/// Per backend: what the controller knows and decided.
struct Known {
    l0: Option<f64>,
    points: Vec<Point>,
    search: Search,
    target: f64,
    waited: u32,
    /// It dropped: weight 0 until its probes are answered within
    /// `DRAINED` × l₀ again, so that its next point measures the next
    /// weight and not the queue the overload left (which, near capacity,
    /// takes many rounds to drain and made every later weight look
    /// overloaded).
    draining: bool,
    curve: Option<Curve>,
    latency: Option<f64>,
    /// The share of new connections it got over the last round or window.
    share: Option<f64>,
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
    /// An inband target's per-backend connection counters (opened when
    /// the balancer is found); HAProxy's follow the weights as asked.
    meter: Option<Meter>,
    /// The balancer's counters could not be found (said once).
    meter_missing: bool,
    /// The last solve failed: try again at the next check.
    unsolved: bool,
    /// The weights in force are capacities (the VIP ranked by load then).
    capacity_weights: bool,
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
                    draining: false,
                    curve: None,
                    latency: None,
                    share: None,
                    off: 0,
                    failed: false,
                })
                .collect(),
            weights: vec![1.0 / n as f64; n],
            applied: vec![0; n],
            phase: Phase::Learning,
            last_solve: None,
            decisions: VecDeque::new(),
            meter: None,
            meter_missing: false,
            unsolved: false,
            capacity_weights: false,
            stop,
            cfg,
        }
    }

    pub async fn run(mut self) -> Result<()> {
        for (i, b) in self.cfg.backends.iter().enumerate() {
            self.observed[i] = observe::watch(b.address, &self.cfg, self.stop.clone());
        }
        if self.cfg.backends.len() == 1 {
            self.decide("one backend: it takes every connection, nothing to learn".into());
            self.set(vec![1.0])?;
            self.phase = Phase::Steady;
        } else {
            self.learn().await?;
            if self.stopped() {
                // Curves from half a learning are not worth a solve.
                self.decide("stopped while learning: the balancer keeps the last round's weights".into());
                self.publish();
                return Ok(());
            }
            self.phase = Phase::Steady;
            if let Err(e) = self.resolve("curves learned") {
                // The last round's weights stay; the next check retries.
                self.decide(format!("no weights from the curves yet: {e:#}"));
                self.unsolved = true;
            }
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

    /// Every backend's new connections so far at an inband balancer; None
    /// for HAProxy, or while the balancer is not found (then the weights
    /// asked for stand in for the shares given).
    fn counts(&mut self) -> Option<Vec<u64>> {
        let Target::Inband { socket, vip, protocol } = &self.cfg.target else { return None };
        if self.meter.is_none() {
            match Meter::open(socket.clone(), *vip, *protocol) {
                Ok(m) => {
                    self.meter = Some(m);
                    self.meter_missing = false;
                }
                Err(e) => {
                    if !self.meter_missing {
                        warn!("shares of new connections unknown, using the weights instead: {e:#}");
                        self.meter_missing = true;
                    }
                    return None;
                }
            }
        }
        let addrs: Vec<_> = self.cfg.backends.iter().map(|b| b.address).collect();
        match self.meter.as_ref()?.counts(&addrs) {
            Ok(c) => Some(c),
            Err(e) => {
                warn!("reading the balancer's counters: {e:#}");
                self.meter = None;
                None
            }
        }
    }

    /// Whether the balancer is given capacities rather than the ILP's
    /// weights (`load_aware`, config.rs).
    fn load_aware(&mut self) -> bool {
        match self.cfg.load_aware {
            LoadAware::Capacity => true,
            LoadAware::Ilp => false,
            LoadAware::Auto => {
                if self.meter.is_none() {
                    self.counts();
                }
                self.meter.as_ref().is_some_and(|m| m.ranks_by_load().unwrap_or(false))
            }
        }
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
    /// returns each backend's window over the round's second half with the
    /// share of new connections it got then (the weight, if unknown).
    async fn round(&mut self, weights: Vec<f64>) -> Result<Option<Round>> {
        self.set(weights.clone())?;
        self.publish();
        let half = Duration::from_millis(self.cfg.round_ms) / 2;
        if !self.pause(half).await {
            return Ok(None);
        }
        let (mid, before) = (Instant::now(), self.counts());
        if !self.pause(half).await {
            return Ok(None);
        }
        let given = before.zip(self.counts()).and_then(|(b, a)| shares::between(&b, &a)).unwrap_or(weights);
        let end = Instant::now();
        let seen = self.observed.iter().zip(given).map(|(o, share)| (o.window(mid, end), share)).collect();
        Ok(Some(Round { mid, end, seen }))
    }

    async fn learn(&mut self) -> Result<()> {
        let n = self.cfg.backends.len();
        // The unloaded latency: a quarter of the backends at a time at
        // weight 0, the others sharing the traffic.
        let group = n.div_ceil(4);
        for chunk in (0..n).collect::<Vec<_>>().chunks(group) {
            let others = (n - chunk.len()) as f64;
            let w: Vec<f64> = (0..n).map(|i| if chunk.contains(&i) { 0.0 } else { 1.0 / others }).collect();
            let Some(round) = self.round(w).await? else { return Ok(()) };
            for (i, &(m, share)) in round.seen.iter().enumerate() {
                match (m, chunk.contains(&i)) {
                    (Some(_), true) => {
                        if let Some(l0) = self.observed[i].median(round.mid, round.end) {
                            self.known[i].l0 = Some(l0);
                            // Points taken while other floors were measured
                            // had no floor to be judged by.
                            for p in &mut self.known[i].points {
                                p.drop = p.dropped(l0);
                            }
                            self.known[i].points.push(Point { weight: 0.0, latency_ms: l0, drop: false });
                        }
                    }
                    (Some(m), false) => self.record(i, share, m, false),
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
                .map(|k| {
                    let safe = if k.failed { 0.0 } else { k.search.good };
                    // Nothing dropped yet: the search is still finding out.
                    let open = k.search.bad.is_none() && !k.search.done;
                    Want {
                        target: if k.draining { 0.0 } else { k.target },
                        searching: k.draining || !(k.search.done || k.failed),
                        waited: k.waited,
                        ceiling: if k.failed || k.draining { 0.0 } else if open { 1.0 } else { safe },
                        safe,
                    }
                })
                .collect();
            let (w, got) = schedule(&wants, &self.weights);
            let draining: Vec<bool> = self.known.iter().map(|k| k.draining).collect();
            let Some(measured) = self.round(w.clone()).await? else { return Ok(()) };
            for (i, &(m, share)) in measured.seen.iter().enumerate() {
                if draining[i] {
                    let l0 = self.known[i].l0.unwrap_or(f64::INFINITY);
                    self.known[i].draining =
                        !self.observed[i].median(measured.mid, measured.end).is_some_and(|l| l <= DRAINED * l0);
                    continue;
                }
                if let Some(m) = m {
                    self.record(i, share, m, got[i]);
                }
                self.known[i].waited = if got[i] { 0 } else { self.known[i].waited + 1 };
            }
            let left: Vec<String> =
                (0..n).filter(|&i| !self.known[i].search.done).map(|i| self.cfg.backends[i].label()).collect();
            self.decide(format!("learning round {round}: weights {}; still searching: {}", fmt_weights(&w), if left.is_empty() { "none".into() } else { left.join(", ") }));
        }
        for i in 0..n {
            self.known[i].curve = learn::fit(&self.known[i].points, self.known[i].l0);
            if self.known[i].curve.is_none() && !self.known[i].failed {
                self.known[i].failed = true;
                self.decide(format!("{}: no measurement without a drop: left out", self.cfg.backends[i].label()));
            }
        }
        Ok(())
    }

    /// Records a round's point for backend `i` at share `w` and, if it
    /// got the weight its search asked for, takes the search's next step.
    fn record(&mut self, i: usize, w: f64, m: Window, search: bool) {
        let k = &mut self.known[i];
        let l0 = k.l0.unwrap_or(m.mean_ms);
        let mut p = Point { weight: w, latency_ms: m.mean_ms.min(1e6), drop: m.failed };
        p.drop = p.dropped(l0);
        k.draining |= p.drop;
        k.points.push(p);
        k.latency = Some(p.latency_ms);
        k.share = Some(w);
        if search && !k.search.done && !k.failed {
            k.target = k.search.next(p, l0, self.cfg.alpha);
        }
    }

    fn resolve(&mut self, reason: &str) -> Result<()> {
        let curves: Vec<Option<Curve>> = self.known.iter().map(|k| if k.failed { None } else { k.curve }).collect();
        let solved = solve::solve(&curves, self.cfg.levels, self.cfg.objective, self.cfg.theta)?;
        self.unsolved = false;
        let by_capacity = self.load_aware();
        self.capacity_weights = by_capacity;
        let weights = if by_capacity { solve::capacities(&curves) } else { solved.weights.clone() };
        let from = if by_capacity { "capacity" } else { "ilp" };
        self.last_solve = Some(SolveRecord {
            unix_ms: status::unix_ms(),
            reason: reason.to_string(),
            solve_ms: solved.solve_ms,
            steps: solved.steps,
            objective_ms: solved.objective_ms,
            fallback: solved.fallback.clone(),
            weights_from: from.to_string(),
        });
        let mut what = format!("solved ({reason}) in {:.1} ms: ILP weights {}", solved.solve_ms, fmt_weights(&solved.weights));
        if let Some(f) = &solved.fallback {
            what += &format!(" ({f})");
        }
        if by_capacity {
            what += &format!("; the VIP ranks by load: learned capacities written instead, {}", fmt_weights(&weights));
        }
        self.decide(what);
        let result = self.set(weights);
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
        let mut history: VecDeque<(Instant, Vec<u64>)> = VecDeque::new();
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
            let given = self.counts().and_then(|c| {
                history.push_back((now, c));
                while history.len() > 1 && now.duration_since(history[1].0) >= window {
                    history.pop_front();
                }
                shares::between(&history.front()?.1, &history.back()?.1)
            });
            let policy_changed = !self.unsolved && self.load_aware() != self.capacity_weights;
            if self.unsolved || policy_changed {
                let why = if policy_changed { "the VIP's policy changed" } else { "retrying a failed solve" };
                if let Err(e) = self.resolve(why) {
                    warn!("{e:#}");
                }
            }
            // Under capacities (a VIP ranking by load) the scores answer
            // traffic and capacity changes within a round trip; shifting
            // curves on latency that the scores keep moving made a second
            // feedback loop on the same signal, and the weights swung
            // (bench.weights: 24% of requests refused at 80% load). Only
            // health and the policy re-solve then.
            if now < settled_at || self.capacity_weights {
                self.observe_only(now - window, now, given);
                self.publish();
                continue;
            }
            if let Some(reason) = self.drift(now - window, now, given) {
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
    /// the share it was given then (`given`; its weight if unknown); after
    /// `confirm` checks off by more than `tolerance`, shifts curves (all of
    /// them for a traffic change, one for a capacity change) and returns
    /// the reason to re-solve.
    fn drift(&mut self, from: Instant, to: Instant, given: Option<Vec<f64>>) -> Option<String> {
        // (backend, its curve adjusted to what was measured, the shift
        // along the weights if that is how it was adjusted, slower?)
        let mut moved: Vec<(usize, Curve, Option<f64>, bool)> = Vec::new();
        let mut live = 0usize;
        for i in 0..self.known.len() {
            let Some(win) = self.observed[i].window(from, to) else { continue };
            let w = given.as_ref().map_or(self.weights[i], |g| g[i]);
            let k = &mut self.known[i];
            k.share = Some(w);
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
                let (fixed, delta) = adjust(&curve, w, win.mean_ms);
                moved.push((i, fixed, delta, win.mean_ms > expected));
            }
        }
        if moved.is_empty() {
            return None;
        }
        let slower = moved.iter().filter(|m| m.3).count();
        let same_way = slower.max(moved.len() - slower);
        let traffic = live >= 2 && same_way as f64 >= TRAFFIC_SHARE * live as f64;
        let mut names = Vec::new();
        for &(i, fixed, delta, _) in &moved {
            let w = self.known[i].share.unwrap_or(self.weights[i]);
            let k = &mut self.known[i];
            let before = k.curve.map_or(f64::NAN, |c| c.latency(w));
            k.curve = Some(fixed);
            let measured = k.latency.unwrap_or(f64::NAN);
            let label = self.cfg.backends[i].label();
            let how = delta.map_or_else(|| format!("moved by {:+.2} ms", measured - before), |d| format!("shifted by {d:.3}"));
            if !traffic {
                self.decide(format!(
                    "capacity change of {label}: {measured:.2} ms measured vs {before:.2} ms on its curve at share {w:.4}; its curve {how}"
                ));
            }
            names.push(label);
        }
        if traffic {
            // The seed's traffic shift: the backends that have not moved
            // yet move with the others (by the median shift).
            let mut deltas: Vec<f64> = moved.iter().filter_map(|m| m.2).collect();
            deltas.sort_by(f64::total_cmp);
            let median = deltas.get(deltas.len() / 2).copied();
            if let Some(d) = median {
                for (i, k) in self.known.iter_mut().enumerate() {
                    if !moved.iter().any(|m| m.0 == i) {
                        k.curve = k.curve.map(|c| c.shifted(d));
                    }
                }
            }
            let what = format!(
                "traffic change: {} of {live} backends off their curves, {}; the others' curves shifted by {}",
                moved.len(),
                if slower * 2 >= moved.len() { "slower" } else { "faster" },
                median.map_or("nothing".into(), |d| format!("{d:.3}"))
            );
            self.decide(what.clone());
            return Some(what);
        }
        Some(format!("capacity change of {}", names.join(", ")))
    }

    /// The latency and share of each backend over [from, to], for status,
    /// without judging them.
    fn observe_only(&mut self, from: Instant, to: Instant, given: Option<Vec<f64>>) {
        for (i, k) in self.known.iter_mut().enumerate() {
            if let Some(win) = self.observed[i].window(from, to).filter(|w| w.count > 0) {
                k.latency = Some(win.mean_ms);
            }
            k.share = given.as_ref().map(|g| g[i]).or(k.share);
        }
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
                share: k.share,
            })
            .collect();
        let s = ControllerStatus {
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

#[cfg(test)]
mod tests {
    use super::super::observe::Sample;
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
        (0..n).find_map(|_| c.drift(from, Instant::now(), None))
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
        assert!(why.starts_with("traffic change: 4 of 4 backends off their curves, slower"), "{why}");
        for (i, k) in c.known.iter().enumerate() {
            let meant = [30.0, 31.0, 29.0, 30.0][i];
            assert!((k.curve.unwrap().latency(0.25) - meant).abs() < 0.01 && k.curve.unwrap().w_max < 0.6, "{i}: {:?}", k.curve);
        }

        // One backend slower: its capacity changed, only its curve moves,
        // so that it now predicts what was measured at its weight.
        let mut c = steady_with([16.0, 16.0, 50.0, 16.0]);
        let why = checks(&mut c, 3).unwrap();
        assert_eq!(why, "capacity change of 10.0.1.3:80");
        assert!((c.known[2].curve.unwrap().latency(0.25) - 50.0).abs() < 0.01);
        assert_eq!(c.known[0].curve.unwrap().w_max, 0.6);
        assert!(c.decisions.back().unwrap().what.contains("50.00 ms measured vs 16.25 ms on its curve at share 0.2500; its curve shifted by"));
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
}

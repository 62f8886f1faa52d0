//! How a backend's latency grows with its weight: the search for the
//! weights to measure at (the seed's Algorithm 1, bracketed) and the
//! degree-2 curve fitted to what was measured.

use serde::{Deserialize, Serialize};

/// One measurement: the weight the balancer applied during a round and the
/// backend's mean probe latency then; `drop` if a probe failed or the
/// latency reached `DROP_FACTOR` times the backend's unloaded latency.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub weight: f64,
    pub latency_ms: f64,
    pub drop: bool,
}

impl Point {
    /// Whether this measurement was past the backend's capacity, judged
    /// against its unloaded latency `l0`. A point measured before `l0` was
    /// known (while another backend's floor was being measured) carries
    /// only `drop` from a failed probe; its latency is judged here, once.
    pub fn dropped(&self, l0: f64) -> bool {
        self.drop || self.latency_ms >= DROP_FACTOR * l0
    }
}

/// The seed treats a latency of five times the unloaded one as a drop:
/// backends this loaded are past their capacity.
pub const DROP_FACTOR: f64 = 5.0;
/// The search stops when the next step would be under 5% of the weight.
const CONVERGED: f64 = 0.05;

/// The state of one backend's search for its capacity.
///
/// The seed backs off "to the midpoint of the current and previous
/// weight". Starting at 1/N, which is already past the capacity of a
/// small backend among large ones (a 1-core backend among 1/2/4/8), that
/// midpoint climbs back into overload after two drops in a row. Here the
/// backoff bisects between the largest weight that did not drop (`good`)
/// and the smallest that did (`bad`), and growth never passes `bad`: the
/// same growth rule, a search that converges from either side.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Search {
    pub good: f64,
    pub bad: Option<f64>,
    pub done: bool,
}

impl Search {
    /// The weight to measure next after measuring `p` (`l0`: the latency at
    /// weight 0); marks the search done when the step is under 5%.
    pub fn next(&mut self, p: Point, l0: f64, alpha: f64) -> f64 {
        let w = p.weight;
        let dropped = p.dropped(l0);
        let next = if dropped {
            self.bad = Some(self.bad.map_or(w, |b| b.min(w)));
            (self.good + w) / 2.0
        } else {
            self.good = self.good.max(w);
            // No backend takes more than all the traffic.
            let grown = (w + w * alpha * l0 / p.latency_ms.max(l0)).min(1.0);
            match self.bad {
                Some(b) if grown >= b => (w + b) / 2.0,
                _ => grown,
            }
        };
        if (next - w).abs() < CONVERGED * w.max(f64::EPSILON) {
            self.done = true;
        }
        next
    }
}

/// latency_ms(w) = c0 + c1·w + c2·w², made monotone by the caller's use of
/// `latency` (never below its value at a smaller weight).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Curve {
    pub c: [f64; 3],
    /// The largest weight measured without a drop: the ILP's candidates
    /// stay at or below it.
    pub w_max: f64,
}

impl Curve {
    fn raw(&self, w: f64) -> f64 {
        self.c[0] + self.c[1] * w + self.c[2] * w * w
    }

    /// The fitted latency at `w`, forced monotone the seed's way: the
    /// maximum of the polynomial over [0, w] (a parabola's maximum there
    /// is at an end or nowhere inside, so two evaluations suffice unless
    /// its vertex is a maximum inside, which c2 < 0 tells).
    pub fn latency(&self, w: f64) -> f64 {
        let w = w.max(0.0);
        let mut best = self.raw(0.0).max(self.raw(w));
        if self.c[2] < 0.0 {
            let vertex = -self.c[1] / (2.0 * self.c[2]);
            if vertex > 0.0 && vertex < w {
                best = best.max(self.raw(vertex));
            }
        }
        best
    }

    /// The weight at which the curve reaches `latency_ms` (bisection on
    /// the monotone curve over [0, `limit`]); None if it never does there
    /// (above it at `limit`, or below its floor).
    pub fn weight_at(&self, latency_ms: f64, limit: f64) -> Option<f64> {
        if self.latency(limit) < latency_ms || self.latency(0.0) > latency_ms {
            return None;
        }
        let (mut lo, mut hi) = (0.0, limit);
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            if self.latency(mid) < latency_ms {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(hi)
    }

    /// The curve moved by `ms` at every weight: what the unloaded latency
    /// changed by (a shift along the weights cannot lower a floor).
    pub fn offset(&self, ms: f64) -> Curve {
        Curve { c: [self.c[0] + ms, self.c[1], self.c[2]], w_max: self.w_max }
    }

    /// The curve after the backend's traffic (or its capacity) changed by
    /// `delta`: what weight w cost before now costs at w·delta (the seed's
    /// shift "to the left" for delta < 1).
    pub fn shifted(&self, delta: f64) -> Curve {
        Curve { c: [self.c[0], self.c[1] / delta, self.c[2] / (delta * delta)], w_max: self.w_max * delta }
    }
}

/// Least-squares fit of latency = l₀ + c1·w + c2·w² to the points without
/// a drop, with the intercept pinned at the measured unloaded latency
/// (`l0`; else the weight-0 points' mean, else the least latency seen) and
/// c1, c2 ≥ 0: convex and monotone. A free degree-2 fit of the hockey
/// stick that latency draws against load dips below l₀ in the middle,
/// and forcing that monotone made the fit's intercept each backend's
/// floor: backends were then ranked by the fit's error (a 1-worker server
/// whose fitted floor came out lower than a 2-worker one's got the same
/// weight). Two coefficients under two sign constraints are solved here
/// in closed form; no linear-algebra dependency is worth that.
pub fn fit(points: &[Point], l0: Option<f64>) -> Option<Curve> {
    let answered: Vec<&Point> = points.iter().filter(|p| !p.drop && p.latency_ms.is_finite()).collect();
    if answered.is_empty() {
        return None;
    }
    let at_zero: Vec<f64> = answered.iter().filter(|p| p.weight <= 0.0).map(|p| p.latency_ms).collect();
    let floor = l0.or_else(|| (!at_zero.is_empty()).then(|| at_zero.iter().sum::<f64>() / at_zero.len() as f64));
    let floor = floor.unwrap_or_else(|| answered.iter().map(|p| p.latency_ms).fold(f64::INFINITY, f64::min));
    // Past the capacity by the floor's measure: such a point would bend
    // the whole curve up and hand the backend a capacity it never had.
    let good: Vec<&Point> = answered.into_iter().filter(|p| !p.dropped(floor)).collect();
    let w_max = good.iter().map(|p| p.weight).fold(0.0, f64::max);
    if w_max <= 0.0 {
        return Some(Curve { c: [floor, 0.0, 0.0], w_max: 0.0 });
    }
    // In x = w / w_max: among a thousand backends weights are ~1e-3 and
    // Σ w⁴ would vanish below any tolerance.
    let (mut s2, mut s3, mut s4, mut yx, mut yx2) = (0.0, 0.0, 0.0, 0.0, 0.0);
    let xy: Vec<(f64, f64)> = good.iter().map(|p| (p.weight / w_max, p.latency_ms - floor)).collect();
    for &(x, y) in &xy {
        s2 += x * x;
        s3 += x * x * x;
        s4 += x * x * x * x;
        yx += y * x;
        yx2 += y * x * x;
    }
    let sse = |a: f64, b: f64| xy.iter().map(|&(x, y)| (y - a * x - b * x * x).powi(2)).sum::<f64>();
    let det = s2 * s4 - s3 * s3;
    let mut options = vec![(0.0, 0.0), ((yx / s2).max(0.0), 0.0), (0.0, (yx2 / s4).max(0.0))];
    if det.abs() > 1e-12 {
        let (a, b) = ((yx * s4 - yx2 * s3) / det, (s2 * yx2 - s3 * yx) / det);
        if a >= 0.0 && b >= 0.0 {
            options.push((a, b));
        }
    }
    let (a, b) = options.into_iter().min_by(|p, q| sse(p.0, p.1).total_cmp(&sse(q.0, q.1)))?;
    Some(Curve { c: [floor, a / w_max, b / (w_max * w_max)], w_max })
}

/// One re-solve shifts a curve along the weights by at most this factor either way.
pub const SHIFT_BOUNDS: (f64, f64) = (0.25, 2.0);

/// `curve` adjusted so that it gives `latency` at share `w`, and the shift
/// along the weights if that is how (the seed's: traffic or capacity
/// moved the knee). A latency below the curve's floor, or one measured at
/// no share, moves the curve up or down instead: the unloaded latency
/// itself changed, and no shift along the weights reaches it.
pub fn adjust(curve: &Curve, w: f64, latency: f64) -> (Curve, Option<f64>) {
    const NO_SHARE: f64 = 1e-3;
    let limit = (8.0 * curve.w_max).max(8.0 * w).max(1.0);
    match curve.weight_at(latency, limit) {
        Some(w2) if w2 > 0.0 && w > NO_SHARE => {
            let d = (w / w2).clamp(SHIFT_BOUNDS.0, SHIFT_BOUNDS.1);
            (curve.shifted(d), Some(d))
        }
        _ if w <= NO_SHARE || latency < curve.latency(w) => (curve.offset(latency - curve.latency(w)), None),
        _ => (curve.shifted(SHIFT_BOUNDS.0), Some(SHIFT_BOUNDS.0)),
    }
}

/// What one backend asks of a learning round.
#[derive(Clone, Copy, Debug)]
pub struct Want {
    /// The next weight its search wants measured.
    pub target: f64,
    pub searching: bool,
    /// Rounds since it last got its target.
    pub waited: u32,
    /// The most it should carry of the weight a round has to spare: what
    /// its search found safe, 1 while nothing it carried dropped, 0 while
    /// it drains.
    pub ceiling: f64,
    /// The most it can carry when nothing else has room: the largest weight
    /// it carried without a drop (a draining backend's is above its
    /// ceiling: it drains a queue, it did not lose its capacity).
    pub safe: f64,
}

/// The weights of one learning round and which backends got their target
/// (the seed's greedy scheduler): those backing off first (they are the
/// overloaded ones, and shrinking always fits), then those growing, the
/// longest-waiting first, each if its target still fits in a total of 1.
/// A backend that did not get its target keeps it for a later round, so a
/// large backend's search still reaches weights near 1.
///
/// The traffic has to go somewhere: what the targets leave goes to the
/// backends without a target this round, then to the scheduled ones, each
/// in proportion to its room below its ceiling; then to draining backends
/// up to their safe weight; only when nobody has room is everything scaled
/// up. The first version scaled every weight up whenever the targets
/// added up to less than 1: at 80% load, with the large backends backing
/// off or draining, that gave a 1-worker server two thirds of the traffic
/// in one round, and the quick benchmark learned it a capacity of 0.
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
    let unscheduled = |i: usize| (!got[i]).then_some(wants[i].ceiling);
    let scheduled = |i: usize| got[i].then_some(wants[i].ceiling);
    let anyone = |i: usize| Some(wants[i].ceiling.max(wants[i].safe));
    for limit in [&unscheduled as &dyn Fn(usize) -> Option<f64>, &scheduled, &anyone] {
        let room: Vec<f64> = (0..n).map(|i| limit(i).map_or(0.0, |c| (c - w[i]).max(0.0))).collect();
        let total: f64 = room.iter().sum();
        if left <= 1e-12 || total <= 1e-12 {
            continue;
        }
        let give = left.min(total);
        for i in 0..n {
            w[i] += give * room[i] / total;
        }
        left -= give;
    }
    let total: f64 = w.iter().sum();
    // Nobody has room: more traffic than every known safe weight, an
    // overload no schedule avoids, shared in proportion.
    let w = if total > 0.0 { w.iter().map(|x| x / total).collect() } else { vec![1.0 / n as f64; n] };
    (w, got)
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A synthetic backend of `cores` capacity under `load` (in cores of
    /// work at weight 1): an M/M/1-like latency that explodes at capacity.
    pub fn latency_of(cores: f64, load: f64, w: f64) -> f64 {
        let util = w * load / cores;
        if util >= 0.95 {
            f64::INFINITY
        } else {
            10.0 / (1.0 - util)
        }
    }

    fn measure(cores: f64, load: f64, w: f64) -> Point {
        let l = latency_of(cores, load, w);
        Point { weight: w, latency_ms: l.min(1e6), drop: !l.is_finite() }
    }

    /// Runs the search from 1/n as the controller does and returns the
    /// largest weight that did not drop.
    fn search_capacity(cores: f64, load: f64, n: f64) -> (f64, usize) {
        let mut s = Search::default();
        let mut w = 1.0 / n;
        let mut steps = 0;
        while !s.done && steps < 50 {
            w = s.next(measure(cores, load, w), 10.0, 1.0);
            steps += 1;
        }
        (s.good, steps)
    }

    #[test]
    fn the_search_converges_to_each_backends_capacity_in_few_steps() {
        // Load of 9 cores over backends of 1, 2, 4 and 8 cores (60% of 15).
        let found: Vec<(f64, usize)> = [1.0, 2.0, 4.0, 8.0].iter().map(|&c| search_capacity(c, 9.0, 4.0)).collect();
        for (i, (good, steps)) in found.iter().enumerate() {
            let cores = [1.0, 2.0, 4.0, 8.0][i];
            // Latency reaches 5·l0 at utilisation 0.8.
            let knee = 0.8 * cores / 9.0;
            assert!(*good <= knee + 1e-9 && *good > 0.7 * knee, "{cores} cores: {good} vs knee {knee}");
            assert!(*steps <= 12, "{cores} cores took {steps} steps");
        }
        // Capacity order survives: more cores, larger weight.
        assert!(found.windows(2).all(|w| w[0].0 < w[1].0), "{found:?}");
    }

    #[test]
    fn a_backend_started_past_its_capacity_backs_off_instead_of_climbing_back() {
        // 1/4 of 9 cores on one core: every step until the bisection finds room.
        let mut s = Search::default();
        let mut w = 0.25;
        for _ in 0..20 {
            let p = measure(1.0, 9.0, w);
            w = s.next(p, 10.0, 1.0);
            assert!(s.bad.unwrap() <= 0.25);
            if s.done {
                break;
            }
        }
        assert!(s.done && s.good > 0.0 && s.good < 0.8 / 9.0 + 1e-9, "{s:?}");
    }

    #[test]
    fn the_fit_reproduces_a_convex_curve_and_never_dips_below_the_floor() {
        let pts: Vec<Point> =
            [0.0, 0.1, 0.2, 0.3].iter().map(|&w| Point { weight: w, latency_ms: 5.0 + 2.0 * w + 30.0 * w * w, drop: false }).collect();
        let c = fit(&pts, Some(5.0)).unwrap();
        assert!((c.c[0] - 5.0).abs() < 1e-9 && (c.c[1] - 2.0).abs() < 1e-6 && (c.c[2] - 30.0).abs() < 1e-6, "{c:?}");
        assert_eq!(c.w_max, 0.3);
        // A hockey stick (flat, then steep): pinned at the measured floor,
        // never below it, rising at the end.
        let stick: Vec<Point> = [(0.0, 22.0), (0.25, 22.0), (0.33, 24.0), (0.38, 25.0), (0.44, 30.0), (0.47, 53.0)]
            .iter()
            .map(|&(weight, latency_ms)| Point { weight, latency_ms, drop: false })
            .collect();
        let c = fit(&stick, Some(22.0)).unwrap();
        assert!(c.c[1] >= 0.0 && c.c[2] >= 0.0, "{c:?}");
        assert!((0..=47).all(|i| c.latency(i as f64 / 100.0) >= 22.0));
        assert!(c.latency(0.47) > 35.0 && c.latency(0.2) < 26.0, "{c:?}");
        // A dip given directly is still flattened by `latency`.
        let dip = Curve { c: [10.0, -20.0, 40.0], w_max: 1.0 };
        assert_eq!(dip.latency(0.2), 10.0);
        // Dropped points are not fitted; a line fits a line.
        let line = fit(
            &[
                Point { weight: 0.0, latency_ms: 4.0, drop: false },
                Point { weight: 0.5, latency_ms: 6.0, drop: false },
                Point { weight: 0.9, latency_ms: 1e6, drop: true },
            ],
            None,
        )
        .unwrap();
        assert!((line.latency(0.25) - 5.0).abs() < 1e-9 && line.w_max == 0.5);
        assert!(fit(&[Point { weight: 0.3, latency_ms: 1.0, drop: true }], None).is_none());
        // A point measured before the floor was known, at 12x the floor,
        // is a drop once the floor is known: it neither bends the curve nor
        // sets the capacity (a 2-worker server's 0.667:275 ms at a floor of
        // 22 ms once fitted c2 = 385 and ranked it below a 1-worker one).
        let late = fit(
            &[
                Point { weight: 0.667, latency_ms: 275.0, drop: false },
                Point { weight: 0.0, latency_ms: 22.0, drop: false },
                Point { weight: 0.25, latency_ms: 24.0, drop: false },
                Point { weight: 0.445, latency_ms: 39.0, drop: false },
            ],
            Some(22.0),
        )
        .unwrap();
        assert_eq!(late.w_max, 0.445);
        assert!(late.latency(0.445) < 45.0, "{late:?}");
    }

    #[test]
    fn a_shifted_curve_costs_at_w_times_delta_what_it_cost_at_w() {
        let c = Curve { c: [5.0, 2.0, 30.0], w_max: 0.4 };
        let s = c.shifted(0.5);
        assert!((s.latency(0.1) - c.latency(0.2)).abs() < 1e-9);
        assert!((s.w_max - 0.2).abs() < 1e-12);
        let w = c.weight_at(c.latency(0.3), 1.0).unwrap();
        assert!((w - 0.3).abs() < 1e-6);
        assert!(c.weight_at(1e9, 1.0).is_none());
    }

    fn wants(v: &[(f64, bool, u32, f64)]) -> Vec<Want> {
        v.iter().map(|&(target, searching, waited, ceiling)| Want { target, searching, waited, ceiling, safe: ceiling }).collect()
    }

    #[test]
    fn a_round_backs_off_first_and_never_gives_out_more_than_everything() {
        // Two backing off get their targets first; of the two growing,
        // the one that waited longer gets its target, the other what is left.
        let (w, got) = schedule(&wants(&[(0.125, true, 0, 1.0), (0.125, true, 0, 1.0), (0.475, true, 0, 1.0), (0.5, true, 2, 1.0)]), &[0.25; 4]);
        assert_eq!(w, vec![0.125, 0.125, 0.25, 0.5]);
        assert_eq!(got, vec![true, true, false, true]);
        // Done backends share the rest by their room below what they
        // carried safely...
        let (w, _) = schedule(&wants(&[(0.2, true, 0, 1.0), (0.9, false, 0, 0.4), (0.9, false, 0, 0.6)]), &[0.3, 0.2, 0.5]);
        assert!((w[0] - 0.2).abs() < 1e-12 && (w[1] - 0.32).abs() < 1e-12 && (w[2] - 0.48).abs() < 1e-12, "{w:?}");
        // ...and yield it all to a backend that grows into it.
        let (w, got) = schedule(&wants(&[(0.9, false, 0, 0.5), (0.9, false, 0, 0.5), (1.0, true, 0, 1.0)]), &[0.1, 0.1, 0.8]);
        assert_eq!((w, got), (vec![0.0, 0.0, 1.0], vec![false, false, true]));
        // Everything scheduled under 1: the rest by room below the ceilings.
        let (w, _) = schedule(&wants(&[(0.1, true, 0, 1.0), (0.3, true, 0, 1.0)]), &[0.05, 0.05]);
        assert!((w[0] - 0.1 - 0.6 * 0.9 / 1.6).abs() < 1e-12 && (w[1] - 0.3 - 0.6 * 0.7 / 1.6).abs() < 1e-12, "{w:?}");
    }

    #[test]
    fn spare_weight_goes_where_there_is_room_not_to_the_overloaded() {
        // The quick benchmark's round 4 at 80% load: the large backends
        // drain at 0, the 1- and 2-worker ones back off. They must not be
        // scaled up to everything: the draining ones take the rest up to
        // the weights they carried without a drop.
        let ws = [
            Want { target: 0.125, searching: true, waited: 0, ceiling: 0.06, safe: 0.0 },
            Want { target: 0.125, searching: true, waited: 0, ceiling: 0.125, safe: 0.125 },
            Want { target: 0.0, searching: true, waited: 0, ceiling: 0.0, safe: 0.25 },
            Want { target: 0.0, searching: true, waited: 0, ceiling: 0.0, safe: 0.5 },
        ];
        let (w, got) = schedule(&ws, &[0.25; 4]);
        assert_eq!(got, vec![true; 4]);
        assert!((w[0] - 0.125).abs() < 1e-12 && (w[1] - 0.125).abs() < 1e-12, "{w:?}");
        assert!((w[2] - 0.25).abs() < 1e-12 && (w[3] - 0.5).abs() < 1e-12, "{w:?}");
        // More traffic than every safe weight: shared in proportion.
        let ws = [Want { target: 0.2, searching: true, waited: 0, ceiling: 0.2, safe: 0.2 }; 2];
        let (w, _) = schedule(&ws, &[0.5, 0.5]);
        assert_eq!(w, vec![0.5, 0.5]);
    }

    #[test]
    fn a_curve_is_adjusted_so_that_it_meets_the_measured_latency() {
        let c = Curve { c: [10.0, 0.0, 100.0], w_max: 0.5 };
        let (fixed, d) = adjust(&c, 0.2, c.latency(0.3));
        assert!((d.unwrap() - 0.2 / 0.3).abs() < 1e-6, "{d:?}");
        assert!((fixed.latency(0.2) - c.latency(0.3)).abs() < 1e-6);
        // Faster than its floor: the floor comes down, nothing shifts
        // (shifting could never reach it: the loop of re-solves the quick
        // benchmark showed).
        let (fixed, d) = adjust(&c, 0.2, 5.0);
        assert_eq!(d, None);
        assert!((fixed.latency(0.2) - 5.0).abs() < 1e-9);
        // At no share: its unloaded latency changed.
        let (fixed, d) = adjust(&c, 0.0, 30.0);
        assert_eq!((fixed.latency(0.0), d), (30.0, None));
        // Far slower than anything the curve reaches: the largest step.
        assert_eq!(adjust(&c, 0.2, 1e9).1, Some(SHIFT_BOUNDS.0));
    }
}

//! What the controller sees of each backend: its latency probes (the
//! seed's, `probe_rate` a second) and the failure detector's handshakes,
//! each run as tasks that write into the backend's `Observed`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inband_health::{FailureKind, Probe};

use super::config::WeightsConfig;

/// The failure detector: this many TCP handshakes per backend every
/// `HEALTH_EVERY` (the seed's 3 requests per 100 ms). A backend fails when
/// all of one window's are refused, or when none completes for
/// `HEALTH_SILENT` windows: a busy server's full listen queue drops SYNs
/// for moments, and is not a failure.
const HEALTH_TRIES: usize = 3;
const HEALTH_EVERY: Duration = Duration::from_millis(100);
const HEALTH_SILENT: u32 = 10;
/// A failed backend is back after this many good windows in a row (1 s):
/// one lucky handshake does not undo a failure.
const HEALTH_RECOVER: u32 = 10;
/// This many latency probes in a row refused or broken (a timeout or a 5xx
/// is an overloaded server, not a failed one) fail a backend whose TCP
/// stack still answers: the application is gone.
const PROBES_FAILED: usize = 3;

/// One latency probe: in flight while `outcome` is None.
pub(super) struct Sample {
    pub(super) sent: Instant,
    pub(super) outcome: Option<Result<f64, FailureKind>>,
}

/// What the probe and health tasks learn about one backend.
#[derive(Default)]
pub(super) struct Observed {
    pub(super) samples: Mutex<VecDeque<Sample>>,
    pub(super) unhealthy: AtomicBool,
}

/// A window's view of one backend's probes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Window {
    pub(super) mean_ms: f64,
    pub(super) count: usize,
    pub(super) failed: bool,
}

/// The share of a window's slowest probes left out of its mean. One probe
/// whose SYN was retransmitted after a second, among a hundred of 10 ms,
/// adds 10 ms to the mean: enough to take a backend for one whose capacity
/// changed, and to move its load onto a smaller one that it overloads
/// (bench.weights, the `weights` row). A loaded backend slows most of its
/// probes, not a few, and its mean still shows it.
const SLOWEST_LEFT_OUT: f64 = 0.05;

impl Observed {
    /// Probes sent in [from, to]; one still in flight counts with its age
    /// so far, so a slow backend's unfinished probes do not leave only its
    /// fast ones in the mean. The mean leaves out the slowest
    /// `SLOWEST_LEFT_OUT` of them (none in a window of fewer than 20).
    pub(super) fn window(&self, from: Instant, to: Instant) -> Option<Window> {
        let now = Instant::now();
        let samples = self.samples.lock().unwrap();
        let mut failed = false;
        let mut ms: Vec<f64> = Vec::new();
        for s in samples.iter().filter(|s| s.sent >= from && s.sent <= to) {
            match s.outcome {
                Some(Ok(v)) => ms.push(v),
                Some(Err(_)) => failed = true,
                None => ms.push(now.duration_since(s.sent).as_secs_f64() * 1e3),
            }
        }
        let count = ms.len();
        ms.sort_by(f64::total_cmp);
        let kept = &ms[..count - (count as f64 * SLOWEST_LEFT_OUT) as usize];
        let mean_ms = if kept.is_empty() { f64::INFINITY } else { kept.iter().sum::<f64>() / kept.len() as f64 };
        (count > 0 || failed).then_some(Window { mean_ms, count, failed })
    }

    /// The last `PROBES_FAILED` finished probes all failed without an
    /// HTTP answer.
    pub(super) fn probes_failing(&self) -> bool {
        let samples = self.samples.lock().unwrap();
        let done: Vec<&Sample> = samples.iter().rev().filter(|s| s.outcome.is_some()).take(PROBES_FAILED).collect();
        done.len() == PROBES_FAILED && done.iter().all(|s| matches!(s.outcome, Some(Err(kind)) if !matches!(kind, FailureKind::Timeout | FailureKind::BadStatus)))
    }

    /// The median of the probes answered in [from, to]: the unloaded
    /// latency, which one stalled probe must not inflate.
    pub(super) fn median(&self, from: Instant, to: Instant) -> Option<f64> {
        let samples = self.samples.lock().unwrap();
        let mut ms: Vec<f64> = samples
            .iter()
            .filter(|s| s.sent >= from && s.sent <= to)
            .filter_map(|s| match s.outcome {
                Some(Ok(ms)) => Some(ms),
                _ => None,
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        (!ms.is_empty()).then(|| ms[ms.len() / 2])
    }
}

/// Starts the probe and health tasks of the backend at `addr`.
pub(super) fn watch(addr: SocketAddr, cfg: &WeightsConfig, stop: Arc<AtomicBool>) -> Arc<Observed> {
    let obs = Arc::new(Observed::default());
    tokio::spawn(probe_loop(addr, cfg.probe_path.clone(), Timing::of(cfg), obs.clone(), stop.clone()));
    tokio::spawn(health_loop(addr, obs.clone(), stop));
    obs
}

/// The seed's latency probes: `probe_rate` a second, each on its own
/// schedule (a slow answer does not delay the next probe).
async fn probe_loop(addr: SocketAddr, path: String, t: Timing, obs: Arc<Observed>, stop: Arc<AtomicBool>) {
    let probe = Probe::Http { path, host: addr.to_string(), expect: inband_health::Expect::Answered };
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
        let (obs, probe) = (obs.clone(), probe.clone());
        tokio::spawn(async move {
            let r = inband_health::timed(addr, None, &probe, t.timeout).await.map(|p| p.elapsed.as_secs_f64() * 1e3).map_err(|f| f.kind);
            let mut s = obs.samples.lock().unwrap();
            if let Some(x) = s.iter_mut().rev().find(|x| x.sent == sent) {
                x.outcome = Some(r);
            }
        });
    }
}

async fn health_loop(addr: SocketAddr, obs: Arc<Observed>, stop: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(HEALTH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut health = Health::default();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let tries: Vec<_> = (0..HEALTH_TRIES).map(|_| tokio::spawn(handshake(addr, HEALTH_EVERY))).collect();
        let mut window = Vec::with_capacity(HEALTH_TRIES);
        for t in tries {
            window.push(t.await.unwrap_or(Handshake::Silent));
        }
        obs.unhealthy.store(health.after(&window), Ordering::Relaxed);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Handshake {
    Done,
    /// Refused, unreachable: the host or its port is gone.
    Refused,
    /// No answer in time: gone, or only too busy to accept (a full listen
    /// queue drops SYNs); told apart by how long it lasts.
    Silent,
}

/// A TCP handshake with `addr` within `timeout`: the failure detector's
/// light request, which costs the server's application nothing.
async fn handshake(addr: SocketAddr, timeout: Duration) -> Handshake {
    match inband_health::probe(addr, None, &Probe::Tcp, timeout).await {
        Ok(_) => Handshake::Done,
        Err(f) if f.kind == FailureKind::Timeout => Handshake::Silent,
        Err(_) => Handshake::Refused,
    }
}

/// The failure detector's memory across windows.
#[derive(Debug)]
struct Health {
    failed: bool,
    silent: u32,
    good: u32,
}

impl Default for Health {
    fn default() -> Self {
        Health { failed: false, silent: 0, good: HEALTH_RECOVER }
    }
}

impl Health {
    /// Takes one window's handshakes; true while the backend is failed.
    fn after(&mut self, window: &[Handshake]) -> bool {
        let any_done = window.contains(&Handshake::Done);
        self.silent = if any_done { 0 } else { self.silent + 1 };
        self.good = if any_done { self.good.saturating_add(1) } else { 0 };
        if window.iter().all(|h| *h == Handshake::Refused) || self.silent >= HEALTH_SILENT {
            self.failed = true;
        } else if self.good >= HEALTH_RECOVER {
            self.failed = false;
        }
        self.failed
    }
}

/// The probes' pace, their time-out, and how long their results are kept
/// (the longest window anyone reads, plus a probe's life).
#[derive(Clone, Copy)]
struct Timing {
    every: Duration,
    timeout: Duration,
    keep: Duration,
}

impl Timing {
    fn of(cfg: &WeightsConfig) -> Timing {
        Timing {
            every: Duration::from_secs_f64(1.0 / f64::from(cfg.probe_rate)),
            timeout: Duration::from_millis(cfg.probe_timeout_ms),
            keep: Duration::from_millis(cfg.window_ms.max(cfg.round_ms) + cfg.probe_timeout_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_backend_is_not_failed_a_refusing_one_is_at_once() {
        use Handshake::*;
        let mut h = Health::default();
        // SYNs dropped by a full listen queue for 0.9 s: still in service.
        for _ in 0..HEALTH_SILENT - 1 {
            assert!(!h.after(&[Silent, Silent, Silent]));
        }
        assert!(!h.after(&[Silent, Done, Silent]));
        // A whole second without a handshake: failed.
        for _ in 0..HEALTH_SILENT - 1 {
            h.after(&[Silent; 3]);
        }
        assert!(h.after(&[Silent; 3]));
        // Back only after a second of good windows.
        for _ in 0..HEALTH_RECOVER - 1 {
            assert!(h.after(&[Done, Silent, Silent]));
        }
        assert!(!h.after(&[Done; 3]));
        // Every handshake refused: failed in one window.
        assert!(h.after(&[Refused; 3]));
        assert!(h.after(&[Refused, Silent, Refused]), "still failed");
    }

    #[test]
    fn a_few_stalled_probes_do_not_move_a_window_but_a_slow_backend_does() {
        let obs = Observed::default();
        let t0 = Instant::now() - Duration::from_secs(5);
        let fill = |ms: &[(usize, f64)]| {
            let mut s = obs.samples.lock().unwrap();
            s.clear();
            for &(n, v) in ms {
                s.extend((0..n).map(|_| Sample { sent: t0, outcome: Some(Ok(v)) }));
            }
        };
        fill(&[(97, 10.0), (3, 1000.0)]);
        let w = obs.window(t0, Instant::now()).unwrap();
        assert_eq!(w.count, 100);
        assert!((w.mean_ms - 10.0).abs() < 1e-9, "three retransmitted SYNs left out: {w:?}");
        fill(&[(40, 10.0), (60, 100.0)]);
        let w = obs.window(t0, Instant::now()).unwrap();
        assert!(w.mean_ms > 60.0, "most probes slow: {w:?}");
        // A small window keeps every probe.
        fill(&[(18, 10.0), (1, 1000.0)]);
        let w = obs.window(t0, Instant::now()).unwrap();
        assert!((w.mean_ms - (180.0 + 1000.0) / 19.0).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn a_window_counts_unfinished_probes_by_their_age_and_notices_failures() {
        let obs = Observed::default();
        let t0 = Instant::now() - Duration::from_millis(500);
        {
            let mut s = obs.samples.lock().unwrap();
            s.push_back(Sample { sent: t0, outcome: Some(Ok(10.0)) });
            s.push_back(Sample { sent: t0, outcome: None });
            s.push_back(Sample { sent: t0, outcome: Some(Err(FailureKind::BadStatus)) });
        }
        let w = obs.window(t0, Instant::now()).unwrap();
        assert_eq!(w.count, 2);
        assert!(w.failed && w.mean_ms >= (10.0 + 500.0) / 2.0, "{w:?}");
        assert!(!obs.probes_failing(), "a 503 is an answer");
        for _ in 0..3 {
            obs.samples.lock().unwrap().push_back(Sample { sent: Instant::now(), outcome: Some(Err(FailureKind::Timeout)) });
        }
        assert!(!obs.probes_failing(), "timeouts are a busy server");
        for _ in 0..3 {
            obs.samples.lock().unwrap().push_back(Sample { sent: Instant::now(), outcome: Some(Err(FailureKind::Refused)) });
        }
        assert!(obs.probes_failing());
    }
}

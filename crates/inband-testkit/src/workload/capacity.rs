//! A server of limited capacity: `workers` requests in service at once, a
//! bounded FIFO queue in front of them, and a service time drawn from a
//! distribution, scaled by the server's speed and by slowdown windows.
//! Work is modelled by waiting, never by burning CPU: the balancer, the
//! load generator and every server share two cores on the testbed, and what
//! must be measured is the balancer's choice, not CPU contention.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum ServiceDist {
    /// Memoryless: most requests short, some several times the mean.
    Exponential,
    /// Heavy right tail (sigma `--service-sigma`, 0.8 by default, around the
    /// mean): occasional very slow requests.
    Lognormal,
    /// Every request takes exactly the mean.
    Constant,
}

/// From `start_s` for `duration_s` seconds, service takes `factor` times longer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slowdown {
    pub start_s: f64,
    pub duration_s: f64,
    pub factor: f64,
}

impl std::str::FromStr for Slowdown {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let p: Vec<f64> = s.split(':').map(|x| x.parse::<f64>()).collect::<Result<_, _>>().map_err(|_| bad(s))?;
        match p[..] {
            [start_s, duration_s, factor] if start_s >= 0.0 && duration_s > 0.0 && factor > 0.0 => {
                Ok(Slowdown { start_s, duration_s, factor })
            }
            _ => Err(bad(s)),
        }
    }
}

fn bad(s: &str) -> String {
    format!("slowdown {s:?}: expected START_S:DURATION_S:FACTOR, e.g. 20:15:3")
}

/// The two uniform numbers a request's service time is drawn with. The
/// server draws them itself unless the request brings its own
/// (`X-Service-Draw: U,V`): a load generator that sends the same numbers
/// in every run gives every configuration the same requests to place, and
/// a heavy tail's luck (a σ 1.5 lognormal's mean over 400 requests varies
/// by ±15% from run to run) stops passing for a difference between them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    u: f64,
    v: f64,
}

impl Draw {
    pub fn random(rng: &mut impl Rng) -> Draw {
        Draw { u: rng.gen_range(f64::EPSILON..1.0), v: rng.gen_range(0.0..1.0) }
    }

    /// `U,V` with 0 < U ≤ 1 and 0 ≤ V < 1, as decimals; None otherwise.
    pub fn parse(value: &[u8]) -> Option<Draw> {
        let (u, v) = std::str::from_utf8(value).ok()?.split_once(',')?;
        let (u, v): (f64, f64) = (u.trim().parse().ok()?, v.trim().parse().ok()?);
        (u > 0.0 && u <= 1.0 && (0.0..1.0).contains(&v)).then_some(Draw { u, v })
    }
}

#[derive(Clone, Debug)]
pub struct Model {
    pub workers: usize,
    pub queue: usize,
    pub service_ms: f64,
    pub dist: ServiceDist,
    /// The lognormal's sigma: 0.8 is the paper's spread; 1.5 spans a
    /// hundredfold from short to long requests (LLM-inference-like).
    pub sigma: f64,
    pub speed: f64,
    pub time_scale: f64,
    pub slowdowns: Vec<Slowdown>,
}

impl Model {
    /// The service time of a request starting `elapsed` after the server
    /// started, drawn with `draw`.
    pub fn service_time(&self, elapsed: Duration, draw: Draw) -> Duration {
        let mean = self.service_ms * self.time_scale / self.speed;
        let t = elapsed.as_secs_f64();
        let slow: f64 =
            self.slowdowns.iter().filter(|s| t >= s.start_s && t < s.start_s + s.duration_s).map(|s| s.factor).product();
        let Draw { u, v } = draw;
        let draw = match self.dist {
            ServiceDist::Constant => mean,
            ServiceDist::Exponential => -mean * u.ln(),
            ServiceDist::Lognormal => {
                // Box-Muller normal, then a lognormal whose mean is `mean`.
                let sigma = self.sigma;
                let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
                mean * (sigma * z - sigma * sigma / 2.0).exp()
            }
        };
        Duration::from_secs_f64((draw * slow / 1000.0).max(0.0))
    }
}

/// Admission to the workers: FIFO, bounded, scheduled on the clock.
///
/// Each request is given its start and end when it arrives: it starts when
/// the earliest worker is free (or at once) and holds that worker until its
/// service time has passed, whether or not its thread runs on time. A
/// worker handed from thread to thread would instead stay idle for every
/// wake-up's latency: on the two shared cores, with a neighbouring testbed
/// busy, that cost a few ms per request and cut a 2-worker server's
/// capacity below its load, which the balancer under test did not cause.
pub struct Capacity {
    queue: usize,
    state: Mutex<State>,
    pub started: Instant,
}

struct State {
    /// When each worker is next free.
    free_at: Vec<Instant>,
    /// Start times of the admitted requests not yet started (non-decreasing:
    /// each takes the earliest worker, which is never free before the last).
    waiting: VecDeque<Instant>,
}

/// When an admitted request's service starts and ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub start: Instant,
    pub end: Instant,
}

impl Capacity {
    pub fn new(workers: usize, queue: usize) -> Capacity {
        let now = Instant::now();
        Capacity { queue, state: Mutex::new(State { free_at: vec![now; workers.max(1)], waiting: VecDeque::new() }), started: now }
    }

    /// Schedules a request arriving now, `service` giving its service time
    /// from its start; `None` when `queue` requests already wait.
    pub fn admit(&self, service: impl FnOnce(Instant) -> Duration) -> Option<Admitted> {
        let mut st = self.state.lock().unwrap();
        let now = Instant::now();
        while st.waiting.front().is_some_and(|&s| s <= now) {
            st.waiting.pop_front();
        }
        let (worker, &free) = st.free_at.iter().enumerate().min_by_key(|(_, t)| **t).expect("at least one worker");
        let start = free.max(now);
        if start > now {
            if st.waiting.len() >= self.queue {
                return None;
            }
            st.waiting.push_back(start);
        }
        let end = start + service(start);
        st.free_at[worker] = end;
        Some(Admitted { start, end })
    }

    /// Requests in service and waiting now.
    pub fn load(&self) -> (usize, usize) {
        let st = self.state.lock().unwrap();
        let now = Instant::now();
        let waiting = st.waiting.iter().filter(|&&s| s > now).count();
        (st.free_at.iter().filter(|&&t| t > now).count(), waiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(dist: ServiceDist) -> Model {
        Model { workers: 1, queue: 1, service_ms: 100.0, dist, sigma: 0.8, speed: 1.0, time_scale: 1.0, slowdowns: vec![] }
    }

    #[test]
    fn distributions_keep_their_mean() {
        let mut rng = rand::thread_rng();
        for dist in [ServiceDist::Constant, ServiceDist::Exponential, ServiceDist::Lognormal] {
            let m = model(dist);
            let n = 20_000;
            let mean: f64 = (0..n).map(|_| m.service_time(Duration::ZERO, Draw::random(&mut rng)).as_secs_f64()).sum::<f64>() / n as f64;
            assert!((mean - 0.1).abs() < 0.01, "{dist:?}: mean {mean}");
        }
    }

    #[test]
    fn a_wider_lognormal_keeps_its_mean_and_spans_a_hundredfold() {
        let mut rng = rand::thread_rng();
        let m = Model { sigma: 1.5, ..model(ServiceDist::Lognormal) };
        let mut draws: Vec<f64> = (0..20_000).map(|_| m.service_time(Duration::ZERO, Draw::random(&mut rng)).as_secs_f64()).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.1).abs() < 0.015, "mean {mean}");
        draws.sort_by(f64::total_cmp);
        let (p5, p95) = (draws[1_000], draws[19_000]);
        // exp(1.5 × 1.645 × 2) ≈ 139 between the 5th and 95th percentiles.
        assert!(p95 / p5 > 80.0 && p95 / p5 < 250.0, "p5 {p5}, p95 {p95}");
    }

    #[test]
    fn a_draw_the_request_brings_fixes_its_service_time() {
        let m = Model { sigma: 1.5, ..model(ServiceDist::Lognormal) };
        let d = Draw::parse(b"0.25, 0.5").unwrap();
        assert_eq!(m.service_time(Duration::ZERO, d), m.service_time(Duration::ZERO, d));
        // u = 0.25, v = 0.5: z = -sqrt(-2 ln 0.25) = -1.665, 100 ms × e^(1.5 z − 1.125).
        let want = 0.1 * (1.5 * -(-2.0 * 0.25f64.ln()).sqrt() - 1.125).exp();
        assert!((m.service_time(Duration::ZERO, d).as_secs_f64() - want).abs() < 1e-6);
        for bad in [&b"0,0.5"[..], b"1.5,0.5", b"0.5,1", b"0.5", b"a,b", b"0.5,-0.1", b"NaN,0.5", b"\xff,0.1"] {
            assert_eq!(Draw::parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(Draw::parse(b"1,0").is_some());
    }

    #[test]
    fn speed_time_scale_and_slowdown_scale_the_time() {
        let mut rng = rand::thread_rng();
        let mut m = model(ServiceDist::Constant);
        m.speed = 0.5;
        m.time_scale = 0.1;
        m.slowdowns = vec!["10:5:3".parse().unwrap()];
        assert_eq!(m.service_time(Duration::from_secs(1), Draw::random(&mut rng)), Duration::from_millis(20));
        assert_eq!(m.service_time(Duration::from_secs(12), Draw::random(&mut rng)), Duration::from_millis(60));
        assert_eq!(m.service_time(Duration::from_secs(15), Draw::random(&mut rng)), Duration::from_millis(20));
        assert!("1:2".parse::<Slowdown>().is_err());
        assert!("1:0:2".parse::<Slowdown>().is_err());
    }

    #[test]
    fn admission_is_bounded_fifo_and_kept_on_the_clock() {
        let cap = Capacity::new(1, 2);
        let ms = |n| Duration::from_millis(n);
        let a = cap.admit(|_| ms(100)).unwrap();
        let b = cap.admit(|_| ms(100)).unwrap();
        let c = cap.admit(|_| ms(100)).unwrap();
        // One in service, two waiting: the next is refused.
        assert!(cap.admit(|_| ms(100)).is_none());
        assert_eq!((b.start, c.start), (a.end, b.end));
        assert_eq!(c.end - a.start, ms(300));
        assert_eq!(cap.load(), (1, 2));
        // Nobody waited on a thread: once the first has ended by the clock
        // the next is in service and a place in the queue is free again.
        std::thread::sleep(a.end.saturating_duration_since(Instant::now()) + ms(5));
        assert_eq!(cap.load(), (1, 1));
        let d = cap.admit(|_| ms(100)).unwrap();
        assert_eq!(d.start, c.end);
    }

    #[test]
    fn workers_serve_side_by_side() {
        let cap = Capacity::new(2, 0);
        let ms = |n| Duration::from_millis(n);
        let a = cap.admit(|_| ms(50)).unwrap();
        let b = cap.admit(|_| ms(80)).unwrap();
        assert!(b.start - a.start < ms(5), "the second worker starts at once");
        assert_eq!(cap.load(), (2, 0));
        assert!(cap.admit(|_| ms(10)).is_none(), "no queue: refused");
    }
}

//! A server of limited capacity: `workers` requests in service at once, a
//! bounded FIFO queue in front of them, and a service time drawn from a
//! distribution, scaled by the server's speed and by slowdown windows.
//! Work is modelled by waiting, never by burning CPU: the balancer, the
//! load generator and every server share two cores on the testbed, and what
//! must be measured is the balancer's choice, not CPU contention.

use std::collections::VecDeque;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum ServiceDist {
    /// Memoryless: most requests short, some several times the mean.
    Exponential,
    /// Heavy right tail (sigma 0.8 around the mean): occasional very slow requests.
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

#[derive(Clone, Debug)]
pub struct Model {
    pub workers: usize,
    pub queue: usize,
    pub service_ms: f64,
    pub dist: ServiceDist,
    pub speed: f64,
    pub time_scale: f64,
    pub slowdowns: Vec<Slowdown>,
}

impl Model {
    /// The service time of a request starting `elapsed` after the server started.
    pub fn service_time(&self, elapsed: Duration, rng: &mut impl Rng) -> Duration {
        let mean = self.service_ms * self.time_scale / self.speed;
        let t = elapsed.as_secs_f64();
        let slow: f64 =
            self.slowdowns.iter().filter(|s| t >= s.start_s && t < s.start_s + s.duration_s).map(|s| s.factor).product();
        let u: f64 = rng.gen_range(f64::EPSILON..1.0);
        let draw = match self.dist {
            ServiceDist::Constant => mean,
            ServiceDist::Exponential => -mean * u.ln(),
            ServiceDist::Lognormal => {
                // Box-Muller normal, then a lognormal whose mean is `mean`.
                const SIGMA: f64 = 0.8;
                let v: f64 = rng.gen_range(0.0..1.0);
                let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
                mean * (SIGMA * z - SIGMA * SIGMA / 2.0).exp()
            }
        };
        Duration::from_secs_f64((draw * slow / 1000.0).max(0.0))
    }
}

#[derive(Default)]
struct State {
    in_service: usize,
    /// The requests waiting, in arrival order: a freed worker is handed to
    /// the first directly. (One condition variable for all would wake every
    /// waiter at each completion: with hundreds queued, that herd alone
    /// took the testbed's CPU and slowed every other server.)
    waiting: VecDeque<SyncSender<()>>,
}

/// Admission to the workers: FIFO, bounded.
pub struct Capacity {
    workers: usize,
    queue: usize,
    state: Mutex<State>,
    pub started: Instant,
}

/// Held while a request is in service; frees the worker on drop.
pub struct Slot<'a>(&'a Capacity);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state.lock().unwrap();
        // The worker goes to the next in line, or back to the pool.
        while let Some(next) = st.waiting.pop_front() {
            if next.send(()).is_ok() {
                return;
            }
        }
        st.in_service -= 1;
    }
}

impl Capacity {
    pub fn new(workers: usize, queue: usize) -> Capacity {
        Capacity { workers: workers.max(1), queue, state: Mutex::new(State::default()), started: Instant::now() }
    }

    /// Waits for a worker in arrival order; `None` when the queue is full.
    pub fn admit(&self) -> Option<Slot<'_>> {
        let mut st = self.state.lock().unwrap();
        if st.in_service < self.workers && st.waiting.is_empty() {
            st.in_service += 1;
            return Some(Slot(self));
        }
        if st.waiting.len() >= self.queue {
            return None;
        }
        let (handover, turn) = sync_channel(1);
        st.waiting.push_back(handover);
        drop(st);
        // The worker is handed over still counted in service.
        turn.recv().ok()?;
        Some(Slot(self))
    }

    pub fn load(&self) -> (usize, usize) {
        let st = self.state.lock().unwrap();
        (st.in_service, st.waiting.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(dist: ServiceDist) -> Model {
        Model { workers: 1, queue: 1, service_ms: 100.0, dist, speed: 1.0, time_scale: 1.0, slowdowns: vec![] }
    }

    #[test]
    fn distributions_keep_their_mean() {
        let mut rng = rand::thread_rng();
        for dist in [ServiceDist::Constant, ServiceDist::Exponential, ServiceDist::Lognormal] {
            let m = model(dist);
            let n = 20_000;
            let mean: f64 = (0..n).map(|_| m.service_time(Duration::ZERO, &mut rng).as_secs_f64()).sum::<f64>() / n as f64;
            assert!((mean - 0.1).abs() < 0.01, "{dist:?}: mean {mean}");
        }
    }

    #[test]
    fn speed_time_scale_and_slowdown_scale_the_time() {
        let mut rng = rand::thread_rng();
        let mut m = model(ServiceDist::Constant);
        m.speed = 0.5;
        m.time_scale = 0.1;
        m.slowdowns = vec!["10:5:3".parse().unwrap()];
        assert_eq!(m.service_time(Duration::from_secs(1), &mut rng), Duration::from_millis(20));
        assert_eq!(m.service_time(Duration::from_secs(12), &mut rng), Duration::from_millis(60));
        assert_eq!(m.service_time(Duration::from_secs(15), &mut rng), Duration::from_millis(20));
        assert!("1:2".parse::<Slowdown>().is_err());
        assert!("1:0:2".parse::<Slowdown>().is_err());
    }

    #[test]
    fn admission_is_bounded_and_fifo() {
        let cap = Capacity::new(1, 1);
        let first = cap.admit().unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| cap.admit().map(|_| Instant::now()));
            while cap.load().1 == 0 {
                std::thread::yield_now();
            }
            // One in service, one queued: the next is refused.
            assert!(cap.admit().is_none());
            let freed = Instant::now();
            drop(first);
            assert!(waiter.join().unwrap().unwrap() >= freed);
        });
        assert_eq!(cap.load(), (0, 0));
    }
}

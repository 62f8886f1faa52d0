//! One backend's run-time state: requests in flight (for least-request),
//! the active check's verdict and the passive ejection window.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::PassiveConfig;

pub struct Backend {
    /// The address as a metrics label and URI authority, formatted once.
    pub name: String,
    in_flight: AtomicU64,
    /// Set by the active checker; true until a check says otherwise.
    checked_up: AtomicBool,
    /// Every request asks whether a backend is ejected, so that answer is
    /// an atomic (ms after `epoch`, 0 for not ejected); only failures,
    /// which are rare, take the lock.
    ejected_until_ms: AtomicU64,
    epoch: Instant,
    passive: Mutex<Passive>,
}

#[derive(Default)]
struct Passive {
    consecutive_failures: u32,
}

/// Counts a request as in flight while it lives.
pub struct InFlight<'a>(&'a Backend);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Backend {
    pub fn new(addr: SocketAddr) -> Backend {
        Backend {
            name: addr.to_string(),
            in_flight: AtomicU64::new(0),
            checked_up: AtomicBool::new(true),
            ejected_until_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            passive: Mutex::new(Passive::default()),
        }
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn start_request(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self)
    }

    /// Eligible for new requests: the active check passes and no passive
    /// ejection is running.
    pub fn is_healthy(&self, now: Instant) -> bool {
        self.checked_up.load(Ordering::Relaxed) && self.ms(now) >= self.ejected_until_ms.load(Ordering::Relaxed)
    }

    pub fn set_checked_up(&self, up: bool) {
        self.checked_up.store(up, Ordering::Relaxed);
    }

    pub fn is_checked_up(&self) -> bool {
        self.checked_up.load(Ordering::Relaxed)
    }

    /// A connection failure, timeout or 5xx. Returns true when this one
    /// ejected the backend.
    pub fn record_failure(&self, cfg: &PassiveConfig, now: Instant) -> bool {
        if cfg.failures == 0 {
            return false;
        }
        let mut p = self.passive.lock().unwrap();
        p.consecutive_failures += 1;
        if p.consecutive_failures >= cfg.failures {
            p.consecutive_failures = 0;
            self.ejected_until_ms.store(self.ms(now + Duration::from_millis(cfg.cooldown_ms)), Ordering::Relaxed);
            return true;
        }
        false
    }

    pub fn record_success(&self) {
        let mut p = self.passive.lock().unwrap();
        p.consecutive_failures = 0;
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_millis() as u64
    }
}

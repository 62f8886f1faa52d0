//! One backend's run-time state: requests in flight (for least-request),
//! its agent's last score (for least-score), the active check's verdict
//! and the passive ejection window.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::PassiveConfig;

pub struct Backend {
    pub addr: SocketAddr,
    /// The address, formatted once.
    pub name: String,
    /// Its metrics labels: `backend`, and `route` for a `[[route]]`'s pool.
    pub labels: Vec<(&'static str, String)>,
    /// The address as a request URI's authority, parsed once.
    pub authority: http::uri::Authority,
    in_flight: AtomicU64,
    /// Set by the active checker; true until a check says otherwise.
    checked_up: AtomicBool,
    /// Every request asks whether a backend is ejected, so that answer is
    /// an atomic (ms after `epoch`, 0 for not ejected).
    ejected_until_ms: AtomicU64,
    epoch: Instant,
    /// Every response updates this, from any worker: an atomic, not a lock
    /// all workers would take in turn.
    consecutive_failures: AtomicU32,
    /// The agent's last polled score (high half) and this proxy's requests
    /// in flight to it when the answer came (low half): one word, so a
    /// pick never pairs one answer's score with another's count.
    score: AtomicU64,
    /// Until when (ms after `epoch`) `score` counts; 0: no score yet.
    score_until_ms: AtomicU64,
    /// Woken by a score that says others' load on it grew: requests
    /// waiting on it may be hedged (forward.rs).
    busier: tokio::sync::Notify,
}

/// The backend whose answer a response is, in the response's extensions:
/// the access log names it (a hedged request's is the one that answered).
#[derive(Clone)]
pub struct Upstream(pub Arc<Backend>);

/// How many hedges a pool may send (forward.rs): each request earns a
/// tenth of one and a hedge spends a whole one, up to a burst of
/// HEDGE_BURST, so hedges stay under a tenth of the requests even when
/// every backend gets busy at once (when hedging can only add load).
pub struct HedgeBudget(AtomicU64);

/// In tenths of a hedge.
const HEDGE_COST: u64 = 10;
const HEDGE_BURST: u64 = 10 * HEDGE_COST;

impl HedgeBudget {
    pub fn new() -> HedgeBudget {
        HedgeBudget(AtomicU64::new(HEDGE_BURST))
    }

    pub fn earn(&self) {
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| (t < HEDGE_BURST).then_some(t + 1));
    }

    /// Spends one hedge if the budget has it.
    pub fn spend(&self) -> bool {
        self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| t.checked_sub(HEDGE_COST)).is_ok()
    }
}

/// Counts a request as in flight while it lives.
pub struct InFlight<'a>(&'a Backend);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A tunnel to a backend counts as a request in flight for its whole
/// life, so least-request weighs open WebSockets as the load they are.
/// In an `Arc` as response extensions must be `Clone`.
pub struct TunnelInFlight(Arc<Backend>);

impl TunnelInFlight {
    pub fn new(b: &Arc<Backend>) -> Arc<TunnelInFlight> {
        b.in_flight.fetch_add(1, Ordering::Relaxed);
        Arc::new(TunnelInFlight(b.clone()))
    }
}

impl Drop for TunnelInFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Backend {
    pub fn new(addr: SocketAddr, route: Option<&str>) -> Backend {
        let name = addr.to_string();
        let mut labels = Vec::new();
        if let Some(r) = route {
            labels.push(("route", r.to_string()));
        }
        labels.push(("backend", name.clone()));
        Backend {
            addr,
            labels,
            authority: name.parse().expect("a socket address is a URI authority"),
            name,
            in_flight: AtomicU64::new(0),
            checked_up: AtomicBool::new(true),
            ejected_until_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            consecutive_failures: AtomicU32::new(0),
            score: AtomicU64::new(0),
            score_until_ms: AtomicU64::new(0),
            busier: tokio::sync::Notify::new(),
        }
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A fresh score from the agent, counting until `now + valid_for`.
    pub fn set_score(&self, score: u32, now: Instant, valid_for: Duration) {
        let before = self.fresh_score(now).map_or(0, |(score, base)| score.saturating_sub(base));
        let base = u32::try_from(self.in_flight()).unwrap_or(u32::MAX);
        self.score.store(u64::from(score) << 32 | u64::from(base), Ordering::Relaxed);
        self.score_until_ms.store(self.ms(now + valid_for).max(1), Ordering::Relaxed);
        if score.saturating_sub(base) > before {
            self.busier.notify_waiters();
        }
    }

    /// Resolves at the next score that says others' load on this backend
    /// grew (`enable` it before checking anything it should not miss).
    pub fn busier(&self) -> tokio::sync::futures::Notified<'_> {
        self.busier.notified()
    }

    /// The agent's score if it is fresh at `now`, and this proxy's
    /// requests in flight when it came.
    fn fresh_score(&self, now: Instant) -> Option<(u32, u32)> {
        (self.ms(now) < self.score_until_ms.load(Ordering::Relaxed)).then(|| {
            let v = self.score.load(Ordering::Relaxed);
            ((v >> 32) as u32, v as u32)
        })
    }

    pub fn score(&self, now: Instant) -> Option<u32> {
        self.fresh_score(now).map(|(s, _)| s)
    }

    /// What least-score ranks by: this proxy's requests in flight now,
    /// which it knows exactly, plus the load of everyone else, which only
    /// the agent sees: its last score less this proxy's requests in
    /// flight when the answer came (the score counts them too). That is
    /// `inband lb`'s "last score + opened − closed since"
    /// (bpf/include/inband/lb/select.h) whenever the agent counted at
    /// least this proxy's requests; when it counted fewer (requests still
    /// queued in the proxy or on the wire, responses read but not yet
    /// relayed), others' load is taken as none rather than negative, so a
    /// backend never ranks below this proxy's own count of it. With a
    /// stale score, the count alone, as least-request.
    pub fn scored_load(&self, now: Instant) -> u64 {
        let others = self.fresh_score(now).map_or(0, |(score, base)| score.saturating_sub(base));
        self.in_flight() + u64::from(others)
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
        let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        // Of concurrent failures reaching the threshold, the one that
        // resets the count ejects.
        if n >= cfg.failures && self.consecutive_failures.compare_exchange(n, 0, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            self.ejected_until_ms.store(self.ms(now + Duration::from_millis(cfg.cooldown_ms)), Ordering::Relaxed);
            return true;
        }
        false
    }

    pub fn record_success(&self) {
        // A load first: most responses find it 0 already, and a store
        // would bounce the cache line between workers for nothing.
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_millis() as u64
    }
}

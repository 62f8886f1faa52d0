//! Which backend gets a request: round-robin, least-request and
//! least-score (power of two choices) or consistent hashing.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use crate::backend::Backend;
use crate::config::PolicyKind;

pub struct Policy {
    kind: PolicyKind,
    next: AtomicUsize,
    /// least-score: `[scores] busy_margin`.
    busy_margin: u32,
}

impl Policy {
    pub fn new(kind: PolicyKind, busy_margin: u32) -> Policy {
        Policy { kind, next: AtomicUsize::new(0), busy_margin }
    }

    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// Index of the chosen backend among those `eligible` says yes to, or
    /// `None` when there is none. `key` is the consistent-hash key.
    pub fn pick(&self, backends: &[std::sync::Arc<Backend>], eligible: impl Fn(usize) -> bool, key: &[u8]) -> Option<usize> {
        let n = backends.len();
        match self.kind {
            PolicyKind::RoundRobin => {
                // The counter walks every backend, skipping ineligible ones,
                // so the split stays even whatever the health of the others.
                let start = self.next.fetch_add(1, Ordering::Relaxed);
                (0..n).map(|i| (start + i) % n).find(|&i| eligible(i))
            }
            PolicyKind::LeastRequest => two_choices(n, eligible, |i| backends[i].in_flight()),
            // Two choices rather than the least of all, as least-request:
            // a score is up to an interval old and every proxy reads the
            // same one, so the least of all would send a whole interval's
            // new requests from every proxy to one backend (the herd a
            // stale signal makes); two random draws cannot herd, and leave
            // only the compared signal different from least-request.
            // ... except that a draw landing on a busy backend (its load
            // `busy_margin` or more above the least loaded one's) takes the
            // least loaded instead. With one backend busy the draw never
            // lands on it (it loses every comparison), but other clients'
            // bursts overlap: with two of three busy, a third of the draws
            // hold only busy ones. Draws among backends within the margin
            // are left as they are, so near-equal ones still share the
            // requests and the pick still cannot herd.
            PolicyKind::LeastScore => {
                let now = std::time::Instant::now();
                let load = |i: usize| backends[i].scored_load(now);
                let pick = two_choices(n, &eligible, load)?;
                if self.busy_margin == 0 {
                    return Some(pick);
                }
                let least = (0..n).filter(|&i| eligible(i)).min_by_key(|&i| load(i))?;
                Some(if load(pick) >= load(least).saturating_add(u64::from(self.busy_margin)) { least } else { pick })
            }
            // Rendezvous (highest-random-weight) hashing rather than a ring:
            // when a backend is ejected only its own keys move, with no ring
            // to rebuild on every health change, and O(backends) per request
            // is nothing for pools of tens. Hashed with xxh3, which is
            // stable across builds and hosts (std's hasher is not promised to be).
            PolicyKind::ConsistentHash => (0..n)
                .filter(|&i| eligible(i))
                .max_by_key(|&i| xxhash_rust::xxh3::xxh3_64_with_seed(key, backend_seed(&backends[i]))),
        }
    }
}

/// Two distinct random eligible backends, found by walking from two
/// random starts (no list of candidates built per request, and a healthy
/// pool, the usual case, takes one step per draw); the one with the lower
/// `load`.
fn two_choices(n: usize, eligible: impl Fn(usize) -> bool, load: impl Fn(usize) -> u64) -> Option<usize> {
    if n == 0 {
        return None;
    }
    let mut rng = rand::thread_rng();
    let first = rng.gen_range(0..n);
    let a = (0..n).map(|k| (first + k) % n).find(|&i| eligible(i))?;
    let start = rng.gen_range(1..n.max(2));
    let b = (0..n).map(|k| (a + start + k) % n).find(|&i| i != a && eligible(i));
    Some(match b {
        Some(b) if load(b) < load(a) => b,
        _ => a,
    })
}

fn backend_seed(b: &Backend) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b.name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn pool(n: u16) -> Vec<Arc<Backend>> {
        (0..n).map(|i| Arc::new(Backend::new(([127, 0, 0, 1], 9000 + i).into(), None))).collect()
    }

    #[test]
    fn round_robin_skips_ineligible_and_stays_even() {
        let b = pool(3);
        let p = Policy::new(PolicyKind::RoundRobin, 0);
        let mut counts = [0; 3];
        for _ in 0..300 {
            counts[p.pick(&b, |i| i != 1, b"").unwrap()] += 1;
        }
        assert_eq!(counts[1], 0);
        assert!(counts[0] >= 100 && counts[2] >= 100, "{counts:?}");
    }

    #[test]
    fn consistent_hash_moves_only_the_ejected_backends_keys() {
        let b = pool(5);
        let p = Policy::new(PolicyKind::ConsistentHash, 0);
        let keys: Vec<String> = (0..1000).map(|k| format!("/k{k}")).collect();
        let before: Vec<usize> = keys.iter().map(|k| p.pick(&b, |_| true, k.as_bytes()).unwrap()).collect();
        let after: Vec<usize> = keys.iter().map(|k| p.pick(&b, |i| i != 2, k.as_bytes()).unwrap()).collect();
        for (x, y) in before.iter().zip(&after) {
            if *x != 2 {
                assert_eq!(x, y);
            }
        }
        let on_two = before.iter().filter(|&&x| x == 2).count();
        assert!((100..300).contains(&on_two), "{on_two} of 1000 keys on one of 5 backends");
    }

    #[test]
    fn least_request_prefers_fewer_in_flight() {
        let b = pool(2);
        let _busy = b[0].start_request();
        let p = Policy::new(PolicyKind::LeastRequest, 0);
        for _ in 0..50 {
            assert_eq!(p.pick(&b, |_| true, b""), Some(1));
        }
    }

    #[test]
    fn least_score_ranks_by_the_score_and_the_requests_since() {
        let b = pool(2);
        let p = Policy::new(PolicyKind::LeastScore, 4);
        // The agent's 5 counts this proxy's two requests in flight then.
        let mine = [b[0].start_request(), b[0].start_request()];
        b[0].set_score(5, std::time::Instant::now(), std::time::Duration::from_secs(60));
        // No score for the other: ranked by its 4 in flight alone.
        let _other: Vec<_> = (0..4).map(|_| b[1].start_request()).collect();
        for _ in 0..50 {
            assert_eq!(p.pick(&b, |_| true, b""), Some(1), "5 against 4");
        }
        // Both of this proxy's requests ended since the score: 3.
        drop(mine);
        for _ in 0..50 {
            assert_eq!(p.pick(&b, |_| true, b""), Some(0), "3 against 4");
        }
        // A stale score no longer counts: ranked by requests in flight alone.
        let b = pool(2);
        b[0].set_score(1000, std::time::Instant::now(), std::time::Duration::from_millis(1));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(b[0].score(std::time::Instant::now()), None);
        let _one = b[1].start_request();
        for _ in 0..50 {
            assert_eq!(p.pick(&b, |_| true, b""), Some(0));
        }
    }

    #[test]
    fn a_draw_of_busy_backends_takes_the_least_loaded_and_near_equal_ones_share() {
        let b = pool(3);
        let now = std::time::Instant::now();
        let valid = std::time::Duration::from_secs(60);
        // Two of three busy at once (overlapping bursts of other clients).
        b[0].set_score(12, now, valid);
        b[1].set_score(12, now, valid);
        let picks = |margin| {
            let p = Policy::new(PolicyKind::LeastScore, margin);
            let mut got = [0; 3];
            for _ in 0..300 {
                got[p.pick(&b, |_| true, b"").unwrap()] += 1;
            }
            got
        };
        assert_eq!(picks(4), [0, 0, 300]);
        // Plain two choices: the draws of the two busy ones, about a third.
        let plain = picks(0);
        assert!(plain[0] + plain[1] >= 50, "{plain:?}");
        // Within the margin of each other, backends still share.
        b[1].set_score(1, now, valid);
        let near = picks(4);
        assert!(near[0] == 0 && near[1] >= 50 && near[2] >= 50, "{near:?}");
    }

    #[test]
    fn least_request_draws_among_eligible_only_and_uses_them_all() {
        let b = pool(4);
        let p = Policy::new(PolicyKind::LeastRequest, 0);
        let mut counts = [0; 4];
        for _ in 0..400 {
            counts[p.pick(&b, |i| i != 2, b"").unwrap()] += 1;
        }
        assert_eq!(counts[2], 0);
        assert!(counts.iter().enumerate().all(|(i, &c)| i == 2 || c > 50), "{counts:?}");
        assert_eq!(p.pick(&b, |_| false, b""), None);
        assert_eq!(p.pick(&b, |i| i == 3, b""), Some(3));
    }
}

//! Finding backends whose path loses inband options (the seed's limit:
//! routers and middleboxes that drop or strip IP options), and falling back
//! to polling for them.
//!
//! The sign is in `scores`: the data path counts every 124 it sends in
//! `unanswered` and resets it when a 125 is taken. A backend of a
//! dsr-dynamic VIP with `LOST_AFTER` requests unanswered and no score for
//! `SILENCE` is flagged `options_lost`: the data path then sends it no
//! option at all (no 155 either, so its connections take the path through
//! the balancer, which needs none) and the poller asks it instead
//! (lb/polling.rs). Packets must be flowing for requests to go unanswered,
//! so an idle backend is never flagged.
//!
//! Nor is one that sends its responses around the balancer, as soon. A
//! path that loses options loses the 155s too, so the backend's
//! connections answer through the balancer (and a path that strips options
//! still delivers the packets it stripped): packets come back from it, none
//! with a 125. A backend whose 155s arrived sends its responses direct and
//! next to nothing comes back; if its answers are late (an agent without
//! carriers on a bulk transfer: the 125 waits for a small packet, up to the
//! end of a response), that is slowness, not loss. So the silence that
//! flags a backend is `SILENCE` if at least `LOST_AFTER` packets came back
//! from it through the balancer while it was suspected, else
//! `SILENCE_DIRECT`: long enough for a multi-megabyte response to end,
//! short enough that a path losing only the backend's options is still
//! found.
//!
//! A path can heal, and only options can show it: after a backoff
//! (`options_retry_s`) the flag is lifted and the backend watched again
//! (`options_retried`); each time it is flagged again soon after, the
//! backoff doubles, up to `BACKOFF_GROWTH` times the first.
//! A backend of no dsr-dynamic VIP is never flagged, and loses its flag.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use tracing::{info, warn};

use super::maps::{Backend, BackendScore, BackendStats, ControlStats, Mode, BACKEND_OPTIONS_LOST};
use super::tables::{self, LbMaps};
use inband_core::bpfmap;

/// Unanswered score requests before a backend is suspected: more than a
/// few requests on flows that ended before their answer.
pub const LOST_AFTER: u32 = 8;
/// ... and no score taken for this long: several sweeps (each gives a
/// stale backend's next packet a request).
pub const SILENCE: Duration = Duration::from_secs(3);
/// ... or this long, if its responses went around the balancer meanwhile.
pub const SILENCE_DIRECT: Duration = Duration::from_secs(15);
pub const BACKOFF_GROWTH: u32 = 20;

#[derive(Clone, Copy, Debug)]
struct Flagged {
    /// When the options come back on (ktime ns); 0 = they are on, watched.
    retry_at: u64,
    backoff: Duration,
    /// When it was last retried, to tell a relapse from a new loss.
    retried_at: u64,
}

pub struct OptionsWatch {
    flagged: HashMap<u32, Flagged>,
    /// Packets that had come back from each watched backend through the
    /// balancer (`return_packets`) when it was last not suspected.
    returned_before: HashMap<u32, u64>,
    first: Duration,
}

/// Whether a backend's path looks like it loses options: `LOST_AFTER`
/// requests unanswered and no score taken for `SILENCE`, or for
/// `SILENCE_DIRECT` if fewer than `LOST_AFTER` packets (`returned`) came
/// back from it through the balancer since it was last not suspected
/// (module doc).
fn looks_lost(s: &BackendScore, returned: u64, now: u64) -> bool {
    let silence = if returned >= u64::from(LOST_AFTER) { SILENCE } else { SILENCE_DIRECT };
    let silent = s.updated_ns == 0 || now.saturating_sub(s.updated_ns) > ns(silence);
    s.unanswered >= LOST_AFTER && silent
}

/// Not suspected at all: the baseline of returned packets moves on.
fn unsuspected(s: &BackendScore, now: u64) -> bool {
    s.unanswered < LOST_AFTER || (s.updated_ns != 0 && now.saturating_sub(s.updated_ns) <= ns(SILENCE))
}

impl OptionsWatch {
    pub fn new(first_backoff: Duration) -> OptionsWatch {
        OptionsWatch { flagged: HashMap::new(), returned_before: HashMap::new(), first: first_backoff }
    }

    fn max_backoff(&self) -> Duration {
        self.first * BACKOFF_GROWTH
    }

    /// One look at every backend, after a sweep, under the config lock.
    pub fn check(&mut self, maps: &LbMaps, now: u64) -> Result<ControlStats> {
        let mut stats = ControlStats::default();
        let mut watched = Vec::new();
        for e in tables::read(maps)? {
            let dynamic = Mode::from_u8(e.vip.mode) == Some(Mode::DsrDynamic);
            for (id, b) in &e.slots {
                if dynamic {
                    watched.push(*id);
                    self.look(maps, *id, b, now, &mut stats)?;
                } else if b.flags & BACKEND_OPTIONS_LOST != 0 {
                    set_lost(maps, *id, false)?;
                }
            }
        }
        // A backend retried long ago and not lost since is forgotten: its
        // next loss starts from the first backoff again.
        let forget_after = 2 * ns(self.max_backoff());
        self.flagged.retain(|id, f| watched.contains(id) && !(f.retry_at == 0 && now.saturating_sub(f.retried_at) > forget_after));
        self.returned_before.retain(|id, _| watched.contains(id));
        Ok(stats)
    }

    fn look(&mut self, maps: &LbMaps, id: u32, b: &Backend, now: u64, stats: &mut ControlStats) -> Result<()> {
        let s: BackendScore = bpfmap::get(&maps.scores, &id)?.unwrap_or_default();
        let ep = tables::backend_endpoint(b);
        if b.flags & BACKEND_OPTIONS_LOST != 0 {
            // Flagged by an earlier daemon: its backoff starts over.
            let first = self.first;
            let f = self.flagged.entry(id).or_insert(Flagged { retry_at: now + ns(first), backoff: first, retried_at: 0 });
            if f.retry_at != 0 && now >= f.retry_at {
                f.retry_at = 0;
                f.retried_at = now;
                bpfmap::put(&maps.scores, &id, &BackendScore { unanswered: 0, ..s })?;
                set_lost(maps, id, false)?;
                stats.options_retried += 1;
                info!(backend = %ep, "sending inband options again to see whether the path still loses them");
            }
            return Ok(());
        }
        let returned = tables::sum_percpu::<BackendStats>(&maps.backend_stats, id)?.return_packets;
        let before = *self.returned_before.entry(id).or_insert(returned);
        if unsuspected(&s, now) {
            self.returned_before.insert(id, returned);
            return Ok(());
        }
        if !looks_lost(&s, returned.saturating_sub(before), now) {
            return Ok(());
        }
        let (first, max) = (self.first, self.max_backoff());
        let f = self.flagged.entry(id).or_insert(Flagged { retry_at: 0, backoff: first, retried_at: 0 });
        // Lost again soon after a retry: the path has not healed.
        f.backoff = if f.retried_at != 0 && now.saturating_sub(f.retried_at) < 2 * ns(f.backoff) {
            (f.backoff * 2).min(max)
        } else {
            first
        };
        f.retry_at = now + ns(f.backoff);
        set_lost(maps, id, true)?;
        stats.options_lost += 1;
        warn!(
            backend = %ep,
            unanswered = s.unanswered,
            returned_without_score = returned.saturating_sub(before),
            retry_in_s = f.backoff.as_secs(),
            "inband options do not come back from this backend: polling it instead, without options"
        );
        Ok(())
    }
}

/// The data path reads the flag per packet; nothing else of the backend
/// changes.
fn set_lost(maps: &LbMaps, id: u32, lost: bool) -> Result<()> {
    let mut b: Backend = bpfmap::get(&maps.backends, &id)?.unwrap_or_default();
    if lost {
        b.flags |= BACKEND_OPTIONS_LOST;
    } else {
        b.flags &= !BACKEND_OPTIONS_LOST;
    }
    bpfmap::put(&maps.backends, &id, &b)
}

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 100_000_000_000;

    fn score(unanswered: u32, age: Duration) -> BackendScore {
        BackendScore { unanswered, updated_ns: NOW - ns(age), ..Default::default() }
    }

    #[test]
    fn a_backend_answering_direct_gets_longer_to_answer_than_one_answering_through_the_balancer() {
        let silent = score(LOST_AFTER * 4, SILENCE * 2);
        // Responses through the balancer, not one 125: the path loses them.
        assert!(looks_lost(&silent, u64::from(LOST_AFTER), NOW));
        // Responses direct (its 155s arrived), answers late: a bulk sender.
        assert!(!looks_lost(&silent, 0, NOW));
        assert!(!looks_lost(&silent, u64::from(LOST_AFTER) - 1, NOW));
        // ... until its silence outlasts any response.
        assert!(looks_lost(&score(LOST_AFTER, SILENCE_DIRECT + Duration::from_secs(1)), 0, NOW));
        // Never a score at all counts as silent.
        assert!(looks_lost(&BackendScore { unanswered: LOST_AFTER, ..Default::default() }, 0, NOW));
    }

    #[test]
    fn a_fresh_score_or_few_unanswered_requests_is_no_suspicion() {
        assert!(unsuspected(&score(LOST_AFTER * 4, SILENCE / 2), NOW));
        assert!(unsuspected(&score(LOST_AFTER - 1, SILENCE * 2), NOW));
        assert!(!unsuspected(&score(LOST_AFTER, SILENCE * 2), NOW));
        for s in [score(LOST_AFTER * 4, SILENCE / 2), score(LOST_AFTER - 1, SILENCE * 2)] {
            assert!(!looks_lost(&s, 1000, NOW));
        }
    }
}

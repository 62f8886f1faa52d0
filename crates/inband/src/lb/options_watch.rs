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
//! A path can heal, and only options can show it: after a backoff
//! (`options_retry_s`) the flag is lifted and the backend watched again
//! (`options_retried`); each time it is flagged again soon after, the
//! backoff doubles, up to `BACKOFF_GROWTH` times the first.
//! A backend of no dsr-dynamic VIP is never flagged, and loses its flag.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use tracing::{info, warn};

use super::maps::{Backend, BackendScore, ControlStats, Mode, BACKEND_OPTIONS_LOST};
use super::tables::{self, LbMaps};
use crate::bpfmap;

/// Unanswered score requests before a backend is suspected: more than a
/// few requests on flows that ended before their answer.
pub const LOST_AFTER: u32 = 8;
/// ... and no score taken for this long: several sweeps (each gives a
/// stale backend's next packet a request).
pub const SILENCE: Duration = Duration::from_secs(3);
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
    first: Duration,
}

impl OptionsWatch {
    pub fn new(first_backoff: Duration) -> OptionsWatch {
        OptionsWatch { flagged: HashMap::new(), first: first_backoff }
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
        let silent = s.updated_ns == 0 || now.saturating_sub(s.updated_ns) > ns(SILENCE);
        if s.unanswered < LOST_AFTER || !silent {
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

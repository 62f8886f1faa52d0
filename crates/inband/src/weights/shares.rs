//! The share of new connections each backend really got, read from an
//! inband balancer's per-backend counters. A weight is what the balancer
//! is asked for; under a load-aware policy (dsr-dynamic ranks by
//! (estimate + 1) / weight) the scores move connections away from busy
//! backends, and a curve of latency against the *asked* weight would be
//! wrong. Against the share actually given it holds under any policy.

use std::net::SocketAddr;

use anyhow::{anyhow, Result};

use crate::net::Protocol;
use crate::lb::maps::BackendStats;
use crate::lb::tables::{self, LbMaps};

/// Fewer new connections than this in a window: too few to tell a share.
pub const MIN_CONNECTIONS: u64 = 20;

pub struct Meter {
    maps: LbMaps,
    vip: SocketAddr,
    protocol: Protocol,
}

impl Meter {
    /// The balancer in this network namespace that serves `vip`.
    pub fn open(vip: SocketAddr, protocol: Protocol) -> Result<Meter> {
        let here = crate::bpfmap::current_netns_name().unwrap_or_default();
        for b in crate::lb::attach::discover().into_iter().filter(|b| b.netns == here) {
            let maps = LbMaps::open(&b.pins)?;
            if tables::read(&maps)?.iter().any(|v| v.endpoint == vip && v.protocol == protocol) {
                return Ok(Meter { maps, vip, protocol });
            }
        }
        Err(anyhow!("no balancer in this network namespace serves {vip}/{}", protocol.name()))
    }

    /// Whether the VIP now ranks backends by their load (least-score or
    /// power-of-two in a mode with scores).
    pub fn ranks_by_load(&self) -> Result<bool> {
        use crate::lb::maps::{Mode, Policy};
        let vips = tables::read(&self.maps)?;
        Ok(vips.iter().find(|v| v.endpoint == self.vip && v.protocol == self.protocol).is_some_and(|v| {
            Mode::from_u8(v.vip.mode).is_some_and(Mode::scored)
                && matches!(Policy::from_u8(v.vip.policy), Some(Policy::LeastScore | Policy::PowerOfTwo))
        }))
    }

    /// New connections given so far to each of `backends` (0 for one the
    /// VIP does not list).
    pub fn counts(&self, backends: &[SocketAddr]) -> Result<Vec<u64>> {
        let vips = tables::read(&self.maps)?;
        let Some(v) = vips.iter().find(|v| v.endpoint == self.vip && v.protocol == self.protocol) else {
            return Ok(vec![0; backends.len()]);
        };
        backends
            .iter()
            .map(|ep| match v.slots.iter().find(|(_, b)| tables::backend_endpoint(b) == *ep) {
                Some((id, _)) => Ok(tables::sum_percpu::<BackendStats>(&self.maps.backend_stats, *id)?.new_conns),
                None => Ok(0),
            })
            .collect()
    }
}

/// Shares between two readings of `counts`, if enough connections came.
pub fn between(before: &[u64], after: &[u64]) -> Option<Vec<f64>> {
    let d: Vec<u64> = after.iter().zip(before).map(|(a, b)| a.saturating_sub(*b)).collect();
    let total: u64 = d.iter().sum();
    (total >= MIN_CONNECTIONS).then(|| d.iter().map(|&x| x as f64 / total as f64).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_need_enough_connections() {
        assert_eq!(between(&[10, 10], &[25, 40]), Some(vec![1.0 / 3.0, 2.0 / 3.0]));
        assert_eq!(between(&[10, 10], &[15, 20]), None);
        // A counter that went backwards (a backend re-added) counts 0.
        assert_eq!(between(&[50, 0], &[10, 30]), Some(vec![0.0, 1.0]));
    }
}

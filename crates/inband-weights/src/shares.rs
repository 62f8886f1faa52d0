//! The share of new connections each backend really got, read from an
//! inband balancer's per-backend counters. A weight is what the balancer
//! is asked for; under a load-aware policy (dsr-dynamic ranks by
//! (estimate + 1) / weight) the scores move connections away from busy
//! backends, and a curve of latency against the *asked* weight would be
//! wrong. Against the share actually given it holds under any policy.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Result};

use inband_core::lb_control::{self, ControlRequest, VipCounts};
use inband_core::net::Protocol;

/// Fewer new connections than this in a window: too few to tell a share.
pub const MIN_CONNECTIONS: u64 = 20;

/// Reads the counters over the balancer's control socket, so the
/// controller needs nothing of the balancer but its protocol.
pub struct Meter {
    socket: PathBuf,
    vip: SocketAddr,
    protocol: Protocol,
}

impl Meter {
    /// The balancer behind `socket`, if it serves `vip`.
    pub fn open(socket: PathBuf, vip: SocketAddr, protocol: Protocol) -> Result<Meter> {
        let m = Meter { socket, vip, protocol };
        m.read()?;
        Ok(m)
    }

    fn read(&self) -> Result<VipCounts> {
        let reply = lb_control::send(&self.socket, &ControlRequest::Counts { vip: self.vip, protocol: self.protocol })?;
        match reply.counts {
            Some(c) if reply.ok => Ok(c),
            _ => bail!("the balancer gave no counts: {}", reply.message),
        }
    }

    /// Whether the VIP now ranks backends by their load (least-score or
    /// power-of-two in a mode with scores).
    pub fn ranks_by_load(&self) -> Result<bool> {
        Ok(self.read()?.ranks_by_load)
    }

    /// New connections given so far to each of `backends` (0 for one the
    /// VIP does not list).
    pub fn counts(&self, backends: &[SocketAddr]) -> Result<Vec<u64>> {
        let c = self.read()?;
        Ok(backends.iter().map(|ep| c.new_conns.iter().find(|(b, _)| b == ep).map_or(0, |(_, n)| *n)).collect())
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

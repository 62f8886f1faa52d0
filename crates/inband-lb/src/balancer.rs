//! The balancer's control plane as one handle, as Katran's `KatranLb` is
//! for its users: the daemon applies its configuration through it at
//! start, the control socket hands it every request, `/metrics` and
//! `/status` read it. It holds the running configuration under the lock
//! every writer of the configuration maps takes (one writer at a time), and
//! `apply.rs` stays the only way a configuration reaches the maps.

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Result};
use tracing::info;

use super::config::LbConfig;
use super::maps::{backend_removed, BackendStats, Mode, Policy};
use super::snapshot::{self, Snapshot};
use super::tables::{self, LbMaps};
use super::{apply, attach, control};
use inband_core::lb_control::{ControlReply, ControlRequest, VipCounts};
use inband_core::net::Protocol;
use inband_core::prog_stats;
use inband_core::wire::Key;

pub struct Balancer {
    maps: LbMaps,
    config: Arc<Mutex<LbConfig>>,
    config_path: PathBuf,
    /// Programs only the daemon holds (the sweeper is attached nowhere a
    /// status command could find it), by name, for `snapshot`.
    programs: Vec<(&'static str, OwnedFd)>,
}

impl Balancer {
    /// A handle on the data path behind `maps`, sharing the running
    /// configuration (and its lock) with the daemon's other workers.
    pub fn new(maps: LbMaps, config: Arc<Mutex<LbConfig>>, config_path: &Path) -> Balancer {
        Balancer { maps, config, config_path: config_path.to_path_buf(), programs: Vec::new() }
    }

    /// Also reports `fd`'s program in `snapshot`.
    pub fn with_program(mut self, name: &'static str, fd: OwnedFd) -> Balancer {
        self.programs.push((name, fd));
        self
    }

    pub fn maps(&self) -> &LbMaps {
        &self.maps
    }

    /// The running configuration, locked: hold it while writing a
    /// configuration map.
    pub fn config(&self) -> MutexGuard<'_, LbConfig> {
        self.config.lock().unwrap()
    }

    /// Writes the running configuration and `keys` into the maps (at start).
    pub fn apply(&self, keys: &[(u8, Key)]) -> Result<()> {
        let cfg = self.config();
        apply::config_and_keys(&self.maps, &cfg, keys)
    }

    /// Validates and applies one request of the control protocol; the
    /// running configuration changes only if the maps took it.
    pub fn change(&self, req: &ControlRequest) -> ControlReply {
        if let ControlRequest::Counts { vip, protocol } = req {
            return match self.counts(*vip, *protocol) {
                Ok(c) => ControlReply { ok: true, message: String::new(), counts: Some(c) },
                Err(e) => ControlReply::refused(format!("{e:#}")),
            };
        }
        let mut guard = self.config();
        match control::next_config(&guard, req, &self.config_path).and_then(|next| {
            // Nothing to apply to if someone removed the program by hand.
            if !attach::attached(&next.interface)? {
                bail!("no XDP program is attached to {} any more (detached by hand?): restart `inband lb`", next.interface);
            }
            if matches!(req, ControlRequest::Reload) {
                apply::config_and_keys(&self.maps, &next, &next.auth.load_keys()?)?;
            } else {
                apply::config(&self.maps, &next)?;
            }
            Ok(next)
        }) {
            Ok(next) => {
                *guard = next;
                info!(request = ?req, "applied");
                ControlReply::applied()
            }
            Err(e) => ControlReply::refused(format!("{e:#}")),
        }
    }

    /// Everything `inband status` shows, read from the maps now.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let interface = self.config().interface.clone();
        let mut s = snapshot::take(&interface, &self.maps)?;
        for (name, fd) in &self.programs {
            s.programs.push(prog_stats::of_fd(name, fd.as_fd())?);
        }
        Ok(s)
    }

    /// What a VIP's backends were given, from the data path's counters.
    fn counts(&self, vip: SocketAddr, protocol: Protocol) -> Result<VipCounts> {
        let maps = &self.maps;
        let vips = tables::read(maps)?;
        let v = vips
            .iter()
            .find(|v| v.endpoint == vip && v.protocol == protocol)
            .ok_or_else(|| anyhow::anyhow!("no VIP {} is configured", inband_core::net::vip_name(vip, protocol)))?;
        let ranks_by_load = Mode::from_u8(v.vip.mode).is_some_and(Mode::scored)
            && matches!(Policy::from_u8(v.vip.policy), Some(Policy::LeastScore | Policy::PowerOfTwo));
        let new_conns = v
            .slots
            .iter()
            .filter(|(_, b)| !backend_removed(b))
            .map(|(id, b)| Ok((tables::backend_endpoint(b), tables::sum_percpu::<BackendStats>(&maps.backend_stats, *id)?.new_conns)))
            .collect::<Result<_>>()?;
        Ok(VipCounts { ranks_by_load, new_conns })
}
}

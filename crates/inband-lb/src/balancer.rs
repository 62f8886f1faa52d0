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

use super::config::{BackendConfig, LbConfig};
use super::maps::{backend_removed, BackendStats, Mode, Policy};
use super::snapshot::{self, Snapshot};
use super::tables::{self, LbMaps};
use super::{apply, attach, flow_query};
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
                Ok(c) => ControlReply { ok: true, message: String::new(), counts: Some(c), flow: None },
                Err(e) => ControlReply::refused(format!("{e:#}")),
            };
        }
        if let ControlRequest::Flow { vip, protocol, client } = req {
            return match flow_query::route(&self.maps, *vip, *protocol, *client) {
                Ok(f) => ControlReply { ok: true, message: String::new(), counts: None, flow: Some(f) },
                Err(e) => ControlReply::refused(format!("{e:#}")),
            };
        }
        let mut guard = self.config();
        match next_config(&guard, req, &self.config_path).and_then(|next| {
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
        let (interface, bpf_stats) = {
            let cfg = self.config();
            (cfg.interface.clone(), cfg.bpf_stats)
        };
        let mut s = snapshot::take(&interface, &self.maps)?;
        // The sysctl does not show what BPF_ENABLE_STATS turned on.
        s.bpf_stats |= bpf_stats;
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
        let policy = Policy::from_u8(v.vip.policy);
        let ranks_by_load = (Mode::from_u8(v.vip.mode).is_some_and(Mode::scored) && matches!(policy, Some(Policy::LeastScore | Policy::PowerOfTwo)))
            || policy == Some(Policy::LeastConnections);
        let new_conns = v
            .slots
            .iter()
            .filter(|(_, b)| !backend_removed(b))
            .map(|(id, b)| Ok((tables::backend_endpoint(b), tables::sum_percpu::<BackendStats>(&maps.backend_stats, *id)?.new_conns)))
            .collect::<Result<_>>()?;
        Ok(VipCounts { ranks_by_load, new_conns })
}
}

/// The new config after `req`, validated; the caller applies it.
pub fn next_config(cfg: &LbConfig, req: &ControlRequest, config_path: &Path) -> Result<LbConfig> {
    let mut next = cfg.clone();
    let vip_mut = |next: &mut LbConfig, vip: &SocketAddr, protocol: &Protocol| -> Result<usize> {
        next.vips.iter().position(|v| v.endpoint() == *vip && v.protocol == *protocol).ok_or_else(|| {
            anyhow::anyhow!("no VIP {} is configured", inband_core::net::vip_name(*vip, *protocol))
        })
    };
    let backend_pos = |next: &LbConfig, vi: usize, be: &SocketAddr| next.vips[vi].backends.iter().position(|b| b.endpoint() == *be);
    match req {
        ControlRequest::AddBackend { vip, protocol, backend, quic_server_id, encap, weight } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            if backend_pos(&next, vi, backend).is_some() {
                bail!("backend {backend} is already in VIP {}", next.vips[vi].name());
            }
            next.vips[vi].backends.push(BackendConfig {
                address: backend.ip(),
                port: backend.port(),
                drain: false,
                quic_server_id: *quic_server_id,
                encap: *encap,
                weight: *weight,
            });
        }
        ControlRequest::RemoveBackend { vip, protocol, backend } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            let bi = backend_pos(&next, vi, backend).ok_or_else(|| anyhow::anyhow!("backend {backend} is not in VIP {}", next.vips[vi].name()))?;
            next.vips[vi].backends.remove(bi);
        }
        ControlRequest::DrainBackend { vip, protocol, backend } | ControlRequest::UndrainBackend { vip, protocol, backend } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            let bi = backend_pos(&next, vi, backend).ok_or_else(|| anyhow::anyhow!("backend {backend} is not in VIP {}", next.vips[vi].name()))?;
            next.vips[vi].backends[bi].drain = matches!(req, ControlRequest::DrainBackend { .. });
        }
        ControlRequest::SetMode { vip, protocol, mode } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            next.vips[vi].mode = *mode;
        }
        ControlRequest::SetPolicy { vip, protocol, policy } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            next.vips[vi].policy = *policy;
        }
        ControlRequest::SetWeights { vip, protocol, weights } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            if weights.is_empty() {
                bail!("no weight given: name backends as ADDR=W");
            }
            let mut named = std::collections::HashSet::new();
            for (backend, weight) in weights {
                if !named.insert(backend) {
                    bail!("backend {backend} is given two weights");
                }
                let bi = backend_pos(&next, vi, backend).ok_or_else(|| anyhow::anyhow!("backend {backend} is not in VIP {}", next.vips[vi].name()))?;
                next.vips[vi].backends[bi].weight = *weight;
            }
        }
        ControlRequest::SetProbeInterval { vip, protocol, n } => {
            let vi = vip_mut(&mut next, vip, protocol)?;
            next.vips[vi].probe_interval = *n;
        }
        ControlRequest::Counts { .. } | ControlRequest::Flow { .. } => {}
        ControlRequest::Reload => {
            let fresh = LbConfig::load(config_path)?;
            if fresh.interface != cfg.interface || fresh.address != cfg.address || fresh.address6 != cfg.address6 {
                bail!("reload cannot change `interface`, `address` or `address6`: restart `inband lb` for that");
            }
            if fresh.moves != cfg.moves {
                bail!("reload cannot change [moves]: its worker binds its address at start; restart `inband lb` for that");
            }
            if fresh.flow_table_size != cfg.flow_table_size {
                bail!(
                    "reload cannot resize the flow tables under live flows (flow_table_size {} -> {}): \
                     detach and restart `inband lb` for that",
                    cfg.flow_table_size,
                    fresh.flow_table_size
                );
            }
            if fresh.maglev_table_size != cfg.maglev_table_size {
                bail!(
                    "reload cannot resize the Maglev tables (maglev_table_size {} -> {}): detach and restart `inband lb` for that",
                    cfg.maglev_table_size,
                    fresh.maglev_table_size
                );
            }
            if fresh.maglev_tables != cfg.maglev_tables {
                bail!(
                    "reload cannot change the number of Maglev tables (maglev_tables {} -> {}): detach and restart `inband lb` for that",
                    cfg.maglev_tables,
                    fresh.maglev_tables
                );
            }
            fresh.check_host()?;
            next = fresh;
        }
    }
    next.validate()?;
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    const CFG: &str = r#"
interface = "eth0"
address = "10.0.0.10"
[auth]
mode = "none"
[[vip]]
address = "10.0.0.100"
port = 80
mode = "dsr-rr"
policy = "round-robin"
[[vip.backend]]
address = "10.0.1.2"
port = 8080
[[vip.backend]]
address = "10.0.1.3"
port = 8080
weight = 2
[[vip.backend]]
address = "10.0.1.4"
port = 8080
"#;

    #[derive(Parser)]
    struct Ctl {
        #[command(subcommand)]
        req: ControlRequest,
    }

    fn cfg() -> LbConfig {
        LbConfig::parse(CFG).unwrap()
    }
    fn weights(c: &LbConfig) -> Vec<u32> {
        c.vips[0].backends.iter().map(|b| b.weight).collect()
    }
    fn set(ws: &[(&str, u32)]) -> ControlRequest {
        ControlRequest::SetWeights {
            vip: "10.0.0.100:80".parse().unwrap(),
            protocol: Protocol::Tcp,
            weights: ws.iter().map(|(a, w)| (a.parse().unwrap(), *w)).collect(),
        }
    }
    fn change_err(req: &ControlRequest) -> String {
        format!("{:#}", next_config(&cfg(), req, Path::new("/nonexistent")).unwrap_err())
    }

    #[test]
    fn set_weights_changes_the_named_backends_only() {
        let next = next_config(&cfg(), &set(&[("10.0.1.2:8080", 3), ("10.0.1.4:8080", 0)]), Path::new("/nonexistent")).unwrap();
        assert_eq!(weights(&next), [3, 2, 0]);
        assert!(!next.vips[0].backends[2].drain, "weight 0 is not the drain flag: a new weight brings it back");
    }

    #[test]
    fn set_weights_refuses_the_whole_request_for_one_bad_backend() {
        // change() works on a copy: an error leaves the running config as it was.
        let e = change_err(&set(&[("10.0.1.2:8080", 3), ("10.0.1.9:8080", 1)]));
        assert!(e.contains("backend 10.0.1.9:8080 is not in VIP 10.0.0.100:80"), "{e}");
        let e = change_err(&set(&[("10.0.1.3:8080", 70_000)]));
        assert!(e.contains("backend 10.0.1.3:8080: weight = 70000 is above 65535"), "{e}");
        let e = change_err(&set(&[("10.0.1.3:8080", 1), ("10.0.1.3:8080", 2)]));
        assert!(e.contains("backend 10.0.1.3:8080 is given two weights"), "{e}");
        assert!(change_err(&set(&[])).contains("no weight given"));
    }

    #[test]
    fn set_weights_from_the_command_line_and_json_is_one_request() {
        let cli = Ctl::try_parse_from([
            "ctl", "set-weights", "--vip", "10.0.0.100:80", "--weight", "10.0.1.2:8080=3", "--weight", "10.0.1.3:8080=1",
        ])
        .unwrap();
        let json: ControlRequest = serde_json::from_str(
            r#"{"cmd":"set-weights","vip":"10.0.0.100:80","protocol":"tcp","weights":[["10.0.1.2:8080",3],["10.0.1.3:8080",1]]}"#,
        )
        .unwrap();
        assert_eq!(serde_json::to_value(&cli.req).unwrap(), serde_json::to_value(&json).unwrap());
        let next = next_config(&cfg(), &json, Path::new("/nonexistent")).unwrap();
        assert_eq!(weights(&next), [3, 1, 1]);
        for bad in ["10.0.1.2:8080", "10.0.1.2:8080=x", "10.0.1.2=3"] {
            assert!(Ctl::try_parse_from(["ctl", "set-weights", "--vip", "10.0.0.100:80", "--weight", bad]).is_err(), "{bad}");
        }
        assert!(Ctl::try_parse_from(["ctl", "set-weights", "--vip", "10.0.0.100:80"]).is_err(), "at least one --weight");
    }

    #[test]
    fn add_backend_takes_a_weight_defaulting_to_one() {
        let add = |extra: &[&str]| {
            let args = ["ctl", "add-backend", "--vip", "10.0.0.100:80", "--backend", "10.0.1.5:8080"];
            let req = Ctl::try_parse_from(args.iter().chain(extra)).unwrap().req;
            next_config(&cfg(), &req, Path::new("/nonexistent")).unwrap().vips[0].backends[3].weight
        };
        assert_eq!((add(&[]), add(&["--weight", "4"])), (1, 4));
        let json: ControlRequest =
            serde_json::from_str(r#"{"cmd":"add-backend","vip":"10.0.0.100:80","backend":"10.0.1.5:8080"}"#).unwrap();
        assert!(matches!(json, ControlRequest::AddBackend { weight: 1, .. }));
    }
}

//! Run-time changes to a running balancer over a unix socket, in the
//! protocol of `inband_core::lb_control` (`inband lb ctl ...` and
//! `inband weights` are its clients). Every change is validated like the config file and applied to the
//! maps without touching flows: a removed VIP or backend drains (new
//! connections refused or sent elsewhere, established ones kept until they
//! end or `drain_timeout_ms`).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tracing::warn;

use super::balancer::Balancer;
use super::config::{BackendConfig, LbConfig};
use inband_core::lb_control::{ControlReply, ControlRequest};
use inband_core::net::Protocol;

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
        ControlRequest::Counts { .. } => {}
        ControlRequest::Reload => {
            let fresh = LbConfig::load(config_path)?;
            if fresh.interface != cfg.interface || fresh.address != cfg.address || fresh.address6 != cfg.address6 {
                bail!("reload cannot change `interface`, `address` or `address6`: restart `inband lb` for that");
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
            fresh.check_host()?;
            next = fresh;
        }
    }
    next.validate()?;
    Ok(next)
}

/// Serves the control socket until `stop` is set.
pub fn serve(path: &Path, balancer: &Balancer, stop: &AtomicBool) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("{} is in use: another `inband lb` is running", path.display());
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    listener.set_nonblocking(true)?;
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = handle(stream, balancer) {
                    warn!(error = %format!("{e:#}"), "control connection failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.into()),
        }
    }
    let _ = std::fs::remove_file(path);
    Ok(())
}

fn handle(stream: UnixStream, balancer: &Balancer) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut writer = stream.try_clone()?;
    let mut line = String::new();
    // A request is one short line; a peer sending more is cut off.
    BufReader::new(std::io::Read::take(stream, 64 * 1024)).read_line(&mut line)?;
    let reply = match serde_json::from_str::<ControlRequest>(line.trim()) {
        Err(e) => ControlReply::refused(format!("bad request: {e}")),
        Ok(req) => balancer.change(&req),
    };
    writeln!(writer, "{}", serde_json::to_string(&reply)?)?;
    Ok(())
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

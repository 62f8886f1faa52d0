//! `inband lb --config lb.toml`: attach, configure, then keep the control
//! plane running (neighbours, polling, control socket, metrics) until
//! SIGINT/SIGTERM. Stopping the daemon leaves the data path attached and
//! its maps pinned: traffic keeps flowing and the next daemon takes over.
//! `inband lb detach` is the explicit full clean-up.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tracing::{error, info, warn};

use super::config::LbConfig;
use super::maps::LbConfig as LbConfigMap;
use super::tables::{self, LbMaps};
use super::{attach, control, neighbour, polling, snapshot};
use crate::bpfmap;
use crate::pod::be_addr;

pub fn run(config_path: &Path) -> Result<()> {
    let cfg = LbConfig::load(config_path)?;
    cfg.check_host()?;
    let dir = attach::pin_dir(&cfg.interface);
    let fresh = !dir.exists();
    attach::load_and_attach(&cfg.interface, cfg.xdp_mode)?;
    let configured = (|| -> Result<()> {
        let maps = LbMaps::open(&dir)?;
        bpfmap::put(&maps.lb_config, &0u32, &LbConfigMap { self_addr: be_addr(cfg.address), flags: 0 })?;
        tables::apply(&maps, &cfg.vips)?;
        neighbour::refresh(&maps, &cfg.interface)?;
        Ok(())
    })();
    if let Err(e) = configured {
        if fresh {
            // Nothing of ours was here before: leave nothing behind.
            let _ = attach::detach(&cfg.interface, true);
        }
        return Err(e.context("configuring the balancer maps"));
    }

    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    let shared = Arc::new(Mutex::new(cfg.clone()));
    let mut workers = Vec::new();

    workers.push(spawn("neighbours", &dir, &stop, {
        let interface = cfg.interface.clone();
        move |maps, stop| {
            while !stop.load(Ordering::Relaxed) {
                let unresolved = neighbour::refresh(&maps, &interface)?;
                // Poll fast while a next hop is missing (a SYN is waiting on it).
                std::thread::sleep(Duration::from_millis(if unresolved > 0 { 100 } else { 1000 }));
            }
            Ok(())
        }
    }));
    workers.push(spawn("polling", &dir, &stop, {
        let shared = Arc::clone(&shared);
        move |maps, stop| polling::run(&maps, &shared, &stop)
    }));
    workers.push(spawn("control", &dir, &stop, {
        let shared = Arc::clone(&shared);
        let socket = cfg.control_socket.clone();
        let config_path = config_path.to_path_buf();
        move |maps, stop| control::serve(&socket, &maps, &shared, &config_path, &stop)
    }));
    if let Some(addr) = cfg.metrics {
        let server = tiny_http::Server::http(addr).map_err(|e| anyhow::anyhow!("metrics endpoint {addr}: {e}"))?;
        info!(%addr, "metrics at http://{addr}/metrics");
        workers.push(spawn("metrics", &dir, &stop, {
            let interface = cfg.interface.clone();
            move |maps, stop| {
                while !stop.load(Ordering::Relaxed) {
                    let Some(req) = server.recv_timeout(Duration::from_millis(200))? else { continue };
                    let resp = match req.url() {
                        "/metrics" => match snapshot::take(&interface, &maps) {
                            Ok(s) => tiny_http::Response::from_string(snapshot::render_prometheus(&s)),
                            Err(e) => tiny_http::Response::from_string(format!("{e:#}")).with_status_code(500),
                        },
                        _ => tiny_http::Response::from_string("see /metrics\n").with_status_code(404),
                    };
                    let _ = req.respond(resp);
                }
                Ok(())
            }
        }));
    }
    info!(interface = %cfg.interface, vips = cfg.vips.len(), "inband lb running");
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if workers.iter().any(|w| w.is_finished()) {
            stop.store(true, Ordering::Relaxed);
        }
    }
    let mut failed = false;
    for w in workers {
        if let Ok(Err(e)) = w.join() {
            error!(error = %format!("{e:#}"), "control-plane task failed");
            failed = true;
        }
    }
    info!("inband lb stopped; the data path stays attached (`inband lb detach --interface {}` removes it)", cfg.interface);
    if failed {
        anyhow::bail!("a control-plane task failed (see the log above)");
    }
    Ok(())
}

fn spawn<F>(name: &'static str, dir: &bpfmap::PinDir, stop: &Arc<AtomicBool>, f: F) -> std::thread::JoinHandle<Result<()>>
where
    F: FnOnce(LbMaps, Arc<AtomicBool>) -> Result<()> + Send + 'static,
{
    let maps = LbMaps::open(dir);
    let stop = Arc::clone(stop);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let result = maps.and_then(|m| f(m, stop)).with_context(|| format!("{name} task"));
            if let Err(e) = &result {
                warn!(task = name, error = %format!("{e:#}"), "stopped");
            }
            result
        })
        .expect("spawning a control-plane thread")
}

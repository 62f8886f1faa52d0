//! `inband lb --config lb.toml`: attach, configure, then keep the control
//! plane running (neighbours, polling, control socket, metrics, the flow
//! sweeper) until SIGINT/SIGTERM. Stopping the daemon leaves the data path
//! attached and its maps pinned: traffic keeps flowing (flows still expire
//! on their own, only memory is not returned until the next daemon sweeps)
//! and the next daemon takes over. `inband lb detach` is the explicit full
//! clean-up. One daemon per interface: a second is refused.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use inband_http::{Reply, StatusCode};
use tracing::{error, info, warn};

use super::config::LbConfig;
use super::tables::{self, LbMaps};
use super::balancer::Balancer;
use super::{apply, attach, control, health, moves, options_watch, peers, polling, query, snapshot, sweep};
use inband_core::bpfmap;
use inband_core::runlock::RunLock;

/// How often the sweeper ages the flow tables, at most.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A pass over a large table takes long (about 1 s at a million flows,
/// 4.7 s at four million: docs/benchmarks.md, "Data path cost"), and passes
/// back to back would keep a core busy: the next pass waits at least this
/// many times the last one's length (a quarter of a core at most).
/// Nothing a packet needs waits for a pass (every path checks timeouts
/// itself); gauges, the idle flows' memory and drained VIPs wait longer.
const SWEEP_DUTY: u32 = 4;

/// When the next pass may start, after one that took `pass`.
fn sweep_interval(pass: Duration) -> Duration {
    SWEEP_EVERY.max(pass * SWEEP_DUTY)
}

pub fn run(config_path: &Path) -> Result<()> {
    let cfg = LbConfig::load(config_path)?;
    cfg.check_host()?;
    let keys = cfg.auth.load_keys()?;
    // Before anything touches the interface: a second daemon must not
    // replace the program or rewrite the maps under the first.
    let lock = RunLock::take(&attach::run_dir(&cfg.interface), &format!("inband lb is already running on {}", cfg.interface))?;
    let dir = attach::pin_dir(&cfg.interface);
    let fresh = !dir.exists();
    let (obj, _) = match attach::load_and_attach(&cfg.interface, cfg.xdp_mode, cfg.flow_table_size, cfg.maglev_table_size, cfg.maglev_tables) {
        Ok(s) => s,
        Err(e) => {
            lock.release();
            return Err(e);
        }
    };
    // Every writer of the configuration maps (control socket, neighbour
    // resolver, reaper) holds this lock: one writer at a time.
    let shared = Arc::new(Mutex::new(cfg.clone()));
    let configured = (|| -> Result<Balancer> {
        let balancer = Balancer::new(LbMaps::open(&dir)?, Arc::clone(&shared), config_path);
        balancer.apply(&keys)?;
        Ok(balancer)
    })();
    let balancer = match configured {
        Ok(m) => m,
        Err(e) => {
            if fresh {
                // Nothing of ours was here before: leave nothing behind.
                drop(lock);
                let _ = attach::detach(&cfg.interface, true);
            }
            return Err(e.context("configuring the balancer maps"));
        }
    };

    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    let maps = balancer.maps();
    let mut workers = Vec::new();

    workers.push(spawn("neighbours", &dir, &stop, {
        let shared = Arc::clone(&shared);
        move |maps, stop| {
            while !stop.load(Ordering::Relaxed) {
                let unresolved = apply::interface(&maps, &shared.lock().unwrap().interface)?;
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
    workers.push(spawn("health", &dir, &stop, {
        let shared = Arc::clone(&shared);
        move |maps, stop| health::run(&maps, &shared, &stop)
    }));
    workers.push(spawn("query", &dir, &stop, {
        let shared = Arc::clone(&shared);
        let prog = attach::program(&obj, "balancer")?.as_fd().try_clone_to_owned().context("duplicating the balancer program's fd")?;
        let interface = cfg.interface.clone();
        move |maps, stop| query::run(&maps, prog, &interface, &shared, &stop)
    }));
    if cfg.scale_out.as_ref().is_some_and(|s| s.fleet().is_some()) {
        workers.push(spawn("peers", &dir, &stop, {
            let shared = Arc::clone(&shared);
            move |maps, stop| peers::run(&maps, &shared, &stop)
        }));
    }
    if cfg.moves.is_some() {
        workers.push(spawn("moves", &dir, &stop, {
            let shared = Arc::clone(&shared);
            let counts = attach::program(&obj, "move_counts")?.as_fd().try_clone_to_owned().context("duplicating move_counts' fd")?;
            move |maps, stop| moves::run(&maps, counts.as_fd(), &shared, &stop)
        }));
    }
    workers.push(spawn("control", &dir, &stop, {
        let shared = Arc::clone(&shared);
        let socket = cfg.control_socket.clone();
        let config_path = config_path.to_path_buf();
        move |maps, stop| control::serve(&socket, &Balancer::new(maps, shared, &config_path), &stop)
    }));
    // Held until the daemon stops: the kernel counts while it is open.
    let _bpf_stats = if cfg.bpf_stats { Some(inband_core::prog_stats::enable()?) } else { None };
    let metrics = match cfg.metrics {
        Some(addr) => {
            let sweeper = attach::program(&obj, "sweep")?.as_fd().try_clone_to_owned().context("duplicating the sweeper's fd")?;
            let b = Balancer::new(LbMaps::open(&dir)?, Arc::clone(&shared), config_path).with_program("sweep", sweeper);
            Some(serve_metrics(addr, b, &stop)?)
        }
        None => None,
    };
    info!(interface = %cfg.interface, vips = cfg.vips.len(), "inband lb running");
    let sweep_prog = attach::program(&obj, "sweep")?;
    let mut last_tick = Instant::now() - SWEEP_EVERY;
    let mut last_sweep = last_tick;
    let mut sweep_every = SWEEP_EVERY;
    let mut options = options_watch::OptionsWatch::new(Duration::from_secs(cfg.options_retry_s));
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if workers.iter().any(|w| w.is_finished()) {
            stop.store(true, Ordering::Relaxed);
        }
        if last_tick.elapsed() >= SWEEP_EVERY {
            last_tick = Instant::now();
            let swept = if last_sweep.elapsed() >= sweep_every {
                last_sweep = Instant::now();
                let r = sweep::run(&sweep_prog, 0);
                sweep_every = sweep_interval(last_sweep.elapsed());
                r
            } else {
                Ok(())
            };
            if let Err(e) = swept.and_then(|()| {
                let _guard = balancer.config();
                for vip in tables::reap(&maps)? {
                    info!(%vip, "removed VIP drained: its last flow ended");
                }
                let found = options.check(&maps, tables::ktime_ns())?;
                polling::add_control_stats(&maps, &found)
            }) {
                warn!(error = %format!("{e:#}"), "sweeping the flow tables failed");
            }
        }
    }
    let mut failed = false;
    for w in workers {
        if let Ok(Err(e)) = w.join() {
            error!(error = %format!("{e:#}"), "control-plane task failed");
            failed = true;
        }
    }
    if let Some(m) = metrics {
        let _ = m.join();
    }
    drop(obj);
    lock.release();
    info!("inband lb stopped; the data path stays attached (`inband lb detach --interface {}` removes it)", cfg.interface);
    if failed {
        anyhow::bail!("a control-plane task failed (see the log above)");
    }
    Ok(())
}

/// `/metrics` (Prometheus) and `/status` (the JSON of `inband status
/// --json`), read from the pins at each request, until `stop`.
fn serve_metrics(addr: SocketAddr, balancer: Balancer, stop: &Arc<AtomicBool>) -> Result<std::thread::JoinHandle<()>> {
    let stop = Arc::clone(stop);
    let until = async move {
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let handler = move |path: &str| {
        let snapshot = match path {
            "/metrics" | "/status" => balancer.snapshot(),
            _ => return Reply::text(StatusCode::NOT_FOUND, "/metrics or /status\n"),
        };
        match (path, snapshot) {
            (_, Err(e)) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
            ("/metrics", Ok(s)) => Reply::metrics(&snapshot::prometheus(s)),
            (_, Ok(s)) => Reply::json(serde_json::to_string(&s).unwrap_or_default()),
        }
    };
    let (addr, thread) = inband_http::spawn("metrics", addr, handler, until).with_context(|| format!("metrics endpoint {addr}"))?;
    info!(%addr, "metrics at http://{addr}/metrics, status at http://{addr}/status");
    Ok(thread)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_sweep_spaces_the_next_one_out() {
        assert_eq!(sweep_interval(Duration::from_millis(40)), SWEEP_EVERY);
        assert_eq!(sweep_interval(Duration::from_millis(1012)), Duration::from_millis(4048));
        assert_eq!(sweep_interval(Duration::from_millis(4680)), Duration::from_millis(18720));
    }
}

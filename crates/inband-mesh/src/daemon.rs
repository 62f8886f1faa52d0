//! `inband mesh run`: loads the programs for one cgroup, keeps the pools,
//! serves the anchor (the user-space path) and the metrics endpoint, and
//! reloads routes on SIGHUP. One thread: the kernel carries the requests,
//! the daemon only what the kernel hands it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::rc::Rc;

use anyhow::{Context, Result};
use tracing::{error, info};

use super::config::Config;
use super::programs::Dataplane;
use super::state::{Health, MeshState, Pool};

/// Lets the process hold a pool socket per slot plus the client
/// connections: the soft limit up to the hard one.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit with a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

pub fn run(path: PathBuf) -> Result<()> {
    let cfg = Config::load(&path)?;
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = tokio::net::TcpListener::bind(cfg.anchor)
            .await
            .with_context(|| format!("binding the anchor {} (is another inband mesh using it?)", cfg.anchor))?;
        let dp = Dataplane::load(&cfg)?;
        dp.install(&cfg)?;
        let backends = cfg.backends();
        let pool = cfg.pool;
        let pool_max = cfg.pool_max();
        let _bpf_stats = if cfg.bpf_stats { Some(inband_core::prog_stats::enable()?) } else { None };
        if let Some(addr) = cfg.metrics {
            super::status::serve_metrics(addr, dp.pins().0.clone(), dp.programs()?, cfg.bpf_stats)?;
        }
        info!(
            cgroup = %cfg.cgroup.display(),
            anchor = %cfg.anchor,
            services = cfg.services.len(),
            backends = backends.len(),
            pool,
            "inband mesh running"
        );
        let sh = Rc::new(MeshState {
            dp,
            health: Health::new(backends.len()),
            pool: Pool::new(backends.len(), pool_max),
            backends: backends.clone(),
            pool_max,
            cfg: RefCell::new(cfg),
            clients: RefCell::new(HashMap::new()),
        });
        for (b, addr) in backends.iter().enumerate() {
            for k in 0..pool {
                tokio::task::spawn_local(super::pool::run_slot(sh.clone(), b as u32, *addr, b as u32 * pool_max + k));
            }
        }
        if let Some(hc) = sh.cfg.borrow().health.clone() {
            for (b, addr) in backends.iter().enumerate() {
                tokio::task::spawn_local(super::health::check(sh.clone(), b as u32, *addr, hc.clone()));
            }
        }
        tokio::task::spawn_local(super::anchor::serve(sh.clone(), listener));
        tokio::task::spawn_local(super::pool::watchdog(sh.clone()));
        let events = sh.clone();
        tokio::task::spawn_local(async move {
            if let Err(e) = super::pool::events(events).await {
                error!("reading mesh_events stopped (handed-over responses now wait for the watchdog's tick): {e:#}");
            }
        });
        signals(sh, path).await
    })
}

async fn signals(sh: Rc<MeshState>, path: PathBuf) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => reload(&sh, &path),
        }
    }
    info!("inband mesh stopping: programs detached, pins removed");
    Ok(())
}

/// Routes, weights, policies, timeouts and services with known backends
/// change in place; a new backend set, pool size, anchor or cgroup needs a
/// restart (the pools and attachments are built from them).
fn reload(sh: &MeshState, path: &PathBuf) {
    let new = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            error!("config not reloaded, the running one stays: {e:#}");
            return;
        }
    };
    {
        let old = sh.cfg.borrow();
        if new.backends() != old.backends()
            || new.pool != old.pool
            || new.pool_max() != old.pool_max()
            || new.health != old.health
            || new.anchor != old.anchor
            || new.cgroup != old.cgroup
        {
            error!(
                "config not reloaded: backends, pool, pool_max, health, anchor and cgroup change only with a restart"
            );
            return;
        }
    }
    if let Err(e) = sh.dp.install(&new) {
        error!("config reload failed part-way: {e:#}");
        return;
    }
    let removed: Vec<SocketAddrV4> = sh
        .cfg
        .borrow()
        .services
        .iter()
        .map(|s| s.address)
        .filter(|a| !new.services.iter().any(|n| n.address == *a))
        .collect();
    for addr in removed {
        sh.dp.remove_service(addr);
    }
    info!(services = new.services.len(), "config reloaded");
    *sh.cfg.borrow_mut() = new;
}

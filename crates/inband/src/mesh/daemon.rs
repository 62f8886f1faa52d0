//! `inband mesh run`: loads the programs for one cgroup, keeps the pools,
//! serves the anchor (the user-space path) and the metrics endpoint, and
//! reloads routes on SIGHUP. One thread: the kernel carries the requests,
//! the daemon only what the kernel hands it.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::rc::Rc;

use anyhow::{Context, Result};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;
use tracing::{error, info, warn};

use super::config::Config;
use super::dataplane::{Dataplane, Slot};

pub struct Shared {
    pub dp: Dataplane,
    pub cfg: RefCell<Config>,
    pub clients: RefCell<HashMap<SocketAddrV4, Rc<Client>>>,
    pub health: Health,
    pub pool: super::pool::Pool,
    /// mesh_backends' entries, by index.
    pub backends: Vec<SocketAddrV4>,
    pub pool_max: u32,
}

/// The daemon's end of a client's anchor connection: the way back to a
/// client for what the daemon relays or answers.
pub struct Client {
    pub writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Wakes the connection's task to close it (with a reset if `rst`).
    pub close: Notify,
    pub rst: Cell<bool>,
    pub fd: RawFd,
}

impl Client {
    /// Ends the connection with a reset: the client sees an error, never a
    /// silently short response.
    pub fn reset(&self) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt on the connection's fd with a correctly sized struct.
        unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        self.rst.set(true);
        self.close.notify_one();
    }
}

impl Shared {
    pub fn client(&self, s: &Slot) -> Option<Rc<Client>> {
        let peer = SocketAddrV4::new(
            std::net::Ipv4Addr::from(u32::from_be(s.client_ip4)),
            s.client_port as u16,
        );
        self.clients.borrow().get(&peer).cloned()
    }

    /// A request failed at the backend: a 502/504 if nothing of the response
    /// reached the client yet, otherwise a reset.
    pub async fn fail_client(&self, s: &Slot, status: u16) {
        let Some(cl) = self.client(s) else { return };
        if s.to_client > 0 {
            cl.reset();
            return;
        }
        let body = if status == 504 {
            "upstream timed out\n"
        } else {
            "upstream connection failed\n"
        };
        let reason = if status == 504 {
            "Gateway Timeout"
        } else {
            "Bad Gateway"
        };
        let msg = format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nvia: 1.1 inband-mesh\r\n\r\n{body}",
            body.len()
        );
        let mut w = cl.writer.lock().await;
        if w.write_all(msg.as_bytes()).await.is_err() {
            cl.reset();
        }
    }

    /// The response ended with the backend's connection: so must the client's.
    pub fn close_client(&self, s: &Slot) {
        if let Some(cl) = self.client(s) {
            cl.close.notify_one();
        }
    }
}

/// A backend is up while it has a connected slot and, with active health
/// checks, while they pass.
pub struct Health {
    connected: RefCell<Vec<u32>>,
    passing: RefCell<Vec<bool>>,
}

impl Health {
    fn new(n: usize) -> Health {
        Health {
            connected: RefCell::new(vec![0; n]),
            passing: RefCell::new(vec![true; n]),
        }
    }

    fn update(&self, dp: &Dataplane, backend: u32) {
        let up = self.connected.borrow()[backend as usize] > 0
            && self.passing.borrow()[backend as usize];
        if up != (dp.backend_snapshot(backend).up != 0) {
            dp.set_up(backend, up);
            info!(backend, up, "backend state");
        }
    }

    pub fn connected(&self, dp: &Dataplane, backend: u32) {
        self.connected.borrow_mut()[backend as usize] += 1;
        self.update(dp, backend);
    }

    pub fn disconnected(&self, dp: &Dataplane, backend: u32) {
        let mut c = self.connected.borrow_mut();
        c[backend as usize] = c[backend as usize].saturating_sub(1);
        drop(c);
        self.update(dp, backend);
    }

    pub fn checked(&self, dp: &Dataplane, backend: u32, passing: bool) {
        self.passing.borrow_mut()[backend as usize] = passing;
        self.update(dp, backend);
    }

    pub fn connect_failed(&self, dp: &Dataplane, backend: u32, slot: u32, why: &str) {
        if self.connected.borrow()[backend as usize] == 0 {
            self.update(dp, backend);
            // Once per slot's first attempt is enough noise.
            if slot == dp.backend_snapshot(backend).slot_base {
                warn!(backend, "backend unreachable: {why}");
            }
        }
    }
}

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
        if let Some(addr) = cfg.metrics {
            super::status::serve_metrics(addr, dp.pins().0.clone())?;
        }
        info!(
            cgroup = %cfg.cgroup.display(),
            anchor = %cfg.anchor,
            services = cfg.services.len(),
            backends = backends.len(),
            pool,
            "inband mesh running"
        );
        let sh = Rc::new(Shared {
            dp,
            health: Health::new(backends.len()),
            pool: super::pool::Pool::new(backends.len(), pool_max),
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

async fn signals(sh: Rc<Shared>, path: PathBuf) -> Result<()> {
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
fn reload(sh: &Shared, path: &PathBuf) {
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

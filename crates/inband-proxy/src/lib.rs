//! `inband proxy`: an HTTP/1.1 and HTTP/2 reverse proxy, plaintext and
//! TLS, in front of backend pools chosen by host and path
//! (round-robin, least-request, least-score from the backends' agents,
//! consistent hashing), with active and
//! passive health checking, bounded retries, an HTTP cache kept in a
//! durable store (inband-cache), a Prometheus endpoint and graceful
//! shutdown. See docs/proxy.md.

mod access;
mod backend;
mod body;
mod cache_control;
mod cache_layer;
mod cache_outcome;
mod cache_store;
mod cdn_cache_control;
mod client_limits;
mod compression;
pub mod config;
mod conn;
mod forward;
mod http2_guard;
mod interim;
pub mod health;
mod hop_by_hop;
mod metrics;
mod policy;
mod probe;
mod ranges;
mod routes;
mod scores;
mod server;
mod tcpe;
mod tcpe_kept;
mod tls;
mod tunnel;
mod upgrade;
mod upstream;
mod uri_path;
mod workers;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use config::Checked;
use metrics::Metrics;

/// What every request handler shares.
pub(crate) struct Shared {
    cfg: Checked,
    router: routes::Router,
    metrics: Metrics,
    cache: Option<cache_store::HttpCache>,
    /// `max_connections` permits, shared by every worker.
    connection_slots: Arc<tokio::sync::Semaphore>,
    /// One per worker thread, by index.
    worker_loads: Vec<Arc<workers::WorkerLoad>>,
    /// Which worker's socket the kernel gives new connections.
    steering: workers::Steering,
    /// The TLS listener's certificates and settings.
    tls: Option<tls::Tls>,
    client_limits: Arc<client_limits::ClientLimits>,
    /// With `[tcpe]`: the sockops program, the servers, the counts.
    tcpe: Option<tcpe::Handoffs>,
}

impl Shared {
    /// `/metrics` on `metrics_listen`; anything else is 404.
    fn metrics_reply(&self, path: &str) -> inband_http::Reply {
        if path != "/metrics" {
            return inband_http::Reply::text(inband_http::StatusCode::NOT_FOUND, "see /metrics\n");
        }
        let now = Instant::now();
        for b in self.router.all().flat_map(|r| &r.pool.backends) {
            self.metrics.set_backend_up(b, b.is_healthy(now));
        }
        for b in scores::scored(&self.router) {
            self.metrics.set_backend_score(&b, b.score(now));
        }
        if let Some(c) = &self.cache {
            self.metrics.set_cache_store(&c.stats());
        }
        if let Some(t) = &self.tls {
            for (file, not_after) in t.expiries() {
                self.metrics.set_tls_expiry(&file, not_after);
            }
        }
        if let Some(t) = &self.tcpe {
            self.metrics.set_tcpe_handoffs(&t.counters, &t.moves);
            match t.option_counters() {
                Ok(c) => self.metrics.set_tcpe_options(&c),
                Err(e) => tracing::warn!("tcpe: reading the sockops program's counters: {e:#}"),
            }
        }
        for (i, l) in self.worker_loads.iter().enumerate() {
            self.metrics.set_worker_load(i, l.open.load(Ordering::Relaxed), l.busy_permille.load(Ordering::Relaxed));
        }
        inband_http::Reply::metrics(self.metrics.registry())
    }
}

/// A running proxy.
pub struct Proxy {
    /// Where clients connect (the bound address, so port 0 works).
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// The TLS listener's bound address.
    pub tls_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    /// One per worker thread, completed when it has stopped serving.
    servers: Vec<tokio::sync::oneshot::Receiver<()>>,
    shared: Arc<Shared>,
    background: Vec<JoinHandle<()>>,
}

impl Proxy {
    /// Binds the listeners and starts serving; returns once both accept.
    pub async fn start(cfg: Checked) -> Result<Proxy> {
        // The store opens before the listener binds, so a proxy that
        // accepts has its cache: the first request after a restart can hit.
        let cache = cfg.raw.cache.as_ref().map(cache_store::HttpCache::open).transpose().context("opening the cache")?;
        let tls = cfg.raw.tls.as_ref().map(tls::Tls::new).transpose().context("TLS")?;
        let poll_keys = cfg.raw.auth.as_ref().map(scores::keys).transpose().context("[auth] keys for score polls")?;
        let metrics = Metrics::new();
        // A backend CA or client certificate file that cannot be used
        // refuses the start, as the listener's certificates do.
        let router = routes::Router::new(&cfg, &metrics).context("backend TLS")?;
        let tcpe = cfg.tcpe.as_ref().map(tcpe::Handoffs::start).transpose()?;
        let workers = match cfg.raw.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let listeners = match &tcpe {
            Some(t) => t.listen(cfg.listen, workers).with_context(|| format!("listening on {} (answering TCPE)", cfg.listen))?,
            None => workers::bind(cfg.listen, workers, |_| Ok(()), |_| Ok(())).with_context(|| format!("listening on {}", cfg.listen))?,
        };
        let addr = listeners[0].local_addr()?;
        let tls_listeners = match cfg.tls_listen {
            Some(t) => workers::bind(t, workers, |_| Ok(()), |_| Ok(())).with_context(|| format!("listening on {t} (TLS)"))?,
            None => Vec::new(),
        };
        let tls_addr = tls_listeners.first().map(|l| l.local_addr()).transpose()?;
        let metrics_listener = match cfg.metrics_listen {
            Some(m) => Some(TcpListener::bind(m).await.with_context(|| format!("listening on {m} (metrics)"))?),
            None => None,
        };
        let metrics_addr = metrics_listener.as_ref().map(|l| l.local_addr()).transpose()?;
        let max_connections = match cfg.raw.max_connections {
            0 => (open_files_limit().saturating_sub(64) / 2).max(1) as usize,
            n => n,
        };
        let worker_loads: Vec<Arc<workers::WorkerLoad>> = (0..workers).map(|_| Arc::default()).collect();
        let steering = workers::Steering::new(&[&listeners, &tls_listeners], worker_loads.clone(), cfg.raw.pack_connections)?;
        let shared = Arc::new(Shared {
            connection_slots: Arc::new(tokio::sync::Semaphore::new(max_connections)),
            worker_loads,
            steering,
            router,
            client_limits: Arc::new(client_limits::ClientLimits::new(
                cfg.raw.client_limits.connections_for(max_connections),
                cfg.raw.client_limits.requests_per_s,
                cfg.raw.client_limits.burst(),
                metrics.clients_untracked.clone(),
            )),
            metrics,
            cache,
            tls,
            tcpe,
            cfg,
        });
        let mut background = Vec::new();
        for pool in shared.router.all().map(|r| &r.pool) {
            if let Some(h) = &pool.health {
                for (b, addr) in pool.backends.iter().zip(&pool.addrs) {
                    background.push(health::spawn(h.clone(), b.clone(), *addr, pool.transport.clone()));
                }
            }
        }
        let scored = scores::scored(&shared.router);
        if let (false, Some((keys, sign_id))) = (scored.is_empty(), poll_keys) {
            for b in &scored {
                shared.metrics.add_scored_backend(b);
            }
            background.push(scores::start(shared.clone(), keys, sign_id).await?);
        }
        if shared.cache.is_some() {
            background.push(tokio::spawn(flush_periodically(shared.clone())));
        }
        if let Some(l) = metrics_listener {
            let shared = shared.clone();
            background.push(tokio::spawn(inband_http::serve(l, move |path| shared.metrics_reply(path))));
        }
        let (stop, stop_rx) = watch::channel(false);
        let mut rxs = Vec::new();
        let mut slots = Vec::new();
        for load in &shared.worker_loads {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            rxs.push(rx);
            slots.push(server::WorkerSlot { tx, load: load.clone() });
        }
        let slots: Arc<[server::WorkerSlot]> = slots.into();
        let mut tls_listeners = tls_listeners.into_iter();
        let mut servers = Vec::new();
        for (i, (rx, plain)) in rxs.into_iter().zip(listeners).enumerate() {
            let own = Listening { plain, tls: tls_listeners.next(), workers: slots.clone() };
            servers.push(spawn_worker(i, shared.clone(), rx, own, stop_rx.clone())?);
        }
        tracing::info!(%addr, tls = ?tls_addr, routes = shared.router.all().count(), workers, max_connections, open_files = open_files_limit(), "proxy listening");
        Ok(Proxy { addr, metrics_addr, tls_addr, stop, servers, shared, background })
    }

    /// Returns at SIGTERM or SIGINT; reloads the TLS certificates at each
    /// SIGHUP meanwhile.
    pub async fn until_stopped(&self) -> Result<()> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut hup = signal(SignalKind::hangup())?;
        loop {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: finishing in-flight requests"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: finishing in-flight requests"),
                _ = hup.recv() => {
                    match self.reload_tls() {
                        Ok(()) => tracing::info!("SIGHUP: TLS certificates reloaded"),
                        Err(e) => tracing::error!("SIGHUP: TLS certificates not reloaded, the previous ones stay: {e:#}"),
                    }
                    continue;
                }
            }
            return Ok(());
        }
    }

    /// Reads the TLS certificate files again (SIGHUP). New handshakes get
    /// the new certificates; open connections are not touched. On an
    /// error the certificates in use stay and the error names the file.
    pub fn reload_tls(&self) -> Result<()> {
        let Some(tls) = &self.shared.tls else { return Ok(()) };
        let r = tls.reload();
        self.shared.metrics.tls_reload(r.is_ok());
        r
    }

    /// Stops accepting, waits for in-flight requests (bounded by
    /// `shutdown_timeout_ms`), then stops health checks and metrics.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.shared.steering.close();
        for done in self.servers {
            let _ = done.await;
        }
        for t in self.background {
            t.abort();
        }
        if let Some(c) = &self.shared.cache {
            c.flush().await;
        }
        tracing::info!("proxy stopped");
    }
}

/// A worker's own listening sockets, and where to send a connection it
/// accepts for another worker.
struct Listening {
    plain: std::net::TcpListener,
    tls: Option<std::net::TcpListener>,
    workers: Arc<[server::WorkerSlot]>,
}

/// A worker: an OS thread with its own single-threaded runtime accepting
/// on its own sockets and serving its connections, like nginx's worker
/// processes. A connection lives on its worker, so a request never hops
/// between threads (no work stealing, no cross-thread wake-ups: a third of
/// the CPU of a cache hit on tokio's multi-threaded runtime), and the
/// worker has its own pool of backend connections for the same reason.
fn spawn_worker(
    i: usize,
    shared: Arc<Shared>,
    conns: tokio::sync::mpsc::UnboundedReceiver<server::Accepted>,
    own: Listening,
    stop: watch::Receiver<bool>,
) -> Result<tokio::sync::oneshot::Receiver<()>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Registered with the worker's runtime here, so that a socket that
    // cannot be refuses the start instead of leaving a queue nobody reads.
    let (plain, tls) = {
        let _in = rt.enter();
        let register = |l: std::net::TcpListener| l.set_nonblocking(true).and_then(|()| TcpListener::from_std(l));
        (register(own.plain)?, own.tls.map(register).transpose()?)
    };
    let (done, finished) = tokio::sync::oneshot::channel();
    let load = shared.worker_loads[i].clone();
    std::thread::Builder::new().name(format!("proxy-worker-{i}")).spawn(move || {
        rt.block_on(async move {
            // Dropped with the runtime when serving ends.
            tokio::spawn(server::measure_busy(shared.clone(), load.clone()));
            if let Some(l) = tls {
                tokio::spawn(server::accept(shared.clone(), l, true, i, own.workers.clone(), stop.clone()));
            }
            tokio::spawn(server::accept(shared.clone(), plain, false, i, own.workers, stop.clone()));
            server::serve(shared, conns, load, stop).await
        });
        let _ = done.send(());
    })?;
    Ok(finished)
}

/// Writes acknowledged cache entries to stable storage every second, so
/// power loss costs at most a second of entries (kill -9 costs none).
async fn flush_periodically(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        if let Some(c) = &shared.cache {
            c.flush().await;
        }
    }
}

/// The soft limit on open files.
fn open_files_limit() -> u64 {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return 1024;
    }
    l.rlim_cur
}

/// A proxy holds two descriptors per client (its own and a backend's), and
/// shells often start processes at a soft limit of 1024 with a far higher
/// hard limit: take the hard one.
fn raise_open_files_limit() {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                tracing::warn!(error = %std::io::Error::last_os_error(), "could not raise the open-files limit");
            }
        }
    }
}

/// `inband proxy --config FILE`: runs until SIGTERM or SIGINT; SIGHUP
/// reloads the TLS certificates.
pub fn run(config: &Path) -> Result<()> {
    let cfg = config::load(config)?;
    raise_open_files_limit();
    // Requests are served on the workers' own runtimes; this one runs
    // signals, health checks, cache flushes and the metrics endpoint.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let proxy = Proxy::start(cfg).await?;
        proxy.until_stopped().await?;
        proxy.shutdown().await;
        Ok(())
    })
}

//! `inband serve`: an HTTP/1.1 server of limited capacity, used as the real
//! server in tests and benchmarks (see docs/workload.md); `inband quic`: a
//! QUIC server and client for UDP and QUIC VIPs (module `quic`).

mod capacity;
mod http;
pub mod quic;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tracing::info;

pub use capacity::{Model, ServiceDist, Slowdown};
pub use http::Stats;

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Requests in service at once.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Requests waiting for a worker; beyond this, 503 at once.
    #[arg(long, default_value_t = 1024)]
    pub queue: usize,
    /// Mean service time of a request when the server is at speed 1.
    #[arg(long, default_value_t = 1000.0)]
    pub service_ms: f64,
    #[arg(long, value_enum, default_value_t = ServiceDist::Exponential)]
    pub service_dist: ServiceDist,
    /// Sigma of the lognormal service time (its spread around the mean).
    #[arg(long, default_value_t = 0.8)]
    pub service_sigma: f64,
    /// Relative speed: service time is divided by it (0.5 = twice as slow).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// START_S:DURATION_S:FACTOR — service is FACTOR times slower in that window (repeatable).
    #[arg(long)]
    pub slowdown: Vec<Slowdown>,
    /// Multiplies every service time (quick benchmark profiles shrink time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Response body size in bytes (the paper's responses are ~46 KB).
    #[arg(long, default_value_t = 47104)]
    pub body_bytes: usize,
    /// Keep connections open when the client asks (default: close after
    /// each response, so every request is a new balancing decision).
    #[arg(long)]
    pub keep_alive: bool,
}

impl ServeArgs {
    fn validate(&self) -> Result<()> {
        anyhow::ensure!(self.speed > 0.0, "--speed must be > 0");
        anyhow::ensure!(self.time_scale > 0.0, "--time-scale must be > 0");
        anyhow::ensure!(self.service_ms >= 0.0, "--service-ms must be >= 0");
        anyhow::ensure!(self.workers >= 1, "--workers must be >= 1");
        // Past 3 the mean-preserving lognormal puts nearly every request
        // near zero and the mean in a rare few: no server behaves like that.
        anyhow::ensure!(self.service_sigma > 0.0 && self.service_sigma <= 3.0, "--service-sigma must be in (0, 3]");
        Ok(())
    }

    fn model(&self) -> Model {
        Model {
            workers: self.workers,
            queue: self.queue,
            service_ms: self.service_ms,
            dist: self.service_dist,
            sigma: self.service_sigma,
            speed: self.speed,
            time_scale: self.time_scale,
            slowdowns: self.slowdown.clone(),
        }
    }
}

/// A running server (in-process; tests use it directly).
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub state: Arc<http::Shared>,
}

impl Server {
    pub fn bind(args: ServeArgs) -> Result<Server> {
        args.validate()?;
        let listener = TcpListener::bind(args.listen).with_context(|| format!("listening on {}", args.listen))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(http::Shared::new(args.model(), args.body_bytes, args.keep_alive));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
            std::thread::spawn(move || http::accept_loop(listener, state, stop))
        };
        Ok(Server { addr, stop, thread: Some(thread), state })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> Stats {
        self.state.stats()
    }

    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    info!(listen = %args.listen, workers = args.workers, service_ms = args.service_ms, speed = args.speed, "inband serve");
    let server = Server::bind(args)?;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    server.shutdown();
    Ok(())
}

//! `inband agent run --config agent.toml`: check, attach, configure, seed
//! the connection counts, then serve the score socket, the poll responder
//! and (with `score = "cpu"`) the CPU score until SIGINT/SIGTERM, and detach.
//! SIGUSR2 stops it for an upgrade instead: the data path stays attached
//! for the next agent (attach.rs, `Attachment::leave`). Meanwhile SIGHUP
//! re-reads `[auth]` and the interface MTU is followed.

use std::collections::HashSet;
use std::mem::MaybeUninit;
use std::net::{IpAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tracing::{debug, error, info, warn};

use super::attach;
use super::config::{self, AgentConfig, ScoreSource};
use super::cpu::{self, RunQueue};
use super::poll_responder;
use super::proc_tcp;
use super::score_socket::{self, ScoreApi};
use super::settings::{self, DataPathSettings};
use super::tables::AgentMaps;
use inband_core::bpfmap;

pub fn run(config_path: &Path) -> Result<()> {
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Info, libbpf_log)));
    let cfg = AgentConfig::load(config_path)?;
    let keys = cfg.load_keys().with_context(|| format!("in {}", config_path.display()))?;
    cfg.check_host()?;
    let client_address = cfg.client_address_cgroup()?;
    let data_path = DataPathSettings::new(cfg.auth.mode, keys, inband_core::netif::mtu(&cfg.interface)?, cfg.udp_idle_timeout_s);
    let group = cfg.score_socket_group.as_deref().map(config::group_id).transpose()?;
    let lock = attach::lock_interface(&cfg.interface)?;
    // From here on a signal must not kill the process half-way through
    // attaching: it only asks the serve loop to stop, which detaches (or,
    // SIGHUP, to reload).
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    let reload = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&reload))?;
    let hand_over = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGUSR2, Arc::clone(&hand_over))?;
    signal_hook::flag::register(signal_hook::consts::SIGUSR2, Arc::clone(&stop))?;
    // Everything that can be refused by the host without side effects on the
    // data path is claimed before anything is attached.
    let claimed = (|| -> Result<_> {
        let poll_sock = match cfg.poll_port {
            0 => Vec::new(),
            p => poll_responder::bind(p)?,
        };
        Ok((score_socket::bind(&cfg.score_socket, group)?, poll_sock))
    })();
    let (listener, poll_sock) = match claimed {
        Ok(c) => c,
        Err(e) => {
            lock.release();
            return Err(e);
        }
    };

    let mut storage = MaybeUninit::uninit();
    let attached = match attach::attach(&mut storage, &cfg.interface, cfg.score, client_address.as_deref()) {
        Ok(a) => a,
        Err(e) => {
            let _ = std::fs::remove_file(&cfg.score_socket);
            lock.release();
            return Err(e);
        }
    };
    let result = configure(&cfg, &data_path, &attached.pins).context("configuring the agent maps").and_then(|maps| {
        // Counting stops when this closes, with the agent.
        let _bpf_stats = if cfg.bpf_stats { Some(inband_core::prog_stats::enable()?) } else { None };
        if let Some(addr) = cfg.metrics {
            let source = super::metrics::Source {
                interface: cfg.interface.clone(),
                pins: bpfmap::PinDir(attached.pins.0.clone()),
                score: cfg.score,
                programs: attached.programs()?,
                bpf_stats: cfg.bpf_stats,
            };
            super::metrics::serve(addr, source, &stop)?;
        }
        let control = Control { config_path, cfg: &cfg, data_path, reload };
        serve(control, maps, &attached.pins, listener, poll_sock, stop)
    });
    let _ = std::fs::remove_file(&cfg.score_socket);
    if result.is_ok() && hand_over.load(Ordering::Relaxed) {
        attached.leave();
        drop(lock);
        return Ok(());
    }
    let detached = attached.detach();
    drop(lock);
    match (result, detached) {
        (Ok(()), Ok(())) => {
            info!(interface = %cfg.interface, "inband agent stopped; nothing is left attached");
            Ok(())
        }
        (Err(e), Ok(())) => Err(e),
        (Ok(()), Err(d)) => Err(d.context(format!(
            "stopping the agent: clean-up was incomplete; retry with `inband agent detach --interface {}`",
            cfg.interface
        ))),
        (Err(e), Err(d)) => {
            error!(error = %format!("{d:#}"), "clean-up after the failure was incomplete too");
            Err(e)
        }
    }
}

/// libbpf's messages (verifier logs included) go to the agent's log.
fn libbpf_log(level: libbpf_rs::PrintLevel, msg: String) {
    let msg = msg.trim_end();
    // The kernel's answer when the clsact qdisc exists already: expected
    // (the agent then uses it), not a warning.
    if msg.contains("Exclusivity flag on") {
        debug!(target: "libbpf", "{msg}");
        return;
    }
    match level {
        libbpf_rs::PrintLevel::Warn => warn!(target: "libbpf", "{msg}"),
        libbpf_rs::PrintLevel::Info => info!(target: "libbpf", "{msg}"),
        libbpf_rs::PrintLevel::Debug => debug!(target: "libbpf", "{msg}"),
    }
}

/// Fills the maps from the config and seeds the connection counts. The
/// format and keys go in before the services: until a port is served the
/// programs leave its packets alone, and from then on they check its options.
fn configure(cfg: &AgentConfig, data_path: &DataPathSettings, pins: &bpfmap::PinDir) -> Result<AgentMaps> {
    let maps = AgentMaps::open(pins)?;
    data_path.apply(&maps, None)?;
    info!(
        auth = data_path.mode.name(),
        key_ids = ?data_path.status().key_ids,
        mtu = data_path.mtu,
        "option format and keys loaded"
    );
    maps.apply(&cfg.services, &cfg.balancers, &cfg.fleet_prefixes)?;
    let ports: HashSet<u16> = cfg.service_ports().into_iter().collect();
    // Overrides left by a crashed agent: the application's (`app`) are its
    // last word and stay; anything else would freeze a stale score.
    for (port, _) in bpfmap::entries::<u16, u32>(&maps.score_override)? {
        if !(cfg.score == ScoreSource::App && ports.contains(&port)) {
            maps.clear_override(port)?;
        }
    }
    for (port, _) in bpfmap::entries::<u16, i64>(&maps.active_conns)? {
        if !ports.contains(&port) {
            bpfmap::delete(&maps.active_conns, &port)?;
        }
    }
    // The in-flight counts exist only for the sources that count requests (their
    // entries are what the data path looks for); they start at 0, as a
    // request already in flight cannot be told from an idle connection.
    for (port, _) in bpfmap::entries::<u16, i64>(&maps.inflight)? {
        bpfmap::delete(&maps.inflight, &port)?;
    }
    if cfg.score.counts_requests() {
        for port in cfg.service_ports() {
            bpfmap::put(&maps.inflight, &port, &0i64)?;
        }
    }
    for port in cfg.service_ports() {
        let n = seed_active(&maps, port, &cfg.balancers, proc_tcp::read)?;
        info!(port, active = n, "connection count seeded from /proc/net/tcp");
    }
    Ok(maps)
}

/// Seeds `active_conns[port]` with the connections that existed before the
/// tracepoint was attached, and returns the seeded count.
///
/// The tracepoint only adds deltas, so the entry needs the number of active
/// sockets at some instant plus every delta after it — and userspace cannot
/// read /proc/net/tcp and write the map atomically with respect to socket
/// state changes. The order bounds the error:
/// - The tracepoint is attached (by `attach`) before this runs, so no
///   transition after the scan is missed; seeding before attaching would
///   lose every transition during program load and attach (milliseconds).
/// - The entry is set to 0 first; from then on it holds exactly the deltas
///   since that moment, D. A scan of /proc/net/tcp gives the true count C.
///   If the entry reads the same before and after the scan, no socket of the
///   port changed state during it, so the count at entry creation was C − D,
///   and the entry must be increased by that. Scans that raced a transition
///   are retried.
/// - That increase is a read followed by a write: a transition between the
///   two (a window of two syscalls, microseconds) is lost, and stays lost
///   since the entry is only ever adjusted by deltas. Removing that window
///   needs an atomic add from userspace, which BPF maps do not offer.
pub fn seed_active(
    maps: &AgentMaps,
    port: u16,
    balancers: &[IpAddr],
    read_sockets: impl Fn() -> Result<Vec<proc_tcp::TcpSocket>>,
) -> Result<i64> {
    const ATTEMPTS: usize = 10;
    bpfmap::put(&maps.active_conns, &port, &0i64)?;
    let mut offset = 0;
    for attempt in 1..=ATTEMPTS {
        let before = maps.active(port)?.unwrap_or(0);
        let count = proc_tcp::active_on_port(&read_sockets()?, port, balancers);
        let after = maps.active(port)?.unwrap_or(0);
        offset = count - after;
        if before == after {
            break;
        }
        if attempt == ATTEMPTS {
            // Connections churn faster than a scan: the last one stands,
            // off by the few transitions that happened during it.
            warn!(port, "sockets changed state during every scan of /proc/net/tcp; the count may be off by a few");
        }
    }
    let now = maps.active(port)?.unwrap_or(0);
    bpfmap::put(&maps.active_conns, &port, &(now + offset))?;
    Ok(now + offset)
}

/// How often the interface MTU is read again.
const MTU_INTERVAL: Duration = Duration::from_secs(1);

/// The main loop's own state: what it rewrites on SIGHUP and MTU changes.
struct Control<'a> {
    config_path: &'a Path,
    /// The config the agent started with: services, balancers and the
    /// rest only take effect on a restart.
    cfg: &'a AgentConfig,
    data_path: DataPathSettings,
    reload: Arc<AtomicBool>,
}

impl Control<'_> {
    /// SIGHUP: re-reads the config file and applies `[auth]` (format and
    /// keys) and the MTU to the running programs, flows untouched. A config
    /// that does not load leaves everything as it was.
    fn reload(&mut self, maps: &AgentMaps) {
        let loaded = AgentConfig::load(self.config_path).and_then(|new| {
            let keys = new.load_keys().with_context(|| format!("in {}", self.config_path.display()))?;
            let mtu = inband_core::netif::mtu(&self.cfg.interface)?;
            Ok((DataPathSettings::new(new.auth.mode, keys, mtu, new.udp_idle_timeout_s), new))
        });
        let (data_path, new) = match loaded {
            Ok(l) => l,
            Err(e) => {
                error!(error = %format!("{e:#}"), "SIGHUP: config not reloaded; the running settings stay");
                return;
            }
        };
        match settings::restart_only_changes(self.cfg, &new) {
            Ok(ignored) if !ignored.is_empty() => warn!(
                settings = %ignored.join(", "),
                "SIGHUP applies [auth] only: restart the agent for the other changed settings"
            ),
            Ok(_) => {}
            Err(e) => warn!(error = %format!("{e:#}"), "SIGHUP: comparing the configs failed"),
        }
        self.apply(maps, data_path, "SIGHUP");
    }

    /// Follows the interface's MTU, which an operator may change at any time.
    fn refresh_mtu(&mut self, maps: &AgentMaps) {
        match inband_core::netif::mtu(&self.cfg.interface) {
            Ok(mtu) if mtu != self.data_path.mtu => {
                let data_path = DataPathSettings { mtu, ..self.data_path.clone() };
                self.apply(maps, data_path, "interface MTU changed");
            }
            Ok(_) => {}
            Err(e) => warn!(error = %format!("{e:#}"), "reading the interface MTU failed; keeping the last one"),
        }
    }

    fn apply(&mut self, maps: &AgentMaps, new: DataPathSettings, why: &str) {
        let changes = self.data_path.changes(&new);
        if changes.is_empty() {
            info!("{why}: nothing to change");
            return;
        }
        match new.apply(maps, Some(&self.data_path)) {
            Ok(()) => {
                info!(changes = %changes.join("; "), "{why}: applied");
                self.data_path = new;
            }
            // The maps may hold part of it: the next attempt writes
            // everything that differs from what was last applied in full.
            Err(e) => error!(error = %format!("{e:#}"), "{why}: applying the settings failed"),
        }
    }
}

fn serve(
    mut control: Control,
    maps: AgentMaps,
    pins: &bpfmap::PinDir,
    listener: std::os::unix::net::UnixListener,
    poll_sock: Vec<UdpSocket>,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let cfg = control.cfg;
    let control_maps = AgentMaps::open(pins)?;
    let ports = cfg.service_ports();
    let mut workers: Vec<(&str, std::thread::JoinHandle<Result<()>>)> = Vec::new();

    let api = Arc::new(ScoreApi { maps, interface: cfg.interface.clone(), ports: ports.clone(), source: cfg.score });
    workers.push(("score socket", {
        let stop = Arc::clone(&stop);
        let api = Arc::clone(&api);
        std::thread::Builder::new()
            .name("score-socket".into())
            .spawn(move || score_socket::serve(listener, api, stop))?
    }));
    if !poll_sock.is_empty() {
        info!(port = cfg.poll_port, "answering score polls");
    }
    for sock in poll_sock {
        let maps = AgentMaps::open(pins)?;
        let stop = Arc::clone(&stop);
        let (ports, balancers, source) = (ports.clone(), cfg.balancers.clone(), cfg.score);
        workers.push((
            "poll responder",
            std::thread::Builder::new()
                .name("poll-responder".into())
                .spawn(move || poll_responder::serve(&sock, &maps, source, &ports, &balancers, &stop))?,
        ));
    }
    if cfg.score == ScoreSource::Cpu {
        let maps = AgentMaps::open(pins)?;
        let stop = Arc::clone(&stop);
        let ports = ports.clone();
        workers.push((
            "cpu score",
            std::thread::Builder::new().name("cpu-score".into()).spawn(move || {
                let mut rq = RunQueue::default();
                while !stop.load(Ordering::Relaxed) {
                    let score = rq.sample()?;
                    for p in &ports {
                        maps.set_override(*p, score)?;
                    }
                    std::thread::sleep(cpu::INTERVAL);
                }
                Ok(())
            })?,
        ));
    }
    info!(
        interface = %cfg.interface,
        services = ports.len(),
        score = cfg.score.name(),
        socket = %cfg.score_socket.display(),
        "inband agent running"
    );
    let mut mtu_checked = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if workers.iter().any(|(_, w)| w.is_finished()) {
            stop.store(true, Ordering::Relaxed);
        }
        if control.reload.swap(false, Ordering::Relaxed) {
            control.reload(&control_maps);
        }
        if mtu_checked.elapsed() >= MTU_INTERVAL {
            control.refresh_mtu(&control_maps);
            mtu_checked = Instant::now();
        }
    }
    let mut failed = Vec::new();
    for (name, w) in workers {
        match w.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                error!(task = name, error = %format!("{e:#}"), "agent task failed");
                failed.push(name);
            }
            Err(_) => failed.push(name),
        }
    }
    if !failed.is_empty() {
        anyhow::bail!("agent task(s) failed: {} (see the log above); the agent detached itself", failed.join(", "));
    }
    Ok(())
}

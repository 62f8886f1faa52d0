//! `inband shadow metrics`: the shadow programs of this network namespace
//! for Prometheus. Nothing else here runs as a process (`attach` and
//! `route` leave filters and pins behind and exit), so the exporter is a
//! process of its own beside them: whatever it finds at each scrape (each
//! server interface's pins under shadow/, the router's under shadow_dt4/,
//! the programs in their filter slots) is what it serves, so an attach,
//! detach or route run while it runs shows at the next scrape. With
//! `--bpf-stats` it holds the kernel's run-time statistics on while it
//! runs, as `bpf_stats = true` makes the daemons do.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use inband_http::{Families, Reply, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tracing::info;

use crate::attach::Count;
use crate::{attach, dt4, Program};

/// A server interface's program: its counters and, if its filter is
/// there, the program's run count and time.
#[derive(Debug)]
pub struct ServerPrograms {
    pub interface: String,
    pub counters: Vec<(&'static str, Count)>,
    pub program: Option<Program>,
}

/// The router's IPv4 shadow program.
#[derive(Debug)]
pub struct RouterPrograms {
    pub counters: Vec<(&'static str, Count)>,
    pub programs: Vec<Program>,
}

#[derive(Debug)]
pub struct Snapshot {
    pub servers: Vec<ServerPrograms>,
    pub router: Option<RouterPrograms>,
    /// Run-time statistics are on (the sysctl, or this process holding them).
    pub bpf_stats: bool,
}

impl Snapshot {
    pub fn read() -> Result<Snapshot> {
        let mut servers = Vec::new();
        for interface in attach::attached()? {
            let counters = attach::counters(&interface)?;
            let program = attach::program(&interface)?;
            servers.push(ServerPrograms { interface, counters, program });
        }
        let router = if dt4::pin_dir().exists() { Some(RouterPrograms { counters: dt4::counters()?, programs: dt4::programs()? }) } else { None };
        Ok(Snapshot { servers, router, bpf_stats: inband_core::prog_stats::enabled() })
    }

    /// What `/status` serves: each side as `inband shadow status --json`
    /// prints it.
    pub fn json(&self) -> Value {
        let servers: serde_json::Map<String, Value> =
            self.servers.iter().map(|s| (s.interface.clone(), status_json(&s.counters, s.program.as_slice(), self.bpf_stats))).collect();
        json!({
            "servers": servers,
            "router": self.router.as_ref().map(|r| status_json(&r.counters, &r.programs, self.bpf_stats)),
            "bpf_stats": self.bpf_stats,
        })
    }
}

/// One program's counters by name, then `programs` and `bpf_stats`: the
/// shape of `inband shadow status --json`.
pub fn status_json(counters: &[(&'static str, Count)], programs: &[Program], bpf_stats: bool) -> Value {
    let mut obj: serde_json::Map<String, Value> =
        counters.iter().map(|(name, c)| (name.to_string(), json!({"packets": c.packets, "bytes": c.bytes}))).collect();
    obj.insert("programs".into(), serde_json::to_value(programs).unwrap_or_default());
    obj.insert("bpf_stats".into(), bpf_stats.into());
    Value::Object(obj)
}

/// libbpf's messages through tracing. Asking a link without a clsact
/// qdisc which program is in a slot gets the kernel's "Parent Qdisc
/// doesn't exists", which libbpf prints: when every link is asked, that
/// is the expected answer "none", not a warning at each scrape.
pub fn quiet_libbpf() {
    fn log(level: libbpf_rs::PrintLevel, msg: String) {
        let msg = msg.trim_end();
        match level {
            _ if msg.contains("Parent Qdisc doesn't exist") => tracing::debug!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Warn => tracing::warn!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Info => tracing::info!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Debug => tracing::debug!(target: "libbpf", "{msg}"),
        }
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Info, log)));
}

/// Serves `/metrics` and `/status` on `listen` until SIGINT/SIGTERM.
pub fn run(listen: SocketAddr, bpf_stats: bool) -> Result<()> {
    quiet_libbpf();
    let first = Snapshot::read()?;
    if first.servers.is_empty() && first.router.is_none() {
        bail!(
            "no shadow program in this network namespace: nothing to export (on a server, `inband shadow attach` first; on \
             the router, `inband shadow route` with an IPv4 VIP)"
        );
    }
    let _stats = if bpf_stats { Some(inband_core::prog_stats::enable()?) } else { None };
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    let until = async move {
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let handler = move |path: &str| match (path, Snapshot::read()) {
        ("/metrics", Ok(mut s)) => {
            s.bpf_stats |= bpf_stats;
            Reply::metrics(&prometheus(s))
        }
        ("/status", Ok(mut s)) => {
            s.bpf_stats |= bpf_stats;
            Reply::json(s.json().to_string())
        }
        ("/metrics" | "/status", Err(e)) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
        _ => Reply::text(StatusCode::NOT_FOUND, "/metrics or /status\n"),
    };
    let (addr, thread) = inband_http::spawn("shadow-metrics", listen, handler, until).with_context(|| format!("metrics endpoint {listen}"))?;
    info!(%addr, servers = first.servers.len(), router = first.router.is_some(), bpf_stats, "metrics at http://{addr}/metrics, status at http://{addr}/status");
    thread.join().map_err(|_| anyhow::anyhow!("the metrics thread panicked"))
}

pub fn prometheus(s: Snapshot) -> Registry {
    let mut r = Registry::with_prefix("inband_shadow");
    r.register_collector(Box::new(Exposition(s)));
    r
}

#[derive(Debug)]
struct Exposition(Snapshot);

impl Collector for Exposition {
    fn encode(&self, encoder: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let mut f = Families(encoder);
        let server = |pick: fn(&Count) -> u64| {
            s.servers.iter().flat_map(move |sv| sv.counters.iter().map(move |(name, c)| ([("interface", sv.interface.as_str()), ("counter", *name)], pick(c))))
        };
        f.counters("packets", "Packets a server's shadow program counted, by interface and counter (`inband shadow status`)", server(|c| c.packets))?;
        f.counters("bytes", "Bytes of those packets", server(|c| c.bytes))?;
        let router = |pick: fn(&Count) -> u64| s.router.iter().flat_map(move |r| r.counters.iter().map(move |(name, c)| ([("counter", *name)], pick(c))));
        f.counters("dt4_packets", "Packets the router's IPv4 shadow program counted, by counter (`inband shadow status --router`)", router(|c| c.packets))?;
        f.counters("dt4_bytes", "Bytes of those packets", router(|c| c.bytes))?;
        f.gauge("bpf_stats", "1 while the kernel counts the programs' runs (bpf_stats)", i64::from(s.bpf_stats))?;
        // A server's program is one per interface; the router's programs
        // (one per route run still on some link) are summed: the kernel
        // counts a program, not a link, so a per-link series would count
        // a program once per link it is on.
        type Labels<'a> = Vec<(&'static str, &'a str)>;
        let mut programs: Vec<(Labels, u64, u64)> = s
            .servers
            .iter()
            .filter_map(|sv| sv.program.as_ref().map(|p| (vec![("program", "shadow"), ("interface", sv.interface.as_str())], p.stats.runs, p.stats.run_time_ns)))
            .collect();
        if let Some(r) = s.router.as_ref().filter(|r| !r.programs.is_empty()) {
            let sum = |pick: fn(&Program) -> u64| r.programs.iter().map(pick).sum::<u64>();
            programs.push((vec![("program", "shadow_dt4")], sum(|p| p.stats.runs), sum(|p| p.stats.run_time_ns)));
        }
        f.programs_labelled("the shadow", programs.iter().map(|(l, runs, ns)| (l.clone(), *runs, *ns)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inband_core::prog_stats::ProgStats;

    fn count(packets: u64, bytes: u64) -> Count {
        Count { packets, bytes }
    }

    fn program(name: &str, id: u32, runs: u64, ns: u64, on: &[&str]) -> Program {
        Program { stats: ProgStats { program: name.into(), id, runs, run_time_ns: ns }, interfaces: on.iter().map(|s| s.to_string()).collect() }
    }

    /// OpenMetrics with a HELP and TYPE for every family; the router's two
    /// programs summed into one series, a server whose filter is gone
    /// keeping its counters and losing its run series.
    #[test]
    fn the_metrics_parse_and_sum_the_routers_programs() {
        let s = Snapshot {
            servers: vec![
                ServerPrograms { interface: "eth0".into(), counters: vec![("new_flow", count(3, 180)), ("chained", count(1, 1500))], program: Some(program("shadow", 7, 40, 4_000, &["eth0"])) },
                ServerPrograms { interface: "eth1".into(), counters: vec![("local", count(5, 500))], program: None },
            ],
            router: Some(RouterPrograms {
                counters: vec![("unwrapped", count(9, 900))],
                programs: vec![program("shadow_dt4", 11, 100, 1_000, &["s1", "s2"]), program("shadow_dt4", 12, 20, 500, &["s3"])],
            }),
            bpf_stats: true,
        };
        let text = inband_http::encode(&prometheus(s)).unwrap();
        inband_http::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        for line in [
            "inband_shadow_packets_total{interface=\"eth0\",counter=\"new_flow\"} 3",
            "inband_shadow_bytes_total{interface=\"eth0\",counter=\"chained\"} 1500",
            "inband_shadow_packets_total{interface=\"eth1\",counter=\"local\"} 5",
            "inband_shadow_dt4_packets_total{counter=\"unwrapped\"} 9",
            "inband_shadow_bpf_stats 1",
            "inband_shadow_bpf_program_runs_total{program=\"shadow\",interface=\"eth0\"} 40",
            "inband_shadow_bpf_program_run_seconds_total{program=\"shadow\",interface=\"eth0\"} 0.000004",
            "inband_shadow_bpf_program_runs_total{program=\"shadow_dt4\"} 120",
            "inband_shadow_bpf_program_run_seconds_total{program=\"shadow_dt4\"} 0.0000015",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        assert!(!text.contains("interface=\"eth1\"}"), "eth1 has no program: no run series\n{text}");
    }
}

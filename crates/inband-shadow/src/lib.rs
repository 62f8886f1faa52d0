//! `inband shadow`: per-connection consistency for servers behind an ECMP
//! router (seed 002, VRF-shadowing without VRF devices). The router keeps
//! the previous next-hop set of the VIP in a shadow routing table
//! (`route`); each server runs the conditional End.DT6 program, which sends
//! packets of connections it does not have back to that table (`attach`).
//! For an IPv4 VIP, the router's own program unwraps those packets into
//! the shadow tables (`dt4`). See "Scale-out behind ECMP" in docs/architecture.md and the choices in
//! docs/decisions.md.

pub mod attach;
pub mod bpf;
pub mod dt4;
pub mod follow;
pub mod metrics;
pub mod route;

use std::net::Ipv6Addr;
use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;
use inband_core::prog_stats::ProgStats;
use serde::Serialize;

/// A shadow program that runs now, read from its filter slot, and the
/// links it is on.
#[derive(Clone, Debug, Serialize)]
pub struct Program {
    #[serde(flatten)]
    pub stats: ProgStats,
    pub interfaces: Vec<String>,
}

#[derive(Subcommand)]
pub enum ShadowCommand {
    /// On a server: attach the conditional program to the interface
    /// toward the router, whose two SIDs are End.DT6 routes already.
    /// Stays attached after the command exits.
    Attach {
        #[arg(long)]
        interface: String,
        /// The SID the router's current next-hop set sends to: checked.
        #[arg(long)]
        sid: Ipv6Addr,
        /// The SID the router's shadow table sends to: always delivered.
        #[arg(long)]
        direct_sid: Ipv6Addr,
        /// The router's SID for its shadow table: where strays go.
        #[arg(long)]
        shadow_sid: Ipv6Addr,
    },
    /// On a server: remove the program and its pinned maps.
    Detach {
        #[arg(long)]
        interface: String,
    },
    /// On a server: the program's counters (packets and bytes) and its
    /// run count and time. With --router, on the router: those of the
    /// IPv4 shadow program.
    Status {
        #[arg(long, required_unless_present = "router")]
        interface: Option<String>,
        #[arg(long, conflicts_with = "interface")]
        router: bool,
        #[arg(long)]
        json: bool,
    },
    /// Serve the counters, run counts and run times of every shadow
    /// program in this network namespace (each server interface's, the
    /// router's IPv4 one) at /metrics (Prometheus) and /status (JSON).
    /// Runs until SIGINT/SIGTERM.
    Metrics {
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// Turn the kernel's run-time statistics on while this runs (the
        /// run counts and times stay 0 otherwise, unless the sysctl
        /// kernel.bpf_stats_enabled is 1), at the price of two clock
        /// reads per packet for every BPF program on the host.
        #[arg(long)]
        bpf_stats: bool,
    },
    /// On the router: set the VIP's next hops to `--up`, after copying the
    /// current ones into the shadow table.
    Route {
        /// The router's servers and VIP (docs/configuration.md, "inband shadow route").
        #[arg(long)]
        config: PathBuf,
        /// The servers the VIP goes to from now on, by name, comma-separated
        /// (empty: none).
        #[arg(long, value_delimiter = ',', num_args = 0..)]
        up: Vec<String>,
        /// Plain ECMP, the baseline: change the routes without keeping the
        /// previous set (and empty the shadow table).
        #[arg(long)]
        plain: bool,
        /// Servers to treat as dead although their link is up (a host
        /// whose program is gone), for this run: their shadow hops go to
        /// a live server's direct SID. Not in --up.
        #[arg(long, value_delimiter = ',', num_args = 0..)]
        dead: Vec<String>,
    },
    /// On the router: keep the VIP's next hops equal to the ones the
    /// routing daemon (BIRD, FRR) learns by BGP into `--table`, each change
    /// made as `route` makes it. Runs until SIGINT/SIGTERM.
    Follow {
        #[arg(long)]
        config: PathBuf,
        /// The kernel table the routing daemon installs the VIP's learned
        /// routes in (not the main table: there they would replace the
        /// VIP's route without a shadow).
        #[arg(long)]
        table: u32,
        /// How often the learned set is read.
        #[arg(long, default_value_t = 100)]
        interval_ms: u64,
        /// How often the links of the servers outside the learned set are
        /// read: one that died or came back gets its shadow hops rewritten.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
        liveness_interval_ms: u64,
    },
}

pub fn run(cmd: ShadowCommand) -> Result<()> {
    match cmd {
        ShadowCommand::Attach { interface, sid, direct_sid, shadow_sid } => {
            attach::attach(&interface, attach::Sids { cond: sid, direct: direct_sid, shadow: shadow_sid })
        }
        ShadowCommand::Detach { interface } => attach::detach(&interface),
        ShadowCommand::Status { interface, router, json } => {
            metrics::quiet_libbpf();
            let (counts, programs) = match interface {
                Some(interface) if !router => (attach::counters(&interface)?, attach::program(&interface)?.into_iter().collect()),
                _ => (dt4::counters()?, dt4::programs()?),
            };
            let bpf_stats = inband_core::prog_stats::enabled();
            if json {
                println!("{}", metrics::status_json(&counts, &programs, bpf_stats));
                return Ok(());
            }
            println!("{:<14} {:>12} {:>14}", "counter", "packets", "bytes");
            for (name, c) in counts {
                println!("{name:<14} {:>12} {:>14}", c.packets, c.bytes);
            }
            println!();
            if programs.is_empty() {
                println!("no program in its filter slot: its counters are all that is left (attach again)");
            }
            for p in &programs {
                let per_run = p.stats.run_time_ns.checked_div(p.stats.runs).unwrap_or(0);
                println!(
                    "program {} (id {}) on {}: {} runs, {} ns, {per_run} ns per run",
                    p.stats.program,
                    p.stats.id,
                    p.interfaces.join(","),
                    p.stats.runs,
                    p.stats.run_time_ns
                );
            }
            if !bpf_stats {
                println!("(runs are counted only while run-time statistics are on: `inband shadow metrics --bpf-stats`, or sysctl kernel.bpf_stats_enabled=1)");
            }
            Ok(())
        }
        ShadowCommand::Metrics { listen, bpf_stats } => metrics::run(listen, bpf_stats),
        ShadowCommand::Route { config, up, plain, dead } => {
            let cfg = route::RouterConfig::load(&config)?;
            let up: Vec<String> = up.into_iter().filter(|s| !s.is_empty()).collect();
            let dead: Vec<String> = dead.into_iter().filter(|s| !s.is_empty()).collect();
            route::apply(&cfg, &up, !plain, &dead).map(|_| ())
        }
        ShadowCommand::Follow { config, table, interval_ms, liveness_interval_ms } => {
            let cfg = route::RouterConfig::load(&config)?;
            if (0..cfg.generations).any(|k| cfg.generation(k).0 == table) || matches!(table, 0 | 253..=255) {
                anyhow::bail!(
                    "--table {table}: the routing daemon needs a table of its own, not a shadow table ({}–{}) nor 0/253/254/255",
                    cfg.shadow_table,
                    cfg.generation(cfg.generations - 1).0
                );
            }
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            signal_hook::flag::register(signal_hook::consts::SIGINT, std::sync::Arc::clone(&stop))?;
            signal_hook::flag::register(signal_hook::consts::SIGTERM, std::sync::Arc::clone(&stop))?;
            let every = |ms: u64| std::time::Duration::from_millis(ms);
            follow::follow(&cfg, table, every(interval_ms.max(10)), every(liveness_interval_ms), &stop)
        }
    }
}

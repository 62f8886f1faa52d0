//! `inband bench ...`: measurements that print tables with ratios.

pub mod churn;
pub mod dataplane;
pub mod load;
pub mod openloop;

use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Per-packet cost of every balancer path against a bounce-only XDP
    /// program (the floor on this CPU), via BPF_PROG_TEST_RUN.
    Dataplane {
        /// Runs per path; the median is reported.
        #[arg(long, default_value_t = 20_000)]
        samples: u32,
        #[arg(long)]
        json: bool,
        /// Also flood the tables with this many SYNs that never complete
        /// (0 = skip) and report what was kept, taken over and dropped.
        #[arg(long, default_value_t = 0)]
        flood: u32,
        /// Backends in the flood (SNAT ports are 31,744 per backend).
        #[arg(long, default_value_t = 16)]
        flood_backends: u8,
        /// Also open and properly close this many connections from distinct
        /// client tuples (0 = skip) and report refusals.
        #[arg(long, default_value_t = 0)]
        churn: u32,
        /// Backends in the churn run.
        #[arg(long, default_value_t = 2)]
        churn_backends: u8,
        /// Also time one sweep of a table holding this many flows (0 = skip).
        #[arg(long, default_value_t = 0)]
        sweep: u32,
        /// Also time a new connection and an established packet with this
        /// many live flows (comma-separated; none = skip), each in a flow
        /// table sized for it, at each of --scale-backends.
        #[arg(long, value_delimiter = ',')]
        scale_flows: Vec<u32>,
        /// Backends of the VIP in the --scale-flows sweep.
        #[arg(long, value_delimiter = ',', default_value = "8,256,4096")]
        scale_backends: Vec<u32>,
        /// Also time the control plane's apply of the largest
        /// configurations the limits allow.
        #[arg(long)]
        control_plane: bool,
    },
    /// Time an upgrade that carries the flow tables over to a build that
    /// sizes them differently (map_upgrade), with this many live flows.
    Upgrade {
        /// Live flows, comma-separated; each in a table sized for it.
        #[arg(long, value_delimiter = ',', default_value = "10000,1000000,4000000")]
        flows: Vec<u32>,
        #[arg(long)]
        json: bool,
    },
    /// Storage micro-benchmark of the HTTP cache's backends (LMDB, RocksDB,
    /// memory, files): read/update mixes over zipfian keys, 10 KiB values.
    Cache(inband_cache::bench::CacheArgs),
    /// Send a pre-built TCP frame out of an interface as fast as XDP live
    /// frames allow (the forwarding benchmark's generator); prints JSON.
    Blast(load::BlastArgs),
    /// Count (and drop, or pass) TCP packets to a port in XDP until
    /// SIGTERM; prints JSON.
    Sink(load::SinkArgs),
    /// Attach the bounce floor (swap MACs, XDP_TX) until SIGTERM.
    Bounce {
        #[arg(long, default_value = "eth0")]
        interface: String,
        #[arg(long, default_value_t = 600)]
        max_seconds: u64,
    },
    /// Many short HTTP connections from distinct client tuples, each
    /// opened, answered and closed; prints JSON.
    Churn(churn::ChurnArgs),
    /// HTTP requests at a fixed rate on new connections (open loop, latency
    /// from the scheduled send time); prints JSON.
    Openloop(openloop::OpenLoopArgs),
    /// Time the weights controller's integer program on synthetic curves
    /// of 1/2/4/8-core backends at 80% load; prints JSON.
    Ilp {
        /// Backend counts, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
        backends: Vec<usize>,
        /// Candidate weights per backend and step.
        #[arg(long, default_value_t = 10)]
        levels: u32,
    },
    /// TCP connections sending small writes with TCP_NODELAY; prints JSON.
    Stream(load::StreamArgs),
    /// A TCP server that reads and discards whatever it is sent.
    Discard {
        #[arg(long)]
        listen: std::net::SocketAddrV4,
    },
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Dataplane {
            samples,
            json,
            flood,
            flood_backends,
            churn,
            churn_backends,
            sweep,
            scale_flows,
            scale_backends,
            control_plane,
        } => {
            let rows = dataplane::measure(samples)?;
            let scale = if flood > 0 { Some(dataplane::table_scale(flood, flood_backends)?) } else { None };
            let churned = if churn > 0 { Some(dataplane::churn(churn, churn_backends)?) } else { None };
            let swept = if sweep > 0 { Some(dataplane::sweep_cost(sweep)?) } else { None };
            let grown = if scale_flows.is_empty() {
                None
            } else {
                let floor = rows.last().map_or(0.0, |r| r.ns_per_packet);
                Some(dataplane::scale::measure(&scale_flows, &scale_backends, samples, floor)?)
            };
            let control = if control_plane { Some(dataplane::scale::control_plane()?) } else { None };
            if json {
                let all = serde_json::json!({
                    "paths": rows, "flood": scale, "churn": churned, "sweep": swept, "scale": grown, "control_plane": control,
                });
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                print!("{}", dataplane::render(&rows));
                if let Some(s) = scale {
                    print!("\n{}", dataplane::render_scale(&s));
                }
                if let Some(c) = churned {
                    print!("\n{}", dataplane::render_churn(&c));
                }
                if let Some(s) = swept {
                    print!("\n{}", dataplane::render_sweep(&s));
                }
                if let Some(s) = grown {
                    print!("\n{}", dataplane::scale::render(&s));
                }
                if let Some(c) = control {
                    print!("\n{}", dataplane::scale::render_control(&c));
                }
            }
            Ok(())
        }
        BenchCommand::Upgrade { flows, json } => {
            let rows = dataplane::scale::carry(&flows)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "rows": rows }))?);
            } else {
                print!("{}", dataplane::scale::render_carry(&rows));
            }
            Ok(())
        }
        BenchCommand::Cache(a) => inband_cache::bench::main(a, &["bench", "cache"]),
        BenchCommand::Blast(a) => {
            println!("{}", serde_json::to_string(&load::blast(&a)?)?);
            Ok(())
        }
        BenchCommand::Sink(a) => load::sink(&a),
        BenchCommand::Bounce { interface, max_seconds } => load::bounce(&interface, max_seconds),
        BenchCommand::Openloop(a) => {
            println!("{}", serde_json::to_string(&openloop::run(&a)?)?);
            Ok(())
        }
        BenchCommand::Ilp { backends, levels } => {
            let mut rows = Vec::new();
            for n in backends {
                anyhow::ensure!((2..=10_000).contains(&n), "--backends {n}: expected 2-10000");
                let s = inband_weights::solve::solve(
                    &inband_weights::solve::synthetic(n),
                    levels,
                    inband_weights::config::Objective::Mean,
                    None,
                )?;
                rows.push(serde_json::json!({ "backends": n, "solve_ms": s.solve_ms, "steps": s.steps, "objective_ms": s.objective_ms }));
            }
            println!("{}", serde_json::to_string(&rows)?);
            Ok(())
        }
        BenchCommand::Stream(a) => {
            println!("{}", serde_json::to_string(&load::stream(&a)?)?);
            Ok(())
        }
        BenchCommand::Discard { listen } => load::discard(listen),
        BenchCommand::Churn(a) => {
            println!("{}", serde_json::to_string(&churn::run(&a)?)?);
            Ok(())
        }
    }
}

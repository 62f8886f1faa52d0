//! `inband bench ...`: measurements that print tables with ratios.

pub mod dataplane;
pub mod load;

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
        /// Also flood the connection table with this many new connections
        /// (0 = skip) and report evictions and drops.
        #[arg(long, default_value_t = 0)]
        flood: u32,
        /// Backends in the flood (SNAT ports are 31,744 per backend).
        #[arg(long, default_value_t = 16)]
        flood_backends: u8,
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
        BenchCommand::Dataplane { samples, json, flood, flood_backends } => {
            let rows = dataplane::measure(samples)?;
            let scale = if flood > 0 { Some(dataplane::table_scale(flood, flood_backends)?) } else { None };
            if json {
                println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "paths": rows, "flood": scale }))?);
            } else {
                print!("{}", dataplane::render(&rows));
                if let Some(s) = scale {
                    print!("\n{}", dataplane::render_scale(&s));
                }
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
        BenchCommand::Stream(a) => {
            println!("{}", serde_json::to_string(&load::stream(&a)?)?);
            Ok(())
        }
        BenchCommand::Discard { listen } => load::discard(listen),
    }
}

//! `inband`: one binary for the balancer, the real-server agent, status,
//! the workload server, the namespace testbed and the benchmarks.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

use inband::lb;

#[derive(Parser)]
#[command(name = "inband", version, about = "eBPF load balancer with Direct Server Return and in-band load feedback")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the balancer (XDP) with a config file, or manage a running one.
    Lb(LbArgs),
    /// Run the real-server agent (tc) with a config file, or talk to a running one.
    Agent(AgentArgs),
    /// An HTTP server of limited capacity, for tests and benchmarks.
    // A later flag wins, so scripts can append per-server overrides to defaults.
    #[command(args_override_self = true)]
    Serve(inband::workload::ServeArgs),
    /// Benchmarks that print tables with ratios.
    Bench {
        #[command(subcommand)]
        command: inband::bench::BenchCommand,
    },
    /// HTTP/1.1 reverse proxy with a durable cache (see docs/proxy.md).
    Proxy {
        #[arg(long)]
        config: PathBuf,
    },
    /// Network-namespace testbeds.
    Testbed {
        #[command(subcommand)]
        command: inband::testbed::TestbedCommand,
    },
    /// Show VIPs, backends, scores and counters of the balancer(s) on this host.
    Status {
        /// Only this interface (default: every interface with a balancer).
        #[arg(long)]
        interface: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct LbArgs {
    /// Run the balancer with this config (see docs/configuration.md).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<LbCommand>,
}

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct AgentArgs {
    /// Run the agent with this config (same as `inband agent run --config`).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<inband::agent::AgentCommand>,
}

#[derive(Subcommand)]
enum LbCommand {
    /// Remove the XDP program and every pinned map from an interface.
    Detach {
        #[arg(long)]
        interface: String,
        /// Also remove an XDP program inband has no state for.
        #[arg(long)]
        force: bool,
    },
    /// Change a running balancer (backends, mode, probe interval, reload).
    Ctl {
        #[arg(long, default_value_os_t = lb::config::default_control_socket())]
        socket: PathBuf,
        #[command(subcommand)]
        request: lb::control::ControlRequest,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("INBAND_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Lb(args) => match (args.config, args.command) {
            (Some(config), None) => lb::daemon::run(&config),
            (None, Some(LbCommand::Detach { interface, force })) => lb::attach::detach(&interface, force),
            (None, Some(LbCommand::Ctl { socket, request })) => {
                let reply = lb::control::send(&socket, &request)?;
                if !reply.ok {
                    anyhow::bail!("{}", reply.message);
                }
                println!("{}", reply.message);
                Ok(())
            }
            _ => anyhow::bail!("`inband lb` needs --config FILE, or a subcommand (detach, ctl); see --help"),
        },
        Command::Agent(args) => match (args.config, args.command) {
            (Some(config), None) => inband::agent::run(inband::agent::AgentCommand::Run { config }),
            (None, Some(command)) => inband::agent::run(command),
            _ => anyhow::bail!("`inband agent` needs --config FILE, or a subcommand; see --help"),
        },
        Command::Status { interface, json } => status(interface, json),
        Command::Serve(args) => inband::workload::run(args),
        Command::Bench { command } => inband::bench::run(command),
        Command::Testbed { command } => inband::testbed::run(command),
        Command::Proxy { config } => inband_proxy::run(&config),
    }
}

fn status(interface: Option<String>, json: bool) -> Result<()> {
    let root = lb::attach::pin_parent();
    let interfaces: Vec<String> = match interface {
        Some(i) => vec![i],
        None => std::fs::read_dir(&root)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default(),
    };
    if interfaces.is_empty() {
        anyhow::bail!("no balancer on this host ({} is empty): start one with `inband lb --config lb.toml`", root.display());
    }
    let mut snaps = Vec::new();
    for i in interfaces {
        let maps = lb::tables::LbMaps::open(&lb::attach::pin_dir(&i))?;
        snaps.push(lb::snapshot::take(&i, &maps)?);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&snaps)?);
    } else {
        for s in &snaps {
            print!("{}", lb::snapshot::render_table(s));
        }
    }
    Ok(())
}

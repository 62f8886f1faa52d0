//! `inband`: one binary for the balancer, the real-server agent, status,
//! the workload server, the namespace testbed and the benchmarks.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

use inband_core::lb_control;
use inband_lb as lb;

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
    Serve(inband_testkit::workload::ServeArgs),
    /// A QUIC server whose connection IDs name it, and a client that can
    /// move its connection (docs/workload.md, "inband quic").
    Quic {
        #[command(subcommand)]
        command: inband_testkit::workload::quic::QuicCommand,
    },
    /// Daisy chaining behind an ECMP router: the server program and the
    /// router's shadow table (seed 002; docs/architecture.md).
    Shadow {
        #[command(subcommand)]
        command: inband_shadow::ShadowCommand,
    },
    /// Benchmarks that print tables with ratios.
    Bench {
        #[command(subcommand)]
        command: inband_testkit::bench::BenchCommand,
    },
    /// Per-request HTTP/1.1 balancing in the kernel's socket layer for the
    /// applications of a cgroup (see docs/mesh.md).
    Mesh {
        #[command(subcommand)]
        command: inband_mesh::MeshCommand,
    },
    /// TCPE connection handoff (seed 003): a client that follows a moved
    /// connection, and the server that takes one over (docs/architecture.md).
    Tcpe {
        #[command(subcommand)]
        command: inband_tcpe::cli::TcpeCommand,
    },
    /// HTTP/1.1 and HTTP/2 reverse proxy, TLS optional, with a durable cache (see docs/proxy.md).
    Proxy {
        #[arg(long)]
        config: PathBuf,
    },
    /// Learn each backend's capacity and set the balancer's weights
    /// (KnapsackLB, docs/weights.md), or show a running controller.
    Weights(WeightsArgs),
    /// Where a running process spends its time in system calls, by
    /// category, thread and phase (eBPF; see docs/trace.md).
    Trace(inband_trace::TraceArgs),
    /// Network-namespace testbeds.
    Testbed {
        #[command(subcommand)]
        command: inband_testkit::testbed::TestbedCommand,
    },
    /// Show VIPs, backends, flows, scores and counters of the balancer(s)
    /// on this host, and the mesh daemons' services, routes and pools.
    Status {
        /// Only this interface (default: every interface with a balancer).
        #[arg(long)]
        interface: Option<String>,
        /// Only the balancers of this named network namespace (`host` for
        /// the host's own). Default: from the host, every namespace; from
        /// inside a named namespace, that namespace.
        #[arg(long)]
        netns: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Write a new random key for authenticated options (mode 0600) to
    /// give to the balancers and agents (docs/configuration.md).
    Keygen {
        #[arg(long)]
        out: PathBuf,
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
    command: Option<inband_agent::AgentCommand>,
}

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct WeightsArgs {
    /// Run the controller with this config (see docs/weights.md).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<inband_weights::WeightsCommand>,
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
    /// Write a sample of the packets the balancer drops, with the reason
    /// of each, to a pcapng file (tcpdump -r, Wireshark).
    Capture(lb::capture::CaptureArgs),
    /// Change a running balancer (backends, mode, probe interval, reload).
    Ctl {
        #[arg(long, default_value_os_t = lb_control::default_control_socket())]
        socket: PathBuf,
        #[command(subcommand)]
        request: lb_control::ControlRequest,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("INBAND_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal: redirected to a
        // file or a journal they are noise in every line (NO_COLOR honoured).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none())
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
            (None, Some(LbCommand::Capture(args))) => lb::capture::run(&args),
            (None, Some(LbCommand::Ctl { socket, request })) => {
                let reply = lb_control::send(&socket, &request)?;
                if !reply.ok {
                    anyhow::bail!("{}", reply.message);
                }
                match (reply.counts, reply.flow) {
                    (Some(c), _) => println!("{}", serde_json::to_string_pretty(&c)?),
                    (_, Some(f)) => println!("{}", serde_json::to_string_pretty(&f)?),
                    _ => println!("{}", reply.message),
                }
                Ok(())
            }
            _ => anyhow::bail!("`inband lb` needs --config FILE, or a subcommand (detach, capture, ctl); see --help"),
        },
        Command::Agent(args) => match (args.config, args.command) {
            (Some(config), None) => inband_agent::run(inband_agent::AgentCommand::Run { config }),
            (None, Some(command)) => inband_agent::run(command),
            _ => anyhow::bail!("`inband agent` needs --config FILE, or a subcommand; see --help"),
        },
        Command::Weights(args) => match (args.config, args.command) {
            (Some(config), None) => inband_weights::run_controller(&config),
            (None, Some(command)) => inband_weights::run(command),
            _ => anyhow::bail!("`inband weights` needs --config FILE, or a subcommand (status); see --help"),
        },
        Command::Status { interface, netns, json } => status(interface, netns, json),
        Command::Keygen { out } => {
            inband_core::auth::keygen(&out)?;
            println!("wrote a new key to {}: list it under [auth] keys on the balancer and every agent", out.display());
            Ok(())
        }
        Command::Serve(args) => inband_testkit::workload::run(args),
        Command::Quic { command } => inband_testkit::workload::quic::run(command),
        Command::Shadow { command } => inband_shadow::run(command),
        Command::Bench { command } => inband_testkit::bench::run(command),
        Command::Testbed { command } => inband_testkit::testbed::run(command),
        Command::Mesh { command } => inband_mesh::main(command),
        Command::Tcpe { command } => inband_tcpe::cli::run(command),
        Command::Proxy { config } => inband_proxy::run(&config),
        Command::Trace(args) => inband_trace::run(args),
    }
}

fn status(interface: Option<String>, netns: Option<String>, json: bool) -> Result<()> {
    let scope = netns.or_else(inband_core::bpfmap::current_netns_name);
    let found: Vec<_> = lb::attach::discover()
        .into_iter()
        .filter(|b| scope.as_deref().map_or(true, |n| b.netns == n || (n == "host" && b.netns.is_empty())))
        .filter(|b| interface.as_deref().map_or(true, |i| b.interface == i))
        .collect();
    // Mesh daemons (docs/mesh.md) beside the balancers, in the text view;
    // `--json` readers use `inband mesh status --json`.
    let meshes: Vec<_> = if interface.is_none() && !json {
        inband_mesh::status::discover()
            .into_iter()
            .filter(|(title, _)| scope.as_deref().map_or(true, |n| title.ends_with(&format!("(network namespace {n})"))))
            .collect()
    } else {
        Vec::new()
    };
    let show_meshes = || {
        for (title, pins) in &meshes {
            match inband_mesh::status::read(pins) {
                Ok(st) => print!("\n{}", inband_mesh::status::render(title, &st)),
                Err(e) => eprintln!("warning: {e:#}"),
            }
        }
    };
    if found.is_empty() && !meshes.is_empty() {
        show_meshes();
        return Ok(());
    }
    if found.is_empty() {
        anyhow::bail!(
            "no balancer on this host{}{}: start one with `inband lb --config lb.toml`",
            scope.map_or(String::new(), |n| format!(" in network namespace {n}")),
            interface.map_or(String::new(), |i| format!(" on {i}"))
        );
    }
    let mut snaps = Vec::new();
    for b in found {
        let maps = lb::tables::LbMaps::open(&b.pins)?;
        let mut snap = lb::snapshot::take(&b.interface, &maps)?;
        snap.netns = b.netns;
        snaps.push(snap);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&snaps)?);
    } else {
        for s in &snaps {
            print!("{}", lb::snapshot::render_table(s));
        }
        // The weights controllers' view (curves, last solve) beside the
        // balancers' (weights in force); `--json` readers use
        // `inband weights status --json`.
        for path in inband_weights::status_files() {
            match inband_weights::status::read(&path) {
                Ok(w) => print!("\n{}", inband_weights::status::render(&w)),
                Err(e) => eprintln!("warning: {e:#}"),
            }
        }
        show_meshes();
    }
    Ok(())
}

//! The real-server agent's control plane: `inband agent`.

pub mod attach;
pub mod bpf;
pub mod config;
pub mod cpu;
pub mod daemon;
pub mod maps;
pub mod metrics;
pub mod poll_responder;
pub mod proc_tcp;
pub mod score_socket;
pub mod settings;
pub mod tables;

use std::path::PathBuf;

use anyhow::{bail, Result};

#[derive(clap::Subcommand)]
pub enum AgentCommand {
    /// Run the agent with a config file (see docs/configuration.md) until
    /// SIGINT/SIGTERM; it detaches itself when it stops.
    Run {
        #[arg(long)]
        config: PathBuf,
    },
    /// Show services, active connections, scores and counters of the agent
    /// running on an interface.
    Status {
        #[arg(long)]
        interface: String,
        #[arg(long)]
        json: bool,
    },
    /// Set, clear or read the score through a running agent's score socket.
    Score {
        #[command(subcommand)]
        command: ScoreCommand,
    },
    /// Remove what an agent that did not stop cleanly (killed, crashed) left
    /// on an interface: tc filters, clsact qdisc, pinned maps.
    Detach {
        #[arg(long)]
        interface: String,
    },
}

#[derive(clap::Subcommand)]
pub enum ScoreCommand {
    /// Set the score reported for one service port, or for all of them.
    Set {
        /// 0-65535; lower attracts more new connections.
        score: u32,
        /// Only this service port (default: every service port).
        #[arg(long)]
        port: Option<u16>,
        #[arg(long, default_value_os_t = config::default_score_socket())]
        socket: PathBuf,
    },
    /// Remove a score set with `set`: the port reports its connections again.
    Clear {
        #[arg(long)]
        port: Option<u16>,
        #[arg(long, default_value_os_t = config::default_score_socket())]
        socket: PathBuf,
    },
    /// Print ports, scores, active connections and counters as JSON.
    Get {
        #[arg(long, default_value_os_t = config::default_score_socket())]
        socket: PathBuf,
    },
}

pub fn run(cmd: AgentCommand) -> Result<()> {
    match cmd {
        AgentCommand::Run { config } => daemon::run(&config),
        AgentCommand::Status { interface, json } => status(&interface, json),
        AgentCommand::Score { command } => score(command),
        AgentCommand::Detach { interface } => attach::detach(&interface),
    }
}

fn status(interface: &str, json: bool) -> Result<()> {
    let dir = attach::pin_dir(interface);
    if !dir.exists() {
        bail!(
            "no inband agent on {interface} in this network namespace ({} is missing): start one with \
             `inband agent run --config agent.toml`",
            dir.0.display()
        );
    }
    let snap = tables::AgentMaps::open(&dir)?.snapshot(interface, None)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&snap)?);
    } else {
        print!("{}", snap.render_table());
    }
    Ok(())
}

fn score(cmd: ScoreCommand) -> Result<()> {
    let target = |port: Option<u16>| port.map(|p| p.to_string()).unwrap_or_else(|| "*".into());
    let (socket, line) = match cmd {
        ScoreCommand::Set { score, port, socket } => (socket, format!("set {} {score}", target(port))),
        ScoreCommand::Clear { port, socket } => (socket, format!("clear {}", target(port))),
        ScoreCommand::Get { socket } => (socket, "get".to_string()),
    };
    let reply = score_socket::request(&socket, &line)?;
    if let Some(msg) = reply.strip_prefix("error: ") {
        bail!("{msg}");
    }
    if line == "get" {
        let v: serde_json::Value = serde_json::from_str(&reply)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(())
}

//! `inband mesh`: HTTP/1.1 balancing per request at the socket layer for
//! the applications of one cgroup, with no proxy in the data path (seed
//! 001, XLB, on a stock kernel). How a request flows: docs/mesh.md.

pub mod anchor;
pub mod bpf;
pub mod config;
pub mod daemon;
pub mod health;
pub mod pool;
pub mod programs;
pub mod relay;
pub mod state;
pub mod status;

use std::path::PathBuf;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum MeshCommand {
    /// Balance the services of a config for its cgroup (runs until SIGTERM;
    /// SIGHUP reloads routes).
    Run {
        #[arg(long)]
        config: PathBuf,
    },
    /// Services, backends, pools and counters of a running daemon.
    Status {
        /// The `name` of its config.
        #[arg(long, default_value = "default")]
        name: String,
        #[arg(long)]
        json: bool,
    },
}

pub fn main(cmd: MeshCommand) -> anyhow::Result<()> {
    match cmd {
        MeshCommand::Run { config } => daemon::run(config),
        MeshCommand::Status { name, json } => status::print(&name, json),
    }
}

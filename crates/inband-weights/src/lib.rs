//! `inband weights`: a KnapsackLB controller (seed 004). It learns how each
//! backend's latency grows with its weight, solves an integer program for
//! the weights that minimise latency, writes them to inband's balancer or
//! to HAProxy, and re-solves when traffic, capacity or health changes
//! (docs/weights.md).

mod apply;
pub mod config;
mod controller;
pub mod learn;
mod observe;
mod shares;
pub mod solve;
pub mod status;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{Context, Result};

pub use apply::haproxy_weights;

#[derive(clap::Subcommand, Debug)]
pub enum WeightsCommand {
    /// Show a running controller's weights, curves and last solve.
    Status {
        #[arg(long, default_value = "/run/inband/weights.json")]
        status_file: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

pub fn run_controller(config: &std::path::Path) -> Result<()> {
    let cfg = config::WeightsConfig::load(config)?;
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the runtime")?;
    rt.block_on(controller::Controller::new(cfg, stop).run())
}

pub fn run(cmd: WeightsCommand) -> Result<()> {
    match cmd {
        WeightsCommand::Status { status_file, json } => {
            let s = status::read(&status_file)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", status::render(&s));
            }
            Ok(())
        }
    }
}

/// The status files of the controllers on this host (`inband status`
/// shows them beside the balancers): `/run/inband/weights*.json`.
pub fn status_files() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/run/inband")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("weights") && n.ends_with(".json"))
        })
        .collect();
    found.sort();
    found
}

//! `inband bench ...`: measurements that print tables with ratios.

pub mod dataplane;

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
    },
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Dataplane { samples, json } => {
            let rows = dataplane::measure(samples)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", dataplane::render(&rows));
            }
            Ok(())
        }
    }
}

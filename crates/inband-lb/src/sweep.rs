//! Running the balancer's `sweep` program (bpf/include/inband/lb/sweep.h): one pass
//! over the flow tables that deletes dead flows with their SNAT
//! reservations, orphaned reservations and flows past a drain deadline, and
//! refreshes the gauges `status` and the metrics read. The daemon runs it
//! every second; correctness never waits for it (every packet path checks
//! timeouts itself).

use anyhow::{bail, Context, Result};
use libbpf_rs::ProgramInput;

/// One pass. `now` (CLOCK_MONOTONIC ns) lets tests sweep as if later; 0 =
/// the current time.
pub fn run(prog: &libbpf_rs::ProgramMut, now: u64) -> Result<()> {
    let mut args = now.to_ne_bytes();
    let input = ProgramInput { context_in: Some(&mut args), ..Default::default() };
    let out = prog.test_run(input).context("running the flow sweeper (BPF_PROG_RUN)")?;
    if out.return_value != 0 {
        bail!("the flow sweeper found no sweep_stats entry");
    }
    Ok(())
}

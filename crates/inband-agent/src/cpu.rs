//! `score = "cpu"`: the host's run-queue load as the score.
//!
//! Source: `procs_running` of /proc/stat (tasks runnable right now), not the
//! 1-minute load average. The load average is an exponential average updated
//! every 5 seconds with a one-minute time constant: after a burst starts it
//! takes tens of seconds to show, and the balancer, acting on it every 100 ms,
//! would keep piling connections onto a server that is already saturated
//! (and keep avoiding it long after it recovered). `procs_running` reacts
//! within one sample; its noise is smoothed by averaging the last
//! `WINDOW` samples (half a second).
//!
//! Scale: runnable tasks per CPU ×100, so 100 means "every CPU has one
//! runnable task" on any machine size and servers with different core counts
//! compare fairly; above 100 tasks are queueing.

use std::collections::VecDeque;

use anyhow::{Context, Result};

/// How often the agent samples and writes the score.
pub const INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);
/// Samples averaged: 5 × 100 ms.
pub const WINDOW: usize = 5;

/// (procs_running, number of CPUs) from the text of /proc/stat.
pub fn parse_proc_stat(text: &str) -> Result<(u64, u32)> {
    let mut running = None;
    let mut cpus = 0u32;
    for line in text.lines() {
        let mut f = line.split_whitespace();
        match f.next() {
            Some("procs_running") => {
                running = Some(f.next().context("procs_running without a value")?.parse::<u64>()?);
            }
            // "cpu" is the total; "cpu0", "cpu1", ... one per online CPU.
            Some(name) if name.len() > 3 && name.starts_with("cpu") => cpus += 1,
            _ => {}
        }
    }
    let running = running.context("/proc/stat has no procs_running line")?;
    Ok((running, cpus.max(1)))
}

/// The sliding average of the run queue.
#[derive(Default)]
pub struct RunQueue {
    samples: VecDeque<u64>,
}

impl RunQueue {
    /// Adds one /proc/stat sample and returns the score. The sampler itself
    /// is running while it reads /proc/stat, and is not load.
    pub fn push(&mut self, procs_running: u64, cpus: u32) -> u32 {
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(procs_running.saturating_sub(1));
        let sum: u64 = self.samples.iter().sum();
        let denom = self.samples.len() as u64 * u64::from(cpus.max(1));
        // Rounded to nearest.
        ((sum * 100 + denom / 2) / denom).min(u64::from(u32::MAX)) as u32
    }

    pub fn sample(&mut self) -> Result<u32> {
        let text = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        let (running, cpus) = parse_proc_stat(&text)?;
        Ok(self.push(running, cpus))
    }
}

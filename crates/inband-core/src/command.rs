//! Runs the host's tools (`ip`, `nsenter`, `ethtool`, `sysctl`) for the
//! daemons and the testbeds alike: a failure names the command line and
//! its stderr.

use std::process::{Command, Output};

use anyhow::{bail, Context, Result};

/// Runs a command and fails with its command line and stderr.
pub fn run(cmd: &mut Command) -> Result<Output> {
    let line = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("running {line}"))?;
    if !out.status.success() {
        bail!("{line} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(out)
}

/// iproute2's `ip` with `args`.
pub fn ip(args: &[&str]) -> Result<Output> {
    run(Command::new("ip").args(args))
}

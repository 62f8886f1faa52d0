//! Thin wrappers over iproute2 and nsenter for building testbeds.

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

pub fn ip(args: &[&str]) -> Result<Output> {
    run(Command::new("ip").args(args))
}

/// A command in `netns`'s network namespace only. Not `ip netns exec`: that
/// also mounts a private /sys, which hides bpffs and so every pinned map.
pub fn in_netns(netns: &str, argv: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{netns}")).arg("--").args(argv);
    c
}

pub fn exists(netns: &str) -> bool {
    std::path::Path::new("/run/netns").join(netns).exists()
}

/// Kills every process in the namespace, then deletes it.
pub fn delete(netns: &str) -> Result<()> {
    if !exists(netns) {
        return Ok(());
    }
    if let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: plain kill(2) on a pid the kernel listed for this namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    ip(&["netns", "del", netns]).map(|_| ())
}

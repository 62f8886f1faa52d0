//! Network namespaces for building testbeds: commands inside one, and
//! its removal.

use std::process::Command;

use anyhow::Result;

use inband_core::command::ip;

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

//! Finding the target under /proc and noticing when it is gone.

use anyhow::{bail, Result};

/// `pid` if it is a running process (not a thread of one: the programs
/// filter on the process id, which a thread id would never match).
pub fn check(pid: u32) -> Result<u32> {
    let status = match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(s) => s,
        Err(_) => bail!("no process with pid {pid}"),
    };
    let tgid = status.lines().find_map(|l| l.strip_prefix("Tgid:")).map(str::trim);
    if tgid != Some(pid.to_string().as_str()) {
        bail!("pid {pid} is a thread of process {}; trace the process", tgid.unwrap_or("?"));
    }
    if !alive(pid) {
        bail!("process {pid} has exited");
    }
    Ok(pid)
}

/// The one process whose command name is `name` or whose command line
/// starts with it, this one left out.
pub fn by_name(name: &str) -> Result<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let argv = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let argv0_base = argv.split(' ').next().and_then(|a| a.rsplit('/').next()).unwrap_or("");
        let line = argv.replacen(argv.split(' ').next().unwrap_or(""), argv0_base, 1);
        if comm.trim_end() == name || (!line.is_empty() && line.starts_with(name)) {
            found.push(pid);
        }
    }
    match found[..] {
        [pid] => check(pid),
        [] => bail!("no process named {name:?}"),
        _ => bail!("{} processes match {name:?} (pids {found:?}); pick one with --pid", found.len()),
    }
}

/// False once the process has exited, zombie included.
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state follows the command name, which may itself hold ") ".
    !matches!(stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()), Some('Z' | 'X') | None)
}

/// The processes `pid` started, and theirs, running now (from
/// `/proc/PID/task/TID/children`, which lists each thread's).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else { continue };
        for task in tasks.flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()) {
                if !found.contains(&child) {
                    found.push(child);
                    next.push(child);
                }
            }
        }
    }
    found
}

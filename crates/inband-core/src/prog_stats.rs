//! What each BPF program costs: the kernel's run count and run time of a
//! program (`bpf_prog_info.run_cnt`, `run_time_ns`), for status and
//! metrics. The kernel counts only while run-time statistics are enabled,
//! at the price of two clock reads per run (tens of nanoseconds on a
//! packet path of about a hundred), so a daemon turns them on only when
//! its configuration asks, and only for as long as it runs
//! (`BPF_ENABLE_STATS`: on while the returned descriptor is open; the
//! sysctl `kernel.bpf_stats_enabled` does the same host-wide).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use anyhow::{bail, Result};
use libbpf_rs::libbpf_sys;
use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProgStats {
    /// Our name for it ("balancer", "sweep", ...).
    pub program: String,
    pub id: u32,
    pub runs: u64,
    pub run_time_ns: u64,
}

/// Turns run-time statistics on until the descriptor is closed.
pub fn enable() -> Result<OwnedFd> {
    // SAFETY: a plain syscall wrapper; a non-negative return is a new fd we own.
    let fd = unsafe { libbpf_sys::bpf_enable_stats(libbpf_sys::BPF_STATS_RUN_TIME) };
    if fd < 0 {
        bail!("enabling BPF run-time statistics: {}", std::io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: see above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether run-time statistics are on host-wide (the sysctl), whoever
/// turned them on.
pub fn enabled() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").is_ok_and(|s| s.trim() == "1")
}

/// The counts of the program behind `fd`.
pub fn of_fd(program: &str, fd: BorrowedFd<'_>) -> Result<ProgStats> {
    let mut info = libbpf_sys::bpf_prog_info::default();
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info is a bpf_prog_info of len bytes with every pointer field
    // null, so the kernel writes only the fixed part.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        bail!("reading the {program} program's info: {}", std::io::Error::from_raw_os_error(-rc));
    }
    Ok(ProgStats { program: program.to_string(), id: info.id, runs: info.run_cnt, run_time_ns: info.run_time_ns })
}

/// The counts of the program with kernel id `id`.
pub fn of_id(program: &str, id: u32) -> Result<ProgStats> {
    // SAFETY: a plain syscall wrapper; a non-negative return is a new fd we own.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
    if fd < 0 {
        bail!("opening the {program} program (id {id}): {}", std::io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: see above.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    of_fd(program, std::os::fd::AsFd::as_fd(&fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_that_is_not_there_is_an_error_not_a_crash() {
        let e = format!("{:#}", of_id("balancer", u32::MAX).unwrap_err());
        assert!(e.contains("opening the balancer program (id 4294967295)"), "{e}");
    }
}

//! One daemon per interface: a lock file under /run that a running `inband
//! lb` or `inband agent` holds (flock) for as long as it runs, so a second
//! one is refused with the first one's pid, and `detach` can tell whether a
//! daemon still owns the data path. /run holds run-time state only and is
//! emptied on reboot; bpffs holds only BPF objects.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// /run/inband[/netns/NAME]/<component>/<interface>: per network namespace
/// like the pins, since a testbed runs one daemon per namespace.
pub fn state_dir(component: &str, interface: &str) -> PathBuf {
    let root = crate::bpfmap::pin_root();
    let rel = root.strip_prefix("/sys/fs/bpf").unwrap_or(&root);
    Path::new("/run").join(rel).join(component).join(interface)
}

/// Held while a daemon runs on the interface; released when dropped (the
/// kernel drops the flock with the fd).
pub struct RunLock {
    _file: File,
    dir: PathBuf,
}

impl RunLock {
    /// Takes the lock in `dir`, or fails with `taken` and the pid of the
    /// process that has it.
    pub fn take(dir: &Path, taken: &str) -> Result<RunLock> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            anyhow::bail!("{taken} (pid {}): stop it first", holder(dir).unwrap_or_else(|| "unknown".into()));
        }
        file.set_len(0)?;
        std::io::Write::write_all(&mut &file, format!("{}\n", std::process::id()).as_bytes())?;
        Ok(RunLock { _file: file, dir: dir.to_path_buf() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Gives the lock up and removes the state directory if nothing else
    /// is in it.
    pub fn release(self) {
        let _ = std::fs::remove_file(self.dir.join("lock"));
        remove_run_dirs(&self.dir);
    }
}

/// The pid of the process holding the lock in `dir`, if one does.
pub fn holder(dir: &Path) -> Option<String> {
    let file = File::open(dir.join("lock")).ok()?;
    // SAFETY: flock on an fd we own; a lock we get is released when `file` closes.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        return None;
    }
    let pid = std::fs::read_to_string(dir.join("lock")).unwrap_or_default();
    Some(pid.split_whitespace().next().unwrap_or("unknown").to_string())
}

/// Removes `dir` and its empty parents up to /run.
pub fn remove_run_dirs(dir: &Path) {
    let mut cur = Some(dir);
    while let Some(p) = cur {
        if p == Path::new("/run") || std::fs::remove_dir(p).is_err() {
            break;
        }
        cur = p.parent();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("lb").join("eth9");
        let first = RunLock::take(&d, "inband lb is already running").unwrap();
        assert_eq!(holder(&d), Some(std::process::id().to_string()));
        let e = RunLock::take(&d, "inband lb is already running").err().unwrap().to_string();
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        first.release();
        assert_eq!(holder(&d), None);
        assert!(!d.exists());
    }
}

//! Run-time changes to a running balancer over a unix socket, in the
//! protocol of `inband_core::lb_control` (`inband lb ctl ...` and
//! `inband weights` are its clients). Every change is validated like the config file and applied to the
//! maps without touching flows: a removed VIP or backend drains (new
//! connections refused or sent elsewhere, established ones kept until they
//! end or `drain_timeout_ms`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tracing::warn;

use super::balancer::Balancer;
use inband_core::lb_control::{ControlReply, ControlRequest};

/// Serves the control socket until `stop` is set.
pub fn serve(path: &Path, balancer: &Balancer, stop: &AtomicBool) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("{} is in use: another `inband lb` is running", path.display());
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    listener.set_nonblocking(true)?;
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = handle(stream, balancer) {
                    warn!(error = %format!("{e:#}"), "control connection failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.into()),
        }
    }
    let _ = std::fs::remove_file(path);
    Ok(())
}

fn handle(stream: UnixStream, balancer: &Balancer) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut writer = stream.try_clone()?;
    let mut line = String::new();
    // A request is one short line; a peer sending more is cut off.
    BufReader::new(std::io::Read::take(stream, 64 * 1024)).read_line(&mut line)?;
    let reply = match serde_json::from_str::<ControlRequest>(line.trim()) {
        Err(e) => ControlReply::refused(format!("bad request: {e}")),
        Ok(req) => balancer.change(&req),
    };
    writeln!(writer, "{}", serde_json::to_string(&reply)?)?;
    Ok(())
}

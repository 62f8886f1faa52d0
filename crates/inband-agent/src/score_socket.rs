//! The local score API: a unix socket taking one command per line and
//! answering each with one line (protocol in docs/agent.md). The application
//! uses it to set its score (`score = "app"`); `inband agent score ...` is a
//! client of it.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tracing::{debug, warn};

use super::config::ScoreSource;
use super::tables::{AgentMaps, SCORE_MAX};

/// A line longer than this is not a command of this protocol.
const MAX_LINE: usize = 4096;
/// Applications may keep a connection open and send `set` periodically; this
/// bounds the threads a misbehaving client can make the agent hold.
const MAX_CONNECTIONS: usize = 64;

/// What a command acts on: the agent's maps and which ports it serves.
pub struct ScoreApi {
    pub maps: AgentMaps,
    pub interface: String,
    pub ports: Vec<u16>,
    pub source: ScoreSource,
}

enum Target {
    All,
    Port(u16),
}

impl ScoreApi {
    /// Executes one command line and returns the reply line (no newline):
    /// `ok`, a JSON object for `get`, or `error: ...`.
    pub fn handle(&self, line: &str) -> String {
        match self.execute(line) {
            Ok(reply) => reply,
            Err(e) => format!("error: {e:#}"),
        }
    }

    fn execute(&self, line: &str) -> Result<String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["get"] => Ok(serde_json::to_string(&self.maps.snapshot(&self.interface, Some(self.source))?)?),
            ["set", target, n] => {
                self.writable("set")?;
                let score: u32 = n
                    .parse()
                    .ok()
                    .filter(|s| *s <= SCORE_MAX)
                    .with_context(|| format!("score {n:?} is not a number from 0 to {SCORE_MAX}"))?;
                for port in self.ports_of(self.target(target)?) {
                    self.maps.set_override(port, score)?;
                }
                debug!(target = *target, score, "score set");
                Ok("ok".into())
            }
            ["clear", target] => {
                self.writable("clear")?;
                for port in self.ports_of(self.target(target)?) {
                    self.maps.clear_override(port)?;
                }
                debug!(target = *target, "score override cleared");
                Ok("ok".into())
            }
            [] => bail!("empty command: expected `set <port|*> <N>`, `clear <port|*>` or `get`"),
            _ => bail!("unknown command {:?}: expected `set <port|*> <N>`, `clear <port|*>` or `get`", line.trim()),
        }
    }

    /// With `score = "cpu"` the agent rewrites every override each 100 ms, so
    /// a value set here would be gone at once: refuse rather than pretend.
    fn writable(&self, verb: &str) -> Result<()> {
        if self.source == ScoreSource::Cpu {
            bail!("`{verb}` is not available with score = \"cpu\" (the agent writes the score itself); use score = \"app\"");
        }
        Ok(())
    }

    fn target(&self, word: &str) -> Result<Target> {
        if word == "*" {
            return Ok(Target::All);
        }
        let port: u16 = word.parse().ok().with_context(|| format!("{word:?} is not a port number or `*`"))?;
        if !self.ports.contains(&port) {
            let list: Vec<String> = self.ports.iter().map(|p| p.to_string()).collect();
            bail!("port {port} is not a service of this agent (services: {})", list.join(", "));
        }
        Ok(Target::Port(port))
    }

    fn ports_of(&self, t: Target) -> Vec<u16> {
        match t {
            Target::All => self.ports.clone(),
            Target::Port(p) => vec![p],
        }
    }
}

/// Binds the socket, refusing to take it from a running agent and removing
/// a stale one. Without a group only root may connect (0600); with one, its
/// members too (0660).
pub fn bind(path: &Path, group: Option<libc::gid_t>) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("{} is in use by another inband agent: give this one its own `score_socket`", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    let mode = match group {
        Some(gid) => {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
            // SAFETY: c is a NUL-terminated path; uid -1 leaves the owner as is.
            if unsafe { libc::chown(c.as_ptr(), u32::MAX, gid) } != 0 {
                bail!("chown {} to group {gid}: {}", path.display(), std::io::Error::last_os_error());
            }
            0o660
        }
        None => 0o600,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(listener)
}

/// Serves connections until `stop` is set, each on its own thread so that
/// a client holding its connection open does not block the others.
pub fn serve(listener: UnixListener, api: Arc<ScoreApi>, stop: Arc<AtomicBool>) -> Result<()> {
    listener.set_nonblocking(true)?;
    let open = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                if open.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                    let _ = writeln!(stream, "error: too many connections ({MAX_CONNECTIONS}); retry later");
                    continue;
                }
                open.fetch_add(1, Ordering::Relaxed);
                let (api, stop, open) = (Arc::clone(&api), Arc::clone(&stop), Arc::clone(&open));
                threads.push(std::thread::spawn(move || {
                    if let Err(e) = connection(stream, &api, &stop) {
                        warn!(error = %format!("{e:#}"), "score socket connection failed");
                    }
                    open.fetch_sub(1, Ordering::Relaxed);
                }));
                threads.retain(|t| !t.is_finished());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_for_client(&listener, Duration::from_millis(200)).context("waiting on the score socket")?
            }
            Err(e) => return Err(e).context("accepting on the score socket"),
        }
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// Returns as soon as a client is waiting, or after `timeout` so that
/// `stop` is still noticed. A sleep between non-blocking accepts instead
/// delayed every one-shot `inband agent score set` by up to the sleep.
fn wait_for_client(listener: &UnixListener, timeout: Duration) -> std::io::Result<()> {
    let mut fd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut fd, 1, timeout.as_millis() as libc::c_int) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

fn connection(mut stream: UnixStream, api: &ScoreApi, stop: &AtomicBool) -> Result<()> {
    stream.set_nonblocking(false)?;
    // Short timeouts only to notice `stop`; an idle client may stay.
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 1024];
    while !stop.load(Ordering::Relaxed) {
        let n = match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e.into()),
        };
        pending.extend_from_slice(&buf[..n]);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let reply = match std::str::from_utf8(&line[..end]) {
                Ok(text) => api.handle(text),
                Err(_) => "error: the command is not UTF-8 text".to_string(),
            };
            stream.write_all(reply.as_bytes())?;
            stream.write_all(b"\n")?;
        }
        if pending.len() > MAX_LINE {
            stream.write_all(format!("error: line longer than {MAX_LINE} bytes; closing\n").as_bytes())?;
            return Ok(());
        }
    }
    Ok(())
}

/// Client side: sends one command and returns the reply line.
pub fn request(socket: &Path, line: &str) -> Result<String> {
    let mut s = UnixStream::connect(socket).with_context(|| {
        format!("connecting to {} (is `inband agent` running? pass --socket if it uses another path)", socket.display())
    })?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(line.as_bytes())?;
    s.write_all(b"\n")?;
    s.shutdown(std::net::Shutdown::Write)?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).context("reading the agent's reply")?;
    let reply = reply.trim_end_matches('\n');
    if reply.is_empty() {
        bail!("the agent closed the connection without a reply");
    }
    Ok(reply.to_string())
}

//! `inband tcpe`: the client command and the takeover server.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::client::{self, Client};
use crate::sockops::Tcpe;
use crate::takeover::{self, Takeover};

#[derive(clap::Subcommand)]
pub enum TcpeCommand {
    /// Fetch http:// URLs over TCPE (a balancer may move each connection
    /// to the server it chose) and write the bodies to stdout, in order.
    Get {
        /// Fetched one after another, each on a connection of its own: only
        /// a connection's first request can move.
        #[arg(required = true)]
        url: Vec<String>,
        /// The cgroup v2 directory to attach the TCPE program to (default:
        /// this process's own cgroup).
        #[arg(long)]
        cgroup: Option<PathBuf>,
        /// Bound on the connect, the join and each wait for a byte.
        #[arg(long, default_value_t = 5000)]
        timeout_ms: u64,
        /// One line per URL on stderr: the CLOCK_MONOTONIC ns of the
        /// connect, the request written, the response's first byte and its
        /// end, the body's bytes, whether the connection moved.
        #[arg(long)]
        timing: bool,
    },
    /// Take over connections a balancer hands off and relay them to a local
    /// HTTP origin (docs/configuration.md, "inband tcpe serve").
    Serve {
        /// The takeover channel's listening address (balancers connect here).
        #[arg(long)]
        control: SocketAddr,
        /// Where clients join: the address balancers announce.
        #[arg(long)]
        join: SocketAddr,
        /// The HTTP origin sessions are relayed to.
        #[arg(long)]
        origin: SocketAddr,
        /// The key file shared with the balancers (`inband keygen`).
        #[arg(long)]
        key: PathBuf,
        #[arg(long, default_value_t = 1024)]
        max_pending: usize,
        #[arg(long, default_value_t = 4096)]
        max_sessions: usize,
        /// The longest join deadline a balancer may ask for.
        #[arg(long, default_value_t = 2000)]
        max_deadline_ms: u64,
        #[arg(long, default_value_t = 1000)]
        io_timeout_ms: u64,
        /// A session without a byte either way for this long is closed.
        #[arg(long, default_value_t = 60_000)]
        idle_ms: u64,
    },
}

/// The cgroup v2 directory this process is in, under the cgroup2 mount
/// (/proc/self/mountinfo), as /proc/self/cgroup's "0::" line names it.
pub fn own_cgroup() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mount = mounts
        .lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split_whitespace().next() == Some("cgroup2")).then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .context("no cgroup2 mount: pass --cgroup")?;
    let cg = std::fs::read_to_string("/proc/self/cgroup")?;
    let rel = cg.lines().find_map(|l| l.strip_prefix("0::")).context("this process has no cgroup v2: pass --cgroup")?;
    Ok(mount.join(rel.trim_start_matches('/')))
}

/// CLOCK_MONOTONIC in ns: the clock every process of the host shares, so
/// that a benchmark can set a client's times against its own.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A stream that notes when its first byte arrived (`--timing`).
struct FirstByte<'a, S> {
    s: &'a mut S,
    at: Option<u64>,
}

impl<S: std::io::Read> std::io::Read for FirstByte<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.s.read(buf)?;
        if n > 0 && self.at.is_none() {
            self.at = Some(monotonic_ns());
        }
        Ok(n)
    }
}

/// A writer that counts what passes (the body's bytes, for `--timing`).
struct Counted<'a, W> {
    w: &'a mut W,
    n: u64,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.w.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

/// One fetch's `--timing` line (bench.handoff parses it).
struct Timing {
    status: u16,
    bytes: u64,
    moved: u64,
    connect: u64,
    sent: u64,
    first: u64,
    done: u64,
}

impl Timing {
    fn line(&self, url: &str) -> String {
        let Timing { status, bytes, moved, connect, sent, first, done } = self;
        format!("timing status={status} bytes={bytes} moved={moved} connect_ns={connect} sent_ns={sent} first_byte_ns={first} done_ns={done} url={url}")
    }
}

pub fn run(cmd: TcpeCommand) -> Result<()> {
    match cmd {
        TcpeCommand::Get { url, cgroup, timeout_ms, timing } => {
            let targets = url.iter().map(|u| client::parse_url(u)).collect::<Result<Vec<_>>>()?;
            let cgroup = match cgroup {
                Some(c) => c,
                None => own_cgroup()?,
            };
            let tcpe = Arc::new(Tcpe::attach(&cgroup)?);
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            for (url, (addr, authority, path)) in url.iter().zip(targets) {
                let connect = monotonic_ns();
                let mut c = Client::connect(tcpe.clone(), addr, Duration::from_millis(timeout_ms))?;
                client::request(&mut c, &authority, &path)?;
                let sent = monotonic_ns();
                let mut first = FirstByte { s: &mut c, at: None };
                let mut body = Counted { w: &mut out, n: 0 };
                let status = client::response(&mut first, &mut body)?;
                let done = monotonic_ns();
                let (first, bytes) = (first.at.unwrap_or(done), body.n);
                out.flush()?;
                let moved = c.counters().get("moved");
                if timing {
                    eprintln!("{}", Timing { status, bytes, moved, connect, sent, first, done }.line(url));
                }
                tracing::debug!("tcpe get {url}: status {status}, {:?}", c.counters().all());
                if status >= 400 {
                    bail!("{url}: HTTP status {status}");
                }
            }
            Ok(())
        }
        TcpeCommand::Serve { control, join, origin, key, max_pending, max_sessions, max_deadline_ms, io_timeout_ms, idle_ms } => {
            let cfg = takeover::Config {
                control,
                join,
                origin,
                key: inband_core::auth::read_key(Path::new(&key))?,
                max_pending,
                max_sessions,
                max_deadline: Duration::from_millis(max_deadline_ms),
                io_timeout: Duration::from_millis(io_timeout_ms),
                idle: Duration::from_millis(idle_ms),
            };
            let t = Takeover::start(cfg)?;
            tracing::info!("tcpe takeover: channel on {control}, joins on {join}, origin {origin}");
            loop {
                std::thread::sleep(Duration::from_secs(60));
                let nonzero: Vec<_> = t.counters().all().into_iter().filter(|(_, v)| *v > 0).collect();
                tracing::info!("tcpe takeover: {} pending, {} sessions, {nonzero:?}", t.pending(), t.sessions());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timing_line_names_every_field() {
        let t = Timing { status: 200, bytes: 1 << 20, moved: 1, connect: 10, sent: 20, first: 30, done: 40 };
        assert_eq!(
            t.line("http://10.1.0.100/f"),
            "timing status=200 bytes=1048576 moved=1 connect_ns=10 sent_ns=20 first_byte_ns=30 done_ns=40 url=http://10.1.0.100/f"
        );
    }

    #[test]
    fn the_first_byte_and_the_body_are_counted() {
        let mut src: &[u8] = b"";
        let mut f = FirstByte { s: &mut src, at: None };
        assert_eq!(std::io::Read::read(&mut f, &mut [0u8; 4]).unwrap(), 0);
        assert!(f.at.is_none(), "no byte, no time");
        let mut src: &[u8] = b"abc";
        let mut f = FirstByte { s: &mut src, at: None };
        let before = monotonic_ns();
        assert_eq!(std::io::Read::read(&mut f, &mut [0u8; 2]).unwrap(), 2);
        let at = f.at.unwrap();
        assert!(at >= before);
        std::io::Read::read(&mut f, &mut [0u8; 2]).unwrap();
        assert_eq!(f.at, Some(at), "the first byte's time stays");
        let mut sink = Vec::new();
        let mut c = Counted { w: &mut sink, n: 0 };
        c.write_all(b"12345").unwrap();
        c.write_all(b"67").unwrap();
        assert_eq!((c.n, sink.len()), (7, 7));
    }
}

//! `inband tcpe`: the client command and the takeover server.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::client;
use crate::sockops::Tcpe;
use crate::takeover::{self, Takeover};

#[derive(clap::Subcommand)]
pub enum TcpeCommand {
    /// Fetch http:// URLs over TCPE (a balancer may move each connection
    /// to the server it chose) and write the bodies to stdout, in order. A
    /// body cut short after a move (the server died) is continued through
    /// the balancer by a range request, when the response allows it.
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
        /// How long a client's join that arrives before its HANDOFF has
        /// been taken waits for it (the balancer tells the client to join
        /// as it sends the HANDOFF; the server dials its origin first).
        #[arg(long, default_value_t = 250)]
        early_join_hold_ms: u64,
        /// A session without a byte either way for this long is closed.
        #[arg(long, default_value_t = 60_000)]
        idle_ms: u64,
        /// The pin directory of this host's `inband agent` (e.g.
        /// /sys/fs/bpf/inband/agent/eth0): connections moved here by a
        /// transparent handoff answer their clients directly through it.
        /// Without it their responses go back through the balancer.
        #[arg(long)]
        agent_pins: Option<PathBuf>,
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

/// One fetch's `--timing` line (bench.handoff parses it): the
/// CLOCK_MONOTONIC times `client::fetch` took.
fn timing_line(url: &str, f: &client::FetchOutcome) -> String {
    let client::FetchOutcome { status, bytes, moved, resumed, connect_ns, sent_ns, first_byte_ns, done_ns, .. } = f;
    format!(
        "timing status={status} bytes={bytes} moved={moved} connect_ns={connect_ns} sent_ns={sent_ns} first_byte_ns={first_byte_ns} done_ns={done_ns} resumed={resumed} url={url}"
    )
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
                let got = client::fetch(&tcpe, addr, &authority, &path, Duration::from_millis(timeout_ms), &mut out)?;
                out.flush()?;
                if timing {
                    eprintln!("{}", timing_line(url, &got));
                }
                tracing::debug!("tcpe get {url}: {got:?}");
                if got.status >= 400 {
                    bail!("{url}: HTTP status {}", got.status);
                }
            }
            Ok(())
        }
        TcpeCommand::Serve { control, join, origin, key, max_pending, max_sessions, max_deadline_ms, io_timeout_ms, early_join_hold_ms, idle_ms, agent_pins } => {
            let cfg = takeover::Config {
                control,
                join,
                origin,
                key: inband_core::auth::read_key(Path::new(&key))?,
                max_pending,
                max_sessions,
                max_deadline: Duration::from_millis(max_deadline_ms),
                io_timeout: Duration::from_millis(io_timeout_ms),
                early_join_hold: Duration::from_millis(early_join_hold_ms),
                idle: Duration::from_millis(idle_ms),
                agent: agent_pins,
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
        let f = client::FetchOutcome { status: 200, bytes: 1 << 20, moved: 1, resumed: 0, connect_ns: 10, sent_ns: 20, first_byte_ns: 30, done_ns: 40, ..Default::default() };
        assert_eq!(
            timing_line("http://10.1.0.100/f", &f),
            "timing status=200 bytes=1048576 moved=1 connect_ns=10 sent_ns=20 first_byte_ns=30 done_ns=40 resumed=0 url=http://10.1.0.100/f"
        );
    }
}

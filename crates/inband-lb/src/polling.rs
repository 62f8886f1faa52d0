//! Out-of-band scores: the seed paper's "request busyness" baseline
//! (`dsr-polling`: the daemon asks every backend's agent for its score over
//! UDP at a fixed interval and writes the answers into `scores`), and the
//! fallback for backends whose path loses inband options (flagged
//! `options_lost` by `options_watch`: polled the same way). Every request
//! and reply is counted in `control_stats`, so the cost of out-of-band
//! feedback can be compared with in-band feedback's zero extra packets.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tracing::warn;

use super::config::LbConfig;
use super::maps::{BackendScore, ControlStats, Mode, BACKEND_OPTIONS_LOST, EXPLORE};
use super::tables::{self, LbMaps};
use inband_core::poll_wire;
use inband_core::bpfmap;

/// Ethernet + IP + UDP headers around each poll datagram.
pub fn wire_overhead(to: &SocketAddr) -> u64 {
    14 + if to.is_ipv4() { 20 } else { 40 } + 8
}

/// The asking side of the polling protocol, both families: one socket
/// each, bound to the balancer's own address of that family, the one the
/// agents trust (left to routing, an IPv6 source could be a VIP on the
/// same interface).
pub struct Asker {
    v4: UdpSocket,
    v6: Option<UdpSocket>,
}

impl Asker {
    pub fn new(cfg: &LbConfig) -> Result<Asker> {
        let v4 = UdpSocket::bind((cfg.address.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED), 0)).context("opening the polling socket")?;
        v4.set_nonblocking(true)?;
        let v6 = match cfg.address6 {
            Some(a) => Some(UdpSocket::bind((a, 0)).context("opening the IPv6 polling socket")?),
            None => None,
        };
        if let Some(s) = &v6 {
            s.set_nonblocking(true)?;
        }
        Ok(Asker { v4, v6 })
    }

    pub fn send(&self, to: SocketAddr, buf: &[u8]) -> io::Result<usize> {
        match (to, &self.v6) {
            (SocketAddr::V4(_), _) => self.v4.send_to(buf, to),
            (SocketAddr::V6(_), Some(s)) => s.send_to(buf, to),
            (SocketAddr::V6(_), None) => Err(io::Error::new(io::ErrorKind::Unsupported, "the balancer has no IPv6 address (address6)")),
        }
    }

    /// The next datagram to arrive before `deadline`, if any.
    pub fn recv_until(&self, deadline: Instant, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
        loop {
            for s in std::iter::once(&self.v4).chain(self.v6.iter()) {
                if let Ok((n, from)) = s.recv_from(buf) {
                    return Some((n, inband_core::net::unmapped(from)));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut fds: Vec<libc::pollfd> = std::iter::once(&self.v4)
                .chain(self.v6.iter())
                .map(|s| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 })
                .collect();
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: fds is a valid array of fds.len() pollfds.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        }
    }
}

/// `control_stats` has several writers in the daemon (this poller, the
/// dsr-query worker, the options watch, the peers' announcements, the flow
/// moves): each adds what it counted under
/// this lock.
static CONTROL_STATS: Mutex<()> = Mutex::new(());

pub fn add_control_stats(maps: &LbMaps, d: &ControlStats) -> Result<()> {
    let _one_writer = CONTROL_STATS.lock().unwrap();
    let mut s: ControlStats = bpfmap::get(&maps.control_stats, &0u32)?.unwrap_or_default();
    s.polls_sent += d.polls_sent;
    s.poll_replies += d.poll_replies;
    s.poll_bytes += d.poll_bytes;
    s.poll_failures += d.poll_failures;
    s.poll_unauthenticated += d.poll_unauthenticated;
    s.queries += d.queries;
    s.query_timeouts += d.query_timeouts;
    s.query_ns += d.query_ns;
    s.options_lost += d.options_lost;
    s.options_retried += d.options_retried;
    s.peer_datagrams_sent += d.peer_datagrams_sent;
    s.peer_records_sent += d.peer_records_sent;
    s.peer_send_failures += d.peer_send_failures;
    s.peer_records_learned += d.peer_records_learned;
    s.peer_unknown_sender += d.peer_unknown_sender;
    s.peer_malformed += d.peer_malformed;
    s.peer_bad_mac += d.peer_bad_mac;
    s.peer_replayed += d.peer_replayed;
    s.moves += d.moves;
    s.move_malformed += d.move_malformed;
    s.move_bad_mac += d.move_bad_mac;
    s.move_unknown_sender += d.move_unknown_sender;
    s.move_replayed += d.move_replayed;
    s.move_no_flow += d.move_no_flow;
    s.move_not_owner += d.move_not_owner;
    s.move_not_a_backend += d.move_not_a_backend;
    s.move_port_in_use += d.move_port_in_use;
    s.move_refused += d.move_refused;
    bpfmap::put(&maps.control_stats, &0u32, &s)
}

/// Writes a polled score: the report and its time, and a fresh start for
/// the connections counted since; the in-band probe's state is left as the
/// data path keeps it, but for an exploration ticket the sweeper gave it
/// while its report was stale (lb/sweep.h): with a fresh report, a ticket
/// would send a connection to a backend the report may show busy (a
/// dsr-dynamic VIP's query after a pause writes every score at once).
pub fn record(maps: &LbMaps, id: u32, score: u32, now: u64) -> Result<()> {
    let old: BackendScore = bpfmap::get(&maps.scores, &id)?.unwrap_or_default();
    bpfmap::put(&maps.scores, &id, &BackendScore { score, opened: 0, closed: 0, updated_ns: now, ..old })?;
    if let Some(due) = bpfmap::get::<u32, u32>(&maps.probe_due, &id)?.filter(|d| d & EXPLORE != 0) {
        bpfmap::put(&maps.probe_due, &id, &(due & !EXPLORE))?;
    }
    Ok(())
}

/// The keys polls are signed and checked with, and the signing key's id:
/// the data path's own (`lb_config`, `auth_keys` as last written), so a
/// SIGHUP's new `[auth]` applies to the next round.
fn poll_keys(maps: &LbMaps) -> Result<(poll_wire::Keys, u8)> {
    let cfg: super::maps::DataPathConfig = bpfmap::get(&maps.lb_config, &0u32)?.unwrap_or_default();
    Ok((inband_core::auth::read_keys(cfg.auth_mode, &maps.auth_keys)?, cfg.sign_key))
}

/// Who one round of polls asks: (backend, its agent's poll port) -> the
/// backend ids that address stands for.
pub type Targets = HashMap<(SocketAddr, u16), Vec<u32>>;

/// One round of polls: asks every backend in `targets` (its agent's poll
/// port -> the ids it backs) and waits `wait` for the answers, counting
/// into `stats`. Returns the targets that did not answer. The wait starts
/// once the last request is out: a backend gets all of `wait` to answer
/// even when this thread lost the CPU while it was still asking (a busy
/// balancer host would otherwise count its own delay as the backends').
pub fn poll_round(
    maps: &LbMaps,
    asker: &Asker,
    targets: &Targets,
    wait: Duration,
    stats: &mut ControlStats,
) -> Result<Vec<(SocketAddr, u16)>> {
    let (keys, sign_id) = poll_keys(maps)?;
    let mut round = poll_wire::Round::new(keys, sign_id).map_err(anyhow::Error::msg)?;
    for (&(backend, poll_port), ids) in targets {
        let to = SocketAddr::new(backend.ip(), poll_port);
        match asker.send(to, &round.ask(backend, poll_port, ids, rand::random())) {
            Ok(n) => {
                stats.polls_sent += 1;
                stats.poll_bytes += n as u64 + wire_overhead(&to);
            }
            Err(e) => {
                round.forget(backend, poll_port);
                stats.poll_failures += 1;
                warn!(%backend, error = %e, "poll request failed");
            }
        }
    }
    let deadline = Instant::now() + wait;
    let mut buf = [0u8; poll_wire::MAX_LEN];
    while round.waiting() > 0 {
        let Some((n, from)) = asker.recv_until(deadline, &mut buf) else { break };
        match round.answer(from, &buf[..n]) {
            poll_wire::Answer::Score(ids, score) => {
                stats.poll_replies += 1;
                stats.poll_bytes += n as u64 + wire_overhead(&from);
                let now = tables::ktime_ns();
                for id in ids {
                    record(maps, *id, score, now)?;
                }
            }
            poll_wire::Answer::Stale | poll_wire::Answer::Refused(poll_wire::Refusal::NotOurs) => {}
            poll_wire::Answer::Refused(why) => {
                stats.poll_unauthenticated += 1;
                warn!(%from, ?why, "poll reply that does not authenticate: ignored (do the balancer's and the agent's [auth] match?)");
            }
        }
    }
    stats.poll_failures += round.waiting() as u64;
    Ok(round.unanswered().map(|(k, _)| k).collect())
}

pub fn run(maps: &LbMaps, cfg: &Arc<Mutex<LbConfig>>, stop: &AtomicBool) -> Result<()> {
    let asker = Asker::new(&cfg.lock().unwrap())?;
    while !stop.load(Ordering::Relaxed) {
        let (interval, targets) = {
            let c = cfg.lock().unwrap();
            targets(maps, &c)?
        };
        if targets.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let round = Instant::now();
        let mut delta = ControlStats::default();
        poll_round(maps, &asker, &targets, interval, &mut delta)?;
        add_control_stats(maps, &delta)?;
        std::thread::sleep(interval.saturating_sub(round.elapsed()));
    }
    Ok(())
}

/// Who is polled, and how often: every backend of a dsr-polling VIP, and
/// every backend flagged options_lost, at its VIP's poll_interval_ms (the
/// shortest where several apply). (backend, agent poll port) -> ids.
fn targets(maps: &LbMaps, cfg: &LbConfig) -> Result<(Duration, Targets)> {
    let mut out = Targets::new();
    let mut interval = u64::MAX;
    for e in tables::read(maps)? {
        let Some(v) = cfg.vips.iter().find(|v| v.endpoint() == e.endpoint && v.protocol == e.protocol) else { continue };
        for (id, b) in &e.slots {
            if v.mode == Mode::DsrPolling || b.flags & BACKEND_OPTIONS_LOST != 0 {
                out.entry((tables::backend_endpoint(b), v.poll_port)).or_default().push(*id);
                interval = interval.min(v.poll_interval_ms);
            }
        }
    }
    Ok((Duration::from_millis(interval.min(60_000)), out))
}

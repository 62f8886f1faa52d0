//! The server side of a handoff (`inband tcpe serve`): it takes a
//! connection a balancer hands over on the takeover channel, accepts the
//! client's join for it, and serves the rest of the session by relaying
//! the new subflow to a local HTTP origin, the handed-over request first.
//! Relaying bytes rather than parsing HTTP keeps the origin whatever it is
//! (keep-alive requests, any response framing) and the server free of a
//! second HTTP implementation; the relay is on the server's own host, so
//! it costs copies on loopback, not a hop on the network.
//!
//! State: a table of pending handoffs (connection ID -> keys, request,
//! origin connection), bounded by `max_pending`; an entry leaves it when
//! its join is accepted or its deadline passes, whichever comes first,
//! decided under one lock so that the balancer's verdict is always true.
//! Beside it, the IDs of the last `REFUSED_KEPT` handoffs refused: the
//! balancer tells the client to join as it sends the HANDOFF, so a join
//! can come before its HANDOFF is decided (it waits up to
//! `early_join_hold` for it), or for a handoff refused (it is reset at
//! once).
//! A session ends, and its threads and sockets with it, when either side
//! closes or resets, or after `idle` without a byte. A takeover channel
//! carries a balancer's handoffs one after another and ends at its
//! balancer's close, after `idle` without a handoff, or at the stop.
//!
//! A channel also carries moves (the transparent handoff, docs/tcpe.md):
//! the balancer froze a client's connection, and this side rebuilds it in
//! repair mode, waits for the balancer's GO (the L4 balancer now sends the
//! connection here), tells its agent where the responses go, and relays
//! the connection to the origin as it relays a joined session.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use inband_core::wire::Key;

use crate::agent_flows::AgentFlows;
use crate::channel::{self, Move, Ready, Reply, Verdict};
use crate::join::{self, Kind, JOIN_LEN};
use crate::relay::{relay, Counters, End};
use crate::wire::Keys;

pub const COUNTERS: &[(&str, &str)] = &[
    ("handoffs_accepted", "Handoffs taken from a balancer"),
    ("handoff_bad_mac", "Takeover-channel messages whose MAC did not verify"),
    ("handoff_malformed", "Takeover channels that broke off, timed out or sent a malformed message"),
    ("handoff_full", "Handoffs refused: the table of pending handoffs was full"),
    ("handoff_duplicate", "Handoffs refused: a handoff with the same connection ID was pending"),
    ("handoff_no_origin", "Handoffs refused: the origin did not take a connection"),
    ("handoff_expired", "Handoffs given back: no valid join before the deadline"),
    ("join_accepted", "Joins verified: sessions taken over"),
    ("join_bad_mac", "Joins refused: the MAC did not verify under the connection's keys"),
    ("join_unknown", "Joins refused: no pending handoff with that connection ID"),
    ("join_malformed", "Joins refused: not a join message"),
    ("join_timeout", "Subflows that sent no join in time"),
    ("sessions_full", "Joins refused: max_sessions sessions were running"),
    ("session_closed", "Sessions that ended with FIN"),
    ("session_reset", "Sessions that ended with a reset of the subflow or the origin"),
    ("session_idle", "Sessions closed after `idle` without a byte"),
    ("conns_busy", "Connections reset at once: max_pending + max_sessions others were waiting for their first message"),
    ("channels_opened", "Takeover channels accepted (a balancer keeps each for its next handoffs)"),
    ("moves_taken", "Frozen connections rebuilt and taken over (transparent handoff)"),
    ("move_full", "Moves refused: max_sessions sessions were running"),
    ("move_no_origin", "Moves refused: the origin did not take a connection"),
    ("move_unrestorable", "Moves refused: the kernel would not rebuild the connection (not this host's address, tuple in use)"),
    ("move_called_off", "Moves the balancer called off after this side was ready (its L4 balancer did not switch)"),
    ("move_no_dsr", "Moves taken whose responses go back through the balancer: the agent's entry could not be written"),
    ("move_port_changed", "Moves rebuilt again from the source port the balancer gave them (their own was held toward this server)"),
    ("move_lost", "Moves lost after the balancer's switch: the connection could not be rebuilt from the new port, or not released"),
    ("join_held", "Joins that came before their HANDOFF was taken, and waited for it"),
];
const HANDOFFS_ACCEPTED: usize = 0;
const HANDOFF_BAD_MAC: usize = 1;
const HANDOFF_MALFORMED: usize = 2;
const HANDOFF_FULL: usize = 3;
const HANDOFF_DUPLICATE: usize = 4;
const HANDOFF_NO_ORIGIN: usize = 5;
const HANDOFF_EXPIRED: usize = 6;
const JOIN_ACCEPTED: usize = 7;
const JOIN_BAD_MAC: usize = 8;
const JOIN_UNKNOWN: usize = 9;
const JOIN_MALFORMED: usize = 10;
const JOIN_TIMEOUT: usize = 11;
const SESSIONS_FULL: usize = 12;
const SESSION_CLOSED: usize = 13;
const SESSION_RESET: usize = 14;
const SESSION_IDLE: usize = 15;
const CONNS_BUSY: usize = 16;
const CHANNELS_OPENED: usize = 17;
const MOVES_TAKEN: usize = 18;
const MOVE_FULL: usize = 19;
const MOVE_NO_ORIGIN: usize = 20;
const MOVE_UNRESTORABLE: usize = 21;
const MOVE_CALLED_OFF: usize = 22;
const MOVE_NO_DSR: usize = 23;
const MOVE_PORT_CHANGED: usize = 24;
const MOVE_LOST: usize = 25;
const JOIN_HELD: usize = 26;

#[derive(Clone, Debug)]
pub struct Config {
    /// Where balancers open the takeover channel.
    pub control: SocketAddr,
    /// Where clients join (the address the balancer's notification names).
    pub join: SocketAddr,
    /// The HTTP origin the sessions are relayed to.
    pub origin: SocketAddr,
    /// The key shared with the balancers.
    pub key: Key,
    pub max_pending: usize,
    pub max_sessions: usize,
    /// The longest join deadline a balancer may ask for.
    pub max_deadline: Duration,
    /// How long a channel or a new subflow may take to send its message,
    /// and the origin to take a connection.
    pub io_timeout: Duration,
    /// How long a join whose connection ID is not pending waits for its
    /// HANDOFF to be taken: the client hears of the path as the HANDOFF
    /// leaves the balancer, and the server dials its origin before it
    /// takes one. A join for an ID refused meanwhile is reset at once.
    pub early_join_hold: Duration,
    /// A session without a byte either way for this long is closed.
    pub idle: Duration,
    /// The pin directory of this host's agent (docs/agent.md): a moved
    /// connection's responses go straight to the client through its
    /// `dsr_flows`. None: moves are still taken, and their responses go
    /// back through the balancer.
    pub agent: Option<std::path::PathBuf>,
}

struct Pending {
    keys: Keys,
    /// What the origin is still to get ahead of the client's bytes: empty
    /// once the request went with the dial (`sent_at_handoff`).
    request: Vec<u8>,
    origin: TcpStream,
    joined: mpsc::Sender<()>,
}

/// How many refused handoffs' IDs are remembered, for the joins their
/// clients send anyway (a refusal's join otherwise waits out the hold).
const REFUSED_KEPT: usize = 1024;

#[derive(Default)]
struct Table {
    pending: HashMap<u32, Pending>,
    refused: VecDeque<u32>,
}

impl Table {
    fn refuse(&mut self, conn_id: u32) {
        if self.refused.len() == REFUSED_KEPT {
            self.refused.pop_front();
        }
        self.refused.push_back(conn_id);
    }
}

struct Shared {
    cfg: Config,
    agent: Option<AgentFlows>,
    table: Mutex<Table>,
    /// Signalled when a handoff is taken or refused, for the joins that
    /// wait for theirs.
    decided: Condvar,
    sessions: AtomicUsize,
    /// Connections of either listener whose first message is not read yet
    /// (each holds a thread): bounded by `max_pending + max_sessions`, as
    /// many as could become pending handoffs and sessions.
    waiting: AtomicUsize,
    /// Takeover channels open: after `stop` each ends at its current
    /// handoff's end, or within a `POLL` between two.
    channels: AtomicUsize,
    counters: Counters,
    stop: AtomicBool,
}

/// One of `Shared::waiting`, given back when dropped.
struct Waiting(Arc<Shared>);

impl Waiting {
    /// A slot, or None when `max_pending + max_sessions` are taken.
    fn enter(shared: &Arc<Shared>) -> Option<Waiting> {
        if shared.waiting.fetch_add(1, Ordering::Relaxed) >= shared.cfg.max_pending + shared.cfg.max_sessions {
            shared.waiting.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Waiting(shared.clone()))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running takeover server; stops its listeners when dropped (sessions
/// under way run to their end).
pub struct Takeover {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// How often the listeners look at the stop flag.
const POLL: Duration = Duration::from_millis(50);

fn listen(addr: SocketAddr) -> Result<TcpListener> {
    let l = TcpListener::bind(addr).with_context(|| format!("listening on {addr}"))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

fn accept_loop(l: TcpListener, shared: Arc<Shared>, serve: fn(Waiting, TcpStream)) {
    let mut p = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    while !shared.stop.load(Ordering::Relaxed) {
        // poll(2) wakes at once for a connection, and every POLL to look
        // at the stop flag: a connection never waits out a sleep.
        // SAFETY: poll on one pollfd.
        if unsafe { libc::poll(&mut p, 1, POLL.as_millis() as libc::c_int) } <= 0 {
            continue;
        }
        match l.accept() {
            Ok((s, _)) => {
                // Each side writes small messages and waits for the
                // answer: Nagle's algorithm would hold the second of two
                // writes (REPLY then VERDICT, JOIN-OK then the response)
                // for the peer's delayed ACK.
                // A flood of connections that send nothing gets resets,
                // not a thread each.
                let Some(w) = Waiting::enter(&shared) else {
                    shared.counters.bump(CONNS_BUSY);
                    reset(s);
                    continue;
                };
                if s.set_nonblocking(false).is_ok() && s.set_nodelay(true).is_ok() {
                    std::thread::spawn(move || serve(w, s));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::warn!("tcpe takeover: accept: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

impl Takeover {
    /// Binds both listeners (in the calling thread's network namespace) and
    /// serves them from threads of their own.
    pub fn start(cfg: Config) -> Result<Takeover> {
        let control = listen(cfg.control)?;
        let joins = listen(cfg.join)?;
        let agent = cfg.agent.as_deref().map(AgentFlows::open).transpose()?;
        let shared = Arc::new(Shared {
            cfg,
            agent,
            table: Mutex::new(Table::default()),
            decided: Condvar::new(),
            sessions: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            channels: AtomicUsize::new(0),
            counters: Counters::new(COUNTERS),
            stop: AtomicBool::new(false),
        });
        let (a, b) = (shared.clone(), shared.clone());
        let threads =
            vec![std::thread::spawn(move || accept_loop(control, a, channel_session)), std::thread::spawn(move || accept_loop(joins, b, join_session))];
        Ok(Takeover { shared, threads })
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Handoffs waiting for their join.
    pub fn pending(&self) -> usize {
        self.shared.table.lock().unwrap().pending.len()
    }

    /// Sessions being relayed.
    pub fn sessions(&self) -> usize {
        self.shared.sessions.load(Ordering::Relaxed)
    }
}

impl Drop for Takeover {
    /// Stops the listeners, and returns once every channel is closed (a
    /// handoff under way ends first: at most its deadline and the I/O
    /// bounds), so that a balancer finds a kept channel closed rather
    /// than sending a handoff to a server that stopped.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let cfg = &self.shared.cfg;
        let bound = Instant::now() + cfg.max_deadline + 3 * cfg.io_timeout;
        while self.shared.channels.load(Ordering::Relaxed) > 0 && Instant::now() < bound {
            std::thread::sleep(POLL / 5);
        }
    }
}

/// One balancer's takeover channel: handoffs one after another, each from
/// its own HELLO (a fresh nonce, so no message of one handoff verifies in
/// another) to its VERDICT or refusing REPLY. Between two, the channel
/// waits for the next HANDOFF for `idle`, holding a `waiting` slot as a
/// new connection would.
fn channel_session(w: Waiting, s: TcpStream) {
    let sh = w.0.clone();
    sh.counters.bump(CHANNELS_OPENED);
    sh.channels.fetch_add(1, Ordering::Relaxed);
    carry_handoffs(w, s);
    sh.channels.fetch_sub(1, Ordering::Relaxed);
}

/// The channel's handoffs until one ends it; closes it.
fn carry_handoffs(w: Waiting, mut s: TcpStream) {
    let sh = w.0.clone();
    let mut slot = Some(w);
    for first in std::iter::once(true).chain(std::iter::repeat(false)) {
        let Some(w) = slot.take().or_else(|| Waiting::enter(&sh)) else { return };
        if sh.stop.load(Ordering::Relaxed) || !handoff_on_channel(w, &mut s, first) {
            return;
        }
    }
}

/// Whether the balancer began another HANDOFF on a channel before `idle`,
/// its close, or the server's stop; the HELLO for it is sent.
fn next_handoff(sh: &Shared, s: &TcpStream) -> bool {
    let nonce_sent = Instant::now();
    let mut p = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    while nonce_sent.elapsed() < sh.cfg.idle {
        // SAFETY: poll on one pollfd.
        let ready = unsafe { libc::poll(&mut p, 1, POLL.as_millis() as libc::c_int) };
        if sh.stop.load(Ordering::Relaxed) {
            return false;
        }
        if ready > 0 {
            // A byte, not the balancer's close or a reset.
            return matches!(s.peek(&mut [0u8; 1]), Ok(1));
        }
    }
    false
}

/// One handoff on a channel, from its HELLO to its VERDICT (or refusing
/// REPLY); whether the channel can carry another. A channel that ends
/// between two handoffs (its balancer closes it, it idles, the server
/// stops) is not counted: that is no fault.
fn handoff_on_channel(w: Waiting, s: &mut TcpStream, first: bool) -> bool {
    let sh = w.0.clone();
    let cfg = &sh.cfg;
    let _ = s.set_read_timeout(Some(cfg.io_timeout));
    let _ = s.set_write_timeout(Some(cfg.io_timeout));
    let nonce = match crate::sockops::random() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!("tcpe takeover: {e:#}");
            return false;
        }
    };
    if channel::send_hello(s, &nonce).is_err() {
        if first {
            sh.counters.bump(HANDOFF_MALFORMED);
        }
        return false;
    }
    if !first && !next_handoff(&sh, s) {
        return false;
    }
    let h = match channel::recv_request(s, &cfg.key, &nonce) {
        Ok(channel::Request::Handoff(h)) => h,
        Ok(channel::Request::Move(m)) => return take_move(w, s, &nonce, *m),
        Err(e) if e.is::<channel::MacError>() => {
            sh.counters.bump(HANDOFF_BAD_MAC);
            return false;
        }
        Err(_) => {
            sh.counters.bump(HANDOFF_MALFORMED);
            return false;
        }
    };
    // From here the pending table's bound holds this channel.
    drop(w);
    let deadline = Duration::from_millis(h.deadline_ms.into()).min(cfg.max_deadline);
    let (tx, rx) = mpsc::channel();
    // Refused before the origin is dialled, and checked again after it
    // (dialling under the lock would stall every join behind a slow origin).
    let refusal = |t: &Table| {
        if t.pending.contains_key(&h.conn_id) {
            Some((HANDOFF_DUPLICATE, Reply::Duplicate))
        } else if t.pending.len() >= cfg.max_pending {
            Some((HANDOFF_FULL, Reply::Full))
        } else {
            None
        }
    };
    // A statement of its own: the lock must not live through the match.
    let refused = refusal(&sh.table.lock().unwrap());
    let taken = match refused {
        Some(r) => Err(r),
        None => match TcpStream::connect_timeout(&cfg.origin, cfg.io_timeout).and_then(|o| sent_at_handoff(o, h.request, cfg.io_timeout)) {
            Err(e) => {
                tracing::warn!("tcpe takeover: origin {}: {e}", cfg.origin);
                Err((HANDOFF_NO_ORIGIN, Reply::NoOrigin))
            }
            Ok((origin, request)) => {
                let mut t = sh.table.lock().unwrap();
                match refusal(&t) {
                    Some(r) => Err(r),
                    None => {
                        t.pending.insert(h.conn_id, Pending { keys: h.keys, request, origin, joined: tx });
                        Ok(())
                    }
                }
            }
        },
    };
    if let Err((counter, reply)) = taken {
        sh.counters.bump(counter);
        sh.table.lock().unwrap().refuse(h.conn_id);
        sh.decided.notify_all();
        return channel::send_reply(s, &cfg.key, &nonce, reply).is_ok();
    }
    sh.counters.bump(HANDOFFS_ACCEPTED);
    sh.decided.notify_all();
    // Even when the balancer is gone (it then keeps the connection, and a
    // client that joins meanwhile gets its bytes there), the entry is
    // waited out here, so that the deadline removes it.
    let verdict = match rx.recv_timeout(deadline) {
        Ok(()) => Verdict::Joined,
        Err(_) => {
            // The join may have taken the entry between the timeout and
            // this lock: then its message is on the way.
            let gone = sh.table.lock().unwrap().pending.remove(&h.conn_id).is_some();
            if gone {
                sh.counters.bump(HANDOFF_EXPIRED);
                Verdict::Expired
            } else if rx.recv_timeout(cfg.io_timeout).is_ok() {
                Verdict::Joined
            } else {
                return false;
            }
        }
    };
    channel::send_verdict(s, &cfg.key, &nonce, verdict).is_ok()
}

/// The origin connection, with a GET or HEAD written to it now rather than
/// at the join: the origin then answers while the client joins (on 2 CPUs
/// with 1 MiB responses the join took 0.19 ms and the origin's first byte
/// 0.37 ms more, one after the other), and its first bytes wait in the
/// socket for the relay. Only these safe methods (RFC 9110, 9.2.1): a
/// handoff that expires is proxied by the balancer, so the origin may get
/// the request twice. Returns what is left to send at the join.
fn sent_at_handoff(mut origin: TcpStream, request: Vec<u8>, io_timeout: Duration) -> std::io::Result<(TcpStream, Vec<u8>)> {
    if !(request.starts_with(b"GET ") || request.starts_with(b"HEAD ")) {
        return Ok((origin, request));
    }
    origin.set_write_timeout(Some(io_timeout))?;
    origin.write_all(&request)?;
    origin.set_write_timeout(None)?;
    Ok((origin, Vec::new()))
}

/// One move on a channel, from its MOVE to the balancer's GO; whether the
/// channel can carry another.
fn take_move(w: Waiting, s: &mut TcpStream, nonce: &channel::Nonce, m: Move) -> bool {
    let sh = w.0.clone();
    let cfg = &sh.cfg;
    // The session's slot, taken now: a rebuilt connection must not wait
    // for one after the balancer has switched it here.
    if sh.sessions.fetch_add(1, Ordering::Relaxed) >= cfg.max_sessions {
        sh.sessions.fetch_sub(1, Ordering::Relaxed);
        sh.counters.bump(MOVE_FULL);
        return channel::send_ready(s, &cfg.key, nonce, Ready::Full).is_ok();
    }
    drop(w);
    let session = SessionSlot(sh.clone());
    let origin = match TcpStream::connect_timeout(&cfg.origin, cfg.io_timeout) {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!("tcpe takeover: origin {}: {e}", cfg.origin);
            sh.counters.bump(MOVE_NO_ORIGIN);
            return channel::send_ready(s, &cfg.key, nonce, Ready::NoOrigin).is_ok();
        }
    };
    let mut conn = match crate::repair::restore(&m.frozen) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("tcpe takeover: rebuilding {} <- {}: {e}", m.frozen.local, m.frozen.peer);
            sh.counters.bump(MOVE_UNRESTORABLE);
            return channel::send_ready(s, &cfg.key, nonce, Ready::Unrestorable).is_ok();
        }
    };
    if channel::send_ready(s, &cfg.key, nonce, Ready::Ready).is_err() {
        return false;
    }
    // Dropped in repair mode (called off, or the channel failed), the
    // rebuilt socket goes without a word, and the balancer, which has not
    // switched, keeps the connection.
    let port = match channel::recv_go(s, &cfg.key, nonce) {
        Ok(Some(port)) => port,
        Ok(None) => {
            sh.counters.bump(MOVE_CALLED_OFF);
            return true;
        }
        Err(e) => {
            sh.counters.bump(if e.is::<channel::MacError>() { HANDOFF_BAD_MAC } else { HANDOFF_MALFORMED });
            return false;
        }
    };
    // The balancer gave the connection another source port (its own was
    // held toward this server): the same connection, rebuilt with that
    // peer. The balancer has switched already, so a failure here loses it.
    let mut frozen = m.frozen;
    if port != frozen.peer.port() {
        frozen.peer.set_port(port);
        drop(conn);
        conn = match crate::repair::restore(&frozen) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("tcpe takeover: rebuilding {} <- {} (the balancer's new port): {e}", frozen.local, frozen.peer);
                sh.counters.bump(MOVE_LOST);
                return true;
            }
        };
        sh.counters.bump(MOVE_PORT_CHANGED);
    }
    let dsr = sh.agent.as_ref().map(|a| a.install(frozen.peer, frozen.local.port(), m.client, m.ts_shift));
    if !matches!(dsr, Some(Ok(()))) {
        if let Some(Err(e)) = dsr {
            tracing::warn!("tcpe takeover: the agent's entry for {}: {e:#}", frozen.peer);
        }
        sh.counters.bump(MOVE_NO_DSR);
    }
    if let Err(e) = crate::repair::release(&conn) {
        // Still in repair mode: it could never answer. Dropped so, it
        // sends nothing, and the client's retransmissions meet no socket.
        tracing::warn!("tcpe takeover: releasing {}: {e}", frozen.peer);
        sh.counters.bump(MOVE_LOST);
        return true;
    }
    sh.counters.bump(MOVES_TAKEN);
    std::thread::spawn(move || serve_session(session, conn, origin, &[]));
    true
}

/// One of `Shared::sessions`, given back when dropped.
struct SessionSlot(Arc<Shared>);

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.0.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Relays a taken-over connection to its origin, `first` ahead of it,
/// until either side ends it; counts how it ended.
fn serve_session(slot: SessionSlot, s: TcpStream, mut origin: TcpStream, first: &[u8]) {
    let sh = &slot.0;
    let end = origin.write_all(first).and_then(|()| relay(s.try_clone()?, origin.try_clone()?, sh.cfg.idle));
    sh.counters.bump(match end {
        Ok(End::Closed) => SESSION_CLOSED,
        Ok(End::Idle) => SESSION_IDLE,
        Ok(End::Reset) | Err(_) => SESSION_RESET,
    });
    let _ = origin.shutdown(Shutdown::Both);
    if !matches!(end, Ok(End::Closed)) {
        reset(s);
    }
}

fn reset(s: TcpStream) {
    // SO_LINGER 0: close sends RST, so a refused join gets no FIN that a
    // client could take for an empty stream.
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt with a pointer to a linger struct and its size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// One new subflow: its join verified, then the session relayed.
fn join_session(w: Waiting, mut s: TcpStream) {
    let sh = w.0.clone();
    let cfg = &sh.cfg;
    let _ = s.set_read_timeout(Some(cfg.io_timeout));
    let _ = s.set_write_timeout(Some(cfg.io_timeout));
    let mut b = [0u8; JOIN_LEN];
    if let Err(e) = s.read_exact(&mut b) {
        let c = if e.kind() == std::io::ErrorKind::UnexpectedEof { JOIN_MALFORMED } else { JOIN_TIMEOUT };
        sh.counters.bump(c);
        return reset(s);
    }
    let Ok((conn_id, mac)) = join::decode(Kind::Join, &b) else {
        sh.counters.bump(JOIN_MALFORMED);
        return reset(s);
    };
    let (Ok(client), Ok(local)) = (s.peer_addr(), s.local_addr()) else { return reset(s) };
    let p = {
        // A join ahead of its HANDOFF waits for it, holding its waiting
        // slot: the slots bound the joins held.
        let hold = Instant::now() + cfg.early_join_hold;
        let mut t = sh.table.lock().unwrap();
        let mut held = false;
        while !t.pending.contains_key(&conn_id) {
            let left = hold.saturating_duration_since(Instant::now());
            if left.is_zero() || t.refused.contains(&conn_id) {
                drop(t);
                sh.counters.bump(JOIN_UNKNOWN);
                return reset(s);
            }
            if !held {
                held = true;
                sh.counters.bump(JOIN_HELD);
            }
            t = sh.decided.wait_timeout(t, left).unwrap().0;
        }
        // From here max_sessions bounds it, or it ends now.
        drop(w);
        let p = &t.pending[&conn_id];
        // A bad MAC leaves the entry in place: a forger cannot spend the
        // real client's join, only be counted.
        if join::mac(Kind::Join, &p.keys, conn_id, client, local) != mac {
            drop(t);
            sh.counters.bump(JOIN_BAD_MAC);
            return reset(s);
        }
        if sh.sessions.load(Ordering::Relaxed) >= cfg.max_sessions {
            drop(t);
            sh.counters.bump(SESSIONS_FULL);
            return reset(s);
        }
        sh.sessions.fetch_add(1, Ordering::Relaxed);
        t.pending.remove(&conn_id).unwrap()
    };
    let slot = SessionSlot(sh.clone());
    sh.counters.bump(JOIN_ACCEPTED);
    let _ = p.joined.send(());
    let ok = join::encode(Kind::Ok, conn_id, join::mac(Kind::Ok, &p.keys, conn_id, client, local));
    if s.write_all(&ok).is_err() {
        sh.counters.bump(SESSION_RESET);
        return reset(s);
    }
    serve_session(slot, s, p.origin, &p.request);
}

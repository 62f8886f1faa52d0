//! The transparent handoff, the balancer's side (docs/tcpe.md, "The
//! transparent handoff"): a client without TCPE, whose connection reached
//! this proxy through `inband lb` in a DSR mode, is moved to the chosen
//! server at L4. The proxy freezes its socket (`repair`), the server's
//! takeover rebuilds it from the frozen state, the L4 balancer is asked to
//! send the connection's packets to the server from now on
//! (inband-core's `flow_move`), and the server's agent sends the responses
//! straight to the client. Every step that fails before the balancer's
//! switch gives the connection back to this socket, as it was: the
//! fallback of every TCPE step.
//!
//! What it needs: the kernel's tuple of the connection (the balancer's
//! address and port: this process must not be under the agent's
//! `client_address` hook, which shows the client instead), this host's
//! agent (its pins: the client the tuple stands for, the VIP, the freeze),
//! and the server listed as a backend of the VIP on the L4 balancer (with
//! weight 0 if it should take moved connections only).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use inband_core::flow_move::{self, FlowSide, MoveOutcome, MoveRequest};
use inband_core::wire::Key;

use crate::agent_flows::AgentFlows;
use crate::channel::{self, Move, Ready};
use crate::handoff::{open_channel, read_frame, send_frame, Outcome, Target};
use crate::relay::Counters;
use crate::repair::{self, Connected};
use tokio::net::UdpSocket;

pub const COUNTERS: &[(&str, &str)] = &[
    ("moved", "Connections moved to a server at L4 (transparent handoff)"),
    ("move_fallback_not_dsr", "Kept: this host's agent names no client for the connection (not from inband lb in a DSR mode)"),
    ("move_fallback_unfreezable", "Kept: the connection could not be frozen (not established, bytes unacknowledged)"),
    ("move_fallback_channel", "Kept: the takeover channel failed (connect, I/O, timeout)"),
    ("move_fallback_bad_mac", "Kept: the server's answer did not verify"),
    ("move_fallback_refused", "Kept: the server refused (sessions full, origin down, could not rebuild it)"),
    ("move_fallback_balancer", "Kept: the L4 balancer refused the move or did not answer"),
    ("move_lost", "Switched at the L4 balancer, but the server's GO could not be sent: the connection is lost"),
    ("move_fallback_family", "Kept: the connection is IPv6 and the server is listed by IPv4, or the other way round"),
];
const MOVED: usize = 0;
const NOT_DSR: usize = 1;
const UNFREEZABLE: usize = 2;
const CHANNEL: usize = 3;
const BAD_MAC: usize = 4;
const REFUSED: usize = 5;
const BALANCER: usize = 6;
const LOST: usize = 7;
const FAMILY: usize = 8;

pub fn counters() -> Counters {
    Counters::new(COUNTERS)
}

fn fallback(c: &Counters, i: usize) -> Outcome {
    c.bump(i);
    Outcome::Fallback(COUNTERS[i].0)
}

/// How long the agent drops a moved connection's segments here: long
/// enough for those in flight when the balancer switched (a few round
/// trips), short enough that the ports are free again soon after.
const FREEZE_FOR: Duration = Duration::from_secs(3);
/// Requests to the L4 balancer, each with a fresh sequence number, before
/// the move is called off.
const LB_TRIES: u32 = 3;
/// Sockets kept per balancer: as many as moves run at once, up to this.
const LB_SOCKETS_KEPT: usize = 16;

/// What moves need on the balancer's host.
pub struct Mover {
    agent: AgentFlows,
    /// The L4 balancer's `[moves] listen` port, on the address the
    /// connection came from.
    lb_port: u16,
    /// A key of the L4 balancer's `[auth]` (its id and the key).
    lb_key: (u8, Key),
    /// The last sequence number used: each request's is above it.
    seq: AtomicU64,
    /// Sockets toward each balancer, connected (so that an ICMP port
    /// unreachable shows), each used by one move at a time, so that only
    /// its own requests' answers come to it; kept off any event loop
    /// between moves, as the takeover channels are.
    lb_sockets: Mutex<HashMap<SocketAddr, Vec<std::net::UdpSocket>>>,
}

impl Mover {
    /// `agent_pins`: this host's agent's pin directory.
    pub fn new(agent_pins: &std::path::Path, lb_port: u16, lb_key: (u8, Key)) -> Result<Mover> {
        Ok(Mover { agent: AgentFlows::open(agent_pins)?, lb_port, lb_key, seq: AtomicU64::new(0), lb_sockets: Default::default() })
    }

    /// The client a connection from the balancer's tuple `peer` to
    /// `local_port` stands for, as the agent's `client_address` hook would
    /// show it (a host that moves connections runs without the hook).
    pub fn client_of(&self, peer: SocketAddr, local_port: u16) -> Option<SocketAddr> {
        self.agent.entry(peer, local_port).ok().flatten().map(|e| e.client)
    }

    /// Microseconds of the wall clock, above every number used before: a
    /// restarted proxy goes on above its old numbers, as the balancer
    /// requires of a sender.
    fn next_seq(&self) -> u64 {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0);
        let prev = self.seq.fetch_max(now, Ordering::Relaxed).max(now);
        // Another thread may take the same number: the balancer takes
        // only the first, and this one retries with a new one.
        let _ = self.seq.compare_exchange(prev, prev + 1, Ordering::Relaxed, Ordering::Relaxed);
        prev + 1
    }

    /// Asks the L4 balancer at `lb` to send `flow` to `to` from now on:
    /// Some(the source port it comes from toward `to`) once switched. A
    /// try whose answer was lost is answered again on the next, since the
    /// balancer answers a flow that goes to `to` already as moved.
    async fn switch(&self, lb: SocketAddr, flow: FlowSide, from: SocketAddr, to: SocketAddr, wait: Duration) -> Result<Option<u16>> {
        let kept = self.lb_sockets.lock().unwrap().get_mut(&lb).and_then(Vec::pop);
        let sock = match kept {
            Some(s) => s,
            None => {
                let s = std::net::UdpSocket::bind(if lb.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
                s.connect(lb)?;
                s.set_nonblocking(true)?;
                s
            }
        };
        let sock = UdpSocket::from_std(sock)?;
        let answer = self.ask(&sock, lb, flow, from, to, wait).await;
        // A socket that met an error (an ICMP unreachable, say) is not
        // kept: its next move starts clean.
        if answer.is_ok() {
            if let Ok(s) = sock.into_std() {
                let mut kept = self.lb_sockets.lock().unwrap();
                let v = kept.entry(lb).or_default();
                if v.len() < LB_SOCKETS_KEPT {
                    v.push(s);
                }
            }
        }
        answer
    }

    async fn ask(&self, sock: &UdpSocket, lb: SocketAddr, flow: FlowSide, from: SocketAddr, to: SocketAddr, wait: Duration) -> Result<Option<u16>> {
        let keys = [self.lb_key];
        for _ in 0..LB_TRIES {
            let req = MoveRequest { key_id: self.lb_key.0, seq: self.next_seq(), flow, from, to };
            sock.send(&flow_move::encode_request(&req, &self.lb_key.1)).await?;
            let deadline = tokio::time::Instant::now() + wait;
            let mut buf = [0u8; flow_move::MAX_LEN];
            loop {
                let n = match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                    Err(_) => break,
                    Ok(Ok(n)) => n,
                    // An ICMP port unreachable: nothing listens there.
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        bail!("the balancer at {lb} takes no moves")
                    }
                    Ok(Err(e)) => return Err(e).context("reading the balancer's answer"),
                };
                match flow_move::decode_reply(&buf[..n], &keys) {
                    Ok(r) if r.seq == req.seq => return Ok((r.outcome == MoveOutcome::Moved).then_some(r.source_port)),
                    // An answer to an earlier try, or noise: wait on.
                    _ => {}
                }
            }
        }
        Ok(None)
    }
}

/// Moves `client` (accepted here from `inband lb`, its request `request`
/// read and not answered) to the server of `to`, which the L4 balancer
/// knows as `backend`. On `Fallback`, `client` is as it was. On
/// `HandedOff` the connection is no longer this side's (moved, or lost and
/// counted `move_lost`): `client` is left in repair mode, and the caller
/// drops it, which sends nothing.
pub async fn move_connection(m: &Mover, client: &impl Connected, request: &[u8], to: &Target, backend: SocketAddr, c: &Counters) -> Outcome {
    let (Ok(peer), Ok(local)) = (client.peer_addr(), client.local_addr()) else { return fallback(c, NOT_DSR) };
    // An IPv4 connection on a dual-stack listener shows IPv4-mapped
    // addresses; the agent's maps and the balancer key it as IPv4.
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (peer, local) = (canonical(peer), canonical(local));
    // The server is named by the one address its pool lists; the balancer
    // knows it in the connection's family only.
    if backend.is_ipv4() != peer.is_ipv4() {
        return fallback(c, FAMILY);
    }
    let entry = match m.agent.entry(peer, local.port()) {
        Ok(Some(e)) => e,
        _ => return fallback(c, NOT_DSR),
    };
    let vip = match m.agent.vip(local.port(), local.is_ipv4()) {
        Ok(Some(v)) => v,
        _ => return fallback(c, NOT_DSR),
    };
    // From here the agent keeps this socket from whatever the client
    // sends: a socket in repair mode would take data and acknowledge it.
    if m.agent.freeze(peer, local.port(), &entry, FREEZE_FOR).is_err() {
        return fallback(c, NOT_DSR);
    }
    let give_back = |i: usize| {
        let _ = repair::thaw(client);
        let _ = m.agent.unfreeze(peer, local.port(), &entry);
        fallback(c, i)
    };
    let mut frozen = match repair::freeze(client, request) {
        Ok(f) => f,
        Err(_) => {
            let _ = m.agent.unfreeze(peer, local.port(), &entry);
            return fallback(c, UNFREEZABLE);
        }
    };
    frozen.local = backend;
    frozen.peer = peer;
    let mv = Move { frozen, client: entry.client, ts_shift: entry.ts_shift };
    let (mut ch, nonce) = match open_channel(to, |w, nonce| channel::send_move(w, &to.key, nonce, &mv)).await {
        Ok(x) => x,
        Err(_) => return give_back(CHANNEL),
    };
    match read_frame(&mut ch, to.io_timeout).await.and_then(|f| channel::recv_ready(&mut f.as_slice(), &to.key, &nonce)) {
        Ok(Ready::Ready) => {}
        Ok(_) => {
            to.channels.keep(ch);
            return give_back(REFUSED);
        }
        Err(e) if e.is::<channel::MacError>() => return give_back(BAD_MAC),
        Err(_) => return give_back(CHANNEL),
    }
    let flow = FlowSide { client: entry.client, vip, proto: 6 };
    let lb = SocketAddr::new(peer.ip(), m.lb_port);
    let port = match m.switch(lb, flow, local, backend, to.io_timeout / LB_TRIES).await {
        Ok(Some(port)) => port,
        Ok(None) | Err(_) => {
            // The server drops what it rebuilt, without a word.
            if send_frame(&mut ch, to.io_timeout, |w| channel::send_go(w, &to.key, &nonce, None)).await.is_ok() {
                to.channels.keep(ch);
            }
            return give_back(BALANCER);
        }
    };
    if send_frame(&mut ch, to.io_timeout, |w| channel::send_go(w, &to.key, &nonce, Some(port))).await.is_err() {
        // The balancer sends the connection to a server that will not
        // take it, and only the server could ask for it back: this side
        // cannot serve it either.
        c.bump(LOST);
        return Outcome::HandedOff;
    }
    to.channels.keep(ch);
    c.bump(MOVED);
    Outcome::HandedOff
}

//! The balancer's side of a handoff: what `inband proxy` calls once it
//! has read a request head on a TCPE connection and chosen a backend (and
//! the request is not a cache hit). It hands the connection to the
//! backend's takeover server, tells the client to join it, and closes its
//! own subflow once the server reports the join; at every step that fails
//! it returns a fallback reason, and the caller proxies the request itself
//! as it would without TCPE: the worst case is the slower path.
//!
//! The caller must have called `sockops::hold_acks` on the client's
//! socket before the request arrived: the notification rides on the ACK
//! the kernel then owes (docs/decisions.md, "Getting a pure ACK out
//! promptly"). Without it no ACK is owed, the client never hears of the
//! new path, and the handoff falls back when the join's deadline passes.

use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use inband_core::wire::Key;

use crate::channel::{self, Handoff, Reply, Verdict};
use crate::relay::Counters;
use crate::sockops::{flush_ack, State, Tcpe};
use crate::wire::{Path, Role};

pub const COUNTERS: &[(&str, &str)] = &[
    ("handed_off", "Connections moved to a server"),
    ("fallback_not_capable", "Kept: the client did not finish TCPE's handshake (no library, options stripped)"),
    ("fallback_channel", "Kept: the takeover channel failed (connect, I/O, timeout)"),
    ("fallback_bad_mac", "Kept: the server's answer did not verify"),
    ("fallback_refused", "Kept: the server refused (table full, duplicate, origin down)"),
    ("fallback_notify", "Kept: the notification could not be queued"),
    ("fallback_no_ack", "Kept: no ACK was owed to carry the notification (the request was acknowledged already)"),
    ("fallback_no_join", "Kept: the client did not join before the deadline"),
    ("fallback_verdict_lost", "Kept: the server's verdict never came (the client, if it joined, stays on this subflow)"),
    ("client_not_closed", "Handed off, but the client did not close its old subflow in time (shut down)"),
];
const HANDED_OFF: usize = 0;
const NOT_CAPABLE: usize = 1;
const CHANNEL: usize = 2;
const BAD_MAC: usize = 3;
const REFUSED: usize = 4;
const NOTIFY: usize = 5;
const NO_ACK: usize = 6;
const NO_JOIN: usize = 7;
const VERDICT_LOST: usize = 8;
const NOT_CLOSED: usize = 9;

/// Where and how to hand a connection off.
#[derive(Clone, Debug)]
pub struct Target {
    /// The server's takeover channel.
    pub control: SocketAddr,
    /// The address the client is told to join (the server's join
    /// listener, as the client reaches it).
    pub join: SocketAddr,
    pub key: Key,
    /// How long the server waits for the join.
    pub deadline: Duration,
    /// Each step's bound on the channel, and the wait for the client's FIN.
    pub io_timeout: Duration,
    /// Channels to this server kept for the next handoffs (shared by the
    /// target's clones).
    pub channels: Arc<Channels>,
}

/// Takeover channels that carried a handoff to its end and wait for the
/// next: the server's HELLO for it is already in their receive buffer, so
/// a handoff on one takes one round trip (HANDOFF, REPLY) where a new
/// channel takes three (connect, HELLO, HANDOFF), and the balancer's CPU
/// for the connection's handshake and close. At most `KEPT` per server,
/// each for at most `KEPT_FOR` idle (the server waits `--idle-ms`, a
/// minute by default, before it closes one).
#[derive(Debug, Default)]
pub struct Channels(Mutex<Vec<(TcpStream, Instant)>>);

impl Channels {
    const KEPT: usize = 16;
    const KEPT_FOR: Duration = Duration::from_secs(10);

    pub(crate) fn keep(&self, ch: TcpStream) {
        let mut kept = self.0.lock().unwrap();
        if kept.len() < Self::KEPT {
            kept.push((ch, Instant::now()));
        }
    }

    /// The channel kept last; the others are older, so when it is too old
    /// they all go.
    fn take(&self) -> Option<TcpStream> {
        let mut kept = self.0.lock().unwrap();
        match kept.pop() {
            Some((ch, at)) if at.elapsed() < Self::KEPT_FOR => Some(ch),
            _ => {
                kept.clear();
                None
            }
        }
    }
}

/// What the caller does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The server has the connection; this side's subflow is closed.
    HandedOff,
    /// Proxy the request as without TCPE; the counter's name says why.
    Fallback(&'static str),
}

pub fn counters() -> Counters {
    Counters::new(COUNTERS)
}

fn fallback(c: &Counters, i: usize) -> Outcome {
    c.bump(i);
    Outcome::Fallback(COUNTERS[i].0)
}

/// Hands `client` (a connection this side accepted, its ACKs held) to the
/// server of `to`, with `request` the bytes read from it and not answered.
/// On `Fallback`, `client` is as it was: nothing was written to it, and
/// the client still reads this subflow.
pub fn hand_off(tcpe: &Tcpe, client: &TcpStream, request: &[u8], to: &Target, c: &Counters) -> Outcome {
    let s = match tcpe.state(client.as_fd()) {
        Ok(Some(s)) if s.state == State::Capable && s.role == Role::Passive => s,
        _ => return fallback(c, NOT_CAPABLE),
    };
    let h = Handoff {
        conn_id: s.conn_id,
        keys: s.keys,
        deadline_ms: to.deadline.as_millis().min(u32::MAX.into()) as u32,
        request: request.to_vec(),
    };
    let (mut ch, nonce) = match open_channel(to, |ch, nonce| channel::send_handoff(ch, &to.key, nonce, &h)) {
        Ok(x) => x,
        Err(_) => return fallback(c, CHANNEL),
    };
    match channel::recv_reply(&mut ch, &to.key, &nonce) {
        Ok(Reply::Accepted) => {}
        Ok(_) => {
            // The server is done with this handoff: its next HELLO follows.
            to.channels.keep(ch);
            return fallback(c, REFUSED);
        }
        Err(e) if e.is::<channel::MacError>() => return fallback(c, BAD_MAC),
        Err(_) => return fallback(c, CHANNEL),
    }
    // From here on a fallback leaves the server's entry to expire unjoined:
    // nobody was told its address.
    let path = Path { addr: to.join, priority: 0, create: true };
    if tcpe.notify(client.as_fd(), &path).is_err() || flush_ack(client.as_fd()).is_err() {
        return fallback(c, NOTIFY);
    }
    // The kernel sends the owed ACK within flush_ack, so the count of
    // pure ACKs that carried the notification says at once whether it left.
    // If none did (the request was acknowledged already: the delayed-ACK
    // timer ran out during the channel's exchange, or the request came in
    // several segments), waiting for the deadline would only delay the
    // fallback.
    let sent = |t: &Tcpe| t.state(client.as_fd()).ok().flatten().map(|x| x.written);
    if sent(tcpe) == Some(s.written) {
        let _ = tcpe.clear(client.as_fd());
        // A pure ACK may have carried it between the two looks.
        if sent(tcpe) == Some(s.written) {
            return fallback(c, NO_ACK);
        }
    }
    // The server decides by the deadline; the wait adds its own bound.
    let _ = ch.set_read_timeout(Some(to.deadline + to.io_timeout));
    let verdict = channel::recv_verdict(&mut ch, &to.key, &nonce);
    // Stop repeating the notification whatever the verdict: a client that
    // has not joined by now must not join later.
    let _ = tcpe.clear(client.as_fd());
    if verdict.is_ok() {
        to.channels.keep(ch);
    }
    match verdict {
        Ok(Verdict::Joined) => {}
        Ok(Verdict::Expired) => return fallback(c, NO_JOIN),
        Err(e) if e.is::<channel::MacError>() => return fallback(c, BAD_MAC),
        Err(_) => return fallback(c, VERDICT_LOST),
    }
    c.bump(HANDED_OFF);
    close_moved(client, to.io_timeout, c);
    Outcome::HandedOff
}

/// A kept channel whose server still answers, or a new one; the first
/// message (HANDOFF or MOVE) sent on it by `first`.
pub(crate) fn open_channel(
    to: &Target,
    first: impl Fn(&mut TcpStream, &channel::Nonce) -> Result<()>,
) -> Result<(TcpStream, channel::Nonce)> {
    while let Some(mut ch) = to.channels.take() {
        if let Ok(nonce) = start_on(&mut ch, to, &first, true) {
            return Ok((ch, nonce));
        }
    }
    let mut ch = TcpStream::connect_timeout(&to.control, to.io_timeout)?;
    // One message at a time each way; no write waits for a delayed ACK.
    ch.set_nodelay(true)?;
    let nonce = start_on(&mut ch, to, &first, false)?;
    Ok((ch, nonce))
}

fn start_on(
    ch: &mut TcpStream,
    to: &Target,
    first: &impl Fn(&mut TcpStream, &channel::Nonce) -> Result<()>,
    kept: bool,
) -> Result<channel::Nonce> {
    ch.set_read_timeout(Some(to.io_timeout))?;
    ch.set_write_timeout(Some(to.io_timeout))?;
    let nonce = channel::recv_hello(ch)?;
    // A kept channel's HELLO may have come before its server stopped (a
    // restart, its idle time): then the close is behind it, and the
    // handoff goes on a new channel instead of failing on this one.
    if kept {
        ch.set_nonblocking(true)?;
        let open = matches!(ch.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        ch.set_nonblocking(false)?;
        anyhow::ensure!(open, "the kept channel was closed");
    }
    first(ch, &nonce)?;
    Ok(nonce)
}

/// The old subflow's end: FIN, which tells the client its stream goes on
/// on the new subflow, then the client's FIN. A client that sends bytes
/// here or does not close in time is shut down: its bytes would be lost.
fn close_moved(client: &TcpStream, timeout: Duration, c: &Counters) {
    let _ = client.shutdown(Shutdown::Write);
    let mut buf = [0u8; 512];
    if client.set_read_timeout(Some(timeout)).is_ok() && matches!((&*client).read(&mut buf), Ok(0)) {
        return;
    }
    c.bump(NOT_CLOSED);
    let _ = client.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// At most `KEPT` channels are kept; the one kept last is taken first.
    #[test]
    fn kept_channels_are_bounded_and_the_last_kept_goes_first() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let channels = Channels::default();
        let mut ports = Vec::new();
        for _ in 0..Channels::KEPT + 3 {
            let ch = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            ports.push(ch.local_addr().unwrap().port());
            channels.keep(ch);
        }
        let mut taken = Vec::new();
        while let Some(ch) = channels.take() {
            taken.push(ch.local_addr().unwrap().port());
        }
        let kept: Vec<u16> = ports[..Channels::KEPT].iter().rev().copied().collect();
        assert_eq!(taken, kept);
    }
}

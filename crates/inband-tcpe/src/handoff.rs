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
//!
//! It runs on the caller's event loop: its one wait, for the server's
//! answer, is a wait of the connection's task, not of a thread of its own
//! (docs/decisions.md, "TCPE handoff (issue 29): the proxy's side").

use std::future::poll_fn;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use inband_core::wire::Key;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::error::Elapsed;
use tokio::time::timeout;

use crate::channel::{self, HandoffAnswer, Handoff, Nonce, Verdict, FRAME_HEAD, NONCE_LEN};
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
    ("fallback_verdict_lost", "Kept: the server's answer never came in time (a client that joined reads the server's subflow, and this one is reset)"),
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
    /// Each step's bound on the channel.
    pub io_timeout: Duration,
    /// Channels to this server kept for the next handoffs (shared by the
    /// target's clones).
    pub channels: Arc<Channels>,
}

/// Takeover channels that carried a handoff to its end and wait for the
/// next: the server's HELLO for it is already in their receive buffer, so
/// a handoff on one sends its HANDOFF, and tells the client to join, at
/// once, where a new channel first takes two round trips (connect, HELLO)
/// and the balancer's CPU for the connection's handshake and close. At most `KEPT` per server,
/// each for at most `KEPT_FOR` idle (the server waits `--idle-ms`, a
/// minute by default, before it closes one). They are kept off any event
/// loop: the next handoff may run on another worker's.
#[derive(Debug, Default)]
pub struct Channels(Mutex<Vec<(std::net::TcpStream, Instant)>>);

impl Channels {
    const KEPT: usize = 16;
    const KEPT_FOR: Duration = Duration::from_secs(10);

    pub(crate) fn keep(&self, ch: TcpStream) {
        let Ok(ch) = ch.into_std() else { return };
        let mut kept = self.0.lock().unwrap();
        if kept.len() < Self::KEPT {
            kept.push((ch, Instant::now()));
        }
    }

    /// The channel kept last, on the caller's event loop; the others are
    /// older, so when it is too old they all go.
    fn take(&self) -> Option<TcpStream> {
        let ch = {
            let mut kept = self.0.lock().unwrap();
            match kept.pop() {
                Some((ch, at)) if at.elapsed() < Self::KEPT_FOR => ch,
                _ => {
                    kept.clear();
                    return None;
                }
            }
        };
        TcpStream::from_std(ch).ok()
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
pub async fn hand_off<C>(tcpe: &Tcpe, client: &mut C, request: &[u8], to: &Target, c: &Counters) -> Outcome
where
    C: AsyncRead + AsyncWrite + AsFd + Unpin,
{
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
    let (mut ch, nonce) = match open_channel(to, |w, nonce| channel::send_handoff(w, &to.key, nonce, &h)).await {
        Ok(x) => x,
        Err(_) => return fallback(c, CHANNEL),
    };
    // The client is told to join now, as the HANDOFF travels, not after
    // the server has taken it: the server's acceptance would cost this
    // task a wake-up and the client the server's dial of its origin. A
    // join that comes first waits at the server for its HANDOFF; one for
    // a handoff the server refuses is reset, and the client stays here.
    // From here on a fallback before the answer leaves the server's entry
    // to expire unjoined.
    let path = Path { addr: to.join, priority: 0, create: true };
    if tcpe.notify(client.as_fd(), &path).is_err() || flush_ack(client.as_fd()).is_err() {
        return fallback(c, NOTIFY);
    }
    // The kernel sends the owed ACK within flush_ack, so the count of
    // pure ACKs that carried the notification says at once whether it left.
    // If none did (the request was acknowledged already: the delayed-ACK
    // timer ran out before the request was routed, or the request came in
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
    let answer = read_frame(&mut ch, to.deadline + to.io_timeout).await.and_then(|f| channel::recv_answer(&mut f.as_slice(), &to.key, &nonce));
    // Stop repeating the notification whatever the answer: a client that
    // has not joined by now must not join later.
    let _ = tcpe.clear(client.as_fd());
    if answer.is_ok() {
        // The server is done with this handoff: its next HELLO follows.
        to.channels.keep(ch);
    }
    match answer {
        Ok(HandoffAnswer::Verdict(Verdict::Joined)) => {}
        Ok(HandoffAnswer::Verdict(Verdict::Expired)) => return fallback(c, NO_JOIN),
        Ok(HandoffAnswer::Refused(_)) => return fallback(c, REFUSED),
        Err(e) if e.is::<channel::MacError>() => return fallback(c, BAD_MAC),
        Err(e) if e.is::<Elapsed>() => return fallback(c, VERDICT_LOST),
        Err(_) => return fallback(c, CHANNEL),
    }
    c.bump(HANDED_OFF);
    // The client left this subflow at the server's JOIN-OK (its FIN may be
    // here already): the stream does not wait for this side's FIN, which
    // only ends the subflow. The kernel finishes the close once the caller
    // drops the socket; a byte the client sends here after its join gets a
    // reset, as nothing would read it.
    let _ = client.shutdown().await;
    Outcome::HandedOff
}

/// A kept channel whose server still answers, or a new one; the first
/// message (HANDOFF or MOVE) written by `first` and sent on it.
pub(crate) async fn open_channel(to: &Target, first: impl Fn(&mut Vec<u8>, &Nonce) -> Result<()>) -> Result<(TcpStream, Nonce)> {
    while let Some(mut ch) = to.channels.take() {
        if let Ok(nonce) = start_on(&mut ch, to, &first, true).await {
            return Ok((ch, nonce));
        }
    }
    let mut ch = timeout(to.io_timeout, TcpStream::connect(to.control)).await.context("connecting the takeover channel: timed out")??;
    // One message at a time each way; no write waits for a delayed ACK.
    ch.set_nodelay(true)?;
    let nonce = start_on(&mut ch, to, &first, false).await?;
    Ok((ch, nonce))
}

async fn start_on(ch: &mut TcpStream, to: &Target, first: &impl Fn(&mut Vec<u8>, &Nonce) -> Result<()>, kept: bool) -> Result<Nonce> {
    // HELLO is the nonce alone.
    let mut nonce = [0u8; NONCE_LEN];
    timeout(to.io_timeout, ch.read_exact(&mut nonce)).await.context("reading the takeover channel's nonce: timed out")??;
    // A kept channel's HELLO may have come before its server stopped (a
    // restart, its idle time): then the close is behind it, and the
    // handoff goes on a new channel instead of failing on this one. Open
    // means nothing more to read yet.
    if kept {
        let open = poll_fn(|cx| Poll::Ready(ch.poll_peek(cx, &mut ReadBuf::new(&mut [0u8; 1])).is_pending())).await;
        anyhow::ensure!(open, "the kept channel was closed");
    }
    send_frame(ch, to.io_timeout, |w| first(w, &nonce)).await?;
    Ok(nonce)
}

/// Sends the frame `write` makes, within `limit`.
pub(crate) async fn send_frame(ch: &mut TcpStream, limit: Duration, write: impl FnOnce(&mut Vec<u8>) -> Result<()>) -> Result<()> {
    let mut frame = Vec::new();
    write(&mut frame)?;
    timeout(limit, ch.write_all(&frame)).await.context("writing to the takeover channel: timed out")??;
    Ok(())
}

/// Reads one frame off the channel within `limit`, for `channel`'s codecs
/// to check and parse. Exactly one: the server's HELLO for the next
/// handoff may follow it.
pub(crate) async fn read_frame(ch: &mut TcpStream, limit: Duration) -> Result<Vec<u8>> {
    let read = async {
        let mut frame = vec![0u8; FRAME_HEAD];
        ch.read_exact(&mut frame).await?;
        let rest = channel::frame_rest(frame[..].try_into().expect("FRAME_HEAD bytes"))?;
        frame.resize(FRAME_HEAD + rest, 0);
        ch.read_exact(&mut frame[FRAME_HEAD..]).await?;
        anyhow::Ok(frame)
    };
    timeout(limit, read).await.context("reading the takeover channel: timed out")?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// At most `KEPT` channels are kept; the one kept last is taken first.
    #[tokio::test]
    async fn kept_channels_are_bounded_and_the_last_kept_goes_first() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let channels = Channels::default();
        let mut ports = Vec::new();
        for _ in 0..Channels::KEPT + 3 {
            let ch = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
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

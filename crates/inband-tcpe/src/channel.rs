//! The takeover channel: how a balancer hands a connection to a server
//! (docs/tcpe.md, "The takeover channel"). A TCP connection from the
//! balancer to the server's control port, carrying handoffs one after
//! another, each:
//!
//! ```text
//! server   -> balancer  HELLO    nonce (16 random bytes)
//! balancer -> server    HANDOFF  connection ID, key halves (masked), join deadline, request bytes
//! server   -> balancer  REPLY    accepted, or why not
//! server   -> balancer  VERDICT  joined, or expired (only after an accepted REPLY)
//! ```
//!
//! Each message after HELLO is a frame `type (1) | body length (4, BE) |
//! body | MAC (8, LE)`, the MAC SipHash-2-4 under the key the balancers
//! and agents already share (`inband keygen`, inband-core's `wire::Key`)
//! of "TCPE-channel", the nonce, the type and the body. The server's fresh
//! nonce for each handoff makes a recorded HANDOFF or VERDICT worthless
//! in any other, on this channel or another; each type occurs once per
//! nonce, so one cannot stand in for another.
//! The connection's key halves are XORed with SipHash of the nonce under
//! the shared key, so that the channel does not show them to whoever
//! watches the servers' network (the request bytes are not masked: the
//! client sent them in clear).

use std::io::{Read, Write};

use anyhow::{bail, Context, Result};
use inband_core::wire::Key;

use crate::wire::Keys;

pub const NONCE_LEN: usize = 16;
/// The largest request a HANDOFF carries: a request head and the little
/// that may follow it (a larger one stays on the proxy).
pub const MAX_REQUEST: usize = 64 * 1024;
const HANDOFF_FIXED: usize = 4 + 16 + 4 + 4;
const MAX_BODY: usize = HANDOFF_FIXED + MAX_REQUEST;

const T_HANDOFF: u8 = 1;
const T_REPLY: u8 = 2;
const T_VERDICT: u8 = 3;

pub type Nonce = [u8; NONCE_LEN];

/// What the balancer hands over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    pub conn_id: u32,
    pub keys: Keys,
    /// How long the server waits for the client's join before it gives
    /// the connection back (VERDICT expired).
    pub deadline_ms: u32,
    /// The bytes the balancer read from the client and did not answer: the
    /// server's origin gets them first.
    pub request: Vec<u8>,
}

/// The server's answer to a HANDOFF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Accepted,
    /// Its table of pending handoffs is full.
    Full,
    /// It already waits for a join with this connection ID.
    Duplicate,
    /// Its origin did not take a connection.
    NoOrigin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The client joined: the server serves the connection from now on.
    Joined,
    /// No valid join before the deadline: the connection stays with the
    /// balancer, and the server no longer accepts a join for it.
    Expired,
}

fn mac(key: &Key, nonce: &Nonce, ty: u8, body: &[u8]) -> u64 {
    let mut m = Vec::with_capacity(12 + NONCE_LEN + 1 + body.len());
    m.extend_from_slice(b"TCPE-channel");
    m.extend_from_slice(nonce);
    m.push(ty);
    m.extend_from_slice(body);
    key.siphash(&m)
}

fn mask(key: &Key, nonce: &Nonce, i: u8) -> u64 {
    let mut m = Vec::with_capacity(9 + NONCE_LEN + 1);
    m.extend_from_slice(b"TCPE-keys");
    m.extend_from_slice(nonce);
    m.push(i);
    key.siphash(&m)
}

fn send(w: &mut impl Write, key: &Key, nonce: &Nonce, ty: u8, body: &[u8]) -> Result<()> {
    let mut f = Vec::with_capacity(5 + body.len() + 8);
    f.push(ty);
    f.extend_from_slice(&(body.len() as u32).to_be_bytes());
    f.extend_from_slice(body);
    f.extend_from_slice(&mac(key, nonce, ty, body).to_le_bytes());
    w.write_all(&f).context("writing to the takeover channel")
}

/// Reads one frame of type `ty` and checks its MAC; its body.
fn recv(r: &mut impl Read, key: &Key, nonce: &Nonce, ty: u8) -> Result<Vec<u8>> {
    let mut h = [0u8; 5];
    r.read_exact(&mut h).context("reading the takeover channel")?;
    if h[0] != ty {
        bail!("takeover channel: message type {} where {ty} was due", h[0]);
    }
    let len = u32::from_be_bytes(h[1..].try_into().unwrap()) as usize;
    if len > MAX_BODY {
        bail!("takeover channel: a {len}-byte message (at most {MAX_BODY})");
    }
    let mut body = vec![0u8; len + 8];
    r.read_exact(&mut body).context("reading the takeover channel")?;
    let got = u64::from_le_bytes(body[len..].try_into().unwrap());
    body.truncate(len);
    if got != mac(key, nonce, ty, &body) {
        bail!(MacError);
    }
    Ok(body)
}

/// A frame whose MAC did not verify (told apart from I/O errors so that
/// both ends count it).
#[derive(Debug)]
pub struct MacError;

impl std::fmt::Display for MacError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("takeover channel: bad MAC (is the same key configured on the balancer and the server?)")
    }
}

impl std::error::Error for MacError {}

pub fn send_hello(w: &mut impl Write, nonce: &Nonce) -> Result<()> {
    w.write_all(nonce).context("writing the takeover channel's nonce")
}

pub fn recv_hello(r: &mut impl Read) -> Result<Nonce> {
    let mut n = [0u8; NONCE_LEN];
    r.read_exact(&mut n).context("reading the takeover channel's nonce")?;
    Ok(n)
}

pub fn send_handoff(w: &mut impl Write, key: &Key, nonce: &Nonce, h: &Handoff) -> Result<()> {
    if h.request.len() > MAX_REQUEST {
        bail!("a {}-byte request is too large to hand off (at most {MAX_REQUEST})", h.request.len());
    }
    let mut b = Vec::with_capacity(HANDOFF_FIXED + h.request.len());
    b.extend_from_slice(&h.conn_id.to_be_bytes());
    b.extend_from_slice(&(h.keys.active ^ mask(key, nonce, 0)).to_le_bytes());
    b.extend_from_slice(&(h.keys.passive ^ mask(key, nonce, 1)).to_le_bytes());
    b.extend_from_slice(&h.deadline_ms.to_be_bytes());
    b.extend_from_slice(&(h.request.len() as u32).to_be_bytes());
    b.extend_from_slice(&h.request);
    send(w, key, nonce, T_HANDOFF, &b)
}

pub fn recv_handoff(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Handoff> {
    let b = recv(r, key, nonce, T_HANDOFF)?;
    if b.len() < HANDOFF_FIXED {
        bail!("takeover channel: a HANDOFF of {} bytes", b.len());
    }
    let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let len = u32_at(24) as usize;
    if len != b.len() - HANDOFF_FIXED {
        bail!("takeover channel: a HANDOFF announcing {len} request bytes carries {}", b.len() - HANDOFF_FIXED);
    }
    Ok(Handoff {
        conn_id: u32_at(0),
        keys: Keys { active: u64_at(4) ^ mask(key, nonce, 0), passive: u64_at(12) ^ mask(key, nonce, 1) },
        deadline_ms: u32_at(20),
        request: b[HANDOFF_FIXED..].to_vec(),
    })
}

pub fn send_reply(w: &mut impl Write, key: &Key, nonce: &Nonce, r: Reply) -> Result<()> {
    let code = match r {
        Reply::Accepted => 0,
        Reply::Full => 1,
        Reply::Duplicate => 2,
        Reply::NoOrigin => 3,
    };
    send(w, key, nonce, T_REPLY, &[code])
}

pub fn recv_reply(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Reply> {
    match recv(r, key, nonce, T_REPLY)?.as_slice() {
        [0] => Ok(Reply::Accepted),
        [1] => Ok(Reply::Full),
        [2] => Ok(Reply::Duplicate),
        [3] => Ok(Reply::NoOrigin),
        b => bail!("takeover channel: a REPLY of {b:02x?}"),
    }
}

pub fn send_verdict(w: &mut impl Write, key: &Key, nonce: &Nonce, v: Verdict) -> Result<()> {
    send(w, key, nonce, T_VERDICT, &[matches!(v, Verdict::Expired) as u8])
}

pub fn recv_verdict(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Verdict> {
    match recv(r, key, nonce, T_VERDICT)?.as_slice() {
        [0] => Ok(Verdict::Joined),
        [1] => Ok(Verdict::Expired),
        b => bail!("takeover channel: a VERDICT of {b:02x?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_round_trip_masks_keys_and_refuses_tampering() {
        let key = Key([7; 16]);
        let nonce = [3; NONCE_LEN];
        let h = Handoff { conn_id: 9, keys: Keys { active: 11, passive: 12 }, deadline_ms: 500, request: b"GET / HTTP/1.1\r\n\r\n".to_vec() };
        let mut b = Vec::new();
        send_handoff(&mut b, &key, &nonce, &h).unwrap();
        assert!(!b.windows(8).any(|w| w == 11u64.to_le_bytes()), "the key halves travel masked");
        assert_eq!(recv_handoff(&mut b.as_slice(), &key, &nonce).unwrap(), h);
        // Another channel's nonce, another key, a flipped byte: refused.
        assert!(recv_handoff(&mut b.as_slice(), &key, &[4; NONCE_LEN]).unwrap_err().is::<MacError>());
        assert!(recv_handoff(&mut b.as_slice(), &Key([8; 16]), &nonce).unwrap_err().is::<MacError>());
        let mut t = b.clone();
        t[10] ^= 1;
        assert!(recv_handoff(&mut t.as_slice(), &key, &nonce).unwrap_err().is::<MacError>());
        // A VERDICT cannot stand in for the REPLY.
        let mut v = Vec::new();
        send_verdict(&mut v, &key, &nonce, Verdict::Joined).unwrap();
        assert!(recv_reply(&mut v.as_slice(), &key, &nonce).is_err());
        // A length past the bound is refused before anything is allocated.
        let mut big = vec![T_HANDOFF];
        big.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(recv_handoff(&mut big.as_slice(), &key, &nonce).is_err());
    }
}

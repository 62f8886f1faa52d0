//! The takeover channel: how a balancer hands a connection to a server
//! (docs/tcpe.md, "The takeover channel"). A TCP connection from the
//! balancer to the server's control port, carrying handoffs one after
//! another, each:
//!
//! ```text
//! server   -> balancer  HELLO    nonce (16 random bytes)
//! balancer -> server    HANDOFF  connection ID, key halves (masked), join deadline, request bytes
//! server   -> balancer  REPLY    why it refuses: full, duplicate, no origin
//!                   or  VERDICT  joined, or expired (it took the handoff and waited for the join)
//! ```
//!
//! One answer to each HANDOFF: the balancer tells the client to join as it
//! sends the HANDOFF, so an acceptance before the join would only wake it
//! once more (docs/tcpe.md, "The walk of a handed-off connection").
//!
//! or, for the transparent handoff of a client without TCPE (docs/tcpe.md,
//! "The transparent handoff"):
//!
//! ```text
//! server   -> balancer  HELLO    nonce
//! balancer -> server    MOVE     the frozen connection, the client it stands for, its timestamp shift
//! server   -> balancer  READY    rebuilt (in repair mode: it sends nothing yet), or why not
//! balancer -> server    GO       the L4 balancer sends the connection here now (from the source port it names), or the move is called off
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
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use anyhow::{bail, Context, Result};
use inband_core::wire::Key;

use crate::repair::{Frozen, RepairWindow};
use crate::wire::Keys;

pub const NONCE_LEN: usize = 16;
/// The largest request a HANDOFF carries: a request head and the little
/// that may follow it (a larger one stays on the proxy).
pub const MAX_REQUEST: usize = 64 * 1024;
const HANDOFF_FIXED: usize = 4 + 16 + 4 + 4;
const MOVE_FIXED: usize = 3 * 18 + 4 + 4 + 2 + 4 + 4 + 4 + 20 + 4;
const MAX_BODY: usize = MOVE_FIXED + MAX_REQUEST;

const T_HANDOFF: u8 = 1;
const T_REPLY: u8 = 2;
const T_VERDICT: u8 = 3;
const T_MOVE: u8 = 4;
const T_READY: u8 = 5;
const T_GO: u8 = 6;

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

/// Why the server refuses a HANDOFF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
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
    recv_one_of(r, key, nonce, &[ty]).map(|(_, body)| body)
}

/// A frame's header: its type and its body's length.
pub const FRAME_HEAD: usize = 5;

/// How many bytes follow the frame header `h` (its body and MAC), or why
/// the frame is refused before they are read.
pub fn frame_rest(h: &[u8; FRAME_HEAD]) -> Result<usize> {
    let len = u32::from_be_bytes(h[1..].try_into().unwrap()) as usize;
    if len > MAX_BODY {
        bail!("takeover channel: a {len}-byte message (at most {MAX_BODY})");
    }
    Ok(len + 8)
}

/// Reads one frame of one of the types `tys` and checks its MAC; its type
/// and body.
fn recv_one_of(r: &mut impl Read, key: &Key, nonce: &Nonce, tys: &[u8]) -> Result<(u8, Vec<u8>)> {
    let mut h = [0u8; FRAME_HEAD];
    r.read_exact(&mut h).context("reading the takeover channel")?;
    let ty = h[0];
    if !tys.contains(&ty) {
        bail!("takeover channel: message type {ty} where one of {tys:?} was due");
    }
    let len = frame_rest(&h)? - 8;
    let mut body = vec![0u8; len + 8];
    r.read_exact(&mut body).context("reading the takeover channel")?;
    let got = u64::from_le_bytes(body[len..].try_into().unwrap());
    body.truncate(len);
    if got != mac(key, nonce, ty, &body) {
        bail!(MacError);
    }
    Ok((ty, body))
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

#[cfg(test)]
fn recv_handoff(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Handoff> {
    match recv_request(r, key, nonce)? {
        Request::Handoff(h) => Ok(h),
        Request::Move(_) => bail!("a MOVE where a HANDOFF was due"),
    }
}

/// What a balancer asks for after a HELLO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Handoff(Handoff),
    Move(Box<Move>),
}

pub fn recv_request(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Request> {
    match recv_one_of(r, key, nonce, &[T_HANDOFF, T_MOVE])? {
        (T_HANDOFF, b) => decode_handoff(b, key, nonce).map(Request::Handoff),
        (_, b) => decode_move(&b).map(|m| Request::Move(Box::new(m))),
    }
}

fn decode_handoff(b: Vec<u8>, key: &Key, nonce: &Nonce) -> Result<Handoff> {
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
        Reply::Full => 1,
        Reply::Duplicate => 2,
        Reply::NoOrigin => 3,
    };
    send(w, key, nonce, T_REPLY, &[code])
}

pub fn send_verdict(w: &mut impl Write, key: &Key, nonce: &Nonce, v: Verdict) -> Result<()> {
    send(w, key, nonce, T_VERDICT, &[matches!(v, Verdict::Expired) as u8])
}

/// The server's one answer to a HANDOFF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffAnswer {
    Refused(Reply),
    Verdict(Verdict),
}

pub fn recv_answer(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<HandoffAnswer> {
    match recv_one_of(r, key, nonce, &[T_REPLY, T_VERDICT])? {
        (T_REPLY, b) => match b.as_slice() {
            [1] => Ok(HandoffAnswer::Refused(Reply::Full)),
            [2] => Ok(HandoffAnswer::Refused(Reply::Duplicate)),
            [3] => Ok(HandoffAnswer::Refused(Reply::NoOrigin)),
            b => bail!("takeover channel: a REPLY of {b:02x?}"),
        },
        (_, b) => match b.as_slice() {
            [0] => Ok(HandoffAnswer::Verdict(Verdict::Joined)),
            [1] => Ok(HandoffAnswer::Verdict(Verdict::Expired)),
            b => bail!("takeover channel: a VERDICT of {b:02x?}"),
        },
    }
}

/// A connection the balancer froze, for the server to rebuild (the
/// transparent handoff).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// Its state; `local` is the server's own address and port as the L4
    /// balancer sends the connection there, `peer` the balancer's tuple.
    pub frozen: Frozen,
    /// The client the balancer's tuple stands for: where the server's
    /// agent sends the responses (its `dsr_flows` entry).
    pub client: SocketAddr,
    /// The entry's timestamp shift (agent/time_wait.h), carried over so
    /// that the client's timestamps look the same to the new socket.
    pub ts_shift: u32,
}

/// The server's answer to a MOVE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// Rebuilt, in repair mode: it waits for GO.
    Ready,
    /// `max_sessions` sessions are running.
    Full,
    /// Its origin did not take a connection.
    NoOrigin,
    /// The kernel refused to rebuild it (an address not this host's, the
    /// tuple in use).
    Unrestorable,
}

fn put_addr(b: &mut Vec<u8>, a: SocketAddr) {
    let ip = match a.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    b.extend_from_slice(&ip.octets());
    b.extend_from_slice(&a.port().to_be_bytes());
}

fn addr_at(b: &[u8]) -> SocketAddr {
    let a = Ipv6Addr::from(<[u8; 16]>::try_from(&b[..16]).unwrap());
    let port = u16::from_be_bytes([b[16], b[17]]);
    match a.to_ipv4_mapped() {
        Some(v4) => SocketAddr::new(IpAddr::V4(v4), port),
        None => SocketAddr::new(IpAddr::V6(a), port),
    }
}

const MOVE_WSCALE: u8 = 1;
const MOVE_SACK: u8 = 2;
const MOVE_TIMESTAMPS: u8 = 4;

pub fn send_move(w: &mut impl Write, key: &Key, nonce: &Nonce, m: &Move) -> Result<()> {
    let f = &m.frozen;
    if f.received.len() > MAX_REQUEST {
        bail!("a {}-byte request is too large to move (at most {MAX_REQUEST})", f.received.len());
    }
    let mut b = Vec::with_capacity(MOVE_FIXED + f.received.len());
    put_addr(&mut b, f.local);
    put_addr(&mut b, f.peer);
    put_addr(&mut b, m.client);
    b.extend_from_slice(&f.snd_seq.to_be_bytes());
    b.extend_from_slice(&f.rcv_seq.to_be_bytes());
    b.extend_from_slice(&f.mss.to_be_bytes());
    let (snd_ws, rcv_ws) = f.wscale.unwrap_or((0, 0));
    let flags = if f.wscale.is_some() { MOVE_WSCALE } else { 0 }
        | if f.sack { MOVE_SACK } else { 0 }
        | if f.ts_now.is_some() { MOVE_TIMESTAMPS } else { 0 };
    b.extend_from_slice(&[snd_ws, rcv_ws, flags, 0]);
    b.extend_from_slice(&f.ts_now.unwrap_or(0).to_be_bytes());
    b.extend_from_slice(&m.ts_shift.to_be_bytes());
    let w5 = &f.window;
    for v in [w5.snd_wl1, w5.snd_wnd, w5.max_window, w5.rcv_wnd, w5.rcv_wup] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    b.extend_from_slice(&(f.received.len() as u32).to_be_bytes());
    b.extend_from_slice(&f.received);
    send(w, key, nonce, T_MOVE, &b)
}

fn decode_move(b: &[u8]) -> Result<Move> {
    if b.len() < MOVE_FIXED {
        bail!("takeover channel: a MOVE of {} bytes", b.len());
    }
    let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
    let (local, peer, client) = (addr_at(&b[0..]), addr_at(&b[18..]), addr_at(&b[36..]));
    if local.is_ipv4() != peer.is_ipv4() || peer.is_ipv4() != client.is_ipv4() {
        bail!("takeover channel: a MOVE mixing IPv4 and IPv6");
    }
    let [snd_ws, rcv_ws, flags, pad] = b[64..68].try_into().unwrap();
    if flags & !(MOVE_WSCALE | MOVE_SACK | MOVE_TIMESTAMPS) != 0 || pad != 0 || snd_ws > 14 || rcv_ws > 14 {
        bail!("takeover channel: a MOVE with options {snd_ws} {rcv_ws} {flags:#x} {pad}");
    }
    let len = u32_at(96) as usize;
    if len != b.len() - MOVE_FIXED {
        bail!("takeover channel: a MOVE announcing {len} received bytes carries {}", b.len() - MOVE_FIXED);
    }
    let frozen = Frozen {
        local,
        peer,
        snd_seq: u32_at(54),
        rcv_seq: u32_at(58),
        received: b[MOVE_FIXED..].to_vec(),
        mss: u16::from_be_bytes([b[62], b[63]]),
        wscale: (flags & MOVE_WSCALE != 0).then_some((snd_ws, rcv_ws)),
        sack: flags & MOVE_SACK != 0,
        ts_now: (flags & MOVE_TIMESTAMPS != 0).then(|| u32_at(68)),
        window: RepairWindow { snd_wl1: u32_at(76), snd_wnd: u32_at(80), max_window: u32_at(84), rcv_wnd: u32_at(88), rcv_wup: u32_at(92) },
    };
    Ok(Move { frozen, client, ts_shift: u32_at(72) })
}

pub fn send_ready(w: &mut impl Write, key: &Key, nonce: &Nonce, r: Ready) -> Result<()> {
    let code = match r {
        Ready::Ready => 0,
        Ready::Full => 1,
        Ready::NoOrigin => 3,
        Ready::Unrestorable => 4,
    };
    send(w, key, nonce, T_READY, &[code])
}

pub fn recv_ready(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Ready> {
    match recv(r, key, nonce, T_READY)?.as_slice() {
        [0] => Ok(Ready::Ready),
        [1] => Ok(Ready::Full),
        [3] => Ok(Ready::NoOrigin),
        [4] => Ok(Ready::Unrestorable),
        b => bail!("takeover channel: a READY of {b:02x?}"),
    }
}

/// `go`: Some(port): the L4 balancer sends the connection to the server
/// now, from the balancer's source port `port` (the frozen one, or the
/// one the balancer gave it when that was held toward the server); None:
/// the move is called off, and the server drops what it rebuilt without a
/// word.
pub fn send_go(w: &mut impl Write, key: &Key, nonce: &Nonce, go: Option<u16>) -> Result<()> {
    match go {
        Some(port) => {
            let [hi, lo] = port.to_be_bytes();
            send(w, key, nonce, T_GO, &[1, hi, lo])
        }
        None => send(w, key, nonce, T_GO, &[0]),
    }
}

pub fn recv_go(r: &mut impl Read, key: &Key, nonce: &Nonce) -> Result<Option<u16>> {
    match recv(r, key, nonce, T_GO)?.as_slice() {
        [0] => Ok(None),
        [1, hi, lo] if [*hi, *lo] != [0, 0] => Ok(Some(u16::from_be_bytes([*hi, *lo]))),
        b => bail!("takeover channel: a GO of {b:02x?}"),
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
        // Either answer, each under its own type: a VERDICT's body under
        // a REPLY's type does not verify, and a REPLY of 0 (no refusal) is
        // refused.
        for a in [HandoffAnswer::Verdict(Verdict::Joined), HandoffAnswer::Verdict(Verdict::Expired), HandoffAnswer::Refused(Reply::Full), HandoffAnswer::Refused(Reply::NoOrigin)] {
            let mut v = Vec::new();
            match a {
                HandoffAnswer::Verdict(x) => send_verdict(&mut v, &key, &nonce, x).unwrap(),
                HandoffAnswer::Refused(x) => send_reply(&mut v, &key, &nonce, x).unwrap(),
            }
            assert_eq!(recv_answer(&mut v.as_slice(), &key, &nonce).unwrap(), a);
        }
        let mut v = Vec::new();
        send_verdict(&mut v, &key, &nonce, Verdict::Joined).unwrap();
        v[0] = T_REPLY;
        assert!(recv_answer(&mut v.as_slice(), &key, &nonce).unwrap_err().is::<MacError>());
        let mut z = Vec::new();
        send(&mut z, &key, &nonce, T_REPLY, &[0]).unwrap();
        assert!(recv_answer(&mut z.as_slice(), &key, &nonce).is_err());
        // A HANDOFF is no answer.
        assert!(recv_answer(&mut b.as_slice(), &key, &nonce).is_err());
        // A length past the bound is refused before anything is allocated.
        let mut big = vec![T_HANDOFF];
        big.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(recv_handoff(&mut big.as_slice(), &key, &nonce).is_err());
    }

    fn a_move() -> Move {
        Move {
            frozen: Frozen {
                local: "10.0.0.22:80".parse().unwrap(),
                peer: "10.0.0.2:1030".parse().unwrap(),
                snd_seq: 0x1122_3344,
                rcv_seq: 0xfedc_ba98,
                received: b"GET / HTTP/1.1\r\nHost: v\r\n\r\n".to_vec(),
                mss: 1448,
                wscale: Some((7, 9)),
                sack: true,
                ts_now: Some(123_456),
                window: RepairWindow { snd_wl1: 1, snd_wnd: 2, max_window: 3, rcv_wnd: 4, rcv_wup: 5 },
            },
            client: "192.0.2.7:40000".parse().unwrap(),
            ts_shift: 77,
        }
    }

    #[test]
    fn a_move_round_trips_and_its_exchange_refuses_tampering() {
        let key = Key([7; 16]);
        let nonce = [3; NONCE_LEN];
        let m = a_move();
        let mut b = Vec::new();
        send_move(&mut b, &key, &nonce, &m).unwrap();
        assert_eq!(recv_request(&mut b.as_slice(), &key, &nonce).unwrap(), Request::Move(Box::new(m.clone())));
        // No options at all, and IPv6.
        let bare = Move {
            frozen: Frozen { wscale: None, sack: false, ts_now: None, local: "[fd00::22]:80".parse().unwrap(), peer: "[fd00::2]:1030".parse().unwrap(), ..m.frozen.clone() },
            client: "[2001:db8::7]:40000".parse().unwrap(),
            ..m.clone()
        };
        let mut b6 = Vec::new();
        send_move(&mut b6, &key, &nonce, &bare).unwrap();
        assert_eq!(recv_request(&mut b6.as_slice(), &key, &nonce).unwrap(), Request::Move(Box::new(bare)));
        // Every byte of it is covered by the MAC.
        for i in 0..b.len() {
            let mut t = b.clone();
            t[i] ^= 0x10;
            assert!(recv_request(&mut t.as_slice(), &key, &nonce).is_err(), "byte {i} flipped was taken");
        }
        // A MOVE cannot stand in for a HANDOFF's answer, nor GO for READY.
        assert!(recv_answer(&mut b.as_slice(), &key, &nonce).is_err());
        let mut go = Vec::new();
        send_go(&mut go, &key, &nonce, Some(1030)).unwrap();
        assert!(recv_ready(&mut go.as_slice(), &key, &nonce).is_err());
        assert_eq!(recv_go(&mut go.as_slice(), &key, &nonce).unwrap(), Some(1030));
        assert!(recv_go(&mut go.as_slice(), &key, &[4; NONCE_LEN]).unwrap_err().is::<MacError>());
        let mut off = Vec::new();
        send_go(&mut off, &key, &nonce, None).unwrap();
        assert_eq!(recv_go(&mut off.as_slice(), &key, &nonce).unwrap(), None);
        let mut zero = Vec::new();
        send(&mut zero, &key, &nonce, T_GO, &[1, 0, 0]).unwrap();
        assert!(recv_go(&mut zero.as_slice(), &key, &nonce).is_err(), "a GO from port 0");
        for r in [Ready::Ready, Ready::Full, Ready::NoOrigin, Ready::Unrestorable] {
            let mut v = Vec::new();
            send_ready(&mut v, &key, &nonce, r).unwrap();
            assert_eq!(recv_ready(&mut v.as_slice(), &key, &nonce).unwrap(), r);
        }
        // A signed MOVE with fields no balancer writes is refused.
        let mut bad = m.clone();
        bad.client = "[2001:db8::7]:40000".parse().unwrap();
        let mut t = Vec::new();
        send_move(&mut t, &key, &nonce, &bad).unwrap();
        assert!(recv_request(&mut t.as_slice(), &key, &nonce).is_err(), "mixed families");
        let mut bad = m.clone();
        bad.frozen.wscale = Some((15, 0));
        let mut t = Vec::new();
        send_move(&mut t, &key, &nonce, &bad).unwrap();
        assert!(recv_request(&mut t.as_slice(), &key, &nonce).is_err(), "a window scale past 14");
    }
}

//! The flow-move protocol: how the host that owns a connection behind
//! `inband lb` (an `inband proxy` that read the request) asks the balancer
//! to send the connection's next packets to another backend of its VIP,
//! the server that has just rebuilt the connection from its frozen state
//! (the transparent handoff, docs/tcpe.md). One UDP datagram asks, one
//! answers. Shared by the asker (`inband-tcpe`'s `transparent`) and the
//! balancer (`inband-lb`'s `moves`).
//!
//! ```text
//! request: "IBM1" | key id (1) | 0 (3) | sequence (8)
//!          | client address (16) | client port (2) | VIP port (2) | VIP address (16) | protocol (1) | 0 (3)
//!          | from: address (16) | port (2)
//!          | to:   port (2) | address (16)
//!          | mac (8)                                                         100 bytes
//! reply:   "IBM2" | key id (1) | result (1) | source port (2) | sequence (8) | mac (8)   24 bytes
//! ```
//!
//! Integers in network order, addresses as 16 bytes (IPv4 as
//! `::ffff:a.b.c.d`, as in the maps); `mac` is SipHash-2-4 under key `key
//! id` (the `[auth]` keys the balancers and agents share) of every byte
//! before it. Only the authenticated format exists: a move redirects a
//! live connection, which nobody may ask for on a source address alone.
//!
//! Trust: every byte is the network's. The balancer takes a request only
//! under a key it holds, from the address the request names as `from`,
//! when `from` is the backend the flow goes to now and `to` a backend of
//! the same VIP that is up, and with a sequence number above the last one
//! that sender used (the sender's wall clock in microseconds, so a
//! restarted sender goes on above its old numbers): a recorded request is
//! worthless once replayed. The reply echoes the sequence number, so the
//! asker takes only the answer to its own request.
//!
//! A moved connection keeps the balancer's source port unless another
//! connection holds that port toward `to`: then the balancer gives it one
//! that is free there, and the reply's source port (the one the
//! connection comes from toward `to` from now on; 0 unless moved) tells
//! the asker, which has the server rebuild its socket with it. A request
//! for a flow that already goes to `to` is answered `Moved` with its
//! port and changes nothing, so a retry after a lost answer learns the
//! outcome.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::poll_wire::{key_of, signed};
use crate::wire::Key;

pub const REQUEST_LEN: usize = 100;
pub const REPLY_LEN: usize = 24;
/// One byte longer than the longest message, so that a longer datagram is
/// seen as longer instead of being truncated into a valid one.
pub const MAX_LEN: usize = REQUEST_LEN + 1;

/// A connection as the balancer keys it: its client side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowSide {
    pub client: SocketAddr,
    pub vip: SocketAddr,
    /// IPPROTO_TCP or IPPROTO_UDP.
    pub proto: u8,
}

/// A request: move `flow` from backend `from` to backend `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoveRequest {
    pub key_id: u8,
    pub seq: u64,
    pub flow: FlowSide,
    pub from: SocketAddr,
    pub to: SocketAddr,
}

/// What the balancer did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The flow's packets go to `to` from now on (or went there already).
    Moved,
    /// No established flow with that client side.
    NoFlow,
    /// The flow does not go to `from`: only its backend may move it.
    NotOwner,
    /// `to` is not a backend of the flow's VIP, or it is down.
    NotABackend,
    /// Another connection holds the flow's source port toward `to`, and
    /// the balancer found no other free there.
    PortInUse,
    /// The sequence number was not above the sender's last, the flow has
    /// a fleet tuple (the other instances would not know of the move), or
    /// the balancer's table of senders is full.
    Refused,
}

impl MoveOutcome {
    fn code(self) -> u8 {
        match self {
            MoveOutcome::Moved => 0,
            MoveOutcome::NoFlow => 1,
            MoveOutcome::NotOwner => 2,
            MoveOutcome::NotABackend => 3,
            MoveOutcome::PortInUse => 4,
            MoveOutcome::Refused => 5,
        }
    }

    fn from_code(c: u8) -> Option<MoveOutcome> {
        Some(match c {
            0 => MoveOutcome::Moved,
            1 => MoveOutcome::NoFlow,
            2 => MoveOutcome::NotOwner,
            3 => MoveOutcome::NotABackend,
            4 => MoveOutcome::PortInUse,
            5 => MoveOutcome::Refused,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            MoveOutcome::Moved => "moved",
            MoveOutcome::NoFlow => "no_flow",
            MoveOutcome::NotOwner => "not_owner",
            MoveOutcome::NotABackend => "not_a_backend",
            MoveOutcome::PortInUse => "port_in_use",
            MoveOutcome::Refused => "refused",
        }
    }
}

/// An answer to the request with sequence number `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoveReply {
    pub seq: u64,
    pub outcome: MoveOutcome,
    /// With `Moved`: the balancer's source port toward `to` from now on.
    pub source_port: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveRefusal {
    /// Not a message of this protocol (length or magic): noise.
    NotOurs,
    /// No key of that id, or a MAC that does not verify.
    BadMac,
    /// Authenticated, but a field no sender writes (a nonzero pad, an
    /// unknown result, mixed address families).
    Malformed,
}

fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

fn ip_of(b: &[u8]) -> IpAddr {
    let a = Ipv6Addr::from(<[u8; 16]>::try_from(&b[..16]).unwrap());
    match a.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(a),
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn verified(buf: &[u8], keys: &[(u8, Key)]) -> Result<(), MoveRefusal> {
    let (body, mac) = buf.split_at(buf.len() - 8);
    let key = key_of(keys, body[4]).ok_or(MoveRefusal::BadMac)?;
    if key.siphash(body) != be64(mac) {
        return Err(MoveRefusal::BadMac);
    }
    Ok(())
}

pub fn encode_request(r: &MoveRequest, key: &Key) -> Vec<u8> {
    let mut b = Vec::with_capacity(REQUEST_LEN);
    b.extend_from_slice(b"IBM1");
    b.extend_from_slice(&[r.key_id, 0, 0, 0]);
    b.extend_from_slice(&r.seq.to_be_bytes());
    b.extend_from_slice(&addr16(r.flow.client.ip()));
    b.extend_from_slice(&r.flow.client.port().to_be_bytes());
    b.extend_from_slice(&r.flow.vip.port().to_be_bytes());
    b.extend_from_slice(&addr16(r.flow.vip.ip()));
    b.extend_from_slice(&[r.flow.proto, 0, 0, 0]);
    b.extend_from_slice(&addr16(r.from.ip()));
    b.extend_from_slice(&r.from.port().to_be_bytes());
    b.extend_from_slice(&r.to.port().to_be_bytes());
    b.extend_from_slice(&addr16(r.to.ip()));
    signed(b, key)
}

/// The id of the key the request in `buf` names, so that its receiver can
/// fetch that key alone; None if `buf` is no request.
pub fn request_key_id(buf: &[u8]) -> Option<u8> {
    (buf.len() == REQUEST_LEN && buf[..4] == *b"IBM1").then(|| buf[4])
}

pub fn decode_request(buf: &[u8], keys: &[(u8, Key)]) -> Result<MoveRequest, MoveRefusal> {
    if buf.len() != REQUEST_LEN || buf[..4] != *b"IBM1" {
        return Err(MoveRefusal::NotOurs);
    }
    verified(buf, keys)?;
    if buf[5..8] != [0; 3] || buf[53..56] != [0; 3] {
        return Err(MoveRefusal::Malformed);
    }
    let client = SocketAddr::new(ip_of(&buf[16..]), be16(&buf[32..]));
    let vip = SocketAddr::new(ip_of(&buf[36..]), be16(&buf[34..]));
    let from = SocketAddr::new(ip_of(&buf[56..]), be16(&buf[72..]));
    let to = SocketAddr::new(ip_of(&buf[76..]), be16(&buf[74..]));
    let v4 = client.is_ipv4();
    if vip.is_ipv4() != v4 || from.is_ipv4() != to.is_ipv4() {
        return Err(MoveRefusal::Malformed);
    }
    Ok(MoveRequest { key_id: buf[4], seq: be64(&buf[8..]), flow: FlowSide { client, vip, proto: buf[52] }, from, to })
}

/// The answer to `req` under its key; None if that key is gone.
/// `source_port`: with `Moved`, the flow's source port toward `to` (0
/// otherwise).
pub fn encode_reply(req: &MoveRequest, outcome: MoveOutcome, source_port: u16, keys: &[(u8, Key)]) -> Option<Vec<u8>> {
    let key = key_of(keys, req.key_id)?;
    let port = if outcome == MoveOutcome::Moved { source_port } else { 0 };
    let body = [&b"IBM2"[..], &[req.key_id, outcome.code()], &port.to_be_bytes(), &req.seq.to_be_bytes()].concat();
    Some(signed(body, key))
}

pub fn decode_reply(buf: &[u8], keys: &[(u8, Key)]) -> Result<MoveReply, MoveRefusal> {
    if buf.len() != REPLY_LEN || buf[..4] != *b"IBM2" {
        return Err(MoveRefusal::NotOurs);
    }
    verified(buf, keys)?;
    let outcome = MoveOutcome::from_code(buf[5]).ok_or(MoveRefusal::Malformed)?;
    let source_port = be16(&buf[6..]);
    // A port only with Moved, and a real one then.
    if (outcome == MoveOutcome::Moved) != (source_port != 0) {
        return Err(MoveRefusal::Malformed);
    }
    Ok(MoveReply { seq: be64(&buf[8..]), outcome, source_port })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> MoveRequest {
        MoveRequest {
            key_id: 3,
            seq: 0x0102_0304_0506_0708,
            flow: FlowSide { client: "10.0.0.10:40000".parse().unwrap(), vip: "10.0.0.100:80".parse().unwrap(), proto: 6 },
            from: "10.0.0.21:8080".parse().unwrap(),
            to: "10.0.0.22:80".parse().unwrap(),
        }
    }

    #[test]
    fn a_request_and_its_reply_round_trip_and_refuse_tampering() {
        let key = Key([9; 16]);
        let keys = [(3u8, key)];
        let r = request();
        let b = encode_request(&r, &key);
        assert_eq!(b.len(), REQUEST_LEN);
        assert_eq!(&b[..8], b"IBM1\x03\0\0\0");
        // The client's address as the maps hold it: ::ffff:10.0.0.10.
        assert_eq!(&b[16..32], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 10]);
        assert_eq!(decode_request(&b, &keys), Ok(r));
        // The key it names, found before any key is read; none for what is no request.
        assert_eq!(request_key_id(&b), Some(3));
        assert_eq!(request_key_id(&b[..99]), None);
        assert_eq!(request_key_id(&encode_reply(&r, MoveOutcome::Moved, 1030, &keys).unwrap()), None);
        for i in 0..REQUEST_LEN {
            let mut t = b.clone();
            t[i] ^= 0x40;
            assert!(decode_request(&t, &keys).is_err(), "byte {i} flipped was taken");
        }
        assert_eq!(decode_request(&b, &[(3, Key([8; 16]))]), Err(MoveRefusal::BadMac));
        assert_eq!(decode_request(&b, &[(4, key)]), Err(MoveRefusal::BadMac));
        assert_eq!(decode_request(&b[..99], &keys), Err(MoveRefusal::NotOurs));
        assert_eq!(decode_request(&[b.clone(), vec![0]].concat(), &keys), Err(MoveRefusal::NotOurs));

        let rep = encode_reply(&r, MoveOutcome::PortInUse, 1030, &keys).unwrap();
        assert_eq!(rep.len(), REPLY_LEN);
        assert_eq!(decode_reply(&rep, &keys), Ok(MoveReply { seq: r.seq, outcome: MoveOutcome::PortInUse, source_port: 0 }), "a port only with Moved");
        let moved = encode_reply(&r, MoveOutcome::Moved, 1030, &keys).unwrap();
        assert_eq!(&moved[..8], &[b'I', b'B', b'M', b'2', 3, 0, 0x04, 0x06]);
        assert_eq!(decode_reply(&moved, &keys), Ok(MoveReply { seq: r.seq, outcome: MoveOutcome::Moved, source_port: 1030 }));
        // A request is not a reply, nor the other way round.
        assert_eq!(decode_reply(&b, &keys), Err(MoveRefusal::NotOurs));
        assert_eq!(decode_request(&rep, &keys), Err(MoveRefusal::NotOurs));
        assert!(encode_reply(&r, MoveOutcome::Moved, 1030, &[(4, key)]).is_none());
    }

    #[test]
    fn signed_fields_no_sender_writes_are_malformed() {
        let key = Key([9; 16]);
        let keys = [(3u8, key)];
        let mut mixed = request();
        mixed.flow.vip = "[fd00::100]:80".parse().unwrap();
        assert_eq!(decode_request(&encode_request(&mixed, &key), &keys), Err(MoveRefusal::Malformed));
        let r = request();
        let rep = encode_reply(&r, MoveOutcome::Moved, 1030, &keys).unwrap();
        let resign = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut body = rep[..16].to_vec();
            f(&mut body);
            signed(body, &key)
        };
        assert_eq!(decode_reply(&resign(&|b| b[5] = 9), &keys), Err(MoveRefusal::Malformed), "an unknown result");
        assert_eq!(decode_reply(&resign(&|b| b[6..8].copy_from_slice(&[0, 0])), &keys), Err(MoveRefusal::Malformed), "moved without a port");
        assert_eq!(decode_reply(&resign(&|b| b[5] = 1), &keys), Err(MoveRefusal::Malformed), "a port without a move");
        let v6 = MoveRequest {
            flow: FlowSide { client: "[fd00::10]:40000".parse().unwrap(), vip: "[fd00::100]:80".parse().unwrap(), proto: 6 },
            from: "[fd00::21]:8080".parse().unwrap(),
            to: "[fd00::22]:80".parse().unwrap(),
            ..r
        };
        assert_eq!(decode_request(&encode_request(&v6, &key), &keys), Ok(v6));
    }
}

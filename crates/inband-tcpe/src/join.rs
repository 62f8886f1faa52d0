//! The join: the first bytes of a new subflow, which tie it to a TCPE
//! connection and prove that each end holds the connection's keys
//! (docs/decisions.md, "TCPE handoff: moving a connection").
//!
//! ```text
//! JOIN    (client -> server) "TCPJ" | version 1 | 0 0 0 | connection ID (4, BE) | MAC (8, LE)
//! JOIN-OK (server -> client) "TCPK" | version 1 | 0 0 0 | connection ID (4, BE) | MAC (8, LE)
//! ```
//!
//! The MAC is SipHash-2-4 under the connection's key halves (k0 the
//! client's, k1 the listener's: the path notifications' key) of the tag
//! "TCPEjoin", the sender's role, the connection ID and the subflow's
//! 4-tuple (client address and port, server address and port; IPv4 as
//! ::ffff:a.b.c.d). The tuple binds a join to the subflow it opens, so a
//! join seen on the wire cannot be replayed from another port; the role
//! keeps a JOIN from passing as a JOIN-OK. Only user space reads these
//! bytes (the sockops program never does), so this module is their one
//! definition, not a C header.

use std::hash::Hasher;
use std::net::{IpAddr, SocketAddr};

use siphasher::sip::SipHasher24;

use crate::wire::{Keys, Role};

pub const JOIN_LEN: usize = 20;
const VERSION: u8 = 1;
const MAGIC_JOIN: [u8; 4] = *b"TCPJ";
const MAGIC_OK: [u8; 4] = *b"TCPK";

/// The two messages, told apart by their magic (and their MAC's role).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Join,
    Ok,
}

impl Kind {
    fn magic(self) -> [u8; 4] {
        match self {
            Kind::Join => MAGIC_JOIN,
            Kind::Ok => MAGIC_OK,
        }
    }

    /// The join comes from the client (the connection's active side), its
    /// answer from the server that took over the passive side.
    fn role(self) -> Role {
        match self {
            Kind::Join => Role::Active,
            Kind::Ok => Role::Passive,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinError {
    Magic([u8; 4]),
    Version(u8),
    Reserved,
}

impl std::fmt::Display for JoinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JoinError::Magic(m) => write!(f, "not a TCPE join message (magic {m:02x?})"),
            JoinError::Version(v) => write!(f, "TCPE join version {v}, this side speaks {VERSION}"),
            JoinError::Reserved => write!(f, "TCPE join message with reserved bytes set"),
        }
    }
}

impl std::error::Error for JoinError {}

fn mapped(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The MAC of `kind` for connection `conn_id` on the subflow from `client`
/// to `server` (each side passes the tuple as it sees it).
pub fn mac(kind: Kind, keys: &Keys, conn_id: u32, client: SocketAddr, server: SocketAddr) -> u64 {
    let mut m = Vec::with_capacity(8 + 4 + 4 + 2 * 18);
    m.extend_from_slice(b"TCPEjoin");
    m.extend_from_slice(&[kind.role().number(), 0, 0, 0]);
    m.extend_from_slice(&conn_id.to_be_bytes());
    for a in [client, server] {
        m.extend_from_slice(&mapped(a.ip()));
        m.extend_from_slice(&a.port().to_be_bytes());
    }
    let mut h = SipHasher24::new_with_keys(keys.active, keys.passive);
    h.write(&m);
    h.finish()
}

pub fn encode(kind: Kind, conn_id: u32, mac: u64) -> [u8; JOIN_LEN] {
    let mut b = [0u8; JOIN_LEN];
    b[..4].copy_from_slice(&kind.magic());
    b[4] = VERSION;
    b[8..12].copy_from_slice(&conn_id.to_be_bytes());
    b[12..].copy_from_slice(&mac.to_le_bytes());
    b
}

/// The connection ID and MAC of a `kind` message; the MAC is the caller's
/// to check (it needs the keys the ID names).
pub fn decode(kind: Kind, b: &[u8; JOIN_LEN]) -> Result<(u32, u64), JoinError> {
    let magic: [u8; 4] = b[..4].try_into().unwrap();
    if magic != kind.magic() {
        return Err(JoinError::Magic(magic));
    }
    if b[4] != VERSION {
        return Err(JoinError::Version(b[4]));
    }
    if b[5..8] != [0, 0, 0] {
        return Err(JoinError::Reserved);
    }
    Ok((u32::from_be_bytes(b[8..12].try_into().unwrap()), u64::from_le_bytes(b[12..].try_into().unwrap())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_binds_role_id_and_tuple() {
        let keys = Keys { active: 1, passive: 2 };
        let (c, s): (SocketAddr, SocketAddr) = ("10.0.0.1:4000".parse().unwrap(), "10.0.0.2:80".parse().unwrap());
        let m = mac(Kind::Join, &keys, 7, c, s);
        assert_ne!(m, mac(Kind::Ok, &keys, 7, c, s));
        assert_ne!(m, mac(Kind::Join, &keys, 8, c, s));
        assert_ne!(m, mac(Kind::Join, &keys, 7, "10.0.0.1:4001".parse().unwrap(), s));
        assert_ne!(m, mac(Kind::Join, &Keys { active: 1, passive: 3 }, 7, c, s));
        let b = encode(Kind::Join, 7, m);
        assert_eq!(decode(Kind::Join, &b), Ok((7, m)));
        assert_eq!(decode(Kind::Ok, &b), Err(JoinError::Magic(*b"TCPJ")));
        let mut v = b;
        v[4] = 2;
        assert_eq!(decode(Kind::Join, &v), Err(JoinError::Version(2)));
        let mut r = b;
        r[6] = 1;
        assert_eq!(decode(Kind::Join, &r), Err(JoinError::Reserved));
    }
}

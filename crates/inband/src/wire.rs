//! The inband wire format in Rust: the mirror of bpf/include/inband/wire.h.
//! Both are checked against tests/vectors/wire.txt.

use std::net::{Ipv4Addr, SocketAddrV4};

pub const OPT_CLIENT_TUPLE: u8 = 155;
pub const OPT_SCORE_REQUEST: u8 = 124;
pub const OPT_SCORE: u8 = 125;
pub const OPT_CLIENT_TUPLE_LEN: usize = 8;
pub const OPT_SCORE_REQUEST_LEN: usize = 4;
pub const OPT_SCORE_LEN: usize = 4;
/// The largest option either side adds: what MSS clamping subtracts.
pub const OPT_MAX_LEN: usize = 8;

/// One inband IPv4 option.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InbandOption {
    ClientTuple(SocketAddrV4),
    ScoreRequest,
    Score(u16),
}

#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    Truncated,
    BadLength { kind: u8, len: u8 },
    NotInband(u8),
}

impl InbandOption {
    pub fn encode(&self) -> Vec<u8> {
        match *self {
            InbandOption::ClientTuple(a) => {
                let mut v = vec![OPT_CLIENT_TUPLE, OPT_CLIENT_TUPLE_LEN as u8];
                v.extend_from_slice(&a.ip().octets());
                v.extend_from_slice(&a.port().to_be_bytes());
                v
            }
            InbandOption::ScoreRequest => vec![OPT_SCORE_REQUEST, OPT_SCORE_REQUEST_LEN as u8, 0, 0],
            InbandOption::Score(s) => {
                let b = s.to_be_bytes();
                vec![OPT_SCORE, OPT_SCORE_LEN as u8, b[0], b[1]]
            }
        }
    }

    /// Decodes the option at the start of `b` (an IPv4 options area).
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < 2 {
            return Err(DecodeError::Truncated);
        }
        let (kind, len) = (b[0], b[1]);
        let want = match kind {
            OPT_CLIENT_TUPLE => OPT_CLIENT_TUPLE_LEN,
            OPT_SCORE_REQUEST => OPT_SCORE_REQUEST_LEN,
            OPT_SCORE => OPT_SCORE_LEN,
            other => return Err(DecodeError::NotInband(other)),
        };
        if usize::from(len) != want {
            return Err(DecodeError::BadLength { kind, len });
        }
        if b.len() < want {
            return Err(DecodeError::Truncated);
        }
        Ok(match kind {
            OPT_CLIENT_TUPLE => InbandOption::ClientTuple(SocketAddrV4::new(
                Ipv4Addr::new(b[2], b[3], b[4], b[5]),
                u16::from_be_bytes([b[6], b[7]]),
            )),
            OPT_SCORE_REQUEST => InbandOption::ScoreRequest,
            _ => InbandOption::Score(u16::from_be_bytes([b[2], b[3]])),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses tests/vectors/wire.txt into (option, bytes).
    fn vectors() -> Vec<(InbandOption, Vec<u8>)> {
        let text = include_str!("../../../tests/vectors/wire.txt");
        let mut out = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
            let (lhs, rhs) = line.split_once('=').expect("vector line has '='");
            let words: Vec<&str> = lhs.split_whitespace().collect();
            let opt = match words[..] {
                ["client_tuple", ip, port] => {
                    InbandOption::ClientTuple(SocketAddrV4::new(ip.parse().unwrap(), port.parse().unwrap()))
                }
                ["score_request"] => InbandOption::ScoreRequest,
                ["score", s] => InbandOption::Score(s.parse().unwrap()),
                _ => panic!("unknown vector: {line}"),
            };
            let bytes = rhs.split_whitespace().map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
            out.push((opt, bytes));
        }
        out
    }

    #[test]
    fn encodes_and_decodes_every_vector() {
        let v = vectors();
        assert!(v.len() >= 8);
        for (opt, bytes) in v {
            assert_eq!(opt.encode(), bytes, "{opt:?}");
            assert_eq!(InbandOption::decode(&bytes), Ok(opt));
        }
    }

    #[test]
    fn rejects_bad_lengths_and_foreign_kinds() {
        assert_eq!(InbandOption::decode(&[125, 0, 0, 0]), Err(DecodeError::BadLength { kind: 125, len: 0 }));
        assert_eq!(InbandOption::decode(&[155, 8, 1, 2]), Err(DecodeError::Truncated));
        assert_eq!(InbandOption::decode(&[7, 4, 0, 0]), Err(DecodeError::NotInband(7)));
        assert_eq!(InbandOption::decode(&[124]), Err(DecodeError::Truncated));
    }
}

//! The out-of-band score protocol of `dsr-polling`: one UDP datagram asks an
//! agent for the score of one local port, one datagram answers. Shared by the
//! agent (the responder) and the balancer (`lb::polling`, the asker).
//!
//! ```text
//! request: "IBP1" | port (u16, network order)                    6 bytes
//! reply:   "IBR1" | port (u16, network order) | score (u32, network order)  10 bytes
//! ```
//!
//! The port in the reply lets the asker match it without per-request state.
//! Anything that is not exactly one of these (other length, other magic) is
//! not a message of this protocol and is ignored by both sides.

pub const REQUEST_MAGIC: [u8; 4] = *b"IBP1";
pub const REPLY_MAGIC: [u8; 4] = *b"IBR1";
pub const REQUEST_LEN: usize = 6;
pub const REPLY_LEN: usize = 10;

pub fn encode_request(port: u16) -> [u8; REQUEST_LEN] {
    let mut out = [0u8; REQUEST_LEN];
    out[..4].copy_from_slice(&REQUEST_MAGIC);
    out[4..].copy_from_slice(&port.to_be_bytes());
    out
}

/// The local port a request asks about, or None if `buf` is not a request.
pub fn decode_request(buf: &[u8]) -> Option<u16> {
    if buf.len() != REQUEST_LEN || buf[..4] != REQUEST_MAGIC {
        return None;
    }
    Some(u16::from_be_bytes([buf[4], buf[5]]))
}

pub fn encode_reply(port: u16, score: u32) -> [u8; REPLY_LEN] {
    let mut out = [0u8; REPLY_LEN];
    out[..4].copy_from_slice(&REPLY_MAGIC);
    out[4..6].copy_from_slice(&port.to_be_bytes());
    out[6..].copy_from_slice(&score.to_be_bytes());
    out
}

/// (port, score) of a reply, or None if `buf` is not a reply.
pub fn decode_reply(buf: &[u8]) -> Option<(u16, u32)> {
    if buf.len() != REPLY_LEN || buf[..4] != REPLY_MAGIC {
        return None;
    }
    Some((u16::from_be_bytes([buf[4], buf[5]]), u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]])))
}

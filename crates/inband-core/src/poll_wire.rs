//! The out-of-band score protocol's messages: one UDP datagram asks an
//! agent for the score of one local port, one datagram answers. Used by `dsr-polling`,
//! `dsr-query` and the fallback for backends whose path loses options.
//! Shared by the agent (the responder, `agent::poll_responder`) and the
//! balancer (the asker, `lb::polling`).
//!
//! Two formats, chosen by `[auth] mode` exactly as for the in-band options:
//!
//! ```text
//! mode = "none" (the seed's baseline, trusted by source address alone):
//!   request: "IBP1" | port (u16)                                          6 bytes
//!   reply:   "IBR1" | port (u16) | score (u32)                           10 bytes
//! mode = "siphash" (the default):
//!   request: "IBP2" | port | key id (u8) | 0 (u8) | nonce (u64) | mac (u64)          24 bytes
//!   reply:   "IBR2" | port | key id | 0 | nonce | score (u32) | mac (u64)            28 bytes
//! ```
//!
//! Integers are in network order; `mac` is SipHash-2-4 under key `key id`
//! of every byte before it. A source address is easy to forge on a shared
//! L2 segment, so without a MAC anyone there could make an agent answer a
//! forged balancer, or feed the balancer a score of 0 for an overloaded
//! backend and steer every new connection to it. The reply echoes the
//! request's random nonce and key id: a reply is fresh only if it answers a
//! nonce the asker is still waiting for, so a recorded reply cannot be
//! replayed later. A replayed request only makes the agent send the current
//! score to the balancer's own address, which drops it unless it is the
//! nonce it waits for (the agent keeps no replay state for this reason).
//!
//! The port lets the asker match a reply without per-request state beyond
//! the nonce. Anything that is not exactly one of these messages is ignored
//! by both sides; the refusals that mean "someone forged or misconfigured"
//! are told apart, so the sides can count them.

use crate::wire::Key;

pub const REQUEST_V1_LEN: usize = 6;
pub const REPLY_V1_LEN: usize = 10;
pub const REQUEST_V2_LEN: usize = 24;
pub const REPLY_V2_LEN: usize = 28;
/// A buffer one byte longer than the longest message, so that a longer
/// datagram is seen as longer instead of being truncated into a valid one.
pub const MAX_LEN: usize = REPLY_V2_LEN + 1;

/// The keys one side holds (`None`: `[auth] mode = "none"`, format 1), read
/// from its program's `auth_keys` map so that a SIGHUP's new keys apply to
/// polls as soon as to options.
pub type Keys = Option<Vec<(u8, Key)>>;

/// A request a responder accepted: what to answer, and with which key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub port: u16,
    /// 0 in format 1.
    pub key_id: u8,
    /// 0 in format 1.
    pub nonce: u64,
}

/// A reply an asker accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub port: u16,
    pub nonce: u64,
    pub score: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not a message of this protocol (length or magic): noise, ignored.
    NotOurs,
    /// The other format than this side's `[auth] mode`: the two sides are
    /// configured differently (or someone tries the unauthenticated one).
    WrongFormat,
    /// Authenticated format, but no key of that id, or a MAC that does not
    /// verify: forged, or the sides hold different keys.
    BadMac,
}

/// The key of id `id` (also the flow-move protocol's).
pub(crate) fn key_of(keys: &[(u8, Key)], id: u8) -> Option<&Key> {
    keys.iter().find(|(k, _)| *k == id).map(|(_, key)| key)
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// Checks the trailing MAC of an authenticated message.
fn verified(buf: &[u8], keys: &[(u8, Key)]) -> Result<(), Refusal> {
    let (body, mac) = buf.split_at(buf.len() - 8);
    let key = key_of(keys, body[6]).ok_or(Refusal::BadMac)?;
    // Not constant-time: a MAC is checked once per datagram and its bytes
    // are not a secret that timing could accumulate (the nonce changes).
    if key.siphash(body) != be64(mac) {
        return Err(Refusal::BadMac);
    }
    Ok(())
}

/// `body` with its MAC appended (also the flow-move protocol's).
pub(crate) fn signed(mut body: Vec<u8>, key: &Key) -> Vec<u8> {
    let mac = key.siphash(&body);
    body.extend_from_slice(&mac.to_be_bytes());
    body
}

/// A request for `port`: format 2 signed with `sign` (key id and key) and
/// carrying `nonce`, or format 1 if `sign` is None.
pub fn encode_request(port: u16, sign: Option<(u8, &Key)>, nonce: u64) -> Vec<u8> {
    match sign {
        None => [&b"IBP1"[..], &port.to_be_bytes()].concat(),
        Some((id, key)) => signed([&b"IBP2"[..], &port.to_be_bytes(), &[id, 0], &nonce.to_be_bytes()].concat(), key),
    }
}

/// Whether `buf` has the length and magic of a request of either format.
pub fn is_request(buf: &[u8]) -> bool {
    (buf.len() == REQUEST_V1_LEN && buf[..4] == *b"IBP1") || (buf.len() == REQUEST_V2_LEN && buf[..4] == *b"IBP2")
}

pub fn decode_request(buf: &[u8], keys: &Keys) -> Result<Request, Refusal> {
    let v1 = buf.len() == REQUEST_V1_LEN && buf[..4] == *b"IBP1";
    let v2 = buf.len() == REQUEST_V2_LEN && buf[..4] == *b"IBP2";
    match (keys, v1, v2) {
        (_, false, false) => Err(Refusal::NotOurs),
        (None, true, _) => Ok(Request { port: be16(&buf[4..]), key_id: 0, nonce: 0 }),
        (Some(keys), _, true) => {
            verified(buf, keys)?;
            Ok(Request { port: be16(&buf[4..]), key_id: buf[6], nonce: be64(&buf[8..]) })
        }
        _ => Err(Refusal::WrongFormat),
    }
}

/// The answer to `req`, in its format and under its key. None if the key
/// it was checked with is gone (a reload between the two).
pub fn encode_reply(req: &Request, score: u32, keys: &Keys) -> Option<Vec<u8>> {
    match keys {
        None => Some([&b"IBR1"[..], &req.port.to_be_bytes(), &score.to_be_bytes()].concat()),
        Some(keys) => {
            let key = key_of(keys, req.key_id)?;
            let body = [&b"IBR2"[..], &req.port.to_be_bytes(), &[req.key_id, 0], &req.nonce.to_be_bytes(), &score.to_be_bytes()].concat();
            Some(signed(body, key))
        }
    }
}

pub fn decode_reply(buf: &[u8], keys: &Keys) -> Result<Reply, Refusal> {
    let v1 = buf.len() == REPLY_V1_LEN && buf[..4] == *b"IBR1";
    let v2 = buf.len() == REPLY_V2_LEN && buf[..4] == *b"IBR2";
    match (keys, v1, v2) {
        (_, false, false) => Err(Refusal::NotOurs),
        (None, true, _) => Ok(Reply { port: be16(&buf[4..]), nonce: 0, score: be32(&buf[6..]) }),
        (Some(keys), _, true) => {
            verified(buf, keys)?;
            Ok(Reply { port: be16(&buf[4..]), nonce: be64(&buf[8..]), score: be32(&buf[16..]) })
        }
        _ => Err(Refusal::WrongFormat),
    }
}

/// The asking side's state for one round of polls, shared by `inband lb`
/// (`lb::polling`) and `inband proxy`'s least-score: who was asked with
/// which nonce, and which reply answers whom. Each asker owns its sockets
/// and clock; this holds only the matching, so a reply is taken exactly
/// when the one definition here says so.
pub struct Round<T> {
    keys: Keys,
    sign: Option<(u8, Key)>,
    /// (backend, its agent's poll port) -> (what the caller asked for, the
    /// nonce the reply must echo: 0 in format 1)
    waiting: std::collections::HashMap<(std::net::SocketAddr, u16), (T, u64)>,
}

/// What a datagram that reached an asker was.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer<T> {
    /// The fresh score of a target asked this round.
    Score(T, u32),
    /// Well-formed and authentic, but late, unsolicited or replayed
    /// (another nonce, or a target not waited for): not a fresh score.
    Stale,
    Refused(Refusal),
}

impl<T> Round<T> {
    /// A round signed with key `sign_id` of `keys` (ignored in format 1);
    /// an error if `keys` has no such key.
    pub fn new(keys: Keys, sign_id: u8) -> Result<Round<T>, String> {
        let sign = match &keys {
            None => None,
            Some(k) => Some(*k.iter().find(|(id, _)| *id == sign_id).ok_or(format!("the signing key {sign_id} is not among the auth keys"))?),
        };
        Ok(Round { keys, sign, waiting: std::collections::HashMap::new() })
    }

    /// The request for the service at `backend`, to send to its agent's
    /// `poll_port`, and waits for its answer as `what`. `nonce` must be
    /// random (a guessable one lets a forger answer for the agent).
    pub fn ask(&mut self, backend: std::net::SocketAddr, poll_port: u16, what: T, nonce: u64) -> Vec<u8> {
        let req = encode_request(backend.port(), self.sign.as_ref().map(|(id, k)| (*id, k)), nonce);
        self.waiting.insert((backend, poll_port), (what, if self.sign.is_some() { nonce } else { 0 }));
        req
    }

    /// Stops waiting for a target whose request could not be sent.
    pub fn forget(&mut self, backend: std::net::SocketAddr, poll_port: u16) -> Option<T> {
        self.waiting.remove(&(backend, poll_port)).map(|(w, _)| w)
    }

    /// Takes one datagram from `from` (an IPv4 sender as IPv4, not
    /// IPv4-mapped): a reply answers the target at `from`'s address and the
    /// port it names, asked through `from`'s port.
    pub fn answer(&mut self, from: std::net::SocketAddr, buf: &[u8]) -> Answer<T> {
        let reply = match decode_reply(buf, &self.keys) {
            Ok(r) => r,
            Err(why) => return Answer::Refused(why),
        };
        let key = (std::net::SocketAddr::new(from.ip(), reply.port), from.port());
        match self.waiting.get(&key) {
            Some((_, nonce)) if *nonce == reply.nonce => {
                let (what, _) = self.waiting.remove(&key).unwrap();
                Answer::Score(what, reply.score)
            }
            _ => Answer::Stale,
        }
    }

    /// Targets still waiting for an answer.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The targets that did not answer, as (backend, poll port) and what
    /// they were asked as.
    pub fn unanswered(self) -> impl Iterator<Item = ((std::net::SocketAddr, u16), T)> {
        self.waiting.into_iter().map(|(k, (w, _))| (k, w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: Key = Key(*b"0123456789abcdef");
    const K2: Key = Key(*b"fedcba9876543210");

    fn keys() -> Keys {
        Some(vec![(1, K1), (2, K2)])
    }

    #[test]
    fn format_1_is_the_seed_s_plain_layout() {
        assert_eq!(encode_request(8080, None, 7), b"IBP1\x1f\x90");
        assert_eq!(decode_request(b"IBP1\x1f\x90", &None), Ok(Request { port: 8080, key_id: 0, nonce: 0 }));
        let req = Request { port: 8080, key_id: 0, nonce: 0 };
        assert_eq!(encode_reply(&req, 0x0102_0304, &None).unwrap(), b"IBR1\x1f\x90\x01\x02\x03\x04");
        assert_eq!(decode_reply(b"IBR1\x1f\x90\x01\x02\x03\x04", &None), Ok(Reply { port: 8080, nonce: 0, score: 0x0102_0304 }));
    }

    #[test]
    fn format_2_layout_and_mac() {
        let req = encode_request(8080, Some((2, &K2)), 0x1122_3344_5566_7788);
        assert_eq!(req.len(), REQUEST_V2_LEN);
        assert_eq!(&req[..16], b"IBP2\x1f\x90\x02\x00\x11\x22\x33\x44\x55\x66\x77\x88");
        assert_eq!(req[16..], K2.siphash(&req[..16]).to_be_bytes());
        let got = decode_request(&req, &keys()).unwrap();
        assert_eq!(got, Request { port: 8080, key_id: 2, nonce: 0x1122_3344_5566_7788 });
        let reply = encode_reply(&got, 42, &keys()).unwrap();
        assert_eq!(reply.len(), REPLY_V2_LEN);
        assert_eq!(&reply[..20], b"IBR2\x1f\x90\x02\x00\x11\x22\x33\x44\x55\x66\x77\x88\x00\x00\x00\x2a");
        assert_eq!(reply[20..], K2.siphash(&reply[..20]).to_be_bytes());
        assert_eq!(decode_reply(&reply, &keys()), Ok(Reply { port: 8080, nonce: 0x1122_3344_5566_7788, score: 42 }));
    }

    #[test]
    fn every_flipped_bit_of_an_authenticated_message_is_refused() {
        let req = encode_request(8080, Some((1, &K1)), 99);
        let reply = encode_reply(&decode_request(&req, &keys()).unwrap(), 5, &keys()).unwrap();
        for i in 32..req.len() * 8 {
            let mut bad = req.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert_eq!(decode_request(&bad, &keys()), Err(Refusal::BadMac), "request bit {i}");
        }
        for i in 32..reply.len() * 8 {
            let mut bad = reply.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert_eq!(decode_reply(&bad, &keys()), Err(Refusal::BadMac), "reply bit {i}");
        }
    }

    #[test]
    fn keys_and_formats_must_match() {
        // Signed with a key the other side does not hold.
        let req = encode_request(8080, Some((3, &K1)), 1);
        assert_eq!(decode_request(&req, &keys()), Err(Refusal::BadMac));
        // The right id with the wrong key material.
        let req = encode_request(8080, Some((1, &K2)), 1);
        assert_eq!(decode_request(&req, &keys()), Err(Refusal::BadMac));
        // Unauthenticated where keys are required, and the other way round.
        assert_eq!(decode_request(b"IBP1\x1f\x90", &keys()), Err(Refusal::WrongFormat));
        assert_eq!(decode_reply(b"IBR1\x1f\x90\x01\x02\x03\x04", &keys()), Err(Refusal::WrongFormat));
        let req = encode_request(8080, Some((1, &K1)), 1);
        assert_eq!(decode_request(&req, &None), Err(Refusal::WrongFormat));
        // A key removed between the check and the answer: no answer.
        let got = decode_request(&req, &keys()).unwrap();
        assert_eq!(encode_reply(&got, 1, &Some(vec![(2, K2)])), None);
    }

    #[test]
    fn noise_is_not_ours() {
        let signed = encode_request(8080, Some((1, &K1)), 1);
        for buf in [
            &b""[..],
            b"IBP1\x1f",
            b"IBP1\x1f\x90\x00",
            b"ibp1\x1f\x90",
            b"IBR1\x1f\x90\x01\x02\x03\x04",
            &signed[..23],
            &[signed.as_slice(), b"\0"].concat(),
        ] {
            assert_eq!(decode_request(buf, &keys()), Err(Refusal::NotOurs), "{buf:?}");
            assert_eq!(decode_request(buf, &None), Err(Refusal::NotOurs), "{buf:?}");
        }
        assert_eq!(decode_reply(&signed, &keys()), Err(Refusal::NotOurs));
        assert_eq!(decode_reply(b"IBR1\x1f\x90\x01\x02\x03", &None), Err(Refusal::NotOurs));
        assert_eq!(decode_reply(b"XBR1\x1f\x90\x01\x02\x03\x04", &None), Err(Refusal::NotOurs));
    }

    #[test]
    fn a_round_takes_only_the_reply_to_its_own_nonce() {
        let backend: std::net::SocketAddr = "10.0.0.2:8080".parse().unwrap();
        let agent: std::net::SocketAddr = "10.0.0.2:9137".parse().unwrap();
        let mut round = Round::new(keys(), 2).unwrap();
        let req = round.ask(backend, 9137, "b", 77);
        let got = decode_request(&req, &keys()).unwrap();
        assert_eq!(got, Request { port: 8080, key_id: 2, nonce: 77 });
        // An older round's nonce, and a reply from another address: not fresh.
        let old = encode_reply(&Request { nonce: 76, ..got }, 1, &keys()).unwrap();
        assert_eq!(round.answer(agent, &old), Answer::Stale);
        let right = encode_reply(&got, 9, &keys()).unwrap();
        assert_eq!(round.answer("10.0.0.3:9137".parse().unwrap(), &right), Answer::Stale);
        let mut forged = right.clone();
        forged[19] ^= 1;
        assert_eq!(round.answer(agent, &forged), Answer::Refused(Refusal::BadMac));
        assert_eq!(round.waiting(), 1);
        assert_eq!(round.answer(agent, &right), Answer::Score("b", 9));
        // Once: a replay of the same reply is stale.
        assert_eq!(round.answer(agent, &right), Answer::Stale);
        assert_eq!(round.unanswered().count(), 0);
        assert!(Round::<()>::new(keys(), 3).is_err());
    }

    #[test]
    fn a_round_without_keys_uses_format_1() {
        let backend: std::net::SocketAddr = "[fd00::2]:80".parse().unwrap();
        let mut round = Round::new(None, 0).unwrap();
        assert_eq!(round.ask(backend, 9137, 1u32, 5), b"IBP1\x00\x50");
        assert_eq!(round.answer("[fd00::2]:9137".parse().unwrap(), b"IBR1\x00\x50\x00\x00\x00\x07"), Answer::Score(1, 7));
        round.ask(backend, 9137, 2u32, 6);
        assert_eq!(round.forget(backend, 9137), Some(2));
        assert_eq!(round.unanswered().count(), 0);
    }
}

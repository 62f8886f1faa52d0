//! The one on-disk/in-map record format every backend stores, and the small
//! meta record LMDB and RocksDB keep beside it.
//!
//! The checksum sits in the record, above the backends: LMDB does not
//! checksum pages, RocksDB checksums blocks but not what a bug or a torn
//! file write hands back, and files have nothing. One check in one place
//! covers all four the same way.
//!
//! Record: `magic "IBC1" | crc32 | stored_at u64 | expires_at u64 |
//! key_len u32 | header_len u32 | body_len u64 | key | header | body`,
//! little-endian; the CRC covers everything after itself. The key is inside
//! because backends address records by a 128-bit hash of the key: a
//! mismatch is a (vanishingly rare) collision and reads as a miss.

use bytes::Bytes;

use crate::body::{BodyChunks, ChunkSource, EntryBody, Slices, STREAM_THRESHOLD};
use crate::{Entry, Meta};

const MAGIC: &[u8; 4] = b"IBC1";
pub(crate) const HEAD: usize = 40;

/// Backends address entries by this hash: fixed-size keys fit LMDB's 511-byte
/// key limit and give file names and eviction-index slots for free.
pub(crate) fn id(key: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(key)
}

pub(crate) fn encode(key: &[u8], stored_at_ms: u64, expires_at_ms: u64, header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(HEAD + key.len() + header.len() + body.len());
    r.extend_from_slice(MAGIC);
    r.extend_from_slice(&[0; 4]);
    r.extend_from_slice(&stored_at_ms.to_le_bytes());
    r.extend_from_slice(&expires_at_ms.to_le_bytes());
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(&(header.len() as u32).to_le_bytes());
    r.extend_from_slice(&(body.len() as u64).to_le_bytes());
    r.extend_from_slice(key);
    r.extend_from_slice(header);
    r.extend_from_slice(body);
    let crc = crc32fast::hash(&r[8..]);
    r[4..8].copy_from_slice(&crc.to_le_bytes());
    r
}

/// A record as a backend hands it back.
pub enum Raw {
    /// The whole record in memory (or mapped).
    Whole(Bytes),
    /// Its first bytes — at least the head, key and header — then the rest
    /// from `rest`, `total` bytes in all.
    Split { prefix: Bytes, total: u64, rest: Box<dyn ChunkSource> },
    /// The backend's own integrity check failed on it.
    Corrupt,
}

pub(crate) enum Decoded {
    Hit(Entry),
    /// Intact record of another key with the same hash.
    OtherKey,
    Corrupt,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The record length its head claims, when it has one.
pub(crate) fn claimed_len(b: &[u8]) -> Option<u64> {
    if b.len() < HEAD || &b[..4] != MAGIC {
        return None;
    }
    (HEAD as u64).checked_add(u32_at(b, 24) as u64)?.checked_add(u32_at(b, 28) as u64)?.checked_add(u64_at(b, 32))
}

/// Parsed head: (meta, key_len, header_len, body_len), lengths checked
/// against `total` (the record's full length).
pub(crate) fn head(b: &[u8], total: u64) -> Option<(Meta, usize, usize, u64)> {
    if b.len() < HEAD || &b[..4] != MAGIC {
        return None;
    }
    let (k, h, body) = (u32_at(b, 24) as u64, u32_at(b, 28) as u64, u64_at(b, 32));
    if (HEAD as u64).checked_add(k)?.checked_add(h)?.checked_add(body)? != total {
        return None;
    }
    let meta = Meta { stored_at_ms: u64_at(b, 8), expires_at_ms: u64_at(b, 16), size: total };
    Some((meta, k as usize, h as usize, body))
}

/// The key a record names, unchecked: for a scan, which finds records
/// without knowing their keys; [`decode`] then checks it with the rest.
pub(crate) fn claimed_key(raw: &Raw) -> Option<Bytes> {
    let (prefix, total) = match raw {
        Raw::Whole(b) => (b, b.len() as u64),
        Raw::Split { prefix, total, .. } => (prefix, *total),
        Raw::Corrupt => return None,
    };
    let (_, k, _, _) = head(prefix, total)?;
    (prefix.len() >= HEAD + k).then(|| prefix.slice(HEAD..HEAD + k))
}

/// Checks and splits a record. A body up to STREAM_THRESHOLD is verified
/// here; a larger one is verified as it streams, and `on_corrupt` runs if
/// it fails then.
pub(crate) fn decode(key: &[u8], raw: Raw, on_corrupt: Box<dyn FnOnce() + Send + Sync>) -> Decoded {
    let (prefix, total, rest): (Bytes, u64, Box<dyn ChunkSource>) = match raw {
        Raw::Corrupt => return Decoded::Corrupt,
        Raw::Whole(b) => {
            let total = b.len() as u64;
            (b, total, Box::new(Slices(Bytes::new())))
        }
        Raw::Split { prefix, total, rest } => (prefix, total, rest),
    };
    let Some((meta, k, h, body_len)) = head(&prefix, total) else { return Decoded::Corrupt };
    let body_at = HEAD + k + h;
    if prefix.len() < body_at || prefix.len() as u64 > total {
        return Decoded::Corrupt;
    }
    let expected = u32_at(&prefix, 4);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&prefix[8..body_at]);
    // The key is checked before a byte of the body is trusted or sent: a
    // record of another key (a hash collision) is a miss, not corruption,
    // but only once its own checksum vouches for the key it names.
    let header = prefix.slice(HEAD + k..body_at);
    let first = prefix.slice(body_at..);
    let key_matches = &prefix[HEAD..HEAD + k] == key;
    let mut chunks = BodyChunks::new(body_len, first, rest, crc, expected, on_corrupt);
    if body_len > STREAM_THRESHOLD && key_matches {
        return Decoded::Hit(Entry { meta, crc: expected, header, body: EntryBody::Chunks(chunks) });
    }
    // Small (or another key's): read to the end now, so the checksum is
    // known before anything is returned. A failure here is reported by the
    // return value; `on_corrupt` is the stream's way and must not run too.
    chunks.forget_corrupt_hook();
    let mut parts = Vec::new();
    loop {
        match chunks.next_chunk() {
            Ok(Some(c)) => parts.push(c),
            Ok(None) => break,
            Err(_) => return Decoded::Corrupt,
        }
    }
    if !key_matches {
        return Decoded::OtherKey;
    }
    // One part (every body from memory or a whole record) is a slice of the
    // record: no copy.
    let body = match parts.len() {
        1 => parts.pop().expect("one part"),
        _ => parts.concat().into(),
    };
    Decoded::Hit(Entry { meta, crc: expected, header, body: EntryBody::Whole(body) })
}

/// Meta-table value: `crc32 | stored_at | expires_at | size | key`.
pub(crate) fn encode_meta(key: &[u8], meta: &Meta) -> Vec<u8> {
    let mut r = Vec::with_capacity(28 + key.len());
    r.extend_from_slice(&[0; 4]);
    r.extend_from_slice(&meta.stored_at_ms.to_le_bytes());
    r.extend_from_slice(&meta.expires_at_ms.to_le_bytes());
    r.extend_from_slice(&meta.size.to_le_bytes());
    r.extend_from_slice(key);
    let crc = crc32fast::hash(&r[4..]);
    r[..4].copy_from_slice(&crc.to_le_bytes());
    r
}

/// (key, meta) of a meta-table value, `None` if it fails its checksum.
pub(crate) fn decode_meta(b: &[u8]) -> Option<(&[u8], Meta)> {
    if b.len() < 28 || crc32fast::hash(&b[4..]) != u32_at(b, 0) {
        return None;
    }
    Some((&b[28..], Meta { stored_at_ms: u64_at(b, 4), expires_at_ms: u64_at(b, 12), size: u64_at(b, 20) }))
}

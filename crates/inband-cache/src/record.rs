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

pub(crate) fn decode(key: &[u8], b: &[u8]) -> Decoded {
    let Some((meta, k, h, _)) = head(b, b.len() as u64) else { return Decoded::Corrupt };
    if crc32fast::hash(&b[8..]) != u32_at(b, 4) {
        return Decoded::Corrupt;
    }
    if &b[HEAD..HEAD + k] != key {
        return Decoded::OtherKey;
    }
    let header = b[HEAD + k..HEAD + k + h].to_vec();
    let body = b[HEAD + k + h..].to_vec();
    Decoded::Hit(Entry { meta, header, body })
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

//! A stored body read chunk by chunk, its checksum verified as it goes, so
//! a hit on a large object holds one chunk in memory, not the object.

use anyhow::{anyhow, bail, Result};
use bytes::Bytes;

/// Bodies up to this size are read whole and checked before `get` returns.
pub const STREAM_THRESHOLD: u64 = 256 * 1024;
/// The largest chunk a streamed body is handed out in.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// Where a backend's chunks come from: slices of a record already in
/// memory or mapped, a file descriptor, RocksDB chunk keys.
pub trait ChunkSource: Send + Sync {
    /// The next bytes of the record after what was handed out before;
    /// `None` at its end.
    fn next_chunk(&mut self) -> Result<Option<Bytes>>;
}

/// Slices of bytes already in memory (the memory store's record, LMDB's
/// mapped value): no copy.
pub(crate) struct Slices(pub(crate) Bytes);

impl ChunkSource for Slices {
    fn next_chunk(&mut self) -> Result<Option<Bytes>> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let n = self.0.len().min(CHUNK_BYTES);
        Ok(Some(self.0.split_to(n)))
    }
}

/// A stored entry's body.
pub enum EntryBody {
    /// Bodies up to [`STREAM_THRESHOLD`]: checksum verified already.
    Whole(Bytes),
    /// Larger bodies, chunk by chunk.
    Chunks(BodyChunks),
}

pub struct BodyChunks {
    len: u64,
    sent: u64,
    /// Bytes of the record read with its head (the body's first bytes).
    first: Option<Bytes>,
    source: Box<dyn ChunkSource>,
    crc: crc32fast::Hasher,
    expected: u32,
    on_corrupt: Option<Box<dyn FnOnce() + Send + Sync>>,
    failed: bool,
}

impl BodyChunks {
    pub(crate) fn new(
        len: u64,
        first: Bytes,
        source: Box<dyn ChunkSource>,
        crc: crc32fast::Hasher,
        expected: u32,
        on_corrupt: Box<dyn FnOnce() + Send + Sync>,
    ) -> BodyChunks {
        let first = (!first.is_empty()).then_some(first);
        BodyChunks { len, sent: 0, first, source, crc, expected, on_corrupt: Some(on_corrupt), failed: false }
    }

    /// The caller reports a failure itself (a body checked before `get`
    /// returns).
    pub(crate) fn forget_corrupt_hook(&mut self) {
        self.on_corrupt = None;
    }

    /// Total body length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes not yet handed out.
    pub fn remaining(&self) -> u64 {
        self.len - self.sent
    }

    /// The next chunk (at most [`CHUNK_BYTES`]), `Ok(None)` at the end. The
    /// checksum is verified as the chunks go: when it fails the last call
    /// is an `Err` instead of `Ok(None)`, and the record is counted corrupt
    /// and deleted. May block on disk I/O when the store's
    /// `reads_block()` is true.
    pub fn next_chunk(&mut self) -> Result<Option<Bytes>> {
        if self.failed {
            bail!("the stored body failed before");
        }
        let chunk = match self.first.take() {
            Some(f) => Some(f),
            None if self.sent == self.len => None,
            None => match self.source.next_chunk() {
                Ok(c) => c,
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            },
        };
        match chunk {
            Some(mut c) => {
                if c.len() > CHUNK_BYTES {
                    self.first = Some(c.split_off(CHUNK_BYTES));
                }
                if self.sent + c.len() as u64 > self.len {
                    return Err(self.corrupt("the stored body is longer than its record says"));
                }
                self.sent += c.len() as u64;
                self.crc.update(&c);
                Ok(Some(c))
            }
            None if self.sent < self.len => Err(self.corrupt("the stored body ended early")),
            None if self.crc.clone().finalize() != self.expected => Err(self.corrupt("the stored body failed its checksum")),
            None => Ok(None),
        }
    }

    fn corrupt(&mut self, what: &str) -> anyhow::Error {
        self.failed = true;
        if let Some(f) = self.on_corrupt.take() {
            f();
        }
        anyhow!("{what}; the record was deleted")
    }
}

impl EntryBody {
    /// The whole body in memory: runs the chunks to the end, so a corrupt
    /// large body is an `Err`.
    pub fn into_bytes(self) -> Result<Bytes> {
        match self {
            EntryBody::Whole(b) => Ok(b),
            EntryBody::Chunks(mut c) => {
                let mut out = Vec::with_capacity(c.len() as usize);
                while let Some(chunk) = c.next_chunk()? {
                    out.extend_from_slice(&chunk);
                }
                Ok(out.into())
            }
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            EntryBody::Whole(b) => b.len() as u64,
            EntryBody::Chunks(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

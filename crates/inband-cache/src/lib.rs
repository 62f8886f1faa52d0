//! Storage for inband's HTTP cache: one [`Store`] trait, four backends
//! (LMDB, RocksDB, in-memory, file-per-key) chosen by [`Config`].
//!
//! Every backend stores the same self-checking record (see `record.rs`):
//! key, [`Meta`], an opaque header blob owned by the HTTP layer (response
//! headers, a serialized cache policy) and the body, under a CRC-32 (crc32fast)
//! checksum that is verified on every read: before `get` returns for bodies
//! up to [`STREAM_THRESHOLD`], as the chunks go for larger ones, which are
//! read [`CHUNK_BYTES`] at a time so a hit never holds a large object in
//! memory. A record that fails the check is counted and deleted; `get`
//! reports it as a miss, a stream as an error at its end.
//!
//! The size bound and eviction live in one generic layer ([`cache::Cache`])
//! above the backends, so every backend evicts the same way and the bound
//! holds across restarts: the in-memory index is rebuilt at open from
//! metadata only (a small meta table for LMDB/RocksDB, `stat` for files),
//! never from values.

pub mod bench;
mod body;
mod cache;
mod files;
mod index;
mod lmdb;
mod memory;
pub mod probe;
mod record;
mod rocks;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use anyhow::{bail, Result};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub use body::{BodyChunks, ChunkSource, EntryBody, CHUNK_BYTES, STREAM_THRESHOLD};
pub use cache::{Backend, Cache, ScanItem};
pub use record::Raw;

/// Which backend holds the entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// LMDB (heed): B+tree in a memory map, readers never block.
    #[default]
    Lmdb,
    /// RocksDB (Debian's librocksdb): LSM tree with a write-ahead log.
    Rocksdb,
    /// A concurrent hash map; lost on restart.
    Memory,
    /// One file per key under hashed subdirectories, like nginx's proxy_cache.
    Files,
}

impl BackendKind {
    pub const ALL: [BackendKind; 4] = [BackendKind::Lmdb, BackendKind::Rocksdb, BackendKind::Memory, BackendKind::Files];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Lmdb => "lmdb",
            BackendKind::Rocksdb => "rocksdb",
            BackendKind::Memory => "memory",
            BackendKind::Files => "files",
        }
    }

    pub fn durable(self) -> bool {
        self != BackendKind::Memory
    }

    /// Why [`Store::scan`] is refused by this kind of store, or `None` for
    /// the two that keep their records in order.
    pub fn unordered(self) -> Option<&'static str> {
        match self {
            BackendKind::Lmdb | BackendKind::Rocksdb => None,
            BackendKind::Memory => Some("the memory store is a hash map: its records have no order to scan in"),
            BackendKind::Files => Some("the files store keeps one file per key under hashed directories: no order to scan in"),
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match BackendKind::ALL.into_iter().find(|k| k.name() == s) {
            Some(k) => Ok(k),
            None => bail!("unknown cache backend {s:?} (lmdb, rocksdb, memory, files)"),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `[cache]` in the proxy's configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub backend: BackendKind,
    /// Directory of the store; required for every backend but `memory`.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Bound on the sum of record sizes (key + metadata + header + body +
    /// 40 bytes framing). Store overhead (B-tree pages, LSM space
    /// amplification, filesystem blocks) comes on top.
    #[serde(default = "default_capacity")]
    pub capacity_bytes: u64,
    /// fsync every write before it is acknowledged. Without it (the default)
    /// writes survive a crash of the process (kill -9) but the last ones may
    /// be lost on power loss until [`Store::flush`] runs.
    #[serde(default)]
    pub fsync: bool,
}

fn default_capacity() -> u64 {
    1 << 30
}

impl Config {
    pub fn new(backend: BackendKind, path: Option<PathBuf>, capacity_bytes: u64) -> Config {
        Config { backend, path, capacity_bytes, fsync: false }
    }
}

/// What the store knows about an entry without reading its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Unix milliseconds, set by the caller (the HTTP layer's response time).
    pub stored_at_ms: u64,
    /// Unix milliseconds after which the entry is stale; `u64::MAX` = never.
    /// The store does not drop stale entries (stale-while-revalidate needs
    /// them); eviction takes them first.
    pub expires_at_ms: u64,
    /// Bytes charged against the capacity: the encoded record's length.
    pub size: u64,
}

/// A stored entry as returned by [`Store::get`]: head and header checked,
/// the body checked already ([`EntryBody::Whole`]) or as it streams.
pub struct Entry {
    pub meta: Meta,
    /// The record's CRC-32: identifies this exact content, so a caller may
    /// memoize what it decoded from `header`.
    pub crc: u32,
    /// Opaque to the store: the HTTP layer's response head and policy.
    pub header: Bytes,
    pub body: EntryBody,
}

impl Entry {
    /// The whole body in memory (a corrupt large body is an `Err`).
    pub fn body_bytes(self) -> Result<Bytes> {
        self.body.into_bytes()
    }
}

/// Counters a metrics endpoint exports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub entries: u64,
    pub size_bytes: u64,
    pub capacity_bytes: u64,
    /// Records that failed their checksum (or framing) and were deleted.
    pub corrupt: u64,
    pub evictions: u64,
}

/// What a read that may not wait on a disk found.
#[derive(Debug)]
pub enum NoWait<T> {
    Ready(T),
    /// The answer is not in memory: finding it would wait on a disk.
    WouldBlock,
}

/// The storage the HTTP cache keeps entries in.
///
/// Writes are atomic per entry: a reader sees the old record or the new one,
/// and after a crash the store holds one of them, never a mix. Durability
/// against power loss follows [`Config::fsync`]; [`Store::flush`] forces
/// everything written so far to stable storage (the proxy calls it
/// periodically and on shutdown).
pub trait Store: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// Whether `get` and [`BodyChunks::next_chunk`] may wait on disk I/O
    /// (files, RocksDB), or only touch memory and mapped pages (LMDB,
    /// memory), so a caller may read on an event loop.
    fn reads_block(&self) -> bool;
    /// Whether `put` and `delete` may wait on disk I/O: RocksDB's and the
    /// files store's always, LMDB's with `fsync`; LMDB's commits without
    /// fsync and the memory store's writes only touch memory and the page
    /// cache.
    fn writes_block(&self) -> bool;
    /// The entry, or `None` on a miss. A corrupt record counts in
    /// [`Stats::corrupt`], is deleted and reads as a miss.
    fn get(&self, key: &[u8]) -> Result<Option<Entry>>;
    /// `get` if it can answer without waiting on a disk, for a caller on
    /// an event loop; otherwise [`NoWait::WouldBlock`], and the caller
    /// calls `get` where waiting is allowed. Always ready for the stores
    /// whose reads never block.
    fn get_nowait(&self, key: &[u8]) -> Result<NoWait<Option<Entry>>>;
    /// Stores (or replaces) an entry, then evicts until the store is within
    /// its capacity. Fails if the record alone exceeds the capacity.
    fn put(&self, key: &[u8], stored_at_ms: u64, expires_at_ms: u64, header: &[u8], body: &[u8]) -> Result<Meta>;
    /// Whether the key was present.
    fn delete(&self, key: &[u8]) -> Result<bool>;
    /// From the in-memory index, no I/O. May be true for an entry whose
    /// record a later `get` finds corrupt.
    fn contains(&self, key: &[u8]) -> bool;
    /// Up to `limit` entries in the store's order, from `key`'s place on
    /// (its own entry first when present), each with its key. The order is
    /// that of the keys' 128-bit hashes, which address the records, so
    /// neighbours are unrelated keys, as in YCSB's scans over hashed keys:
    /// what a scan costs the store is the same. Every record is copied out
    /// and checked whole, however large. Refused, with the reason
    /// [`BackendKind::unordered`] gives, by a store without order.
    fn scan(&self, key: &[u8], limit: usize) -> Result<Vec<(Bytes, Entry)>>;
    /// Every key with its metadata, without reading bodies (a meta table for
    /// LMDB/RocksDB; a short read of each file's head for `files`). `f`
    /// runs inside the backend's iteration (a read transaction, a map
    /// shard's lock) and must not call back into the store; collect first.
    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()>;
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sum of [`Meta::size`] over all entries.
    fn size_bytes(&self) -> u64;
    /// Forces every acknowledged write to stable storage.
    fn flush(&self) -> Result<()>;
    fn stats(&self) -> Stats;
}

/// Opens (or creates) the store `config` describes.
pub fn open(config: &Config) -> Result<Box<dyn Store>> {
    let path = || match &config.path {
        Some(p) => Ok(p.clone()),
        None => Err(anyhow::anyhow!("cache backend {} needs a path", config.backend)),
    };
    Ok(match config.backend {
        BackendKind::Lmdb => Box::new(Cache::open(lmdb::Lmdb::open(&path()?, config)?, config)?),
        BackendKind::Rocksdb => Box::new(Cache::open(rocks::Rocks::open(&path()?, config)?, config)?),
        BackendKind::Memory => Box::new(Cache::open(memory::Memory::default(), config)?),
        BackendKind::Files => Box::new(Cache::open(files::Files::open(&path()?, config)?, config)?),
    })
}

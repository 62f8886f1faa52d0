//! RocksDB backend (Debian's librocksdb 7.8): one keyspace, records under
//! `d` + id and meta records under `m` + id, so startup iterates the small
//! `m` range only. Every key of a record goes in one WriteBatch, which
//! RocksDB applies atomically (one WAL record).
//!
//! RocksDB reads a value whole, so a record whose body is over
//! STREAM_THRESHOLD is split: `d` + id holds the record's head, key and
//! header followed by an 8-byte generation, and the body lies in
//! `c` + id + generation + index (big-endian u32), CHUNK_BYTES each. A
//! read takes one chunk at a time; a record replaced or deleted while
//! its body streams has a new generation (or none), so the stream ends
//! in an error, never in another record's bytes. Every write of a record
//! deletes the chunk range of its id first, so no chunk outlives its
//! record.
//!
//! The WAL is always on: without `fsync` it is written to the OS (kill -9
//! loses nothing) and `flush` syncs it; with `fsync` every batch is synced.
//! Tuned as RocksDB advises for large values and point lookups: records go
//! to blob files (integrated BlobDB, with garbage collection), so
//! compaction moves keys and pointers, not 10 KiB bodies; a bloom filter
//! spares reads of SST files that cannot hold the key. Compression is off:
//! HTTP bodies worth caching are mostly compressed already.

use std::path::Path;

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use rocksdb::{BlockBasedOptions, DBCompressionType, ErrorKind, IteratorMode, Options, ReadOptions, WriteBatch, WriteOptions, DB};

use crate::cache::{Backend, ScanItem};
use crate::record::{self, Raw};
use crate::{BackendKind, ChunkSource, Config, Meta, CHUNK_BYTES, STREAM_THRESHOLD};

pub(crate) struct Rocks {
    db: Arc<DB>,
    fsync: bool,
}

fn chunk_key(id: u128, generation: u64, index: u32) -> [u8; 29] {
    let mut k = [b'c'; 29];
    k[1..17].copy_from_slice(&id.to_be_bytes());
    k[17..25].copy_from_slice(&generation.to_be_bytes());
    k[25..].copy_from_slice(&index.to_be_bytes());
    k
}

/// Every chunk key of `id`, whatever its generation: [from, to).
fn chunk_range(id: u128) -> ([u8; 17], [u8; 17]) {
    let mut from = [b'c'; 17];
    from[1..].copy_from_slice(&id.to_be_bytes());
    let mut to = from;
    // The id + 1 as a 128-bit big-endian number; the last id has no next,
    // so its range ends at the next prefix letter.
    match id.checked_add(1) {
        Some(next) => to[1..].copy_from_slice(&next.to_be_bytes()),
        None => to = [b'd'; 17],
    }
    (from, to)
}

struct RocksChunks {
    db: Arc<DB>,
    id: u128,
    generation: u64,
    next: u32,
}

impl ChunkSource for RocksChunks {
    fn next_chunk(&mut self) -> Result<Option<Bytes>> {
        let got = self.db.get_pinned(chunk_key(self.id, self.generation, self.next));
        self.next += 1;
        match got {
            Ok(Some(v)) => Ok(Some(Bytes::copy_from_slice(&v))),
            // Asked only while the body is incomplete: the record was
            // replaced or deleted since its head was read. Not corruption.
            Ok(None) => bail!("the cache entry was replaced while its body was read"),
            Err(e) => Err(e.into()),
        }
    }
}

fn is_corruption(e: &rocksdb::Error) -> bool {
    e.kind() == ErrorKind::Corruption
}

fn data_key(id: u128) -> [u8; 17] {
    let mut k = [b'd'; 17];
    k[1..].copy_from_slice(&id.to_be_bytes());
    k
}

fn meta_key(id: u128) -> [u8; 17] {
    let mut k = [b'm'; 17];
    k[1..].copy_from_slice(&id.to_be_bytes());
    k
}

impl Rocks {
    /// Whether the record whose meta value is `meta` may have chunks to
    /// delete: only one whose record is over the streaming threshold (a
    /// record is never smaller than its body), or one whose meta cannot
    /// be read. A range deletion is paid for by every later read near it
    /// until a compaction drops it: one with every put cut RocksDB to
    /// about 3,000 writes a second, RocksDB re-sorting its memtable's
    /// range tombstones (`inband trace study`, docs/benchmarks.md). Puts
    /// and removes of one id are serialised (cache.rs), so the meta read
    /// here is the one being replaced.
    fn may_have_chunks(meta: Option<&[u8]>) -> bool {
        meta.is_some_and(|m| record::decode_meta(m).is_none_or(|(_, meta)| meta.size > STREAM_THRESHOLD))
    }

    pub(crate) fn open(dir: &Path, config: &Config) -> Result<Rocks> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(DBCompressionType::None);
        opts.set_enable_blob_files(true);
        // Meta records (~70 bytes) stay in the LSM, so startup's scan of
        // the `m` range reads no blob file.
        opts.set_min_blob_size(1024);
        opts.set_blob_compression_type(DBCompressionType::None);
        opts.set_enable_blob_gc(true);
        let mut table = BlockBasedOptions::default();
        table.set_bloom_filter(10.0, false);
        opts.set_block_based_table_factory(&table);
        let db = DB::open(&opts, dir).with_context(|| format!("opening RocksDB at {}", dir.display()))?;
        Ok(Rocks { db: Arc::new(db), fsync: config.fsync })
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(self.fsync);
        self.db.write_opt(batch, &wo)?;
        Ok(())
    }

    /// Moves everything written out of the memtable (and so out of the
    /// WAL) into table and blob files: tests corrupt those.
    #[cfg(test)]
    pub(crate) fn flush_memtable(&self) -> Result<()> {
        self.db.flush()?;
        Ok(())
    }

    /// How many chunk keys the store holds, of every record.
    #[cfg(test)]
    pub(crate) fn chunk_keys(&self) -> usize {
        let mut ro = ReadOptions::default();
        ro.set_iterate_upper_bound(*b"d");
        self.db.iterator_opt(IteratorMode::From(b"c", rocksdb::Direction::Forward), ro).count()
    }

    /// A `d` value as the record it stands for: whole, or its head with
    /// the body to follow from its chunks.
    fn raw(&self, id: u128, v: &[u8]) -> Raw {
        let Some((total, (_, k, h, _))) = record::claimed_len(v).and_then(|total| Some((total, record::head(v, total)?))) else {
            return Raw::Corrupt;
        };
        let at = record::HEAD + k + h;
        if v.len() as u64 == total {
            return Raw::Whole(Bytes::copy_from_slice(v));
        }
        if v.len() != at + 8 {
            return Raw::Corrupt;
        }
        let generation = u64::from_le_bytes(v[at..].try_into().expect("8 bytes"));
        let rest = Box::new(RocksChunks { db: self.db.clone(), id, generation, next: 0 });
        Raw::Split { prefix: Bytes::copy_from_slice(&v[..at]), total, rest }
    }

    fn for_each_meta_raw(&self, f: &mut dyn FnMut(u128, &[u8])) -> Result<()> {
        let mut ro = ReadOptions::default();
        ro.set_iterate_upper_bound(*b"n");
        for kv in self.db.iterator_opt(IteratorMode::From(b"m", rocksdb::Direction::Forward), ro) {
            let (k, v) = kv?;
            if let Ok(id) = <[u8; 16]>::try_from(&k[1..]) {
                f(u128::from_be_bytes(id), &v);
            }
        }
        Ok(())
    }
}

impl Backend for Rocks {
    const KIND: BackendKind = BackendKind::Rocksdb;
    const READS_BLOCK: bool = true;
    // Its writes stall while compaction falls behind.
    const WRITES_BLOCK: bool = true;

    fn get(&self, id: u128) -> Result<Option<Raw>> {
        match self.db.get_pinned(data_key(id)) {
            Ok(Some(v)) => Ok(Some(self.raw(id, &v))),
            Ok(None) => Ok(None),
            // RocksDB's own block checksums failed: the same as ours.
            Err(e) if is_corruption(&e) => Ok(Some(Raw::Corrupt)),
            Err(e) => Err(e.into()),
        }
    }

    fn range(&self, from: u128, limit: usize) -> Result<Vec<(u128, Raw)>> {
        let mut ro = ReadOptions::default();
        ro.set_iterate_upper_bound(*b"e");
        let mut out = Vec::with_capacity(limit);
        for kv in self.db.iterator_opt(IteratorMode::From(&data_key(from), rocksdb::Direction::Forward), ro).take(limit) {
            let (k, v) = kv?;
            let Ok(id) = <[u8; 16]>::try_from(&k[1..]) else { continue };
            let id = u128::from_be_bytes(id);
            out.push((id, self.raw(id, &v)));
        }
        Ok(out)
    }

    fn put(&self, id: u128, rec: &[u8], meta: &[u8]) -> Result<()> {
        let mut batch = WriteBatch::default();
        if Self::may_have_chunks(self.db.get_pinned(meta_key(id))?.as_deref()) {
            let (from, to) = chunk_range(id);
            batch.delete_range(from, to);
        }
        match record::head(rec, rec.len() as u64) {
            Some((_, k, h, body)) if body > STREAM_THRESHOLD => {
                let at = record::HEAD + k + h;
                let generation: u64 = rand::random();
                let mut first = rec[..at].to_vec();
                first.extend_from_slice(&generation.to_le_bytes());
                batch.put(data_key(id), first);
                for (i, chunk) in rec[at..].chunks(CHUNK_BYTES).enumerate() {
                    batch.put(chunk_key(id, generation, i as u32), chunk);
                }
            }
            // Small, or not a record at all (tests plant torn ones): whole.
            _ => batch.put(data_key(id), rec),
        }
        batch.put(meta_key(id), meta);
        self.write(batch)
    }

    fn remove(&self, id: u128) -> Result<bool> {
        // Ask the meta key: it is small and answers "was it there".
        let meta = self.db.get_pinned(meta_key(id))?;
        let mut batch = WriteBatch::default();
        batch.delete(data_key(id));
        batch.delete(meta_key(id));
        if Self::may_have_chunks(meta.as_deref()) {
            let (from, to) = chunk_range(id);
            batch.delete_range(from, to);
        }
        self.write(batch)?;
        Ok(meta.is_some())
    }

    fn scan(&self, f: &mut dyn FnMut(u128, Option<ScanItem>)) -> Result<()> {
        self.for_each_meta_raw(&mut |id, v| {
            let item = record::decode_meta(v)
                .map(|(_, m)| ScanItem { size: m.size, expires_at_ms: m.expires_at_ms, order: m.stored_at_ms });
            f(id, item)
        })
    }

    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()> {
        self.for_each_meta_raw(&mut |_, v| {
            if let Some((key, m)) = record::decode_meta(v) {
                f(key, &m);
            }
        })
    }

    fn flush(&self) -> Result<()> {
        self.db.flush_wal(true)?;
        Ok(())
    }
}

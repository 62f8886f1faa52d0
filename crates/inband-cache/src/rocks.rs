//! RocksDB backend (Debian's librocksdb 7.8): one keyspace, records under
//! `d` + id and meta records under `m` + id, so startup iterates the small
//! `m` range only. Both keys go in one WriteBatch, which RocksDB applies
//! atomically (one WAL record).
//!
//! The WAL is always on: without `fsync` it is written to the OS (kill -9
//! loses nothing) and `flush` syncs it; with `fsync` every batch is synced.
//! Tuned as RocksDB advises for large values and point lookups: records go
//! to blob files (integrated BlobDB, with garbage collection), so
//! compaction moves keys and pointers, not 10 KiB bodies; a bloom filter
//! spares reads of SST files that cannot hold the key. Compression is off:
//! HTTP bodies worth caching are mostly compressed already.

use std::path::Path;

use anyhow::{Context, Result};
use rocksdb::{BlockBasedOptions, DBCompressionType, IteratorMode, Options, ReadOptions, WriteBatch, WriteOptions, DB};

use crate::cache::{Backend, ScanItem};
use crate::record;
use crate::{BackendKind, Config, Meta};

pub(crate) struct Rocks {
    db: DB,
    fsync: bool,
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
        Ok(Rocks { db, fsync: config.fsync })
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(self.fsync);
        self.db.write_opt(batch, &wo)?;
        Ok(())
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

    fn get(&self, id: u128) -> Result<Option<Vec<u8>>> {
        Ok(self.db.get_pinned(data_key(id))?.map(|v| v.to_vec()))
    }

    fn put(&self, id: u128, rec: &[u8], meta: &[u8]) -> Result<()> {
        let mut batch = WriteBatch::default();
        batch.put(data_key(id), rec);
        batch.put(meta_key(id), meta);
        self.write(batch)
    }

    fn remove(&self, id: u128) -> Result<bool> {
        // Ask the meta key: it is small and answers "was it there".
        let had = self.db.get_pinned(meta_key(id))?.is_some();
        let mut batch = WriteBatch::default();
        batch.delete(data_key(id));
        batch.delete(meta_key(id));
        self.write(batch)?;
        Ok(had)
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

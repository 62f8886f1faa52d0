//! LMDB backend (heed): two named databases in one environment, `data`
//! (id → record) and `meta` (id → meta record with the key), written in one
//! transaction so they never disagree. Startup reads only `meta`.
//!
//! Without `fsync` the environment runs with MDB_NOSYNC: commits reach the
//! OS page cache (so kill -9 loses nothing) and `flush` fsyncs. LMDB's
//! copy-on-write pages and its two meta pages make every commit atomic.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use heed::types::Bytes;
use heed::{Database, Env, EnvFlags, EnvOpenOptions, RoTxn};

use crate::cache::{Backend, ScanItem};
use crate::record::{self, Raw};
use crate::{BackendKind, Config, Meta, STREAM_THRESHOLD};

/// A value handed out without a copy: the read transaction that keeps its
/// pages valid travels with it and ends when the last `Bytes` of it drops.
/// Pages of that snapshot are not reused by writers until then, which is
/// why the map leaves room (`map_size`) and why the proxy bounds how long
/// a client may take to read a response (`send_timeout_ms`).
struct Mapped {
    _txn: RoTxn<'static>,
    ptr: *const u8,
    len: usize,
    _slot: ReaderSlot,
}

/// One of the reader slots values handed out without a copy hold; the
/// count is what keeps them within [`MAPPED_READERS`].
struct ReaderSlot(Arc<AtomicUsize>);

impl Drop for ReaderSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

// SAFETY: the pointer is into pages of the read-only snapshot `_txn` holds
// (MDB_NOTLS, heed's `read-txn-no-tls`, makes the transaction itself
// movable between threads); nothing writes through it.
unsafe impl Send for Mapped {}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see `Send`; valid for `len` bytes while `_txn` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Reader slots of the environment (each open read transaction holds one
/// under MDB_NOTLS).
const MAX_READERS: u32 = 4096;

/// Values handed out without a copy, at most, but for records too large to
/// copy (from [`COPY_BELOW`]): each holds a reader slot until its response
/// is sent, so past this many (slow clients holding hits) smaller records
/// are copied out and their transaction closed at once, leaving the other
/// half of the slots to large bodies, reads and the writer.
/// Below it nothing is copied: copying a 10 KiB hit out of the map was a
/// tenth of the proxy's CPU on cached hits, and the copy the TLS or socket
/// write makes of it anyway reads the same pages.
const MAPPED_READERS: usize = MAX_READERS as usize / 2;

/// Records from this size on are always mapped (their body streams by
/// slices): a copy would hold the whole of a large body in memory.
const COPY_BELOW: usize = STREAM_THRESHOLD as usize + 64 * 1024;

pub(crate) struct Lmdb {
    env: Env,
    mapped: Arc<AtomicUsize>,
    data: Database<Bytes, Bytes>,
    meta: Database<Bytes, Bytes>,
}

impl Lmdb {
    pub(crate) fn open(dir: &Path, config: &Config) -> Result<Lmdb> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        // The map is address space, not memory or disk; LMDB cannot grow it
        // while open, so leave room for the free pages copy-on-write holds
        // while readers are active.
        let map_size = (config.capacity_bytes.saturating_mul(2) + (256 << 20)).next_multiple_of(1 << 20);
        let mut flags = EnvFlags::NO_READ_AHEAD;
        if !config.fsync {
            flags |= EnvFlags::NO_SYNC;
        }
        let mut options = EnvOpenOptions::new();
        // With MDB_NOTLS a reader slot is held by each open read
        // transaction, not by each thread that ever read: the proxy's
        // workers read briefly, and each large body streaming to a client
        // keeps one, so the slots bound those streams (LMDB's default 126
        // would be too few).
        options.map_size(map_size as usize).max_dbs(2).max_readers(MAX_READERS);
        // SAFETY: the directory holds only this store and is opened once per
        // process (NO_SYNC is "unsafe" only in that it trades durability on
        // power loss, which `flush` restores).
        let env = unsafe { options.flags(flags).open(dir) }.with_context(|| format!("opening LMDB at {}", dir.display()))?;
        let mut txn = env.write_txn()?;
        let data = env.create_database(&mut txn, Some("data"))?;
        let meta = env.create_database(&mut txn, Some("meta"))?;
        txn.commit()?;
        // Reader slots of a killed process stay taken until cleared.
        env.clear_stale_readers()?;
        Ok(Lmdb { env, mapped: Arc::default(), data, meta })
    }
}

impl Drop for Lmdb {
    // heed keeps every opened environment in a global registry until told
    // otherwise; without this a reopen in the same process (tests, or a
    // config reload) would get the old handle or an error.
    fn drop(&mut self) {
        self.env.clone().prepare_for_closing();
    }
}

impl Backend for Lmdb {
    const KIND: BackendKind = BackendKind::Lmdb;
    const READS_BLOCK: bool = false;
    // Under NO_SYNC (no `fsync`) a commit writes its pages into the page
    // cache and returns; the kernel writes them back later.
    const WRITES_BLOCK: bool = false;

    fn get(&self, id: u128) -> Result<Option<Raw>> {
        let txn = self.env.clone().static_read_txn()?;
        let Some(v) = self.data.get(&txn, &id.to_be_bytes())? else { return Ok(None) };
        if self.mapped.fetch_add(1, Ordering::Relaxed) >= MAPPED_READERS && v.len() < COPY_BELOW {
            self.mapped.fetch_sub(1, Ordering::Relaxed);
            return Ok(Some(Raw::Whole(bytes::Bytes::copy_from_slice(v))));
        }
        let slot = ReaderSlot(self.mapped.clone());
        let (ptr, len) = (v.as_ptr(), v.len());
        Ok(Some(Raw::Whole(bytes::Bytes::from_owner(Mapped { _txn: txn, ptr, len, _slot: slot }))))
    }

    fn put(&self, id: u128, rec: &[u8], meta: &[u8]) -> Result<()> {
        let k = id.to_be_bytes();
        let mut txn = self.env.write_txn()?;
        self.data.put(&mut txn, &k, rec)?;
        self.meta.put(&mut txn, &k, meta)?;
        txn.commit()?;
        Ok(())
    }

    fn remove(&self, id: u128) -> Result<bool> {
        let k = id.to_be_bytes();
        let mut txn = self.env.write_txn()?;
        let had = self.data.delete(&mut txn, &k)?;
        self.meta.delete(&mut txn, &k)?;
        txn.commit()?;
        Ok(had)
    }

    fn range(&self, from: u128, limit: usize) -> Result<Vec<(u128, Raw)>> {
        let txn = self.env.read_txn()?;
        let from = from.to_be_bytes();
        let mut out = Vec::with_capacity(limit);
        // A tuple of bounds: the range type that takes an unsized `[u8]`.
        let bounds = (std::ops::Bound::Included(&from[..]), std::ops::Bound::Unbounded);
        for kv in self.data.range(&txn, &bounds)?.take(limit) {
            let (k, v) = kv?;
            let Ok(k) = <[u8; 16]>::try_from(k) else { continue };
            out.push((u128::from_be_bytes(k), Raw::Whole(bytes::Bytes::copy_from_slice(v))));
        }
        Ok(out)
    }

    fn scan(&self, f: &mut dyn FnMut(u128, Option<ScanItem>)) -> Result<()> {
        let txn = self.env.read_txn()?;
        for kv in self.meta.iter(&txn)? {
            let (k, v) = kv?;
            let Ok(k) = <[u8; 16]>::try_from(k) else { continue };
            let item = record::decode_meta(v)
                .map(|(_, m)| ScanItem { size: m.size, expires_at_ms: m.expires_at_ms, order: m.stored_at_ms });
            f(u128::from_be_bytes(k), item);
        }
        Ok(())
    }

    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()> {
        let txn = self.env.read_txn()?;
        for kv in self.meta.iter(&txn)? {
            if let Some((key, m)) = record::decode_meta(kv?.1) {
                f(key, &m);
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.env.force_sync()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BackendKind;

    fn whole(r: Option<Raw>) -> bytes::Bytes {
        match r {
            Some(Raw::Whole(b)) => b,
            _ => panic!("expected a whole record"),
        }
    }

    /// A value handed out without a copy keeps the bytes it was read with
    /// while the record is replaced and removed under it.
    #[test]
    fn a_mapped_value_outlives_writes_to_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let db = Lmdb::open(dir.path(), &Config::new(BackendKind::Lmdb, None, 1 << 20)).unwrap();
        db.put(1, &[b'a'; 10240], b"m").unwrap();
        let held = whole(db.get(1).unwrap());
        assert_eq!(db.mapped.load(Ordering::Relaxed), 1);
        for fill in [b'b', b'c'] {
            db.put(1, &[fill; 10240], b"m").unwrap();
        }
        assert_eq!(whole(db.get(1).unwrap()), vec![b'c'; 10240]);
        assert!(db.remove(1).unwrap());
        assert_eq!(held, vec![b'a'; 10240]);
        drop(held);
        assert_eq!(db.mapped.load(Ordering::Relaxed), 0, "the slot is given back with the value");
    }

    /// Past MAPPED_READERS held values, small records are copied (and
    /// their reader slot freed at once), large ones still mapped; every
    /// read returns the record's bytes.
    #[test]
    fn held_values_are_bounded_by_the_mapped_readers() {
        let dir = tempfile::tempdir().unwrap();
        let db = Lmdb::open(dir.path(), &Config::new(BackendKind::Lmdb, None, 16 << 20)).unwrap();
        db.put(1, b"small", b"m").unwrap();
        let large = vec![7u8; COPY_BELOW];
        db.put(2, &large, b"m").unwrap();
        let held: Vec<_> = (0..MAPPED_READERS + 10).map(|_| whole(db.get(1).unwrap())).collect();
        assert!(held.iter().all(|b| b == b"small".as_slice()));
        assert_eq!(db.mapped.load(Ordering::Relaxed), MAPPED_READERS, "the ten past the bound were copied");
        let big = whole(db.get(2).unwrap());
        assert_eq!(big, large);
        assert_eq!(db.mapped.load(Ordering::Relaxed), MAPPED_READERS + 1, "a large record is mapped whatever the count");
        drop((held, big));
        assert_eq!(db.mapped.load(Ordering::Relaxed), 0);
        assert_eq!(whole(db.get(1).unwrap()), b"small".as_slice());
    }
}

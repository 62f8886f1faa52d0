//! The layer every backend shares: checksums, the size bound, eviction.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};

use crate::index::Index;
use crate::record::{self, Decoded, Raw};
use crate::{BackendKind, Config, Entry, Meta, NoWait, Stats, Store};

/// What a backend reports per entry at open, without reading its value.
pub struct ScanItem {
    pub size: u64,
    /// `u64::MAX` when the backend cannot tell without reading the record.
    pub expires_at_ms: u64,
    /// Orders entries for eviction after a restart (stored-at or mtime,
    /// Unix milliseconds): recency of use is not persisted, because writing
    /// it on every hit would turn reads into writes.
    pub order: u64,
}

/// Raw storage below the checksum layer: records addressed by the 128-bit
/// hash of their key. Each call is atomic on its own.
pub trait Backend: Send + Sync + 'static {
    const KIND: BackendKind;
    /// Whether `get` and the chunks it hands out may wait on a disk.
    const READS_BLOCK: bool;
    /// Whether `put` and `remove` may wait on a disk when nothing is
    /// fsynced (with `Config::fsync` every durable backend's writes do).
    const WRITES_BLOCK: bool;
    /// The record, whole or as a prefix and chunks (see [`Raw`]). An error
    /// the backend itself calls corruption (RocksDB's block checksums) is
    /// `Ok(Some(Raw::Corrupt))`, so it is counted like a CRC failure.
    fn get(&self, id: u128) -> Result<Option<Raw>>;
    /// `get` where it needs no disk I/O, for [`crate::Store::get_nowait`].
    fn get_nowait(&self, id: u128) -> Result<NoWait<Option<Raw>>> {
        if Self::READS_BLOCK {
            return Ok(NoWait::WouldBlock);
        }
        self.get(id).map(NoWait::Ready)
    }
    /// `meta` is the meta-table value for backends that keep one.
    fn put(&self, id: u128, record: &[u8], meta: &[u8]) -> Result<()>;
    fn remove(&self, id: u128) -> Result<bool>;
    /// Up to `limit` records in id order from `from` on. Only the backends
    /// [`BackendKind::unordered`] names ordered implement it; the rest are
    /// refused before they are asked.
    fn range(&self, _from: u128, _limit: usize) -> Result<Vec<(u128, Raw)>> {
        bail!("{}", Self::KIND.unordered().unwrap_or("this store cannot scan"))
    }
    /// Every entry for the eviction index; `None` for an entry whose
    /// metadata is unreadable (the caller deletes it).
    fn scan(&self, f: &mut dyn FnMut(u128, Option<ScanItem>)) -> Result<()>;
    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()>;
    fn flush(&self) -> Result<()>;
}

/// Serialises writers of one key (put, delete, eviction) so the backend and
/// the index agree on its size; different keys proceed in parallel.
const STRIPES: usize = 64;

/// The store: a handle on the shared state, so a body still streaming
/// can report its record corrupt after `get` returned.
pub struct Cache<B>(Arc<Inner<B>>);

impl<B> Deref for Cache<B> {
    type Target = Inner<B>;
    fn deref(&self) -> &Inner<B> {
        &self.0
    }
}

pub struct Inner<B> {
    backend: B,
    index: RwLock<Index>,
    stripes: Vec<Mutex<()>>,
    capacity: u64,
    fsync: bool,
    /// Logical clock for recency; starts above every restored `order` so
    /// entries used in this run rank newer than anything from before.
    tick: AtomicU64,
    corrupt: AtomicU64,
    evictions: AtomicU64,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl<B: Backend> Cache<B> {
    pub fn open(backend: B, config: &Config) -> Result<Self> {
        let mut index = Index::default();
        let mut unreadable = Vec::new();
        let mut newest = 0;
        backend.scan(&mut |id, item| match item {
            Some(s) => {
                newest = newest.max(s.order);
                index.insert(id, s.size, s.expires_at_ms, s.order);
            }
            None => unreadable.push(id),
        })?;
        for &id in &unreadable {
            backend.remove(id)?;
        }
        let cache = Cache(Arc::new(Inner {
            backend,
            index: RwLock::new(index),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            capacity: config.capacity_bytes,
            fsync: config.fsync,
            tick: AtomicU64::new(newest.max(now_ms()) + 1),
            corrupt: AtomicU64::new(unreadable.len() as u64),
            evictions: AtomicU64::new(0),
        }));
        // The capacity may have shrunk since the last run.
        cache.evict_to_capacity()?;
        Ok(cache)
    }

    /// What a backend read means: the entry, or a miss for another key's
    /// record under the same hash, or a corrupt record (deleted).
    fn found(&self, key: &[u8], id: u128, raw: Option<Raw>) -> Result<Option<Entry>> {
        let Some(raw) = raw else { return Ok(None) };
        let inner = self.0.clone();
        let on_corrupt = Box::new(move || {
            // The stream reports the corruption to its reader; a failed
            // delete has no one else to tell.
            if let Err(e) = inner.drop_corrupt(id) {
                tracing::warn!(error = %e, "deleting a corrupt cache record failed");
            }
        });
        match record::decode(key, raw, on_corrupt) {
            Decoded::Hit(e) => {
                self.index.read().unwrap().touch(id, self.next_tick());
                Ok(Some(e))
            }
            Decoded::OtherKey => Ok(None),
            Decoded::Corrupt => {
                self.drop_corrupt(id)?;
                Ok(None)
            }
        }
    }

    /// The raw layer, for tests that plant bad records below the checksum.
    #[cfg(test)]
    pub(crate) fn backend(&self) -> &B {
        &self.backend
    }
}

impl<B: Backend> Inner<B> {
    /// A record failed its checksum or framing: counted once, deleted.
    fn drop_corrupt(&self, id: u128) -> Result<()> {
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        // A put racing in between may have replaced the bad record with a
        // good one; deleting that too only costs a miss.
        let _g = self.stripe(id);
        self.backend.remove(id)?;
        self.index.write().unwrap().remove(id);
        Ok(())
    }

    fn stripe(&self, id: u128) -> std::sync::MutexGuard<'_, ()> {
        self.stripes[id as usize % STRIPES].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed)
    }

    fn evict_to_capacity(&self) -> Result<()> {
        loop {
            let victim = {
                let index = self.index.read().unwrap();
                if index.total() <= self.capacity {
                    return Ok(());
                }
                index.victim(now_ms())
            };
            let Some(id) = victim else { return Ok(()) };
            let _g = self.stripe(id);
            if self.index.write().unwrap().remove(id).is_some() {
                self.backend.remove(id)?;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl<B: Backend> Store for Cache<B> {
    fn kind(&self) -> BackendKind {
        B::KIND
    }

    fn reads_block(&self) -> bool {
        B::READS_BLOCK
    }

    fn writes_block(&self) -> bool {
        B::WRITES_BLOCK || (self.fsync && B::KIND.durable())
    }

    fn get(&self, key: &[u8]) -> Result<Option<Entry>> {
        crate::probe::store_get();
        let id = record::id(key);
        let raw = self.backend.get(id)?;
        self.found(key, id, raw)
    }

    fn get_nowait(&self, key: &[u8]) -> Result<NoWait<Option<Entry>>> {
        let id = record::id(key);
        match self.backend.get_nowait(id)? {
            NoWait::Ready(raw) => {
                crate::probe::store_get();
                self.found(key, id, raw).map(NoWait::Ready)
            }
            NoWait::WouldBlock => Ok(NoWait::WouldBlock),
        }
    }

    fn put(&self, key: &[u8], stored_at_ms: u64, expires_at_ms: u64, header: &[u8], body: &[u8]) -> Result<Meta> {
        crate::probe::store_put();
        let rec = record::encode(key, stored_at_ms, expires_at_ms, header, body);
        let meta = Meta { stored_at_ms, expires_at_ms, size: rec.len() as u64 };
        if meta.size > self.capacity {
            bail!("entry of {} bytes exceeds the cache capacity of {} bytes", meta.size, self.capacity);
        }
        let id = record::id(key);
        {
            let _g = self.stripe(id);
            self.backend.put(id, &rec, &record::encode_meta(key, &meta))?;
            self.index.write().unwrap().insert(id, meta.size, expires_at_ms, self.next_tick());
        }
        self.evict_to_capacity()?;
        Ok(meta)
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        crate::probe::store_delete();
        let id = record::id(key);
        let _g = self.stripe(id);
        self.index.write().unwrap().remove(id);
        self.backend.remove(id)
    }

    fn contains(&self, key: &[u8]) -> bool {
        self.index.read().unwrap().contains(record::id(key))
    }

    fn scan(&self, key: &[u8], limit: usize) -> Result<Vec<(bytes::Bytes, Entry)>> {
        if let Some(why) = B::KIND.unordered() {
            bail!("{why}");
        }
        let mut out = Vec::with_capacity(limit);
        for (id, raw) in self.backend.range(record::id(key), limit)? {
            let Some(key) = record::claimed_key(&raw) else {
                self.drop_corrupt(id)?;
                continue;
            };
            // Whole records only (a split one is read to its end here), so
            // a corrupt body is known now and the stream's hook never runs.
            match record::decode(&key, raw, Box::new(|| {})) {
                Decoded::Hit(mut e) => {
                    if let crate::EntryBody::Chunks(_) = e.body {
                        let body = e.body.into_bytes();
                        let Ok(body) = body else {
                            self.drop_corrupt(id)?;
                            continue;
                        };
                        e.body = crate::EntryBody::Whole(body);
                    }
                    out.push((key, e));
                }
                // Not reached: the key came from the record itself.
                Decoded::OtherKey => {}
                Decoded::Corrupt => self.drop_corrupt(id)?,
            }
        }
        Ok(out)
    }

    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()> {
        self.backend.for_each_meta(f)
    }

    fn len(&self) -> u64 {
        self.index.read().unwrap().len()
    }

    fn size_bytes(&self) -> u64 {
        self.index.read().unwrap().total()
    }

    fn flush(&self) -> Result<()> {
        self.backend.flush()
    }

    fn stats(&self) -> Stats {
        let index = self.index.read().unwrap();
        Stats {
            entries: index.len(),
            size_bytes: index.total(),
            capacity_bytes: self.capacity,
            corrupt: self.corrupt.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }
}

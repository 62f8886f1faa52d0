//! In-memory eviction index: id → (size, expiry, last access).
//!
//! Eviction is sampled LRU (as in Redis): look at a few random entries and
//! evict the least recently used, expired entries first. A true LRU list
//! needs a write lock on every hit to move the entry to the front, which
//! serialises readers; here a hit is a read lock plus one relaxed atomic
//! store, and with 8 samples the victim is in the oldest ~10% with high
//! probability. No crate offers this over an external store with a
//! persisted size, so it is written here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng;

/// Entries looked at per eviction; an index this small or smaller is
/// scanned whole, so eviction is exact LRU there.
const SAMPLES: usize = 8;

struct Slot {
    id: u128,
    size: u64,
    expires_at_ms: u64,
    last: AtomicU64,
}

#[derive(Default)]
pub(crate) struct Index {
    map: HashMap<u128, usize>,
    // A dense vector so a random sample is O(1); removal swaps the last in.
    slots: Vec<Slot>,
    total: u64,
}

impl Index {
    pub(crate) fn len(&self) -> u64 {
        self.slots.len() as u64
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    pub(crate) fn contains(&self, id: u128) -> bool {
        self.map.contains_key(&id)
    }

    pub(crate) fn insert(&mut self, id: u128, size: u64, expires_at_ms: u64, tick: u64) {
        self.total += size;
        match self.map.get(&id) {
            Some(&i) => {
                let s = &mut self.slots[i];
                self.total -= s.size;
                s.size = size;
                s.expires_at_ms = expires_at_ms;
                *s.last.get_mut() = tick;
            }
            None => {
                self.map.insert(id, self.slots.len());
                self.slots.push(Slot { id, size, expires_at_ms, last: AtomicU64::new(tick) });
            }
        }
    }

    pub(crate) fn remove(&mut self, id: u128) -> Option<u64> {
        let i = self.map.remove(&id)?;
        let s = self.slots.swap_remove(i);
        if let Some(moved) = self.slots.get(i) {
            self.map.insert(moved.id, i);
        }
        self.total -= s.size;
        Some(s.size)
    }

    pub(crate) fn touch(&self, id: u128, tick: u64) {
        if let Some(&i) = self.map.get(&id) {
            self.slots[i].last.store(tick, Ordering::Relaxed);
        }
    }

    pub(crate) fn victim(&self, now_ms: u64) -> Option<u128> {
        let age = |s: &Slot| if s.expires_at_ms <= now_ms { 0 } else { s.last.load(Ordering::Relaxed) };
        if self.slots.len() <= SAMPLES {
            return self.slots.iter().min_by_key(|s| age(s)).map(|s| s.id);
        }
        let mut rng = rand::thread_rng();
        (0..SAMPLES).map(|_| &self.slots[rng.gen_range(0..self.slots.len())]).min_by_key(|s| age(s)).map(|s| s.id)
    }
}

//! In-memory backend: a sharded concurrent map (dashmap) of records. Not
//! durable; kept behind the same checksum layer so all four backends are
//! measured doing the same work per operation.

use anyhow::Result;
use bytes::Bytes;
use dashmap::DashMap;

use crate::cache::{Backend, ScanItem};
use crate::record::{self, Raw};
use crate::{BackendKind, Meta};

/// Records are `Bytes`, so a hit hands out a reference, not a copy.
#[derive(Default)]
pub(crate) struct Memory {
    map: DashMap<u128, Bytes>,
}

impl Backend for Memory {
    const KIND: BackendKind = BackendKind::Memory;
    const READS_BLOCK: bool = false;
    const WRITES_BLOCK: bool = false;

    fn get(&self, id: u128) -> Result<Option<Raw>> {
        Ok(self.map.get(&id).map(|r| Raw::Whole(r.clone())))
    }

    fn put(&self, id: u128, rec: &[u8], _meta: &[u8]) -> Result<()> {
        self.map.insert(id, Bytes::copy_from_slice(rec));
        Ok(())
    }

    fn remove(&self, id: u128) -> Result<bool> {
        Ok(self.map.remove(&id).is_some())
    }

    fn scan(&self, _f: &mut dyn FnMut(u128, Option<ScanItem>)) -> Result<()> {
        // Opened empty, every time.
        Ok(())
    }

    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()> {
        for r in self.map.iter() {
            if let Some((meta, k, _, _)) = record::head(r.value(), r.value().len() as u64) {
                f(&r.value()[record::HEAD..record::HEAD + k], &meta);
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

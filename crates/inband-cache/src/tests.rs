//! One conformance suite run against every backend, plus corruption and
//! crash-consistency tests for the durable ones.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::Rng;

use super::*;
use crate::cache::Backend;
use crate::record;

const FAR: u64 = u64::MAX;

fn store(kind: BackendKind, dir: &Path, capacity: u64) -> Box<dyn Store> {
    open(&Config::new(kind, Some(dir.to_path_buf()), capacity)).unwrap()
}

fn record_size(key: &[u8], header: &[u8], body: &[u8]) -> u64 {
    (record::HEAD + key.len() + header.len() + body.len()) as u64
}

fn body(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn round_trip(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 1 << 20);
    assert_eq!(s.kind(), kind);
    let (k, h, b) = (b"GET /a?x=1".as_slice(), b"HTTP/1.1 200 OK\r\nETag: \"1\"".as_slice(), body(5000, 1));
    let meta = s.put(k, 1000, 2000, h, &b).unwrap();
    assert_eq!(meta, Meta { stored_at_ms: 1000, expires_at_ms: 2000, size: record_size(k, h, &b) });
    let e = s.get(k).unwrap().expect("hit");
    assert_eq!((e.meta, &e.header[..]), (meta, h));
    assert_eq!(e.body_bytes().unwrap(), b);
    assert!(s.contains(k));
    // Missing key, and an empty key/header/body.
    assert!(s.get(b"GET /b").unwrap().is_none());
    assert!(!s.contains(b"GET /b"));
    s.put(b"", 1, FAR, b"", b"").unwrap();
    let e = s.get(b"").unwrap().expect("empty entry");
    assert!(e.header.is_empty() && e.body.is_empty());
    assert_eq!(s.len(), 2);
    s.flush().unwrap();
}

fn overwrite(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 1 << 20);
    s.put(b"k", 1, FAR, b"h1", &body(3000, 1)).unwrap();
    let m2 = s.put(b"k", 2, FAR, b"h2", &body(700, 2)).unwrap();
    let e = s.get(b"k").unwrap().unwrap();
    assert_eq!((e.meta.stored_at_ms, &e.header[..]), (2, b"h2".as_slice()));
    assert_eq!(e.body_bytes().unwrap(), body(700, 2));
    assert_eq!((s.len(), s.size_bytes()), (1, m2.size));
}

fn delete(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 1 << 20);
    s.put(b"a", 1, FAR, b"", &body(100, 0)).unwrap();
    let mb = s.put(b"b", 1, FAR, b"", &body(200, 0)).unwrap();
    assert!(s.delete(b"a").unwrap());
    assert!(!s.delete(b"a").unwrap(), "second delete finds nothing");
    assert!(!s.delete(b"never").unwrap());
    assert!(s.get(b"a").unwrap().is_none());
    assert!(!s.contains(b"a"));
    assert_eq!((s.len(), s.size_bytes()), (1, mb.size));
    assert!(s.get(b"b").unwrap().is_some());
}

fn metadata_iteration(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 1 << 20);
    let mut want = HashMap::new();
    for i in 0..50u64 {
        let key = format!("GET /obj/{i}").into_bytes();
        let m = s.put(&key, 1000 + i, 5000 + i, &[i as u8; 10], &body(i as usize * 13, i as u8)).unwrap();
        want.insert(key, m);
    }
    s.delete(b"GET /obj/7").unwrap();
    want.remove(b"GET /obj/7".as_slice());
    let mut got = HashMap::new();
    s.for_each_meta(&mut |k, m| assert!(got.insert(k.to_vec(), *m).is_none(), "key listed twice")).unwrap();
    assert_eq!(got, want);
}

fn size_accounting(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 1 << 20);
    let mut total = 0;
    for i in 0..20usize {
        let key = format!("k{i}");
        total += s.put(key.as_bytes(), 1, FAR, b"hdr", &body(i * 100, 0)).unwrap().size;
    }
    total -= record_size(b"k3", b"hdr", &body(300, 0));
    s.delete(b"k3").unwrap();
    total -= record_size(b"k4", b"hdr", &body(400, 0)) - record_size(b"k4", b"", &[]);
    s.put(b"k4", 1, FAR, b"", b"").unwrap();
    let mut listed = 0;
    s.for_each_meta(&mut |_, m| listed += m.size).unwrap();
    let st = s.stats();
    assert_eq!((s.size_bytes(), listed, st.size_bytes, st.entries), (total, total, total, 19));
}

fn eviction(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let b = body(1000, 9);
    // Same-length keys: every record is the same size.
    let one = record_size(b"k000", b"", &b);
    let s = store(kind, dir.path(), 6 * one);
    for i in 0..6 {
        s.put(format!("k{i:03}").as_bytes(), 1, FAR, b"", &b).unwrap();
    }
    assert_eq!(s.stats().evictions, 0);
    // k000 used, so k001 is the least recently used (the index is small enough
    // to be scanned whole: exact LRU).
    assert!(s.get(b"k000").unwrap().is_some());
    s.put(b"k006", 1, FAR, b"", &b).unwrap();
    assert_eq!(s.stats().evictions, 1);
    assert!(s.get(b"k001").unwrap().is_none(), "LRU entry evicted");
    assert!(s.get(b"k000").unwrap().is_some(), "recently used entry kept");
    // An expired entry goes first, however recently used.
    s.put(b"s000", 1, 1, b"", &body(1000, 9)).unwrap();
    assert!(s.get(b"s000").unwrap().is_none(), "expired entry evicted first");
    // Under sustained writes the bound holds and every survivor is intact.
    for i in 0..200 {
        s.put(format!("n{i:03}").as_bytes(), 1, FAR, b"", &b).unwrap();
        assert!(s.size_bytes() <= 6 * one);
    }
    assert_eq!(s.len(), 6);
    let mut n = 0;
    s.for_each_meta(&mut |_, _| n += 1).unwrap();
    assert_eq!(n, 6, "backend and index agree");
    assert!(s.stats().evictions >= 200);
    assert!(s.put(b"huge", 1, FAR, b"", &body(7 * 1000, 0)).is_err(), "entry over capacity refused");
}

fn reopen(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let mut want = Vec::new();
    {
        let s = store(kind, dir.path(), 1 << 20);
        for i in 0..30u8 {
            let (k, h, b) = (format!("key-{i}").into_bytes(), vec![i; 7], body(i as usize * 200, i));
            s.put(&k, 100 + i as u64, FAR, &h, &b).unwrap();
            want.push((k, h, b));
        }
        s.flush().unwrap();
    }
    let total: u64 = want.iter().map(|(k, h, b)| record_size(k, h, b)).sum();
    {
        let s = store(kind, dir.path(), 1 << 20);
        assert_eq!((s.len(), s.size_bytes()), (30, total));
        for (k, h, b) in &want {
            let e = s.get(k).unwrap().expect("entry survives reopen");
            assert_eq!(&e.header[..], &h[..]);
            assert_eq!(e.body_bytes().unwrap(), b);
        }
    }
    // A smaller bound is enforced at open.
    let s = store(kind, dir.path(), total / 2);
    assert!(s.size_bytes() <= total / 2);
    assert!(s.stats().evictions > 0);
    assert!(s.len() < 30);
    for (k, h, b) in &want {
        if let Some(e) = s.get(k).unwrap() {
            assert_eq!(&e.header[..], &h[..]);
            assert_eq!(e.body_bytes().unwrap(), b);
        }
    }
}

/// Every chunk of a streamed body, checked for size; the last call's result.
fn drain(mut c: BodyChunks) -> (Vec<u8>, Result<()>) {
    let mut out = Vec::new();
    loop {
        match c.next_chunk() {
            Ok(Some(chunk)) => {
                assert!(!chunk.is_empty() && chunk.len() <= CHUNK_BYTES, "chunk of {} bytes", chunk.len());
                out.extend_from_slice(&chunk);
            }
            Ok(None) => return (out, Ok(())),
            Err(e) => return (out, Err(e)),
        }
    }
}

fn chunks_of(e: Entry) -> BodyChunks {
    match e.body {
        EntryBody::Chunks(c) => c,
        EntryBody::Whole(b) => panic!("a body of {} bytes came whole", b.len()),
    }
}

fn large_bodies_stream(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 64 << 20);
    let (odd, even) = (body(3_000_001, 7), body(4 * CHUNK_BYTES, 8));
    s.put(b"odd", 1, FAR, b"h-odd", &odd).unwrap();
    s.put(b"even", 1, FAR, b"h-even", &even).unwrap();
    s.put(b"small", 1, FAR, b"h", &body(STREAM_THRESHOLD as usize, 9)).unwrap();
    for (k, h, b) in [(b"odd".as_slice(), b"h-odd".as_slice(), &odd), (b"even", b"h-even", &even)] {
        let e = s.get(k).unwrap().unwrap();
        assert_eq!((&e.header[..], e.body.len()), (h, b.len() as u64));
        let (got, end) = drain(chunks_of(e));
        end.unwrap();
        assert!(got == *b, "{k:?} streamed other bytes");
        assert_eq!(s.get(k).unwrap().unwrap().body_bytes().unwrap(), *b);
    }
    assert!(matches!(s.get(b"small").unwrap().unwrap().body, EntryBody::Whole(_)), "a body at the threshold comes whole");
    assert_eq!(s.stats().corrupt, 0);
}

fn large_overwrite_and_delete(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 64 << 20);
    s.put(b"k", 1, FAR, b"", &body(1_000_000, 1)).unwrap();
    let m = s.put(b"k", 2, FAR, b"", &body(100, 2)).unwrap();
    assert_eq!(s.get(b"k").unwrap().unwrap().body_bytes().unwrap(), body(100, 2));
    assert_eq!(s.size_bytes(), m.size);
    s.put(b"k", 3, FAR, b"", &body(2_000_000, 3)).unwrap();
    assert_eq!(s.get(b"k").unwrap().unwrap().body_bytes().unwrap(), body(2_000_000, 3));
    assert!(s.delete(b"k").unwrap());
    assert!(s.get(b"k").unwrap().is_none());
    assert_eq!((s.len(), s.size_bytes(), s.stats().corrupt), (0, 0, 0));
}

/// A body being read while its key is overwritten and deleted yields the
/// bytes it started with (LMDB's snapshot, the memory store's reference,
/// the file's open descriptor) or, for RocksDB, an error: never a mix.
fn stream_outlives_overwrite(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 64 << 20);
    let first = body(3_000_000, 4);
    s.put(b"k", 1, FAR, b"", &first).unwrap();
    let mut c = chunks_of(s.get(b"k").unwrap().unwrap());
    let mut got = c.next_chunk().unwrap().unwrap().to_vec();
    s.put(b"k", 2, FAR, b"", &body(3_000_000, 5)).unwrap();
    s.delete(b"k").unwrap();
    let (rest, end) = drain(c);
    got.extend_from_slice(&rest);
    match end {
        Ok(()) => assert!(got == first, "mixed bytes"),
        Err(e) => assert_eq!(kind, BackendKind::Rocksdb, "{e:#}"),
    }
    assert_eq!(s.stats().corrupt, 0, "a replaced record is not corruption");
}

/// A read on an event loop: answered from memory (LMDB's mapped pages,
/// the memory store, a file in the page cache) or refused as one that
/// would wait, never a wait; and `get` still answers what it refused.
fn get_nowait_never_waits_on_the_disk(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 1 << 20);
    let b = body(5000, 2);
    s.put(b"k", 1, FAR, b"h", &b).unwrap();
    let ready = |r: NoWait<Option<Entry>>| match r {
        NoWait::Ready(e) => Some(e.map(|e| e.body_bytes().unwrap())),
        NoWait::WouldBlock => None,
    };
    let (hot, absent) = (ready(s.get_nowait(b"k").unwrap()), ready(s.get_nowait(b"absent").unwrap()));
    match kind {
        // Its values are in blob files, which RocksDB reads with pread.
        BackendKind::Rocksdb => assert_eq!((hot, absent), (None, None)),
        _ => assert_eq!((hot, absent), (Some(Some(b.clone().into())), Some(None))),
    }
    if kind == BackendKind::Files {
        // RWF_NOWAIT starts the disk read it refuses to wait for, and a
        // virtual disk can finish it inside the call (15 of 3,000 cold
        // reads on this VM): that answer came without a wait too. A read
        // that waits answers every time, so the record, dropped from the
        // page cache before each try (and seen gone: a drop can miss a
        // page held at that instant, which answered 96 of 750 tries with
        // both CPUs busy and a writer on the disk), must be refused at
        // least once in five.
        let mut refused = 0;
        for _ in 0..5 {
            crate::bench::drop_cached_pages(dir.path()).unwrap();
            match ready(s.get_nowait(b"k").unwrap()) {
                None => refused += 1,
                Some(got) => assert_eq!(got, Some(b.clone().into())),
            }
        }
        assert!(refused > 0, "a record out of the page cache was read five times without a refusal");
    }
    assert_eq!(s.get(b"k").unwrap().unwrap().body_bytes().unwrap(), b);
}

/// Scans go in id order from the key's place, read large bodies whole,
/// stop at the end; a store without order refuses with its reason.
fn scan(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(kind, dir.path(), 64 << 20);
    let mut stored: Vec<(String, Vec<u8>)> = (0..50).map(|i| (format!("GET /s/{i}"), body(100 + i, i as u8))).collect();
    stored.push(("GET /big".to_string(), body(STREAM_THRESHOLD as usize + 5000, 9)));
    for (k, b) in &stored {
        s.put(k.as_bytes(), 1, FAR, b"h", b).unwrap();
    }
    if let Some(why) = kind.unordered() {
        let Err(e) = s.scan(b"GET /s/0", 10) else { panic!("{kind} scanned") };
        assert_eq!(e.to_string(), why);
        return;
    }
    stored.sort_by_key(|(k, _)| record::id(k.as_bytes()));
    let keys = |got: &[(bytes::Bytes, Entry)]| got.iter().map(|(k, _)| String::from_utf8(k.to_vec()).unwrap()).collect::<Vec<_>>();
    let got = s.scan(stored[10].0.as_bytes(), 7).unwrap();
    assert_eq!(keys(&got), stored[10..17].iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
    let all = s.scan(stored[0].0.as_bytes(), 100).unwrap();
    assert_eq!(all.len(), stored.len());
    for ((k, e), (want_k, want_b)) in all.into_iter().zip(&stored) {
        assert_eq!((&k[..], &e.header[..]), (want_k.as_bytes(), b"h".as_slice()));
        let EntryBody::Whole(b) = e.body else { panic!("{want_k}: a scan reads bodies whole") };
        assert_eq!(&b[..], &want_b[..], "{want_k}");
    }
    assert_eq!(keys(&s.scan(stored[49].0.as_bytes(), 10).unwrap()), [stored[49].0.clone(), stored[50].0.clone()]);
    // A key not stored: the scan starts where it would be.
    let absent = b"GET /absent";
    let from = stored.iter().position(|(k, _)| record::id(k.as_bytes()) > record::id(absent)).unwrap_or(stored.len());
    let got = s.scan(absent, 3).unwrap();
    assert_eq!(keys(&got), stored[from..(from + 3).min(stored.len())].iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
}

/// A record's chunks go with it when it is replaced by a small one or
/// deleted, though only records that had chunks get a range deletion.
#[test]
fn rocksdb_leaves_no_chunk_behind() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new(BackendKind::Rocksdb, None, 64 << 20);
    let s = Cache::open(rocks::Rocks::open(dir.path(), &config).unwrap(), &config).unwrap();
    s.put(b"k", 1, FAR, b"", &body(1_000_000, 1)).unwrap();
    let chunks = s.backend().chunk_keys();
    assert!(chunks > 1, "{chunks}");
    s.put(b"k", 2, FAR, b"", &body(100, 2)).unwrap();
    assert_eq!(s.backend().chunk_keys(), 0, "a small record left the large one's chunks");
    s.put(b"k", 3, FAR, b"", &body(100, 3)).unwrap();
    s.put(b"k", 4, FAR, b"", &body(1_000_000, 4)).unwrap();
    assert_eq!(s.backend().chunk_keys(), chunks);
    assert!(s.delete(b"k").unwrap());
    assert_eq!(s.backend().chunk_keys(), 0, "a delete left chunks");
    assert!(s.get(b"k").unwrap().is_none());
}

macro_rules! conformance {
    ($($backend:ident: $kind:expr, [$($case:ident),*];)*) => {$(
        mod $backend {
            use super::BackendKind;
            $(#[test] fn $case() { super::$case($kind) })*
        }
    )*};
}

conformance! {
    on_lmdb: BackendKind::Lmdb, [round_trip, overwrite, delete, metadata_iteration, size_accounting, eviction, reopen,
        large_bodies_stream, large_overwrite_and_delete, stream_outlives_overwrite, get_nowait_never_waits_on_the_disk, scan];
    on_rocksdb: BackendKind::Rocksdb, [round_trip, overwrite, delete, metadata_iteration, size_accounting, eviction, reopen,
        large_bodies_stream, large_overwrite_and_delete, stream_outlives_overwrite, get_nowait_never_waits_on_the_disk, scan];
    on_files: BackendKind::Files, [round_trip, overwrite, delete, metadata_iteration, size_accounting, eviction, reopen,
        large_bodies_stream, large_overwrite_and_delete, stream_outlives_overwrite, get_nowait_never_waits_on_the_disk, scan];
    on_memory: BackendKind::Memory, [round_trip, overwrite, delete, metadata_iteration, size_accounting, eviction,
        large_bodies_stream, large_overwrite_and_delete, stream_outlives_overwrite, get_nowait_never_waits_on_the_disk, scan];
}

#[test]
fn config_names_and_defaults() {
    let c: Config = serde_json::from_str(r#"{"path": "/var/cache/inband"}"#).unwrap();
    assert_eq!((c.backend, c.capacity_bytes, c.fsync), (BackendKind::Lmdb, 1 << 30, false));
    for kind in BackendKind::ALL {
        let c: Config = serde_json::from_str(&format!(r#"{{"backend": "{kind}"}}"#)).unwrap();
        assert_eq!(c.backend, kind);
        assert_eq!(kind.name().parse::<BackendKind>().unwrap(), kind);
    }
    assert!(serde_json::from_str::<Config>(r#"{"backend": "leveldb"}"#).is_err());
    assert!(serde_json::from_str::<Config>(r#"{"capacity": 1}"#).is_err(), "unknown field refused");
    assert!(open(&Config::new(BackendKind::Lmdb, None, 1 << 20)).is_err(), "durable backend needs a path");
}

/// Which stores a caller may read and write on an event loop: the proxy
/// writes a miss on its worker only where `writes_block` is false.
#[test]
fn which_stores_may_wait_on_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    for kind in BackendKind::ALL {
        for fsync in [false, true] {
            let mut config = Config::new(kind, Some(dir.path().join(format!("{kind}-{fsync}"))), 16 << 20);
            config.fsync = fsync;
            let s = open(&config).unwrap();
            let disk = matches!(kind, BackendKind::Rocksdb | BackendKind::Files);
            assert_eq!(s.reads_block(), disk, "{kind} reads");
            assert_eq!(s.writes_block(), disk || (fsync && kind.durable()), "{kind} writes, fsync {fsync}");
        }
    }
}

/// More threads than LMDB's default reader table, each reading once.
#[test]
fn lmdb_serves_many_reader_threads() {
    const READERS: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let s = store(BackendKind::Lmdb, dir.path(), 1 << 20);
    s.put(b"k", 1, FAR, b"", b"v").unwrap();
    let ok = std::sync::atomic::AtomicUsize::new(0);
    // Bounded, not a Barrier: a reader that fails (or a thread that cannot
    // be spawned) must fail the test, not leave the others waiting forever.
    let deadline = Instant::now() + Duration::from_secs(10);
    std::thread::scope(|sc| {
        for _ in 0..READERS {
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn_scoped(sc, || {
                    if s.get(b"k").ok().flatten().is_some_and(|e| e.body_bytes().unwrap() == b"v".as_slice()) {
                        ok.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    // Keep every thread (and its reader slot) alive until all have read.
                    while ok.load(std::sync::atomic::Ordering::SeqCst) < READERS && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                })
                .expect("spawning a reader thread");
        }
    });
    assert_eq!(ok.into_inner(), READERS);
}

#[test]
fn memory_forgets_on_reopen() {
    let s = store(BackendKind::Memory, Path::new("/nonexistent"), 1 << 20);
    s.put(b"k", 1, FAR, b"", b"v").unwrap();
    drop(s);
    assert!(store(BackendKind::Memory, Path::new("/nonexistent"), 1 << 20).is_empty());
}

fn decode_whole(key: &[u8], rec: &[u8]) -> record::Decoded {
    record::decode(key, record::Raw::Whole(bytes::Bytes::copy_from_slice(rec)), Box::new(|| {}))
}

#[test]
fn codec_detects_every_flipped_byte_and_truncation() {
    let rec = record::encode(b"key", 1, 2, b"hdr", b"body bytes");
    assert!(matches!(decode_whole(b"key", &rec), record::Decoded::Hit(_)));
    assert!(matches!(decode_whole(b"other", &rec), record::Decoded::OtherKey));
    for i in 0..rec.len() {
        let mut bad = rec.clone();
        bad[i] ^= 0x40;
        assert!(matches!(decode_whole(b"key", &bad), record::Decoded::Corrupt), "flip at {i} undetected");
    }
    for n in 0..rec.len() {
        assert!(matches!(decode_whole(b"key", &rec[..n]), record::Decoded::Corrupt), "truncation to {n} undetected");
    }
    let meta = Meta { stored_at_ms: 5, expires_at_ms: 6, size: 7 };
    let m = record::encode_meta(b"key", &meta);
    assert_eq!(record::decode_meta(&m), Some((b"key".as_slice(), meta)));
    let mut bad = m.clone();
    bad[10] ^= 1;
    assert_eq!(record::decode_meta(&bad), None);
}

/// Plants a bad record through the backend (below the checksum layer): a
/// flipped body byte, then a torn (truncated) record.
fn planted_corruption<B: Backend>(open_backend: impl Fn() -> B) {
    let cache = Cache::open(open_backend(), &Config::new(B::KIND, None, 16 << 20)).unwrap();
    let b = body(4000, 3);
    for key in [b"good".as_slice(), b"flipped", b"torn"] {
        cache.put(key, 1, FAR, b"h", &b).unwrap();
    }
    let mut rec = record::encode(b"flipped", 1, FAR, b"h", &b);
    rec[2000] ^= 1;
    let meta = record::encode_meta(b"flipped", &Meta { stored_at_ms: 1, expires_at_ms: FAR, size: rec.len() as u64 });
    cache.backend().put(record::id(b"flipped"), &rec, &meta).unwrap();
    let rec = record::encode(b"torn", 1, FAR, b"h", &b);
    cache.backend().put(record::id(b"torn"), &rec[..rec.len() / 2], &meta).unwrap();

    assert!(cache.get(b"flipped").unwrap().is_none());
    assert!(cache.get(b"torn").unwrap().is_none());
    assert_eq!(cache.stats().corrupt, 2);
    assert!(!cache.contains(b"flipped") && !cache.contains(b"torn"), "corrupt entries deleted");
    assert!(cache.backend().get(record::id(b"torn")).unwrap().is_none());
    assert!(cache.get(b"flipped").unwrap().is_none());
    assert_eq!(cache.stats().corrupt, 2, "a deleted entry is not counted again");
    assert_eq!(cache.get(b"good").unwrap().unwrap().body_bytes().unwrap(), b);
    assert_eq!(cache.len(), 1);

    // A large body streams; a flipped byte shows at its end.
    let big = body(1_500_000, 4);
    cache.put(b"big", 1, FAR, b"h", &big).unwrap();
    let mut rec = record::encode(b"big", 1, FAR, b"h", &big);
    rec[1_200_000] ^= 1;
    let meta = record::encode_meta(b"big", &Meta { stored_at_ms: 1, expires_at_ms: FAR, size: rec.len() as u64 });
    cache.backend().put(record::id(b"big"), &rec, &meta).unwrap();
    let (got, end) = drain(chunks_of(cache.get(b"big").unwrap().expect("the head is intact: the body streams")));
    assert!(end.is_err(), "a corrupt large body must end in an error");
    assert_eq!(got.len(), big.len(), "every byte was read before the check");
    assert_eq!(cache.stats().corrupt, 3);
    assert!(!cache.contains(b"big") && cache.get(b"big").unwrap().is_none(), "deleted");
    assert_eq!(cache.stats().corrupt, 3, "counted once");
}

#[test]
fn corruption_lmdb() {
    let dir = tempfile::tempdir().unwrap();
    planted_corruption(|| lmdb::Lmdb::open(dir.path(), &Config::new(BackendKind::Lmdb, None, 1 << 20)).unwrap());
}

#[test]
fn corruption_rocksdb() {
    let dir = tempfile::tempdir().unwrap();
    planted_corruption(|| rocks::Rocks::open(dir.path(), &Config::new(BackendKind::Rocksdb, None, 1 << 20)).unwrap());
}

#[test]
fn corruption_memory() {
    planted_corruption(memory::Memory::default);
}

#[test]
fn corruption_files() {
    let dir = tempfile::tempdir().unwrap();
    planted_corruption(|| files::Files::open(dir.path(), &Config::new(BackendKind::Files, None, 1 << 20)).unwrap());
}

/// Flips one byte of `marker`'s first occurrence in a file under `dir`.
fn flip_on_disk(dir: &Path, marker: &[u8]) {
    for e in walkdir(dir) {
        let mut bytes = std::fs::read(&e).unwrap();
        if let Some(at) = bytes.windows(marker.len()).position(|w| w == marker) {
            bytes[at + marker.len() / 2] ^= 0x01;
            std::fs::write(&e, bytes).unwrap();
            return;
        }
    }
    panic!("marker not found on disk");
}

fn walkdir(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walkdir(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Bytes rotted in the store's own files, found by a marker in the body.
fn disk_corruption(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let marker: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(97) ^ 0xA5).collect();
    let mut b = body(8192, 5);
    b[4000..4064].copy_from_slice(&marker);
    {
        let s = store(kind, dir.path(), 1 << 20);
        s.put(b"victim", 1, FAR, b"", &b).unwrap();
        s.put(b"bystander", 1, FAR, b"", &body(8192, 6)).unwrap();
        s.flush().unwrap();
    }
    flip_on_disk(dir.path(), &marker);
    let s = store(kind, dir.path(), 1 << 20);
    assert!(s.get(b"victim").unwrap().is_none(), "corrupt entry never returned");
    assert_eq!(s.stats().corrupt, 1);
    assert!(!s.contains(b"victim"));
    assert_eq!(s.get(b"bystander").unwrap().unwrap().body_bytes().unwrap(), body(8192, 6));
    drop(s);
    assert!(store(kind, dir.path(), 1 << 20).get(b"victim").unwrap().is_none(), "deleted for good");
}

#[test]
fn disk_corruption_files() {
    disk_corruption(BackendKind::Files);
}

#[test]
fn disk_corruption_rocksdb() {
    // RocksDB's own block (or blob) checksum fails first, or ours does:
    // either way one corrupt record, counted once, never served.
    let dir = tempfile::tempdir().unwrap();
    let marker: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(97) ^ 0xA5).collect();
    let mut b = body(8192, 5);
    b[4000..4064].copy_from_slice(&marker);
    {
        let r = rocks::Rocks::open(dir.path(), &Config::new(BackendKind::Rocksdb, None, 1 << 20)).unwrap();
        let s = Cache::open(r, &Config::new(BackendKind::Rocksdb, None, 1 << 20)).unwrap();
        s.put(b"victim", 1, FAR, b"", &b).unwrap();
        s.put(b"bystander", 1, FAR, b"", &body(8192, 6)).unwrap();
        // Out of the memtable and the WAL into table and blob files.
        s.backend().flush_memtable().unwrap();
    }
    for f in walkdir(dir.path()) {
        let mut bytes = std::fs::read(&f).unwrap();
        if let Some(at) = bytes.windows(marker.len()).position(|w| w == marker) {
            bytes[at + 32] ^= 0x01;
            std::fs::write(&f, bytes).unwrap();
        }
    }
    let s = store(BackendKind::Rocksdb, dir.path(), 1 << 20);
    assert!(s.get(b"victim").unwrap().is_none(), "corrupt entry never returned");
    assert!(s.get(b"victim").unwrap().is_none());
    assert_eq!(s.stats().corrupt, 1, "counted once");
    assert_eq!(s.get(b"bystander").unwrap().unwrap().body_bytes().unwrap(), body(8192, 6));
}

#[test]
fn disk_corruption_lmdb() {
    // A 8 KiB value lives contiguously in LMDB overflow pages of data.mdb.
    disk_corruption(BackendKind::Lmdb);
}

// ---- crash consistency: kill -9 a writer, reopen, verify every entry ----

const CHILD_ENV: &str = "INBAND_CACHE_CRASH_CHILD";
// libtest prints "test name ... " before it on the same line.
const READY: &str = "crash-writer-ready";
const KEYS: u64 = 200;
const CRASH_CAPACITY: u64 = 2 << 20;

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x
}

/// The only content key `i` may ever hold for generation `g`.
fn expected(i: u64, g: u64) -> (Vec<u8>, Vec<u8>) {
    let len = 1 + (mix(i ^ g.rotate_left(17)) % 32768) as usize;
    let mut s = mix(i.wrapping_mul(31) ^ g);
    let body = (0..len)
        .map(|_| {
            s = mix(s.wrapping_add(0x9e3779b97f4a7c15));
            s as u8
        })
        .collect();
    let header = [i.to_le_bytes(), g.to_le_bytes()].concat();
    (header, body)
}

/// The writer half, in a process of its own so that it can be killed.
/// Ignored, so that a plain `cargo test` lists it as such instead of
/// counting a test that did nothing as passed; run on its own it fails.
#[test]
#[ignore = "helper of crash_consistency: runs only when re-executed by it"]
fn crash_child() {
    let spec = std::env::var(CHILD_ENV).unwrap_or_else(|_| panic!("{CHILD_ENV} unset: crash_child is run by crash_consistency_*"));
    let (kind, dir) = spec.split_once(':').unwrap();
    let s = store(kind.parse().unwrap(), Path::new(dir), CRASH_CAPACITY);
    println!("{READY}");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut g = mix(std::process::id() as u64 ^ nanos);
    for n in 0u64.. {
        g = g.wrapping_add(1);
        let i = mix(g) % KEYS;
        let key = format!("GET /crash/{i}");
        if n % 7 == 6 {
            s.delete(key.as_bytes()).unwrap();
        } else {
            let (h, b) = expected(i, g);
            s.put(key.as_bytes(), g, FAR, &h, &b).unwrap();
        }
    }
}

/// SIGKILLs and reaps the writer, also when an assertion fails first.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn crash_consistency(kind: BackendKind) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::thread_rng();
    let mut seen = 0;
    let started = Instant::now();
    for round in 0..5 {
        let mut child = KillOnDrop(Command::new(std::env::current_exe().unwrap())
            .args(["tests::crash_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{kind}:{}", dir.path().display()))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap());
        let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
        assert!(lines.any(|l| l.unwrap().contains(READY)), "writer did not start");
        std::thread::sleep(Duration::from_millis(rng.gen_range(30..300)));
        drop(child);

        let s = store(kind, dir.path(), CRASH_CAPACITY);
        let mut keys = Vec::new();
        s.for_each_meta(&mut |k, m| keys.push((k.to_vec(), *m))).unwrap();
        assert_eq!(keys.len() as u64, s.len(), "round {round}: index and backend agree");
        assert!(s.size_bytes() <= CRASH_CAPACITY);
        for (k, m) in &keys {
            let e = s.get(k).unwrap().unwrap_or_else(|| panic!("round {round}: listed key {k:?} unreadable"));
            let i = u64::from_le_bytes(e.header[..8].try_into().unwrap());
            let g = u64::from_le_bytes(e.header[8..16].try_into().unwrap());
            assert_eq!(k, format!("GET /crash/{i}").as_bytes());
            let (h, b) = expected(i, g);
            assert_eq!((e.meta, m.stored_at_ms), (*m, g));
            assert!(e.header == h && e.body_bytes().unwrap() == b, "round {round}: entry {i} not byte-exact");
        }
        assert_eq!(s.stats().corrupt, 0, "round {round}: kill -9 produced a corrupt record");
        seen += keys.len();
    }
    assert!(seen > 0, "the writer never got an entry in");
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn crash_consistency_lmdb() {
    crash_consistency(BackendKind::Lmdb);
}

#[test]
fn crash_consistency_rocksdb() {
    crash_consistency(BackendKind::Rocksdb);
}

#[test]
fn crash_consistency_files() {
    crash_consistency(BackendKind::Files);
}

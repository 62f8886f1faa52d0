//! `inband bench cache`: the thesis's storage micro-benchmark (YCSB-style
//! read/update mixes over zipfian keys, 10 KiB values) for every
//! inband-cache backend.
//!
//! Each backend × workload × thread count runs in its own child process
//! (this binary re-executed with a hidden `--child`), so CPU time and peak
//! RSS are that run's alone and no backend inherits another's page-cache
//! warmth in its own heap. Durable stores are filled once by a load child
//! and reopened by every run child, which also measures the reopen time of
//! a full store.
//!
//! It lives in this crate, not in the binary, so the timed loop is built
//! with the crate's optimisation level (see the workspace Cargo.toml).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use crate::{BackendKind, Config, Store};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::{Deserialize, Serialize};

#[derive(clap::Args, Clone)]
pub struct CacheArgs {
    /// Records per store. The default (~1 GB with 10 KiB values) is far
    /// larger than the CPU caches, and the size the startup target is set for.
    #[arg(long, default_value_t = 100_000)]
    records: u64,
    /// Body bytes per record.
    #[arg(long, default_value_t = 10 * 1024)]
    value_bytes: usize,
    /// Seconds per backend × workload × thread count.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2])]
    threads: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_values_t = BackendKind::ALL)]
    backends: Vec<BackendKind>,
    /// Workload mixes: the thesis's read-only, 99/1, 95/5, 90/10, or seed
    /// 003's W, A, B, C, D, E, F (docs/benchmarks.md, "Cache study"). A
    /// scanning mix on a store without order is left out, with its reason;
    /// the inserting mixes (W, D, E) run after the others on each store,
    /// as they grow it.
    #[arg(long, value_delimiter = ',', default_values_t = WORKLOADS.map(String::from))]
    workloads: Vec<String>,
    /// Most records one scan reads (mix E; each scan reads 1 to this many).
    #[arg(long, default_value_t = 100)]
    scan_max: usize,
    /// Zipf exponent of key popularity (YCSB's 0.99).
    #[arg(long, default_value_t = 0.99)]
    zipf: f64,
    /// Parent directory of the stores (one at a time, removed after).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// A tiny run for tests: 2,000 records, 0.2 s per cell.
    #[arg(long)]
    quick: bool,
    /// Print the report as JSON instead of Markdown tables.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report here (for bench/cache_plot.py).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Internal: `load`, `reopen-cold` or `run:<mix>:<threads>` for one
    /// backend.
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true)]
    backend: Option<BackendKind>,
    #[arg(long, hide = true)]
    path: Option<PathBuf>,
    /// Internal: a run child says `ready` on stdout once its store is open
    /// and waits for a line on stdin before its timed loop, so that a
    /// tracer can attach in between (`inband trace overhead`); after the
    /// loop it prints its row and waits for another line (or the end of
    /// stdin) before it closes its store, so that a tracer can stop first
    /// (`inband trace study`).
    #[arg(long, hide = true)]
    hold: bool,
}

impl CacheArgs {
    /// The benchmark's settings for runs started one by one ([`prepare`],
    /// [`hold_run`]): the defaults but for these.
    pub fn for_runs(records: u64, seconds: f64, dir: Option<PathBuf>) -> CacheArgs {
        CacheArgs {
            records,
            value_bytes: 10 * 1024,
            seconds,
            threads: vec![1],
            backends: BackendKind::ALL.to_vec(),
            workloads: WORKLOADS.map(String::from).to_vec(),
            scan_max: 100,
            zipf: 0.99,
            dir,
            quick: false,
            json: false,
            save: None,
            child: None,
            backend: None,
            path: None,
            hold: false,
        }
    }

    pub fn with_scan_max(mut self, n: usize) -> CacheArgs {
        self.scan_max = n;
        self
    }
}

/// What one operation of a mix does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    /// `get` of a loaded key (a hit, or the run fails).
    Read,
    /// `put` of a new value under a loaded key.
    Update,
    /// `put` of a key the store has never held, numbered on from the
    /// store's count.
    Insert,
    /// `scan` of 1 to `--scan-max` records from a key (uniform).
    Scan,
    /// `get` and `put` of the same key, timed as one operation.
    ReadModifyWrite,
}

/// Which keys reads, updates and scans pick.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Keys {
    /// Scrambled zipfian over the loaded keys (YCSB's default).
    Zipf,
    /// Zipfian by age: rank 1 is the newest key, inserts included
    /// (YCSB's "latest").
    Latest,
}

/// A workload: its operations' shares in percent (summing to 100).
#[derive(Debug)]
pub struct Mix {
    pub name: &'static str,
    pub about: &'static str,
    pub ops: &'static [(Op, u32)],
    pub keys: Keys,
}

impl Mix {
    pub fn scans(&self) -> bool {
        self.ops.iter().any(|(op, _)| *op == Op::Scan)
    }

    pub fn inserts(&self) -> u32 {
        self.ops.iter().filter(|(op, _)| *op == Op::Insert).map(|(_, p)| p).sum()
    }

    /// Why `kind` cannot run this mix, if it cannot.
    pub fn unsupported(&self, kind: BackendKind) -> Option<String> {
        let why = kind.unordered().filter(|_| self.scans())?;
        Some(format!("mix {} scans, and {why}", self.name))
    }

    fn op(&self, roll: u32) -> Op {
        let mut at = 0;
        for &(op, pct) in self.ops {
            at += pct;
            if roll < at {
                return op;
            }
        }
        self.ops.last().expect("a mix has operations").0
    }
}

use Op::*;

/// Every mix: the thesis's read/update mixes (the report's default), then
/// seed 003's seven, named by YCSB's letters where YCSB has the mix.
pub const MIXES: [Mix; 11] = [
    Mix { name: "read-only", about: "reads only (as YCSB C)", ops: &[(Read, 100)], keys: Keys::Zipf },
    Mix { name: "99/1", about: "99% reads, 1% updates", ops: &[(Read, 99), (Update, 1)], keys: Keys::Zipf },
    Mix { name: "95/5", about: "95% reads, 5% updates (as YCSB B)", ops: &[(Read, 95), (Update, 5)], keys: Keys::Zipf },
    Mix { name: "90/10", about: "90% reads, 10% updates", ops: &[(Read, 90), (Update, 10)], keys: Keys::Zipf },
    Mix { name: "W", about: "write-only: inserts of new keys (YCSB's load phase)", ops: &[(Insert, 100)], keys: Keys::Zipf },
    Mix { name: "A", about: "50% reads, 50% updates", ops: &[(Read, 50), (Update, 50)], keys: Keys::Zipf },
    Mix { name: "B", about: "95% reads, 5% updates", ops: &[(Read, 95), (Update, 5)], keys: Keys::Zipf },
    Mix { name: "C", about: "reads only", ops: &[(Read, 100)], keys: Keys::Zipf },
    Mix { name: "D", about: "95% reads of the newest keys, 5% inserts", ops: &[(Read, 95), (Insert, 5)], keys: Keys::Latest },
    Mix { name: "E", about: "95% short scans, 5% inserts (ordered stores only)", ops: &[(Scan, 95), (Insert, 5)], keys: Keys::Zipf },
    Mix { name: "F", about: "50% reads, 50% read-modify-writes", ops: &[(Read, 50), (ReadModifyWrite, 50)], keys: Keys::Zipf },
];

/// The thesis's mixes: what `inband bench cache` runs unless told.
pub const WORKLOADS: [&str; 4] = ["read-only", "99/1", "95/5", "90/10"];

/// Seed 003's seven, as `inband trace study` runs them.
pub const STUDY_MIXES: [&str; 7] = ["W", "A", "B", "C", "D", "E", "F"];

pub fn mix(name: &str) -> Result<&'static Mix> {
    match MIXES.iter().find(|m| m.name == name) {
        Some(m) => Ok(m),
        None => {
            let names: Vec<&str> = MIXES.iter().map(|m| m.name).collect();
            bail!("no workload mix {name:?} (there are: {})", names.join(", "))
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Row {
    pub backend: BackendKind,
    pub workload: String,
    pub threads: usize,
    pub ops: u64,
    pub ops_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// User + system CPU of the whole process during the timed phase.
    pub cpu_s: f64,
    pub cpu_us_per_op: f64,
    pub peak_rss_mib: f64,
    /// Time to open the store (a full one for durable backends).
    pub open_ms: f64,
    /// The whole process during the timed phase: user and system CPU, page
    /// faults served without I/O (minor) and with it (major).
    #[serde(default)]
    pub user_s: f64,
    #[serde(default)]
    pub sys_s: f64,
    #[serde(default)]
    pub minor_faults: u64,
    #[serde(default)]
    pub major_faults: u64,
    /// Reads of a key inserted during the run whose put had not finished
    /// yet (read-latest with more than one thread): counted, not failed.
    #[serde(default)]
    pub misses: u64,
    /// Records the scans returned.
    #[serde(default)]
    pub scanned: u64,
    /// The same by thread, so a store's own threads (RocksDB's flushes
    /// and compactions) show apart from the benchmark's.
    #[serde(default)]
    pub thread_use: Vec<ThreadUse>,
}

/// One thread's share of the timed phase.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct ThreadUse {
    pub tid: u32,
    /// Its name (`comm`): `worker-N` for the benchmark's loops.
    pub name: String,
    /// `worker`, `main` (the child's main thread, asleep while the workers
    /// run) or `store` (a thread the store started).
    pub role: String,
    /// Seconds it existed during the timed phase (a worker: its loop).
    pub wall_s: f64,
    pub user_s: f64,
    pub sys_s: f64,
    pub minor_faults: u64,
    pub major_faults: u64,
    /// Context switches: voluntary (it blocked) and involuntary (it was
    /// preempted, e.g. for a thread of another process on a busy machine).
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Fill {
    pub backend: BackendKind,
    pub load_s: f64,
    /// Median open time of the full store over the run children (the
    /// store's files in the page cache: a process restart).
    pub reopen_ms: f64,
    /// Open time after the store's file pages were dropped from the page
    /// cache (close to a reboot; directory and inode caches stay warm).
    pub reopen_cold_ms: f64,
    pub disk_mib: f64,
}

#[derive(Serialize, Deserialize, Debug)]
pub struct Report {
    pub records: u64,
    pub value_bytes: usize,
    pub seconds: f64,
    pub zipf: f64,
    pub rows: Vec<Row>,
    pub fills: Vec<Fill>,
}

fn key(i: u64) -> Vec<u8> {
    format!("GET example.com/objects/{i:010}").into_bytes()
}

/// Fake response head, the size a real one has.
const HEADER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncache-control: max-age=3600\r\netag: \"0123456789abcdef\"\r\nlast-modified: Mon, 23 Nov 2026 05:00:00 GMT\r\n";

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Values are windows of a random pool: incompressible, distinct per write,
/// and no allocation or RNG work inside the timed loop.
struct Values {
    pool: Vec<u8>,
    len: usize,
}

impl Values {
    fn new(len: usize) -> Values {
        let mut pool = vec![0; len * 4 + 4096];
        StdRng::seed_from_u64(7).fill(&mut pool[..]);
        Values { pool, len }
    }
    fn get(&self, n: u64) -> &[u8] {
        let at = (n as usize).wrapping_mul(4099) % (self.pool.len() - self.len);
        &self.pool[at..at + self.len]
    }
}

/// Records the inserting mixes (W, D, E) may add to a store over all
/// their runs before it would evict: a few seconds of inserts at the
/// fastest store's rate. A run that evicts anyway fails, rather than
/// measure eviction or leave keys missing for the next run.
const INSERT_ROOM: u64 = 500_000;

fn config(a: &CacheArgs, kind: BackendKind, path: &Path) -> Config {
    // Room for every record twice over, and for inserts: the benchmark
    // measures access, not eviction. Every child opens its store with the
    // same capacity, or the open would evict to a smaller one.
    let capacity = (a.records * 2 + INSERT_ROOM) * (a.value_bytes as u64 + 512);
    Config::new(kind, Some(path.to_path_buf()), capacity)
}

fn load(store: &dyn Store, records: u64, values: &Values) -> Result<()> {
    let now = now_ms();
    for i in 0..records {
        store.put(&key(i), now, now + 3_600_000, HEADER, values.get(i))?;
    }
    store.flush()
}

/// What getrusage says of the process or of one thread.
#[derive(Clone, Copy, Default)]
struct Rusage {
    user_s: f64,
    sys_s: f64,
    max_rss_kib: i64,
    minor_faults: u64,
    major_faults: u64,
    voluntary_switches: u64,
    involuntary_switches: u64,
}

fn rusage(who: libc::c_int) -> Rusage {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(who, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Rusage {
        user_s: tv(ru.ru_utime),
        sys_s: tv(ru.ru_stime),
        max_rss_kib: ru.ru_maxrss,
        minor_faults: ru.ru_minflt as u64,
        major_faults: ru.ru_majflt as u64,
        voluntary_switches: ru.ru_nvcsw as u64,
        involuntary_switches: ru.ru_nivcsw as u64,
    }
}

impl Rusage {
    fn since(self, then: Rusage) -> Rusage {
        Rusage {
            user_s: self.user_s - then.user_s,
            sys_s: self.sys_s - then.sys_s,
            max_rss_kib: self.max_rss_kib,
            minor_faults: self.minor_faults.saturating_sub(then.minor_faults),
            major_faults: self.major_faults.saturating_sub(then.major_faults),
            voluntary_switches: self.voluntary_switches.saturating_sub(then.voluntary_switches),
            involuntary_switches: self.involuntary_switches.saturating_sub(then.involuntary_switches),
        }
    }

    fn thread(self, tid: u32, name: String, role: &str, wall_s: f64) -> ThreadUse {
        ThreadUse {
            tid,
            name,
            role: role.to_string(),
            wall_s,
            user_s: self.user_s,
            sys_s: self.sys_s,
            minor_faults: self.minor_faults,
            major_faults: self.major_faults,
            voluntary_switches: self.voluntary_switches,
            involuntary_switches: self.involuntary_switches,
        }
    }
}

/// Every thread of this process but the workers, from /proc: threads
/// cannot be asked by getrusage from outside themselves. CPU times come in
/// clock ticks (10 ms at the usual 100 Hz).
fn other_threads() -> Vec<(u32, String, Rusage)> {
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else { continue };
        let (Ok(stat), Ok(status)) = (std::fs::read_to_string(task.path().join("stat")), std::fs::read_to_string(task.path().join("status"))) else {
            continue;
        };
        // The fields after the command name, which may itself hold ") ":
        // state is field 3, so field n is at n - 3.
        let Some((head, rest)) = stat.rsplit_once(") ") else { continue };
        let name = head.split_once(" (").map_or("", |(_, n)| n).to_string();
        let f: Vec<u64> = rest.split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
        let field = |n: usize| f.get(n - 4).copied().unwrap_or(0);
        let switches = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
        let ru = Rusage {
            user_s: field(14) as f64 / tick,
            sys_s: field(15) as f64 / tick,
            max_rss_kib: 0,
            minor_faults: field(10),
            major_faults: field(12),
            voluntary_switches: switches("voluntary_ctxt_switches:"),
            involuntary_switches: switches("nonvoluntary_ctxt_switches:"),
        };
        out.push((tid, name, ru));
    }
    out
}

fn gettid() -> u32 {
    unsafe { libc::gettid() as u32 }
}

/// What one worker did.
struct Done {
    ops: u64,
    misses: u64,
    scanned: u64,
    lat: Vec<u32>,
    usage: ThreadUse,
}

/// One timed run inside a child process; prints its row (JSON) on stdout.
fn run_child(a: &CacheArgs, kind: BackendKind, path: &Path, mix: &Mix, threads: usize, hold: bool) -> Result<()> {
    use std::io::{BufRead, Write};
    if let Some(why) = mix.unsupported(kind) {
        bail!("{kind}: {why}");
    }
    let values = Values::new(a.value_bytes);
    let t = Instant::now();
    let store = crate::open(&config(a, kind, path))?;
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    if !kind.durable() {
        load(store.as_ref(), a.records, &values)?;
    }
    // Keys 0..len are all there: the load wrote them, and inserts of
    // earlier runs numbered on from the count.
    let present = store.len();
    if present < a.records {
        bail!("{kind}: store holds {present} records, expected at least {}", a.records);
    }
    let zipf = Zipf::new(present, a.zipf).context("zipf parameters")?;
    let next_key = AtomicU64::new(present);
    if hold {
        writeln!(std::io::stdout(), "ready").and_then(|_| std::io::stdout().flush())?;
        std::io::stdin().lock().read_line(&mut String::new())?;
    }
    let stop = AtomicBool::new(false);
    let before = rusage(libc::RUSAGE_SELF);
    let others_before = other_threads();
    let started = Instant::now();
    let (per_thread, spawn_failed): (Vec<Result<Done>>, Option<std::io::Error>) = std::thread::scope(|s| {
        let mut workers = Vec::new();
        let mut spawn_failed = None;
        for t in 0..threads {
            let (store, values, stop, zipf, next_key) = (&store, &values, &stop, &zipf, &next_key);
            let spawned = std::thread::Builder::new().name(format!("worker-{t}")).spawn_scoped(s, move || -> Result<Done> {
                let start = rusage(libc::RUSAGE_THREAD);
                let born = Instant::now();
                let mut rng = StdRng::seed_from_u64(0x5eed + t as u64);
                let mut lat = Vec::with_capacity(1 << 20);
                let (mut ops, mut misses, mut scanned) = (0u64, 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let rank = zipf.sample(&mut rng) as u64;
                    let i = match mix.keys {
                        // Scrambled zipfian (as YCSB): popularity by
                        // rank, hot keys spread over the key space.
                        Keys::Zipf => rank.wrapping_mul(0x9e3779b97f4a7c15) % present,
                        Keys::Latest => next_key.load(Ordering::Relaxed).saturating_sub(rank),
                    };
                    let op = mix.op(rng.gen_range(0..100));
                    // The key is made before the clock starts, as the
                    // thesis's mixes always did: the store's time only.
                    let i = if op == Insert { next_key.fetch_add(1, Ordering::Relaxed) } else { i };
                    let k = key(i);
                    let scan_len = if op == Scan { rng.gen_range(1..=a.scan_max.max(1)) } else { 0 };
                    let t0 = Instant::now();
                    match op {
                        Read => {
                            if store.get(&k)?.is_none() {
                                if i < present {
                                    bail!("{kind}: record {i} missing");
                                }
                                misses += 1;
                            }
                        }
                        Update | Insert => {
                            let now = now_ms();
                            store.put(&k, now, now + 3_600_000, HEADER, values.get(ops ^ i))?;
                        }
                        Scan => {
                            let got = store.scan(&k, scan_len)?;
                            if got.is_empty() {
                                bail!("{kind}: a scan from record {i} found nothing");
                            }
                            scanned += got.len() as u64;
                        }
                        ReadModifyWrite => {
                            if store.get(&k)?.is_none() {
                                bail!("{kind}: record {i} missing");
                            }
                            let now = now_ms();
                            store.put(&k, now, now + 3_600_000, HEADER, values.get(ops ^ i))?;
                        }
                    }
                    lat.push(t0.elapsed().as_nanos().min(u32::MAX as u128) as u32);
                    ops += 1;
                }
                let usage = rusage(libc::RUSAGE_THREAD).since(start).thread(
                    gettid(),
                    format!("worker-{t}"),
                    "worker",
                    born.elapsed().as_secs_f64(),
                );
                Ok(Done { ops, misses, scanned, lat, usage })
            });
            match spawned {
                Ok(w) => workers.push(w),
                Err(e) => {
                    spawn_failed = Some(e);
                    break;
                }
            }
        }
        if spawn_failed.is_none() {
            std::thread::sleep(Duration::from_secs_f64(a.seconds));
        }
        stop.store(true, Ordering::Relaxed);
        (workers.into_iter().map(|w| w.join().expect("worker panicked")).collect(), spawn_failed)
    });
    if let Some(e) = spawn_failed {
        bail!("starting the benchmark's worker threads: {e}");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let process = rusage(libc::RUSAGE_SELF).since(before);
    let evicted = store.stats().evictions;
    if evicted > 0 {
        bail!("{kind}: mix {} filled the store to its capacity and {evicted} records were evicted (fewer --records or --seconds)", mix.name);
    }
    let mut thread_use = Vec::new();
    let me = std::process::id();
    for (tid, name, now) in other_threads() {
        // A thread started during the run counts from zero.
        let then = others_before.iter().find(|(t, _, _)| *t == tid).map(|(_, _, r)| *r).unwrap_or_default();
        thread_use.push(now.since(then).thread(tid, name, if tid == me { "main" } else { "store" }, elapsed));
    }
    let mut lat = Vec::new();
    let (mut ops, mut misses, mut scanned) = (0, 0, 0);
    for r in per_thread {
        let done = r?;
        ops += done.ops;
        misses += done.misses;
        scanned += done.scanned;
        lat.extend(done.lat);
        thread_use.push(done.usage);
    }
    lat.sort_unstable();
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).map_or(0.0, |&ns| ns as f64 / 1e3);
    let cpu_s = process.user_s + process.sys_s;
    let row = Row {
        backend: kind,
        workload: mix.name.to_string(),
        threads,
        ops,
        ops_per_s: ops as f64 / elapsed,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        cpu_s,
        cpu_us_per_op: if ops > 0 { cpu_s * 1e6 / ops as f64 } else { 0.0 },
        peak_rss_mib: process.max_rss_kib as f64 / 1024.0,
        open_ms,
        user_s: process.user_s,
        sys_s: process.sys_s,
        minor_faults: process.minor_faults,
        major_faults: process.major_faults,
        misses,
        scanned,
        thread_use,
    };
    writeln!(std::io::stdout(), "{}", serde_json::to_string(&row)?).and_then(|_| std::io::stdout().flush())?;
    if hold {
        std::io::stdin().lock().read_line(&mut String::new())?;
    }
    Ok(())
}

/// Drops the page-cache pages of every file under `dir` (only these
/// files: dropping all caches would disturb everything else running),
/// written back first: the kernel drops only clean pages. The advice can
/// leave a page that someone holds at that instant (the end of its
/// writeback on another CPU, a reader): each file is advised again until
/// mincore(2) finds none of its pages, or the error says which stayed.
pub fn drop_cached_pages(dir: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            drop_cached_pages(&e.path())?;
            continue;
        }
        let f = std::fs::File::open(e.path())?;
        f.sync_data()?;
        let mut tries = 0;
        loop {
            // SAFETY: an advice on an open descriptor.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            let resident = resident_pages(&f)?;
            if resident == 0 {
                break;
            }
            tries += 1;
            if tries == 100 {
                anyhow::bail!("{}: {resident} pages stayed in the page cache after {tries} drops", e.path().display());
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    Ok(())
}

/// Pages of `f` in the page cache: its mapping's mincore(2), which looks
/// without reading (the mapping faults nothing in).
fn resident_pages(f: &std::fs::File) -> Result<usize> {
    use std::os::fd::AsRawFd;
    let len = f.metadata()?.len() as usize;
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: a shared read-only mapping of an open file, unmapped below;
    // mincore writes one byte per page of it into `v`, which has that many.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0);
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let mut v = vec![0u8; len.div_ceil(page_size())];
        let r = libc::mincore(p, len, v.as_mut_ptr());
        let err = std::io::Error::last_os_error();
        libc::munmap(p, len);
        if r != 0 {
            return Err(err.into());
        }
        Ok(v.iter().filter(|b| **b & 1 != 0).count())
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Bytes the store occupies on disk (allocated blocks, not file lengths).
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

fn child_command(a: &CacheArgs, argv: &[&str], kind: BackendKind, path: &Path, child: &str) -> Result<Command> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(argv).args(["--child", child, "--backend", kind.name()])
        .arg("--path")
        .arg(path)
        .args(["--records", &a.records.to_string(), "--value-bytes", &a.value_bytes.to_string()])
        .args(["--seconds", &a.seconds.to_string(), "--zipf", &a.zipf.to_string(), "--scan-max", &a.scan_max.to_string()])
        .stderr(Stdio::inherit());
    Ok(cmd)
}

fn spawn_child(a: &CacheArgs, argv: &[&str], kind: BackendKind, path: &Path, child: &str) -> Result<String> {
    let out = child_command(a, argv, kind, path, child)?.output()?;
    if !out.status.success() {
        bail!("{kind} {child}: child failed ({})", out.status);
    }
    let stdout = String::from_utf8(out.stdout)?;
    Ok(stdout.lines().last().unwrap_or_default().to_string())
}

/// A store for runs started one by one: a directory under `--dir` (or
/// the temporary directory), filled by a load child for a durable store
/// (a memory store is filled by each run child).
pub fn prepare(a: &CacheArgs, argv: &[&str], kind: BackendKind) -> Result<tempfile::TempDir> {
    let parent = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&parent)?;
    let dir = tempfile::Builder::new().prefix(&format!("inband-bench-cache-{kind}-")).tempdir_in(&parent)?;
    if kind.durable() {
        spawn_child(a, argv, kind, dir.path(), "load")?;
    }
    Ok(dir)
}

/// A run child stopped before its timed loop (its store open and full).
pub struct HeldRun {
    child: std::process::Child,
    go: Option<std::process::ChildStdin>,
    out: std::io::BufReader<std::process::ChildStdout>,
}

/// Starts one run on the store `path` ([`prepare`]) and returns once it
/// waits at its start.
pub fn hold_run(a: &CacheArgs, argv: &[&str], kind: BackendKind, path: &Path, mix: &Mix, threads: usize) -> Result<HeldRun> {
    use std::io::BufRead;
    if let Some(why) = mix.unsupported(kind) {
        bail!("{kind}: {why}");
    }
    let mut cmd = child_command(a, argv, kind, path, &format!("run:{}:{threads}", mix.name))?;
    let mut child = cmd.arg("--hold").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
    let go = child.stdin.take().context("child stdin")?;
    let mut out = std::io::BufReader::new(child.stdout.take().context("child stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    if line != "ready\n" {
        let _ = child.kill();
        let status = child.wait()?;
        bail!("{kind} run child did not start ({status})");
    }
    Ok(HeldRun { child, go: Some(go), out })
}

impl HeldRun {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the run go and returns its result when it has exited.
    pub fn go(mut self) -> Result<Row> {
        let row = self.start()?;
        self.finish()?;
        Ok(row)
    }

    /// Lets the run go and returns its result, the child still alive with
    /// its store open until [`HeldRun::finish`]: what runs in between (a
    /// tracer stopping) is outside the timed phase and before the store's
    /// close.
    pub fn start(&mut self) -> Result<Row> {
        use std::io::{BufRead, Write};
        let go = self.go.as_mut().context("the run has started already")?;
        writeln!(go, "go")?;
        let mut line = String::new();
        self.out.read_line(&mut line)?;
        if line.is_empty() {
            let status = self.child.wait()?;
            bail!("run child failed ({status})");
        }
        serde_json::from_str(&line).with_context(|| format!("run child output {line:?}"))
    }

    /// Lets the started run close its store and exit.
    pub fn finish(mut self) -> Result<()> {
        // The end of its stdin is the signal.
        drop(self.go.take());
        let status = self.child.wait()?;
        if !status.success() {
            bail!("run child failed ({status})");
        }
        Ok(())
    }
}

impl Drop for HeldRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mixes named, those that insert after the rest (fewest inserts
/// first), since their runs grow the store the next runs open.
pub fn in_run_order(names: &[String]) -> Result<Vec<&'static Mix>> {
    let mut mixes = names.iter().map(|n| mix(n)).collect::<Result<Vec<_>>>()?;
    mixes.sort_by_key(|m| m.inserts());
    Ok(mixes)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `argv`: the arguments that make the current executable run this
/// benchmark (`["bench", "cache"]` for `inband`).
pub fn measure(mut a: CacheArgs, argv: &[&str]) -> Result<Report> {
    if a.quick {
        a.records = 2_000;
        a.seconds = 0.2;
    }
    let parent = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&parent)?;
    let mut rows = Vec::new();
    let mut fills = Vec::new();
    for &kind in &a.backends {
        let dir = tempfile::Builder::new().prefix(&format!("inband-bench-cache-{kind}-")).tempdir_in(&parent)?;
        let (mut load_s, mut reopen_cold_ms) = (0.0, 0.0);
        if kind.durable() {
            let t = Instant::now();
            spawn_child(&a, argv, kind, dir.path(), "load")?;
            load_s = t.elapsed().as_secs_f64();
        }
        let disk_mib = disk_bytes(dir.path()) as f64 / (1 << 20) as f64;
        let mut opens = Vec::new();
        for mix in in_run_order(&a.workloads)? {
            if let Some(why) = mix.unsupported(kind) {
                eprintln!("{kind:>8} {:>9} left out: {why}", mix.name);
                continue;
            }
            for &threads in &a.threads {
                let line = spawn_child(&a, argv, kind, dir.path(), &format!("run:{}:{threads}", mix.name))?;
                let row: Row = serde_json::from_str(&line).with_context(|| format!("child output {line:?}"))?;
                eprintln!("{:>8} {:>9} {}t {:>10.0} ops/s", kind, row.workload, threads, row.ops_per_s);
                opens.push(row.open_ms);
                rows.push(row);
            }
        }
        // Last: it leaves the store's pages out of the page cache, which
        // would turn the next run into a disk benchmark.
        if kind.durable() {
            reopen_cold_ms = spawn_child(&a, argv, kind, dir.path(), "reopen-cold")?.parse()?;
        }
        let reopen_ms = if kind.durable() { median(opens) } else { 0.0 };
        fills.push(Fill { backend: kind, load_s, reopen_ms, reopen_cold_ms, disk_mib });
    }
    Ok(Report { records: a.records, value_bytes: a.value_bytes, seconds: a.seconds, zipf: a.zipf, rows, fills })
}

pub fn render(r: &Report) -> String {
    let mut s = format!(
        "{} records × {} B values, zipf {}, {} s per cell; ratios against lmdb\n\n",
        r.records, r.value_bytes, r.zipf, r.seconds
    );
    s += "| backend | workload | threads | ops/s | × lmdb | p50 µs | p99 µs | CPU µs/op | peak RSS MiB |\n";
    s += "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
    for row in &r.rows {
        let base = r.rows.iter().find(|b| b.backend == BackendKind::Lmdb && b.workload == row.workload && b.threads == row.threads);
        let ratio = base.filter(|b| b.ops_per_s > 0.0).map_or("–".to_string(), |b| format!("{:.2}", row.ops_per_s / b.ops_per_s));
        s += &format!(
            "| {} | {} | {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.0} |\n",
            row.backend, row.workload, row.threads, row.ops_per_s, ratio, row.p50_us, row.p99_us, row.cpu_us_per_op, row.peak_rss_mib
        );
    }
    s += "\n| backend | load s | reopen full store ms | same, file pages not cached | on disk MiB |\n|---|---:|---:|---:|---:|\n";
    for f in &r.fills {
        let ms = |v: f64| if f.backend.durable() { format!("{v:.1}") } else { "– (not durable)".into() };
        s += &format!("| {} | {:.1} | {} | {} | {:.0} |\n", f.backend, f.load_s, ms(f.reopen_ms), ms(f.reopen_cold_ms), f.disk_mib);
    }
    s
}

/// The parent, or one child when `--child` is set.
pub fn main(a: CacheArgs, argv: &[&str]) -> Result<()> {
    if let Some(child) = a.child.clone() {
        let kind = a.backend.context("--child needs --backend")?;
        let path = a.path.clone().context("--child needs --path")?;
        if child == "load" {
            let store = crate::open(&config(&a, kind, &path))?;
            return load(store.as_ref(), a.records, &Values::new(a.value_bytes));
        }
        if child == "reopen-cold" {
            drop_cached_pages(&path)?;
            let t = Instant::now();
            let store = crate::open(&config(&a, kind, &path))?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if store.len() < a.records {
                bail!("{kind}: reopened store holds {} records, expected at least {}", store.len(), a.records);
            }
            println!("{ms}");
            return Ok(());
        }
        let spec = child.strip_prefix("run:").context("unknown --child")?;
        let (name, threads) = spec.rsplit_once(':').context("--child run:<mix>:<threads>")?;
        return run_child(&a, kind, &path, mix(name)?, threads.parse()?, a.hold);
    }
    // Refused before a store is filled.
    for name in &a.workloads {
        mix(name)?;
    }
    let (json, save) = (a.json, a.save.clone());
    let report = measure(a, argv)?;
    if let Some(p) = save {
        std::fs::write(&p, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", p.display()))?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

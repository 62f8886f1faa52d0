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
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Internal: `load`, `reopen-cold` or `run:<update %>:<threads>` for
    /// one backend.
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true)]
    backend: Option<BackendKind>,
    #[arg(long, hide = true)]
    path: Option<PathBuf>,
    /// Internal: a run child says `ready` on stdout once its store is open
    /// and waits for a line on stdin before its timed loop, so that a
    /// tracer can attach in between (`inband trace overhead`).
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
}

/// Read/update mixes of the thesis (YCSB C, and B-like variants).
pub const WORKLOADS: [(&str, u32); 4] = [("read-only", 0), ("99/1", 1), ("95/5", 5), ("90/10", 10)];

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

fn config(a: &CacheArgs, kind: BackendKind, path: &Path) -> Config {
    // Room for every record twice over: the benchmark measures access, not
    // eviction.
    let capacity = a.records * (a.value_bytes as u64 + 512) * 2;
    Config::new(kind, Some(path.to_path_buf()), capacity)
}

fn load(store: &dyn Store, records: u64, values: &Values) -> Result<()> {
    let now = now_ms();
    for i in 0..records {
        store.put(&key(i), now, now + 3_600_000, HEADER, values.get(i))?;
    }
    store.flush()
}

struct Rusage {
    cpu_s: f64,
    max_rss_kib: i64,
}

fn rusage() -> Rusage {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Rusage { cpu_s: tv(ru.ru_utime) + tv(ru.ru_stime), max_rss_kib: ru.ru_maxrss }
}

/// One timed run inside a child process.
fn run_child(a: &CacheArgs, kind: BackendKind, path: &Path, update_pct: u32, threads: usize, hold: bool) -> Result<Row> {
    let values = Values::new(a.value_bytes);
    let t = Instant::now();
    let store = crate::open(&config(a, kind, path))?;
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    if !kind.durable() {
        load(store.as_ref(), a.records, &values)?;
    }
    if store.len() != a.records {
        bail!("{kind}: store holds {} records, expected {}", store.len(), a.records);
    }
    let zipf = Zipf::new(a.records, a.zipf).context("zipf parameters")?;
    if hold {
        use std::io::{BufRead, Write};
        writeln!(std::io::stdout(), "ready").and_then(|_| std::io::stdout().flush())?;
        std::io::stdin().lock().read_line(&mut String::new())?;
    }
    let stop = AtomicBool::new(false);
    let before = rusage();
    let started = Instant::now();
    let per_thread: Vec<Result<(u64, Vec<u32>)>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (store, values, stop, zipf) = (&store, &values, &stop, &zipf);
                s.spawn(move || -> Result<(u64, Vec<u32>)> {
                    let mut rng = StdRng::seed_from_u64(0x5eed + t as u64);
                    let mut lat = Vec::with_capacity(1 << 20);
                    let mut ops = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Scrambled zipfian (as YCSB): popularity by rank,
                        // hot keys spread over the key space.
                        let rank = zipf.sample(&mut rng) as u64;
                        let i = rank.wrapping_mul(0x9e3779b97f4a7c15) % a.records;
                        let k = key(i);
                        let t0 = Instant::now();
                        if rng.gen_range(0..100) < update_pct {
                            let now = now_ms();
                            store.put(&k, now, now + 3_600_000, HEADER, values.get(ops ^ i))?;
                        } else if store.get(&k)?.is_none() {
                            bail!("{kind}: record {i} missing");
                        }
                        lat.push(t0.elapsed().as_nanos().min(u32::MAX as u128) as u32);
                        ops += 1;
                    }
                    Ok((ops, lat))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(a.seconds));
        stop.store(true, Ordering::Relaxed);
        workers.into_iter().map(|w| w.join().expect("worker panicked")).collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let after = rusage();
    let mut lat = Vec::new();
    let mut ops = 0;
    for r in per_thread {
        let (n, l) = r?;
        ops += n;
        lat.extend(l);
    }
    lat.sort_unstable();
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).map_or(0.0, |&ns| ns as f64 / 1e3);
    let cpu_s = after.cpu_s - before.cpu_s;
    Ok(Row {
        backend: kind,
        workload: WORKLOADS.iter().find(|w| w.1 == update_pct).map_or("?", |w| w.0).to_string(),
        threads,
        ops,
        ops_per_s: ops as f64 / elapsed,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        cpu_s,
        cpu_us_per_op: if ops > 0 { cpu_s * 1e6 / ops as f64 } else { 0.0 },
        peak_rss_mib: after.max_rss_kib as f64 / 1024.0,
        open_ms,
    })
}

/// Drops the page-cache pages of every file under `dir` (only these
/// files: dropping all caches would disturb everything else running),
/// written back first: the kernel drops only clean pages.
pub fn drop_cached_pages(dir: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            drop_cached_pages(&e.path())?;
        } else {
            let f = std::fs::File::open(e.path())?;
            f.sync_data()?;
            // SAFETY: an advice on an open descriptor.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
    Ok(())
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
        .args(["--seconds", &a.seconds.to_string(), "--zipf", &a.zipf.to_string()])
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
    go: std::process::ChildStdin,
    out: std::io::BufReader<std::process::ChildStdout>,
}

/// Starts one run on the store `path` ([`prepare`]) and returns once it
/// waits at its start.
pub fn hold_run(a: &CacheArgs, argv: &[&str], kind: BackendKind, path: &Path, update_pct: u32, threads: usize) -> Result<HeldRun> {
    use std::io::BufRead;
    let mut cmd = child_command(a, argv, kind, path, &format!("run:{update_pct}:{threads}"))?;
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
    Ok(HeldRun { child, go, out })
}

impl HeldRun {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the run go and returns its result when it has exited.
    pub fn go(mut self) -> Result<Row> {
        use std::io::{BufRead, Write};
        writeln!(self.go, "go")?;
        let mut line = String::new();
        self.out.read_line(&mut line)?;
        let status = self.child.wait()?;
        if !status.success() {
            bail!("run child failed ({status})");
        }
        serde_json::from_str(&line).with_context(|| format!("run child output {line:?}"))
    }
}

impl Drop for HeldRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
        for &(_, update_pct) in &WORKLOADS {
            for &threads in &a.threads {
                let line = spawn_child(&a, argv, kind, dir.path(), &format!("run:{update_pct}:{threads}"))?;
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
            if store.len() != a.records {
                bail!("{kind}: reopened store holds {} records, expected {}", store.len(), a.records);
            }
            println!("{ms}");
            return Ok(());
        }
        let spec = child.strip_prefix("run:").context("unknown --child")?;
        let (pct, threads) = spec.split_once(':').context("--child run:<update %>:<threads>")?;
        let row = run_child(&a, kind, &path, pct.parse()?, threads.parse()?, a.hold)?;
        println!("{}", serde_json::to_string(&row)?);
        return Ok(());
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

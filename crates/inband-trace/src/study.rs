//! `inband trace study` (docs/trace.md, "Study"): seed 003's study on our
//! stores. Every store × workload mix of `inband bench cache` runs in its
//! own child, held at its start while a separate `inband trace --pid`
//! process attaches (the machinery of `inband trace overhead`), and
//! stopped by SIGINT once the timed loop is over, before the child closes
//! its store. Each cell joins what the tracer timed per thread (system
//! calls by category) with what the child measured per thread
//! (getrusage, /proc: CPU, faults, context switches).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use inband_cache::bench::{self, CacheArgs, ThreadUse};
use inband_cache::BackendKind;
use serde::Serialize;
use serde_json::Value;

use crate::categories::ALL;
use crate::overhead::{start_tracer, stop_tracer, BENCH_ARGV};

#[derive(clap::Args, Debug)]
pub struct StudyArgs {
    #[arg(long, value_delimiter = ',', default_values_t = BackendKind::ALL)]
    backends: Vec<BackendKind>,
    /// Workload mixes (`inband bench cache --workloads`): seed 003's seven
    /// unless told. Those that insert run last on each store.
    #[arg(long, value_delimiter = ',', default_values_t = bench::STUDY_MIXES.map(String::from))]
    mixes: Vec<String>,
    /// Benchmark threads per run.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Records loaded into each store (10 KiB values).
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Seconds per cell.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Most records one scan reads (mix E).
    #[arg(long, default_value_t = 100)]
    scan_max: usize,
    /// Parent directory of the stores (default: the temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Also run each cell a second time under the memory pass (`inband
    /// trace --memory`): allocator calls and page allocations per
    /// operation. That run is many times slower (docs/trace.md, "Overhead"),
    /// so its counts are kept and its times are not.
    #[arg(long)]
    memory: bool,
    /// A tiny run for tests: 2,000 records, 0.3 s per cell.
    #[arg(long)]
    quick: bool,
    /// The report as JSON instead of tables.
    #[arg(long)]
    json: bool,
}

/// System calls of one category: how many, and the time from entry to
/// exit (CPU in the kernel and time blocked in the call alike).
#[derive(Serialize, Clone, Copy, Default)]
struct Calls {
    count: u64,
    ns: u64,
}

/// One thread, or the sum over threads of one role.
#[derive(Serialize, Clone, Default)]
struct Part {
    threads: usize,
    wall_s: f64,
    user_s: f64,
    sys_s: f64,
    minor_faults: u64,
    major_faults: u64,
    voluntary_switches: u64,
    involuntary_switches: u64,
    /// By category (io_read, io_write, sync, memory, other).
    calls: BTreeMap<&'static str, Calls>,
}

impl Part {
    fn add(&mut self, u: &ThreadUse, calls: &BTreeMap<&'static str, Calls>) {
        self.threads += 1;
        self.wall_s += u.wall_s;
        self.user_s += u.user_s;
        self.sys_s += u.sys_s;
        self.minor_faults += u.minor_faults;
        self.major_faults += u.major_faults;
        self.voluntary_switches += u.voluntary_switches;
        self.involuntary_switches += u.involuntary_switches;
        for (c, n) in calls {
            let e = self.calls.entry(c).or_default();
            e.count += n.count;
            e.ns += n.ns;
        }
    }

    fn call_count(&self) -> u64 {
        self.calls.values().map(|c| c.count).sum()
    }
}

#[derive(Serialize)]
struct Thread {
    tid: u32,
    name: String,
    role: String,
    #[serde(flatten)]
    part: Part,
}

#[derive(Serialize)]
struct Cell {
    backend: BackendKind,
    mix: String,
    about: String,
    threads: usize,
    /// Why this store cannot run this mix; every number below is absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    unsupported: Option<String>,
    #[serde(flatten)]
    run: Option<Run>,
}

#[derive(Serialize)]
struct Run {
    ops: u64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// The whole process (getrusage) over the timed phase.
    user_s: f64,
    sys_s: f64,
    minor_faults: u64,
    major_faults: u64,
    /// Records the scans returned (mix E).
    scanned: u64,
    /// The benchmark's loops, the store's own threads (RocksDB's flushes
    /// and compactions), and the child's main thread (asleep while the
    /// loops run), each summed.
    workers: Part,
    store: Part,
    main: Part,
    by_thread: Vec<Thread>,
    /// The calls that took the most time, every thread's together
    /// (name, category, count, ns).
    top_calls: Vec<Value>,
    /// With --memory: what the memory pass counted in the second run.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory: Option<MemoryPass>,
    /// The tracer's counts of calls it could not place (docs/trace.md,
    /// "Output"): a call under way when it attached has no start.
    tracer_lost: Value,
}

/// The memory pass's run of a cell, per operation of that run.
#[derive(Serialize)]
struct MemoryPass {
    ops: u64,
    /// Calls of malloc, calloc, realloc, aligned_alloc, posix_memalign.
    allocs_per_op: f64,
    alloc_bytes_per_op: f64,
    frees_per_op: f64,
    /// Pages the kernel allocated to the process (kmem/mm_page_alloc).
    pages_per_op: f64,
}

impl MemoryPass {
    fn new(ops: u64, memory: &Value) -> MemoryPass {
        let per_op = |n: u64| n as f64 / ops.max(1) as f64;
        let (mut allocs, mut bytes, mut frees) = (0, 0, 0);
        for (function, a) in memory["allocs"].as_object().into_iter().flatten() {
            let (count, b) = (a["count"].as_u64().unwrap_or(0), a["bytes"].as_u64().unwrap_or(0));
            if function == "free" {
                frees += count;
            } else {
                allocs += count;
                bytes += b;
            }
        }
        MemoryPass {
            ops,
            allocs_per_op: per_op(allocs),
            alloc_bytes_per_op: per_op(bytes),
            frees_per_op: per_op(frees),
            pages_per_op: per_op(memory["pages"]["count"].as_u64().unwrap_or(0)),
        }
    }
}

#[derive(Serialize)]
struct Fill {
    backend: BackendKind,
    load_s: f64,
}

#[derive(Serialize)]
struct Report {
    records: u64,
    value_bytes: usize,
    seconds: f64,
    threads: usize,
    scan_max: usize,
    zipf: f64,
    cells: Vec<Cell>,
    fills: Vec<Fill>,
}

/// Calls listed by name in each cell (the tracer lists them by time).
const TOP_CALLS: usize = 4;

/// Per category from one thread's entry of the tracer's `threads`.
fn calls_of(thread: Option<&Value>) -> BTreeMap<&'static str, Calls> {
    ALL.iter()
        .map(|c| {
            let v = thread.and_then(|t| t.get(c.name()));
            let n = |k: &str| v.and_then(|v| v[k].as_u64()).unwrap_or(0);
            (c.name(), Calls { count: n("count"), ns: n("ns") })
        })
        .collect()
}

fn cell(row: bench::Row, total: &Value, mix: &bench::Mix) -> Cell {
    let traced = total["threads"].as_object();
    let (mut workers, mut store, mut main) = (Part::default(), Part::default(), Part::default());
    let mut by_thread = Vec::new();
    for u in &row.thread_use {
        let calls = calls_of(traced.and_then(|t| t.get(&u.tid.to_string())));
        match u.role.as_str() {
            "worker" => workers.add(u, &calls),
            "main" => main.add(u, &calls),
            _ => store.add(u, &calls),
        }
        let mut part = Part::default();
        part.add(u, &calls);
        by_thread.push(Thread { tid: u.tid, name: u.name.clone(), role: u.role.clone(), part });
    }
    // Threads the tracer saw that had exited before the run's end (the
    // child lists those alive then): the store's, short-lived.
    for (tid, t) in traced.into_iter().flatten() {
        if row.thread_use.iter().any(|u| u.tid.to_string() == *tid) {
            continue;
        }
        let calls = calls_of(Some(t));
        let gone = ThreadUse { tid: tid.parse().unwrap_or(0), name: "(exited)".into(), role: "store".into(), ..Default::default() };
        store.add(&gone, &calls);
        let mut part = Part::default();
        part.add(&gone, &calls);
        by_thread.push(Thread { tid: gone.tid, name: gone.name, role: gone.role, part });
    }
    Cell {
        backend: row.backend,
        mix: row.workload.clone(),
        about: mix.about.to_string(),
        threads: row.threads,
        unsupported: None,
        run: Some(Run {
            ops: row.ops,
            ops_per_s: row.ops_per_s,
            p50_us: row.p50_us,
            p99_us: row.p99_us,
            user_s: row.user_s,
            sys_s: row.sys_s,
            minor_faults: row.minor_faults,
            major_faults: row.major_faults,
            scanned: row.scanned,
            workers,
            store,
            main,
            by_thread,
            memory: None,
            top_calls: total["syscalls"].as_array().map_or(Vec::new(), |calls| calls.iter().take(TOP_CALLS).cloned().collect()),
            tracer_lost: total["lost"].clone(),
        }),
    }
}

pub fn run(mut a: StudyArgs) -> Result<()> {
    if a.quick {
        a.records = 2_000;
        a.seconds = 0.3;
    }
    if a.threads == 0 || a.scan_max == 0 {
        bail!("--threads and --scan-max must be at least 1");
    }
    // Every name is checked before a store is filled.
    let mixes = bench::in_run_order(&a.mixes)?;
    let cache_args = CacheArgs::for_runs(a.records, a.seconds, a.dir.clone()).with_scan_max(a.scan_max);
    let traces = tempfile::tempdir().context("a directory for the traces")?;
    let mut cells = Vec::new();
    let mut fills = Vec::new();
    for &kind in &a.backends {
        let t = Instant::now();
        let store = bench::prepare(&cache_args, &BENCH_ARGV, kind).with_context(|| format!("filling the {kind} store"))?;
        fills.push(Fill { backend: kind, load_s: if kind.durable() { t.elapsed().as_secs_f64() } else { 0.0 } });
        for mix in &mixes {
            if let Some(why) = mix.unsupported(kind) {
                eprintln!("{kind:>8} {:>2}: not supported: {why}", mix.name);
                cells.push(Cell {
                    backend: kind,
                    mix: mix.name.to_string(),
                    about: mix.about.to_string(),
                    threads: a.threads,
                    unsupported: Some(why),
                    run: None,
                });
                continue;
            }
            let mut held = bench::hold_run(&cache_args, &BENCH_ARGV, kind, store.path(), mix, a.threads)?;
            let out = traces.path().join(format!("{kind}-{}.jsonl", cells.len()));
            let tracer = start_tracer(held.pid(), &[], &out)
                .with_context(|| format!("attaching inband trace to the {kind} {} run (pid {})", mix.name, held.pid()))?;
            let row = held.start()?;
            let total = stop_tracer(tracer, &out)?;
            held.finish()?;
            let mut c = cell(row, &total, mix);
            if a.memory {
                let mut held = bench::hold_run(&cache_args, &BENCH_ARGV, kind, store.path(), mix, a.threads)?;
                let out = traces.path().join(format!("{kind}-{}-memory.jsonl", cells.len()));
                let tracer = start_tracer(held.pid(), &["--memory"], &out).with_context(|| {
                    format!("attaching inband trace --memory to the {kind} {} run (pid {})", mix.name, held.pid())
                })?;
                let row = held.start()?;
                let total = stop_tracer(tracer, &out)?;
                held.finish()?;
                if let Some(run) = &mut c.run {
                    run.memory = Some(MemoryPass::new(row.ops, &total["memory"]));
                }
            }
            if let Some(r) = &c.run {
                eprintln!(
                    "{kind:>8} {:>2}: {:>9.0} ops/s, workers {:.2} system calls per op",
                    mix.name,
                    r.ops_per_s,
                    r.workers.call_count() as f64 / r.ops.max(1) as f64
                );
            }
            cells.push(c);
        }
    }
    let report = Report {
        records: a.records,
        value_bytes: 10 * 1024,
        seconds: a.seconds,
        threads: a.threads,
        scan_max: a.scan_max,
        zipf: 0.99,
        cells,
        fills,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

fn pct(part: f64, whole: f64) -> String {
    if whole > 0.0 {
        format!("{:.1}", 100.0 * part / whole)
    } else {
        "–".into()
    }
}

/// The terminal's table: the first of docs/benchmarks.md's ("Cache
/// study", rendered by bench/cachestudy.py from the JSON).
fn table(r: &Report) -> String {
    let mut s = format!(
        "{} records × {} B values, {} thread(s), {} s per cell; shares of the workers' time\n\n",
        r.records, r.value_bytes, r.threads, r.seconds
    );
    s += "| store | mix | ops/s | p50 µs | p99 µs | user % | sys % | off-CPU % | read % | write % | sync % | memory % | other % | preempted /s | calls/op | minor faults/op | major faults | store threads CPU ms | store threads I/O ms |\n";
    s += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for c in &r.cells {
        let Some(run) = &c.run else {
            let _ = writeln!(s, "| {} | {} | not supported: {} |", c.backend, c.mix, c.unsupported.as_deref().unwrap_or(""));
            continue;
        };
        let w = &run.workers;
        let ops = run.ops.max(1) as f64;
        let _ = write!(
            s,
            "| {} | {} | {:.0} | {:.1} | {:.1} | {} | {} | {} ",
            c.backend,
            c.mix,
            run.ops_per_s,
            run.p50_us,
            run.p99_us,
            pct(w.user_s, w.wall_s),
            pct(w.sys_s, w.wall_s),
            pct((w.wall_s - w.user_s - w.sys_s).max(0.0), w.wall_s)
        );
        for cat in ALL {
            let _ = write!(s, "| {} ", pct(w.calls.get(cat.name()).map_or(0, |c| c.ns) as f64 / 1e9, w.wall_s));
        }
        let store_io_ns: u64 = ["io_read", "io_write"].iter().map(|c| run.store.calls.get(c).map_or(0, |c| c.ns)).sum();
        let _ = writeln!(
            s,
            "| {:.0} | {:.2} | {:.2} | {} | {:.0} | {:.0} |",
            if w.wall_s > 0.0 { w.involuntary_switches as f64 / w.wall_s } else { 0.0 },
            w.call_count() as f64 / ops,
            w.minor_faults as f64 / ops,
            w.major_faults,
            (run.store.user_s + run.store.sys_s) * 1e3,
            store_io_ns as f64 / 1e6
        );
    }
    s
}

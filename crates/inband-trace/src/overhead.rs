//! `inband trace overhead` (docs/trace.md, "Overhead"): what tracing costs,
//! measured as seed 003 does: one benchmark, a cell of `inband bench
//! cache`, run untraced and under each pass of the tracer in the same
//! session, the passes taking turns so that drift of the machine is shared,
//! and its throughput compared.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use inband_cache::bench::{self, CacheArgs};
use inband_cache::BackendKind;
use serde::Serialize;
use serde_json::Value;

/// How this binary runs the benchmark's children and the tracer.
pub(crate) const BENCH_ARGV: [&str; 2] = ["bench", "cache"];
const TRACE_ARGV: [&str; 1] = ["trace"];

#[derive(clap::Args, Debug)]
pub struct OverheadArgs {
    /// The store: lmdb, rocksdb, memory or files.
    #[arg(long, default_value = "lmdb")]
    backend: BackendKind,
    /// The workload mix, as `inband bench cache --workloads` names them:
    /// read-only, 99/1, 95/5, 90/10, or W, A, B, C, D, E, F.
    #[arg(long, default_value = "95/5")]
    workload: String,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Records in the store (10 KiB values).
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Seconds per run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runs of each pass; the median is compared.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Parent directory of the store (default: the temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// The child that times a loop of getppid(2) for the per-call cost.
    #[arg(long, hide = true)]
    call_loop_child: bool,
}

/// The per-call cost: getppid(2), the cheapest system call, CALLS times,
/// the fastest of ROUNDS rounds (the least disturbed by the machine's other
/// work). Its time per call over the untraced loop's is what a pass adds
/// to every system call with the CPU caches warm; times a store's calls
/// per second, what it costs that store at least.
const CALLS: u32 = 1_000_000;
const ROUNDS: u32 = 5;

/// The passes: a name and the tracer's arguments (none: untraced).
const PASSES: [(&str, Option<&[&str]>); 6] = [
    ("untraced", None),
    ("floor: tracepoints only", Some(&["--floor", "tracepoints"])),
    ("floor: clocks only", Some(&["--floor", "clocks"])),
    ("timing", Some(&[])),
    ("timing, --phases cache", Some(&["--phases", "cache"])),
    ("timing and --memory", Some(&["--memory"])),
];

/// One run: the benchmark's throughput, and what the tracer counted.
#[derive(Serialize)]
struct Run {
    ops: u64,
    ops_per_s: f64,
    /// System calls the tracer timed.
    syscalls: Option<u64>,
    /// Hits of the markers (store_get, store_put, store_delete).
    marker_hits: Option<u64>,
    /// Allocator calls the memory pass counted.
    allocs: Option<u64>,
}

#[derive(Serialize)]
struct Pass {
    pass: &'static str,
    runs: Vec<Run>,
    median_ops_per_s: f64,
    /// Median throughput over the untraced median.
    ratio: f64,
    /// The call loop: its median over the repeats, and each run's.
    ns_per_call: f64,
    per_call: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    backend: BackendKind,
    workload: String,
    threads: usize,
    records: u64,
    seconds: f64,
    passes: Vec<Pass>,
}

fn call_loop_child() -> Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "ready")?;
    stdout.flush()?;
    std::io::stdin().read_line(&mut String::new())?;
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..CALLS {
            // SAFETY: getppid takes nothing and cannot fail.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
        best = best.min(started.elapsed().as_nanos() as f64 / f64::from(CALLS));
    }
    writeln!(stdout, "{best}")?;
    Ok(())
}

/// One run of the call loop under `tracer_args` (none: untraced): the
/// fastest round's nanoseconds per call.
fn call_loop(tracer_args: Option<&[&str]>, out: &Path) -> Result<f64> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(TRACE_ARGV)
        .args(["overhead", "--call-loop-child"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the call loop")?;
    let mut go = child.stdin.take().context("call loop stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("call loop stdout")?).lines();
    if lines.next().transpose()?.as_deref() != Some("ready") {
        let _ = child.kill();
        bail!("the call loop did not start");
    }
    let tracer = match tracer_args {
        Some(extra) => match start_tracer(child.id(), extra, out) {
            Ok(t) => Some(t),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.context("starting the tracer for the call loop"));
            }
        },
        None => None,
    };
    use std::io::Write;
    writeln!(go, "go")?;
    let ns: f64 = lines.next().transpose()?.context("the call loop printed no time")?.trim().parse()?;
    child.wait()?;
    if let Some(tracer) = tracer {
        finish_tracer(tracer, out)?;
    }
    Ok(ns)
}

pub fn run(a: OverheadArgs) -> Result<()> {
    if a.call_loop_child {
        return call_loop_child();
    }
    let mix = bench::mix(&a.workload)?;
    if let Some(why) = mix.unsupported(a.backend) {
        bail!("{}: {why}", a.backend);
    }
    if a.repeats == 0 || a.threads == 0 {
        bail!("--repeats and --threads must be at least 1");
    }
    let cache_args = CacheArgs::for_runs(a.records, a.seconds, a.dir.clone());
    let store = bench::prepare(&cache_args, &BENCH_ARGV, a.backend).context("filling the store")?;
    let traces = tempfile::tempdir().context("a directory for the traces")?;
    let mut runs: Vec<Vec<Run>> = PASSES.iter().map(|_| Vec::new()).collect();
    let mut per_call: Vec<Vec<f64>> = PASSES.iter().map(|_| Vec::new()).collect();
    for repeat in 0..a.repeats {
        for (i, (name, tracer_args)) in PASSES.iter().enumerate() {
            let out = traces.path().join(format!("loop-{i}-{repeat}.jsonl"));
            per_call[i].push(call_loop(*tracer_args, &out).with_context(|| format!("the call loop under {name}"))?);
            let held = bench::hold_run(&cache_args, &BENCH_ARGV, a.backend, store.path(), mix, a.threads)?;
            let out = traces.path().join(format!("{i}-{repeat}.jsonl"));
            let tracer = match tracer_args {
                Some(extra) => Some(start_tracer(held.pid(), extra, &out).with_context(|| format!("starting the tracer for {name}"))?),
                None => None,
            };
            let row = held.go()?;
            let mut run = Run { ops: row.ops, ops_per_s: row.ops_per_s, syscalls: None, marker_hits: None, allocs: None };
            if let Some(tracer) = tracer {
                let total = finish_tracer(tracer, &out)?;
                run.syscalls = Some(total["syscalls"].as_array().map_or(0, |s| s.iter().map(|c| c["count"].as_u64().unwrap_or(0)).sum()));
                let phases = total["phases"].as_object().context("no phases in the trace")?;
                run.marker_hits =
                    Some(phases.iter().filter(|(name, _)| *name != "none").map(|(_, p)| p["hits"].as_u64().unwrap_or(0)).sum());
                run.allocs = total.get("memory").map(|m| {
                    m["allocs"].as_object().map_or(0, |f| {
                        f.iter().filter(|(name, _)| *name != "free").map(|(_, v)| v["count"].as_u64().unwrap_or(0)).sum()
                    })
                });
            }
            eprintln!("{name:>24}: {:>10.0} ops/s", run.ops_per_s);
            runs[i].push(run);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let untraced = median(runs[0].iter().map(|r| r.ops_per_s).collect());
    let passes = PASSES
        .iter()
        .zip(runs.into_iter().zip(per_call))
        .map(|((name, _), (runs, per_call))| {
            let m = median(runs.iter().map(|r| r.ops_per_s).collect());
            let ns_per_call = median(per_call.clone());
            Pass { pass: name, median_ops_per_s: m, ratio: if untraced > 0.0 { m / untraced } else { 0.0 }, runs, ns_per_call, per_call }
        })
        .collect();
    let report = Report { backend: a.backend, workload: a.workload, threads: a.threads, records: a.records, seconds: a.seconds, passes };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

fn table(r: &Report) -> String {
    let mut s = format!(
        "inband bench cache, {} store, {} workload, {} thread(s), {} records, {} s per run, median of {} runs per pass\n\n",
        r.backend,
        r.workload,
        r.threads,
        r.records,
        r.seconds,
        r.passes[0].runs.len()
    );
    s += "| pass | ops/s | × untraced | cost | ns per getppid | counted per op |\n|---|---:|---:|---:|---:|---|\n";
    for p in &r.passes {
        let cost = if p.pass == "untraced" { "–".to_string() } else { format!("{:.1}%", (1.0 - p.ratio) * 100.0) };
        // From the last run: what the tracer saw for each operation.
        let last = p.runs.last().expect("at least one run");
        let per_op = |n: Option<u64>| n.map(|n| n as f64 / last.ops.max(1) as f64);
        let mut counted = Vec::new();
        if let Some(n) = per_op(last.syscalls) {
            counted.push(format!("{n:.3} system calls"));
        }
        if let Some(n) = per_op(last.marker_hits).filter(|n| *n > 0.0) {
            counted.push(format!("{n:.3} marker hits"));
        }
        if let Some(n) = per_op(last.allocs) {
            counted.push(format!("{n:.2} allocations"));
        }
        s += &format!(
            "| {} | {:.0} | {:.3} | {} | {:.1} | {} |\n",
            p.pass,
            p.median_ops_per_s,
            p.ratio,
            cost,
            p.ns_per_call,
            counted.join(", ")
        );
    }
    s
}

/// `inband trace` on `pid`, returned once its programs are attached (it
/// says so on stderr).
pub(crate) fn start_tracer(pid: u32, extra: &[&str], out: &Path) -> Result<(Child, BufReader<ChildStderr>)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(TRACE_ARGV)
        .args(["--pid", &pid.to_string(), "--interval-s", "3600", "--out"])
        .arg(out)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stderr = BufReader::new(child.stderr.take().context("tracer stderr")?);
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if stderr.read_line(&mut line)? == 0 {
            let status = child.wait()?;
            bail!("inband trace ended ({status}) before attaching: {seen}");
        }
        seen += &line;
        if line.contains("tracing pid") {
            return Ok((child, stderr));
        }
    }
}

/// Stops the tracer by SIGINT, as a user would, and returns what
/// [`finish_tracer`] does.
pub(crate) fn stop_tracer(tracer: (Child, BufReader<ChildStderr>), out: &Path) -> Result<Value> {
    // SAFETY: kill only sends a signal, to a child not yet waited for.
    if unsafe { libc::kill(tracer.0.id() as i32, libc::SIGINT) } != 0 {
        bail!("stopping inband trace: {}", std::io::Error::last_os_error());
    }
    finish_tracer(tracer, out)
}

/// Waits for the tracer, which stops once its target has exited, and
/// returns the `total` of its last line.
fn finish_tracer((mut tracer, mut stderr): (Child, BufReader<ChildStderr>), out: &Path) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = tracer.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = tracer.kill();
            let _ = tracer.wait();
            bail!("inband trace did not stop after the run ended");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        bail!("inband trace failed ({status}): {}", text.trim_end());
    }
    let text = std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
    let last = text.lines().last().context("the tracer wrote no snapshot")?;
    let line: Value = serde_json::from_str(last)?;
    Ok(line["total"].clone())
}

//! `inband trace` (docs/trace.md): where a running process spends its time
//! in system calls, by category (seed 003's: I/O read, I/O write,
//! synchronisation, memory, other), by thread and by workload phase, phases
//! being marked by uprobes on functions the user names.
//!
//! The programs count from the moment they attach; this side reads the
//! cumulative maps every interval and writes what changed (JSON lines) and,
//! at the end, a table. Every link is held by a file descriptor of this
//! process and nothing is pinned, so the kernel detaches all of it when the
//! process ends, however it ends.

mod bpf;
mod categories;
mod memory;
mod overhead;
mod process;
mod report;
mod sets;
mod study;
mod symbolize;
mod symbols;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, UprobeOpts};

use bpf::shared::{INBAND_TRACE_FLOOR_CLOCKS, INBAND_TRACE_FLOOR_NONE, INBAND_TRACE_FLOOR_TRACEPOINTS, INBAND_TRACE_MAX_PHASES};
use bpf::trace::TraceSkelBuilder;

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "name"])))]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct TraceArgs {
    #[command(subcommand)]
    pub command: Option<TraceCommand>,
    /// The process to trace (every thread of it).
    #[arg(long)]
    pub pid: Option<u32>,
    /// The process to trace by name: its command name (`comm`) or the start
    /// of its command line, e.g. "inband proxy". Exactly one must match.
    #[arg(long)]
    pub name: Option<String>,
    /// A phase marker, NAME=SYMBOL: each call of function SYMBOL of the
    /// target's executable starts phase NAME on the calling thread, and
    /// that thread's system calls are charged to it until its next marker.
    /// Repeatable (at most 15).
    #[arg(long = "phase", value_name = "NAME=SYMBOL", value_parser = parse_phase)]
    pub phases: Vec<(String, String)>,
    /// Built-in phase markers: `proxy` (`inband proxy`: request_in,
    /// cache_lookup, origin_fetch, response_out) and `cache` (the
    /// inband-cache stores: store_get, store_put, store_delete). Comma
    /// separated or repeated; counted with --phase in the limit of 15.
    #[arg(long = "phases", value_name = "SET", value_delimiter = ',', value_parser = sets::parse)]
    pub sets: Vec<sets::Set>,
    /// Seconds between snapshots.
    #[arg(long, default_value_t = 15.0)]
    pub interval_s: f64,
    /// Stop after this many seconds (default: at SIGINT/SIGTERM or when the
    /// target exits).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Also the memory pass: calls of the C allocator (malloc, calloc,
    /// realloc, free, aligned_alloc, posix_memalign) by size and by call
    /// site, and page allocations, by phase. Costs a uprobe trap per
    /// allocator call, and slows a program that allocates often many times.
    #[arg(long)]
    pub memory: bool,
    /// Also the processes the target starts, and theirs, from their fork
    /// to their exit (those running when the tracer attaches included):
    /// their calls and marker hits count with the target's. Tracing stops
    /// when all of them and the target have exited.
    #[arg(long, conflicts_with = "memory")]
    pub follow: bool,
    /// Write one JSON line per snapshot here (docs/trace.md, "Output").
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// `inband trace overhead`'s floor passes: the system-call tracepoints
    /// attached with programs that stop at the process check
    /// (`tracepoints`), or that also read the clock at entry and exit
    /// (`clocks`), counting nothing.
    #[arg(long, hide = true, value_enum, conflicts_with_all = ["memory", "follow"])]
    pub floor: Option<Floor>,
}

/// bpf/include/inband/trace.h `enum inband_trace_floor`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Floor {
    Tracepoints,
    Clocks,
}

#[derive(clap::Subcommand, Debug)]
pub enum TraceCommand {
    /// What tracing costs: a cell of `inband bench cache` run untraced and
    /// under each pass of the tracer, in turns, throughput compared.
    Overhead(overhead::OverheadArgs),
    /// Seed 003's study on the cache stores: every store × workload mix of
    /// `inband bench cache`, each run traced, where its time goes.
    Study(study::StudyArgs),
}

fn parse_phase(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, symbol)) if !name.is_empty() && !symbol.is_empty() => Ok((name.to_string(), symbol.to_string())),
        _ => Err(format!("`{s}`: expected NAME=SYMBOL")),
    }
}

pub fn run(args: TraceArgs) -> Result<()> {
    match args.command {
        Some(TraceCommand::Overhead(a)) => return overhead::run(a),
        Some(TraceCommand::Study(a)) => return study::run(a),
        None => {}
    }
    if cfg!(not(target_arch = "x86_64")) {
        bail!("inband trace knows the x86_64 system call numbers only");
    }
    let interval = seconds("--interval-s", args.interval_s)?;
    let duration = args.duration_s.map(|s| seconds("--duration-s", s)).transpose()?;
    // The sets' markers first, then --phase's, in the order given.
    let markers: Vec<(String, String, Option<sets::Set>)> = args
        .sets
        .iter()
        .flat_map(|set| set.markers.iter().map(move |(name, symbol)| (name.to_string(), symbol.to_string(), Some(*set))))
        .chain(args.phases.iter().map(|(name, symbol)| (name.clone(), symbol.clone(), None)))
        .collect();
    let phase_names = phase_names(&markers)?;
    let pid = match (&args.pid, &args.name) {
        (Some(pid), _) => process::check(*pid)?,
        (None, Some(name)) => process::by_name(name)?,
        (None, None) => unreachable!("clap requires --pid or --name"),
    };
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    let exe_name = std::fs::read_link(&exe).map(|p| p.display().to_string()).unwrap_or_else(|_| exe.display().to_string());
    // Every bad argument is refused before anything is loaded, and before
    // an existing output file is emptied.
    let offsets = markers
        .iter()
        .map(|(_, symbol, set)| {
            symbols::function_offsets(&exe, symbol).with_context(|| match set {
                Some(set) => format!("phase set {} in pid {pid} ({exe_name}), which is for {}", set.name, set.program),
                None => format!("phase marker in pid {pid} ({exe_name})"),
            })
        })
        .collect::<Result<Vec<Vec<u64>>>>()?;
    let allocator = if args.memory {
        let file = memory::allocator_file(pid)?;
        let mut found = Vec::new();
        for (function, name, required) in memory::FUNCTIONS {
            match symbols::function_offsets(&file, name) {
                Ok(offsets) => found.push((function, offsets)),
                Err(e) if required => return Err(e.context(format!("memory pass on pid {pid}"))),
                Err(_) => {}
            }
        }
        Some((file, found))
    } else {
        None
    };
    let mut out = match &args.out {
        Some(path) => Some(BufWriter::new(
            File::create(path).with_context(|| format!("cannot write the output file {}", path.display()))?,
        )),
        None => None,
    };

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone()).context("installing the signal handlers")?;
    }

    // The programs' tracepoints and their CO-RE fields need the kernel's
    // BTF: said plainly rather than as a load error.
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!("this kernel has no BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF): inband trace needs it for its tracepoints");
    }
    let mut storage = MaybeUninit::uninit();
    let mut open = TraceSkelBuilder::default().open(&mut storage).context("opening the trace BPF object")?;
    let ro = open.maps.rodata_data.as_mut().context("the trace object has no read-only data")?;
    ro.target_tgid = pid;
    ro.category_of = categories::by_slot();
    ro.follow = u8::from(args.follow);
    ro.floor_pass = match args.floor {
        None => INBAND_TRACE_FLOOR_NONE,
        Some(Floor::Tracepoints) => INBAND_TRACE_FLOOR_TRACEPOINTS,
        Some(Floor::Clocks) => INBAND_TRACE_FLOOR_CLOCKS,
    } as u8;
    let skel = open.load().context(
        "loading the trace programs (needs root, or CAP_BPF and CAP_PERFMON, and a kernel with BTF and task storage for tracing programs)",
    )?;
    let mut links: Vec<Link> = Vec::new();
    // The exit program first: it keeps the totals of a thread that ends,
    // which the calls' programs start adding up.
    let mut tracepoints = vec![
        (&skel.progs.trace_exit, "sched_process_exit"),
        (&skel.progs.trace_sys_enter, "sys_enter"),
        (&skel.progs.trace_sys_exit, "sys_exit"),
    ];
    if args.follow {
        // The fork program before the processes already running are added:
        // a process started in between is in both, none in neither.
        tracepoints.insert(0, (&skel.progs.trace_fork, "sched_process_fork"));
    }
    for (prog, point) in tracepoints {
        links.push(prog.attach().with_context(|| {
            format!("attaching to the tracepoint {point} (needs a kernel with BTF, /sys/kernel/btf/vmlinux)")
        })?);
    }
    if args.follow {
        for child in process::descendants(pid) {
            // Exists already if its fork was seen after the attach.
            let _ = skel.maps.processes.update(&child.to_ne_bytes(), &[1], libbpf_rs::MapFlags::NO_EXIST);
        }
    }
    // Following, a marker must also fire in the processes started later,
    // which only a uprobe on every process running the file does; the
    // programs keep to the traced ones.
    let uprobe_pid = if args.follow { -1 } else { pid as i32 };
    for (i, ((name, symbol, _), offsets)) in markers.iter().zip(&offsets).enumerate() {
        for offset in offsets {
            let opts = UprobeOpts { cookie: i as u64 + 1, ..Default::default() };
            links.push(
                skel.progs
                    .trace_phase
                    .attach_uprobe_with_opts(uprobe_pid, &exe, *offset as usize, opts)
                    .with_context(|| {
                        format!("attaching phase {name} to {symbol} in {exe_name} (uprobes with cookies need kernel 5.15 or later)")
                    })?,
            );
        }
    }
    if let Some((file, found)) = &allocator {
        for (function, offsets) in found {
            for offset in offsets {
                let opts = UprobeOpts { cookie: u64::from(*function), ..Default::default() };
                links.push(
                    skel.progs
                        .trace_alloc
                        .attach_uprobe_with_opts(pid as i32, file, *offset as usize, opts)
                        .with_context(|| format!("attaching the memory pass to {} in {}", memory::name(*function), file.display()))?,
                );
            }
        }
        links.push(
            skel.progs.trace_page_alloc.attach().context("attaching to the tracepoint kmem/mm_page_alloc for the memory pass")?,
        );
        let names: Vec<&str> = found.iter().map(|(f, _)| memory::name(*f)).collect();
        eprintln!("inband trace: memory pass on {} ({}) and page allocations", file.display(), names.join(", "));
    }
    // Read again at each snapshot; first before the trace is announced as
    // running, as a target that exits before the first snapshot has no
    // mappings left to read, and one told to go on by whoever waited for
    // the announcement may exit at once.
    let mut symbols = symbolize::Symbolizer::default();
    if args.memory {
        symbols.refresh(pid);
    }
    eprintln!(
        "inband trace: tracing pid {pid} ({exe_name}), {} phase marker(s) on {} function(s)",
        offsets.len(),
        offsets.iter().map(Vec::len).sum::<usize>()
    );

    let started = Instant::now();
    let mut last = report::Totals::default();
    let mut next = started + interval;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = Instant::now();
        let gone = !process::alive(pid) && (!args.follow || report::processes(&skel).iter().all(|p| !process::alive(*p)));
        let done = stop.load(Ordering::Relaxed) || duration.is_some_and(|d| now - started >= d) || gone;
        if !done && now < next {
            continue;
        }
        if args.memory {
            symbols.refresh(pid);
        }
        let mut traced = report::processes(&skel);
        traced.push(pid);
        let totals =
            report::read(&skel, &traced, phase_names.len(), args.memory, &mut symbols).context("reading the trace maps")?;
        if let Some(out) = &mut out {
            let mut followed = report::processes(&skel);
            followed.sort_unstable();
            let line = report::snapshot(pid, &followed, &phase_names, &last, &totals, started.elapsed(), done);
            let path = args.out.as_ref().unwrap();
            writeln!(out, "{line}").and_then(|_| out.flush()).with_context(|| format!("writing {}", path.display()))?;
        }
        last = totals;
        if done {
            break;
        }
        // A reading later than a whole interval moves the schedule instead
        // of bunching the readings it missed.
        next += interval;
        if next <= now {
            next = now + interval;
        }
    }
    drop(links);
    print!("{}", report::table(pid, &exe_name, &phase_names, &last, started.elapsed()));
    Ok(())
}

fn seconds(flag: &str, s: f64) -> Result<Duration> {
    match Duration::try_from_secs_f64(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => bail!("{flag} must be a positive number of seconds, not {s}"),
    }
}

/// "none" (phase 0, before a thread's first marker), then the markers'
/// names in order.
fn phase_names(markers: &[(String, String, Option<sets::Set>)]) -> Result<Vec<String>> {
    if markers.len() >= INBAND_TRACE_MAX_PHASES as usize {
        bail!("at most {} phase markers, --phases sets' included ({} given)", INBAND_TRACE_MAX_PHASES - 1, markers.len());
    }
    let mut names = vec!["none".to_string()];
    for (name, _, _) in markers {
        if names.contains(name) {
            bail!("phase name {name} given twice (\"none\" is taken: calls before any marker)");
        }
        names.push(name.clone());
    }
    Ok(names)
}

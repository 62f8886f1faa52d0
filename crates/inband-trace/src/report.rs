//! Reading the programs' cumulative maps, and turning two readings into a
//! snapshot line (docs/trace.md, "Output") or the final table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Result};
use libbpf_rs::{MapCore, MapFlags};
use serde_json::{json, Map as JsonMap, Value};

use crate::bpf::shared::{
    inband_trace_alloc, inband_trace_last, inband_trace_site, inband_trace_thread, inband_trace_time, inband_trace_totals, INBAND_TRACE_ALLOC_FNS, INBAND_TRACE_COUNTERS,
    INBAND_TRACE_FREE, INBAND_TRACE_NR_SLOTS, INBAND_TRACE_PAGE_ORDERS, INBAND_TRACE_PAGE_ORDER_UNKNOWN,
    INBAND_TRACE_PHASE_UNSET, INBAND_TRACE_PROCESSES_FULL, INBAND_TRACE_SITES_FULL, INBAND_TRACE_SIZE_BUCKETS,
    INBAND_TRACE_STACK_DEPTH, INBAND_TRACE_STACK_LOST, INBAND_TRACE_THREADS_FULL, INBAND_TRACE_UNTIMED,
};
use crate::memory;
use crate::bpf::trace::TraceSkel;
use crate::symbolize::Symbolizer;
use crate::categories::{self, Category, ALL};

#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Time {
    pub count: u64,
    pub ns: u64,
}

impl Time {
    fn add(&mut self, t: Time) {
        self.count += t.count;
        self.ns += t.ns;
    }

    fn since(self, earlier: Time) -> Time {
        Time { count: self.count.saturating_sub(earlier.count), ns: self.ns.saturating_sub(earlier.ns) }
    }

    fn json(self) -> Value {
        json!({ "count": self.count, "ns": self.ns })
    }
}

/// Calls of the allocator or page allocations, and their bytes.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Amount {
    pub count: u64,
    pub bytes: u64,
}

impl Amount {
    fn add(&mut self, a: Amount) {
        self.count += a.count;
        self.bytes += a.bytes;
    }

    fn json(self) -> Value {
        json!({ "count": self.count, "bytes": self.bytes })
    }
}

/// A value the maps only ever add to.
trait Cumulative: Copy + Default {
    fn since(self, earlier: Self) -> Self;
    fn is_zero(&self) -> bool;
}

impl Cumulative for Time {
    fn since(self, earlier: Time) -> Time {
        Time::since(self, earlier)
    }
    fn is_zero(&self) -> bool {
        self.count == 0
    }
}

impl Cumulative for Amount {
    fn since(self, earlier: Amount) -> Amount {
        Amount { count: self.count.saturating_sub(earlier.count), bytes: self.bytes.saturating_sub(earlier.bytes) }
    }
    fn is_zero(&self) -> bool {
        self.count == 0
    }
}

fn diff<K: Ord + Copy, V: Cumulative>(now: &BTreeMap<K, V>, then: &BTreeMap<K, V>) -> BTreeMap<K, V> {
    now.iter().map(|(k, v)| (*k, v.since(then.get(k).copied().unwrap_or_default()))).filter(|(_, v)| !v.is_zero()).collect()
}

/// An allocation's call site: the caller's address, the stack above it
/// (id in `alloc_stacks`, -1 none), the allocating function.
type Site = (u64, i32, u32);

/// Call sites listed in a snapshot (by bytes, most first).
const SITES_SHOWN: usize = 20;

/// The memory pass's maps: by (phase, function, size bucket), pages by
/// (phase, order), allocations by call site with the site's frames named.
#[derive(Clone, Default)]
struct Memory {
    allocs: BTreeMap<(u32, u32, u32), Amount>,
    pages: BTreeMap<(u32, u32), Amount>,
    sites: BTreeMap<Site, Amount>,
    site_names: BTreeMap<Site, Vec<String>>,
}

/// What the maps held at one moment (or the difference of two moments).
#[derive(Clone, Default)]
pub struct Totals {
    /// By (phase, call number); zeros left out.
    syscalls: BTreeMap<(u32, u32), Time>,
    /// Marker hits by phase.
    hits: Vec<u64>,
    /// By (thread id, category index).
    threads: BTreeMap<(u32, u32), Time>,
    lost: [u64; INBAND_TRACE_COUNTERS as usize],
    /// With --memory only.
    memory: Option<Memory>,
    /// The latest marker hit: (CLOCK_MONOTONIC ns, phase, thread id).
    last: Option<(u64, u32, u32)>,
}

fn decode<T: Copy>(bytes: &[u8]) -> Result<T> {
    ensure!(bytes.len() >= size_of::<T>(), "a map entry of {} bytes, expected {}", bytes.len(), size_of::<T>());
    // SAFETY: the length is checked, T is a plain C struct or integer
    // (bpf/include/inband/trace.h) for which every bit pattern is valid.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

fn sum_cpus<T: Copy>(per_cpu: Option<Vec<Vec<u8>>>, mut add: impl FnMut(T)) -> Result<()> {
    for bytes in per_cpu.into_iter().flatten() {
        add(decode(&bytes)?);
    }
    Ok(())
}

/// The totals of the live threads of `pids` that made a timed call, from
/// their task storage, which is looked up by a pidfd of the thread.
fn live_threads(skel: &TraceSkel, pids: &[u32]) -> Vec<(u32, inband_trace_totals)> {
    let mut found = Vec::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|s| s.parse::<libc::pid_t>().ok()) else { continue };
            // SAFETY: pidfd_open takes a thread id and flags and returns a
            // new descriptor, or -1 (a thread that has ended meanwhile:
            // its totals are in `exited`).
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, tid, libc::PIDFD_THREAD) };
            let Ok(fd) = i32::try_from(fd) else { continue };
            if fd < 0 {
                continue;
            }
            // SAFETY: a descriptor just opened, owned here alone.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let Ok(Some(bytes)) = skel.maps.thread_state.lookup(&fd.as_raw_fd().to_ne_bytes(), MapFlags::ANY) else { continue };
            if let Ok(thread) = decode::<inband_trace_thread>(&bytes) {
                if thread.totals.since != 0 {
                    found.push((tid as u32, thread.totals));
                }
            }
        }
    }
    found
}

/// Reads the maps; only the first `phases` phases (the rest are never hit);
/// the threads of `pids`, live or not.
pub fn read(skel: &TraceSkel, pids: &[u32], phases: usize, memory: bool, symbols: &mut Symbolizer) -> Result<Totals> {
    let mut t = Totals { hits: vec![0; phases], ..Default::default() };
    for phase in 0..phases as u32 {
        for nr in 0..INBAND_TRACE_NR_SLOTS {
            let slot = phase * INBAND_TRACE_NR_SLOTS + nr;
            let mut time = Time::default();
            sum_cpus(skel.maps.syscalls.lookup_percpu(&slot.to_ne_bytes(), MapFlags::ANY)?, |v: inband_trace_time| {
                time.add(Time { count: v.count, ns: v.ns })
            })?;
            if time.count > 0 {
                t.syscalls.insert((phase, nr), time);
            }
        }
        sum_cpus(skel.maps.phase_hits.lookup_percpu(&phase.to_ne_bytes(), MapFlags::ANY)?, |v: u64| {
            t.hits[phase as usize] += v
        })?;
    }
    // The live threads first: one that ends before `exited` is read is
    // found there too, later, with the same start.
    let live = live_threads(skel, pids);
    let mut exited = BTreeMap::new();
    for key in skel.maps.exited.keys() {
        let Some(value) = skel.maps.exited.lookup(&key, MapFlags::ANY)? else { continue };
        exited.insert(decode::<u32>(&key)?, decode::<inband_trace_totals>(&value)?);
    }
    let mut add = |tid: u32, totals: &inband_trace_totals| {
        for (category, time) in totals.category.iter().enumerate() {
            if time.count > 0 {
                t.threads.entry((tid, category as u32)).or_default().add(Time { count: time.count, ns: time.ns });
            }
        }
    };
    for (tid, totals) in &live {
        if !exited.get(tid).is_some_and(|e| e.since == totals.since) {
            add(*tid, totals);
        }
    }
    for (tid, totals) in &exited {
        add(*tid, totals);
    }
    sum_cpus(skel.maps.last_phase.lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)?, |v: inband_trace_last| {
        if v.ns > 0 && t.last.is_none_or(|(ns, _, _)| v.ns > ns) {
            t.last = Some((v.ns, v.phase, v.tid));
        }
    })?;
    for (i, lost) in t.lost.iter_mut().enumerate() {
        sum_cpus(skel.maps.counters.lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)?, |v: u64| *lost += v)?;
    }
    if memory {
        let mut m = Memory::default();
        let read_amount = |map: &libbpf_rs::Map, slot: u32| -> Result<Amount> {
            let mut a = Amount::default();
            sum_cpus(map.lookup_percpu(&slot.to_ne_bytes(), MapFlags::ANY)?, |v: inband_trace_alloc| {
                a.add(Amount { count: v.count, bytes: v.bytes })
            })?;
            Ok(a)
        };
        for phase in 0..phases as u32 {
            for function in 0..INBAND_TRACE_ALLOC_FNS {
                for bucket in 0..INBAND_TRACE_SIZE_BUCKETS {
                    let slot = (phase * INBAND_TRACE_ALLOC_FNS + function) * INBAND_TRACE_SIZE_BUCKETS + bucket;
                    let a = read_amount(&skel.maps.allocs, slot)?;
                    if a.count > 0 {
                        m.allocs.insert((phase, function, bucket), a);
                    }
                }
            }
            for order in 0..INBAND_TRACE_PAGE_ORDERS {
                let a = read_amount(&skel.maps.pages, phase * INBAND_TRACE_PAGE_ORDERS + order)?;
                if a.count > 0 {
                    m.pages.insert((phase, order), a);
                }
            }
        }
        for key in skel.maps.sites.keys() {
            let Some(value) = skel.maps.sites.lookup(&key, MapFlags::ANY)? else { continue };
            let k: inband_trace_site = decode(&key)?;
            let v: inband_trace_alloc = decode(&value)?;
            let site = (k.caller, k.stack_id, k.fn_);
            m.sites.insert(site, Amount { count: v.count, bytes: v.bytes });
            // The caller, then the frame-pointer chain above it; its first
            // frame is the allocator's own entry. Where the chain runs
            // through code without frame pointers it reads whatever the
            // register held: it ends at the first address that is not code.
            let mut frames = vec![symbols.name(k.caller)];
            if k.stack_id >= 0 {
                if let Some(stack) = skel.maps.alloc_stacks.lookup(&k.stack_id.to_ne_bytes(), MapFlags::ANY)? {
                    let stack: [u64; INBAND_TRACE_STACK_DEPTH as usize] = decode(&stack)?;
                    let code: Vec<u64> = stack.iter().skip(1).copied().take_while(|a| symbols.is_code(*a)).collect();
                    frames.extend(code.into_iter().map(|a| symbols.name(a)));
                }
            }
            m.site_names.insert(site, frames);
        }
        t.memory = Some(m);
    }
    Ok(t)
}

/// The smallest size of a bucket: sizes with `bucket` significant bits.
fn bucket_floor(bucket: u32) -> u64 {
    if bucket == 0 {
        0
    } else {
        1 << (bucket - 1)
    }
}

impl Memory {
    fn since(&self, earlier: Option<&Memory>) -> Memory {
        let empty = Memory::default();
        let earlier = earlier.unwrap_or(&empty);
        Memory {
            allocs: diff(&self.allocs, &earlier.allocs),
            pages: diff(&self.pages, &earlier.pages),
            sites: diff(&self.sites, &earlier.sites),
            site_names: self.site_names.clone(),
        }
    }

    /// Allocating calls (free left out), frees and pages, of one phase or
    /// of all.
    fn summary(&self, phase: Option<u32>) -> (Amount, u64, Amount) {
        let (mut allocs, mut frees, mut pages) = (Amount::default(), 0, Amount::default());
        for ((p, function, _), a) in &self.allocs {
            if phase.is_none_or(|want| want == *p) {
                if *function == INBAND_TRACE_FREE {
                    frees += a.count;
                } else {
                    allocs.add(*a);
                }
            }
        }
        for ((p, _), a) in &self.pages {
            if phase.is_none_or(|want| want == *p) {
                pages.add(*a);
            }
        }
        (allocs, frees, pages)
    }

    fn json(&self) -> Value {
        // Over the phases: by function, then by the bucket's smallest size.
        let mut functions: BTreeMap<&str, BTreeMap<u64, Amount>> = BTreeMap::new();
        for ((_, function, bucket), a) in &self.allocs {
            functions.entry(memory::name(*function)).or_default().entry(bucket_floor(*bucket)).or_default().add(*a);
        }
        let allocs: JsonMap<String, Value> = functions
            .into_iter()
            .map(|(name, sizes)| {
                let mut total = Amount::default();
                sizes.values().for_each(|a| total.add(*a));
                let sizes: JsonMap<String, Value> = sizes.into_iter().map(|(floor, a)| (floor.to_string(), a.json())).collect();
                (name.to_string(), json!({ "count": total.count, "bytes": total.bytes, "sizes": sizes }))
            })
            .collect();
        let mut orders: BTreeMap<u32, Amount> = BTreeMap::new();
        for ((_, order), a) in &self.pages {
            orders.entry(*order).or_default().add(*a);
        }
        let (_, _, pages) = self.summary(None);
        let orders: JsonMap<String, Value> = orders.into_iter().map(|(o, a)| (o.to_string(), a.json())).collect();
        let mut sites: Vec<(&Site, &Amount)> = self.sites.iter().collect();
        sites.sort_by_key(|(_, a)| std::cmp::Reverse(a.bytes));
        let sites: Vec<Value> = sites
            .into_iter()
            .take(SITES_SHOWN)
            .map(|(site, a)| {
                json!({
                    "function": memory::name(site.2),
                    "count": a.count,
                    "bytes": a.bytes,
                    "stack": self.site_names.get(site).cloned().unwrap_or_default(),
                })
            })
            .collect();
        json!({ "allocs": allocs, "pages": { "count": pages.count, "bytes": pages.bytes, "orders": orders }, "sites": sites })
    }
}

impl Totals {
    fn since(&self, earlier: &Totals) -> Totals {
        Totals {
            memory: self.memory.as_ref().map(|m| m.since(earlier.memory.as_ref())),
            syscalls: diff(&self.syscalls, &earlier.syscalls),
            hits: self.hits.iter().enumerate().map(|(i, h)| h.saturating_sub(earlier.hits.get(i).copied().unwrap_or(0))).collect(),
            threads: diff(&self.threads, &earlier.threads),
            lost: std::array::from_fn(|i| self.lost[i].saturating_sub(earlier.lost[i])),
            last: self.last,
        }
    }

    fn by_category(&self, phase: Option<u32>) -> BTreeMap<Category, Time> {
        let mut out: BTreeMap<Category, Time> = ALL.iter().map(|c| (*c, Time::default())).collect();
        for ((p, nr), time) in &self.syscalls {
            if phase.is_none_or(|want| want == *p) {
                out.get_mut(&categories::of(*nr)).unwrap().add(*time);
            }
        }
        out
    }

    /// By call number over every phase, most time first.
    fn by_call(&self) -> Vec<(u32, Time)> {
        let mut calls: BTreeMap<u32, Time> = BTreeMap::new();
        for ((_, nr), time) in &self.syscalls {
            calls.entry(*nr).or_default().add(*time);
        }
        let mut calls: Vec<(u32, Time)> = calls.into_iter().collect();
        calls.sort_by_key(|(_, t)| std::cmp::Reverse(t.ns));
        calls
    }

    fn json(&self, phase_names: &[String]) -> Value {
        let categories = |m: BTreeMap<Category, Time>| -> Value {
            m.into_iter().map(|(c, t)| (c.name().to_string(), t.json())).collect::<JsonMap<_, _>>().into()
        };
        let syscalls: Vec<Value> = self
            .by_call()
            .into_iter()
            .map(|(nr, t)| {
                json!({ "nr": nr, "name": categories::name(nr), "category": categories::of(nr).name(), "count": t.count, "ns": t.ns })
            })
            .collect();
        let phases: JsonMap<String, Value> = phase_names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let hits = self.hits.get(i).copied().unwrap_or(0);
                let mut phase = json!({ "hits": hits, "categories": categories(self.by_category(Some(i as u32))) });
                if let Some(m) = &self.memory {
                    let (allocs, frees, pages) = m.summary(Some(i as u32));
                    phase["memory"] = json!({ "allocs": allocs.json(), "frees": frees, "pages": pages.json() });
                }
                (name.clone(), phase)
            })
            .collect();
        let mut threads: BTreeMap<u32, JsonMap<String, Value>> = BTreeMap::new();
        for ((tid, category), t) in &self.threads {
            let name = ALL.get(*category as usize).map_or("other", |c| c.name());
            threads.entry(*tid).or_default().insert(name.to_string(), t.json());
        }
        let threads: JsonMap<String, Value> = threads.into_iter().map(|(tid, m)| (tid.to_string(), m.into())).collect();
        let mut section = json!({
            "categories": categories(self.by_category(None)),
            "syscalls": syscalls,
            "phases": phases,
            "threads": threads,
            "lost": {
                "untimed": self.lost[INBAND_TRACE_UNTIMED as usize],
                "threads_full": self.lost[INBAND_TRACE_THREADS_FULL as usize],
                "phase_unset": self.lost[INBAND_TRACE_PHASE_UNSET as usize],
                "page_order_unknown": self.lost[INBAND_TRACE_PAGE_ORDER_UNKNOWN as usize],
                "processes_full": self.lost[INBAND_TRACE_PROCESSES_FULL as usize],
                "sites_full": self.lost[INBAND_TRACE_SITES_FULL as usize],
                "stack_lost": self.lost[INBAND_TRACE_STACK_LOST as usize],
            },
        });
        if let Some(m) = &self.memory {
            section["memory"] = m.json();
        }
        section
    }
}

/// The processes followed now (--follow): started by traced ones, their
/// main thread not exited.
pub fn processes(skel: &TraceSkel) -> Vec<u32> {
    skel.maps.processes.keys().filter_map(|k| decode::<u32>(&k).ok()).collect()
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One JSON line: what changed since `last` and the totals since the start.
pub fn snapshot(
    pid: u32,
    followed: &[u32],
    phase_names: &[String],
    last: &Totals,
    now: &Totals,
    elapsed: Duration,
    last_line: bool,
) -> String {
    let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
    // The phase the process was in when the maps were read: the one its
    // latest marker hit entered, whichever thread hit it.
    let phase = now.last.map_or(Value::Null, |(ns, phase, tid)| {
        let name = phase_names.get(phase as usize).map_or("?", String::as_str);
        json!({ "name": name, "thread": tid, "since_ms": monotonic_ns().saturating_sub(ns) / 1_000_000 })
    });
    json!({
        "time_unix_ms": unix_ms,
        "elapsed_ms": elapsed.as_millis() as u64,
        "pid": pid,
        "final": last_line,
        "followed": followed,
        "phase": phase,
        "interval": now.since(last).json(phase_names),
        "total": now.json(phase_names),
    })
    .to_string()
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The summary printed at the end.
pub fn table(pid: u32, exe: &str, phase_names: &[String], t: &Totals, elapsed: Duration) -> String {
    let by_category = t.by_category(None);
    let all_ns: u64 = by_category.values().map(|t| t.ns).sum();
    let mut s = String::new();
    let _ = writeln!(s, "pid {pid} ({exe}), traced {:.1} s, {} threads seen", elapsed.as_secs_f64(), {
        let mut tids: Vec<u32> = t.threads.keys().map(|(tid, _)| *tid).collect();
        tids.dedup();
        tids.len()
    });
    let _ = writeln!(s, "\n{:<10} {:>12} {:>14} {:>7}", "category", "calls", "time ms", "share");
    for (c, time) in &by_category {
        let share = if all_ns == 0 { 0.0 } else { 100.0 * time.ns as f64 / all_ns as f64 };
        let _ = writeln!(s, "{:<10} {:>12} {:>14.3} {:>6.1}%", c.name(), time.count, ms(time.ns), share);
    }
    let _ = write!(s, "\n{:<16} {:>10}", "phase", "hits");
    for c in ALL {
        let _ = write!(s, " {:>12}", format!("{} ms", c.name()));
    }
    s.push('\n');
    for (i, name) in phase_names.iter().enumerate() {
        let _ = write!(s, "{:<16} {:>10}", name, t.hits.get(i).copied().unwrap_or(0));
        for time in t.by_category(Some(i as u32)).values() {
            let _ = write!(s, " {:>12.3}", ms(time.ns));
        }
        s.push('\n');
    }
    let _ = writeln!(s, "\n{:<18} {:<9} {:>12} {:>14}", "top calls", "category", "calls", "time ms");
    for (nr, time) in t.by_call().into_iter().take(10) {
        let _ = writeln!(s, "{:<18} {:<9} {:>12} {:>14.3}", categories::name(nr), categories::of(nr).name(), time.count, ms(time.ns));
    }
    if let Some(m) = &t.memory {
        let mb = |b: u64| b as f64 / (1 << 20) as f64;
        let _ = writeln!(s, "\n{:<16} {:>12} {:>12} {:>10} {:>12} {:>12}", "memory", "allocs", "alloc MiB", "frees", "page allocs", "page MiB");
        for (i, name) in phase_names.iter().enumerate() {
            let (allocs, frees, pages) = m.summary(Some(i as u32));
            let _ = writeln!(s, "{:<16} {:>12} {:>12.3} {:>10} {:>12} {:>12.3}", name, allocs.count, mb(allocs.bytes), frees, pages.count, mb(pages.bytes));
        }
        let mut sites: Vec<(&Site, &Amount)> = m.sites.iter().collect();
        sites.sort_by_key(|(_, a)| std::cmp::Reverse(a.bytes));
        let _ = writeln!(s, "\n{:<14} {:>10} {:>12}  caller < its callers", "top sites", "allocs", "MiB");
        for (site, a) in sites.into_iter().take(5) {
            let frames = m.site_names.get(site).map(|f| f.iter().take(3).cloned().collect::<Vec<_>>().join(" < ")).unwrap_or_default();
            let _ = writeln!(s, "{:<14} {:>10} {:>12.3}  {frames}", memory::name(site.2), a.count, mb(a.bytes));
        }
    }
    if t.lost.iter().any(|n| *n > 0) {
        let _ = writeln!(
            s,
            "\nnot counted: {} calls not timed, {} calls missing from the per-thread view, {} phase changes, {} processes not followed, \
             {} allocations not by call site, {} call sites without their stack",
            t.lost[INBAND_TRACE_UNTIMED as usize],
            t.lost[INBAND_TRACE_THREADS_FULL as usize],
            t.lost[INBAND_TRACE_PHASE_UNSET as usize],
            t.lost[INBAND_TRACE_PROCESSES_FULL as usize],
            t.lost[INBAND_TRACE_SITES_FULL as usize],
            t.lost[INBAND_TRACE_STACK_LOST as usize],
        );
    }
    s
}

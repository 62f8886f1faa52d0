//! `inband trace` (docs/trace.md) against workloads whose system calls and
//! phases are known exactly: a Python loop of reads and writes, and a C
//! program whose marker functions are called a known number of times. Also
//! the refusals of bad input, and that a SIGKILLed tracer leaves no program,
//! link or map of its own in the kernel. Needs root (BPF, uprobes).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn inband() -> Command {
    Command::new(env!("CARGO_BIN_EXE_inband"))
}

/// A workload started and stopped at its first line on stdout, which it
/// prints once set up; a line on its stdin lets it go on.
struct Target {
    child: Child,
    go: ChildStdin,
}

impl Target {
    fn start(mut cmd: Command) -> Target {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("starting the workload");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n", "workload did not start");
        let go = child.stdin.take().unwrap();
        Target { child, go }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the workload run to its end and reaps it.
    fn finish(mut self) {
        self.go.write_all(b"go\n").unwrap();
        assert!(self.child.wait().unwrap().success(), "workload failed");
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `inband trace` running; returns once its programs are attached (it says
/// so on stderr).
fn start_tracer(args: &[&str]) -> Child {
    let mut child = inband().arg("trace").args(args).stderr(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("inband trace ended before attaching: {seen}");
        }
        seen += &line;
        if line.contains("tracing pid") {
            return child;
        }
    }
}

/// Waits (bounded) for the tracer, which stops by itself when its target
/// is gone, and returns its output.
fn wait_tracer(mut tracer: Child) -> Output {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tracer.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = tracer.kill();
            panic!("inband trace did not stop after its target exited");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = tracer.wait_with_output().unwrap();
    assert!(out.status.success(), "inband trace failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn count(v: &Value) -> u64 {
    v["count"].as_u64().unwrap_or_else(|| panic!("no count in {v}"))
}

fn syscall<'a>(section: &'a Value, name: &str) -> &'a Value {
    section["syscalls"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap_or_else(|| panic!("no {name} in {section}"))
}

const READS: u64 = 1013;
const WRITES: u64 = 707;

#[test]
fn system_calls_are_counted_in_their_categories() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("trace.jsonl");
    // os.read and os.write are one system call each; the reads and writes
    // of setting up happen before the tracer attaches. The main thread
    // reads, a second one writes.
    let script = format!(
        "import os, threading\n\
         z = os.open('/dev/zero', os.O_RDONLY)\n\
         n = os.open('/dev/null', os.O_WRONLY)\n\
         os.write(1, b'ready\\n')\n\
         os.read(0, 16)\n\
         def writes():\n    for _ in range({WRITES}): os.write(n, b'x')\n\
         t = threading.Thread(target=writes)\n\
         t.start()\n\
         for _ in range({READS}): os.read(z, 1)\n\
         t.join()\n\
         os._exit(0)\n"
    );
    let mut python = Command::new("python3");
    python.args(["-c", &script]);
    let target = Target::start(python);
    let pid = target.pid();
    let tracer = start_tracer(&["--pid", &pid.to_string(), "--interval-s", "0.1", "--out", out.to_str().unwrap()]);
    target.finish();
    let report = wait_tracer(tracer);

    let lines = lines(&out);
    let last = lines.last().unwrap();
    assert_eq!(last["final"], true);
    assert_eq!(last["pid"], pid);
    let total = &last["total"];
    assert_eq!(count(syscall(total, "read")), READS, "{total}");
    assert_eq!(count(syscall(total, "write")), WRITES, "{total}");
    assert_eq!(syscall(total, "read")["category"], "io_read");
    assert_eq!(syscall(total, "write")["category"], "io_write");
    assert_eq!(count(&total["categories"]["io_read"]), READS, "{total}");
    assert_eq!(count(&total["categories"]["io_write"]), WRITES, "{total}");
    assert!(total["categories"]["io_read"]["ns"].as_u64().unwrap() > 0);
    // Each thread's part: the main thread (its id is the process's) read,
    // the other wrote.
    let threads = total["threads"].as_object().unwrap();
    assert_eq!(count(&threads[&pid.to_string()]["io_read"]), READS, "{total}");
    assert!(threads[&pid.to_string()].get("io_write").is_none(), "{total}");
    let writer: Vec<_> = threads.iter().filter(|(_, t)| t.get("io_write").is_some()).collect();
    assert_eq!(writer.len(), 1, "{total}");
    assert_ne!(writer[0].0, &pid.to_string());
    assert_eq!(count(&writer[0].1["io_write"]), WRITES, "{total}");
    assert!(writer[0].1.get("io_read").is_none(), "{total}");
    // The intervals add up to the total.
    let summed: u64 = lines.iter().map(|l| count(&l["interval"]["categories"]["io_read"])).sum();
    assert_eq!(summed, READS);
    // No marker: everything is in phase "none".
    assert_eq!(count(&total["phases"]["none"]["categories"]["io_write"]), WRITES);
    let table = String::from_utf8_lossy(&report.stdout);
    assert!(table.lines().any(|l| l.starts_with("io_read") && l.split_whitespace().nth(1) == Some(&READS.to_string())), "{table}");
}

/// A thread's totals are read from the thread while it lives (its task
/// storage, by a pidfd), not only once it has exited: a snapshot taken
/// while the target sleeps after its reads has them all, on its thread.
#[test]
fn a_live_threads_totals_are_in_every_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("trace.jsonl");
    let script = format!(
        "import os, time\n\
         z = os.open('/dev/zero', os.O_RDONLY)\n\
         os.write(1, b'ready\\n')\n\
         os.read(0, 16)\n\
         for _ in range({READS}): os.read(z, 1)\n\
         time.sleep(30)\n"
    );
    let mut python = Command::new("python3");
    python.args(["-c", &script]);
    let mut target = Target::start(python);
    let pid = target.pid().to_string();
    let mut tracer = start_tracer(&["--pid", &pid, "--interval-s", "0.1", "--out", out.to_str().unwrap()]);
    target.go.write_all(b"go\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        let done = std::fs::read_to_string(&out).unwrap_or_default().lines().rev().find_map(|l| {
            let line: Value = serde_json::from_str(l).ok()?;
            (count(&line["total"]["categories"]["io_read"]) >= READS).then_some(line)
        });
        if let Some(line) = done {
            break line;
        }
        assert!(Instant::now() < deadline, "no snapshot with the reads");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(target.child.try_wait().unwrap().is_none(), "the target is still sleeping");
    assert_eq!(seen["final"], false);
    assert_eq!(count(&seen["total"]["threads"][&pid]["io_read"]), READS, "{seen}");
    drop(target);
    let _ = tracer.kill();
    let _ = tracer.wait();
}

/// Threads of the marker program that write.
const WRITERS: u64 = 3;

/// A C program with two marker functions: WRITERS threads each call
/// `mark_write` before each of WRITES writes, while the main thread calls
/// `mark_read` once before READS reads. Named `name` and this test
/// process's id, for `--name`.
fn marker_program(dir: &Path, name: &str) -> PathBuf {
    let src = dir.join("markers.c");
    let bin = dir.join(format!("{name}-{}", std::process::id()));
    std::fs::write(
        &src,
        format!(
            "#include <fcntl.h>\n#include <pthread.h>\n#include <unistd.h>\n\
             __attribute__((noinline)) void mark_write(void) {{ __asm__ volatile(\"\"); }}\n\
             __attribute__((noinline)) void mark_read(void) {{ __asm__ volatile(\"\"); }}\n\
             static int zero, null;\n\
             static void *writes(void *arg) {{\n\
             char c = 0;\n\
             for (int i = 0; i < {WRITES}; i++) {{ mark_write(); write(null, &c, 1); }}\n\
             return arg;\n}}\n\
             int main(void) {{\n\
             char c = 0;\n\
             pthread_t t[{WRITERS}];\n\
             zero = open(\"/dev/zero\", O_RDONLY), null = open(\"/dev/null\", O_WRONLY);\n\
             write(1, \"ready\\n\", 6);\n\
             if (read(0, &c, 1) != 1) return 1;\n\
             for (int i = 0; i < {WRITERS}; i++) pthread_create(&t[i], 0, writes, 0);\n\
             mark_read();\n\
             for (int i = 0; i < {READS}; i++) read(zero, &c, 1);\n\
             for (int i = 0; i < {WRITERS}; i++) pthread_join(t[i], 0);\n\
             return 0;\n}}\n"
        ),
    )
    .unwrap();
    let cc = Command::new("cc").args(["-O1", "-pthread", "-o"]).arg(&bin).arg(&src).status().expect("running cc");
    assert!(cc.success());
    bin
}

/// The threads' phases are their own: the writers' writes are charged to
/// `writing`, the main thread's reads, made meanwhile, to `reading`.
#[test]
fn phase_markers_are_counted_and_charged_their_calls() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("trace.jsonl");
    let program = marker_program(dir.path(), "phases");
    let target = Target::start(Command::new(&program));
    let pid = target.pid();
    let tracer = start_tracer(&[
        "--name",
        program.file_name().unwrap().to_str().unwrap(),
        "--phase",
        "writing=mark_write",
        "--phase",
        "reading=mark_read",
        "--out",
        out.to_str().unwrap(),
    ]);
    target.finish();
    wait_tracer(tracer);

    let lines = lines(&out);
    assert_eq!(lines.last().unwrap()["pid"], pid, "--name found another process");
    let phases = &lines.last().unwrap()["total"]["phases"];
    assert_eq!(phases["writing"]["hits"], WRITERS * WRITES, "{phases}");
    assert_eq!(phases["reading"]["hits"], 1, "{phases}");
    assert_eq!(count(&phases["writing"]["categories"]["io_write"]), WRITERS * WRITES, "{phases}");
    assert_eq!(count(&phases["writing"]["categories"]["io_read"]), 0, "{phases}");
    assert_eq!(count(&phases["reading"]["categories"]["io_read"]), READS, "{phases}");
    assert_eq!(count(&phases["reading"]["categories"]["io_write"]), 0, "{phases}");
    // Starting the threads (clone3, mmap, ...) comes before any marker;
    // the read that waited for "go" began before the tracer: not timed.
    for c in ["io_read", "io_write"] {
        assert_eq!(count(&phases["none"]["categories"][c]), 0, "{phases}");
    }
    assert!(count(&phases["none"]["categories"]["sync"]) >= WRITERS, "{phases}");
}

fn refused(args: &[&str]) -> String {
    let out = inband().arg("trace").args(args).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{args:?} was accepted: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_input_is_refused_by_name() {
    // Process ids stay below pid_max.
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max").unwrap().trim().to_string();
    let err = refused(&["--pid", &pid_max]);
    assert!(err.contains(&format!("no process with pid {pid_max}")), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let target = Target::start(Command::new(marker_program(dir.path(), "refused")));
    let pid = target.pid().to_string();
    let err = refused(&["--pid", &pid, "--phase", "x=mark_write", "--phase", "y=no_such_function"]);
    assert!(err.contains("symbol no_such_function is not a function defined in"), "{err}");

    let unwritable = dir.path().join("no-such-dir/trace.jsonl");
    let err = refused(&["--pid", &pid, "--out", unwritable.to_str().unwrap()]);
    assert!(err.contains("cannot write the output file") && err.contains("No such file"), "{err}");

    // A full disk: the first snapshot cannot be written.
    let err = refused(&["--pid", &pid, "--out", "/dev/full", "--interval-s", "0.1"]);
    assert!(err.contains("writing /dev/full") && err.contains("No space left on device"), "{err}");

    let err = refused(&["--name", "no-such-process-name-at-all"]);
    assert!(err.contains("no process named"), "{err}");
}

/// The ids of the BPF programs, links and maps `pid` holds open.
fn bpf_ids(pid: u32) -> Vec<(String, u32)> {
    let mut ids = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fdinfo")).unwrap().flatten() {
        let info = std::fs::read_to_string(fd.path()).unwrap_or_default();
        // A link's fdinfo names its program too: the link id comes first.
        let kind = ["link_id", "prog_id", "map_id"].into_iter().find(|k| info.lines().any(|l| l.starts_with(&format!("{k}:"))));
        if let Some(kind) = kind {
            let line = info.lines().find(|l| l.starts_with(&format!("{kind}:"))).unwrap();
            ids.push((kind.to_string(), line[kind.len() + 1..].trim().parse().unwrap()));
        }
    }
    ids
}

fn loaded(kind: &str, id: u32) -> bool {
    match kind {
        "link_id" => libbpf_rs::query::LinkInfoIter::default().any(|l| l.id == id),
        "prog_id" => libbpf_rs::query::ProgInfoIter::default().any(|p| p.id == id),
        _ => libbpf_rs::query::MapInfoIter::default().any(|m| m.id == id),
    }
}

#[test]
fn sigkill_leaves_no_probe_attached() {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start(Command::new(marker_program(dir.path(), "killed")));
    // Two tracepoints and a marker's uprobe; the memory pass's uprobes on
    // at least malloc, calloc, realloc and free, and its tracepoint; or
    // --follow's two tracepoints.
    for (pass, links) in [("--memory", 8), ("--follow", 5)] {
        sigkill_frees_everything(target.pid(), pass, links);
    }
    drop(target);
}

fn sigkill_frees_everything(pid: u32, pass: &str, links: usize) {
    let mut tracer = start_tracer(&["--pid", &pid.to_string(), "--phase", "w=mark_write", pass]);
    let ids = bpf_ids(tracer.id());
    assert!(ids.iter().filter(|(k, _)| k == "link_id").count() >= links, "{pass}: {ids:?}");
    assert!(ids.iter().any(|(k, _)| k == "map_id"), "{ids:?}");
    assert!(ids.iter().all(|(k, id)| loaded(k, *id)), "{ids:?}");
    tracer.kill().unwrap();
    tracer.wait().unwrap();
    // The kernel frees them once their last reference is gone (after an
    // RCU grace period).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<_> = ids.iter().filter(|(k, id)| loaded(k, *id)).collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{pass}: still loaded after SIGKILL: {left:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One of our own daemons, marked by a Rust function's source path: a
/// tracer (A) whose snapshots come only at its end, traced by another (B)
/// with a marker on the function that reads A's maps. SIGTERM makes A
/// read once, write its last line and exit 0, and B counts exactly that.
#[test]
fn rust_names_mark_phases_and_sigterm_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let (a_out, b_out) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let target = Target::start(Command::new(marker_program(dir.path(), "idle")));
    let a = start_tracer(&["--pid", &target.pid().to_string(), "--interval-s", "1000", "--out", a_out.to_str().unwrap()]);
    let a_pid = a.id();
    let b = start_tracer(&["--pid", &a_pid.to_string(), "--phase", "snapshot=inband_trace::report::read", "--out", b_out.to_str().unwrap()]);
    assert_eq!(unsafe { libc::kill(a_pid as i32, libc::SIGTERM) }, 0);
    wait_tracer(a);
    wait_tracer(b);

    let a_lines = lines(&a_out);
    assert_eq!(a_lines.len(), 1);
    assert_eq!(a_lines[0]["final"], true);
    let b_lines = lines(&b_out);
    let phases = &b_lines.last().unwrap()["total"]["phases"];
    assert_eq!(phases["snapshot"]["hits"], 1, "{phases}");
    // Reading the maps is a bpf() call per slot: at least the 512 call
    // numbers of phase "none", all charged to the marked phase.
    let bpf_calls = count(syscall(&b_lines.last().unwrap()["total"], "bpf"));
    assert!(bpf_calls >= 512, "{bpf_calls}");
    assert!(count(&phases["snapshot"]["categories"]["other"]) >= bpf_calls, "{phases}");
    drop(target);
}

/// The memory pass: a C program that, after its marker, makes known
/// numbers of allocator calls of known sizes and touches 8 MiB of new
/// memory page by page.
#[test]
fn memory_pass_counts_allocations_by_size_and_pages() {
    const MALLOCS: u64 = 333;
    const CALLOCS: u64 = 77;
    const TOUCHED: u64 = 8 << 20;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("allocs.c");
    let bin = dir.path().join("allocs");
    // The empty asm statements keep the compiler from removing allocations
    // whose memory is never read.
    std::fs::write(
        &src,
        format!(
            "#include <stdlib.h>\n#include <unistd.h>\n\
             __attribute__((noinline)) void mark(void) {{ __asm__ volatile(\"\"); }}\n\
             int main(void) {{\n\
             char c;\n\
             write(1, \"ready\\n\", 6);\n\
             if (read(0, &c, 1) != 1) return 1;\n\
             mark();\n\
             for (int i = 0; i < {MALLOCS}; i++) {{ void *p = malloc(100); __asm__ volatile(\"\" :: \"r\"(p) : \"memory\"); free(p); }}\n\
             for (int i = 0; i < {CALLOCS}; i++) {{ void *p = calloc(10, 1000); __asm__ volatile(\"\" :: \"r\"(p) : \"memory\"); free(p); }}\n\
             char *big = malloc({TOUCHED});\n\
             for (long i = 0; i < {TOUCHED}; i += 4096) big[i] = 1;\n\
             __asm__ volatile(\"\" :: \"r\"(big) : \"memory\");\n\
             return 0;\n}}\n"
        ),
    )
    .unwrap();
    assert!(Command::new("cc").args(["-O1", "-o"]).arg(&bin).arg(&src).status().unwrap().success());
    let out = dir.path().join("trace.jsonl");
    let target = Target::start(Command::new(&bin));
    let tracer = start_tracer(&["--pid", &target.pid().to_string(), "--memory", "--phase", "work=mark", "--out", out.to_str().unwrap()]);
    target.finish();
    wait_tracer(tracer);

    let lines = lines(&out);
    let total = &lines.last().unwrap()["total"];
    let allocs = &total["memory"]["allocs"];
    // 100 bytes: 7 significant bits, the bucket from 64; 10 * 1000: from 8192.
    assert_eq!(allocs["malloc"]["sizes"]["64"], serde_json::json!({ "count": MALLOCS, "bytes": MALLOCS * 100 }), "{allocs}");
    assert_eq!(allocs["calloc"]["sizes"]["8192"], serde_json::json!({ "count": CALLOCS, "bytes": CALLOCS * 10_000 }), "{allocs}");
    assert_eq!(allocs["calloc"]["count"], CALLOCS, "{allocs}");
    assert_eq!(allocs["malloc"]["count"], MALLOCS + 1, "{allocs}");
    assert_eq!(allocs["malloc"]["bytes"], MALLOCS * 100 + TOUCHED, "{allocs}");
    assert_eq!(allocs["free"]["count"], MALLOCS + CALLOCS, "{allocs}");
    let phase = &total["phases"]["work"]["memory"];
    assert_eq!(phase["allocs"]["count"], MALLOCS + CALLOCS + 1, "{phase}");
    assert_eq!(phase["frees"], MALLOCS + CALLOCS, "{phase}");
    // Touching the pages allocates them (4 KiB each, or huge pages).
    let pages = phase["pages"]["bytes"].as_u64().unwrap();
    assert!(pages >= TOUCHED, "{pages} bytes of pages for {TOUCHED} touched: {phase}");
    assert_eq!(total["phases"]["none"]["memory"]["allocs"]["count"], 0, "{total}");
}

/// An origin on loopback for `inband proxy`: every GET gets a cacheable
/// 200 naming its path, on a connection it then closes. Counts requests.
fn origin() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use std::io::Read;
    use std::sync::atomic::{AtomicU64, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let served = std::sync::Arc::new(AtomicU64::new(0));
    let count = served.clone();
    // Ends with the test process: a thread blocked in accept is harmless.
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            let path = String::from_utf8_lossy(&head).split_whitespace().nth(1).unwrap_or("/").to_string();
            let body = format!("body of {path}\n");
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\ncache-control: max-age=600\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            count.fetch_add(1, Ordering::SeqCst);
        }
    });
    (addr, served)
}

/// (status, x-cache) of one request on its own connection.
fn request(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: trace.test\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let x_cache = out.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("x-cache: ").map(str::to_string)).unwrap_or_default();
    (status, x_cache)
}

/// `inband proxy` with a memory cache, traced with both built-in sets
/// while it serves a known workload: N URLs missed (each looked up twice,
/// before and after becoming the one fetch of its URL), then hit, then M
/// of them purged. Every marker's hits are the workload's events, and
/// every snapshot names the phase the proxy was in when it was taken.
#[test]
fn builtin_phase_sets_count_the_proxys_requests() {
    const N: u64 = 20;
    const M: u64 = 5;
    let dir = tempfile::tempdir().unwrap();
    let (origin, served) = origin();
    let config = dir.path().join("proxy.toml");
    std::fs::write(&config, format!("listen = \"127.0.0.1:0\"\nbackends = [\"{origin}\"]\nworkers = 1\n[cache]\nbackend = \"memory\"\n")).unwrap();
    let log = dir.path().join("proxy.log");
    let proxy = inband()
        .args(["proxy", "--config"])
        .arg(&config)
        .env("INBAND_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let proxy = Proxy(proxy);
    let deadline = Instant::now() + Duration::from_secs(10);
    let addr: std::net::SocketAddr = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let addr = text.lines().filter(|l| l.contains("proxy listening")).find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("addr=")));
        if let Some(a) = addr {
            break a.parse().unwrap();
        }
        assert!(Instant::now() < deadline, "proxy did not start: {text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = dir.path().join("trace.jsonl");
    let tracer = start_tracer(&["--pid", &proxy.0.id().to_string(), "--phases", "proxy,cache", "--interval-s", "0.2", "--out", out.to_str().unwrap()]);
    for i in 0..N {
        assert_eq!(request(addr, "GET", &format!("/k/{i}")), (200, "miss".to_string()));
    }
    for i in 0..N {
        assert_eq!(request(addr, "GET", &format!("/k/{i}")), (200, "hit".to_string()));
    }
    for i in 0..M {
        assert_eq!(request(addr, "PURGE", &format!("/k/{i}")).0, 200);
    }
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), N);
    assert_eq!(unsafe { libc::kill(tracer.id() as i32, libc::SIGTERM) }, 0);
    wait_tracer(tracer);

    let lines = lines(&out);
    let last = lines.last().unwrap();
    let phases = &last["total"]["phases"];
    let hits = |p: &str| phases[p]["hits"].as_u64().unwrap_or_else(|| panic!("no phase {p}: {phases}"));
    assert_eq!(hits("request_in"), 2 * N + M, "{phases}");
    assert_eq!(hits("response_out"), 2 * N + M, "{phases}");
    assert_eq!(hits("cache_lookup"), 2 * N + N, "{phases}");
    assert_eq!(hits("origin_fetch"), N, "{phases}");
    // A PURGE reads the entry (Vary or not) before deleting it.
    assert_eq!(hits("store_get"), 2 * N + N + M, "{phases}");
    assert_eq!(hits("store_put"), N, "{phases}");
    assert_eq!(hits("store_delete"), M, "{phases}");
    // The origin's replies are read in origin_fetch, the responses written
    // in response_out, by the one worker thread.
    assert!(count(&phases["origin_fetch"]["categories"]["io_read"]) >= N, "{phases}");
    assert!(count(&phases["response_out"]["categories"]["io_write"]) >= 2 * N + M, "{phases}");
    // The intervals' hits add up, and each snapshot names the phase the
    // proxy was in: the last one entered by then, response_out at the end.
    let summed: u64 = lines.iter().map(|l| l["interval"]["phases"]["request_in"]["hits"].as_u64().unwrap()).sum();
    assert_eq!(summed, 2 * N + M);
    let mut seen = false;
    for l in &lines {
        seen |= l["total"]["phases"]["request_in"]["hits"].as_u64().unwrap() > 0;
        assert_eq!(l["phase"].is_null(), !seen, "{l}");
    }
    assert_eq!(last["phase"]["name"], "response_out", "{}", last["phase"]);
    drop(proxy);
}

/// Kills the proxy if the test fails before it ends.
struct Proxy(Child);

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_phase_set_on_another_program_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let target = Target::start(Command::new(marker_program(dir.path(), "noset")));
    let err = refused(&["--pid", &target.pid().to_string(), "--phases", "proxy"]);
    assert!(err.contains("phase set proxy") && err.contains("which is for inband proxy"), "{err}");
    assert!(err.contains("symbol inband_proxy::probe::request_in is not a function defined in"), "{err}");
    let out = inband().args(["trace", "--pid", "1", "--phases", "nginx"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no phase set \"nginx\" (there are: proxy, cache)"), "{err}");
}

/// `inband trace overhead` runs the cache benchmark untraced and under
/// each pass, and each traced run was traced from its first operation:
/// the cache set's markers hit once per operation, the memory pass sees
/// at least the key the benchmark allocates per operation.
#[test]
fn overhead_compares_the_benchmark_traced_and_untraced() {
    let dir = tempfile::tempdir().unwrap();
    let out = inband()
        .args(["trace", "overhead", "--backend", "memory", "--records", "2000", "--seconds", "0.3", "--repeats", "1", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let passes = report["passes"].as_array().unwrap();
    let names: Vec<&str> = passes.iter().map(|p| p["pass"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["untraced", "floor: tracepoints only", "floor: clocks only", "timing", "timing, --phases cache", "timing and --memory"]
    );
    let untraced = passes[0]["median_ops_per_s"].as_f64().unwrap();
    assert!(untraced > 0.0, "{report}");
    assert_eq!(passes[0]["ratio"], 1.0);
    for p in passes {
        let run = &p["runs"][0];
        assert!(run["ops"].as_u64().unwrap() > 0, "{p}");
        // Each pass also timed its call loop.
        assert!(p["ns_per_call"].as_f64().unwrap() > 0.0, "{p}");
        let ratio = p["median_ops_per_s"].as_f64().unwrap() / untraced;
        assert!((p["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9, "{p}");
    }
    assert!(passes[0]["runs"][0]["syscalls"].is_null());
    // The floors' programs stop at the process check, or after reading
    // the clocks: nothing is counted.
    for floor in &passes[1..3] {
        assert_eq!(floor["runs"][0]["syscalls"], 0, "{floor}");
    }
    assert!(passes[3]["runs"][0]["syscalls"].as_u64().unwrap() > 0, "{}", passes[3]);
    assert_eq!(passes[3]["runs"][0]["marker_hits"], 0, "{}", passes[3]);
    let phases = &passes[4]["runs"][0];
    assert_eq!(phases["marker_hits"], phases["ops"], "{phases}");
    // The memory store's operations make no system calls; the uprobe(2)
    // a marker on a nop costs (kernel 6.18) is not counted as one.
    assert!(phases["syscalls"].as_u64().unwrap() < phases["ops"].as_u64().unwrap() / 10, "{phases}");
    let memory = &passes[5]["runs"][0];
    assert!(memory["allocs"].as_u64().unwrap() >= memory["ops"].as_u64().unwrap(), "{memory}");
    // The store and the traces are gone with the command.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// --follow: a program whose children write (one also forking a
/// grandchild that execs the program again, which writes too), traced
/// with --follow and, at the same time, without. The children's calls and
/// marker hits count only with --follow; the parent's count in both.
#[test]
fn follow_counts_the_processes_the_target_starts() {
    const CHILDREN: u64 = 3;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("forks.c");
    let bin = dir.path().join("forks");
    std::fs::write(
        &src,
        format!(
            "#include <fcntl.h>\n#include <sys/wait.h>\n#include <unistd.h>\n\
             __attribute__((noinline)) void mark_child(void) {{ __asm__ volatile(\"\"); }}\n\
             static void writes(void) {{\n\
             char c = 0; int null = open(\"/dev/null\", O_WRONLY);\n\
             mark_child();\n\
             for (int i = 0; i < {WRITES}; i++) write(null, &c, 1);\n}}\n\
             int main(int argc, char **argv) {{\n\
             char c = 0;\n\
             if (argc > 1) {{ writes(); return 0; }}\n\
             int zero = open(\"/dev/zero\", O_RDONLY);\n\
             write(1, \"ready\\n\", 6);\n\
             if (read(0, &c, 1) != 1) return 1;\n\
             for (int i = 0; i < {CHILDREN}; i++) {{\n\
               if (fork() == 0) {{\n\
                 writes();\n\
                 if (fork() == 0) {{ execl(\"/proc/self/exe\", \"forks\", \"again\", (char *)0); _exit(1); }}\n\
                 wait(0);\n\
                 _exit(0);\n\
               }}\n\
             }}\n\
             for (int i = 0; i < {CHILDREN}; i++) wait(0);\n\
             for (int i = 0; i < {READS}; i++) read(zero, &c, 1);\n\
             return 0;\n}}\n"
        ),
    )
    .unwrap();
    assert!(Command::new("cc").args(["-O1", "-o"]).arg(&bin).arg(&src).status().unwrap().success());
    let target = Target::start(Command::new(&bin));
    let pid = target.pid().to_string();
    let (followed, alone) = (dir.path().join("followed.jsonl"), dir.path().join("alone.jsonl"));
    let a = start_tracer(&["--pid", &pid, "--follow", "--phase", "child=mark_child", "--out", followed.to_str().unwrap()]);
    let b = start_tracer(&["--pid", &pid, "--phase", "child=mark_child", "--out", alone.to_str().unwrap()]);
    target.finish();
    wait_tracer(a);
    wait_tracer(b);

    let with = lines(&followed).pop().unwrap();
    let total = &with["total"];
    // Each child and each exec'd grandchild: WRITES writes after its marker.
    assert_eq!(count(syscall(total, "write")), 2 * CHILDREN * WRITES, "{total}");
    assert_eq!(total["phases"]["child"]["hits"], 2 * CHILDREN, "{total}");
    assert_eq!(count(&total["phases"]["child"]["categories"]["io_write"]), 2 * CHILDREN * WRITES, "{total}");
    // The parent's reads, and the exec'd programs' loader reading libc.
    assert!(count(syscall(total, "read")) >= READS, "{total}");
    assert!(count(syscall(total, "execve")) >= CHILDREN, "{total}");
    assert!(total["threads"].as_object().unwrap().len() as u64 >= 1 + 2 * CHILDREN, "{total}");
    assert_eq!(with["followed"], serde_json::json!([]), "all exited: {with}");
    assert_eq!(total["lost"]["processes_full"], 0);

    let alone = lines(&alone).pop().unwrap();
    let total = &alone["total"];
    assert_eq!(count(syscall(total, "read")), READS, "{total}");
    assert!(total["syscalls"].as_array().unwrap().iter().all(|s| s["name"] != "write"), "{total}");
    assert_eq!(total["phases"]["child"]["hits"], 0, "{total}");
}

#[test]
fn follow_refuses_the_memory_pass() {
    let out = inband().args(["trace", "--pid", "1", "--follow", "--memory"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--follow") && err.contains("--memory"), "{err}");
}

/// The memory pass's call sites: a C program built with frame pointers
/// allocates from two functions, one called from a third; each site is
/// its caller (found at the allocator's entry) and the chain above it,
/// named by the program's symbols, with exact counts and bytes.
#[test]
fn memory_pass_names_call_sites() {
    const SMALL: u64 = 211;
    const BIG: u64 = 37;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("sites.c");
    let bin = dir.path().join("sites");
    std::fs::write(
        &src,
        format!(
            "#include <stdlib.h>\n#include <unistd.h>\n\
             #define KEEP(p) __asm__ volatile(\"\" :: \"r\"(p) : \"memory\")\n\
             __attribute__((noinline)) void *alloc_small(void) {{ void *p = malloc(100); KEEP(p); return p; }}\n\
             __attribute__((noinline)) void *alloc_big(void) {{ void *p = calloc(10, 1000); KEEP(p); return p; }}\n\
             __attribute__((noinline)) void outer(void) {{ for (int i = 0; i < {SMALL}; i++) free(alloc_small()); KEEP(0); }}\n\
             int main(void) {{\n\
             char c;\n\
             write(1, \"ready\\n\", 6);\n\
             if (read(0, &c, 1) != 1) return 1;\n\
             outer();\n\
             for (int i = 0; i < {BIG}; i++) free(alloc_big());\n\
             return 0;\n}}\n"
        ),
    )
    .unwrap();
    let cc = Command::new("cc").args(["-O1", "-fno-omit-frame-pointer", "-o"]).arg(&bin).arg(&src).status().unwrap();
    assert!(cc.success());
    let out = dir.path().join("trace.jsonl");
    let target = Target::start(Command::new(&bin));
    let tracer = start_tracer(&["--pid", &target.pid().to_string(), "--memory", "--out", out.to_str().unwrap()]);
    target.finish();
    wait_tracer(tracer);

    let total = &lines(&out).pop().unwrap()["total"];
    let sites = total["memory"]["sites"].as_array().unwrap();
    let site = |function: &str, first: &str| {
        sites
            .iter()
            .find(|s| s["function"] == function && s["stack"][0].as_str().is_some_and(|f| f.starts_with(first)))
            .unwrap_or_else(|| panic!("no {function} site in {first}: {sites:?}"))
    };
    let small = site("malloc", "alloc_small+");
    assert_eq!((small["count"].as_u64(), small["bytes"].as_u64()), (Some(SMALL), Some(SMALL * 100)), "{small}");
    let frames: Vec<&str> = small["stack"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
    assert!(frames.len() >= 3 && frames[1].starts_with("outer+") && frames[2].starts_with("main+"), "{frames:?}");
    let big = site("calloc", "alloc_big+");
    assert_eq!((big["count"].as_u64(), big["bytes"].as_u64()), (Some(BIG), Some(BIG * 10_000)), "{big}");
    assert!(big["stack"][1].as_str().unwrap().starts_with("main+"), "{big}");
    assert_eq!(total["lost"]["sites_full"], 0);
}

fn study(args: &[&str], dir: &Path) -> Value {
    let out = inband().args(["trace", "study", "--quick", "--json", "--dir"]).arg(dir).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn calls(part: &Value, category: &str) -> u64 {
    part["calls"][category]["count"].as_u64().unwrap()
}

/// `inband trace study`: each cell's calls are charged to the thread that
/// made them. The files store's inserts (mix W) write each record's file
/// from the worker thread, at least one write(2) per operation, and its
/// store has no threads of its own; the memory store's reads (mix C) make
/// no system call, and allocate (the memory pass's second run); a scan mix on a store without order is reported with
/// its reason, not run; an unknown mix is refused before a store is
/// filled; a tracer that cannot attach is named with the cell.
#[test]
fn study_charges_each_stores_calls_to_its_threads() {
    let dir = tempfile::tempdir().unwrap();
    let report = study(&["--backends", "files", "--mixes", "W,E"], dir.path());
    let cells = report["cells"].as_array().unwrap();
    let mixes: Vec<&str> = cells.iter().map(|c| c["mix"].as_str().unwrap()).collect();
    assert_eq!(mixes, ["E", "W"], "the inserting mix runs last");
    let unsupported = cells[0]["unsupported"].as_str().unwrap();
    assert!(unsupported.contains("files store keeps one file per key") && cells[0].get("ops").is_none(), "{}", cells[0]);
    let w = &cells[1];
    let ops = w["ops"].as_u64().unwrap();
    assert!(ops > 0, "{w}");
    let workers = &w["workers"];
    assert_eq!(workers["threads"], 1, "{w}");
    assert!(calls(workers, "io_write") >= ops, "{w}");
    assert!(workers["calls"]["io_write"]["ns"].as_u64().unwrap() > 0, "{w}");
    // The per-thread view holds the worker under its name, with the same
    // numbers the tracer gave for its thread id.
    let worker = w["by_thread"].as_array().unwrap().iter().find(|t| t["role"] == "worker").unwrap();
    assert_eq!(worker["name"], "worker-0");
    assert_eq!(calls(worker, "io_write"), calls(workers, "io_write"));
    assert_eq!(w["store"]["threads"], 0, "{w}");
    // The main thread sleeps through the run: its calls are not the
    // workers'.
    assert!(calls(&w["main"], "io_write") <= 2, "{w}");

    let report = study(&["--backends", "memory", "--mixes", "C", "--memory"], dir.path());
    let c = &report["cells"][0];
    // The memory pass's run: at least the key each read formats.
    let memory = &c["memory"];
    assert!(memory["ops"].as_u64().unwrap() > 0 && memory["allocs_per_op"].as_f64().unwrap() >= 1.0, "{c}");
    assert!(memory["frees_per_op"].as_f64().unwrap() >= 1.0, "{c}");
    let ops = c["ops"].as_u64().unwrap();
    assert!(ops > 1000, "{c}");
    let worker_calls: u64 = ["io_read", "io_write", "sync", "memory", "other"].iter().map(|k| calls(&c["workers"], k)).sum();
    assert!(worker_calls * 100 < ops, "{worker_calls} system calls for {ops} reads from memory: {c}");
    assert!(c["workers"]["user_s"].as_f64().unwrap() > 0.0, "{c}");

    let out = inband().args(["trace", "study", "--quick", "--mixes", "C,Z", "--dir"]).arg(dir.path()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no workload mix \"Z\" (there are: read-only, 99/1, 95/5, 90/10, W, A, B, C, D, E, F)"), "{err}");

    // A tracer that cannot attach (its capabilities dropped, as for a user
    // who is not root): the cell and the reason are named, the held run
    // is not left behind.
    let out = Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-bpf,-perfmon,-sys_admin", env!("CARGO_BIN_EXE_inband")])
        .args(["trace", "study", "--quick", "--backends", "memory", "--mixes", "C", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("attaching inband trace to the memory C run (pid ") && err.contains("needs root, or CAP_BPF and CAP_PERFMON"), "{err}");
    let pid: u32 = err.split("(pid ").nth(1).and_then(|r| r.split(')').next()).unwrap().parse().unwrap();
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "run child {pid} left running");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the stores are gone with the command");
}

//! `inband proxy` as a process, on loopback: SIGTERM finishes the request
//! in flight and exits 0; `kill -9` in the middle of cache writes leaves a
//! cache that serves only intact entries after a restart; out of file
//! descriptors it backs off and recovers once idle clients time out; a bad
//! config gets every error at once; logs to a file carry no colour codes;
//! concurrent hits on a 100 MiB object do not hold it in memory.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// Kills the proxy if a test fails before it stops it.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An origin on a thread: `/k/N` is cacheable with a body derived from N,
/// `/slow` takes 800 ms and is not cacheable. Counts requests. Dropping it
/// stops it.
struct Origin {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn body_for(i: usize) -> String {
    format!("key {i} {}", char::from(b'a' + (i % 26) as u8).to_string().repeat(8000))
}

const BIG: usize = 100 << 20;

fn big_body() -> Vec<u8> {
    (0..BIG).map(|i| (i % 251) as u8).collect()
}

fn origin() -> Origin {
    use hyper::{body::Incoming, server::conn::http1, service::service_fn, Request, Response};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let h = hits.clone();
    let big = bytes::Bytes::from(big_body());
    thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let serve = async {
                loop {
                    let Ok((stream, _)) = listener.accept().await else { continue };
                    let (h, big) = (h.clone(), big.clone());
                    let service = service_fn(move |req: Request<Incoming>| {
                        h.fetch_add(1, Ordering::SeqCst);
                        let big = big.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let (body, cache) = if path == "/big" {
                                (big, "max-age=600")
                            } else if path == "/slow" {
                                tokio::time::sleep(Duration::from_millis(800)).await;
                                (bytes::Bytes::from("slow done"), "no-store")
                            } else {
                                let i: usize = path.trim_start_matches("/k/").parse().unwrap_or(0);
                                (bytes::Bytes::from(body_for(i)), "max-age=600")
                            };
                            let resp = Response::builder().header("cache-control", cache).body(http_body_util::Full::new(body)).unwrap();
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    tokio::spawn(http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service));
                }
            };
            tokio::select! {
                _ = serve => {}
                _ = stopped => {}
            }
        });
    });
    Origin { addr, hits, _stop: stop }
}

/// Starts `inband proxy` with its log in `log`; returns once it accepts,
/// with the address it bound. Configs listen on port 0 (or, for a restart,
/// on the address the first run reported), so no other test's listener can
/// answer in its place.
fn start(config: &Path, log: &Path) -> (Proc, SocketAddr) {
    let child = Command::new(env!("CARGO_BIN_EXE_inband"))
        .args(["proxy", "--config"])
        .arg(config)
        .env("INBAND_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut p = Proc(child);
    let addr = listening(&mut p, log);
    (p, addr)
}

/// The address the proxy reports in its log once it accepts.
fn listening(p: &mut Proc, log: &Path) -> SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let addr = text.lines().filter(|l| l.contains("proxy listening")).find_map(|l| {
            l.split_whitespace().find_map(|w| w.strip_prefix("addr=")).and_then(|a| a.parse::<SocketAddr>().ok())
        });
        if let Some(addr) = addr {
            return addr;
        }
        if let Some(st) = p.0.try_wait().unwrap() {
            panic!("proxy exited ({st}) before listening:\n{text}");
        }
        assert!(Instant::now() < deadline, "proxy did not start listening:\n{text}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// (status, x-cache, body) of one GET on its own connection.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: cli.test\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or(std::io::ErrorKind::UnexpectedEof)?;
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let x_cache = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("x-cache: ").map(str::to_string))
        .unwrap_or_default();
    Ok((status, x_cache, body.to_string()))
}

fn write_config(dir: &Path, addr: &str, origin: SocketAddr) -> std::path::PathBuf {
    let cfg = dir.join("proxy.toml");
    let cache = dir.join("cache");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"{addr}\"\nbackends = [\"{origin}\"]\n[cache]\nbackend = \"lmdb\"\npath = \"{}\"\ncapacity_bytes = 67108864\n",
            cache.display()
        ),
    )
    .unwrap();
    cfg
}

#[test]
fn sigterm_finishes_the_request_in_flight_and_exits_0() {
    let o = origin();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "127.0.0.1:0", o.addr);
    let (mut p, addr) = start(&cfg, &dir.path().join("proxy.log"));
    let pending = thread::spawn(move || get(addr, "/slow"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while o.hits.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "request never reached the origin");
        thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(p.0.id() as i32, libc::SIGTERM) }, 0);
    let (status, _, body) = pending.join().unwrap().unwrap();
    assert_eq!((status, body.as_str()), (200, "slow done"));
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(st) = p.0.try_wait().unwrap() {
            break st.code();
        }
        assert!(Instant::now() < deadline, "proxy did not exit after SIGTERM");
        thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0));
    assert!(TcpStream::connect(addr).is_err(), "no longer listening");
}

#[test]
fn kill_9_during_cache_writes_then_restart_serves_only_intact_entries() {
    const KEYS: usize = 300;
    let o = origin();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "127.0.0.1:0", o.addr);
    let (mut p, addr) = start(&cfg, &dir.path().join("proxy.log"));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|t| {
            let stop = stop.clone();
            thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::SeqCst) && i < KEYS {
                    let _ = get(addr, &format!("/k/{i}"));
                    i += 2;
                }
            })
        })
        .collect();
    // Let writes get going, then kill without warning mid-stream.
    let deadline = Instant::now() + Duration::from_secs(10);
    while o.hits.load(Ordering::SeqCst) < 40 {
        assert!(Instant::now() < deadline, "no traffic reached the origin");
        thread::sleep(Duration::from_millis(5));
    }
    p.0.kill().unwrap();
    p.0.wait().unwrap();
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let before = o.hits.load(Ordering::SeqCst);
    let cfg = write_config(dir.path(), &addr.to_string(), o.addr);
    let (_p, again) = start(&cfg, &dir.path().join("restart.log"));
    assert_eq!(again, addr);
    let mut hits = 0;
    let mut misses = 0;
    for i in 0..KEYS {
        let (status, x_cache, body) = get(addr, &format!("/k/{i}")).unwrap();
        assert_eq!(status, 200, "/k/{i}");
        assert!(body == body_for(i), "/k/{i} served a wrong body ({x_cache})");
        match x_cache.as_str() {
            "hit" => hits += 1,
            "miss" => misses += 1,
            other => panic!("/k/{i}: x-cache {other:?}"),
        }
    }
    assert!(hits >= 30, "only {hits} entries survived the kill");
    assert_eq!(o.hits.load(Ordering::SeqCst) - before, misses, "every miss, and only misses, went to the origin");
}

/// CPU seconds (user + system) a process has used so far.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    // utime and stime are fields 14 and 15; fields[0] is field 3.
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

#[test]
fn out_of_descriptors_it_backs_off_and_recovers_when_idle_clients_time_out() {
    let o = origin();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("proxy.toml");
    // max_connections far above what 48 descriptors allow: the limit hit is
    // the kernel's (EMFILE), not the proxy's own.
    std::fs::write(
        &cfg,
        format!("listen = \"127.0.0.1:0\"\nbackends = [\"{}\"]\nmax_connections = 1000\nclient_header_timeout_ms = 1500\n", o.addr),
    )
    .unwrap();
    let log = dir.path().join("proxy.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inband"));
    cmd.args(["proxy", "--config"]).arg(&cfg).env("INBAND_LOG", "info").stdout(Stdio::null());
    cmd.stderr(std::fs::File::create(&log).unwrap());
    // SAFETY: only setrlimit between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let l = libc::rlimit { rlim_cur: 48, rlim_max: 48 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut p = Proc(cmd.spawn().unwrap());
    let addr = listening(&mut p, &log);
    assert_eq!(get(addr, "/k/1").unwrap().0, 200);
    // Idle clients, more than the proxy has descriptors for.
    let idle: Vec<TcpStream> = (0..60).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(&log).unwrap().contains("accept failed") {
        assert!(Instant::now() < deadline, "accept never failed: the test did not reach EMFILE");
        thread::sleep(Duration::from_millis(20));
    }
    let c0 = cpu_s(p.0.id());
    thread::sleep(Duration::from_millis(500));
    let spent = cpu_s(p.0.id()) - c0;
    assert!(spent < 0.2, "{spent:.2} CPU s in 0.5 s while out of descriptors: the accept loop spins");
    // The header timeout closes the idle clients from accept; service resumes.
    let t = Instant::now();
    let (status, _, body) = get(addr, "/k/2").unwrap();
    assert_eq!((status, body.as_str()), (200, body_for(2).as_str()));
    assert!(t.elapsed() < Duration::from_secs(8), "recovered only after {:?}", t.elapsed());
    drop(idle);
    drop(p);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("proxy listening"), "{text}");
    // The access line of /k/2: the backend that answered, time to head and
    // to the last byte, all bytes sent.
    let line = text.lines().find(|l| l.contains("uri=/k/2")).unwrap_or_else(|| panic!("no access line for /k/2:\n{text}"));
    for want in ["status=200", &format!("upstream={}", o.addr), "head_ms=", " ms=", &format!("bytes={}", body_for(2).len()), "complete=true"] {
        assert!(line.contains(want), "{want:?} missing in {line}");
    }
    assert!(!text.contains('\x1b'), "colour codes in a log file:\n{text}");
}

#[test]
fn a_bad_config_gets_every_error_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("proxy.toml");
    std::fs::write(&cfg, "listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\nretries = -1\nidle_timeout = 5\n[cache]\nbackend = \"tape\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_inband")).args(["proxy", "--config"]).arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for want in ["line 3:", "line 4: unknown field `idle_timeout`", "line 6: unknown variant `tape`"] {
        assert!(err.contains(want), "{want:?} missing in:\n{err}");
    }
    assert!(!err.contains('\x1b'), "{err}");
}

/// The process's anonymous resident memory (heap, stacks), in bytes: what
/// a copy of a body would grow. Mapped store pages are file-backed.
fn rss_anon(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status.lines().find_map(|l| l.strip_prefix("RssAnon:")).unwrap().trim().trim_end_matches(" kB").trim().parse().unwrap();
    kb * 1024
}

/// GET with the body read and checked without keeping it.
fn get_big(addr: SocketAddr) -> std::io::Result<(u16, String, usize)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(b"GET /big HTTP/1.1\r\nHost: cli.test\r\nConnection: close\r\n\r\n")?;
    let mut buf = vec![0; 1 << 16];
    let mut head = Vec::new();
    let mut at = 0usize;
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        let mut data = &buf[..n];
        if at == 0 && !head.ends_with(b"\r\n\r\n") {
            let split = (0..data.len()).find(|&i| [&head[..], &data[..=i]].concat().ends_with(b"\r\n\r\n"));
            match split {
                Some(i) => {
                    head.extend_from_slice(&data[..=i]);
                    data = &data[i + 1..];
                }
                None => {
                    head.extend_from_slice(data);
                    continue;
                }
            }
        }
        for (j, b) in data.iter().enumerate() {
            assert_eq!(*b, ((at + j) % 251) as u8, "byte {} of the body", at + j);
        }
        at += data.len();
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let x_cache = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("x-cache: ").map(str::to_string)).unwrap_or_default();
    Ok((status, x_cache, at))
}

#[test]
fn five_concurrent_hits_on_a_100_mib_object_do_not_hold_it_in_memory() {
    let o = origin();
    for backend in ["lmdb", "rocksdb", "files"] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("proxy.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"127.0.0.1:0\"\nbackends = [\"{}\"]\n[cache]\nbackend = \"{backend}\"\npath = \"{}\"\ncapacity_bytes = 536870912\nmax_object_bytes = 134217728\n",
                o.addr,
                dir.path().join("cache").display()
            ),
        )
        .unwrap();
        let log = dir.path().join("proxy.log");
        let (p, addr) = start(&cfg, &log);
        let fill = get_big(addr).unwrap_or_else(|e| panic!("{backend}: the fill: {e}; the proxy's log:\n{}", std::fs::read_to_string(&log).unwrap_or_default()));
        assert_eq!(fill, (200, "miss".into(), BIG), "{backend}: the fill");
        let before = rss_anon(p.0.id());
        let done = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (done, pid) = (done.clone(), p.0.id());
            thread::spawn(move || {
                let mut peak = 0;
                while !done.load(Ordering::SeqCst) {
                    peak = peak.max(rss_anon(pid));
                    thread::sleep(Duration::from_millis(5));
                }
                peak
            })
        };
        let clients: Vec<_> = (0..5).map(|_| thread::spawn(move || get_big(addr))).collect();
        for c in clients {
            let hit = c.join().unwrap().unwrap_or_else(|e| panic!("{backend}: a hit: {e}; the proxy's log:\n{}", std::fs::read_to_string(&log).unwrap_or_default()));
            assert_eq!(hit, (200, "hit".into(), BIG), "{backend}");
        }
        done.store(true, Ordering::SeqCst);
        let peak = sampler.join().unwrap();
        let grew = peak.saturating_sub(before);
        println!("{backend}: anonymous memory {} MiB before the hits, peak {} MiB during 5 concurrent hits of 100 MiB", before >> 20, peak >> 20);
        // One object's worth would be 100 MiB, five 500: the bound is a
        // few chunks per client plus allocator slack.
        assert!(grew < 48 << 20, "{backend}: 5 hits of 100 MiB grew anonymous memory by {} MiB", grew >> 20);
    }
}

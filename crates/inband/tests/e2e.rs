//! Integration tests on a network-namespace testbed with real HTTP traffic:
//! one client, the balancer, three real servers running `inband serve` and
//! `inband agent`. Each test brings up its own testbed (named after the
//! process and test) and tears it down even when it fails.

use std::io::{Read, Write};
use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use inband::testbed::{Testbed, TestbedSpec};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_inband");
const SERVERS: usize = 3;
const BODY: usize = 46 * 1024;

/// Runs `cmd` in the node's network namespace only (the mount namespace
/// stays shared, so bpffs pins are visible to every command).
fn in_ns(tb: &Testbed, node: &str, cmd: &[&str]) -> Command {
    let mut c = tb.command(node, cmd);
    c.env("INBAND_LOG", "warn");
    c
}

fn run_ok(tb: &Testbed, node: &str, cmd: &[&str]) -> Output {
    let out = in_ns(tb, node, cmd).output().expect("spawn");
    assert!(out.status.success(), "{cmd:?} in {node} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

struct Cluster {
    tb: Testbed,
    dir: PathBuf,
    lb: Option<Child>,
    others: Vec<Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SIGTERM first: agents and the balancer clean up after themselves
        // on a normal stop; whatever does not stop in time is killed.
        for c in self.lb.iter_mut().chain(self.others.iter_mut()) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for c in self.lb.iter_mut().chain(self.others.iter_mut()) {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = in_ns(&self.tb, "lb", &[BIN, "lb", "detach", "--interface", "eth0", "--force"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn vip(tb: &Testbed) -> SocketAddrV4 {
    SocketAddrV4::new(tb.vip(), 80)
}

fn server(tb: &Testbed, i: usize) -> SocketAddrV4 {
    SocketAddrV4::new(tb.addr(&format!("s{i}")), 8080)
}

impl Cluster {
    /// `serve_args[i]` are extra `inband serve` flags for server i+1.
    fn up(test: &str, mode: &str, serve_args: &[&[&str]]) -> Cluster {
        let name = format!("e{}{}", std::process::id() % 10000, test);
        let tb = Testbed::up(TestbedSpec { name: name.clone(), clients: 1, servers: SERVERS, ..Default::default() })
            .expect("testbed up");
        let dir = std::env::temp_dir().join(format!("inband-e2e-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster { tb, dir, lb: None, others: Vec::new() };
        inband::auth::keygen(&c.key()).unwrap();
        let lb_addr = c.tb.addr("lb");
        for i in 1..=SERVERS {
            let node = format!("s{i}");
            let cfg = c.dir.join(format!("agent-{node}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "interface = \"eth0\"\nbalancers = [\"{lb_addr}\"]\nscore_socket = \"{}\"\n\n{}\n[[service]]\nport = 8080\nvip = \"{}\"\n",
                    c.dir.join(format!("agent-{node}.sock")).display(),
                    c.auth(),
                    vip(&c.tb)
                ),
            )
            .unwrap();
            let mut serve = vec![BIN, "serve", "--listen", "0.0.0.0:8080", "--service-ms", "20", "--service-dist", "constant"];
            serve.extend_from_slice(serve_args.get(i - 1).copied().unwrap_or(&[]));
            let s = in_ns(&c.tb, &node, &serve).stdout(Stdio::null()).spawn().unwrap();
            c.others.push(s);
            let a = in_ns(&c.tb, &node, &[BIN, "agent", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
            c.others.push(a);
        }
        std::fs::write(c.dir.join("lb.toml"), lb_config(&c, mode, &[1, 2, 3])).unwrap();
        c.start_lb();
        for i in 1..=SERVERS {
            wait_for(&format!("agent on s{i}"), || {
                in_ns(&c.tb, &format!("s{i}"), &["tc", "filter", "show", "dev", "eth0", "egress"])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).contains("agent_egress"))
                    .unwrap_or(false)
            });
            wait_for(&format!("server on s{i}"), || http_get(&c, server(&c.tb, i), "/stats", false).is_ok());
        }
        c
    }

    fn start_lb(&mut self) {
        let cfg = self.dir.join("lb.toml");
        let child = in_ns(&self.tb, "lb", &[BIN, "lb", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
        self.lb = Some(child);
        wait_for("balancer control socket", || self.ctl_ok(&["set-probe-interval", "--vip", &vip(&self.tb).to_string(), "--n", &self.probe_n().to_string()]));
        // The first SYN waits for the backends' MACs: make sure they are known.
        wait_for("backend MACs", || self.status()[0]["vips"][0]["backends"].as_array().unwrap().iter().all(|b| b["mac"] != "00:00:00:00:00:00"));
    }

    /// The key the balancer and every agent share.
    fn key(&self) -> PathBuf {
        self.dir.join("auth.key")
    }

    fn auth(&self) -> String {
        format!("[auth]\nkeys = [{{ id = 1, file = \"{}\" }}]\n", self.key().display())
    }

    fn probe_n(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("lb.toml")).unwrap().lines().find_map(|l| l.strip_prefix("probe_interval = ")).map_or(100, |n| n.parse().unwrap())
    }

    fn stop_lb(&mut self) {
        if let Some(mut c) = self.lb.take() {
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }

    fn ctl(&self, args: &[&str]) -> Output {
        let sock = self.dir.join("lb.sock");
        let mut cmd = vec![BIN, "lb", "ctl", "--socket", sock.to_str().unwrap()];
        cmd.extend_from_slice(args);
        in_ns(&self.tb, "lb", &cmd).output().unwrap()
    }

    fn ctl_ok(&self, args: &[&str]) -> bool {
        self.ctl(args).status.success()
    }

    fn status(&self) -> Value {
        serde_json::from_slice(&run_ok(&self.tb, "lb", &[BIN, "status", "--json"]).stdout).unwrap()
    }

    /// Per-backend counters keyed by "addr:port".
    fn backend(&self, i: usize) -> Value {
        let s = self.status();
        let want = server(&self.tb, i).to_string();
        s[0]["vips"][0]["backends"].as_array().unwrap().iter().find(|b| b["backend"] == want.as_str()).cloned().unwrap_or(Value::Null)
    }
}

fn lb_config(c: &Cluster, mode: &str, servers: &[usize]) -> String {
    let mut s = format!(
        "interface = \"eth0\"\naddress = \"{}\"\ncontrol_socket = \"{}\"\n\n{}\n[[vip]]\naddress = \"{}\"\nport = 80\nmode = \"{mode}\"\nprobe_interval = 4\npoll_interval_ms = 50\n",
        c.tb.addr("lb"),
        c.dir.join("lb.sock").display(),
        c.auth(),
        c.tb.vip()
    );
    for i in servers {
        s += &format!("\n[[vip.backend]]\naddress = \"{}\"\nport = 8080\n", server(&c.tb, *i).ip());
    }
    s
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}");
}

/// One HTTP/1.1 GET with curl, from the client (or from the balancer's
/// namespace, which reaches servers directly); returns (status, body length).
fn http_get(c: &Cluster, to: SocketAddrV4, path: &str, from_client: bool) -> Result<(u16, usize), String> {
    let node = if from_client { "c1" } else { "lb" };
    let url = format!("http://{to}{path}");
    let out = in_ns(&c.tb, node, &["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download}", "--max-time", "5", &url])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut it = text.split_whitespace();
    let code: u16 = it.next().and_then(|s| s.parse().ok()).ok_or(format!("curl {url}: {text:?}"))?;
    let size: usize = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    if code == 0 {
        return Err(format!("curl {url}: no response"));
    }
    Ok((code, size))
}

fn get_vip(c: &Cluster) -> (u16, usize) {
    http_get(c, vip(&c.tb), "/", true).expect("GET via the VIP")
}

fn sum(c: &Cluster, field: &str) -> u64 {
    (1..=SERVERS).map(|i| c.backend(i)["stats"][field].as_u64().unwrap_or(0)).sum()
}

#[test]
fn passthrough_carries_responses_through_the_balancer() {
    let c = Cluster::up("pt", "passthrough", &[]);
    for _ in 0..6 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    assert_eq!(sum(&c, "new_conns"), 6);
    // Every response byte came back through the balancer.
    assert!(sum(&c, "return_bytes") >= 6 * BODY as u64, "return bytes {}", sum(&c, "return_bytes"));
    // Round-robin: every server got two.
    for i in 1..=SERVERS {
        assert_eq!(c.backend(i)["stats"]["new_conns"], 2, "server {i}");
    }
    assert_eq!(c.status()[0]["control"]["polls_sent"], 0);
}

#[test]
fn dsr_round_robin_sends_responses_around_the_balancer() {
    let c = Cluster::up("rr", "dsr-rr", &[]);
    for _ in 0..6 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    assert_eq!(sum(&c, "new_conns"), 6);
    // DSR: response bytes do not cross the balancer.
    assert!(sum(&c, "return_bytes") < BODY as u64, "return bytes {}", sum(&c, "return_bytes"));
    assert_eq!(sum(&c, "probes_sent"), 0);
    for i in 1..=SERVERS {
        assert_eq!(c.backend(i)["stats"]["new_conns"], 2, "server {i}");
    }
}

#[test]
fn dsr_polling_polls_and_dsr_dynamic_does_not() {
    let c = Cluster::up("po", "dsr-polling", &[]);
    for _ in 0..3 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    wait_for("poll replies", || c.status()[0]["control"]["poll_replies"].as_u64().unwrap() >= 3);
    let polls = c.status()[0]["control"]["polls_sent"].as_u64().unwrap();
    assert!(polls >= 3);
    assert!(sum(&c, "return_bytes") < BODY as u64);
    // Switching to in-band feedback stops the polling traffic.
    assert!(c.ctl_ok(&["set-mode", "--vip", &vip(&c.tb).to_string(), "--mode", "dsr-dynamic"]));
    std::thread::sleep(Duration::from_millis(300));
    let before = c.status()[0]["control"]["polls_sent"].as_u64().unwrap();
    for _ in 0..6 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(c.status()[0]["control"]["polls_sent"].as_u64().unwrap(), before, "dsr-dynamic must not poll");
    assert!(sum(&c, "scores_received") > 0, "in-band scores arrive with responses");
}

#[test]
fn dsr_dynamic_follows_real_load() {
    let c = Cluster::up("dy", "dsr-dynamic", &[]);
    // Load s1 with 6 open connections made directly (not through the
    // balancer): its agent counts them, the balancer learns it in-band.
    let s1 = server(&c.tb, 1);
    let holder = format!(
        "import socket, time\nconns = [socket.create_connection(('{}', {})) for _ in range(6)]\ntime.sleep(60)",
        s1.ip(),
        s1.port()
    );
    let mut hog = in_ns(&c.tb, "lb", &["python3", "-c", &holder]).spawn().unwrap();
    wait_for("6 connections on s1", || {
        let out = run_ok(&c.tb, "s1", &[BIN, "agent", "status", "--interface", "eth0", "--json"]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["ports"]["8080"]["active_connections"].as_i64() == Some(6)
    });
    // Until its first score s1 ranks like the others. That score may take
    // a few connections: a probe that lands on a connection's last packet
    // has no response to ride on. So traffic flows until the balancer
    // holds it, and only the connections after that are counted.
    wait_for("s1's score at the balancer", || {
        assert_eq!(get_vip(&c), (200, BODY));
        c.backend(1)["score"].as_u64().is_some_and(|s| s >= 6)
    });
    let s1_before = c.backend(1)["stats"]["new_conns"].as_u64().unwrap();
    for _ in 0..30 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    let (s1_score, s1_conns) = (c.backend(1)["score"].as_u64(), c.backend(1)["stats"]["new_conns"].as_u64().unwrap() - s1_before);
    let others: Vec<Option<u64>> = (2..=SERVERS).map(|i| c.backend(i)["score"].as_u64()).collect();
    let _ = hog.kill();
    let _ = hog.wait();
    let s1_score = s1_score.expect("s1 reported a score");
    assert!(s1_score >= 6, "s1 has 6 open connections, reported {s1_score}");
    for o in &others {
        assert!(o.unwrap_or(0) < s1_score, "idle servers report less than s1: {others:?} vs {s1_score}");
    }
    // A fair share would be 10. An idle server's estimate (its score +
    // connections since its last report) passes s1's only while it goes
    // several connections without a report (probe counters are per CPU), so
    // s1 gets a stray connection now and then, far below a fair share.
    assert!(s1_conns <= 5, "s1 got {s1_conns} of 30 new connections while its score said busy");
    // When the load goes away, the score follows.
    wait_for("s1's score back down", || {
        let _ = get_vip(&c);
        c.backend(1)["score"].as_u64().is_some_and(|s| s < 6)
    });
}

/// A keep-alive HTTP connection from the client, kept open across changes.
/// A small Python client reads one line per request from stdin and prints
/// the status, body length and its local port: the port proves that every
/// request went over the same TCP connection (http.client would silently
/// reconnect otherwise).
struct KeepAlive {
    child: Child,
    port: Option<String>,
}

const KEEPALIVE_CLIENT: &str = r#"
import http.client, sys
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=5)
for _ in sys.stdin:
    try:
        conn.request("GET", "/", headers={"Connection": "keep-alive"})
        r = conn.getresponse()
        body = r.read()
        print(r.status, len(body), conn.sock.getsockname()[1], flush=True)
    except Exception as e:
        print("error", type(e).__name__, 0, flush=True)
"#;

impl KeepAlive {
    fn open(c: &Cluster) -> KeepAlive {
        let v = vip(&c.tb);
        let child = in_ns(&c.tb, "c1", &["timeout", "120", "python3", "-c", KEEPALIVE_CLIENT, &v.ip().to_string(), &v.port().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        KeepAlive { child, port: None }
    }

    /// One request; true if a full response came back on the same connection.
    fn request(&mut self) -> bool {
        if self.child.stdin.as_mut().unwrap().write_all(b"go\n").is_err() {
            return false;
        }
        let out = self.child.stdout.as_mut().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(out);
        let mut line = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(8);
        while !line.ends_with(b"\n") && Instant::now() < deadline {
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: pfd is a valid pollfd for the child's stdout.
            if unsafe { libc::poll(&mut pfd, 1, 500) } == 1 {
                let mut b = [0u8; 1];
                if out.read(&mut b).unwrap_or(0) == 0 {
                    return false;
                }
                line.push(b[0]);
            }
        }
        let text = String::from_utf8_lossy(&line).to_string();
        let f: Vec<&str> = text.split_whitespace().collect();
        if f.len() != 3 || f[0] != "200" || f[1] != BODY.to_string() {
            eprintln!("keep-alive request failed: {text:?}");
            return false;
        }
        let same = self.port.get_or_insert_with(|| f[2].to_string()) == f[2];
        if !same {
            eprintln!("keep-alive client reconnected: port {} -> {}", self.port.as_ref().unwrap(), f[2]);
        }
        same
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn changes_and_restart_keep_established_connections() {
    let mut c = Cluster::up("ch", "dsr-dynamic", &[&["--keep-alive"], &["--keep-alive"], &["--keep-alive"]]);
    let mut conn = KeepAlive::open(&c);
    assert!(conn.request(), "first request");
    let v = vip(&c.tb).to_string();
    assert!(c.ctl_ok(&["set-mode", "--vip", &v, "--mode", "passthrough"]));
    assert!(conn.request(), "after a mode switch");
    assert!(c.ctl_ok(&["set-probe-interval", "--vip", &v, "--n", "1"]));
    assert!(conn.request(), "after a probe interval change");
    // Restart the daemon: the data path and its flows stay.
    c.stop_lb();
    assert!(conn.request(), "while no daemon runs");
    c.start_lb();
    assert!(conn.request(), "after a daemon restart");
    // Which server holds the connection? Remove all the others, then it.
    let flows_before = c.status()[0]["flows"].as_u64().unwrap();
    assert!(flows_before >= 1);
    for i in 1..=SERVERS {
        assert!(c.ctl_ok(&["drain-backend", "--vip", &v, "--backend", &server(&c.tb, i).to_string()]));
    }
    assert!(conn.request(), "after draining every backend");
    // Drained: new connections have nowhere to go (counted as no_backend).
    assert!(http_get(&c, vip(&c.tb), "/", true).is_err());
    assert!(c.status()[0]["drops"]["no_backend"].as_u64().unwrap() >= 1);
    // An explicit detach removes the program and every pin.
    c.stop_lb();
    run_ok(&c.tb, "lb", &[BIN, "lb", "detach", "--interface", "eth0"]);
    let link = run_ok(&c.tb, "lb", &["ip", "link", "show", "dev", "eth0"]);
    assert!(!String::from_utf8_lossy(&link.stdout).contains("xdp"), "XDP still attached");
    let pins = std::path::PathBuf::from(format!("/sys/fs/bpf/inband/netns/{}/lb", c.tb.netns("lb")));
    assert!(!pins.exists(), "{} left behind", pins.display());
    let out = in_ns(&c.tb, "lb", &[BIN, "status"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no balancer on this host"));
}

#[test]
fn removed_backend_gets_no_new_connections() {
    let c = Cluster::up("rm", "dsr-rr", &[]);
    let v = vip(&c.tb).to_string();
    let s2 = server(&c.tb, 2).to_string();
    assert!(c.ctl_ok(&["remove-backend", "--vip", &v, "--backend", &s2]));
    for _ in 0..6 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    assert!(c.backend(2).is_null(), "s2 is no longer listed");
    assert_eq!(c.backend(1)["stats"]["new_conns"], 3);
    assert_eq!(c.backend(3)["stats"]["new_conns"], 3);
    // And back again: it takes new connections.
    assert!(c.ctl_ok(&["add-backend", "--vip", &v, "--backend", &s2]));
    for _ in 0..3 {
        assert_eq!(get_vip(&c), (200, BODY));
    }
    assert!(c.backend(2)["stats"]["new_conns"].as_u64().unwrap() >= 1);
    // Bad run-time input is refused with a reason, nothing changes.
    let out = c.ctl(&["add-backend", "--vip", "10.1.1.1:80", "--backend", &s2]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no VIP 10.1.1.1:80"));
}

#[test]
fn bad_config_is_refused_before_attaching() {
    let c = Cluster::up("bc", "dsr-rr", &[]);
    let bad = c.dir.join("bad.toml");
    // VIP that is not local to the balancer.
    std::fs::write(&bad, lb_config(&c, "dsr-rr", &[1]).replace(&c.tb.vip().to_string(), "10.77.9.9")).unwrap();
    let out = in_ns(&c.tb, "lb", &[BIN, "lb", "--config", bad.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a local address"), "{}", String::from_utf8_lossy(&out.stderr));
    // The running balancer is untouched.
    assert_eq!(get_vip(&c), (200, BODY));
}

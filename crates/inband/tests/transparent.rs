//! The transparent handoff (docs/tcpe.md) on the namespace testbed, with
//! stock clients (curl): `inband lb` (dsr-rr, `[moves]`) sends every new
//! connection of the VIP to s1, where `inband proxy` reads the request
//! and moves the connection to s2 at L4: frozen on s1, rebuilt by s2's
//! `inband tcpe serve`, switched by the balancer, answered by s2 straight
//! to the client. s2 is a backend of the VIP with weight 0: it takes moved
//! connections only. Then the moves are broken on purpose (the balancer
//! unreachable, the takeover server stopped) and every request must still
//! be answered whole, by the proxy.

mod cluster;

use std::path::PathBuf;
use std::process::{Child, Stdio};

use cluster::{in_ns, run_ok, server, vip, vip6, wait_for, Cluster, Spec, BIN};

const PROXY_METRICS: u16 = 8001;
const CONTROL_PORT: u16 = 7070;
const JOIN_PORT: u16 = 7071;
const MOVES_PORT: u16 = 7156;
const BODY: usize = 1 << 20;
/// The balancer's IPv6 address on the testbed (TestbedSpec: fd00:<subnet>::<host>).
const LB6: &str = "fd00:77::2";

/// What `inband serve --body-bytes n` answers (workload/http.rs).
fn body(n: usize) -> Vec<u8> {
    (0..n).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[(i * 7 + i / 36) % 36]).collect()
}

/// Processes (and a cgroup) of the test, gone when it ends however it ends.
struct Procs {
    children: Vec<Child>,
    cgroup: PathBuf,
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

/// The cgroup2 mount (/proc/self/mountinfo).
fn cgroup2_mount() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mounts
        .lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split_whitespace().next() == Some("cgroup2")).then(|| PathBuf::from(pre.split_whitespace().nth(4).unwrap()))
        })
        .expect("a cgroup2 mount")
}

fn metrics(c: &Cluster) -> String {
    let url = format!("http://{}:{PROXY_METRICS}/metrics", c.tb.addr("s1"));
    let out = in_ns(&c.tb, "s1", &["curl", "-s", "--max-time", "2", &url]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The proxy's handoff counter `result`.
fn handoffs(c: &Cluster, result: &str) -> u64 {
    let want = format!("inband_proxy_tcpe_handoffs_total{{result=\"{result}\"}} ");
    metrics(c).lines().find_map(|l| l.strip_prefix(&want)).map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

/// Requests s2's application served (its own count).
fn served(c: &Cluster, i: usize) -> u64 {
    let url = format!("http://{}/stats", server(&c.tb, i));
    let out = run_ok(&c.tb, "lb", &["curl", "-s", "--max-time", "2", &url]);
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["served"].as_u64().unwrap()
}

/// GETs `paths` through the VIP on one connection from the client; each
/// response's body, in order.
fn fetch(c: &Cluster, paths: &[&str]) -> Vec<Vec<u8>> {
    fetch_from(c, vip(&c.tb).into(), paths)
}

fn fetch_from(c: &Cluster, vip: std::net::SocketAddr, paths: &[&str]) -> Vec<Vec<u8>> {
    let mut argv = vec!["curl".to_string(), "-g".into(), "-s".into(), "--max-time".into(), "10".into(), "--fail".into()];
    let files: Vec<PathBuf> = (0..paths.len()).map(|i| c.dir.join(format!("got-{i}"))).collect();
    for (p, f) in paths.iter().zip(&files) {
        let _ = std::fs::remove_file(f);
        argv.extend([format!("http://{vip}{p}"), "-o".into(), f.display().to_string()]);
    }
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let out = in_ns(&c.tb, "c1", &argv).output().unwrap();
    assert!(out.status.success(), "curl {paths:?}: {}", String::from_utf8_lossy(&out.stderr));
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

fn lb_moves(c: &Cluster) -> serde_json::Value {
    c.status()[0]["control"]["moves"].clone()
}

#[test]
fn plain_clients_connections_move_to_the_server_at_l4_and_every_failure_falls_back_to_proxying() {
    let lb = "10.77.0.2";
    let mut c = Cluster::with(
        Spec::new("tr", "dsr-rr")
            .servers(2)
            // Both families: the proxy listens dual-stack, so its IPv4
            // connections show IPv4-mapped addresses.
            .ipv6()
            // The proxy must see the kernel's tuple (the balancer's), not
            // the client the agent would show it.
            .agent("client_address = false")
            .serve(2, &["--body-bytes", &BODY.to_string(), "--keep-alive", "--service-ms", "1"])
            .backend(2, "weight = 0")
            .lb(&format!("[moves]\nlisten = [\"{lb}:{MOVES_PORT}\", \"[{LB6}]:{MOVES_PORT}\"]")),
    );
    assert_eq!(c.tb.addr("lb").to_string(), lb);
    let (s1, s2) = (server(&c.tb, 1), server(&c.tb, 2));
    let netns: Vec<String> = (1..=2).map(|i| c.tb.netns(&format!("s{i}"))).collect();
    let pins = |i: usize| inband_core::bpfmap::pin_root_of(&netns[i - 1]).join("agent/eth0");

    // s2: the takeover server, relaying moved connections to its origin.
    let tcpe_key = c.dir.join("tcpe.key");
    inband_core::auth::keygen(&tcpe_key).unwrap();
    let s2ip = s2.ip().to_string();
    let takeover = |c: &Cluster, max_sessions: &str| {
        in_ns(
            &c.tb,
            "s2",
            &[
                BIN,
                "tcpe",
                "serve",
                "--control",
                &format!("{s2ip}:{CONTROL_PORT}"),
                "--join",
                &format!("{s2ip}:{JOIN_PORT}"),
                "--origin",
                &s2.to_string(),
                "--key",
                tcpe_key.to_str().unwrap(),
                "--agent-pins",
                pins(2).to_str().unwrap(),
                "--max-sessions",
                max_sessions,
            ],
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
    };
    let cgroup = cgroup2_mount().join(format!("inband-test-transparent-{}", std::process::id()));
    std::fs::create_dir(&cgroup).unwrap();
    let mut procs = Procs { children: vec![takeover(&c, "64")], cgroup: cgroup.clone() };

    // s1: the proxy in place of its application, on the port the balancer
    // sends to, in a cgroup of its own for the TCPE program.
    c.kill_server(1);
    let cfg = c.dir.join("proxy.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"[::]:{}\"\nmetrics_listen = \"{}:{PROXY_METRICS}\"\nbackends = [\"{s2}\"]\n\n[auth]\nkeys = [{{ id = 1, file = \"{}\" }}]\n\n[tcpe]\ncgroup = \"{}\"\nkey = \"{}\"\n[[tcpe.server]]\nbackend = \"{s2}\"\nbackend6 = \"[{}]:{}\"\ncontrol = \"{s2ip}:{CONTROL_PORT}\"\njoin = \"{s2ip}:{JOIN_PORT}\"\n[tcpe.transparent]\nagent_pins = \"{}\"\nbalancer_port = {MOVES_PORT}\n",
            s1.port(),
            s1.ip(),
            c.key().display(),
            cgroup.display(),
            tcpe_key.display(),
            c.tb.addr6("s2"),
            s2.port(),
            pins(1).display(),
        ),
    )
    .unwrap();
    let enter = format!("echo $$ > {}/cgroup.procs && exec {BIN} proxy --config {}", cgroup.display(), cfg.display());
    let log = c.dir.join("proxy.log");
    let proxy = in_ns(&c.tb, "s1", &["sh", "-c", &enter]).env("INBAND_LOG", "info").stderr(std::fs::File::create(&log).unwrap()).spawn();
    procs.children.push(proxy.unwrap());
    wait_for("the proxy", || metrics(&c).contains("inband_proxy_tcpe_handoffs_total"));
    wait_for("the takeover server", || in_ns(&c.tb, "s1", &["bash", "-c", &format!("exec 3<>/dev/tcp/{s2ip}/{CONTROL_PORT}")]).status().unwrap().success());

    // Moved: five connections of one 1 MiB request each (they leave s2 as
    // GSO bursts), then one of two keep-alive requests.
    let want = body(BODY);
    let before = served(&c, 2);
    for i in 0..5 {
        assert!(fetch(&c, &[&format!("/a{i}")])[0] == want, "moved response {i}: the bytes differ");
    }
    let two = fetch(&c, &["/b0", "/b1"]);
    assert!(two.iter().all(|b| *b == want), "both keep-alive responses whole");
    assert_eq!(handoffs(&c, "moved"), 6, "{}", metrics(&c));
    assert_eq!(lb_moves(&c)["moved"], 6, "{}", lb_moves(&c));
    assert_eq!(served(&c, 2) - before, 7, "s2 served every request");
    // No response byte crossed the proxy: it asked its backend nothing.
    assert!(!metrics(&c).lines().any(|l| l.starts_with("inband_proxy_origin_requests_total") && !l.ends_with(" 0")), "{}", metrics(&c));
    // A connection that closes before its first byte (as a TCP health
    // check does) had no request: nothing kept, nothing moved.
    let vip = vip(&c.tb);
    run_ok(&c.tb, "c1", &["bash", "-c", &format!("exec 3<>/dev/tcp/{}/{}; exec 3>&-", vip.ip(), vip.port())]);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let kept: Vec<String> = metrics(&c).lines().filter(|l| l.starts_with("inband_proxy_tcpe_kept_total") && !l.ends_with(" 0")).map(String::from).collect();
    assert!(kept.is_empty(), "{kept:?}");
    assert_eq!(handoffs(&c, "moved"), 6);
    // The proxy sees the balancer's tuple, yet logs the client: the agent's
    // entry names it.
    let logged = std::fs::read_to_string(&log).unwrap();
    let c1 = c.tb.addr("c1").to_string();
    let moved_lines: Vec<&str> = logged.lines().filter(|l| l.contains("handed off")).collect();
    assert_eq!(moved_lines.len(), 6, "{logged}");
    assert!(moved_lines.iter().all(|l| l.contains(&format!("client={c1}:"))), "{logged}");
    // IPv6: the connection moves to the server's IPv6 address (backend6),
    // the request to the balancer goes to its IPv6 listener.
    assert!(fetch_from(&c, vip6(&c.tb), &["/six"])[0] == want, "the IPv6 response");
    assert_eq!((handoffs(&c, "moved"), handoffs(&c, "move_fallback_family")), (7, 0), "{}", metrics(&c));

    // s2's agent answered the clients straight: 8 MiB at least went out DSR.
    let s2_agent = c.agent_status(2)["counters"].clone();
    assert!(s2_agent["dsr_rewrites"].as_u64().unwrap() >= 8 * (BODY as u64) / 65536, "{s2_agent}");

    // The balancer does not answer moves (its port unreachable: refused at
    // once on s1's way out, then silently dropped on the balancer's way
    // in): each move is called off after the server was ready, the
    // connection thawed, and the proxy serves it.
    for (node, hook) in [("s1", "output"), ("lb", "input")] {
        let nft = |rule: &str| run_ok(&c.tb, node, &["nft", rule]);
        nft(&format!("add table inet tr; add chain inet tr h {{ type filter hook {hook} priority 0; }}; add rule inet tr h udp dport {MOVES_PORT} drop"));
        assert!(fetch(&c, &[&format!("/c{node}")])[0] == want, "proxied response ({node}): the bytes differ");
        nft("delete table inet tr");
    }
    assert_eq!(handoffs(&c, "move_fallback_balancer"), 2, "{}", metrics(&c));

    // The takeover server stopped: the channel fails, the proxy serves.
    let t = &mut procs.children[0];
    t.kill().unwrap();
    t.wait().unwrap();
    for i in 0..3 {
        assert!(fetch(&c, &[&format!("/d{i}")])[0] == want, "proxied response {i}: the bytes differ");
    }
    assert_eq!(handoffs(&c, "move_fallback_channel"), 3, "{}", metrics(&c));

    // A takeover server with no session to spare refuses: the proxy serves.
    let up = |c: &Cluster| in_ns(&c.tb, "s1", &["bash", "-c", &format!("exec 3<>/dev/tcp/{s2ip}/{CONTROL_PORT}")]).status().unwrap().success();
    procs.children[0] = takeover(&c, "0");
    wait_for("the takeover server again", || up(&c));
    assert!(fetch(&c, &["/full"])[0] == want);
    assert_eq!(handoffs(&c, "move_fallback_refused"), 1, "{}", metrics(&c));
    let t = &mut procs.children[0];
    t.kill().unwrap();
    t.wait().unwrap();

    // Back: moves work again on a new takeover server.
    procs.children[0] = takeover(&c, "64");
    wait_for("the takeover server again", || up(&c));
    assert!(fetch(&c, &["/e"])[0] == want);
    assert_eq!(handoffs(&c, "moved"), 8, "{}", metrics(&c));
    for lost in ["move_lost", "move_fallback_not_dsr", "move_fallback_unfreezable", "move_fallback_bad_mac"] {
        assert_eq!(handoffs(&c, lost), 0, "{lost}: {}", metrics(&c));
    }
    assert_eq!(lb_moves(&c)["moved"], 8, "{}", lb_moves(&c));
}

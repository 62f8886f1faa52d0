//! Health checks of `inband lb` on a namespace testbed (tests/cluster):
//! backends broken on purpose — the application killed, the host silenced
//! — get no new connections in any mode or policy, come back when they
//! recover, and what down means for flows and for an all-down VIP is what
//! `[vip.health]` says.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;

mod cluster;
use cluster::*;

/// Backend i's entry in the status of VIP `v` (0 = IPv4).
fn backend(c: &Cluster, v: usize, i: usize) -> Value {
    let want = if v == 0 { server(&c.tb, i).to_string() } else { server6(&c.tb, i).to_string() };
    let s = c.status();
    s[0]["vips"][v]["backends"].as_array().unwrap().iter().find(|b| b["backend"] == want.as_str()).cloned().unwrap()
}

/// Waits (at most `within`) until backend i of VIP `v` shows `state`;
/// returns how long it took.
fn wait_health(c: &Cluster, v: usize, i: usize, state: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let b = backend(c, v, i);
        if b["health"]["state"] == state {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "backend s{i} not {state} within {within:?}: {}", b["health"]);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `n` GETs through the VIP of family `v`; every one must succeed.
fn all_served(c: &Cluster, v: usize, n: usize, what: &str) {
    for k in 0..n {
        let r = if v == 0 { http_get(c, vip(&c.tb), "/", true) } else { http_get(c, vip6(&c.tb), "/", true) };
        assert_eq!(r, Ok((200, BODY)), "{what}: request {k}");
    }
}

fn new_conns(c: &Cluster, v: usize, i: usize) -> u64 {
    backend(c, v, i)["stats"]["new_conns"].as_u64().unwrap()
}

/// A killed application and a silenced host are taken out in every mode
/// and policy, IPv4 and IPv6: after detection every request succeeds and
/// the dead backend's connection count stands still; once it recovers it
/// is back within rise checks and gets connections again.
#[test]
fn a_dead_backend_gets_no_new_connections_in_any_mode_or_policy() {
    let mut c = Cluster::with(Spec::new("hd", "dsr-rr").servers(2).ipv6().lb("metrics = \"127.0.0.1:9100\""));
    let (v4, v6) = (vip(&c.tb).to_string(), vip6(&c.tb).to_string());
    for (mode, policy) in [
        ("dsr-rr", "round-robin"),
        ("dsr-rr", "maglev"),
        ("passthrough", "round-robin"),
        ("dsr-polling", "least-score"),
        ("dsr-dynamic", "least-score"),
        ("dsr-dynamic", "power-of-two"),
    ] {
        for vip in [&v4, &v6] {
            assert!(c.ctl_ok(&["set-mode", "--vip", vip, "--mode", mode]), "{mode}");
            assert!(c.ctl_ok(&["set-policy", "--vip", vip, "--policy", policy]), "{policy}");
        }
        let what = format!("{mode}/{policy}");
        c.kill_server(2);
        let took = wait_health(&c, 0, 2, "down", Duration::from_secs(2));
        assert!(took < Duration::from_millis(1500), "{what}: a refusing port is found within interval + fast interval: {took:?}");
        assert_eq!(backend(&c, 0, 2)["health"]["reason"], "refused", "{what}");
        wait_health(&c, 1, 2, "down", Duration::from_secs(2));
        let before = (new_conns(&c, 0, 2), new_conns(&c, 1, 2));
        all_served(&c, 0, 12, &what);
        all_served(&c, 1, 6, &what);
        assert_eq!((new_conns(&c, 0, 2), new_conns(&c, 1, 2)), before, "{what}: the dead backend got connections");
        c.restart_server(2);
        let took = wait_health(&c, 0, 2, "up", Duration::from_secs(3));
        assert!(took < Duration::from_secs(2), "{what}: back within rise checks: {took:?}");
        wait_health(&c, 1, 2, "up", Duration::from_secs(3));
        let before = new_conns(&c, 0, 2);
        all_served(&c, 0, 12, &what);
        assert!(new_conns(&c, 0, 2) > before, "{what}: the recovered backend gets connections again");
    }
    // A silent host: its checks time out.
    c.silence(2, true);
    let took = wait_health(&c, 0, 2, "down", Duration::from_secs(4));
    assert!(took < Duration::from_secs(3), "a silent host is found within interval + 2 timeouts: {took:?}");
    assert_eq!(backend(&c, 0, 2)["health"]["reason"], "timeout");
    let before = new_conns(&c, 0, 2);
    all_served(&c, 0, 8, "silent host");
    assert_eq!(new_conns(&c, 0, 2), before, "the silent host got connections");
    c.silence(2, false);
    wait_health(&c, 0, 2, "up", Duration::from_secs(4));
    let h = &backend(&c, 0, 2)["health"];
    assert!(h["transitions"].as_u64().unwrap() >= 14, "every down and up counted: {h}");
    let metrics = metrics(&c);
    assert!(metrics.contains(&format!("inband_backend_up{{vip=\"{v4}\",backend=\"{}\",reason=\"passing\"}} 1", server(&c.tb, 2))), "{metrics}");
}

/// A down backend still sees the SYNs that clients of its earlier
/// connections send again; they must not count against it once it is
/// back: a silent host that recovers is up for good, not ejected again
/// (passively) right after its checks brought it back.
#[test]
fn a_recovered_host_is_not_ejected_again_for_syns_sent_while_it_was_down() {
    let c = Cluster::with(Spec::new("hq", "dsr-rr").servers(2));
    wait_health(&c, 0, 2, "up", Duration::from_secs(3));
    c.silence(2, true);
    // Round-robin: half of these go to the silent host and send their SYN
    // again at 1 s and 3 s.
    let url = format!("http://{}/", vip(&c.tb));
    let clients: Vec<_> = (0..8)
        .map(|_| in_ns(&c.tb, "c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "8", &url]).spawn().unwrap())
        .collect();
    wait_health(&c, 0, 2, "down", Duration::from_secs(4));
    let retried = backend(&c, 0, 2)["stats"]["handshakes_retried"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(3500));
    let down = backend(&c, 0, 2);
    let retried_while_down = down["stats"]["handshakes_retried"].as_u64().unwrap() - retried;
    assert!(retried_while_down >= 3, "SYNs sent again while it was down (passive_fall of them): {retried_while_down}");
    for mut cl in clients {
        let _ = cl.kill();
        let _ = cl.wait();
    }
    c.silence(2, false);
    wait_health(&c, 0, 2, "up", Duration::from_secs(4));
    std::thread::sleep(Duration::from_millis(1000));
    let h = backend(&c, 0, 2)["health"].clone();
    assert_eq!(h["state"], "up", "{h}");
    let (t0, t1) = (down["health"]["transitions"].as_u64().unwrap(), h["transitions"].as_u64().unwrap());
    assert_eq!(t1, t0 + 1, "back up once, never down again: {h}");
    assert_eq!(h["passive_ejections"], down["health"]["passive_ejections"], "{h}");
    all_served(&c, 0, 4, "after the recovery");
}

/// Clients through the VIP, each loop a shell that ends when killed.
fn client_loops(c: &Cluster, n: usize) -> Vec<std::process::Child> {
    let script = format!("for i in $(seq 2000); do curl -s -o /dev/null --max-time 3 http://{}/; done", vip(&c.tb));
    (0..n).map(|_| in_ns(&c.tb, "c1", &["sh", "-c", &script]).spawn().unwrap()).collect()
}

fn stop(loops: Vec<std::process::Child>) {
    for mut l in loops {
        let _ = l.kill();
        let _ = l.wait();
    }
}

/// Switches the VIP's checks (`check = "tcp"` or `"http"`) by a reload.
fn set_check(c: &Cluster, kind: &str) {
    let cfg = c.dir.join("lb.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text.replace("check = \"tcp\"", &format!("check = \"{kind}\"")).replace("check = \"http\"", &format!("check = \"{kind}\""));
    std::fs::write(&cfg, text).unwrap();
    assert!(c.ctl_ok(&["reload"]), "reload: {}", String::from_utf8_lossy(&c.ctl(&["reload"]).stderr));
}

/// A backend too busy to answer its checks in time (its HTTP answer takes
/// 400 ms, the check waits 200 ms: as a full listen queue drops the
/// check's SYN) stays up while clients keep completing handshakes with it,
/// and keeps serving them; the same timeouts with no client take it down,
/// and so do timeouts that last longer than `busy_max_ms`, since the
/// clients' handshakes are only their word.
/// Client loops that keep s2 busy. A check is taken for busy only if a
/// client completes a handshake with s2 during its 200 ms wait. Round-robin
/// gives s2 every other connection, and a loop's connection lasts about
/// 210 ms on average (400 ms on s2, 20 ms on s1) plus curl's start, so n
/// loops start about 2.2n a second there and a wait sees none with
/// probability about e^(-0.45n): 3% with 8, which a run of ten checks met
/// now and then (the busy row restarted: in_a_row 1), and 2e-5 with 24,
/// nearer a server whose listen queue overflows.
const BUSY_LOOPS: usize = 24;

#[test]
fn a_busy_backend_stays_up_an_idle_or_endlessly_busy_one_does_not() {
    let c = Cluster::with(
        Spec::new("hb", "dsr-rr")
            .servers(2)
            .lb("metrics = \"127.0.0.1:9100\"")
            .serve(2, &["--service-ms", "400", "--workers", "64"])
            .vip("policy = \"round-robin\"\n[vip.health]\ncheck = \"tcp\"\npath = \"/\"\ntimeout_ms = 200\ninterval_ms = 300\nfast_interval_ms = 150\nbusy_max_ms = 4000"),
    );
    wait_for("both checked", || (1..=2).all(|i| backend(&c, 0, i)["health"]["reason"] == "passing"));
    let loops = client_loops(&c, BUSY_LOOPS);
    std::thread::sleep(Duration::from_millis(500));
    set_check(&c, "http");
    wait_for("a check taken for busy", || backend(&c, 0, 2)["health"]["reason"] == "busy");
    let (t0, n0) = (backend(&c, 0, 2)["health"]["transitions"].as_u64().unwrap(), new_conns(&c, 0, 2));
    std::thread::sleep(Duration::from_millis(2000));
    let b = backend(&c, 0, 2);
    let h = &b["health"];
    assert_eq!((h["state"].as_str(), h["reason"].as_str()), (Some("up"), Some("busy")), "{b}");
    assert_eq!(h["transitions"].as_u64().unwrap(), t0, "never down while busy: {b}");
    assert!(h["in_a_row"].as_u64().unwrap() >= 4, "checks in a row taken for busy: {b}");
    assert!(new_conns(&c, 0, 2) > n0 + 4, "the busy backend keeps serving: {b}");
    let text = metrics(&c);
    assert!(text.contains(&format!("inband_backend_up{{vip=\"{}\",backend=\"{}\",reason=\"busy\"}} 1\n", vip(&c.tb), server(&c.tb, 2))), "{text}");
    // No client completes a handshake with it any more: its timeouts count.
    stop(loops);
    let took = wait_health(&c, 0, 2, "down", Duration::from_secs(3));
    assert!(took < Duration::from_millis(2500), "down within a few fast checks once clients stop, long before busy_max_ms: {took:?}");
    assert_eq!(backend(&c, 0, 2)["health"]["reason"], "timeout");
    // Back by its TCP checks, then busy again for longer than busy_max_ms.
    set_check(&c, "tcp");
    wait_health(&c, 0, 2, "up", Duration::from_secs(3));
    let loops = client_loops(&c, BUSY_LOOPS);
    std::thread::sleep(Duration::from_millis(500));
    set_check(&c, "http");
    wait_for("busy again", || backend(&c, 0, 2)["health"]["reason"] == "busy");
    let t0 = Instant::now();
    let took = wait_health(&c, 0, 2, "down", Duration::from_secs(8));
    stop(loops);
    assert!(took > Duration::from_millis(3000), "kept up as busy for busy_max_ms (4 s): down after {:?}", t0.elapsed());
    assert_eq!(backend(&c, 0, 2)["health"]["reason"], "timeout");
    all_served(&c, 0, 4, "beside the backend taken down");
}

fn metrics(c: &Cluster) -> String {
    scrape(c, "/metrics")
}

fn scrape(c: &Cluster, path: &str) -> String {
    let out = run_ok(&c.tb, "lb", &["curl", "-s", &format!("http://127.0.0.1:9100{path}")]);
    String::from_utf8(out.stdout).unwrap()
}

/// HTTP checks: a status outside `expect` takes the backend down with that
/// status as the reason; the Host and path are the configured ones.
#[test]
fn http_checks_judge_by_status() {
    let c = Cluster::with(
        Spec::new("hh", "dsr-rr")
            .servers(2)
            .lb("metrics = \"127.0.0.1:9100\"")
            .vip("[vip.health]\ncheck = \"http\"\npath = \"/stats\"\nexpect = [200]"),
    );
    // The first checks may have met a server still starting (refused):
    // what counts is that passing checks come with the status they saw.
    wait_for("a passing check with its status", || {
        let h = backend(&c, 0, 1)["health"].clone();
        h["state"] == "up" && h["reason"] == "passing" && h["last_status"] == 200
    });
    // Only 204 passes now: both go down with the status they answered.
    let cfg = c.dir.join("lb.toml");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("expect = [200]", "expect = [204]");
    std::fs::write(&cfg, text).unwrap();
    assert!(c.ctl_ok(&["reload"]), "reload: {}", String::from_utf8_lossy(&c.ctl(&["reload"]).stderr));
    for i in 1..=2 {
        wait_health(&c, 0, i, "down", Duration::from_secs(3));
        let h = backend(&c, 0, i)["health"].clone();
        assert_eq!((h["reason"].as_str(), h["last_status"].as_u64()), (Some("bad_status"), Some(200)), "{h}");
        assert_eq!(backend(&c, 0, i)["health"]["failing_open"], true, "both down: the VIP fails open by default");
    }
    // Failing open: connections still go to them.
    assert_eq!(http_get(&c, vip(&c.tb), "/", true), Ok((200, BODY)));
    // The endpoint says the same: OpenMetrics with a HELP and TYPE for
    // every family, up (failing open) with the reason; /status is the JSON.
    let text = metrics(&c);
    inband_http::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(text.contains("# TYPE inband_backend_up gauge\n") && text.contains("# TYPE inband_backend_health_checks counter\n"), "{text}");
    for i in 1..=2 {
        let labels = format!("vip=\"{}\",backend=\"{}\"", vip(&c.tb), server(&c.tb, i));
        assert!(text.contains(&format!("inband_backend_up{{{labels},reason=\"bad_status\"}} 1\n")), "{text}");
        let failed = format!("inband_backend_health_checks_total{{{labels},result=\"failed\"}} ");
        let n: u64 = text.lines().find_map(|l| l.strip_prefix(failed.as_str())).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no {failed}in {text}"));
        assert!(n >= 1, "the failed checks are counted: {text}");
    }
    let status: Value = serde_json::from_str(&scrape(&c, "/status")).unwrap();
    assert_eq!(status["vips"][0]["backends"][0]["health"]["reason"], "bad_status", "{status}");
    assert_eq!(scrape(&c, "/other"), "/metrics or /status\n");
}

/// `all_down = "refuse"`: with every backend down a SYN is answered with a
/// RST at once (curl: connection refused in milliseconds, not a timeout).
#[test]
fn a_vip_with_every_backend_down_refuses_with_a_reset() {
    let mut c = Cluster::with(Spec::new("hr", "dsr-dynamic").servers(2).vip("[vip.health]\nall_down = \"refuse\""));
    c.kill_server(1);
    c.kill_server(2);
    wait_health(&c, 0, 1, "down", Duration::from_secs(2));
    wait_health(&c, 0, 2, "down", Duration::from_secs(2));
    let t0 = Instant::now();
    let out = in_ns(&c.tb, "c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "5", &format!("http://{}/", vip(&c.tb))]).output().unwrap();
    assert_eq!(out.status.code(), Some(7), "curl: couldn't connect (refused)");
    assert!(t0.elapsed() < Duration::from_millis(900), "refused at once, not after SYN retries: {:?}", t0.elapsed());
    assert!(c.event("reset_no_backend") >= 1);
    assert_eq!(c.drop_count("no_backend"), 0, "refused, not dropped");
    c.restart_server(1);
    wait_health(&c, 0, 1, "up", Duration::from_secs(3));
    all_served(&c, 0, 4, "one back");
}

/// `on_down = "reset"`: a keep-alive connection to a backend whose host
/// went silent gets a RST from the VIP at its next request, at once, and
/// the client reconnects to a backend that is up; with the default (keep)
/// that request would wait on the silent host.
#[test]
fn flows_of_a_down_backend_are_reset_when_configured() {
    let c = Cluster::with(Spec::new("hz", "dsr-rr").servers(2).every_server(&["--keep-alive"]).vip("[vip.health]\non_down = \"reset\""));
    // One keep-alive connection: a request, then (at our word) another.
    let script = format!(
        "import socket,sys,time\n\
         s=socket.create_connection(('{}',80)); s.settimeout(8)\n\
         def req():\n\
         \x20 s.sendall(b'GET / HTTP/1.1\\r\\nHost: v\\r\\n\\r\\n'); b=b''\n\
         \x20 while b'\\r\\n\\r\\n' not in b: b+=s.recv(65536) or sys.exit('closed')\n\
         \x20 h,_,body=b.partition(b'\\r\\n\\r\\n'); n=int([l.split(b':')[1] for l in h.split(b'\\r\\n') if l.lower().startswith(b'content-length')][0])\n\
         \x20 while len(body)<n: body+=s.recv(65536) or sys.exit('closed')\n\
         req(); print('first', flush=True); sys.stdin.readline(); t=time.time()\n\
         try:\n\
         \x20 req(); print('served', time.time()-t)\n\
         except ConnectionResetError: print('reset', time.time()-t)\n\
         except socket.timeout: print('timeout', time.time()-t)\n",
        vip(&c.tb).ip()
    );
    let mut client = in_ns(&c.tb, "c1", &["python3", "-c", &script]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = std::io::BufReader::new(client.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "first");
    // The server holding it goes silent.
    wait_for("the sweeper's flow count", || (1..=2).any(|i| c.backend(i)["flows"].as_u64() == Some(1)));
    let held = (1..=2).find(|i| c.backend(*i)["flows"].as_u64() == Some(1)).unwrap();
    c.silence(held, true);
    wait_health(&c, 0, held, "down", Duration::from_secs(4));
    std::io::Write::write_all(client.stdin.as_mut().unwrap(), b"go\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let _ = client.wait();
    let mut it = line.split_whitespace();
    assert_eq!(it.next(), Some("reset"), "{line}");
    let secs: f64 = it.next().unwrap().parse().unwrap();
    assert!(secs < 0.5, "reset at once: {secs} s");
    assert_eq!(c.event("reset_backend_down"), 1);
    assert_eq!(c.backend(held)["stats"]["flows_reset"], 1);
    // The client's next connection goes to the other server.
    all_served(&c, 0, 4, "after the reset");
    c.silence(held, false);
}

/// Passive detection: SYNs to a silent host sent again by clients take it
/// down before its active checks would (checks slowed down on purpose);
/// then its checks must pass `rise` times to bring it back.
#[test]
fn unanswered_handshakes_take_a_backend_down_passively() {
    let c = Cluster::with(
        Spec::new("hp", "dsr-rr")
            .servers(2)
            .vip("[vip.health]\ninterval_ms = 20000\nfast_interval_ms = 20000\ntimeout_ms = 15000\npassive_fall = 2"),
    );
    wait_health(&c, 0, 2, "up", Duration::from_secs(3));
    c.silence(2, true);
    // Round-robin: half of these go to the silent host and retry their SYN.
    let url = format!("http://{}/", vip(&c.tb));
    let clients: Vec<_> = (0..4)
        .map(|_| in_ns(&c.tb, "c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "8", &url]).spawn().unwrap())
        .collect();
    let took = wait_health(&c, 0, 2, "down", Duration::from_secs(6));
    assert!(took < Duration::from_secs(5), "{took:?}");
    let h = backend(&c, 0, 2)["health"].clone();
    assert_eq!(h["reason"], "passive_unanswered", "{h}");
    assert_eq!(h["passive_ejections"], 1, "{h}");
    assert!(backend(&c, 0, 2)["stats"]["handshakes_retried"].as_u64().unwrap() >= 2);
    for mut cl in clients {
        let _ = cl.kill();
        let _ = cl.wait();
    }
    c.silence(2, false);
}

/// A backend at an address nobody answers for (no neighbour: the check's
/// SYN finds no MAC) is down with a reason, gets nothing, and breaks
/// nothing: the daemon, the other backends and status go on.
#[test]
fn a_backend_nobody_answers_for_is_down_with_a_reason() {
    let c = Cluster::with(Spec::new("hu", "dsr-dynamic").servers(2));
    let o = c.tb.addr("s1").octets();
    let ghost = format!("{}.{}.{}.250:8080", o[0], o[1], o[2]);
    let out = c.ctl(&["add-backend", "--vip", &vip(&c.tb).to_string(), "--backend", &ghost]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t0 = Instant::now();
    let h = loop {
        let s = c.status();
        let b = s[0]["vips"][0]["backends"].as_array().unwrap().iter().find(|b| b["backend"] == ghost.as_str()).cloned().unwrap();
        if b["health"]["state"] == "down" {
            break b["health"].clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "not down: {b}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(["timeout", "unreachable"].contains(&h["reason"].as_str().unwrap()), "{h}");
    all_served(&c, 0, 10, "beside a backend nobody answers for");
    assert_eq!(c.drop_count("no_route"), 0, "no SYN went to it");
}

/// In DSR too, a backend whose application is gone is taken down by the
/// handshakes it refuses: its agent sends its RSTs back through the
/// balancer, which sees them answer SYNs (active checks slowed on purpose).
#[test]
fn refused_handshakes_take_a_backend_down_passively_in_dsr() {
    let mut c = Cluster::with(
        Spec::new("hf", "dsr-dynamic")
            .servers(2)
            .vip("[vip.health]\ninterval_ms = 20000\nfast_interval_ms = 20000\npassive_fall = 2"),
    );
    c.ctl_ok(&["set-policy", "--vip", &vip(&c.tb).to_string(), "--policy", "round-robin"]);
    wait_for("first checks", || backend(&c, 0, 2)["health"]["reason"] == "passing");
    c.kill_server(2);
    let t0 = Instant::now();
    // Round-robin: every second connection meets the closed port.
    for _ in 0..6 {
        let _ = http_get(&c, vip(&c.tb), "/", true);
    }
    let took = wait_health(&c, 0, 2, "down", Duration::from_secs(3));
    let h = backend(&c, 0, 2);
    assert_eq!(h["health"]["reason"], "passive_refused", "{h}");
    assert!(h["stats"]["handshakes_refused"].as_u64().unwrap() >= 2, "{h}");
    assert!(c.agent_counter("resets_via_balancer") >= 2);
    assert!(t0.elapsed() < Duration::from_secs(5), "down {took:?} after the requests, {:?} after the kill", t0.elapsed());
    all_served(&c, 0, 6, "after the passive verdict");
}

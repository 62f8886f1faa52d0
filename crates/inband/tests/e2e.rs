//! Integration tests on a network-namespace testbed with real HTTP traffic:
//! one client, the balancer, three real servers running `inband serve` and
//! `inband agent` (tests/cluster): the modes, run-time changes, restarts.

use std::io::{Read, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod cluster;
use cluster::*;

const SERVERS: usize = 3;

fn sum(c: &Cluster, field: &str) -> u64 {
    c.sum(field)
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
    // The sweeper counts live flows every second.
    wait_for("the connection counted", || c.status()[0]["flows"].as_u64() >= Some(1));
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
    std::fs::write(&bad, c.lb_config(&[1]).replace(&c.tb.vip().to_string(), "10.77.9.9")).unwrap();
    let out = in_ns(&c.tb, "lb", &[BIN, "lb", "--config", bad.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a local address"), "{}", String::from_utf8_lossy(&out.stderr));
    // The running balancer is untouched.
    assert_eq!(get_vip(&c), (200, BODY));
}

//! `inband proxy` with `policy = "least-score"` in front of real servers
//! and their real agents, on the namespace testbed: the proxy runs in the
//! balancer's namespace (an address every agent lists in `balancers`) and
//! polls each server's agent. A server whose agent reports load gets
//! fewer new requests, and all of them again once the load is cleared; a
//! server whose agent stops answering is ranked by the proxy's own
//! requests in flight and counted stale; polls signed with a key the
//! agents do not hold are refused by the agents and counted on both sides.

mod cluster;

use std::path::Path;
use std::process::Child;

use cluster::{in_ns, run_ok, server, wait_for, Cluster, Spec, BIN};

const PROXY_PORT: u16 = 8000;
const METRICS_PORT: u16 = 8001;

fn up(test: &str) -> Cluster {
    Cluster::with(Spec::new(test, "dsr-rr").agent("score = \"app\"").every_server(&["--service-ms", "1", "--keep-alive", "--body-bytes", "512"]))
}

/// Starts the proxy in the balancer's namespace with the cluster's
/// servers as a least-score pool, signing polls with `key`. A backend goes
/// stale after a second without an answer (50 polls of 20 ms), not the
/// default 100 ms: beside the other test binaries on two CPUs an agent or
/// the proxy can be off the CPU that long, and the tests assert that only
/// the agent they silence goes stale.
fn start_proxy(c: &Cluster, key: &Path) -> Child {
    let backends: Vec<String> = (1..=3).map(|i| format!("\"{}\"", server(&c.tb, i))).collect();
    let lb = c.tb.addr("lb");
    let cfg = c.dir.join(format!("proxy-{}.toml", key.file_stem().unwrap().to_string_lossy()));
    std::fs::write(
        &cfg,
        format!(
            "listen = \"{lb}:{PROXY_PORT}\"\nmetrics_listen = \"{lb}:{METRICS_PORT}\"\nbackends = [{}]\npolicy = \"least-score\"\n\n[scores]\ninterval_ms = 20\nstale_after = 50\n\n[auth]\nkeys = [{{ id = 1, file = \"{}\" }}]\n",
            backends.join(", "),
            key.display()
        ),
    )
    .unwrap();
    let p = in_ns(&c.tb, "lb", &[BIN, "proxy", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
    wait_for("the proxy", || metrics(c).contains("inband_proxy_score_polls"));
    p
}

/// Kills the proxy when a test ends, however it ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn metrics(c: &Cluster) -> String {
    let url = format!("http://{}:{METRICS_PORT}/metrics", c.tb.addr("lb"));
    let out = in_ns(&c.tb, "lb", &["curl", "-s", "--max-time", "2", &url]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the series of `name` whose labels include every one of `labels`.
fn metric(c: &Cluster, name: &str, labels: &[&str]) -> Option<f64> {
    metrics(c).lines().filter(|l| l.starts_with(&format!("{name}{{"))).find(|l| labels.iter().all(|x| l.contains(x))).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn backend_label(c: &Cluster, i: usize) -> String {
    format!("backend=\"{}\"", server(&c.tb, i))
}

/// Requests server i has served (its own count, health checks included:
/// the proxy has none here).
fn served(c: &Cluster, i: usize) -> u64 {
    let url = format!("http://{}/stats", server(&c.tb, i));
    let out = run_ok(&c.tb, "lb", &["curl", "-s", "--max-time", "2", &url]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["served"].as_u64().unwrap()
}

/// `n` GETs through the proxy, one at a time on one connection (so each
/// choice sees no request of this proxy in flight); returns how many each
/// server served.
fn requests(c: &Cluster, n: usize) -> [u64; 3] {
    let before = [1, 2, 3].map(|i| served(c, i));
    let url = format!("http://{}:{PROXY_PORT}/r[1-{n}]", c.tb.addr("lb"));
    let out = run_ok(&c.tb, "lb", &["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}\n", "--max-time", "30", &url]);
    let codes = String::from_utf8_lossy(&out.stdout);
    assert_eq!(codes.lines().filter(|l| *l == "200").count(), n, "not every request got a 200: {codes}");
    let after = [1, 2, 3].map(|i| served(c, i));
    [0, 1, 2].map(|k| after[k] - before[k])
}

fn set_score(c: &Cluster, i: usize, score: &str) {
    let sock = c.agent_socket(i);
    let args: Vec<&str> = match score {
        "clear" => vec![BIN, "agent", "score", "clear", "--port", "8080", "--socket", sock.to_str().unwrap()],
        n => vec![BIN, "agent", "score", "set", n, "--port", "8080", "--socket", sock.to_str().unwrap()],
    };
    run_ok(&c.tb, &format!("s{i}"), &args);
}

#[test]
fn a_server_whose_agent_reports_load_gets_fewer_requests() {
    let c = up("sc");
    let _proxy = Proc(start_proxy(&c, &c.key()));
    set_score(&c, 1, "40");
    let s1 = backend_label(&c, 1);
    wait_for("the proxy to hold s1's score", || metric(&c, "inband_proxy_backend_score", &[&s1]) == Some(40.0));
    // Two choices among three: the loaded server loses every draw it is
    // in, so it gets nothing; least-request would give it a third.
    let got = requests(&c, 300);
    assert!(got[0] <= 3, "s1 reports 40 and got {got:?}");
    assert!(got[1] >= 100 && got[2] >= 100, "{got:?}");
    // The ranking follows the score: cleared, s1 takes its share again.
    set_score(&c, 1, "clear");
    wait_for("the proxy to see s1's score cleared", || metric(&c, "inband_proxy_backend_score", &[&s1]) == Some(0.0));
    let got = requests(&c, 300);
    assert!(got.iter().all(|&n| n >= 50), "{got:?}");
    assert_eq!(metric(&c, "inband_proxy_score_stale_total", &[&s1]), Some(0.0));
    assert!(c.agent_counter("polls_answered") > 0, "{}", c.agent_counters());
}

#[test]
fn a_silent_agent_falls_back_to_requests_in_flight_and_bad_keys_are_refused() {
    let c = up("sf");
    let _proxy = Proc(start_proxy(&c, &c.key()));
    let s2 = backend_label(&c, 2);
    wait_for("s2's first score", || metric(&c, "inband_proxy_backend_score", &[&s2]) == Some(0.0));
    // s2's agent reports a high score, then stops getting polls (its host
    // drops them; HTTP still flows): the proxy must not keep the old
    // score, which would starve s2 for good.
    set_score(&c, 2, "1000");
    wait_for("the proxy to hold s2's score", || metric(&c, "inband_proxy_backend_score", &[&s2]) == Some(1000.0));
    run_ok(&c.tb, "s2", &["nft", "add table inet nopoll"]);
    run_ok(&c.tb, "s2", &["nft", "add chain inet nopoll in { type filter hook input priority -300 ; }"]);
    run_ok(&c.tb, "s2", &["nft", "add rule inet nopoll in udp dport 9137 drop"]);
    wait_for("s2 counted stale", || metric(&c, "inband_proxy_score_stale_total", &[&s2]) == Some(1.0));
    assert_eq!(metric(&c, "inband_proxy_backend_score", &[&s2]), Some(-1.0));
    let got = requests(&c, 300);
    assert!(got[1] >= 50, "s2's agent is silent, so s2 is ranked by requests in flight: {got:?}");
    assert!(metric(&c, "inband_proxy_score_polls_total", &[&s2, "result=\"unanswered\""]).unwrap() >= 5.0);
    for s in [backend_label(&c, 1), backend_label(&c, 3)] {
        assert_eq!(metric(&c, "inband_proxy_score_stale_total", &[&s]), Some(0.0), "{s}");
    }
    run_ok(&c.tb, "s2", &["nft", "delete table inet nopoll"]);
    wait_for("s2's score back", || metric(&c, "inband_proxy_backend_score", &[&s2]) == Some(1000.0));
    drop(_proxy);

    // A proxy whose key the agents do not hold: every poll is refused by
    // the agents (counted there), every backend goes stale (counted
    // here), and requests still flow, ranked by requests in flight.
    let other = c.dir.join("other.key");
    inband_core::auth::keygen(&other).unwrap();
    let refused_before = c.agent_counter("polls_unauthenticated");
    let _proxy = Proc(start_proxy(&c, &other));
    wait_for("every backend stale", || (1..=3).all(|i| metric(&c, "inband_proxy_score_stale_total", &[&backend_label(&c, i)]) == Some(1.0)));
    assert!(c.agent_counter("polls_unauthenticated") >= refused_before + 15, "{}", c.agent_counters());
    assert_eq!(metric(&c, "inband_proxy_score_polls_total", &[&s2, "result=\"answered\""]), Some(0.0));
    let got = requests(&c, 300);
    assert!(got.iter().all(|&n| n >= 50), "{got:?}");
}

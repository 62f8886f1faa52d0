//! The weights controller (`inband weights`, KnapsackLB) on a namespace
//! testbed: servers of 1, 2 and 4 workers under open-loop load through the
//! balancer; the controller must learn weights in capacity order, write
//! them, and the balancer's new connections (counted at the servers) must
//! follow them. Then the same against HAProxy's runtime API.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod cluster;
use cluster::*;

const WORKERS: [&str; 3] = ["1", "2", "4"];

fn cluster(test: &str) -> Cluster {
    let mut spec = Spec::new(test, "dsr-rr").vip("policy = \"round-robin\"").alone();
    for (i, w) in WORKERS.iter().enumerate() {
        spec = spec.serve(i + 1, &["--workers", w, "--body-bytes", "1024"]);
    }
    Cluster::with(spec)
}

/// Open-loop load from the client: 200 requests a second (7 workers of
/// 20 ms serve 350; even shares would overload the 1-worker server, which
/// serves 50, 10 of them the controller's probes), for `seconds`.
fn load(c: &Cluster, to: &str, seconds: u32) -> Child {
    in_ns(&c.tb, "c1", &[BIN, "bench", "openloop", "--url", &format!("http://{to}/"), "--rate", "200", "--seconds", &seconds.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn weights_toml(c: &Cluster, target: &str, status: &Path) -> String {
    let mut t = format!(
        "probe_rate = 10\nround_ms = 1000\nmax_rounds = 24\nstatus_file = \"{}\"\n\n[target]\n{target}\n",
        status.display()
    );
    for i in 1..=3 {
        t += &format!("\n[[backend]]\naddress = \"{}\"\nname = \"s{i}\"\n", server(&c.tb, i));
    }
    t
}

/// Runs the controller in the balancer's namespace until its status says
/// steady (bounded), and returns the status.
fn learn(c: &mut Cluster, name: &str, target: &str) -> Value {
    let status = c.dir.join(format!("{name}.json"));
    let cfg = c.dir.join(format!("{name}.toml"));
    std::fs::write(&cfg, weights_toml(c, target, &status)).unwrap();
    let child = in_ns(&c.tb, "lb", &[BIN, "weights", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
    c.others.push(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s: Option<Value> = std::fs::read(&status).ok().and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(s) = s.filter(|s| s["phase"] == "steady") {
            // What was learned, for a failing assertion's reader.
            for d in s["decisions"].as_array().unwrap() {
                eprintln!("{name}: {}", d["what"].as_str().unwrap_or_default());
            }
            for b in s["backends"].as_array().unwrap() {
                let pts: Vec<String> = b["points"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| format!("{:.3}:{:.0}{}", p["weight"].as_f64().unwrap_or(0.0), p["latency_ms"].as_f64().unwrap_or(0.0), if p["drop"] == true { "!" } else { "" }))
                    .collect();
                eprintln!("{name}: {} l0 {} points {}", b["name"], b["l0_ms"], pts.join(" "));
            }
            return s;
        }
        assert!(Instant::now() < deadline, "no steady state in 60 s: {}", std::fs::read_to_string(&status).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn learned_weights(s: &Value) -> Vec<f64> {
    s["backends"].as_array().unwrap().iter().map(|b| b["weight"].as_f64().unwrap()).collect()
}

/// The learned capacities (the largest share each server took without a
/// drop) and the weights, both in worker order.
fn assert_capacity_order(s: &Value) {
    let w = learned_weights(s);
    let cap: Vec<f64> = s["backends"].as_array().unwrap().iter().map(|b| b["w_max"].as_f64().unwrap()).collect();
    assert!(cap[0] < cap[1] && cap[1] < cap[2], "capacities of the 1/2/4-worker servers out of order: {cap:?}\n{s:#}");
    assert!(w[0] < w[1] && w[1] < w[2], "weights of the 1/2/4-worker servers out of order: {w:?}\n{s:#}");
    assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-6);
    assert!(s["last_solve"]["solve_ms"].as_f64().unwrap() > 0.0);
    for b in s["backends"].as_array().unwrap() {
        assert_eq!(b["state"], "ready", "{b}");
        assert!(b["curve"].is_array() && b["points"].as_array().unwrap().len() >= 3, "{b}");
    }
}

/// Connections each server took from the balancer (its agent's count of
/// accepted 155 options: the probes come straight from the balancer's
/// namespace and carry none).
fn from_balancer(c: &Cluster) -> Vec<u64> {
    (1..=3)
        .map(|i| {
            let out = run_ok(&c.tb, &format!("s{i}"), &[BIN, "agent", "status", "--interface", "eth0", "--json"]);
            serde_json::from_slice::<Value>(&out.stdout).unwrap()["counters"]["tuples_stored"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn learned_weights_follow_capacity_and_the_balancer_follows_the_weights() {
    let mut c = cluster("wts");
    let vip = vip(&c.tb).to_string();
    let sock = c.dir.join("lb.sock");
    let mut learning_load = load(&c, &vip, 60);
    let s = learn(&mut c, "inband", &format!("kind = \"inband\"\nsocket = \"{}\"\nvip = \"{vip}\"", sock.display()));
    assert_capacity_order(&s);

    // The balancer holds exactly the integers the controller wrote.
    let lb = c.status();
    for (i, b) in s["backends"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c.backend(i + 1)["weight"], b["applied"], "s{}: {lb}", i + 1);
    }
    let total: u64 = s["backends"].as_array().unwrap().iter().map(|b| b["applied"].as_u64().unwrap()).sum();
    assert!((9_990..=10_010).contains(&total), "{total}");

    // Shares of new connections over 10 s of the same load follow the weights.
    // The controller stops first: from steady it probes every server and
    // re-solves when latencies drift, either of which could move the
    // shares away from the weights they are compared with (CI 67 saw s1
    // take 0.140 of the connections against a learned 0.194, the
    // 1-worker server being the one its probes load most). The balancer
    // keeps the weights it holds, checked again after the measurement.
    let mut controller = c.others.pop().expect("the controller learn() started");
    let _ = controller.kill();
    let _ = controller.wait();
    let _ = learning_load.kill();
    let _ = learning_load.wait();
    let before = from_balancer(&c);
    let measured = load(&c, &vip, 10).wait_with_output().unwrap();
    let got: Vec<u64> = from_balancer(&c).iter().zip(&before).map(|(a, b)| a - b).collect();
    let n: u64 = got.iter().sum();
    assert!(n > 1500, "about 2,000 connections in 10 s: {got:?}");
    for (i, b) in s["backends"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c.backend(i + 1)["weight"], b["applied"], "s{}: the weights moved during the measurement", i + 1);
    }
    let w = learned_weights(&s);
    for i in 0..3 {
        let share = got[i] as f64 / n as f64;
        assert!((share - w[i]).abs() < 0.05, "s{}: share {share:.3} vs weight {:.3} ({got:?})", i + 1, w[i]);
    }
    // `inband status` shows the controller beside the balancer.
    let out = run_ok(&c.tb, "lb", &[BIN, "weights", "status", "--status-file", c.dir.join("inband.json").to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("steady") && text.contains("last solve"), "{text}");

    // At these weights nothing fails, and no server is past its knee.
    let r: Value = serde_json::from_slice(&measured.stdout).unwrap();
    assert_eq!(r["errors"], 0, "{r}");
    assert!(r["p99_ms"].as_f64().unwrap() < 200.0, "{r}");
}

#[test]
fn the_weights_reach_haproxy_through_its_runtime_api() {
    let mut c = cluster("wth");
    let admin = c.dir.join("haproxy.sock");
    let mut cfg = format!(
        "global\n  stats socket {} level admin\n  maxconn 4096\ndefaults\n  mode http\n  timeout connect 2s\n  timeout client 10s\n  timeout server 10s\n\
         frontend fe\n  bind {}:8000\n  default_backend servers\nbackend servers\n  balance roundrobin\n",
        admin.display(),
        c.tb.addr("lb")
    );
    for i in 1..=3 {
        cfg += &format!("  server s{i} {} weight 1\n", server(&c.tb, i));
    }
    let cfg_path = c.dir.join("haproxy.cfg");
    std::fs::write(&cfg_path, cfg).unwrap();
    let h = in_ns(&c.tb, "lb", &["haproxy", "-db", "-f", cfg_path.to_str().unwrap()]).stdout(Stdio::null()).spawn().unwrap();
    c.others.push(h);
    wait_for("HAProxy admin socket", || admin.exists());
    let front = format!("{}:8000", c.tb.addr("lb"));
    let mut traffic = load(&c, &front, 60);
    let s = learn(&mut c, "haproxy", &format!("kind = \"haproxy\"\nsocket = \"{}\"\nbackend = \"servers\"", admin.display()));
    assert_capacity_order(&s);
    let mut got = inband_weights::haproxy_weights(&admin, "servers").unwrap();
    got.sort();
    let want: Vec<(String, u32)> =
        s["backends"].as_array().unwrap().iter().map(|b| (b["name"].as_str().unwrap().to_string(), b["applied"].as_u64().unwrap() as u32)).collect();
    assert_eq!(got, want, "HAProxy's weights are the controller's");
    assert_eq!(want[2].1, 256, "the largest weight is HAProxy's maximum");
    let _ = traffic.kill();
    let _ = traffic.wait();
}

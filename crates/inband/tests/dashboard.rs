//! The Grafana dashboard (deploy/grafana/inband.json) against a real
//! Prometheus (Debian's `prometheus`, installed by scripts/setup.sh)
//! scraping a running testbed: `inband lb` with `bpf_stats`, agents,
//! `inband proxy` with a cache and TLS in front of an nginx, and
//! `inband mesh`. After traffic through each (a backend killed, packets
//! dropped, cache hits and misses) every query of the dashboard, its
//! panels' and its variables', must return data; and every `inband_`
//! family the endpoints export must be on some panel.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod cluster;
use cluster::*;

const DASHBOARD: &str = include_str!("../../../deploy/grafana/inband.json");

/// Inside the balancer's namespace, which the test made: nothing else
/// listens there, so fixed ports are free.
const PROMETHEUS: &str = "127.0.0.1:9090";
const LB_METRICS: &str = "127.0.0.1:9100";
const PROXY: &str = "127.0.0.1:8088";
const PROXY_TLS: &str = "127.0.0.1:8443";
const PROXY_METRICS: &str = "127.0.0.1:9180";
const MESH_METRICS: &str = "127.0.0.1:9105";
/// Each server's agent, on its own address (Prometheus runs in the lb's namespace).
const AGENT_METRICS_PORT: u16 = 9110;
/// `inband shadow metrics` on s1, for the shadow program beside its agent.
const SHADOW_METRICS_PORT: u16 = 9120;
const MESH_SERVICE: &str = "10.96.0.10:80";
/// The nginx on s1 and s2 that the proxy and the mesh use: keep-alive,
/// and every answer cacheable.
const ORIGIN_PORT: u16 = 8081;

/// The mesh's client cgroup; removed once the cluster (and with it every
/// process in the cgroup) is gone.
struct Cgroup(PathBuf);

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() || !self.0.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Prometheus in the balancer's namespace; when dropped (a failing test
/// included) it is killed, then its data directory removed (`dir`'s own
/// drop).
struct Prometheus {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(c: &Cluster, targets: &[(&str, &str)]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let mut config = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n");
        for (job, target) in targets {
            config += &format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n");
        }
        let path = dir.path().join("prometheus.yml");
        std::fs::write(&path, config).unwrap();
        let (data, log) = (dir.path().join("data"), dir.path().join("prometheus.log"));
        let child = in_ns(
            &c.tb,
            "lb",
            &[
                "prometheus",
                &format!("--config.file={}", path.display()),
                &format!("--storage.tsdb.path={}", data.display()),
                &format!("--web.listen-address={PROMETHEUS}"),
            ],
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("prometheus (scripts/setup.sh installs it)");
        let p = Prometheus { child, dir };
        let ready = || in_ns(&c.tb, "lb", &["curl", "-sf", "--max-time", "1", &format!("http://{PROMETHEUS}/-/ready")]).output().is_ok_and(|o| o.status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready() {
            assert!(Instant::now() < deadline, "prometheus not ready:\n{}", p.log());
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    fn api(&self, c: &Cluster, path: &str, args: &[(&str, &str)]) -> Value {
        let url = format!("http://{PROMETHEUS}{path}");
        let mut cmd = vec!["curl", "-sS", "-G", "--max-time", "5", &url];
        let encoded: Vec<String> = args.iter().map(|(k, v)| format!("{k}={v}")).collect();
        for a in &encoded {
            cmd.extend(["--data-urlencode", a.as_str()]);
        }
        let out = run_ok(&c.tb, "lb", &cmd);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{path} {args:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
    }

    /// The series of an instant query that carry a number (NaN, a rate
    /// divided by a zero rate, is a gap in Grafana, not data), or why
    /// there are none.
    fn data(&self, c: &Cluster, expr: &str) -> Result<Vec<Value>, String> {
        let r = self.api(c, "/api/v1/query", &[("query", expr)]);
        if r["status"] != "success" {
            return Err(format!("{} {}", r["errorType"], r["error"]));
        }
        let finite = |v: &Value| v[1].as_str().and_then(|s| s.parse::<f64>().ok()).is_some_and(f64::is_finite);
        match r["data"]["resultType"].as_str() {
            Some("scalar") => finite(&r["data"]["result"]).then(|| vec![r["data"]["result"].clone()]).ok_or("NaN".into()),
            _ => {
                let all = r["data"]["result"].as_array().cloned().unwrap_or_default();
                let n = all.len();
                let with: Vec<Value> = all.into_iter().filter(|s| finite(&s["value"])).collect();
                if with.is_empty() {
                    Err(format!("no data ({n} series, none with a number)"))
                } else {
                    Ok(with)
                }
            }
        }
    }
}

/// The dashboard's template variables' names.
fn variable_names(dashboard: &Value) -> Vec<String> {
    dashboard["templating"]["list"].as_array().into_iter().flatten().filter_map(|v| v["name"].as_str().map(str::to_string)).collect()
}

/// A query of the dashboard as Prometheus gets it: Grafana's interval
/// macro and every template variable (all selected) replaced.
fn substitute(expr: &str, variables: &[String]) -> String {
    let mut s = expr.replace("$__rate_interval", "10s").replace("${__rate_interval}", "10s");
    for var in variables {
        s = s.replace(&format!("${{{var}}}"), ".*").replace(&format!("${var}"), ".*");
    }
    assert!(!s.contains('$'), "a macro or variable the test does not know in {expr:?}");
    s
}

/// (what, expr): every query target of every panel (rows' nested panels
/// included) and the metric selector of every query variable.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"].as_array().expect("panels").iter().rev().collect();
    while let Some(p) = panels.pop() {
        panels.extend(p["panels"].as_array().into_iter().flatten().rev());
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_else(|| panic!("a target of panel {} without expr", p["title"]));
            out.push((format!("panel {}", p["title"]), expr.to_string()));
        }
    }
    for v in dashboard["templating"]["list"].as_array().into_iter().flatten().filter(|v| v["type"] == "query") {
        let def = v["definition"].as_str().expect("a query variable has a definition");
        let selector = def
            .strip_prefix("label_values(")
            .and_then(|d| d.strip_suffix(')'))
            .and_then(|d| d.rsplit_once(','))
            .unwrap_or_else(|| panic!("variable {}: label_values(metric, label) expected, not {def}", v["name"]))
            .0;
        out.push((format!("variable {}", v["name"]), selector.trim().to_string()));
    }
    out
}

/// The metric names an expression names: its identifiers.
fn names_in(expr: &str) -> BTreeSet<String> {
    expr.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == ':')).filter(|w| w.starts_with("inband_")).map(str::to_string).collect()
}

/// The `__name__=~"..."` matchers of an expression (the regular
/// expressions, which Prometheus resolves to names).
fn name_patterns(expr: &str) -> Vec<String> {
    expr.split("__name__=~\"").skip(1).filter_map(|rest| rest.split('"').next()).map(str::to_string).collect()
}

/// An nginx on server i, port ORIGIN_PORT: keep-alive, every answer
/// cacheable for ten minutes.
fn start_origin(c: &mut Cluster, i: usize) {
    let dir = c.dir.join(format!("origin-s{i}"));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 256; }}\nhttp {{\naccess_log off;\n\
         client_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\nfastcgi_temp_path {d}/fastcgi;\n\
         uwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n\
         server {{ listen 0.0.0.0:{ORIGIN_PORT}; location / {{ add_header Cache-Control \"max-age=600\"; return 200 \"s{i} $uri\\n\"; }} }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let err = dir.join("error.log");
    let argv = ["/usr/sbin/nginx", "-p", dir.to_str().unwrap(), "-e", err.to_str().unwrap(), "-c", path.to_str().unwrap()];
    let s = in_ns(&c.tb, &format!("s{i}"), &argv).stdout(Stdio::null()).spawn().unwrap();
    c.others.push(s);
    let url = format!("http://{}:{ORIGIN_PORT}/", c.tb.addr(&format!("s{i}")));
    wait_for(&format!("nginx on s{i}"), || in_ns(&c.tb, "lb", &["curl", "-sf", "--max-time", "1", &url]).output().is_ok_and(|o| o.status.success()));
}

/// `inband proxy` in the balancer's namespace in front of s1's nginx,
/// with an LMDB cache, a TLS listener and health checks; returns its pid.
fn start_proxy(c: &mut Cluster) -> u32 {
    let (cert, key) = (c.dir.join("proxy.crt"), c.dir.join("proxy.key"));
    let made = rcgen::generate_simple_self_signed(vec!["proxy.inband.test".to_string()]).unwrap();
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.key_pair.serialize_pem()).unwrap();
    let config = format!(
        "listen = \"{PROXY}\"\nmetrics_listen = \"{PROXY_METRICS}\"\nbackends = [\"{}:{ORIGIN_PORT}\"]\n\
         [cache]\nbackend = \"lmdb\"\npath = \"{}\"\ncapacity_bytes = 67108864\n\
         [tls]\nlisten = \"{PROXY_TLS}\"\n[[tls.certificate]]\ncert = \"{}\"\nkey = \"{}\"\n\
         [health]\npath = \"/\"\ninterval_ms = 500\ntimeout_ms = 400\n",
        c.tb.addr("s1"),
        c.dir.join("proxy-cache").display(),
        cert.display(),
        key.display(),
    );
    let path = c.dir.join("proxy.toml");
    std::fs::write(&path, config).unwrap();
    let log = std::fs::File::create(c.dir.join("proxy.log")).unwrap();
    let p = in_ns(&c.tb, "lb", &[BIN, "proxy", "--config", path.to_str().unwrap()]).stdout(Stdio::null()).stderr(log).spawn().unwrap();
    let pid = p.id();
    c.others.push(p);
    let log = c.dir.join("proxy.log");
    wait_logged("the proxy's metrics", &log, || scrape(c, PROXY_METRICS).contains("inband_proxy_connections"));
    pid
}

/// `inband mesh` in the balancer's namespace, balancing the cgroup's
/// connections to MESH_SERVICE over s1's and s2's nginx.
fn start_mesh(c: &mut Cluster, cgroup: &Cgroup) {
    let backends = [1, 2].map(|i| format!("\"{}:{ORIGIN_PORT}\"", c.tb.addr(&format!("s{i}")))).join(", ");
    let config = format!(
        "cgroup = \"{}\"\npool = 2\nmetrics = \"{MESH_METRICS}\"\nbpf_stats = true\n[health]\npath = \"/\"\ninterval_ms = 500\ntimeout_ms = 400\n\
         [[service]]\nname = \"web\"\naddress = \"{MESH_SERVICE}\"\nbackends = [{backends}]\n",
        cgroup.0.display()
    );
    let path = c.dir.join("mesh.toml");
    std::fs::write(&path, config).unwrap();
    let log = std::fs::File::create(c.dir.join("mesh.log")).unwrap();
    let m = in_ns(&c.tb, "lb", &[BIN, "mesh", "run", "--config", path.to_str().unwrap()]).stdout(Stdio::null()).stderr(log).spawn().unwrap();
    c.others.push(m);
    let log = c.dir.join("mesh.log");
    wait_logged("the mesh's metrics", &log, || scrape(c, MESH_METRICS).contains("inband_mesh_pool_slots{"));
}

/// Waits (at most 15 s) for `ok`; fails with the log of what it waits for.
/// The servers' shadow program (seed 002) on s1's interface, beside its
/// agent, and `inband shadow metrics` for it: attach wants its two SIDs
/// routed as End.DT6 first (no packet goes to them here; the program
/// counts the VIP's traffic as `other`). The lb's `bpf_stats` counts its runs.
fn start_shadow(c: &mut Cluster) {
    let (sid, direct, shadow) = ("fd00:db5::b", "fd00:db5::d", "fd00:db5::5");
    run_ok(&c.tb, "s1", &["sysctl", "-q", "-w", "net.ipv6.conf.eth0.seg6_enabled=1"]);
    for s in [sid, direct] {
        run_ok(&c.tb, "s1", &["ip", "-6", "route", "add", s, "encap", "seg6local", "action", "End.DT6", "table", "local", "dev", "eth0"]);
    }
    run_ok(&c.tb, "s1", &[BIN, "shadow", "attach", "--interface", "eth0", "--sid", sid, "--direct-sid", direct, "--shadow-sid", shadow]);
    let listen = format!("0.0.0.0:{SHADOW_METRICS_PORT}");
    let child = in_ns(&c.tb, "s1", &[BIN, "shadow", "metrics", "--listen", &listen]).stdout(Stdio::null()).spawn().unwrap();
    c.others.push(child);
}

fn wait_logged(what: &str, log: &std::path::Path, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}:\n{}", std::fs::read_to_string(log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn scrape(c: &Cluster, addr: &str) -> String {
    in_ns(&c.tb, "lb", &["curl", "-s", "--max-time", "2", &format!("http://{addr}/metrics")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// A shell loop in `node` (in `cgroup` if given) running `body` every
/// 200 ms for at most a minute; the cluster stops it.
fn keep_doing(c: &mut Cluster, node: &str, cgroup: Option<&Cgroup>, body: &str) {
    let enter = cgroup.map_or(String::new(), |g| format!("echo $$ > {}/cgroup.procs; ", g.0.display()));
    let script = format!("{enter}for i in $(seq 300); do {body}; sleep 0.2; done");
    let l = in_ns(&c.tb, node, &["sh", "-c", &script]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    c.others.push(l);
}

/// Every query of the dashboard returns data from a testbed where each
/// product runs and carries traffic; a misspelled metric would not.
#[test]
fn every_query_of_the_dashboard_returns_data_from_a_running_testbed() {
    let cgroup = Cgroup(PathBuf::from(format!("/sys/fs/cgroup/unified/inband-test-dashboard-{}", std::process::id())));
    std::fs::create_dir_all(&cgroup.0).expect("cgroup v2 at /sys/fs/cgroup/unified");
    let mut c = Cluster::with(
        Spec::new("db", "dsr-dynamic")
            .servers(2)
            .clients(2)
            .lb(&format!("metrics = \"{LB_METRICS}\""))
            .lb("bpf_stats = true")
            .agent(&format!("metrics = \"0.0.0.0:{AGENT_METRICS_PORT}\"\nbpf_stats = true")),
    );
    for i in 1..=2 {
        start_origin(&mut c, i);
    }
    let proxy = start_proxy(&mut c);
    start_mesh(&mut c, &cgroup);
    start_shadow(&mut c);
    let agents: Vec<String> = (1..=2).map(|i| format!("{}:{AGENT_METRICS_PORT}", server(&c.tb, i).ip())).collect();
    let shadow = format!("{}:{SHADOW_METRICS_PORT}", server(&c.tb, 1).ip());
    let prom = Prometheus::start(
        &c,
        &[
            ("inband-lb", LB_METRICS),
            ("inband-proxy", PROXY_METRICS),
            ("inband-mesh", MESH_METRICS),
            ("inband-agent-s1", &agents[0]),
            ("inband-agent-s2", &agents[1]),
            ("inband-shadow-s1", &shadow),
        ],
    );

    // Traffic: through the VIP, through the proxy (a miss, then hits, a
    // refusal, TLS, a certificate reload), through the mesh.
    for _ in 0..6 {
        assert_eq!(get_vip(&c).0, 200);
    }
    let proxy_get = |path: &str, host: &str| {
        let out = run_ok(&c.tb, "lb", &["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", host, "--max-time", "5", &format!("http://{PROXY}{path}")]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(proxy_get("/a", "Host: dashboard.test"), "200");
    assert_eq!(proxy_get("/a", "Host: dashboard.test"), "200");
    assert_eq!(proxy_get("/a", "Host:"), "400", "HTTP/1.1 without Host is the proxy's own 400 (refusal bad_host)");
    run_ok(&c.tb, "lb", &["curl", "-sf", "-k", "-o", "/dev/null", "--max-time", "5", &format!("https://{PROXY_TLS}/a")]);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(proxy as i32, libc::SIGHUP) }, 0);
    let vip_url = format!("http://{}/", vip(&c.tb));
    keep_doing(&mut c, "c1", None, &format!("curl -s -o /dev/null --max-time 2 {vip_url}"));
    keep_doing(&mut c, "lb", None, &format!("curl -s -o /dev/null --max-time 2 -H 'Host: dashboard.test' http://{PROXY}/a http://{PROXY}/b$i"));
    keep_doing(&mut c, "lb", Some(&cgroup), &format!("curl -s -o /dev/null --max-time 2 http://{MESH_SERVICE}/m$i"));

    // A backend's application dies: its checks are refused, it goes down.
    c.kill_server(2);
    wait_for("s2 down", || c.backend(2)["health"]["state"] == "down");
    // Packets dropped: c2's SYNs to the VIP would leave the balancer with
    // their TTL at 0 (ttl_exceeded).
    run_ok(&c.tb, "c2", &["sysctl", "-q", "-w", "net.ipv4.ip_default_ttl=1"]);
    keep_doing(&mut c, "c2", None, &format!("curl -s -o /dev/null --max-time 0.3 {vip_url}"));

    // Prometheus scrapes every endpoint.
    wait_for("every target up", || {
        let t = prom.api(&c, "/api/v1/targets", &[]);
        let active = t["data"]["activeTargets"].as_array().cloned().unwrap_or_default();
        active.len() == 6 && active.iter().all(|t| t["health"] == "up")
    });

    // What the health and drop panels are for shows in Prometheus.
    let down = format!("inband_backend_up{{backend=\"{}\",reason=\"refused\"}} == 0", server(&c.tb, 2));
    let ttl = "rate(inband_drops_total{reason=\"ttl_exceeded\"}[10s]) > 0";
    let hits = "inband_proxy_cache_total{result=\"hit\"} > 0";
    // The agents took client tuples, and the kernel counted their programs.
    let tuples = "inband_agent_events_total{event=\"tuples_stored\"} > 0";
    let egress = "rate(inband_agent_bpf_program_runs_total{program=\"egress\"}[10s]) > 0";
    // The VIP's traffic crosses s1's shadow program (counted as not to its SIDs).
    let shadow_runs = "rate(inband_shadow_bpf_program_runs_total{program=\"shadow\",interface=\"eth0\"}[10s]) > 0";
    for expr in [down.as_str(), ttl, hits, tuples, egress, shadow_runs] {
        wait_for(expr, || prom.data(&c, expr).is_ok());
    }
    assert!(prom.data(&c, "inband_backend_upp").is_err(), "a misspelled metric has no data");

    // Every panel's query, and every variable's, returns data: rates need
    // two scrapes of a series, so the queries are retried for a while.
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("deploy/grafana/inband.json is JSON");
    let (queries, variables) = (queries(&dashboard), variable_names(&dashboard));
    assert!(queries.len() > 50, "the dashboard has its panels: {}", queries.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    let failing = loop {
        let failing: Vec<String> =
            queries.iter().filter_map(|(what, expr)| prom.data(&c, &substitute(expr, &variables)).err().map(|e| format!("{what}: {expr}\n    {e}"))).collect();
        if failing.is_empty() || Instant::now() > deadline {
            break failing;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(failing.is_empty(), "queries with no data:\n{}", failing.join("\n"));

    // Every family the endpoints export is on a panel.
    let mut covered: BTreeSet<String> = queries.iter().flat_map(|(_, e)| names_in(e)).collect();
    for pattern in queries.iter().flat_map(|(_, e)| name_patterns(e)) {
        let r = prom.data(&c, &format!("group by (__name__) ({{__name__=~\"{pattern}\"}})")).unwrap_or_default();
        covered.extend(r.iter().filter_map(|s| s["metric"]["__name__"].as_str().map(str::to_string)));
    }
    let family = |n: &str| ["_bucket", "_sum", "_count"].iter().find_map(|s| n.strip_suffix(s)).unwrap_or(n).to_string();
    let covered: BTreeSet<String> = covered.iter().map(|n| family(n)).collect();
    let exported = prom.api(&c, "/api/v1/label/__name__/values", &[]);
    let missing: Vec<&str> = exported["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .filter(|n| n.starts_with("inband_") && !covered.contains(&family(n)))
        .collect();
    assert!(missing.is_empty(), "exported but on no panel of the dashboard: {missing:?}");
}

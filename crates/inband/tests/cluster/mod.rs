//! A balanced cluster on a network-namespace testbed, for the integration
//! tests (`e2e.rs`, `regimes.rs`, `lifecycle.rs`, `security.rs`): clients,
//! the balancer, real servers running `inband serve` and `inband agent`,
//! all sharing one auth key. Each test brings up its own testbed (named
//! after the process and test) and tears it down even when it fails:
//! processes first (SIGTERM, then SIGKILL), then the data path, then the
//! namespaces.
#![allow(dead_code)] // each test binary uses a part

use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use inband::testbed::{Testbed, TestbedSpec};
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_inband");

/// A cluster of a test that loads the machine on purpose (floods, churn)
/// holds this exclusively, every other cluster of its test binary shares
/// it: the heavy test runs alone, so what it measures is its own and its
/// load does not make the others time out.
static MACHINE: std::sync::RwLock<()> = std::sync::RwLock::new(());

enum Share {
    Shared(std::sync::RwLockReadGuard<'static, ()>),
    Alone(std::sync::RwLockWriteGuard<'static, ()>),
}
pub const BODY: usize = 46 * 1024;

/// Runs `cmd` in the node's network namespace only (the mount namespace
/// stays shared, so bpffs pins are visible to every command).
pub fn in_ns(tb: &Testbed, node: &str, cmd: &[&str]) -> Command {
    let mut c = tb.command(node, cmd);
    c.env("INBAND_LOG", "warn");
    c
}

pub fn run_ok(tb: &Testbed, node: &str, cmd: &[&str]) -> Output {
    let out = in_ns(tb, node, cmd).output().expect("spawn");
    assert!(out.status.success(), "{cmd:?} in {node} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// What to build. `vip_lines` go into the `[[vip]]` section (timeouts,
/// policy, probe interval...), `lb_lines` at the top of lb.toml.
pub struct Spec<'a> {
    pub test: &'a str,
    pub mode: &'a str,
    pub clients: usize,
    pub servers: usize,
    /// Extra `inband serve` flags for server i+1.
    pub serve_args: Vec<Vec<String>>,
    pub vip_lines: Vec<String>,
    pub lb_lines: Vec<String>,
    pub client_link_mtu: Option<u32>,
    pub heavy: bool,
}

impl<'a> Spec<'a> {
    pub fn new(test: &'a str, mode: &'a str) -> Spec<'a> {
        Spec {
            test,
            mode,
            clients: 1,
            servers: 3,
            serve_args: Vec::new(),
            vip_lines: Vec::new(),
            lb_lines: Vec::new(),
            client_link_mtu: None,
            heavy: false,
        }
    }
    /// The test loads the machine: it runs alone (see `MACHINE`).
    pub fn heavy(mut self) -> Self {
        self.heavy = true;
        self
    }
    pub fn servers(mut self, n: usize) -> Self {
        self.servers = n;
        self
    }
    pub fn clients(mut self, n: usize) -> Self {
        self.clients = n;
        self
    }
    pub fn serve(mut self, server: usize, args: &[&str]) -> Self {
        if self.serve_args.len() < server {
            self.serve_args.resize(server, Vec::new());
        }
        self.serve_args[server - 1].extend(args.iter().map(|a| a.to_string()));
        self
    }
    pub fn every_server(mut self, args: &[&str]) -> Self {
        for i in 1..=self.servers {
            self = self.serve(i, args);
        }
        self
    }
    pub fn vip(mut self, line: &str) -> Self {
        self.vip_lines.push(line.to_string());
        self
    }
    pub fn lb(mut self, line: &str) -> Self {
        self.lb_lines.push(line.to_string());
        self
    }
    pub fn client_link_mtu(mut self, mtu: u32) -> Self {
        self.client_link_mtu = Some(mtu);
        self
    }
}

pub struct Cluster {
    pub tb: Testbed,
    pub dir: PathBuf,
    pub lb: Option<Child>,
    pub others: Vec<Child>,
    pub servers: usize,
    mode: String,
    vip_lines: Vec<String>,
    lb_lines: Vec<String>,
    _share: Share,
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

pub fn vip(tb: &Testbed) -> SocketAddrV4 {
    SocketAddrV4::new(tb.vip(), 80)
}

pub fn server(tb: &Testbed, i: usize) -> SocketAddrV4 {
    SocketAddrV4::new(tb.addr(&format!("s{i}")), 8080)
}

impl Cluster {
    /// Three servers, one client; `serve_args[i]` are extra `inband serve`
    /// flags for server i+1.
    pub fn up(test: &str, mode: &str, serve_args: &[&[&str]]) -> Cluster {
        let mut spec = Spec::new(test, mode);
        for (i, args) in serve_args.iter().enumerate() {
            spec = spec.serve(i + 1, args);
        }
        Cluster::with(spec)
    }

    pub fn with(spec: Spec) -> Cluster {
        let share = if spec.heavy {
            Share::Alone(MACHINE.write().unwrap_or_else(|e| e.into_inner()))
        } else {
            Share::Shared(MACHINE.read().unwrap_or_else(|e| e.into_inner()))
        };
        let name = format!("e{}{}", std::process::id() % 10000, spec.test);
        let tb = Testbed::up(TestbedSpec {
            name: name.clone(),
            clients: spec.clients,
            servers: spec.servers,
            client_link_mtu: spec.client_link_mtu,
            ..Default::default()
        })
        .expect("testbed up");
        let dir = std::env::temp_dir().join(format!("inband-e2e-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster {
            tb,
            dir,
            lb: None,
            others: Vec::new(),
            servers: spec.servers,
            mode: spec.mode.to_string(),
            vip_lines: spec.vip_lines,
            lb_lines: spec.lb_lines,
            _share: share,
        };
        inband::auth::keygen(&c.key()).unwrap();
        for i in 1..=spec.servers {
            let extra: Vec<&str> = spec.serve_args.get(i - 1).map(|v| v.iter().map(String::as_str).collect()).unwrap_or_default();
            c.start_server(i, &extra);
            c.start_agent(i);
        }
        let all: Vec<usize> = (1..=spec.servers).collect();
        std::fs::write(c.dir.join("lb.toml"), c.lb_config(&all)).unwrap();
        c.start_lb();
        for i in 1..=spec.servers {
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

    pub fn start_server(&mut self, i: usize, extra: &[&str]) {
        let node = format!("s{i}");
        let mut serve = vec![BIN, "serve", "--listen", "0.0.0.0:8080", "--service-ms", "20", "--service-dist", "constant"];
        serve.extend_from_slice(extra);
        let s = in_ns(&self.tb, &node, &serve).stdout(Stdio::null()).spawn().unwrap();
        self.others.push(s);
    }

    fn start_agent(&mut self, i: usize) {
        let node = format!("s{i}");
        let cfg = self.dir.join(format!("agent-{node}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "interface = \"eth0\"\nbalancers = [\"{}\"]\nscore_socket = \"{}\"\n\n{}\n[[service]]\nport = 8080\nvip = \"{}\"\n",
                self.tb.addr("lb"),
                self.agent_socket(i).display(),
                self.auth(),
                vip(&self.tb)
            ),
        )
        .unwrap();
        let a = in_ns(&self.tb, &node, &[BIN, "agent", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
        self.others.push(a);
    }

    pub fn agent_socket(&self, i: usize) -> PathBuf {
        self.dir.join(format!("agent-s{i}.sock"))
    }

    pub fn lb_config(&self, servers: &[usize]) -> String {
        let mut s = format!(
            "interface = \"eth0\"\naddress = \"{}\"\ncontrol_socket = \"{}\"\n{}\n\n{}\n[[vip]]\naddress = \"{}\"\nport = 80\nmode = \"{}\"\nprobe_interval = 4\npoll_interval_ms = 50\n{}\n",
            self.tb.addr("lb"),
            self.dir.join("lb.sock").display(),
            self.lb_lines.join("\n"),
            self.auth(),
            self.tb.vip(),
            self.mode,
            self.vip_lines.join("\n"),
        );
        for i in servers {
            s += &format!("\n[[vip.backend]]\naddress = \"{}\"\nport = 8080\n", server(&self.tb, *i).ip());
        }
        s
    }

    pub fn start_lb(&mut self) {
        let cfg = self.dir.join("lb.toml");
        let child = in_ns(&self.tb, "lb", &[BIN, "lb", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
        self.lb = Some(child);
        wait_for("balancer control socket", || self.ctl_ok(&["set-probe-interval", "--vip", &vip(&self.tb).to_string(), "--n", &self.probe_n().to_string()]));
        // The first SYN waits for the backends' MACs: make sure they are known.
        wait_for("backend MACs", || self.status()[0]["vips"][0]["backends"].as_array().unwrap().iter().all(|b| b["mac"] != "00:00:00:00:00:00"));
    }

    /// The key the balancer and every agent share.
    pub fn key(&self) -> PathBuf {
        self.dir.join("auth.key")
    }

    fn auth(&self) -> String {
        format!("[auth]\nkeys = [{{ id = 1, file = \"{}\" }}]\n", self.key().display())
    }

    fn probe_n(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("lb.toml"))
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("probe_interval = "))
            .last()
            .map_or(100, |n| n.parse().unwrap())
    }

    pub fn stop_lb(&mut self) {
        if let Some(mut c) = self.lb.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }

    pub fn ctl(&self, args: &[&str]) -> Output {
        let sock = self.dir.join("lb.sock");
        let mut cmd = vec![BIN, "lb", "ctl", "--socket", sock.to_str().unwrap()];
        cmd.extend_from_slice(args);
        in_ns(&self.tb, "lb", &cmd).output().unwrap()
    }

    pub fn ctl_ok(&self, args: &[&str]) -> bool {
        self.ctl(args).status.success()
    }

    pub fn status(&self) -> Value {
        serde_json::from_slice(&run_ok(&self.tb, "lb", &[BIN, "status", "--json"]).stdout).unwrap()
    }

    /// Per-backend counters keyed by "addr:port".
    pub fn backend(&self, i: usize) -> Value {
        let s = self.status();
        let want = server(&self.tb, i).to_string();
        s[0]["vips"][0]["backends"].as_array().unwrap().iter().find(|b| b["backend"] == want.as_str()).cloned().unwrap_or(Value::Null)
    }

    /// New connections each server got so far, by the balancer's count.
    pub fn conns(&self) -> Vec<u64> {
        (1..=self.servers).map(|i| self.backend(i)["stats"]["new_conns"].as_u64().unwrap_or(0)).collect()
    }

    pub fn sum(&self, field: &str) -> u64 {
        (1..=self.servers).map(|i| self.backend(i)["stats"][field].as_u64().unwrap_or(0)).sum()
    }

    pub fn drop_count(&self, reason: &str) -> u64 {
        self.status()[0]["drops"][reason].as_u64().unwrap()
    }

    pub fn event(&self, name: &str) -> u64 {
        self.status()[0]["events"][name].as_u64().unwrap()
    }
}

pub fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
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
pub fn http_get(c: &Cluster, to: SocketAddrV4, path: &str, from_client: bool) -> Result<(u16, usize), String> {
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

pub fn get_vip(c: &Cluster) -> (u16, usize) {
    http_get(c, vip(&c.tb), "/", true).expect("GET via the VIP")
}

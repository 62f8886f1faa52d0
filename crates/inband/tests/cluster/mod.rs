//! A balanced cluster on a network-namespace testbed, for the integration
//! tests (`e2e.rs`, `regimes.rs`, `lifecycle.rs`, `security.rs`): clients,
//! the balancer, real servers running `inband serve` and `inband agent`,
//! all sharing one auth key. Each test brings up its own testbed (named
//! after the process and test) and tears it down even when it fails:
//! processes first (SIGTERM, then SIGKILL), then the data path, then the
//! namespaces.
#![allow(dead_code)] // each test binary uses a part

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use inband_testkit::testbed::{Testbed, TestbedSpec};
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_inband");

/// A cluster of a test that loads the machine on purpose (floods, churn)
/// or times what a neighbour's load would delay (how fresh scores are
/// while a paced client reads) holds this exclusively, every other
/// cluster of its test binary shares it: that test runs alone, so what
/// it measures is its own and its load does not make the others time out.
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
    /// (server, line): extra lines of that server's `[[vip.backend]]`.
    pub backend_lines: Vec<(usize, String)>,
    pub client_link_mtu: Option<u32>,
    pub alone: bool,
    /// A second VIP, IPv6 (vips[1] in status), beside the IPv4 one, on the
    /// same servers (listening dual-stack).
    pub ipv6: bool,
    /// Every VIP is UDP, and every server runs `inband quic serve` (server
    /// id = its number) beside `inband serve`.
    pub udp: bool,
    /// The UDP VIPs route QUIC by connection ID (`quic = true`, backends'
    /// `quic_server_id` = their number).
    pub quic: bool,
    /// Every server runs stock nginx (`start_nginx`) instead of `inband serve`.
    pub nginx: bool,
    /// Extra top-level lines of every agent's agent.toml.
    pub agent_lines: Vec<String>,
    /// The balancer's SNAT pool (`snat_prefix`): local on its lo, listed
    /// as a block in every agent's `balancers`.
    pub snat_pool: Option<&'a str>,
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
            backend_lines: Vec::new(),
            client_link_mtu: None,
            alone: false,
            ipv6: false,
            udp: false,
            quic: false,
            nginx: false,
            agent_lines: Vec::new(),
            snat_pool: None,
        }
    }
    pub fn snat_pool(mut self, prefix: &'a str) -> Self {
        self.snat_pool = Some(prefix);
        self.lb_lines.push(format!("snat_prefix = \"{prefix}\""));
        self
    }
    pub fn nginx(mut self) -> Self {
        self.nginx = true;
        self
    }
    pub fn agent(mut self, line: &str) -> Self {
        self.agent_lines.push(line.to_string());
        self
    }
    pub fn udp(mut self) -> Self {
        self.udp = true;
        self
    }
    pub fn quic(mut self) -> Self {
        self.udp = true;
        self.quic = true;
        self
    }
    pub fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }
    /// The test loads the machine, or times something a neighbour's load
    /// would delay: it runs alone (see `MACHINE`).
    pub fn alone(mut self) -> Self {
        self.alone = true;
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
    pub fn backend(mut self, server: usize, line: &str) -> Self {
        self.backend_lines.push((server, line.to_string()));
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
    /// Server i's `inband serve` is others[server_at[i - 1]], with its
    /// flags (a stopped server restarts with them).
    server_at: Vec<(usize, Vec<String>)>,
    mode: String,
    vip_lines: Vec<String>,
    lb_lines: Vec<String>,
    backend_lines: Vec<(usize, String)>,
    ipv6: bool,
    udp: bool,
    quic: bool,
    nginx: bool,
    agent_lines: Vec<String>,
    snat_pool: Option<String>,
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

pub fn vip6(tb: &Testbed) -> SocketAddr {
    SocketAddr::new(tb.vip6().into(), 80)
}

pub fn server6(tb: &Testbed, i: usize) -> SocketAddr {
    SocketAddr::new(tb.addr6(&format!("s{i}")).into(), 8080)
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
        let share = if spec.alone {
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
        // A client's receive buffer grows to 6 MB by default, so a server
        // would hand a whole test download to the kernel in milliseconds
        // and close, however slowly curl reads (`--limit-rate`): a test
        // that acts during a download would race it. 256 KB keeps the
        // server sending at the reader's pace.
        for i in 1..=spec.clients {
            run_ok(&tb, &format!("c{i}"), &["sysctl", "-q", "-w", "net.ipv4.tcp_rmem=4096 131072 262144"]);
        }
        let dir = std::env::temp_dir().join(format!("inband-e2e-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster {
            tb,
            dir,
            lb: None,
            others: Vec::new(),
            servers: spec.servers,
            server_at: Vec::new(),
            mode: spec.mode.to_string(),
            vip_lines: spec.vip_lines,
            lb_lines: spec.lb_lines,
            backend_lines: spec.backend_lines,
            ipv6: spec.ipv6,
            udp: spec.udp,
            quic: spec.quic,
            nginx: spec.nginx,
            agent_lines: spec.agent_lines,
            snat_pool: spec.snat_pool.map(str::to_string),
            _share: share,
        };
        if let Some(pool) = &c.snat_pool {
            run_ok(&c.tb, "lb", &["ip", "route", "add", "local", pool, "dev", "lo"]);
        }
        inband_core::auth::keygen(&c.key()).unwrap();
        if c.udp {
            let (cert, key) = (c.quic_cert(), c.dir.join("quic.key"));
            let out = Command::new(BIN)
                .args(["quic", "cert", "--name", QUIC_NAME, "--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap()])
                .output()
                .unwrap();
            assert!(out.status.success(), "inband quic cert: {}", String::from_utf8_lossy(&out.stderr));
        }
        for i in 1..=spec.servers {
            let extra: Vec<&str> = spec.serve_args.get(i - 1).map(|v| v.iter().map(String::as_str).collect()).unwrap_or_default();
            if c.nginx {
                c.start_nginx(i);
            } else {
                c.start_server(i, &extra);
            }
            if c.udp {
                c.start_quic_server(i);
            }
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
            if c.udp {
                // Straight from the balancer's namespace, not through a VIP.
                wait_for(&format!("QUIC server on s{i}"), || quic_get(&c, "lb", server(&c.tb, i).into(), &["--timeout-s", "1"]).ok);
            }
        }
        c
    }

    /// `inband quic serve` on server i, on the port `inband serve` has for
    /// TCP, dual-stack like it.
    pub fn start_quic_server(&mut self, i: usize) {
        let (cert, key) = (self.quic_cert(), self.dir.join("quic.key"));
        let (id, name) = (i.to_string(), format!("s{i}"));
        let serve = [BIN, "quic", "serve", "--listen", "[::]:8080", "--server-id", &id, "--name", &name, "--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap()];
        let s = in_ns(&self.tb, &name, &serve).stdout(Stdio::null()).spawn().unwrap();
        self.others.push(s);
    }

    /// The certificate every QUIC server presents, made for QUIC_NAME.
    pub fn quic_cert(&self) -> PathBuf {
        self.dir.join("quic.crt")
    }

    /// The VIPs' transport, as `inband lb ctl --protocol` takes it.
    pub fn protocol(&self) -> &'static str {
        if self.udp {
            "udp"
        } else {
            "tcp"
        }
    }

    pub fn start_server(&mut self, i: usize, extra: &[&str]) {
        let node = format!("s{i}");
        // Dual-stack for an IPv6 cluster: one socket serves both VIPs.
        let listen = if self.ipv6 { "[::]:8080" } else { "0.0.0.0:8080" };
        let mut serve = vec![BIN, "serve", "--listen", listen, "--service-ms", "20", "--service-dist", "constant"];
        serve.extend_from_slice(extra);
        let s = in_ns(&self.tb, &node, &serve).stdout(Stdio::null()).spawn().unwrap();
        let at = (self.others.len(), extra.iter().map(|a| a.to_string()).collect());
        if self.server_at.len() < i {
            self.server_at.resize(i, (usize::MAX, Vec::new()));
        }
        self.server_at[i - 1] = at;
        self.others.push(s);
    }

    /// Kills server i's application (SIGKILL: no goodbye); its host and
    /// agent stay, so its port refuses connections.
    pub fn kill_server(&mut self, i: usize) {
        let c = &mut self.others[self.server_at[i - 1].0];
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Starts server i's application again, with the flags it had, and
    /// waits until it answers.
    pub fn restart_server(&mut self, i: usize) {
        let (at, extra) = self.server_at[i - 1].clone();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        self.start_server(i, &extra);
        // The new child took a new slot; the old one is reaped already.
        let new = self.others.pop().unwrap();
        self.others[at] = new;
        self.server_at[i - 1].0 = at;
        wait_for(&format!("server on s{i} again"), || http_get(self, server(&self.tb, i), "/stats", false).is_ok());
    }

    /// Server i's host drops every packet that reaches it (`on`), as a host
    /// that hangs or loses its link would; `off` brings it back.
    pub fn silence(&self, i: usize, on: bool) {
        let node = format!("s{i}");
        if on {
            run_ok(&self.tb, &node, &["nft", "add table inet silence"]);
            run_ok(&self.tb, &node, &["nft", "add chain inet silence in { type filter hook input priority -300 ; policy drop ; }"]);
        } else {
            run_ok(&self.tb, &node, &["nft", "delete table inet silence"]);
        }
    }

    /// Stock nginx on server i, port 8080, logging `$remote_addr
    /// $remote_port $request_uri` of every request to `nginx_log(i)` and
    /// answering 200. With IPv6, odd servers listen on separate IPv4 and
    /// IPv6 sockets and even ones on one dual-stack socket (IPv4 clients
    /// on it are IPv4-mapped).
    pub fn start_nginx(&mut self, i: usize) {
        let dir = self.dir.join(format!("nginx-s{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let listen = match (self.ipv6, i % 2) {
            (false, _) => "listen 0.0.0.0:8080;",
            (true, 1) => "listen 0.0.0.0:8080; listen [::]:8080 ipv6only=on;",
            (true, _) => "listen [::]:8080 ipv6only=off;",
        };
        let d = dir.display();
        let conf = format!(
            "daemon off;\nmaster_process on;\nworker_processes 1;\nuser root root;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log warn;\nevents {{ worker_connections 256; }}\nhttp {{\n\
             log_format peer '$remote_addr $remote_port $request_uri';\naccess_log {d}/access.log peer;\n\
             client_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\nfastcgi_temp_path {d}/fastcgi;\n\
             uwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n\
             server {{ {listen} location / {{ return 200 \"ok\\n\"; }} }}\n}}\n"
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let err = dir.join("error.log");
        let argv = ["/usr/sbin/nginx", "-p", dir.to_str().unwrap(), "-e", err.to_str().unwrap(), "-c", path.to_str().unwrap()];
        let s = in_ns(&self.tb, &format!("s{i}"), &argv).stdout(Stdio::null()).spawn().unwrap();
        self.others.push(s);
    }

    pub fn nginx_log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("nginx-s{i}")).join("access.log")
    }

    fn start_agent(&mut self, i: usize) {
        let node = format!("s{i}");
        let cfg = self.dir.join(format!("agent-{node}.toml"));
        let pool = self.snat_pool.as_ref().map(|p| format!(", \"{p}\"")).unwrap_or_default();
        let mut text = format!(
            "interface = \"eth0\"\nbalancers = [\"{}\", \"{}\"{pool}]\nscore_socket = \"{}\"\n\n{}\n[[service]]\nport = 8080\nvip = \"{}\"\nprotocol = \"{}\"\n",
            self.tb.addr("lb"),
            self.tb.addr6("lb"),
            self.agent_socket(i).display(),
            self.auth(),
            vip(&self.tb),
            self.protocol(),
        );
        if self.ipv6 {
            text += &format!("\n[[service]]\nport = 8080\nvip = \"{}\"\nprotocol = \"{}\"\n", vip6(&self.tb), self.protocol());
        }
        text = format!("{}\n{text}", self.agent_lines.join("\n"));
        std::fs::write(&cfg, text).unwrap();
        let a = in_ns(&self.tb, &node, &[BIN, "agent", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
        self.others.push(a);
    }

    /// Stops server i's agent for an upgrade (SIGUSR2: its data path stays
    /// attached) and starts the next one on the same configuration.
    pub fn hand_over_agent(&mut self, i: usize) {
        let cfg = self.dir.join(format!("agent-s{i}.toml"));
        let node = format!("s{i}");
        let filter = |c: &Cluster| String::from_utf8_lossy(&run_ok(&c.tb, &node, &["tc", "filter", "show", "dev", "eth0", "egress"]).stdout).to_string();
        let old = filter(self);
        let out = Command::new("pgrep").args(["-f", &format!("agent --config {}", cfg.display())]).output().unwrap();
        let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("the agent's pid");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(pid, libc::SIGUSR2) };
        wait_for(&format!("agent on s{i} stopped"), || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |st| st.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
        });
        assert_eq!(filter(self), old, "the agent on s{i} left its tc programs attached");
        self.start_agent(i);
        // Attached: its own programs replaced the old ones in place.
        wait_for(&format!("the next agent on s{i}"), || {
            let now = filter(self);
            now != old && now.contains("agent_egress")
        });
    }

    pub fn agent_socket(&self, i: usize) -> PathBuf {
        self.dir.join(format!("agent-s{i}.sock"))
    }

    pub fn lb_config(&self, servers: &[usize]) -> String {
        let vip = |address: String| {
            format!(
                "\n[[vip]]\naddress = \"{address}\"\nport = 80\nprotocol = \"{}\"\nquic = {}\nmode = \"{}\"\nprobe_interval = 4\npoll_interval_ms = 50\n{}\n",
                self.protocol(),
                self.quic,
                self.mode,
                self.vip_lines.join("\n"),
            )
        };
        let backend = |address: IpAddr, i: usize| {
            let id = if self.quic { format!("quic_server_id = {i}\n") } else { String::new() };
            let extra: String = self.backend_lines.iter().filter(|(b, _)| *b == i).map(|(_, l)| format!("{l}\n")).collect();
            format!("\n[[vip.backend]]\naddress = \"{address}\"\nport = 8080\n{id}{extra}")
        };
        let mut s = format!(
            "interface = \"eth0\"\naddress = \"{}\"\naddress6 = \"{}\"\ncontrol_socket = \"{}\"\n{}\n\n{}\n",
            self.tb.addr("lb"),
            self.tb.addr6("lb"),
            self.dir.join("lb.sock").display(),
            self.lb_lines.join("\n"),
            self.auth(),
        );
        s += &vip(self.tb.vip().to_string());
        for i in servers {
            s += &backend(IpAddr::V4(*server(&self.tb, *i).ip()), *i);
        }
        if self.ipv6 {
            s += &vip(self.tb.vip6().to_string());
            for i in servers {
                s += &backend(server6(&self.tb, *i).ip(), *i);
            }
        }
        s
    }

    pub fn start_lb(&mut self) {
        self.start_lb_with(&[]);
    }

    /// `start_lb` with environment variables for the daemon.
    pub fn start_lb_with(&mut self, env: &[(&str, &str)]) {
        let cfg = self.dir.join("lb.toml");
        let child = in_ns(&self.tb, "lb", &[BIN, "lb", "--config", cfg.to_str().unwrap()]).envs(env.iter().copied()).spawn().unwrap();
        self.lb = Some(child);
        wait_for("balancer control socket", || {
            self.ctl_ok(&["set-probe-interval", "--vip", &vip(&self.tb).to_string(), "--protocol", self.protocol(), "--n", &self.probe_n().to_string()])
        });
        // The first SYN waits for the backends' MACs: make sure they are known.
        wait_for("backend MACs", || {
            self.status()[0]["vips"].as_array().unwrap().iter().all(|v| {
                v["backends"].as_array().unwrap().iter().all(|b| b["mac"] != "00:00:00:00:00:00")
            })
        });
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

    /// An agent counter (`inband agent status`), summed over the servers.
    pub fn agent_counter(&self, name: &str) -> u64 {
        (1..=self.servers).map(|i| self.agent_status(i)["counters"][name].as_u64().unwrap()).sum()
    }

    /// Holds `n` idle connections open on server `i`, made straight from
    /// the client's namespace (not through the VIP): its agent counts them
    /// as load. Not from the balancer's: the agents leave a balancer's own
    /// connections (its health checks) out of the count. Returns once the
    /// agent counts them; kill the process to close them.
    pub fn hold_connections(&self, i: usize, n: usize) -> Child {
        let s = server(&self.tb, i);
        let holder = format!(
            "import socket, time\nconns = [socket.create_connection(('{}', {})) for _ in range({n})]\ntime.sleep(120)",
            s.ip(),
            s.port()
        );
        let hog = in_ns(&self.tb, "c1", &["python3", "-c", &holder]).spawn().unwrap();
        wait_for(&format!("{n} connections on s{i}"), || self.agent_status(i)["ports"]["8080"]["active_connections"].as_i64() == Some(n as i64));
        hog
    }

    /// Every agent's nonzero counters, by server: what a failing assertion
    /// on the agents' work prints.
    pub fn agent_counters(&self) -> String {
        (1..=self.servers)
            .map(|i| {
                let counters = self.agent_status(i)["counters"].as_object().cloned().unwrap_or_default();
                let nonzero: Vec<String> = counters.iter().filter(|(_, v)| v.as_u64() != Some(0)).map(|(k, v)| format!("{k}={v}")).collect();
                format!("s{i}: {}", nonzero.join(" "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub fn agent_status(&self, i: usize) -> Value {
        let out = run_ok(&self.tb, &format!("s{i}"), &[BIN, "agent", "status", "--interface", "eth0", "--json"]);
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// Keep-alive GETs over one connection, each body read at a steady rate
/// (bytes/s), as a client on a slower link would: argv = address, port,
/// requests, rate, and optionally the local port to connect from. Prints
/// status, body bytes and local port per response. (curl 7.88's
/// --limit-rate does not hold: 2.5 MB at "500K" arrive in 0.2 s.)
pub const PACED_CLIENT: &str = r#"
import socket, sys, time
addr, port, n, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
local = int(sys.argv[5]) if len(sys.argv) > 5 else 0
s = socket.create_connection((addr, port), timeout=10, source_address=("", local) if local else None)
buf = b""
for _ in range(n):
    s.sendall(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    length = int([l.split(":")[1] for l in lines if l.lower().startswith("content-length")][0])
    got, t0 = len(buf), time.monotonic()
    while got < length:
        ahead = got / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
        chunk = s.recv(min(65536, length - got))
        if not chunk:
            break
        got += len(chunk)
    buf = b""
    print(lines[0].split()[1], got, s.getsockname()[1], flush=True)
"#;

/// One GET of `to` from `node` in the background, its body read at `rate`
/// bytes/s (PACED_CLIENT) from client port `port` (0: any), stopped after
/// `max_s`; `paced_result` reads what it printed. A download that must be
/// live while a test acts on it is paced this way: unpaced, megabytes
/// cross the testbed in a fraction of a second.
pub fn paced_get(tb: &Testbed, node: &str, to: SocketAddr, rate: u64, port: u16, max_s: u32) -> Child {
    let (ip, vport, rate, port, max) = (to.ip().to_string(), to.port().to_string(), rate.to_string(), port.to_string(), max_s.to_string());
    in_ns(tb, node, &["timeout", &max, "python3", "-c", PACED_CLIENT, &ip, &vport, "1", &rate, &port])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A finished `paced_get`'s "status body-bytes" ("" if it printed nothing).
pub fn paced_result(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).split_whitespace().take(2).collect::<Vec<_>>().join(" ")
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
pub fn http_get(c: &Cluster, to: impl Into<SocketAddr>, path: &str, from_client: bool) -> Result<(u16, usize), String> {
    http_get_within(c, to, path, from_client, 5)
}

/// `http_get` that gives up after `max_s` seconds.
pub fn http_get_within(c: &Cluster, to: impl Into<SocketAddr>, path: &str, from_client: bool, max_s: u32) -> Result<(u16, usize), String> {
    let node = if from_client { "c1" } else { "lb" };
    let url = format!("http://{}{path}", to.into());
    let max = max_s.to_string();
    // -g: an IPv6 URL's brackets are the address's, not a glob.
    let out = in_ns(&c.tb, node, &["curl", "-g", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download}", "--max-time", &max, &url])
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

pub fn get_vip6(c: &Cluster) -> (u16, usize) {
    http_get(c, vip6(&c.tb), "/", true).expect("GET via the IPv6 VIP")
}

/// The name the QUIC servers' certificate is made for.
pub const QUIC_NAME: &str = "quic.inband.test";

/// What one `inband quic get --json` printed.
pub struct QuicRun {
    pub ok: bool,
    /// One object per answered request (`server_id`, `peer`, `local`, ...).
    pub answers: Vec<Value>,
    pub outcome: Value,
    pub stderr: String,
}

impl QuicRun {
    pub fn server_ids(&self) -> Vec<u64> {
        self.answers.iter().map(|a| a["server_id"].as_u64().unwrap()).collect()
    }
}

/// `inband quic get` from `node` to `to` with the cluster's certificate;
/// `extra`: more flags (--requests, --migrate-after...).
pub fn quic_get(c: &Cluster, node: &str, to: SocketAddr, extra: &[&str]) -> QuicRun {
    let (to, cert) = (to.to_string(), c.quic_cert());
    let mut cmd = vec![BIN, "quic", "get", "--json", "--connect", &to, "--cert", cert.to_str().unwrap(), "--server-name", QUIC_NAME];
    cmd.extend_from_slice(extra);
    let out = in_ns(&c.tb, node, &cmd).output().expect("spawn inband quic get");
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("inband quic get printed {l:?}: {e}")))
        .collect();
    let (outcome, answers): (Vec<Value>, Vec<Value>) = lines.into_iter().partition(|v| v.get("outcome").is_some());
    QuicRun {
        ok: out.status.success(),
        answers,
        outcome: outcome.into_iter().next().unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

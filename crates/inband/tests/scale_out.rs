//! Several `inband lb` instances behind an ECMP router (issue 12): the
//! router spreads an IPv6 VIP over the instances by SRv6; each instance
//! balances its share over the same servers (dsr-dynamic, full NAT from
//! its own address, responses straight to the client). Changing the
//! router's next hops moves connections to instances that do not hold
//! them; they chain such packets back to the router's shadow table, which
//! delivers them to the instance that does. Real TCP downloads, every byte
//! counted, while an instance is added, removed, restarted and killed -9;
//! and the same change without the shadow table must break downloads, or
//! the rest would prove nothing. With BGP (BIRD on the router and on each
//! instance), announcing and withdrawing the VIP is how an instance joins
//! and leaves, and `inband shadow follow` makes each change. An IPv4 VIP
//! takes the same path as IPv4 in IPv6, with the router's IPv4 shadow
//! program in place of End.DT6.
//!
//! Needs root (namespaces, XDP, tc, bpffs).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use inband_testkit::testbed::bgp;
use inband_testkit::testbed::ecmp::{hex, Plan};
use inband_testkit::testbed::{Testbed, TestbedSpec};
use serde_json::Value;

mod cluster;
use cluster::{paced_get, paced_result, run_ok, wait_for, BIN};
const BODY: usize = 2_500_000;
/// Concurrent downloads per step: with 16, the chance that a change of
/// one next hop in three moves none of them is (2/3)^16, 0.15%.
const DOWNLOADS: usize = 16;
/// Each download's pace (bytes/s, PACED_CLIENT): BODY takes 5 s at it, so
/// none ends before the last of its step has started, on a machine slow
/// to start processes too (alone on the router's 64 Mbit/s a download
/// ended in 0.3 s, and a step that waits for all of them to be
/// established at once waited for one already done). DOWNLOADS of them
/// fill the 64 Mbit/s.
const DOWNLOAD_RATE: u64 = 500_000;
const SERVERS: usize = 2;

/// The VIP the instances serve.
#[derive(Clone, Copy, PartialEq)]
enum Vip {
    /// dsr-dynamic, each instance's own tuples.
    Dynamic,
    /// dsr-dynamic with fleet tuples: the agents steer the 125s to the
    /// instance the flow label names.
    DynamicFleet,
    /// dsr-rr with policy maglev, fleet tuples on (true) or off.
    Maglev(bool),
    /// dsr-dynamic (least-score) with fleet tuples, each instance listing
    /// the others as `peers`: it announces its choices to them.
    Announced,
}


/// How an instance's host dies (issue 28): the program gone behind a
/// link that stays up, the router's link to it losing carrier, or the
/// router's end of that link gone.
#[derive(Clone, Copy, Debug)]
enum Crash {
    ProgramGone,
    CarrierLost,
    InterfaceGone,
}

/// The testbed, its servers and agents, and one balancer process per
/// instance (restartable); everything stops and detaches when dropped.
struct Farm {
    tb: Testbed,
    dir: PathBuf,
    lbs: Vec<Option<Child>>,
    /// The VIP (and the backends) in IPv4: the router carries it as IPv4
    /// in IPv6, its IPv4 shadow program takes the strays.
    v4: bool,
    /// The router's config for `inband shadow route`.
    router_cfg: PathBuf,
}

impl Drop for Farm {
    fn drop(&mut self) {
        for c in self.lbs.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for i in 1..=self.lbs.len() {
            let _ = self.tb.exec(&format!("b{i}"), &[BIN, "lb", "detach", "--interface", "eth0", "--force"]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Farm {
    fn up(tag: &str, subnet: u8, balancers: usize, bgp: bool) -> Farm {
        Farm::up_family(tag, subnet, balancers, bgp, false, Vip::Dynamic)
    }

    fn up_family(tag: &str, subnet: u8, balancers: usize, bgp: bool, v4: bool, vip_kind: Vip) -> Farm {
        let name = format!("x{}{tag}", std::process::id() % 10000);
        let spec = TestbedSpec { name: name.clone(), clients: 1, servers: SERVERS, subnet, ecmp: true, balancers, bgp, ..Default::default() };
        let mut tb = Testbed::up(spec).expect("testbed");
        let dir = std::env::temp_dir().join(format!("inband-scale-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("auth.key");
        inband_core::auth::keygen(&key).unwrap();
        let auth = format!("[auth]\nkeys = [{{ id = 1, file = \"{}\" }}]\n", key.display());
        let fleet_key = dir.join("fleet.key");
        inband_core::auth::keygen(&fleet_key).unwrap();
        let fleet_prefix = fleet_prefix(subnet);
        let fleet = matches!(vip_kind, Vip::DynamicFleet | Vip::Maglev(true) | Vip::Announced);
        let (agent_fleet, lb_fleet) = if fleet {
            (
                format!("fleet_prefixes = [\"{fleet_prefix}\"]\n"),
                format!("fleet = true\nfleet_prefix = \"{fleet_prefix}\"\nfleet_key = \"{}\"\n", fleet_key.display()),
            )
        } else {
            (String::new(), String::new())
        };
        let vip_mode = match vip_kind {
            Vip::Dynamic | Vip::DynamicFleet | Vip::Announced => "mode = \"dsr-dynamic\"\nprobe_interval = 4\n",
            Vip::Maglev(_) => "mode = \"dsr-rr\"\npolicy = \"maglev\"\n",
        };
        // The router sends to the client at 64 Mbit/s (a token bucket on
        // its link): DOWNLOADS downloads of BODY take seconds, paced by the
        // network whatever else the machine runs; the client's small
        // receive buffer keeps each server sending at that pace.
        run_ok(&tb, "r1", &["tc", "qdisc", "add", "dev", "c1", "root", "tbf", "rate", "64mbit", "burst", "64kb", "latency", "400ms"]);
        run_ok(&tb, "c1", &["sysctl", "-q", "-w", "net.ipv4.tcp_rmem=4096 131072 262144"]);
        let balancer_list: Vec<String> = (1..=balancers)
            .map(|i| if v4 { format!("\"{}\"", tb.addr(&format!("b{i}"))) } else { format!("\"{}\"", tb.addr6(&format!("b{i}"))) })
            .collect();
        let vip = if v4 { SocketAddr::new(tb.vip().into(), 80) } else { SocketAddr::new(tb.vip6().into(), 80) };
        for i in 1..=SERVERS {
            let node = format!("s{i}");
            tb.spawn(&node, &[BIN, "serve", "--listen", if v4 { "0.0.0.0:8080" } else { "[::]:8080" }, "--service-ms", "1", "--body-bytes", &BODY.to_string()]).unwrap();
            let cfg = dir.join(format!("agent-{node}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "interface = \"eth0\"\nbalancers = [{}]\n{agent_fleet}score_socket = \"{}\"\n\n{auth}\n[[service]]\nport = 8080\nvip = \"{vip}\"\n",
                    balancer_list.join(", "),
                    dir.join(format!("agent-{node}.sock")).display(),
                ),
            )
            .unwrap();
            tb.spawn(&node, &[BIN, "agent", "--config", cfg.to_str().unwrap()]).unwrap();
        }
        let plan = Plan { subnet: hex(subnet) };
        for i in 1..=balancers {
            let node = format!("b{i}");
            let address4 = if v4 { format!("address = \"{}\"\n", tb.addr(&node)) } else { String::new() };
            let peers = if vip_kind == Vip::Announced {
                let others: Vec<String> = (1..=balancers).filter(|&j| j != i).map(|j| format!("\"{}\"", tb.addr6(&format!("b{j}")))).collect();
                format!("peers = [{}]\n", others.join(", "))
            } else {
                String::new()
            };
            let mut text = format!(
                "interface = \"eth0\"\n{address4}address6 = \"{}\"\ncontrol_socket = \"{}\"\n\n[scale_out]\nsid = \"{}\"\ndirect_sid = \"{}\"\nshadow_sid = \"{}\"\n{lb_fleet}{peers}\n{auth}\n[[vip]]\naddress = \"{}\"\nport = 80\n{vip_mode}",
                tb.addr6(&node),
                dir.join(format!("lb-{node}.sock")).display(),
                plan.sid(i),
                plan.direct_sid(i),
                plan.shadow_sid(),
                vip.ip(),
            );
            for s in 1..=SERVERS {
                let backend = if v4 { tb.addr(&format!("s{s}")).to_string() } else { tb.addr6(&format!("s{s}")).to_string() };
                text += &format!("\n[[vip.backend]]\naddress = \"{backend}\"\nport = 8080\n");
            }
            std::fs::write(dir.join(format!("lb-{node}.toml")), text).unwrap();
        }
        // The testbed's router.toml routes the IPv6 VIP; the IPv4 one, and
        // the fleet's prefix (routed nowhere), get a copy.
        let mut router_cfg = tb.router_config.clone().unwrap();
        if v4 || fleet {
            let mut text = std::fs::read_to_string(&router_cfg).unwrap();
            if v4 {
                text = text.replace(&format!("vip = \"{}\"", tb.vip6()), &format!("vip = \"{}\"", tb.vip()));
            }
            if fleet {
                text = format!("fleet_prefix = \"{fleet_prefix}\"\n{text}");
            }
            router_cfg = dir.join("router-own.toml");
            std::fs::write(&router_cfg, text).unwrap();
        }
        let mut farm = Farm { tb, dir, lbs: (0..balancers).map(|_| None).collect(), v4, router_cfg };
        for i in 1..=balancers {
            farm.start_lb(i);
        }
        for i in 1..=SERVERS {
            wait_for(&format!("the agent on s{i}"), || {
                let out = run_ok(&farm.tb, &format!("s{i}"), &["tc", "filter", "show", "dev", "eth0", "egress"]);
                String::from_utf8_lossy(&out.stdout).contains("agent_egress")
            });
            wait_for(&format!("the server on s{i}"), || !run_ok(&farm.tb, &format!("s{i}"), &["ss", "-Htln", "sport", "= :8080"]).stdout.is_empty());
        }
        farm
    }

    fn start_lb(&mut self, i: usize) {
        let node = format!("b{i}");
        let cfg = self.dir.join(format!("lb-{node}.toml"));
        let child = self.tb.command(&node, &[BIN, "lb", "--config", cfg.to_str().unwrap()]).spawn().unwrap();
        self.lbs[i - 1] = Some(child);
        // The first SYN waits for the servers' next hop (the router): make
        // sure the instance knows its MAC.
        wait_for(&format!("{node} to resolve its backends"), || {
            self.status(i)["vips"][0]["backends"].as_array().is_some_and(|b| b.len() == SERVERS && b.iter().all(|b| b["mac"] != "00:00:00:00:00:00"))
        });
    }

    /// Stops instance `i`'s daemon: SIGTERM, or SIGKILL with `kill`. The
    /// data path stays attached either way, as in production.
    fn stop_lb(&mut self, i: usize, kill: bool) {
        let mut c = self.lbs[i - 1].take().expect("a running instance");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, if kill { libc::SIGKILL } else { libc::SIGTERM }) };
        c.wait().unwrap();
    }

    fn status(&self, i: usize) -> Value {
        let node = format!("b{i}");
        let out = self.tb.exec(&node, &[BIN, "status", "--json", "--netns", &self.tb.netns(&node)]).unwrap();
        let all: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        all.as_array().and_then(|a| a.first().cloned()).unwrap_or(Value::Null)
    }

    /// Every instance's non-zero drop and event counters, for a failure's message.
    fn report(&self) -> String {
        let mut out = String::new();
        for i in 1..=self.lbs.len() {
            let s = self.status(i);
            let nonzero = |v: &Value| -> String {
                v.as_object().map(|m| m.iter().filter(|(_, n)| n.as_u64() != Some(0)).map(|(k, n)| format!("{k}={n} ")).collect()).unwrap_or_default()
            };
            out += &format!("\nb{i}: drops {}| events {}", nonzero(&s["drops"]), nonzero(&s["events"]));
        }
        out
    }

    fn event(&self, i: usize, name: &str) -> u64 {
        self.status(i)["events"][name].as_u64().unwrap_or(0)
    }

    fn drop_count(&self, i: usize, name: &str) -> u64 {
        self.status(i)["drops"][name].as_u64().unwrap_or(0)
    }

    /// Instance 1's host dies as `form` says, its daemon killed -9 and
    /// nothing of it cleaning up; 1 s later the router withdraws it,
    /// substituting a live instance's direct SID for its shadow hops
    /// (`liveness = "echo"`: a program gone behind a link that is up is
    /// found by probing).
    fn crash_b1(&mut self, form: Crash) {
        self.stop_lb(1, true);
        match form {
            Crash::ProgramGone => {
                run_ok(&self.tb, "b1", &["ip", "link", "set", "dev", "eth0", "xdp", "off"]);
                run_ok(&self.tb, "b1", &["sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=0"]);
            }
            Crash::CarrierLost => drop(run_ok(&self.tb, "b1", &["ip", "link", "set", "eth0", "down"])),
            Crash::InterfaceGone => drop(run_ok(&self.tb, "r1", &["ip", "link", "del", "b1"])),
        }
        std::thread::sleep(Duration::from_secs(1));
        let echo_cfg = self.dir.join("router-echo.toml");
        std::fs::write(&echo_cfg, format!("liveness = \"echo\"\n{}", std::fs::read_to_string(&self.router_cfg).unwrap())).unwrap();
        run_ok(&self.tb, "r1", &[BIN, "shadow", "route", "--config", echo_cfg.to_str().unwrap(), "--up", "b2,b3"]);
    }

    /// b1's host comes back from `crash_b1(form)` (its daemon not yet
    /// started); an interface that is gone does not come back.
    fn revive_b1_host(&self, form: Crash) {
        match form {
            Crash::ProgramGone => drop(run_ok(&self.tb, "b1", &["sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"])),
            Crash::CarrierLost => {
                // IPv6 took the link's address and routes away with it.
                let addr = self.tb.addr6("b1");
                let mut gw = addr.segments();
                gw[7] = 1;
                run_ok(&self.tb, "b1", &["ip", "link", "set", "eth0", "up"]);
                run_ok(&self.tb, "b1", &["ip", "-6", "addr", "replace", &format!("{addr}/64"), "dev", "eth0", "nodad"]);
                inband_testkit::testbed::netns::wait_ipv6_usable(&self.tb.netns("b1")).unwrap();
                run_ok(&self.tb, "b1", &["ip", "-6", "route", "replace", "default", "via", &std::net::Ipv6Addr::from(gw).to_string()]);
            }
            Crash::InterfaceGone => panic!("b1's interface on the router is gone for good"),
        }
    }

    /// Points the router's VIP route at `up` (instance numbers), the
    /// shadow table at the set before (unless `plain`).
    fn route(&self, up: &[usize], plain: bool) {
        let cfg = self.router_cfg.clone();
        let list = up.iter().map(|i| format!("b{i}")).collect::<Vec<_>>().join(",");
        let mut argv = vec![BIN, "shadow", "route", "--config", cfg.to_str().unwrap(), "--up", &list];
        if plain {
            argv.push("--plain");
        }
        run_ok(&self.tb, "r1", &argv);
    }

    /// Instance `i`'s BIRD: `enable` or `disable` its announcement of the VIP.
    fn announce(&self, i: usize, on: bool) {
        let node = format!("b{i}");
        let sock = bgp::socket(&self.tb, &node);
        run_ok(&self.tb, &node, &["birdc", "-s", sock.to_str().unwrap(), if on { "enable" } else { "disable" }, "vip"]);
    }

    /// Each hop of the VIP's route in the router's `table` ("main" or a
    /// number): its first segment (the router's own routes, whose hops
    /// have no gateway), or its gateway (routes BGP learned).
    fn hops(&self, table: &str) -> Vec<String> {
        route_hops(&self.tb, table).iter().filter_map(|h| h["segs"][0].as_str().or(h["gateway"].as_str()).map(str::to_string)).collect()
    }

    /// The VIP's current next hops, as instance numbers.
    fn routed(&self) -> Vec<usize> {
        let hops = self.hops("main");
        let plan = Plan { subnet: hex(self.tb.spec.subnet) };
        (1..=self.lbs.len()).filter(|i| hops.contains(&plan.sid(*i).to_string())).collect()
    }

    /// The VIP's URL.
    fn url(&self) -> String {
        if self.v4 {
            format!("http://{}/", self.tb.vip())
        } else {
            format!("http://[{}]/", self.tb.vip6())
        }
    }

    fn downloads(&self) -> Vec<Child> {
        (0..DOWNLOADS).map(|_| self.paced_download(0)).collect()
    }

    /// `n` downloads from the client ports `first`.., each with its port.
    fn downloads_from(&self, first: u16, n: usize) -> Vec<(u16, Child)> {
        (first..first + n as u16).map(|port| (port, self.paced_download(port))).collect()
    }

    /// DOWNLOADS downloads under way from client ports `first`.., at least
    /// one of them through instance `i`, with the ports it holds. The
    /// router's multipath hash is seeded once per boot, so the same ports
    /// go the same way in every run of a boot, and on some boots 16 of
    /// them send none to one of three instances: a step that needs it to
    /// hold connections would prove nothing. Such a batch is ended and the
    /// next ports tried. (`ip route get` cannot choose the ports: its hash
    /// of a tuple is not the one the router forwards by; it named b1 for 8
    /// of 16 ports of which b1 held none.)
    fn downloads_through(&self, i: usize, first: u16) -> (Vec<(u16, Child)>, Vec<u16>) {
        for from in (0..4).map(|k| first + 100 * k) {
            let ours = from..from + DOWNLOADS as u16;
            let dls = self.downloads_from(from, DOWNLOADS);
            self.wait_started(DOWNLOADS);
            let held: Vec<u16> = self.held(i).into_iter().filter(|p| ours.contains(p)).collect();
            if !held.is_empty() {
                return (dls, held);
            }
            for (_, mut c) in dls {
                let _ = c.kill();
                let _ = c.wait();
            }
            wait_for("the client's downloads to end", || self.under_way() == 0);
        }
        panic!("b{i} held none of 4 batches of {DOWNLOADS} downloads from client port {first}");
    }

    /// One download of the VIP's BODY at DOWNLOAD_RATE, from client port
    /// `port` (0: any).
    fn paced_download(&self, port: u16) -> Child {
        let vip = if self.v4 { IpAddr::from(self.tb.vip()) } else { IpAddr::from(self.tb.vip6()) };
        paced_get(&self.tb, "c1", SocketAddr::new(vip, 80), DOWNLOAD_RATE, port, 20)
    }

    /// The client ports instance `i` holds flows of (its pinned `flows`).
    fn held(&self, i: usize) -> Vec<u16> {
        self.flows(i).iter().map(|(port, _)| *port).collect()
    }

    /// Instance `i`'s pinned `flows`, by client port.
    fn flows(&self, i: usize) -> Vec<(u16, inband_lb::maps::Flow)> {
        use inband_lb::maps::{Flow, FlowKey};
        let pin = format!("/sys/fs/bpf/inband/netns/{}/lb/eth0/flows", self.tb.netns(&format!("b{i}")));
        let map = libbpf_rs::MapHandle::from_pinned_path(pin).unwrap();
        inband_core::bpfmap::entries::<FlowKey, Flow>(&map).unwrap().into_iter().map(|(k, f)| (inband_core::pod::port_of(k.client_port), f)).collect()
    }

    /// Scores instance `i` took from 125s, over the VIP's backends.
    fn scores_received(&self, i: usize) -> u64 {
        let s = self.status(i);
        s["vips"][0]["backends"].as_array().map_or(0, |b| b.iter().map(|b| b["stats"]["scores_received"].as_u64().unwrap_or(0)).sum())
    }

    /// `inband agent status --json` of the agent on server `i`.
    fn agent_status(&self, i: usize) -> Value {
        let out = run_ok(&self.tb, &format!("s{i}"), &[BIN, "agent", "status", "--interface", "eth0", "--json"]);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Counter `name` of the agent on server `i`.
    fn agent_counter(&self, i: usize, name: &str) -> u64 {
        self.agent_status(i)["counters"][name].as_u64().unwrap_or(0)
    }

    /// How many of the client's downloads from the VIP are under way:
    /// established, or in CLOSE-WAIT (the server has sent the whole body
    /// and closed, and the paced reader is still draining it: under load
    /// an early download gets there before the last one has started).
    fn under_way(&self) -> usize {
        let out = run_ok(&self.tb, "c1", &["ss", "-Htn", "state", "established", "state", "close-wait", "dport", "= :80"]);
        String::from_utf8_lossy(&out.stdout).lines().count()
    }

    /// The client's sockets toward the VIP on ports `ports` whose FIN is
    /// still unacknowledged 3 s after their downloads ended (LAST-ACK,
    /// FIN-WAIT-1, CLOSING), as ss prints them: a server's last ACK that
    /// left its host without the DSR rewrite went to the balancer's tuple,
    /// and with fleet tuples that reaches no instance; the client then
    /// retransmits its FIN for minutes, its port taken.
    fn unacknowledged_fins(&self, ports: std::ops::Range<u16>) -> Vec<String> {
        let list = || {
            let out = run_ok(&self.tb, "c1", &["ss", "-Htan", "state", "last-ack", "state", "fin-wait-1", "state", "closing", "dport", "= :80"]);
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.split_whitespace().find_map(|w| w.rsplit_once(':')?.1.parse::<u16>().ok()).is_some_and(|p| ports.contains(&p)))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let left = list();
            if left.is_empty() || Instant::now() >= deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until `n` of the client's downloads from the VIP are under
    /// way; if they are not within wait_for's time, fails with
    /// every socket of the client's toward port 80 and the instances'
    /// counters, which tell a lost SYN from a connection that hangs.
    fn wait_started(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.under_way() != n {
            if Instant::now() >= deadline {
                let out = run_ok(&self.tb, "c1", &["ss", "-tani", "dport", "= :80"]);
                panic!("timed out waiting for {n} downloads to start:\n{}{}", String::from_utf8_lossy(&out.stdout), self.report());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts DOWNLOADS downloads, runs `change` once all are under way,
    /// and returns how many completed with every byte.
    fn across(&mut self, change: impl FnOnce(&mut Farm)) -> usize {
        let dls = self.downloads();
        self.wait_started(DOWNLOADS);
        change(self);
        dls.into_iter()
            .map(|d| d.wait_with_output().unwrap())
            .filter(|o| {
                let whole = complete(o);
                if !whole {
                    eprintln!("a download ended with {:?}: {}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr).trim());
                }
                whole
            })
            .count()
    }
}

/// The hops of the VIP's route in the router's `table` ("main" or a
/// number), as `ip -j route` prints them.
fn route_hops(tb: &Testbed, table: &str) -> Vec<Value> {
    // A table the kernel has not made yet (no route in it) is an error: no hops.
    let out = tb.exec("r1", &["ip", "-6", "-j", "route", "show", "table", table, &format!("{}/128", tb.vip6())]).unwrap();
    let routes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let Some(r) = routes.get(0) else { return Vec::new() };
    r["nexthops"].as_array().cloned().unwrap_or_else(|| vec![r.clone()])
}

/// The fleet's source prefix in a testbed on `subnet`: no node's address.
fn fleet_prefix(subnet: u8) -> String {
    format!("fd00:f1ee:{subnet}::/96")
}

fn total(farm: &Farm, n: usize, f: impl Fn(&Farm, usize) -> u64) -> u64 {
    (1..=n).map(|i| f(farm, i)).sum()
}

#[test]
fn instances_join_leave_restart_and_crash_under_load_without_breaking_a_download() {
    let mut farm = Farm::up("a", 81, 3, false);
    farm.route(&[1, 2], false);
    wait_for("the VIP to answer", || {
        let url = format!("http://[{}]/", farm.tb.vip6());
        farm.tb.exec("c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "3", &url]).map(|o| o.status.success()).unwrap_or(false)
    });

    let so = &farm.status(1)["scale_out"];
    let plan = Plan { subnet: hex(81) };
    assert_eq!((so["sid"].as_str(), so["shadow_sid"].as_str()), (Some(plan.sid(1).to_string().as_str()), Some(plan.shadow_sid().to_string().as_str())));

    // Joining: b3 takes a third of the hash space, connections included.
    let ok = farm.across(|f| f.route(&[1, 2, 3], false));
    assert_eq!(ok, DOWNLOADS, "downloads broken by b3 joining{}", farm.report());
    assert!(farm.event(3, "chained") > 0, "no connection moved to b3: the step proved nothing");
    assert!(farm.event(1, "srv6_direct") + farm.event(2, "srv6_direct") > 0, "chained packets never reached their owners");

    // Leaving: b1 is withdrawn and keeps serving what it holds.
    let before = total(&farm, 3, |f, i| f.event(i, "srv6_direct"));
    let ok = farm.across(|f| f.route(&[2, 3], false));
    assert_eq!(ok, DOWNLOADS, "downloads broken by b1 leaving{}", farm.report());
    assert!(farm.event(1, "srv6_direct") > 0, "no connection of b1's moved away: the step proved nothing");
    assert!(total(&farm, 3, |f, i| f.event(i, "srv6_direct")) > before);

    // A daemon restarted (SIGTERM) and one killed -9 and started again:
    // their data paths and flow tables stay.
    let ok = farm.across(|f| {
        f.stop_lb(2, false);
        f.stop_lb(3, true);
        std::thread::sleep(Duration::from_millis(500));
        f.start_lb(2);
        f.start_lb(3);
    });
    assert_eq!(ok, DOWNLOADS, "downloads broken by restarting b2 and killing b3{}", farm.report());

    // Nothing found no owner along the way.
    for i in 1..=3 {
        assert_eq!(farm.drop_count(i, "chained_no_flow"), 0, "b{i} dropped chained packets");
        assert_eq!(farm.drop_count(i, "srv6_unsupported"), 0, "b{i}");
    }
    // Load awareness kept working on every instance: each got in-band
    // scores (125s, authenticated) for the backends it sent flows to, and
    // none failed its MAC or format. (A 125 that answers a retransmitted
    // 124, or arrives after its flow ended, is `score_unsolicited`:
    // dropped, and expected when packets are retransmitted.)
    for i in 1..=3 {
        let st = farm.status(i);
        let scored = st["vips"][0]["backends"].as_array().unwrap().iter().filter(|b| b["score"].is_u64()).count();
        assert!(scored >= 1, "b{i} holds no in-band score: {}", st["vips"][0]["backends"]);
        for e in ["score_bad_mac", "score_wrong_format"] {
            assert_eq!(farm.event(i, e), 0, "b{i}: {e}{}", farm.report());
        }
    }

    // The same join without the shadow table breaks the moved connections:
    // their packets reach an instance without them and, chained to a
    // shadow SID with no table behind it, go nowhere.
    farm.route(&[2, 3], true);
    let ok = farm.across(|f| f.route(&[1, 2, 3], true));
    assert!(ok < DOWNLOADS, "every download survived a plain ECMP change: the test cannot tell shadowing from luck");
}

/// An IPv4 VIP behind the same router (issue 28, item 5): the router's
/// route carries it to the instances as IPv4 in IPv6, the instances chain
/// IPv4 strays as IPv4 in IPv6 to the shadow SIDs, and the router's IPv4
/// shadow program unwraps them into the shadow table (End.DT4 needs a VRF
/// device this kernel lacks). Instances join and leave under load; no
/// download breaks, and the same change without the shadow table does.
#[test]
fn an_ipv4_vip_keeps_every_download_as_instances_join_and_leave() {
    let mut farm = Farm::up_family("v", 87, 3, false, true, Vip::Dynamic);
    farm.route(&[1, 2], false);
    let answers = |f: &Farm| f.tb.exec("c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "3", &f.url()]).map(|o| o.status.success()).unwrap_or(false);
    wait_for("the IPv4 VIP to answer", || answers(&farm));
    let unwrapped = |f: &Farm| {
        let out = run_ok(&f.tb, "r1", &[BIN, "shadow", "status", "--router", "--json"]);
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["unwrapped"]["packets"].as_u64().unwrap()
    };

    let set_generations = |f: &Farm, g: u32| {
        let text = std::fs::read_to_string(&f.router_cfg).unwrap();
        let text: String = text.lines().filter(|l| !l.starts_with("generations")).map(|l| format!("{l}\n")).collect();
        std::fs::write(&f.router_cfg, format!("generations = {g}\n{text}")).unwrap();
    };
    let rules = |f: &Farm| String::from_utf8_lossy(&run_ok(&f.tb, "r1", &["ip", "-4", "rule", "show"]).stdout).into_owned();
    // Each generation's table, then a drop for a stray its table has no route for.
    let has = |f: &Farm, mark: &str, table: u32| {
        let r = rules(f);
        (r.contains(&format!("fwmark {mark} lookup {table}")), r.contains(&format!("fwmark {mark} blackhole")))
    };

    // The router's exporter, counting the program's runs from here on.
    const METRICS: &str = "127.0.0.1:9464";
    farm.tb.spawn("r1", &[BIN, "shadow", "metrics", "--listen", METRICS, "--bpf-stats"]).unwrap();
    let scrape = |f: &Farm| {
        let out = f.tb.exec("r1", &["curl", "-sf", "--max-time", "5", &format!("http://{METRICS}/metrics")]).unwrap();
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    wait_for("the router's exporter", || scrape(&farm).is_some());
    let sample = |text: &str, series: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0) };
    let counted = |text: &str| -> f64 { ["unwrapped", "not_taken", "failed"].iter().map(|c| sample(text, &format!("inband_shadow_dt4_packets_total{{counter=\"{c}\"}}"))).sum() };
    let runs = "inband_shadow_bpf_program_runs_total{program=\"shadow_dt4\"}";
    let before = scrape(&farm).unwrap();

    // Joining: b3 takes a third of the hash space; what it does not hold
    // goes back as IPv4 in IPv6, the router unwraps it into table 200,
    // whose hops go to the owners' direct SIDs.
    let ok = farm.across(|f| f.route(&[1, 2, 3], false));
    assert_eq!(ok, DOWNLOADS, "downloads broken by b3 joining{}", farm.report());
    assert!(farm.event(3, "chained") > 0, "no connection moved to b3: the step proved nothing");
    assert!(farm.event(1, "srv6_direct") + farm.event(2, "srv6_direct") > 0, "chained packets never reached their owners");
    assert!(unwrapped(&farm) > 0, "the router's IPv4 shadow program unwrapped nothing");
    // The exporter shows what `status --router` counts, and the program
    // ran at least once per packet it counted. The route run reloaded it
    // (its runs start at 0, the pinned counters carry on), and before
    // that run nothing was a stray: its runs alone must cover the step.
    let after = scrape(&farm).unwrap();
    inband_http::check_exposition(&after).unwrap_or_else(|e| panic!("{e}\n{after}"));
    assert_eq!(sample(&after, "inband_shadow_dt4_packets_total{counter=\"unwrapped\"}"), unwrapped(&farm) as f64, "{after}");
    let (seen, ran) = (counted(&after) - counted(&before), sample(&after, runs));
    assert!(seen > 0.0 && ran >= seen, "{ran} runs for {seen} packets counted\n{after}");
    assert!(answers(&farm), "a short request failed after b3 joined");

    // Leaving, with two generations from here: b1 is withdrawn and keeps
    // serving what it holds. Table 200 now sends to each owner's
    // conditional SID with generation 2's SID as a second segment, so
    // after the change b1 gets only IPv4 under a two-segment SRH.
    set_generations(&farm, 2);
    let mut at_change = 0;
    let ok = farm.across(|f| {
        f.route(&[2, 3], false);
        at_change = f.event(1, "srv6_cond");
    });
    assert_eq!(ok, DOWNLOADS, "downloads broken by b1 leaving{}", farm.report());
    assert!(farm.event(1, "srv6_cond") > at_change, "no connection of b1's reached it after it left: the step proved nothing");
    assert!(answers(&farm), "a short request failed after b1 left");
    assert_eq!((has(&farm, "0x1b5e00c8", 200), has(&farm, "0x1b5e00c9", 201)), ((true, true), (true, true)), "{}", rules(&farm));
    for i in 1..=3 {
        assert_eq!(farm.drop_count(i, "chained_no_flow"), 0, "b{i} dropped chained packets{}", farm.report());
        assert_eq!(farm.drop_count(i, "srv6_unsupported"), 0, "b{i}{}", farm.report());
    }
    let out = run_ok(&farm.tb, "r1", &[BIN, "shadow", "status", "--router", "--json"]);
    let counts: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(counts["failed"]["packets"], 0, "{counts}");

    // Fewer generations, fewer rules (at the next run, with the set unchanged).
    set_generations(&farm, 1);
    farm.route(&[2, 3], false);
    assert_eq!((has(&farm, "0x1b5e00c8", 200), has(&farm, "0x1b5e00c9", 201)), ((true, true), (false, false)), "{}", rules(&farm));

    // Without the shadow table the moved connections break: the test can tell.
    farm.route(&[2, 3], true);
    let ok = farm.across(|f| f.route(&[1, 2, 3], true));
    assert!(ok < DOWNLOADS, "every download survived a plain ECMP change: the test cannot tell shadowing from luck");
}

#[test]
fn instances_join_and_leave_by_bgp_without_breaking_a_download() {
    let mut farm = Farm::up("g", 84, 3, true);
    farm.announce(3, false);
    wait_for("BGP to learn b1 and b2", || farm.hops(&bgp::LEARNED_TABLE.to_string()).len() == 2);
    let cfg = farm.tb.router_config.clone().unwrap();
    let table = bgp::LEARNED_TABLE.to_string();
    farm.tb.spawn("r1", &[BIN, "shadow", "follow", "--config", cfg.to_str().unwrap(), "--table", &table]).unwrap();
    wait_for("the VIP's route to follow BGP", || farm.routed() == [1, 2]);

    // b3's BIRD announces the VIP: the router learns it, the follower
    // adds it with the old set in the shadow table.
    let ok = farm.across(|f| {
        f.announce(3, true);
        wait_for("b3 in the VIP's route", || f.routed() == [1, 2, 3]);
    });
    assert_eq!(ok, DOWNLOADS, "downloads broken by b3 announcing{}", farm.report());
    assert!(farm.event(3, "chained") > 0, "no connection moved to b3: the step proved nothing");
    assert_eq!(farm.hops("200").len(), 2, "the shadow table holds the set before");

    // b1 withdraws, and keeps serving what it holds.
    let ok = farm.across(|f| {
        f.announce(1, false);
        wait_for("b1 out of the VIP's route", || f.routed() == [2, 3]);
    });
    assert_eq!(ok, DOWNLOADS, "downloads broken by b1 withdrawing{}", farm.report());
    assert!(farm.event(1, "srv6_direct") > 0, "no connection of b1's moved away: the step proved nothing");
    for i in 1..=3 {
        assert_eq!(farm.drop_count(i, "chained_no_flow"), 0, "b{i} dropped chained packets");
    }
}

/// The group of the VIP's route in the router's `table` ("main" or a
/// number): each member's segments, in the group's order.
fn group(tb: &Testbed, table: &str) -> Vec<Vec<String>> {
    group_or_none(tb, table).unwrap_or_else(|| panic!("table {table}: no VIP route on a group"))
}

/// As `group`, None while the table has no such route.
fn group_or_none(tb: &Testbed, table: &str) -> Option<Vec<Vec<String>>> {
    let out = tb.exec("r1", &["ip", "-6", "-j", "route", "show", "table", table, &format!("{}/128", tb.vip6())]).unwrap();
    let routes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let nhid = routes[0]["nhid"].as_u64()?;
    let nexthop = |id: u64| -> Value {
        let out = run_ok(tb, "r1", &["ip", "-j", "nexthop", "show", "id", &id.to_string()]);
        serde_json::from_slice::<Value>(&out.stdout).unwrap()[0].clone()
    };
    let members = nexthop(nhid)["group"].as_array().cloned().unwrap_or_default();
    Some(
        members
            .iter()
            .map(|m| nexthop(m["id"].as_u64().unwrap())["segs"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .collect(),
    )
}

/// An instance's host dies behind the router (no daemon here: the router
/// alone). Its link loses carrier, then another's link goes away: no group
/// shrinks under the survivors, every route change still works, the
/// shadow SIDs stay, and a dead instance's shadow hops go to a live one's
/// direct SID until it comes back.
#[test]
fn shadow_route_survives_down_and_missing_next_hops() {
    let name = format!("x{}d", std::process::id() % 10000);
    let tb = Testbed::up(TestbedSpec { name, clients: 1, servers: 1, subnet: 83, ecmp: true, balancers: 3, ..Default::default() }).expect("testbed");
    let plan = Plan { subnet: hex(83) };
    // Two generations: after the second change the first dead instance is
    // still in the older one's group, where its revival shows.
    let path = tb.router_config.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("generations = 2\n{text}")).unwrap();
    let route = |args: &[&str]| {
        let mut argv = vec![BIN, "shadow", "route", "--config", path.to_str().unwrap()];
        argv.extend_from_slice(args);
        let out = tb.exec("r1", &argv).unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let (cond, direct) = (|i: usize| vec![plan.sid(i).to_string()], |i: usize| vec![plan.direct_sid(i).to_string()]);
    // In generation 1 (table 200), a hop chains on to generation 2's SID.
    let cond_then_older = |i: usize| vec![plan.sid(i).to_string(), inband_shadow::route::generation_sid(plan.shadow_sid(), 1).to_string()];
    let carrier = |dev: &str| String::from_utf8_lossy(&run_ok(&tb, "r1", &["ip", "link", "show", "dev", dev]).stdout).contains("LOWER_UP");
    route(&["--up", "b1,b2,b3"]);
    assert_eq!(group(&tb, "main"), [cond(1), cond(2), cond(3)]);

    // 1. b2's host goes down: the router's link to it loses carrier. The
    // kernel would delete a hop on that link from every group.
    run_ok(&tb, "b2", &["ip", "link", "set", "eth0", "down"]);
    assert!(!carrier("b2"), "r1's link to b2 kept its carrier: the step proves nothing");
    assert_eq!(group(&tb, "main"), [cond(1), cond(2), cond(3)], "the VIP's group shrank under b1's and b3's connections");

    // 2. b2 is withdrawn while down: the change works; the old set keeps
    // b2's place, its hop going to the next live instance's direct SID.
    route(&["--up", "b1,b3"]);
    assert_eq!(group(&tb, "main"), [cond(1), cond(3)]);
    assert_eq!(group(&tb, "200"), [cond_then_older(1), direct(3), cond_then_older(3)]);

    // 3. b1's link goes away altogether (its veth deleted on r1). The
    // shadow SIDs do not hang on it, nor does the VIP's group.
    run_ok(&tb, "r1", &["ip", "link", "del", "b1"]);
    for k in 0..2 {
        let sid = inband_shadow::route::generation_sid(plan.shadow_sid(), k).to_string();
        let out = run_ok(&tb, "r1", &["ip", "-6", "-j", "route", "show", &sid]);
        let routes: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(routes[0]["dev"].as_str(), Some(inband_testkit::testbed::ecmp::ANCHOR), "shadow SID {sid} gone with b1's link: {routes}");
    }
    assert_eq!(group(&tb, "main"), [cond(1), cond(3)]);

    // 4. b1 withdrawn too: nothing of b1's link is needed. Both dead
    // instances' shadow hops go to b3's direct SID, in both generations.
    route(&["--up", "b3"]);
    assert_eq!(group(&tb, "main"), [cond(3)]);
    assert_eq!(group(&tb, "200"), [direct(3), cond_then_older(3)]);
    assert_eq!(group(&tb, "201"), [direct(3), direct(3), direct(3)]);

    // 5. b2's link comes back. Told it is dead (its program, say, is
    // gone), the router keeps its hop substituted; then, as its link says,
    // it gets its own direct SID back, with the set unchanged.
    run_ok(&tb, "b2", &["ip", "link", "set", "eth0", "up"]);
    wait_for("r1's link to b2 to regain carrier", || carrier("b2"));
    route(&["--up", "b3", "--dead", "b2"]);
    assert_eq!(group(&tb, "201"), [direct(3), direct(3), direct(3)]);
    route(&["--up", "b3"]);
    assert_eq!(group(&tb, "201"), [direct(3), direct(2), direct(3)]);
    assert_eq!(group(&tb, "200"), [direct(3), cond_then_older(3)], "an unchanged set shifted the generations");
    assert_eq!(group(&tb, "main"), [cond(3)]);
}

/// `inband shadow follow` watches the links of the instances outside the
/// learned set: one withdrawn, then dead, gets its shadow hop pointed at a
/// live instance's direct SID with nothing learned changing, and back when
/// its link returns. The learned routes are written by hand here, as a
/// routing daemon would write them.
#[test]
fn follow_rewrites_the_shadow_hops_of_an_instance_that_dies_after_leaving() {
    let name = format!("x{}r", std::process::id() % 10000);
    let mut tb = Testbed::up(TestbedSpec { name, clients: 1, servers: 1, subnet: 85, ecmp: true, balancers: 3, ..Default::default() }).expect("testbed");
    let plan = Plan { subnet: hex(85) };
    let vip = format!("{}/128", tb.vip6());
    let learn = |tb: &Testbed, hops: &[usize]| {
        let mut argv = vec!["ip".to_string(), "-6".into(), "route".into(), "replace".into(), vip.clone(), "table".into(), "100".into()];
        for i in hops {
            argv.extend(["nexthop".into(), "via".into(), tb.addr6(&format!("b{i}")).to_string(), "dev".into(), format!("b{i}")]);
        }
        run_ok(tb, "r1", &argv.iter().map(String::as_str).collect::<Vec<_>>());
    };
    learn(&tb, &[1, 2, 3]);
    let cfg = tb.router_config.clone().unwrap();
    tb.spawn("r1", &[BIN, "shadow", "follow", "--config", cfg.to_str().unwrap(), "--table", "100", "--liveness-interval-ms", "100"]).unwrap();
    let direct = |i: usize| vec![plan.direct_sid(i).to_string()];
    wait_for("the VIP's route to follow the learned set", || group_or_none(&tb, "main").is_some_and(|g| g.len() == 3));
    learn(&tb, &[1, 3]);
    wait_for("b2 to leave", || group_or_none(&tb, "main").is_some_and(|g| g.len() == 2));
    assert_eq!(group(&tb, "200"), [direct(1), direct(2), direct(3)]);

    // b2's host dies after leaving: its link loses carrier; nothing learned changes.
    run_ok(&tb, "b2", &["ip", "link", "set", "eth0", "down"]);
    wait_for("b2's shadow hop to go to b3's direct SID", || group(&tb, "200") == [direct(1), direct(3), direct(3)]);
    run_ok(&tb, "b2", &["ip", "link", "set", "eth0", "up"]);
    wait_for("b2's shadow hop to come back", || group(&tb, "200") == [direct(1), direct(2), direct(3)]);
    assert_eq!(group(&tb, "main").len(), 2, "the liveness rewrite changed the VIP's route");
}

/// An instance's host dies under load, with no clean-up: its daemon is
/// killed -9 and the router's link to it loses carrier, or (later) goes
/// away; 1 s later the route withdraws it. Its own connections are lost
/// (their server-side tuples name it); every other download completes.
/// b1 dies: the first member's exit moves part of b2's share to b3
/// (hash-threshold), so survivors' packets take the shadow path, and the
/// shadow SIDs used to hang on b1's link.
#[test]
fn an_instance_host_crash_breaks_only_its_own_connections() {
    let mut farm = Farm::up("c", 86, 3, false);
    farm.route(&[1, 2, 3], false);
    let answers = |f: &Farm| {
        let url = format!("http://[{}]/", f.tb.vip6());
        f.tb.exec("c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "3", &url]).map(|o| o.status.success()).unwrap_or(false)
    };
    wait_for("the VIP to answer", || answers(&farm));
    // The probe a router can send to tell a dead program from a live host:
    // b1's XDP program answers an echo at its direct SID, and with the
    // program gone (daemon killed, XDP removed, the link up) nothing does.
    let sid = Plan { subnet: hex(86) }.direct_sid(1).to_string();
    let echo = |f: &Farm| f.tb.exec("r1", &["ping", "-6", "-c", "1", "-W", "1", &sid]).map(|o| o.status.success()).unwrap_or(false);
    assert!(echo(&farm), "b1's program does not answer at its direct SID {sid}");
    assert!(farm.event(1, "sid_echo") >= 1);
    farm.stop_lb(1, true);
    run_ok(&farm.tb, "b1", &["ip", "link", "set", "dev", "eth0", "xdp", "off"]);
    assert!(!echo(&farm), "{sid} answered with b1's program gone");
    // A router told to probe (`liveness = "echo"`) finds it dead when it
    // leaves the set, though its link is up: its shadow hop goes to a live
    // instance's direct SID instead of its own.
    let echo_cfg = farm.dir.join("router-echo.toml");
    std::fs::write(&echo_cfg, format!("liveness = \"echo\"\n{}", std::fs::read_to_string(&farm.router_cfg).unwrap())).unwrap();
    run_ok(&farm.tb, "r1", &[BIN, "shadow", "route", "--config", echo_cfg.to_str().unwrap(), "--up", "b2,b3"]);
    let shadow_hops = group(&farm.tb, "200").concat();
    assert!(!shadow_hops.contains(&sid) && !shadow_hops.is_empty(), "b1's shadow hop still goes to its own direct SID: {shadow_hops:?}");
    farm.start_lb(1);
    wait_for("b1 back", || echo(&farm));
    farm.route(&[1, 2, 3], false);
    wait_for("the VIP to answer", || answers(&farm));
    for (form, first_port) in [(Crash::CarrierLost, 41000), (Crash::InterfaceGone, 42000)] {
        let (dls, held) = farm.downloads_through(1, first_port);
        farm.crash_b1(form);
        let broken = broken(dls);
        let survivors_broken: Vec<&u16> = broken.iter().filter(|p| !held.contains(p)).collect();
        eprintln!(
            "{form:?}: b1 held {} of {DOWNLOADS}, {} broke; chained packets delivered by b2+b3: {}",
            held.len(),
            broken.len(),
            farm.event(2, "srv6_direct") + farm.event(3, "srv6_direct")
        );
        assert!(survivors_broken.is_empty(), "{form:?}: b2's or b3's downloads broke: {survivors_broken:?} (b1 held {held:?}){}", farm.report());
        if let Crash::CarrierLost = form {
            // b1's host comes back and rejoins for the next form.
            farm.revive_b1_host(form);
            farm.start_lb(1);
            farm.route(&[1, 2, 3], false);
            wait_for("the VIP to answer", || answers(&farm));
        }
    }
}

/// An instance's host dies under live downloads (Farm::crash_b1). With
/// fleet tuples and Maglev the connections it held reach the end of the
/// chain at a survivor, which adopts them: every download completes, when
/// its program is gone behind a link that stays up and, after it came
/// back, when the router's end of its link is gone. With fleet off (the
/// same VIP, its own tuples) its downloads break, or the first half would
/// prove nothing.
#[test]
fn an_instance_host_crash_keeps_its_maglev_connections_with_fleet_tuples() {
    let fleet_on = [Crash::ProgramGone, Crash::InterfaceGone];
    for (fleet, subnet, forms) in [(true, 88, &fleet_on[..]), (false, 89, &[Crash::ProgramGone][..])] {
        let mut farm = Farm::up_family(if fleet { "f" } else { "n" }, subnet, 3, false, false, Vip::Maglev(fleet));
        farm.route(&[1, 2, 3], false);
        let url = format!("http://[{}]/", farm.tb.vip6());
        let answers = |f: &Farm| f.tb.exec("c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "3", &url]).map(|o| o.status.success()).unwrap_or(false);
        wait_for("the VIP to answer", || answers(&farm));
        let shown = farm.status(2)["scale_out"]["fleet_prefix"].clone();
        assert_eq!(shown, if fleet { Value::from(fleet_prefix(subnet)) } else { Value::Null }, "inband status");
        // `shadow route` routed the fleet's prefix nowhere on the router.
        let out = run_ok(&farm.tb, "r1", &["ip", "-6", "-j", "route", "show", &fleet_prefix(subnet)]);
        let routes: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(routes[0]["type"].as_str(), fleet.then_some("unreachable"), "the router's route for {}: {routes}", fleet_prefix(subnet));
        for (round, &form) in forms.iter().enumerate() {
            if round > 0 {
                farm.revive_b1_host(forms[round - 1]);
                farm.start_lb(1);
                farm.route(&[1, 2, 3], false);
                wait_for("the VIP to answer", || answers(&farm));
            }
            let first_port = 43000 + 1000 * round as u16;
            let adopted_before = farm.event(2, "adopted_maglev") + farm.event(3, "adopted_maglev");
            let (dls, held) = farm.downloads_through(1, first_port);
            farm.crash_b1(form);
            let broken = broken(dls);
            let adopted = farm.event(2, "adopted_maglev") + farm.event(3, "adopted_maglev") - adopted_before;
            eprintln!("fleet {fleet}, {form:?}: b1 held {} of {DOWNLOADS}, {} broke, b2+b3 adopted {adopted}", held.len(), broken.len());
            if fleet {
                assert!(broken.is_empty(), "{form:?}: downloads broke: {broken:?} (b1 held {held:?}){}", farm.report());
                assert!(adopted > 0, "{form:?}: nothing adopted: b1's downloads did not move{}", farm.report());
            } else {
                assert!(broken.iter().any(|p| held.contains(p)), "fleet off: none of b1's downloads {held:?} broke{}", farm.report());
                assert!(broken.iter().all(|p| held.contains(p)), "fleet off: a survivor's download broke: {broken:?}{}", farm.report());
                assert_eq!(adopted, 0);
            }
        }
    }
}

/// As above with a dsr-dynamic VIP (least-score: a choice no survivor can
/// compute), each instance announcing its choices to the others: the
/// router's link to b1 loses carrier under live downloads, the survivors adopt its connections to
/// the backends it announced, and every download completes. Then, with b1
/// back and announcing to nobody (`peers` empty: b2 and b3 still listen),
/// the same crash breaks b1's downloads and only those, or the first half
/// would prove nothing; those are given up once the others are done.
/// Datagrams from a stranger, cut short or under another key are refused
/// and counted.
#[test]
fn an_instance_host_crash_keeps_its_dsr_dynamic_connections_with_announced_choices() {
    let mut farm = Farm::up_family("p", 90, 3, false, false, Vip::Announced);
    farm.route(&[1, 2, 3], false);
    let answers = |f: &Farm| {
        let url = format!("http://[{}]/", f.tb.vip6());
        f.tb.exec("c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "3", &url]).map(|o| o.status.success()).unwrap_or(false)
    };
    wait_for("the VIP to answer", || answers(&farm));
    let adopted = |f: &Farm| f.event(2, "adopted_announced") + f.event(3, "adopted_announced");
    let records_sent = |f: &Farm| f.status(1)["control"]["peers"]["records_sent"].as_u64().unwrap_or(0);
    for (announce, first_port) in [(true, 46000), (false, 47000)] {
        let sent_before = records_sent(&farm);
        let (dls, held) = farm.downloads_through(1, first_port);
        // Each of b1's downloads to each of its two peers (the batch of its last SYN may still be on its way).
        if announce {
            wait_for("b1 to announce its downloads", || records_sent(&farm) - sent_before >= 2 * held.len() as u64);
        }
        let (sent, adopted_before) = (records_sent(&farm) - sent_before, adopted(&farm));
        // The router's link to b1 loses carrier, then (announcements off)
        // its program goes behind a link that stays up.
        farm.crash_b1(if announce { Crash::CarrierLost } else { Crash::ProgramGone });
        let broken = if announce { broken(dls) } else { broken_once_the_rest_are_done(dls, &held) };
        let took = adopted(&farm) - adopted_before;
        eprintln!("announce {announce}: b1 held {} of {DOWNLOADS} and sent {sent} records, {} broke, b2+b3 adopted {took}", held.len(), broken.len());
        if announce {
            assert!(broken.is_empty(), "downloads broke: {broken:?} (b1 held {held:?}){}", farm.report());
            assert!(took > 0, "nothing adopted: b1's downloads did not move{}", farm.report());
            for i in 2..=3 {
                let p = &farm.status(i)["control"]["peers"];
                assert!(p["records_learned"].as_u64() > Some(0), "b{i} learned no choice: {p}");
                for refused in ["unknown_sender", "malformed", "bad_mac", "replayed"] {
                    assert_eq!(p[refused].as_u64(), Some(0), "b{i} refused a datagram: {p}");
                }
            }
            // What is not a peer's datagram under the fleet key changes
            // nothing and is counted, by reason: from the client, from a
            // peer but cut short, from a peer under another key.
            let b2 = farm.tb.addr6("b2").to_string();
            let send = |from: &str, d: &[u8]| {
                let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
                run_ok(&farm.tb, from, &["python3", "-c", SEND_UDP, &b2, "7155", &hex]);
            };
            let key = inband_lb::maps::FlowKey { proto: 6, ..Default::default() };
            let forged = inband_lb::peers::encode(
                &inband_core::wire::Key([9; 16]),
                u64::MAX,
                &[inband_lb::peers::Choice { key, backend_addr: Default::default(), backend_port: 0, age_ms: 0 }],
            );
            send("c1", &forged);
            send("b3", &forged[..40]);
            send("b3", &forged);
            let refused = |f: &Farm| {
                let p = &f.status(2)["control"]["peers"];
                ["unknown_sender", "malformed", "bad_mac", "replayed"].map(|k| p[k].as_u64().unwrap_or(0))
            };
            wait_for("b2 to refuse the three datagrams", || refused(&farm) == [1, 1, 1, 0]);
            // b1 comes back, announcing to nobody.
            farm.revive_b1_host(Crash::CarrierLost);
            let cfg = farm.dir.join("lb-b1.toml");
            let text = std::fs::read_to_string(&cfg).unwrap();
            let line = text.lines().find(|l| l.starts_with("peers = ")).unwrap().to_string();
            std::fs::write(&cfg, text.replace(&line, "peers = []")).unwrap();
            farm.start_lb(1);
            farm.route(&[1, 2, 3], false);
            wait_for("the VIP to answer", || answers(&farm));
        } else {
            assert!(broken.iter().any(|p| held.contains(p)), "announcements off: none of b1's downloads {held:?} broke{}", farm.report());
            assert!(broken.iter().all(|p| held.contains(p)), "announcements off: a survivor's download broke: {broken:?}{}", farm.report());
            // b2 and b3 still announce theirs to each other: a stray of
            // one survivor's connection that the router's substitute hop
            // brings to the other may be adopted there (`took`), as under
            // Maglev; none of b1's could be.
            assert_eq!(sent, 0, "announcements off: b1 sent records (survivors adopted {took})");
        }
    }
}

/// dsr-dynamic with fleet tuples (issue 28): every instance sends from the
/// fleet's addresses, which reach no instance, so each agent sends its
/// 125s wrapped to the instance the flow label of their 124 named. Two
/// instances under live downloads: each instance that holds downloads
/// takes scores for them, no steered packet reaches an instance that does
/// not hold its connection, the agents name every instance they are
/// asked by, and every download completes. Then a forged 125, wrapped as
/// an agent wraps it, is refused by the instance that owns its
/// connection (no recorded score) and dropped by the other.
#[test]
fn dsr_dynamic_scores_reach_the_instance_that_asked_with_fleet_tuples() {
    const N: usize = 8;
    let farm = Farm::up_family("s", 82, 2, false, false, Vip::DynamicFleet);
    farm.route(&[1, 2], false);
    let url = farm.url();
    wait_for("the VIP to answer", || {
        farm.tb.exec("c1", &["curl", "-s", "-o", "/dev/null", "--max-time", "3", &url]).map(|o| o.status.success()).unwrap_or(false)
    });
    let before = [farm.scores_received(1), farm.scores_received(2)];
    let first_port = 45000;
    let dls = farm.downloads_from(first_port, N);
    farm.wait_started(N);
    let ours = |port: &u16| (first_port..first_port + N as u16).contains(port);
    let held: Vec<Vec<u16>> = (1..=2).map(|i| farm.held(i).into_iter().filter(ours).collect()).collect();
    let broken = broken(dls);
    let report = farm.report();
    assert!(broken.is_empty(), "downloads broke: {broken:?}{report}");
    // The server closed first (`inband serve` ends each download with
    // its connection); the client's FIN that follows is acknowledged by
    // the server's TIME_WAIT, by DSR like every other segment.
    let unacknowledged = farm.unacknowledged_fins(first_port..first_port + N as u16);
    assert!(unacknowledged.is_empty(), "the client's FINs were never acknowledged:\n{}{report}", unacknowledged.join("\n"));
    let closed_sent: u64 = (1..=SERVERS).map(|s| farm.agent_counter(s, "closed_flow_segments")).sum();
    assert!(closed_sent >= N as u64, "{closed_sent} segments of closed connections sent by DSR, for {N} connections the servers closed first");
    // Their tuples stay until a SYN on their ports (none comes here).
    let kept: u64 = (1..=SERVERS).map(|s| farm.agent_status(s)["closed_flows"].as_u64().unwrap()).sum();
    assert!(kept >= N as u64, "closed_flows holds {kept} tuples for {N} closed connections");
    for i in 1..=2 {
        let fleet_flows = farm.flows(i).iter().filter(|(p, f)| ours(p) && f.snat_index == inband_lb::maps::SNAT_FLEET).count();
        assert_eq!(fleet_flows, held[i - 1].len(), "b{i}: a download without the fleet tuple{report}");
        if !held[i - 1].is_empty() {
            assert!(farm.scores_received(i) > before[i - 1], "b{i} holds {:?} and took no score{report}", held[i - 1]);
            assert!(farm.event(i, "fleet_steered") > 0, "b{i}: nothing steered to it{report}");
        }
        assert_eq!(farm.drop_count(i, "steered_not_owner"), 0, "b{i}: a 125 steered to the wrong instance{report}");
        assert_eq!(farm.drop_count(i, "score_not_owner"), 0, "b{i}{report}");
        assert_eq!(farm.event(i, "score_bad_mac"), 0, "b{i}{report}");
    }
    assert!(held.iter().any(|h| !h.is_empty()), "no instance holds a download");
    let steered: u64 = (1..=SERVERS).map(|s| farm.agent_counter(s, "fleet_steered")).sum();
    let unnamed: u64 = (1..=SERVERS).map(|s| farm.agent_counter(s, "fleet_unnamed")).sum();
    eprintln!(
        "b1 held {}, took {} scores; b2 held {}, took {}; the agents steered {steered}",
        held[0].len(),
        farm.scores_received(1) - before[0],
        held[1].len(),
        farm.scores_received(2) - before[1]
    );
    assert!(steered > 0, "the agents steered nothing");
    assert_eq!(unnamed, 0, "a 124 named no instance");

    // A forged 125 for a connection b_owner holds (closing now, in its
    // table for closing_timeout_ms), wrapped from its backend to an
    // instance's address: refused by the owner, dropped by the other.
    let owner = if held[0].is_empty() { 2 } else { 1 };
    let (_, flow) = farm.flows(owner).into_iter().find(|(p, f)| ours(p) && f.snat_index == inband_lb::maps::SNAT_FLEET).unwrap();
    let backend = inband_core::pod::ip_of(&flow.backend_addr);
    let server = (1..=SERVERS).find(|s| IpAddr::V6(farm.tb.addr6(&format!("s{s}"))) == backend).expect("the flow's backend is a server");
    let prefix = fleet_prefix(82);
    let mut fleet_addr = prefix.split('/').next().unwrap().parse::<std::net::Ipv6Addr>().unwrap().octets();
    fleet_addr[12..].copy_from_slice(&flow.fleet_suffix.to_ne_bytes());
    let fleet_addr = std::net::Ipv6Addr::from(fleet_addr).to_string();
    let forge = |to: usize| {
        let to = farm.tb.addr6(&format!("b{to}")).to_string();
        let (sport, dport) = (inband_core::pod::port_of(flow.backend_port).to_string(), inband_core::pod::port_of(flow.snat_port).to_string());
        run_ok(&farm.tb, &format!("s{server}"), &["python3", "-c", FORGE_125, &backend.to_string(), &fleet_addr, &sport, &dport, &to]);
    };
    let other = 3 - owner;
    let refused = |f: &Farm| f.event(owner, "score_bad_mac") + f.event(owner, "score_unsolicited");
    let (was_refused, was_steered, was_scores) = (refused(&farm), farm.event(owner, "fleet_steered"), farm.scores_received(owner));
    forge(owner);
    wait_for("the owner to refuse the forged 125", || refused(&farm) > was_refused);
    assert!(farm.event(owner, "fleet_steered") > was_steered);
    assert_eq!(farm.scores_received(owner), was_scores, "a forged score was recorded");
    let was_dropped = farm.drop_count(other, "steered_not_owner");
    forge(other);
    wait_for("the other instance to drop the forged 125", || farm.drop_count(other, "steered_not_owner") > was_dropped);
}

/// A UDP datagram: argv address, port, payload in hex.
const SEND_UDP: &str = r#"
import socket, sys
socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).sendto(bytes.fromhex(sys.argv[3]), (sys.argv[1], int(sys.argv[2])))
"#;

/// A backend's packet with a 125 (score 60000, nonce and MAC zero) to the
/// fleet address, wrapped in IPv6 to an instance as an agent wraps it:
/// argv backend, fleet address, backend port, SNAT port, instance.
const FORGE_125: &str = r#"
import socket, struct, sys
src, fleet, sport, dport, to = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
a = lambda s: socket.inet_pton(socket.AF_INET6, s)
def csum(b):
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
tcp = struct.pack('!HHIIBBHHH', sport, dport, 1, 1, 5 << 4, 0x10, 512, 0, 0)
tcp = tcp[:16] + struct.pack('!H', csum(a(src) + a(fleet) + struct.pack('!I3xB', len(tcp), 6) + tcp)) + tcp[18:]
doh = bytes([6, 2, 0x1e, 16, 125, 16]) + struct.pack('!H', 60000) + bytes(12) + bytes([1, 2, 0, 0])
inner = struct.pack('!IHBB', 6 << 28, len(doh) + len(tcp), 60, 64) + a(src) + a(fleet) + doh + tcp
outer = struct.pack('!IHBB', 6 << 28, len(inner), 41, 64) + a(src) + a(to) + inner
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_RAW)
s.setsockopt(socket.IPPROTO_IPV6, 36, 1)
s.sendto(outer, (to, 0))
"#;

/// The instances' configuration (`inband lb` refuses what cannot work).
#[test]
fn an_instance_config_without_an_ipv6_address_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg: &Path = &dir.path().join("lb.toml");
    std::fs::write(
        cfg,
        "interface = \"eth0\"\naddress = \"10.0.0.2\"\n[scale_out]\nsid = \"fd00:51::b\"\ndirect_sid = \"fd00:51::d\"\nshadow_sid = \"fd00:5f::5\"\n[auth]\nmode = \"none\"\n",
    )
    .unwrap();
    let out = Command::new(BIN).args(["lb", "--config"]).arg(cfg).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[scale_out]: chained packets leave in IPv6 from the balancer's own address: set `address6`"), "{err}");
}

/// The client ports of the downloads that did not end whole.
fn broken(dls: Vec<(u16, std::process::Child)>) -> Vec<u16> {
    dls.into_iter().filter_map(|(port, d)| (!complete(&d.wait_with_output().unwrap())).then_some(port)).collect()
}

/// Whether a paced download got status 200 and all of BODY (it prints
/// status, body bytes and its local port).
fn complete(o: &std::process::Output) -> bool {
    o.status.success() && paced_result(o) == format!("200 {BODY}")
}

/// As `broken`, but the downloads of `held` (expected to break) are not
/// waited for past the others: once every other one has ended, those
/// still running get 5 s more (a live one ends within that at the
/// client's rate), then are stopped and counted broken.
fn broken_once_the_rest_are_done(dls: Vec<(u16, std::process::Child)>, held: &[u16]) -> Vec<u16> {
    let (mine, rest): (Vec<_>, Vec<_>) = dls.into_iter().partition(|(p, _)| held.contains(p));
    let mut out = broken(rest);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut left = mine;
    while !left.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let (mut done, mut running) = (Vec::new(), Vec::new());
        for (port, mut d) in left {
            if matches!(d.try_wait(), Ok(Some(_))) {
                done.push((port, d));
            } else {
                running.push((port, d));
            }
        }
        out.extend(broken(done));
        left = running;
    }
    for (port, mut d) in left {
        let _ = d.kill();
        let _ = d.wait();
        out.push(port);
    }
    out
}

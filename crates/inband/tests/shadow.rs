//! Seed 002 on the ECMP testbed (`inband testbed up --ecmp`): a router
//! spreads a VIP over servers by ECMP; changing its next hops breaks the
//! connections that land on another server, unless the shadow table keeps
//! the previous set and the servers chain strays to it (`inband shadow`).
//! Real TCP downloads, bytes checked; the same change with plain ECMP must
//! break them, or the shadowed run would prove nothing.
//!
//! Needs root (namespaces, tc, bpffs).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use inband_testkit::testbed::{Testbed, TestbedSpec};
use serde_json::Value;

mod cluster;
use cluster::{run_ok, wait_for, BIN};
const BODY: usize = 4_000_000;


/// The testbed with `servers` serving BODY bytes at the VIP, routed to all.
fn up(tag: &str, subnet: u8, servers: usize, clients: usize) -> Testbed {
    let name = format!("s{}{tag}", std::process::id() % 10000);
    let mut tb = Testbed::up(TestbedSpec { name, clients, servers, subnet, ecmp: true, ..Default::default() }).expect("testbed");
    let listen = SocketAddr::new(tb.vip6().into(), 80).to_string();
    for i in 1..=servers {
        tb.spawn(&format!("s{i}"), &[BIN, "serve", "--listen", &listen, "--service-ms", "1", "--body-bytes", &BODY.to_string()])
            .unwrap();
    }
    for i in 1..=clients {
        // A client takes in at most 256 KiB its reader has not read, far
        // less than BODY: a download held by `hold` cannot finish.
        run_ok(&tb, &format!("c{i}"), &["sysctl", "-qw", "net.ipv4.tcp_rmem=4096 65536 262144"]);
        // The router sends to each client at 16 Mbit/s (a token bucket on
        // its link): a download lasts seconds, paced by the network, as
        // the seed's did on real links, whatever else the machine runs.
        run_ok(&tb, "r1", &["tc", "qdisc", "add", "dev", &format!("c{i}"), "root", "tbf", "rate", "16mbit", "burst", "32kb", "latency", "400ms"]);
    }
    // Every server listening before any client connects: ECMP may send
    // the first connection to any of them.
    for i in 1..=servers {
        wait_for("the servers to listen", || !run_ok(&tb, &format!("s{i}"), &["ss", "-Htln", "sport", "= :80"]).stdout.is_empty());
    }
    let all: Vec<String> = (1..=servers).map(|i| format!("s{i}")).collect();
    route(&tb, &all, false);
    wait_for("the VIP to answer", || get(&tb, "c1").is_ok());
    tb
}

fn route(tb: &Testbed, up: &[String], plain: bool) {
    let cfg = tb.router_config.clone().unwrap();
    let mut argv = vec![BIN, "shadow", "route", "--config", cfg.to_str().unwrap(), "--up", ""];
    let list = up.join(",");
    *argv.last_mut().unwrap() = &list;
    if plain {
        argv.push("--plain");
    }
    run_ok(tb, "r1", &argv);
}

fn attach(tb: &Testbed, i: usize) {
    let plan = inband_testkit::testbed::ecmp::Plan { subnet: inband_testkit::testbed::ecmp::hex(tb.spec.subnet) };
    let (sid, direct, shadow) = (plan.sid(i).to_string(), plan.direct_sid(i).to_string(), plan.shadow_sid().to_string());
    run_ok(tb, &format!("s{i}"), &[
        BIN, "shadow", "attach", "--interface", "eth0", "--sid", &sid, "--direct-sid", &direct, "--shadow-sid", &shadow,
    ]);
}

fn counters(tb: &Testbed, node: &str) -> Value {
    serde_json::from_slice(&run_ok(tb, node, &[BIN, "shadow", "status", "--interface", "eth0", "--json"]).stdout).unwrap()
}

fn get(tb: &Testbed, client: &str) -> Result<String, String> {
    let url = format!("http://[{}]/", tb.vip6());
    let out = tb.exec(client, &["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download}", "--max-time", "10", &url]).unwrap();
    let got = String::from_utf8_lossy(&out.stdout).to_string();
    if out.status.success() {
        Ok(got)
    } else {
        Err(got)
    }
}

fn download(tb: &Testbed, client: &str) -> Child {
    let url = format!("http://[{}]/", tb.vip6());
    tb.command(client, &["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{size_download}", "--max-time", "40", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Stops the download's reader: its window closes and the server stops
/// sending, so the connection stays in progress through route changes
/// however long the machine takes to make them. `finish` lets it go on.
fn hold(dl: &Child) {
    // SAFETY: a plain signal to our own child (nsenter execs curl in place).
    assert_eq!(unsafe { libc::kill(dl.id() as i32, libc::SIGSTOP) }, 0);
}

fn finish(dl: Child) -> String {
    // SAFETY: as in `hold`; continuing a process that runs is a no-op.
    assert_eq!(unsafe { libc::kill(dl.id() as i32, libc::SIGCONT) }, 0);
    String::from_utf8_lossy(&dl.wait_with_output().unwrap().stdout).to_string()
}


/// The local ports of `client`'s connections to the VIP in progress. The
/// client's side is the one to ask: it stays established until the last
/// byte, while a server that has written the whole body closes early and
/// older connections linger in its closing states.
fn client_ports(tb: &Testbed, client: &str) -> Vec<u16> {
    let out = run_ok(tb, client, &["ss", "-Htn", "state", "established", "dport", "= :80"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2)?.rsplit(':').next()?.parse().ok())
        .collect()
}

/// The server with a socket for the client port `port`.
fn owner_of(tb: &Testbed, servers: usize, port: u16) -> Vec<usize> {
    let dport = format!("= :{port}");
    (1..=servers)
        .filter(|i| {
            let out = run_ok(tb, &format!("s{i}"), &["ss", "-Htn", "state", "connected", "sport", "= :80", "and", "dport", &dport]);
            !out.stdout.is_empty()
        })
        .collect()
}

/// One download, and the VIP moved off its server in the middle of it.
fn move_a_download(tb: &Testbed, plain: bool) -> String {
    let dl = download(tb, "c1");
    wait_for("the download's connection", || client_ports(tb, "c1").len() == 1);
    hold(&dl);
    let owners = owner_of(tb, 2, client_ports(tb, "c1")[0]);
    assert_eq!(owners.len(), 1, "one server has the connection: {owners:?}");
    let owner = owners[0];
    let other = 3 - owner;
    route(tb, &[format!("s{other}")], plain);
    let got = finish(dl);
    route(tb, &["s1".to_string(), "s2".to_string()], plain);
    got
}

#[test]
fn moving_the_vip_off_a_live_download_breaks_it_with_plain_ecmp_and_not_with_shadowing() {
    let tb = up("mv", 79, 2, 1);
    for i in 1..=2 {
        attach(&tb, i);
    }
    // While the set stays as it is, connections are delivered, never chained.
    for _ in 0..3 {
        assert_eq!(get(&tb, "c1"), Ok(format!("200 {BODY}")));
    }
    let sum = |counter: &str| -> u64 { (1..=2).map(|i| counters(&tb, &format!("s{i}"))[counter]["packets"].as_u64().unwrap()).sum() };
    assert_eq!(sum("chained"), 0, "{}", counters(&tb, "s1"));
    assert_eq!(sum("new_flow"), 3, "each connection's SYN is a new flow");
    assert!(sum("local") >= 3 * 4, "each connection's later packets found their socket: {}", sum("local"));
    // The VIP moves off the download's server: its packets are chained
    // back, and it completes.
    let shadowed = move_a_download(&tb, false);
    assert_eq!(shadowed, format!("200 {BODY}"), "the download finished whole");
    assert!(sum("chained") >= 1, "no packet was chained: {}", counters(&tb, "s1"));
    // Detached, nothing of the program is left...
    for i in 1..=2 {
        run_ok(&tb, &format!("s{i}"), &[BIN, "shadow", "detach", "--interface", "eth0"]);
        let st = tb.exec(&format!("s{i}"), &[BIN, "shadow", "status", "--interface", "eth0"]).unwrap();
        assert!(!st.status.success() && String::from_utf8_lossy(&st.stderr).contains("no shadow program"));
    }
    // ...and the same move with plain ECMP breaks the download: the
    // client's packets reach the other server, which resets it.
    let plain = move_a_download(&tb, true);
    assert_ne!(plain, format!("200 {BODY}"), "plain ECMP kept the connection: the test would prove nothing");
    assert_eq!(get(&tb, "c1"), Ok(format!("200 {BODY}")));
}

/// The router keeps `generations` earlier sets from now on.
fn keep_generations(tb: &Testbed, generations: u32) {
    let path = tb.router_config.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let text: String = text.lines().filter(|l| !l.starts_with("generations")).map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, format!("generations = {generations}\n{text}")).unwrap();
}

/// One download, and the VIP moved off its server twice in the middle of
/// it: to the two others, then to one of them. Its packets then reach a
/// server that never had it, whose first shadow generation (the two)
/// does not have its server either: only the second one does.
fn move_a_download_twice(tb: &Testbed) -> String {
    let all: Vec<String> = (1..=3).map(|i| format!("s{i}")).collect();
    route(tb, &all, false);
    let dl = download(tb, "c1");
    wait_for("the download's connection", || client_ports(tb, "c1").len() == 1);
    hold(&dl);
    let owners = owner_of(tb, 3, client_ports(tb, "c1")[0]);
    assert_eq!(owners.len(), 1, "one server has the connection: {owners:?}");
    let others: Vec<String> = (1..=3).filter(|i| *i != owners[0]).map(|i| format!("s{i}")).collect();
    route(tb, &others, false);
    std::thread::sleep(std::time::Duration::from_millis(300));
    route(tb, &others[..1], false);
    let got = finish(dl);
    route(tb, &all, false);
    got
}

#[test]
fn two_changes_within_a_download_need_two_shadow_generations() {
    let tb = up("gen", 82, 3, 1);
    for i in 1..=3 {
        attach(&tb, i);
    }
    let sum = |counter: &str| -> u64 { (1..=3).map(|i| counters(&tb, &format!("s{i}"))[counter]["packets"].as_u64().unwrap()).sum() };
    // One generation (the seed's): the oldest set is gone when the
    // download needs it, and a server that never had it resets it.
    keep_generations(&tb, 1);
    let one = move_a_download_twice(&tb);
    assert_ne!(one, format!("200 {BODY}"), "one generation kept the connection: the test would prove nothing");
    assert_eq!(sum("chained_named"), 0, "no route names a second generation");
    // Two: chained twice, the second time to the table the SRH named.
    keep_generations(&tb, 2);
    let two = move_a_download_twice(&tb);
    assert_eq!(two, format!("200 {BODY}"), "the download finished whole");
    assert!(sum("chained_named") >= 1, "no packet went to the second generation: {}", counters(&tb, "s1"));
    let table = |t: &str| String::from_utf8_lossy(&run_ok(&tb, "r1", &["ip", "-6", "route", "show", "table", t]).stdout).to_string();
    // After the last change back to all three: the first generation is
    // the set of one, to its conditional SID and then the second
    // generation's SID; the second is the set of two, to direct SIDs.
    let (first, second) = (table("200"), table("201"));
    assert_eq!((first.matches("nexthop ").count(), first.matches("segs 2 [ ").count()), (1, 1), "{first}");
    assert_eq!((second.matches("nexthop ").count(), second.matches("segs 1 [ ").count()), (2, 2), "{second}");
    // Each table's route points at a nexthop group, which a change
    // replaces whole (a multipath route is rewritten a hop at a time).
    for t in [&first, &second, &table("main")] {
        assert!(t.contains(" nhid "), "{t}");
    }
    // An object in the VIP's id block that is not the VIP's (another
    // VIP's hop, here one to a foreign SID) is refused, not overwritten.
    let main = table("main");
    let group: u32 = main.split_whitespace().skip_while(|w| *w != "nhid").nth(1).unwrap().parse().unwrap();
    let hop = (group + 1).to_string();
    let via = tb.addr6("s1").to_string();
    run_ok(&tb, "r1", &["ip", "nexthop", "del", "id", &hop]);
    run_ok(&tb, "r1", &["ip", "nexthop", "add", "id", &hop, "encap", "seg6", "mode", "encap", "segs", "fd00:99::1", "via", &via, "dev", "s1"]);
    let cfg = tb.router_config.clone().unwrap();
    let out = tb.exec("r1", &[BIN, "shadow", "route", "--config", cfg.to_str().unwrap(), "--up", "s1"]).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&format!("nexthop object {hop} is someone else's")) && err.contains("nexthop_ids"), "{err}");
    let segs = String::from_utf8_lossy(&run_ok(&tb, "r1", &["ip", "nexthop", "show", "id", &hop]).stdout).to_string();
    assert!(segs.contains("fd00:99::1"), "the foreign object was overwritten: {segs}");
}

#[test]
fn four_to_two_to_four_under_concurrent_downloads() {
    // The seed's planned change: half the servers leave, then come back,
    // while downloads run through both changes' neighbourhood.
    let tb = up("424", 80, 4, 4);
    for i in 1..=4 {
        attach(&tb, i);
    }
    let all: Vec<String> = (1..=4).map(|i| format!("s{i}")).collect();
    let mut kept: Vec<String> = Vec::new();
    for step in ["4→2", "2→4"] {
        let dls: Vec<Child> = (0..8).map(|k| download(&tb, &format!("c{}", k % 4 + 1))).collect();
        wait_for("the downloads' connections", || {
            let v: Vec<usize> = (1..=4).map(|i| client_ports(&tb, &format!("c{i}")).len()).collect();
            v.iter().sum::<usize>() == 8
        });
        dls.iter().for_each(hold);
        let set = if kept.is_empty() {
            // The two servers holding the most downloads leave, so at
            // least four must be chained whichever way ECMP spread them.
            let mut held = [0usize; 5];
            for c in 1..=4 {
                for port in client_ports(&tb, &format!("c{c}")) {
                    owner_of(&tb, 4, port).into_iter().for_each(|s| held[s] += 1);
                }
            }
            let mut by_load: Vec<usize> = (1..=4).collect();
            by_load.sort_by_key(|s| held[*s]);
            kept = by_load[..2].iter().map(|s| format!("s{s}")).collect();
            &kept
        } else {
            &all
        };
        route(&tb, set, false);
        let results: Vec<String> = dls.into_iter().map(finish).collect();
        assert!(results.iter().all(|r| *r == format!("200 {BODY}")), "{step}: {results:?}");
    }
    let chained: u64 = (1..=4).map(|i| counters(&tb, &format!("s{i}"))["chained"]["packets"].as_u64().unwrap()).sum();
    assert!(chained >= 4, "the two servers that left held at least 4 of the 8 downloads: each must have been chained");
}

#[test]
fn the_router_controller_refuses_bad_configs_and_unknown_servers() {
    let dir = std::env::temp_dir().join(format!("inband-shadow-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("router.toml");
    let server = |name: &str, n: u8| {
        format!("[[server]]\nname = \"{name}\"\nsid = \"fd00:5{n}::b\"\ndirect_sid = \"fd00:5{n}::d\"\nvia = \"fd00:{n}::2\"\ndev = \"r{n}\"\n")
    };
    let cases = [
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\nshadow_table = 254\n{}", server("s1", 1)), "shadow_table = 254"),
        (format!("vip = \"fd00::80\"\nshadow_sid = \"fd00:5f::5\"\n{}", server("s1", 1)), "anchor missing: every nexthop and shadow SID is put on it"),
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\n{}{}", server("s1", 1), server("s1", 2)), "server \"s1\" twice"),
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:51::b\"\n{}", server("s1", 1)), "used twice"),
        ("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\n".to_string(), "missing field `server`"),
        (format!("vip = \"fd00::80/128\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\n{}", server("s1", 1)), "vip"),
        // An IPv4 VIP's marks hold its tables in their low 16 bits.
        (format!("vip = \"10.0.0.1\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\nipv4_mark = 0x1b5e0001\n{}", server("s1", 1)), "ipv4_mark = 0x1b5e0001: its low 16 bits must be 0"),
        (format!("vip = \"10.0.0.1\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\nshadow_table = 70000\n{}", server("s1", 1)), "below 65536"),
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\nweight = 3\n{}", server("s1", 1)), "unknown field `weight`"),
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\ngenerations = 9\n{}", server("s1", 1)), "generations = 9: keep 1 to 8"),
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\ngenerations = 0\n{}", server("s1", 1)), "generations = 0"),
        // Generation 3's table would be 253 (the kernel's default table).
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\nshadow_table = 251\ngenerations = 3\n{}", server("s1", 1)), "tables 251–253"),
        // Generation 2's SID would be the server's conditional SID.
        (format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:51::a\"\ngenerations = 2\n{}", server("s1", 1)), "used twice"),
    ];
    for (text, expect) in cases {
        std::fs::write(&cfg, &text).unwrap();
        let out = Command::new(BIN).args(["shadow", "route", "--config", cfg.to_str().unwrap(), "--up", "s1"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect), "{text}\nwanted {expect:?} in: {err}");
    }
    std::fs::write(&cfg, format!("vip = \"fd00::80\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:5f::5\"\n{}", server("s1", 1))).unwrap();
    let out = Command::new(BIN).args(["shadow", "route", "--config", cfg.to_str().unwrap(), "--up", "s9"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no server \"s9\"") && err.contains("it has s1"), "{err}");
    // The anchor is checked before anything is written, in a network
    // namespace of the command's own (only `lo` there, and down).
    for (anchor, expect) in [("inb0", "anchor = \"inb0\": no such interface"), ("lo", "anchor = \"lo\" is down (flags LOOPBACK)")] {
        std::fs::write(&cfg, format!("vip = \"fd00::80\"\nanchor = \"{anchor}\"\nshadow_sid = \"fd00:5f::5\"\n{}", server("s1", 1))).unwrap();
        let out = Command::new("unshare").args(["-n", BIN, "shadow", "route", "--config", cfg.to_str().unwrap(), "--up", "s1"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(expect) && err.contains("veth pair with both ends up"), "wanted {expect:?} in: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Inside each server's namespace, which the test made: the port is free.
const METRICS: &str = "127.0.0.1:9464";

fn scrape(tb: &Testbed, node: &str) -> String {
    let url = format!("http://{METRICS}/metrics");
    String::from_utf8_lossy(&run_ok(tb, node, &["curl", "-sS", "--max-time", "5", &url]).stdout).into_owned()
}

/// The value of the exposition's sample `series` (name and labels as
/// written), or 0 if it is absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

fn packets_seen(text: &str) -> f64 {
    text.lines().filter(|l| l.starts_with("inband_shadow_packets_total{interface=\"eth0\",")).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

#[test]
fn the_metrics_exporter_serves_each_programs_counters_and_runs() {
    let mut tb = up("met", 83, 2, 1);
    // Nothing attached yet: nothing to export, said so.
    let out = tb.exec("s1", &[BIN, "shadow", "metrics", "--listen", METRICS]).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no shadow program in this network namespace") && err.contains("inband shadow attach"), "{err}");
    for i in 1..=2 {
        attach(&tb, i);
        tb.spawn(&format!("s{i}"), &[BIN, "shadow", "metrics", "--listen", METRICS, "--bpf-stats"]).unwrap();
    }
    for i in 1..=2 {
        let node = format!("s{i}");
        wait_for("the exporter to listen", || tb.exec(&node, &["curl", "-sf", "-o", "/dev/null", &format!("http://{METRICS}/metrics")]).is_ok_and(|o| o.status.success()));
    }
    // A second one on the same address is refused, naming it.
    let out = tb.exec("s1", &[BIN, "shadow", "metrics", "--listen", METRICS]).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&format!("metrics endpoint {METRICS}")) && err.contains("in use"), "{err}");

    let before: Vec<String> = (1..=2).map(|i| scrape(&tb, &format!("s{i}"))).collect();
    for _ in 0..3 {
        assert_eq!(get(&tb, "c1"), Ok(format!("200 {BODY}")));
    }
    // Packets each program sees whatever ECMP chose for the three
    // connections (all of them may go to one server): 20 echoes from the
    // router to each.
    for i in 1..=2 {
        let server = tb.addr6(&format!("s{i}")).to_string();
        run_ok(&tb, "r1", &["ping", "-6", "-q", "-c", "20", "-i", "0.01", &server]);
    }
    let after: Vec<String> = (1..=2).map(|i| scrape(&tb, &format!("s{i}"))).collect();
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        inband_http::check_exposition(a).unwrap_or_else(|e| panic!("s{}: {e}\n{a}", i + 1));
        assert_eq!(sample(a, "inband_shadow_bpf_stats"), 1.0, "{a}");
        let runs = "inband_shadow_bpf_program_runs_total{program=\"shadow\",interface=\"eth0\"}";
        let seen = packets_seen(a) - packets_seen(b);
        let ran = sample(a, runs) - sample(b, runs);
        // Every run counts one packet at most (the program counts each it
        // returns on), and runs are counted from the exporter's start on.
        assert!(ran > 0.0 && ran >= seen, "s{}: {ran} runs for {seen} packets\n{a}", i + 1);
        let time = "inband_shadow_bpf_program_run_seconds_total{program=\"shadow\",interface=\"eth0\"}";
        assert!(sample(a, time) > sample(b, time), "s{}: no run time\n{a}", i + 1);
    }
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(packets_seen(a) - packets_seen(b) >= 20.0, "s{} did not count the echoes\n{a}", i + 1);
    }
    // The three connections' SYNs, on whichever server each went to.
    let flows: f64 = after.iter().map(|a| sample(a, "inband_shadow_packets_total{interface=\"eth0\",counter=\"new_flow\"}")).sum();
    assert_eq!(flows, 3.0, "{after:?}");
    // `status` prints the program's runs too, and the exporter's /status
    // is the same document per interface.
    let st = String::from_utf8_lossy(&run_ok(&tb, "s1", &[BIN, "shadow", "status", "--interface", "eth0"]).stdout).into_owned();
    assert!(st.contains("program shadow (id ") && st.contains(" on eth0: ") && st.contains(" ns per run"), "{st}");
    let json = counters(&tb, "s1");
    assert!(json["programs"][0]["runs"].as_u64().unwrap() > 0 && json["programs"][0]["interfaces"][0] == "eth0", "{json}");
    let url = format!("http://{METRICS}/status");
    let doc: Value = serde_json::from_slice(&run_ok(&tb, "s1", &["curl", "-sS", "--max-time", "5", &url]).stdout).unwrap();
    assert_eq!(doc["servers"]["eth0"]["new_flow"], json["new_flow"], "{doc}");
    assert!(doc["router"].is_null(), "{doc}");
    // Detached while it runs: the next scrape has no server series left.
    run_ok(&tb, "s1", &[BIN, "shadow", "detach", "--interface", "eth0"]);
    let gone = scrape(&tb, "s1");
    assert!(!gone.contains("interface=\"eth0\""), "{gone}");
}

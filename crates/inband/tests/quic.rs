//! UDP and QUIC VIPs on a network-namespace testbed (tests/cluster) with
//! real QUIC traffic: `inband quic serve` on every server (server id = its
//! number), `inband quic get` on the client. What a QUIC VIP promises: the
//! connections spread over the servers, answers go around the balancer
//! (DSR), and a client that moves to a new port or address keeps its
//! server because the balancer reads the server id from the connection ID.

use std::net::{IpAddr, SocketAddr};

use serde_json::Value;

mod cluster;
use cluster::*;

const SERVERS: usize = 3;
/// Body bytes per request: big enough that answers through the balancer
/// would show in its return bytes.
const BYTES: u64 = 20_000;

/// The backends of status VIP `k` (0: IPv4, 1: IPv6), in server order.
fn backends(c: &Cluster, k: usize) -> Vec<Value> {
    let st = c.status();
    (1..=SERVERS)
        .map(|i| {
            let want = if k == 0 { server(&c.tb, i).to_string() } else { server6(&c.tb, i).to_string() };
            st[0]["vips"][k]["backends"].as_array().unwrap().iter().find(|b| b["backend"] == want.as_str()).cloned().unwrap()
        })
        .collect()
}

fn new_conns(c: &Cluster, k: usize) -> Vec<u64> {
    backends(c, k).iter().map(|b| b["stats"]["new_conns"].as_u64().unwrap()).collect()
}

fn return_bytes(c: &Cluster, k: usize) -> u64 {
    backends(c, k).iter().map(|b| b["stats"]["return_bytes"].as_u64().unwrap()).sum()
}

fn ip_of(v: &Value) -> IpAddr {
    v.as_str().unwrap().parse::<SocketAddr>().unwrap().ip()
}

fn port_of(v: &Value) -> u16 {
    v.as_str().unwrap().parse::<SocketAddr>().unwrap().port()
}

/// `conns` connections of `per` requests each through VIP `to`: the
/// server id each connection was answered by (all its requests by one).
fn spread(c: &Cluster, to: SocketAddr, conns: usize, per: u32) -> Vec<u64> {
    let per_s = per.to_string();
    let bytes = BYTES.to_string();
    let lb: IpAddr = if to.is_ipv4() { c.tb.addr("lb").into() } else { c.tb.addr6("lb").into() };
    (0..conns)
        .map(|n| {
            let r = quic_get(c, "c1", to, &["--requests", &per_s, "--bytes", &bytes]);
            assert!(r.ok, "connection {n}: {}\n{}", r.outcome, r.stderr);
            let ids = r.server_ids();
            assert_eq!(ids.len(), per as usize, "connection {n}: {:?}", r.answers);
            assert!(ids.iter().all(|&id| id == ids[0]), "connection {n} changed servers: {ids:?}");
            // Every answer counted came from the VIP: the client drops
            // datagrams from any other address than the one it connected to.
            for a in &r.answers {
                assert_eq!(a["bytes"], BYTES, "{a}");
                // Full NAT toward the server: it sees the balancer, never the client.
                assert_eq!(ip_of(&a["peer"]), lb, "{a}");
            }
            ids[0]
        })
        .collect()
}

fn per_server(ids: &[u64]) -> Vec<u64> {
    (1..=SERVERS as u64).map(|s| ids.iter().filter(|&&id| id == s).count() as u64).collect()
}

/// Plain UDP (quic = false), dsr-rr: the round-robin gives each server
/// every third connection, the servers' answers (which name them) agree
/// with the balancer's count, and the bodies never cross the balancer.
#[test]
fn udp_vip_in_dsr_rr_spreads_quic_connections_and_answers_go_direct() {
    let c = Cluster::with(Spec::new("qrr", "dsr-rr").udp());
    let rewrites = c.agent_counter("dsr_rewrites");
    let ids = spread(&c, vip(&c.tb).into(), 6, 2);
    assert_eq!(per_server(&ids), [2, 2, 2], "round-robin by connection: {ids:?}");
    assert_eq!(new_conns(&c, 0), [2, 2, 2]);
    // 12 answers of 20 kB went out: had they come back through the
    // balancer, its return bytes would hold them.
    assert!(return_bytes(&c, 0) < BYTES, "answers went through the balancer: {}", return_bytes(&c, 0));
    // At least one rewrite per answer (a GSO burst of datagrams is one).
    assert!(c.agent_counter("dsr_rewrites") - rewrites >= 12, "the agents sent the answers to the client");
    let st = c.status();
    assert_eq!((st[0]["vips"][0]["protocol"].as_str(), st[0]["vips"][0]["quic"].as_bool()), (Some("udp"), Some(false)));
    // UDP has no FIN: each connection's flow stays until its idle timeout.
    wait_for("the six UDP flows in status", || c.status()[0]["vips"][0]["flows"] == 6);
    assert_eq!(c.event("quic_cid_routed") + c.event("quic_cid_unknown"), 0, "quic = false reads no connection IDs");
}

/// A QUIC VIP in dsr-dynamic: every server gets connections, the answers
/// go direct but for the few that carry a score back (the 124/125
/// exchange runs on the QUIC datagrams as on TCP segments). Round-robin
/// among the backends, so that every server gets its three whatever the
/// scores say (least-score may rightly leave one out of nine).
#[test]
fn quic_vip_in_dsr_dynamic_reaches_every_server_and_scores_ride_on_quic() {
    let c = Cluster::with(Spec::new("qdy", "dsr-dynamic").quic().vip("policy = \"round-robin\""));
    let ids = spread(&c, vip(&c.tb).into(), 9, 3);
    assert_eq!(per_server(&ids), [3, 3, 3], "every server answered: {ids:?}");
    assert_eq!(new_conns(&c, 0).iter().sum::<u64>(), 9);
    assert_eq!(per_server(&ids), new_conns(&c, 0), "the servers' ids agree with the balancer's count");
    let sent = 27 * BYTES;
    assert!(return_bytes(&c, 0) < sent / 4, "most answers went around the balancer: {} of {sent}", return_bytes(&c, 0));
    assert!(c.sum("scores_received") > 0, "in-band scores over QUIC: {}", c.status()[0]["vips"][0]);
    assert_eq!(c.status()[0]["vips"][0]["quic"], true);
    // No connection moved: no short header ever lacked its flow.
    assert_eq!(c.event("quic_cid_routed"), 0);
}

/// A second address for the client, `n` as its last number (IPv4) or group (IPv6).
fn add_client_address(c: &Cluster, v6: bool, n: u8) -> IpAddr {
    let ip: IpAddr = if v6 {
        let mut seg = c.tb.addr6("c1").segments();
        seg[7] = u16::from(n);
        seg.into()
    } else {
        let mut o = c.tb.addr("c1").octets();
        o[3] = n;
        o.into()
    };
    let prefix = if v6 { format!("{ip}/64") } else { format!("{ip}/24") };
    let mut cmd = vec!["ip", "addr", "add", &prefix, "dev", "eth0"];
    if v6 {
        cmd.push("nodad");
    }
    run_ok(&c.tb, "c1", &cmd);
    if v6 {
        inband_testkit::testbed::netns::wait_ipv6_usable(&c.tb.netns("c1")).unwrap();
    }
    ip
}

/// One connection through VIP `to` (status VIP `k`), six requests, moved
/// to a new socket after the third (on `migrate_to` if given): every
/// answer from one server, the move seen by it as a new flow, routed by
/// the connection ID.
fn migrate(c: &Cluster, to: SocketAddr, k: usize, migrate_to: Option<IpAddr>) {
    let routed = c.event("quic_cid_routed");
    let conns = new_conns(c, k);
    let bytes = BYTES.to_string();
    let addr = migrate_to.map(|a| a.to_string());
    let mut args = vec!["--requests", "6", "--migrate-after", "3", "--bytes", &bytes];
    if let Some(a) = &addr {
        args.extend(["--migrate-to", a.as_str()]);
    }
    let r = quic_get(c, "c1", to, &args);
    assert!(r.ok, "{}\n{}", r.outcome, r.stderr);
    assert_eq!(r.outcome["migrated"], true);
    let ids = r.server_ids();
    assert_eq!(ids.len(), 6, "{:?}", r.answers);
    assert!(ids.iter().all(|&id| id == ids[0]), "the connection changed servers: {ids:?}");
    let (before, after) = (&r.answers[2], &r.answers[3]);
    assert_ne!(port_of(&before["local"]), port_of(&after["local"]), "the client moved to a new socket");
    if let Some(a) = migrate_to {
        assert_eq!(ip_of(&after["local"]), a);
    }
    // The server saw the move: a new flow, a new SNAT port...
    assert_eq!(r.answers[..3].iter().map(|a| &a["peer"]).collect::<std::collections::HashSet<_>>().len(), 1);
    assert_eq!(r.answers[3..].iter().map(|a| &a["peer"]).collect::<std::collections::HashSet<_>>().len(), 1);
    assert_ne!(before["peer"], after["peer"], "the moved connection is a new flow at the balancer");
    // ...which the balancer gave the server the connection ID names, not
    // the round-robin's next one.
    assert!(c.event("quic_cid_routed") > routed, "routed by connection ID");
    let got: Vec<u64> = new_conns(c, k).iter().zip(&conns).map(|(n, b)| n - b).collect();
    let mut want = vec![0; SERVERS];
    want[ids[0] as usize - 1] = 2;
    assert_eq!(got, want, "both flows of the connection went to server {}", ids[0]);
}

#[test]
fn a_migrated_quic_connection_keeps_its_server_by_connection_id() {
    let c = Cluster::with(Spec::new("qmg", "dsr-rr").quic());
    migrate(&c, vip(&c.tb).into(), 0, None);
    let second = add_client_address(&c, false, 51);
    migrate(&c, vip(&c.tb).into(), 0, Some(second));
    assert!(return_bytes(&c, 0) < BYTES, "answers after the move go direct too: {}", return_bytes(&c, 0));
}

/// The same VIP without `quic = true` (the control for the test above):
/// the moved connection is a new flow like any other, the round-robin
/// sends it to the next server, which does not know the connection, and
/// the request after the move is never answered.
#[test]
fn without_quic_routing_a_migrated_connection_loses_its_server() {
    let c = Cluster::with(Spec::new("qnq", "dsr-rr").udp());
    let r = quic_get(&c, "c1", vip(&c.tb).into(), &["--requests", "4", "--migrate-after", "2", "--timeout-s", "2"]);
    assert!(!r.ok, "the moved connection was answered: {:?}", r.answers);
    assert_eq!(r.answers.len(), 2, "{:?}", r.answers);
    assert_eq!(r.outcome["answered"], 2);
    assert!(r.outcome["error"].as_str().unwrap().contains("request 3"), "{}", r.outcome);
    let mut conns = new_conns(&c, 0);
    conns.sort();
    assert_eq!(conns, [0, 1, 1], "the move went to another server");
    assert_eq!(c.event("quic_cid_routed"), 0);
}

/// Both over an IPv6 VIP (the agents' IPv6 rewrite, the options in a
/// Destination Options header).
#[test]
fn ipv6_quic_vip_spreads_and_keeps_a_migrated_connection() {
    let c = Cluster::with(Spec::new("q6", "dsr-rr").quic().ipv6());
    let ids = spread(&c, vip6(&c.tb), 3, 2);
    assert_eq!(per_server(&ids), [1, 1, 1], "{ids:?}");
    assert!(return_bytes(&c, 1) < BYTES, "answers through the balancer: {}", return_bytes(&c, 1));
    migrate(&c, vip6(&c.tb), 1, None);
    let second = add_client_address(&c, true, 0x51);
    migrate(&c, vip6(&c.tb), 1, Some(second));
    assert_eq!(c.status()[0]["vips"][1]["protocol"], "udp");
}

/// Bad input ends with a clear message and a non-zero exit, never a hang.
#[test]
fn quic_commands_refuse_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("c.der"), dir.path().join("k.der"));
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let run = |args: &[&str]| std::process::Command::new(BIN).args(args).env("INBAND_LOG", "warn").output().unwrap();
    let out = run(&["quic", "cert", "--cert", cert_s, "--key", key_s, "--name", "localhost"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let fails = |args: &[&str], want: &str| {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{args:?}: {err}");
    };
    fails(&["quic", "serve", "--listen", "127.0.0.1:0", "--server-id", "0", "--cert", cert_s, "--key", key_s], "--server-id 0 is not a server id");
    fails(&["quic", "serve", "--listen", "127.0.0.1:0", "--server-id", "1", "--cert", "/nonexistent", "--key", key_s], "reading certificate /nonexistent");
    fails(&["quic", "serve", "--listen", "127.0.0.1:0", "--server-id", "1", "--cert", cert_s, "--key", cert_s], "certificate and key");
    fails(&["quic", "get", "--connect", "127.0.0.1:9", "--cert", "/nonexistent", "--server-name", "localhost"], "reading certificate /nonexistent");
    fails(&["quic", "get", "--connect", "127.0.0.1:9", "--cert", cert_s, "--server-name", "localhost", "--requests", "2", "--migrate-after", "2"], "--migrate-after 2");
    // Nothing answers there: the handshake is bounded.
    let t0 = std::time::Instant::now();
    fails(&["quic", "get", "--connect", "127.0.0.1:9", "--cert", cert_s, "--server-name", "localhost", "--timeout-s", "1"], "127.0.0.1:9");
    assert!(t0.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t0.elapsed());
}

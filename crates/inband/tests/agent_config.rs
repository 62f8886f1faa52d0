//! The agent's control plane: config validation (with `[auth]` and its key
//! files), the poll protocol and its responder, the score socket,
//! /proc/net/tcp seeding, the CPU score, and (as root, with the BPF program)
//! full runs against a veth in a network namespace, SIGHUP key rotation
//! included. The tests are always run as root: one that is not fails.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inband_agent::config::{AgentConfig, ScoreSource, ServiceConfig};
use inband_agent::cpu::{parse_proc_stat, RunQueue};
use inband_agent::daemon::seed_active;
use inband_agent::maps::{AgentCounter, AuthKey, ConnKey, DataPathConfig, DsrFlow};
use inband_agent::settings::DataPathSettings;
use inband_core::net::Protocol;
use inband_core::poll_wire;
use inband_core::wire::Key;
use inband_agent::poll_responder;
use inband_agent::proc_tcp::{self, TcpState};
use inband_agent::score_socket::{self, ScoreApi};
use inband_agent::tables::AgentMaps;
use inband_core::auth::{AuthMode, KeyRef};
use inband_core::bpfmap;

// ---------------------------------------------------------------- config

const GOOD: &str = r#"
interface = "eth0"
balancers = ["10.77.0.2"]

[[service]]
port = 8080
vip = "10.77.0.100:80"

[[service]]
port = 8081
vip = "10.77.0.100:81"

[auth]
keys = [{ id = 1, file = "/etc/inband/auth-1.key" }]
"#;

fn config_err(text: &str) -> String {
    format!("{:#}", AgentConfig::parse(text).unwrap_err())
}

/// A balancer's SNAT pool is listed as a block and taken as its addresses;
/// a block too large to be one is refused, naming it.
#[test]
fn config_balancers_take_blocks_of_addresses() {
    let c = AgentConfig::parse(&GOOD.replace("balancers = [\"10.77.0.2\"]", "balancers = [\"10.77.0.2\", \"10.77.0.224/29\", \"fd00::e0/126\"]")).unwrap();
    let mut want = vec![IpAddr::V4(Ipv4Addr::new(10, 77, 0, 2))];
    want.extend((224..232).map(|h| IpAddr::V4(Ipv4Addr::new(10, 77, 0, h))));
    want.extend((0xe0..0xe4).map(|h| IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, h))));
    assert_eq!(c.balancers, want);
    let e = config_err(&GOOD.replace("balancers = [\"10.77.0.2\"]", "balancers = [\"10.77.0.0/23\"]"));
    assert!(e.contains("10.77.0.0/23 is not a block of at most 256 addresses"), "{e}");
    let e = config_err(&GOOD.replace("balancers = [\"10.77.0.2\"]", "balancers = [\"lb1\"]"));
    assert!(e.contains("\"lb1\" is neither an address nor a block"), "{e}");
}

/// A fleet's prefix is listed as the /96 its balancers' `fleet_prefix` is;
/// anything else is refused, naming it.
#[test]
fn config_fleet_prefixes_are_96s() {
    let with = |list: &str| GOOD.replace("balancers = [\"10.77.0.2\"]", &format!("balancers = [\"10.77.0.2\"]\nfleet_prefixes = [{list}]"));
    let c = AgentConfig::parse(&with("\"fd00:f1ee::/96\"")).unwrap();
    assert_eq!(c.fleet_prefixes.iter().map(ToString::to_string).collect::<Vec<_>>(), ["fd00:f1ee::/96"]);
    assert!(AgentConfig::parse(GOOD).unwrap().fleet_prefixes.is_empty(), "none by default");
    for (list, want) in [
        ("\"fd00:f1ee::/104\"", "fd00:f1ee::/104 is not a /96"),
        ("\"fd00:f1ee::5/96\"", "is not a /96 starting at its first address"),
        ("\"fd00:f1ee::/96\", \"fd00:f1ee::/96\"", "listed twice"),
    ] {
        let e = config_err(&with(list));
        assert!(e.contains(want), "{list}: {e}");
    }
    let many: Vec<String> = (0..17).map(|i| format!("\"fd00:f1ee:{i}::/96\"")).collect();
    assert!(config_err(&with(&many.join(", "))).contains("17 fleet_prefixes listed, at most 16"));
}

/// A fleet flow's 125s go to the balancer its flow label names, so with a
/// fleet trusted two IPv6 balancers may not share a label (found here by
/// trying addresses until two meet); without a fleet the label is unused.
#[test]
fn config_refuses_two_balancers_with_one_fleet_label() {
    let mut seen = std::collections::HashMap::new();
    let (a, b) = (1u16..)
        .map(|h| std::net::Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, h))
        .find_map(|a| seen.insert(inband_core::wire::fleet_label(a), a).map(|b| (b, a)))
        .unwrap();
    let both = format!("balancers = [\"{a}\", \"{b}\"]");
    let fleet = GOOD.replace("balancers = [\"10.77.0.2\"]", &format!("{both}\nfleet_prefixes = [\"fd00:f1ee::/96\"]"));
    let e = config_err(&fleet);
    assert!(e.contains(&format!("balancers {a} and {b} have the same fleet flow label")), "{e}");
    assert!(AgentConfig::parse(&GOOD.replace("balancers = [\"10.77.0.2\"]", &both)).is_ok());
    let label = inband_core::wire::fleet_label(a);
    assert!((1..=0xfffff).contains(&label), "20 bits, never 0: {label:#x}");
}

#[test]
fn config_defaults() {
    let c = AgentConfig::parse(GOOD).unwrap();
    assert_eq!(c.interface, "eth0");
    assert_eq!(c.balancers, vec![IpAddr::V4(Ipv4Addr::new(10, 77, 0, 2))]);
    assert_eq!(c.score, ScoreSource::Connections);
    assert_eq!(c.score_socket, PathBuf::from("/run/inband/agent.sock"));
    assert_eq!(c.score_socket_group, None);
    assert_eq!(c.poll_port, 9137);
    assert!(c.client_address);
    assert_eq!(c.client_address_cgroup, None);
    assert_eq!(
        c.services,
        vec![
            ServiceConfig { port: 8080, vip: "10.77.0.100:80".parse().unwrap(), protocol: Protocol::Tcp },
            ServiceConfig { port: 8081, vip: "10.77.0.100:81".parse().unwrap(), protocol: Protocol::Tcp },
        ]
    );
    assert_eq!(c.auth.mode, AuthMode::Siphash);
    assert_eq!(c.auth.keys, vec![KeyRef { id: 1, file: PathBuf::from("/etc/inband/auth-1.key") }]);
    let c = AgentConfig::parse(&GOOD.replace("interface", "score = \"cpu\"\npoll_port = 0\ninterface")).unwrap();
    assert_eq!(c.score, ScoreSource::Cpu);
    assert_eq!(c.poll_port, 0);
    let c = AgentConfig::parse(&GOOD.replace("interface", "score = \"connections+requests\"\ninterface")).unwrap();
    assert_eq!((c.score, c.score.name()), (ScoreSource::ConnectionsAndRequests, "connections+requests"));
    assert!(AgentConfig::parse(&GOOD.replace("interface", "score = \"requests+connections\"\ninterface")).is_err());
}

/// GOOD with its `[auth]` section replaced by `auth` (TOML lines, or "").
fn with_auth(auth: &str) -> String {
    let base = &GOOD[..GOOD.find("[auth]").unwrap()];
    if auth.is_empty() {
        base.to_string()
    } else {
        format!("{base}[auth]\n{auth}\n")
    }
}

#[test]
fn config_auth_section() {
    // Authenticated options are the default, so a config without keys is
    // refused, saying how to make one.
    let e = config_err(&with_auth(""));
    assert!(e.contains("[auth]") && e.contains("no auth key configured") && e.contains("inband keygen"), "{e}");
    let e = config_err(&with_auth("mode = \"siphash\""));
    assert!(e.contains("inband keygen"), "{e}");
    let c = AgentConfig::parse(&with_auth("mode = \"none\"")).unwrap();
    assert_eq!(c.auth.mode, AuthMode::None);
    let e = config_err(&with_auth("mode = \"none\"\nkeys = [{ id = 1, file = \"/k\" }]"));
    assert!(e.contains("unauthenticated"), "{e}");
    let e = config_err(&with_auth("keys = [{ id = 1, file = \"/k\" }]\nsign_with = 1"));
    assert!(e.contains("sign_with is a balancer setting"), "{e}");
    let e = config_err(&with_auth("keys = [{ id = 0, file = \"/k\" }]"));
    assert!(e.contains("key id 0 is reserved"), "{e}");
    let e = config_err(&with_auth("keys = [{ id = 2, file = \"/a\" }, { id = 2, file = \"/b\" }]"));
    assert!(e.contains("auth key id 2 is listed twice"), "{e}");
    let e = config_err(&with_auth("mode = \"md5\""));
    assert!(e.contains("unknown variant `md5`"), "{e}");
    let e = config_err(&with_auth("keys = [{ id = 1, path = \"/k\" }]"));
    assert!(e.contains("unknown field `path`"), "{e}");
}

#[test]
fn config_auth_key_files() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("auth-1.key");
    inband_core::auth::keygen(&good).unwrap();
    let cfg = |file: &Path| {
        AgentConfig::parse(&with_auth(&format!("keys = [{{ id = 1, file = \"{}\" }}]", file.display()))).unwrap()
    };
    let keys = cfg(&good).load_keys().unwrap();
    assert_eq!(keys, vec![(1, inband_core::auth::read_key(&good).unwrap())]);

    let missing = dir.path().join("auth-2.key");
    let e = format!("{:#}", cfg(&missing).load_keys().unwrap_err());
    assert!(e.contains(&missing.display().to_string()) && e.contains("inband keygen --out"), "{e}");

    let open = dir.path().join("open.key");
    std::fs::copy(&good, &open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = format!("{:#}", cfg(&open).load_keys().unwrap_err());
    assert!(e.contains("readable by group or others") && e.contains(&format!("chmod 600 {}", open.display())), "{e}");

    // The agent refuses to start on them, before it looks at the host.
    for (file, want) in [(&missing, "inband keygen"), (&open, "chmod 600")] {
        let config = dir.path().join("agent.toml");
        std::fs::write(&config, toml_text(&cfg(file))).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_inband"))
            .args(["agent", "run", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want) && err.contains("agent.toml"), "{err}");
    }
}

fn toml_text(cfg: &AgentConfig) -> String {
    toml::to_string(cfg).unwrap()
}

#[test]
fn config_unknown_key() {
    let e = config_err(&GOOD.replace("balancers =", "balancer ="));
    assert!(e.contains("unknown field `balancer`"), "{e}");
    let e = config_err(&GOOD.replace("vip = \"10.77.0.100:81\"", "vip = \"10.77.0.100:81\"\nweight = 2"));
    assert!(e.contains("unknown field `weight`"), "{e}");
    let e = config_err(&GOOD.replace("interface", "score = \"memory\"\ninterface"));
    assert!(e.contains("unknown variant `memory`"), "{e}");
}

#[test]
fn config_duplicate_port() {
    let e = config_err(&GOOD.replace("port = 8081", "port = 8080"));
    assert!(e.contains("service port 8080/tcp is listed twice for IPv4 VIPs"), "{e}");
    // The same port may serve an IPv6 VIP, or a UDP one, beside it.
    let both = GOOD.replace("port = 8081", "port = 8080").replace("10.77.0.100:81", "[fd00::100]:80");
    assert_eq!(AgentConfig::parse(&both).unwrap().service_ports(), vec![8080]);
    let udp = GOOD.replace("port = 8081", "port = 8080\nprotocol = \"udp\"");
    assert!(AgentConfig::parse(&udp).is_ok());
}

#[test]
fn config_zero_ports() {
    let e = config_err(&GOOD.replace("port = 8081", "port = 0"));
    assert!(e.contains("service port 0"), "{e}");
    let e = config_err(&GOOD.replace("10.77.0.100:81", "10.77.0.100:0"));
    assert!(e.contains("vip 10.77.0.100:0 has port 0"), "{e}");
}

#[test]
fn config_bad_vip() {
    let e = config_err(&GOOD.replace("10.77.0.100:81", "10.77.0.300:81"));
    assert!(e.contains("vip \"10.77.0.300:81\" is not an address:port"), "{e}");
    let e = config_err(&GOOD.replace("10.77.0.100:81", "10.77.0.100"));
    assert!(e.contains("vip \"10.77.0.100\" is not an address:port"), "{e}");
    let e = config_err(&GOOD.replace("10.77.0.100:81", "[ff02::1]:81"));
    assert!(e.contains("is not a unicast address"), "{e}");
}

#[test]
fn config_empty_balancers_and_services() {
    let e = config_err(&GOOD.replace("[\"10.77.0.2\"]", "[]"));
    assert!(e.contains("balancers is empty"), "{e}");
    let e = config_err(&GOOD.replace("[\"10.77.0.2\"]", "[\"10.77.0.2\", \"10.77.0.2\"]"));
    assert!(e.contains("balancer 10.77.0.2 is listed twice"), "{e}");
    let e = config_err("interface = \"eth0\"\nbalancers = [\"10.77.0.2\"]\n");
    assert!(e.contains("no [[service]]"), "{e}");
    let e = config_err(&GOOD.replace("balancers = [\"10.77.0.2\"]\n", ""));
    assert!(e.contains("missing field `balancers`"), "{e}");
}

#[test]
fn config_missing_interface() {
    let c = AgentConfig::parse(&GOOD.replace("eth0", "nosuchif0")).unwrap();
    let e = format!("{:#}", c.check_host().unwrap_err());
    assert!(e.contains("interface \"nosuchif0\" does not exist"), "{e}");
    let c = AgentConfig::parse(
        &GOOD.replace("eth0", "lo").replace("interface", "score_socket_group = \"no-such-group-x\"\ninterface"),
    )
    .unwrap();
    let e = format!("{:#}", c.check_host().unwrap_err());
    assert!(e.contains("score_socket_group \"no-such-group-x\" is not a group"), "{e}");
}

/// `client_address_cgroup` must be a cgroup v2 directory (the root of the
/// hierarchy when not given), and means nothing without `client_address`.
#[test]
fn config_client_address_cgroup() {
    let with = |lines: &str| GOOD.replace("eth0", "lo").replace("interface", &format!("{lines}\ninterface"));
    let e = config_err(&with("client_address = false\nclient_address_cgroup = \"/sys/fs/cgroup/unified\""));
    assert!(e.contains("client_address_cgroup is set but client_address = false"), "{e}");
    let c = AgentConfig::parse(&with("client_address_cgroup = \"/tmp\"")).unwrap();
    let e = format!("{:#}", c.client_address_cgroup().unwrap_err());
    assert!(e.contains("client_address_cgroup /tmp is not a cgroup v2 directory"), "{e}");
    let c = AgentConfig::parse(&with("client_address = false")).unwrap();
    assert_eq!(c.client_address_cgroup().unwrap(), None);
    // This machine's cgroup2 hierarchy, wherever it is mounted.
    let c = AgentConfig::parse(&with("")).unwrap();
    let root = c.client_address_cgroup().unwrap().expect("a cgroup2 mount");
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(mounts.lines().any(|l| l.split(' ').nth(1) == root.to_str() && l.split(' ').nth(2) == Some("cgroup2")), "{root:?}");
}

// ---------------------------------------------------------------- poll protocol
// (message layouts and MACs: unit tests in src/poll_wire.rs)

fn services(ports: &[(u16, &str)]) -> Vec<ServiceConfig> {
    ports.iter().map(|(p, v)| ServiceConfig { port: *p, vip: v.parse().unwrap(), protocol: Protocol::Tcp }).collect()
}

const POLL_KEY: Key = Key(*b"poll-test-key-01");

/// Maps as an agent with `[auth]` `keys = [{ id = 1, .. }]` has them, or
/// with `mode = "none"` if `unauthenticated`.
fn detached_maps(unauthenticated: bool) -> AgentMaps {
    let maps = AgentMaps::create_detached().expect("creating BPF maps (run the tests as root)");
    maps.apply(&services(&[(8080, "10.77.0.100:80"), (8081, "10.77.0.100:81")]), &[IpAddr::V4(Ipv4Addr::LOCALHOST)], &[]).unwrap();
    let (mode, keys) = if unauthenticated { (AuthMode::None, vec![]) } else { (AuthMode::Siphash, vec![(1, POLL_KEY)]) };
    DataPathSettings::new(mode, keys, 1500, 120).apply(&maps, None).unwrap();
    maps
}

/// Sends `req` from `from` to `to` and returns the reply with its source, or
/// None if nothing came back within 300 ms.
fn poll(from: &UdpSocket, to: SocketAddrV4, req: &[u8]) -> Option<(Vec<u8>, SocketAddrV4)> {
    from.send_to(req, to).unwrap();
    from.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut buf = [0u8; 64];
    match from.recv_from(&mut buf) {
        Ok((n, std::net::SocketAddr::V4(src))) => Some((buf[..n].to_vec(), src)),
        Ok(_) => panic!("IPv6 reply"),
        Err(_) => None,
    }
}

/// A responder on a wildcard socket (like the agent's) over `maps`, scoring
/// by `source`, until the returned flag is set; the thread gives the maps
/// back.
fn responder(maps: AgentMaps, source: ScoreSource) -> (SocketAddrV4, Arc<AtomicBool>, std::thread::JoinHandle<AgentMaps>) {
    let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
    let to = SocketAddrV4::new(Ipv4Addr::LOCALHOST, sock.local_addr().unwrap().port());
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            poll_responder::serve(&sock, &maps, source, &[8080, 8081], &[IpAddr::V4(Ipv4Addr::LOCALHOST)], &stop).unwrap();
            maps
        })
    };
    (to, stop, server)
}

fn signed_request(port: u16, nonce: u64) -> Vec<u8> {
    poll_wire::encode_request(port, Some((1, &POLL_KEY)), nonce)
}

/// The reply the agent must send to a signed request: same key, nonce echoed.
fn signed_reply(port: u16, nonce: u64, score: u32) -> Vec<u8> {
    let keys = Some(vec![(1, POLL_KEY)]);
    poll_wire::encode_reply(&poll_wire::Request { port, key_id: 1, nonce }, score, &keys).unwrap()
}

#[test]
fn poll_replies_add_the_counts_the_score_source_names() {
    for (source, want) in
        [(ScoreSource::Connections, 5), (ScoreSource::Requests, 2), (ScoreSource::ConnectionsAndRequests, 7)]
    {
        let maps = detached_maps(false);
        bpfmap::put(&maps.active_conns, &8080u16, &5i64).unwrap();
        bpfmap::put(&maps.inflight, &8080u16, &2i64).unwrap();
        let (to, stop, server) = responder(maps, source);
        let balancer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let (reply, _) = poll(&balancer, to, &signed_request(8080, 21)).expect("a reply");
        assert_eq!(reply, signed_reply(8080, 21, want), "{source:?}");
        stop.store(true, Ordering::Relaxed);
        let maps = server.join().unwrap();
        let snap = maps.snapshot("lo", Some(source)).unwrap();
        assert_eq!((snap.ports[&8080].score, snap.ports[&8080].requests_in_flight), (want, Some(2)), "{source:?}");
    }
}

#[test]
fn poll_responder_answers_like_the_egress_program() {
    let maps = detached_maps(false);
    bpfmap::put(&maps.active_conns, &8080u16, &5i64).unwrap();
    bpfmap::put(&maps.active_conns, &8081u16, &-3i64).unwrap();
    let (to, stop, server) = responder(maps, ScoreSource::Connections);
    let balancer = UdpSocket::bind("127.0.0.1:0").unwrap();

    let (reply, src) = poll(&balancer, to, &signed_request(8080, 11)).expect("a reply");
    assert_eq!(reply, signed_reply(8080, 11, 5));
    assert_eq!(src, to);
    // Negative counts (a socket closed that was never counted) read as 0.
    let (reply, _) = poll(&balancer, to, &signed_request(8081, 12)).expect("a reply");
    assert_eq!(reply, signed_reply(8081, 12, 0));

    // The reply comes from the address the request was sent to, even when
    // routing would pick another one (here 127.0.0.1).
    let other = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 3), to.port());
    let (reply, src) = poll(&balancer, other, &signed_request(8080, 13)).expect("a reply");
    assert_eq!(reply, signed_reply(8080, 13, 5));
    assert_eq!(src, other);

    // Unanswered and not counted: noise (bad magic, wrong length, a reply).
    assert_eq!(poll(&balancer, to, b"IBX1\x1f\x90"), None);
    assert_eq!(poll(&balancer, to, b"IBP1\x1f\x90\x00"), None);
    assert_eq!(poll(&balancer, to, &signed_reply(8080, 1, 1)), None);
    // Unanswered, counted as unauthenticated: the plain format where keys
    // are configured, another key, a forged MAC, a tampered port.
    assert_eq!(poll(&balancer, to, b"IBP1\x1f\x90"), None);
    assert_eq!(poll(&balancer, to, &poll_wire::encode_request(8080, Some((2, &POLL_KEY)), 1)), None);
    assert_eq!(poll(&balancer, to, &poll_wire::encode_request(8080, Some((1, &Key(*b"not-the-pollkey!"))), 1)), None);
    let mut tampered = signed_request(8080, 14);
    tampered[5] ^= 1;
    assert_eq!(poll(&balancer, to, &tampered), None);
    // Unanswered, counted as refused: an unserved port, a sender that is
    // not a balancer (even with a valid MAC: the key is not the only check).
    assert_eq!(poll(&balancer, to, &signed_request(9090, 15)), None);
    let stranger = UdpSocket::bind("127.0.0.2:0").unwrap();
    assert_eq!(poll(&stranger, to, &signed_request(8080, 16)), None);

    // Still serving after all that; the override wins and saturates.
    stop.store(true, Ordering::Relaxed);
    let maps = server.join().unwrap();
    assert_eq!(maps.counter(AgentCounter::PollsAnswered).unwrap(), 3);
    assert_eq!(maps.counter(AgentCounter::PollsUnauthenticated).unwrap(), 4);
    assert_eq!(maps.counter(AgentCounter::PollsRefused).unwrap(), 2);
    maps.set_override(8080, 70_000).unwrap();
    maps.set_override(8081, 12).unwrap();
    bpfmap::put(&maps.active_conns, &8081u16, &100_000i64).unwrap();
    let (to, stop, server) = responder(maps, ScoreSource::Connections);
    assert_eq!(poll(&balancer, to, &signed_request(8080, 21)).unwrap().0, signed_reply(8080, 21, 65535));
    assert_eq!(poll(&balancer, to, &signed_request(8081, 22)).unwrap().0, signed_reply(8081, 22, 12));
    stop.store(true, Ordering::Relaxed);
    assert_eq!(server.join().unwrap().counter(AgentCounter::PollsAnswered).unwrap(), 5);
}

#[test]
fn poll_responder_in_mode_none_speaks_the_seed_s_plain_format_only() {
    let maps = detached_maps(true);
    bpfmap::put(&maps.active_conns, &8080u16, &7i64).unwrap();
    let (to, stop, server) = responder(maps, ScoreSource::Connections);
    let balancer = UdpSocket::bind("127.0.0.1:0").unwrap();
    let plain = poll_wire::encode_request(8080, None, 0);
    assert_eq!(poll(&balancer, to, &plain).expect("a reply").0, b"IBR1\x1f\x90\x00\x00\x00\x07");
    // A signed request to an agent without keys: the configs differ.
    assert_eq!(poll(&balancer, to, &signed_request(8080, 1)), None);
    stop.store(true, Ordering::Relaxed);
    let maps = server.join().unwrap();
    assert_eq!(maps.counter(AgentCounter::PollsAnswered).unwrap(), 1);
    assert_eq!(maps.counter(AgentCounter::PollsUnauthenticated).unwrap(), 1);
}

#[test]
fn poll_keys_follow_the_data_path_settings() {
    let maps = detached_maps(false);
    assert_eq!(maps.poll_keys().unwrap(), Some(vec![(1, POLL_KEY)]));
    // A reload that rotates keys (as SIGHUP applies it) is what polls use next.
    let rotated = DataPathSettings::new(AuthMode::Siphash, vec![(2, Key(*b"second-key-00002")), (1, POLL_KEY)], 1500, 120);
    rotated.apply(&maps, None).unwrap();
    assert_eq!(maps.poll_keys().unwrap(), Some(vec![(1, POLL_KEY), (2, Key(*b"second-key-00002"))]));
    DataPathSettings::new(AuthMode::None, vec![], 1500, 120).apply(&maps, None).unwrap();
    assert_eq!(maps.poll_keys().unwrap(), None);
}

// ---------------------------------------------------------------- score socket

struct ScoreServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    api: Arc<ScoreApi>,
    _dir: tempfile::TempDir,
}

impl ScoreServer {
    fn start(source: ScoreSource) -> ScoreServer {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = score_socket::bind(&path, None).unwrap();
        let api =
            Arc::new(ScoreApi { maps: detached_maps(false), interface: "test0".into(), ports: vec![8080, 8081], source });
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (api, stop) = (Arc::clone(&api), Arc::clone(&stop));
            std::thread::spawn(move || score_socket::serve(listener, api, stop).unwrap())
        };
        ScoreServer { path, stop, thread: Some(thread), api, _dir: dir }
    }
}

impl Drop for ScoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One connection, several commands: the protocol is line by line.
struct Session {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Session {
    fn open(path: &Path) -> Session {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        Session { writer: s.try_clone().unwrap(), reader: BufReader::new(s) }
    }
    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.writer, "{line}").unwrap();
        let mut reply = String::new();
        self.reader.read_line(&mut reply).unwrap();
        assert!(reply.ends_with('\n'), "reply {reply:?} is not a whole line");
        reply.trim_end().to_string()
    }
    fn get(&mut self) -> serde_json::Value {
        let r = self.cmd("get");
        serde_json::from_str(&r).unwrap_or_else(|e| panic!("get returned {r:?}: {e}"))
    }
}

fn overrides(maps: &AgentMaps) -> BTreeMap<u16, u32> {
    bpfmap::entries::<u16, u32>(&maps.score_override).unwrap().into_iter().collect()
}

#[test]
fn score_socket_set_get_clear() {
    let srv = ScoreServer::start(ScoreSource::App);
    bpfmap::put(&srv.api.maps.active_conns, &8080u16, &3i64).unwrap();
    bpfmap::put(&srv.api.maps.active_conns, &8081u16, &9i64).unwrap();
    let mut s = Session::open(&srv.path);

    let g = s.get();
    assert_eq!(g["score_source"], "app");
    assert_eq!(g["interface"], "test0");
    assert_eq!(g["ports"]["8080"]["active_connections"], 3);
    assert_eq!(g["ports"]["8080"]["score"], 3);
    assert_eq!(g["ports"]["8080"]["score_override"], serde_json::Value::Null);
    assert_eq!(g["ports"]["8080"]["vips"][0], "10.77.0.100:80");
    assert_eq!(g["ports"]["8081"]["score"], 9);
    assert_eq!(g["balancers"], serde_json::json!(["127.0.0.1"]));
    assert_eq!(g["dsr_flows"], 0);
    assert_eq!(g["closed_flows"], 0);
    assert_eq!(g["counters"]["scores_sent"], 0);
    assert_eq!(g["counters"].as_object().unwrap().len(), inband_agent::maps::COUNTER_MAX);
    assert_eq!(g["counters"]["tuple_in_use"], 0);
    assert_eq!(g["counters"]["stale_tuples_forgotten"], 0);
    // As detached_maps applied them: the authenticated format, key 1.
    assert_eq!(g["auth"], serde_json::json!({ "mode": "siphash", "key_ids": [1] }));

    assert_eq!(s.cmd("set 8080 42"), "ok");
    assert_eq!(overrides(&srv.api.maps), BTreeMap::from([(8080, 42)]));
    let g = s.get();
    assert_eq!(g["ports"]["8080"]["score"], 42);
    assert_eq!(g["ports"]["8080"]["score_override"], 42);
    assert_eq!(g["ports"]["8080"]["active_connections"], 3);
    assert_eq!(g["ports"]["8081"]["score"], 9);

    assert_eq!(s.cmd("set * 7"), "ok");
    assert_eq!(overrides(&srv.api.maps), BTreeMap::from([(8080, 7), (8081, 7)]));
    assert_eq!(s.cmd("  set   8081   65535  "), "ok");
    assert_eq!(overrides(&srv.api.maps), BTreeMap::from([(8080, 7), (8081, 65535)]));
    assert_eq!(s.cmd("clear 8080"), "ok");
    assert_eq!(overrides(&srv.api.maps), BTreeMap::from([(8081, 65535)]));
    assert_eq!(s.get()["ports"]["8080"]["score"], 3);
    assert_eq!(s.cmd("clear *"), "ok");
    assert!(overrides(&srv.api.maps).is_empty());
    // Clearing what is not set is fine.
    assert_eq!(s.cmd("clear 8081"), "ok");

    // The CLI's client: one command per connection.
    assert_eq!(score_socket::request(&srv.path, "set 8081 5").unwrap(), "ok");
    assert_eq!(overrides(&srv.api.maps), BTreeMap::from([(8081, 5)]));
}

#[test]
fn score_socket_bad_commands_get_an_error_line() {
    let srv = ScoreServer::start(ScoreSource::App);
    let mut s = Session::open(&srv.path);
    let cases = [
        ("bogus", "error: unknown command \"bogus\""),
        ("set 8080", "error: unknown command \"set 8080\""),
        ("set 8080 1 2", "error: unknown command \"set 8080 1 2\""),
        ("", "error: empty command"),
        ("set 9999 1", "error: port 9999 is not a service of this agent (services: 8080, 8081)"),
        ("set http 1", "error: \"http\" is not a port number or `*`"),
        ("set 8080 65536", "error: score \"65536\" is not a number from 0 to 65535"),
        ("set 8080 -1", "error: score \"-1\" is not a number from 0 to 65535"),
        ("clear 70000", "error: \"70000\" is not a port number or `*`"),
        ("GET", "error: unknown command \"GET\""),
    ];
    for (cmd, want) in cases {
        let got = s.cmd(cmd);
        assert!(got.starts_with(want), "{cmd:?} -> {got:?}, wanted {want:?}...");
    }
    assert!(overrides(&srv.api.maps).is_empty(), "a refused command changed the maps");
    // Non-UTF-8 input is refused too, and the connection still works.
    s.writer.write_all(b"set \xff\xfe 1\n").unwrap();
    let mut reply = String::new();
    s.reader.read_line(&mut reply).unwrap();
    assert_eq!(reply, "error: the command is not UTF-8 text\n");
    assert_eq!(s.cmd("set 8080 1"), "ok");
    // An over-long line ends the connection with an error, not the server.
    let mut long = Session::open(&srv.path);
    long.writer.write_all(&vec![b'x'; 10_000]).unwrap();
    let mut reply = String::new();
    long.reader.read_line(&mut reply).unwrap();
    assert_eq!(reply, "error: line longer than 4096 bytes; closing\n");
    assert_eq!(Session::open(&srv.path).cmd("set 8081 2"), "ok");
    assert_eq!(overrides(&srv.api.maps), BTreeMap::from([(8080, 1), (8081, 2)]));
}

#[test]
fn score_socket_refuses_set_when_the_agent_writes_the_score() {
    let srv = ScoreServer::start(ScoreSource::Cpu);
    let mut s = Session::open(&srv.path);
    let r = s.cmd("set 8080 5");
    assert!(r.starts_with("error: `set` is not available with score = \"cpu\""), "{r}");
    let r = s.cmd("clear *");
    assert!(r.starts_with("error: `clear` is not available with score = \"cpu\""), "{r}");
    assert_eq!(s.get()["score_source"], "cpu");
    assert!(overrides(&srv.api.maps).is_empty());
}

#[test]
fn score_socket_refuses_to_take_a_live_socket() {
    let srv = ScoreServer::start(ScoreSource::App);
    let e = format!("{:#}", score_socket::bind(&srv.path, None).unwrap_err());
    assert!(e.contains("is in use by another inband agent"), "{e}");
    // A stale socket file (no listener) is replaced.
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let l = score_socket::bind(&stale, None).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&stale).unwrap().permissions().mode() & 0o777, 0o600);
    drop(l);
}

// ---------------------------------------------------------------- /proc/net/tcp

const PROC_NET_TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 0200630A:1F90 0100630A:D431 01 00000000:00000000 00:00000000 00000000     0        0 1002 1 0000000000000000 20 4 30 10 -1
   2: 0200630A:1F90 0100630A:D432 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
   3: 0200630A:1F90 0100630A:D433 08 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 20 4 30 10 -1
   4: 0200630A:1F90 0100630A:D434 03 00000000:00000000 01:00000064 00000000     0        0 0 2 0000000000000000 20 4 30 10 -1
   5: 0200630A:1F90 0100630A:D435 03 00000000:00000000 01:00000064 00000000     0        0 0 0 0000000000000000
   6: 0200630A:1F90 0100630A:D436 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0000000000000000
   7: 0200630A:1F90 0100630A:D437 09 00000000:00000001 01:00000014 00000000     0        0 0 2 0000000000000000 20 4 30 10 -1
   8: 0200630A:1F91 0100630A:D438 01 00000000:00000000 00:00000000 00000000     0        0 1005 1 0000000000000000 20 4 30 10 -1
   9: 0100630A:D439 0200630A:1F90 01 00000000:00000000 00:00000000 00000000     0        0 1006 1 0000000000000000 20 4 30 10 -1
  10: 00000000:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1007 1 0000000000000000 100 0 0 10 0
  11: 0200630A:1F91 0100630A:D43A 04 00000000:00000000 00:00000000 00000000     0        0 0 1 0000000000000000 20 4 30 10 -1
";

#[test]
fn proc_net_tcp_counts() {
    let socks = proc_tcp::parse(PROC_NET_TCP).unwrap();
    assert_eq!(socks.len(), 12);
    // Only the handshake-pending request (refcount 0, SYN_RECV) is a request.
    let requests: Vec<usize> = socks.iter().enumerate().filter(|(_, s)| s.request).map(|(i, _)| i).collect();
    assert_eq!(requests, vec![5]);
    let counts = proc_tcp::count_by_port_state(&socks);
    let want = BTreeMap::from([
        ((8080, TcpState::Established), 2),
        ((8080, TcpState::SynRecv), 1),
        ((8080, TcpState::TimeWait), 1),
        ((8080, TcpState::CloseWait), 1),
        ((8080, TcpState::LastAck), 1),
        ((8080, TcpState::Listen), 1),
        ((8081, TcpState::Established), 1),
        ((8081, TcpState::FinWait1), 1),
        ((8081, TcpState::Listen), 1),
        ((0xD439, TcpState::Established), 1),
    ]);
    assert_eq!(counts, want);
    // Active = SYN_RECV (full sockets) + ESTABLISHED + FIN_WAIT1/2: until
    // the client's FIN (CLOSE_WAIT and LAST_ACK are past it).
    assert_eq!(proc_tcp::active_on_port(&socks, 8080, &[]), 3);
    assert_eq!(proc_tcp::active_on_port(&socks, 8081, &[]), 2);
    assert_eq!(proc_tcp::active_on_port(&socks, 0xD439, &[]), 1);
    assert_eq!(proc_tcp::active_on_port(&socks, 9999, &[]), 0);
    // Every peer in the sample is 10.99.0.1, on ports above the SNAT
    // range: a balancer's own connections (its checks) if it is a
    // balancer, not counted, as the tracepoint does not count them.
    assert_eq!((socks[1].peer, socks[1].peer_port), ("10.99.0.1".parse::<IpAddr>().unwrap(), 0xD431));
    assert_eq!(proc_tcp::active_on_port(&socks, 8080, &["10.99.0.1".parse().unwrap()]), 0);
    assert_eq!(proc_tcp::active_on_port(&socks, 8080, &["10.99.0.3".parse().unwrap()]), 3);
    // From a SNAT port it is a client's connection through the balancer.
    let mut through = socks.clone();
    through[1].peer_port = 20000;
    assert_eq!(proc_tcp::active_on_port(&through, 8080, &["10.99.0.1".parse().unwrap()]), 1);
}

#[test]
fn proc_net_tcp6_peers_are_read_and_ipv4_mapped_ones_are_ipv4() {
    let text = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000200630A:1F90 0000000000000000FFFF00000100630A:D431 01 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 20 4 30 10 -1
   1: 000080FE00000000000000000200000A:1F90 000080FE00000000000000000100000A:D432 01 00000000:00000000 00:00000000 00000000     0        0 2002 1 0000000000000000 20 4 30 10 -1
";
    let socks = proc_tcp::parse(text).unwrap();
    assert_eq!(socks[0].peer, "10.99.0.1".parse::<IpAddr>().unwrap());
    assert_eq!(socks[1].peer, "fe80::a00:1".parse::<IpAddr>().unwrap());
    assert_eq!(proc_tcp::active_on_port(&socks, 8080, &["10.99.0.1".parse().unwrap()]), 1);
}

#[test]
fn proc_net_tcp_malformed_line_is_named() {
    let bad = format!("{PROC_NET_TCP}  12: 0200630A 0100630A:D43A 01 0 0 0 0 0 0 1\n");
    let e = format!("{:#}", proc_tcp::parse(&bad).unwrap_err());
    assert!(e.contains("/proc/net/tcp line 14") && e.contains("has no port"), "{e}");
    let bad = PROC_NET_TCP.replace(
        " 0A 00000000:00000000 00:00000000 00000000     0        0 1007",
        " 0F 00000000:00000000 00:00000000 00000000     0        0 1007",
    );
    let e = format!("{:#}", proc_tcp::parse(&bad).unwrap_err());
    assert!(e.contains("unknown state 15"), "{e}");
}

#[test]
fn seeding_compensates_transitions_during_the_scan() {
    let maps = detached_maps(false);
    // A stale value from an earlier agent is replaced.
    bpfmap::put(&maps.active_conns, &8080u16, &99i64).unwrap();
    let socks = proc_tcp::parse(PROC_NET_TCP).unwrap();
    assert_eq!(seed_active(&maps, 8080, &[], || Ok(socks.clone())).unwrap(), 3);
    assert_eq!(maps.active(8080).unwrap(), Some(3));

    // The first scan races a connection that opens (the tracepoint adds 1
    // while /proc is read): it is retried, and the connection is counted once.
    let calls = std::cell::Cell::new(0);
    let n = seed_active(&maps, 8081, &[], || {
        calls.set(calls.get() + 1);
        if calls.get() == 1 {
            let v = maps.active(8081).unwrap().unwrap();
            bpfmap::put(&maps.active_conns, &8081u16, &(v + 1)).unwrap();
        }
        // 8081 has 2 active sockets in the sample, plus the new one.
        let mut s = socks.clone();
        s.push(proc_tcp::TcpSocket { local_port: 8081, peer: socks[1].peer, peer_port: 0xD440, state: TcpState::Established, request: false });
        Ok(s)
    })
    .unwrap();
    assert_eq!(calls.get(), 2);
    assert_eq!(n, 3);
    assert_eq!(maps.active(8081).unwrap(), Some(3));
}

// ---------------------------------------------------------------- cpu score

#[test]
fn cpu_score_from_proc_stat() {
    let text = "cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 5 0 5 50 0 0 0 0 0 0\ncpu1 5 0 5 50 0 0 0 0 0 0\n\
                intr 0\nctxt 1\nbtime 1\nprocesses 10\nprocs_running 3\nprocs_blocked 0\n";
    assert_eq!(parse_proc_stat(text).unwrap(), (3, 2));
    assert!(format!("{:#}", parse_proc_stat("cpu0 1\n").unwrap_err()).contains("no procs_running"));
    let mut rq = RunQueue::default();
    // The sampler itself is one of procs_running: 3 → 2 runnable on 2 CPUs.
    assert_eq!(rq.push(3, 2), 100);
    assert_eq!(rq.push(1, 2), 50); // (2 + 0) / 2 samples / 2 CPUs
    assert_eq!(rq.push(0, 2), 33); // nothing below the sampler itself; 2/3/2 = 0.333
    assert_eq!(rq.push(9, 2), 125); // (2 + 0 + 0 + 8) / 4 / 2
    assert_eq!(rq.push(1, 2), 100); // (2 + 0 + 0 + 8 + 0) / 5 / 2
                                    // The window is 5 samples: the first (2) drops out.
    assert_eq!(rq.push(1, 2), 80); // (0 + 0 + 8 + 0 + 0) / 5 / 2
}

// ---------------------------------------------------------------- the agent on a veth

/// A network namespace with a veth pair inside (eth0 10.99.0.2, peer0
/// 10.99.0.1), deleted on drop together with an agent still running in it.
struct Netns {
    name: String,
    agent: Option<Child>,
}

impl Netns {
    fn new(name: String) -> Netns {
        // A namespace of the same name can only be left over from a killed run.
        let _ = Command::new("ip").args(["netns", "del", &name]).stderr(Stdio::null()).status();
        let ns = Netns { name, agent: None };
        for args in [
            vec!["netns", "add", &ns.name],
            vec!["-n", &ns.name, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0"],
            vec!["-n", &ns.name, "addr", "add", "10.99.0.2/24", "dev", "eth0"],
            vec!["-n", &ns.name, "addr", "add", "10.99.0.1/24", "dev", "peer0"],
            vec!["-n", &ns.name, "link", "set", "eth0", "up"],
            vec!["-n", &ns.name, "link", "set", "peer0", "up"],
            vec!["-n", &ns.name, "link", "set", "lo", "up"],
        ] {
            let st = Command::new("ip").args(&args).status().unwrap();
            assert!(st.success(), "ip {args:?} failed");
        }
        ns
    }

    fn run(&self, prog: &str, args: &[&str]) -> std::process::Output {
        Command::new("nsenter").arg(format!("--net=/run/netns/{}", self.name)).arg(prog).args(args).output().unwrap()
    }

    fn tc(&self, args: &[&str]) -> String {
        let out = Command::new("ip").args(["netns", "exec", &self.name, "tc"]).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `f` on a thread inside the namespace; sockets it creates stay
    /// in the namespace wherever they are used afterwards.
    fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(path).unwrap();
            use std::os::fd::AsRawFd;
            // SAFETY: setns on a valid namespace fd; affects this thread only.
            assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            f()
        })
        .join()
        .unwrap()
    }

    fn pins(&self) -> PathBuf {
        PathBuf::from(format!("/sys/fs/bpf/inband/netns/{}/agent/eth0", self.name))
    }

    fn start_agent(&mut self, config: &Path, log: &Path) {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.name))
            .arg(env!("CARGO_BIN_EXE_inband"))
            .args(["agent", "run", "--config"])
            .arg(config)
            .env("INBAND_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap();
        self.agent = Some(child);
    }

    /// SIGTERM (or SIGKILL) to the agent; returns whether it exited 0.
    fn stop_agent(&mut self, signal: i32) -> bool {
        let mut child = self.agent.take().expect("agent running");
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(child.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return st.success();
            }
            assert!(Instant::now() < deadline, "agent did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if self.pins().exists() {
            let _ = self.run(env!("CARGO_BIN_EXE_inband"), &["agent", "detach", "--interface", "eth0"]);
        }
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// The agent runs need root, bpffs and tracefs; the test command always
/// runs as root, so anything else is a failure to report, not a skip.
fn require_root_with_bpf() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test loads BPF programs and creates network namespaces: run the tests as root (e.g. `sudo -E cargo test`)"
    );
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    if !mounts.lines().any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf")) {
        assert!(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]).status().unwrap().success());
    }
    if !Path::new("/sys/kernel/tracing/events").exists() {
        let _ = Command::new("mount").args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"]).status();
    }
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An agent.toml for the namespace's eth0, authenticating with the key
/// files `keys` (id, file).
fn agent_config(dir: &Path, socket: &Path, keys: &[(u8, &Path)]) -> PathBuf {
    let path = dir.join("agent.toml");
    let keys: Vec<String> = keys.iter().map(|(id, f)| format!("{{ id = {id}, file = \"{}\" }}", f.display())).collect();
    std::fs::write(
        &path,
        format!(
            "interface = \"eth0\"\nbalancers = [\"10.99.0.1\"]\nscore_socket = \"{}\"\npoll_port = 9137\n\n\
             [[service]]\nport = 8080\nvip = \"10.77.0.100:80\"\n\n[auth]\nkeys = [{}]\n",
            socket.display(),
            keys.join(", ")
        ),
    )
    .unwrap();
    path
}

/// A fresh key file in `dir`.
fn key_file(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    inband_core::auth::keygen(&p).unwrap();
    p
}

fn active_8080(socket: &Path) -> Option<i64> {
    let r = score_socket::request(socket, "get").ok()?;
    let v: serde_json::Value = serde_json::from_str(&r).ok()?;
    v["ports"]["8080"]["active_connections"].as_i64()
}

const MAP_NAMES: [&str; 15] = [
    "active_conns",
    "agent_config",
    "agent_stats",
    "auth_keys",
    "balancer_nets",
    "balancers",
    "carrier_slot",
    "closed_flows",
    "conn_counted",
    "dsr_flows",
    "fleet_instances",
    "inflight",
    "inflight_conns",
    "score_override",
    "services",
];

fn pinned(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn agent_attaches_counts_and_cleans_up() {
    require_root_with_bpf();
    let mut ns = Netns::new(format!("ibt-ag-{}", std::process::id()));
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("agent.sock");
    let key = key_file(tmp.path(), "auth-1.key");
    let config = agent_config(tmp.path(), &socket, &[(1, &key)]);
    let log = tmp.path().join("agent.log");

    // Three connections to the service exist before the agent starts: the
    // seed must find them in /proc/net/tcp.
    let (listener, mut conns) = ns.within(|| {
        let l = std::net::TcpListener::bind("10.99.0.2:8080").unwrap();
        let mut conns = Vec::new();
        for _ in 0..3 {
            let c = std::net::TcpStream::connect("10.99.0.2:8080").unwrap();
            let (s, _) = l.accept().unwrap();
            conns.push((c, s));
        }
        (l, conns)
    });

    ns.start_agent(&config, &log);
    let seeded = wait_for("the score socket", || active_8080(&socket));
    let logtext = || std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(seeded, 3, "seeded count; log:\n{}", logtext());

    let ingress = ns.tc(&["filter", "show", "dev", "eth0", "ingress"]);
    let egress = ns.tc(&["filter", "show", "dev", "eth0", "egress"]);
    assert!(ingress.contains("agent_ingress") && ingress.contains("handle 0x1b0"), "{ingress}");
    assert!(egress.contains("agent_egress") && egress.contains("handle 0x1b0"), "{egress}");
    assert!(ns.tc(&["qdisc", "show", "dev", "eth0"]).contains("clsact"));
    assert_eq!(pinned(&ns.pins()), MAP_NAMES);

    // The tracepoint follows new connections and closes from here on.
    let extra = ns.within(move || {
        let c = std::net::TcpStream::connect("10.99.0.2:8080").unwrap();
        let (s, _) = listener.accept().unwrap();
        (c, s)
    });
    wait_for("4 active connections", || (active_8080(&socket) == Some(4)).then_some(()));
    // Client closes: its FIN ends the count (CLOSE_WAIT does not count),
    // also for a connection older than the agent (counted by the seed,
    // without a mark: its states' delta counts).
    let (c, s) = conns.pop().unwrap();
    drop(c);
    wait_for("3 active connections", || (active_8080(&socket) == Some(3)).then_some(()));
    drop(s);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(active_8080(&socket), Some(3), "its server side closing is not uncounted twice");
    drop(extra);
    wait_for("2 active connections", || (active_8080(&socket) == Some(2)).then_some(()));

    // `status` reads the pins.
    let out = ns.run(env!("CARGO_BIN_EXE_inband"), &["agent", "status", "--interface", "eth0", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["ports"]["8080"]["active_connections"], 2);
    assert_eq!(st["ports"]["8080"]["vips"][0], "10.77.0.100:80");
    assert_eq!(st["balancers"], serde_json::json!(["10.99.0.1"]));
    assert_eq!(st["auth"], serde_json::json!({ "mode": "siphash", "key_ids": [1] }));
    assert_eq!(st["mtu"], 1500);
    let table = ns.run(env!("CARGO_BIN_EXE_inband"), &["agent", "status", "--interface", "eth0"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("auth: siphash  key ids: 1  mtu: 1500"), "{table}");
    assert!(table.contains("tuple_in_use") && table.contains("score_deferred_mtu"), "{table}");

    // An application score wins over the count, in the poll reply too.
    let out = Command::new(env!("CARGO_BIN_EXE_inband"))
        .args(["agent", "score", "set", "17", "--port", "8080", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let secret = inband_core::auth::read_key(&key).unwrap();
    let replies = ns.within(move || {
        let b = UdpSocket::bind("10.99.0.1:0").unwrap();
        let to = SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 2), 9137);
        let good = poll(&b, to, &poll_wire::encode_request(8080, Some((1, &secret)), 77));
        let bad = poll(&b, to, b"IBP1\x1f\x90\x00");
        let stranger = UdpSocket::bind("10.99.0.2:0").unwrap();
        let untrusted = poll(&stranger, to, &poll_wire::encode_request(8080, Some((1, &secret)), 78));
        (good, bad, untrusted)
    });
    let (reply, src) = replies.0.expect("poll reply");
    let keys = Some(vec![(1, secret)]);
    assert_eq!(reply, poll_wire::encode_reply(&poll_wire::Request { port: 8080, key_id: 1, nonce: 77 }, 17, &keys).unwrap());
    assert_eq!(src, SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 2), 9137));
    assert_eq!(replies.1, None);
    assert_eq!(replies.2, None);

    // A second agent on the same interface is refused before it attaches.
    let out = ns.run(env!("CARGO_BIN_EXE_inband"), &["agent", "run", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("another inband agent is running on eth0"));

    assert!(ns.stop_agent(libc::SIGTERM), "agent exit status; log:\n{}", logtext());
    let ingress = ns.tc(&["filter", "show", "dev", "eth0", "ingress"]);
    let egress = ns.tc(&["filter", "show", "dev", "eth0", "egress"]);
    assert!(!ingress.contains("agent_ingress"), "{ingress}");
    assert!(!egress.contains("agent_egress"), "{egress}");
    assert!(
        !ns.tc(&["qdisc", "show", "dev", "eth0"]).contains("clsact"),
        "the agent created clsact and must remove it"
    );
    assert!(!ns.pins().exists(), "pins left: {:?}", pinned(&ns.pins()));
    assert!(!Path::new(&format!("/run/inband/netns/{}/agent/eth0", ns.name)).exists());
    assert!(!socket.exists());
    drop(conns);
}

#[test]
fn agent_after_a_crash_reuses_state_and_detach_cleans_up() {
    require_root_with_bpf();
    let mut ns = Netns::new(format!("ibt-ag-{}-k", std::process::id()));
    // A clsact that exists before the agent is someone else's: it stays.
    ns.tc(&["qdisc", "add", "dev", "eth0", "clsact"]);
    assert!(ns.tc(&["qdisc", "show", "dev", "eth0"]).contains("clsact"));
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("agent.sock");
    let config = agent_config(tmp.path(), &socket, &[(1, &key_file(tmp.path(), "auth-1.key"))]);
    let log = tmp.path().join("agent.log");

    // Refused before attaching anything: the poll port is taken.
    let squatter = ns.within(|| UdpSocket::bind("0.0.0.0:9137").unwrap());
    let out = ns.run(env!("CARGO_BIN_EXE_inband"), &["agent", "run", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("binding UDP port 9137 for poll requests"), "{err}");
    drop(squatter);
    assert!(!ns.tc(&["filter", "show", "dev", "eth0", "ingress"]).contains("agent_ingress"));
    assert!(!ns.pins().exists());
    assert!(!socket.exists());
    assert!(!Path::new(&format!("/run/inband/netns/{}", ns.name)).exists(), "lock directory left behind");

    ns.start_agent(&config, &log);
    wait_for("the score socket", || active_8080(&socket));
    assert_eq!(score_socket::request(&socket, "set 8080 5").unwrap(), "ok");
    assert!(!ns.stop_agent(libc::SIGKILL));
    // Killed: filters and pins stay (connections keep their DSR path).
    assert!(ns.tc(&["filter", "show", "dev", "eth0", "ingress"]).contains("agent_ingress"));
    assert_eq!(pinned(&ns.pins()), MAP_NAMES);

    // The next agent takes the maps over and replaces the filters in place.
    ns.start_agent(&config, &log);
    wait_for("the restarted agent", || active_8080(&socket));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("taking over the maps of an earlier agent"), "{text}");
    let ingress = ns.tc(&["filter", "show", "dev", "eth0", "ingress"]);
    assert_eq!(ingress.matches("agent_ingress").count(), 2, "one filter (name shown twice per line): {ingress}");
    // score = "connections": the override of the dead agent is not kept.
    let g: serde_json::Value = serde_json::from_str(&score_socket::request(&socket, "get").unwrap()).unwrap();
    assert_eq!(g["ports"]["8080"]["score_override"], serde_json::Value::Null);

    // `detach` refuses while an agent runs; after a kill it cleans up.
    let out = ns.run(env!("CARGO_BIN_EXE_inband"), &["agent", "detach", "--interface", "eth0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("an inband agent is running on eth0"));
    assert!(!ns.stop_agent(libc::SIGKILL));
    let out = ns.run(env!("CARGO_BIN_EXE_inband"), &["agent", "detach", "--interface", "eth0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!ns.tc(&["filter", "show", "dev", "eth0", "ingress"]).contains("agent_ingress"));
    assert!(!ns.tc(&["filter", "show", "dev", "eth0", "egress"]).contains("agent_egress"));
    assert!(!ns.pins().exists());
    // Not created by the agent: left in place.
    assert!(ns.tc(&["qdisc", "show", "dev", "eth0"]).contains("clsact"));
}

/// The pinned `auth_keys` of the agent in `ns`: id -> key halves, valid ones only.
fn pinned_keys(ns: &Netns) -> BTreeMap<u8, (u64, u64)> {
    let maps = AgentMaps::open(&bpfmap::PinDir(ns.pins())).unwrap();
    (0..256u32)
        .filter_map(|id| {
            let k: AuthKey = bpfmap::get(&maps.auth_keys, &id).unwrap()?;
            (k.valid != 0).then_some((id as u8, (k.k0, k.k1)))
        })
        .collect()
}

fn pinned_data_path(ns: &Netns) -> DataPathConfig {
    let maps = AgentMaps::open(&bpfmap::PinDir(ns.pins())).unwrap();
    bpfmap::get(&maps.agent_config, &0u32).unwrap().unwrap()
}

#[test]
fn agent_sighup_rotates_keys_without_detaching() {
    require_root_with_bpf();
    let mut ns = Netns::new(format!("ibt-ag-{}-h", std::process::id()));
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("agent.sock");
    let log = tmp.path().join("agent.log");
    let logtext = || std::fs::read_to_string(&log).unwrap_or_default();
    let (k1, k2) = (key_file(tmp.path(), "auth-1.key"), key_file(tmp.path(), "auth-2.key"));
    let halves = |p: &Path| inband_core::auth::read_key(p).unwrap().halves();
    let config = agent_config(tmp.path(), &socket, &[(1, &k1)]);
    ns.start_agent(&config, &log);
    wait_for("the score socket", || active_8080(&socket));
    assert_eq!(pinned_keys(&ns), BTreeMap::from([(1, halves(&k1))]));
    assert_eq!(pinned_data_path(&ns).auth_mode, AuthMode::Siphash.to_c());
    // A connection's client tuple, which a rotation must not drop.
    let maps = AgentMaps::open(&bpfmap::PinDir(ns.pins())).unwrap();
    let conn = ConnKey {
        peer_addr: inband_core::pod::be_ip(IpAddr::V4(Ipv4Addr::new(10, 99, 0, 1))),
        peer_port: 2000u16.to_be(),
        local_port: 8080u16.to_be(),
        proto: 6,
        pad: [0; 3],
    };
    let flow = DsrFlow {
        client_addr: inband_core::pod::be_ip(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7))),
        client_port: 40000u16.to_be(),
        ..Default::default()
    };
    bpfmap::put(&maps.dsr_flows, &conn, &flow).unwrap();
    let hup = |ns: &Netns| {
        // SAFETY: signalling our own child (nsenter execs the agent) by pid.
        unsafe { libc::kill(ns.agent.as_ref().unwrap().id() as i32, libc::SIGHUP) };
    };
    let running = |ns: &mut Netns| ns.agent.as_mut().unwrap().try_wait().unwrap().is_none();

    // Step 1 of a rotation: the new key next to the old one.
    agent_config(tmp.path(), &socket, &[(1, &k1), (2, &k2)]);
    hup(&ns);
    wait_for("both keys", || (pinned_keys(&ns).len() == 2).then_some(()));
    assert_eq!(pinned_keys(&ns), BTreeMap::from([(1, halves(&k1)), (2, halves(&k2))]));
    wait_for("the reload logged", || logtext().contains("key ids added: 2").then_some(()));
    assert!(running(&mut ns), "the agent keeps running; log:\n{}", logtext());
    assert_eq!(bpfmap::get::<ConnKey, DsrFlow>(&maps.dsr_flows, &conn).unwrap(), Some(flow), "flows kept");
    assert!(ns.tc(&["filter", "show", "dev", "eth0", "ingress"]).contains("agent_ingress"), "still attached");
    let g: serde_json::Value = serde_json::from_str(&score_socket::request(&socket, "get").unwrap()).unwrap();
    assert_eq!(g["auth"], serde_json::json!({ "mode": "siphash", "key_ids": [1, 2] }));
    assert!(!logtext().contains(&format!("{:016x}", halves(&k2).0)), "key bytes never logged");

    // A config that does not load (a key file gone) changes nothing.
    std::fs::remove_file(&k1).unwrap();
    hup(&ns);
    wait_for("the refusal logged", || logtext().contains("config not reloaded").then_some(()));
    assert_eq!(pinned_keys(&ns).len(), 2);
    assert!(running(&mut ns));

    // Step 2: the old key goes; settings SIGHUP does not apply are named.
    let text = std::fs::read_to_string(agent_config(tmp.path(), &socket, &[(2, &k2)])).unwrap();
    std::fs::write(&config, text.replace("poll_port = 9137", "poll_port = 9138")).unwrap();
    hup(&ns);
    wait_for("the old key removed", || (pinned_keys(&ns) == BTreeMap::from([(2, halves(&k2))])).then_some(()));
    wait_for("the warning", || logtext().contains("restart the agent").then_some(()));
    assert!(logtext().contains("poll_port"), "{}", logtext());

    // The seed format, and back: the mode follows too.
    std::fs::write(&config, format!("{}[auth]\nmode = \"none\"\n", &text[..text.find("[auth]").unwrap()])).unwrap();
    hup(&ns);
    wait_for("mode none", || (pinned_data_path(&ns).auth_mode == AuthMode::None.to_c()).then_some(()));
    assert!(pinned_keys(&ns).is_empty(), "{}", logtext());
    assert!(logtext().contains("auth mode siphash -> none"), "{}", logtext());

    // The interface MTU is followed without a signal.
    assert_eq!(pinned_data_path(&ns).mtu, 1500);
    let st = Command::new("ip").args(["-n", &ns.name, "link", "set", "eth0", "mtu", "1400"]).status().unwrap();
    assert!(st.success());
    wait_for("the new MTU", || (pinned_data_path(&ns).mtu == 1400).then_some(()));
    assert!(logtext().contains("mtu 1500 -> 1400"), "{}", logtext());

    assert!(running(&mut ns));
    assert!(ns.stop_agent(libc::SIGTERM), "log:\n{}", logtext());
    assert!(!ns.pins().exists());
}

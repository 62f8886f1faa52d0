//! BPF_PROG_TEST_RUN fixtures for bpf/agent.bpf.c: every branch of the tc
//! ingress and egress programs on frames built with `inband_testkit::packet` and
//! options built with `inband_core::wire`, and the connection accounting of the
//! tracepoint on real loopback TCP.
//!
//! Needs root (loading BPF, network namespaces). Route-dependent cases
//! (`bpf_fib_lookup`) and socket-dependent ones (`bpf_skc_lookup_tcp`) run
//! with the test thread moved into a namespace of its own: the test run
//! gives the packet that namespace's loopback device, so both helpers see
//! only the routes and sockets the test made.

use std::ffi::CString;
use std::mem::MaybeUninit;
use std::sync::Mutex;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use inband_agent::config::ScoreSource;
use inband_agent::maps::{AgentCounter, Balancer, ConnKey, DataPathConfig, DsrFlow, Service, ServiceKey};
use inband_agent::tables::balancer_net;
use inband_core::auth::AuthMode;
use inband_agent::bpf::agent::{AgentSkel, AgentSkelBuilder};
use inband_testkit::packet::{
    mss_option, parse, Mac, PacketBuilder, ETH_HLEN, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS, IPPROTO_TCP, TCP_ACK,
    TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN,
};
use inband_lb::tables::ktime_ns;
use inband_core::pod::{be_ip, be_port, Pod};
use inband_core::wire::{Conn, InbandOption, Key};
use libbpf_rs::libbpf_sys;
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{AsRawLibbpf, MapCore, MapFlags, MapMut, OpenObject, ProgramInput, ProgramMut};

// Shared by the fixture crates; this one needs only part of it.
#[allow(dead_code)]
mod frames;
mod own_netns;
use own_netns::TestNetns;
use frames::{cut6, ext, ipip, opts_header, routing, IPPROTO_ROUTING};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const LB: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const SNAT_PORT: u16 = 2000;
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
const LOCAL_PORT: u16 = 8080;
const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const VIP_PORT: u16 = 80;
/// Routed via a gateway with a permanent neighbour entry.
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
/// Routed via a gateway with no neighbour entry.
const CLIENT_NO_NEIGH: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 9);
/// No route at all.
const CLIENT_UNROUTED: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 7);
/// Whom a forged 155 wants the server's responses sent to.
const VICTIM: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 66);
const CLIENT_PORT: u16 = 40000;

/// The key the balancer signs with in these fixtures, and a second one.
const KEY_ID: u8 = 1;
const KEY: Key = Key(*b"inband-agent-k01");
const KEY2_ID: u8 = 7;
const KEY2: Key = Key(*b"inband-agent-k07");
/// The interface MTU the agent is configured with unless a test says otherwise.
const MTU: u16 = 1500;

const SERVER_MAC: Mac = [0x02, 0, 0, 0, 0xaa, 0x01];
const GATEWAY_MAC: Mac = [0x02, 0, 0, 0, 0xbb, 0x01];
const DEV: &str = "ibt-s0";

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}
fn lb() -> SocketAddr {
    sa(LB, SNAT_PORT)
}
fn server() -> SocketAddr {
    sa(SERVER, LOCAL_PORT)
}
fn vip() -> SocketAddr {
    sa(VIP, VIP_PORT)
}
fn client() -> SocketAddr {
    sa(CLIENT, CLIENT_PORT)
}
/// The connection as the balancer sends it to the server.
fn conn() -> Conn {
    Conn::tcp(lb(), server())
}
fn conn_key() -> ConnKey {
    conn_key_of(lb(), LOCAL_PORT, 6)
}
fn conn_key_of(peer: SocketAddr, local_port: u16, proto: u8) -> ConnKey {
    ConnKey { peer_addr: be_ip(peer.ip()), peer_port: be_port(peer.port()), local_port: be_port(local_port), proto, pad: [0; 3] }
}
fn tuple_flow(client: impl Into<IpAddr>) -> DsrFlow {
    DsrFlow { client_addr: be_ip(client.into()), client_port: be_port(CLIENT_PORT), ..Default::default() }
}
/// An entry whose 124 was accepted, signed with `key_id` and `nonce`.
fn requested(flow: DsrFlow, key_id: u8, nonce: [u8; 4]) -> DsrFlow {
    DsrFlow { score_requested: 1, probe_key: key_id, probe_nonce: u32::from_ne_bytes(nonce), ..flow }
}

/// The client's SYN as the balancer forwards it (sequence number 1000).
fn syn() -> PacketBuilder {
    PacketBuilder::tcp(lb(), server()).syn(1452)
}
/// The authenticated 155 for `p` (signed over its sequence number).
fn auth_tuple(p: &PacketBuilder, key_id: u8, key: &Key, client: SocketAddr) -> Vec<u8> {
    InbandOption::auth_client_tuple(key, key_id, p.seq, Conn::tcp(p.src, p.dst), client).encode()
}
fn seed_tuple(client: SocketAddr) -> Vec<u8> {
    InbandOption::ClientTuple(client).encode()
}
fn auth_request(nonce: [u8; 4]) -> Vec<u8> {
    InbandOption::auth_score_request(&KEY, KEY_ID, nonce, conn()).encode()
}
/// A client request toward the server, as the balancer forwards it.
fn request() -> PacketBuilder {
    PacketBuilder::tcp(lb(), server()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec())
}

/// A loaded agent a test holds; back among the idle ones when it ends.
struct Agent {
    skel: &'static AgentSkel<'static>,
    source: ScoreSource,
}

impl std::ops::Deref for Agent {
    type Target = AgentSkel<'static>;
    fn deref(&self) -> &AgentSkel<'static> {
        self.skel
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // A failed test's agent is not reused: whatever went wrong stays with it.
        if !std::thread::panicking() {
            IDLE.lock().unwrap().push((self.source, Pooled(self.skel)));
        }
    }
}

/// Loaded agents no test holds, by their score source (a constant fixed
/// at load). A test takes one and resets its maps rather
/// than loading its own: the verifier was most of this binary's time.
static IDLE: Mutex<Vec<(ScoreSource, Pooled)>> = Mutex::new(Vec::new());

struct Pooled(&'static AgentSkel<'static>);
// SAFETY: a pooled agent is used by one test at a time, and the skeleton's
// libbpf objects (descriptors and heap memory) belong to no thread.
unsafe impl Send for Pooled {}

/// The agent with pinning switched off, so a test run leaves nothing under
/// /sys/fs/bpf and never reuses a running agent's maps.
fn load() -> Agent {
    load_with(ScoreSource::Connections)
}

/// `source`: what a 125 carries, and whether data packets are accounted
/// for requests in flight.
fn load_with(source: ScoreSource) -> Agent {
    let idle = {
        let mut idle = IDLE.lock().unwrap();
        idle.iter().position(|(s, _)| *s == source).map(|i| idle.swap_remove(i).1)
    };
    if let Some(Pooled(skel)) = idle {
        inband_core::bpfmap::reset_maps(skel.object()).expect("reset a pooled agent");
        return Agent { skel, source };
    }
    // The skeleton borrows its object storage for as long as it lives,
    // which for a pooled agent is the process's life.
    let obj: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
    let mut open = AgentSkelBuilder::default().open(obj).expect("open agent skeleton");
    for map in open.open_object_mut().maps_mut() {
        // SAFETY: a valid open map; a NULL path is libbpf's "do not pin".
        let rc = unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
        assert_eq!(rc, 0);
    }
    open.maps.rodata_data.as_mut().expect("rodata").score_source = source.data_path();
    let skel: &'static AgentSkel<'static> = Box::leak(Box::new(open.load().expect("load agent (verifier)")));
    Agent { skel, source }
}

fn put<K: Pod, V: Pod>(map: &MapMut, key: &K, value: &V) {
    map.update(key.as_bytes(), value.as_bytes(), MapFlags::ANY).expect("map update");
}
fn get<K: Pod, V: Pod>(map: &MapMut, key: &K) -> Option<V> {
    map.lookup(key.as_bytes(), MapFlags::ANY).expect("map lookup").map(|b| V::from_bytes(&b))
}

/// A server agent for LOCAL_PORT serving VIP:VIP_PORT, trusting LB, with
/// authenticated options under KEY (id KEY_ID) and an MTU of 1500.
fn configure(skel: &AgentSkel) {
    add_service(skel, LOCAL_PORT, 6, vip());
    put(&skel.maps.balancers, &be_ip(LB.into()), &Balancer::default());
    set_keys(skel, &[(KEY_ID, KEY)]);
    set_mode(skel, AuthMode::Siphash, MTU);
}

/// `port` (of transport `proto`) serves `vip`.
fn add_service(skel: &AgentSkel, port: u16, proto: u8, vip: SocketAddr) {
    let key = ServiceKey { port: be_port(port), proto, family: if vip.is_ipv4() { 4 } else { 6 } };
    put(&skel.maps.services, &key, &Service { vip_addr: be_ip(vip.ip()), vip_port: be_port(vip.port()), pad: 0 });
}

/// As `configure`, with the seed's unauthenticated options.
fn configure_seed(skel: &AgentSkel) {
    configure(skel);
    set_keys(skel, &[]);
    set_mode(skel, AuthMode::None, MTU);
}

fn set_mode(skel: &AgentSkel, mode: AuthMode, mtu: u16) {
    put(&skel.maps.agent_config, &0u32, &DataPathConfig { auth_mode: mode.to_c(), mtu, ..Default::default() });
}

fn set_keys(skel: &AgentSkel, keys: &[(u8, Key)]) {
    inband_core::auth::write_keys(&skel.maps.auth_keys, keys).expect("writing auth_keys");
}

fn counters(skel: &AgentSkel) -> Vec<(AgentCounter, u64)> {
    AgentCounter::ALL
        .iter()
        .map(|&c| {
            let key = (c as u32).to_ne_bytes();
            let per_cpu = skel.maps.agent_stats.lookup_percpu(&key, MapFlags::ANY).unwrap().unwrap();
            (c, per_cpu.iter().map(|v| u64::from_bytes(v)).sum())
        })
        .collect()
}

/// Asserts every counter: the listed ones have these values, all others are 0.
#[track_caller]
fn assert_counters(skel: &AgentSkel, expected: &[(AgentCounter, u64)]) {
    let want: Vec<(AgentCounter, u64)> =
        AgentCounter::ALL.iter().map(|&c| (c, expected.iter().find(|(e, _)| *e == c).map_or(0, |(_, n)| *n))).collect();
    assert_eq!(counters(skel), want);
}

fn flows(skel: &AgentSkel) -> usize {
    skel.maps.dsr_flows.keys().count()
}

/// Runs a tc program on one frame; `ifindex` sets `__sk_buff.ifindex` (the
/// device bpf_fib_lookup uses). Returns the verdict and the output frame.
fn run(prog: &ProgramMut, frame: &[u8], ifindex: Option<u32>) -> (u32, Vec<u8>) {
    run_gso(prog, frame, ifindex, None)
}

/// As `run`; `gso`: the frame stands for a GSO burst of (gso_segs,
/// gso_size). The test run hands every frame over as CHECKSUM_NONE.
fn run_gso(prog: &ProgramMut, frame: &[u8], ifindex: Option<u32>, gso: Option<(u32, u32)>) -> (u32, Vec<u8>) {
    use inband_agent::bpf::agent::types::__sk_buff;
    let mut ctx = vec![0u8; std::mem::size_of::<__sk_buff>()];
    let mut set = |off: usize, v: u32| ctx[off..off + 4].copy_from_slice(&v.to_ne_bytes());
    set(std::mem::offset_of!(__sk_buff, ifindex), ifindex.unwrap_or(0));
    let (segs, size) = gso.unwrap_or((0, 0));
    set(std::mem::offset_of!(__sk_buff, gso_segs), segs);
    set(std::mem::offset_of!(__sk_buff, gso_size), size);
    let mut out = vec![0u8; 4096];
    let input = ProgramInput {
        data_in: Some(frame),
        data_out: Some(&mut out),
        context_in: (ifindex.is_some() || gso.is_some()).then_some(&mut ctx[..]),
        ..Default::default()
    };
    let output = prog.test_run(input).expect("BPF_PROG_TEST_RUN");
    let ret = output.return_value;
    let len = output.data.expect("output data").len();
    out.truncate(len);
    (ret, out)
}

/// Byte-exact frame comparison that reports where two frames differ
/// instead of dumping both.
#[track_caller]
fn assert_frame(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        panic!(
            "{what}: frames differ (len {} vs {}), first at byte {first}\n got: {:?}\nwant: {:?}",
            got.len(),
            want.len(),
            parse(got),
            parse(want)
        );
    }
}

/// Runs ingress on `frame` and asserts the verdict; for a pass, that the
/// output is `want` byte for byte.
#[track_caller]
fn ingress(skel: &AgentSkel, frame: &[u8], verdict: u32, want: Option<&[u8]>, what: &str) {
    let (ret, out) = run(&skel.progs.agent_ingress, frame, None);
    assert_eq!(ret, verdict, "{what}: verdict");
    if let Some(want) = want {
        assert_frame(&out, want, what);
    }
}

// ---------------------------------------------------------------- ingress: 155

#[test]
fn ingress_stores_an_authenticated_client_tuple_and_strips_155() {
    let skel = load();
    configure(&skel);
    let plain = syn();
    let with_opt = plain.clone().ip_options(auth_tuple(&plain, KEY_ID, &KEY, client()));

    ingress(&skel, &with_opt.build(), TC_ACT_OK, Some(&plain.build()), "the stack sees the SYN as sent");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_stores_a_seed_client_tuple_in_mode_none() {
    let skel = load();
    configure_seed(&skel);
    let plain = syn();
    ingress(
        &skel,
        &plain.clone().ip_options(seed_tuple(client())).build(),
        TC_ACT_OK,
        Some(&plain.build()),
        "stripped",
    );
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_verifies_the_checksum_of_a_syn_with_data() {
    let skel = load();
    configure(&skel);
    // TCP Fast Open: data on the SYN, more than one 64-byte chunk of the
    // software checksum and an odd length.
    let plain = syn().payload(vec![0x6b; 301]);
    let with_opt = plain.clone().ip_options(auth_tuple(&plain, KEY_ID, &KEY, client()));
    ingress(&skel, &with_opt.build(), TC_ACT_OK, Some(&plain.build()), "stripped");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));

    // One bit flipped in the last chunk: the stack would drop it.
    let mut bad = with_opt.build();
    *bad.last_mut().unwrap() ^= 0x10;
    let other = sa(VICTIM, 1);
    let mut forged = with_opt.clone().ip_options(auth_tuple(&with_opt, KEY_ID, &KEY, other)).build();
    *forged.last_mut().unwrap() ^= 0x10;
    ingress(&skel, &bad, TC_ACT_SHOT, None, "bad checksum in the last chunk");
    ingress(&skel, &forged, TC_ACT_SHOT, None, "bad checksum, another client");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1), (AgentCounter::BadChecksum, 2)]);
}

#[test]
fn ingress_drops_155_with_a_bad_checksum() {
    let skel = load();
    configure(&skel);
    let p = syn();
    let good = p.clone().ip_options(auth_tuple(&p, KEY_ID, &KEY, client())).build();
    let ip = ETH_HLEN;
    let l4 = ip + 20 + 20;

    let mut bad_ip = good.clone();
    bad_ip[ip + 10] ^= 0x01; // IPv4 header checksum
    let mut bad_tcp = good.clone();
    bad_tcp[l4 + 16] ^= 0x01; // TCP checksum
    let mut bad_window = good.clone();
    bad_window[l4 + 14] ^= 0x80; // covered by the TCP checksum only
    for (name, frame) in [("IPv4 checksum", bad_ip), ("TCP checksum", bad_tcp), ("TCP window", bad_window)] {
        ingress(&skel, &frame, TC_ACT_SHOT, None, name);
    }
    assert_eq!(flows(&skel), 0, "nothing stored");
    // Seed format: the same checks (its 155 carries no MAC at all).
    configure_seed(&skel);
    let mut bad_seed = p.clone().ip_options(seed_tuple(client())).build();
    bad_seed[ip + 20 + 2] ^= 0x01; // the client address inside the option
    ingress(&skel, &bad_seed, TC_ACT_SHOT, None, "seed 155 with its option corrupted");
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::BadChecksum, 4)]);
}

#[test]
fn ingress_drops_a_forged_155() {
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let victim = sa(VICTIM, CLIENT_PORT);
    let p = syn();

    let mut flipped = auth_tuple(&p, KEY_ID, &KEY, victim);
    *flipped.last_mut().unwrap() ^= 0x01;
    // A genuine option with the client replaced, and one signed for a SYN
    // with another sequence number (a replay onto this one).
    let mut swapped = auth_tuple(&p, KEY_ID, &KEY, client());
    swapped[4..8].copy_from_slice(&VICTIM.octets());
    let replayed = auth_tuple(&p.clone().seq_no(999), KEY_ID, &KEY, victim);
    let wrong_key = auth_tuple(&p, KEY_ID, &KEY2, victim);
    // Signed for another server port, or another balancer port.
    let other_backend = InbandOption::auth_client_tuple(
        &KEY,
        KEY_ID,
        p.seq,
        Conn::tcp(lb(), sa(SERVER, LOCAL_PORT + 1)),
        victim,
    )
    .encode();
    let other_snat = InbandOption::auth_client_tuple(
        &KEY,
        KEY_ID,
        p.seq,
        Conn::tcp(sa(LB, 2001), server()),
        victim,
    )
    .encode();
    let cases = [
        ("MAC bit flipped", flipped),
        ("client replaced", swapped),
        ("replayed onto another SYN", replayed),
        ("signed with another key", wrong_key),
        ("signed for another backend port", other_backend),
        ("signed for another SNAT port", other_snat),
    ];
    let n = cases.len() as u64;
    for (name, opt) in cases {
        ingress(&skel, &p.clone().ip_options(opt).build(), TC_ACT_SHOT, None, name);
    }
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)), "unchanged");
    assert_eq!(flows(&skel), 1);
    assert_counters(&skel, &[(AgentCounter::AuthFailed, n)]);
}

#[test]
fn ingress_drops_155_under_an_unknown_key_id() {
    let skel = load();
    configure(&skel);
    let p = syn();
    // Correctly signed, but with keys the agent does not have: id 7
    // (not loaded), and id 0 (never valid).
    for (id, key) in [(KEY2_ID, KEY2), (0, KEY)] {
        ingress(&skel, &p.clone().ip_options(auth_tuple(&p, id, &key, client())).build(), TC_ACT_SHOT, None, "key id");
    }
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::AuthFailed, 2)]);

    // Once the key is loaded (rotation), the same option is accepted.
    set_keys(&skel, &[(KEY_ID, KEY), (KEY2_ID, KEY2)]);
    let plain = syn();
    ingress(
        &skel,
        &plain.clone().ip_options(auth_tuple(&plain, KEY2_ID, &KEY2, client())).build(),
        TC_ACT_OK,
        Some(&plain.build()),
        "second key",
    );
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::AuthFailed, 2), (AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_drops_options_of_the_format_not_configured() {
    let skel = load();
    configure(&skel);
    let p = syn();
    // Authenticated mode: a seed option carries no MAC.
    let seed_cases = [
        ("seed 155", p.clone().ip_options(seed_tuple(client())).build()),
        ("seed 124", request().ip_options(InbandOption::ScoreRequest.encode()).build()),
        ("155 of length 6", p.clone().ip_options(vec![155, 6, 1, 2, 3, 4, 0, 0]).build()),
        ("124 of length 8", request().ip_options(vec![124, 8, 0, 0, 0, 0, 0, 0]).build()),
    ];
    for (name, frame) in &seed_cases {
        ingress(&skel, frame, TC_ACT_SHOT, None, name);
    }
    // Seed mode: a balancer configured for MACs is a configuration error.
    configure_seed(&skel);
    let auth_cases = [
        ("authenticated 155", p.clone().ip_options(auth_tuple(&p, KEY_ID, &KEY, client())).build()),
        ("authenticated 124", request().ip_options(auth_request([1, 2, 3, 4])).build()),
    ];
    for (name, frame) in &auth_cases {
        ingress(&skel, frame, TC_ACT_SHOT, None, name);
    }
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::WrongFormat, 6)]);
}

#[test]
fn ingress_drops_155_on_anything_but_a_syn() {
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let victim = sa(VICTIM, CLIENT_PORT);
    // The attack this stops: a 155 on the ACKs of a live download,
    // redirecting its data.
    for (name, p) in [
        ("ACK", PacketBuilder::tcp(lb(), server()).flags(TCP_ACK)),
        ("data", request()),
        ("SYN-ACK", PacketBuilder::tcp(lb(), server()).flags(TCP_SYN | TCP_ACK)),
    ] {
        let frame = p.clone().ip_options(auth_tuple(&p, KEY_ID, &KEY, victim)).build();
        ingress(&skel, &frame, TC_ACT_SHOT, None, name);
    }
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)), "unchanged");
    assert_counters(&skel, &[(AgentCounter::NotSyn, 3)]);
}

#[test]
fn ingress_strips_only_the_first_option_and_keeps_the_rest() {
    let skel = load();
    configure(&skel);
    // A 155 followed by a (made-up, 4-byte) option the agent does not own.
    let other = vec![0x88, 4, 0xab, 0xcd];
    let p = syn();
    let mut opts = auth_tuple(&p, KEY_ID, &KEY, client());
    opts.extend_from_slice(&other);
    ingress(
        &skel,
        &p.clone().ip_options(opts).build(),
        TC_ACT_OK,
        Some(&p.ip_options(other).build()),
        "only the 155 removed",
    );
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_untrusted_source_is_untouched_and_counted() {
    let skel = load();
    configure(&skel);
    let stranger = PacketBuilder::tcp(sa(Ipv4Addr::new(10, 0, 0, 66), SNAT_PORT), server()).syn(1452);
    let frames = [
        stranger.clone().ip_options(auth_tuple(&stranger, KEY_ID, &KEY, client())).build(),
        stranger.clone().ip_options(seed_tuple(client())).build(),
        stranger.clone().ip_options(auth_request([1, 2, 3, 4])).build(),
    ];
    for frame in &frames {
        ingress(&skel, frame, TC_ACT_OK, Some(frame), "untrusted");
    }
    assert_eq!(flows(&skel), 0, "nothing stored for a non-balancer");
    assert_counters(&skel, &[(AgentCounter::UntrustedOption, 3)]);
}

#[test]
fn ingress_malformed_ipv4_is_untouched_and_counted() {
    let skel = load();
    configure(&skel);
    let p = syn();
    let good = p.clone().ip_options(auth_tuple(&p, KEY_ID, &KEY, client())).build();
    let ip = ETH_HLEN;

    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut f = good.clone();
    f[ip] = 0x44;
    cases.push(("IHL 4", f));
    let mut f = good.clone();
    f[ip] = 0x4f;
    cases.push(("IHL 15 beyond the packet", f));
    let mut f = good.clone();
    f[ip + 2..ip + 4].copy_from_slice(&(good.len() as u16).to_be_bytes());
    cases.push(("total length beyond the packet", f));
    let mut f = good.clone();
    f[ip + 2..ip + 4].copy_from_slice(&24u16.to_be_bytes());
    cases.push(("total length below the header", f));
    // Transport headers the stack would refuse or read otherwise.
    let mut f = good.clone();
    f[ip + 40 + 12] = 0xf0;
    cases.push(("TCP data offset past the segment", f));
    let mut f = datagram(lb(), server()).ip_options(udp_tuple(lb(), server(), 1, client())).build();
    f[ip + 44 + 5] += 1;
    cases.push(("UDP length past the payload", f));
    for (name, opts) in [
        ("option length 0", vec![155, 0, 1, 2, 3, 4, 5, 6]),
        ("option length 1", vec![155, 1, 1, 2, 3, 4, 5, 6]),
        ("155 overruns the header", vec![155, 20, 1, 2, 3, 4, 5, 6]),
        ("another option overruns the header", vec![0x88, 12, 1, 2, 3, 4, 5, 6]),
    ] {
        cases.push((name, syn().ip_options(opts).build()));
    }
    let n = cases.len() as u64;
    for (name, frame) in cases {
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::Malformed, n)]);
}

#[test]
fn ingress_leaves_everything_else_untouched() {
    let skel = load();
    configure(&skel);
    let tuple = auth_tuple(&syn(), KEY_ID, &KEY, client());
    let other_port = sa(SERVER, 9999);
    let cases = [
        ("no options", PacketBuilder::tcp(lb(), server()).syn(1460).build()),
        ("not a service port", PacketBuilder::tcp(lb(), other_port).syn(1452).ip_options(tuple.clone()).build()),
        ("UDP", PacketBuilder::udp(lb(), server()).ip_options(tuple.clone()).payload(b"q".to_vec()).build()),
        ("another option first", PacketBuilder::tcp(lb(), server()).ip_options(vec![0x88, 4, 0, 0]).build()),
        (
            "NOP before the 155",
            PacketBuilder::tcp(lb(), server()).ip_options([vec![1, 1, 1, 1], tuple.clone()].concat()).build(),
        ),
        ("score from a server", PacketBuilder::tcp(lb(), server()).ip_options(vec![125, 4, 0, 9]).build()),
        ("fragment", syn().frag(0x2000).ip_options(tuple.clone()).build()),
        ("server's own response", PacketBuilder::tcp(server(), lb()).ip_options(tuple.clone()).build()),
    ];
    for (name, frame) in cases {
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    let mut not_ipv4 = syn().ip_options(tuple).build();
    not_ipv4[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    ingress(&skel, &not_ipv4, TC_ACT_OK, Some(&not_ipv4), "ARP ethertype");
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[]);
}

#[test]
fn ingress_drops_a_frozen_connections_segments_until_its_time_passes() {
    let skel = load();
    configure(&skel);
    let frame = request().build();
    let frozen = DsrFlow { frozen_until_ms: monotonic_ms().wrapping_add(10_000), ..tuple_flow(CLIENT) };
    put(&skel.maps.dsr_flows, &conn_key(), &frozen);
    ingress(&skel, &frame, TC_ACT_SHOT, None, "a segment of a frozen connection");
    // Another connection of the same balancer is not touched.
    let other = PacketBuilder::tcp(sa(LB, 40001), server()).flags(TCP_ACK).build();
    put(&skel.maps.dsr_flows, &conn_key_of(sa(LB, 40001), LOCAL_PORT, 6), &tuple_flow(CLIENT));
    ingress(&skel, &other, TC_ACT_OK, Some(&other), "another connection");
    assert_counters(&skel, &[(AgentCounter::FrozenDropped, 1)]);
    // Its time passed (also across the 32-bit wrap of the milliseconds):
    // segments go to the stack again.
    let thawed = DsrFlow { frozen_until_ms: monotonic_ms().wrapping_sub(1), ..tuple_flow(CLIENT) };
    put(&skel.maps.dsr_flows, &conn_key(), &thawed);
    ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "its time passed");
    assert_counters(&skel, &[(AgentCounter::FrozenDropped, 1)]);
}

// ---------------------------------------------------------------- ingress: 124

#[test]
fn ingress_marks_an_authenticated_score_request_and_strips_124() {
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let nonce = [0xde, 0xad, 0xbe, 0xef];
    ingress(&skel, &request().ip_options(auth_request(nonce)).build(), TC_ACT_OK, Some(&request().build()), "stripped");
    let flow: Option<DsrFlow> = get(&skel.maps.dsr_flows, &conn_key());
    assert_eq!(flow, Some(requested(tuple_flow(CLIENT), KEY_ID, nonce)), "tuple kept; flag, key and nonce set");
    assert_counters(&skel, &[(AgentCounter::ProbesSeen, 1)]);
}

#[test]
fn ingress_marks_a_seed_score_request() {
    let skel = load();
    configure_seed(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let frame = request().ip_options(InbandOption::ScoreRequest.encode()).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&request().build()), "stripped");
    let flow: Option<DsrFlow> = get(&skel.maps.dsr_flows, &conn_key());
    assert_eq!(flow, Some(DsrFlow { score_requested: 1, ..tuple_flow(CLIENT) }));
    assert_counters(&skel, &[(AgentCounter::ProbesSeen, 1)]);
}

#[test]
fn ingress_drops_a_124_with_a_bad_mac() {
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let nonce = [1, 2, 3, 4];
    let mut flipped = auth_request(nonce);
    flipped[15] ^= 0x80;
    let mut other_nonce = auth_request(nonce);
    other_nonce[4] ^= 0x01;
    let other_conn = InbandOption::auth_score_request(
        &KEY,
        KEY_ID,
        nonce,
        Conn::tcp(sa(LB, 2001), server()),
    )
    .encode();
    // A 125 replayed as a 124: the kind is in the MAC.
    let mut as_score = InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 0).encode();
    as_score[0] = 124;
    as_score[2] = KEY_ID;
    for (name, opt) in [
        ("MAC bit flipped", flipped),
        ("nonce changed", other_nonce),
        ("signed for another connection", other_conn),
        ("a 125 relabelled", as_score),
    ] {
        ingress(&skel, &request().ip_options(opt).build(), TC_ACT_SHOT, None, name);
    }
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)), "no score requested");
    assert_counters(&skel, &[(AgentCounter::AuthFailed, 4)]);
}

#[test]
fn ingress_124_on_an_unknown_flow_creates_nothing_and_gets_no_answer() {
    let skel = load();
    configure(&skel);
    ingress(
        &skel,
        &request().ip_options(auth_request([9, 9, 9, 9])).build(),
        TC_ACT_OK,
        Some(&request().build()),
        "stripped",
    );
    assert_eq!(flows(&skel), 0, "no entry created");
    // An entry without a client tuple does not make the flow known either.
    let other = ConnKey { peer_port: be_port(SNAT_PORT + 1), ..conn_key() };
    put(&skel.maps.dsr_flows, &other, &DsrFlow::default());
    let other_conn = Conn::tcp(sa(LB, SNAT_PORT + 1), server());
    let p = PacketBuilder::tcp(sa(LB, SNAT_PORT + 1), server()).flags(TCP_ACK);
    let opt = InbandOption::auth_score_request(&KEY, KEY_ID, [9, 9, 9, 9], other_conn).encode();
    ingress(&skel, &p.clone().ip_options(opt).build(), TC_ACT_OK, Some(&p.build()), "stripped");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &other), Some(DsrFlow::default()));

    // The server's responses carry no 125.
    let resp = PacketBuilder::tcp(server(), lb()).flags(TCP_ACK).build();
    let (ret, out) = run(&skel.progs.agent_egress, &resp, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &resp, "no score");
    assert_counters(&skel, &[(AgentCounter::ProbeUnknownFlow, 2)]);
}

// ---------------------------------------------------------------- egress: scores

fn response() -> PacketBuilder {
    PacketBuilder::tcp(server(), lb()).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n".to_vec())
}

/// Runs one response through egress with `flow` stored; returns the frame
/// and asserts the flag was cleared with everything else kept.
fn answer(skel: &AgentSkel, flow: DsrFlow) -> Vec<u8> {
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let (ret, out) = run(&skel.progs.agent_egress, &response().build(), None);
    assert_eq!(ret, TC_ACT_OK);
    let got: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(got, DsrFlow { score_requested: 0, ..flow }, "flag cleared, the rest kept");
    out
}

fn with_option(opt: InbandOption) -> Vec<u8> {
    response().ip_options(opt.encode()).build()
}

fn seed_flow() -> DsrFlow {
    DsrFlow { score_requested: 1, ..tuple_flow(CLIENT) }
}

#[test]
fn egress_answers_a_seed_score_request_with_active_connections() {
    let skel = load();
    configure_seed(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    // A tuple is present: the 125 still goes to the balancer, not via DSR.
    assert_frame(&answer(&skel, seed_flow()), &with_option(InbandOption::Score(3)), "score 3");
    put(&skel.maps.active_conns, &LOCAL_PORT, &300_000i64);
    assert_frame(&answer(&skel, seed_flow()), &with_option(InbandOption::Score(65535)), "saturated");
    put(&skel.maps.active_conns, &LOCAL_PORT, &-2i64);
    assert_frame(&answer(&skel, seed_flow()), &with_option(InbandOption::Score(0)), "a negative count reads as idle");
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 3)]);
}

#[test]
fn egress_answers_with_an_authenticated_125() {
    let skel = load();
    configure(&skel);
    set_keys(&skel, &[(KEY_ID, KEY), (KEY2_ID, KEY2)]);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    let nonce = [0x01, 0x02, 0x03, 0x04];
    let want = InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 3);
    assert_frame(&answer(&skel, requested(tuple_flow(CLIENT), KEY_ID, nonce)), &with_option(want), "key 1");
    // Signed with the key of the 124 it answers, whichever that was.
    put(&skel.maps.score_override, &LOCAL_PORT, &258u32);
    let nonce = [0xde, 0xad, 0xbe, 0xef];
    let want = InbandOption::auth_score(&KEY2, KEY2_ID, nonce, conn(), 258);
    assert_frame(&answer(&skel, requested(tuple_flow(CLIENT), KEY2_ID, nonce)), &with_option(want), "key 7");
    assert!(parse(&with_option(want)).unwrap().checksums_ok);
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 2)]);
}

#[test]
fn authenticated_round_trip_155_124_125() {
    let skel = load();
    configure(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &12i64);
    let s = syn();
    ingress(
        &skel,
        &s.clone().ip_options(auth_tuple(&s, KEY_ID, &KEY, client())).build(),
        TC_ACT_OK,
        Some(&s.build()),
        "155",
    );
    let nonce = [0x5e, 0xed, 0x00, 0x07];
    ingress(&skel, &request().ip_options(auth_request(nonce)).build(), TC_ACT_OK, Some(&request().build()), "124");
    let (ret, out) = run(&skel.progs.agent_egress, &response().build(), None);
    assert_eq!(ret, TC_ACT_OK);
    // Exactly the 125 the balancer checks (crates/inband-core/src/wire.rs).
    assert_frame(&out, &with_option(InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 12)), "125");
    let answered = DsrFlow { score_requested: 0, ..requested(tuple_flow(CLIENT), KEY_ID, nonce) };
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(answered));
    assert_counters(
        &skel,
        &[(AgentCounter::TuplesStored, 1), (AgentCounter::ProbesSeen, 1), (AgentCounter::ScoresSent, 1)],
    );
}

#[test]
fn egress_cannot_sign_after_its_key_was_removed() {
    let skel = load();
    configure(&skel);
    // The 124 came under key 7, which a rotation removed before the answer.
    put(&skel.maps.dsr_flows, &conn_key(), &requested(DsrFlow::default(), KEY2_ID, [1, 2, 3, 4]));
    let resp = response().build();
    let (ret, out) = run(&skel.progs.agent_egress, &resp, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &resp, "unsigned answers are not sent");
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(flow.score_requested, 0, "given up: the balancer asks again");
    assert_counters(&skel, &[(AgentCounter::AuthFailed, 1)]);
}

#[test]
fn egress_score_override_wins_over_active_connections() {
    let skel = load();
    configure_seed(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    put(&skel.maps.score_override, &LOCAL_PORT, &42u32);
    assert_frame(&answer(&skel, seed_flow()), &with_option(InbandOption::Score(42)), "override");
    put(&skel.maps.score_override, &LOCAL_PORT, &70_000u32);
    assert_frame(&answer(&skel, seed_flow()), &with_option(InbandOption::Score(65535)), "saturated");
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 2)]);
}

#[test]
fn egress_without_room_for_the_option_keeps_the_request() {
    let skel = load();
    configure(&skel);
    let flow = requested(DsrFlow::default(), KEY_ID, [1, 2, 3, 4]);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    // 28 bytes of options already: no room for a 16-byte 125 in 60 bytes.
    let full = PacketBuilder::tcp(server(), lb()).ip_options(vec![1; 28]).payload(b"x".to_vec()).build();
    let (ret, out) = run(&skel.progs.agent_egress, &full, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &full, "no room");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flow));
    assert_counters(&skel, &[(AgentCounter::ScoreDeferredNoRoom, 1)]);
}

#[test]
fn egress_leaves_other_traffic_untouched() {
    let skel = load();
    configure(&skel);
    let flow = requested(DsrFlow::default(), KEY_ID, [1, 2, 3, 4]);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let other_peer = sa(Ipv4Addr::new(10, 0, 0, 2), SNAT_PORT);
    let cases = [
        ("peer without an entry", PacketBuilder::tcp(server(), other_peer).build()),
        ("not from a service port", PacketBuilder::tcp(sa(SERVER, 9999), lb()).build()),
        ("UDP", PacketBuilder::udp(server(), lb()).payload(b"u".to_vec()).build()),
    ];
    for (name, frame) in cases {
        let (ret, out) = run(&skel.progs.agent_egress, &frame, None);
        assert_eq!(ret, TC_ACT_OK, "{name}");
        assert_frame(&out, &frame, name);
    }
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flow));
    assert_counters(&skel, &[]);
}

// ---------------------------------------------------------------- egress: DSR

/// The server side of a one-armed server: DEV with SERVER/24, CLIENT's
/// network via a gateway whose MAC is known, CLIENT_NO_NEIGH's via one whose
/// MAC is not, nothing for CLIENT_UNROUTED. bpf_fib_lookup answers only for
/// a device with IPv4 forwarding on (else BPF_FIB_LKUP_RET_FWD_DISABLED, also
/// for BPF_FIB_LOOKUP_OUTPUT), so that is a switch. Returns DEV's ifindex.
fn server_routes(ns: &TestNetns, forwarding: bool) -> u32 {
    ns.ip(&["link", "add", DEV, "type", "veth", "peer", "name", "ibt-s1"]);
    ns.ip(&["link", "set", DEV, "address", "02:00:00:00:aa:01"]);
    ns.ip(&["addr", "add", "10.99.0.2/24", "dev", DEV]);
    ns.ip(&["link", "set", DEV, "up"]);
    ns.ip(&["link", "set", "ibt-s1", "up"]);
    ns.ip(&["neigh", "add", "10.99.0.1", "lladdr", "02:00:00:00:bb:01", "dev", DEV, "nud", "permanent"]);
    ns.ip(&["route", "add", "198.51.100.0/24", "via", "10.99.0.1", "dev", DEV]);
    ns.ip(&["route", "add", "192.0.2.0/24", "via", "10.99.0.3", "dev", DEV]);
    let sysctl = format!("net.ipv4.conf.{DEV}.forwarding={}", u8::from(forwarding));
    let out = Command::new("ip").args(["netns", "exec", &ns.name, "sysctl", "-qw", &sysctl]).output().unwrap();
    assert!(out.status.success(), "{sysctl}: {}", String::from_utf8_lossy(&out.stderr));
    let name = CString::new(DEV).unwrap();
    // SAFETY: a valid C string; resolved in the thread's (test) namespace.
    let idx = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(idx, 0, "ifindex of {DEV}");
    idx
}

fn syn_ack_options(mss: u16) -> Vec<u8> {
    // NOP, NOP, SACK-permitted, MSS, NOP, window scale 7: the MSS is not
    // first, so the walk has to step over other options to find it.
    let mut o = vec![1, 1, 4, 2];
    o.extend_from_slice(&mss_option(mss));
    o.extend_from_slice(&[1, 3, 3, 7]);
    o
}

fn syn_ack(src: SocketAddr, dst: SocketAddr, mss: u16) -> PacketBuilder {
    PacketBuilder::tcp(src, dst)
        .flags(TCP_SYN | TCP_ACK)
        .seq_no(77_000)
        .ack_no(5001)
        .tcp_options(syn_ack_options(mss))
        // Frames leave the server's stack addressed to the balancer's MAC.
        .macs(SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01])
}

#[test]
fn egress_dsr_rewrites_syn_ack_to_the_client() {
    let ns = TestNetns::enter("dsr");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let client = sa(CLIENT, CLIENT_PORT);

    let (ret, out) = run(&skel.progs.agent_egress, &syn_ack(server(), lb(), 1460).build(), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK, "the lookup resolved a next hop on this device");
    let p = parse(&out).expect("IPv4/TCP out");
    assert_eq!((p.src, p.dst), (vip(), client));
    assert_eq!((p.src_mac, p.dst_mac), (SERVER_MAC, GATEWAY_MAC), "MACs from the route lookup");
    assert!(p.checksums_ok);
    assert_eq!(p.mss(), Some(1444), "MSS clamped by 16");
    assert_eq!(p.tcp_flags, TCP_SYN | TCP_ACK);
    assert!(p.ip_options.is_empty());
    // Byte-exact: the frame as if the server had sent it from the VIP.
    let expected = syn_ack(vip(), client, 1444).macs(SERVER_MAC, GATEWAY_MAC).build();
    assert_frame(&out, &expected, "DSR");
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1), (AgentCounter::MssClamped, 1)]);
}

#[test]
fn egress_dsr_rewrites_data_without_touching_tcp_options() {
    let ns = TestNetns::enter("data");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let client = sa(CLIENT, CLIENT_PORT);
    let body = vec![0x5a; 999]; // odd length: the checksum covers a padded last word
                                // Timestamps, and an MSS option that only a SYN-ACK's gets clamped.
    let mut ts = vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2];
    ts.extend_from_slice(&mss_option(1460));
    let resp = |src, dst, macs: (Mac, Mac)| {
        PacketBuilder::tcp(src, dst)
            .flags(TCP_ACK | TCP_PSH)
            .tcp_options(ts.clone())
            .payload(body.clone())
            .macs(macs.0, macs.1)
    };
    let input = resp(server(), lb(), (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01])).build();
    let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &resp(vip(), client, (SERVER_MAC, GATEWAY_MAC)).build(), "DSR data");
    assert!(parse(&out).unwrap().checksums_ok);
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1)]);
}

#[test]
fn egress_dsr_without_neighbour_redirects_via_neigh() {
    let ns = TestNetns::enter("neigh");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT_NO_NEIGH));
    let client = sa(CLIENT_NO_NEIGH, CLIENT_PORT);
    let input = syn_ack(server(), lb(), 1460).build();

    let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
    assert_eq!(ret, TC_ACT_REDIRECT, "bpf_redirect_neigh resolves the gateway's MAC");
    // L3/L4 rewritten; the MACs are left for the neighbour layer to fill.
    let expected = syn_ack(vip(), client, 1444).build();
    assert_frame(&out, &expected, "DSR");
    assert!(parse(&out).unwrap().checksums_ok);
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1), (AgentCounter::MssClamped, 1)]);
}

#[test]
fn egress_dsr_without_route_goes_via_the_balancer() {
    let ns = TestNetns::enter("noroute");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT_UNROUTED));
    let input = syn_ack(server(), lb(), 1460).build();

    let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &input, "unchanged: the balancer NATs it back");
    assert_counters(&skel, &[(AgentCounter::NoRoute, 1)]);
}

/// A server's RST of a DSR connection goes back through the balancer
/// unchanged (it ends the flow there, and a RST answering a SYN is the
/// balancer's sign of a refused handshake); the connection's other segments
/// still go direct.
#[test]
fn egress_sends_a_servers_reset_through_the_balancer() {
    let ns = TestNetns::enter("rst");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let to_lb = |flags| PacketBuilder::tcp(server(), lb()).flags(flags).seq_no(77_000).ack_no(5001).macs(SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]);
    for flags in [TCP_RST | TCP_ACK, TCP_RST] {
        let input = to_lb(flags).build();
        let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
        assert_eq!(ret, TC_ACT_OK);
        assert_frame(&out, &input, "a reset leaves unchanged, toward the balancer");
    }
    assert_counters(&skel, &[(AgentCounter::ResetsViaBalancer, 2)]);
    let (_, out) = run(&skel.progs.agent_egress, &to_lb(TCP_ACK).build(), Some(ifindex));
    assert_eq!(parse(&out).unwrap().dst, sa(CLIENT, CLIENT_PORT), "an ACK of the same connection goes direct");
}

/// A connection the server closed first: its socket is gone, its TIME_WAIT
/// acknowledges the client's FIN, and that ACK goes direct from the
/// `closed_flows` copy of its tuple (toward the balancer's tuple it would
/// reach, with fleet tuples, no instance). A balancer's next SYN on the
/// ports, with a 155 or without, deletes the copy: the new connection's
/// answers never go to the old client.
#[test]
fn egress_sends_a_time_wait_ack_direct_until_the_next_syn_on_its_ports() {
    let ns = TestNetns::enter("closed");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    let ack = |src, dst, macs: (Mac, Mac)| PacketBuilder::tcp(src, dst).flags(TCP_ACK).seq_no(77_000).ack_no(5001).macs(macs.0, macs.1);
    let to_lb = ack(server(), lb(), (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01])).build();
    let plain = syn();
    let with_155 = plain.clone().ip_options(auth_tuple(&plain, KEY_ID, &KEY, sa(VICTIM, CLIENT_PORT)));
    for (i, (name, next_syn, stored)) in [("a SYN without 155", plain.build(), None), ("a SYN with a 155", with_155.build(), Some(tuple_flow(VICTIM)))].into_iter().enumerate() {
        put(&skel.maps.closed_flows, &conn_key(), &tuple_flow(CLIENT));
        let (ret, out) = run(&skel.progs.agent_egress, &to_lb, Some(ifindex));
        assert_eq!(ret, TC_ACT_OK);
        assert_frame(&out, &ack(vip(), client(), (SERVER_MAC, GATEWAY_MAC)).build(), "the TIME_WAIT's ACK, direct");
        let n = i as u64 + 1;
        assert_counters(&skel, &[(AgentCounter::ClosedFlowSegments, n), (AgentCounter::DsrRewrites, n)]);
        // A TIME_WAIT sends no data: a data segment on these ports is
        // not looked for there, and leaves as it was.
        let data = PacketBuilder::tcp(server(), lb()).flags(TCP_ACK | TCP_PSH).payload(vec![0x5a; 100]).macs(SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]).build();
        let (_, out) = run(&skel.progs.agent_egress, &data, Some(ifindex));
        assert_frame(&out, &data, "data on a closed connection's ports: unchanged");
        assert_counters(&skel, &[(AgentCounter::ClosedFlowSegments, n), (AgentCounter::DsrRewrites, n)]);

        ingress(&skel, &next_syn, TC_ACT_OK, Some(&plain.build()), name);
        assert_eq!(get::<_, DsrFlow>(&skel.maps.closed_flows, &conn_key()), None, "{name}: the closed connection's tuple is gone");
        assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), stored, "{name}");
        if stored.is_none() {
            let (_, out) = run(&skel.progs.agent_egress, &to_lb, Some(ifindex));
            assert_frame(&out, &to_lb, "the new connection's answers: toward the balancer, unchanged");
        }
    }
    assert_counters(&skel, &[(AgentCounter::ClosedFlowSegments, 2), (AgentCounter::DsrRewrites, 2), (AgentCounter::TuplesStored, 1)]);
}

/// A UDP GSO burst (how quinn sends a QUIC server's answers) as it reaches
/// tc: the checksum field holds the pseudo-header sum, not complemented,
/// for segmentation to finish per datagram. Linux hands it over as
/// CHECKSUM_NONE when the device has no checksum offload (the testbed's
/// veths), and the csum helpers took that sum for a finished checksum:
/// every datagram of a burst reached the client with a wrong one (found by
/// tests/quic.rs). The rewrite must move the sum to the new addresses and
/// leave the ports to segmentation.
#[test]
fn egress_dsr_rewrites_the_pseudo_header_sum_of_a_udp_gso_burst() {
    let ns = TestNetns::enter("gso");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    add_service(&skel, LOCAL_PORT, 17, vip());
    put(&skel.maps.dsr_flows, &conn_key_of(lb(), LOCAL_PORT, 17), &tuple_flow(CLIENT));
    let client = sa(CLIENT, CLIENT_PORT);
    let burst = |src: SocketAddr, dst: SocketAddr, macs: (Mac, Mac)| {
        let mut f = PacketBuilder::udp(src, dst).payload(vec![0x5a; 1000]).macs(macs.0, macs.1).build();
        let (IpAddr::V4(s), IpAddr::V4(d)) = (src.ip(), dst.ip()) else { unreachable!() };
        let udp_len = (f.len() - ETH_HLEN - 20) as u32;
        let words = [s.octets(), d.octets()].concat();
        let mut sum: u32 = words.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum::<u32>() + 17 + udp_len;
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        let at = ETH_HLEN + 20 + 6;
        f[at..at + 2].copy_from_slice(&(sum as u16).to_be_bytes());
        f
    };
    let input = burst(server(), lb(), (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]));
    let (ret, out) = run_gso(&skel.progs.agent_egress, &input, Some(ifindex), Some((2, 500)));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &burst(vip(), client, (SERVER_MAC, GATEWAY_MAC)), "the pseudo-header sum of VIP -> client");
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1)]);
    // A single datagram (no GSO) keeps a finished checksum, ports included.
    let single = PacketBuilder::udp(server(), lb()).payload(vec![0x5a; 1000]).macs(SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]).build();
    let (ret, out) = run(&skel.progs.agent_egress, &single, Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &PacketBuilder::udp(vip(), client).payload(vec![0x5a; 1000]).macs(SERVER_MAC, GATEWAY_MAC).build(), "one datagram");
    assert!(parse(&out).unwrap().checksums_ok);
}

// ---------------------------------------------------------------- tracepoint

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn set_linger_zero(s: &TcpStream) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket fd and a correctly sized option value.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
}

#[test]
fn tracepoint_counts_active_connections_and_closes_flows() {
    let ns = TestNetns::enter("tp");
    ns.ip(&["link", "set", "lo", "up"]);
    let skel = load();
    let _links = [skel.progs.agent_sock_state.attach().expect("attach tracepoint"), skel.progs.agent_sock_destroy.attach().expect("attach tracepoint")];
    // The tracepoint fires for every namespace: a port below the ephemeral
    // range that no other test serves keeps other hosts' sockets out.
    let port = 20_000 + (std::process::id() % 10_000) as u16;
    let listener = TcpListener::bind(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
    put(&skel.maps.active_conns, &port, &0i64);
    let active = |skel: &AgentSkel| get::<_, i64>(&skel.maps.active_conns, &port).unwrap();

    // Graceful close, client first: the client's FIN ends the count (the
    // balancer counts the connection closed on that FIN too); CLOSE_WAIT
    // does not count. The flow entry stays until the server closes.
    let client = TcpStream::connect(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
    let (served, _) = listener.accept().unwrap();
    wait_for("1 active connection", || active(&skel) == 1);
    let key = conn_key_of(sa(Ipv4Addr::LOCALHOST, client.local_addr().unwrap().port()), port, 6);
    put(&skel.maps.dsr_flows, &key, &tuple_flow(CLIENT));
    let unrelated = ConnKey { peer_port: be_port(1), ..key };
    put(&skel.maps.dsr_flows, &unrelated, &tuple_flow(CLIENT));
    drop(client);
    wait_for("0 active connections after the client's FIN", || active(&skel) == 0);
    assert!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key).is_some());
    drop(served);
    wait_for("the flow entry deleted", || get::<_, DsrFlow>(&skel.maps.dsr_flows, &key).is_none());
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(active(&skel), 0, "LAST_ACK and CLOSE do not count it twice");
    assert!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &unrelated).is_some(), "only the closed connection's entry goes");

    // Server first: FIN_WAIT still counts until the client's FIN arrives.
    // (A server that closes its socket, not only its sending side, hands
    // the connection to a timewait socket once its FIN is acknowledged:
    // the kernel ends the socket there, and so does the count.)
    let client = TcpStream::connect(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
    let (served, _) = listener.accept().unwrap();
    wait_for("1 active connection", || active(&skel) == 1);
    served.shutdown(std::net::Shutdown::Write).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(active(&skel), 1, "FIN_WAIT2 counts until the client's FIN");
    drop(client);
    wait_for("0 active connections after the client's FIN", || active(&skel) == 0);
    drop(served);

    // A connection whose timestamps are translated (it reopened a
    // TIME_WAIT) keeps its entry past its socket: its own TIME_WAIT still
    // takes the client's last segments, which need the same shift.
    let client = TcpStream::connect(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
    let (served, _) = listener.accept().unwrap();
    let key = conn_key_of(sa(Ipv4Addr::LOCALHOST, client.local_addr().unwrap().port()), port, 6);
    let shifted = DsrFlow { ts_shift: 1000, ..tuple_flow(CLIENT) };
    put(&skel.maps.dsr_flows, &key, &shifted);
    drop(served);
    drop(client);
    let closed = |skel: &AgentSkel| counters(skel).iter().find(|(c, _)| *c == AgentCounter::FlowsClosed).unwrap().1;
    wait_for("the socket closed", || closed(&skel) == 2);
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(shifted), "kept for its TIME_WAIT");

    // A frozen connection's entry outlives its socket (closed in repair
    // mode by the owner that moved it) until its time passes: its stray
    // segments must be dropped, not answered by a RST. Once the time has
    // passed, a close deletes it as any other.
    for (until, kept) in [(monotonic_ms().wrapping_add(10_000), true), (monotonic_ms().wrapping_sub(1), false)] {
        let client = TcpStream::connect(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
        let (served, _) = listener.accept().unwrap();
        let key = conn_key_of(sa(Ipv4Addr::LOCALHOST, client.local_addr().unwrap().port()), port, 6);
        let frozen = DsrFlow { frozen_until_ms: until, ..tuple_flow(CLIENT) };
        put(&skel.maps.dsr_flows, &key, &frozen);
        let before = closed(&skel);
        drop(served);
        drop(client);
        wait_for("the socket closed", || closed(&skel) == before + 1);
        let left = get::<_, DsrFlow>(&skel.maps.dsr_flows, &key);
        assert_eq!(left, kept.then_some(frozen), "frozen until {until}: kept = {kept}");
    }

    // A socket counted before its change was missed is uncounted at its
    // next change, not counted again: the count is the socket's mark, not
    // a sum of deltas. (A missed change cannot be caused from here; what
    // can be checked is that no sequence of changes counts a socket twice.)
    let conns: Vec<(TcpStream, TcpStream)> = (0..20)
        .map(|_| {
            let c = TcpStream::connect(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
            (c, listener.accept().unwrap().0)
        })
        .collect();
    wait_for("20 active connections", || active(&skel) == 20);
    for (i, (c, s)) in conns.into_iter().enumerate() {
        if i % 2 == 0 {
            drop(c);
            drop(s);
        } else {
            drop(s);
            drop(c);
        }
    }
    wait_for("0 active connections after 20 closes", || active(&skel) == 0);

    // Reset by the server: ESTABLISHED straight to CLOSE.
    let client = TcpStream::connect(sa(Ipv4Addr::LOCALHOST, port)).unwrap();
    let (served, _) = listener.accept().unwrap();
    wait_for("1 active connection", || active(&skel) == 1);
    set_linger_zero(&served);
    drop(served);
    wait_for("0 active connections after a reset", || active(&skel) == 0);
    drop(client);
    drop(listener);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(active(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::FlowsClosed, 4)]);
}

#[test]
fn egress_dsr_with_forwarding_off_lets_the_kernel_route() {
    // Routes and neighbour in place, but the device does not forward, so
    // bpf_fib_lookup refuses: the rewritten response goes to
    // bpf_redirect_neigh without a next hop, which routes it itself.
    let ns = TestNetns::enter("nofwd");
    let ifindex = server_routes(&ns, false);
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let input = syn_ack(server(), lb(), 1460).build();

    let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
    assert_eq!(ret, TC_ACT_REDIRECT);
    let p = parse(&out).unwrap();
    assert_eq!((p.src, p.dst), (vip(), sa(CLIENT, CLIENT_PORT)));
    assert!(p.checksums_ok);
    assert_eq!(p.mss(), Some(1444));
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1), (AgentCounter::MssClamped, 1)]);
}

#[test]
fn requests_score_counts_connections_with_a_request_in_flight() {
    let skel = load_with(ScoreSource::Requests);
    configure_seed(&skel);
    put(&skel.maps.inflight, &LOCAL_PORT, &0i64);
    let inflight = |skel: &AgentSkel| get::<_, i64>(&skel.maps.inflight, &LOCAL_PORT).unwrap();
    let request =
        || PacketBuilder::tcp(lb(), server()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec());
    let ack = PacketBuilder::tcp(lb(), server()).flags(TCP_ACK).build();
    let response = || PacketBuilder::tcp(server(), lb()).flags(TCP_ACK | TCP_PSH).payload(vec![b'r'; 100]);

    // A bare ACK is not a request; request bytes make the connection busy, once.
    let (ret, out) = run(&skel.progs.agent_ingress, &ack, None);
    assert_eq!((ret, out), (TC_ACT_OK, ack.clone()));
    assert_eq!(inflight(&skel), 0);
    for _ in 0..2 {
        let input = request().build();
        let (ret, out) = run(&skel.progs.agent_ingress, &input, None);
        assert_eq!((ret, out), (TC_ACT_OK, input), "accounting never changes the packet");
    }
    assert_eq!(inflight(&skel), 1);
    // A second connection with a request in flight.
    let other =
        PacketBuilder::tcp(sa(LB, SNAT_PORT + 1), server()).flags(TCP_ACK).payload(b"GET".to_vec());
    run(&skel.progs.agent_ingress, &other.build(), None);
    assert_eq!(inflight(&skel), 2);

    // A score asked on the first connection reports 2 in-flight requests.
    put(&skel.maps.dsr_flows, &conn_key(), &DsrFlow { score_requested: 1, ..Default::default() });
    let (ret, out) = run(&skel.progs.agent_egress, &PacketBuilder::tcp(server(), lb()).flags(TCP_ACK).build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_eq!(parse(&out).unwrap().ip_options, InbandOption::Score(2).encode());
    // Its response's first byte ends the first request; more bytes change nothing.
    for _ in 0..2 {
        run(&skel.progs.agent_egress, &response().build(), None);
    }
    assert_eq!(inflight(&skel), 1);
    // A port that is not counted (no entry) is left alone.
    let unserved =
        PacketBuilder::tcp(lb(), sa(SERVER, 9999)).flags(TCP_ACK).payload(b"x".to_vec()).build();
    run(&skel.progs.agent_ingress, &unserved, None);
    assert_eq!(inflight(&skel), 1);
}

#[test]
fn connections_and_requests_score_adds_the_two_counts() {
    let skel = load_with(ScoreSource::ConnectionsAndRequests);
    configure_seed(&skel);
    put(&skel.maps.inflight, &LOCAL_PORT, &0i64);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    let ask = || {
        put(&skel.maps.dsr_flows, &conn_key(), &DsrFlow { score_requested: 1, ..Default::default() });
        let (ret, out) = run(&skel.progs.agent_egress, &PacketBuilder::tcp(server(), lb()).flags(TCP_ACK).build(), None);
        assert_eq!(ret, TC_ACT_OK);
        parse(&out).unwrap().ip_options
    };
    // Three connections, none busy: the connections alone.
    assert_eq!(ask(), InbandOption::Score(3).encode());
    // A request arrives on one of them: it counts twice now.
    run(&skel.progs.agent_ingress, &request().build(), None);
    assert_eq!(get::<_, i64>(&skel.maps.inflight, &LOCAL_PORT), Some(1));
    assert_eq!(ask(), InbandOption::Score(4).encode());
    // A count below zero (a close seen before its open) adds nothing.
    put(&skel.maps.active_conns, &LOCAL_PORT, &-2i64);
    assert_eq!(ask(), InbandOption::Score(1).encode());
}

// ---------------------------------------------------------------- egress: carriers of a 125

/// A TCP segment as the stack hands it to tc (CHECKSUM_PARTIAL): its
/// checksum field holds the pseudo-header sum over the segment's length,
/// not complemented, for the device or segmentation to finish. IPv6: after
/// a Destination Options header, if there is one.
fn partial_sum(mut frame: Vec<u8>) -> Vec<u8> {
    let ip = ETH_HLEN;
    let (l4_off, l4_len, addrs) = if frame[12..14] == [0x08, 0x00] {
        let ihl = usize::from(frame[ip] & 0xf) * 4;
        let tot = usize::from(u16::from_be_bytes([frame[ip + 2], frame[ip + 3]]));
        (ip + ihl, tot - ihl, frame[ip + 12..ip + 20].to_vec())
    } else {
        let ext = if frame[ip + 6] == IPPROTO_DSTOPTS { (usize::from(frame[ip + 41]) + 1) * 8 } else { 0 };
        let plen = usize::from(u16::from_be_bytes([frame[ip + 4], frame[ip + 5]]));
        (ip + 40 + ext, plen - ext, frame[ip + 8..ip + 40].to_vec())
    };
    let mut sum: u32 = addrs.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum::<u32>();
    sum += u32::from(IPPROTO_TCP) + l4_len as u32;
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    frame[l4_off + 16..l4_off + 18].copy_from_slice(&(sum as u16).to_be_bytes());
    frame
}

/// Timestamps, as Linux puts them on every segment of a connection.
fn ts_option() -> Vec<u8> {
    vec![1, 1, 8, 10, 0, 0, 0x30, 0x39, 0, 0, 0x10, 0x92]
}

/// The agent's egress program on DEV, as the daemon attaches it: a clone
/// sent back to DEV by bpf_clone_redirect runs it again.
fn attach_egress(skel: &AgentSkel, ifindex: u32) {
    use std::os::fd::AsFd;
    inband_core::tc::create_clsact(ifindex as i32).expect("clsact on DEV");
    let slot = inband_core::tc::Slot { ifindex: ifindex as i32, handle: 1, priority: 1 };
    slot.attach(skel.progs.agent_egress.as_fd(), libbpf_rs::TC_EGRESS).expect("attach egress to DEV");
}

/// Frames arriving at DEV's peer: what left DEV.
struct Capture(std::os::fd::OwnedFd);

impl Capture {
    fn on_peer() -> Capture {
        use std::os::fd::FromRawFd;
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the fd is owned from here.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(all)) };
        assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just returned by socket(2).
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let name = CString::new("ibt-s1").unwrap();
        // SAFETY: zeroed sockaddr_ll is valid; fields set below.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = all;
        // SAFETY: a valid C string.
        addr.sll_ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
        assert_ne!(addr.sll_ifindex, 0);
        // SAFETY: addr is a sockaddr_ll of the size passed.
        let rc = unsafe {
            libc::bind(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_ll>() as u32)
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval { tv_sec: 0, tv_usec: 200_000 };
        // SAFETY: tv is a timeval of the size passed.
        unsafe {
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv as *const _ as *const libc::c_void, std::mem::size_of::<libc::timeval>() as u32)
        };
        Capture(fd)
    }

    /// The frames from `src` that arrived within a second.
    fn from(&self, src: IpAddr) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut buf = vec![0u8; 65536];
        while Instant::now() < deadline {
            // SAFETY: buf is writable for its length.
            let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n <= 0 {
                continue;
            }
            let frame = buf[..n as usize].to_vec();
            if parse(&frame).is_some_and(|p| p.src.ip() == src) {
                got.push(frame);
            }
        }
        got
    }
}

/// The frame with its TCP checksum field zeroed. The test run hands frames
/// over as CHECKSUM_NONE, so the DSR rewrite updates a burst's
/// pseudo-header sum as if it were a finished checksum, which the kernel's
/// CHECKSUM_PARTIAL burst never is (egress_dsr_rewrites_data_... checks
/// that rewrite byte for byte on a whole segment).
fn without_tcp_check(mut frame: Vec<u8>) -> Vec<u8> {
    let l4 = if frame[12..14] == [0x08, 0x00] { ETH_HLEN + usize::from(frame[ETH_HLEN] & 0xf) * 4 } else { ETH_HLEN + 40 };
    frame[l4 + 16..l4 + 18].fill(0);
    frame
}

/// A 124 pending while the server sends a burst of six segments (TSO and
/// software GSO alike reach tc as one packet). The burst goes on direct,
/// untouched by the score; a clone of it runs the program again and leaves
/// DEV as the 125's carrier: the burst's headers alone, its sequence
/// number past the data, ACK only, toward the balancer, with a
/// pseudo-header sum of its own length. Both families; the carrier as it
/// arrives at DEV's peer. Before carriers the burst
/// left with no 125 and the request waited for the next small packet of
/// the connection, which on a long keep-alive transfer can be seconds away.
///
/// The test run cannot make a GSO skb the kernel would transmit (it sets
/// no GSO type: a clone of one is refused with EBADMSG), so the burst is
/// given as `gso_segs` = 6 alone, which is what the program reads of it,
/// and DEV takes 3 KB frames (the route lookup holds a packet that is not
/// GSO to the device's MTU). A refused clone shows the fallback: the burst
/// goes on direct and the request waits.
#[test]
fn egress_answers_a_124_under_a_gso_burst_with_a_carrier_of_its_headers() {
    let ns = TestNetns::enter("carrier");
    let ifindex = server_routes6(&ns);
    ns.ip(&["link", "set", DEV, "mtu", "9000"]);
    let skel = load();
    configure6(&skel);
    attach_egress(&skel, ifindex);
    let capture = Capture::on_peer();
    put(&skel.maps.active_conns, &LOCAL_PORT, &5i64);
    let to_lb = (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]);
    for (n, (server, lb, vip, conn, key, client)) in [
        (server(), lb(), vip(), conn(), conn_key(), client()),
        (server6(), lb6(), vip6(), conn6(), conn_key6(), client6()),
    ]
    .into_iter()
    .enumerate()
    {
        let nonce = [9, 8, 7, n as u8];
        let flow = requested(tuple_flow(client.ip()), KEY_ID, nonce);
        put(&skel.maps.dsr_flows, &key, &flow);
        let segment = |src, dst, macs: (Mac, Mac), flags: u8, seq: u32, payload: Vec<u8>| {
            PacketBuilder::tcp(src, dst).flags(flags).seq_no(seq).ack_no(777).tcp_options(ts_option()).payload(payload).macs(macs.0, macs.1)
        };
        let data = || vec![0x42; 6 * 500];
        let flags = TCP_ACK | TCP_PSH | TCP_FIN;
        let burst = partial_sum(segment(server, lb, to_lb, flags, 100_000, data()).build());
        let (ret, out) = run_gso(&skel.progs.agent_egress, &burst, Some(ifindex), Some((6, 0)));
        assert_eq!(ret, TC_ACT_OK, "{server}");
        let want = segment(vip, client, (SERVER_MAC, GATEWAY_MAC), flags, 100_000, data()).build();
        assert_frame(&without_tcp_check(out), &without_tcp_check(want), "the burst, DSR, whole");
        assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(DsrFlow { score_requested: 0, ..flow }), "answered");
        let carriers = capture.from(server.ip());
        assert_eq!(carriers.len(), 1, "{server}: one carrier left DEV");
        let score = InbandOption::auth_score(&KEY, KEY_ID, nonce, conn, 5).encode();
        let want = partial_sum(segment(server, lb, to_lb, TCP_ACK, 103_000, Vec::new()).inband(&score).build());
        assert_frame(&carriers[0], &want, "the carrier: headers only, past the data, with the 125");
        // The clone's pass made the carrier and sent nothing direct.
        let n = n as u64 + 1;
        assert_counters(
            &skel,
            &[(AgentCounter::ScoresSent, n), (AgentCounter::ScoreCarriers, n), (AgentCounter::DsrRewrites, n)],
        );
    }
    // A clone the kernel refuses: the burst goes on itself, direct.
    let flow = requested(tuple_flow(CLIENT), KEY_ID, [4, 4, 4, 4]);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let burst = partial_sum(PacketBuilder::tcp(server(), lb()).payload(vec![0x42; 3000]).macs(to_lb.0, to_lb.1).build());
    let (ret, out) = run_gso(&skel.progs.agent_egress, &burst, Some(ifindex), Some((6, 500)));
    assert_eq!(ret, TC_ACT_OK);
    assert_eq!(parse(&out).unwrap().src, vip(), "direct");
    assert_eq!(parse(&out).unwrap().payload.len(), 3000, "whole");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flow), "flag kept");
    // A UDP burst gets no carrier: each datagram reaches the application,
    // an empty one too. It goes direct and the request waits.
    add_service(&skel, LOCAL_PORT, 17, vip());
    let udp_key = conn_key_of(lb(), LOCAL_PORT, 17);
    put(&skel.maps.dsr_flows, &udp_key, &flow);
    let burst = PacketBuilder::udp(server(), lb()).payload(vec![0x5a; 1000]).macs(to_lb.0, to_lb.1).build();
    let (ret, out) = run_gso(&skel.progs.agent_egress, &burst, Some(ifindex), Some((2, 500)));
    assert_eq!(ret, TC_ACT_OK);
    assert_eq!(parse(&out).unwrap().src, vip(), "direct");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &udp_key), Some(flow), "flag kept");
    assert_counters(
        &skel,
        &[
            (AgentCounter::ScoresSent, 2),
            (AgentCounter::ScoreCarriers, 2),
            (AgentCounter::DsrRewrites, 4),
            (AgentCounter::ScoreDeferredCarrierFailed, 1),
            (AgentCounter::ScoreDeferredUdpBurst, 1),
        ],
    );
}

/// A full-sized segment (no GSO) has no room for the 125 under the MTU:
/// it goes direct, and a clone cut to its headers takes the 125 (the
/// carrier, as it arrives at DEV's peer). A packet without
/// data that would still exceed the MTU waits for a later one.
#[test]
fn egress_answers_a_124_under_a_full_sized_segment_with_a_carrier() {
    let ns = TestNetns::enter("mtu");
    let ifindex = server_routes(&ns, true);
    let skel = load();
    configure(&skel);
    attach_egress(&skel, ifindex);
    let capture = Capture::on_peer();
    put(&skel.maps.active_conns, &LOCAL_PORT, &5i64);
    let nonce = [7, 7, 7, 7];
    let flow = requested(tuple_flow(CLIENT), KEY_ID, nonce);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let full = |src, dst, macs: (Mac, Mac), flags: u8, seq: u32, len: usize| {
        PacketBuilder::tcp(src, dst).flags(flags).seq_no(seq).payload(vec![0x42; len]).macs(macs.0, macs.1)
    };
    let to_lb = (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]);
    let segment = full(server(), lb(), to_lb, TCP_ACK | TCP_PSH, 5000, 1460);
    assert_eq!(segment.build_ip().len(), usize::from(MTU), "exactly the MTU: no room for 16 more bytes");
    let (ret, out) = run(&skel.progs.agent_egress, &partial_sum(segment.build()), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    let want = full(vip(), client(), (SERVER_MAC, GATEWAY_MAC), TCP_ACK | TCP_PSH, 5000, 1460).build();
    assert_frame(&without_tcp_check(out), &without_tcp_check(want), "the data, DSR");
    let carriers = capture.from(SERVER.into());
    assert_eq!(carriers.len(), 1, "one carrier left DEV");
    let score = InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 5).encode();
    let carrier = partial_sum(full(server(), lb(), to_lb, TCP_ACK, 5000 + 1460, 0).ip_options(score).build());
    assert_frame(&carriers[0], &carrier, "the carrier toward the balancer");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(DsrFlow { score_requested: 0, ..flow }));
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 1), (AgentCounter::ScoreCarriers, 1), (AgentCounter::DsrRewrites, 1)]);

    // An MTU too small even for the headers and the 125: nothing to split
    // off, so the packet goes direct and the request waits.
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    set_mode(&skel, AuthMode::Siphash, 40 + 16 - 1);
    let (ret, out) = run(&skel.progs.agent_egress, &partial_sum(segment.build()), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_eq!(parse(&out).unwrap().src, vip(), "direct, whole");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flow), "flag kept");
    assert_counters(
        &skel,
        &[
            (AgentCounter::ScoresSent, 1),
            (AgentCounter::ScoreCarriers, 1),
            (AgentCounter::DsrRewrites, 2),
            (AgentCounter::ScoreDeferredMtu, 1),
        ],
    );
}

// ---------------------------------------------------------------- ingress: live sockets

/// A connection held by real sockets in the test's namespace: a client at
/// 127.0.0.3 (standing in for the balancer's NAT address) connected to a
/// listener at 127.0.0.2. The agent serves the listener's port and trusts
/// 127.0.0.3.
struct LiveConn {
    listener: TcpListener,
    client: TcpStream,
    served: TcpStream,
}

const LIVE_LB: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
const LIVE_SERVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

impl LiveConn {
    fn open(skel: &AgentSkel) -> LiveConn {
        let listener = TcpListener::bind(sa(LIVE_SERVER, 0)).unwrap();
        let client = connect_from(LIVE_LB, listener.local_addr().unwrap());
        let (served, _) = listener.accept().unwrap();
        add_service(skel, listener.local_addr().unwrap().port(), 6, vip());
        put(&skel.maps.balancers, &be_ip_v4(LIVE_LB), &Balancer::default());
        LiveConn { listener, client, served }
    }

    /// The balancer side of the connection, and the server side.
    fn lb(&self) -> SocketAddr {
        self.client.local_addr().unwrap()
    }
    fn server(&self) -> SocketAddr {
        self.listener.local_addr().unwrap()
    }
    fn key(&self) -> ConnKey {
        conn_key_of(self.lb(), self.server().port(), 6)
    }
    /// A SYN on the connection's tuple.
    fn syn(&self) -> PacketBuilder {
        PacketBuilder::tcp(self.lb(), self.server()).syn(1452).seq_no(77)
    }
}

/// A TCP connection from `local` (any port) to `to`, of either family.
fn connect_from(local: impl Into<IpAddr>, to: SocketAddr) -> TcpStream {
    fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
        // SAFETY: an all-zero sockaddr_storage is valid; the family's
        // struct is written into its start, which it is sized and aligned for.
        unsafe {
            let mut ss: libc::sockaddr_storage = std::mem::zeroed();
            let len = match a {
                SocketAddr::V4(a) => {
                    let sin = &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                    sin.sin_family = libc::AF_INET as libc::sa_family_t;
                    sin.sin_port = a.port().to_be();
                    sin.sin_addr = libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) };
                    std::mem::size_of::<libc::sockaddr_in>()
                }
                SocketAddr::V6(a) => {
                    let sin6 = &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
                    sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                    sin6.sin6_port = a.port().to_be();
                    sin6.sin6_addr = libc::in6_addr { s6_addr: a.ip().octets() };
                    std::mem::size_of::<libc::sockaddr_in6>()
                }
            };
            (ss, len as libc::socklen_t)
        }
    }
    let local = SocketAddr::new(local.into(), 0);
    let (me, me_len) = sockaddr(local);
    let (peer, peer_len) = sockaddr(to);
    let family = if local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket calls on an fd this function owns until it is
    // handed to TcpStream.
    unsafe {
        let fd = libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let rc = libc::bind(fd, (&me as *const libc::sockaddr_storage).cast(), me_len);
        assert_eq!(rc, 0, "bind {local}: {}", std::io::Error::last_os_error());
        let rc = libc::connect(fd, (&peer as *const libc::sockaddr_storage).cast(), peer_len);
        assert_eq!(rc, 0, "connect {local} -> {to}: {}", std::io::Error::last_os_error());
        std::os::fd::FromRawFd::from_raw_fd(fd)
    }
}

#[test]
fn ingress_forged_155_cannot_take_over_a_live_connection() {
    // Seed format: anyone who can send from the balancer's address can
    // write any 155; the live socket is what protects the connection.
    let ns = TestNetns::enter("live");
    ns.ip(&["link", "set", "lo", "up"]);
    let skel = load();
    configure_seed(&skel);
    let live = LiveConn::open(&skel);
    let owner = DsrFlow { client_addr: be_ip_v4(CLIENT), client_port: be_port(CLIENT_PORT), ..Default::default() };
    put(&skel.maps.dsr_flows, &live.key(), &owner);

    // The reflection/hijack attempt: a SYN on the live tuple naming a victim.
    let p = live.syn();
    let forged = p.clone().ip_options(seed_tuple(sa(VICTIM, 9))).build();
    ingress(&skel, &forged, TC_ACT_OK, Some(&p.build()), "stripped, passed: the stack answers with a challenge ACK");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &live.key()), Some(owner), "stored tuple unchanged");
    assert_counters(&skel, &[(AgentCounter::TupleInUse, 1)]);

    // Nor does it create an entry for a live connection that has none
    // (one older than the agent, or a pass-through one).
    bpf_delete(&skel, &live.key());
    ingress(&skel, &forged, TC_ACT_OK, Some(&p.build()), "no entry");
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::TupleInUse, 2)]);

    // Once the connection is gone (the server's side closed, only the
    // listener left), a SYN on the tuple is a new connection again.
    let LiveConn { listener, client, served } = live;
    drop(client);
    drop(served);
    std::thread::sleep(Duration::from_millis(100));
    let frame = p.clone().ip_options(seed_tuple(sa(CLIENT, CLIENT_PORT))).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&p.build()), "new connection");
    let key = conn_key_of(sa(LIVE_LB, p.src.port()), listener.local_addr().unwrap().port(), 6);
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(owner));
    assert_counters(&skel, &[(AgentCounter::TupleInUse, 2), (AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_replayed_authenticated_155_cannot_take_over_a_live_connection() {
    // Authenticated format: a genuine 155 of an earlier connection on the
    // same SNAT port, replayed on a SYN with its sequence number.
    let ns = TestNetns::enter("replay");
    ns.ip(&["link", "set", "lo", "up"]);
    let skel = load();
    configure(&skel);
    let live = LiveConn::open(&skel);
    put(&skel.maps.dsr_flows, &live.key(), &tuple_flow(CLIENT));
    let p = live.syn();
    let old = auth_tuple(&p, KEY_ID, &KEY, sa(VICTIM, 9));
    ingress(&skel, &p.clone().ip_options(old).build(), TC_ACT_OK, Some(&p.build()), "stripped");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &live.key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TupleInUse, 1)]);
    drop(live);
}

#[test]
fn ingress_syn_without_155_forgets_an_unfinished_handshake_tuple() {
    // A SYN flood through the balancer leaves tuples of handshakes that
    // never became sockets. A later connection from the balancer's address
    // without a 155 (pass-through VIP, the balancer host's own) must not
    // send its SYN-ACK to the flood's spoofed source.
    let skel = load();
    configure(&skel);
    let flooded = tuple_flow(VICTIM);
    put(&skel.maps.dsr_flows, &conn_key(), &flooded);

    // Packets that leave the entry alone: not a SYN, not from a balancer,
    // a SYN-ACK.
    let stranger = sa(Ipv4Addr::new(10, 0, 0, 66), SNAT_PORT);
    for (name, p) in [
        ("ACK from the balancer", PacketBuilder::tcp(lb(), server()).flags(TCP_ACK)),
        ("data from the balancer", request()),
        ("SYN-ACK from the balancer", PacketBuilder::tcp(lb(), server()).flags(TCP_SYN | TCP_ACK)),
        ("SYN from a stranger on the same ports", PacketBuilder::tcp(stranger, server()).syn(1452)),
    ] {
        let frame = p.build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flooded), "kept");
    assert_counters(&skel, &[]);

    // A balancer's SYN without a 155, with no IP options or with options
    // that are not inband's: passed on unchanged, the stale tuple gone.
    let other_option = vec![0x88, 4, 0xab, 0xcd];
    for (i, p) in [syn(), syn().ip_options(other_option)].into_iter().enumerate() {
        put(&skel.maps.dsr_flows, &conn_key(), &flooded);
        let frame = p.build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "passed unchanged");
        assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), None, "forgotten");
        assert_counters(&skel, &[(AgentCounter::StaleTuplesForgotten, i as u64 + 1)]);
    }
}

#[test]
fn ingress_syn_without_155_keeps_a_live_connections_tuple() {
    // Anyone can send a SYN from the balancer's address: over a live
    // connection it must not cost that connection its DSR path.
    let ns = TestNetns::enter("nosyn");
    ns.ip(&["link", "set", "lo", "up"]);
    let skel = load();
    configure(&skel);
    let live = LiveConn::open(&skel);
    put(&skel.maps.dsr_flows, &live.key(), &tuple_flow(CLIENT));
    let frame = live.syn().build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "passed: the stack answers with a challenge ACK");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &live.key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[]);
    drop(live);
}

// ---------------------------------------------------------------- ingress: reopening a TIME_WAIT

/// A Linux SYN's TCP options: MSS, SACK permitted, timestamps, window scale.
fn syn_ts_options(tsval: u32) -> Vec<u8> {
    let mut o = mss_option(1452).to_vec();
    o.extend([4, 2, 8, 10]);
    o.extend(tsval.to_be_bytes());
    o.extend(0u32.to_be_bytes());
    o.extend([1, 3, 3, 7]);
    o
}

/// Any later segment's: NOP, NOP, timestamps.
fn ts_options(tsval: u32, tsecr: u32) -> Vec<u8> {
    let mut o = vec![1, 1, 8, 10];
    o.extend(tsval.to_be_bytes());
    o.extend(tsecr.to_be_bytes());
    o
}

/// CLOCK_MONOTONIC in ms, mod 2^32: a client's TCP timestamp clock when
/// timestamps have no random offset.
fn monotonic_ms() -> u32 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) }, 0);
    (ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000) as u32
}

/// Enters a namespace of its own for the test's thread in which clients'
/// timestamps are the clock (no random offset), and leaves a connection
/// from `lb` to a listener at `server` in TIME_WAIT on the server's side
/// (the server closed first). Returns the namespace, the listener, the
/// balancer-side address, and the window [t0, t1] in which the
/// TIME_WAIT's last timestamp from its client was taken.
fn time_wait_from(skel: &AgentSkel, ns: &TestNetns, lb: IpAddr, server: IpAddr) -> (TcpListener, SocketAddr, u32, u32) {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, "sysctl", "-qw", "net.ipv4.tcp_timestamps=2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t0 = monotonic_ms();
    let listener = TcpListener::bind(SocketAddr::new(server, 0)).unwrap();
    let mut balancer_side = connect_from(lb, listener.local_addr().unwrap());
    let (served, _) = listener.accept().unwrap();
    add_service(skel, listener.local_addr().unwrap().port(), 6, if lb.is_ipv4() { vip() } else { vip6() });
    put(&skel.maps.balancers, &be_ip(lb), &Balancer::default());
    drop(served);
    use std::io::Read;
    assert_eq!(balancer_side.read(&mut [0u8; 1]).unwrap(), 0, "the server's FIN");
    let lb_addr = balancer_side.local_addr().unwrap();
    drop(balancer_side);
    std::thread::sleep(Duration::from_millis(50));
    (listener, lb_addr, t0, monotonic_ms())
}

#[test]
fn ingress_syn_over_a_time_wait_gets_a_newer_timestamp_for_its_whole_connection() {
    let ns = TestNetns::enter("tw");
    ns.ip(&["link", "set", "lo", "up"]);
    let skel = load();
    configure_seed(&skel);

    // A connection the server closes first: its socket stays in TIME_WAIT
    // holding the client's last timestamp, taken between t0 and t1.
    let (listener, lb, t0, t1) = time_wait_from(&skel, &ns, LIVE_LB.into(), LIVE_SERVER.into());
    let srv = listener.local_addr().unwrap();
    let key = conn_key_of(lb, srv.port(), 6);

    // Another client's SYN on those ports, its clock far behind: raised
    // just above the TIME_WAIT's last timestamp, and the shift kept.
    let old = t0.wrapping_sub(100_000);
    let syn = |tsval: u32| PacketBuilder::tcp(lb, srv).syn(1452).seq_no(77).tcp_options(syn_ts_options(tsval));
    let frame = syn(old).ip_options(seed_tuple(client())).build();
    let (ret, out) = run(&skel.progs.agent_ingress, &frame, None);
    assert_eq!(ret, TC_ACT_OK);
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &key).expect("client tuple stored");
    let shift = flow.ts_shift;
    let raised = old.wrapping_add(shift);
    assert!(
        (raised.wrapping_sub(t0) as i32) > 0 && (raised.wrapping_sub(t1 + 1) as i32) <= 0,
        "TSval {raised} just above the TIME_WAIT's, which was taken in [{t0}, {t1}]"
    );
    assert_frame(&out, &syn(raised).build(), "SYN: TSval raised, checksum updated, 155 stripped");
    assert_eq!(flow, DsrFlow { ts_shift: shift, ..tuple_flow(CLIENT) });
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1), (AgentCounter::TimeWaitReopened, 1)]);

    // Every later segment from the client is raised by it: plain ones and
    // those carrying a 124.
    let seg = |tsval: u32, tsecr: u32| {
        PacketBuilder::tcp(lb, srv).seq_no(78).ack_no(5000).tcp_options(ts_options(tsval, tsecr)).payload(b"GET /".to_vec())
    };
    ingress(&skel, &seg(old + 1040, 7).build(), TC_ACT_OK, Some(&seg(raised + 1040, 7).build()), "data");
    let frame = seg(old + 1050, 7).ip_options(InbandOption::ScoreRequest.encode()).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&seg(raised + 1050, 7).build()), "124 stripped, TSval raised");

    // Every segment to the client echoes its own clock again: the TSecr
    // lowered (here on the 125 that answers the 124; no route to the
    // client, so it goes back through the balancer).
    let reply = |tsecr: u32| PacketBuilder::tcp(srv, lb).seq_no(5000).tcp_options(ts_options(9, tsecr)).payload(b"HTTP/1.1".to_vec());
    let (ret, out) = run(&skel.progs.agent_egress, &reply(raised + 1050).build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &reply(old + 1050).ip_options(InbandOption::Score(0).encode()).build(), "TSecr lowered");
    assert_counters(
        &skel,
        &[(AgentCounter::TuplesStored, 1), (AgentCounter::TimeWaitReopened, 1), (AgentCounter::ProbesSeen, 1), (AgentCounter::ScoresSent, 1)],
    );

    // Another SYN over the same TIME_WAIT, even from the same client tuple
    // (the flow of the connection before is kept past its close): a new
    // connection, its shift computed anew.
    let frame = syn(old + 1000).ip_options(seed_tuple(client())).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&syn(raised).build()), "a new connection over the TIME_WAIT");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key).unwrap().ts_shift, shift.wrapping_sub(1000));

    // A SYN sent again after its first one reopened the TIME_WAIT (none is
    // left: here, ports no socket holds) keeps the shift its flow has.
    let again = sa(LIVE_LB, 2);
    let flow = DsrFlow { ts_shift: 777, ..tuple_flow(CLIENT) };
    put(&skel.maps.dsr_flows, &conn_key_of(again, srv.port(), 6), &flow);
    let p = |tsval: u32| PacketBuilder::tcp(again, srv).syn(1452).seq_no(77).tcp_options(syn_ts_options(tsval));
    ingress(&skel, &p(old).ip_options(seed_tuple(client())).build(), TC_ACT_OK, Some(&p(old + 777).build()), "SYN again");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key_of(again, srv.port(), 6)), Some(flow));

    // Over a TIME_WAIT whose last timestamp is older, or with no
    // timestamps at all, or with no TIME_WAIT: nothing to raise.
    let newer = t1.wrapping_add(100_000);
    for (what, p) in [
        ("newer than the TIME_WAIT's", syn(newer)),
        ("without timestamps", PacketBuilder::tcp(lb, srv).syn(1452).seq_no(77)),
        ("no socket on the tuple", PacketBuilder::tcp(sa(LIVE_LB, 1), srv).syn(1452).seq_no(77).tcp_options(syn_ts_options(old))),
    ] {
        // The earlier connection's entry goes; the stranger's port has none.
        let _ = skel.maps.dsr_flows.delete(conn_key_of(p.src, srv.port(), 6).as_bytes());
        ingress(&skel, &p.clone().ip_options(seed_tuple(client())).build(), TC_ACT_OK, Some(&p.build()), what);
        assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key_of(p.src, srv.port(), 6)), Some(tuple_flow(CLIENT)), "{what}");
    }
    assert_eq!(counters(&skel).iter().find(|(c, _)| *c == AgentCounter::TimeWaitReopened).unwrap().1, 2);
}

#[test]
fn ipv6_syn_over_a_time_wait_gets_a_newer_timestamp_behind_its_options_header() {
    // The 155 sits in a Destination Options header before the TCP header:
    // the timestamp is found behind it, and the header then removed.
    let ns = TestNetns::enter("tw6");
    ns.ip(&["link", "set", "lo", "up"]);
    for a in [LB6, SERVER6] {
        ns.add_ipv6("lo", &format!("{a}/128"));
    }
    let skel = load();
    configure_seed(&skel);
    let (listener, lb, t0, t1) = time_wait_from(&skel, &ns, LB6.into(), SERVER6.into());
    let srv = listener.local_addr().unwrap();
    let old = t0.wrapping_sub(100_000);
    let syn = |tsval: u32| PacketBuilder::tcp(lb, srv).syn(1440).seq_no(77).tcp_options(syn_ts_options(tsval));
    let (ret, out) = run(&skel.progs.agent_ingress, &syn(old).inband(&seed_tuple(client6())).build(), None);
    assert_eq!(ret, TC_ACT_OK);
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &conn_key_of(lb, srv.port(), 6)).expect("client tuple stored");
    let raised = old.wrapping_add(flow.ts_shift);
    assert!((raised.wrapping_sub(t0) as i32) > 0 && (raised.wrapping_sub(t1 + 1) as i32) <= 0, "{raised} in [{t0}, {t1}]");
    assert_frame(&out, &syn(raised).build(), "IPv6 SYN: TSval raised, header removed");
    assert_eq!(flow.client_addr, be_ip(CLIENT6.into()));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1), (AgentCounter::TimeWaitReopened, 1)]);
}

fn bpf_delete(skel: &AgentSkel, key: &ConnKey) {
    skel.maps.dsr_flows.delete(key.as_bytes()).expect("map delete");
}

fn be_ip_v4(a: Ipv4Addr) -> inband_lb::maps::Addr {
    be_ip(a.into())
}

// ---------------------------------------------------------------- IPv6

const LB6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1);
const SERVER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 2);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 0x10);
/// Routed via a gateway with a permanent neighbour entry (`server_routes6`).
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 7);
const STRANGER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x66);

fn lb6() -> SocketAddr {
    sa(LB6, SNAT_PORT)
}
fn server6() -> SocketAddr {
    sa(SERVER6, LOCAL_PORT)
}
fn vip6() -> SocketAddr {
    sa(VIP6, VIP_PORT)
}
fn client6() -> SocketAddr {
    sa(CLIENT6, CLIENT_PORT)
}
fn conn6() -> Conn {
    Conn::tcp(lb6(), server6())
}
fn conn_key6() -> ConnKey {
    conn_key_of(lb6(), LOCAL_PORT, 6)
}
fn syn6() -> PacketBuilder {
    PacketBuilder::tcp(lb6(), server6()).syn(1440)
}
fn request6() -> PacketBuilder {
    PacketBuilder::tcp(lb6(), server6()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec())
}
fn response6() -> PacketBuilder {
    PacketBuilder::tcp(server6(), lb6()).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n".to_vec())
}

/// As `configure`, with LOCAL_PORT also serving VIP6 over IPv6 and LB6 trusted.
fn configure6(skel: &AgentSkel) {
    configure(skel);
    add_service(skel, LOCAL_PORT, 6, vip6());
    put(&skel.maps.balancers, &be_ip(LB6.into()), &Balancer::default());
}

/// The Destination Options header offset in a frame, and where the option
/// data starts in it.
const DOH: usize = ETH_HLEN + 40;
const DOH_OPT: usize = DOH + 4;

#[test]
fn ipv6_ingress_takes_a_client_tuple_from_its_destination_options_header_and_removes_the_header() {
    let skel = load();
    configure6(&skel);
    let plain = syn6();
    let frame = plain.clone().inband(&auth_tuple(&plain, KEY_ID, &KEY, client6())).build();
    // next header 60, then a 40-byte header: 0x1E, 32, the 155, PadN(2).
    assert_eq!((frame[ETH_HLEN + 6], frame[DOH], frame[DOH + 1], frame[DOH + 2], frame[DOH + 3]), (60, 6, 4, 0x1e, 32));
    // Out: payload length 40 less, next header TCP, segment unchanged.
    ingress(&skel, &frame, TC_ACT_OK, Some(&plain.build()), "authenticated 155 removed with its header");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(tuple_flow(CLIENT6)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);

    configure_seed(&skel);
    let other = PacketBuilder::tcp(sa(LB6, SNAT_PORT + 1), server6()).syn(1440);
    let seed = other.clone().inband(&seed_tuple(client6())).build();
    assert_eq!(seed.len(), other.build().len() + 24);
    ingress(&skel, &seed, TC_ACT_OK, Some(&other.build()), "seed 155 removed with its header");
    let key = conn_key_of(sa(LB6, SNAT_PORT + 1), LOCAL_PORT, 6);
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(tuple_flow(CLIENT6)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 2)]);
}

#[test]
fn ipv6_ingress_marks_a_score_request_and_removes_its_header() {
    let skel = load();
    configure6(&skel);
    put(&skel.maps.dsr_flows, &conn_key6(), &tuple_flow(CLIENT6));
    let nonce = [0xde, 0xad, 0xbe, 0xef];
    let opt = InbandOption::auth_score_request(&KEY, KEY_ID, nonce, conn6()).encode();
    ingress(&skel, &request6().inband(&opt).build(), TC_ACT_OK, Some(&request6().build()), "authenticated 124");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(requested(tuple_flow(CLIENT6), KEY_ID, nonce)));

    configure_seed(&skel);
    put(&skel.maps.dsr_flows, &conn_key6(), &tuple_flow(CLIENT6));
    let seed = request6().inband(&InbandOption::ScoreRequest.encode()).build();
    assert_eq!(seed.len(), request6().build().len() + 8, "4 bytes of option, no padding");
    ingress(&skel, &seed, TC_ACT_OK, Some(&request6().build()), "seed 124");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(DsrFlow { score_requested: 1, ..tuple_flow(CLIENT6) }));
    assert_counters(&skel, &[(AgentCounter::ProbesSeen, 2)]);
}

#[test]
fn ipv6_egress_answers_in_a_destination_options_header_within_the_mtu() {
    let skel = load();
    configure6(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    let nonce = [1, 2, 3, 4];
    // No client tuple: a packet that gets no 125 is not sent direct either.
    let flow = requested(DsrFlow::default(), KEY_ID, nonce);
    let egress = |skel: &AgentSkel, frame: &[u8]| {
        let (ret, out) = run(&skel.progs.agent_egress, frame, None);
        assert_eq!(ret, TC_ACT_OK);
        out
    };
    // 79 bytes of IPv6 packet and a 24-byte header: an MTU of 103 takes
    // the answer. A packet without data (nothing to send on apart from a
    // carrier) 1 byte over it defers the answer.
    let resp = response6().build();
    assert_eq!(resp.len() - ETH_HLEN, 79);
    put(&skel.maps.dsr_flows, &conn_key6(), &flow);
    let ack = response6().flags(TCP_ACK).payload(Vec::new()).build();
    set_mode(&skel, AuthMode::Siphash, 60 + 24 - 1);
    assert_frame(&egress(&skel, &ack), &ack, "deferred");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(flow), "flag kept");
    set_mode(&skel, AuthMode::Siphash, 103);
    let want = response6().inband(&InbandOption::auth_score(&KEY, KEY_ID, nonce, conn6(), 3).encode()).build();
    assert_frame(&egress(&skel, &resp), &want, "authenticated 125: 0x1E, 16, the 125, PadN(2)");
    assert_eq!(&want[DOH..DOH_OPT], &[6, 2, 0x1e, 16]);
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(DsrFlow { score_requested: 0, ..flow }));

    configure_seed(&skel);
    put(&skel.maps.dsr_flows, &conn_key6(), &DsrFlow { score_requested: 1, ..Default::default() });
    let want = response6().inband(&InbandOption::Score(3).encode()).build();
    assert_frame(&egress(&skel, &resp), &want, "seed 125 in an 8-byte header");

    // A response that has a Destination Options header of its own (the
    // application's) gets no second one: the request waits.
    let pending = requested(DsrFlow::default(), KEY_ID, nonce);
    put(&skel.maps.dsr_flows, &conn_key6(), &pending);
    let own = response6().ext_headers(IPPROTO_DSTOPTS, opts_header(IPPROTO_TCP, &[])).build();
    assert_frame(&egress(&skel, &own), &own, "untouched");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(pending));
    assert_counters(&skel, &[(AgentCounter::ScoreDeferredMtu, 1), (AgentCounter::ScoresSent, 2), (AgentCounter::ScoreDeferredNoRoom, 1)]);
}

/// `server_routes`, and for IPv6: DEV with SERVER6/64, CLIENT6's network
/// via a gateway whose MAC is known, forwarding on (bpf_fib_lookup's
/// condition, as for IPv4).
fn server_routes6(ns: &TestNetns) -> u32 {
    let ifindex = server_routes(ns, true);
    ns.add_ipv6(DEV, "fd00:99::2/64");
    ns.ip(&["-6", "neigh", "add", "fd00:99::1", "lladdr", "02:00:00:00:bb:01", "dev", DEV, "nud", "permanent"]);
    ns.ip(&["-6", "route", "add", "2001:db8:100::/64", "via", "fd00:99::1", "dev", DEV]);
    let sysctl = format!("net.ipv6.conf.{DEV}.forwarding=1");
    let out = Command::new("ip").args(["netns", "exec", &ns.name, "sysctl", "-qw", &sysctl]).output().unwrap();
    assert!(out.status.success(), "{sysctl}: {}", String::from_utf8_lossy(&out.stderr));
    ifindex
}

#[test]
fn ipv6_egress_dsr_sends_from_the_vip_with_the_mss_clamped_by_24() {
    let ns = TestNetns::enter("dsr6");
    let ifindex = server_routes6(&ns);
    let skel = load();
    configure6(&skel);
    put(&skel.maps.dsr_flows, &conn_key6(), &tuple_flow(CLIENT6));

    let (ret, out) = run(&skel.progs.agent_egress, &syn_ack(server6(), lb6(), 1440).build(), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    // Byte-exact: as if the server had sent it from the VIP, MSS 1440 - 24.
    assert_frame(&out, &syn_ack(vip6(), client6(), 1416).macs(SERVER_MAC, GATEWAY_MAC).build(), "DSR SYN-ACK");
    let resp = |src, dst, macs: (Mac, Mac)| {
        PacketBuilder::tcp(src, dst).flags(TCP_ACK | TCP_PSH).payload(vec![0x5a; 999]).macs(macs.0, macs.1)
    };
    let (ret, out) = run(&skel.progs.agent_egress, &resp(server6(), lb6(), (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01])).build(), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &resp(vip6(), client6(), (SERVER_MAC, GATEWAY_MAC)).build(), "DSR data, not clamped");
    assert!(parse(&out).unwrap().checksums_ok);
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 2), (AgentCounter::MssClamped, 1)]);
}

#[test]
fn ipv6_options_from_a_non_balancer_are_not_trusted_and_forged_ones_are_dropped() {
    let skel = load();
    configure6(&skel);
    let stranger = PacketBuilder::tcp(sa(STRANGER6, SNAT_PORT), server6()).syn(1440);
    let conn = Conn::tcp(stranger.src, stranger.dst);
    for opt in [
        auth_tuple(&stranger, KEY_ID, &KEY, client6()),
        InbandOption::auth_score_request(&KEY, KEY_ID, [1, 2, 3, 4], conn).encode(),
    ] {
        let frame = stranger.clone().inband(&opt).build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "untrusted: passed as it came");
    }
    assert_counters(&skel, &[(AgentCounter::UntrustedOption, 2)]);

    let p = syn6();
    let victim = sa(VICTIM.to_ipv6_mapped(), CLIENT_PORT);
    let mut flipped = auth_tuple(&p, KEY_ID, &KEY, victim);
    *flipped.last_mut().unwrap() ^= 1;
    let mut swapped = auth_tuple(&p, KEY_ID, &KEY, client6());
    swapped[4..20].copy_from_slice(&VICTIM.to_ipv6_mapped().octets());
    for (name, opt) in [("MAC bit flipped", flipped), ("client replaced", swapped)] {
        ingress(&skel, &p.clone().inband(&opt).build(), TC_ACT_SHOT, None, name);
    }
    let good = p.clone().inband(&auth_tuple(&p, KEY_ID, &KEY, client6())).build();
    let mut bad_tcp = good.clone();
    bad_tcp[DOH + 40 + 14] ^= 0x80; // the window: the TCP checksum covers it
    ingress(&skel, &bad_tcp, TC_ACT_SHOT, None, "bad TCP checksum");
    let ack = PacketBuilder::tcp(lb6(), server6()).flags(TCP_ACK);
    ingress(&skel, &ack.clone().inband(&auth_tuple(&ack, KEY_ID, &KEY, client6())).build(), TC_ACT_SHOT, None, "155 on an ACK");
    // The IPv4 lengths of a 155 in an IPv6 header: another format.
    let v4_sized = InbandOption::auth_client_tuple(&KEY, KEY_ID, p.seq, conn6(), client()).encode();
    ingress(&skel, &p.clone().inband(&v4_sized).build(), TC_ACT_SHOT, None, "20-byte 155");
    assert_eq!(flows(&skel), 0);
    assert_counters(
        &skel,
        &[
            (AgentCounter::UntrustedOption, 2),
            (AgentCounter::AuthFailed, 2),
            (AgentCounter::BadChecksum, 1),
            (AgentCounter::NotSyn, 1),
            (AgentCounter::WrongFormat, 1),
        ],
    );
}

#[test]
fn ipv6_with_an_ipv4_mapped_address_never_passes_for_ipv4() {
    // The maps hold IPv4 peers as IPv4-mapped addresses: an IPv6 packet
    // from ::ffff:<balancer> would be trusted as the balancer and store a
    // tuple under the IPv4 connection's key.
    let skel = load();
    configure6(&skel);
    configure_seed(&skel);
    let victim = sa(VICTIM.to_ipv6_mapped(), 9);
    for (src, dst) in [(sa(LB.to_ipv6_mapped(), SNAT_PORT), server6()), (lb6(), sa(SERVER.to_ipv6_mapped(), LOCAL_PORT))] {
        let frame = PacketBuilder::tcp(src, dst).syn(1440).inband(&seed_tuple(victim)).build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "passed as it came");
    }
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::Malformed, 2)]);
}

// ---------------------------------------------------------------- IPv6: malformed headers

/// An IPv6 frame with its Destination Options header patched by `f`.
fn patched(frame: &[u8], f: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let mut out = frame.to_vec();
    f(&mut out);
    out
}

#[test]
fn ipv6_malformed_headers_and_carriers_pass_untouched_and_are_counted() {
    let skel = load();
    configure6(&skel);
    let p = syn6();
    // A 40-byte header: 0x1E, 32, the 155 (32 bytes), PadN of 2 at DOH + 36.
    let good = p.clone().inband(&auth_tuple(&p, KEY_ID, &KEY, client6())).build();
    let pad = DOH + 36;
    let l4 = DOH + 40;
    // A frame that ends inside the fixed header is one BPF_PROG_TEST_RUN
    // refuses to build an skb from (EINVAL); the program takes it as
    // malformed by the same failed load as a header cut below.
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("fixed header only", patched(&good[..DOH], |f| f[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&[0, 1]))),
        ("payload length past the frame", patched(&good, |f| f[ETH_HLEN + 5] += 1)),
        ("header cut after 1 byte", cut6(&good, DOH + 1)),
        ("header cut after 4 bytes", cut6(&good, DOH + 4)),
        ("header cut before its padding", cut6(&good, pad)),
        ("hdr ext len past the packet", patched(&good, |f| f[DOH + 1] = 9)),
        ("hdr ext len short of the option", patched(&good, |f| f[DOH + 1] = 3)),
        ("option data length 0", patched(&good, |f| f[DOH + 3] = 0)),
        ("option data length 1", patched(&good, |f| f[DOH + 3] = 1)),
        ("option data length not the 155's", patched(&good, |f| f[DOH + 3] = 30)),
        ("PadN of the wrong length", patched(&good, |f| f[pad + 1] = 3)),
        ("PadN with data", patched(&good, |f| f[pad + 3] = 0xff)),
        ("two Pad1s and a PadN of 0: padding, but not the balancer's", patched(&good, |f| f[pad..pad + 4].copy_from_slice(&[0, 0, 1, 0]))),
        ("TCP header cut", cut6(&good, l4 + 12)),
        ("TCP data offset 4", patched(&good, |f| f[l4 + 12] = 0x40)),
        ("TCP data offset past the segment", patched(&good, |f| f[l4 + 12] = 0xf0)),
    ];
    // Another option where the padding goes, of each action (RFC 8200
    // §4.2): removing the header would hide it from the stack.
    for t in [0x1d, 0x5d, 0x9d, 0xdd] {
        cases.push(("an unknown option after the 155", patched(&good, |f| f[pad..pad + 2].copy_from_slice(&[t, 0]))));
    }
    // A 124 of 3 bytes ends in a Pad1; one that is not 0 is not padding.
    let short = request6().ext_headers(IPPROTO_DSTOPTS, vec![IPPROTO_TCP, 0, 0x1e, 3, 124, 3, 0, 1]).build();
    cases.push(("Pad1 that is not", short));
    add_service(&skel, LOCAL_PORT, 17, vip6());
    let d = PacketBuilder::udp(lb6(), server6()).payload(b"datagram".to_vec());
    let opt = InbandOption::auth_client_tuple(&KEY, KEY_ID, 1, Conn::udp(lb6(), server6()), client6()).encode();
    let udp = d.inband(&opt).build();
    let ul4 = DOH + 40;
    cases.push(("UDP header cut", cut6(&udp, ul4 + 6)));
    cases.push(("UDP length past the payload", patched(&udp, |f| f[ul4 + 5] += 1)));
    cases.push(("UDP length short of the payload", patched(&udp, |f| f[ul4 + 5] -= 1)));
    let n = cases.len() as u64;
    for (name, frame) in cases {
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::Malformed, n)]);

    // Well-formed carriers of the wrong length are the other format: dropped.
    let pad1 = request6().ext_headers(IPPROTO_DSTOPTS, vec![IPPROTO_TCP, 0, 0x1e, 3, 124, 3, 0, 0]).build();
    ingress(&skel, &pad1, TC_ACT_SHOT, None, "3-byte 124 and a Pad1");
    assert_counters(&skel, &[(AgentCounter::Malformed, n), (AgentCounter::WrongFormat, 1)]);
}

#[test]
fn ipv6_headers_that_are_not_one_inband_header_first_are_the_stacks_and_counted_from_a_balancer() {
    let skel = load();
    configure6(&skel);
    put(&skel.maps.dsr_flows, &conn_key6(), &tuple_flow(VICTIM));
    let p = syn6();
    let tuple = inband_core::wire::doh(&auth_tuple(&p, KEY_ID, &KEY, client6()), IPPROTO_TCP);
    let tuple_then_routing = inband_core::wire::doh(&auth_tuple(&p, KEY_ID, &KEY, client6()), IPPROTO_ROUTING);
    let hop = |next| opts_header(next, &[]);
    let five: Vec<u8> = (0..5).flat_map(|i| hop(if i == 4 { IPPROTO_TCP } else { IPPROTO_DSTOPTS })).collect();
    // The option behind other headers, or before a Routing header (RFC
    // 8200 §4.1: options for the first destination and the Routing
    // header's hops), a chain longer than any walk, a fragment.
    let chains: [(&str, u8, Vec<u8>); 6] = [
        ("Hop-by-Hop, then the option", IPPROTO_HOPOPTS, [hop(IPPROTO_DSTOPTS), tuple.clone()].concat()),
        (
            "Hop-by-Hop, Routing, the option",
            IPPROTO_HOPOPTS,
            [hop(IPPROTO_ROUTING), routing(IPPROTO_DSTOPTS), tuple.clone()].concat(),
        ),
        (
            "the option, Routing, Destination Options",
            IPPROTO_DSTOPTS,
            [tuple_then_routing, routing(IPPROTO_DSTOPTS), hop(IPPROTO_TCP)].concat(),
        ),
        ("Routing alone", IPPROTO_ROUTING, routing(IPPROTO_TCP)),
        ("five Destination Options headers", IPPROTO_DSTOPTS, five),
        ("a first fragment", IPPROTO_FRAGMENT, vec![IPPROTO_TCP, 0, 0, 1, 0, 0, 0, 9]),
    ];
    for (name, first, headers) in &chains {
        let frame = p.clone().ext_headers(*first, headers.clone()).build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    let n = chains.len() as u64;
    // From anyone else: the stack's business, uncounted.
    let stranger = PacketBuilder::tcp(sa(STRANGER6, SNAT_PORT), server6()).syn(1440);
    for (name, first, headers) in &chains {
        let frame = stranger.clone().ext_headers(*first, headers.clone()).build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    // The option not first in its header (padding before it), or an
    // unknown option of any action first: not a carrier of ours, the
    // stack skips or discards it by its type (RFC 8200 §4.2).
    let req = request6();
    let mut not_ours = vec![
        ("PadN before the option", opts_header(IPPROTO_TCP, &[1, 0, 0x1e, 4, 124, 4, 0, 0])),
        ("Pad1 before the option", opts_header(IPPROTO_TCP, &[0, 0x1e, 4, 124, 4, 0, 0])),
    ];
    for t in [0x1d, 0x5d, 0x9d, 0xdd] {
        not_ours.push(("an unknown option first", ext(IPPROTO_TCP, &[t, 4, 0, 0, 0, 0])));
    }
    for (name, h) in not_ours {
        let frame = req.clone().ext_headers(IPPROTO_DSTOPTS, h).build();
        ingress(&skel, &frame, TC_ACT_OK, Some(&frame), name);
    }
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key6()), Some(tuple_flow(VICTIM)), "nothing read");
    assert_counters(&skel, &[(AgentCounter::UnwalkedExtHeaders, n)]);

    // Egress: the server's own headers keep its packet off the agent's path.
    put(&skel.maps.dsr_flows, &conn_key6(), &requested(tuple_flow(CLIENT6), KEY_ID, [1, 2, 3, 4]));
    let own = response6().ext_headers(IPPROTO_HOPOPTS, hop(IPPROTO_TCP)).build();
    let (ret, out) = run(&skel.progs.agent_egress, &own, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &own, "untouched");
    assert_counters(&skel, &[(AgentCounter::UnwalkedExtHeaders, n)]);
}

// ---------------------------------------------------------------- UDP

/// A datagram of odd length (the checksum's padded last word).
fn datagram(src: SocketAddr, dst: SocketAddr) -> PacketBuilder {
    PacketBuilder::udp(src, dst).payload(vec![0x40; 33])
}
/// The authenticated UDP 155 of a flow's first datagram, stamped `stamp`
/// (the balancer's clock, ms), which the MAC covers.
fn udp_tuple(lb: SocketAddr, server: SocketAddr, stamp: u32, client: SocketAddr) -> Vec<u8> {
    InbandOption::auth_client_tuple(&KEY, KEY_ID, stamp, Conn::udp(lb, server), client).encode()
}
fn udp_key(lb: SocketAddr) -> ConnKey {
    conn_key_of(lb, LOCAL_PORT, 17)
}
/// The UDP checksum of an IPv4 frame without IP options zeroed: none.
fn without_udp_checksum(mut frame: Vec<u8>) -> Vec<u8> {
    frame[ETH_HLEN + 20 + 6..ETH_HLEN + 20 + 8].copy_from_slice(&[0, 0]);
    frame
}

/// `configure6`, LOCAL_PORT serving both VIPs over UDP too, UDP tuples
/// forgotten after `idle_s` (0: never).
fn configure_udp(skel: &AgentSkel, idle_s: u32) {
    configure6(skel);
    add_service(skel, LOCAL_PORT, 17, vip());
    add_service(skel, LOCAL_PORT, 17, vip6());
    let cfg = DataPathConfig { auth_mode: AuthMode::Siphash.to_c(), mtu: MTU, udp_idle_timeout_s: idle_s, ..Default::default() };
    put(&skel.maps.agent_config, &0u32, &cfg);
}

/// Asserts the UDP tuple stored under `key`: `client`, `stamp`, and a
/// last use from the coarse clock since `since` (it lags the fine one by
/// up to a tick).
#[track_caller]
fn assert_udp_flow(skel: &AgentSkel, key: &ConnKey, client: SocketAddr, stamp: u32, since: u64) -> DsrFlow {
    let got: DsrFlow = get(&skel.maps.dsr_flows, key).expect("a UDP tuple");
    assert!(got.last_ns + 20_000_000 >= since && got.last_ns <= ktime_ns(), "last use {} vs {since}", got.last_ns);
    let want = DsrFlow {
        client_addr: be_ip(client.ip()),
        client_port: be_port(client.port()),
        stamp: u32::from_ne_bytes(stamp.to_be_bytes()),
        last_ns: got.last_ns,
        ..Default::default()
    };
    assert_eq!(got, want);
    got
}

fn balancer_stamp(skel: &AgentSkel, lb: IpAddr) -> u32 {
    get::<_, Balancer>(&skel.maps.balancers, &be_ip(lb)).expect("a balancer").stamp
}

#[test]
fn udp_155_of_either_family_is_stored_with_its_stamp_and_removed() {
    let skel = load();
    configure_udp(&skel, 0);
    let since = ktime_ns();
    for (lb, server, client, carrier) in [(lb(), server(), client(), 24), (lb6(), server6(), client6(), 40)] {
        let d = datagram(lb, server);
        let frame = d.clone().inband(&udp_tuple(lb, server, 7_000, client)).build();
        assert_eq!(frame.len(), d.build().len() + carrier, "24-byte IPv4 option, 36 bytes in a 40-byte header");
        ingress(&skel, &frame, TC_ACT_OK, Some(&d.build()), "155 removed");
        assert_udp_flow(&skel, &udp_key(lb), client, 7_000, since);
        assert_eq!(balancer_stamp(&skel, lb.ip()), 7_000, "the balancer's newest stamp");
    }
    // Seed format: no stamp to keep.
    configure_seed(&skel);
    let other = sa(LB, SNAT_PORT + 1);
    let d = datagram(other, server());
    ingress(&skel, &d.clone().inband(&seed_tuple(client())).build(), TC_ACT_OK, Some(&d.build()), "seed 155 removed");
    assert_udp_flow(&skel, &udp_key(other), client(), 0, since);
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 3)]);
}

#[test]
fn udp_155_older_than_its_balancer_sent_is_a_replay() {
    let skel = load();
    configure_udp(&skel, 0);
    let since = ktime_ns();
    let d = datagram(lb(), server());
    let with = |stamp, client| d.clone().inband(&udp_tuple(lb(), server(), stamp, client)).build();
    ingress(&skel, &with(10_000, client()), TC_ACT_OK, Some(&d.build()), "stored");
    let victim = sa(VICTIM, CLIENT_PORT);
    // Older than the tuple's own stamp: removed, nothing changed.
    ingress(&skel, &with(9_999, victim), TC_ACT_OK, Some(&d.build()), "older than the tuple's");
    assert_udp_flow(&skel, &udp_key(lb()), client(), 10_000, since);
    // A new tuple, but more than 5 s behind what the balancer sent since.
    let other = sa(LB, SNAT_PORT + 1);
    let od = datagram(other, server());
    let stale = od.clone().inband(&udp_tuple(other, server(), 10_000 - 5_001, victim)).build();
    ingress(&skel, &stale, TC_ACT_OK, Some(&od.build()), "outside the window");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &udp_key(other)), None);
    // A newer one wins (the port's next flow).
    ingress(&skel, &with(10_500, victim), TC_ACT_OK, Some(&d.build()), "newer");
    assert_udp_flow(&skel, &udp_key(lb()), victim, 10_500, since);
    assert_eq!(balancer_stamp(&skel, lb().ip()), 10_500);
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 2), (AgentCounter::StaleStamp, 2)]);
}

#[test]
fn udp_155_untrusted_is_passed_and_forged_or_corrupt_is_dropped() {
    let skel = load();
    configure_udp(&skel, 0);
    let stranger = sa(Ipv4Addr::new(10, 0, 0, 66), SNAT_PORT);
    let untrusted = datagram(stranger, server()).inband(&udp_tuple(stranger, server(), 1, client())).build();
    ingress(&skel, &untrusted, TC_ACT_OK, Some(&untrusted), "untrusted");

    let d = datagram(lb(), server());
    let victim = sa(VICTIM, CLIENT_PORT);
    let mut flipped = udp_tuple(lb(), server(), 1, victim);
    *flipped.last_mut().unwrap() ^= 1;
    let mut restamped = udp_tuple(lb(), server(), 1, victim);
    restamped[15] ^= 1; // the stamp: covered by the MAC
    for (name, opt) in [("MAC bit flipped", flipped), ("stamp changed", restamped)] {
        ingress(&skel, &d.clone().inband(&opt).build(), TC_ACT_SHOT, None, name);
    }
    let mut corrupt = d.clone().inband(&udp_tuple(lb(), server(), 1, victim)).build();
    *corrupt.last_mut().unwrap() ^= 1;
    ingress(&skel, &corrupt, TC_ACT_SHOT, None, "bad UDP checksum");
    // IPv6 has no datagram without a checksum.
    let d6 = datagram(lb6(), server6());
    let mut none6 = d6.inband(&udp_tuple(lb6(), server6(), 1, client6())).build();
    none6[DOH + 40 + 6..DOH + 40 + 8].copy_from_slice(&[0, 0]);
    ingress(&skel, &none6, TC_ACT_SHOT, None, "IPv6 UDP checksum 0");
    assert_eq!(flows(&skel), 0);
    // IPv4 without a checksum has nothing to check: accepted, and still none.
    let with_opt = d.clone().inband(&udp_tuple(lb(), server(), 1, client())).build();
    let mut none = with_opt.clone();
    let at = ETH_HLEN + with_opt.len() - d.build().len() + 20 + 6;
    none[at..at + 2].copy_from_slice(&[0, 0]);
    ingress(&skel, &none, TC_ACT_OK, Some(&without_udp_checksum(d.build())), "IPv4 UDP checksum 0");
    assert!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &udp_key(lb())).is_some());
    assert_counters(
        &skel,
        &[
            (AgentCounter::UntrustedOption, 1),
            (AgentCounter::AuthFailed, 2),
            (AgentCounter::BadChecksum, 2),
            (AgentCounter::TuplesStored, 1),
        ],
    );
}

#[test]
fn udp_tuples_stay_while_used_and_are_forgotten_when_idle() {
    let skel = load();
    configure_udp(&skel, 30);
    let key = udp_key(lb());
    let used = |ago_ns: u64| DsrFlow { last_ns: ktime_ns() - ago_ns, ..tuple_flow(CLIENT) };
    let plain = datagram(lb(), server()).build();
    // Used half a second ago: not rewritten (to the second).
    let recent = used(500_000_000);
    put(&skel.maps.dsr_flows, &key, &recent);
    ingress(&skel, &plain, TC_ACT_OK, Some(&plain), "kept");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(recent));
    // Two seconds ago: its last use moves to now.
    let since = ktime_ns();
    put(&skel.maps.dsr_flows, &key, &used(2_000_000_000));
    ingress(&skel, &plain, TC_ACT_OK, Some(&plain), "kept");
    assert_udp_flow(&skel, &key, client(), 0, since);
    // Past the idle timeout: forgotten by the next datagram either way.
    put(&skel.maps.dsr_flows, &key, &used(31_000_000_000));
    ingress(&skel, &plain, TC_ACT_OK, Some(&plain), "expired");
    assert_eq!(flows(&skel), 0);
    put(&skel.maps.dsr_flows, &key, &used(31_000_000_000));
    let resp = datagram(server(), lb()).build();
    let (ret, out) = run(&skel.progs.agent_egress, &resp, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &resp, "expired: through the balancer");
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::UdpTuplesExpired, 2)]);
}

#[test]
fn udp_egress_goes_direct_from_the_vip_or_answers_a_score_request() {
    let ns = TestNetns::enter("udp");
    let ifindex = server_routes6(&ns);
    let skel = load();
    configure_udp(&skel, 0);
    let to_lb = (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]);
    let direct = (SERVER_MAC, GATEWAY_MAC);
    let egress = |frame: &[u8]| {
        let (ret, out) = run(&skel.progs.agent_egress, frame, Some(ifindex));
        assert_eq!(ret, TC_ACT_OK);
        out
    };
    put(&skel.maps.dsr_flows, &udp_key(lb()), &tuple_flow(CLIENT));
    put(&skel.maps.dsr_flows, &udp_key(lb6()), &tuple_flow(CLIENT6));
    for (lb, server, vip, client) in [(lb(), server(), vip(), client()), (lb6(), server6(), vip6(), client6())] {
        let out = egress(&datagram(server, lb).macs(to_lb.0, to_lb.1).build());
        assert_frame(&out, &datagram(vip, client).macs(direct.0, direct.1).build(), "DSR datagram");
    }
    // IPv4 without a checksum: still none after the rewrite.
    let out = egress(&without_udp_checksum(datagram(server(), lb()).macs(to_lb.0, to_lb.1).build()));
    assert_frame(&out, &without_udp_checksum(datagram(vip(), client()).macs(direct.0, direct.1).build()), "no checksum");
    // A 125 goes to the balancer, signed for UDP.
    let nonce = [9, 8, 7, 6];
    put(&skel.maps.dsr_flows, &udp_key(lb()), &requested(tuple_flow(CLIENT), KEY_ID, nonce));
    let out = egress(&datagram(server(), lb()).macs(to_lb.0, to_lb.1).build());
    let score = InbandOption::auth_score(&KEY, KEY_ID, nonce, Conn::udp(lb(), server()), 0).encode();
    assert_frame(&out, &datagram(server(), lb()).macs(to_lb.0, to_lb.1).ip_options(score).build(), "125");
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 3), (AgentCounter::ScoresSent, 1)]);
}

// ---------------------------------------------------------------- IP-in-IP carrier

#[test]
fn ingress_unwraps_a_balancers_ipip_and_takes_its_155() {
    let skel = load();
    configure(&skel);
    let plain = syn();
    let wrapped = ipip(&plain.clone().ip_options(auth_tuple(&plain, KEY_ID, &KEY, client())).build());
    ingress(&skel, &wrapped, TC_ACT_OK, Some(&plain.build()), "outer header and 155 gone");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1), (AgentCounter::Decapsulated, 1)]);
}

#[test]
fn a_wrapped_124_is_answered_by_a_wrapped_125() {
    let skel = load();
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let nonce = [0x0b, 0x0a, 0x0d, 0x0e];
    ingress(&skel, &ipip(&request().ip_options(auth_request(nonce)).build()), TC_ACT_OK, Some(&request().build()), "unwrapped, stripped");
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(flow, DsrFlow { score_requested: 3, ..requested(tuple_flow(CLIENT), KEY_ID, nonce) }, "requested, to be answered wrapped");
    put(&skel.maps.active_conns, &LOCAL_PORT, &4i64);
    let out = answer(&skel, flow);
    let want = ipip(&with_option(InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 4)));
    assert_frame(&out, &want, "125 inside IP-in-IP");
    assert_eq!(inband_testkit::packet::checksum(&[&out[ETH_HLEN..ETH_HLEN + 20]]), 0, "outer header checksum");
    // A 124 that came plain is answered plain, on the same flow.
    ingress(&skel, &request().ip_options(auth_request(nonce)).build(), TC_ACT_OK, Some(&request().build()), "plain 124");
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(flow.score_requested, 1);
    assert_frame(&answer(&skel, flow), &with_option(InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 4)), "plain 125");
    assert_counters(
        &skel,
        &[(AgentCounter::ProbesSeen, 2), (AgentCounter::ScoresSent, 2), (AgentCounter::Decapsulated, 1), (AgentCounter::Encapsulated, 1)],
    );
}

#[test]
fn ingress_leaves_other_tunnels_untouched() {
    let skel = load();
    configure(&skel);
    let plain = syn();
    let inner = plain.clone().ip_options(auth_tuple(&plain, KEY_ID, &KEY, client())).build();
    // From a host that is not a balancer.
    let mut stranger = PacketBuilder::tcp(sa(VICTIM, 1000), server()).syn(1452);
    stranger.seq = plain.seq;
    let foreign = ipip(&stranger.ip_options(auth_tuple(&plain, KEY_ID, &KEY, client())).build());
    ingress(&skel, &foreign, TC_ACT_OK, Some(&foreign), "not from a balancer");
    // Outer addresses other than the inner ones: someone's real tunnel.
    let mut other = ipip(&inner);
    other[ETH_HLEN + 12..ETH_HLEN + 16].copy_from_slice(&VICTIM.octets());
    ingress(&skel, &other, TC_ACT_OK, Some(&other), "outer source differs");
    // An outer length that does not match the inner packet.
    let mut short = ipip(&inner);
    short[ETH_HLEN + 3] -= 4;
    ingress(&skel, &short, TC_ACT_OK, Some(&short), "lengths disagree");
    assert_eq!(flows(&skel), 0);
    assert_counters(&skel, &[]);
}

// ---------------------------------------------------------------- fleet prefixes

/// A fleet's prefix (lb.toml `[scale_out] fleet_prefix`) and one of its
/// addresses, as a fleet tuple's source.
const FLEET: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xf1ee, 0, 0, 0, 0, 0, 0);
const FLEET_TUPLE: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xf1ee, 0, 0, 0, 0, 0x9a3c, 0x1234);

fn trust_fleet(skel: &AgentSkel) {
    put(&skel.maps.balancer_nets, &balancer_net(format!("{FLEET}/96").parse().unwrap()), &Balancer::default());
}

/// Any address of a configured fleet prefix may send a 155, which is
/// checked and stored as a listed balancer's; an address next to the
/// prefix (the same /95) may not. Without the prefix the first is refused
/// too (untrusted_option).
#[test]
fn a_155_from_a_fleet_prefix_is_taken_and_from_its_neighbour_is_not() {
    let skel = load();
    configure6(&skel);
    let inside = PacketBuilder::tcp(sa(FLEET_TUPLE, 7311), server6()).syn(1440);
    let frame = inside.clone().inband(&auth_tuple(&inside, KEY_ID, &KEY, client6())).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "no fleet configured: left as it came");
    assert_counters(&skel, &[(AgentCounter::UntrustedOption, 1)]);

    trust_fleet(&skel);
    ingress(&skel, &frame, TC_ACT_OK, Some(&inside.build()), "from the fleet: 155 taken and removed");
    let key = conn_key_of(sa(FLEET_TUPLE, 7311), LOCAL_PORT, 6);
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(tuple_flow(CLIENT6)));
    // Its flow label names no balancer: counted, nothing to steer by.
    let counted = [(AgentCounter::UntrustedOption, 1), (AgentCounter::TuplesStored, 1), (AgentCounter::FleetUnnamed, 1)];
    assert_counters(&skel, &counted);

    let neighbour = Ipv6Addr::new(0xfd00, 0xf1ee, 0, 0, 0, 1, 0x9a3c, 0x1234);
    let outside = PacketBuilder::tcp(sa(neighbour, 7311), server6()).syn(1440);
    let frame = outside.clone().inband(&auth_tuple(&outside, KEY_ID, &KEY, client6())).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "outside the /96: left as it came");
    assert_eq!(flows(&skel), 1);
    assert_counters(&skel, &[(AgentCounter::UntrustedOption, 2), (AgentCounter::TuplesStored, 1), (AgentCounter::FleetUnnamed, 1)]);
}

/// `frame` (Ethernet, IPv6) with the flow label `label`.
fn labelled(mut frame: Vec<u8>, label: u32) -> Vec<u8> {
    frame[ETH_HLEN + 1] = (frame[ETH_HLEN + 1] & 0xf0) | (label >> 16) as u8;
    frame[ETH_HLEN + 2] = (label >> 8) as u8;
    frame[ETH_HLEN + 3] = label as u8;
    frame
}

/// A fleet's 124 names the instance that sent it in its flow label: the
/// agent keeps the label when a `balancers` address has it
/// (fleet_instances) and sends the 125 wrapped in IPv6 from the server to
/// that address, since the fleet address reaches no instance. A label
/// that names no balancer is counted (fleet_unnamed), and the answer goes
/// to the fleet address unwrapped, as before.
#[test]
fn a_fleet_flows_125_goes_wrapped_to_the_instance_its_124_named() {
    let skel = load();
    configure6(&skel);
    trust_fleet(&skel);
    let label = inband_core::wire::fleet_label(LB6);
    put(&skel.maps.fleet_instances, &label, &be_ip(LB6.into()));
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    let from = sa(FLEET_TUPLE, 7311);
    let key = conn_key_of(from, LOCAL_PORT, 6);
    put(&skel.maps.dsr_flows, &key, &tuple_flow(CLIENT6));
    let nonce = [5, 6, 7, 8];
    let req = PacketBuilder::tcp(from, server6()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec());
    let opt = InbandOption::auth_score_request(&KEY, KEY_ID, nonce, Conn::tcp(from, server6())).encode();
    let asked = labelled(req.clone().inband(&opt).build(), label);
    ingress(&skel, &asked, TC_ACT_OK, Some(&labelled(req.build(), label)), "a fleet's 124");
    let flow = DsrFlow { fleet_label: label, ..requested(tuple_flow(CLIENT6), KEY_ID, nonce) };
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(flow));

    let resp = PacketBuilder::tcp(server6(), from).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n".to_vec());
    let (ret, out) = run(&skel.progs.agent_egress, &resp.build(), None);
    assert_eq!(ret, TC_ACT_REDIRECT, "routed by the kernel to the instance");
    let inner = resp.clone().inband(&InbandOption::auth_score(&KEY, KEY_ID, nonce, Conn::tcp(from, server6()), 3).encode()).build();
    let mut want = inner[..ETH_HLEN].to_vec();
    want.extend_from_slice(&inner[ETH_HLEN..ETH_HLEN + 4]);
    want.extend_from_slice(&((inner.len() - ETH_HLEN) as u16).to_be_bytes());
    want.extend_from_slice(&[41, 64]);
    want.extend_from_slice(&SERVER6.octets());
    want.extend_from_slice(&LB6.octets());
    want.extend_from_slice(&inner[ETH_HLEN..]);
    assert_frame(&out, &want, "the 125 wrapped to the instance");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(DsrFlow { score_requested: 0, ..flow }));

    // A 124 whose label names no balancer: the 125 goes as it did.
    ingress(&skel, &labelled(req.clone().inband(&opt).build(), label ^ 1), TC_ACT_OK, None, "an unnamed label");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key).map(|f| f.fleet_label), Some(0));
    let (ret, out) = run(&skel.progs.agent_egress, &resp.build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &inner, "unwrapped, to the fleet address");
    assert_counters(
        &skel,
        &[(AgentCounter::ProbesSeen, 2), (AgentCounter::ScoresSent, 2), (AgentCounter::FleetSteered, 1), (AgentCounter::FleetUnnamed, 1)],
    );
}

/// Two clients whose fleet tuples are the same: the second one's SYN meets
/// the first one's live socket. From a fleet it is dropped and counted
/// (fleet_collisions), so the stack sends no challenge ACK toward the
/// fleet address, and the live connection still carries data. From a
/// listed balancer's own address the SYN goes on to the stack as before
/// (tuple_in_use).
#[test]
fn a_fleet_syn_on_a_live_sockets_tuple_is_dropped() {
    let ns = TestNetns::enter("fleet");
    ns.ip(&["link", "set", "lo", "up"]);
    for a in [FLEET_TUPLE, SERVER6] {
        ns.add_ipv6("lo", &format!("{a}/128"));
    }
    let skel = load();
    configure(&skel);
    trust_fleet(&skel);
    let listener = TcpListener::bind(sa(SERVER6, 0)).unwrap();
    let mut client = connect_from(FLEET_TUPLE, listener.local_addr().unwrap());
    let (mut served, _) = listener.accept().unwrap();
    add_service(&skel, listener.local_addr().unwrap().port(), 6, vip6());
    let p = PacketBuilder::tcp(client.local_addr().unwrap(), listener.local_addr().unwrap()).syn(1440).seq_no(77);
    let frame = p.clone().inband(&auth_tuple(&p, KEY_ID, &KEY, sa(CLIENT6, 9))).build();
    let key = conn_key_of(client.local_addr().unwrap(), listener.local_addr().unwrap().port(), 6);

    ingress(&skel, &frame, TC_ACT_SHOT, None, "a fleet's colliding SYN");
    assert_eq!(flows(&skel), 0, "nothing stored");
    assert_counters(&skel, &[(AgentCounter::FleetCollisions, 1)]);

    put(&skel.maps.balancers, &be_ip(FLEET_TUPLE.into()), &Balancer::default());
    ingress(&skel, &frame, TC_ACT_OK, Some(&p.build()), "a listed balancer's: to the stack, stripped");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), None);
    assert_counters(&skel, &[(AgentCounter::FleetCollisions, 1), (AgentCounter::TupleInUse, 1)]);

    use std::io::{Read, Write};
    client.write_all(b"still here").unwrap();
    let mut buf = [0u8; 10];
    served.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"still here");
}

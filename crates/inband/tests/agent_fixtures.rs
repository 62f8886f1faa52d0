//! BPF_PROG_TEST_RUN fixtures for bpf/agent.bpf.c: every branch of the tc
//! ingress and egress programs on frames built with `inband::packet` and
//! options built with `inband::wire`, and the connection accounting of the
//! tracepoint on real loopback TCP.
//!
//! Needs root (loading BPF, network namespaces). Route-dependent cases
//! (`bpf_fib_lookup`) and socket-dependent ones (`bpf_skc_lookup_tcp`) run
//! with the test thread moved into a namespace of its own: the test run
//! gives the packet that namespace's loopback device, so both helpers see
//! only the routes and sockets the test made.

use std::ffi::CString;
use std::fs::File;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use inband::agent::maps::{AgentCounter, ConnKey, DataPathConfig, DsrFlow, Service};
use inband::auth::AuthMode;
use inband::bpf::agent::{AgentSkel, AgentSkelBuilder};
use inband::packet::{mss_option, parse, Mac, PacketBuilder, ETH_HLEN, TCP_ACK, TCP_PSH, TCP_SYN};
use inband::pod::{be_addr, be_port, Pod};
use inband::wire::{Conn, InbandOption, Key};
use libbpf_rs::libbpf_sys;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{AsRawLibbpf, MapCore, MapFlags, MapMut, OpenObject, ProgramInput, ProgramMut};

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

fn lb() -> SocketAddrV4 {
    SocketAddrV4::new(LB, SNAT_PORT)
}
fn server() -> SocketAddrV4 {
    SocketAddrV4::new(SERVER, LOCAL_PORT)
}
fn vip() -> SocketAddrV4 {
    SocketAddrV4::new(VIP, VIP_PORT)
}
fn client() -> SocketAddrV4 {
    SocketAddrV4::new(CLIENT, CLIENT_PORT)
}
/// The connection as the balancer sends it to the server.
fn conn() -> Conn {
    Conn { lb: lb(), backend: server() }
}
fn conn_key() -> ConnKey {
    ConnKey { peer_addr: be_addr(LB), peer_port: be_port(SNAT_PORT), local_port: be_port(LOCAL_PORT) }
}
fn tuple_flow(client: Ipv4Addr) -> DsrFlow {
    DsrFlow { client_addr: be_addr(client), client_port: be_port(CLIENT_PORT), ..Default::default() }
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
fn auth_tuple(p: &PacketBuilder, key_id: u8, key: &Key, client: SocketAddrV4) -> Vec<u8> {
    InbandOption::auth_client_tuple(key, key_id, p.seq, Conn { lb: p.src, backend: p.dst }, client).encode()
}
fn seed_tuple(client: SocketAddrV4) -> Vec<u8> {
    InbandOption::ClientTuple(client).encode()
}
fn auth_request(nonce: [u8; 4]) -> Vec<u8> {
    InbandOption::auth_score_request(&KEY, KEY_ID, nonce, conn()).encode()
}
/// A client request toward the server, as the balancer forwards it.
fn request() -> PacketBuilder {
    PacketBuilder::tcp(lb(), server()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec())
}

/// Opens and loads the agent with pinning switched off, so a test run leaves
/// nothing under /sys/fs/bpf and never reuses a running agent's maps.
fn load(obj: &mut MaybeUninit<OpenObject>) -> AgentSkel<'_> {
    load_with(obj, false)
}

/// `requests`: the "requests" score source's per-packet accounting on.
fn load_with(obj: &mut MaybeUninit<OpenObject>, requests: bool) -> AgentSkel<'_> {
    let mut open = AgentSkelBuilder::default().open(obj).expect("open agent skeleton");
    for map in open.open_object_mut().maps_mut() {
        // SAFETY: a valid open map; a NULL path is libbpf's "do not pin".
        let rc = unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
        assert_eq!(rc, 0);
    }
    open.maps.rodata_data.as_mut().expect("rodata").score_requests = u8::from(requests);
    open.load().expect("load agent (verifier)")
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
    let svc = Service { vip_addr: be_addr(VIP), vip_port: be_port(VIP_PORT), pad: 0 };
    put(&skel.maps.services, &be_port(LOCAL_PORT), &svc);
    put(&skel.maps.balancers, &be_addr(LB), &1u8);
    set_keys(skel, &[(KEY_ID, KEY)]);
    set_mode(skel, AuthMode::Siphash, MTU);
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
    inband::auth::write_keys(&skel.maps.auth_keys, keys).expect("writing auth_keys");
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
    use inband::bpf::agent::types::__sk_buff;
    let mut ctx = vec![0u8; std::mem::size_of::<__sk_buff>()];
    let off = std::mem::offset_of!(__sk_buff, ifindex);
    ctx[off..off + 4].copy_from_slice(&ifindex.unwrap_or(0).to_ne_bytes());
    let mut out = vec![0u8; 1600];
    let input = ProgramInput {
        data_in: Some(frame),
        data_out: Some(&mut out),
        context_in: ifindex.map(|_| &mut ctx[..]),
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let plain = syn();
    let with_opt = plain.clone().ip_options(auth_tuple(&plain, KEY_ID, &KEY, client()));

    ingress(&skel, &with_opt.build(), TC_ACT_OK, Some(&plain.build()), "the stack sees the SYN as sent");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_stores_a_seed_client_tuple_in_mode_none() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let other = SocketAddrV4::new(VICTIM, 1);
    let mut forged = with_opt.clone().ip_options(auth_tuple(&with_opt, KEY_ID, &KEY, other)).build();
    *forged.last_mut().unwrap() ^= 0x10;
    ingress(&skel, &bad, TC_ACT_SHOT, None, "bad checksum in the last chunk");
    ingress(&skel, &forged, TC_ACT_SHOT, None, "bad checksum, another client");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1), (AgentCounter::BadChecksum, 2)]);
}

#[test]
fn ingress_drops_155_with_a_bad_checksum() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let victim = SocketAddrV4::new(VICTIM, CLIENT_PORT);
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
        Conn { lb: lb(), backend: SocketAddrV4::new(SERVER, LOCAL_PORT + 1) },
        victim,
    )
    .encode();
    let other_snat = InbandOption::auth_client_tuple(
        &KEY,
        KEY_ID,
        p.seq,
        Conn { lb: SocketAddrV4::new(LB, 2001), backend: server() },
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let victim = SocketAddrV4::new(VICTIM, CLIENT_PORT);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let stranger = PacketBuilder::tcp(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), SNAT_PORT), server()).syn(1452);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let tuple = auth_tuple(&syn(), KEY_ID, &KEY, client());
    let other_port = SocketAddrV4::new(SERVER, 9999);
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

// ---------------------------------------------------------------- ingress: 124

#[test]
fn ingress_marks_an_authenticated_score_request_and_strips_124() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
        Conn { lb: SocketAddrV4::new(LB, 2001), backend: server() },
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let other_conn = Conn { lb: SocketAddrV4::new(LB, SNAT_PORT + 1), backend: server() };
    let p = PacketBuilder::tcp(SocketAddrV4::new(LB, SNAT_PORT + 1), server()).flags(TCP_ACK);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    // Exactly the 125 the balancer checks (crates/inband/src/wire.rs).
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let flow = requested(DsrFlow::default(), KEY_ID, [1, 2, 3, 4]);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    // 28 bytes of options already: no room for a 16-byte 125 in 60 bytes.
    let full = PacketBuilder::tcp(server(), lb()).ip_options(vec![1; 28]).payload(b"x".to_vec()).build();
    let (ret, out) = run(&skel.progs.agent_egress, &full, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &full, "no room");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flow));
    assert_counters(&skel, &[(AgentCounter::AdjustFailed, 1)]);
}

#[test]
fn egress_leaves_other_traffic_untouched() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let flow = requested(DsrFlow::default(), KEY_ID, [1, 2, 3, 4]);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let other_peer = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), SNAT_PORT);
    let cases = [
        ("peer without an entry", PacketBuilder::tcp(server(), other_peer).build()),
        ("not from a service port", PacketBuilder::tcp(SocketAddrV4::new(SERVER, 9999), lb()).build()),
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

/// A network namespace owned by one test, entered by the test's thread; the
/// thread goes back and the namespace is deleted on drop, also on panic.
struct TestNetns {
    name: String,
    orig: File,
}

fn setns(fd: &File) {
    // SAFETY: a valid namespace fd; affects only the calling thread.
    let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl TestNetns {
    fn enter(tag: &str) -> TestNetns {
        let orig = File::open("/proc/thread-self/ns/net").unwrap();
        let name = format!("ibt-agent-{}-{tag}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        // From here on the guard exists, so a failure below still cleans up.
        let ns = TestNetns { name, orig };
        setns(&File::open(format!("/run/netns/{}", ns.name)).unwrap());
        ns
    }

    fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        // SAFETY: as in setns(); no assert here, this may run while unwinding.
        unsafe { libc::setns(self.orig.as_raw_fd(), libc::CLONE_NEWNET) };
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

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

fn syn_ack(src: SocketAddrV4, dst: SocketAddrV4, mss: u16) -> PacketBuilder {
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);

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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT_NO_NEIGH));
    let client = SocketAddrV4::new(CLIENT_NO_NEIGH, CLIENT_PORT);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT_UNROUTED));
    let input = syn_ack(server(), lb(), 1460).build();

    let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &input, "unchanged: the balancer NATs it back");
    assert_counters(&skel, &[(AgentCounter::NoRoute, 1)]);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let _link = skel.progs.agent_sock_state.attach().expect("attach tracepoint");
    // The tracepoint fires for every namespace: a port below the ephemeral
    // range that no other test serves keeps other hosts' sockets out.
    let port = 20_000 + (std::process::id() % 10_000) as u16;
    let listener = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
    put(&skel.maps.active_conns, &port, &0i64);
    let active = |skel: &AgentSkel| get::<_, i64>(&skel.maps.active_conns, &port).unwrap();

    // Graceful close, client first: the server's socket stays active in
    // CLOSE_WAIT and stops counting when it closes too.
    let client = TcpStream::connect(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
    let (served, _) = listener.accept().unwrap();
    wait_for("1 active connection", || active(&skel) == 1);
    let key = ConnKey {
        peer_addr: be_addr(Ipv4Addr::LOCALHOST),
        peer_port: be_port(client.local_addr().unwrap().port()),
        local_port: be_port(port),
    };
    put(&skel.maps.dsr_flows, &key, &tuple_flow(CLIENT));
    let unrelated = ConnKey { peer_port: be_port(1), ..key };
    put(&skel.maps.dsr_flows, &unrelated, &tuple_flow(CLIENT));
    drop(client);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(active(&skel), 1, "CLOSE_WAIT still counts");
    assert!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key).is_some());
    drop(served);
    wait_for("the flow entry deleted", || get::<_, DsrFlow>(&skel.maps.dsr_flows, &key).is_none());
    wait_for("0 active connections", || active(&skel) == 0);
    assert!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &unrelated).is_some(), "only the closed connection's entry goes");

    // Reset by the server: ESTABLISHED straight to CLOSE.
    let client = TcpStream::connect(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
    let (served, _) = listener.accept().unwrap();
    wait_for("1 active connection", || active(&skel) == 1);
    set_linger_zero(&served);
    drop(served);
    wait_for("0 active connections after a reset", || active(&skel) == 0);
    drop(client);
    drop(listener);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(active(&skel), 0);
    assert_counters(&skel, &[(AgentCounter::FlowsClosed, 1)]);
}

#[test]
fn egress_dsr_with_forwarding_off_lets_the_kernel_route() {
    // Routes and neighbour in place, but the device does not forward, so
    // bpf_fib_lookup refuses: the rewritten response goes to
    // bpf_redirect_neigh without a next hop, which routes it itself.
    let ns = TestNetns::enter("nofwd");
    let ifindex = server_routes(&ns, false);
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let input = syn_ack(server(), lb(), 1460).build();

    let (ret, out) = run(&skel.progs.agent_egress, &input, Some(ifindex));
    assert_eq!(ret, TC_ACT_REDIRECT);
    let p = parse(&out).unwrap();
    assert_eq!((p.src, p.dst), (vip(), SocketAddrV4::new(CLIENT, CLIENT_PORT)));
    assert!(p.checksums_ok);
    assert_eq!(p.mss(), Some(1444));
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1), (AgentCounter::MssClamped, 1)]);
}

#[test]
fn requests_score_counts_connections_with_a_request_in_flight() {
    let mut obj = MaybeUninit::uninit();
    let skel = load_with(&mut obj, true);
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
        PacketBuilder::tcp(SocketAddrV4::new(LB, SNAT_PORT + 1), server()).flags(TCP_ACK).payload(b"GET".to_vec());
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
        PacketBuilder::tcp(lb(), SocketAddrV4::new(SERVER, 9999)).flags(TCP_ACK).payload(b"x".to_vec()).build();
    run(&skel.progs.agent_ingress, &unserved, None);
    assert_eq!(inflight(&skel), 1);
}

#[test]
fn egress_defers_a_125_that_would_exceed_the_mtu() {
    let ns = TestNetns::enter("mtu");
    let ifindex = server_routes(&ns, true);
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &5i64);
    let nonce = [7, 7, 7, 7];
    let flow = requested(tuple_flow(CLIENT), KEY_ID, nonce);
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let full = |src, dst, macs: (Mac, Mac)| {
        PacketBuilder::tcp(src, dst).flags(TCP_ACK | TCP_PSH).payload(vec![0x42; 1460]).macs(macs.0, macs.1)
    };
    let to_lb = (SERVER_MAC, [0x02, 0, 0, 0, 0xcc, 0x01]);
    let segment = full(server(), lb(), to_lb);
    let ip_len = segment.build_ip().len() as u16; // 1500: exactly the MTU

    // A full-sized segment has no room for 16 more bytes: it goes direct
    // as if no score were asked, and the request waits.
    let (ret, out) = run(&skel.progs.agent_egress, &segment.build(), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &full(vip(), client(), (SERVER_MAC, GATEWAY_MAC)).build(), "DSR, no option");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(flow), "flag kept");
    assert_counters(&skel, &[(AgentCounter::ScoreDeferredMtu, 1), (AgentCounter::DsrRewrites, 1)]);

    // The smaller packet that follows (an ACK) carries it. One that ends
    // exactly at the MTU with the option still fits.
    set_mode(&skel, AuthMode::Siphash, ip_len);
    let ack = PacketBuilder::tcp(server(), lb()).flags(TCP_ACK).payload(vec![0x42; 1500 - 40 - 16]);
    let (ret, out) = run(&skel.progs.agent_egress, &ack.build(), Some(ifindex));
    assert_eq!(ret, TC_ACT_OK);
    let want = ack.ip_options(InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(), 5).encode()).build();
    assert_frame(&out, &want, "125 toward the balancer");
    assert_eq!(parse(&out).unwrap().payload.len() + 40 + 16, usize::from(ip_len));
    let answered = DsrFlow { score_requested: 0, ..flow };
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(answered));
    assert_counters(
        &skel,
        &[(AgentCounter::ScoreDeferredMtu, 1), (AgentCounter::DsrRewrites, 1), (AgentCounter::ScoresSent, 1)],
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
        let listener = TcpListener::bind(SocketAddrV4::new(LIVE_SERVER, 0)).unwrap();
        let client = connect_from(LIVE_LB, listener.local_addr().unwrap());
        let (served, _) = listener.accept().unwrap();
        let svc = Service { vip_addr: be_addr(VIP), vip_port: be_port(VIP_PORT), pad: 0 };
        put(&skel.maps.services, &be_port(listener.local_addr().unwrap().port()), &svc);
        put(&skel.maps.balancers, &be_addr(LIVE_LB), &1u8);
        LiveConn { listener, client, served }
    }

    fn v4(a: std::net::SocketAddr) -> SocketAddrV4 {
        match a {
            std::net::SocketAddr::V4(a) => a,
            std::net::SocketAddr::V6(_) => unreachable!("IPv4 sockets"),
        }
    }

    /// The balancer side of the connection, and the server side.
    fn lb(&self) -> SocketAddrV4 {
        Self::v4(self.client.local_addr().unwrap())
    }
    fn server(&self) -> SocketAddrV4 {
        Self::v4(self.listener.local_addr().unwrap())
    }
    fn key(&self) -> ConnKey {
        ConnKey {
            peer_addr: be_addr(*self.lb().ip()),
            peer_port: be_port(self.lb().port()),
            local_port: be_port(self.server().port()),
        }
    }
    /// A SYN on the connection's tuple.
    fn syn(&self) -> PacketBuilder {
        PacketBuilder::tcp(self.lb(), self.server()).syn(1452).seq_no(77)
    }
}

fn connect_from(local: Ipv4Addr, to: std::net::SocketAddr) -> TcpStream {
    // SAFETY: plain socket calls on an fd this function owns until it is
    // handed to TcpStream.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let sin = |a: Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.octets()) },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let me = sin(local, 0);
        assert_eq!(libc::bind(fd, (&me as *const libc::sockaddr_in).cast(), len), 0);
        let std::net::SocketAddr::V4(to) = to else { unreachable!() };
        let peer = sin(*to.ip(), to.port());
        assert_eq!(libc::connect(fd, (&peer as *const libc::sockaddr_in).cast(), len), 0);
        std::os::fd::FromRawFd::from_raw_fd(fd)
    }
}

#[test]
fn ingress_forged_155_cannot_take_over_a_live_connection() {
    // Seed format: anyone who can send from the balancer's address can
    // write any 155; the live socket is what protects the connection.
    let ns = TestNetns::enter("live");
    ns.ip(&["link", "set", "lo", "up"]);
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure_seed(&skel);
    let live = LiveConn::open(&skel);
    let owner = DsrFlow { client_addr: be_addr(CLIENT), client_port: be_port(CLIENT_PORT), ..Default::default() };
    put(&skel.maps.dsr_flows, &live.key(), &owner);

    // The reflection/hijack attempt: a SYN on the live tuple naming a victim.
    let p = live.syn();
    let forged = p.clone().ip_options(seed_tuple(SocketAddrV4::new(VICTIM, 9))).build();
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
    let frame = p.clone().ip_options(seed_tuple(SocketAddrV4::new(CLIENT, CLIENT_PORT))).build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&p.build()), "new connection");
    let key = ConnKey {
        peer_addr: be_addr(LIVE_LB),
        peer_port: be_port(p.src.port()),
        local_port: be_port(listener.local_addr().unwrap().port()),
    };
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &key), Some(owner));
    assert_counters(&skel, &[(AgentCounter::TupleInUse, 2), (AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_replayed_authenticated_155_cannot_take_over_a_live_connection() {
    // Authenticated format: a genuine 155 of an earlier connection on the
    // same SNAT port, replayed on a SYN with its sequence number.
    let ns = TestNetns::enter("replay");
    ns.ip(&["link", "set", "lo", "up"]);
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let live = LiveConn::open(&skel);
    put(&skel.maps.dsr_flows, &live.key(), &tuple_flow(CLIENT));
    let p = live.syn();
    let old = auth_tuple(&p, KEY_ID, &KEY, SocketAddrV4::new(VICTIM, 9));
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let flooded = tuple_flow(VICTIM);
    put(&skel.maps.dsr_flows, &conn_key(), &flooded);

    // Packets that leave the entry alone: not a SYN, not from a balancer,
    // a SYN-ACK.
    let stranger = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), SNAT_PORT);
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
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let live = LiveConn::open(&skel);
    put(&skel.maps.dsr_flows, &live.key(), &tuple_flow(CLIENT));
    let frame = live.syn().build();
    ingress(&skel, &frame, TC_ACT_OK, Some(&frame), "passed: the stack answers with a challenge ACK");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &live.key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[]);
    drop(live);
}

fn bpf_delete(skel: &AgentSkel, key: &ConnKey) {
    skel.maps.dsr_flows.delete(key.as_bytes()).expect("map delete");
}

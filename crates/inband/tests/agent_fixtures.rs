//! BPF_PROG_TEST_RUN fixtures for bpf/agent.bpf.c: every branch of the tc
//! ingress and egress programs on frames built with `inband::packet`, and the
//! connection accounting of the tracepoint on real loopback TCP.
//!
//! Needs root (loading BPF, network namespaces). Route-dependent cases
//! (`bpf_fib_lookup`) run with the test thread moved into a namespace of its
//! own, so the lookup sees only the routes the test made.

use std::ffi::CString;
use std::fs::File;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use inband::agent::maps::{AgentCounter, ConnKey, DsrFlow, Service};
use inband::bpf::agent::{AgentSkel, AgentSkelBuilder};
use inband::packet::{mss_option, parse, Mac, PacketBuilder, ETH_HLEN, TCP_ACK, TCP_PSH, TCP_SYN};
use inband::pod::{be_addr, be_port, Pod};
use inband::wire::InbandOption;
use libbpf_rs::libbpf_sys;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{AsRawLibbpf, MapCore, MapFlags, MapMut, OpenObject, ProgramInput, ProgramMut};

const TC_ACT_OK: u32 = 0;
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
const CLIENT_PORT: u16 = 40000;

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
fn tuple_option(client: SocketAddrV4) -> Vec<u8> {
    let mut o = vec![155, 8];
    o.extend_from_slice(&client.ip().octets());
    o.extend_from_slice(&client.port().to_be_bytes());
    o
}
fn conn_key() -> ConnKey {
    ConnKey { peer_addr: be_addr(LB), peer_port: be_port(SNAT_PORT), local_port: be_port(LOCAL_PORT) }
}
fn tuple_flow(client: Ipv4Addr) -> DsrFlow {
    DsrFlow { client_addr: be_addr(client), client_port: be_port(CLIENT_PORT), score_requested: 0, pad: 0 }
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

/// A server agent for LOCAL_PORT serving VIP:VIP_PORT, trusting LB.
fn configure(skel: &AgentSkel) {
    let svc = Service { vip_addr: be_addr(VIP), vip_port: be_port(VIP_PORT), pad: 0 };
    put(&skel.maps.services, &be_port(LOCAL_PORT), &svc);
    put(&skel.maps.balancers, &be_addr(LB), &1u8);
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
fn assert_counters(skel: &AgentSkel, expected: &[(AgentCounter, u64)]) {
    let want: Vec<(AgentCounter, u64)> = AgentCounter::ALL
        .iter()
        .map(|&c| (c, expected.iter().find(|(e, _)| *e == c).map_or(0, |(_, n)| *n)))
        .collect();
    assert_eq!(counters(skel), want);
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

// ---------------------------------------------------------------- ingress

#[test]
fn ingress_stores_client_tuple_and_strips_155() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);
    let plain = PacketBuilder::tcp(lb(), server()).syn(1452);
    let with_opt = plain.clone().ip_options(tuple_option(client));

    let (ret, out) = run(&skel.progs.agent_ingress, &with_opt.build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &plain.build(), "the server's stack sees the packet as sent without the option");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_marks_score_request_and_strips_124() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &tuple_flow(CLIENT));
    let plain = PacketBuilder::tcp(lb(), server()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec());
    let with_opt = plain.clone().ip_options(vec![124, 4, 0, 0]);

    let (ret, out) = run(&skel.progs.agent_ingress, &with_opt.build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &plain.build(), "stripped");
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(flow, DsrFlow { score_requested: 1, ..tuple_flow(CLIENT) }, "the tuple is kept, the flag set");
    assert_counters(&skel, &[(AgentCounter::ProbesSeen, 1)]);
}

#[test]
fn ingress_124_without_tuple_creates_a_score_only_entry() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let plain = PacketBuilder::tcp(lb(), server()).payload(b"x".to_vec());
    let (ret, out) = run(&skel.progs.agent_ingress, &plain.clone().ip_options(vec![124, 4, 0, 0]).build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &plain.build(), "stripped");
    let flow: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(flow, DsrFlow { client_addr: 0, client_port: 0, score_requested: 1, pad: 0 });
    assert_counters(&skel, &[(AgentCounter::ProbesSeen, 1)]);
}

#[test]
fn ingress_strips_only_the_first_option_and_keeps_the_rest() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);
    // A 155 followed by a (made-up, 4-byte) option the agent does not own.
    let other = vec![0x88, 4, 0xab, 0xcd];
    let mut opts = tuple_option(client);
    opts.extend_from_slice(&other);
    let p = PacketBuilder::tcp(lb(), server()).syn(1452);
    let (ret, out) = run(&skel.progs.agent_ingress, &p.clone().ip_options(opts).build(), None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &p.ip_options(other).build(), "only the 155 removed");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(tuple_flow(CLIENT)));
    assert_counters(&skel, &[(AgentCounter::TuplesStored, 1)]);
}

#[test]
fn ingress_untrusted_source_is_untouched_and_counted() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let stranger = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), SNAT_PORT);
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);
    for opt in [tuple_option(client), vec![124, 4, 0, 0]] {
        let frame = PacketBuilder::tcp(stranger, server()).syn(1452).ip_options(opt).build();
        let (ret, out) = run(&skel.progs.agent_ingress, &frame, None);
        assert_eq!(ret, TC_ACT_OK);
        assert_frame(&out, &frame, "untrusted");
    }
    assert_eq!(skel.maps.dsr_flows.keys().count(), 0, "nothing stored for a non-balancer");
    assert_counters(&skel, &[(AgentCounter::UntrustedOption, 2)]);
}

#[test]
fn ingress_malformed_ipv4_is_untouched_and_counted() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);
    let good = PacketBuilder::tcp(lb(), server()).syn(1452).ip_options(tuple_option(client)).build();
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
        ("155 overruns the header", vec![155, 8, 1, 2]),
        ("another option overruns the header", vec![0x88, 12, 1, 2, 3, 4, 5, 6]),
        ("155 with a length other than 8", vec![155, 6, 1, 2, 3, 4, 0, 0]),
        ("124 with a length other than 4", vec![124, 8, 0, 0, 0, 0, 0, 0]),
    ] {
        cases.push((name, PacketBuilder::tcp(lb(), server()).syn(1452).ip_options(opts).build()));
    }
    let n = cases.len() as u64;
    for (name, frame) in cases {
        let (ret, out) = run(&skel.progs.agent_ingress, &frame, None);
        assert_eq!(ret, TC_ACT_OK, "{name}");
        assert_frame(&out, &frame, name);
    }
    assert_eq!(skel.maps.dsr_flows.keys().count(), 0);
    assert_counters(&skel, &[(AgentCounter::Malformed, n)]);
}

#[test]
fn ingress_leaves_everything_else_untouched() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    let client = SocketAddrV4::new(CLIENT, CLIENT_PORT);
    let other_port = SocketAddrV4::new(SERVER, 9999);
    let cases = [
        ("no options", PacketBuilder::tcp(lb(), server()).syn(1460).build()),
        ("not a service port", PacketBuilder::tcp(lb(), other_port).syn(1452).ip_options(tuple_option(client)).build()),
        ("UDP", PacketBuilder::udp(lb(), server()).ip_options(tuple_option(client)).payload(b"q".to_vec()).build()),
        ("another option first", PacketBuilder::tcp(lb(), server()).ip_options(vec![0x88, 4, 0, 0]).build()),
        (
            "NOP before the 155",
            PacketBuilder::tcp(lb(), server()).ip_options(vec![1, 1, 1, 1, 155, 8, 1, 2, 3, 4, 5, 6]).build(),
        ),
        ("score from a server", PacketBuilder::tcp(lb(), server()).ip_options(vec![125, 4, 0, 9]).build()),
        ("fragment", PacketBuilder::tcp(lb(), server()).frag(0x2000).ip_options(tuple_option(client)).build()),
        ("server's own response", PacketBuilder::tcp(server(), lb()).ip_options(tuple_option(client)).build()),
    ];
    for (name, frame) in cases {
        let (ret, out) = run(&skel.progs.agent_ingress, &frame, None);
        assert_eq!(ret, TC_ACT_OK, "{name}");
        assert_frame(&out, &frame, name);
    }
    let mut not_ipv4 = PacketBuilder::tcp(lb(), server()).ip_options(tuple_option(client)).build();
    not_ipv4[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    let (ret, out) = run(&skel.progs.agent_ingress, &not_ipv4, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &not_ipv4, "ARP ethertype");
    assert_eq!(skel.maps.dsr_flows.keys().count(), 0);
    assert_counters(&skel, &[]);
}

// ---------------------------------------------------------------- egress: scores

fn score_flow() -> DsrFlow {
    DsrFlow { client_addr: 0, client_port: 0, score_requested: 1, pad: 0 }
}

/// Runs one response through egress with a score requested; returns the frame.
fn answer(skel: &AgentSkel, flow: DsrFlow) -> Vec<u8> {
    put(&skel.maps.dsr_flows, &conn_key(), &flow);
    let resp = PacketBuilder::tcp(server(), lb()).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n".to_vec());
    let (ret, out) = run(&skel.progs.agent_egress, &resp.build(), None);
    assert_eq!(ret, TC_ACT_OK);
    let got: DsrFlow = get(&skel.maps.dsr_flows, &conn_key()).unwrap();
    assert_eq!(got, DsrFlow { score_requested: 0, ..flow }, "flag cleared, tuple kept");
    out
}

fn with_score(score: u16) -> Vec<u8> {
    let s = score.to_be_bytes();
    PacketBuilder::tcp(server(), lb())
        .flags(TCP_ACK | TCP_PSH)
        .payload(b"HTTP/1.1 200 OK\r\n\r\n".to_vec())
        .ip_options(vec![125, 4, s[0], s[1]])
        .build()
}

#[test]
fn egress_answers_a_score_request_with_active_connections() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    // A tuple is present: the 125 still goes to the balancer, not via DSR.
    assert_frame(&answer(&skel, DsrFlow { score_requested: 1, ..tuple_flow(CLIENT) }), &with_score(3), "score 3");
    put(&skel.maps.active_conns, &LOCAL_PORT, &300_000i64);
    assert_frame(&answer(&skel, score_flow()), &with_score(65535), "saturated");
    put(&skel.maps.active_conns, &LOCAL_PORT, &-2i64);
    assert_frame(&answer(&skel, score_flow()), &with_score(0), "a negative count reads as idle");
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 3)]);

    // With the flag cleared the next response passes untouched.
    let resp = PacketBuilder::tcp(server(), lb()).payload(b"more".to_vec()).build();
    let (ret, out) = run(&skel.progs.agent_egress, &resp, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &resp, "no score requested");
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 3)]);
}

#[test]
fn egress_score_override_wins_over_active_connections() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.active_conns, &LOCAL_PORT, &3i64);
    put(&skel.maps.score_override, &LOCAL_PORT, &42u32);
    assert_frame(&answer(&skel, score_flow()), &with_score(42), "override");
    put(&skel.maps.score_override, &LOCAL_PORT, &70_000u32);
    assert_frame(&answer(&skel, score_flow()), &with_score(65535), "saturated");
    assert_counters(&skel, &[(AgentCounter::ScoresSent, 2)]);
}

#[test]
fn egress_without_room_for_the_option_keeps_the_request() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &score_flow());
    // 40 bytes of options already: IHL 15, no room for a 125.
    let full = PacketBuilder::tcp(server(), lb()).ip_options(vec![1; 40]).payload(b"x".to_vec()).build();
    let (ret, out) = run(&skel.progs.agent_egress, &full, None);
    assert_eq!(ret, TC_ACT_OK);
    assert_frame(&out, &full, "no room");
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(score_flow()));
    assert_counters(&skel, &[(AgentCounter::AdjustFailed, 1)]);
}

#[test]
fn egress_leaves_other_traffic_untouched() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    configure(&skel);
    put(&skel.maps.dsr_flows, &conn_key(), &score_flow());
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
    assert_eq!(get::<_, DsrFlow>(&skel.maps.dsr_flows, &conn_key()), Some(score_flow()));
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
    assert_eq!(p.mss(), Some(1452), "MSS clamped by 8");
    assert_eq!(p.tcp_flags, TCP_SYN | TCP_ACK);
    assert!(p.ip_options.is_empty());
    // Byte-exact: the frame as if the server had sent it from the VIP.
    let expected = syn_ack(vip(), client, 1452).macs(SERVER_MAC, GATEWAY_MAC).build();
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
    let expected = syn_ack(vip(), client, 1452).build();
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
    assert_eq!(p.mss(), Some(1452));
    assert_counters(&skel, &[(AgentCounter::DsrRewrites, 1), (AgentCounter::MssClamped, 1)]);
}

#[test]
fn requests_score_counts_connections_with_a_request_in_flight() {
    let mut obj = MaybeUninit::uninit();
    let skel = load_with(&mut obj, true);
    configure(&skel);
    put(&skel.maps.inflight, &LOCAL_PORT, &0i64);
    let inflight = |skel: &AgentSkel| get::<_, i64>(&skel.maps.inflight, &LOCAL_PORT).unwrap();
    let request = || PacketBuilder::tcp(lb(), server()).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n".to_vec());
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
    let other = PacketBuilder::tcp(SocketAddrV4::new(LB, SNAT_PORT + 1), server()).flags(TCP_ACK).payload(b"GET".to_vec());
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
    let unserved = PacketBuilder::tcp(lb(), SocketAddrV4::new(SERVER, 9999)).flags(TCP_ACK).payload(b"x".to_vec()).build();
    run(&skel.progs.agent_ingress, &unserved, None);
    assert_eq!(inflight(&skel), 1);
}

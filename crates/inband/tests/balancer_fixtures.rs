//! BPF_PROG_TEST_RUN fixtures for bpf/balancer.bpf.c (and the bounce floor):
//! every branch of the "Balancer packet walk" and the "Flow lifecycle" in
//! docs/architecture.md, on frames built with `inband_testkit::packet` and options
//! built with `inband_core::wire`. Each test loads its own private instance of
//! the program (nothing pinned) and fills the maps directly, then asserts
//! the verdict, the exact output bytes, the map state and the counters.
//!
//! Needs root (loading BPF). probe_count is read back per CPU, so every
//! fixture pins its test thread to one CPU. Time is moved by
//! writing timestamps into the past, never by sleeping.

use std::mem::MaybeUninit;
use std::sync::Mutex;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use inband_testkit::bpf::bounce::BounceSkelBuilder;
use inband_core::shared as c;
use inband_lb::maps::*;
use inband_lb::private::{PrivateBalancer, XDP_DROP, XDP_PASS, XDP_TX};
use inband_lb::tables::ktime_ns;
use inband_testkit::packet::{
    checksum, mss_option, parse, Mac, PacketBuilder, ETH_HLEN, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS, IPPROTO_TCP, IPPROTO_UDP,
    TCP_ACK, TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN,
};
use inband_core::pod::{be_ip, be_port, port_of, Pod};
use inband_core::wire::{parse_doh, Conn, InbandOption, Key};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject, ProgramInput};

mod frames;
use frames::{cut6, ext, ipip, opts_header, routing, srv6, srv6_then, IPPROTO_ROUTING};

const LB_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 10);
const LB6_ADDR: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10);
/// The balancer interface's MAC: the destination of every frame it receives.
const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x0b];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0xc1];
const VIP_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);
const VIP6_ADDR: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x100);
const VIP_PORT: u16 = 80;
/// Not 0, so a program that confuses VIP ids with slots or indexes shows it.
const VIP_ID: u32 = 3;
const SYN_MSS: u16 = 1460;
const MTU: u16 = 1500;
/// A small prime table: the fixtures write it whole.
const MAGLEV_SIZE: u32 = 251;
/// The Maglev table the fixtures hand their VIP: neither 0 nor VIP_ID, so a
/// program that reads the table by VIP id shows it.
const MAGLEV_TABLE: u32 = 5;
const KEY: Key = Key(*b"fixture-key-0001");
const KEY_ID: u8 = 7;
const SEC: u64 = 1_000_000_000;
/// The fixtures' per-VIP timeouts.
const SYN_TIMEOUT: u64 = 5 * SEC;
// Short enough that `age` can date a packet before it on a machine booted
// minutes ago (a fresh CI machine): CLOCK_MONOTONIC starts at boot.
const IDLE_TIMEOUT: u64 = 60 * SEC;
const CLOSING_TIMEOUT: u64 = 10 * SEC;

fn sa4(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}
fn v4_of(a: SocketAddr) -> Ipv4Addr {
    match a.ip() {
        IpAddr::V4(a) => a,
        IpAddr::V6(a) => panic!("{a} is not IPv4"),
    }
}
fn vip() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(VIP_ADDR), VIP_PORT)
}
fn vip6() -> SocketAddr {
    SocketAddr::new(IpAddr::V6(VIP6_ADDR), VIP_PORT)
}
/// The VIP of `c`'s family.
fn vip_for(c: SocketAddr) -> SocketAddr {
    if c.is_ipv4() {
        vip()
    } else {
        vip6()
    }
}
fn lb_addr(v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(LB_ADDR)
    } else {
        IpAddr::V6(LB6_ADDR)
    }
}
fn client(n: u8) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, 1, n)), 40000 + u16::from(n))
}
fn client6(n: u8) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 1, u16::from(n))), 40000 + u16::from(n))
}

/// Backend `i` of the test VIP. Ids are not slot numbers, on purpose.
#[derive(Clone, Copy, Debug, PartialEq)]
struct B {
    id: u32,
    addr: SocketAddr,
    mac: Mac,
}
fn backend(i: u8) -> B {
    B {
        id: 10 + u32::from(i),
        addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 1, i + 1)), 8080 + u16::from(i)),
        mac: [0x02, 0, 0, 0, 0x01, i + 1],
    }
}
/// Backend `i` of the IPv6 VIP (fixtures that use it make it the VIP's).
fn backend6(i: u8) -> B {
    B {
        id: 40 + u32::from(i),
        addr: SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 1, 0, 0, 0, 0, u16::from(i) + 1)), 8080 + u16::from(i)),
        mac: [0x02, 0, 0, 0, 0x06, i + 1],
    }
}

/// A client's SYN to the VIP of its family, as Linux sends it (MSS option first).
fn syn(c: SocketAddr) -> PacketBuilder {
    PacketBuilder::tcp(c, vip_for(c)).macs(CLIENT_MAC, LB_MAC).syn(SYN_MSS)
}
/// The client's ACK that completes the handshake.
fn ack(c: SocketAddr) -> PacketBuilder {
    PacketBuilder::tcp(c, vip_for(c)).macs(CLIENT_MAC, LB_MAC).flags(TCP_ACK).seq_no(1001)
}
/// A client's data segment on an established connection.
fn data(c: SocketAddr) -> PacketBuilder {
    PacketBuilder::tcp(c, vip_for(c)).macs(CLIENT_MAC, LB_MAC).flags(TCP_ACK | TCP_PSH).seq_no(1001).payload(b"GET / HTTP/1.1\r\n\r\n")
}
/// A backend's segment back to the balancer's SNAT port.
fn reply(b: &B, snat_port: u16) -> PacketBuilder {
    PacketBuilder::tcp(b.addr, SocketAddr::new(lb_addr(b.addr.is_ipv4()), snat_port))
        .macs(b.mac, LB_MAC)
        .flags(TCP_ACK | TCP_PSH)
        .payload(b"HTTP/1.1 200 OK\r\n\r\n")
}

fn conn(b: &B, snat_port: u16) -> Conn {
    Conn::tcp(SocketAddr::new(lb_addr(b.addr.is_ipv4()), snat_port), b.addr)
}
/// The authenticated 155 the balancer must put on `syn` toward `b`.
fn tuple_option(syn: &PacketBuilder, b: &B, snat_port: u16) -> Vec<u8> {
    InbandOption::auth_client_tuple(&KEY, KEY_ID, syn.seq, conn(b, snat_port), syn.src).encode()
}

/// What the balancer must send toward `b` for the client packet `p`: NATed,
/// one hop older, with `ip_options`.
fn forwarded(p: &PacketBuilder, b: &B, snat_port: u16, ip_options: Vec<u8>) -> Vec<u8> {
    let mut e = p.clone();
    e.src = SocketAddr::new(lb_addr(b.addr.is_ipv4()), snat_port);
    e.dst = b.addr;
    e.src_mac = LB_MAC;
    e.dst_mac = b.mac;
    e.ttl -= 1;
    e.ip_options = ip_options;
    e.build()
}
/// ... with an inband option where its family carries it.
fn forwarded_with(p: &PacketBuilder, b: &B, snat_port: u16, option: &[u8]) -> Vec<u8> {
    let mut e = p.clone().inband(option);
    e.src = SocketAddr::new(lb_addr(b.addr.is_ipv4()), snat_port);
    e.dst = b.addr;
    e.src_mac = LB_MAC;
    e.dst_mac = b.mac;
    e.ttl -= 1;
    e.build()
}
/// A SYN forwarded in a DSR mode: the MSS lowered by 16 (IPv6: 24), option 155.
fn forwarded_dsr_syn(p: &PacketBuilder, b: &B, snat_port: u16) -> Vec<u8> {
    let mut clamped = p.clone();
    let by = if p.is_ipv4() { 16 } else { 24 };
    clamped.tcp_options = mss_option(SYN_MSS - by).to_vec();
    forwarded_with(&clamped, b, snat_port, &tuple_option(p, b, snat_port))
}
/// What the balancer must send to the client for the backend packet `p`.
fn returned(p: &PacketBuilder, c: SocketAddr, ip_options: Vec<u8>) -> Vec<u8> {
    let mut e = p.clone();
    e.src = vip_for(c);
    e.dst = c;
    e.src_mac = LB_MAC;
    e.dst_mac = CLIENT_MAC;
    e.ttl -= 1;
    e.ip_options = ip_options;
    e.build()
}

/// Keeps the per-CPU maps the program reads back (probe_count) on one CPU
/// across the test's runs.
fn pin_thread_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t is valid; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
    }
}

fn put<K: Pod, V: Pod>(map: &dyn MapCore, k: &K, v: &V) {
    map.update(k.as_bytes(), v.as_bytes(), MapFlags::ANY).expect("map update");
}
fn get<K: Pod, V: Pod>(map: &dyn MapCore, k: &K) -> Option<V> {
    map.lookup(k.as_bytes(), MapFlags::ANY).expect("map lookup").map(|b| V::from_bytes(&b))
}
fn del<K: Pod>(map: &dyn MapCore, k: &K) {
    map.delete(k.as_bytes()).expect("map delete");
}

/// The client side of `c`'s TCP connection to the VIP of its family.
fn flow_key(c: SocketAddr) -> FlowKey {
    flow_key_to(c, vip_for(c), IPPROTO_TCP)
}
fn flow_key_to(c: SocketAddr, vip: SocketAddr, proto: u8) -> FlowKey {
    FlowKey {
        client_addr: be_ip(c.ip()),
        vip_addr: be_ip(vip.ip()),
        client_port: be_port(c.port()),
        vip_port: be_port(vip.port()),
        proto,
        pad: [0; 3],
    }
}
fn nat_key(b: &B, snat_port: u16) -> NatKey {
    nat_key_proto(b, snat_port, IPPROTO_TCP)
}
fn nat_key_proto(b: &B, snat_port: u16, proto: u8) -> NatKey {
    NatKey {
        backend_addr: be_ip(b.addr.ip()),
        backend_port: be_port(b.addr.port()),
        snat_port: be_port(snat_port),
        proto,
        ..Default::default()
    }
}

struct Fixture {
    lb: &'static PrivateBalancer<'static>,
}

/// Loaded balancers no test holds. A fixture takes one and resets its maps
/// rather than loading its own: the verifier was most of this binary's
/// time, 135 times over.
static IDLE: Mutex<Vec<Pooled>> = Mutex::new(Vec::new());

struct Pooled(&'static PrivateBalancer<'static>);
// SAFETY: a pooled balancer is used by one test at a time, and the
// skeleton's libbpf objects (descriptors and heap memory) belong to no thread.
unsafe impl Send for Pooled {}

impl Drop for Fixture {
    fn drop(&mut self) {
        // A failed test's balancer is not reused: whatever went wrong stays with it.
        if !std::thread::panicking() {
            IDLE.lock().unwrap().push(Pooled(self.lb));
        }
    }
}

/// What `Fixture::lb_vip` sets up.
struct Spec {
    mode: Mode,
    policy: Policy,
    n: u8,
    auth: u32,
    v6: bool,
    proto: u8,
    quic: bool,
}

impl Default for Spec {
    fn default() -> Spec {
        Spec {
            mode: Mode::DsrRr,
            policy: Policy::RoundRobin,
            n: 1,
            auth: c::INBAND_AUTH_SIPHASH,
            v6: false,
            proto: IPPROTO_TCP,
            quic: false,
        }
    }
}

impl Fixture {
    /// A loaded balancer with authenticated options, its self address set
    /// and no VIP.
    fn new() -> Fixture {
        Fixture::with_auth(c::INBAND_AUTH_SIPHASH)
    }

    fn with_auth(auth: u32) -> Fixture {
        let cfg = DataPathConfig {
            self4: be_ip(LB_ADDR.into()),
            self6: be_ip(LB6_ADDR.into()),
            mtu: MTU,
            auth_mode: auth as u8,
            sign_key: KEY_ID,
            maglev_size: MAGLEV_SIZE,
            snat_key: [1, 2],
            ..Default::default()
        };
        let pooled = IDLE.lock().unwrap().pop();
        let lb = match pooled {
            Some(Pooled(lb)) => {
                lb.reset(&cfg).expect("reset a pooled balancer");
                lb
            }
            None => {
                // The skeleton borrows its object storage for as long as it
                // lives, which for a pooled balancer is the process's life.
                let storage: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
                &*Box::leak(Box::new(PrivateBalancer::load(storage, 262_144, &cfg).expect("load balancer")))
            }
        };
        // Pinned after the load: the verifier, most of a fixture's time,
        // then runs on any CPU rather than every test's on CPU 0.
        pin_thread_to_cpu0();
        inband_core::auth::write_keys(&lb.skel.maps.auth_keys, &[(KEY_ID, KEY)]).unwrap();
        Fixture { lb }
    }

    /// One VIP with `n` ACTIVE backends (`backend(0..n)`, slot i = backend i).
    fn lb_with(mode: Mode, policy: Policy, n: u8) -> Fixture {
        Fixture::lb_auth(mode, policy, n, c::INBAND_AUTH_SIPHASH)
    }

    fn lb_auth(mode: Mode, policy: Policy, n: u8, auth: u32) -> Fixture {
        Fixture::lb_vip(Spec { mode, policy, n, auth, ..Spec::default() })
    }

    /// One VIP as `spec` says (VIP_ID, slot i = backend i of its family).
    fn lb_vip(spec: Spec) -> Fixture {
        let fx = Fixture::with_auth(spec.auth);
        let of = |i| if spec.v6 { backend6(i) } else { backend(i) };
        let slots: Vec<u32> = (0..spec.n).map(|i| of(i).id).collect();
        for i in 0..spec.n {
            fx.set_backend(&of(i), BACKEND_ACTIVE);
        }
        let v = Vip {
            mode: spec.mode as u8,
            policy: spec.policy as u8,
            flags: VIP_ACTIVE | if spec.quic { VIP_QUIC } else { 0 },
            proto: spec.proto,
            probe_interval: 0,
            score_max_age_ns: SEC,
            syn_timeout_ns: SYN_TIMEOUT,
            idle_timeout_ns: IDLE_TIMEOUT,
            closing_timeout_ns: CLOSING_TIMEOUT,
            ..Default::default()
        };
        let vip = if spec.v6 { vip6() } else { vip() };
        let key = VipKey { addr: be_ip(vip.ip()), port: be_port(vip.port()), proto: spec.proto, pad: 0 };
        fx.lb.set_vip(VIP_ID, key, &v, &slots).unwrap();
        fx
    }

    /// A backend as the control plane adds it: its first packet asks for a score.
    fn set_backend(&self, b: &B, flags: u16) {
        let entry = Backend { addr: be_ip(b.addr.ip()), port: be_port(b.addr.port()), mac: b.mac, flags, ..Default::default() };
        self.lb.set_backend(b.id, &entry).unwrap();
        put(&self.lb.skel.maps.probe_due, &b.id, &PROBE_DUE);
    }

    fn set_flags(&self, b: &B, flags: u16) {
        let mut entry: Backend = get(&self.lb.skel.maps.backends, &b.id).unwrap();
        entry.flags = flags;
        put(&self.lb.skel.maps.backends, &b.id, &entry);
    }

    fn update_vip(&self, change: impl FnOnce(&mut Vip)) {
        let mut v = self.lb.vip(VIP_ID).unwrap();
        change(&mut v);
        put(&self.lb.skel.maps.vip_conf, &VIP_ID, &v);
    }

    fn config(&self, change: impl FnOnce(&mut DataPathConfig)) {
        let mut cfg: DataPathConfig = get(&self.lb.skel.maps.lb_config, &0u32).unwrap();
        change(&mut cfg);
        put(&self.lb.skel.maps.lb_config, &0u32, &cfg);
    }

    fn run(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let r = self.lb.run(frame).expect("BPF_PROG_TEST_RUN");
        (r.verdict, r.frame)
    }

    /// Runs a frame that must leave with XDP_TX; returns the frame.
    #[track_caller]
    fn tx(&self, frame: &[u8]) -> Vec<u8> {
        let (verdict, out) = self.run(frame);
        assert_eq!(verdict, XDP_TX, "verdict; drops: {:?}", self.named_drops());
        out
    }

    fn drops(&self) -> Vec<u64> {
        self.lb.drops().unwrap()
    }
    fn events(&self) -> Vec<u64> {
        self.lb.events().unwrap()
    }
    fn event(&self, name: &str) -> u64 {
        self.events()[event_index(name)]
    }
    fn named_drops(&self) -> Vec<(&'static str, u64)> {
        DROP_NAMES.iter().copied().zip(self.drops()).filter(|(_, n)| *n > 0).collect()
    }

    fn flow(&self, c: SocketAddr) -> Option<Flow> {
        get(&self.lb.skel.maps.flows, &flow_key(c))
    }
    fn half_open(&self, c: SocketAddr) -> Option<Flow> {
        get(&self.lb.skel.maps.half_open, &flow_key(c))
    }
    fn put_flow(&self, c: SocketAddr, f: &Flow) {
        put(&self.lb.skel.maps.flows, &flow_key(c), f);
    }
    fn flow_count(&self) -> usize {
        self.lb.skel.maps.flows.keys().count()
    }
    fn half_open_count(&self) -> usize {
        self.lb.skel.maps.half_open.keys().count()
    }
    fn snat_owner(&self, b: &B, snat_port: u16) -> Option<FlowKey> {
        get::<NatKey, SnatOwner>(&self.lb.skel.maps.snat, &nat_key(b, snat_port)).map(|o| o.flow)
    }
    fn hold_owner(&self, b: &B, snat_port: u16) -> Option<FlowKey> {
        get::<NatKey, PortHold>(&self.lb.skel.maps.half_open_ports, &nat_key(b, snat_port)).map(|h| h.flow)
    }

    fn score(&self, b: &B) -> BackendScore {
        get(&self.lb.skel.maps.scores, &b.id).unwrap()
    }
    /// A report: when the backend was last picked stays, as record_score
    /// leaves it.
    fn set_score(&self, b: &B, score: u32, updated_ns: u64) {
        self.set_score_full(b, score, 0, 0, updated_ns);
    }
    fn set_score_full(&self, b: &B, score: u32, opened: u32, closed: u32, updated_ns: u64) {
        let picked_ns = get::<u32, BackendScore>(&self.lb.skel.maps.scores, &b.id).map_or(0, |s| s.picked_ns);
        put(&self.lb.skel.maps.scores, &b.id, &BackendScore { score, opened, closed, updated_ns, picked_ns, ..Default::default() });
    }

    fn backend_stats(&self, b: &B) -> BackendStats {
        self.lb.backend_stats(b.id).unwrap()
    }

    /// The backend `id` names.
    fn backend_of(&self, id: u32) -> B {
        (0..SCAN_MAX as u8).flat_map(|i| [backend(i), backend6(i)]).find(|b| b.id == id).expect("known backend")
    }

    /// Sends `c`'s SYN; returns (backend, SNAT port) of its handshake.
    #[track_caller]
    fn open(&self, c: SocketAddr) -> (B, u16) {
        self.tx(&syn(c).build());
        let f = self.half_open(c).expect("half-open flow after SYN");
        (self.backend_of(u32::from(f.backend_id)), port_of(f.snat_port))
    }

    /// Opens a connection from `c` (SYN, then the ACK that completes it)
    /// and returns (backend it went to, SNAT port).
    #[track_caller]
    fn connect(&self, c: SocketAddr) -> (B, u16) {
        let (b, port) = self.open(c);
        self.tx(&ack(c).build());
        assert!(self.flow(c).is_some(), "established flow after the handshake");
        (b, port)
    }

    /// As `connect`, the client's initial sequence number `isn`.
    #[track_caller]
    fn connect_at(&self, c: SocketAddr, isn: u32) -> (B, u16) {
        self.tx(&syn(c).seq_no(isn).build());
        let f = self.half_open(c).expect("half-open flow after SYN");
        self.tx(&ack(c).seq_no(isn.wrapping_add(1)).build());
        assert!(self.flow(c).is_some(), "established flow after the handshake");
        (self.backend_of(u32::from(f.backend_id)), port_of(f.snat_port))
    }

    /// The backend `c`'s SYN is sent to.
    #[track_caller]
    fn pick(&self, c: SocketAddr) -> u32 {
        self.open(c).0.id
    }

    /// Runs `frame` and asserts it is dropped, counted under `reason` only.
    #[track_caller]
    fn assert_dropped(&self, frame: &[u8], reason: &str) {
        let before = self.drops();
        let (verdict, _) = self.run(frame);
        let after = self.drops();
        assert_eq!(verdict, XDP_DROP, "verdict for a {reason} case");
        for (i, name) in DROP_NAMES.iter().enumerate() {
            assert_eq!(after[i] - before[i], u64::from(*name == reason), "drop counter {name}");
        }
    }

    /// Runs `frame` and asserts it goes to the kernel byte for byte, uncounted.
    #[track_caller]
    fn assert_passed_untouched(&self, frame: &[u8]) {
        let before = self.drops();
        let (verdict, out) = self.run(frame);
        assert_eq!(verdict, XDP_PASS);
        assert_eq!(out, frame);
        assert_eq!(self.drops(), before);
    }

    /// As if the 125 answering `c`'s outstanding 124 had come.
    fn answered(&self, c: SocketAddr) {
        let mut f = self.flow(c).expect("a flow");
        f.flags &= !(FLOW_PROBE_OUTSTANDING | c::INBAND_FLOW_PROBE_OLD as u8);
        self.put_flow(c, &f);
    }

    /// Marks the flow of `c` as if its last packet came `ago_ns` ago (and
    /// no sweep has seen one since).
    fn age(&self, c: SocketAddr, ago_ns: u64) {
        let then = ktime_ns().checked_sub(ago_ns).expect("the machine has been up for less than the age asked for");
        if let Some(mut f) = self.flow(c) {
            f.last_seen_ns = then;
            f.seen = 0;
            self.put_flow(c, &f);
        } else {
            let mut f = self.half_open(c).expect("a flow to age");
            f.last_seen_ns = then;
            put(&self.lb.skel.maps.half_open, &flow_key(c), &f);
        }
    }

    fn vip_stats(&self) -> VipStats {
        self.lb.vip_stats(VIP_ID).unwrap()
    }

    fn gauge(&self, idx: u32) -> FlowGauges {
        let st: SweepStats = get(&self.lb.skel.maps.sweep_stats, &0u32).unwrap();
        get(&self.lb.skel.maps.gauges, &(((st.passes & 1) as u32) * GAUGES + idx)).unwrap()
    }
}

/// Patches the IPv4 total length (byte offsets 16-17 of the frame).
fn set_tot_len(frame: &mut [u8], len: u16) {
    frame[16..18].copy_from_slice(&len.to_be_bytes());
}

// ---------------------------------------------------------------- loading

#[test]
fn loading_pins_nothing_under_sys_fs_bpf() {
    let _fx = Fixture::new();
    for name in ["lb_config", "vips", "backends", "flows", "half_open", "snat", "scores", "drops"] {
        assert!(!std::path::Path::new("/sys/fs/bpf").join(name).exists(), "{name} was pinned by a test load");
    }
}

// ------------------------------------------------------ not the balancer's

#[test]
fn non_ip_frames_pass_untouched() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    // An ARP request for the VIP.
    let mut arp = Vec::new();
    arp.extend_from_slice(&[0xff; 6]);
    arp.extend_from_slice(&CLIENT_MAC);
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    arp.extend_from_slice(&CLIENT_MAC);
    arp.extend_from_slice(&v4_of(client(1)).octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&VIP_ADDR.octets());
    fx.assert_passed_untouched(&arp);
    // A frame of another EtherType whose bytes after the Ethernet header
    // would parse as a TCP segment to the VIP if the type were ignored.
    let mut other = syn(client(1)).build();
    other[12..14].copy_from_slice(&[0x88, 0xb5]);
    fx.assert_passed_untouched(&other);
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn non_vip_traffic_passes_untouched() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 2);
    let c = client(1);
    let other_host = sa4(Ipv4Addr::new(10, 0, 0, 200), VIP_PORT);
    let vip_other_port = sa4(VIP_ADDR, 443);
    // TCP to another address, TCP to the VIP address on another port, UDP to
    // the VIP's address and port, and TCP to the balancer itself that is no
    // connection of ours (its own ssh, say) — also with an IP option.
    fx.assert_passed_untouched(&PacketBuilder::tcp(c, other_host).macs(CLIENT_MAC, LB_MAC).syn(1460).build());
    fx.assert_passed_untouched(&PacketBuilder::tcp(c, vip_other_port).macs(CLIENT_MAC, LB_MAC).syn(1460).build());
    fx.assert_passed_untouched(&PacketBuilder::udp(c, vip()).macs(CLIENT_MAC, LB_MAC).payload(vec![1, 2, 3]).build());
    let to_lb = PacketBuilder::tcp(c, sa4(LB_ADDR, 22)).macs(CLIENT_MAC, LB_MAC);
    fx.assert_passed_untouched(&to_lb.clone().build());
    fx.assert_passed_untouched(&to_lb.ip_options(vec![1, 1, 1, 1]).build());
    // A non-first fragment carries no ports, so it cannot be matched to a
    // VIP (documented limit): the kernel gets it, untouched.
    fx.assert_passed_untouched(&data(c).frag(0x0010).build());
    assert_eq!(fx.half_open_count() + fx.flow_count(), 0);
    assert_eq!(fx.vip_stats(), VipStats::default());
}

// ------------------------------------------------------------- handshake

#[test]
fn passthrough_syn_is_natted_without_option_or_clamp_and_held_as_half_open() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(1));
    let s = syn(c);
    let before = ktime_ns();
    let out = fx.tx(&s.build());

    let f = fx.half_open(c).expect("half-open flow");
    let snat = port_of(f.snat_port);
    assert!((1024..=32767).contains(&snat), "SNAT port {snat}");
    assert_eq!(out, forwarded(&s, &b, snat, vec![]));
    assert_eq!(
        (f.backend_addr, f.backend_port, u32::from(f.backend_id), u32::from(f.vip_id), f.mode, f.state),
        (be_ip(b.addr.ip()), be_port(b.addr.port()), b.id, VIP_ID, Mode::Passthrough as u8, FLOW_SYN_SENT)
    );
    assert_eq!((f.client_mac, f.syn_seq, f.flags), (CLIENT_MAC, s.seq.to_be(), 0));
    // The coarse clock ticks at most every few ms.
    assert!(f.last_seen_ns + 10_000_000 >= before && f.last_seen_ns <= ktime_ns(), "last_seen {}", f.last_seen_ns);
    // The port is held for the handshake, not reserved yet; nothing established.
    assert_eq!(fx.hold_owner(&b, snat), Some(flow_key(c)));
    assert_eq!(fx.snat_owner(&b, snat), None);
    assert_eq!(fx.flow_count(), 0);
    let st = fx.backend_stats(&b);
    assert_eq!((st.packets, st.new_conns), (1, 1));
    assert_eq!(fx.score(&b).opened, 0, "round-robin modes do not count connections");
}

#[test]
fn the_first_ack_completes_the_handshake_and_reserves_the_port() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let (b, c) = (backend(0), client(1));
    let (_, snat) = fx.open(c);
    assert_eq!(fx.score(&b).opened, 1, "score modes count the connection");
    let a = ack(c);
    assert_eq!(fx.tx(&a.build()), forwarded(&a, &b, snat, vec![]));

    let f = fx.flow(c).expect("established flow");
    assert_eq!((f.state, port_of(f.snat_port), u32::from(f.backend_id)), (FLOW_ESTABLISHED, snat, b.id));
    assert_eq!(fx.snat_owner(&b, snat), Some(flow_key(c)));
    assert_eq!(fx.half_open(c), None);
    assert_eq!(fx.hold_owner(&b, snat), None);
    assert_eq!(fx.event("flows_promoted"), 1);
    assert_eq!(fx.backend_stats(&b).new_conns, 1);
}

#[test]
fn dsr_syn_carries_the_authenticated_client_tuple_and_a_clamped_mss() {
    for mode in [Mode::DsrRr, Mode::DsrPolling, Mode::DsrDynamic] {
        let fx = Fixture::lb_with(mode, Policy::LeastScore, 1);
        let (b, c) = (backend(0), client(7));
        let s = syn(c).seq_no(0x1234_5678);
        let out = fx.tx(&s.build());
        let snat = port_of(fx.half_open(c).unwrap().snat_port);
        assert_eq!(out, forwarded_dsr_syn(&s, &b, snat), "{}", mode.name());
        let p = parse(&out).unwrap();
        assert!(p.checksums_ok);
        assert_eq!(p.mss(), Some(SYN_MSS - 16));
        // The MAC binds the option to this SYN: another sequence number or
        // port would not verify.
        let opt = InbandOption::decode(&p.ip_options, false).unwrap();
        assert_ne!(opt, InbandOption::auth_client_tuple(&KEY, KEY_ID, s.seq + 1, conn(&b, snat), c));
        assert_ne!(opt, InbandOption::auth_client_tuple(&KEY, KEY_ID, s.seq, conn(&b, snat ^ 1), c));
    }
}

#[test]
fn seed_mode_sends_the_papers_plain_options() {
    let fx = Fixture::lb_auth(Mode::DsrDynamic, Policy::LeastScore, 1, c::INBAND_AUTH_NONE);
    fx.update_vip(|v| v.probe_interval = 1);
    let (b, c) = (backend(0), client(3));
    let s = syn(c);
    let out = fx.tx(&s.build());
    let snat = port_of(fx.half_open(c).unwrap().snat_port);
    let mut clamped = s.clone();
    clamped.tcp_options = mss_option(SYN_MSS - 16).to_vec();
    assert_eq!(out, forwarded(&clamped, &b, snat, InbandOption::ClientTuple(c).encode()));
    fx.tx(&ack(c).build()); // asks: a backend never asked before
    fx.answered(c);
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, InbandOption::ScoreRequest.encode()));
}

#[test]
fn mss_at_an_odd_offset_is_clamped_with_a_valid_checksum() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(2));
    // NOP, MSS, NOP NOP NOP: the MSS value straddles two checksum words.
    let s = syn(c).tcp_options(vec![1, 2, 4, 0x05, 0xb4, 1, 1, 1]);
    let out = fx.tx(&s.build());
    let snat = port_of(fx.half_open(c).unwrap().snat_port);
    let clamped = s.clone().tcp_options(vec![1, 2, 4, 0x05, 0xa4, 1, 1, 1]);
    assert_eq!(out, forwarded(&clamped, &b, snat, tuple_option(&s, &b, snat)));
    assert!(parse(&out).unwrap().checksums_ok);
}

#[test]
fn syn_without_mss_option_is_forwarded_unclamped() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(2));
    // Window scale and SACK-permitted only: nothing to clamp.
    let s = syn(c).tcp_options(vec![3, 3, 7, 4, 2, 1, 1, 1]);
    let out = fx.tx(&s.build());
    let snat = port_of(fx.half_open(c).unwrap().snat_port);
    assert_eq!(out, forwarded(&s, &b, snat, tuple_option(&s, &b, snat)));
}

/// A SYN forwarded in a DSR mode without its 155 (MSS still clamped).
fn forwarded_plain_syn(p: &PacketBuilder, b: &B, snat_port: u16) -> Vec<u8> {
    let mut clamped = p.clone();
    clamped.tcp_options = mss_option(SYN_MSS - if p.is_ipv4() { 16 } else { 24 }).to_vec();
    forwarded(&clamped, b, snat_port, vec![])
}

#[test]
fn retransmitted_syn_follows_its_handshake_without_the_tuple_and_counts_once() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 3);
    let c = client(1);
    let (b, snat) = fx.open(c);
    // The retransmission goes without its 155: if a middlebox dropped the
    // first SYN for its option, this one opens the connection (through
    // the balancer rather than direct).
    let s = syn(c);
    assert_eq!(fx.tx(&s.build()), forwarded_plain_syn(&s, &b, snat));
    let st = fx.backend_stats(&b);
    assert_eq!((st.new_conns, st.packets, st.syn_retries), (1, 2, 1));
    assert_eq!(fx.half_open_count(), 1);
}

#[test]
fn syn_ack_through_the_balancer_finds_its_client_and_is_clamped() {
    // A server without the agent answers the balancer: the SYN-ACK comes
    // back during the handshake, through the port hold. In a DSR mode the
    // client's segments may get a 124, so its MSS is lowered as the agent
    // would; pass-through adds nothing and leaves it.
    for (mode, clamp) in [(Mode::DsrRr, 16), (Mode::Passthrough, 0)] {
        let fx = Fixture::lb_with(mode, Policy::RoundRobin, 1);
        let c = client(5);
        let (b, snat) = fx.open(c);
        let sa = reply(&b, snat).flags(TCP_SYN | TCP_ACK).tcp_options(mss_option(1460).to_vec()).payload(Vec::<u8>::new());
        let out = fx.tx(&sa.build());
        let want = sa.clone().tcp_options(mss_option(1460 - clamp).to_vec());
        assert_eq!(out, returned(&want, c, vec![]), "{}", mode.name());
        assert!(parse(&out).unwrap().checksums_ok);
    }
}

#[test]
fn a_reset_during_the_handshake_ends_it() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (c, c2) = (client(1), client(2));
    // The client gives up: the backend hears it, the handshake is gone.
    let (b, snat) = fx.open(c);
    let rst = ack(c).flags(TCP_RST);
    assert_eq!(fx.tx(&rst.build()), forwarded(&rst, &b, snat, vec![]));
    assert_eq!((fx.half_open(c), fx.hold_owner(&b, snat)), (None, None));
    fx.assert_dropped(&ack(c).build(), "no_flow");
    // The backend refuses (no listener): its RST reaches the client and ends it too.
    let (b2, snat2) = fx.open(c2);
    let refused = reply(&b2, snat2).flags(TCP_RST | TCP_ACK).payload(Vec::<u8>::new());
    assert_eq!(fx.tx(&refused.build()), returned(&refused, c2, vec![]));
    assert_eq!(fx.half_open(c2), None);
}

#[test]
fn a_handshake_that_ends_unfinished_leaves_the_estimate() {
    // Its SYN was counted as a connection (opened); the client's reset,
    // the backend's, or a timeout ends it as a FIN would (closed).
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let b = backend(0);
    let (_, snat) = fx.open(client(1));
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (1, 0));
    fx.tx(&ack(client(1)).flags(TCP_RST).build());
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (1, 1), "the client's reset");
    let (_, snat2) = fx.open(client(2));
    fx.tx(&reply(&b, snat2).flags(TCP_RST | TCP_ACK).payload(Vec::<u8>::new()).build());
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (2, 2), "the backend's reset");
    fx.open(client(3));
    fx.age(client(3), SYN_TIMEOUT + SEC);
    fx.lb.sweep(0).unwrap();
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (3, 3), "a timeout");
    assert_eq!(fx.half_open(client(3)), None);
    // A completed handshake is not an abandoned one.
    fx.connect(client(4));
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (4, 3));
    assert_ne!(snat, 0);
}

#[test]
fn an_unfinished_handshake_expires() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, snat) = fx.open(c);
    fx.age(c, SYN_TIMEOUT + SEC);
    fx.assert_dropped(&ack(c).build(), "flow_expired");
    assert_eq!((fx.half_open(c), fx.hold_owner(&b, snat), fx.flow(c)), (None, None, None));
    assert_eq!(fx.event("flows_expired"), 1);
    // A retransmitted SYN after that is a new handshake.
    fx.open(c);
    assert!(fx.half_open(c).is_some());
}

#[test]
fn non_syn_without_flow_is_dropped_as_no_flow() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    fx.assert_dropped(&data(client(1)).build(), "no_flow");
    // A SYN-ACK is no connection opening either.
    let synack = syn(client(1)).flags(TCP_SYN | TCP_ACK).build();
    fx.assert_dropped(&synack, "no_flow");
    assert_eq!(fx.half_open_count() + fx.flow_count(), 0);
}

// ----------------------------------------------------------- established

#[test]
fn established_packets_follow_the_flow_without_option() {
    for mode in [Mode::Passthrough, Mode::DsrRr, Mode::DsrPolling, Mode::DsrDynamic] {
        let fx = Fixture::lb_with(mode, Policy::RoundRobin, 3);
        let c = client(1);
        let (b, snat) = fx.connect(c);
        // Other connections move the round-robin cursor past c's backend.
        fx.connect(client(2));
        fx.connect(client(3));
        let d = data(c);
        for _ in 0..3 {
            assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]), "{}", mode.name());
        }
        let st = fx.backend_stats(&b);
        assert_eq!((st.packets, st.new_conns, st.probes_sent), (5, 1, 0));
    }
}

#[test]
fn the_routed_hop_decrements_ttl_and_refuses_an_expiring_one() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    let mut d = data(c);
    d.ttl = 2;
    let out = fx.tx(&d.build());
    assert_eq!(out, forwarded(&d, &b, snat, vec![]));
    assert_eq!(out[14 + 8], 1);
    d.ttl = 1;
    fx.assert_dropped(&d.build(), "ttl_exceeded");
    let mut r = reply(&b, snat);
    r.ttl = 1;
    fx.assert_dropped(&r.build(), "ttl_exceeded");
}

// ------------------------------------------------------------- lifecycle

#[test]
fn fin_and_rst_move_a_flow_to_closing_counted_once() {
    for flag in [TCP_FIN, TCP_RST] {
        let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
        let (b, c) = (backend(0), client(1));
        let (_, snat) = fx.connect(c);
        let end = data(c).flags(TCP_ACK | flag).payload(Vec::<u8>::new());
        assert_eq!(fx.tx(&end.build()), forwarded(&end, &b, snat, vec![]));
        let f = fx.flow(c).unwrap();
        assert_eq!(f.state, FLOW_CLOSING);
        // The last ACK and a retransmitted FIN still go through, counted once.
        fx.tx(&ack(c).build());
        fx.tx(&end.build());
        assert_eq!(fx.event("flows_closed"), 1);
        assert_eq!(fx.backend_stats(&b).closed_conns, 1);
        assert_eq!(fx.vip_stats().closed_conns, 1);
        let s = fx.score(&b);
        assert_eq!((s.opened, s.closed), (1, 1), "the estimate loses the ended connection");
        assert_eq!(fx.snat_owner(&b, snat), Some(flow_key(c)), "the port stays with the closing flow");
    }
}

/// least-connections (dsr-rr: no feedback at all): a new connection goes
/// to the backend with the fewest connections this balancer opened and
/// has not seen end; an ended one frees its backend at once. A flow's end
/// is counted only if its opening was, whatever the policy is by then.
#[test]
fn least_connections_ranks_by_the_balancers_own_counts() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::LeastConnections, 3);
    // Three connections, one on each backend whichever way the ties break.
    let conns: Vec<(SocketAddr, B, u16)> = (1..=3).map(|n| {
        let (b, snat) = fx.connect(client(n));
        (client(n), b, snat)
    }).collect();
    let mut ids: Vec<u32> = conns.iter().map(|(_, b, _)| b.id).collect();
    ids.sort();
    assert_eq!(ids, (0..3).map(|i| backend(i).id).collect::<Vec<_>>());
    assert!(fx.flow(client(1)).unwrap().flags & c::INBAND_FLOW_COUNTED as u8 != 0);
    // The first client ends its connection: its backend is the lightest.
    let (c1, b1, snat1) = conns[0];
    let fin = data(c1).flags(TCP_ACK | TCP_FIN).payload(Vec::<u8>::new());
    assert_eq!(fx.tx(&fin.build()), forwarded(&fin, &b1, snat1, vec![]));
    let s = fx.score(&b1);
    assert_eq!((s.opened, s.closed), (1, 1));
    for n in 4..=8 {
        assert_eq!(fx.pick(client(n)), b1.id, "client {n}: {b1:?} has none left, the others one each");
        // Each pick's handshake ends unfinished (the client's RST): its
        // count goes as it came, and the backend stays the lightest.
        fx.tx(&ack(client(n)).flags(TCP_RST).build());
        assert_eq!(fx.half_open(client(n)), None);
    }
    let s = fx.score(&b1);
    assert_eq!((s.opened, s.closed), (6, 6), "five abandoned handshakes counted in and out");
    // Opened under least-connections and ended under round-robin: still
    // counted out. Opened under round-robin: never counted, in or out.
    let (c2, b2, snat2) = conns[1];
    fx.update_vip(|v| v.policy = Policy::RoundRobin as u8);
    let (b9, snat9) = fx.connect(client(9));
    assert_eq!(fx.flow(client(9)).unwrap().flags & c::INBAND_FLOW_COUNTED as u8, 0);
    fx.update_vip(|v| v.policy = Policy::LeastConnections as u8);
    let before = fx.score(&b9);
    for (c, b, snat) in [(c2, b2, snat2), (client(9), b9, snat9)] {
        let fin = data(c).flags(TCP_ACK | TCP_FIN).payload(Vec::<u8>::new());
        assert_eq!(fx.tx(&fin.build()), forwarded(&fin, &b, snat, vec![]));
    }
    let after_b2 = fx.score(&b2);
    let after_b9 = fx.score(&b9);
    if b9.id == b2.id {
        assert_eq!(after_b2.closed - before.closed, 1, "only the counted flow is counted out");
    } else {
        assert_eq!((after_b2.opened, after_b2.closed), (1, 1));
        assert_eq!((after_b9.opened, after_b9.closed), (before.opened, before.closed), "an uncounted flow's end changes nothing");
    }
}

#[test]
fn packets_keep_a_flow_alive_and_the_sweeper_ends_an_idle_one() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(1));
    let (_, snat) = fx.connect(c);
    // The packet path marks the flow seen; the sweeper turns that into a
    // timestamp and keeps the flow.
    fx.age(c, IDLE_TIMEOUT + SEC);
    fx.tx(&data(c).build());
    assert_eq!(fx.flow(c).unwrap().seen, 1);
    fx.lb.sweep(0).unwrap();
    let f = fx.flow(c).expect("a flow with a packet since the last sweep lives");
    assert!(f.seen == 0 && ktime_ns() - f.last_seen_ns < 5 * SEC);
    // Idle past the timeout: the next sweep ends it and frees its port.
    fx.age(c, IDLE_TIMEOUT + SEC);
    fx.lb.sweep(0).unwrap();
    assert_eq!((fx.flow(c), fx.snat_owner(&b, snat)), (None, None));
    assert_eq!(fx.event("flows_expired"), 1);
    fx.assert_dropped(&data(c).build(), "no_flow");
    // A new connection from the same client tuple gets the same port again.
    let (_, again) = fx.connect(c);
    assert_eq!(again, snat);
}

#[test]
fn a_closing_flow_ends_after_the_closing_timeout() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let c = client(1);
    fx.connect(c);
    fx.tx(&data(c).flags(TCP_ACK | TCP_FIN).build());
    fx.age(c, CLOSING_TIMEOUT - 2 * SEC);
    fx.lb.sweep(0).unwrap();
    assert!(fx.flow(c).is_some(), "inside the closing timeout");
    fx.age(c, CLOSING_TIMEOUT + SEC);
    fx.lb.sweep(0).unwrap();
    assert_eq!(fx.flow(c), None);
}

#[test]
fn a_syn_does_not_rebalance_a_live_flow_but_does_a_closing_one() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    let c = client(7);
    let (b, snat) = fx.connect(c);
    // A SYN with another sequence number on a live connection (forged, or
    // a client that lost its state) goes to the same backend and port,
    // whose stack answers with a challenge ACK; nothing is re-balanced.
    // It carries no 155: the agent would refuse one for a live socket.
    let forged = syn(c).seq_no(900_000);
    assert_eq!(fx.tx(&forged.build()), forwarded_plain_syn(&forged, &b, snat));
    assert_eq!(fx.event("syn_on_live_flow"), 1);
    assert_eq!(fx.backend_stats(&b).syn_retries, 0, "not a handshake's retransmission");
    let f = fx.flow(c).unwrap();
    assert_eq!((u32::from(f.backend_id), f.state), (b.id, FLOW_ESTABLISHED));
    // Once the connection is closing, a new SYN on the tuple is a new
    // connection: balanced afresh (round robin: the other backend).
    fx.tx(&data(c).flags(TCP_ACK | TCP_FIN).build());
    fx.tx(&syn(c).seq_no(5_000_000).build());
    let b2 = fx.half_open(c).expect("a new handshake");
    assert_ne!(u32::from(b2.backend_id), b.id);
    assert_eq!(fx.flow(c), None, "the closing flow made way");
    assert_eq!(fx.snat_owner(&b, snat), None, "with its reservation");
}

// ------------------------------------------------------- sequence window

/// The client's sequence window (lifecycle.h): a FIN or RST counts from
/// BEHIND before to AHEAD after the number the flow recorded, which moves
/// once the client is more than STEP past it.
const STEP: u32 = 1 << 16;
const AHEAD: u32 = 1 << 18;
const BEHIND: u32 = 1 << 16;
/// The initial sequence number of `syn()`.
const ISN: u32 = 1000;

/// A client's bare FIN or RST (`flags`) at `seq`.
fn client_end(c: SocketAddr, flags: u8, seq: u32) -> PacketBuilder {
    data(c).flags(flags).seq_no(seq).payload(Vec::<u8>::new())
}

#[test]
fn a_fin_or_rst_outside_the_clients_window_is_forwarded_and_changes_nothing() {
    for mode in [Mode::Passthrough, Mode::DsrPolling] {
        for flags in [TCP_ACK | TCP_FIN, TCP_RST, TCP_ACK | TCP_RST] {
            let what = format!("{} flags {flags:#x}", mode.name());
            let fx = Fixture::lb_with(mode, Policy::RoundRobin, 2);
            let c = client(1);
            let (b, snat) = fx.connect(c);
            // One past each edge (below: across the wrap to 0xfffe_....),
            // and the far side of the sequence space.
            let guesses = [ISN + AHEAD + 1, ISN.wrapping_sub(BEHIND + 1), ISN.wrapping_add(0x8000_0000)];
            for seq in guesses {
                let p = client_end(c, flags, seq);
                // Forwarded as it came: the backend's stack judges it (RFC 5961).
                assert_eq!(fx.tx(&p.build()), forwarded(&p, &b, snat, vec![]), "{what}");
            }
            let f = fx.flow(c).unwrap();
            assert_eq!((f.state, f.client_done, u32::from_be(f.client_seq)), (FLOW_ESTABLISHED, 0, ISN), "{what}");
            assert_eq!((fx.event("out_of_window"), fx.event("flows_closed")), (3, 0), "{what}");
            assert_eq!((fx.backend_stats(&b).closed_conns, fx.vip_stats().closed_conns), (0, 0), "{what}");
            if mode == Mode::DsrPolling {
                let s = fx.score(&b);
                assert_eq!((s.opened, s.closed), (1, 0), "{what}: the estimate keeps the live connection");
            }
            // The attack of issue 27 went on with a SYN: on a live flow it
            // goes to the same backend (its stack answers with a challenge
            // ACK); nothing is re-balanced, round robin's next pick unused.
            fx.tx(&syn(c).seq_no(ISN.wrapping_add(0x4000_0000)).build());
            assert_eq!(fx.half_open(c), None, "{what}");
            let f = fx.flow(c).unwrap();
            assert_eq!((u32::from(f.backend_id), port_of(f.snat_port), f.state), (b.id, snat, FLOW_ESTABLISHED), "{what}");
            let d = data(c);
            assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]), "{what}: the client's next segment");
            assert_eq!(fx.pick(client(2)), backend(1).id, "{what}: round robin's next pick was still due");
            // The client's own FIN, in its window, still ends it.
            fx.tx(&client_end(c, TCP_ACK | TCP_FIN, ISN + 1 + d.payload.len() as u32).build());
            assert_eq!((fx.flow(c).unwrap().state, fx.event("flows_closed")), (FLOW_CLOSING, 1), "{what}");
        }
    }
}

#[test]
fn the_window_holds_for_ipv6_flows_too() {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrRr, n: 2, ..Spec::default() });
    let c = client6(1);
    let (b, snat) = fx.connect(c);
    let guess = client_end(c, TCP_RST, ISN.wrapping_add(0x2000_0000));
    assert_eq!(fx.tx(&guess.build()), forwarded(&guess, &b, snat, vec![]));
    assert_eq!((fx.flow(c).unwrap().state, fx.event("out_of_window")), (FLOW_ESTABLISHED, 1));
    fx.tx(&client_end(c, TCP_RST, ISN + 1).build());
    assert_eq!((fx.flow(c).unwrap().state, fx.event("flows_closed")), (FLOW_CLOSING, 1));
}

#[test]
fn a_fin_or_rst_at_either_edge_of_the_window_closes_the_flow() {
    for flags in [TCP_ACK | TCP_FIN, TCP_RST] {
        for seq in [ISN.wrapping_sub(BEHIND), ISN + AHEAD] {
            let fx = Fixture::lb_with(Mode::DsrPolling, Policy::RoundRobin, 1);
            let c = client(1);
            let (b, snat) = fx.connect(c);
            let p = client_end(c, flags, seq);
            assert_eq!(fx.tx(&p.build()), forwarded(&p, &b, snat, vec![]));
            let f = fx.flow(c).unwrap();
            assert_eq!((f.state, f.client_done, u32::from_be(f.client_seq)), (FLOW_CLOSING, 1, seq), "flags {flags:#x} seq {seq:#x}");
            assert_eq!((fx.event("flows_closed"), fx.event("out_of_window")), (1, 0));
            assert_eq!((fx.score(&b).closed, fx.backend_stats(&b).closed_conns), (1, 1));
        }
    }
}

#[test]
fn the_window_follows_the_client_a_step_at_a_time_across_the_wrap() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let c = client(3);
    // Near the top of the sequence space: the upload below crosses 2^32.
    let isn = 0xfffe_8000u32;
    let (b, snat) = fx.connect_at(c, isn);
    let recorded = |fx: &Fixture| u32::from_be(fx.flow(c).unwrap().client_seq);
    assert_eq!(recorded(&fx), isn, "the SYN's number");
    // Within a step of the record: nothing written.
    let seg = |seq: u32| data(c).seq_no(seq);
    fx.tx(&seg(isn.wrapping_add(STEP)).build());
    assert_eq!(recorded(&fx), isn);
    // Past a step: recorded; segment after segment, past the wrap.
    let mut at = isn;
    for _ in 0..4 {
        at = at.wrapping_add(STEP + 1000);
        let p = seg(at);
        assert_eq!(fx.tx(&p.build()), forwarded(&p, &b, snat, vec![]));
        assert_eq!(recorded(&fx), at);
    }
    assert!(at < isn, "the record wrapped: {at:#x}");
    // Retransmissions behind it do not move it back; a segment beyond the
    // window (forged, or of another connection) does not carry it there:
    // it is forwarded and the window stays.
    fx.tx(&seg(at.wrapping_sub(100_000)).build());
    let far = seg(at.wrapping_add(AHEAD + 1));
    assert_eq!(fx.tx(&far.build()), forwarded(&far, &b, snat, vec![]));
    assert_eq!(recorded(&fx), at);
    // So a RST where that segment pointed is out of the window, whichever
    // side of the wrap; one inside it counts.
    for seq in [at.wrapping_add(AHEAD + 2), at.wrapping_sub(BEHIND + 1), isn] {
        fx.tx(&client_end(c, TCP_RST, seq).build());
    }
    assert_eq!((fx.flow(c).unwrap().state, fx.event("out_of_window")), (FLOW_ESTABLISHED, 3));
    fx.tx(&client_end(c, TCP_RST, at.wrapping_add(1000)).build());
    assert_eq!(fx.flow(c).unwrap().state, FLOW_CLOSING);
}

#[test]
fn a_reset_during_the_handshake_counts_only_next_to_its_syn() {
    let fx = Fixture::lb_with(Mode::DsrPolling, Policy::RoundRobin, 2);
    let c = client(1);
    let (b, snat) = fx.open(c);
    // A guess: forwarded on the handshake, which stays (no `closed` for
    // its backend, its retransmitted SYN still follows it).
    let guess = ack(c).flags(TCP_RST).seq_no(ISN.wrapping_add(0x1234_5678));
    assert_eq!(fx.tx(&guess.build()), forwarded(&guess, &b, snat, vec![]));
    assert_eq!(fx.event("out_of_window"), 1);
    assert_eq!(fx.hold_owner(&b, snat), Some(flow_key(c)));
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (1, 0));
    fx.tx(&syn(c).build());
    let f = fx.half_open(c).expect("the handshake stays");
    assert_eq!((u32::from(f.backend_id), port_of(f.snat_port)), (b.id, snat));
    assert_eq!(fx.backend_stats(&b).new_conns, 1, "not balanced again");
    // The client's own RST (one past its SYN, as Linux answers a SYN-ACK it
    // no longer wants) ends it.
    fx.tx(&ack(c).flags(TCP_RST).build());
    assert_eq!((fx.half_open(c), fx.hold_owner(&b, snat)), (None, None));
    assert_eq!((fx.score(&b).opened, fx.score(&b).closed), (1, 1));
}

#[test]
fn a_backends_fin_or_rst_counts_only_if_it_acknowledges_what_the_client_sent() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    // Claiming the backend (its address, port and the SNAT port): an ACK
    // far from the client's numbers, or none at all.
    let far = ISN.wrapping_add(0x7000_0000);
    for p in [
        reply(&b, snat).flags(TCP_ACK | TCP_RST).ack_no(far),
        reply(&b, snat).flags(TCP_ACK | TCP_FIN).ack_no(far),
        reply(&b, snat).flags(TCP_RST).ack_no(ISN + 1),
        reply(&b, snat).flags(TCP_ACK | TCP_RST).ack_no(ISN + AHEAD + 1),
    ] {
        // Still sent on to the client, whose stack judges it.
        assert_eq!(fx.tx(&p.build()), returned(&p, c, vec![]));
    }
    let f = fx.flow(c).unwrap();
    assert_eq!((f.state, fx.event("out_of_window"), fx.event("flows_closed")), (FLOW_ESTABLISHED, 4, 0));
    // The backend's own FIN acknowledges the client's request.
    let fin = reply(&b, snat).flags(TCP_ACK | TCP_FIN).ack_no(ISN + 1 + 18);
    assert_eq!(fx.tx(&fin.build()), returned(&fin, c, vec![]));
    assert_eq!((fx.flow(c).unwrap().state, fx.event("flows_closed")), (FLOW_CLOSING, 1));

    // A refusal during the handshake acknowledges the SYN; a RST that
    // does not leaves the handshake be.
    let c2 = client(2);
    let (b2, snat2) = fx.open(c2);
    let guess = reply(&b2, snat2).flags(TCP_ACK | TCP_RST).ack_no(far).payload(Vec::<u8>::new());
    fx.tx(&guess.build());
    assert!(fx.half_open(c2).is_some(), "a guessed refusal ends nothing");
    let refused = reply(&b2, snat2).flags(TCP_ACK | TCP_RST).ack_no(ISN + 1).payload(Vec::<u8>::new());
    assert_eq!(fx.tx(&refused.build()), returned(&refused, c2, vec![]));
    assert_eq!(fx.half_open(c2), None);
    assert_eq!(fx.event("out_of_window"), 5);
}

#[test]
fn the_sweeper_removes_dead_flows_and_orphans_and_counts_the_live() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    let (live, idle, closing, half) = (client(1), client(2), client(3), client(4));
    let (b_live, _) = fx.connect(live);
    let (b_idle, snat_idle) = fx.connect(idle);
    let (_, _) = fx.connect(closing);
    fx.tx(&data(closing).flags(TCP_ACK | TCP_FIN).build());
    let (b_half, snat_half) = fx.open(half);
    fx.age(idle, IDLE_TIMEOUT + SEC);
    fx.age(half, SYN_TIMEOUT + SEC);
    // An orphaned reservation: its owner was evicted from the LRU.
    let orphan = nat_key(&b_live, 30000);
    put(&fx.lb.skel.maps.snat, &orphan, &SnatOwner { flow: flow_key(client(99)) });
    fx.lb.sweep(0).unwrap();

    assert_eq!((fx.flow(idle), fx.snat_owner(&b_idle, snat_idle)), (None, None));
    assert_eq!((fx.half_open(half), fx.hold_owner(&b_half, snat_half)), (None, None));
    assert_eq!(get::<NatKey, SnatOwner>(&fx.lb.skel.maps.snat, &orphan), None);
    assert!(fx.flow(live).is_some() && fx.flow(closing).is_some());
    assert_eq!(fx.gauge(GAUGE_TOTAL), FlowGauges { established: 1, closing: 1 });
    assert_eq!(fx.gauge(GAUGE_VIP0 + VIP_ID), FlowGauges { established: 1, closing: 1 });
    let per_backend: u64 = [backend(0), backend(1)].iter().map(|b| {
        let g = fx.gauge(GAUGE_BACKEND0 + b.id);
        g.established + g.closing
    }).sum();
    assert_eq!(per_backend, 2);
    let st: SweepStats = get(&fx.lb.skel.maps.sweep_stats, &0u32).unwrap();
    assert_eq!((st.passes, st.half_open, st.snat_entries), (1, 0, 2));
    assert_eq!(fx.event("flows_expired"), 2);
    assert_eq!(fx.event("snat_orphans_reclaimed"), 1);
    // A sweep "later" ends the rest too.
    fx.lb.sweep(ktime_ns() + IDLE_TIMEOUT + 10 * SEC).unwrap();
    assert_eq!(fx.flow_count(), 0);
    assert_eq!(fx.gauge(GAUGE_TOTAL), FlowGauges::default());
}

#[test]
fn draining_and_removed_backends_keep_flows_but_get_no_new_syns() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    let (b0, b1) = (backend(0), backend(1));
    let a = client(1);
    let (first, snat) = fx.connect(a);
    assert_eq!(first.id, b0.id, "round robin starts at slot 0");
    let d = data(a);

    fx.set_flags(&b0, BACKEND_DRAINING);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b0, snat, vec![]), "draining keeps the flow");
    for n in 2..6 {
        assert_eq!(fx.pick(client(n)), b1.id, "new connections avoid the draining backend");
    }
    fx.set_flags(&b0, 0); // removed: a tombstone the daemon keeps for the flows
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b0, snat, vec![]), "removed keeps the flow");
    // Past a drain deadline the sweeper ends what is left.
    let mut entry: Backend = get(&fx.lb.skel.maps.backends, &b0.id).unwrap();
    entry.drain_deadline_ns = ktime_ns() - SEC;
    put(&fx.lb.skel.maps.backends, &b0.id, &entry);
    fx.lb.sweep(0).unwrap();
    assert_eq!(fx.flow(a), None);
    assert_eq!(fx.event("drained_flows_ended"), 1);
}

#[test]
fn a_removed_vip_keeps_its_flows_and_refuses_new_connections() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(1));
    let (_, snat) = fx.connect(c);
    fx.update_vip(|v| v.flags = VIP_DRAINING);
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
    fx.assert_dropped(&syn(client(2)).build(), "vip_draining");
    fx.update_vip(|v| v.drain_deadline_ns = ktime_ns() - SEC);
    fx.lb.sweep(0).unwrap();
    assert_eq!(fx.flow(c), None);
}

// ------------------------------------------------------------------ SNAT

/// The SNAT port candidates of client `c` under the fixtures' SNAT key
/// ([1, 2]), as nat.h derives them: SipHash-2-4 of the client side, then
/// lb/common.h's mix32 (the murmur3 finaliser), which spreads a SNAT
/// port's candidates.
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^ (x >> 16)
}

/// one mixed port per try.
fn candidates(c: SocketAddr) -> Vec<u16> {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&1u64.to_le_bytes());
    key[8..].copy_from_slice(&2u64.to_le_bytes());
    let h = Key(key).siphash(flow_key(c).as_bytes());
    (0..16u32).map(|i| (1024 + (mix32((h as u32).wrapping_add(i.wrapping_mul(0x9e37_79b9))) ^ (h >> 32) as u32) % 31744) as u16).collect()
}

#[test]
fn snat_ports_come_from_a_keyed_hash() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    for n in 1..=8 {
        assert_eq!(fx.open(client(n)).1, candidates(client(n))[0], "client {n}");
    }
    // Another key, other ports: an outsider cannot aim at one.
    let other = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    other.config(|c| c.snat_key = [3, 4]);
    let moved = (1..=8).filter(|n| other.open(client(*n)).1 != candidates(client(*n))[0]).count();
    assert!(moved >= 7, "{moved} of 8 ports moved with the key");
}

/// An established flow from `owner` that holds `port` toward `b`.
fn occupy(fx: &Fixture, b: &B, port: u16, owner: SocketAddr, state: u32, last_seen_ns: u64) {
    let f = Flow {
        backend_addr: be_ip(b.addr.ip()),
        backend_port: be_port(b.addr.port()),
        snat_port: be_port(port),
        backend_id: b.id as u16,
        vip_id: VIP_ID as u16,
        state,
        proto: IPPROTO_TCP,
        last_seen_ns,
        ..Default::default()
    };
    if state == FLOW_SYN_SENT {
        put(&fx.lb.skel.maps.half_open, &flow_key(owner), &f);
        put(&fx.lb.skel.maps.half_open_ports, &nat_key(b, port), &PortHold { flow: flow_key(owner), since_ns: last_seen_ns });
    } else {
        fx.put_flow(owner, &f);
        put(&fx.lb.skel.maps.snat, &nat_key(b, port), &SnatOwner { flow: flow_key(owner) });
    }
}

fn owner_of(port: u16) -> SocketAddr {
    sa4(Ipv4Addr::new(172, 16, (port >> 8) as u8, port as u8), 5555)
}

#[test]
fn a_live_flows_port_is_never_handed_out_but_a_dead_ones_is() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let now = ktime_ns();
    // Every port of the backend belongs to an established flow.
    for port in 1024..=32767u16 {
        occupy(&fx, &b, port, owner_of(port), FLOW_ESTABLISHED, now);
    }
    let c = client(1);
    fx.assert_dropped(&syn(c).build(), "snat_exhausted");
    assert_eq!(fx.half_open_count(), 0);
    // The LRU evicts the flow on c's sixth candidate: that connection is
    // gone, so its reservation is an orphan and c's next SYN gets the
    // port; no other reservation moves.
    let freed = candidates(c)[5];
    del(&fx.lb.skel.maps.flows, &flow_key(owner_of(freed)));
    let (_, port) = fx.open(c);
    assert_eq!(port, freed);
    assert_eq!(fx.event("snat_orphans_reclaimed"), 1);
    assert_eq!(fx.snat_owner(&b, freed), None, "the orphan is gone; the port is held by the handshake");
    assert_eq!(fx.lb.skel.maps.snat.keys().count(), 31743);
    // A flow that only looks stale in the other table keeps its port: a
    // hold naming a different owner is not a reservation of this port.
    let taken = candidates(client(2))[0];
    put(&fx.lb.skel.maps.half_open_ports, &nat_key(&b, taken), &PortHold { flow: flow_key(client(99)), since_ns: ktime_ns() });
    fx.assert_dropped(&syn(client(2)).build(), "snat_exhausted");
    assert_eq!(fx.snat_owner(&b, taken), Some(flow_key(owner_of(taken))));
    // A flow past its timeout that no sweep has ended yet: the search ends
    // it and takes its port, counted as an expiry, not as an orphan.
    let c3 = client(3);
    let stale = candidates(c3)[2];
    occupy(&fx, &b, stale, owner_of(stale), FLOW_CLOSING, now - CLOSING_TIMEOUT - SEC);
    let expired = fx.event("flows_expired");
    let (_, port) = fx.open(c3);
    assert_eq!(port, stale);
    assert_eq!(fx.flow(owner_of(stale)), None);
    assert_eq!((fx.event("flows_expired"), fx.event("snat_orphans_reclaimed")), (expired + 1, 1));
}

#[test]
fn ports_of_unfinished_handshakes_and_closing_flows_are_taken_oldest_first() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let now = ktime_ns();
    // Every port is held: by handshakes (even ports, newer) and closing
    // flows (odd ports, older).
    for port in 1024..=32767u16 {
        let closing = port % 2 == 1;
        let (state, ago) = if closing { (FLOW_CLOSING, 5 * SEC) } else { (FLOW_SYN_SENT, SEC / 2) };
        occupy(&fx, &b, port, owner_of(port), state, now - ago);
    }
    // New connections are refused none: each takes the oldest owner among
    // its candidates, a closing flow whenever one is among them.
    for n in 1..=50u8 {
        let (b2, port) = fx.open(client(n));
        assert_eq!(b2.id, b.id);
        assert_eq!(fx.hold_owner(&b, port), Some(flow_key(client(n))));
    }
    let (closing, half) = (fx.event("snat_preempt_closing"), fx.event("snat_preempt_half_open"));
    assert_eq!(closing + half, 50);
    assert!(closing >= 45, "the older closing flows go first: {closing} closing, {half} handshakes");
    assert_eq!(fx.drops().iter().sum::<u64>(), 0);
}

#[test]
fn a_port_search_takes_the_oldest_of_its_first_four_preemptible_candidates() {
    // The flood regime: every port is held by a handshake. The search looks
    // at candidates until it has met INBAND_SNAT_HOLDS_SEEN (4) held ones and
    // takes the oldest of those, ranked by the age the hold carries; an
    // older hold further down the list is not looked at (the cost bound).
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let now = ktime_ns();
    let c = client(1);
    let cand = candidates(c);
    for port in 1024..=32767u16 {
        occupy(&fx, &b, port, owner_of(port), FLOW_SYN_SENT, now - SEC / 10);
    }
    // Among the first four, the third is the oldest; the sixth is older still.
    occupy(&fx, &b, cand[2], owner_of(cand[2]), FLOW_SYN_SENT, now - SEC);
    occupy(&fx, &b, cand[5], owner_of(cand[5]), FLOW_SYN_SENT, now - 2 * SEC);
    let (_, port) = fx.open(c);
    assert_eq!(port, cand[2]);
    assert_eq!(fx.half_open(owner_of(cand[2])), None, "the preempted handshake is ended");
    assert!(fx.half_open(owner_of(cand[5])).is_some(), "beyond the fourth candidate: untouched");
    assert_eq!(fx.event("snat_preempt_half_open"), 1);
    assert_eq!(fx.hold_owner(&b, cand[2]), Some(flow_key(c)));
}

#[test]
fn a_hold_whose_handshake_is_gone_is_taken_without_ending_anything() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let now = ktime_ns();
    let c = client(1);
    let cand = candidates(c);
    for port in 1024..=32767u16 {
        occupy(&fx, &b, port, owner_of(port), FLOW_SYN_SENT, now - SEC / 10);
    }
    // The oldest hold among c's first candidates names a handshake that now
    // holds another port (it was retried): taking this one must not end it.
    let retried = owner_of(cand[1]);
    occupy(&fx, &b, cand[1], retried, FLOW_SYN_SENT, now - SEC);
    let elsewhere = Flow { snat_port: be_port(cand[9]), ..fx.half_open(retried).unwrap() };
    put(&fx.lb.skel.maps.half_open, &flow_key(retried), &elsewhere);
    let (_, port) = fx.open(c);
    assert_eq!(port, cand[1]);
    assert_eq!(fx.half_open(retried), Some(elsewhere), "the other handshake lives on");
    assert_eq!(fx.event("snat_preempt_half_open"), 0);
    assert_eq!(fx.hold_owner(&b, cand[1]), Some(flow_key(c)));
}

#[test]
fn a_retransmitted_syn_makes_its_hold_young_again() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, port) = fx.open(c);
    let key = nat_key(&b, port);
    let mut hold: PortHold = get(&fx.lb.skel.maps.half_open_ports, &key).unwrap();
    hold.since_ns -= 3 * SEC;
    put(&fx.lb.skel.maps.half_open_ports, &key, &hold);
    let before = ktime_ns();
    fx.tx(&syn(c).build());
    let now: PortHold = get(&fx.lb.skel.maps.half_open_ports, &key).unwrap();
    assert_eq!(now.flow, flow_key(c));
    assert!(now.since_ns + SEC >= before, "hold age {} ns after the retransmission", before - now.since_ns);
}

#[test]
fn a_backend_without_free_ports_is_skipped_for_the_next() {
    let fx = Fixture::lb_with(Mode::DsrPolling, Policy::LeastScore, 2);
    let (b0, b1) = (backend(0), backend(1));
    let now = ktime_ns();
    fx.set_score(&b0, 0, now);
    fx.set_score(&b1, 50, now);
    for port in 1024..=32767u16 {
        occupy(&fx, &b0, port, owner_of(port), FLOW_ESTABLISHED, now);
    }
    assert_eq!(fx.pick(client(1)), b1.id, "least-score would pick b0, which has no port");
    assert_eq!(fx.event("backend_full"), 1);
}

// ------------------------------------------------------------ SNAT pool

/// The pool the SNAT-pool fixtures give the balancer (lb.toml
/// `snat_prefix = "10.0.0.64/29"`): 8 addresses beside LB_ADDR.
const POOL: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 64);

impl Fixture {
    fn with_pool(&self) {
        let mut cfg: DataPathConfig = get(&self.lb.skel.maps.lb_config, &0u32).unwrap();
        cfg.snat_pool4 = be_ip(POOL.into());
        cfg.snat_pool4_n = 8;
        put(&self.lb.skel.maps.lb_config, &0u32, &cfg);
    }
}

/// The index a flow must record for source address `a`: 0 for the
/// balancer's own, 1 + the offset in the pool.
fn pool_index(a: IpAddr) -> u8 {
    match a {
        IpAddr::V4(a) if a == LB_ADDR => 0,
        IpAddr::V4(a) if (u32::from(a).wrapping_sub(u32::from(POOL))) < 8 => 1 + (u32::from(a) - u32::from(POOL)) as u8,
        _ => panic!("{a} is neither the balancer's address nor in its pool"),
    }
}

/// New connections leave from every address of the balancer's SNAT pool
/// as well as its own, each flow records which, the 155's MAC is over the
/// address the backend sees, and a backend's answer to a pool address
/// finds its flow. Without the pool every SYN left from LB_ADDR.
#[test]
fn a_snat_pool_spreads_connections_over_its_addresses_and_answers_find_them() {
    for mode in [Mode::Passthrough, Mode::DsrRr] {
        let fx = Fixture::lb_with(mode, Policy::RoundRobin, 1);
        fx.with_pool();
        let b = backend(0);
        let mut used = std::collections::BTreeSet::new();
        for n in 1..=32 {
            let c = client(n);
            let s = syn(c);
            let out = parse(&fx.tx(&s.build())).unwrap();
            let f = fx.half_open(c).expect("half-open flow");
            assert_eq!(f.snat_index, pool_index(out.src.ip()), "{mode:?}: flow and wire disagree on the address");
            assert_eq!(out.src.port(), port_of(f.snat_port));
            if mode == Mode::DsrRr {
                let want = InbandOption::auth_client_tuple(&KEY, KEY_ID, s.seq, Conn::tcp(out.src, b.addr), c).encode();
                assert_eq!(out.ip_options, want, "the 155 binds the address the backend sees");
            }
            used.insert(f.snat_index);
        }
        assert!(used.len() >= 6, "{mode:?}: 32 connections used only addresses {used:?}");
        // A pool address's answer goes back to its client.
        let c = client(7);
        let f = fx.half_open(c).unwrap();
        let to = if f.snat_index == 0 { LB_ADDR } else { Ipv4Addr::from(u32::from(POOL) + u32::from(f.snat_index) - 1) };
        let r = PacketBuilder::tcp(b.addr, sa4(to, port_of(f.snat_port))).macs(b.mac, LB_MAC).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!(fx.tx(&r.build()), returned(&r, c, vec![]), "{mode:?}");
    }
}

/// One address has 31,744 SNAT ports toward a backend; with every one of
/// them held by a live flow, a SYN is refused (`snat_exhausted`, as in
/// a_live_flows_port_is_never_handed_out_but_a_dead_ones_is) — unless the
/// balancer has a pool: then it leaves from a pool address.
#[test]
fn a_snat_pool_lifts_the_port_ceiling_of_one_address() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let now = ktime_ns();
    for port in 1024..=32767u16 {
        occupy(&fx, &b, port, owner_of(port), FLOW_ESTABLISHED, now);
    }
    fx.assert_dropped(&syn(client(1)).build(), "snat_exhausted");
    fx.with_pool();
    let out = parse(&fx.tx(&syn(client(1)).build())).unwrap();
    let f = fx.half_open(client(1)).expect("a handshake");
    assert!(f.snat_index > 0 && pool_index(out.src.ip()) == f.snat_index, "left from {} (index {})", out.src, f.snat_index);
}

// ---------------------------------------------------------------- probes

/// The authenticated 124 the balancer put on `out` (which must carry one),
/// checked against the nonce it recorded in `c`'s flow.
#[track_caller]
fn expect_request(fx: &Fixture, out: &[u8], c: SocketAddr, b: &B, snat: u16) -> Vec<u8> {
    let f = fx.flow(c).unwrap();
    assert_eq!(f.flags & FLOW_PROBE_OUTSTANDING, FLOW_PROBE_OUTSTANDING);
    assert_eq!(f.probe_key, KEY_ID);
    let want = InbandOption::auth_score_request(&KEY, KEY_ID, f.probe_nonce.to_ne_bytes(), conn(b, snat)).encode();
    assert_eq!(parse(out).unwrap().ip_options, want);
    want
}

#[test]
fn dsr_dynamic_adds_an_authenticated_score_request_on_every_nth_packet() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 3;
        v.score_max_age_ns = 3600 * SEC; // only the count asks here
    });
    let c = client(1);
    let (b, snat) = fx.connect(c);
    fx.answered(c);
    let d = data(c);
    let mut nonces = Vec::new();
    for n in 1..=7 {
        let out = fx.tx(&d.build());
        // The handshake's ACK asked already (a backend never asked before
        // is asked at once); from there every third packet asks.
        let want = if n % 3 == 0 {
            let opt = expect_request(&fx, &out, c, &b, snat);
            nonces.push(fx.flow(c).unwrap().probe_nonce);
            fx.answered(c);
            opt
        } else {
            vec![]
        };
        assert_eq!(out, forwarded(&d, &b, snat, want), "packet {n} after the handshake");
        assert!(parse(&out).unwrap().checksums_ok);
    }
    assert_eq!(nonces.len(), 2);
    assert_ne!(nonces[0], nonces[1], "every request gets a fresh nonce");
    let st = fx.backend_stats(&b);
    assert_eq!((st.probes_sent, st.packets), (3, 9));
}

#[test]
fn a_backend_whose_score_gets_old_is_asked_on_its_next_packet() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| v.probe_interval = 1000);
    let (b, c) = (backend(0), client(1));
    let (_, snat) = fx.connect(c); // a new backend's first packet asks at once
    assert_eq!(fx.backend_stats(&b).probes_sent, 1);
    fx.answered(c);
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]), "just asked: not again");
    // A fresh score: the sweeper asks for nothing.
    fx.set_score(&b, 3, ktime_ns());
    fx.lb.sweep(0).unwrap();
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
    // Older than half the VIP's max age (1 s): the next packet asks,
    // whatever the packet count, so a quiet backend's next report is one
    // round trip away; the one after does not.
    fx.set_score(&b, 3, ktime_ns() - SEC / 2 - 50_000_000);
    fx.lb.sweep(0).unwrap();
    let out = fx.tx(&d.build());
    expect_request(&fx, &out, c, &b, snat);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
    assert_eq!(fx.backend_stats(&b).probes_sent, 2);
}

#[test]
fn a_probe_that_would_exceed_the_mtu_waits_for_a_packet_it_fits() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 1;
        v.score_max_age_ns = 3600 * SEC;
    });
    let c = client(1);
    let (b, snat) = fx.connect(c);
    fx.answered(c);
    let full = data(c).payload(vec![b'x'; 1460]); // 1500 bytes of IPv4: nothing fits on top
    fx.config(|cfg| cfg.mtu = 1500);
    assert_eq!(fx.tx(&full.build()), forwarded(&full, &b, snat, vec![]));
    assert_eq!(fx.event("probe_deferred_mtu"), 1);
    let small = data(c);
    let out = fx.tx(&small.build());
    expect_request(&fx, &out, c, &b, snat);
    assert_eq!(fx.backend_stats(&b).probes_sent, 2, "the handshake's ACK asked, then the small packet");
    // A SYN that would not fit its 155 goes without (the connection falls
    // back to the balancer path).
    fx.config(|cfg| cfg.mtu = 60); // the SYN is 44 bytes of IPv4, 64 with the 155
    let s = syn(client(2));
    let out = fx.tx(&s.build());
    assert_eq!(parse(&out).unwrap().ip_options, Vec::<u8>::new());
    assert_eq!(fx.event("tuple_skipped_mtu"), 1);
}

#[test]
fn a_flow_has_one_score_request_outstanding_at_a_time() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 1;
        v.score_max_age_ns = 3600 * SEC;
    });
    let (c1, c2) = (client(1), client(2));
    let (b, snat1) = fx.connect(c1); // asks (outstanding on c1)
    let d1 = data(c1);
    // Due, but c1's request is unanswered: a second one would replace its
    // nonce while the first answer may be on its way.
    assert_eq!(fx.tx(&d1.build()), forwarded(&d1, &b, snat1, vec![]));
    // Another flow to the backend asks instead.
    let (_, snat2) = fx.open(c2);
    let out = fx.tx(&ack(c2).build());
    expect_request(&fx, &out, c2, &b, snat2);
    // The sweeper gives up on a request unanswered for a whole pass: after
    // two passes c1 may ask again.
    fx.lb.sweep(0).unwrap();
    assert_eq!(fx.tx(&d1.build()), forwarded(&d1, &b, snat1, vec![]), "one pass: still outstanding");
    fx.lb.sweep(0).unwrap();
    let out = fx.tx(&d1.build());
    expect_request(&fx, &out, c1, &b, snat1);
}

#[test]
fn only_dsr_dynamic_flows_are_probed() {
    for mode in [Mode::Passthrough, Mode::DsrRr, Mode::DsrPolling] {
        let fx = Fixture::lb_with(mode, Policy::LeastScore, 1);
        fx.update_vip(|v| v.probe_interval = 1);
        let c = client(1);
        let (b, snat) = fx.connect(c);
        let d = data(c);
        for _ in 0..4 {
            assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]), "{}", mode.name());
        }
        assert_eq!(fx.backend_stats(&b).probes_sent, 0);
    }
    // A flow keeps the mode its SYN saw: switching the VIP to dsr-dynamic
    // does not start probing connections opened under dsr-rr.
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::LeastScore, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    fx.update_vip(|v| {
        v.mode = Mode::DsrDynamic as u8;
        v.probe_interval = 1;
    });
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
}

#[test]
fn probe_interval_zero_never_probes() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    let d = data(c);
    for _ in 0..5 {
        assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
    }
    assert_eq!(fx.backend_stats(&b).probes_sent, 0);
}

// ---------------------------------------------------------- return path

/// A flow of `c` to `b` with an outstanding 124 of nonce `nonce`, as if the
/// balancer had just sent it.
fn outstanding(fx: &Fixture, c: SocketAddr, nonce: u32) {
    let mut f = fx.flow(c).unwrap();
    f.flags |= FLOW_PROBE_OUTSTANDING;
    f.probe_nonce = nonce;
    f.probe_key = KEY_ID;
    fx.put_flow(c, &f);
}

const NONCE: u32 = 0x0a0b_0c0d;

#[test]
fn an_authenticated_score_is_recorded_stripped_and_translated_to_the_client() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    outstanding(&fx, c, NONCE);
    assert_eq!(fx.score(&b).opened, 1);
    let opt = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 4242);
    let r = reply(&b, snat).ip_options(opt.encode());
    let before = ktime_ns();
    let out = fx.tx(&r.build());
    let after = ktime_ns();

    assert_eq!(out, returned(&r, c, vec![]));
    let s = fx.score(&b);
    assert_eq!((s.score, s.opened, s.closed), (4242, 0, 0));
    // Stamped with the fine clock, as a polled score is: within the call.
    assert!(s.updated_ns >= before && s.updated_ns <= after, "updated_ns {} not in [{before}, {after}]", s.updated_ns);
    assert_eq!(fx.flow(c).unwrap().flags & FLOW_PROBE_OUTSTANDING, 0, "one answer per request");
    let st = fx.backend_stats(&b);
    let len = r.build().len() as u64;
    assert_eq!((st.scores_received, st.return_packets, st.return_bytes), (1, 1, len));
    assert_eq!(fx.drops().iter().sum::<u64>(), 0);
    // The same 125 again is a replay: no request outstanding any more.
    fx.tx(&r.build());
    assert_eq!((fx.score(&b).score, fx.event("score_unsolicited")), (4242, 1));
}

#[test]
fn a_closing_flow_asks_no_score_and_its_answer_keeps_its_close() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| v.probe_interval = 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    fx.answered(c);
    // Due on every packet, but the FIN goes without a 124: the backend
    // would answer on its ACK of that FIN, counting the connection.
    let fin = data(c).flags(TCP_ACK | TCP_FIN).payload(Vec::<u8>::new());
    assert_eq!(fx.tx(&fin.build()), forwarded(&fin, &b, snat, vec![]));
    let last = ack(c);
    assert_eq!(fx.tx(&last.build()), forwarded(&last, &b, snat, vec![]), "nor anything after it");
    let probes = fx.backend_stats(&b).probes_sent;
    // A 124 sent before the FIN, answered after it: the score counts the
    // connection whose close was counted already, so the close is kept.
    outstanding(&fx, c, NONCE);
    let opt = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 1);
    let r = reply(&b, snat).flags(TCP_ACK).payload(Vec::<u8>::new()).ip_options(opt.encode());
    fx.tx(&r.build());
    let s = fx.score(&b);
    assert_eq!((s.score, s.opened, s.closed), (1, 0, 1));
    assert_eq!(fx.backend_stats(&b).probes_sent, probes);
}

#[test]
fn scores_that_fail_any_check_are_not_recorded() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    let good = |score| InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), score);
    let initial = fx.score(&b);
    // Each refused 125 on a live flow with good checksums: the option is
    // stripped and the packet still reaches the client.
    let refused = |opt: Vec<u8>, event: &str, n: u64| {
        outstanding(&fx, c, NONCE);
        let r = reply(&b, snat).ip_options(opt);
        assert_eq!(fx.tx(&r.build()), returned(&r, c, vec![]), "{event}");
        assert_eq!(fx.event(event), n, "{event}");
        assert_eq!(fx.score(&b), initial, "{event}: score untouched");
    };
    let InbandOption::AuthScore { mac, .. } = good(9) else { unreachable!() };
    refused(InbandOption::AuthScore { score: 9, nonce: NONCE.to_ne_bytes(), mac: mac ^ 1 }.encode(), "score_bad_mac", 1);
    refused(InbandOption::AuthScore { score: 10, nonce: NONCE.to_ne_bytes(), mac }.encode(), "score_bad_mac", 2);
    refused(InbandOption::auth_score(&KEY, KEY_ID, [9, 9, 9, 9], conn(&b, snat), 9).encode(), "score_bad_mac", 3);
    refused(InbandOption::auth_score(&Key(*b"another-key-0001"), KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 9).encode(), "score_bad_mac", 4);
    refused(InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat ^ 1), 9).encode(), "score_bad_mac", 5);
    refused(InbandOption::Score(9).encode(), "score_wrong_format", 1);
    // No request outstanding.
    let mut f = fx.flow(c).unwrap();
    f.flags = 0;
    fx.put_flow(c, &f);
    let r = reply(&b, snat).ip_options(good(9).encode());
    fx.tx(&r.build());
    assert_eq!((fx.event("score_unsolicited"), fx.score(&b)), (1, initial));
    // Bad checksums: the packet is garbage a receiver would drop; so do we.
    outstanding(&fx, c, NONCE);
    let mut bad_tcp = reply(&b, snat).ip_options(good(9).encode()).build();
    *bad_tcp.last_mut().unwrap() ^= 0x20;
    fx.assert_dropped(&bad_tcp, "bad_checksum");
    let mut bad_ip = reply(&b, snat).ip_options(good(9).encode()).build();
    bad_ip[14 + 10] ^= 0x01;
    fx.assert_dropped(&bad_ip, "bad_checksum");
    assert_eq!(fx.score(&b), initial);
}

#[test]
fn seed_mode_takes_a_plain_score_only_when_one_was_asked() {
    let fx = Fixture::lb_auth(Mode::DsrDynamic, Policy::LeastScore, 1, c::INBAND_AUTH_NONE);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    let r = reply(&b, snat).ip_options(InbandOption::Score(77).encode());
    fx.tx(&r.build());
    assert_eq!((fx.score(&b).updated_ns, fx.event("score_unsolicited")), (0, 1));
    outstanding(&fx, c, 0);
    assert_eq!(fx.tx(&r.build()), returned(&r, c, vec![]));
    assert_eq!(fx.score(&b).score, 77);
    // An authenticated 125 is the wrong format here.
    outstanding(&fx, c, 0);
    let a = reply(&b, snat).ip_options(InbandOption::auth_score(&KEY, KEY_ID, [0; 4], conn(&b, snat), 5).encode());
    fx.tx(&a.build());
    assert_eq!((fx.score(&b).score, fx.event("score_wrong_format")), (77, 1));
}

#[test]
fn score_option_followed_by_other_options_keeps_them() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    outstanding(&fx, c, NONCE);
    let mut opts = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 7).encode();
    opts.extend_from_slice(&[1, 1, 1, 0]);
    let r = reply(&b, snat).ip_options(opts);
    assert_eq!(fx.tx(&r.build()), returned(&r, c, vec![1, 1, 1, 0]));
    assert_eq!(fx.score(&b).score, 7);
}

#[test]
fn return_path_translates_back_in_both_directions() {
    // Passthrough, and the DSR fallback (a server without the agent answers
    // the balancer): client -> backend and backend -> client, several rounds.
    for mode in [Mode::Passthrough, Mode::DsrRr] {
        let fx = Fixture::lb_with(mode, Policy::RoundRobin, 2);
        let c = client(9);
        let (b, snat) = fx.connect(c);
        for round in 0..3u32 {
            let d = data(c).seq_no(1000 + round);
            assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
            let r = reply(&b, snat).seq_no(5000 + round);
            let out = fx.tx(&r.build());
            assert_eq!(out, returned(&r, c, vec![]), "{}", mode.name());
            assert!(parse(&out).unwrap().checksums_ok);
        }
        let st = fx.backend_stats(&b);
        assert_eq!((st.packets, st.return_packets, st.scores_received), (5, 3, 0));
        // The backend's FIN (seen here in pass-through) closes the flow too.
        let fin = reply(&b, snat).flags(TCP_ACK | TCP_FIN).payload(Vec::<u8>::new());
        fx.tx(&fin.build());
        assert_eq!(fx.flow(c).unwrap().state, FLOW_CLOSING);
    }
}

#[test]
fn reply_with_foreign_options_is_forwarded_with_them() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let c = client(9);
    let (b, snat) = fx.connect(c);
    let r = reply(&b, snat).ip_options(vec![1, 1, 1, 1]);
    assert_eq!(fx.tx(&r.build()), returned(&r, c, vec![1, 1, 1, 1]));
}

#[test]
fn inband_options_from_outside_to_the_balancer_are_dropped() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let (b, snat) = fx.connect(client(1));
    let picked_ns = fx.score(&b).picked_ns;
    let stranger = B { addr: sa4(Ipv4Addr::new(10, 0, 1, 66), 8080), ..b };
    let score = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 0).encode();
    // A 125 for no connection: unknown host, or a backend naming a port that
    // is not its connection, or the right host from another source port.
    fx.assert_dropped(&reply(&stranger, snat).ip_options(score.clone()).build(), "score_not_owner");
    fx.assert_dropped(&reply(&b, snat ^ 1).ip_options(score.clone()).build(), "score_not_owner");
    let other_port = B { addr: SocketAddr::new(b.addr.ip(), 9999), ..b };
    fx.assert_dropped(&reply(&other_port, snat).ip_options(score).build(), "score_not_owner");
    // 155/124 are ours to send, never to receive.
    fx.assert_dropped(&reply(&stranger, snat).ip_options(InbandOption::ScoreRequest.encode()).build(), "unexpected_option");
    fx.assert_dropped(&reply(&stranger, snat).ip_options(InbandOption::ClientTuple(client(1)).encode()).build(), "unexpected_option");
    assert_eq!(fx.score(&b), BackendScore { opened: 1, picked_ns, ..Default::default() });
}

#[test]
fn bad_options_from_a_backend_are_dropped() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let (b, snat) = fx.connect(client(1));
    let picked_ns = fx.score(&b).picked_ns;
    let with = |opts: Vec<u8>| reply(&b, snat).ip_options(opts).build();

    // Other inband options from a backend are no score.
    fx.assert_dropped(&with(InbandOption::ScoreRequest.encode()), "score_not_owner");
    fx.assert_dropped(&with(InbandOption::ClientTuple(client(1)).encode()), "score_not_owner");
    // A 125 not where the agent puts it, twice, or of an unknown length.
    fx.assert_dropped(&with(vec![1, 1, 1, 1, 125, 4, 0, 1]), "malformed_option");
    fx.assert_dropped(&with(vec![125, 4, 0, 1, 125, 4, 0, 2]), "malformed_option");
    fx.assert_dropped(&with(vec![125, 8, 0, 1, 0, 0, 0, 0]), "malformed_option");
    // Broken option lengths.
    fx.assert_dropped(&with(vec![125, 0, 0, 0]), "malformed_option");
    fx.assert_dropped(&with(vec![125, 1, 0, 0]), "malformed_option");
    fx.assert_dropped(&with(vec![125, 12, 0, 0]), "malformed_option");
    assert_eq!(fx.score(&b), BackendScore { opened: 1, picked_ns, ..Default::default() });
    assert_eq!(fx.backend_stats(&b).return_packets, 0);
}

#[test]
fn truncated_or_fragmented_replies_are_dropped() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let (b, snat) = fx.connect(client(1));
    let good = reply(&b, snat).payload(Vec::<u8>::new()).build();

    let mut short = good[..14 + 20 + 12].to_vec();
    set_tot_len(&mut short, 32);
    fx.assert_dropped(&short, "truncated_l4");
    let mut doff4 = good.clone();
    doff4[14 + 20 + 12] = 0x40;
    fx.assert_dropped(&doff4, "truncated_l4");

    fx.assert_dropped(&reply(&b, snat).frag(0x2000).build(), "fragment");
    assert_eq!(fx.backend_stats(&b).return_packets, 0);
}

// ------------------------------------------------------------------ ICMP

/// An ICMP error from `router` to `dst` quoting `inner` (its IPv4 header
/// and the first `quote` bytes after it), with `mtu` in the header.
fn icmp_error(router: Ipv4Addr, dst: Ipv4Addr, kind: (u8, u8), mtu: u16, inner: &[u8], quote: usize) -> Vec<u8> {
    let ihl = usize::from(inner[0] & 0x0f) * 4;
    let mut icmp = vec![kind.0, kind.1, 0, 0, 0, 0];
    icmp.extend_from_slice(&mtu.to_be_bytes());
    icmp.extend_from_slice(&inner[..(ihl + quote).min(inner.len())]);
    let sum = checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut ip = vec![0x45, 0xc0];
    ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0, 0, 64, 1, 0, 0]);
    ip.extend_from_slice(&router.octets());
    ip.extend_from_slice(&dst.octets());
    let sum = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(&LB_MAC);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&icmp);
    frame
}

const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 9, 9, 1);
const FRAG_NEEDED: (u8, u8) = (3, 4);

#[test]
fn fragmentation_needed_for_a_dsr_response_goes_to_its_backend() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    // The backend's DSR response, as a router on the client's path saw it
    // (VIP -> client, full size), and the error that router sends the VIP.
    let resp = PacketBuilder::tcp(vip(), c).flags(TCP_ACK).seq_no(777).payload(vec![0; 1400]);
    let err = icmp_error(ROUTER, VIP_ADDR, FRAG_NEEDED, 1280, &resp.build_ip(), 28);
    let out = fx.tx(&err);
    // The same error about the connection as the backend's stack knows it:
    // backend:port -> balancer:SNAT port, from the balancer to the backend.
    let as_sent = PacketBuilder::tcp(b.addr, sa4(LB_ADDR, snat)).flags(TCP_ACK).seq_no(777).payload(vec![0; 1400]);
    let mut want = icmp_error(LB_ADDR, v4_of(b.addr), FRAG_NEEDED, 1280, &as_sent.build_ip(), 28);
    want[0..6].copy_from_slice(&b.mac);
    want[6..12].copy_from_slice(&LB_MAC);
    want[14 + 8] = 63; // one hop
    let sum = checksum(&[&want[14..14 + 10], &[0, 0], &want[14 + 12..14 + 20]]);
    want[14 + 10..14 + 12].copy_from_slice(&sum.to_be_bytes());
    assert_eq!(out, want);
    assert_eq!(checksum(&[&out[34..]]), 0, "ICMP checksum");
    assert_eq!(fx.event("icmp_to_backend"), 1);
}

#[test]
fn fragmentation_needed_for_a_natted_packet_goes_to_its_client_with_the_option_taken_off() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    // The balancer's packet toward the backend carried a 124 (16 bytes)
    // that the client never sent: the MTU the client must use is lower.
    let natted = PacketBuilder::tcp(sa4(LB_ADDR, snat), b.addr)
        .flags(TCP_ACK)
        .seq_no(4242)
        .ip_options(InbandOption::auth_score_request(&KEY, KEY_ID, [1, 2, 3, 4], conn(&b, snat)).encode())
        .payload(vec![0; 1400]);
    let err = icmp_error(ROUTER, LB_ADDR, FRAG_NEEDED, 1400, &natted.build_ip(), 8);
    let out = fx.tx(&err);
    let p = &out[14..];
    assert_eq!(&out[0..6], &CLIENT_MAC);
    assert_eq!((&p[12..16], &p[16..20]), (&VIP_ADDR.octets()[..], &v4_of(c).octets()[..]));
    let icmp = &p[20..];
    assert_eq!(u16::from_be_bytes([icmp[6], icmp[7]]), 1400 - 16);
    let inner = &icmp[8..];
    assert_eq!((&inner[12..16], &inner[16..20]), (&v4_of(c).octets()[..], &VIP_ADDR.octets()[..]));
    let ihl = usize::from(inner[0] & 0x0f) * 4;
    assert_eq!(&inner[ihl..ihl + 4], &[c.port().to_be_bytes(), VIP_PORT.to_be_bytes()].concat()[..]);
    assert_eq!(checksum(&[&inner[..ihl]]), 0, "inner IPv4 checksum");
    assert_eq!(checksum(&[icmp]), 0, "ICMP checksum");
    assert_eq!(checksum(&[&p[..20]]), 0, "outer IPv4 checksum");
    assert_eq!(fx.event("icmp_to_client"), 1);
}

#[test]
fn icmp_about_nothing_of_ours_passes() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    fx.connect(client(1));
    // About a connection the balancer does not have, about the balancer's
    // own traffic, and a ping to the VIP.
    let unknown = PacketBuilder::tcp(vip(), client(2)).flags(TCP_ACK).payload(vec![0; 100]);
    fx.assert_passed_untouched(&icmp_error(ROUTER, VIP_ADDR, FRAG_NEEDED, 1280, &unknown.build_ip(), 8));
    let own = PacketBuilder::tcp(sa4(LB_ADDR, 50000), sa4(ROUTER, 22)).payload(vec![0; 10]);
    fx.assert_passed_untouched(&icmp_error(ROUTER, LB_ADDR, (3, 1), 0, &own.build_ip(), 8));
    fx.assert_passed_untouched(&icmp_error(ROUTER, VIP_ADDR, (8, 0), 0, &unknown.build_ip(), 8));
}

// ---------------------------------------------------------------- policy

#[test]
fn round_robin_spreads_in_slot_order_skipping_inactive_slots() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 3);
    let ids: Vec<u32> = (1..=6).map(|n| fx.pick(client(n))).collect();
    let (b0, b1, b2) = (backend(0).id, backend(1).id, backend(2).id);
    assert_eq!(ids, vec![b0, b1, b2, b0, b1, b2]);
    // Tickets 6.. continue the rotation; a draining slot's turn passes to
    // the next ACTIVE slot.
    fx.set_flags(&backend(1), BACKEND_DRAINING);
    let ids: Vec<u32> = (7..=12).map(|n| fx.pick(client(n))).collect();
    assert_eq!(ids, vec![b0, b2, b2, b0, b2, b2]);
}

#[test]
fn passthrough_and_dsr_rr_round_robin_whatever_the_policy() {
    for mode in [Mode::Passthrough, Mode::DsrRr] {
        for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
            let fx = Fixture::lb_with(mode, policy, 3);
            // Scores that would send everything to backend 2.
            let now = ktime_ns();
            fx.set_score(&backend(0), 900, now);
            fx.set_score(&backend(1), 900, now);
            fx.set_score(&backend(2), 1, now);
            let ids: Vec<u32> = (1..=3).map(|n| fx.pick(client(n))).collect();
            assert_eq!(ids, vec![backend(0).id, backend(1).id, backend(2).id], "{} {}", mode.name(), policy.name());
        }
    }
}

#[test]
fn least_score_picks_the_lowest_estimate() {
    let fx = Fixture::lb_with(Mode::DsrPolling, Policy::LeastScore, 3);
    fx.update_vip(|v| v.score_max_age_ns = 3600 * SEC);
    let now = ktime_ns();
    let (b0, b1, b2) = (backend(0), backend(1), backend(2));
    fx.set_score(&b0, 30, now);
    fx.set_score(&b1, 10, now);
    fx.set_score(&b2, 12, now);
    // 10 + 0, then 10 + 1 < 12: b1 twice; then 10 + 2 = 12 ties with b2, so
    // b2 must come up within a few more picks while b0 (30) never does.
    assert_eq!(fx.pick(client(1)), b1.id);
    assert_eq!(fx.pick(client(2)), b1.id);
    assert_eq!(fx.score(&b1).opened, 2);
    let more: Vec<u32> = (3..=12).map(|n| fx.pick(client(n))).collect();
    assert!(more.contains(&b2.id));
    assert!(!more.contains(&b0.id));
    // Connections given since the report keep the two within one of each other.
    let (o1, o2) = (fx.score(&b1).opened, fx.score(&b2).opened);
    assert_eq!(o1 + o2, 12);
    assert!((10 + o1).abs_diff(12 + o2) <= 1, "estimates {} and {}", 10 + o1, 12 + o2);
}

#[test]
fn ties_go_to_the_backend_picked_least_recently() {
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        let name = policy.name();
        let fx = Fixture::lb_with(Mode::DsrDynamic, policy, 3);
        let now = ktime_ns();
        // Never picked: a tie on both counts, drawn at random. Always the
        // first (or last) slot would give 40/0/0 (a fair draw: 3 * 3^-40).
        let mut first = [0u32; 3];
        for n in 1..=40 {
            for i in 0..3 {
                put(&fx.lb.skel.maps.scores, &backend(i).id, &BackendScore { score: 5, updated_ns: now, ..Default::default() });
            }
            first[(fx.pick(client(n)) - backend(0).id) as usize] += 1;
        }
        assert!(first.iter().filter(|&&k| k > 0).count() >= 2, "{name}: first picks {first:?}");
        // Equal reports before every connection: they take turns.
        let mut order = Vec::new();
        for n in 41..=52 {
            for i in 0..3 {
                fx.set_score(&backend(i), 5, now);
            }
            order.push(fx.pick(client(n)) - backend(0).id);
        }
        match policy {
            // least-score ranks all three: a rotation, whatever the first.
            Policy::LeastScore => {
                for w in order.windows(4) {
                    assert_eq!(w[0], w[3], "{name}: {order:?}");
                }
                let mut round = order[..3].to_vec();
                round.sort();
                assert_eq!(round, [0, 1, 2], "{name}: {order:?}");
            }
            // power-of-two compares two: never the one it just gave a
            // connection to while the other of the pair waits.
            _ => {
                for w in order.windows(2) {
                    assert_ne!(w[0], w[1], "{name}: {order:?}");
                }
            }
        }
        for i in 0..3 {
            assert!(fx.score(&backend(i)).picked_ns > 0, "{name}: backend {i} was picked");
        }
    }
}

/// The ranking over a sequence of reports, assignments and closes, in the
/// regimes that starved a backend before: light load (one connection at a
/// time, reports rare), a backend reported busy that then idles, and a
/// backend whose agent went silent.
#[test]
fn the_estimate_never_exiles_a_backend() {
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        // Light load: sequential connections, each closed before the next,
        // no reports at all. Both backends keep getting connections.
        let fx = Fixture::lb_with(Mode::DsrDynamic, policy, 2);
        let mut per = [0u32; 2];
        for n in 1..=60u8 {
            let c = sa4(Ipv4Addr::new(192, 168, 5, n), 30000);
            let (b, _) = fx.connect(c);
            per[(b.id - backend(0).id) as usize] += 1;
            fx.tx(&data(c).flags(TCP_ACK | TCP_FIN).build());
        }
        assert!(per[0] >= 15 && per[1] >= 15, "{}: light load split {per:?}", policy.name());
        for i in 0..2 {
            let s = fx.score(&backend(i));
            assert_eq!(s.opened, s.closed, "every connection ended: the estimate is back to the report");
        }

        // A backend reported busy (60 idle connections held on it directly)
        // while the other has not reported for long: the busy one gets
        // (almost) nothing, the quiet one is not exiled.
        let fx = Fixture::lb_with(Mode::DsrDynamic, policy, 2);
        let (busy, quiet) = (backend(0), backend(1));
        fx.set_score(&busy, 61, ktime_ns());
        fx.set_score(&quiet, 3, ktime_ns() - 30 * SEC);
        let to_busy = (1..=30u8).filter(|n| fx.pick(client(*n)) == busy.id).count();
        assert!(to_busy <= 2, "{}: {to_busy} of 30 to the busy backend", policy.name());

        // The busy report ages: halved every max age (1 s here), so once the
        // busy backend stops being picked it is tried again within seconds.
        fx.set_score_full(&busy, 61, 0, 0, ktime_ns() - 6 * SEC - SEC / 2);
        fx.set_score_full(&quiet, 3, 8, 0, ktime_ns());
        assert_eq!(fx.pick(client(100)), busy.id, "{}: 61 >> 6 = 0 < 3 + 8", policy.name());
    }
}

#[test]
fn a_stale_backend_gets_one_exploratory_connection_per_sweep() {
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        let fx = Fixture::lb_with(Mode::DsrDynamic, policy, 2);
        let (busy, idle) = (backend(0), backend(1));
        // busy reported 1000 three max ages ago (1 s here): 1000 >> 3 = 125,
        // still far above idle's fresh 0 plus the connections it gets here;
        // nothing but exploration sends busy anything.
        fx.set_score(&busy, 1000, ktime_ns() - 3 * SEC - SEC / 2);
        fx.set_score(&idle, 0, ktime_ns());
        let picks = |from: u8| -> Vec<u32> { (from..from + 10).map(|n| fx.pick(client(n))).collect() };
        assert!(!picks(1).contains(&busy.id), "{}: no ticket, no connection", policy.name());
        fx.lb.sweep(0).unwrap();
        let after = picks(20);
        assert_eq!(after[0], busy.id, "{}: the next connection explores the stale backend", policy.name());
        assert!(!after[1..].contains(&busy.id), "{}: one ticket, one connection: {after:?}", policy.name());
        assert_eq!(get::<u32, u32>(&fx.lb.skel.maps.probe_due, &busy.id), Some(PROBE_DUE), "its first packet will ask");
        // A fresh report: no ticket at the next pass.
        fx.set_score(&busy, 1000, ktime_ns());
        fx.lb.sweep(0).unwrap();
        assert!(!picks(40).contains(&busy.id), "{}", policy.name());
    }
}

/// The ticket is for a stale report: a 125 that comes before the ticket is
/// taken withdraws it, or the next connection would go to a backend the
/// fresh report shows busy.
#[test]
fn a_fresh_report_withdraws_the_exploration_ticket() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 2);
    let c = client(4);
    // The backend the connection went to reports busy, stale; the other idle, fresh.
    let (busy, snat) = fx.connect(c);
    let idle = if busy.id == backend(0).id { backend(1) } else { backend(0) };
    fx.set_score(&busy, 1000, ktime_ns() - 3 * SEC - SEC / 2);
    fx.set_score(&idle, 0, ktime_ns());
    fx.lb.sweep(0).unwrap();
    assert_eq!(get::<u32, u32>(&fx.lb.skel.maps.probe_due, &busy.id).map(|d| d & EXPLORE), Some(EXPLORE));
    outstanding(&fx, c, NONCE);
    let opt = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&busy, snat), 1000);
    fx.tx(&reply(&busy, snat).ip_options(opt.encode()).build());
    assert_eq!(fx.score(&busy).score, 1000);
    assert_eq!(get::<u32, u32>(&fx.lb.skel.maps.probe_due, &busy.id).map(|d| d & EXPLORE), Some(0));
    assert!(!(10..20).map(|n| fx.pick(client(n))).any(|id| id == busy.id), "no ticket left to take");
}

#[test]
fn power_of_two_never_picks_the_worse_of_the_pair() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::PowerOfTwo, 3);
    fx.update_vip(|v| v.score_max_age_ns = 3600 * SEC);
    let now = ktime_ns();
    let (b0, b1, b2) = (backend(0), backend(1), backend(2));
    fx.set_score(&b0, 100, now);
    fx.set_score(&b1, 200, now);
    fx.set_score(&b2, 10_000, now);
    // Two distinct slots are always compared, so the worst of three never wins.
    let ids: Vec<u32> = (1..=30).map(|n| fx.pick(client(n))).collect();
    assert!(!ids.contains(&b2.id), "{ids:?}");
    assert!(ids.contains(&b0.id) && ids.contains(&b1.id));
    // With two ACTIVE backends both are always drawn: the better one wins.
    fx.set_flags(&b0, BACKEND_DRAINING);
    fx.set_score(&b1, 900, now);
    fx.set_score(&b2, 100, now);
    for n in 31..=40 {
        assert_eq!(fx.pick(client(n)), b2.id);
    }
    // A single ACTIVE backend is taken as is.
    fx.set_flags(&b2, BACKEND_DRAINING);
    assert_eq!(fx.pick(client(41)), b1.id);
}

#[test]
fn no_active_backend_is_dropped_as_no_backend() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    fx.set_flags(&backend(0), BACKEND_DRAINING);
    fx.set_flags(&backend(1), 0);
    fx.assert_dropped(&syn(client(1)).build(), "no_backend");
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        fx.update_vip(|v| {
            v.mode = Mode::DsrDynamic as u8;
            v.policy = policy as u8;
        });
        fx.assert_dropped(&syn(client(1)).build(), "no_backend");
    }
    let empty = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 0);
    empty.assert_dropped(&syn(client(1)).build(), "no_backend");
    assert_eq!(fx.half_open_count() + empty.half_open_count(), 0);
}

#[test]
fn unresolved_next_hop_is_dropped_as_no_route_without_state() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let b = backend(0);
    fx.set_backend(&B { mac: [0; 6], ..b }, BACKEND_ACTIVE);
    fx.assert_dropped(&syn(client(1)).build(), "no_route");
    assert_eq!(fx.half_open_count(), 0);
    assert_eq!(fx.lb.skel.maps.half_open_ports.keys().count(), 0);
    // Once the daemon resolves the MAC the retransmitted SYN goes through.
    fx.set_backend(&b, BACKEND_ACTIVE);
    let (got, _) = fx.connect(client(1));
    assert_eq!(got.id, b.id);
}

// ------------------------------------------------------------- malformed

#[test]
fn malformed_ipv4_headers_are_dropped_as_malformed_ip() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let good = syn(client(1)).build();

    let mut ihl4 = good.clone();
    ihl4[14] = 0x44;
    fx.assert_dropped(&ihl4, "malformed_ip");

    let mut version6 = good.clone();
    version6[14] = 0x65;
    fx.assert_dropped(&version6, "malformed_ip");

    // Fewer than 20 bytes after the Ethernet header.
    fx.assert_dropped(&good[..14 + 12], "malformed_ip");

    // IHL 15 (60 bytes) on a 44-byte packet.
    let mut hdr_beyond = good[..14 + 44].to_vec();
    hdr_beyond[14] = 0x4f;
    set_tot_len(&mut hdr_beyond, 44);
    fx.assert_dropped(&hdr_beyond, "malformed_ip");

    let mut too_long = good.clone();
    set_tot_len(&mut too_long, (good.len() - 14 + 1) as u16);
    fx.assert_dropped(&too_long, "malformed_ip");

    let mut below_header = good.clone();
    set_tot_len(&mut below_header, 19);
    fx.assert_dropped(&below_header, "malformed_ip");

    // Not only toward a VIP: a broken header is broken for everyone.
    let mut other = PacketBuilder::tcp(client(1), sa4(LB_ADDR, 22)).build();
    other[14] = 0x43;
    fx.assert_dropped(&other, "malformed_ip");
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn ethernet_padding_beyond_total_length_is_kept() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    // A bare ACK is 54 bytes; Ethernet pads it to 60.
    let bare = ack(c);
    let mut padded = bare.build();
    padded.extend_from_slice(&[0; 6]);
    let mut want = forwarded(&bare, &b, snat, vec![]);
    want.extend_from_slice(&[0; 6]);
    assert_eq!(fx.tx(&padded), want);
}

#[test]
fn client_packets_with_ip_options_are_dropped_by_kind() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(1);
    fx.connect(c);
    let with = |opts: Vec<u8>| data(c).ip_options(opts).build();

    // Length 0, length 1, overrunning the header, and a length byte missing.
    fx.assert_dropped(&with(vec![0x44, 0, 0, 0]), "malformed_option");
    fx.assert_dropped(&with(vec![0x44, 1, 0, 0]), "malformed_option");
    fx.assert_dropped(&with(vec![0x44, 12, 0, 0]), "malformed_option");
    fx.assert_dropped(&with(vec![1, 1, 1, 0x44]), "malformed_option");
    // Inband options from outside.
    fx.assert_dropped(&with(InbandOption::ClientTuple(c).encode()), "unexpected_option");
    fx.assert_dropped(&with(InbandOption::ScoreRequest.encode()), "unexpected_option");
    fx.assert_dropped(&with(InbandOption::Score(1).encode()), "unexpected_option");
    let mut behind_nops = vec![1, 1, 1, 1];
    behind_nops.extend_from_slice(&InbandOption::ScoreRequest.encode());
    fx.assert_dropped(&with(behind_nops), "unexpected_option");
    // Anything else the balancer does not carry through.
    fx.assert_dropped(&with(vec![0x44, 4, 5, 0]), "ip_options");
    fx.assert_dropped(&with(vec![1, 1, 1, 1]), "ip_options");
    fx.assert_dropped(&syn(client(2)).ip_options(vec![0x94, 4, 0, 0]).build(), "ip_options");
    assert_eq!(fx.flow_count(), 1);
    assert_eq!(fx.backend_stats(&backend(0)).packets, 2);
}

#[test]
fn truncated_tcp_to_a_vip_is_dropped_as_truncated_l4() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let good = syn(client(1)).build();

    // Ports present (so the VIP matches) but only 12 of 20 header bytes.
    let mut short = good[..14 + 20 + 12].to_vec();
    set_tot_len(&mut short, 32);
    fx.assert_dropped(&short, "truncated_l4");

    // Data offset below 5 words.
    let mut doff4 = good.clone();
    doff4[14 + 20 + 12] = 0x40;
    fx.assert_dropped(&doff4, "truncated_l4");

    // Data offset (60 bytes) beyond the IPv4 total length.
    let mut doff15 = good.clone();
    doff15[14 + 20 + 12] = 0xf0;
    fx.assert_dropped(&doff15, "truncated_l4");

    // The TCP header inside the frame but past the IPv4 total length.
    let mut hidden = good.clone();
    set_tot_len(&mut hidden, 20 + 10);
    fx.assert_dropped(&hidden, "truncated_l4");
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn fragments_to_a_vip_are_dropped_as_fragment() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    // First fragment (MF, offset 0), of a SYN and of a data segment.
    fx.assert_dropped(&syn(client(1)).frag(0x2000).build(), "fragment");
    fx.connect(client(2));
    fx.assert_dropped(&data(client(2)).frag(0x2000).build(), "fragment");
    assert_eq!(fx.flow_count(), 1);
}

// ------------------------------------------------------------------ VLAN

/// `frame` with an 802.1Q tag (VLAN `id`) after the MAC addresses.
fn tagged(frame: &[u8], id: u16) -> Vec<u8> {
    let mut t = frame[..12].to_vec();
    t.extend_from_slice(&[0x81, 0x00]);
    t.extend_from_slice(&id.to_be_bytes());
    t.extend_from_slice(&frame[12..]);
    t
}

#[test]
fn tagged_frames_to_a_vip_are_refused_never_sent_on_untagged() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    fx.assert_dropped(&tagged(&syn(client(1)).build(), 100), "vlan");
    // Also double-tagged (802.1ad outer), and to the balancer's own address.
    let mut qinq = tagged(&tagged(&syn(client(1)).build(), 100), 200);
    qinq[12..14].copy_from_slice(&[0x88, 0xa8]);
    fx.assert_dropped(&qinq, "vlan");
    let to_lb = PacketBuilder::tcp(client(1), sa4(LB_ADDR, 22)).build();
    fx.assert_dropped(&tagged(&to_lb, 100), "vlan");
    assert_eq!(fx.half_open_count(), 0);
    // Tagged traffic for others is the kernel's VLAN devices' business.
    let other = PacketBuilder::tcp(client(1), sa4(Ipv4Addr::new(10, 0, 0, 200), 80)).build();
    fx.assert_passed_untouched(&tagged(&other, 100));
}

// ---------------------------------------------------------------- bounce

#[test]
fn bounce_swaps_macs_and_transmits() {
    pin_thread_to_cpu0();
    let mut storage = MaybeUninit::uninit();
    let skel = BounceSkelBuilder::default().open(&mut storage).expect("open bounce").load().expect("load bounce");
    let frame = syn(client(1)).build();
    let mut out = vec![0u8; frame.len()];
    let mut input = ProgramInput::default();
    input.data_in = Some(&frame);
    input.data_out = Some(&mut out);
    let res = skel.progs.bounce.test_run(input).expect("test run");
    assert_eq!(res.return_value, XDP_TX);
    let mut want = frame.clone();
    want[0..6].copy_from_slice(&frame[6..12]);
    want[6..12].copy_from_slice(&frame[0..6]);
    assert_eq!(res.data.unwrap().to_vec(), want);
}

// ------------------------------------------------------------------ IPv6

/// A backend's quic_server_id, as the control plane writes it.
fn set_server_id(fx: &Fixture, b: &B, id: u16) {
    let mut entry: Backend = get(&fx.lb.skel.maps.backends, &b.id).unwrap();
    entry.quic_server_id = id;
    put(&fx.lb.skel.maps.backends, &b.id, &entry);
}

fn dsr6() -> Fixture {
    Fixture::lb_vip(Spec { v6: true, ..Spec::default() })
}

#[test]
fn an_ipv6_syn_carries_its_tuple_in_a_destination_options_header_and_is_clamped_by_24() {
    let fx = dsr6();
    let (c, b) = (client6(1), backend6(0));
    let s = syn(c);
    let out = fx.tx(&s.build());
    let snat = port_of(fx.half_open(c).expect("a handshake").snat_port);
    assert_eq!(out, forwarded_dsr_syn(&s, &b, snat));
    let p = parse(&out).unwrap();
    assert!(p.checksums_ok);
    assert_eq!((p.mss(), p.ttl), (Some(SYN_MSS - 24), 63));
    let (next, opt) = parse_doh(&p.ip_options).unwrap();
    assert_eq!((next, p.ip_options.len()), (IPPROTO_TCP, 40));
    assert_eq!(InbandOption::decode(opt, true), Ok(InbandOption::auth_client_tuple(&KEY, KEY_ID, s.seq, conn(&b, snat), c)));
    // The seed format: the 20-byte IPv6 155 in a 24-byte header.
    let seed = Fixture::lb_vip(Spec { v6: true, auth: c::INBAND_AUTH_NONE, ..Spec::default() });
    let carrier = parse(&seed.tx(&s.build())).unwrap().ip_options;
    let (_, opt) = parse_doh(&carrier).unwrap();
    assert_eq!(InbandOption::decode(opt, true), Ok(InbandOption::ClientTuple(c)));
    assert_eq!(carrier.len(), 24, "the seed's 24 bytes");
}

#[test]
fn ipv6_connections_are_translated_both_ways() {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::Passthrough, ..Spec::default() });
    let c = client6(2);
    let (b, snat) = fx.connect(c);
    let d = data(c);
    let out = fx.tx(&d.build());
    assert_eq!(out, forwarded(&d, &b, snat, vec![]));
    assert!(parse(&out).unwrap().checksums_ok);
    let r = reply(&b, snat);
    let back = fx.tx(&r.build());
    assert_eq!(back, returned(&r, c, vec![]));
    let p = parse(&back).unwrap();
    assert!(p.checksums_ok);
    assert_eq!((p.src, p.dst, p.ttl), (vip6(), c, 63));
    // One table holds both families: an IPv4 client of a VIP with the
    // same port is another flow altogether.
    assert_eq!(fx.flow(client(2)), None);
}

#[test]
fn ipv6_score_requests_and_scores_ride_destination_options_headers() {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrDynamic, policy: Policy::LeastScore, ..Spec::default() });
    fx.update_vip(|v| {
        v.probe_interval = 1;
        v.probe_interval_max = 1;
    });
    let c = client6(3);
    let (b, snat) = fx.connect(c);
    fx.answered(c);
    let d = data(c);
    let out = fx.tx(&d.build());
    let f = fx.flow(c).unwrap();
    assert_eq!(f.flags & FLOW_PROBE_OUTSTANDING, FLOW_PROBE_OUTSTANDING);
    let nonce = f.probe_nonce.to_ne_bytes();
    let request = InbandOption::auth_score_request(&KEY, KEY_ID, nonce, conn(&b, snat)).encode();
    assert_eq!(out, forwarded_with(&d, &b, snat, &request));
    assert_eq!(parse(&out).unwrap().ip_options.len(), 24);
    // The agent's answer, in its own carrier: recorded, and the carrier
    // is gone before the client sees the packet.
    let score = InbandOption::auth_score(&KEY, KEY_ID, nonce, conn(&b, snat), 42).encode();
    let r = reply(&b, snat);
    let back = fx.tx(&r.clone().inband(&score).build());
    assert_eq!(back, returned(&r, c, vec![]));
    assert!(parse(&back).unwrap().checksums_ok);
    assert_eq!((fx.score(&b).score, fx.backend_stats(&b).scores_received), (42, 1));
    // A forged one (another key) changes nothing, and still goes through.
    outstanding(&fx, c, u32::from_ne_bytes(nonce));
    let forged = InbandOption::auth_score(&Key(*b"not-the-real-key"), KEY_ID, nonce, conn(&b, snat), 7).encode();
    assert_eq!(fx.tx(&r.clone().inband(&forged).build()), returned(&r, c, vec![]));
    assert_eq!((fx.score(&b).score, fx.event("score_bad_mac")), (42, 1));
}

/// An ICMPv6 error from `router` to `dst` quoting `inner` (an IPv6 packet).
fn icmp6_error(router: Ipv6Addr, dst: Ipv6Addr, kind: (u8, u8), mtu: u32, inner: &[u8]) -> Vec<u8> {
    let mut icmp = vec![kind.0, kind.1, 0, 0];
    icmp.extend_from_slice(&mtu.to_be_bytes());
    icmp.extend_from_slice(inner);
    let sum = checksum(&[&icmp6_pseudo(router, dst, icmp.len()), &icmp]);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(&LB_MAC);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    frame.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    frame.extend_from_slice(&[58, 64]);
    frame.extend_from_slice(&router.octets());
    frame.extend_from_slice(&dst.octets());
    frame.extend_from_slice(&icmp);
    frame
}

fn icmp6_pseudo(src: Ipv6Addr, dst: Ipv6Addr, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 58]);
    p
}

/// The outer addresses, ICMPv6 type and MTU of an ICMPv6 error frame, the
/// quoted packet, and whether its checksum verifies.
fn read_icmp6(frame: &[u8]) -> (Ipv6Addr, Ipv6Addr, u8, u32, Vec<u8>, bool) {
    let ip = &frame[14..];
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap());
    let icmp = &ip[40..];
    let ok = checksum(&[&icmp6_pseudo(src, dst, icmp.len()), icmp]) == 0;
    (src, dst, icmp[0], u32::from_be_bytes(icmp[4..8].try_into().unwrap()), icmp[8..].to_vec(), ok)
}

const ROUTER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 9, 9, 0, 0, 0, 0, 1);

#[test]
fn packet_too_big_for_an_ipv6_dsr_response_goes_to_its_backend() {
    let fx = dsr6();
    let c = client6(4);
    let (b, snat) = fx.connect(c);
    // The response as the backend sent it direct: VIP -> client.
    let resp = PacketBuilder::tcp(vip6(), c).flags(TCP_ACK).payload(vec![0; 1400]).build_ip();
    let out = fx.tx(&icmp6_error(ROUTER6, VIP6_ADDR, (2, 0), 1280, &resp));
    let (src, dst, kind, mtu, inner, ok) = read_icmp6(&out);
    assert!(ok, "ICMPv6 checksum");
    assert_eq!((IpAddr::V6(src), IpAddr::V6(dst), kind, mtu), (lb_addr(false), b.addr.ip(), 2, 1280));
    // The quote is now what the backend sent to the balancer's port.
    let q = parse(&[&LB_MAC[..], &CLIENT_MAC[..], &[0x86, 0xdd], &inner].concat()).unwrap();
    assert_eq!((q.src, q.dst), (b.addr, SocketAddr::new(lb_addr(false), snat)));
    assert!(q.checksums_ok, "the quoted TCP checksum follows the rewrite");
    assert_eq!(&out[0..6], &b.mac);
    assert_eq!(fx.event("icmp_to_backend"), 1);
}

#[test]
fn packet_too_big_for_an_ipv6_natted_packet_goes_to_its_client_lowered_by_the_header_added() {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrDynamic, policy: Policy::LeastScore, ..Spec::default() });
    fx.update_vip(|v| {
        v.probe_interval = 1;
        v.probe_interval_max = 1;
    });
    let c = client6(5);
    fx.connect(c);
    fx.answered(c);
    // A data packet as the balancer sent it on: with a 124 in 24 bytes.
    let sent = fx.tx(&data(c).payload(vec![0; 1200]).build());
    let out = fx.tx(&icmp6_error(ROUTER6, LB6_ADDR, (2, 0), 1400, &sent[14..]));
    let (src, dst, _, mtu, inner, ok) = read_icmp6(&out);
    assert!(ok);
    assert_eq!((IpAddr::V6(src), IpAddr::V6(dst), mtu), (vip6().ip(), c.ip(), 1400 - 24));
    let q = parse(&[&LB_MAC[..], &CLIENT_MAC[..], &[0x86, 0xdd], &inner].concat()).unwrap();
    assert_eq!((q.src, q.dst), (c, vip6()));
    assert!(q.checksums_ok);
    assert_eq!(&out[0..6], &CLIENT_MAC);
    assert_eq!(fx.event("icmp_to_client"), 1);
}

#[test]
fn ipv6_extension_headers_to_a_vip_are_refused_by_what_they_are() {
    let fx = dsr6();
    let c = client6(6);
    let pad4 = [1, 4, 0, 0, 0, 0]; // PadN of 6 bytes
    let hop = syn(c).ext_headers(IPPROTO_HOPOPTS, ext(IPPROTO_TCP, &pad4));
    fx.assert_dropped(&hop.build(), "ip_options");
    // Someone else's destination option, with the "discard if unknown" bits.
    let foreign = syn(c).ext_headers(IPPROTO_DSTOPTS, ext(IPPROTO_TCP, &[0x5e, 4, 0, 0, 0, 0]));
    fx.assert_dropped(&foreign.build(), "ip_options");
    // Our own option from a client: refused as such.
    let ours = syn(c).inband(&InbandOption::ScoreRequest.encode());
    fx.assert_dropped(&ours.build(), "unexpected_option");
    // A first fragment (more to come), and a header that runs past the packet.
    let first = syn(c).ext_headers(IPPROTO_FRAGMENT, vec![IPPROTO_TCP, 0, 0, 1, 0, 0, 0, 9]);
    fx.assert_dropped(&first.build(), "fragment");
    let overrun = syn(c).ext_headers(IPPROTO_DSTOPTS, ext(IPPROTO_TCP, &pad4));
    let mut f = overrun.build();
    f[14 + 40 + 1] = 30; // claims 248 bytes
    fx.assert_dropped(&f, "malformed_ip");
    // A later fragment has no ports: the kernel's, untouched. So is a chain
    // longer than the four headers the balancer walks.
    let later = syn(c).ext_headers(IPPROTO_FRAGMENT, vec![IPPROTO_TCP, 0, 0, 8, 0, 0, 0, 9]);
    fx.assert_passed_untouched(&later.build());
    let mut chain = Vec::new();
    for i in 0..5 {
        chain.extend(ext(if i == 4 { IPPROTO_TCP } else { IPPROTO_DSTOPTS }, &pad4));
    }
    fx.assert_passed_untouched(&syn(c).ext_headers(IPPROTO_DSTOPTS, chain).build());
    assert_eq!(fx.event("ipv6_chain_unwalked"), 1);
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn ipv6_headers_from_a_backend_other_than_one_inband_header_are_refused() {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrDynamic, policy: Policy::LeastScore, ..Spec::default() });
    let c = client6(7);
    let (b, snat) = fx.connect(c);
    outstanding(&fx, c, NONCE);
    let r = reply(&b, snat);
    let score = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 9).encode();
    // Not our option type: someone else's header, which we do not pass on.
    fx.assert_dropped(&r.clone().ext_headers(IPPROTO_DSTOPTS, ext(IPPROTO_TCP, &[0x5e, 4, 0, 0, 0, 0])).build(), "ip_options");
    // Ours, but the carrier's length and the option's disagree.
    let mut h = inband_core::wire::doh(&score, IPPROTO_TCP);
    h[3] = 14;
    fx.assert_dropped(&r.clone().ext_headers(IPPROTO_DSTOPTS, h).build(), "malformed_option");
    // Ours, with padding that is not padding.
    let mut h = inband_core::wire::doh(&score, IPPROTO_TCP);
    h[21] = 9;
    fx.assert_dropped(&r.clone().ext_headers(IPPROTO_DSTOPTS, h).build(), "malformed_option");
    // A 155 or a 124 from a backend.
    fx.assert_dropped(&r.clone().inband(&InbandOption::ScoreRequest.encode()).build(), "score_not_owner");
    // None of it recorded anything; the real one still counts.
    assert_eq!(fx.score(&b).score, 0);
    assert_eq!(fx.tx(&r.clone().inband(&score).build()), returned(&r, c, vec![]));
    assert_eq!(fx.score(&b).score, 9);
}

/// Options of an unknown type with each value of the two high bits
/// (RFC 8200 §4.2: 00 skip, 01 discard, 10 discard and send ICMP, 11 ditto
/// unless multicast), and padding alone: none of it is inband's.
const UNKNOWN_OPTIONS: [[u8; 6]; 5] =
    [[0x1d, 4, 0, 0, 0, 0], [0x5d, 4, 0, 0, 0, 0], [0x9d, 4, 0, 0, 0, 0], [0xdd, 4, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]];

#[test]
fn ipv6_chains_unknown_options_and_padding_to_a_vip_are_refused_as_ip_options() {
    let fx = dsr6();
    let c = client6(9);
    // RFC 8200 §4.1 order: Hop-by-Hop, Destination Options (for the
    // Routing header's hops), Routing, Destination Options: four headers,
    // as deep as the walk goes.
    let rfc_order = [
        opts_header(IPPROTO_DSTOPTS, &[]),
        opts_header(IPPROTO_ROUTING, &[]),
        routing(IPPROTO_DSTOPTS),
        opts_header(IPPROTO_TCP, &[]),
    ]
    .concat();
    fx.assert_dropped(&syn(c).ext_headers(IPPROTO_HOPOPTS, rfc_order).build(), "ip_options");
    assert_eq!(fx.event("ipv6_chain_unwalked"), 0, "four headers are walked");
    // Our own option, but behind other headers: not where a balancer puts it.
    let request = inband_core::wire::doh(&InbandOption::ScoreRequest.encode(), IPPROTO_TCP);
    let behind = [opts_header(IPPROTO_ROUTING, &[]), routing(IPPROTO_DSTOPTS), request.clone()].concat();
    fx.assert_dropped(&syn(c).ext_headers(IPPROTO_HOPOPTS, behind).build(), "ip_options");
    let before = [inband_core::wire::doh(&InbandOption::ScoreRequest.encode(), IPPROTO_ROUTING), routing(IPPROTO_TCP)].concat();
    fx.assert_dropped(&syn(c).ext_headers(IPPROTO_DSTOPTS, before).build(), "ip_options");
    fx.assert_dropped(&syn(c).ext_headers(IPPROTO_ROUTING, routing(IPPROTO_TCP)).build(), "ip_options");
    for body in UNKNOWN_OPTIONS {
        for first in [IPPROTO_DSTOPTS, IPPROTO_HOPOPTS] {
            fx.assert_dropped(&syn(c).ext_headers(first, ext(IPPROTO_TCP, &body)).build(), "ip_options");
        }
    }
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn ipv6_and_its_transport_cut_short_at_every_boundary_are_dropped() {
    let fx = dsr6();
    let c = client6(10);
    let plain = syn(c).build();
    let l4 = ETH_HLEN + 40;
    // The fixed header cut, or its payload length 0 (a jumbogram's, never
    // on Ethernet) or beyond the frame.
    fx.assert_dropped(&plain[..l4 - 1], "malformed_ip");
    let mut zero = plain.clone();
    zero[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&[0, 0]);
    fx.assert_dropped(&zero, "malformed_ip");
    let mut beyond = plain.clone();
    beyond[ETH_HLEN + 5] += 1;
    fx.assert_dropped(&beyond, "malformed_ip");
    // An extension header ending inside its first 8 bytes, or by its
    // length byte 8 bytes past the payload (40 bytes of 32).
    let with_ext = syn(c).ext_headers(IPPROTO_DSTOPTS, opts_header(IPPROTO_TCP, &[])).build();
    for at in [l4 + 1, l4 + 4, l4 + 7] {
        fx.assert_dropped(&cut6(&with_ext, at), "malformed_ip");
    }
    let mut long = with_ext.clone();
    long[l4 + 1] = 4;
    fx.assert_dropped(&long, "malformed_ip");
    // The TCP header cut (ports present, so it is the VIP's), or its data
    // offset past the segment.
    for at in [l4 + 4, l4 + 12, l4 + 19] {
        fx.assert_dropped(&cut6(&plain, at), "truncated_l4");
    }
    let mut doff = plain.clone();
    doff[l4 + 12] = 0xf0;
    fx.assert_dropped(&doff, "truncated_l4");
    // Ports cut: nothing to match a VIP by, the kernel's.
    fx.assert_passed_untouched(&cut6(&plain, l4 + 3));
    assert_eq!(fx.half_open_count(), 0);

    // A UDP header cut after the ports.
    let fx = Fixture::lb_vip(Spec { v6: true, proto: IPPROTO_UDP, ..Spec::default() });
    let d = PacketBuilder::udp(c, vip6()).macs(CLIENT_MAC, LB_MAC).payload(b"q".to_vec()).build();
    for at in [l4 + 4, l4 + 7] {
        fx.assert_dropped(&cut6(&d, at), "truncated_l4");
    }
    fx.tx(&d);
}

#[test]
fn ipv6_backend_headers_beyond_one_inband_header_or_cut_short_are_refused() {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrDynamic, policy: Policy::LeastScore, ..Spec::default() });
    let c = client6(11);
    let (b, snat) = fx.connect(c);
    outstanding(&fx, c, NONCE);
    let r = reply(&b, snat);
    let score = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 9).encode();
    // The 125 where an agent puts it, but with a Routing header after or before it.
    let after = [inband_core::wire::doh(&score, IPPROTO_ROUTING), routing(IPPROTO_TCP)].concat();
    fx.assert_dropped(&r.clone().ext_headers(IPPROTO_DSTOPTS, after).build(), "ip_options");
    let before = [routing(IPPROTO_DSTOPTS), inband_core::wire::doh(&score, IPPROTO_TCP)].concat();
    fx.assert_dropped(&r.clone().ext_headers(IPPROTO_ROUTING, before).build(), "ip_options");
    for body in UNKNOWN_OPTIONS {
        fx.assert_dropped(&r.clone().ext_headers(IPPROTO_DSTOPTS, ext(IPPROTO_TCP, &body)).build(), "ip_options");
    }
    // The carrier's length byte past the packet, the carrier cut, the TCP header cut.
    let whole = r.clone().inband(&score).build();
    let mut long = whole.clone();
    long[ETH_HLEN + 40 + 1] = 9;
    fx.assert_dropped(&long, "malformed_ip");
    fx.assert_dropped(&cut6(&whole, ETH_HLEN + 40 + 20), "malformed_ip");
    fx.assert_dropped(&cut6(&whole, ETH_HLEN + 40 + 24 + 12), "truncated_l4");
    assert_eq!(fx.score(&b).score, 0, "nothing recorded");
    assert_eq!(fx.backend_stats(&b).return_packets, 0);
}

/// `a` as an IPv4-mapped IPv6 endpoint.
fn mapped(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        IpAddr::V6(_) => a,
    }
}

#[test]
fn ipv6_with_ipv4_mapped_addresses_never_passes_for_ipv4_traffic() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let c = client(12);
    let (b, snat) = fx.connect(c);
    let flow = fx.flow(c);
    // The tables key IPv4 by its mapped form: these would reach c's flow,
    // the balancer's own address, and the VIP.
    let rst = PacketBuilder::tcp(mapped(c), mapped(vip())).macs(CLIENT_MAC, LB_MAC).flags(TCP_RST | TCP_ACK).seq_no(1001);
    fx.assert_dropped(&rst.build(), "malformed_ip");
    let to_lb = PacketBuilder::tcp(mapped(b.addr), mapped(sa4(LB_ADDR, snat))).macs(b.mac, LB_MAC).flags(TCP_ACK);
    fx.assert_dropped(&to_lb.build(), "malformed_ip");
    fx.assert_dropped(&syn(mapped(client(13))).build(), "malformed_ip");
    assert_eq!(fx.flow(c), flow);
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn a_family_without_a_balancer_address_is_refused_not_natted_from_nothing() {
    let fx = dsr6();
    fx.config(|c| c.self6 = Default::default());
    fx.assert_dropped(&syn(client6(8)).build(), "family");
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn tagged_ipv6_frames_to_a_vip_are_refused() {
    let fx = dsr6();
    fx.assert_dropped(&tagged(&syn(client6(9)).build(), 100), "vlan");
    let to_lb = PacketBuilder::tcp(client6(9), SocketAddr::new(lb_addr(false), 22)).build();
    fx.assert_dropped(&tagged(&to_lb, 100), "vlan");
}

// ------------------------------------------------------------ UDP, QUIC

fn udp_vip() -> SocketAddr {
    sa4(VIP_ADDR, 443)
}
fn udp_key(c: SocketAddr) -> FlowKey {
    flow_key_to(c, udp_vip(), IPPROTO_UDP)
}
/// A datagram from `c` to the UDP VIP.
fn datagram(c: SocketAddr, payload: &[u8]) -> PacketBuilder {
    PacketBuilder::udp(c, udp_vip()).macs(CLIENT_MAC, LB_MAC).payload(payload.to_vec())
}
/// A QUIC short-header packet whose destination connection ID names `server_id`.
fn short_header(c: SocketAddr, server_id: u16) -> PacketBuilder {
    let mut p = vec![0x41, c::INBAND_QUIC_CID_FIRST as u8, (server_id >> 8) as u8, server_id as u8, 1, 2, 3, 4, 5];
    p.extend_from_slice(&[0xab; 40]);
    datagram(c, &p)
}
/// A QUIC Initial (long header), its connection IDs the client's.
fn initial(c: SocketAddr) -> PacketBuilder {
    let mut p = vec![0xc3, 0, 0, 0, 1, 8, 9, 9, 9, 9, 9, 9, 9, 9, 0];
    p.resize(1200, 0);
    datagram(c, &p)
}

fn udp_fixture(mode: Mode, n: u8, quic: bool) -> Fixture {
    let fx = Fixture::lb_vip(Spec { mode, n, proto: IPPROTO_UDP, quic, ..Spec::default() });
    // lb_vip keys the VIP by the TCP port: the UDP VIP listens on 443.
    del(&fx.lb.skel.maps.vips, &VipKey { addr: be_ip(VIP_ADDR.into()), port: be_port(VIP_PORT), proto: IPPROTO_UDP, pad: 0 });
    let key = VipKey { addr: be_ip(VIP_ADDR.into()), port: be_port(443), proto: IPPROTO_UDP, pad: 0 };
    put(&fx.lb.skel.maps.vips, &key, &VIP_ID);
    fx
}

#[test]
fn a_udp_flow_opens_on_its_first_datagram_with_a_stamped_tuple_and_completes_on_its_second() {
    let fx = udp_fixture(Mode::DsrRr, 1, false);
    let (c, b) = (client(1), backend(0));
    let first = datagram(c, b"hello");
    let out = fx.tx(&first.build());
    let ho = get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(c)).expect("a half-open UDP flow");
    assert_eq!(ho.proto, IPPROTO_UDP);
    let snat = port_of(ho.snat_port);
    let p = parse(&out).unwrap();
    assert!(p.checksums_ok);
    assert_eq!((p.src, p.dst, p.proto), (SocketAddr::new(lb_addr(true), snat), b.addr, IPPROTO_UDP));
    let Ok(InbandOption::AuthClientTuple { client, stamp: Some(stamp), .. }) = InbandOption::decode(&p.ip_options, false) else {
        panic!("no stamped 155: {:?}", p.ip_options)
    };
    assert_eq!((client, p.ip_options.len()), (c, 24));
    // The MAC covers the stamp and the UDP transport.
    let want = InbandOption::auth_client_tuple(&KEY, KEY_ID, u32::from_be_bytes(stamp), Conn::udp(p.src, b.addr), c);
    assert_eq!(InbandOption::decode(&p.ip_options, false), Ok(want));
    // The stamp is the balancer's clock (TAI, ms): close to now.
    let tai_ms = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 + 37_000) as u32;
    assert!((tai_ms.wrapping_sub(u32::from_be_bytes(stamp)) as i32).abs() < 60_000, "stamp {stamp:?} vs {tai_ms}");
    // The second datagram completes it: no option, a flow and a reservation.
    let second = datagram(c, b"again");
    let out = fx.tx(&second.build());
    assert_eq!(parse(&out).unwrap().ip_options, Vec::<u8>::new());
    assert!(get::<FlowKey, Flow>(&fx.lb.skel.maps.flows, &udp_key(c)).is_some());
    assert_eq!(get::<NatKey, SnatOwner>(&fx.lb.skel.maps.snat, &nat_key_proto(&b, snat, IPPROTO_UDP)).map(|o| o.flow), Some(udp_key(c)));
    // An answer that came back through the balancer finds its client.
    let r = PacketBuilder::udp(b.addr, SocketAddr::new(lb_addr(true), snat)).macs(b.mac, LB_MAC).payload(b"reply".to_vec());
    let back = parse(&fx.tx(&r.build())).unwrap();
    assert!(back.checksums_ok);
    assert_eq!((back.src, back.dst, back.payload.as_slice()), (udp_vip(), c, &b"reply"[..]));
}

#[test]
fn a_udp_datagram_without_a_checksum_keeps_none() {
    let fx = udp_fixture(Mode::Passthrough, 1, false);
    let mut f = datagram(client(2), b"no checksum").build();
    f[14 + 20 + 6..14 + 20 + 8].copy_from_slice(&[0, 0]);
    let out = fx.tx(&f);
    assert_eq!(&out[14 + 20 + 6..14 + 20 + 8], &[0, 0], "none before, none after");
    assert!(parse(&out).unwrap().checksums_ok);
}

#[test]
fn quic_short_headers_without_a_flow_go_to_the_server_their_id_names() {
    let fx = udp_fixture(Mode::DsrRr, 3, true);
    for i in 0..3 {
        set_server_id(&fx, &backend(i), 11 + u16::from(i));
    }
    // A client that moved (no flow for its new tuple), on server 13's ID.
    let moved = client(20);
    fx.tx(&short_header(moved, 13).build());
    let f = get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(moved)).expect("a flow");
    assert_eq!(u32::from(f.backend_id), backend(2).id, "the server its ID names, not round robin's");
    assert_eq!(fx.event("quic_cid_routed"), 1);
    // An Initial (the client's own IDs) is balanced: round robin's first.
    fx.tx(&initial(client(21)).build());
    let f = get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(client(21))).unwrap();
    assert_eq!(u32::from(f.backend_id), backend(0).id);
    // An ID naming no server of the VIP: balanced too, and counted.
    fx.tx(&short_header(client(22), 99).build());
    assert_eq!(fx.event("quic_cid_unknown"), 1);
    let f = get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(client(22))).unwrap();
    assert_eq!(u32::from(f.backend_id), backend(1).id);
    // A draining server still gets its connections; a removed one does not.
    fx.set_flags(&backend(1), BACKEND_DRAINING);
    fx.tx(&short_header(client(23), 12).build());
    assert_eq!(get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(client(23))).map(|f| u32::from(f.backend_id)), Some(backend(1).id));
    fx.set_flags(&backend(1), 0);
    fx.tx(&short_header(client(24), 12).build());
    assert_ne!(get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(client(24))).map(|f| u32::from(f.backend_id)), Some(backend(1).id));
    assert_eq!(fx.event("quic_cid_unknown"), 2);
}

#[test]
fn a_quic_id_routes_even_while_the_vip_drains() {
    let fx = udp_fixture(Mode::DsrRr, 2, true);
    set_server_id(&fx, &backend(1), 5);
    fx.update_vip(|v| v.flags = VIP_DRAINING | VIP_QUIC);
    fx.assert_dropped(&initial(client(30)).build(), "vip_draining");
    fx.tx(&short_header(client(31), 5).build());
    assert_eq!(get::<FlowKey, Flow>(&fx.lb.skel.maps.half_open, &udp_key(client(31))).map(|f| u32::from(f.backend_id)), Some(backend(1).id));
}

// --------------------------------------------------- adaptive probing

/// Sends `c`'s flow a 125 of `score` for an outstanding request.
fn score_back(fx: &Fixture, c: SocketAddr, b: &B, snat: u16, score: u16) {
    outstanding(fx, c, NONCE);
    let opt = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(b, snat), score);
    fx.tx(&reply(b, snat).ip_options(opt.encode()).build());
}

/// The adaptive rule (score.h adapt_interval), for the test to follow.
fn next_interval(n: u32, lo: u32, hi: u32, moved: bool) -> u32 {
    let n = if n < lo || n > hi { lo } else { n };
    if moved {
        (n / 2).max(lo)
    } else {
        (n + n / 4 + 1).min(hi)
    }
}

#[test]
fn the_probe_interval_shrinks_when_the_score_moves_and_grows_while_it_holds() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 4;
        v.probe_interval_max = 64;
        v.score_max_age_ns = 3600 * SEC;
    });
    let c = client(1);
    let (b, snat) = fx.connect(c);
    let mut n = 0;
    // The first report has nothing to compare with: it grows. A move of
    // more than an eighth (at least 1) halves n.
    for (score, moved) in [(10, false), (10, false), (11, false), (12, false), (12, false), (40, true), (41, false), (2, true), (3, false)] {
        score_back(&fx, c, &b, snat, score);
        n = next_interval(n, 4, 64, moved);
        assert_eq!(fx.score(&b).interval, n, "after a report of {score}");
    }
    assert_eq!((fx.score(&b).changes, fx.event("probe_faster")), (2, 2));
    // The interval is what the data path asks by: every n-th packet.
    let mut s = fx.score(&b);
    s.interval = 5;
    put(&fx.lb.skel.maps.scores, &b.id, &s);
    put(&fx.lb.skel.maps.probe_due, &b.id, &0u32);
    fx.answered(c);
    let zeros = vec![0u32.to_ne_bytes().to_vec(); libbpf_rs::num_possible_cpus().unwrap()];
    fx.lb.skel.maps.probe_count.update_percpu(&b.id.to_ne_bytes(), &zeros, MapFlags::ANY).unwrap();
    let asked: Vec<bool> = (0..10).map(|_| {
        let out = fx.tx(&data(c).build());
        let has = !parse(&out).unwrap().ip_options.is_empty();
        fx.answered(c);
        has
    }).collect();
    assert_eq!(asked, [false, false, false, false, true, false, false, false, false, true]);
}

#[test]
fn fixed_bounds_keep_the_seed_fixed_interval() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 100;
        v.probe_interval_max = 100;
    });
    let c = client(2);
    let (b, snat) = fx.connect(c);
    for score in [1, 500, 2, 2] {
        score_back(&fx, c, &b, snat, score);
        assert_eq!(fx.score(&b).interval, 100);
    }
}

#[test]
fn the_probe_budget_bounds_score_requests_a_second() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 1;
        v.probe_interval_max = 1;
        v.probe_budget = 2; // one every 500 ms, a burst of five
        v.score_max_age_ns = 3600 * SEC;
    });
    let c = client(3);
    let (b, _) = fx.connect(c);
    fx.answered(c);
    let mut asked = 0;
    for _ in 0..20 {
        let out = fx.tx(&data(c).build());
        asked += u32::from(!parse(&out).unwrap().ip_options.is_empty());
        fx.answered(c);
    }
    // The handshake's ACK spent one already.
    assert_eq!(asked + 1, 5, "a burst of five, then the budget");
    assert!(fx.event("probe_budget") >= 15);
    assert_eq!(fx.score(&b).unanswered, 5, "none of them answered");
}

#[test]
fn a_backend_whose_path_loses_options_gets_none() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 1;
        v.probe_interval_max = 1;
    });
    let b = backend(0);
    fx.set_flags(&b, BACKEND_ACTIVE | BACKEND_OPTIONS_LOST);
    let c = client(4);
    let s = syn(c);
    let out = fx.tx(&s.build());
    let snat = port_of(fx.half_open(c).unwrap().snat_port);
    assert_eq!(out, forwarded_plain_syn(&s, &b, snat), "no 155, MSS still clamped");
    fx.tx(&ack(c).build());
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]), "no 124");
    assert_eq!(fx.backend_stats(&b).probes_sent, 0);
    // The sweeper does not ask it either: it is polled instead.
    put(&fx.lb.skel.maps.probe_due, &b.id, &0u32);
    fx.lb.sweep(0).unwrap();
    assert_eq!(get::<u32, u32>(&fx.lb.skel.maps.probe_due, &b.id), Some(0));
}

#[test]
fn a_report_newer_than_the_sweepers_clock_is_fresh() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let b = backend(0);
    // Stamped by the fine clock a moment ago: ahead of the coarse clock
    // the sweeper reads, by up to a tick.
    fx.set_score(&b, 5, ktime_ns() + 3_000_000);
    put(&fx.lb.skel.maps.probe_due, &b.id, &0u32);
    fx.lb.sweep(0).unwrap();
    assert_eq!(get::<u32, u32>(&fx.lb.skel.maps.probe_due, &b.id), Some(0), "not due");
    // Never reported: due.
    fx.set_score(&b, 0, 0);
    fx.lb.sweep(0).unwrap();
    assert_eq!(get::<u32, u32>(&fx.lb.skel.maps.probe_due, &b.id), Some(PROBE_DUE));
}

// ------------------------------------------------------------ dsr-query

#[test]
fn dsr_query_holds_a_syn_for_the_daemon_and_balances_it_once_answered() {
    use std::sync::Arc;
    let fx = Fixture::lb_with(Mode::DsrQuery, Policy::LeastScore, 2);
    let c = client(1);
    // No daemon has swept yet: nobody would answer, so nothing is held.
    fx.tx(&syn(c).build());
    assert_eq!(fx.event("query_skipped"), 1);
    let c = client(2);
    fx.lb.sweep(0).unwrap();
    fx.assert_dropped(&syn(c).build(), "query_pending");
    assert_eq!(fx.half_open(c), None);
    let held: Arc<Mutex<Vec<QueryReq>>> = Arc::default();
    let mut rb = libbpf_rs::RingBufferBuilder::new();
    let sink = Arc::clone(&held);
    rb.add(&fx.lb.skel.maps.query_ring, move |d: &[u8]| {
        sink.lock().unwrap().push(QueryReq::from_bytes(d));
        0
    })
    .unwrap();
    rb.build().unwrap().consume().unwrap();
    let held = held.lock().unwrap();
    assert_eq!(held.len(), 1);
    let syn_frame = syn(c).build();
    assert_eq!((held[0].vip_id, &held[0].frame[..held[0].len as usize]), (VIP_ID, &syn_frame[..]));
    assert_eq!(held[0].key, flow_key(c), "the key the daemon marks query_done with");
    // The daemon asked; backend 1 is idle, backend 0 busy: the SYN, run
    // again, goes to backend 1 on those fresh scores.
    fx.set_score(&backend(0), 50, ktime_ns());
    fx.set_score(&backend(1), 0, ktime_ns());
    put(&fx.lb.skel.maps.query_done, &flow_key(c), &ktime_ns());
    fx.tx(&syn_frame);
    assert_eq!(fx.half_open(c).map(|f| u32::from(f.backend_id)), Some(backend(1).id));
    assert_eq!(fx.event("query_answered"), 1);
    assert_eq!(get::<FlowKey, u64>(&fx.lb.skel.maps.query_done, &flow_key(c)), None, "the answer is used once");
    // Its retransmission follows the handshake without asking again.
    fx.tx(&syn_frame);
    assert_eq!(fx.drops()[drop_index("query_pending")], 1);
}

/// dsr-dynamic with `query_when_stale`: a SYN is held for a query only
/// when every active backend's score is stale (or missing); one fresh
/// score lets SYNs through at once, as does the flag being off.
#[test]
fn dsr_dynamic_holds_a_syn_for_a_query_only_when_every_score_is_stale() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 3);
    let max_age = 2 * SEC;
    fx.update_vip(|v| {
        v.score_max_age_ns = max_age;
        v.flags |= VIP_QUERY_STALE;
    });
    fx.lb.sweep(0).unwrap();
    let old = ktime_ns() - 3 * max_age;
    // Never scored: nothing is known, the first SYN is asked about.
    let c = client(1);
    fx.assert_dropped(&syn(c).build(), "query_pending");
    assert_eq!(fx.half_open(c), None);
    // Every score older than the max age: held too.
    for i in 0..3 {
        fx.set_score(&backend(i), 0, old);
    }
    let c = client(2);
    fx.assert_dropped(&syn(c).build(), "query_pending");
    // The only fresh score is a down backend's: it takes no connection,
    // so it says nothing of where this one can go.
    fx.set_score(&backend(1), 3, ktime_ns() - max_age / 2);
    fx.set_flags(&backend(1), BACKEND_ACTIVE | BACKEND_DOWN);
    let c = client(3);
    fx.assert_dropped(&syn(c).build(), "query_pending");
    // Back up, its fresh score is enough: balanced at once.
    fx.set_flags(&backend(1), BACKEND_ACTIVE);
    let c = client(4);
    fx.tx(&syn(c).build());
    assert!(fx.half_open(c).is_some(), "one fresh score: balanced at once");
    // Answered: the held SYN goes on, once.
    fx.set_score(&backend(1), 3, old);
    let c = client(5);
    fx.assert_dropped(&syn(c).build(), "query_pending");
    put(&fx.lb.skel.maps.query_done, &flow_key(c), &ktime_ns());
    fx.tx(&syn(c).build());
    assert!(fx.half_open(c).is_some());
    assert_eq!((fx.event("query_answered"), fx.drops()[drop_index("query_pending")]), (1, 4));
    // No active backend: nobody to ask, the SYN is not held.
    for i in 0..3 {
        fx.set_flags(&backend(i), BACKEND_ACTIVE | BACKEND_DOWN);
    }
    fx.assert_dropped(&syn(client(7)).build(), "no_backend");
    assert_eq!(fx.drops()[drop_index("query_pending")], 4, "held with every backend down");
    for i in 0..3 {
        fx.set_flags(&backend(i), BACKEND_ACTIVE);
    }
    // The flag off: stale or not, a dsr-dynamic SYN is balanced at once.
    fx.update_vip(|v| v.flags &= !VIP_QUERY_STALE);
    let c = client(6);
    fx.tx(&syn(c).build());
    assert!(fx.half_open(c).is_some());
    assert_eq!(fx.drops()[drop_index("query_pending")], 4);
}

// ---------------------------------------------------------- IP-in-IP carrier

#[test]
fn options_to_an_encap_backend_travel_in_ipip_and_nothing_else_does() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| {
        v.probe_interval = 2;
        v.score_max_age_ns = 3600 * SEC;
    });
    let (b, c) = (backend(0), client(7));
    fx.set_flags(&b, BACKEND_ACTIVE | BACKEND_ENCAP);
    let s = syn(c).seq_no(0x1234_5678);
    let out = fx.tx(&s.build());
    let snat = port_of(fx.half_open(c).unwrap().snat_port);
    // The MSS leaves room for the outer header too: a data packet with a
    // 124 or 125 still fits once wrapped.
    let mut clamped = s.clone();
    clamped.tcp_options = mss_option(SYN_MSS - 16 - 20).to_vec();
    assert_eq!(out, ipip(&forwarded_with(&clamped, &b, snat, &tuple_option(&s, &b, snat))), "155 wrapped");
    // The ACK asks for the score (the backend is new): wrapped too.
    let a = ack(c);
    let out = fx.tx(&a.build());
    let inner = [&out[..ETH_HLEN], &out[ETH_HLEN + 20..]].concat();
    let request = expect_request(&fx, &inner, c, &b, snat);
    assert_eq!(out, ipip(&forwarded_with(&a, &b, snat, &request)), "124 wrapped");
    // Without an option, a packet goes as it would to any backend.
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
    assert_eq!((fx.event("encapsulated"), fx.event("decapsulated")), (2, 0));
}

#[test]
fn a_wrapped_125_is_unwrapped_checked_and_its_packet_sent_on_plain() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    outstanding(&fx, c, NONCE);
    let good = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 77);
    let r = reply(&b, snat).ip_options(good.encode());
    assert_eq!(fx.tx(&ipip(&r.build())), returned(&r, c, vec![]));
    assert_eq!(fx.score(&b).score, 77);
    assert_eq!(fx.event("decapsulated"), 1);
    // The carrier vouches for nothing: a forged 125 inside is refused as
    // it would be without it, and its packet still goes to the client.
    outstanding(&fx, c, NONCE);
    let forged = InbandOption::auth_score(&Key(*b"not-the-real-key"), KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 1);
    let r = reply(&b, snat).ip_options(forged.encode());
    assert_eq!(fx.tx(&ipip(&r.build())), returned(&r, c, vec![]));
    assert_eq!((fx.score(&b).score, fx.event("score_bad_mac"), fx.event("decapsulated")), (77, 1, 2));
}

#[test]
fn ip_in_ip_that_is_not_inbands_passes_untouched() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    let inner = reply(&b, snat).build();
    // Outer source other than the inner one: the host's own tunnel.
    let mut other = ipip(&inner);
    other[ETH_HLEN + 12..ETH_HLEN + 16].copy_from_slice(&[192, 0, 2, 1]);
    other[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&[0, 0]);
    let check = inband_testkit::packet::checksum(&[&other[ETH_HLEN..ETH_HLEN + 20]]);
    other[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&check.to_be_bytes());
    assert_eq!(fx.run(&other), (XDP_PASS, other.clone()));
    // An outer length that does not match what it carries.
    let mut short = ipip(&inner);
    short[ETH_HLEN + 3] -= 4;
    assert_eq!(fx.run(&short), (XDP_PASS, short.clone()));
    // Cut inside the inner header: the outer one lies about its length.
    fx.assert_dropped(&ipip(&inner)[..ETH_HLEN + 30], "malformed_ip");
    assert_eq!(fx.event("decapsulated"), 0);
}

// ---------------------------------------------------------- Maglev

impl Fixture {
    /// Writes the test VIP's Maglev table as the control plane writes it
    /// for backends 0.. weighted `w` (in table MAGLEV_TABLE, which the VIP
    /// then names); returns it.
    fn write_table(&self, w: &[u32]) -> Vec<u32> {
        let named: Vec<(String, u32)> = w.iter().enumerate().map(|(i, w)| (backend(i as u8).addr.to_string(), *w)).collect();
        let table = inband_lb::maglev::table(&named, MAGLEV_SIZE);
        for (i, slot) in table.iter().enumerate() {
            put(&self.lb.skel.maps.maglev, &(MAGLEV_TABLE * MAGLEV_SIZE + i as u32), slot);
        }
        self.update_vip(|v| v.maglev_table = MAGLEV_TABLE);
        table
    }
}

/// A dsr-rr VIP of 3 backends with policy maglev and its table written as
/// the control plane writes it (weights `w`).
fn maglev_fixture(w: [u32; 3]) -> (Fixture, Vec<u32>) {
    let fx = Fixture::lb_vip(Spec { mode: Mode::DsrRr, policy: Policy::Maglev, n: 3, ..Spec::default() });
    let table = fx.write_table(&w);
    (fx, table)
}

/// The slot the table gives client `c`'s connection (the data path's hash).
fn maglev_slot(table: &[u32], c: SocketAddr) -> u32 {
    table[(inband_lb::maglev::flow_hash(flow_key(c).as_bytes()) % u64::from(MAGLEV_SIZE)) as usize]
}

#[test]
fn maglev_sends_each_client_where_the_table_says_on_any_balancer() {
    let (a, table) = maglev_fixture([1, 1, 1]);
    let (b, _) = maglev_fixture([1, 1, 1]);
    let mut seen = [0; 3];
    for n in 1..=60 {
        let c = client(n);
        let want = maglev_slot(&table, c);
        assert_eq!(a.pick(c), backend(want as u8).id, "client {c}");
        // Another instance with the same configuration agrees: no shared state.
        assert_eq!(b.pick(c), backend(want as u8).id, "client {c} on a second balancer");
        seen[want as usize] += 1;
    }
    assert!(seen.iter().all(|n| *n > 5), "spread over the backends: {seen:?}");
}

#[test]
fn maglev_weights_and_an_ineligible_slot() {
    // Weight 0: the table never names backend 2.
    let (fx, table) = maglev_fixture([1, 1, 0]);
    assert!(!table.contains(&2));
    for n in 1..=30 {
        assert_ne!(fx.pick(client(n)), backend(2).id);
    }
    // A draining backend's connections go to the next eligible slot, not
    // all to one backend of the rest.
    let (fx, table) = maglev_fixture([1, 1, 1]);
    fx.set_flags(&backend(0), BACKEND_DRAINING);
    for n in 1..=30 {
        let c = client(n);
        let want = match maglev_slot(&table, c) {
            0 => 1,
            s => s,
        };
        assert_eq!(fx.pick(c), backend(want as u8).id, "client {c}");
    }
}

// ---------------------------------------------------------- flow query

/// `inband lb ctl flow`: for a new client side the query names the backend
/// the data path's SYN then goes to (Maglev, round-robin, least-score),
/// without taking a ticket itself; for one in the tables, the backend its
/// handshake or flow holds, with its SNAT port and what a backend now
/// down or drained means for it.
#[test]
fn the_flow_query_names_the_backend_the_data_path_uses() {
    use inband_core::net::Protocol::Tcp;
    use inband_lb::flow_query::route;
    let (fx, _) = maglev_fixture([1, 1, 1]);
    let maps = fx.lb.maps().unwrap();
    for n in 1..=20 {
        let c = client(n);
        let r = route(&maps, vip(), Tcp, c).unwrap();
        assert_eq!((r.state.as_str(), r.candidates.len()), ("new", 3), "{r:?}");
        assert!(r.why.starts_with("maglev"), "{r:?}");
        let (b, port) = fx.open(c);
        assert_eq!(r.backend, Some(b.addr), "client {c}");
        let r = route(&maps, vip(), Tcp, c).unwrap();
        assert_eq!((r.state.as_str(), r.backend, r.snat_port), ("handshake", Some(b.addr), Some(port)), "{r:?}");
        fx.tx(&ack(c).build());
        assert_eq!(route(&maps, vip(), Tcp, c).unwrap().state, "established");
    }
    // A backend taken down: its flows say what happens to them; a new
    // client side whose entry names it is sent to the next eligible slot.
    let c = client(1);
    let held = route(&maps, vip(), Tcp, c).unwrap().backend.unwrap();
    let b = (0..3).map(backend).find(|b| b.addr == held).unwrap();
    fx.set_flags(&b, BACKEND_ACTIVE | BACKEND_DOWN);
    let r = route(&maps, vip(), Tcp, c).unwrap();
    assert_eq!(r.backend, Some(held));
    assert!(r.why.contains("down by its health checks") && r.why.contains("keep"), "{r:?}");
    for n in 21..=40 {
        let c = client(n);
        let r = route(&maps, vip(), Tcp, c).unwrap();
        assert!(r.candidates.iter().any(|k| k.backend == held && !k.eligible && k.why_not.as_deref() == Some("down by its health checks")), "{r:?}");
        assert_ne!(r.backend, Some(held));
        assert_eq!(r.backend, Some(fx.open(c).0.addr), "client {c}: {r:?}");
    }

    // Round-robin: asking twice names the same backend (no ticket taken),
    // and the next SYN goes there.
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 3);
    let maps = fx.lb.maps().unwrap();
    for n in 1..=6 {
        let c = client(n);
        let first = route(&maps, vip(), Tcp, c).unwrap();
        assert_eq!(route(&maps, vip(), Tcp, c).unwrap().backend, first.backend);
        assert!(first.why.starts_with("round-robin"), "{first:?}");
        assert_eq!(first.backend, Some(fx.open(c).0.addr), "client {c}: {first:?}");
    }

    // Least-score ranks by (estimate + 1) / weight: backend 1 is the
    // lightest; in a mode without scores the policy is round-robin's.
    let fx = Fixture::lb_with(Mode::DsrPolling, Policy::LeastScore, 3);
    let maps = fx.lb.maps().unwrap();
    let now = ktime_ns();
    for (i, score) in [(0, 50), (1, 5), (2, 30)] {
        fx.set_score(&backend(i), score, now);
    }
    let r = route(&maps, vip(), Tcp, client(9)).unwrap();
    assert!(r.why.starts_with("least-score"), "{r:?}");
    assert_eq!(r.candidates.iter().map(|k| k.load_estimate).collect::<Vec<_>>(), [50, 5, 30]);
    assert_eq!((r.backend, fx.open(client(9)).0.addr), (Some(backend(1).addr), backend(1).addr));
    fx.update_vip(|v| v.mode = Mode::DsrRr as u8);
    assert!(route(&maps, vip(), Tcp, client(10)).unwrap().why.starts_with("round-robin (dsr-rr has no scores"));

    // No backend can take it; bad questions get a clear refusal.
    for i in 0..3 {
        fx.set_flags(&backend(i), BACKEND_DRAINING);
    }
    let r = route(&maps, vip(), Tcp, client(11)).unwrap();
    assert_eq!(r.backend, None);
    assert!(r.why.starts_with("no backend can take a new connection"), "{r:?}");
    let e = route(&maps, SocketAddr::new(VIP_ADDR.into(), 81), Tcp, client(1)).unwrap_err();
    assert!(format!("{e:#}").contains("no VIP 10.0.0.100:81"), "{e:#}");
    let e = route(&maps, vip(), Tcp, client6(1)).unwrap_err();
    assert!(format!("{e:#}").contains("different address families"), "{e:#}");
}

// ---------------------------------------------------------- capture

impl Fixture {
    fn capture_maps(&self) -> inband_lb::capture::CaptureMaps {
        let h = |m: &libbpf_rs::Map| libbpf_rs::MapHandle::try_from(m).unwrap();
        let m = &self.lb.skel.maps;
        inband_lb::capture::CaptureMaps { conf: h(&m.capture_conf), state: h(&m.capture_state), ring: h(&m.capture_ring) }
    }
}

/// `inband lb capture`: off until a lease is taken; then each dropped
/// frame (never a forwarded one) is recorded with its reason, at most the
/// rate a second per CPU (the rest counted), its first 256 bytes for a
/// longer one; the pcapng holds the frames byte for byte; a second
/// capture is refused while one runs, and a lease that ran out or was
/// dropped captures nothing more.
#[test]
fn dropped_frames_are_captured_with_their_reason_within_the_lease_and_the_rate() {
    use inband_lb::capture::{record, Lease, PcapOut};
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let maps = fx.capture_maps();
    fx.assert_dropped(&data(client(1)).build(), "no_flow");
    assert_eq!(maps.counters().unwrap().captured, 0, "off by default");

    let mut lease = Lease::take(&maps, 3).unwrap();
    let e = Lease::take(&maps, 3).err().unwrap();
    assert!(format!("{e:#}").contains("another capture is running"), "{e:#}");
    fx.connect(client(2));
    let mut frames: Vec<Vec<u8>> = (10..13).map(|n| data(client(n)).build()).collect();
    frames[2] = data(client(12)).payload(vec![0x5a; 600]).build();
    for f in frames.iter().chain([data(client(13)).build(), data(client(14)).build()].iter()) {
        fx.assert_dropped(f, "no_flow");
    }
    let c = maps.counters().unwrap();
    assert_eq!((c.captured, c.limited, c.lost), (3, 2, 0), "3 a second, the rest counted; the forwarded handshake not captured");

    let mut out = PcapOut::new(Vec::new(), "eth0").unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    assert_eq!(record(&maps, &mut lease, &mut out, 3, Some(5), &stop).unwrap(), 3);
    let packets = inband_testkit::pcap::packets(&out.finish().unwrap()).unwrap();
    assert_eq!(packets.len(), 3);
    for ((bytes, len, comment), f) in packets.iter().zip(&frames) {
        assert_eq!((comment.as_str(), *len as usize), ("drop: no_flow", f.len()));
        assert_eq!(bytes[..], f[..f.len().min(256)], "the frame's first bytes as it came");
    }
    assert_eq!(packets[2].0.len(), 256, "snap length");

    drop(lease);
    fx.assert_dropped(&data(client(20)).build(), "no_flow");
    assert_eq!(maps.counters().unwrap().captured, 3, "no capture once the lease is given back");
    put(&fx.lb.skel.maps.capture_conf, &0u32, &CaptureConf { until_ns: ktime_ns() - 1, per_second: 100, pad: 0 });
    fx.assert_dropped(&data(client(21)).build(), "no_flow");
    assert_eq!(maps.counters().unwrap().captured, 3, "nor once it ran out");
}

// ---------------------------------------------------------- weights

impl Fixture {
    /// Writes weight `w[i]` into backend i's entry, as the control plane does.
    fn set_weights(&self, w: &[u32]) {
        for (i, w) in w.iter().enumerate() {
            let b = backend(i as u8);
            let mut entry: Backend = get(&self.lb.skel.maps.backends, &b.id).unwrap();
            entry.weight = *w;
            put(&self.lb.skel.maps.backends, &b.id, &entry);
        }
    }

    /// Sends `c`'s SYN; returns where the balancer sent it (from the bytes).
    #[track_caller]
    fn sent_to(&self, c: SocketAddr) -> SocketAddr {
        parse(&self.tx(&syn(c).build())).expect("a TCP frame").dst
    }
}

/// A two-backend VIP of a scored mode: power-of-two always draws both, so
/// it ranks them as least-score does. Reports do not age here.
fn two_weighed(policy: Policy, w: [u32; 2]) -> Fixture {
    let fx = Fixture::lb_with(Mode::DsrPolling, policy, 2);
    fx.update_vip(|v| v.score_max_age_ns = 3600 * SEC);
    fx.set_weights(&w);
    fx
}

/// The backend index the SYN of client `n` goes to when the two backends
/// report `est` (connections since the report reset).
fn pick_with(fx: &Fixture, est: [u32; 2], n: u8) -> u32 {
    let now = ktime_ns();
    fx.set_score(&backend(0), est[0], now);
    fx.set_score(&backend(1), est[1], now);
    fx.pick(client(n)) - backend(0).id
}

#[test]
fn least_score_and_power_of_two_rank_by_load_per_weight() {
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        let name = policy.name();
        let fx = two_weighed(policy, [1, 4]);
        for n in 1..=10 {
            assert_eq!(pick_with(&fx, [1, 3], n), 1, "{name}: (3+1)/4 < (1+1)/1");
            assert_eq!(pick_with(&fx, [1, 9], n + 10), 0, "{name}: (9+1)/4 > (1+1)/1: the weight is not all");
        }
        // Equal weights, whatever they are: the lower estimate, as before
        // weights. 0 counts as 1.
        for w in [[1, 1], [4, 4], [0, 1]] {
            fx.set_weights(&w);
            for n in 21..=30 {
                assert_eq!(pick_with(&fx, [1, 3], n), 0, "{name}: weights {w:?}");
                assert_eq!(pick_with(&fx, [3, 1], n + 10), 1, "{name}: weights {w:?}");
            }
        }
        // (1+1)/1 = (3+1)/2: a tie, so they take turns.
        fx.set_weights(&[1, 2]);
        let turns: Vec<u32> = (41..=50).map(|n| pick_with(&fx, [1, 3], n)).collect();
        for w in turns.windows(2) {
            assert_ne!(w[0], w[1], "{name}: {turns:?}");
        }
    }
}

#[test]
fn idle_backends_go_to_the_largest_weight_then_in_proportion() {
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        let name = policy.name();
        let fx = two_weighed(policy, [1, 3]);
        for n in 1..=10 {
            assert_eq!(pick_with(&fx, [0, 0], n), 1, "{name}: (0+1)/3 < (0+1)/1, no tie");
        }
        // Left to count their connections from idle: each pick takes the
        // lowest (o+1)/w and raises it by 1/w, so no backend's rank minus
        // its step ever exceeds the other's rank: 3·o0 <= o1 + 1 and
        // o1 <= 3·o0 + 3. With o0 + o1 = 40 only (10, 30) satisfies both.
        pick_with(&fx, [0, 0], 11);
        for n in 12..=50 {
            fx.pick(client(n));
        }
        let (o0, o1) = (fx.score(&backend(0)).opened, fx.score(&backend(1)).opened);
        assert_eq!((o0, o1), (10, 30), "{name}");
    }
}

/// A dsr-rr round-robin VIP of backends weighted `w`, with its table and
/// flag as the control plane writes them for weights that differ.
fn weighted_round_robin(w: &[u32]) -> (Fixture, Vec<u32>) {
    let fx = Fixture::lb_vip(Spec { mode: Mode::DsrRr, policy: Policy::RoundRobin, n: w.len() as u8, ..Spec::default() });
    fx.set_weights(w);
    let table = fx.write_table(w);
    fx.update_vip(|v| v.flags |= VIP_WEIGHTED);
    (fx, table)
}

#[test]
fn weighted_round_robin_walks_the_maglev_table_in_turn() {
    let (fx, table) = weighted_round_robin(&[1, 3]);
    // Ticket k takes entry k: one turn of the table (251 SYNs) meets every
    // entry once, so the split is the table's, which gives the weight-3
    // backend three entries each time the weight-1 one gets one (maglev.rs):
    // 251/4 = 62.75 for the light one, to one entry.
    let sent: Vec<SocketAddr> = (1..=MAGLEV_SIZE).map(|n| fx.sent_to(client(n as u8))).collect();
    let want: Vec<SocketAddr> = table.iter().map(|s| backend(*s as u8).addr).collect();
    assert_eq!(sent, want, "ticket k goes where entry k says");
    let light = sent.iter().filter(|a| **a == backend(0).addr).count();
    assert!((62..=64).contains(&light), "{light} of 251 to the weight-1 backend");
    // Interleaved, not in blocks: the weight-1 backend comes up in every
    // stretch of 20 (a block of 3/4 of the table would go 188 without it).
    assert!(sent.windows(20).all(|w| w.contains(&backend(0).addr)), "{sent:?}");

    // An ineligible entry passes to the next eligible slot, as under Maglev.
    let (fx, table) = weighted_round_robin(&[1, 3, 2]);
    fx.set_flags(&backend(1), BACKEND_DRAINING);
    for n in 1..=40u8 {
        let want = match table[usize::from(n) - 1] {
            1 => 2,
            s => s,
        };
        assert_eq!(fx.sent_to(client(n)), backend(want as u8).addr, "ticket {}", n - 1);
    }
}

#[test]
fn round_robin_without_the_weighted_flag_takes_slots_in_turn_whatever_the_weights() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    fx.set_weights(&[1, 3]);
    fx.write_table(&[1, 3]);
    let ids: Vec<u32> = (1..=6).map(|n| fx.pick(client(n))).collect();
    let (b0, b1) = (backend(0).id, backend(1).id);
    assert_eq!(ids, [b0, b1, b0, b1, b0, b1]);
}

/// An lb.toml whose VIP is the test VIP with backends 0..3 weighted `w`.
fn weighted_config(mode: &str, policy: &str, w: [u32; 3]) -> inband_lb::config::LbConfig {
    let mut text = format!(
        "interface = \"lo\"\naddress = \"{LB_ADDR}\"\nmaglev_table_size = {MAGLEV_SIZE}\n[auth]\nmode = \"none\"\n\
         [[vip]]\naddress = \"{VIP_ADDR}\"\nport = {VIP_PORT}\nmode = \"{mode}\"\npolicy = \"{policy}\"\n"
    );
    for (i, w) in w.iter().enumerate() {
        let b = backend(i as u8).addr;
        text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = {}\nweight = {w}\n", b.ip(), b.port());
    }
    inband_lb::config::LbConfig::parse(&text).unwrap()
}

/// Fills in the backends' MACs as the daemon's neighbour resolver would.
fn resolve(fx: &Fixture, maps: &inband_lb::tables::LbMaps) {
    for v in inband_lb::tables::read(maps).unwrap() {
        for (id, mut entry) in v.slots {
            let ep = inband_lb::tables::backend_endpoint(&entry);
            entry.mac = (0..3).map(backend).find(|b| b.addr == ep).unwrap().mac;
            put(&fx.lb.skel.maps.backends, &id, &entry);
        }
    }
}

#[test]
fn the_control_plane_writes_weights_the_flag_and_the_table_and_weight_0_takes_nothing() {
    use inband_lb::{balancer, tables};
    let fx = Fixture::new();
    let maps = fx.lb.maps().unwrap();
    let mut cfg = weighted_config("dsr-rr", "round-robin", [1, 3, 0]);
    tables::apply(&maps, &cfg.vips, 0, MAGLEV_SIZE, false).unwrap();
    resolve(&fx, &maps);
    let v = tables::read(&maps).unwrap().remove(0);
    assert_ne!(v.vip.flags & VIP_WEIGHTED, 0, "weights 1 and 3 differ");
    let written: Vec<(u32, u16)> = v.slots.iter().map(|(_, b)| (b.weight, b.flags)).collect();
    assert_eq!(written, [(1, BACKEND_ACTIVE), (3, BACKEND_ACTIVE), (0, BACKEND_DRAINING)], "weight 0 is written drained");
    let named: Vec<(String, u32)> = (0..3).map(|i| (backend(i).addr.to_string(), [1, 3, 0][i as usize])).collect();
    let table = inband_lb::maglev::table(&named, MAGLEV_SIZE);
    let ring: Vec<u32> = (0..MAGLEV_SIZE).map(|i| get(&fx.lb.skel.maps.maglev, &(v.vip.maglev_table * MAGLEV_SIZE + i)).unwrap()).collect();
    assert_eq!(ring, table, "a weighted round-robin VIP gets its table");
    for n in 1..=40u8 {
        assert_eq!(fx.sent_to(client(n)), backend(table[usize::from(n) - 1] as u8).addr);
    }
    let status = inband_lb::snapshot::take("lo", &maps).unwrap();
    let shown: Vec<u32> = status.vips[0].backends.iter().map(|b| b.weight).collect();
    assert_eq!((status.vips[0].weighted, shown), (true, vec![1, 3, 0]));
    assert!(inband_lb::snapshot::render_table(&status).contains("policy round-robin (weighted)"));

    // Weight 0 takes no new connection in any policy.
    for (i, (mode, policy)) in [("dsr-polling", "least-score"), ("dsr-polling", "power-of-two"), ("dsr-rr", "maglev")].iter().enumerate() {
        let cfg = weighted_config(mode, policy, [1, 3, 0]);
        tables::apply(&maps, &cfg.vips, 0, MAGLEV_SIZE, false).unwrap();
        let from = 50 + 30 * i as u8;
        let sent: Vec<SocketAddr> = (from..from + 30).map(|n| fx.sent_to(client(n))).collect();
        assert!(!sent.contains(&backend(2).addr), "{policy}: {sent:?}");
    }

    // set-weights through the control request: one apply, the flag gone
    // with the differences, the weight-0 backend back in service.
    let req = inband_core::lb_control::ControlRequest::SetWeights {
        vip: vip(),
        protocol: inband_core::net::Protocol::Tcp,
        weights: (0..3).map(|i| (backend(i).addr, 2)).collect(),
    };
    cfg = balancer::next_config(&cfg, &req, std::path::Path::new("/nonexistent")).unwrap();
    tables::apply(&maps, &cfg.vips, 0, MAGLEV_SIZE, false).unwrap();
    let v = tables::read(&maps).unwrap().remove(0);
    assert_eq!(v.vip.flags & VIP_WEIGHTED, 0);
    assert!(v.slots.iter().all(|(_, b)| b.weight == 2 && b.flags == BACKEND_ACTIVE));
    let mut per = [0; 3];
    for n in 200..230u8 {
        let to = fx.sent_to(client(n));
        per[(0..3).position(|i| backend(i).addr == to).unwrap()] += 1;
    }
    assert_eq!(per, [10, 10, 10], "plain round-robin again");
}

// ------------------------------------------------- scale-out behind ECMP

const ROUTER_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const COND_SID: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x51, 0, 0, 0, 0, 0, 0xb);
const DIRECT_SID: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x51, 0, 0, 0, 0, 0, 0xd);
const SHADOW_SID: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 5);

/// An IPv6 dsr-rr VIP on an instance with `[scale_out]`.
fn scaled_out() -> Fixture {
    let fx = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrRr, n: 2, ..Spec::default() });
    fx.config(|c| {
        c.cond_sid = be_ip(COND_SID.into());
        c.direct_sid = be_ip(DIRECT_SID.into());
        c.shadow_sid = be_ip(SHADOW_SID.into());
    });
    fx
}

/// The client packet `p` as the router delivers it to `sid`.
fn via(sid: Ipv6Addr, p: &PacketBuilder) -> Vec<u8> {
    srv6((ROUTER_MAC, LB_MAC), ROUTER6, sid, &p.build_ip(), 0, false)
}

/// What an instance sends back to the router for a stray `inner`: plain
/// IPv6-in-IPv6 (or IPv4-in-IPv6) from its own address to the shadow SID `to`.
fn chained_to(to: Ipv6Addr, inner: &[u8]) -> Vec<u8> {
    let mut f = ROUTER_MAC.to_vec();
    f.extend_from_slice(&LB_MAC);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&(inner.len() as u16).to_be_bytes());
    f.extend_from_slice(&[frames::inner_proto(inner), 64]);
    f.extend_from_slice(&LB6_ADDR.octets());
    f.extend_from_slice(&to.octets());
    f.extend_from_slice(inner);
    f
}

/// The router's liveness probe: an ICMPv6 echo request to the direct SID
/// is answered by the program itself (MACs and addresses swapped, type
/// 129, a valid checksum), so a reply says the instance's XDP runs; to the
/// conditional SID it is refused as before, and to any other address it
/// is the kernel's. Before, the direct SID dropped it (`srv6_unsupported`).
#[test]
fn an_echo_request_to_the_direct_sid_is_answered_by_the_program() {
    let fx = scaled_out();
    let ping = icmp6_error(ROUTER6, DIRECT_SID, (128, 0), 0x1b50_0007, b"inband liveness");
    let (verdict, out) = fx.run(&ping);
    assert_eq!(verdict, XDP_TX);
    assert_eq!((&out[0..6], &out[6..12]), (&CLIENT_MAC[..], &LB_MAC[..]));
    assert_eq!(out[14 + 7], 64, "hop limit");
    let (src, dst, kind, id_seq, data, ok) = read_icmp6(&out);
    assert_eq!((src, dst, kind, id_seq, data.as_slice(), ok), (DIRECT_SID, ROUTER6, 129, 0x1b50_0007, &b"inband liveness"[..], true));
    assert_eq!(fx.event("sid_echo"), 1);
    fx.assert_dropped(&icmp6_error(ROUTER6, COND_SID, (128, 0), 1, b"x"), "srv6_unsupported");
    assert_eq!(fx.run(&icmp6_error(ROUTER6, LB6_ADDR, (128, 0), 1, b"x")).0, XDP_PASS);
    assert_eq!(fx.event("sid_echo"), 1);
}

#[test]
fn srv6_to_an_instance_is_unwrapped_and_balanced_as_if_it_came_straight() {
    let fx = scaled_out();
    let c = client6(1);
    let s = syn(c);
    let out = fx.tx(&via(COND_SID, &s));
    let f = fx.half_open(c).expect("a handshake");
    let (b, snat) = (fx.backend_of(u32::from(f.backend_id)), port_of(f.snat_port));
    assert_eq!(out, forwarded_dsr_syn(&s, &b, snat));
    // The return next hop is the router, whose frame it was.
    assert_eq!(f.client_mac, ROUTER_MAC);
    let a = ack(c);
    assert_eq!(fx.tx(&via(COND_SID, &a)), forwarded(&a, &b, snat, vec![]));
    // encap.red (no SRH) is the same packet, and so is one chained to the
    // direct SID by another instance's shadow table.
    let d = data(c);
    let plain = srv6((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, &d.build_ip(), 0, true);
    assert_eq!(fx.tx(&plain), forwarded(&d, &b, snat, vec![]));
    assert_eq!(fx.tx(&via(DIRECT_SID, &d)), forwarded(&d, &b, snat, vec![]));
    assert_eq!((fx.event("srv6_cond"), fx.event("srv6_direct"), fx.event("chained")), (3, 1, 0));
}

#[test]
fn a_tcp_packet_without_a_connection_here_is_chained_to_the_shadow_sid_once() {
    let fx = scaled_out();
    let c = client6(2);
    for p in [data(c), ack(c), data(c).flags(TCP_RST)] {
        // Back to the router, in plain IPv6-in-IPv6 from the instance's
        // own address to the shadow SID; the packet inside untouched.
        assert_eq!(fx.tx(&via(COND_SID, &p)), chained_to(SHADOW_SID, &p.build_ip()));
    }
    assert_eq!(fx.event("chained"), 3);
    assert_eq!(fx.half_open_count() + fx.flow_count(), 0, "a stray opens nothing");
    // From the direct SID it was chained already: it ends here.
    fx.assert_dropped(&via(DIRECT_SID, &data(c)), "chained_no_flow");
    // Without [scale_out] nothing is unwrapped, nothing chained.
    let plain = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrRr, n: 2, ..Spec::default() });
    plain.assert_passed_untouched(&via(COND_SID, &data(c)));
    plain.assert_dropped(&data(c).build(), "no_flow");
    assert_eq!(plain.event("chained"), 0);
}

#[test]
fn a_handshake_split_across_instances_completes_on_the_one_that_saw_the_syn() {
    // The router's next hops changed between the SYN and the ACK: the new
    // instance chains the ACK, the old one gets it at its direct SID.
    let (old, new) = (scaled_out(), scaled_out());
    let c = client6(3);
    old.tx(&via(COND_SID, &syn(c)));
    let chained = new.tx(&via(COND_SID, &ack(c)));
    assert_eq!(new.event("chained"), 1);
    // What the router's shadow table makes of it: End.DT6 takes the outer
    // header off, the route to the old instance puts an SRv6 one to its
    // direct SID on.
    let inner = &chained[ETH_HLEN + 40..];
    let (b, snat) = {
        let f = old.half_open(c).unwrap();
        (old.backend_of(u32::from(f.backend_id)), port_of(f.snat_port))
    };
    let delivered = srv6((ROUTER_MAC, LB_MAC), ROUTER6, DIRECT_SID, inner, 0, false);
    assert_eq!(old.tx(&delivered), forwarded(&ack(c), &b, snat, vec![]));
    assert!(old.flow(c).is_some(), "the handshake completed where it began");
    assert!(new.flow(c).is_none() && new.half_open(c).is_none());
}

#[test]
fn a_later_connection_on_a_closing_tuple_is_chained_not_sent_to_the_old_backend() {
    // A client reused its port while this instance still holds the old
    // connection's closing flow; the new SYN reached another instance
    // (the router's set changed). The new connection's packets that the
    // router sends here must take the shadow path to that instance, not
    // the old backend's TIME-WAIT socket (bench.scaleout hung downloads so).
    let fx = scaled_out();
    let c = client6(6);
    // The FIN near the top of the sequence space: the test crosses the wrap.
    let fin_seq = 0xffff_ff00u32;
    let (b, snat) = fx.connect_at(c, fin_seq - 20_000);
    let fin = data(c).flags(TCP_ACK | TCP_FIN).seq_no(fin_seq);
    assert_eq!(fx.tx(&via(COND_SID, &fin)), forwarded(&fin, &b, snat, vec![]));
    // The old connection's own late segments still go to its backend: the
    // last ACK (one past the FIN), a retransmitted FIN, and data retransmitted
    // from before it.
    for p in [ack(c).seq_no(fin_seq.wrapping_add(1)), fin.clone(), data(c).seq_no(fin_seq - 3000)] {
        assert_eq!(fx.tx(&via(COND_SID, &p)), forwarded(&p, &b, snat, vec![]));
    }
    // The later connection's ACK: its sequence numbers run ahead (Linux: by
    // the ISN clock, 1 per 64 ns since the old connection began).
    let later = ack(c).seq_no(fin_seq.wrapping_add(5_000_000));
    assert_eq!(fx.tx(&via(COND_SID, &later)), chained_to(SHADOW_SID, &later.build_ip()));
    assert_eq!((fx.event("later_connection"), fx.event("chained")), (1, 1));
    // Chained here by the router, it ends here like any packet without a flow.
    fx.assert_dropped(&via(DIRECT_SID, &later), "chained_no_flow");
    // The old flow is neither ended nor kept alive by it.
    let f = fx.flow(c).expect("the old connection's closing flow stays");
    assert_eq!((u32::from(f.backend_id), f.state, port_of(f.snat_port)), (b.id, FLOW_CLOSING, snat));
    assert_eq!(fx.snat_owner(&b, snat), Some(flow_key(c)));
    // Without [scale_out] nothing else can own it: dropped, not forwarded.
    let single = Fixture::lb_vip(Spec { v6: true, mode: Mode::DsrRr, n: 2, ..Spec::default() });
    let (b1, snat1) = single.connect(c);
    single.tx(&data(c).flags(TCP_ACK | TCP_RST).seq_no(7000).build());
    single.assert_dropped(&data(c).seq_no(7000 + 70_000).build(), "no_flow");
    let p = data(c).seq_no(7000 + 60_000);
    assert_eq!(single.tx(&p.build()), forwarded(&p, &b1, snat1, vec![]), "within a segment of the RST: the old connection's");
    // A flow the server closed: its client may still send, so nothing is
    // taken for a later connection.
    let other = client6(7);
    let (b2, snat2) = single.connect(other);
    single.tx(&reply(&b2, snat2).flags(TCP_ACK | TCP_FIN).build());
    assert_eq!(single.flow(other).unwrap().state, FLOW_CLOSING);
    let more = data(other).seq_no(1001 + 5_000_000);
    assert_eq!(single.tx(&more.build()), forwarded(&more, &b2, snat2, vec![]));
    assert_eq!(single.event("later_connection"), 1);
}

#[test]
fn srv6_to_our_sid_that_the_router_would_not_send_is_dropped() {
    let fx = scaled_out();
    let c = client6(4);
    let d = data(c);
    // A segment still to go: the packet is not at its end.
    fx.assert_dropped(&srv6((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, &d.build_ip(), 1, false), "srv6_unsupported");
    // IPv6 announced as IPv4 inside (next header 4).
    let mut v4 = srv6((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, &d.build_ip(), 0, true);
    v4[ETH_HLEN + 6] = 4;
    fx.assert_dropped(&v4, "malformed_ip");
    // Neither IPv6 nor IPv4 inside (UDP right after the SRH).
    let mut udp = srv6((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, &d.build_ip(), 0, true);
    udp[ETH_HLEN + 6] = 17;
    fx.assert_dropped(&udp, "srv6_unsupported");
    // Another extension header before the SRH.
    let mut chain = srv6((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, &d.build_ip(), 0, false);
    let srh_at = ETH_HLEN + 40;
    chain[ETH_HLEN + 6] = 0;
    let mut hbh = opts_header(IPPROTO_ROUTING, &[]);
    hbh.extend_from_slice(&chain[srh_at..]);
    chain.truncate(srh_at);
    chain.extend_from_slice(&hbh);
    let payload = (chain.len() - ETH_HLEN - 40) as u16;
    chain[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&payload.to_be_bytes());
    fx.assert_dropped(&chain, "srv6_unsupported");
    // SRv6 to an address that is not one of our SIDs is the kernel's.
    fx.assert_passed_untouched(&srv6((ROUTER_MAC, LB_MAC), ROUTER6, SHADOW_SID, &d.build_ip(), 0, false));
    assert_eq!(fx.half_open_count() + fx.flow_count() + fx.event("chained") as usize, 0);
}

/// An IPv4 dsr-rr VIP on an instance with `[scale_out]`: the router
/// carries it as IPv4 in IPv6 (issue 28, item 5).
fn scaled_out4() -> Fixture {
    let fx = Fixture::lb_vip(Spec { mode: Mode::DsrRr, n: 2, ..Spec::default() });
    fx.config(|c| {
        c.cond_sid = be_ip(COND_SID.into());
        c.direct_sid = be_ip(DIRECT_SID.into());
        c.shadow_sid = be_ip(SHADOW_SID.into());
    });
    fx
}

#[test]
fn ipv4_in_srv6_to_an_instance_is_unwrapped_and_balanced_as_if_it_came_straight() {
    let fx = scaled_out4();
    let c = client(21);
    let s = syn(c);
    let out = fx.tx(&via(COND_SID, &s));
    let f = fx.half_open(c).expect("a handshake");
    let (b, snat) = (fx.backend_of(u32::from(f.backend_id)), port_of(f.snat_port));
    // The same bytes as the SYN straight from the router would give: an
    // IPv4 frame to the backend.
    assert_eq!(out, forwarded_dsr_syn(&s, &b, snat));
    assert_eq!(&out[12..14], &[0x08, 0x00]);
    assert_eq!(f.client_mac, ROUTER_MAC);
    let a = ack(c);
    assert_eq!(fx.tx(&via(COND_SID, &a)), forwarded(&a, &b, snat, vec![]));
    let d = data(c);
    let plain = srv6((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, &d.build_ip(), 0, true);
    assert_eq!(fx.tx(&plain), forwarded(&d, &b, snat, vec![]));
    assert_eq!(fx.tx(&via(DIRECT_SID, &d)), forwarded(&d, &b, snat, vec![]));
    let generation_2 = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 6);
    assert_eq!(fx.tx(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, generation_2, &d.build_ip())), forwarded(&d, &b, snat, vec![]));
    assert_eq!((fx.event("srv6_cond"), fx.event("srv6_direct"), fx.event("chained")), (4, 1, 0));
    // An IPv4 header that lies about its length: dropped, nothing opened.
    let mut bad = via(COND_SID, &data(client(22)));
    let inner_at = bad.len() - data(client(22)).build_ip().len();
    bad[inner_at + 2..inner_at + 4].copy_from_slice(&[0xff, 0xff]);
    fx.assert_dropped(&bad, "malformed_ip");
    assert!(fx.half_open(client(22)).is_none() && fx.flow(client(22)).is_none());
}

#[test]
fn an_ipv4_stray_is_chained_as_ipv4_in_ipv6_to_the_shadow_sid() {
    let fx = scaled_out4();
    let c = client(23);
    for p in [data(c), ack(c), data(c).flags(TCP_RST)] {
        // IPv4 in IPv6 (next header 4) from the instance's IPv6 address,
        // the IPv4 packet inside untouched.
        let out = fx.tx(&via(COND_SID, &p));
        assert_eq!(out, chained_to(SHADOW_SID, &p.build_ip()));
        assert_eq!((&out[12..14], out[ETH_HLEN + 6]), (&[0x86, 0xdd][..], 4));
    }
    assert_eq!(fx.event("chained"), 3);
    assert_eq!(fx.half_open_count() + fx.flow_count(), 0, "a stray opens nothing");
    // The generation the router's SRH names.
    let generation_3 = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 7);
    let d = data(c);
    assert_eq!(fx.tx(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, generation_3, &d.build_ip())), chained_to(generation_3, &d.build_ip()));
    assert_eq!(fx.event("chained_named"), 1);
    fx.assert_dropped(&via(DIRECT_SID, &d), "chained_no_flow");
}

#[test]
fn from_an_older_generation_a_stray_is_chained_to_the_generation_its_srh_names() {
    let fx = scaled_out();
    let c = client6(5);
    let generation_3 = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 7);
    let d = data(c);
    let out = fx.tx(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, generation_3, &d.build_ip()));
    // The whole SRv6 header came off; the chained copy is plain
    // IPv6-in-IPv6 from the instance to that generation's SID.
    assert_eq!(out, chained_to(generation_3, &d.build_ip()));
    assert_eq!((fx.event("chained"), fx.event("chained_named")), (0, 1));
    // A connection this instance holds is balanced, whatever generation
    // brought it.
    let s = syn(c);
    fx.tx(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, generation_3, &s.build_ip()));
    let f = fx.half_open(c).expect("a handshake");
    let (b, snat) = (fx.backend_of(u32::from(f.backend_id)), port_of(f.snat_port));
    let a = ack(c);
    assert_eq!(fx.tx(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, generation_3, &a.build_ip())), forwarded(&a, &b, snat, vec![]));
    // Not one of the router's shadow SIDs (a ninth generation, the
    // client): never relayed there. Nor two segments to the direct SID,
    // which the router never sends.
    let client_addr = match c.ip() {
        IpAddr::V6(a) => a,
        IpAddr::V4(_) => unreachable!(),
    };
    for next in [Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 0xd), client_addr] {
        fx.assert_dropped(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, COND_SID, next, &d.build_ip()), "srv6_unsupported");
    }
    fx.assert_dropped(&srv6_then((ROUTER_MAC, LB_MAC), ROUTER6, DIRECT_SID, generation_3, &d.build_ip()), "srv6_unsupported");
    assert_eq!(fx.event("chained_named"), 1);
}


// ---------------------------------------------------------- health

/// The RST the balancer must send back for the client packet `p`: from the
/// VIP, no options or payload, TTL 64; seq = p's ACK, or for a packet
/// without ACK (a SYN) seq 0 and RST+ACK of everything p occupied.
fn rst_for(p: &PacketBuilder) -> Vec<u8> {
    let mut r = PacketBuilder::tcp(p.dst, p.src).macs(LB_MAC, CLIENT_MAC);
    r.ttl = 64;
    r.ip_id = 0;
    r.window = 0;
    if p.tcp_flags & TCP_ACK != 0 {
        r = r.flags(TCP_RST).seq_no(p.ack).ack_no(0);
    } else {
        let occupied = p.payload.len() as u32 + u32::from(p.tcp_flags & TCP_SYN != 0) + u32::from(p.tcp_flags & TCP_FIN != 0);
        r = r.flags(TCP_RST | TCP_ACK).seq_no(0).ack_no(p.seq.wrapping_add(occupied));
    }
    r.build()
}

#[test]
fn a_down_backend_gets_no_new_connection_in_any_policy() {
    for (mode, policy) in [
        (Mode::DsrRr, Policy::RoundRobin),
        (Mode::Passthrough, Policy::RoundRobin),
        (Mode::DsrRr, Policy::Maglev),
        (Mode::DsrRr, Policy::LeastConnections),
        (Mode::DsrDynamic, Policy::LeastScore),
        (Mode::DsrDynamic, Policy::PowerOfTwo),
    ] {
        let fx = Fixture::lb_with(mode, policy, 3);
        let table = (policy == Policy::Maglev).then(|| fx.write_table(&[1, 1, 1]));
        let down = backend(1);
        // The least-connections black hole: a refusing backend looks idle.
        fx.set_score(&backend(0), 50, ktime_ns());
        fx.set_score(&down, 0, ktime_ns());
        fx.set_score(&backend(2), 50, ktime_ns());
        fx.set_flags(&down, BACKEND_ACTIVE | BACKEND_DOWN);
        let mut got = [0u32; 3];
        for n in 1..=45 {
            let c = client(n);
            let id = fx.pick(c);
            assert_ne!(id, down.id, "{mode:?}/{policy:?}: client {c} sent to the down backend");
            got[(id - backend(0).id) as usize] += 1;
            if let Some(t) = &table {
                // Only the down backend's entries move: the rest keep theirs.
                let want = maglev_slot(t, c);
                if want != 1 {
                    assert_eq!(id, backend(want as u8).id, "{policy:?}: client {c} moved off its own backend");
                }
            }
        }
        assert!(got[0] > 5 && got[2] > 5, "{mode:?}/{policy:?}: the others share the connections: {got:?}");
        assert_eq!(fx.named_drops(), vec![], "{mode:?}/{policy:?}");
        // Back up: it takes connections again.
        fx.set_flags(&down, BACKEND_ACTIVE);
        assert!((100..=145).any(|n| fx.pick(client(n)) == down.id), "{mode:?}/{policy:?}: back in the rotation");
    }
}

#[test]
fn a_refusing_vip_answers_a_syn_no_backend_can_take_with_a_rst() {
    for v6 in [false, true] {
        let fx = Fixture::lb_vip(Spec { n: 2, v6, ..Spec::default() });
        let of = |i| if v6 { backend6(i) } else { backend(i) };
        let c = if v6 { client6(1) } else { client(1) };
        fx.set_flags(&of(0), BACKEND_ACTIVE | BACKEND_DOWN);
        fx.set_flags(&of(1), BACKEND_ACTIVE | BACKEND_DOWN);
        // Without the flag: dropped, as before.
        fx.assert_dropped(&syn(c).build(), "no_backend");
        fx.update_vip(|v| v.flags |= VIP_REFUSE_EMPTY);
        let s = syn(c);
        assert_eq!(fx.tx(&s.build()), rst_for(&s), "v6 {v6}");
        assert_eq!(fx.event("reset_no_backend"), 1);
        assert_eq!(fx.half_open_count(), 0, "no state for a refused SYN");
        // A SYN with data (TFO) is acknowledged whole.
        let tfo = syn(c).payload(b"GET /");
        assert_eq!(fx.tx(&tfo.build()), rst_for(&tfo));
        // One backend back: connections go to it again.
        fx.set_flags(&of(1), BACKEND_ACTIVE);
        assert_eq!(fx.pick(c), of(1).id);
    }
}

#[test]
fn flows_of_a_down_backend_are_reset_only_when_the_vip_says_so() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    fx.set_flags(&b, BACKEND_ACTIVE | BACKEND_DOWN);
    // on_down = keep (no VIP flag): the flow goes on to its backend.
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, snat, vec![]));
    assert!(fx.flow(c).is_some());
    // on_down = reset: the next packet gets a RST and the flow ends.
    fx.update_vip(|v| v.flags |= VIP_RESET_DOWN);
    assert_eq!(fx.tx(&d.build()), rst_for(&d));
    assert!(fx.flow(c).is_none(), "the flow ends with the reset");
    assert_eq!(fx.snat_owner(&b, snat), None, "and its port is free");
    assert_eq!(fx.event("reset_backend_down"), 1);
    assert_eq!(fx.backend_stats(&b).flows_reset, 1);
    assert_eq!(fx.backend_stats(&b).closed_conns, 1, "counted closed once");
    // A flow of a backend that is up is untouched on the same VIP.
    let (other, snat2) = fx.connect(client(2));
    assert_ne!(other.id, b.id);
    let d2 = data(client(2));
    assert_eq!(fx.tx(&d2.build()), forwarded(&d2, &other, snat2, vec![]));
}

#[test]
fn handshakes_are_counted_by_how_they_end_for_passive_health() {
    for mode in [Mode::Passthrough, Mode::DsrRr] {
        let fx = Fixture::lb_with(mode, Policy::RoundRobin, 1);
        let b = backend(0);
        // Completed.
        fx.connect(client(1));
        // Retried: the same SYN again, twice.
        fx.open(client(2));
        fx.tx(&syn(client(2)).build());
        fx.tx(&syn(client(2)).build());
        // Refused: the backend answers a SYN with a RST (back through the balancer).
        let (_, snat3) = fx.open(client(3));
        let rst = PacketBuilder::tcp(b.addr, SocketAddr::new(lb_addr(true), snat3)).macs(b.mac, LB_MAC).flags(TCP_RST | TCP_ACK);
        fx.tx(&rst.build());
        let st = fx.backend_stats(&b);
        assert_eq!((st.handshakes_completed, st.handshakes_retried, st.handshakes_refused), (1, 2, 1), "{mode:?}");
        assert!(fx.half_open(client(3)).is_none(), "the refused handshake ended");
    }
}

// ---------------------------------------------------------- scale

/// Backend `i` of a large configuration: 10.2.(i / 256).(i % 256):8080.
fn many(i: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 2, (i / 256) as u8, (i % 256) as u8)), 8080)
}

/// Client `n` of many: 192.168.(n / 250).(n % 250 + 1), a port of its own.
fn client_n(n: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, (n / 250) as u8, (n % 250 + 1) as u8)), 20000 + (n % 40000) as u16)
}

/// Applies `text` (an lb.toml) through the control plane and resolves every
/// backend's MAC as the neighbour resolver would; returns the maps.
fn apply_large(fx: &Fixture, text: &str) -> inband_lb::tables::LbMaps {
    let maps = fx.lb.maps().unwrap();
    let cfg = inband_lb::config::LbConfig::parse(text).unwrap();
    inband_lb::tables::apply(&maps, &cfg.vips, 0, MAGLEV_SIZE, false).unwrap();
    for v in inband_lb::tables::read(&maps).unwrap() {
        for (id, mut entry) in v.slots {
            entry.mac = [0x02, 0, 0, 0x0b, (id >> 8) as u8, id as u8];
            put(&fx.lb.skel.maps.backends, &id, &entry);
        }
    }
    maps
}

fn lb_toml_head() -> String {
    format!("interface = \"lo\"\naddress = \"{LB_ADDR}\"\nmaglev_table_size = {MAGLEV_SIZE}\n[auth]\nmode = \"none\"\n")
}

/// One VIP of MAX_BACKENDS_PER_VIP backends: every 5th drained, every
/// 7th taken DOWN by the health checker (which rewrites the eligible set),
/// every 13th DOWN in the backends map only (a verdict the eligible set
/// has not caught up with yet). A new connection lands on an eligible
/// backend in every policy, never on a DOWN or drained one, and the spread
/// over two SYNs per entry of the eligible set is within a stated bound:
/// round-robin gives each eligible backend two, or four after a stale
/// entry; least-score and power-of-two (two random choices above
/// INBAND_SCAN_MAX) at most the mean (rounded up, 3) + 3: the maximum of two
/// choices is about ln ln n / ln 2 ≈ 3 above the mean at n = 4,096 (4 in all
/// seen), one random choice would give about 9.
#[test]
fn a_vip_of_4096_backends_gives_new_connections_to_eligible_backends_in_bounded_spread() {
    let n = MAX_BACKENDS_PER_VIP;
    assert_eq!(n, 4096);
    for (mode, policy) in [("dsr-rr", "round-robin"), ("dsr-polling", "least-score"), ("dsr-polling", "power-of-two")] {
        let fx = Fixture::new();
        let mut text = lb_toml_head()
            + &format!("[[vip]]\naddress = \"{VIP_ADDR}\"\nport = {VIP_PORT}\nmode = \"{mode}\"\npolicy = \"{policy}\"\n");
        for i in 0..n {
            let b = many(i);
            text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = {}\ndrain = {}\n", b.ip(), b.port(), i % 5 == 0);
        }
        let maps = apply_large(&fx, &text);
        let v = inband_lb::tables::read(&maps).unwrap().remove(0);
        let id_of: std::collections::HashMap<SocketAddr, u32> =
            v.slots.iter().map(|(id, b)| (inband_lb::tables::backend_endpoint(b), *id)).collect();
        let set_down = |i: u32| {
            let mut b: Backend = get(&fx.lb.skel.maps.backends, &id_of[&many(i)]).unwrap();
            b.flags |= BACKEND_DOWN;
            put(&fx.lb.skel.maps.backends, &id_of[&many(i)], &b);
        };
        (0..n).filter(|i| i % 7 == 0).for_each(set_down);
        let checked_down = (0..n).filter(|i| i % 7 == 0).map(|i| id_of[&many(i)]).collect();
        inband_lb::tables::refresh_eligible(&maps, &checked_down).unwrap();
        (0..n).filter(|i| i % 13 == 0).for_each(set_down);
        let eligible: Vec<u32> = (0..n).filter(|i| i % 5 != 0 && i % 7 != 0 && i % 13 != 0).collect();
        let in_set = (0..n).filter(|i| i % 5 != 0 && i % 7 != 0).count();
        assert_eq!(u32::from(fx.lb.vip(v.id).unwrap().eligible_count) as usize, in_set, "{policy}: the dense set");

        // Two tickets per entry of the set: round-robin meets each twice.
        let syns = 2 * in_set as u32;
        let mean = syns.div_ceil(eligible.len() as u32);
        let mut per: std::collections::HashMap<SocketAddr, u32> = std::collections::HashMap::new();
        for c in 0..syns {
            *per.entry(fx.sent_to(client_n(c))).or_default() += 1;
        }
        let allowed: std::collections::HashSet<SocketAddr> = eligible.iter().map(|i| many(*i)).collect();
        let wrong: Vec<&SocketAddr> = per.keys().filter(|a| !allowed.contains(*a)).collect();
        assert!(wrong.is_empty(), "{policy}: new connections on DOWN or drained backends: {wrong:?}");
        assert_eq!(per.values().sum::<u32>(), syns);
        let max = *per.values().max().unwrap();
        if policy == "round-robin" {
            // The dense set in turn; a ticket on a stale entry (DOWN, not
            // yet out of the set) passes to the next, which takes one more.
            let min = eligible.iter().map(|i| per.get(&many(*i)).copied().unwrap_or(0)).min().unwrap();
            assert!(min >= 2 && max <= 4, "{policy}: spread {min}..{max}");
        } else {
            assert!(max <= mean + 3, "{policy}: a backend got {max} of {syns} (mean {mean})");
            assert!(per.len() > eligible.len() * 3 / 4, "{policy}: {} of {} backends got one", per.len(), eligible.len());
        }
    }
}

/// MAX_VIPS VIPs of 16 backends each (MAX_BACKENDS in all): every VIP takes
/// a connection to one of its own backends, and the connection's next
/// packet finds it again (a VIP id above 255 in the flow).
#[test]
fn a_thousand_vips_of_sixteen_backends_each_are_reachable() {
    assert_eq!((MAX_VIPS, MAX_BACKENDS), (1024, 16384));
    let per_vip = MAX_BACKENDS / MAX_VIPS;
    let vip_n = |v: u32| SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 100, (v / 256) as u8, (v % 256) as u8)), 80);
    let mut text = lb_toml_head();
    for v in 0..MAX_VIPS {
        text += &format!("[[vip]]\naddress = \"{}\"\nport = 80\nmode = \"dsr-rr\"\n", vip_n(v).ip());
        for j in 0..per_vip {
            let b = many(v * per_vip + j);
            text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = {}\n", b.ip(), b.port());
        }
    }
    let fx = Fixture::new();
    let maps = apply_large(&fx, &text);
    let ids: std::collections::HashMap<SocketAddr, u32> =
        inband_lb::tables::read(&maps).unwrap().iter().map(|v| (v.endpoint, v.id)).collect();
    assert_eq!(ids.len(), MAX_VIPS as usize);
    for v in 0..MAX_VIPS {
        let c = client_n(v);
        let to = |f: PacketBuilder| parse(&fx.tx(&f.build())).expect("a TCP frame").dst;
        let first = to(PacketBuilder::tcp(c, vip_n(v)).macs(CLIENT_MAC, LB_MAC).syn(SYN_MSS));
        assert!((0..per_vip).any(|j| many(v * per_vip + j) == first), "VIP {v}: {first}");
        let f: Flow = get(&fx.lb.skel.maps.half_open, &flow_key_to(c, vip_n(v), IPPROTO_TCP)).expect("half-open flow");
        assert_eq!(u32::from(f.vip_id), ids[&vip_n(v)]);
        let next = to(PacketBuilder::tcp(c, vip_n(v)).macs(CLIENT_MAC, LB_MAC).flags(TCP_ACK).seq_no(1001));
        assert_eq!(next, first, "VIP {v}: the connection's next packet");
    }
    // Status at the limits: a lookup or a few per backend, no walk of
    // anything larger (0.24 s in a debug build here).
    let started = std::time::Instant::now();
    let status = inband_lb::snapshot::take("lo", &maps).unwrap();
    let shown: usize = status.vips.iter().map(|v| v.backends.len()).sum();
    let text = inband_lb::snapshot::render_table(&status);
    let took = started.elapsed();
    assert_eq!(shown, MAX_BACKENDS as usize);
    assert!(text.contains(&many(MAX_BACKENDS - 1).to_string()));
    assert!(took < std::time::Duration::from_secs(5), "status of {shown} backends took {took:?}");
}

/// Above INBAND_SCAN_MAX backends weights still hold: the two choices are
/// drawn from the Maglev table (in proportion to weight), so a backend of
/// weight 40 among 39 of weight 1 takes about half the new connections
/// (drawn uniformly it could take at most about 2 in 40). Maglev itself
/// places each client side where the control plane's table says.
#[test]
fn a_large_weighted_vip_keeps_its_weights_and_a_large_maglev_vip_its_table() {
    let n = SCAN_MAX + 8;
    let vip_text = |mode: &str, policy: &str, w0: u32| {
        let mut text = lb_toml_head()
            + &format!("[[vip]]\naddress = \"{VIP_ADDR}\"\nport = {VIP_PORT}\nmode = \"{mode}\"\npolicy = \"{policy}\"\n");
        for i in 0..n {
            let (b, w) = (many(i), if i == 0 { w0 } else { 1 });
            text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = {}\nweight = {w}\n", b.ip(), b.port());
        }
        text
    };
    for policy in ["least-score", "power-of-two"] {
        let fx = Fixture::new();
        apply_large(&fx, &vip_text("dsr-polling", policy, 40));
        let heavy = (0..400).filter(|c| fx.sent_to(client_n(*c)) == many(0)).count();
        assert!((120..=280).contains(&heavy), "{policy}: weight 40 of 79 took {heavy} of 400");
    }
    let fx = Fixture::new();
    let maps = apply_large(&fx, &vip_text("dsr-rr", "maglev", 1));
    let named: Vec<(String, u32)> = (0..n).map(|i| (many(i).to_string(), 1)).collect();
    let table = inband_lb::maglev::table(&named, MAGLEV_SIZE);
    let v = inband_lb::tables::read(&maps).unwrap().remove(0);
    let ring: Vec<u32> = (0..MAGLEV_SIZE).map(|i| get(&fx.lb.skel.maps.maglev, &(v.vip.maglev_table * MAGLEV_SIZE + i)).unwrap()).collect();
    assert_eq!(ring, table);
    for c in 0..200 {
        let key = flow_key(client_n(c));
        let want = table[(inband_lb::maglev::flow_hash(key.as_bytes()) % u64::from(MAGLEV_SIZE)) as usize];
        assert_eq!(fx.sent_to(client_n(c)), many(want), "client {c}");
    }
}

/// The sweeper's pass over backends whose score is getting old walks the
/// slots of active dsr-dynamic VIPs, however large (and not the 4M slots
/// there could be): after one pass every backend of a 4,096-backend VIP
/// and of a VIP after it is due a probe, and none of a dsr-rr VIP's.
#[test]
fn one_sweep_marks_every_backend_of_large_dsr_dynamic_vips_due() {
    let per = [MAX_BACKENDS_PER_VIP, 16, 16];
    let mut text = lb_toml_head();
    let mut first = 0;
    for (v, (n, mode)) in per.iter().zip(["dsr-dynamic", "dsr-dynamic", "dsr-rr"]).enumerate() {
        text += &format!("[[vip]]\naddress = \"10.100.0.{}\"\nport = 80\nmode = \"{mode}\"\n", v + 1);
        for i in first..first + n {
            text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = 8080\n", many(i).ip());
        }
        first += n;
    }
    let fx = Fixture::new();
    let maps = apply_large(&fx, &text);
    let vips = inband_lb::tables::read(&maps).unwrap();
    for v in &vips {
        for (id, _) in &v.slots {
            put(&fx.lb.skel.maps.probe_due, id, &0u32);
        }
    }
    fx.lb.sweep(0).unwrap();
    for v in &vips {
        let dynamic = v.vip.mode == Mode::DsrDynamic as u8;
        let due = v.slots.iter().filter(|(id, _)| get::<u32, u32>(&fx.lb.skel.maps.probe_due, id).unwrap() & PROBE_DUE != 0).count();
        assert_eq!(due, if dynamic { v.slots.len() } else { 0 }, "VIP {} of {} backends", v.name(), v.slots.len());
    }
}

/// A VIP that starts reading a Maglev table (weighted least-score grown past
/// INBAND_SCAN_MAX backends) gets a table of its own: not the one its zero
/// `maglev_table` names, which another VIP holds.
#[test]
fn a_vip_that_starts_reading_a_maglev_table_gets_its_own() {
    // The growing VIP first: it has the lower VIP id, so it is met first.
    let config = |grown: u32| {
        let mut text = lb_toml_head() + "[[vip]]\naddress = \"10.100.0.2\"\nport = 80\nmode = \"dsr-polling\"\npolicy = \"least-score\"\n";
        for i in 0..grown {
            text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = 8080\nweight = {}\n", many(100 + i).ip(), 1 + i % 2);
        }
        text += "[[vip]]\naddress = \"10.100.0.1\"\nport = 80\nmode = \"dsr-rr\"\npolicy = \"maglev\"\n";
        for i in 0..3 {
            text += &format!("[[vip.backend]]\naddress = \"{}\"\nport = 8080\n", many(i).ip());
        }
        text
    };
    let fx = Fixture::new();
    let maps = apply_large(&fx, &config(3));
    let table_of = |maps: &inband_lb::tables::LbMaps, last: u8| {
        let v = inband_lb::tables::read(maps).unwrap().into_iter().find(|v| v.endpoint.ip() == IpAddr::V4(Ipv4Addr::new(10, 100, 0, last))).unwrap();
        v.vip.maglev_table
    };
    let maglev = table_of(&maps, 1);
    let ring = |t: u32| (0..MAGLEV_SIZE).map(|i| get::<u32, u32>(&fx.lb.skel.maps.maglev, &(t * MAGLEV_SIZE + i)).unwrap()).collect::<Vec<_>>();
    let before = ring(maglev);
    let maps = apply_large(&fx, &config(SCAN_MAX + 8));
    assert_eq!(table_of(&maps, 1), maglev, "the Maglev VIP keeps its table");
    assert_ne!(table_of(&maps, 2), maglev, "the grown VIP gets another");
    assert_eq!(ring(maglev), before, "the Maglev VIP's table is untouched");
}

// ---------------------------------------------------------------- fleet tuples

const FLEET_PREFIX: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xf1ee, 0, 0, 0, 0, 0, 0);
const FLEET_KEY: [u64; 2] = [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];

/// The fleet tuple of `c` under `key`, computed here as nat.h's try_fleet
/// must: the suffix from the hash's high word (0 becomes 1), the port as a
/// SNAT port's first candidate.
fn fleet_tuple(c: SocketAddr, key: [u64; 2]) -> SocketAddr {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&key[0].to_le_bytes());
    k[8..].copy_from_slice(&key[1].to_le_bytes());
    let h = Key(k).siphash(flow_key(c).as_bytes());
    let suffix = ((h >> 32) as u32).max(1);
    let port = (1024 + (mix32(h as u32) ^ (h >> 32) as u32) % 31744) as u16;
    SocketAddr::new(IpAddr::V6(Ipv6Addr::from(u128::from(FLEET_PREFIX) | u128::from(suffix))), port)
}

/// An instance of a fleet: the IPv6 DSR VIP with one backend, fleet tuples
/// on under `key`; `n` tells the instances apart (own address and SNAT
/// key), as two hosts differ.
fn fleet_instance(n: u8, key: [u64; 2], policy: Policy) -> Fixture {
    fleet_of(n, key, Spec { v6: true, policy, ..Spec::default() })
}

fn fleet_of(n: u8, key: [u64; 2], spec: Spec) -> Fixture {
    let fx = Fixture::lb_vip(spec);
    fx.config(|c| {
        c.self6 = be_ip(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10 + u16::from(n))));
        c.snat_key = [u64::from(n), 2];
        c.fleet_prefix = be_ip(FLEET_PREFIX.into());
        c.fleet_key = key;
    });
    fx.update_vip(|v| v.flags |= VIP_FLEET);
    fx
}

/// A DSR SYN as forwarded from `src` (a fleet or own tuple) to `b`.
fn forwarded_dsr_syn_from(p: &PacketBuilder, b: &B, src: SocketAddr) -> Vec<u8> {
    let mut e = p.clone();
    e.tcp_options = mss_option(SYN_MSS - 24).to_vec();
    let opt = InbandOption::auth_client_tuple(&KEY, KEY_ID, p.seq, Conn::tcp(src, b.addr), p.src).encode();
    let mut e = e.inband(&opt);
    e.src = src;
    e.dst = b.addr;
    e.src_mac = LB_MAC;
    e.dst_mac = b.mac;
    e.ttl -= 1;
    e.build()
}

/// Two instances of one fleet (other own addresses, other SNAT keys, the
/// same fleet key) send a connection's SYN and its data from the same
/// tuple, byte for byte: the fleet's address with the hashed suffix, the
/// hashed port, and a 155 whose MAC binds that address. A backend's answer
/// to the fleet address finds the flow. Without fleet tuples each leaves
/// from its own address and port (fleet_off_keeps_each_instances_own_tuple).
#[test]
fn two_instances_with_one_fleet_key_send_a_flow_from_the_same_tuple() {
    let (a, b_) = (fleet_instance(1, FLEET_KEY, Policy::Maglev), fleet_instance(2, FLEET_KEY, Policy::Maglev));
    let be = backend6(0);
    for n in 1..=4 {
        let c = client6(n);
        let want = fleet_tuple(c, FLEET_KEY);
        let s = syn(c);
        let (out_a, out_b) = (a.tx(&s.build()), b_.tx(&s.build()));
        assert_eq!(out_a, forwarded_dsr_syn_from(&s, &be, want), "client {n}: instance 1's SYN");
        assert_eq!(out_b, out_a, "client {n}: both instances send the same bytes");
        for fx in [&a, &b_] {
            let f = fx.half_open(c).expect("a handshake");
            assert_eq!((f.snat_index, f.fleet_suffix, port_of(f.snat_port)), (SNAT_FLEET, be_ip(want.ip()).w[3], want.port()));
            fx.tx(&ack(c).build());
        }
        let d = data(c);
        let (da, db) = (a.tx(&d.build()), b_.tx(&d.build()));
        let mut e = d.clone();
        (e.src, e.dst, e.src_mac, e.dst_mac, e.ttl) = (want, be.addr, LB_MAC, be.mac, d.ttl - 1);
        assert_eq!(da, e.build(), "client {n}: data from the fleet tuple");
        assert_eq!(db, da, "client {n}: the same data bytes from both");
        // The backend's answer to the fleet address goes back to the client.
        let r = PacketBuilder::tcp(be.addr, want).macs(be.mac, LB_MAC).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!(a.tx(&r.build()), returned(&r, c, vec![]), "client {n}: the answer finds its flow");
    }
    assert_eq!((a.event("fleet_tuples"), a.event("fleet_pinned")), (4, 0));
}

/// `frame` (Ethernet, IPv6) wrapped as an agent steers a fleet flow's
/// packet: an outer IPv6 header from `from` to `to`, next header 41.
fn steered(frame: &[u8], from: IpAddr, to: Ipv6Addr) -> Vec<u8> {
    let IpAddr::V6(from) = from else { panic!("IPv6 only") };
    let inner = &frame[14..];
    let mut out = frame[..14].to_vec();
    out.extend_from_slice(&[0x60, 0, 0, 0]);
    out.extend_from_slice(&(inner.len() as u16).to_be_bytes());
    out.extend_from_slice(&[41, 64]);
    out.extend_from_slice(&from.octets());
    out.extend_from_slice(&to.octets());
    out.extend_from_slice(inner);
    out
}

/// A fleet flow's answers reach the instance that holds it: its SYN's 155
/// leaves with the instance's flow label (the agent steers by it; a packet
/// without an option carries none), and the backend's packet to the
/// fleet address that the agent wrapped to the instance's own address is
/// unwrapped and goes to the client as if it had come straight. Steered
/// for a fleet tuple held by no connection here it is dropped
/// (`steered_not_owner`); a wrapping whose inner source is not the outer
/// one is not an agent's, and goes to the kernel untouched.
#[test]
fn a_fleet_flows_packet_steered_to_its_instance_is_taken_there() {
    let fx = fleet_instance(1, FLEET_KEY, Policy::RoundRobin);
    fx.config(|c| c.fleet_label = 0xabcde);
    let own = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x11);
    let label = |f: &[u8]| u32::from_be_bytes(f[14..18].try_into().unwrap()) & 0xfffff;
    let (be, c) = (backend6(0), client6(1));
    assert_eq!(label(&fx.tx(&syn(c).build())), 0xabcde, "the 155 names the instance");
    fx.tx(&ack(c).build());
    assert_eq!(label(&fx.tx(&data(c).build())), 0, "no option, no label");
    let answer = |to: SocketAddr| PacketBuilder::tcp(be.addr, to).macs(be.mac, LB_MAC).flags(TCP_ACK | TCP_PSH).payload(b"HTTP/1.1 200 OK\r\n\r\n");
    let r = answer(fleet_tuple(c, FLEET_KEY));
    assert_eq!(fx.tx(&steered(&r.build(), be.addr.ip(), own)), returned(&r, c, vec![]));
    assert_eq!(fx.event("fleet_steered"), 1);
    let stranger = answer(fleet_tuple(client6(2), FLEET_KEY));
    fx.assert_dropped(&steered(&stranger.build(), be.addr.ip(), own), "steered_not_owner");
    fx.assert_passed_untouched(&steered(&r.build(), backend6(1).addr.ip(), own));
    assert_eq!(fx.event("fleet_steered"), 2);
}

/// A fleet tuple's retransmitted SYN carries its 155 again, the bytes of
/// the first (counted as a retry): the agent keeps the client it learned,
/// and the server's SYN-ACK, which no instance would take at the fleet
/// address, reaches the client through it. An own tuple's retransmission
/// still goes without (retransmitted_syn_follows_its_handshake_...).
#[test]
fn a_fleet_tuples_retransmitted_syn_carries_its_155_again() {
    let fx = fleet_instance(1, FLEET_KEY, Policy::RoundRobin);
    let (c, be) = (client6(1), backend6(0));
    let s = syn(c);
    let first = fx.tx(&s.build());
    assert_eq!(first, forwarded_dsr_syn_from(&s, &be, fleet_tuple(c, FLEET_KEY)));
    assert_eq!(fx.tx(&s.build()), first, "the retransmission, byte for byte");
    assert_eq!((fx.backend_stats(&be).syn_retries, fx.event("fleet_tuples")), (1, 1));
    fx.update_vip(|v| v.flags &= !VIP_FLEET);
    let c = client6(2);
    fx.tx(&syn(c).build());
    assert!(parse(&fx.tx(&syn(c).build())).unwrap().ip_options.is_empty(), "an own tuple's retransmission: no 155");
}

/// Another fleet key gives other tuples (an outsider cannot aim at one,
/// and two fleets do not share theirs); the tuple follows the key given.
#[test]
fn another_fleet_key_gives_another_tuple() {
    let other_key = [5, 6];
    let (a, o) = (fleet_instance(1, FLEET_KEY, Policy::RoundRobin), fleet_instance(1, other_key, Policy::RoundRobin));
    let mut moved = 0;
    for n in 1..=8 {
        let c = client6(n);
        let (sa, so) = (parse(&a.tx(&syn(c).build())).unwrap().src, parse(&o.tx(&syn(c).build())).unwrap().src);
        assert_eq!((sa, so), (fleet_tuple(c, FLEET_KEY), fleet_tuple(c, other_key)), "client {n}");
        moved += usize::from(sa.ip() != so.ip() && sa.port() != so.port());
    }
    assert!(moved >= 7, "{moved} of 8 tuples moved with the key");
}

/// A fleet tuple another connection holds here (two client sides that
/// hash alike) is not shared: the new connection leaves from this
/// instance's own address and first SNAT candidate, counted fleet_pinned,
/// and the holder keeps its tuple. A backend whose path loses options gets
/// own tuples too (its SYN carries no 155 to tell the agent the client).
#[test]
fn a_fleet_tuple_held_here_falls_back_to_an_own_tuple() {
    let fx = fleet_instance(1, FLEET_KEY, Policy::RoundRobin);
    let (c, be) = (client6(1), backend6(0));
    let want = fleet_tuple(c, FLEET_KEY);
    let holder = client6(99);
    let nk = NatKey { snat_index: SNAT_FLEET, fleet_suffix: be_ip(want.ip()).w[3], ..nat_key(&be, want.port()) };
    let f = Flow {
        backend_addr: be_ip(be.addr.ip()),
        backend_port: be_port(be.addr.port()),
        snat_port: be_port(want.port()),
        snat_index: SNAT_FLEET,
        fleet_suffix: nk.fleet_suffix,
        backend_id: be.id as u16,
        vip_id: VIP_ID as u16,
        state: FLOW_ESTABLISHED,
        proto: IPPROTO_TCP,
        last_seen_ns: ktime_ns(),
        ..Default::default()
    };
    fx.put_flow(holder, &f);
    put(&fx.lb.skel.maps.snat, &nk, &SnatOwner { flow: flow_key(holder) });
    let s = syn(c);
    // fleet_instance(1): address ::11, the SNAT key candidates() assumes.
    let own = SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x11)), candidates(c)[0]);
    assert_eq!(fx.tx(&s.build()), forwarded_dsr_syn_from(&s, &be, own), "its own address and first candidate");
    let h = fx.half_open(c).expect("a handshake");
    assert_eq!((h.snat_index, h.fleet_suffix), (0, 0), "an own tuple");
    assert_eq!((fx.event("fleet_tuples"), fx.event("fleet_pinned")), (0, 1));
    assert_eq!(get::<NatKey, SnatOwner>(&fx.lb.skel.maps.snat, &nk).map(|o| o.flow), Some(flow_key(holder)), "the holder keeps it");

    let lost = fleet_instance(1, FLEET_KEY, Policy::RoundRobin);
    lost.set_flags(&be, BACKEND_ACTIVE | BACKEND_OPTIONS_LOST);
    let out = parse(&lost.tx(&s.build())).unwrap();
    assert_eq!(out.src.ip(), own.ip(), "options lost: an own tuple");
    assert!(out.ip_options.is_empty());
    assert_eq!(lost.event("fleet_pinned"), 1);
}

/// Fleet off (the VIP without VIP_FLEET, as the control plane writes it
/// when `[scale_out] fleet` is false), even with a fleet prefix and key
/// configured: each instance sends from its own address and SNAT port,
/// the bytes of today's path, and counts nothing of the fleet.
#[test]
fn fleet_off_keeps_each_instances_own_tuple() {
    let a = fleet_instance(1, FLEET_KEY, Policy::RoundRobin);
    let b_ = fleet_instance(2, FLEET_KEY, Policy::RoundRobin);
    for fx in [&a, &b_] {
        fx.update_vip(|v| v.flags &= !VIP_FLEET);
    }
    let (c, be) = (client6(1), backend6(0));
    let s = syn(c);
    let (raw_a, raw_b) = (a.tx(&s.build()), b_.tx(&s.build()));
    let (out_a, out_b) = (parse(&raw_a).unwrap(), parse(&raw_b).unwrap());
    let self_of = |n: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10 + n));
    let own = SocketAddr::new(self_of(1), candidates(c)[0]);
    assert_eq!(raw_a, forwarded_dsr_syn_from(&s, &be, own), "instance 1: today's bytes, its own tuple");
    assert_eq!(out_b.src.ip(), self_of(2));
    assert_ne!(out_a.src.port(), out_b.src.port(), "their own keys, their own ports");
    for fx in [&a, &b_] {
        assert_eq!((fx.event("fleet_tuples"), fx.event("fleet_pinned")), (0, 0));
        assert_eq!(fx.half_open(c).unwrap().snat_index, 0);
    }
}

// ---------------------------------------------------------------- adoption

/// Instance `n` of a scaled-out fleet: the IPv6 dsr-rr VIP with policy
/// maglev over 3 backends, its table as the control plane writes it (the
/// same on every instance), fleet tuples on, its SIDs, and `adopt_per_s`.
fn fleet_maglev(n: u8, adopt_per_s: u32) -> Fixture {
    let fx = fleet_of(n, FLEET_KEY, Spec { v6: true, policy: Policy::Maglev, n: 3, ..Spec::default() });
    fx.write_table(&[1, 1, 1]);
    fx.config(|c| {
        c.cond_sid = be_ip(COND_SID.into());
        c.direct_sid = be_ip(DIRECT_SID.into());
        c.shadow_sid = be_ip(SHADOW_SID.into());
        c.adopt_per_s = adopt_per_s;
    });
    fx
}

/// Instance 1 opened a connection and has died; the router's shadow
/// table delivers the connection's next segment to instance 2's direct
/// SID. Instance 2 takes it over: it sends the backend exactly the bytes
/// instance 1 would have sent (same backend, same fleet tuple), keeps an
/// established flow marked adopted, and carries the later segments on it.
/// Before (and with fleet off) the segment was dropped (chained_no_flow).
/// At the conditional SID such a segment is still chained: its owner may
/// be alive.
#[test]
fn a_stray_at_the_direct_sid_is_adopted_by_maglev() {
    let (one, two) = (fleet_maglev(1, 100), fleet_maglev(2, 100));
    for n in 1..=3 {
        let c = client6(n);
        let (b, port) = one.connect(c);
        let d = data(c);
        let sent_by_one = one.tx(&d.build());
        assert_eq!(parse(&sent_by_one).unwrap().src, fleet_tuple(c, FLEET_KEY), "client {n}: instance 1 used the fleet tuple");
        assert_eq!(two.tx(&via(DIRECT_SID, &d)), sent_by_one, "client {n}: instance 2 sends the same bytes");
        let f = two.flow(c).expect("an adopted flow");
        assert_eq!((u32::from(f.backend_id), port_of(f.snat_port), f.state), (b.id, port, FLOW_ESTABLISHED));
        assert_eq!(f.flags & c::INBAND_FLOW_ADOPTED as u8, c::INBAND_FLOW_ADOPTED as u8);
        // Its next segments, however they come, follow the flow.
        assert_eq!(two.tx(&d.build()), sent_by_one, "client {n}: carried on");
    }
    assert_eq!((two.event("adopted_maglev"), two.flow_count()), (3, 3));
    assert_eq!(two.named_drops(), vec![]);

    let c = client6(9);
    one.connect(c);
    let mut chained = chained_to(SHADOW_SID, &data(c).build_ip());
    chained[ETH_HLEN + 8..ETH_HLEN + 24].copy_from_slice(&Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x12).octets());
    assert_eq!(two.tx(&via(COND_SID, &data(c))), chained, "the conditional SID still chains (from instance 2's address)");
    assert_eq!(two.event("adopted_maglev"), 3);

    let off = fleet_maglev(2, 100);
    off.update_vip(|v| v.flags &= !VIP_FLEET);
    off.assert_dropped(&via(DIRECT_SID, &data(client6(1))), "chained_no_flow");
    assert_eq!((off.event("adopted_maglev"), off.flow_count()), (0, 0));
    // Nor a fleet VIP whose backend no hash reproduces (round-robin).
    let rr = fleet_maglev(2, 100);
    rr.update_vip(|v| v.policy = Policy::RoundRobin as u8);
    rr.assert_dropped(&via(DIRECT_SID, &data(client6(1))), "chained_no_flow");
}

/// Strays to the direct SID create flows at adopt_per_s a CPU at most: a
/// forged flood of them cannot churn the flow table faster. The rest are
/// dropped (adopt_budget); a retransmission later is adopted then.
#[test]
fn adoption_stops_at_the_budget() {
    let fx = fleet_maglev(2, 1);
    fx.tx(&via(DIRECT_SID, &data(client6(1))));
    for n in 2..=3 {
        fx.assert_dropped(&via(DIRECT_SID, &data(client6(n))), "adopt_budget");
    }
    assert_eq!((fx.event("adopted_maglev"), fx.flow_count()), (1, 1));
    let none = fleet_maglev(2, 0);
    none.assert_dropped(&via(DIRECT_SID, &data(client6(1))), "adopt_budget");
}

// ------------------------------------------------------ announced choices

/// Instance `n` of a fleet whose VIP is round-robin over 3 backends (a
/// choice no peer can recompute), marked to announce its choices as the
/// control plane marks every fleet VIP not under Maglev.
fn fleet_announcing(n: u8) -> Fixture {
    let fx = fleet_maglev(n, 100);
    fx.update_vip(|v| {
        v.policy = Policy::RoundRobin as u8;
        v.flags |= VIP_ANNOUNCE;
    });
    fx
}

/// What `fx`'s data path put in choice_ring since the last call.
fn announced(fx: &Fixture) -> Vec<ChoiceRec> {
    use std::sync::{Arc, Mutex};
    let got: Arc<Mutex<Vec<ChoiceRec>>> = Arc::default();
    let mut rb = libbpf_rs::RingBufferBuilder::new();
    let sink = Arc::clone(&got);
    rb.add(&fx.lb.skel.maps.choice_ring, move |d: &[u8]| {
        sink.lock().unwrap().push(ChoiceRec::from_bytes(d));
        0
    })
    .unwrap();
    rb.build().unwrap().consume().unwrap();
    let v = got.lock().unwrap().clone();
    v
}

/// Instance 1 opens connections of a round-robin fleet VIP and announces
/// each one's client side and backend (choice_ring); then it dies. A
/// stray of such a connection at instance 2's direct SID is dropped until
/// instance 2 holds the announced choice (`adopt_no_choice`), then adopted
/// to that backend: instance 2 sends the bytes instance 1 would have sent.
/// A choice naming a backend the VIP no longer has is not taken, and a
/// Maglev VIP announces nothing (its backend is computable).
#[test]
fn a_stray_of_a_round_robin_vip_is_adopted_to_the_backend_its_opener_announced() {
    let (one, two) = (fleet_announcing(1), fleet_announcing(2));
    let mut opened = Vec::new();
    for n in 1..=3 {
        let c = client6(n);
        let (b, _) = one.connect(c);
        opened.push((c, b));
    }
    let recs = announced(&one);
    assert_eq!(recs.len(), 3, "one record per new connection");
    for (r, (c, b)) in recs.iter().zip(&opened) {
        assert_eq!((r.key, r.backend_addr, r.backend_port), (flow_key(*c), be_ip(b.addr.ip()), be_port(b.addr.port())));
        assert!(r.opened_ns > 0 && r.opened_ns <= ktime_ns());
    }
    assert_eq!(opened.iter().map(|(_, b)| b.id).collect::<std::collections::HashSet<_>>().len(), 3, "round-robin spread them");
    // Retransmissions and the handshake's ACK announce nothing more.
    one.tx(&syn(opened[0].0).build());
    assert_eq!(announced(&one).len(), 0);

    let (c, _) = opened[2];
    two.assert_dropped(&via(DIRECT_SID, &data(c)), "chained_no_flow");
    assert_eq!(two.event("adopt_no_choice"), 1);
    for r in &recs {
        let choice = PeerChoice { backend_addr: r.backend_addr, backend_port: r.backend_port, opened_ns: ktime_ns(), ..Default::default() };
        put(&two.lb.skel.maps.peer_choices, &r.key, &choice);
    }
    for (c, b) in &opened {
        let d = data(*c);
        let sent_by_one = one.tx(&d.build());
        assert_eq!(two.tx(&via(DIRECT_SID, &d)), sent_by_one, "{c}: instance 2 sends what instance 1 sent");
        let f = two.flow(*c).expect("an adopted flow");
        assert_eq!((u32::from(f.backend_id), f.snat_index, f.flags & c::INBAND_FLOW_ADOPTED as u8), (b.id, SNAT_FLEET, c::INBAND_FLOW_ADOPTED as u8));
    }
    assert_eq!((two.event("adopted_announced"), two.event("adopted_maglev"), two.flow_count()), (3, 0, 3));

    // A choice whose backend left the VIP: the existing verdict.
    let c = client6(7);
    let gone = PeerChoice { backend_addr: be_ip("fd00:99::1".parse().unwrap()), backend_port: be_port(8080), ..Default::default() };
    put(&two.lb.skel.maps.peer_choices, &flow_key(c), &gone);
    two.assert_dropped(&via(DIRECT_SID, &data(c)), "chained_no_flow");
    assert_eq!((two.event("adopt_no_choice"), two.event("adopted_announced")), (2, 3));

    let maglev = fleet_maglev(1, 100);
    maglev.connect(client6(1));
    assert_eq!(announced(&maglev).len(), 0, "a Maglev VIP's choice is computable: not announced");
}

/// A flow move (crates/inband-lb/src/moves.rs) as the lb daemon's worker
/// handles a datagram: from `src`, under KEY. The reply's outcome, checked
/// to answer this very request; None when nothing was answered.
fn ask_move(moves: &mut inband_lb::moves::Moves, maps: &inband_lb::tables::LbMaps, src: IpAddr, datagram: &[u8]) -> Option<(inband_core::flow_move::MoveOutcome, u16)> {
    use inband_core::flow_move::decode_reply;
    let mut stats = ControlStats::default();
    let reply = moves.handle(maps, SocketAddr::new(src, 7777), datagram, &mut stats).expect("handling a move");
    inband_lb::polling::add_control_stats(maps, &stats).unwrap();
    let seq = u64::from_be_bytes(datagram.get(8..16).map_or([0; 8], |s| s.try_into().unwrap()));
    reply.map(|r| {
        let r = decode_reply(&r, &[(KEY_ID, KEY)]).expect("a reply under the request's key");
        assert_eq!(r.seq, seq, "the reply echoes the request's number");
        (r.outcome, r.source_port)
    })
}

/// The wall clock in µs, as a move's sender numbers its requests.
fn wall_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64
}

/// A live flow to backend `b` from SNAT port `port`.
fn live_flow(b: &B, port: u16) -> Flow {
    Flow {
        backend_addr: be_ip(b.addr.ip()),
        backend_port: be_port(b.addr.port()),
        snat_port: be_port(port),
        backend_id: b.id as u16,
        vip_id: VIP_ID as u16,
        state: FLOW_ESTABLISHED,
        proto: IPPROTO_TCP,
        last_seen_ns: ktime_ns(),
        ..Default::default()
    }
}

/// A live flow of client `c` to backend `b` from SNAT port `port`, with
/// its reservation: what holds that port toward `b`.
fn hold_port(fx: &Fixture, c: SocketAddr, b: &B, port: u16) {
    fx.put_flow(c, &live_flow(b, port));
    put(&fx.lb.skel.maps.snat, &nat_key(b, port), &SnatOwner { flow: flow_key(c) });
}

#[test]
fn a_moved_flow_goes_to_its_new_backend_from_a_port_free_there_and_only_its_owner_may_move_it() {
    use inband_core::flow_move::{encode_request, FlowSide, MoveOutcome, MoveRequest};
    use std::os::fd::AsFd;

    // Least-connections: the move must carry the flow's count over.
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::LeastConnections, 3);
    let b = backend(2);
    // Weight 0, as the control plane writes it: no new connections.
    fx.set_flags(&b, BACKEND_DRAINING);
    let maps = fx.lb.maps().unwrap();
    let mut moves = inband_lb::moves::Moves::new(fx.lb.skel.progs.move_counts.as_fd());
    let c = client(1);
    let (a, port) = fx.connect(c);
    assert_ne!(a, b, "weight 0 took a new connection");
    let other = if a == backend(0) { backend(1) } else { backend(0) };
    assert_eq!((fx.score(&a).opened, fx.score(&b).opened), (1, 0));

    // Sequence numbers are the sender's wall clock in µs: the balancer
    // refuses those from before it started.
    let t0 = wall_us();
    let req = |seq: u64, from: &B, to: SocketAddr| MoveRequest {
        key_id: KEY_ID,
        seq,
        flow: FlowSide { client: c, vip: vip(), proto: IPPROTO_TCP },
        from: from.addr,
        to,
    };
    let signed = |r: &MoveRequest| encode_request(r, &KEY);
    let mut ask = |src: &B, d: &[u8]| ask_move(&mut moves, &maps, src.addr.ip(), d);
    let refused = |o: MoveOutcome| Some((o, 0));

    // Dropped unanswered: a forged MAC, a truncated request, a sender
    // that is not the `from` it names.
    assert_eq!(ask(&a, &encode_request(&req(t0 + 1, &a, b.addr), &Key([0; 16]))), None);
    // Under a key id the balancer does not hold (only the named key is read).
    assert_eq!(ask(&a, &encode_request(&MoveRequest { key_id: KEY_ID + 1, ..req(t0 + 1, &a, b.addr) }, &KEY)), None);
    assert_eq!(ask(&a, &signed(&req(t0 + 1, &a, b.addr))[..99]), None);
    assert_eq!(ask(&other, &signed(&req(t0 + 1, &a, b.addr))), None);
    // Answered refusals. A number from before the balancer started (a
    // request recorded before a restart) is refused from anyone.
    assert_eq!(ask(&other, &signed(&req(t0 - 1_000_000, &other, b.addr))), refused(MoveOutcome::Refused));
    assert_eq!(ask(&other, &signed(&req(t0 + 1, &other, b.addr))), refused(MoveOutcome::NotOwner));
    assert_eq!(ask(&other, &signed(&req(t0 + 1, &other, b.addr))), refused(MoveOutcome::Refused), "a number used again");
    assert_eq!(ask(&a, &signed(&req(t0 + 5, &a, sa4(Ipv4Addr::new(10, 0, 9, 9), 80)))), refused(MoveOutcome::NotABackend));
    assert_eq!(ask(&a, &signed(&req(t0 + 6, &a, SocketAddr::new(b.addr.ip(), 80)))), refused(MoveOutcome::NotABackend), "its address, another port");
    fx.set_flags(&b, BACKEND_DRAINING | BACKEND_DOWN);
    assert_eq!(ask(&a, &signed(&req(t0 + 7, &a, b.addr))), refused(MoveOutcome::NotABackend), "a DOWN backend");
    fx.set_flags(&b, BACKEND_DRAINING);
    let mut gone = req(t0 + 8, &a, b.addr);
    gone.flow.client = client(7);
    assert_eq!(ask(&a, &signed(&gone)), refused(MoveOutcome::NoFlow));
    let f = fx.flow(c).unwrap();
    assert_eq!((u32::from(f.backend_id), fx.snat_owner(&a, port)), (a.id, Some(flow_key(c))), "nothing moved yet");

    // A second flow holds the port toward B: the moved flow gets another
    // port there, and the answer names it.
    let holder = client(9);
    hold_port(&fx, holder, &b, port);
    let moved = signed(&req(t0 + 10, &a, b.addr));
    let Some((MoveOutcome::Moved, new)) = ask(&a, &moved) else { panic!("not moved") };
    assert_ne!(new, port);
    assert!((1024..=32767).contains(&new), "{new}");
    let f = fx.flow(c).unwrap();
    assert_eq!((ip_of_addr(&f.backend_addr), port_of(f.backend_port), u32::from(f.backend_id)), (b.addr.ip(), b.addr.port(), b.id));
    assert_eq!((port_of(f.snat_port), f.state, f.vip_id), (new, FLOW_ESTABLISHED, VIP_ID as u16));
    assert_eq!((fx.snat_owner(&b, new), fx.snat_owner(&a, port)), (Some(flow_key(c)), None));
    assert_eq!(fx.snat_owner(&b, port), Some(flow_key(holder)), "the holder keeps its port");
    // The count went with the flow.
    assert_eq!((fx.score(&a).opened, fx.score(&a).closed, fx.score(&b).opened, fx.score(&b).closed), (1, 1, 1, 0));
    // The client's next segment goes to B from the new port, B's answer on
    // it goes back to the client, A's on the old one no longer does.
    let d = data(c);
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b, new, vec![]));
    let r = reply(&b, new);
    assert_eq!(fx.tx(&r.build()), returned(&r, c, vec![]));
    fx.assert_passed_untouched(&reply(&a, port).build());

    assert_eq!(ask(&a, &moved), refused(MoveOutcome::Refused), "a replayed move");
    // A retry after a lost answer learns it, and nothing changes.
    assert_eq!(ask(&a, &signed(&req(t0 + 11, &a, b.addr))), Some((MoveOutcome::Moved, new)));
    assert_eq!((port_of(fx.flow(c).unwrap().snat_port), fx.score(&b).opened), (new, 1));
    assert_eq!(ask(&a, &signed(&req(t0 + 12, &a, other.addr))), refused(MoveOutcome::NotOwner), "the old backend owns it no more");
    assert_eq!(ask(&b, &signed(&req(t0 + 13, &b, a.addr))), Some((MoveOutcome::Moved, new)), "its new owner may move it back, its port free there");
    assert_eq!(ask(&a, &signed(&req(t0 + 12, &a, b.addr))), refused(MoveOutcome::Refused), "a number refused once is used up");
    assert_eq!(ask(&a, &signed(&req(t0 + 14, &a, b.addr))), Some((MoveOutcome::Moved, new)));

    // Its end is counted where it is now: no backend is left a connection
    // it does not have.
    fx.tx(&client_end(c, TCP_FIN | TCP_ACK, 1001).build());
    assert_eq!(fx.flow(c).unwrap().state, FLOW_CLOSING);
    assert_eq!((fx.score(&a).opened, fx.score(&a).closed, fx.score(&b).opened, fx.score(&b).closed), (2, 2, 2, 2));

    let s: ControlStats = get(&fx.lb.skel.maps.control_stats, &0u32).unwrap();
    assert_eq!(
        (s.moves, s.move_malformed, s.move_bad_mac, s.move_unknown_sender, s.move_replayed),
        (4, 1, 2, 1, 4),
        "moved (one a retry's answer), malformed, bad MAC (a wrong key, a key id not held), unknown sender, replayed"
    );
    assert_eq!(
        (s.move_no_flow, s.move_not_owner, s.move_not_a_backend, s.move_port_in_use, s.move_refused),
        (1, 2, 3, 0, 0),
        "no flow, not owner, not a backend, port in use, refused otherwise"
    );
}

#[test]
fn a_move_finds_no_port_toward_a_backend_whose_every_port_is_held() {
    use inband_core::flow_move::{encode_request, FlowSide, MoveOutcome, MoveRequest};
    use std::os::fd::AsFd;

    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 3);
    let b = backend(2);
    fx.set_flags(&b, BACKEND_DRAINING);
    let maps = fx.lb.maps().unwrap();
    let mut moves = inband_lb::moves::Moves::new(fx.lb.skel.progs.move_counts.as_fd());
    let c = client(1);
    let (a, port) = fx.connect(c);
    // Every SNAT port toward B held by a live flow (one batch per table).
    let ports: Vec<u16> = (1024..=32767).collect();
    let holders: Vec<FlowKey> = ports.iter().map(|p| flow_key(sa4(Ipv4Addr::new(198, 18, (p >> 8) as u8, *p as u8), 5000))).collect();
    let flows: Vec<Flow> = ports.iter().map(|p| live_flow(&b, *p)).collect();
    inband_core::bpfmap::put_batch(&fx.lb.skel.maps.flows, &holders, &flows).unwrap();
    let keys: Vec<NatKey> = ports.iter().map(|p| nat_key(&b, *p)).collect();
    let owners: Vec<SnatOwner> = holders.iter().map(|k| SnatOwner { flow: *k }).collect();
    inband_core::bpfmap::put_batch(&fx.lb.skel.maps.snat, &keys, &owners).unwrap();

    let r = MoveRequest { key_id: KEY_ID, seq: wall_us() + 1, flow: FlowSide { client: c, vip: vip(), proto: IPPROTO_TCP }, from: a.addr, to: b.addr };
    assert_eq!(ask_move(&mut moves, &maps, a.addr.ip(), &encode_request(&r, &KEY)), Some((MoveOutcome::PortInUse, 0)));
    // Left as it was: A's flow, A's reservation, every holder's.
    let f = fx.flow(c).unwrap();
    assert_eq!((u32::from(f.backend_id), port_of(f.snat_port), fx.snat_owner(&a, port)), (a.id, port, Some(flow_key(c))));
    assert_eq!(fx.snat_owner(&b, port), Some(holders[usize::from(port - 1024)]));
    let s: ControlStats = get(&fx.lb.skel.maps.control_stats, &0u32).unwrap();
    assert_eq!((s.moves, s.move_port_in_use), (0, 1));
}

fn ip_of_addr(a: &Addr) -> IpAddr {
    inband_core::pod::ip_of(a)
}

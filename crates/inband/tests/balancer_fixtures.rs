//! BPF_PROG_TEST_RUN fixtures for bpf/balancer.bpf.c (and the bounce floor):
//! every branch of the "Balancer packet walk" and the "Flow lifecycle" in
//! docs/architecture.md, on frames built with `inband::packet` and options
//! built with `inband::wire`. Each test loads its own private instance of
//! the program (nothing pinned) and fills the maps directly, then asserts
//! the verdict, the exact output bytes, the map state and the counters.
//!
//! Needs root (loading BPF). probe_count is read back per CPU, so every
//! fixture pins its test thread to one CPU. Time is moved by
//! writing timestamps into the past, never by sleeping.

use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4};

use inband::bpf::bounce::BounceSkelBuilder;
use inband::bpf::shared as c;
use inband::lb::maps::*;
use inband::lb::private::{PrivateBalancer, XDP_DROP, XDP_PASS, XDP_TX};
use inband::lb::tables::ktime_ns;
use inband::packet::{checksum, mss_option, parse, Mac, PacketBuilder, IPPROTO_TCP, TCP_ACK, TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN};
use inband::pod::{be_addr, be_port, port_of, Pod};
use inband::wire::{Conn, InbandOption, Key};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject, ProgramInput};

const LB_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 10);
/// The balancer interface's MAC: the destination of every frame it receives.
const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x0b];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0xc1];
const VIP_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);
const VIP_PORT: u16 = 80;
/// Not 0, so a program that confuses VIP ids with slots or indexes shows it.
const VIP_ID: u32 = 3;
const SYN_MSS: u16 = 1460;
const MTU: u16 = 1500;
const KEY: Key = Key(*b"fixture-key-0001");
const KEY_ID: u8 = 7;
const SEC: u64 = 1_000_000_000;
/// The fixtures' per-VIP timeouts.
const SYN_TIMEOUT: u64 = 5 * SEC;
const IDLE_TIMEOUT: u64 = 900 * SEC;
const CLOSING_TIMEOUT: u64 = 10 * SEC;

fn vip() -> SocketAddrV4 {
    SocketAddrV4::new(VIP_ADDR, VIP_PORT)
}
fn client(n: u8) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, n), 40000 + u16::from(n))
}

/// Backend `i` of the test VIP. Ids are not slot numbers, on purpose.
#[derive(Clone, Copy, Debug, PartialEq)]
struct B {
    id: u32,
    addr: SocketAddrV4,
    mac: Mac,
}
fn backend(i: u8) -> B {
    B {
        id: 10 + u32::from(i),
        addr: SocketAddrV4::new(Ipv4Addr::new(10, 0, 1, i + 1), 8080 + u16::from(i)),
        mac: [0x02, 0, 0, 0, 0x01, i + 1],
    }
}

/// A client's SYN to the VIP, as Linux sends it (MSS option first).
fn syn(c: SocketAddrV4) -> PacketBuilder {
    PacketBuilder::tcp(c, vip()).macs(CLIENT_MAC, LB_MAC).syn(SYN_MSS)
}
/// The client's ACK that completes the handshake.
fn ack(c: SocketAddrV4) -> PacketBuilder {
    PacketBuilder::tcp(c, vip()).macs(CLIENT_MAC, LB_MAC).flags(TCP_ACK).seq_no(1001)
}
/// A client's data segment on an established connection.
fn data(c: SocketAddrV4) -> PacketBuilder {
    PacketBuilder::tcp(c, vip()).macs(CLIENT_MAC, LB_MAC).flags(TCP_ACK | TCP_PSH).seq_no(1001).payload(b"GET / HTTP/1.1\r\n\r\n")
}
/// A backend's segment back to the balancer's SNAT port.
fn reply(b: &B, snat_port: u16) -> PacketBuilder {
    PacketBuilder::tcp(b.addr, SocketAddrV4::new(LB_ADDR, snat_port))
        .macs(b.mac, LB_MAC)
        .flags(TCP_ACK | TCP_PSH)
        .payload(b"HTTP/1.1 200 OK\r\n\r\n")
}

fn conn(b: &B, snat_port: u16) -> Conn {
    Conn { lb: SocketAddrV4::new(LB_ADDR, snat_port), backend: b.addr }
}
/// The authenticated 155 the balancer must put on `syn` toward `b`.
fn tuple_option(syn: &PacketBuilder, b: &B, snat_port: u16) -> Vec<u8> {
    InbandOption::auth_client_tuple(&KEY, KEY_ID, syn.seq, conn(b, snat_port), syn.src).encode()
}

/// What the balancer must send toward `b` for the client packet `p`: NATed,
/// one hop older, with `ip_options`.
fn forwarded(p: &PacketBuilder, b: &B, snat_port: u16, ip_options: Vec<u8>) -> Vec<u8> {
    let mut e = p.clone();
    e.src = SocketAddrV4::new(LB_ADDR, snat_port);
    e.dst = b.addr;
    e.src_mac = LB_MAC;
    e.dst_mac = b.mac;
    e.ttl -= 1;
    e.ip_options = ip_options;
    e.build()
}
/// A SYN forwarded in a DSR mode: the MSS lowered by 16, option 155.
fn forwarded_dsr_syn(p: &PacketBuilder, b: &B, snat_port: u16) -> Vec<u8> {
    let mut clamped = p.clone();
    clamped.tcp_options = mss_option(SYN_MSS - 16).to_vec();
    forwarded(&clamped, b, snat_port, tuple_option(p, b, snat_port))
}
/// What the balancer must send to the client for the backend packet `p`.
fn returned(p: &PacketBuilder, c: SocketAddrV4, ip_options: Vec<u8>) -> Vec<u8> {
    let mut e = p.clone();
    e.src = vip();
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

fn vip_key() -> VipKey {
    VipKey { addr: be_addr(VIP_ADDR), port: be_port(VIP_PORT), proto: IPPROTO_TCP, pad: 0 }
}
fn flow_key(c: SocketAddrV4) -> FlowKey {
    FlowKey {
        client_addr: be_addr(*c.ip()),
        vip_addr: be_addr(VIP_ADDR),
        client_port: be_port(c.port()),
        vip_port: be_port(VIP_PORT),
        proto: IPPROTO_TCP,
        pad: [0; 3],
    }
}
fn nat_key(b: &B, snat_port: u16) -> NatKey {
    NatKey {
        backend_addr: be_addr(*b.addr.ip()),
        backend_port: be_port(b.addr.port()),
        snat_port: be_port(snat_port),
        proto: IPPROTO_TCP,
        pad: [0; 3],
    }
}

struct Fixture {
    lb: PrivateBalancer<'static>,
}

impl Fixture {
    /// A loaded balancer with authenticated options, its self address set
    /// and no VIP.
    fn new() -> Fixture {
        Fixture::with_auth(c::INBAND_AUTH_SIPHASH)
    }

    fn with_auth(auth: u32) -> Fixture {
        pin_thread_to_cpu0();
        // The skeleton borrows its object storage for as long as it lives;
        // a test's fixture lives to the end of the test.
        let storage: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
        let cfg = LbConfig { self_addr: be_addr(LB_ADDR), mtu: MTU, auth_mode: auth as u8, sign_key: KEY_ID, snat_key: [1, 2] };
        let lb = PrivateBalancer::load(storage, 262_144, &cfg).expect("load balancer");
        inband::auth::write_keys(&lb.skel.maps.auth_keys, &[(KEY_ID, KEY)]).unwrap();
        Fixture { lb }
    }

    /// One VIP with `n` ACTIVE backends (`backend(0..n)`, slot i = backend i).
    fn lb_with(mode: Mode, policy: Policy, n: u8) -> Fixture {
        Fixture::lb_auth(mode, policy, n, c::INBAND_AUTH_SIPHASH)
    }

    fn lb_auth(mode: Mode, policy: Policy, n: u8, auth: u32) -> Fixture {
        let fx = Fixture::with_auth(auth);
        let slots: Vec<u32> = (0..n).map(|i| backend(i).id).collect();
        for i in 0..n {
            fx.set_backend(&backend(i), BACKEND_ACTIVE);
        }
        let v = Vip {
            mode: mode as u8,
            policy: policy as u8,
            flags: VIP_ACTIVE,
            probe_interval: 0,
            score_max_age_ns: SEC,
            syn_timeout_ns: SYN_TIMEOUT,
            idle_timeout_ns: IDLE_TIMEOUT,
            closing_timeout_ns: CLOSING_TIMEOUT,
            ..Default::default()
        };
        fx.lb.set_vip(VIP_ID, vip_key(), &v, &slots).unwrap();
        fx
    }

    /// A backend as the control plane adds it: its first packet asks for a score.
    fn set_backend(&self, b: &B, flags: u16) {
        let entry = Backend { addr: be_addr(*b.addr.ip()), port: be_port(b.addr.port()), mac: b.mac, flags, ..Default::default() };
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

    fn config(&self, change: impl FnOnce(&mut LbConfig)) {
        let mut cfg: LbConfig = get(&self.lb.skel.maps.lb_config, &0u32).unwrap();
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

    fn flow(&self, c: SocketAddrV4) -> Option<Flow> {
        get(&self.lb.skel.maps.flows, &flow_key(c))
    }
    fn half_open(&self, c: SocketAddrV4) -> Option<Flow> {
        get(&self.lb.skel.maps.half_open, &flow_key(c))
    }
    fn put_flow(&self, c: SocketAddrV4, f: &Flow) {
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
    fn set_score(&self, b: &B, score: u32, updated_ns: u64) {
        put(&self.lb.skel.maps.scores, &b.id, &BackendScore { score, updated_ns, ..Default::default() });
    }
    fn set_score_full(&self, b: &B, score: u32, opened: u32, closed: u32, updated_ns: u64) {
        put(&self.lb.skel.maps.scores, &b.id, &BackendScore { score, opened, closed, pad: 0, updated_ns });
    }

    fn backend_stats(&self, b: &B) -> BackendStats {
        self.lb.backend_stats(b.id).unwrap()
    }

    /// The backend `id` names.
    fn backend_of(&self, id: u32) -> B {
        (0..MAX_BACKENDS_PER_VIP as u8).map(backend).find(|b| b.id == id).expect("known backend")
    }

    /// Sends `c`'s SYN; returns (backend, SNAT port) of its handshake.
    #[track_caller]
    fn open(&self, c: SocketAddrV4) -> (B, u16) {
        self.tx(&syn(c).build());
        let f = self.half_open(c).expect("half-open flow after SYN");
        (self.backend_of(u32::from(f.backend_id)), port_of(f.snat_port))
    }

    /// Opens a connection from `c` (SYN, then the ACK that completes it)
    /// and returns (backend it went to, SNAT port).
    #[track_caller]
    fn connect(&self, c: SocketAddrV4) -> (B, u16) {
        let (b, port) = self.open(c);
        self.tx(&ack(c).build());
        assert!(self.flow(c).is_some(), "established flow after the handshake");
        (b, port)
    }

    /// The backend `c`'s SYN is sent to.
    #[track_caller]
    fn pick(&self, c: SocketAddrV4) -> u32 {
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
    fn answered(&self, c: SocketAddrV4) {
        let mut f = self.flow(c).expect("a flow");
        f.flags &= !(FLOW_PROBE_OUTSTANDING | c::INBAND_FLOW_PROBE_OLD as u8);
        self.put_flow(c, &f);
    }

    /// Marks the flow of `c` as if its last packet came `ago_ns` ago (and
    /// no sweep has seen one since).
    fn age(&self, c: SocketAddrV4, ago_ns: u64) {
        if let Some(mut f) = self.flow(c) {
            f.last_seen_ns = ktime_ns() - ago_ns;
            f.seen = 0;
            self.put_flow(c, &f);
        } else {
            let mut f = self.half_open(c).expect("a flow to age");
            f.last_seen_ns = ktime_ns() - ago_ns;
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
fn non_ipv4_frames_pass_untouched() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    // An ARP request for the VIP.
    let mut arp = Vec::new();
    arp.extend_from_slice(&[0xff; 6]);
    arp.extend_from_slice(&CLIENT_MAC);
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    arp.extend_from_slice(&CLIENT_MAC);
    arp.extend_from_slice(&client(1).ip().octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&VIP_ADDR.octets());
    fx.assert_passed_untouched(&arp);
    // An IPv6 frame whose bytes after the Ethernet header would parse as a
    // TCP segment to the VIP if the EtherType were ignored.
    let mut v6 = syn(client(1)).build();
    v6[12..14].copy_from_slice(&[0x86, 0xdd]);
    fx.assert_passed_untouched(&v6);
    assert_eq!(fx.half_open_count(), 0);
}

#[test]
fn non_vip_traffic_passes_untouched() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 2);
    let c = client(1);
    let other_host = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 200), VIP_PORT);
    let vip_other_port = SocketAddrV4::new(VIP_ADDR, 443);
    // TCP to another address, TCP to the VIP address on another port, UDP to
    // the VIP's address and port, and TCP to the balancer itself that is no
    // connection of ours (its own ssh, say) — also with an IP option.
    fx.assert_passed_untouched(&PacketBuilder::tcp(c, other_host).macs(CLIENT_MAC, LB_MAC).syn(1460).build());
    fx.assert_passed_untouched(&PacketBuilder::tcp(c, vip_other_port).macs(CLIENT_MAC, LB_MAC).syn(1460).build());
    fx.assert_passed_untouched(&PacketBuilder::udp(c, vip()).macs(CLIENT_MAC, LB_MAC).payload(vec![1, 2, 3]).build());
    let to_lb = PacketBuilder::tcp(c, SocketAddrV4::new(LB_ADDR, 22)).macs(CLIENT_MAC, LB_MAC);
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
        (be_addr(*b.addr.ip()), be_port(b.addr.port()), b.id, VIP_ID, Mode::Passthrough as u8, FLOW_SYN_SENT)
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
        let opt = InbandOption::decode(&p.ip_options).unwrap();
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

#[test]
fn retransmitted_syn_follows_its_handshake_and_counts_once() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 3);
    let c = client(1);
    let (b, snat) = fx.open(c);
    let s = syn(c);
    assert_eq!(fx.tx(&s.build()), forwarded_dsr_syn(&s, &b, snat));
    let st = fx.backend_stats(&b);
    assert_eq!((st.new_conns, st.packets), (1, 2));
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
    let forged = syn(c).seq_no(900_000);
    assert_eq!(fx.tx(&forged.build()), forwarded_dsr_syn(&forged, &b, snat));
    assert_eq!(fx.event("syn_on_live_flow"), 1);
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
/// one mixed port per try.
fn candidates(c: SocketAddrV4) -> Vec<u16> {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&1u64.to_le_bytes());
    key[8..].copy_from_slice(&2u64.to_le_bytes());
    let h = Key(key).siphash(flow_key(c).as_bytes());
    let mix = |mut x: u32| {
        x ^= x >> 16;
        x = x.wrapping_mul(0x85eb_ca6b);
        x ^= x >> 13;
        x = x.wrapping_mul(0xc2b2_ae35);
        x ^ (x >> 16)
    };
    (0..16u32).map(|i| (1024 + (mix((h as u32).wrapping_add(i.wrapping_mul(0x9e37_79b9))) ^ (h >> 32) as u32) % 31744) as u16).collect()
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
fn occupy(fx: &Fixture, b: &B, port: u16, owner: SocketAddrV4, state: u32, last_seen_ns: u64) {
    let f = Flow {
        backend_addr: be_addr(*b.addr.ip()),
        backend_port: be_port(b.addr.port()),
        snat_port: be_port(port),
        backend_id: b.id as u16,
        vip_id: VIP_ID as u8,
        state,
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

fn owner_of(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(172, 16, (port >> 8) as u8, port as u8), 5555)
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

// ---------------------------------------------------------------- probes

/// The authenticated 124 the balancer put on `out` (which must carry one),
/// checked against the nonce it recorded in `c`'s flow.
#[track_caller]
fn expect_request(fx: &Fixture, out: &[u8], c: SocketAddrV4, b: &B, snat: u16) -> Vec<u8> {
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
fn outstanding(fx: &Fixture, c: SocketAddrV4, nonce: u32) {
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
    assert!(s.updated_ns + 10_000_000 >= before && s.updated_ns <= after, "updated_ns {} not in [{before}, {after}]", s.updated_ns);
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
    let stranger = B { addr: SocketAddrV4::new(Ipv4Addr::new(10, 0, 1, 66), 8080), ..b };
    let score = InbandOption::auth_score(&KEY, KEY_ID, NONCE.to_ne_bytes(), conn(&b, snat), 0).encode();
    // A 125 for no connection: unknown host, or a backend naming a port that
    // is not its connection, or the right host from another source port.
    fx.assert_dropped(&reply(&stranger, snat).ip_options(score.clone()).build(), "score_not_owner");
    fx.assert_dropped(&reply(&b, snat ^ 1).ip_options(score.clone()).build(), "score_not_owner");
    let other_port = B { addr: SocketAddrV4::new(*b.addr.ip(), 9999), ..b };
    fx.assert_dropped(&reply(&other_port, snat).ip_options(score).build(), "score_not_owner");
    // 155/124 are ours to send, never to receive.
    fx.assert_dropped(&reply(&stranger, snat).ip_options(InbandOption::ScoreRequest.encode()).build(), "unexpected_option");
    fx.assert_dropped(&reply(&stranger, snat).ip_options(InbandOption::ClientTuple(client(1)).encode()).build(), "unexpected_option");
    assert_eq!(fx.score(&b), BackendScore { opened: 1, ..Default::default() });
}

#[test]
fn bad_options_from_a_backend_are_dropped() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let (b, snat) = fx.connect(client(1));
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
    assert_eq!(fx.score(&b), BackendScore { opened: 1, ..Default::default() });
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
    let as_sent = PacketBuilder::tcp(b.addr, SocketAddrV4::new(LB_ADDR, snat)).flags(TCP_ACK).seq_no(777).payload(vec![0; 1400]);
    let mut want = icmp_error(LB_ADDR, *b.addr.ip(), FRAG_NEEDED, 1280, &as_sent.build_ip(), 28);
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
    let natted = PacketBuilder::tcp(SocketAddrV4::new(LB_ADDR, snat), b.addr)
        .flags(TCP_ACK)
        .seq_no(4242)
        .ip_options(InbandOption::auth_score_request(&KEY, KEY_ID, [1, 2, 3, 4], conn(&b, snat)).encode())
        .payload(vec![0; 1400]);
    let err = icmp_error(ROUTER, LB_ADDR, FRAG_NEEDED, 1400, &natted.build_ip(), 8);
    let out = fx.tx(&err);
    let p = &out[14..];
    assert_eq!(&out[0..6], &CLIENT_MAC);
    assert_eq!((&p[12..16], &p[16..20]), (&VIP_ADDR.octets()[..], &c.ip().octets()[..]));
    let icmp = &p[20..];
    assert_eq!(u16::from_be_bytes([icmp[6], icmp[7]]), 1400 - 16);
    let inner = &icmp[8..];
    assert_eq!((&inner[12..16], &inner[16..20]), (&c.ip().octets()[..], &VIP_ADDR.octets()[..]));
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
    let own = PacketBuilder::tcp(SocketAddrV4::new(LB_ADDR, 50000), SocketAddrV4::new(ROUTER, 22)).payload(vec![0; 10]);
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
fn least_score_breaks_ties_at_random() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 2);
    let now = ktime_ns();
    let mut seen = [0u32; 2];
    for n in 1..=40 {
        fx.set_score(&backend(0), 5, now);
        fx.set_score(&backend(1), 5, now);
        let id = fx.pick(client(n));
        seen[(id - backend(0).id) as usize] += 1;
    }
    // Always the first (or last) of equals would give 40/0; the chance of
    // that from a fair coin is 2^-39.
    assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
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
            let c = SocketAddrV4::new(Ipv4Addr::new(192, 168, 5, n), 30000);
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
    let mut other = PacketBuilder::tcp(client(1), SocketAddrV4::new(LB_ADDR, 22)).build();
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
    let to_lb = PacketBuilder::tcp(client(1), SocketAddrV4::new(LB_ADDR, 22)).build();
    fx.assert_dropped(&tagged(&to_lb, 100), "vlan");
    assert_eq!(fx.half_open_count(), 0);
    // Tagged traffic for others is the kernel's VLAN devices' business.
    let other = PacketBuilder::tcp(client(1), SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 200), 80)).build();
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

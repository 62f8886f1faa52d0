//! BPF_PROG_TEST_RUN fixtures for bpf/balancer.bpf.c (and the bounce floor):
//! every branch of the "Balancer packet walk" in docs/architecture.md, on
//! frames built with `inband::packet`. Each test loads its own program
//! instance with pinning switched off and fills the maps directly, then
//! asserts the verdict, the exact output bytes, the map state and the
//! counters.
//!
//! Needs root (loading BPF). rr_cursor and probe_count are per-CPU, so every
//! fixture pins its test thread to one CPU.

use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4};

use inband::bpf::balancer::{BalancerSkel, BalancerSkelBuilder};
use inband::bpf::bounce::BounceSkelBuilder;
use inband::lb::maps::{
    Backend, BackendScore, BackendStats, DropReason, Flow, FlowKey, LbConfig, Mode, NatBack, NatKey, Policy, Vip,
    VipKey, VipStats, BACKEND_ACTIVE, BACKEND_DRAINING, MAX_BACKENDS_PER_VIP,
};
use inband::lb::tables::ktime_ns;
use inband::packet::{mss_option, parse, Mac, PacketBuilder, IPPROTO_TCP, TCP_ACK, TCP_PSH, TCP_SYN};
use inband::pod::{be_addr, be_port, Pod};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{libbpf_sys, AsRawLibbpf, MapCore, MapFlags, OpenObject, ProgramInput};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

const LB_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 10);
/// The balancer interface's MAC: the destination of every frame it receives.
const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x0b];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0xc1];
const VIP_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);
const VIP_PORT: u16 = 80;
/// Not 0, so a program that confuses VIP ids with slots or indexes shows it.
const VIP_ID: u32 = 3;
const SYN_MSS: u16 = 1460;

fn vip() -> SocketAddrV4 {
    SocketAddrV4::new(VIP_ADDR, VIP_PORT)
}
fn client(n: u8) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, n), 40000 + u16::from(n))
}

/// Backend `i` of the test VIP. Ids are not slot numbers, on purpose.
#[derive(Clone, Copy, Debug)]
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

fn tuple_option(c: SocketAddrV4) -> Vec<u8> {
    let mut o = vec![155, 8];
    o.extend_from_slice(&c.ip().octets());
    o.extend_from_slice(&c.port().to_be_bytes());
    o
}
const SCORE_REQUEST: [u8; 4] = [124, 4, 0, 0];
fn score_option(score: u16) -> Vec<u8> {
    let s = score.to_be_bytes();
    vec![125, 4, s[0], s[1]]
}

/// A client's SYN to the VIP, as Linux sends it (MSS option first).
fn syn(c: SocketAddrV4) -> PacketBuilder {
    PacketBuilder::tcp(c, vip()).macs(CLIENT_MAC, LB_MAC).syn(SYN_MSS)
}
/// A client's data segment on an established connection.
fn data(c: SocketAddrV4) -> PacketBuilder {
    PacketBuilder::tcp(c, vip()).macs(CLIENT_MAC, LB_MAC).flags(TCP_ACK | TCP_PSH).payload(b"GET / HTTP/1.1\r\n\r\n")
}
/// A backend's segment back to the balancer's SNAT port.
fn reply(b: &B, snat_port: u16) -> PacketBuilder {
    PacketBuilder::tcp(b.addr, SocketAddrV4::new(LB_ADDR, snat_port))
        .macs(b.mac, LB_MAC)
        .flags(TCP_ACK | TCP_PSH)
        .payload(b"HTTP/1.1 200 OK\r\n\r\n")
}

/// What the balancer must send toward `b` for the client packet `p`.
fn forwarded(p: &PacketBuilder, b: &B, snat_port: u16, ip_options: Vec<u8>) -> Vec<u8> {
    let mut e = p.clone();
    e.src = SocketAddrV4::new(LB_ADDR, snat_port);
    e.dst = b.addr;
    e.src_mac = LB_MAC;
    e.dst_mac = b.mac;
    e.ip_options = ip_options;
    e.build()
}
/// A SYN forwarded in a DSR mode: option 155 and the MSS lowered by 8.
fn forwarded_dsr_syn(p: &PacketBuilder, b: &B, snat_port: u16, client: SocketAddrV4) -> Vec<u8> {
    let mut clamped = p.clone();
    clamped.tcp_options = mss_option(SYN_MSS - 8).to_vec();
    forwarded(&clamped, b, snat_port, tuple_option(client))
}
/// What the balancer must send to the client for the backend packet `p`.
fn returned(p: &PacketBuilder, c: SocketAddrV4, ip_options: Vec<u8>) -> Vec<u8> {
    let mut e = p.clone();
    e.src = vip();
    e.dst = c;
    e.src_mac = LB_MAC;
    e.dst_mac = CLIENT_MAC;
    e.ip_options = ip_options;
    e.build()
}

/// Keeps the per-CPU maps the program reads back (rr_cursor, probe_count)
/// on one CPU across the test's runs.
fn pin_thread_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t is valid; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
    }
}

struct Fixture {
    skel: BalancerSkel<'static>,
}

impl Fixture {
    /// A loaded balancer with its self address set and no VIP.
    fn new() -> Fixture {
        pin_thread_to_cpu0();
        // The skeleton borrows its object storage for as long as it lives;
        // a test's fixture lives to the end of the test.
        let storage: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = BalancerSkelBuilder::default().open(storage).expect("open balancer skeleton");
        for map in open.open_object_mut().maps_mut() {
            // LIBBPF_PIN_BY_NAME would pin under /sys/fs/bpf (and reuse what
            // a running balancer pinned there): a test owns private maps.
            // SAFETY: a NULL path clears the pin path; the map is valid.
            let rc = unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
            assert_eq!(rc, 0);
        }
        let skel = open.load().expect("load balancer (verifier)");
        let fx = Fixture { skel };
        put(&fx.skel.maps.lb_config, &0u32, &LbConfig { self_addr: be_addr(LB_ADDR), flags: 0 });
        fx
    }

    /// One VIP with `n` ACTIVE backends (`backend(0..n)`, slot i = backend i).
    fn lb_with(mode: Mode, policy: Policy, n: u8) -> Fixture {
        let fx = Fixture::new();
        for i in 0..n {
            fx.add_backend(&backend(i), u32::from(i), BACKEND_ACTIVE);
        }
        put(
            &fx.skel.maps.vips,
            &vip_key(),
            &Vip {
                id: VIP_ID,
                mode: mode as u8,
                policy: policy as u8,
                backend_count: u16::from(n),
                probe_interval: 0,
                pad: 0,
                score_max_age_ns: 1_000_000_000,
            },
        );
        fx
    }

    fn add_backend(&self, b: &B, slot: u32, flags: u16) {
        let entry = Backend { addr: be_addr(*b.addr.ip()), port: be_port(b.addr.port()), mac: b.mac, flags, pad: 0 };
        put(&self.skel.maps.backends, &b.id, &entry);
        put(&self.skel.maps.vip_backends, &(VIP_ID * MAX_BACKENDS_PER_VIP + slot), &b.id);
    }

    fn set_flags(&self, b: &B, flags: u16) {
        let mut entry: Backend = get(&self.skel.maps.backends, &b.id).unwrap();
        entry.flags = flags;
        put(&self.skel.maps.backends, &b.id, &entry);
    }

    fn update_vip(&self, change: impl FnOnce(&mut Vip)) {
        let mut v: Vip = get(&self.skel.maps.vips, &vip_key()).unwrap();
        change(&mut v);
        put(&self.skel.maps.vips, &vip_key(), &v);
    }

    fn run(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let mut out = vec![0u8; frame.len() + 256];
        let mut input = ProgramInput::default();
        input.data_in = Some(frame);
        input.data_out = Some(&mut out);
        let res = self.skel.progs.balancer.test_run(input).expect("BPF_PROG_TEST_RUN");
        let verdict = res.return_value;
        let data = res.data.expect("data out").to_vec();
        (verdict, data)
    }

    /// Runs a frame that must leave with XDP_TX; returns the frame.
    #[track_caller]
    fn tx(&self, frame: &[u8]) -> Vec<u8> {
        let (verdict, out) = self.run(frame);
        assert_eq!(verdict, XDP_TX, "verdict; drops: {:?}", self.drops());
        out
    }

    fn drops(&self) -> Vec<u64> {
        DropReason::ALL
            .iter()
            .map(|r| percpu::<u64>(&self.skel.maps.drops, *r as u32).iter().sum())
            .collect()
    }

    fn flow(&self, c: SocketAddrV4) -> Option<Flow> {
        get(&self.skel.maps.flows, &flow_key(c))
    }

    fn flow_count(&self) -> usize {
        self.skel.maps.flows.keys().count()
    }

    fn nat(&self, b: &B, snat_port: u16) -> Option<NatBack> {
        get(&self.skel.maps.nat_back, &nat_key(b, snat_port))
    }

    fn score(&self, b: &B) -> BackendScore {
        get(&self.skel.maps.scores, &b.id).unwrap()
    }

    fn set_score(&self, b: &B, score: u32, updated_ns: u64) {
        self.set_score_assigned(b, score, 0, updated_ns);
    }

    fn set_score_assigned(&self, b: &B, score: u32, assigned_since: u32, updated_ns: u64) {
        put(&self.skel.maps.scores, &b.id, &BackendScore { score, assigned_since, updated_ns });
    }

    fn backend_stats(&self, b: &B) -> BackendStats {
        percpu::<BackendStats>(&self.skel.maps.backend_stats, b.id).iter().fold(BackendStats::default(), |t, s| {
            BackendStats {
                packets: t.packets + s.packets,
                bytes: t.bytes + s.bytes,
                return_packets: t.return_packets + s.return_packets,
                return_bytes: t.return_bytes + s.return_bytes,
                new_conns: t.new_conns + s.new_conns,
                probes_sent: t.probes_sent + s.probes_sent,
                scores_received: t.scores_received + s.scores_received,
            }
        })
    }

    fn vip_stats(&self) -> VipStats {
        percpu::<VipStats>(&self.skel.maps.vip_stats, VIP_ID).iter().fold(VipStats::default(), |t, s| VipStats {
            packets: t.packets + s.packets,
            bytes: t.bytes + s.bytes,
            return_packets: t.return_packets + s.return_packets,
            return_bytes: t.return_bytes + s.return_bytes,
            new_conns: t.new_conns + s.new_conns,
        })
    }

    /// Opens a connection from `c` and returns (backend it went to, SNAT port).
    #[track_caller]
    fn connect(&self, c: SocketAddrV4) -> (B, u16) {
        self.tx(&syn(c).build());
        let f = self.flow(c).expect("flow after SYN");
        let b = (0..MAX_BACKENDS_PER_VIP as u8).map(backend).find(|b| b.id == f.backend_id).expect("known backend");
        (b, u16::from_be(f.snat_port))
    }

    /// The backend `c`'s SYN is sent to.
    #[track_caller]
    fn pick(&self, c: SocketAddrV4) -> u32 {
        self.connect(c).0.id
    }

    /// Sends `frame` (must be forwarded) and returns the client's flow after it.
    fn flow_after(&self, frame: &[u8], c: SocketAddrV4) -> Flow {
        self.tx(frame);
        self.flow(c).expect("flow")
    }

    /// Runs `frame` and asserts it is dropped, counted under `reason` only.
    #[track_caller]
    fn assert_dropped(&self, frame: &[u8], reason: DropReason) {
        let before = self.drops();
        let (verdict, _) = self.run(frame);
        let after = self.drops();
        assert_eq!(verdict, XDP_DROP, "verdict for a {} case", reason.name());
        for r in DropReason::ALL {
            let i = r as usize;
            assert_eq!(after[i] - before[i], u64::from(r == reason), "drop counter {}", r.name());
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

fn put<K: Pod, V: Pod>(map: &dyn MapCore, k: &K, v: &V) {
    map.update(k.as_bytes(), v.as_bytes(), MapFlags::ANY).expect("map update");
}
fn get<K: Pod, V: Pod>(map: &dyn MapCore, k: &K) -> Option<V> {
    map.lookup(k.as_bytes(), MapFlags::ANY).expect("map lookup").map(|b| V::from_bytes(&b))
}
fn percpu<V: Pod>(map: &dyn MapCore, key: u32) -> Vec<V> {
    map.lookup_percpu(key.as_bytes(), MapFlags::ANY).expect("per-CPU lookup").unwrap().iter().map(|b| V::from_bytes(b)).collect()
}

/// Patches the IPv4 total length (byte offsets 16-17 of the frame).
fn set_tot_len(frame: &mut [u8], len: u16) {
    frame[16..18].copy_from_slice(&len.to_be_bytes());
}

// ---------------------------------------------------------------- loading

#[test]
fn loading_pins_nothing_under_sys_fs_bpf() {
    let _fx = Fixture::new();
    for name in ["lb_config", "vips", "backends", "flows", "nat_back", "scores", "drops"] {
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
    assert_eq!(fx.flow_count(), 0);
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
    assert_eq!(fx.flow_count(), 0);
    assert_eq!(fx.vip_stats(), VipStats::default());
}

// ------------------------------------------------------------------ SYNs

#[test]
fn passthrough_syn_is_natted_without_option_or_clamp() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(1));
    let s = syn(c);
    let out = fx.tx(&s.build());

    let f = fx.flow(c).expect("flow");
    let snat = u16::from_be(f.snat_port);
    assert!((1024..=32767).contains(&snat), "SNAT port {snat}");
    assert_eq!(out, forwarded(&s, &b, snat, vec![]));
    assert_eq!(
        f,
        Flow {
            backend_addr: be_addr(*b.addr.ip()),
            backend_port: be_port(b.addr.port()),
            snat_port: be_port(snat),
            backend_id: b.id,
            vip_id: VIP_ID,
            client_mac: CLIENT_MAC,
            mode: Mode::Passthrough as u8,
            pad: 0,
            syn_seq: s.seq.to_be(),
        }
    );
    assert_eq!(
        fx.nat(&b, snat).expect("nat_back entry"),
        NatBack {
            client_addr: be_addr(*c.ip()),
            vip_addr: be_addr(VIP_ADDR),
            client_port: be_port(c.port()),
            vip_port: be_port(VIP_PORT),
            backend_id: b.id,
            vip_id: VIP_ID,
            client_mac: CLIENT_MAC,
            pad: [0; 2],
        }
    );
    let len = s.build().len() as u64;
    assert_eq!(fx.backend_stats(&b), BackendStats { packets: 1, bytes: len, new_conns: 1, ..Default::default() });
    assert_eq!(fx.vip_stats(), VipStats { packets: 1, bytes: len, new_conns: 1, ..Default::default() });
    assert_eq!(fx.score(&b).assigned_since, 0, "round-robin modes do not count assignments");
}

#[test]
fn dsr_syn_carries_the_client_tuple_and_a_clamped_mss_in_every_dsr_mode() {
    for mode in [Mode::DsrRr, Mode::DsrPolling, Mode::DsrDynamic] {
        let fx = Fixture::lb_with(mode, Policy::LeastScore, 1);
        let (b, c) = (backend(0), client(7));
        let s = syn(c);
        let out = fx.tx(&s.build());
        let f = fx.flow(c).expect("flow");
        let snat = u16::from_be(f.snat_port);
        assert_eq!(out, forwarded_dsr_syn(&s, &b, snat, c), "{}", mode.name());
        assert_eq!(f.mode, mode as u8);
        let p = parse(&out).unwrap();
        assert!(p.checksums_ok);
        assert_eq!(p.mss(), Some(SYN_MSS - 8));
        assert_eq!(fx.backend_stats(&b).new_conns, 1);
    }
}

#[test]
fn mss_at_an_odd_offset_is_clamped_with_a_valid_checksum() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(2));
    // NOP, MSS, NOP NOP NOP: the MSS value straddles two checksum words.
    let s = syn(c).tcp_options(vec![1, 2, 4, 0x05, 0xb4, 1, 1, 1]);
    let out = fx.tx(&s.build());
    let snat = u16::from_be(fx.flow(c).unwrap().snat_port);
    let clamped = s.clone().tcp_options(vec![1, 2, 4, 0x05, 0xac, 1, 1, 1]);
    assert_eq!(out, forwarded(&clamped, &b, snat, tuple_option(c)));
    assert!(parse(&out).unwrap().checksums_ok);
}

#[test]
fn syn_without_mss_option_is_forwarded_unclamped() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let (b, c) = (backend(0), client(2));
    // Window scale and SACK-permitted only: nothing to clamp.
    let s = syn(c).tcp_options(vec![3, 3, 7, 4, 2, 1, 1, 1]);
    let out = fx.tx(&s.build());
    let snat = u16::from_be(fx.flow(c).unwrap().snat_port);
    assert_eq!(out, forwarded(&s, &b, snat, tuple_option(c)));
}

#[test]
fn retransmitted_syn_follows_its_flow_and_counts_once() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 3);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    let s = syn(c);
    assert_eq!(fx.tx(&s.build()), forwarded_dsr_syn(&s, &b, snat, c));
    assert_eq!(fx.backend_stats(&b).new_conns, 1);
    assert_eq!(fx.backend_stats(&b).packets, 2);
    assert_eq!(fx.score(&b).assigned_since, 0, "round-robin modes do not count assignments");
    assert_eq!(fx.flow_count(), 1);
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
        assert_eq!((st.packets, st.new_conns, st.probes_sent), (4, 1, 0));
    }
}

#[test]
fn non_syn_without_flow_is_dropped_as_no_flow() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    fx.assert_dropped(&data(client(1)).build(), DropReason::NoFlow);
    // A SYN-ACK is no connection opening either.
    let synack = syn(client(1)).flags(TCP_SYN | TCP_ACK).build();
    fx.assert_dropped(&synack, DropReason::NoFlow);
    assert_eq!(fx.flow_count(), 0);
}

// ---------------------------------------------------------------- probes

#[test]
fn dsr_dynamic_adds_a_score_request_on_every_nth_packet() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| v.probe_interval = 3);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    let d = data(c);
    for n in 1..=7 {
        let want = if n % 3 == 0 { SCORE_REQUEST.to_vec() } else { vec![] };
        let out = fx.tx(&d.build());
        assert_eq!(out, forwarded(&d, &b, snat, want), "packet {n} after the SYN");
        assert!(parse(&out).unwrap().checksums_ok);
    }
    assert_eq!(fx.backend_stats(&b).probes_sent, 2);
    assert_eq!(fx.backend_stats(&b).packets, 8);
}

#[test]
fn probe_counter_is_per_backend_across_connections() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    fx.update_vip(|v| v.probe_interval = 2);
    let (b, snat1) = fx.connect(client(1));
    let (_, snat2) = fx.connect(client(2));
    let (d1, d2) = (data(client(1)), data(client(2)));
    assert_eq!(fx.tx(&d1.build()), forwarded(&d1, &b, snat1, vec![]));
    assert_eq!(fx.tx(&d2.build()), forwarded(&d2, &b, snat2, SCORE_REQUEST.to_vec()));
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

#[test]
fn score_reply_is_recorded_stripped_and_translated_to_the_client() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    assert_eq!(fx.score(&b).assigned_since, 1);
    let r = reply(&b, snat).ip_options(score_option(4242));
    let before = ktime_ns();
    let out = fx.tx(&r.build());
    let after = ktime_ns();

    assert_eq!(out, returned(&r, c, vec![]));
    let s = fx.score(&b);
    assert_eq!((s.score, s.assigned_since), (4242, 0));
    assert!((before..=after).contains(&s.updated_ns), "updated_ns {} not in [{before}, {after}]", s.updated_ns);
    let st = fx.backend_stats(&b);
    let len = r.build().len() as u64;
    assert_eq!((st.scores_received, st.return_packets, st.return_bytes), (1, 1, len));
    let vs = fx.vip_stats();
    assert_eq!((vs.return_packets, vs.return_bytes), (1, len));
    assert_eq!(fx.drops().iter().sum::<u64>(), 0);
}

#[test]
fn score_option_followed_by_other_options_keeps_them() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let c = client(4);
    let (b, snat) = fx.connect(c);
    let mut opts = score_option(7);
    opts.extend_from_slice(&[1, 1, 1, 0]);
    let r = reply(&b, snat).ip_options(opts);
    let out = fx.tx(&r.build());
    assert_eq!(out, returned(&r, c, vec![1, 1, 1, 0]));
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
        assert_eq!((st.packets, st.return_packets, st.scores_received), (4, 3, 0));
        let counted = u32::from(matches!(mode, Mode::DsrPolling | Mode::DsrDynamic));
        assert_eq!(fx.score(&b).assigned_since, counted, "no 125, no reset");
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

// ---------------------------------------------------- backend lifecycle

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
    // Even a retransmitted SYN of that connection stays with it.
    assert_eq!(fx.tx(&syn(a).build()), forwarded_dsr_syn(&syn(a), &b0, snat, a));
    for n in 2..6 {
        assert_eq!(fx.pick(client(n)), b1.id, "new connections avoid the draining backend");
    }

    fx.set_flags(&b0, 0); // removed: a tombstone the daemon keeps for the flows
    assert_eq!(fx.tx(&d.build()), forwarded(&d, &b0, snat, vec![]), "removed keeps the flow");
    // A SYN on that tuple now is a new connection (port reuse): rebalanced.
    assert_eq!(fx.pick(a), b1.id);
    assert_eq!(fx.backend_stats(&b0).new_conns, 1);
}

#[test]
fn no_active_backend_is_dropped_as_no_backend() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    fx.set_flags(&backend(0), BACKEND_DRAINING);
    fx.set_flags(&backend(1), 0);
    fx.assert_dropped(&syn(client(1)).build(), DropReason::NoBackend);
    for policy in [Policy::LeastScore, Policy::PowerOfTwo] {
        fx.update_vip(|v| {
            v.mode = Mode::DsrDynamic as u8;
            v.policy = policy as u8;
        });
        fx.assert_dropped(&syn(client(1)).build(), DropReason::NoBackend);
    }
    let empty = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 0);
    empty.assert_dropped(&syn(client(1)).build(), DropReason::NoBackend);
    assert_eq!(fx.flow_count() + empty.flow_count(), 0);
}

#[test]
fn unresolved_next_hop_is_dropped_as_no_route_without_state() {
    let fx = Fixture::new();
    let b = B { mac: [0; 6], ..backend(0) };
    fx.add_backend(&b, 0, BACKEND_ACTIVE);
    put(
        &fx.skel.maps.vips,
        &vip_key(),
        &Vip { id: VIP_ID, mode: Mode::DsrRr as u8, backend_count: 1, score_max_age_ns: 1, ..Default::default() },
    );
    fx.assert_dropped(&syn(client(1)).build(), DropReason::NoRoute);
    assert_eq!(fx.flow_count(), 0);
    assert_eq!(fx.skel.maps.nat_back.keys().count(), 0);
    // Once the daemon resolves the MAC the retransmitted SYN goes through.
    fx.add_backend(&backend(0), 0, BACKEND_ACTIVE);
    let (got, _) = fx.connect(client(1));
    assert_eq!(got.id, b.id);
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
fn least_score_picks_the_lowest_effective_score() {
    let fx = Fixture::lb_with(Mode::DsrPolling, Policy::LeastScore, 3);
    let now = ktime_ns();
    let (b0, b1, b2) = (backend(0), backend(1), backend(2));
    fx.set_score(&b0, 30, now);
    fx.set_score(&b1, 10, now);
    fx.set_score(&b2, 12, now);
    // 10 + 0, then 10 + 1 < 12: b1 twice; then 10 + 2 = 12 ties with b2, so
    // b2 must come up within a few more picks while b0 (30) never does.
    assert_eq!(fx.pick(client(1)), b1.id);
    assert_eq!(fx.pick(client(2)), b1.id);
    assert_eq!(fx.score(&b1).assigned_since, 2);
    let more: Vec<u32> = (3..=12).map(|n| fx.pick(client(n))).collect();
    assert!(more.contains(&b2.id));
    assert!(!more.contains(&b0.id));
    // Assignments since the score keep the two within one of each other.
    let (a1, a2) = (fx.score(&b1).assigned_since, fx.score(&b2).assigned_since);
    assert_eq!(a1 + a2, 12);
    assert!((10 + a1).abs_diff(12 + a2) <= 1, "effective scores {} and {}", 10 + a1, 12 + a2);
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

#[test]
fn stale_or_missing_scores_rank_as_the_best_fresh_report_plus_assignments() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 2);
    let (b0, b1) = (backend(0), backend(1));
    let now = ktime_ns();
    let old = now - 5_000_000_000; // max age is 1 s
    // A stale low score does not count: b0 ranks at b1's 500 + its 10 assignments.
    fx.set_score_assigned(&b0, 0, 10, old);
    fx.set_score(&b1, 500, now);
    assert_eq!(fx.pick(client(1)), b1.id);
    // A backend that never reported gets connections (so it gets probed):
    // it ranks at the best fresh report (5) + 0 < b1's 5 + 3 assigned.
    fx.set_score_assigned(&b0, 0, 0, 0);
    fx.set_score_assigned(&b1, 5, 3, now);
    assert_eq!(fx.pick(client(2)), b0.id);
    // Among stale backends the one assigned fewer connections wins.
    fx.set_score_assigned(&b0, 1, 2, old);
    fx.set_score_assigned(&b1, 900, 1, old);
    assert_eq!(fx.pick(client(3)), b1.id);
    // A backend whose agent went silent attracts fewer and fewer: with b1
    // reporting before every connection, b0 gets at most the first one.
    fx.set_score_assigned(&b0, 0, 0, old);
    let mut to_b0 = 0;
    for n in 10..30 {
        fx.set_score(&b1, 1, ktime_ns());
        to_b0 += u32::from(fx.pick(client(n)) == b0.id);
    }
    assert!(to_b0 <= 1, "silent backend got {to_b0} of 20");
}

#[test]
fn power_of_two_never_picks_the_worse_of_the_pair() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::PowerOfTwo, 3);
    let now = ktime_ns();
    let (b0, b1, b2) = (backend(0), backend(1), backend(2));
    fx.set_score(&b0, 1, now);
    fx.set_score(&b1, 2, now);
    fx.set_score(&b2, 1000, now);
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

// ------------------------------------------------------------------ SNAT

#[test]
fn snat_port_skips_a_port_held_by_another_client() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let a = client(1);
    let (_, first) = fx.connect(a);
    // Forget a's connection and give its port to someone else.
    fx.skel.maps.flows.delete(flow_key(a).as_bytes()).unwrap();
    let other = NatBack {
        client_addr: be_addr(Ipv4Addr::new(192, 168, 9, 9)),
        vip_addr: be_addr(VIP_ADDR),
        client_port: be_port(5555),
        vip_port: be_port(VIP_PORT),
        backend_id: b.id,
        vip_id: VIP_ID,
        client_mac: CLIENT_MAC,
        pad: [0; 2],
    };
    put(&fx.skel.maps.nat_back, &nat_key(&b, first), &other);
    let (_, second) = fx.connect(a);
    assert_ne!(second, first);
    assert!((1024..=32767).contains(&second));
    assert_eq!(fx.nat(&b, first), Some(other), "the other client's entry is untouched");
    assert_eq!(fx.nat(&b, second).unwrap().client_port, be_port(a.port()));
}

#[test]
fn snat_port_is_stable_for_the_same_client_tuple() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let a = client(1);
    let (_, first) = fx.connect(a);
    // A lost flow entry (LRU eviction) and a retransmitted SYN: the same port
    // again, so the server sees the same connection.
    fx.skel.maps.flows.delete(flow_key(a).as_bytes()).unwrap();
    let (_, again) = fx.connect(a);
    assert_eq!(again, first);
}

#[test]
fn all_snat_candidates_taken_is_dropped_as_snat_exhausted() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let b = backend(0);
    let mut other = NatBack {
        client_addr: be_addr(Ipv4Addr::new(192, 168, 9, 9)),
        vip_addr: be_addr(VIP_ADDR),
        vip_port: be_port(VIP_PORT),
        backend_id: b.id,
        vip_id: VIP_ID,
        ..Default::default()
    };
    for port in 1024..=32767u16 {
        other.client_port = be_port(port);
        put(&fx.skel.maps.nat_back, &nat_key(&b, port), &other);
    }
    fx.assert_dropped(&syn(client(1)).build(), DropReason::SnatExhausted);
    assert_eq!(fx.flow_count(), 0);
    assert_eq!(fx.backend_stats(&b).new_conns, 0);
}

// ------------------------------------------------------------- malformed

#[test]
fn malformed_ipv4_headers_are_dropped_as_malformed_ip() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let good = syn(client(1)).build();

    let mut ihl4 = good.clone();
    ihl4[14] = 0x44;
    fx.assert_dropped(&ihl4, DropReason::MalformedIp);

    let mut version6 = good.clone();
    version6[14] = 0x65;
    fx.assert_dropped(&version6, DropReason::MalformedIp);

    // Fewer than 20 bytes after the Ethernet header.
    fx.assert_dropped(&good[..14 + 12], DropReason::MalformedIp);

    // IHL 15 (60 bytes) on a 44-byte packet.
    let mut hdr_beyond = good[..14 + 44].to_vec();
    hdr_beyond[14] = 0x4f;
    set_tot_len(&mut hdr_beyond, 44);
    fx.assert_dropped(&hdr_beyond, DropReason::MalformedIp);

    let mut too_long = good.clone();
    set_tot_len(&mut too_long, (good.len() - 14 + 1) as u16);
    fx.assert_dropped(&too_long, DropReason::MalformedIp);

    let mut below_header = good.clone();
    set_tot_len(&mut below_header, 19);
    fx.assert_dropped(&below_header, DropReason::MalformedIp);

    // Not only toward a VIP: a broken header is broken for everyone.
    let mut other = PacketBuilder::tcp(client(1), SocketAddrV4::new(LB_ADDR, 22)).build();
    other[14] = 0x43;
    fx.assert_dropped(&other, DropReason::MalformedIp);
    assert_eq!(fx.flow_count(), 0);
}

#[test]
fn ethernet_padding_beyond_total_length_is_kept() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let c = client(1);
    let (b, snat) = fx.connect(c);
    // A bare ACK is 54 bytes; Ethernet pads it to 60.
    let ack = data(c).flags(TCP_ACK).payload(Vec::<u8>::new());
    let mut padded = ack.build();
    padded.extend_from_slice(&[0; 6]);
    let mut want = forwarded(&ack, &b, snat, vec![]);
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
    fx.assert_dropped(&with(vec![0x44, 0, 0, 0]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![0x44, 1, 0, 0]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![0x44, 12, 0, 0]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![1, 1, 1, 0x44]), DropReason::MalformedOption);
    // Inband options from outside.
    fx.assert_dropped(&with(tuple_option(c)), DropReason::UnexpectedOption);
    fx.assert_dropped(&with(SCORE_REQUEST.to_vec()), DropReason::UnexpectedOption);
    fx.assert_dropped(&with(score_option(1)), DropReason::UnexpectedOption);
    let mut behind_nops = vec![1, 1, 1, 1];
    behind_nops.extend_from_slice(&SCORE_REQUEST);
    fx.assert_dropped(&with(behind_nops), DropReason::UnexpectedOption);
    // Anything else the balancer does not carry through.
    fx.assert_dropped(&with(vec![0x44, 4, 5, 0]), DropReason::IpOptions);
    fx.assert_dropped(&with(vec![1, 1, 1, 1]), DropReason::IpOptions);
    fx.assert_dropped(&syn(client(2)).ip_options(vec![0x94, 4, 0, 0]).build(), DropReason::IpOptions);
    assert_eq!(fx.flow_count(), 1);
    assert_eq!(fx.backend_stats(&backend(0)).packets, 1);
}

#[test]
fn truncated_tcp_to_a_vip_is_dropped_as_truncated_l4() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    let good = syn(client(1)).build();

    // Ports present (so the VIP matches) but only 12 of 20 header bytes.
    let mut short = good[..14 + 20 + 12].to_vec();
    set_tot_len(&mut short, 32);
    fx.assert_dropped(&short, DropReason::TruncatedL4);

    // Data offset below 5 words.
    let mut doff4 = good.clone();
    doff4[14 + 20 + 12] = 0x40;
    fx.assert_dropped(&doff4, DropReason::TruncatedL4);

    // Data offset (60 bytes) beyond the IPv4 total length.
    let mut doff15 = good.clone();
    doff15[14 + 20 + 12] = 0xf0;
    fx.assert_dropped(&doff15, DropReason::TruncatedL4);

    // The TCP header inside the frame but past the IPv4 total length.
    let mut hidden = good.clone();
    set_tot_len(&mut hidden, 20 + 10);
    fx.assert_dropped(&hidden, DropReason::TruncatedL4);
    assert_eq!(fx.flow_count(), 0);
}

#[test]
fn fragments_to_a_vip_are_dropped_as_fragment() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 1);
    // First fragment (MF, offset 0), of a SYN and of a data segment.
    fx.assert_dropped(&syn(client(1)).frag(0x2000).build(), DropReason::Fragment);
    fx.connect(client(2));
    fx.assert_dropped(&data(client(2)).frag(0x2000).build(), DropReason::Fragment);
    assert_eq!(fx.flow_count(), 1);
}

#[test]
fn inband_options_from_outside_to_the_balancer_are_dropped() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let (b, snat) = fx.connect(client(1));
    let stranger = B { addr: SocketAddrV4::new(Ipv4Addr::new(10, 0, 1, 66), 8080), ..b };

    // A 125 for no connection: unknown host, or a backend naming a port that
    // is not its connection, or the right host from another source port.
    fx.assert_dropped(&reply(&stranger, snat).ip_options(score_option(0)).build(), DropReason::ScoreNotOwner);
    fx.assert_dropped(&reply(&b, snat ^ 1).ip_options(score_option(0)).build(), DropReason::ScoreNotOwner);
    let other_port = B { addr: SocketAddrV4::new(*b.addr.ip(), 9999), ..b };
    fx.assert_dropped(&reply(&other_port, snat).ip_options(score_option(0)).build(), DropReason::ScoreNotOwner);
    // 155/124 are ours to send, never to receive.
    fx.assert_dropped(&reply(&stranger, snat).ip_options(SCORE_REQUEST.to_vec()).build(), DropReason::UnexpectedOption);
    fx.assert_dropped(&reply(&stranger, snat).ip_options(tuple_option(client(1))).build(), DropReason::UnexpectedOption);
    assert_eq!(fx.score(&b), BackendScore { assigned_since: 1, ..Default::default() });
}

#[test]
fn bad_options_from_a_backend_are_dropped() {
    let fx = Fixture::lb_with(Mode::DsrDynamic, Policy::LeastScore, 1);
    let (b, snat) = fx.connect(client(1));
    let with = |opts: Vec<u8>| reply(&b, snat).ip_options(opts).build();

    // Other inband options from a backend are no score.
    fx.assert_dropped(&with(SCORE_REQUEST.to_vec()), DropReason::ScoreNotOwner);
    fx.assert_dropped(&with(tuple_option(client(1))), DropReason::ScoreNotOwner);
    // A 125 not where the agent puts it, twice, or of the wrong length.
    fx.assert_dropped(&with(vec![1, 1, 1, 1, 125, 4, 0, 1]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![125, 4, 0, 1, 125, 4, 0, 2]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![125, 8, 0, 1, 0, 0, 0, 0]), DropReason::MalformedOption);
    // Broken option lengths.
    fx.assert_dropped(&with(vec![125, 0, 0, 0]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![125, 1, 0, 0]), DropReason::MalformedOption);
    fx.assert_dropped(&with(vec![125, 12, 0, 0]), DropReason::MalformedOption);
    assert_eq!(fx.score(&b), BackendScore { assigned_since: 1, ..Default::default() });
    assert_eq!(fx.backend_stats(&b).return_packets, 0);
}

#[test]
fn truncated_or_fragmented_replies_are_dropped() {
    let fx = Fixture::lb_with(Mode::Passthrough, Policy::RoundRobin, 1);
    let (b, snat) = fx.connect(client(1));
    let good = reply(&b, snat).payload(Vec::<u8>::new()).build();

    let mut short = good[..14 + 20 + 12].to_vec();
    set_tot_len(&mut short, 32);
    fx.assert_dropped(&short, DropReason::TruncatedL4);
    let mut doff4 = good.clone();
    doff4[14 + 20 + 12] = 0x40;
    fx.assert_dropped(&doff4, DropReason::TruncatedL4);

    fx.assert_dropped(&reply(&b, snat).frag(0x2000).build(), DropReason::Fragment);
    assert_eq!(fx.backend_stats(&b).return_packets, 0);
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

#[test]
fn a_new_syn_reusing_the_client_port_is_balanced_again() {
    let fx = Fixture::lb_with(Mode::DsrRr, Policy::RoundRobin, 2);
    let c = client(7);
    let first = fx.flow_after(&syn(c).seq_no(1000).build(), c);
    // The same SYN again is a retransmission: same flow, counted once.
    assert_eq!(fx.flow_after(&syn(c).seq_no(1000).build(), c).backend_id, first.backend_id);
    // Another sequence number on the same tuple is a new connection: the
    // next round-robin turn, the other backend.
    let second = fx.flow_after(&syn(c).seq_no(900_000).build(), c);
    assert_ne!(second.backend_id, first.backend_id);
    assert_eq!(second.syn_seq, 900_000u32.to_be());
    let conns: u64 = [backend(0), backend(1)].iter().map(|b| fx.backend_stats(b).new_conns).sum();
    assert_eq!(conns, 2);
}

//! BPF_PROG_TEST_RUN fixtures for bpf/shadow.bpf.c (seed 002's
//! conditional End.DT6): every branch on SRv6 frames built here, with the
//! socket lookup answered by real sockets in a namespace of the test's own.
//!
//! Needs root (loading BPF, network namespaces).

use std::mem::MaybeUninit;
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};

use inband_shadow::bpf::shadow::{ShadowSkel, ShadowSkelBuilder};
use inband_testkit::packet::{PacketBuilder, ETH_HLEN, IPPROTO_TCP, TCP_ACK, TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN};
use inband_shadow::attach::{read_counters, Config, COUNTERS};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::libbpf_sys;
use libbpf_rs::{AsRawLibbpf, OpenObject, ProgramInput, ProgramMut};

// Shared by the fixture crates; this one needs only part of them.
#[allow(dead_code)]
mod frames;
#[allow(dead_code)]
mod own_netns;
use own_netns::TestNetns;

const TC_ACT_OK: u32 = 0;
const TC_ACT_UNSPEC: u32 = u32::MAX; // -1
const TC_ACT_SHOT: u32 = 2;

const ROUTER: Ipv6Addr = Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 1);
const COND_SID: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x51, 0, 0, 0, 0, 0, 0xb);
const DIRECT_SID: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x51, 0, 0, 0, 0, 0, 0xd);
const SHADOW_SID: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 5);
/// The shadow SIDs of generations 2, 8 and 9 (shadow_generations.h): the
/// last one the program accepts, and the first it does not.
const SHADOW_SID_2: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 6);
const SHADOW_SID_8: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 0xc);
const SHADOW_SID_9: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x5f, 0, 0, 0, 0, 0, 0xd);
const CLIENT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc, 0, 0, 0, 0, 0, 2);
const VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xffff, 0, 0, 0, 0, 0, 0x80);

fn load(obj: &mut MaybeUninit<OpenObject>) -> ShadowSkel<'_> {
    let mut open = ShadowSkelBuilder::default().open(obj).expect("open");
    // Fixtures must not meet (or leave) pins of a running program.
    for map in open.open_object_mut().maps_mut() {
        // SAFETY: a valid open map; a NULL path is libbpf's "do not pin".
        let rc = unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
        assert_eq!(rc, 0);
    }
    let skel = open.load().expect("load shadow.bpf.o");
    let cfg = Config { cond_sid: COND_SID.octets(), shadow_sid: SHADOW_SID.octets(), direct_sid: DIRECT_SID.octets() };
    inband_core::bpfmap::put(&skel.maps.shadow_config, &0u32, &cfg).unwrap();
    skel
}

fn run(prog: &ProgramMut, frame: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; 1600];
    let input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), ..Default::default() };
    let output = prog.test_run(input).expect("BPF_PROG_TEST_RUN");
    let (ret, len) = (output.return_value, output.data.expect("output data").len());
    out.truncate(len);
    (ret, out)
}

/// `inner` (an IP packet) as the router sends it to `sid`: an outer IPv6
/// header and, unless `reduced`, a one-segment SRH with `segments_left`.
/// What the router sends this server (frames from the router's MAC).
fn srv6(sid: Ipv6Addr, inner: &[u8], segments_left: u8, reduced: bool) -> Vec<u8> {
    frames::srv6(([0x02, 0, 0, 0, 0, 0x01], [0x02, 0, 0, 0, 0, 0x51]), ROUTER, sid, inner, segments_left, reduced)
}

fn srv6_then(next: Ipv6Addr, inner: &[u8]) -> Vec<u8> {
    frames::srv6_then(([0x02, 0, 0, 0, 0, 0x01], [0x02, 0, 0, 0, 0, 0x51]), ROUTER, COND_SID, next, inner)
}

/// The frame with no segment left in its two-segment SRH, and its outer
/// destination `to` (None: kept).
fn consumed(frame: &[u8], to: Option<Ipv6Addr>) -> Vec<u8> {
    let mut f = to.map_or_else(|| frame.to_vec(), |to| readdressed(frame, to));
    assert_eq!(f[ETH_HLEN + 40 + 3], 1);
    f[ETH_HLEN + 40 + 3] = 0;
    f
}

fn tcp(from: SocketAddr, to: SocketAddr, flags: u8) -> Vec<u8> {
    PacketBuilder::tcp(from, to).flags(flags).payload(b"GET / HTTP/1.1\r\n".to_vec()).build_ip()
}

fn count(skel: &ShadowSkel, name: &str) -> (u64, u64) {
    let all = read_counters(&skel.maps.shadow_stats).unwrap();
    let c = all.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no counter {name}")).1;
    (c.packets, c.bytes)
}

/// The frame with its outer destination replaced: what a chained packet
/// leaves as. Nothing else may change.
fn readdressed(frame: &[u8], to: Ipv6Addr) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[ETH_HLEN + 24..ETH_HLEN + 40].copy_from_slice(&to.octets());
    f
}

#[test]
fn new_flows_and_other_protocols_are_delivered_untouched() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let (client, vip) = (SocketAddr::new(CLIENT.into(), 40000), SocketAddr::new(VIP.into(), 80));
    let syn = srv6(COND_SID, &PacketBuilder::tcp(client, vip).syn(1440).build_ip(), 0, false);
    assert_eq!(run(&skel.progs.shadow_ingress, &syn), (TC_ACT_UNSPEC, syn.clone()));
    let udp = srv6(COND_SID, &PacketBuilder::udp(client, vip).payload(b"q".to_vec()).build_ip(), 0, false);
    assert_eq!(run(&skel.progs.shadow_ingress, &udp), (TC_ACT_UNSPEC, udp.clone()));
    assert_eq!(count(&skel, "new_flow"), (1, syn.len() as u64));
    assert_eq!(count(&skel, "not_tcp"), (1, udp.len() as u64));
    assert_eq!(count(&skel, "chained"), (0, 0));
}

#[test]
fn packets_not_for_the_conditional_sid_are_not_judged() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let (client, vip) = (SocketAddr::new(CLIENT.into(), 40000), SocketAddr::new(VIP.into(), 80));
    let ack = tcp(client, vip, TCP_ACK);
    // From the shadow table (the direct SID): delivered whatever it is, so
    // a packet is chained at most once and never loops.
    let direct = srv6(DIRECT_SID, &ack, 0, false);
    // Plain traffic to the server, and IPv4.
    let plain = PacketBuilder::tcp(client, vip).flags(TCP_ACK).build();
    let v4 = PacketBuilder::tcp("10.0.0.1:1000".parse::<SocketAddr>().unwrap(), "10.0.0.2:80".parse::<SocketAddr>().unwrap())
        .flags(TCP_ACK)
        .build();
    for f in [&direct, &plain, &v4] {
        assert_eq!(run(&skel.progs.shadow_ingress, f), (TC_ACT_UNSPEC, f.clone()));
    }
    assert_eq!(count(&skel, "other").0, 3);
    assert_eq!(count(&skel, "chained"), (0, 0));
}

#[test]
fn a_stray_goes_to_the_shadow_sid_with_only_its_destination_changed() {
    let _ns = TestNetns::enter("shstray");
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let (client, vip) = (SocketAddr::new(CLIENT.into(), 40000), SocketAddr::new(VIP.into(), 80));
    for frame in [
        srv6(COND_SID, &tcp(client, vip, TCP_ACK | TCP_PSH), 0, false),
        // The reduced encapsulation (no SRH) too.
        srv6(COND_SID, &tcp(client, vip, TCP_ACK), 0, true),
        // A SYN-ACK is no new flow: it is asked about like any other.
        srv6(COND_SID, &tcp(client, vip, TCP_SYN | TCP_ACK), 0, false),
    ] {
        assert_eq!(run(&skel.progs.shadow_ingress, &frame), (TC_ACT_OK, readdressed(&frame, SHADOW_SID)));
    }
    assert_eq!(count(&skel, "chained").0, 3);
}

#[test]
fn a_local_connection_is_delivered_and_a_listener_is_not_one() {
    let ns = TestNetns::enter("shsock");
    ns.ip(&["link", "set", "lo", "up"]);
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let listener = TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).unwrap();
    let server = listener.local_addr().unwrap();
    let conn = TcpStream::connect(server).unwrap();
    let (accepted, _) = listener.accept().unwrap();
    let client = conn.local_addr().unwrap();
    // The connection's own packet: a local socket has it.
    let own = srv6(COND_SID, &tcp(client, server, TCP_ACK), 0, false);
    assert_eq!(run(&skel.progs.shadow_ingress, &own), (TC_ACT_UNSPEC, own.clone()));
    assert_eq!(count(&skel, "local"), (1, own.len() as u64));
    // Another client port of the same listening port: only the listener
    // matches, which says nothing about this connection — chained.
    let other = SocketAddr::new(client.ip(), client.port().wrapping_add(1).max(1024));
    let stray = srv6(COND_SID, &tcp(other, server, TCP_ACK), 0, false);
    assert_eq!(run(&skel.progs.shadow_ingress, &stray), (TC_ACT_OK, readdressed(&stray, SHADOW_SID)));
    // A UDP socket on the port is no TCP connection either.
    let udp = UdpSocket::bind(SocketAddr::new(Ipv6Addr::LOCALHOST.into(), 0)).unwrap();
    let to_udp_port = srv6(COND_SID, &tcp(client, udp.local_addr().unwrap(), TCP_ACK), 0, false);
    assert_eq!(run(&skel.progs.shadow_ingress, &to_udp_port).0, TC_ACT_OK);
    // The server closes first: its time-wait socket owns a late FIN (or
    // RST) of the closed connection, and its late ACK at the sequence
    // number after the client's FIN, which stay here; any other packet
    // with the tuple is a newer connection that reused the client's port
    // on another server, and goes on.
    let client_next = received_up_to(&accepted);
    drop(accepted);
    std::thread::sleep(std::time::Duration::from_millis(50));
    drop(conn);
    std::thread::sleep(std::time::Duration::from_millis(100));
    // (A child started from this thread runs in its namespace.)
    let tw = std::process::Command::new("ss").args(["-Htn", "state", "time-wait"]).output().unwrap();
    let tw = String::from_utf8_lossy(&tw.stdout).to_string();
    assert!(tw.contains(&format!(":{}", server.port())), "no time-wait socket: {tw}");
    for flags in [TCP_FIN | TCP_ACK, TCP_RST] {
        let late = srv6(COND_SID, &tcp(client, server, flags), 0, false);
        assert_eq!(run(&skel.progs.shadow_ingress, &late).0, TC_ACT_UNSPEC, "a late FIN or RST: the time-wait socket's");
    }
    // The client's FIN took one sequence number.
    let late_ack = |seq: u32| srv6(COND_SID, &PacketBuilder::tcp(client, server).flags(TCP_ACK).seq_no(seq).build_ip(), 0, false);
    let dup_ack = late_ack(client_next.wrapping_add(1));
    assert_eq!(run(&skel.progs.shadow_ingress, &dup_ack), (TC_ACT_UNSPEC, dup_ack.clone()), "the closed connection's late ACK");
    for seq in [client_next, client_next.wrapping_add(2), client_next.wrapping_add(1 << 31)] {
        let newer = late_ack(seq);
        assert_eq!(run(&skel.progs.shadow_ingress, &newer), (TC_ACT_OK, readdressed(&newer, SHADOW_SID)), "a newer connection's ACK");
    }
    assert_eq!(count(&skel, "chained").0, 5);
}

/// The sequence number `conn` expects next from its peer (rcv_nxt),
/// readable only in repair mode, left at once without the window probe
/// leaving it would send.
fn received_up_to(conn: &TcpStream) -> u32 {
    use std::os::fd::AsRawFd;
    const TCP_RECV_QUEUE: libc::c_int = 1;
    const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
    let fd = conn.as_raw_fd();
    let set = |opt: libc::c_int, v: libc::c_int| {
        let r = unsafe { libc::setsockopt(fd, libc::IPPROTO_TCP, opt, (&v as *const libc::c_int).cast(), 4) };
        assert_eq!(r, 0, "setsockopt {opt}: {}", std::io::Error::last_os_error());
    };
    set(libc::TCP_REPAIR, 1);
    set(libc::TCP_REPAIR_QUEUE, TCP_RECV_QUEUE);
    let (mut seq, mut len) = (0u32, 4 as libc::socklen_t);
    let r = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ, (&mut seq as *mut u32).cast(), &mut len) };
    assert_eq!(r, 0, "TCP_QUEUE_SEQ: {}", std::io::Error::last_os_error());
    set(libc::TCP_REPAIR, TCP_REPAIR_OFF_NO_WP);
    seq
}

#[test]
fn malformed_encapsulations_are_left_to_the_kernel() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let (client, vip) = (SocketAddr::new(CLIENT.into(), 40000), SocketAddr::new(VIP.into(), 80));
    let ack = tcp(client, vip, TCP_ACK);
    let mut not_srh = srv6(COND_SID, &ack, 0, false);
    not_srh[ETH_HLEN + 40 + 2] = 2; // routing type 2 (mobility), not segment routing
    let mut tcp_outside = PacketBuilder::tcp(SocketAddr::new(ROUTER.into(), 1), SocketAddr::new(COND_SID.into(), 80)).flags(TCP_ACK).build();
    tcp_outside[ETH_HLEN + 6] = IPPROTO_TCP;
    let full = srv6(COND_SID, &ack, 0, false);
    let cases = [
        ("segments left", srv6(COND_SID, &ack, 1, false)),
        ("not an SRH", not_srh),
        ("no inner IPv6", tcp_outside),
        ("inner header cut", full[..ETH_HLEN + 40 + 24 + 20].to_vec()),
        ("TCP header cut", full[..ETH_HLEN + 40 + 24 + 40 + 10].to_vec()),
    ];
    for (what, f) in &cases {
        assert_eq!(run(&skel.progs.shadow_ingress, f), (TC_ACT_UNSPEC, f.clone()), "{what}");
    }
    assert_eq!(count(&skel, "malformed").0, cases.len() as u64);
    assert_eq!(count(&skel, "chained"), (0, 0));
    assert_eq!(COUNTERS.len(), 7);
}

#[test]
fn from_an_older_generation_a_stray_goes_to_the_shadow_sid_its_srh_names() {
    let _ns = TestNetns::enter("shgen");
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let (client, vip) = (SocketAddr::new(CLIENT.into(), 40000), SocketAddr::new(VIP.into(), 80));
    let ack = tcp(client, vip, TCP_ACK);
    // No socket here: to the second segment, with none left (the router's
    // End.DT6 takes no other), and nothing else changed.
    for next in [SHADOW_SID_2, SHADOW_SID_8] {
        let f = srv6_then(next, &ack);
        assert_eq!(run(&skel.progs.shadow_ingress, &f), (TC_ACT_OK, consumed(&f, Some(next))));
    }
    assert_eq!(count(&skel, "chained_named").0, 2);
    // Delivered here (a SYN, UDP): the path ends here, so no segment is
    // left for the kernel's End.DT6 at the conditional SID.
    let syn = srv6_then(SHADOW_SID_2, &PacketBuilder::tcp(client, vip).syn(1440).build_ip());
    assert_eq!(run(&skel.progs.shadow_ingress, &syn), (TC_ACT_UNSPEC, consumed(&syn, None)));
    let udp = srv6_then(SHADOW_SID_2, &PacketBuilder::udp(client, vip).payload(b"q".to_vec()).build_ip());
    assert_eq!(run(&skel.progs.shadow_ingress, &udp), (TC_ACT_UNSPEC, consumed(&udp, None)));
    // A second segment that is no shadow SID of the router's (a ninth
    // generation, another address): not relayed, left to the kernel,
    // which drops SRv6 at a SID with segments left.
    for next in [SHADOW_SID_9, CLIENT] {
        let f = srv6_then(next, &ack);
        assert_eq!(run(&skel.progs.shadow_ingress, &f), (TC_ACT_UNSPEC, f.clone()), "{next}");
    }
    assert_eq!(count(&skel, "malformed").0, 2);
    assert_eq!((count(&skel, "chained").0, count(&skel, "chained_named").0), (0, 2));
}

// ------------------------------------------- the router's IPv4 shadow SIDs

mod dt4 {
    //! bpf/shadow_dt4.bpf.c, on the router's link to an instance: a stray
    //! of an IPv4 VIP comes back as IPv4 in IPv6 to a shadow SID, and
    //! leaves the program as the IPv4 packet inside, marked for its
    //! generation's table; nothing else is touched.

    use super::*;
    use inband_shadow::bpf::shadow_dt4::{ShadowDt4Skel, ShadowDt4SkelBuilder};
    use inband_shadow::dt4::{read_counters, Dt4};
    use inband_core::pod::Pod;
    use libbpf_rs::{MapCore, MapFlags};

    const INSTANCE: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x31, 0, 0, 0, 0, 0, 2);
    const MARK_0: u32 = 0x1b5e_00c8;
    const MARK_2: u32 = 0x1b5e_00ca;

    fn load(obj: &mut MaybeUninit<OpenObject>) -> ShadowDt4Skel<'_> {
        let mut open = ShadowDt4SkelBuilder::default().open(obj).expect("open");
        for map in open.open_object_mut().maps_mut() {
            // SAFETY: a valid open map; a NULL path is libbpf's "do not pin".
            let rc = unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
            assert_eq!(rc, 0);
        }
        let skel = open.load().expect("load shadow_dt4.bpf.o");
        for (sid, mark) in [(SHADOW_SID, MARK_0), (SHADOW_SID_2, MARK_2)] {
            skel.maps.dt4_sids.update(&sid.octets(), Dt4 { mark }.as_bytes(), MapFlags::ANY).unwrap();
        }
        skel
    }

    /// The verdict, the frame and the mark the program leaves.
    fn run(prog: &ProgramMut, frame: &[u8]) -> (u32, Vec<u8>, u32) {
        let mut out = vec![0u8; 1600];
        // struct __sk_buff: len, pkt_type, mark, ...; the kernel copies it back.
        let mut ctx_out = vec![0u8; 192];
        let input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), context_out: Some(&mut ctx_out), ..Default::default() };
        let output = prog.test_run(input).expect("BPF_PROG_TEST_RUN");
        let (ret, len) = (output.return_value, output.data.expect("output data").len());
        out.truncate(len);
        (ret, out, u32::from_ne_bytes(ctx_out[8..12].try_into().unwrap()))
    }

    fn count(skel: &ShadowDt4Skel, name: &str) -> u64 {
        read_counters(&skel.maps.dt4_stats).unwrap().iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no counter {name}")).1.packets
    }

    /// A client's IPv4 TCP packet to an IPv4 VIP.
    fn inner4() -> Vec<u8> {
        let (client, vip) = ("192.0.2.7:40000".parse::<SocketAddr>().unwrap(), "198.51.100.80:80".parse::<SocketAddr>().unwrap());
        PacketBuilder::tcp(client, vip).flags(TCP_ACK).payload(b"GET / HTTP/1.1\r\n".to_vec()).build_ip()
    }

    /// As an instance chains it: plain IPv6 (no SRH) to `sid`, next header 4;
    /// or, `srh`, with a one-segment SRH whose segment is spent.
    fn from_instance(sid: Ipv6Addr, inner: &[u8], srh: bool) -> Vec<u8> {
        frames::srv6(([0x02, 0, 0, 0, 0, 0x31], [0x02, 0, 0, 0, 0, 0x01]), INSTANCE, sid, inner, 0, !srh)
    }

    /// What leaves the program: the same MACs, type IPv4, the inner packet.
    fn unwrapped(frame: &[u8], inner: &[u8]) -> Vec<u8> {
        let mut f = frame[..12].to_vec();
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(inner);
        f
    }

    #[test]
    fn an_ipv4_stray_to_a_shadow_sid_leaves_as_ipv4_marked_for_its_generation() {
        let mut obj = MaybeUninit::uninit();
        let skel = load(&mut obj);
        let inner = inner4();
        for (sid, srh, mark) in [(SHADOW_SID, false, MARK_0), (SHADOW_SID_2, false, MARK_2), (SHADOW_SID, true, MARK_0)] {
            let f = from_instance(sid, &inner, srh);
            assert_eq!(run(&skel.progs.shadow_dt4, &f), (TC_ACT_OK, unwrapped(&f, &inner), mark), "to {sid}, SRH {srh}");
        }
        assert_eq!((count(&skel, "unwrapped"), count(&skel, "not_taken"), count(&skel, "failed")), (3, 0, 0));
    }

    #[test]
    fn anything_else_is_left_to_the_kernel_and_a_stub_is_dropped() {
        let mut obj = MaybeUninit::uninit();
        let skel = load(&mut obj);
        let inner = inner4();
        let (client, vip) = (SocketAddr::new(CLIENT.into(), 40000), SocketAddr::new(VIP.into(), 80));
        let inner6 = tcp(client, vip, TCP_ACK);
        // Not to a shadow SID: uncounted. A ninth generation's SID is not in the map.
        let others = [
            from_instance(COND_SID, &inner, false),
            from_instance(SHADOW_SID_9, &inner, false),
            PacketBuilder::tcp(client, vip).flags(TCP_ACK).build(),
            PacketBuilder::tcp("192.0.2.7:40000".parse::<SocketAddr>().unwrap(), "198.51.100.80:80".parse::<SocketAddr>().unwrap()).build(),
        ];
        for f in &others {
            assert_eq!(run(&skel.progs.shadow_dt4, f), (TC_ACT_UNSPEC, f.clone(), 0));
        }
        assert_eq!(count(&skel, "not_taken"), 0);
        // To a shadow SID but not ours to take: IPv6 inside (End.DT6's), a
        // segment still to go, IPv6 announced as IPv4, a fragment.
        let mut lying = from_instance(SHADOW_SID, &inner6, false);
        lying[ETH_HLEN + 6] = 4;
        let mut fragment = from_instance(SHADOW_SID, &inner, false);
        fragment[ETH_HLEN + 6] = 44;
        let refused = [
            from_instance(SHADOW_SID, &inner6, false),
            frames::srv6(([0x02, 0, 0, 0, 0, 0x31], [0x02, 0, 0, 0, 0, 0x01]), INSTANCE, SHADOW_SID, &inner, 1, false),
            lying,
            fragment,
        ];
        for f in &refused {
            assert_eq!(run(&skel.progs.shadow_dt4, f), (TC_ACT_UNSPEC, f.clone(), 0));
        }
        assert_eq!((count(&skel, "not_taken"), count(&skel, "unwrapped")), (refused.len() as u64, 0));
        // IPv4 announced, but less than an IPv4 header inside: the kernel
        // will not shrink the packet to that; dropped and counted.
        let stub = from_instance(SHADOW_SID, &inner[..8], false);
        assert_eq!(run(&skel.progs.shadow_dt4, &stub), (TC_ACT_SHOT, stub.clone(), 0));
        assert_eq!((count(&skel, "failed"), count(&skel, "unwrapped")), (1, 0));
    }
}

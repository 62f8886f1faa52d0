//! TCPE's options on real TCP: a client and a server in two network
//! namespaces joined by a veth, the sockops program on a cgroup v2 this
//! test moves itself into. The SYN, SYN-ACK and third ACK are captured
//! and their option bytes compared; a notification the server queues
//! reaches the client's state by the ACK TCP_QUICKACK sends (not the
//! delayed-ACK timer's), while the stream's bytes go through unchanged;
//! forged, unauthenticated, malformed, replayed and reflected
//! notifications, injected as raw segments in the connection's window,
//! are counted and not exposed.
//!
//! Namespaces and the cgroup are named after the test's pid and removed on
//! every exit path (Drop).

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use inband_core::command::ip;
use inband_tcpe::sockops::{flush_ack, hold_acks, State, Tcpe};
use inband_tcpe::wire::{self, Keys, Path, Role, TcpeOption};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const PORT: u16 = 8077;

/// Two namespaces, a cgroup holding this process; all undone on drop.
struct Bed {
    client: String,
    server: String,
    cgroup: PathBuf,
    home: PathBuf,
    host_ns: File,
}

impl Bed {
    fn up() -> Bed {
        let pid = std::process::id();
        let home = std::fs::read_to_string("/proc/self/cgroup")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("0::").map(|p| PathBuf::from(format!("/sys/fs/cgroup/unified{p}"))))
            .expect("a cgroup v2 line in /proc/self/cgroup");
        let bed = Bed {
            client: format!("itcpe-{pid}-c"),
            server: format!("itcpe-{pid}-s"),
            cgroup: PathBuf::from(format!("/sys/fs/cgroup/unified/inband-test-tcpe-{pid}")),
            home,
            host_ns: File::open("/proc/thread-self/ns/net").unwrap(),
        };
        for ns in [&bed.client, &bed.server] {
            ip(&["netns", "add", ns]).unwrap();
            ip(&["-n", ns, "link", "set", "lo", "up"]).unwrap();
        }
        ip(&["link", "add", "tcpe-c", "netns", &bed.client, "type", "veth", "peer", "name", "tcpe-s", "netns", &bed.server])
            .unwrap();
        for (ns, dev, a) in [(&bed.client, "tcpe-c", CLIENT), (&bed.server, "tcpe-s", SERVER)] {
            ip(&["-n", ns, "addr", "add", &format!("{a}/24"), "dev", dev]).unwrap();
            ip(&["-n", ns, "link", "set", dev, "up"]).unwrap();
        }
        std::fs::create_dir(&bed.cgroup).expect("cgroup v2 at /sys/fs/cgroup/unified");
        std::fs::write(bed.cgroup.join("cgroup.procs"), pid.to_string()).unwrap();
        bed
    }

    fn enter(&self, ns: &str) {
        let f = File::open(format!("/run/netns/{ns}")).unwrap();
        // SAFETY: setns(2) on this thread with a namespace file it holds open.
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns {ns}");
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        // SAFETY: as in enter().
        unsafe { libc::setns(self.host_ns.as_raw_fd(), libc::CLONE_NEWNET) };
        let _ = std::fs::write(self.home.join("cgroup.procs"), std::process::id().to_string());
        let _ = std::fs::remove_dir(&self.cgroup);
        for ns in [&self.client, &self.server] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

fn check(r: libc::c_int, what: &str) {
    assert!(r >= 0, "{what}: {}", std::io::Error::last_os_error());
}

fn socket(domain: libc::c_int, ty: libc::c_int, proto: libc::c_int) -> OwnedFd {
    // SAFETY: socket(2); the descriptor is owned from here on.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
    check(fd, "socket");
    // SAFETY: a new descriptor nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
        sin_zero: [0; 8],
    }
}

const SIN_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;

/// Frames on the server's veth, both ways.
struct Capture(OwnedFd);

#[derive(Debug, Clone)]
struct Segment {
    from_client: bool,
    flags: u8,
    seq: u32,
    ack: u32,
    window: u16,
    payload: usize,
    options: Vec<u8>,
}

impl Segment {
    fn timestamps(&self) -> Option<(u32, u32)> {
        let o = &self.options;
        let mut i = 0;
        while i + 1 < o.len() {
            match o[i] {
                0 => break,
                1 => i += 1,
                8 if o[i + 1] == 10 && i + 10 <= o.len() => {
                    let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
                    return Some((be(&o[i + 2..i + 6]), be(&o[i + 6..i + 10])));
                }
                _ => i += o[i + 1].max(2) as usize,
            }
        }
        None
    }
}

impl Capture {
    fn open() -> Capture {
        let proto = (libc::ETH_P_ALL as u16).to_be() as libc::c_int;
        let fd = socket(libc::AF_PACKET, libc::SOCK_RAW, proto);
        let big: libc::c_int = 16 << 20;
        // SAFETY: setsockopt/bind with pointers to locals and their sizes.
        unsafe {
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, (&big as *const libc::c_int).cast(), 4);
            let mut ll: libc::sockaddr_ll = std::mem::zeroed();
            ll.sll_family = libc::AF_PACKET as u16;
            ll.sll_protocol = proto as u16;
            ll.sll_ifindex = libc::if_nametoindex(c"tcpe-s".as_ptr()) as i32;
            assert!(ll.sll_ifindex > 0);
            check(
                libc::bind(fd.as_raw_fd(), (&ll as *const libc::sockaddr_ll).cast(), std::mem::size_of_val(&ll) as u32),
                "bind capture",
            );
        }
        Capture(fd)
    }

    /// The TCP segments between CLIENT:* and SERVER:PORT captured so far.
    fn drain(&self) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 17];
        loop {
            // SAFETY: recv into a buffer of its length.
            let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if n <= 0 {
                return out;
            }
            if let Some(s) = parse_frame(&buf[..n as usize]) {
                out.push(s);
            }
        }
    }
}

fn parse_frame(f: &[u8]) -> Option<Segment> {
    if f.len() < 14 + 20 + 20 || f[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = &f[14..];
    let ihl = (ip[0] & 0xf) as usize * 4;
    if ip[9] != 6 || ip.len() < ihl + 20 {
        return None;
    }
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let tot = (u16::from_be_bytes([ip[2], ip[3]]) as usize).min(ip.len());
    let tcp = &ip[ihl..];
    let doff = (tcp[12] >> 4) as usize * 4;
    let (sport, dport) = (u16::from_be_bytes([tcp[0], tcp[1]]), u16::from_be_bytes([tcp[2], tcp[3]]));
    if sport != PORT && dport != PORT || doff < 20 || tcp.len() < doff {
        return None;
    }
    Some(Segment {
        from_client: src == CLIENT,
        flags: tcp[13],
        seq: u32::from_be_bytes(tcp[4..8].try_into().unwrap()),
        ack: u32::from_be_bytes(tcp[8..12].try_into().unwrap()),
        window: u16::from_be_bytes([tcp[14], tcp[15]]),
        payload: tot.saturating_sub(ihl + doff),
        options: tcp[20..doff].to_vec(),
    })
}

fn csum(chunks: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for c in chunks {
        for w in c.chunks(2) {
            sum += u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]) as u32;
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Sends a pure ACK from the server's side of the connection to the client,
/// in its window (after `last_client`, the client's last segment, and with
/// the server's latest timestamps), carrying `option`: what an attacker on
/// the path can do.
fn inject(raw: &OwnedFd, client_port: u16, last_client: &Segment, last_server: &Segment, option: &[u8]) {
    let server_ts = last_server.timestamps().expect("server timestamps");
    let mut opts = vec![1, 1, 8, 10];
    opts.extend_from_slice(&server_ts.0.to_be_bytes());
    opts.extend_from_slice(&server_ts.1.to_be_bytes());
    opts.extend_from_slice(option);
    while opts.len() % 4 != 0 {
        opts.push(0);
    }
    let mut tcp = Vec::new();
    tcp.extend_from_slice(&PORT.to_be_bytes());
    tcp.extend_from_slice(&client_port.to_be_bytes());
    tcp.extend_from_slice(&last_client.ack.to_be_bytes());
    tcp.extend_from_slice(&last_client.seq.wrapping_add(last_client.payload as u32).to_be_bytes());
    tcp.push((((20 + opts.len()) / 4) as u8) << 4);
    tcp.push(0x10);
    tcp.extend_from_slice(&last_server.window.to_be_bytes());
    tcp.extend_from_slice(&[0, 0, 0, 0]);
    tcp.extend_from_slice(&opts);
    let len = (tcp.len() as u16).to_be_bytes();
    let c = csum(&[&SERVER.octets(), &CLIENT.octets(), &[0, 6], &len, &tcp]);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    let mut pkt = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 6, 0, 0];
    pkt[2..4].copy_from_slice(&((20 + tcp.len()) as u16).to_be_bytes());
    pkt.extend_from_slice(&SERVER.octets());
    pkt.extend_from_slice(&CLIENT.octets());
    let c = csum(&[&pkt]);
    pkt[10..12].copy_from_slice(&c.to_be_bytes());
    pkt.extend_from_slice(&tcp);
    let to = sockaddr(SocketAddrV4::new(CLIENT, 0));
    // SAFETY: sendto with a buffer and address of their sizes.
    let n = unsafe {
        libc::sendto(raw.as_raw_fd(), pkt.as_ptr().cast(), pkt.len(), 0, (&to as *const libc::sockaddr_in).cast(), SIN_LEN)
    };
    assert_eq!(n, pkt.len() as isize, "sendto: {}", std::io::Error::last_os_error());
}

/// TcpExt's DelayedACKs of the namespace this thread is in: ACKs the
/// delayed-ACK timer sent.
fn delayed_acks() -> u64 {
    let t = std::fs::read_to_string("/proc/thread-self/net/netstat").unwrap();
    let mut lines = t.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next().unwrap(), lines.next().unwrap());
    let i = names.split_whitespace().position(|n| n == "DelayedACKs").unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    eprintln!("waited {limit:?} for {what}");
    false
}

#[test]
fn options_on_real_tcp_and_forged_notifications_refused() {
    let bed = Bed::up();
    let tcpe = Tcpe::attach(&bed.cgroup).unwrap();

    bed.enter(&bed.server);
    let capture = Capture::open();
    let raw = socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW);
    let lfd = socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    tcpe.answer(lfd.as_fd()).unwrap();
    let sa = sockaddr(SocketAddrV4::new(SERVER, PORT));
    // SAFETY: bind/listen on a socket this test owns.
    unsafe {
        check(libc::bind(lfd.as_raw_fd(), (&sa as *const libc::sockaddr_in).cast(), SIN_LEN), "bind");
        check(libc::listen(lfd.as_raw_fd(), 8), "listen");
    }
    let listener = TcpListener::from(lfd);

    bed.enter(&bed.client);
    let cfd = socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    let id = tcpe.offer(cfd.as_fd()).unwrap();
    // SAFETY: connect on a socket this test owns.
    check(unsafe { libc::connect(cfd.as_raw_fd(), (&sa as *const libc::sockaddr_in).cast(), SIN_LEN) }, "connect");
    let mut client = TcpStream::from(cfd);
    client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let SocketAddr::V4(local) = client.local_addr().unwrap() else { panic!() };
    let (mut server, _) = listener.accept().unwrap();
    server.set_read_timeout(Some(Duration::from_secs(5))).unwrap();

    // Both ends agree: TCPE, one connection ID, one pair of key halves.
    let cs = tcpe.state(client.as_fd()).unwrap().expect("client state");
    assert!(
        wait_for("the server's confirmation", Duration::from_secs(1), || {
            tcpe.state(server.as_fd()).unwrap().is_some_and(|s| s.state == State::Capable)
        }),
        "{:?}",
        tcpe.state(server.as_fd())
    );
    let ss = tcpe.state(server.as_fd()).unwrap().unwrap();
    assert_eq!((cs.state, cs.role, cs.conn_id), (State::Capable, Role::Active, id));
    assert_eq!((ss.role, ss.conn_id, ss.keys), (Role::Passive, id, cs.keys));
    let keys = cs.keys;

    // The handshake's bytes as they went on the wire.
    let segs = capture.drain();
    let syn = segs.iter().find(|s| s.from_client && s.flags == 0x02).expect("SYN captured");
    let synack = segs.iter().find(|s| !s.from_client && s.flags == 0x12).expect("SYN-ACK captured");
    let third = segs.iter().find(|s| s.from_client && s.flags == 0x10).expect("third ACK captured");
    let tcpe_opts = |s: &Segment| wire::options(&s.options).unwrap();
    assert_eq!(tcpe_opts(syn), vec![TcpeOption::ConnId(id), TcpeOption::Key(keys.active)], "{syn:?}");
    assert_eq!(tcpe_opts(synack), vec![TcpeOption::ConnId(id), TcpeOption::Key(keys.passive)], "{synack:?}");
    assert_eq!(tcpe_opts(third), vec![TcpeOption::ConnId(id)], "{third:?}");
    for s in [syn, synack] {
        let at = s.options.windows(4).position(|w| w == [254, 8, 0x05, 0x89]).unwrap();
        assert_eq!(s.options[at + 4..at + 8], id.to_be_bytes());
    }

    // A request, its ACK held back; the notification queued, then the ACK
    // sent by TCP_QUICKACK. A machine too busy to queue within the
    // delayed-ACK timer's 40 ms gets another try.
    let path = Path { addr: "10.77.0.3:8080".parse().unwrap(), priority: 5, create: true };
    let mut serial = 0;
    let mut prompt = false;
    for attempt in 0..3 {
        bed.enter(&bed.server);
        hold_acks(server.as_fd()).unwrap();
        let before = delayed_acks();
        bed.enter(&bed.client);
        let request = format!("GET /{attempt} HTTP/1.1\r\nHost: tcpe\r\n\r\n");
        client.write_all(request.as_bytes()).unwrap();
        let mut got = vec![0u8; request.len()];
        server.read_exact(&mut got).unwrap();
        assert_eq!(got, request.as_bytes());
        serial = tcpe.notify(server.as_fd(), &path).unwrap();
        flush_ack(server.as_fd()).unwrap();
        let seen = wait_for("the notification", Duration::from_millis(500), || {
            tcpe.state(client.as_fd()).unwrap().unwrap().last == Some((path, serial))
        });
        bed.enter(&bed.server);
        let timer = delayed_acks() - before;
        eprintln!("attempt {attempt}: notification seen {seen}, delayed ACKs {timer}");
        assert!(seen || timer > 0, "the notification did not arrive though no ACK was left to the timer");
        if seen && timer == 0 {
            prompt = true;
            break;
        }
    }
    assert!(prompt, "no notification arrived by the ACK TCP_QUICKACK sent");
    let cs = tcpe.state(client.as_fd()).unwrap().unwrap();
    assert_eq!(cs.last, Some((path, serial)));
    let accepted = cs.accepted;

    // The stream is untouched while every pure ACK of the server repeats
    // the notification.
    bed.enter(&bed.client);
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 7 + i / 251) as u8).collect();
    client.write_all(&data).unwrap();
    let mut got = vec![0u8; data.len()];
    server.read_exact(&mut got).unwrap();
    assert!(got == data, "client-to-server bytes changed");
    server.write_all(&got).unwrap();
    let mut back = vec![0u8; data.len()];
    client.read_exact(&mut back).unwrap();
    assert!(back == data, "server-to-client bytes changed");
    let cs = tcpe.state(client.as_fd()).unwrap().unwrap();
    assert_eq!((cs.last, cs.accepted), (Some((path, serial)), accepted));
    assert!(cs.repeats > 0, "{cs:?}");
    assert_eq!(tcpe.counter("path_on_data").unwrap(), 0);

    // An IPv6 path on this IPv4 connection: the 28-byte option fills what
    // the pure ACK's timestamps leave.
    let path6 = Path { addr: "[2001:db8::77]:443".parse().unwrap(), priority: 15, create: false };
    bed.enter(&bed.server);
    hold_acks(server.as_fd()).unwrap();
    bed.enter(&bed.client);
    client.write_all(b"x").unwrap();
    server.read_exact(&mut [0u8; 1]).unwrap();
    let serial6 = tcpe.notify(server.as_fd(), &path6).unwrap();
    flush_ack(server.as_fd()).unwrap();
    assert!(wait_for("the IPv6 notification", Duration::from_secs(2), || {
        tcpe.state(client.as_fd()).unwrap().unwrap().last == Some((path6, serial6))
    }));
    tcpe.clear(server.as_fd()).unwrap();
    client.write_all(b"y").unwrap();
    server.read_exact(&mut [0u8; 1]).unwrap();

    // Segments an attacker on the path injects in the window.
    bed.enter(&bed.server);
    std::thread::sleep(Duration::from_millis(50));
    let segs = capture.drain();
    let last_client = segs.iter().rev().find(|s| s.from_client).expect("client segments").clone();
    let last_server = segs.iter().rev().find(|s| !s.from_client).expect("server segments").clone();
    let to_client = |opt: &[u8]| {
        inject(&raw, local.port(), &last_client, &last_server, opt);
        std::thread::sleep(Duration::from_millis(30));
        tcpe.state(client.as_fd()).unwrap().unwrap()
    };
    let moved = Path { addr: "10.66.6.6:6666".parse().unwrap(), priority: 1, create: true };
    let next = serial6.wrapping_add(1);

    // A MAC under a guessed key: counted, not exposed.
    let guessed = Keys { active: keys.active, passive: keys.passive ^ 1 };
    let s = to_client(&wire::path_option(&moved, next, &guessed, id, Role::Passive).unwrap());
    assert_eq!((s.last, s.bad_mac, s.state), (Some((path6, serial6)), 1, State::Capable));
    assert_eq!(tcpe.counter("path_bad_mac").unwrap(), 1);
    // The seed's option, which has no MAC: counted, not exposed.
    let s = to_client(&wire::seed_path_option(&moved).unwrap());
    assert_eq!(s.last, Some((path6, serial6)));
    assert_eq!(tcpe.counter("path_unauthenticated").unwrap(), 1);
    // A path option cut short, and one with reserved flag bits: malformed.
    let mut cut = wire::path_option(&moved, next, &keys, id, Role::Passive).unwrap();
    cut.truncate(14);
    cut[1] = 14;
    let s = to_client(&cut);
    assert_eq!(s.last, Some((path6, serial6)));
    let mut reserved = wire::path_option(&moved, next, &keys, id, Role::Passive).unwrap();
    reserved[10] |= 0x01;
    let s = to_client(&reserved);
    assert_eq!(s.last, Some((path6, serial6)));
    assert_eq!(tcpe.counter("path_malformed").unwrap(), 2);
    // The same route with the connection's keys is taken: the injection
    // reaches the program, so the refusals above were the MAC's.
    let s = to_client(&wire::path_option(&moved, next, &keys, id, Role::Passive).unwrap());
    assert_eq!(s.last, Some((moved, next)));
    // A replay of an older notification, genuine MAC and all: stale.
    let s = to_client(&wire::path_option(&path6, serial6, &keys, id, Role::Passive).unwrap());
    assert_eq!(s.last, Some((moved, next)));
    assert_eq!(tcpe.counter("path_stale").unwrap(), 1);
    // A notification the client itself would have sent, reflected back.
    let s = to_client(&wire::path_option(&path, next.wrapping_add(1), &keys, id, Role::Active).unwrap());
    assert_eq!((s.last, s.bad_mac), (Some((moved, next)), 2));
    // Two more bad MACs reach the limit: the connection stops taking
    // notifications, even genuine ones (its options are no longer parsed).
    let accepted = tcpe.counter("path_accepted").unwrap();
    for n in 0..2u8 {
        to_client(&wire::path_option(&path, next.wrapping_add(2 + n), &guessed, id, Role::Passive).unwrap());
    }
    let s = to_client(&wire::path_option(&path, next.wrapping_add(4), &keys, id, Role::Passive).unwrap());
    assert_eq!((s.last, s.bad_mac, s.state), (Some((moved, next)), 4, State::Fallback("fallback_bad_mac_limit")));
    assert_eq!(tcpe.counter("path_accepted").unwrap(), accepted);
    client.write_all(b"still a stream").unwrap();
    let mut got = [0u8; 14];
    server.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"still a stream");

    // Fallbacks: an offer to a listener that does not answer, and an
    // answering listener's client that did not offer. Both carry bytes.
    bed.enter(&bed.server);
    let plain = TcpListener::bind(SocketAddrV4::new(SERVER, PORT + 1)).unwrap();
    bed.enter(&bed.client);
    let cfd = socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    tcpe.offer(cfd.as_fd()).unwrap();
    let sa2 = sockaddr(SocketAddrV4::new(SERVER, PORT + 1));
    // SAFETY: connect on a socket this test owns.
    check(unsafe { libc::connect(cfd.as_raw_fd(), (&sa2 as *const libc::sockaddr_in).cast(), SIN_LEN) }, "connect");
    let mut offered = TcpStream::from(cfd);
    let (mut unaware, _) = plain.accept().unwrap();
    assert_eq!(tcpe.state(offered.as_fd()).unwrap().unwrap().state, State::Fallback("fallback_not_answered"));
    assert_eq!(tcpe.state(unaware.as_fd()).unwrap(), None);
    offered.write_all(b"ping").unwrap();
    let mut got = [0u8; 4];
    unaware.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping");
    let mut silent = TcpStream::connect(SocketAddrV4::new(SERVER, PORT)).unwrap();
    let (mut answered, _) = listener.accept().unwrap();
    assert_eq!(tcpe.state(silent.as_fd()).unwrap(), None);
    assert_eq!(tcpe.state(answered.as_fd()).unwrap(), None);
    silent.write_all(b"pong").unwrap();
    answered.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"pong");

    let counters = tcpe.counters().unwrap();
    let get = |n: &str| counters.iter().find(|(k, _)| *k == n).unwrap().1;
    assert_eq!(get("syn_answered"), 1);
    assert_eq!(get("fallback_not_answered"), 1);
    assert_eq!(get("passive_not_offered"), 1);
    assert_eq!(get("fallback_bad_mac_limit"), 1);
    assert_eq!(get("active_capable"), 1);
    assert_eq!(get("passive_capable"), 1);
    assert_eq!(get("confirm_written"), 1);
    assert!(get("syn_offered") >= 1 && get("path_written") >= 1, "{counters:?}");
    drop((client, server, listener, offered, unaware, silent, answered, plain));
}

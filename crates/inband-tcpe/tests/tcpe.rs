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
//! On top of them, the handoff: a balancer (this test's, calling
//! `handoff::hand_off` as `inband proxy` does) hands connections to a
//! takeover server that relays them to an HTTP origin; the client library
//! follows the move and the body arrives byte-exact, forged joins are
//! refused and counted, every fallback keeps the body on the balancer's
//! path, a reset subflow frees the server's session, the client moves at
//! the server's JOIN-OK whether the balancer hears the verdict late or
//! never, stays where a byte waits on the first subflow, and handoffs side
//! by side each move once and leave nothing behind.
//!
//! Namespaces and the cgroup are named after the test's pid and removed on
//! every exit path (Drop). The tests share the process's cgroup, so they
//! run one at a time (SERIAL).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inband_core::command::ip;
use inband_core::wire::Key;
use inband_tcpe::channel;
use inband_tcpe::client::{self, Client};
use inband_tcpe::handoff::{self, hand_off, Outcome, Target};
use inband_tcpe::join::{self, Kind};
use inband_tcpe::relay::{relay, Counters};
use inband_tcpe::sockops::{flush_ack, hold_acks, State, Tcpe};
use inband_tcpe::takeover::{self, Takeover};
use inband_tcpe::wire::{self, Keys, Path, Role, TcpeOption};
use inband_tcpe::ffi;

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const PORT: u16 = 8077;

/// Two namespaces, a cgroup holding this process; all undone on drop.
/// Held by each test: the process is in one cgroup at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Bed {
    client: String,
    server: String,
    cgroup: PathBuf,
    home: PathBuf,
    host_ns: File,
}

impl Bed {
    fn up(tag: &str) -> Bed {
        let pid = std::process::id();
        let home = inband_tcpe::cli::own_cgroup().expect("this process's cgroup v2");
        let bed = Bed {
            client: format!("itcpe-{pid}-{tag}-c"),
            server: format!("itcpe-{pid}-{tag}-s"),
            cgroup: PathBuf::from(format!("/sys/fs/cgroup/unified/inband-test-tcpe-{pid}-{tag}")),
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

/// Whether a wake-up for an accepted notification was queued (the
/// program's `tcpe_paths`); takes them.
fn woken(tcpe: &Tcpe) -> bool {
    let mut p = libc::pollfd { fd: tcpe.paths_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: poll on one pollfd, without waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    tcpe.drain_paths();
    n > 0
}

#[test]
fn options_on_real_tcp_and_forged_notifications_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("opt");
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
    // The client's reader was woken for it, and is not again until the
    // next notification is accepted.
    assert!(woken(&tcpe), "no wake-up for an accepted notification");
    assert!(!woken(&tcpe));

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
    assert!(!woken(&tcpe), "a repeated notification woke the reader");

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
    assert!(woken(&tcpe));

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
    assert!(!woken(&tcpe), "a refused notification woke the reader");
    // The same route with the connection's keys is taken: the injection
    // reaches the program, so the refusals above were the MAC's.
    let s = to_client(&wire::path_option(&moved, next, &keys, id, Role::Passive).unwrap());
    assert_eq!(s.last, Some((moved, next)));
    assert!(woken(&tcpe));
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
    assert!(!woken(&tcpe), "a replayed, reflected or refused notification woke the reader");
    assert_eq!(tcpe.counter("path_event_lost").unwrap(), 0);
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

// The handoff. The server namespace holds the balancer (SERVER), the
// takeover server's join listener (JOIN, a second address on its veth),
// its takeover channel and the HTTP origin (loopback).

const BALANCER_PORT: u16 = 8177;
const JOIN: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);
const JOIN_PORT: u16 = 8178;
const ORIGIN_PORT: u16 = 8190;
const CONTROL_PORT: u16 = 8191;
/// Nothing listens here in the server namespace.
const NOBODY_PORT: u16 = 8199;
const KEY: Key = Key([0x5a; 16]);
const WAIT: Duration = Duration::from_secs(5);

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

fn big_body() -> Vec<u8> {
    (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
}

const CHUNKS: [&str; 3] = ["keep", "-alive ", "after the move"];

#[derive(Default)]
struct OriginStats {
    conns: AtomicUsize,
    requests: AtomicUsize,
    closed: AtomicUsize,
}

/// Accepts on `l` until `stop`, each connection served by `f` in a thread
/// of its own (spawned in this thread's network namespace).
fn serve(l: TcpListener, stop: Arc<AtomicBool>, f: impl Fn(TcpStream) + Send + Sync + 'static) -> std::thread::JoinHandle<()> {
    l.set_nonblocking(true).unwrap();
    let f = Arc::new(f);
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    let f = f.clone();
                    std::thread::spawn(move || f(s));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    })
}

/// Reads up to the end of a request head; None at the stream's end.
fn read_head(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(n) if n > 0 => buf.extend_from_slice(&b[..n]),
            _ => return None,
        }
    }
    Some(buf)
}

/// An HTTP/1.1 origin with keep-alive: /big is 1 MiB with a
/// Content-Length, anything else a chunked body.
fn origin_conn(mut s: TcpStream, stats: &OriginStats) {
    stats.conns.fetch_add(1, Ordering::Relaxed);
    s.set_read_timeout(Some(WAIT)).unwrap();
    while let Some(head) = read_head(&mut s) {
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut headers);
        assert!(req.parse(&head).unwrap().is_complete(), "one request at a time");
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let r = if req.path == Some("/big") {
            let body = big_body();
            let mut r = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
            r.extend_from_slice(&body);
            r
        } else {
            let mut r = String::from("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
            for c in CHUNKS {
                r += &format!("{:x}\r\n{c}\r\n", c.len());
            }
            (r + "0\r\n\r\n").into_bytes()
        };
        if s.write_all(&r).is_err() {
            break;
        }
    }
    stats.closed.fetch_add(1, Ordering::Relaxed);
}

/// The balancer: each connection's ACKs held (inherited from the
/// listener), its request head read, then handed to the next target
/// queued, or proxied to the origin when the handoff falls back.
fn balancer_conn(mut s: TcpStream, tcpe: &Tcpe, targets: &Mutex<VecDeque<Target>>, counters: &Counters) {
    hold_acks(s.as_fd()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let Some(request) = read_head(&mut s) else { return };
    let to = targets.lock().unwrap().pop_front().expect("a target queued for each connection");
    // The routine runs on an event loop, as in `inband proxy`.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    s.set_nonblocking(true).unwrap();
    let s = rt.block_on(async {
        let mut s = tokio::net::TcpStream::from_std(s).unwrap();
        match hand_off(tcpe, &mut s, &request, &to, counters).await {
            Outcome::HandedOff => None,
            Outcome::Fallback(_) => Some(s.into_std().unwrap()),
        }
    });
    let Some(s) = s else { return };
    s.set_nonblocking(false).unwrap();
    let mut o = TcpStream::connect(loopback(ORIGIN_PORT)).unwrap();
    o.write_all(&request).unwrap();
    let _ = relay(s, o, WAIT);
}

fn target() -> Target {
    Target {
        control: loopback(CONTROL_PORT),
        join: SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT)),
        key: KEY,
        // The server's --max-deadline-ms here: room for the forged joins
        // before the real one (an unknown ID's is held 250 ms).
        deadline: Duration::from_secs(1),
        io_timeout: Duration::from_secs(1),
        channels: Default::default(),
    }
}

/// The takeover server's config; `n` > 0 for another server beside the
/// first (its own control and join ports).
fn takeover_config(n: u16) -> takeover::Config {
    takeover::Config {
        control: loopback(CONTROL_PORT + n),
        join: SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT + 2 * n)),
        origin: loopback(ORIGIN_PORT),
        key: KEY,
        max_pending: 16,
        max_sessions: 16,
        max_deadline: Duration::from_secs(1),
        io_timeout: Duration::from_secs(1),
        early_join_hold: Duration::from_millis(250),
        idle: WAIT,
        agent: None,
    }
}

/// Origin, takeover server and balancer, started in the server namespace.
struct World {
    origin: ServerSide,
    takeover: Takeover,
    targets: Arc<Mutex<VecDeque<Target>>>,
    balancer: Arc<Counters>,
    stop: Arc<AtomicBool>,
    balancer_thread: std::thread::JoinHandle<()>,
}

impl World {
    fn start(bed: &Bed, tcpe: &Arc<Tcpe>) -> World {
        let origin = ServerSide::start(bed);
        let stop = Arc::new(AtomicBool::new(false));
        let takeover = Takeover::start(takeover_config(0)).unwrap();
        let targets = Arc::new(Mutex::new(VecDeque::new()));
        let balancer = Arc::new(handoff::counters());
        let (t, tg, b) = (tcpe.clone(), targets.clone(), balancer.clone());
        let balancer_thread = serve(balancer_listener(tcpe, BALANCER_PORT), stop.clone(), move |s| balancer_conn(s, &t, &tg, &b));
        World { origin, takeover, targets, balancer, stop, balancer_thread }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.balancer_thread.join().unwrap();
        self.origin.stop();
    }
}

/// A balancer's listener on `port` of the server's address, answering
/// TCPE and holding its connections' ACKs.
fn balancer_listener(tcpe: &Tcpe, port: u16) -> TcpListener {
    let lfd = socket(libc::AF_INET, libc::SOCK_STREAM, 0);
    tcpe.answer(lfd.as_fd()).unwrap();
    let sa = sockaddr(SocketAddrV4::new(SERVER, port));
    // SAFETY: bind/listen on a socket this test owns.
    unsafe {
        check(libc::bind(lfd.as_raw_fd(), (&sa as *const libc::sockaddr_in).cast(), SIN_LEN), "bind");
        check(libc::listen(lfd.as_raw_fd(), 8), "listen");
    }
    // After listen(), which resets it: accepted connections inherit it,
    // so the request that may come before accept() is not ACKed at once.
    hold_acks(lfd.as_fd()).unwrap();
    TcpListener::from(lfd)
}

fn balancer_addr() -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(SERVER, BALANCER_PORT))
}

/// Sends a join of `conn_id` under `keys` to the join listener; whether a
/// JOIN-OK came back.
fn forge_join(conn_id: u32, keys: &Keys, raw: Option<[u8; join::JOIN_LEN]>) -> bool {
    let mut s = TcpStream::connect(SocketAddrV4::new(JOIN, JOIN_PORT)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let (local, peer) = (s.local_addr().unwrap(), s.peer_addr().unwrap());
    let msg = raw.unwrap_or_else(|| join::encode(Kind::Join, conn_id, join::mac(Kind::Join, keys, conn_id, local, peer)));
    s.write_all(&msg).unwrap();
    let mut b = [0u8; join::JOIN_LEN];
    s.read_exact(&mut b).is_ok()
}

#[test]
fn handoff_moves_the_stream_and_refuses_forged_joins() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("ho");
    let tcpe = Arc::new(Tcpe::attach(&bed.cgroup).unwrap());
    let world = World::start(&bed, &tcpe);
    let big = big_body();

    bed.enter(&bed.client);
    let tc = world.takeover.counters();
    // A machine too busy to route the request and send the HANDOFF within
    // the delayed-ACK timer's 40 ms leaves no ACK to carry the
    // notification (the balancer then falls back at once, counted): that
    // attempt's body comes by the balancer, and another attempt is made.
    let mut attempt = 0;
    let mut c = loop {
        world.targets.lock().unwrap().push_back(target());
        let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
        client::request(&mut c, "tcpe", "/big").unwrap();
        assert!(wait_for("the handoff", WAIT, || tc.get("handoffs_accepted") == attempt + 1));
        if attempt == 0 {
            // Forged joins while the real one is pending, from an attacker
            // who knows the connection ID: a MAC under a guessed key, an
            // unknown ID (held for its HANDOFF first, in case it came
            // early), not a join at all. Each is reset and counted; the
            // entry stays.
            let st = tcpe.state(c.current().as_fd()).unwrap().unwrap();
            let guessed = Keys { active: st.keys.active, passive: st.keys.passive ^ 1 };
            assert!(!forge_join(st.conn_id, &guessed, None), "a join under a guessed key was answered");
            assert!(!forge_join(st.conn_id.wrapping_add(1), &st.keys, None));
            assert!(!forge_join(0, &st.keys, Some(*b"GET / HTTP/1.1\r\n\r\nab")));
            assert_eq!((tc.get("join_bad_mac"), tc.get("join_unknown"), tc.get("join_malformed")), (1, 1, 1));
            assert_eq!(world.takeover.pending(), 1);
        }
        // The real client joins and reads the whole body off the new subflow.
        let mut body = Vec::new();
        assert_eq!(client::response(&mut c, &mut body).unwrap(), 200);
        assert_eq!(body.len(), big.len());
        assert!(body == big, "the body changed on its way");
        if c.counters().get("moved") == 1 {
            break c;
        }
        attempt += 1;
        assert_eq!(world.balancer.get("fallback_no_ack"), attempt, "{:?} {:?}", world.balancer.all(), c.counters().all());
        assert!(attempt < 3, "no handoff in 3 attempts");
    };
    eprintln!("handed off at attempt {attempt}");
    assert_eq!(c.current().peer_addr().unwrap(), SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT)));
    // The client moved at the JOIN-OK; the balancer counts the handoff when
    // the server's verdict reaches it, which the client does not wait for.
    assert!(wait_for("the verdict", WAIT, || world.balancer.get("handed_off") == 1), "{:?}", world.balancer.all());
    assert_eq!(tc.get("join_accepted"), 1);
    assert_eq!(world.takeover.sessions(), 1);
    // The attempts that fell back leave the server's entries to expire,
    // and their origin connections to close.
    assert!(wait_for("the entries' expiry", WAIT, || world.takeover.pending() == 0));
    let origin = &world.origin.stats;
    let conns = origin.conns.load(Ordering::Relaxed);
    assert!(wait_for("the other origin connections' end", WAIT, || origin.closed.load(Ordering::Relaxed) == conns - 1));

    // A keep-alive request after the move: same origin connection, chunked.
    let requests = origin.requests.load(Ordering::Relaxed);
    let mut body = Vec::new();
    assert_eq!(client::get(&mut c, "tcpe", "/small", &mut body).unwrap(), 200);
    assert_eq!(body, CHUNKS.concat().as_bytes());
    assert_eq!((origin.conns.load(Ordering::Relaxed), origin.requests.load(Ordering::Relaxed)), (conns, requests + 1));

    // The joined subflow resets: the server's session, and its origin
    // connection, go.
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt with a pointer to a linger struct and its size.
    check(
        unsafe {
            libc::setsockopt(
                c.current().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&l as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        },
        "SO_LINGER",
    );
    drop(c);
    assert!(wait_for("the session's end", WAIT, || world.takeover.sessions() == 0));
    assert_eq!(tc.get("session_reset"), 1, "{:?}", tc.all());
    assert!(wait_for("the origin connection's end", WAIT, || origin.closed.load(Ordering::Relaxed) == conns));

    // The C ABI: a second connection, handed off the same way.
    world.targets.lock().unwrap().push_back(target());
    let cg = std::ffi::CString::new(bed.cgroup.to_str().unwrap()).unwrap();
    let addr = std::ffi::CString::new(balancer_addr().to_string()).unwrap();
    // SAFETY: the header's contract: live pointers, buffers of their lengths.
    unsafe {
        let t = ffi::inband_tcpe_attach(cg.as_ptr());
        assert!(!t.is_null());
        ffi::inband_tcpe_detach(t);
        let t = Box::into_raw(Box::new(ffi::InbandTcpe::from(tcpe.clone())));
        let conn = ffi::inband_tcpe_connect(t, addr.as_ptr(), 5000);
        assert!(!conn.is_null(), "{}", std::io::Error::last_os_error());
        let req = b"GET /big HTTP/1.1\r\nHost: tcpe\r\n\r\n";
        assert_eq!(ffi::inband_tcpe_write(conn, req.as_ptr().cast(), req.len()), req.len() as isize);
        let mut got = Vec::new();
        let mut b = vec![0u8; 1 << 16];
        let want = big.len() + b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n".len();
        while got.len() < want {
            let n = ffi::inband_tcpe_read(conn, b.as_mut_ptr().cast(), b.len());
            assert!(n > 0, "read {n}: {}", std::io::Error::last_os_error());
            got.extend_from_slice(&b[..n as usize]);
        }
        assert!(got.ends_with(&big) && got.len() == want);
        // Moved, or kept for want of an ACK (as above).
        let moved = ffi::inband_tcpe_moved(conn);
        assert_eq!(moved as u64 + world.balancer.get("fallback_no_ack"), attempt + 1, "{:?}", world.balancer.all());
        ffi::inband_tcpe_close(conn);
        ffi::inband_tcpe_detach(t);
    }
    assert!(
        wait_for("the verdict", WAIT, || world.balancer.get("handed_off") + world.balancer.get("fallback_no_ack") == attempt + 2),
        "{:?}",
        world.balancer.all()
    );
    // The origin's and the takeover server's listeners share the cgroup
    // without opting in: their connections are not TCPE's, nor counted.
    assert_eq!(tcpe.counter("fallback_no_syn").unwrap(), 0);
    assert_eq!(tcpe.counter("passive_not_offered").unwrap(), 0);
    // The program answers for the balancer's listener while it listens,
    // for nothing else, and forgets it when it closes.
    assert!(tcpe.answers(balancer_addr()).unwrap());
    assert!(!tcpe.answers(SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT))).unwrap());
    world.stop();
    assert!(!tcpe.answers(balancer_addr()).unwrap(), "the closed listener's entry stayed");
}

#[test]
fn every_fallback_keeps_the_body_on_the_balancer() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("fb");
    let tcpe = Arc::new(Tcpe::attach(&bed.cgroup).unwrap());
    let world = World::start(&bed, &tcpe);
    let big = big_body();
    // Bad input to the takeover server, answered within its I/O timeout
    // while the rest runs: a HANDOFF frame announcing 4 GiB (refused
    // before anything is allocated), and a subflow that never sends its
    // join.
    let mut bad = TcpStream::connect(loopback(CONTROL_PORT)).unwrap();
    bad.set_read_timeout(Some(WAIT)).unwrap();
    bad.read_exact(&mut [0u8; 16]).unwrap();
    bad.write_all(&[1, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let silent = TcpStream::connect(SocketAddrV4::new(JOIN, JOIN_PORT)).unwrap();
    bed.enter(&bed.client);
    let fetch = |c: &mut dyn FnMut(&mut Vec<u8>) -> u16| {
        let mut body = Vec::new();
        assert_eq!(c(&mut body), 200);
        assert!(body == big, "the body changed on the fallback path");
    };

    // A client without the library: plain TCP, proxied.
    world.targets.lock().unwrap().push_back(target());
    let mut plain = TcpStream::connect(balancer_addr()).unwrap();
    plain.set_read_timeout(Some(WAIT)).unwrap();
    fetch(&mut |b| client::get(&mut plain, "tcpe", "/big", b).unwrap());

    // The server's channel does not answer (nothing listens).
    world.targets.lock().unwrap().push_back(Target { control: loopback(NOBODY_PORT), ..target() });
    let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
    fetch(&mut |b| client::get(&mut c, "tcpe", "/big", b).unwrap());
    assert_eq!(c.counters().get("moved"), 0);

    // The fallbacks below come after the notification has gone out beside
    // the HANDOFF; an attempt whose notification found no ACK to ride on
    // falls back before that (counted, as in the test above), and another
    // is made. The attempts that fell back so: `early`.
    let early = std::cell::Cell::new(0);
    let fall_back = |to: Target, why: &str| {
        for _ in 0..3 {
            let before = world.balancer.get(why);
            world.targets.lock().unwrap().push_back(to.clone());
            let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
            fetch(&mut |b| client::get(&mut c, "tcpe", "/big", b).unwrap());
            assert_eq!(c.counters().get("moved"), 0);
            if world.balancer.get(why) == before + 1 {
                return c;
            }
            early.set(early.get() + 1);
            assert_eq!(world.balancer.get("fallback_no_ack"), early.get(), "{:?}", world.balancer.all());
        }
        panic!("no {why} in 3 attempts: {:?}", world.balancer.all());
    };

    // The balancer's key is not the server's: the server counts the MAC
    // and closes the channel.
    fall_back(Target { key: Key([0xa5; 16]), ..target() }, "fallback_channel");
    // Each attempt's HANDOFF reached the server.
    let bad_mac = 1 + early.get();

    // Servers that refuse: one whose table of pending handoffs is full
    // (bounded at 0 here), one whose origin is down.
    bed.enter(&bed.server);
    let full = Takeover::start(takeover::Config { max_pending: 0, ..takeover_config(1) }).unwrap();
    let no_origin = Takeover::start(takeover::Config { origin: loopback(NOBODY_PORT), ..takeover_config(2) }).unwrap();
    // A server with no room at all resets connections before giving
    // them a thread.
    let busy = Takeover::start(takeover::Config { max_pending: 0, max_sessions: 0, ..takeover_config(3) }).unwrap();
    let mut s = TcpStream::connect(SocketAddrV4::new(JOIN, JOIN_PORT + 6)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    assert_eq!(s.read(&mut [0u8; 1]).unwrap_or(0), 0);
    assert_eq!(busy.counters().get("conns_busy"), 1);
    drop(busy);
    bed.enter(&bed.client);
    // Each refusing server resets the join the client sends it at once;
    // each attempt's HANDOFF reached it.
    for (n, server, why) in [(1, &full, "handoff_full"), (2, &no_origin, "handoff_no_origin")] {
        let before = early.get();
        let c = fall_back(Target { control: loopback(CONTROL_PORT + n), join: SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT + 2 * n)), ..target() }, "fallback_refused");
        assert_eq!(c.counters().get("join_refused"), 1, "{:?}", c.counters().all());
        assert_eq!((server.counters().get(why), server.counters().get("join_unknown"), server.pending()), (1 + early.get() - before, 1, 0));
    }
    drop((full, no_origin));

    // The join never arrives: the client is told a path where nothing
    // listens; the server gives the connection back at its deadline. (An
    // attempt whose notification found no ACK to ride on falls back at
    // once, counted: another is made, as in the test above.)
    let mut no_ack = 0;
    let mut c = loop {
        world.targets.lock().unwrap().push_back(Target {
            join: SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT + 1)),
            deadline: Duration::from_millis(300),
            ..target()
        });
        let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
        fetch(&mut |b| client::get(&mut c, "tcpe", "/big", b).unwrap());
        assert_eq!(c.counters().get("moved"), 0);
        if c.counters().get("join_failed") == 1 {
            break c;
        }
        no_ack += 1;
        assert_eq!(world.balancer.get("fallback_no_ack"), early.get() + no_ack, "{:?} {:?}", world.balancer.all(), c.counters().all());
        assert!(no_ack < 3, "no notification in 3 attempts");
    };
    // ... and the connection carries on, on the balancer.
    fetch(&mut |b| {
        let mut small = Vec::new();
        let s = client::get(&mut c, "tcpe", "/small", &mut small).unwrap();
        assert_eq!(small, CHUNKS.concat().as_bytes());
        b.extend_from_slice(&big);
        s
    });
    assert!(wait_for("the entries' expiry", WAIT, || world.takeover.pending() == 0));

    let b = &world.balancer;
    let tc = world.takeover.counters();
    assert_eq!(
        [b.get("fallback_not_capable"), b.get("fallback_channel"), b.get("fallback_refused"), b.get("fallback_no_join"), b.get("handed_off")],
        [1, 2, 2, 1, 0],
        "{:?}",
        b.all()
    );
    assert_eq!([tc.get("handoff_bad_mac"), tc.get("handoff_expired"), tc.get("join_accepted")], [bad_mac, 1 + no_ack, 0], "{:?}", tc.all());
    assert!(wait_for("the silent subflow's timeout", WAIT, || tc.get("join_timeout") == 1), "{:?}", tc.all());
    assert_eq!(tc.get("handoff_malformed"), 1);
    // Both were closed by the server, not left to hang.
    assert_eq!(bad.read(&mut [0u8; 1]).unwrap_or(0), 0);
    silent.set_read_timeout(Some(WAIT)).unwrap();
    assert_eq!((&silent).read(&mut [0u8; 1]).unwrap_or(0), 0);
    world.stop();
}

/// A HANDOFF on the takeover channel: the frame as sent, and the nonce
/// (from the server's HELLO) it is under.
fn send_handoff(ch: &mut TcpStream, conn_id: u32, deadline_ms: u32) -> Vec<u8> {
    let nonce = channel::recv_hello(ch).unwrap();
    let h = channel::Handoff { conn_id, keys: Keys { active: 1, passive: 2 }, deadline_ms, request: b"GET /small HTTP/1.1\r\nHost: tcpe\r\n\r\n".to_vec() };
    let mut frame = Vec::new();
    channel::send_handoff(&mut frame, &KEY, &nonce, &h).unwrap();
    ch.write_all(&frame).unwrap();
    assert_eq!(channel::recv_answer(ch, &KEY, &nonce).unwrap(), channel::HandoffAnswer::Verdict(channel::Verdict::Expired));
    frame
}

/// Fetches /big through the balancer with `to` until a fetch moves (an
/// attempt whose notification found no ACK to ride falls back at once,
/// counted, as in the tests above); the attempts that fell back.
fn fetch_moved(world: &World, tcpe: &Arc<Tcpe>, to: &Target) -> u64 {
    for attempt in 0..3 {
        let handed_off = world.balancer.get("handed_off");
        world.targets.lock().unwrap().push_back(to.clone());
        let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
        let mut body = Vec::new();
        assert_eq!(client::get(&mut c, "tcpe", "/big", &mut body).unwrap(), 200);
        assert!(body == big_body(), "the body changed on its way");
        if c.counters().get("moved") == 1 {
            // The balancer keeps the channel once the verdict has reached
            // it, which can come after the client's last byte.
            assert!(wait_for("the verdict", WAIT, || world.balancer.get("handed_off") == handed_off + 1), "{:?}", world.balancer.all());
            return attempt;
        }
    }
    panic!("no handoff in 3 attempts: {:?}", world.balancer.all());
}

#[test]
fn a_takeover_channel_carries_handoffs_one_after_another() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("kc");
    let tcpe = Arc::new(Tcpe::attach(&bed.cgroup).unwrap());
    let world = World::start(&bed, &tcpe);
    let tc = world.takeover.counters();

    // Each handoff on a channel is under the nonce of its own HELLO: one
    // recorded on the channel does not verify as its next (the server
    // counts the MAC and closes the channel).
    let mut ch = TcpStream::connect(loopback(CONTROL_PORT)).unwrap();
    ch.set_read_timeout(Some(WAIT)).unwrap();
    let recorded = send_handoff(&mut ch, 1, 50);
    channel::recv_hello(&mut ch).unwrap();
    ch.write_all(&recorded).unwrap();
    assert_eq!(ch.read(&mut [0u8; 1]).unwrap_or(0), 0, "a replayed HANDOFF left the channel open");
    assert_eq!((tc.get("handoff_bad_mac"), tc.get("handoffs_accepted")), (1, 1));
    // Two handoffs on one channel; its balancer's close between two
    // handoffs is no fault.
    let mut ch = TcpStream::connect(loopback(CONTROL_PORT)).unwrap();
    ch.set_read_timeout(Some(WAIT)).unwrap();
    send_handoff(&mut ch, 2, 50);
    send_handoff(&mut ch, 3, 50);
    drop(ch);
    assert!(wait_for("the channel's end", WAIT, || world.takeover.pending() == 0));
    assert_eq!(
        [tc.get("channels_opened"), tc.get("handoffs_accepted"), tc.get("handoff_expired"), tc.get("handoff_malformed")],
        [2, 3, 3, 0],
        "{:?}",
        tc.all()
    );

    // The balancer keeps a channel for its next handoffs to that server.
    bed.enter(&bed.client);
    let to = target();
    let mut no_ack = 0;
    for _ in 0..3 {
        no_ack += fetch_moved(&world, &tcpe, &to);
    }
    // An attempt that fell back for want of an ACK closed its channel
    // (its verdict was still to come).
    assert_eq!(tc.get("channels_opened"), 2 + 1 + no_ack, "{:?} {:?}", tc.all(), world.balancer.all());

    // A server restarted: the channel kept to it is found closed, and the
    // handoff goes on a new one instead of falling back.
    bed.enter(&bed.server);
    let second = Takeover::start(takeover_config(1)).unwrap();
    bed.enter(&bed.client);
    let to = Target { control: loopback(CONTROL_PORT + 1), join: SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT + 2)), ..target() };
    fetch_moved(&world, &tcpe, &to);
    bed.enter(&bed.server);
    drop(second);
    let second = Takeover::start(takeover_config(1)).unwrap();
    bed.enter(&bed.client);
    let channel_fallbacks = world.balancer.get("fallback_channel");
    fetch_moved(&world, &tcpe, &to);
    assert_eq!(world.balancer.get("fallback_channel"), channel_fallbacks, "{:?}", world.balancer.all());
    assert!(second.counters().get("join_accepted") == 1 && second.counters().get("channels_opened") >= 1, "{:?}", second.counters().all());
    drop(second);
    world.stop();
}

/// The server namespace entered, the join address added, and an origin
/// serving on loopback until `stop`.
struct ServerSide {
    stats: Arc<OriginStats>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl ServerSide {
    fn start(bed: &Bed) -> ServerSide {
        bed.enter(&bed.server);
        ip(&["addr", "add", &format!("{JOIN}/24"), "dev", "tcpe-s"]).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(OriginStats::default());
        let o = stats.clone();
        let thread = serve(TcpListener::bind(loopback(ORIGIN_PORT)).unwrap(), stop.clone(), move |s| origin_conn(s, &o));
        ServerSide { stats, stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}

/// A join with a valid MAC for `conn_id` under `keys`, sent to `at`;
/// whether JOIN-OK came back.
fn join_at(at: SocketAddrV4, conn_id: u32, keys: &Keys) -> bool {
    let mut s = TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let (local, peer) = (s.local_addr().unwrap(), s.peer_addr().unwrap());
    s.write_all(&join::encode(Kind::Join, conn_id, join::mac(Kind::Join, keys, conn_id, local, peer))).unwrap();
    let mut b = [0u8; join::JOIN_LEN];
    s.read_exact(&mut b).is_ok()
}

const GET_SMALL: &[u8] = b"GET /small HTTP/1.1\r\nHost: tcpe\r\n\r\n";

/// A HANDOFF of `request` for `conn_id` under `keys` on a new channel to
/// `control`; the server's one answer.
fn hand_over(control: SocketAddr, conn_id: u32, keys: Keys, request: &[u8]) -> channel::HandoffAnswer {
    let mut ch = TcpStream::connect(control).unwrap();
    ch.set_read_timeout(Some(WAIT)).unwrap();
    let nonce = channel::recv_hello(&mut ch).unwrap();
    let h = channel::Handoff { conn_id, keys, deadline_ms: 1000, request: request.to_vec() };
    let mut frame = Vec::new();
    channel::send_handoff(&mut frame, &KEY, &nonce, &h).unwrap();
    ch.write_all(&frame).unwrap();
    channel::recv_answer(&mut ch, &KEY, &nonce).unwrap()
}

#[test]
fn a_join_ahead_of_its_handoff_waits_for_it_and_one_for_a_refused_handoff_is_reset() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("ej");
    let origin = ServerSide::start(&bed);
    // A hold far above anything the test waits: a join reset early was
    // reset for its refusal, not for the hold.
    let hold = Duration::from_secs(30);
    let taking = Takeover::start(takeover::Config { early_join_hold: hold, ..takeover_config(0) }).unwrap();
    let refusing = Takeover::start(takeover::Config { early_join_hold: hold, origin: loopback(NOBODY_PORT), ..takeover_config(1) }).unwrap();
    let keys = Keys { active: 0x1111, passive: 0x2222 };
    let join_of = |n: u16| SocketAddrV4::new(JOIN, JOIN_PORT + 2 * n);

    // The client's join reaches the server before the balancer's HANDOFF:
    // it waits, and is taken when the HANDOFF is.
    let early = std::thread::spawn(move || join_at(join_of(0), 7, &keys));
    assert!(wait_for("the join's wait", WAIT, || taking.counters().get("join_held") == 1));
    assert_eq!(hand_over(loopback(CONTROL_PORT), 7, keys, GET_SMALL), channel::HandoffAnswer::Verdict(channel::Verdict::Joined));
    assert!(early.join().unwrap(), "the early join was not answered");
    assert_eq!((taking.counters().get("join_accepted"), taking.counters().get("join_unknown")), (1, 0));

    // The server refuses the handoff (its origin is down): a join already
    // waiting for it, and one that comes after, are reset at once.
    let started = Instant::now();
    let waiting = std::thread::spawn(move || join_at(join_of(1), 8, &keys));
    assert!(wait_for("the join's wait", WAIT, || refusing.counters().get("join_held") == 1));
    assert_eq!(hand_over(loopback(CONTROL_PORT + 1), 8, keys, GET_SMALL), channel::HandoffAnswer::Refused(channel::Reply::NoOrigin));
    assert!(!waiting.join().unwrap(), "a join for a refused handoff was answered");
    assert!(!join_at(join_of(1), 8, &keys));
    assert!(started.elapsed() < hold / 2, "the joins waited out the hold: {:?}", started.elapsed());
    let rc = refusing.counters();
    // The one after the refusal was not held.
    assert_eq!([rc.get("handoff_no_origin"), rc.get("join_held"), rc.get("join_unknown"), rc.get("join_accepted")], [1, 1, 2, 0], "{:?}", rc.all());
    drop((taking, refusing));
    origin.stop();
}

#[test]
fn a_get_reaches_the_origin_with_its_handoff_and_other_methods_with_the_join() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("eg");
    let origin = ServerSide::start(&bed);
    let takeover = Takeover::start(takeover_config(0)).unwrap();
    let keys = Keys { active: 0x3333, passive: 0x4444 };
    let handoff = |conn_id: u32, request: &'static [u8]| std::thread::spawn(move || hand_over(loopback(CONTROL_PORT), conn_id, keys, request));

    // A GET is with the origin while its handoff still waits for the join.
    let get = handoff(1, GET_SMALL);
    assert!(wait_for("the GET at the origin", WAIT, || origin.stats.requests.load(Ordering::Relaxed) == 1));
    assert_eq!(takeover.pending(), 1, "the GET reached the origin after its handoff ended");
    assert!(join_at(SocketAddrV4::new(JOIN, JOIN_PORT), 1, &keys));
    assert_eq!(get.join().unwrap(), channel::HandoffAnswer::Verdict(channel::Verdict::Joined));

    // Any other method waits for the client: a handoff that expires is
    // proxied by the balancer, and the origin must not have had it.
    let delete = handoff(2, b"DELETE /small HTTP/1.1\r\nHost: tcpe\r\n\r\n");
    assert!(wait_for("the DELETE's handoff taken", WAIT, || takeover.pending() == 1));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(origin.stats.requests.load(Ordering::Relaxed), 1, "the DELETE reached the origin before the join");
    assert!(join_at(SocketAddrV4::new(JOIN, JOIN_PORT), 2, &keys));
    assert!(wait_for("the DELETE at the origin", WAIT, || origin.stats.requests.load(Ordering::Relaxed) == 2));
    assert_eq!(delete.join().unwrap(), channel::HandoffAnswer::Verdict(channel::Verdict::Joined));
    drop(takeover);
    origin.stop();
}

/// A relay of takeover channels (balancer ↔ server on `CONTROL_PORT`)
/// that passes each server's HELLO at once and holds what follows it (the
/// answer) until `open`, or drops it for good when `lose`: the verdict
/// reaches the balancer late, or never.
struct VerdictGate {
    open: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl VerdictGate {
    /// Listens on `port` in the calling thread's namespace.
    fn start(port: u16, lose: bool) -> VerdictGate {
        let (open, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (o, st) = (open.clone(), stop.clone());
        let thread = serve(TcpListener::bind(loopback(port)).unwrap(), stop.clone(), move |balancer| {
            let server = TcpStream::connect(loopback(CONTROL_PORT)).unwrap();
            let (mut b_in, mut s_out) = (balancer.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut b_in, &mut s_out);
                let _ = s_out.shutdown(std::net::Shutdown::Write);
            });
            let (mut from, mut to) = (server, balancer);
            let mut hello = [0u8; channel::NONCE_LEN];
            if from.read_exact(&mut hello).is_err() || to.write_all(&hello).is_err() {
                return;
            }
            let mut rest = Vec::new();
            let mut b = [0u8; 4096];
            from.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            while !st.load(Ordering::Relaxed) {
                match from.read(&mut b) {
                    Ok(0) => break,
                    Ok(n) => rest.extend_from_slice(&b[..n]),
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                    Err(_) => break,
                }
                if !lose && o.load(Ordering::Relaxed) && !rest.is_empty() {
                    if to.write_all(&rest).is_err() {
                        break;
                    }
                    rest.clear();
                }
            }
        });
        VerdictGate { open, stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}

/// The client goes on on the server's subflow at its JOIN-OK: it does not
/// wait for the balancer to hear the verdict and send its FIN (a wake-up
/// of each on every handoff's path). A verdict held back until the client
/// has read the whole body still ends in a handoff; a verdict that never
/// comes makes the balancer fall back and proxy into the subflow the
/// client left, which resets it: the stream is the server's, whole, and
/// the origin has answered both.
#[test]
fn the_client_moves_at_the_join_ok_whatever_becomes_of_the_verdict() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("vg");
    let tcpe = Arc::new(Tcpe::attach(&bed.cgroup).unwrap());
    let world = World::start(&bed, &tcpe);
    const GATE_PORT: u16 = 8196;
    let late = VerdictGate::start(GATE_PORT, false);
    let lost = VerdictGate::start(GATE_PORT + 1, true);
    bed.enter(&bed.client);
    let b = &world.balancer;
    let big = big_body();
    // A fetch through `to` until one moves (an attempt whose notification
    // found no ACK to ride on falls back at once, counted; as above).
    let moved_fetch = |to: Target| {
        for attempt in 1..=3 {
            let no_ack = b.get("fallback_no_ack");
            world.targets.lock().unwrap().push_back(to.clone());
            let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
            let mut body = Vec::new();
            assert_eq!(client::get(&mut c, "tcpe", "/big", &mut body).unwrap(), 200);
            assert!(body == big, "the body changed on its way");
            if c.counters().get("moved") == 1 {
                return c;
            }
            assert_eq!(b.get("fallback_no_ack"), no_ack + 1, "{:?} {:?}", b.all(), c.counters().all());
            assert!(attempt < 3, "no handoff in 3 attempts");
        }
        unreachable!()
    };

    // Late: the balancer waits up to its deadline and I/O bound (6 s).
    let mut c = moved_fetch(Target { control: loopback(GATE_PORT), io_timeout: WAIT, ..target() });
    assert_eq!((b.get("handed_off"), b.get("fallback_verdict_lost")), (0, 0), "the verdict came before the body was read: {:?}", b.all());
    late.open.store(true, Ordering::Relaxed);
    assert!(wait_for("the late verdict", WAIT, || b.get("handed_off") == 1), "{:?}", b.all());
    let mut small = Vec::new();
    assert_eq!(client::get(&mut c, "tcpe", "/small", &mut small).unwrap(), 200);
    assert_eq!(small, CHUNKS.concat().as_bytes());
    drop(c);

    // Lost: the balancer gives up after 2 s and proxies the request again.
    // The origin answers the server's GET and the balancer's (and both of
    // any attempt that fell back for want of an ACK).
    let (requests, no_ack) = (world.origin.stats.requests.load(Ordering::Relaxed), b.get("fallback_no_ack"));
    let mut c = moved_fetch(Target { control: loopback(GATE_PORT + 1), ..target() });
    assert!(wait_for("the fallback", WAIT, || b.get("fallback_verdict_lost") == 1), "{:?}", b.all());
    let want = requests + 2 + 2 * (b.get("fallback_no_ack") - no_ack) as usize;
    assert!(wait_for("the balancer's request", WAIT, || world.origin.stats.requests.load(Ordering::Relaxed) == want));
    // The stream stays the server's: a keep-alive request after it.
    let mut small = Vec::new();
    assert_eq!(client::get(&mut c, "tcpe", "/small", &mut small).unwrap(), 200);
    assert_eq!(small, CHUNKS.concat().as_bytes());
    assert_eq!(c.counters().get("join_abandoned"), 0);
    assert_eq!(b.get("handed_off"), 1, "{:?}", b.all());
    drop(c);
    late.stop();
    lost.stop();
    world.stop();
}

/// A byte on the first subflow at the JOIN-OK keeps the stream there: a
/// balancer that told the client to join and then answered the request
/// itself (its handoff fell back before the join) is read whole, the
/// joined subflow is closed, and nothing of the server's answer reaches
/// the stream, although the server took the join.
#[test]
fn a_byte_on_the_first_subflow_at_the_join_ok_keeps_the_stream_there() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("ab");
    let tcpe = Arc::new(Tcpe::attach(&bed.cgroup).unwrap());
    let world = World::start(&bed, &tcpe);
    // The balancer, by hand: notification, its own answer, then the
    // HANDOFF, so the server's JOIN-OK comes after the answer's bytes.
    const KEEPER_PORT: u16 = 8195;
    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\nfrom the keeper";
    let listener = balancer_listener(&tcpe, KEEPER_PORT);
    let tc = world.takeover.counters();
    std::thread::scope(|scope| {
        // Per connection: whether the notification left on an ACK, and
        // the server's answer to the HANDOFF that followed the keeper's
        // answer. The answer goes once the client's join waits at the
        // server (ahead of its HANDOFF), so that it is on the first
        // subflow before the JOIN-OK and after the client heard of the
        // path.
        let keeper = scope.spawn(|| {
            let mut out = Vec::new();
            for _ in 0..3 {
                let (mut s, _) = listener.accept().unwrap();
                s.set_read_timeout(Some(WAIT)).unwrap();
                let request = read_head(&mut s).unwrap();
                let st = tcpe.state(s.as_fd()).unwrap().filter(|st| st.state == State::Capable).expect("a TCPE connection");
                let held = tc.get("join_held");
                tcpe.notify(s.as_fd(), &Path { addr: SocketAddr::V4(SocketAddrV4::new(JOIN, JOIN_PORT)), priority: 0, create: true }).unwrap();
                flush_ack(s.as_fd()).unwrap();
                let notified = tcpe.state(s.as_fd()).unwrap().unwrap().written != st.written;
                if notified {
                    assert!(wait_for("the join held at the server", WAIT, || tc.get("join_held") == held + 1), "{:?}", tc.all());
                }
                s.write_all(ANSWER).unwrap();
                let verdict = notified.then(|| hand_over(loopback(CONTROL_PORT), st.conn_id, st.keys, &request));
                let _ = tcpe.clear(s.as_fd());
                out.push((notified, verdict, s));
                if notified {
                    break;
                }
            }
            out
        });
        bed.enter(&bed.client);
        let mut tries = 0;
        let c = loop {
            tries += 1;
            let mut c = Client::connect(tcpe.clone(), SocketAddr::V4(SocketAddrV4::new(SERVER, KEEPER_PORT)), WAIT).unwrap();
            let mut body = Vec::new();
            assert_eq!(client::get(&mut c, "tcpe", "/big", &mut body).unwrap(), 200);
            assert_eq!(body, b"from the keeper", "the stream took bytes of another subflow");
            assert_eq!(c.counters().get("moved"), 0);
            if c.counters().get("join_abandoned") == 1 {
                break c;
            }
            // No ACK was left to carry the notification (a busy machine):
            // the client never heard of the path. Another connection.
            assert_eq!(c.counters().all().iter().map(|(_, v)| v).sum::<u64>(), 0, "{:?}", c.counters().all());
            assert!(tries < 3, "no notification in 3 connections");
        };
        let out = keeper.join().unwrap();
        assert_eq!(out.len(), tries);
        let (notified, verdict, _s) = out.last().unwrap();
        assert!(*notified);
        // The server took the join; the client closed it.
        assert_eq!(verdict.as_ref(), Some(&channel::HandoffAnswer::Verdict(channel::Verdict::Joined)));
        assert_eq!(tc.get("join_accepted"), 1, "{:?}", tc.all());
        assert!(wait_for("the session's end", WAIT, || world.takeover.sessions() == 0));
        drop(c);
    });
    world.stop();
}

/// Handoffs side by side: eight clients of one process, five fetches each,
/// through one target (its kept channels shared). Every body arrives
/// whole; each connection either moved or, for want of an ACK to carry
/// its notification, stayed and was counted; the server's table and
/// sessions empty afterwards. One process's clients share its wake-up
/// ring: a reader that takes another's wake-up leaves that one to its
/// periodic look, a slower join, never a lost one.
#[test]
fn concurrent_handoffs_each_move_once_and_leave_nothing_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bed = Bed::up("cc");
    let tcpe = Arc::new(Tcpe::attach(&bed.cgroup).unwrap());
    let world = World::start(&bed, &tcpe);
    bed.enter(&bed.client);
    const CLIENTS: u64 = 8;
    const FETCHES: u64 = 5;
    let to = target();
    for _ in 0..CLIENTS * FETCHES {
        world.targets.lock().unwrap().push_back(to.clone());
    }
    let big = big_body();
    let moved: u64 = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                // Spawned in the client namespace, as this thread is.
                scope.spawn(|| {
                    let mut moved = 0;
                    for _ in 0..FETCHES {
                        let mut c = Client::connect(tcpe.clone(), balancer_addr(), WAIT).unwrap();
                        let mut body = Vec::new();
                        assert_eq!(client::get(&mut c, "tcpe", "/big", &mut body).unwrap(), 200);
                        assert!(body == big, "the body changed on its way");
                        let all = c.counters().all();
                        assert!(all.iter().all(|(n, v)| *v == 0 || *n == "moved"), "{all:?}");
                        moved += c.counters().get("moved");
                    }
                    moved
                })
            })
            .collect();
        clients.into_iter().map(|t| t.join().unwrap()).sum()
    });
    let b = &world.balancer;
    assert!(
        wait_for("every verdict", WAIT, || b.get("handed_off") == moved && b.get("handed_off") + b.get("fallback_no_ack") == CLIENTS * FETCHES),
        "moved {moved}: {:?}",
        b.all()
    );
    assert!(moved > 0, "{:?}", b.all());
    let tc = world.takeover.counters();
    assert_eq!(tc.get("join_accepted"), moved, "{:?}", tc.all());
    assert!(wait_for("the server's table and sessions emptied", WAIT, || world.takeover.pending() == 0 && world.takeover.sessions() == 0));
    world.stop();
}

//! Announced choices ([scale_out] `peers`; docs/decisions.md, "Announced
//! choices"): the backend of each new fleet connection of a VIP whose
//! policy is not Maglev goes to every other instance, so that whichever
//! survives this instance's host can adopt the connection
//! (lb/peer_choices.h).
//!
//! The data path hands each choice to this worker through `choice_ring`;
//! the worker wakes with the ring, sends what came as datagrams of at most
//! `MAX_RECORDS` records to each peer's `peer_port` (at most one round
//! every `MIN_GAP`, so a burst of connections shares datagrams), and
//! writes what the peers sent it into `peer_choices`. A datagram
//! (integers in network order):
//!
//! ```text
//! magic "IBpc" (4) | sequence (8) | records (2) | 0 (2) | records × 64 | mac (8)
//! record: client side as `peer_choices` keys it (inband_flow_key, 40)
//!       | backend address (16) | backend port (2) | 0 (2) | age of the SYN, ms (4)
//! ```
//!
//! `mac` is SipHash-2-4 under the fleet key over every byte before it. The
//! sequence number grows with every datagram a sender sends (to any peer);
//! it starts from the sender's wall clock in microseconds, so a restarted
//! daemon goes on above its last number.
//!
//! Trust: every byte is the network's. A datagram is taken only from an
//! address of `peers`, at the right length, under the fleet key, with a
//! sequence number above that sender's last; each refusal is counted
//! (`peer_unknown_sender`, `peer_malformed`, `peer_bad_mac`,
//! `peer_replayed`) and nothing else happens. Whoever holds the fleet key
//! can name a backend for a client side; it could forge fleet tuples
//! already. A taken record only lets a stray of that client side, at the
//! direct SID, go to a backend the VIP has; the LRU bounds what they hold.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tracing::warn;

use super::config::LbConfig;
use super::maps::{Addr, ChoiceRec, ControlStats, FlowKey, PeerChoice};
use super::polling;
use super::tables::{self, LbMaps};
use inband_core::bpfmap;
use inband_core::pod::Pod;
use inband_core::wire::Key;

const MAGIC: [u8; 4] = *b"IBpc";
const HEADER: usize = 16;
const MAC: usize = 8;
const RECORD: usize = 64;
const KEY: usize = std::mem::size_of::<FlowKey>();
/// What a datagram carries at most: 1,232 bytes of UDP payload pass any
/// IPv6 path unfragmented (1,280, its minimum MTU, less the headers).
pub const MAX_RECORDS: usize = (1232 - HEADER - MAC) / RECORD;
/// The least time between two rounds of sending. A choice waits at most
/// this long (a lone one not at all): the connections younger than that
/// (plus a datagram's trip) when the host dies are the ones not carried,
/// about those still in their handshake. Under load, records gather for
/// this long, so a busy instance sends at most 1,000 rounds a second, of
/// full datagrams.
const MIN_GAP: Duration = Duration::from_millis(1);
/// How long the worker sleeps with nothing to send: the bound on noticing
/// `stop` and on taking a peer's datagram late (the socket wakes it too).
const IDLE_WAIT: Duration = Duration::from_millis(100);
const TCP: u8 = 6;

/// One announced choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub key: FlowKey,
    pub backend_addr: Addr,
    /// Network order, as the maps hold it.
    pub backend_port: u16,
    /// How long before the datagram was sent its SYN came.
    pub age_ms: u32,
}

/// One datagram of `choices` (at most MAX_RECORDS) under `key`.
pub fn encode(key: &Key, seq: u64, choices: &[Choice]) -> Vec<u8> {
    assert!(choices.len() <= MAX_RECORDS);
    let mut d = Vec::with_capacity(HEADER + choices.len() * RECORD + MAC);
    d.extend_from_slice(&MAGIC);
    d.extend_from_slice(&seq.to_be_bytes());
    d.extend_from_slice(&(choices.len() as u16).to_be_bytes());
    d.extend_from_slice(&[0, 0]);
    for c in choices {
        d.extend_from_slice(c.key.as_bytes());
        d.extend_from_slice(c.backend_addr.as_bytes());
        d.extend_from_slice(&c.backend_port.to_ne_bytes());
        d.extend_from_slice(&[0, 0]);
        d.extend_from_slice(&c.age_ms.to_be_bytes());
    }
    let mac = key.siphash(&d);
    d.extend_from_slice(&mac.to_be_bytes());
    d
}

/// Why a datagram was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    UnknownSender,
    Malformed,
    BadMac,
    Replayed,
}

/// The receiving end: each peer's last sequence number.
#[derive(Default)]
pub struct Receiver {
    last: HashMap<Ipv6Addr, u64>,
}

impl Receiver {
    /// The choices of datagram `d` from `from`, if it is one of `peers`'
    /// under `key` and newer than that peer's last.
    pub fn accept(&mut self, key: &Key, peers: &[Ipv6Addr], from: IpAddr, d: &[u8]) -> Result<Vec<Choice>, Refused> {
        let from = match from {
            IpAddr::V6(a) => a.to_ipv4_mapped().map_or(a, |_| Ipv6Addr::UNSPECIFIED),
            IpAddr::V4(_) => Ipv6Addr::UNSPECIFIED,
        };
        if !peers.contains(&from) {
            return Err(Refused::UnknownSender);
        }
        if d.len() < HEADER + MAC || d[..4] != MAGIC {
            return Err(Refused::Malformed);
        }
        let n = usize::from(u16::from_be_bytes([d[12], d[13]]));
        if n == 0 || n > MAX_RECORDS || d.len() != HEADER + n * RECORD + MAC || d[14..16] != [0, 0] {
            return Err(Refused::Malformed);
        }
        let (body, mac) = d.split_at(d.len() - MAC);
        if key.siphash(body) != u64::from_be_bytes(mac.try_into().unwrap()) {
            return Err(Refused::BadMac);
        }
        let seq = u64::from_be_bytes(d[4..12].try_into().unwrap());
        let choices = body[HEADER..].chunks_exact(RECORD).map(decode_record).collect::<Option<Vec<_>>>().ok_or(Refused::Malformed)?;
        if self.last.get(&from).is_some_and(|&last| seq <= last) {
            return Err(Refused::Replayed);
        }
        self.last.insert(from, seq);
        Ok(choices)
    }
}

/// A record's fields, or None if they cannot name a TCP connection and a
/// backend as the data path keys them (non-zero padding, another protocol).
fn decode_record(r: &[u8]) -> Option<Choice> {
    let key = FlowKey::from_bytes(&r[..KEY]);
    let zero_pad = key.pad == [0; 3] && r[KEY + 18..KEY + 20] == [0, 0];
    if !zero_pad || key.proto != TCP {
        return None;
    }
    Some(Choice {
        key,
        backend_addr: Addr::from_bytes(&r[KEY..KEY + 16]),
        backend_port: u16::from_ne_bytes([r[KEY + 16], r[KEY + 17]]),
        age_ms: u32::from_be_bytes(r[KEY + 20..KEY + 24].try_into().unwrap()),
    })
}

/// What the worker needs of the configuration, read again at each flush
/// (a reload may change the peers; the port and the key are the start's).
fn peers_of(cfg: &Arc<Mutex<LbConfig>>) -> Vec<Ipv6Addr> {
    cfg.lock().unwrap().scale_out.as_ref().map(|s| s.peers.clone()).unwrap_or_default()
}

/// Runs until `stop`: sends this instance's choices, takes the peers'.
/// Only with fleet tuples on (the daemon starts it then).
pub fn run(maps: &LbMaps, cfg: &Arc<Mutex<LbConfig>>, stop: &AtomicBool) -> Result<()> {
    let (bind, port, key) = {
        let c = cfg.lock().unwrap();
        let so = c.scale_out.as_ref().context("[scale_out] is not set")?;
        let (_, key_file) = so.fleet().context("[scale_out] fleet is off")?;
        let key = inband_core::auth::read_key(key_file).context("[scale_out] fleet_key")?;
        (c.address6.context("[scale_out] needs address6")?, so.peer_port, key)
    };
    let socket = UdpSocket::bind(SocketAddr::new(IpAddr::V6(bind), port)).with_context(|| format!("binding [{bind}]:{port} ([scale_out] peer_port)"))?;
    socket.set_nonblocking(true)?;
    let pending: Arc<Mutex<Vec<ChoiceRec>>> = Arc::default();
    let mut builder = libbpf_rs::RingBufferBuilder::new();
    let sink = Arc::clone(&pending);
    builder
        .add(&maps.choice_ring, move |d: &[u8]| {
            sink.lock().unwrap().push(ChoiceRec::from_bytes(d));
            0
        })
        .context("reading choice_ring")?;
    let ring = builder.build().context("reading choice_ring")?;
    let mut seq = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64);
    let mut receiver = Receiver::default();
    let mut last_flush = Instant::now();
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        let wait = if pending.lock().unwrap().is_empty() { IDLE_WAIT } else { MIN_GAP.saturating_sub(last_flush.elapsed()) };
        let mut fds = [
            libc::pollfd { fd: ring.epoll_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // ppoll, not poll: MIN_GAP's remainder is under a millisecond, which
        // poll's timeout would round to a busy loop.
        let timeout = libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
        // SAFETY: two valid pollfds for the length given, a valid timespec, no signal mask.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &timeout, std::ptr::null()) };
        let mut stats = ControlStats::default();
        ring.consume().context("reading choice_ring")?;
        let peers = peers_of(cfg);
        loop {
            let (n, from) = match socket.recv_from(&mut buf) {
                Ok(r) => r,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!(error = %e, "receiving a peer's choices");
                    break;
                }
            };
            match receiver.accept(&key, &peers, from.ip(), &buf[..n]) {
                Ok(choices) => match learn(maps, &choices) {
                    Ok(n) => stats.peer_records_learned += n,
                    Err(e) => warn!(error = %format!("{e:#}"), "writing a peer's choices into peer_choices"),
                },
                Err(Refused::UnknownSender) => stats.peer_unknown_sender += 1,
                Err(Refused::Malformed) => stats.peer_malformed += 1,
                Err(Refused::BadMac) => stats.peer_bad_mac += 1,
                Err(Refused::Replayed) => stats.peer_replayed += 1,
            }
        }
        if last_flush.elapsed() >= MIN_GAP && !pending.lock().unwrap().is_empty() {
            last_flush = Instant::now();
            let batch = std::mem::take(&mut *pending.lock().unwrap());
            send(&socket, &key, &peers, port, &batch, &mut seq, &mut stats);
        }
        let counted = [
            stats.peer_datagrams_sent,
            stats.peer_send_failures,
            stats.peer_records_learned,
            stats.peer_unknown_sender,
            stats.peer_malformed,
            stats.peer_bad_mac,
            stats.peer_replayed,
        ];
        if counted.iter().any(|&n| n > 0) {
            polling::add_control_stats(maps, &stats)?;
        }
    }
    Ok(())
}

/// `batch` to every peer, MAX_RECORDS a datagram. With no peers the
/// choices are only drained.
fn send(socket: &UdpSocket, key: &Key, peers: &[Ipv6Addr], port: u16, batch: &[ChoiceRec], seq: &mut u64, stats: &mut ControlStats) {
    if peers.is_empty() || batch.is_empty() {
        return;
    }
    let now = tables::ktime_ns();
    let choices: Vec<Choice> = batch
        .iter()
        .map(|r| Choice {
            key: r.key,
            backend_addr: r.backend_addr,
            backend_port: r.backend_port,
            age_ms: (now.saturating_sub(r.opened_ns) / 1_000_000).min(u64::from(u32::MAX)) as u32,
        })
        .collect();
    for chunk in choices.chunks(MAX_RECORDS) {
        *seq += 1;
        let d = encode(key, *seq, chunk);
        for p in peers {
            match socket.send_to(&d, SocketAddr::new(IpAddr::V6(*p), port)) {
                Ok(_) => {
                    stats.peer_datagrams_sent += 1;
                    stats.peer_records_sent += chunk.len() as u64;
                }
                Err(_) => stats.peer_send_failures += 1,
            }
        }
    }
}

/// Writes `choices` into `peer_choices`, each unless a newer one for its
/// client side is there (a delayed datagram after a reused client side's
/// new SYN). Returns how many were written.
fn learn(maps: &LbMaps, choices: &[Choice]) -> Result<u64> {
    let now = tables::ktime_ns();
    let mut n = 0;
    for c in choices {
        let opened_ns = now.saturating_sub(u64::from(c.age_ms) * 1_000_000);
        let old: Option<PeerChoice> = bpfmap::get(&maps.peer_choices, &c.key)?;
        if old.is_some_and(|o| o.opened_ns > opened_ns) {
            continue;
        }
        let v = PeerChoice { backend_addr: c.backend_addr, backend_port: c.backend_port, opened_ns, ..Default::default() };
        bpfmap::put(&maps.peer_choices, &c.key, &v)?;
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inband_core::pod::{be_ip, be_port};

    const K: Key = Key([7; 16]);
    const PEER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x51, 0, 0, 0, 0, 0, 2);

    fn choice(client_port: u16) -> Choice {
        let key = FlowKey {
            client_addr: be_ip("fd00:c::1".parse().unwrap()),
            vip_addr: be_ip("fd00:5::80".parse().unwrap()),
            client_port: be_port(client_port),
            vip_port: be_port(80),
            proto: TCP,
            pad: [0; 3],
        };
        Choice { key, backend_addr: be_ip("fd00:77::21".parse().unwrap()), backend_port: be_port(8080), age_ms: 42 }
    }

    #[test]
    fn a_datagram_is_its_bytes_and_comes_back_whole() {
        let d = encode(&K, 0x0102030405060708, &[choice(40000), choice(40001)]);
        assert_eq!(d.len(), HEADER + 2 * RECORD + MAC);
        assert_eq!(&d[..16], b"IBpc\x01\x02\x03\x04\x05\x06\x07\x08\x00\x02\x00\x00");
        // The first record: client address, VIP, ports, proto, backend, age.
        let r = &d[HEADER..HEADER + RECORD];
        assert_eq!(&r[..2], &[0xfd, 0x00]);
        assert_eq!(&r[32..37], &[0x9c, 0x40, 0x00, 0x50, 6]);
        assert_eq!(&r[40..42], &[0xfd, 0x00]);
        assert_eq!(&r[56..64], &[0x1f, 0x90, 0, 0, 0, 0, 0, 42]);
        assert_eq!(d[d.len() - MAC..], K.siphash(&d[..d.len() - MAC]).to_be_bytes());
        let got = Receiver::default().accept(&K, &[PEER], IpAddr::V6(PEER), &d).unwrap();
        assert_eq!(got, [choice(40000), choice(40001)]);
        assert_eq!(encode(&K, 1, &vec![choice(1); MAX_RECORDS]).len(), 1176);
    }

    #[test]
    fn every_flipped_bit_truncation_and_stranger_is_refused() {
        let d = encode(&K, 9, &[choice(40000)]);
        for bit in 0..d.len() * 8 {
            let mut bad = d.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let got = Receiver::default().accept(&K, &[PEER], IpAddr::V6(PEER), &bad);
            // The magic, the count and the padding are read before the MAC.
            assert!(matches!(got, Err(Refused::BadMac | Refused::Malformed)), "bit {bit}: {got:?}");
        }
        for len in 0..d.len() {
            assert_eq!(Receiver::default().accept(&K, &[PEER], IpAddr::V6(PEER), &d[..len]), Err(Refused::Malformed), "{len} bytes");
        }
        let mut longer = d.clone();
        longer.push(0);
        assert_eq!(Receiver::default().accept(&K, &[PEER], IpAddr::V6(PEER), &longer), Err(Refused::Malformed));
        assert_eq!(Receiver::default().accept(&Key([8; 16]), &[PEER], IpAddr::V6(PEER), &d), Err(Refused::BadMac));
        let stranger = IpAddr::V6("fd00:51::3".parse().unwrap());
        assert_eq!(Receiver::default().accept(&K, &[PEER], stranger, &d), Err(Refused::UnknownSender));
        assert_eq!(Receiver::default().accept(&K, &[PEER], IpAddr::V4("10.0.0.2".parse().unwrap()), &d), Err(Refused::UnknownSender));
        // Authentic, but naming a UDP flow: not a key the data path adopts.
        let mut udp = choice(40000);
        udp.key.proto = 17;
        assert_eq!(Receiver::default().accept(&K, &[PEER], IpAddr::V6(PEER), &encode(&K, 9, &[udp])), Err(Refused::Malformed));
    }

    #[test]
    fn a_replayed_or_older_sequence_is_refused_per_sender() {
        let mut r = Receiver::default();
        let other: Ipv6Addr = "fd00:51::3".parse().unwrap();
        let peers = [PEER, other];
        let d10 = encode(&K, 10, &[choice(1)]);
        assert!(r.accept(&K, &peers, IpAddr::V6(PEER), &d10).is_ok());
        assert_eq!(r.accept(&K, &peers, IpAddr::V6(PEER), &d10), Err(Refused::Replayed));
        assert_eq!(r.accept(&K, &peers, IpAddr::V6(PEER), &encode(&K, 9, &[choice(1)])), Err(Refused::Replayed));
        // Another sender's numbers are its own.
        assert!(r.accept(&K, &peers, IpAddr::V6(other), &d10).is_ok());
        assert!(r.accept(&K, &peers, IpAddr::V6(PEER), &encode(&K, 11, &[choice(1)])).is_ok());
        // A refused datagram does not move the sender's number on.
        let mut forged = encode(&K, 1000, &[choice(1)]);
        forged[20] ^= 1;
        assert_eq!(r.accept(&K, &peers, IpAddr::V6(PEER), &forged), Err(Refused::BadMac));
        assert!(r.accept(&K, &peers, IpAddr::V6(PEER), &encode(&K, 12, &[choice(1)])).is_ok());
    }
}

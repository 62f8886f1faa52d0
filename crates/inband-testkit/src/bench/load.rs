//! Load generators and receivers for the forwarding benchmark
//! (`bench/forwarding.py`), each run inside one testbed namespace:
//!
//! - `blast`: a pre-built TCP frame sent out of an interface with
//!   BPF_PROG_TEST_RUN in live-frame mode (the `tx` program writes it and
//!   returns XDP_TX): no socket, no stack and no syscall per packet. On a
//!   veth it is still not free (about 2 µs per frame with the sink on
//!   this project's VM), which is why the benchmark reports what each
//!   forwarder adds to it.
//! - `sink`: counts TCP packets to a port in XDP at the receiver, and drops
//!   them (raw load) or passes them to a real server.
//! - `stream` / `discard`: real TCP connections carrying small writes with
//!   TCP_NODELAY, for proxies (HAProxy) that only forward what a socket
//!   hands them.
//!
//! Every loop is bounded by a packet/message count and by time.

use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, Xdp, XdpFlags};
use serde::Serialize;

use crate::bpf::loadgen::LoadgenSkelBuilder;
use crate::packet::{PacketBuilder, TCP_ACK, TCP_PSH};

const XDP_DROP: u32 = 1;
const XDP_TX: u32 = 3;
/// Frames per BPF_PROG_TEST_RUN call: short enough that the time bound is
/// checked every few tens of milliseconds even on a slow path.
const CHUNK: u32 = 16_384;

#[derive(clap::Args, Debug)]
pub struct BlastArgs {
    #[arg(long, default_value = "eth0")]
    pub interface: String,
    /// Destination MAC: the next hop (balancer or server) on the segment.
    #[arg(long)]
    pub dst_mac: String,
    #[arg(long)]
    pub src: SocketAddrV4,
    #[arg(long)]
    pub dst: SocketAddrV4,
    /// TCP payload bytes; 10 makes a 64-byte Ethernet frame (no FCS).
    #[arg(long, default_value_t = 10)]
    pub payload: usize,
    /// Stop after this many frames.
    #[arg(long, default_value_t = 10_000_000)]
    pub packets: u64,
    /// Stop after this long, whichever comes first.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Frames per second at most (default: as fast as the path takes them).
    #[arg(long)]
    pub rate: Option<u64>,
    /// Send a SYN for the tuple first (a balancer needs a flow entry before
    /// it forwards established packets), then wait this many ms.
    #[arg(long)]
    pub syn_first_ms: Option<u64>,
    /// Drop each frame instead of sending it: what generating costs alone.
    #[arg(long)]
    pub drop: bool,
    /// Send SYNs from random sources instead (a SYN flood): each copy gets
    /// a random source address in this network, source port and sequence
    /// number; `--src` only gives the first frame's.
    #[arg(long)]
    pub spoof_from: Option<crate::bench::load::Net>,
}

/// An IPv4 network `a.b.c.d/len`.
#[derive(Clone, Copy, Debug)]
pub struct Net {
    pub addr: std::net::Ipv4Addr,
    pub len: u8,
}

impl std::str::FromStr for Net {
    type Err = String;
    fn from_str(s: &str) -> Result<Net, String> {
        let (a, l) = s.split_once('/').ok_or_else(|| format!("{s:?}: expected ADDRESS/LENGTH"))?;
        let len: u8 = l.parse().map_err(|_| format!("{s:?}: bad prefix length"))?;
        if len > 32 {
            return Err(format!("{s:?}: prefix length above 32"));
        }
        Ok(Net { addr: a.parse().map_err(|_| format!("{s:?}: bad address"))?, len })
    }
}

impl Net {
    /// (network, variable bits) as network-order words.
    fn spoof_words(&self) -> (u32, u32) {
        let mask = if self.len == 0 { 0 } else { u32::MAX << (32 - u32::from(self.len)) };
        ((u32::from(self.addr) & mask).to_be(), (!mask).to_be())
    }
}

#[derive(Debug, Serialize)]
pub struct BlastResult {
    pub sent: u64,
    pub seconds: f64,
    pub frame_bytes: usize,
}

/// Sends (or, with `--drop`, only makes) `count` copies of `frame`, bounded
/// by `deadline` from `start`; returns how many.
fn send_frames(a: &BlastArgs, ifindex: u32, frame: &[u8], count: u64, start: Instant, deadline: Duration) -> Result<u64> {
    // The program rewrites whole 8-byte words; the frame is padded to them
    // (Ethernet trailer bytes, outside the IP packet's total length).
    let mut padded = frame.to_vec();
    padded.resize(frame.len().div_ceil(8) * 8, 0);
    let words = padded.len() / 8;
    if words > 32 {
        bail!("frames up to 256 bytes");
    }
    let mut storage = MaybeUninit::uninit();
    let mut open = LoadgenSkelBuilder::default().open(&mut storage)?;
    if let Some(ro) = open.maps.rodata_data.as_mut() {
        for (i, w) in padded.chunks_exact(8).enumerate() {
            ro.tx_frame[i] = u64::from_ne_bytes(w.try_into().unwrap());
        }
        ro.tx_words = words as u32;
        ro.tx_verdict = if a.drop { XDP_DROP } else { XDP_TX };
        if let Some(net) = a.spoof_from {
            let (net, mask) = net.spoof_words();
            ro.tx_spoof = 1;
            ro.tx_spoof_net = net;
            ro.tx_spoof_mask = mask;
        }
    }
    let skel = open.load().context("loading the load generator")?;
    let fd = skel.progs.tx.as_fd();
    // Paced: a chunk every 100 ms (each run sets up a page pool, so small
    // chunks would cap the rate far below what the path takes).
    let chunk = a.rate.map_or(CHUNK, |r| (r / 10).clamp(1, u64::from(CHUNK)) as u32);
    let mut sent = 0u64;
    while sent < count && start.elapsed() < deadline {
        let n = chunk.min((count - sent) as u32);
        inband_core::xdp_live::run(fd, ifindex, &padded, n)?;
        sent += u64::from(n);
        if let Some(rate) = a.rate {
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    Ok(sent)
}

pub fn blast(a: &BlastArgs) -> Result<BlastResult> {
    let ifindex = inband_core::netif::ifindex(&a.interface)?;
    let src_mac = inband_core::netif::mac(&a.interface)?;
    let dst_mac = inband_core::netif::parse_mac(&a.dst_mac)?;
    let base = PacketBuilder::tcp(a.src, a.dst).macs(src_mac, dst_mac);
    if let Some(ms) = a.syn_first_ms {
        send_frames(a, ifindex, &base.clone().seq_no(999).syn(1460).build(), 1, Instant::now(), Duration::from_secs(1))?;
        std::thread::sleep(Duration::from_millis(ms));
    }
    let frame = if a.spoof_from.is_some() {
        base.syn(1460).build()
    } else {
        base.flags(TCP_ACK | TCP_PSH).payload(vec![b'x'; a.payload]).build()
    };
    let start = Instant::now();
    let sent = send_frames(a, ifindex, &frame, a.packets, start, Duration::from_secs_f64(a.seconds))?;
    Ok(BlastResult { sent, seconds: start.elapsed().as_secs_f64(), frame_bytes: frame.len() })
}

#[derive(clap::Args, Debug)]
pub struct SinkArgs {
    #[arg(long, default_value = "eth0")]
    pub interface: String,
    /// Count TCP packets to this port.
    #[arg(long)]
    pub port: u16,
    /// Pass counted packets on to the stack (a real server is listening)
    /// instead of dropping them.
    #[arg(long)]
    pub pass: bool,
    /// Detach and report after this long even without a signal.
    #[arg(long, default_value_t = 600)]
    pub max_seconds: u64,
}

#[derive(Debug, Serialize, Default)]
pub struct SinkResult {
    pub packets: u64,
    pub bytes: u64,
}

/// Attaches `prog` to `interface` (native XDP), prints `attached`, and
/// detaches on SIGTERM/SIGINT or after `max_seconds`.
fn attach_until_signal(prog: &libbpf_rs::Program, interface: &str, max_seconds: u64) -> Result<()> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    let xdp = Xdp::new(prog.as_fd());
    xdp.attach(ifindex, XdpFlags::DRV_MODE).with_context(|| format!("attaching XDP to {interface}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    println!("attached");
    std::io::stdout().flush()?;
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(max_seconds) {
        std::thread::sleep(Duration::from_millis(20));
    }
    xdp.detach(ifindex, XdpFlags::DRV_MODE).with_context(|| format!("detaching XDP from {interface}"))
}

/// The counter, attached until a signal; then prints the counts as JSON.
pub fn sink(a: &SinkArgs) -> Result<()> {
    let mut storage = MaybeUninit::uninit();
    let mut open = LoadgenSkelBuilder::default().open(&mut storage)?;
    if let Some(ro) = open.maps.rodata_data.as_mut() {
        ro.sink_port = a.port;
        ro.sink_drop = u8::from(!a.pass);
    }
    let skel = open.load().context("loading the sink")?;
    attach_until_signal(&skel.progs.sink, &a.interface, a.max_seconds)?;
    let mut r = SinkResult::default();
    let per_cpu = skel.maps.sink_counts.lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)?.unwrap_or_default();
    for v in per_cpu {
        let f = |i: usize| u64::from_ne_bytes(v[i * 8..i * 8 + 8].try_into().unwrap());
        r.packets += f(0);
        r.bytes += f(1);
    }
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

/// The bounce floor (swap MACs, XDP_TX) attached until a signal: the
/// least any XDP forwarder does, as a forwarding path of its own.
pub fn bounce(interface: &str, max_seconds: u64) -> Result<()> {
    let mut storage = MaybeUninit::uninit();
    let skel = crate::bpf::bounce::BounceSkelBuilder::default().open(&mut storage)?.load()?;
    attach_until_signal(&skel.progs.bounce, interface, max_seconds)
}

#[derive(clap::Args, Debug)]
pub struct StreamArgs {
    #[arg(long)]
    pub connect: SocketAddrV4,
    #[arg(long, default_value_t = 2)]
    pub connections: usize,
    /// Bytes per write, sent at once (TCP_NODELAY); writes share a segment
    /// only when the connection is backed up.
    #[arg(long, default_value_t = 64)]
    pub message: usize,
    #[arg(long, default_value_t = 50_000_000)]
    pub max_messages: u64,
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
}

#[derive(Debug, Serialize)]
pub struct StreamResult {
    pub messages: u64,
    pub bytes: u64,
    pub seconds: f64,
}

pub fn stream(a: &StreamArgs) -> Result<StreamResult> {
    let sent = Arc::new(AtomicU64::new(0));
    let deadline = Duration::from_secs_f64(a.seconds);
    let mut conns = Vec::new();
    for _ in 0..a.connections.max(1) {
        let s = TcpStream::connect_timeout(&a.connect.into(), Duration::from_secs(5))
            .with_context(|| format!("connecting to {}", a.connect))?;
        s.set_nodelay(true)?;
        s.set_write_timeout(Some(Duration::from_secs(2)))?;
        conns.push(s);
    }
    let start = Instant::now();
    let threads: Vec<_> = conns
        .into_iter()
        .map(|mut s| {
            let sent = Arc::clone(&sent);
            let (msg, max) = (vec![b'x'; a.message], a.max_messages);
            std::thread::spawn(move || -> Result<u64> {
                // Claims messages in batches so the shared counter is not
                // the bottleneck; checks the clock once per batch.
                const BATCH: u64 = 256;
                let mut written = 0;
                while start.elapsed() < deadline && sent.fetch_add(BATCH, Ordering::Relaxed) < max {
                    for _ in 0..BATCH {
                        s.write_all(&msg)?;
                    }
                    written += BATCH;
                }
                Ok(written)
            })
        })
        .collect();
    let mut messages = 0;
    for t in threads {
        messages += t.join().map_err(|_| anyhow::anyhow!("a stream thread panicked"))??;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(StreamResult { messages, bytes: messages * a.message as u64, seconds })
}

/// Accepts connections and reads everything they send until they close.
pub fn discard(listen: SocketAddrV4) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    println!("listening");
    std::io::stdout().flush()?;
    for s in l.incoming() {
        let mut s = s?;
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        });
    }
    Ok(())
}

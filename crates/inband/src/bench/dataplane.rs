//! Per-packet cost of each balancer path, measured in this process with
//! BPF_PROG_TEST_RUN against a private (unpinned) instance of the program,
//! next to `bounce` (swap MACs, XDP_TX): the least any XDP forwarder costs
//! on this CPU. Both are measured the same way on packets of the same size,
//! so the ratio is what to read; absolute ns depend on the machine.
//!
//! Every sample is one run (`repeat` = 1) of a fresh copy of the packet:
//! with `repeat` > 1 the kernel runs the program again on the packet it
//! has just rewritten (an established packet already NATed to the backend
//! is no longer for the VIP), which would time a different path. The kernel
//! times each run itself; the median of many runs is reported. Single runs
//! carry the cold-cache cost of entering the program after a syscall, for
//! the floor as much as for the balancer, so ratios are conservative.

use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4};

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{libbpf_sys, AsRawLibbpf, OpenObject, ProgramInput};
use serde::Serialize;

use crate::bpf::balancer::{BalancerSkel, BalancerSkelBuilder};
use crate::bpf::bounce::BounceSkelBuilder;
use crate::bpfmap::{get, put};
use crate::lb::maps::*;
use crate::lb::tables::{ktime_ns, vip_key};
use crate::packet::{PacketBuilder, TCP_ACK, TCP_PSH};
use crate::pod::{be_addr, be_port};
use crate::wire::InbandOption;

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const LB: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 100), 80);
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 1), 40000);
const BACKENDS: u8 = 3;
const PAYLOAD: usize = 64;
/// Mirrors INBAND_FLOW_TABLE_SIZE in balancer_maps.h.
const INBAND_FLOW_TABLE_SIZE: u32 = 262_144; // a small request segment: per-packet cost dominates

#[derive(Debug, Serialize)]
pub struct Row {
    pub path: &'static str,
    pub mode: &'static str,
    pub verdict: &'static str,
    pub ns_per_packet: f64,
    pub mpps: f64,
    pub ratio_to_floor: f64,
}

fn backend(i: u8) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 0, 1, i + 1), 8080)
}

fn load(storage: &mut MaybeUninit<OpenObject>) -> Result<BalancerSkel<'_>> {
    load_with(storage, BACKENDS)
}

fn load_with(storage: &mut MaybeUninit<OpenObject>, backends: u8) -> Result<BalancerSkel<'_>> {
    let mut open = BalancerSkelBuilder::default().open(storage)?;
    for map in open.open_object_mut().maps_mut() {
        // A private instance: nothing pinned, nothing shared with a running balancer.
        // SAFETY: a NULL path clears the pin path of a valid map.
        unsafe { libbpf_sys::bpf_map__set_pin_path(map.as_libbpf_object().as_ptr(), std::ptr::null()) };
    }
    let skel = open.load().context("loading the balancer program")?;
    put(&skel.maps.lb_config, &0u32, &LbConfig { self_addr: be_addr(LB), flags: 0 })?;
    for i in 0..backends {
        let b = backend(i);
        let id = u32::from(i);
        let entry = Backend { addr: be_addr(*b.ip()), port: be_port(b.port()), mac: [2, 0, 0, 0, 1, i], flags: BACKEND_ACTIVE, pad: 0 };
        put(&skel.maps.backends, &id, &entry)?;
        put(&skel.maps.vip_backends, &id, &id)?;
        put(&skel.maps.scores, &id, &BackendScore { score: u32::from(i), assigned_since: 0, updated_ns: ktime_ns() })?;
    }
    Ok(skel)
}

fn set_vip(skel: &BalancerSkel, mode: Mode, probe_interval: u32) -> Result<()> {
    set_vip_with(skel, mode, probe_interval, BACKENDS)
}

fn set_vip_with(skel: &BalancerSkel, mode: Mode, probe_interval: u32, backends: u8) -> Result<()> {
    let vip = Vip {
        id: 0,
        mode: mode as u8,
        policy: Policy::LeastScore as u8,
        backend_count: u16::from(backends),
        probe_interval,
        pad: 0,
        score_max_age_ns: 3_600_000_000_000,
    };
    put(&skel.maps.vips, &vip_key(VIP), &vip)
}

/// One run of `frame`: (verdict, ns the kernel measured).
fn run_once(prog: &libbpf_rs::ProgramMut, frame: &[u8]) -> Result<(u32, f64)> {
    let mut out = vec![0u8; frame.len() + 64];
    let mut input = ProgramInput::default();
    input.data_in = Some(frame);
    input.data_out = Some(&mut out);
    input.repeat = 1;
    let o = prog.test_run(input).context("BPF_PROG_TEST_RUN")?;
    Ok((o.return_value, o.duration.as_nanos() as f64))
}

/// Median ns over `samples` runs of `frame(i)`; fails if any run's verdict
/// differs from the first (the path changed under the measurement).
fn time(prog: &libbpf_rs::ProgramMut, samples: u32, frame: impl Fn(u32) -> Vec<u8>) -> Result<(u32, f64)> {
    let mut ns = Vec::with_capacity(samples as usize);
    let mut verdict = None;
    for i in 0..samples.max(1) {
        let (v, t) = run_once(prog, &frame(i))?;
        if *verdict.get_or_insert(v) != v {
            bail!("verdict changed from {} to {} during the measurement", verdict_name(verdict.unwrap()), verdict_name(v));
        }
        ns.push(t);
    }
    ns.sort_by(f64::total_cmp);
    Ok((verdict.unwrap_or(0), ns[ns.len() / 2]))
}

fn verdict_name(v: u32) -> &'static str {
    match v {
        1 => "XDP_DROP",
        XDP_PASS => "XDP_PASS",
        XDP_TX => "XDP_TX",
        _ => "other",
    }
}

/// The flow a client's SYN created: (backend, SNAT port).
fn flow_of(skel: &BalancerSkel, client: SocketAddrV4) -> Result<(SocketAddrV4, u16)> {
    let key = FlowKey {
        client_addr: be_addr(*client.ip()),
        vip_addr: be_addr(*VIP.ip()),
        client_port: be_port(client.port()),
        vip_port: be_port(VIP.port()),
        proto: 6,
        pad: [0; 3],
    };
    let f: Flow = get(&skel.maps.flows, &key)?.context("the SYN created no flow")?;
    Ok((SocketAddrV4::new(crate::pod::addr_of(f.backend_addr), crate::pod::port_of(f.backend_port)), crate::pod::port_of(f.snat_port)))
}

pub fn measure(samples: u32) -> Result<Vec<Row>> {
    let mut storage = MaybeUninit::uninit();
    let skel = load(&mut storage)?;
    let prog = &skel.progs.balancer;
    let data = || PacketBuilder::tcp(CLIENT, VIP).flags(TCP_ACK | TCP_PSH).payload(vec![b'x'; PAYLOAD]).build();
    let mut rows: Vec<(&'static str, &'static str, u32, f64)> = Vec::new();

    // New connections: a distinct client per run, so every SYN is new. Few
    // enough that SNAT port collisions stay negligible (each SYN tries 4
    // hashed ports among 31744 per backend).
    set_vip(&skel, Mode::DsrDynamic, 0)?;
    let (v, ns) = time(prog, samples.min(3000), |i| {
        let c = SocketAddrV4::new(Ipv4Addr::from(0xc0a8_0000 | (i >> 8 << 8) | 0x0100 | (i & 0xff)), 1024 + (i % 60000) as u16);
        PacketBuilder::tcp(c, VIP).syn(1460).build()
    })?;
    rows.push(("new connection (SYN: select, 155, MSS clamp)", "dsr-dynamic", v, ns));

    // Established, then probes, on one flow.
    run_once(prog, &PacketBuilder::tcp(CLIENT, VIP).syn(1460).build())?;
    let (backend, snat) = flow_of(&skel, CLIENT)?;
    let (v, ns) = time(prog, samples, |_| data())?;
    rows.push(("established (client -> backend)", "dsr-dynamic", v, ns));
    set_vip(&skel, Mode::DsrDynamic, 1)?;
    let (v, ns) = time(prog, samples, |_| data())?;
    rows.push(("established + score request (124)", "dsr-dynamic", v, ns));
    set_vip(&skel, Mode::Passthrough, 0)?;
    let (v, ns) = time(prog, samples, |_| data())?;
    rows.push(("established (client -> backend)", "passthrough", v, ns));

    // Returns through the balancer.
    let reply = move || PacketBuilder::tcp(backend, SocketAddrV4::new(LB, snat)).flags(TCP_ACK | TCP_PSH).payload(vec![b'y'; PAYLOAD]);
    let (v, ns) = time(prog, samples, |_| reply().ip_options(InbandOption::Score(7).encode()).build())?;
    rows.push(("score return (125: record, strip, NAT back)", "dsr-dynamic", v, ns));
    let (v, ns) = time(prog, samples, |_| reply().build())?;
    rows.push(("return (backend -> client, NAT back)", "passthrough", v, ns));
    let other = PacketBuilder::tcp(CLIENT, SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 7), 22)).payload(vec![0; PAYLOAD]).build();
    let (v, ns) = time(prog, samples, |_| other.clone())?;
    rows.push(("not for a VIP (pass to the kernel)", "any", v, ns));

    let mut bstorage = MaybeUninit::uninit();
    let bounce = BounceSkelBuilder::default().open(&mut bstorage)?.load()?;
    let (v, floor) = time(&bounce.progs.bounce, samples, |_| data())?;
    if v != XDP_TX || floor <= 0.0 {
        bail!("the bounce floor did not run (verdict {v}, {floor} ns)");
    }
    rows.push(("floor: bounce (swap MACs, XDP_TX)", "-", v, floor));

    Ok(rows
        .into_iter()
        .map(|(path, mode, v, ns)| Row {
            path,
            mode,
            verdict: verdict_name(v),
            ns_per_packet: ns,
            mpps: if ns > 0.0 { 1000.0 / ns } else { 0.0 },
            ratio_to_floor: ns / floor,
        })
        .collect())
}

/// What a flood of new connections does to the connection table.
#[derive(Debug, Serialize)]
pub struct TableScale {
    pub syns: u32,
    pub backends: u8,
    pub table_size: u32,
    pub forwarded: u32,
    pub dropped: u32,
    pub drops_by_reason: Vec<(&'static str, u64)>,
    pub flows_in_table: usize,
    /// Of the first 1000 connections, how many still have their flow entry.
    pub oldest_1000_kept: u32,
    /// Of the last 1000 connections, how many have their flow entry.
    pub newest_1000_kept: u32,
    pub new_conns_per_s_one_core: f64,
}

fn flood_client(i: u32) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(0x0a80_0000 | (i >> 6)), 1024 + (i & 63) as u16)
}

/// Pushes `syns` distinct SYNs through a private instance (dsr-rr over
/// `backends` backends) and reports what the tables did: the LRU evicts the
/// least recently used flows, SNAT ports run out per backend.
pub fn table_scale(syns: u32, backends: u8) -> Result<TableScale> {
    let mut storage = MaybeUninit::uninit();
    let skel = load_with(&mut storage, backends)?;
    set_vip_with(&skel, Mode::DsrRr, 0, backends)?;
    let prog = &skel.progs.balancer;
    let (mut forwarded, mut dropped, mut ns) = (0u32, 0u32, 0f64);
    for i in 0..syns {
        let (v, t) = run_once(prog, &PacketBuilder::tcp(flood_client(i), VIP).syn(1460).build())?;
        ns += t;
        if v == XDP_TX {
            forwarded += 1;
        } else {
            dropped += 1;
        }
    }
    let has_flow = |i: u32| -> Result<bool> {
        let c = flood_client(i);
        let key = FlowKey {
            client_addr: be_addr(*c.ip()),
            vip_addr: be_addr(*VIP.ip()),
            client_port: be_port(c.port()),
            vip_port: be_port(VIP.port()),
            proto: 6,
            pad: [0; 3],
        };
        Ok(get::<FlowKey, Flow>(&skel.maps.flows, &key)?.is_some())
    };
    let count_kept = |range: std::ops::Range<u32>| -> Result<u32> {
        let mut n = 0;
        for i in range {
            n += u32::from(has_flow(i)?);
        }
        Ok(n)
    };
    let mut drops_by_reason = Vec::new();
    for r in DropReason::ALL {
        let n: u64 = crate::bpfmap::get_percpu::<u32, u64>(&skel.maps.drops, &(r as u32))?.iter().sum();
        if n > 0 {
            drops_by_reason.push((r.name(), n));
        }
    }
    Ok(TableScale {
        syns,
        backends,
        table_size: INBAND_FLOW_TABLE_SIZE,
        forwarded,
        dropped,
        drops_by_reason,
        flows_in_table: crate::bpfmap::count(&skel.maps.flows),
        oldest_1000_kept: count_kept(0..1000.min(syns))?,
        newest_1000_kept: count_kept(syns.saturating_sub(1000)..syns)?,
        new_conns_per_s_one_core: if ns > 0.0 { f64::from(syns) * 1e9 / ns } else { 0.0 },
    })
}

pub fn render(rows: &[Row]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "| path | mode | verdict | ns/packet | Mpps (1 core) | × floor |");
    let _ = writeln!(o, "|---|---|---|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {:.1} | {:.2} | {:.2} |",
            r.path, r.mode, r.verdict, r.ns_per_packet, r.mpps, r.ratio_to_floor
        );
    }
    o
}

pub fn render_scale(s: &TableScale) -> String {
    let drops: Vec<String> = s.drops_by_reason.iter().map(|(r, n)| format!("{r} {n}")).collect();
    format!(
        "| new connections pushed | backends | flow table | forwarded | dropped (by reason) | flows in table | oldest 1000 kept | newest 1000 kept | new conns/s, 1 core |\n\
         |---:|---:|---:|---:|---|---:|---:|---:|---:|\n\
         | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {:.0} |\n",
        s.syns,
        s.backends,
        s.table_size,
        s.forwarded,
        s.dropped,
        if drops.is_empty() { "none".to_string() } else { drops.join(", ") },
        s.flows_in_table,
        s.oldest_1000_kept,
        s.newest_1000_kept,
        s.new_conns_per_s_one_core
    )
}

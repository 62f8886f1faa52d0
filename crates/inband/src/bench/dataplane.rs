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
//!
//! Also here: what floods and churn do to the flow tables (`table_scale`,
//! `churn`) and what a sweep of a full table costs (`sweep_cost`).

use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::ProgramInput;
use serde::Serialize;

use crate::bpf::bounce::BounceSkelBuilder;
use crate::bpf::shared as c;
use crate::bpfmap::{count, get, put};
use crate::lb::maps::*;
use crate::lb::private::{PrivateBalancer, XDP_PASS, XDP_TX};
use crate::lb::tables::{ktime_ns, vip_key};
use crate::packet::{PacketBuilder, TCP_ACK, TCP_FIN, TCP_PSH};
use crate::pod::{be_addr, be_port};
use crate::wire::{Conn, InbandOption, Key};

const LB: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 100), 80);
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 1), 40000);
const BACKENDS: u8 = 3;
/// A small request segment: per-packet cost dominates.
const PAYLOAD: usize = 64;
const FLOW_TABLE_SIZE: u32 = c::INBAND_FLOW_TABLE_SIZE;
const KEY: Key = Key(*b"inband-bench-key");
const KEY_ID: u8 = 1;

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

fn lb_config(auth: u32) -> LbConfig {
    LbConfig { self_addr: be_addr(LB), mtu: 1500, auth_mode: auth as u8, sign_key: KEY_ID, snat_key: [7, 11] }
}

/// A private balancer with `backends` ACTIVE backends (scores 0, 1, ...,
/// fresh), the bench key, and one VIP in `mode`.
fn load(storage: &mut MaybeUninit<libbpf_rs::OpenObject>, backends: u8, auth: u32) -> Result<PrivateBalancer<'_>> {
    let lb = PrivateBalancer::load(storage, FLOW_TABLE_SIZE, &lb_config(auth))?;
    crate::auth::write_keys(&lb.skel.maps.auth_keys, &[(KEY_ID, KEY)])?;
    for i in 0..backends {
        let b = backend(i);
        let entry = Backend { addr: be_addr(*b.ip()), port: be_port(b.port()), mac: [2, 0, 0, 0, 1, i], flags: BACKEND_ACTIVE, ..Default::default() };
        lb.set_backend(u32::from(i), &entry)?;
        put(&lb.skel.maps.scores, &u32::from(i), &BackendScore { score: u32::from(i), updated_ns: ktime_ns(), ..Default::default() })?;
    }
    set_vip(&lb, Mode::DsrDynamic, 0, backends)?;
    Ok(lb)
}

fn set_vip(lb: &PrivateBalancer, mode: Mode, probe_interval: u32, backends: u8) -> Result<()> {
    let vip = Vip {
        mode: mode as u8,
        policy: Policy::LeastScore as u8,
        flags: VIP_ACTIVE,
        probe_interval,
        // Long enough that nothing goes stale or expires while measured.
        score_max_age_ns: 3_600_000_000_000,
        syn_timeout_ns: 5_000_000_000,
        idle_timeout_ns: 900_000_000_000,
        closing_timeout_ns: 10_000_000_000,
        ..Default::default()
    };
    let slots: Vec<u32> = (0..u32::from(backends)).collect();
    lb.set_vip(0, vip_key(VIP), &vip, &slots)
}

/// Median ns over `samples` runs of `frame(i)`; fails if any run's verdict
/// differs from the first (the path changed under the measurement).
fn time(lb: &PrivateBalancer, samples: u32, frame: impl Fn(u32) -> Vec<u8>) -> Result<(u32, f64)> {
    let mut ns = Vec::with_capacity(samples as usize);
    let mut verdict = None;
    for i in 0..samples.max(1) {
        let r = lb.run(&frame(i))?;
        if *verdict.get_or_insert(r.verdict) != r.verdict {
            bail!("verdict changed from {} to {} during the measurement", verdict_name(verdict.unwrap()), verdict_name(r.verdict));
        }
        ns.push(r.ns);
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

fn flow_key(client: SocketAddrV4) -> FlowKey {
    FlowKey {
        client_addr: be_addr(*client.ip()),
        vip_addr: be_addr(*VIP.ip()),
        client_port: be_port(client.port()),
        vip_port: be_port(VIP.port()),
        proto: 6,
        pad: [0; 3],
    }
}

/// Opens `client`'s connection (SYN, then the handshake's ACK) and returns
/// (backend, SNAT port).
fn connect(lb: &PrivateBalancer, client: SocketAddrV4) -> Result<(SocketAddrV4, u16)> {
    lb.run(&PacketBuilder::tcp(client, VIP).syn(1460).build())?;
    lb.run(&PacketBuilder::tcp(client, VIP).flags(TCP_ACK).build())?;
    let f: Flow = get(&lb.skel.maps.flows, &flow_key(client))?.context("the handshake created no flow")?;
    Ok((SocketAddrV4::new(crate::pod::addr_of(f.backend_addr), crate::pod::port_of(f.backend_port)), crate::pod::port_of(f.snat_port)))
}

fn syn_client(i: u32) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(0xc0a8_0000 | (i >> 8 << 8) | 0x0100 | (i & 0xff)), 1024 + (i % 60000) as u16)
}

/// Clears `client`'s outstanding 124, as if its 125 had come: a flow asks
/// again only then.
fn answered(lb: &PrivateBalancer, client: SocketAddrV4) -> Result<()> {
    let k = flow_key(client);
    let mut f: Flow = get(&lb.skel.maps.flows, &k)?.context("no flow")?;
    f.flags &= !(FLOW_PROBE_OUTSTANDING | c::INBAND_FLOW_PROBE_OLD as u8);
    put(&lb.skel.maps.flows, &k, &f)
}

/// Marks `client`'s flow as having an outstanding 124 with `nonce`, as if
/// the balancer had just sent one.
fn expect_score(lb: &PrivateBalancer, client: SocketAddrV4, nonce: [u8; 4]) -> Result<()> {
    let k = flow_key(client);
    let mut f: Flow = get(&lb.skel.maps.flows, &k)?.context("no flow")?;
    f.flags |= FLOW_PROBE_OUTSTANDING;
    f.probe_nonce = u32::from_ne_bytes(nonce);
    f.probe_key = KEY_ID;
    put(&lb.skel.maps.flows, &k, &f)
}

pub fn measure(samples: u32) -> Result<Vec<Row>> {
    let mut rows: Vec<(&'static str, &'static str, u32, f64)> = Vec::new();
    let data = || PacketBuilder::tcp(CLIENT, VIP).flags(TCP_ACK | TCP_PSH).payload(vec![b'x'; PAYLOAD]).build();
    for auth in [c::INBAND_AUTH_SIPHASH, c::INBAND_AUTH_NONE] {
        let mut storage = MaybeUninit::uninit();
        let lb = load(&mut storage, BACKENDS, auth)?;
        let new_conn = if auth == c::INBAND_AUTH_SIPHASH { "new connection (SYN: select, SNAT, 155 + MAC)" } else { "new connection (SYN: select, SNAT, seed 155)" };
        // A distinct client per run, so every SYN is new.
        let (v, ns) = time(&lb, samples.min(3000), |i| PacketBuilder::tcp(syn_client(i), VIP).syn(1460).build())?;
        rows.push((new_conn, "dsr-dynamic", v, ns));
        if auth == c::INBAND_AUTH_SIPHASH {
            let (v, ns) = time(&lb, samples.min(3000), |i| PacketBuilder::tcp(syn_client(i), VIP).flags(TCP_ACK).build())?;
            rows.push(("handshake done (first ACK: half-open -> flows)", "dsr-dynamic", v, ns));
        }
        let (backend, snat) = connect(&lb, CLIENT)?;
        if auth == c::INBAND_AUTH_SIPHASH {
            let (v, ns) = time(&lb, samples, |_| data())?;
            rows.push(("established (client -> backend)", "dsr-dynamic", v, ns));
        }
        set_vip(&lb, Mode::DsrDynamic, 1, BACKENDS)?;
        let request = if auth == c::INBAND_AUTH_SIPHASH { "established + score request (124 + MAC)" } else { "established + score request (seed 124)" };
        let (v, ns) = time(&lb, samples, |_| {
            answered(&lb, CLIENT).expect("flow");
            data()
        })?;
        rows.push((request, "dsr-dynamic", v, ns));
        set_vip(&lb, Mode::DsrDynamic, 0, BACKENDS)?;

        // Score returns: the flow expects a 125 before every run.
        let conn = Conn { lb: SocketAddrV4::new(LB, snat), backend };
        let nonce = [1, 2, 3, 4];
        let opt = if auth == c::INBAND_AUTH_SIPHASH { InbandOption::auth_score(&KEY, KEY_ID, nonce, conn, 7) } else { InbandOption::Score(7) };
        let reply = move || PacketBuilder::tcp(backend, SocketAddrV4::new(LB, snat)).flags(TCP_ACK | TCP_PSH).payload(vec![b'y'; PAYLOAD]);
        let score = if auth == c::INBAND_AUTH_SIPHASH { "score return (125: checksums, MAC, record, strip)" } else { "score return (seed 125: checksums, record, strip)" };
        let (v, ns) = time(&lb, samples, |_| {
            expect_score(&lb, CLIENT, nonce).expect("flow");
            reply().ip_options(opt.encode()).build()
        })?;
        rows.push((score, "dsr-dynamic", v, ns));
        if auth == c::INBAND_AUTH_SIPHASH {
            set_vip(&lb, Mode::Passthrough, 0, BACKENDS)?;
            let (v, ns) = time(&lb, samples, |_| data())?;
            rows.push(("established (client -> backend)", "passthrough", v, ns));
            let (v, ns) = time(&lb, samples, |_| reply().build())?;
            rows.push(("return (backend -> client, NAT back)", "passthrough", v, ns));
            let other = PacketBuilder::tcp(CLIENT, SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 7), 22)).payload(vec![0; PAYLOAD]).build();
            let (v, ns) = time(&lb, samples, |_| other.clone())?;
            rows.push(("not for a VIP (pass to the kernel)", "any", v, ns));
        }
    }

    let mut bstorage = MaybeUninit::uninit();
    let bounce = BounceSkelBuilder::default().open(&mut bstorage)?.load()?;
    let mut floor_ns = Vec::new();
    for _ in 0..samples.max(1) {
        let frame = data();
        let mut out = vec![0u8; frame.len()];
        let input = ProgramInput { data_in: Some(&frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
        let o = bounce.progs.bounce.test_run(input)?;
        if o.return_value != XDP_TX {
            bail!("the bounce floor did not run (verdict {})", o.return_value);
        }
        floor_ns.push(o.duration.as_nanos() as f64);
    }
    floor_ns.sort_by(f64::total_cmp);
    let floor = floor_ns[floor_ns.len() / 2];
    if floor <= 0.0 {
        bail!("the bounce floor took no time");
    }
    rows.push(("floor: bounce (swap MACs, XDP_TX)", "-", XDP_TX, floor));

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

/// What a flood of new connections that never complete does to the tables.
#[derive(Debug, Serialize)]
pub struct TableScale {
    pub syns: u32,
    pub backends: u8,
    pub half_open_table: u32,
    pub snat_ports: u32,
    pub forwarded: u32,
    pub dropped: u32,
    pub drops_by_reason: Vec<(&'static str, u64)>,
    pub half_open_in_table: usize,
    pub established_in_table: usize,
    pub half_open_ports_preempted: u64,
    /// Of the first 1000 SYNs, how many still have their half-open entry.
    pub oldest_1000_kept: u32,
    /// Of the last 1000 SYNs, how many have their half-open entry.
    pub newest_1000_kept: u32,
    pub new_conns_per_s_one_core: f64,
}

fn flood_client(i: u32) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(0x0a80_0000 | (i >> 6)), 1024 + (i & 63) as u16)
}

fn drops_by_reason(lb: &PrivateBalancer) -> Result<Vec<(&'static str, u64)>> {
    Ok(DROP_NAMES.iter().copied().zip(lb.drops()?).filter(|(_, n)| *n > 0).collect())
}

/// Pushes `syns` distinct SYNs that never complete through a private
/// instance (dsr-rr over `backends` backends) and reports what the tables
/// did: the half-open table keeps the newest handshakes, ports held by
/// unfinished handshakes are taken over, established flows are untouched.
pub fn table_scale(syns: u32, backends: u8) -> Result<TableScale> {
    let mut storage = MaybeUninit::uninit();
    let lb = load(&mut storage, backends, c::INBAND_AUTH_SIPHASH)?;
    set_vip(&lb, Mode::DsrRr, 0, backends)?;
    let (mut forwarded, mut dropped, mut ns) = (0u32, 0u32, 0f64);
    for i in 0..syns {
        let r = lb.run(&PacketBuilder::tcp(flood_client(i), VIP).syn(1460).build())?;
        ns += r.ns;
        if r.verdict == XDP_TX {
            forwarded += 1;
        } else {
            dropped += 1;
        }
    }
    let kept = |range: std::ops::Range<u32>| -> Result<u32> {
        let mut n = 0;
        for i in range {
            n += u32::from(get::<FlowKey, Flow>(&lb.skel.maps.half_open, &flow_key(flood_client(i)))?.is_some());
        }
        Ok(n)
    };
    let events = lb.events()?;
    Ok(TableScale {
        syns,
        backends,
        half_open_table: crate::lb::attach::table_sizes(FLOW_TABLE_SIZE)[1].1,
        snat_ports: u32::from(backends) * SNAT_PORTS,
        forwarded,
        dropped,
        drops_by_reason: drops_by_reason(&lb)?,
        half_open_in_table: count(&lb.skel.maps.half_open),
        established_in_table: count(&lb.skel.maps.flows),
        half_open_ports_preempted: events[event_index("snat_preempt_half_open")],
        oldest_1000_kept: kept(0..1000.min(syns))?,
        newest_1000_kept: kept(syns.saturating_sub(1000)..syns)?,
        new_conns_per_s_one_core: if ns > 0.0 { f64::from(syns) * 1e9 / ns } else { 0.0 },
    })
}

/// Many short connections through a private instance, each opened and
/// properly closed (SYN, ACK, FIN, ACK), faster than their ports' closing
/// timeout lets go of them.
#[derive(Debug, Serialize)]
pub struct Churn {
    pub connections: u32,
    pub backends: u8,
    pub snat_ports: u32,
    pub refused: u64,
    pub drops_by_reason: Vec<(&'static str, u64)>,
    pub closing_ports_reused: u64,
    pub orphans_reclaimed: u64,
    pub flows_in_table: usize,
    pub connections_per_s_one_core: f64,
    pub wall_s: f64,
}

pub fn churn(connections: u32, backends: u8) -> Result<Churn> {
    let mut storage = MaybeUninit::uninit();
    let lb = load(&mut storage, backends, c::INBAND_AUTH_SIPHASH)?;
    set_vip(&lb, Mode::DsrDynamic, 0, backends)?;
    let start = Instant::now();
    let mut ns = 0f64;
    let mut refused = 0u64;
    for i in 0..connections {
        // Distinct client tuples: 64 ports on each of many addresses.
        let c = SocketAddrV4::new(Ipv4Addr::from(0x0b00_0000 | (i >> 6)), 20000 + (i & 63) as u16);
        let steps = [
            PacketBuilder::tcp(c, VIP).syn(1460).build(),
            PacketBuilder::tcp(c, VIP).flags(TCP_ACK).build(),
            PacketBuilder::tcp(c, VIP).flags(TCP_ACK | TCP_FIN).build(),
            PacketBuilder::tcp(c, VIP).flags(TCP_ACK).build(),
        ];
        for (n, frame) in steps.iter().enumerate() {
            let r = lb.run(frame)?;
            ns += r.ns;
            if r.verdict != XDP_TX {
                refused += u64::from(n == 0);
                break;
            }
        }
    }
    let events = lb.events()?;
    Ok(Churn {
        connections,
        backends,
        snat_ports: u32::from(backends) * SNAT_PORTS,
        refused,
        drops_by_reason: drops_by_reason(&lb)?,
        closing_ports_reused: events[event_index("snat_preempt_closing")],
        orphans_reclaimed: events[event_index("snat_orphans_reclaimed")],
        flows_in_table: count(&lb.skel.maps.flows),
        connections_per_s_one_core: if ns > 0.0 { f64::from(connections) * 1e9 / ns } else { 0.0 },
        wall_s: start.elapsed().as_secs_f64(),
    })
}

/// What one sweep of a table of `flows` established flows costs.
#[derive(Debug, Serialize)]
pub struct SweepCost {
    pub flows: u32,
    pub sweep_ms: f64,
    pub ns_per_flow: f64,
}

pub fn sweep_cost(flows: u32) -> Result<SweepCost> {
    let mut storage = MaybeUninit::uninit();
    let lb = load(&mut storage, BACKENDS, c::INBAND_AUTH_SIPHASH)?;
    let now = ktime_ns();
    for i in 0..flows {
        let k = flow_key(SocketAddrV4::new(Ipv4Addr::from(0x0c00_0000 | i), 5000));
        let port = 1024 + (i % SNAT_PORTS) as u16;
        let b = (i % u32::from(BACKENDS)) as u8;
        let f = Flow {
            backend_addr: be_addr(*backend(b).ip()),
            backend_port: be_port(8080),
            snat_port: be_port(port),
            backend_id: u16::from(b),
            state: FLOW_ESTABLISHED,
            last_seen_ns: now,
            ..Default::default()
        };
        put(&lb.skel.maps.flows, &k, &f)?;
    }
    lb.sweep(0)?;
    let st: SweepStats = get(&lb.skel.maps.sweep_stats, &0u32)?.unwrap_or_default();
    let ms = st.last_duration_ns as f64 / 1e6;
    Ok(SweepCost { flows, sweep_ms: ms, ns_per_flow: st.last_duration_ns as f64 / f64::from(flows.max(1)) })
}

pub fn render(rows: &[Row]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "| path | mode | verdict | ns/packet | Mpps (1 core) | × floor |");
    let _ = writeln!(o, "|---|---|---|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(o, "| {} | {} | {} | {:.1} | {:.2} | {:.2} |", r.path, r.mode, r.verdict, r.ns_per_packet, r.mpps, r.ratio_to_floor);
    }
    o
}

fn reasons(d: &[(&str, u64)]) -> String {
    if d.is_empty() {
        "none".to_string()
    } else {
        d.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", ")
    }
}

pub fn render_scale(s: &TableScale) -> String {
    format!(
        "| SYNs, never completed | backends (SNAT ports) | half-open table | forwarded | dropped (by reason) | half-open kept | established | ports taken from older handshakes | oldest 1000 kept | newest 1000 kept | new conns/s, 1 core |\n\
         |---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|\n\
         | {} | {} ({}) | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {:.0} |\n",
        s.syns,
        s.backends,
        s.snat_ports,
        s.half_open_table,
        s.forwarded,
        s.dropped,
        reasons(&s.drops_by_reason),
        s.half_open_in_table,
        s.established_in_table,
        s.half_open_ports_preempted,
        s.oldest_1000_kept,
        s.newest_1000_kept,
        s.new_conns_per_s_one_core
    )
}

pub fn render_churn(c: &Churn) -> String {
    format!(
        "| connections opened and closed | backends (SNAT ports) | refused (by reason) | ports reused from closing flows | orphaned reservations reclaimed | flows left in table | connections/s, 1 core | wall s |\n\
         |---:|---:|---|---:|---:|---:|---:|---:|\n\
         | {} | {} ({}) | {} ({}) | {} | {} | {} | {:.0} | {:.1} |\n",
        c.connections,
        c.backends,
        c.snat_ports,
        c.refused,
        reasons(&c.drops_by_reason),
        c.closing_ports_reused,
        c.orphans_reclaimed,
        c.flows_in_table,
        c.connections_per_s_one_core,
        c.wall_s
    )
}

pub fn render_sweep(s: &SweepCost) -> String {
    format!(
        "| flows swept | one sweep, ms | ns per flow |\n|---:|---:|---:|\n| {} | {:.1} | {:.0} |\n",
        s.flows, s.sweep_ms, s.ns_per_flow
    )
}

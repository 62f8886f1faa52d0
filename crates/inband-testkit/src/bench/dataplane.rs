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
//! `churn`), what a sweep of a full table costs (`sweep_cost`), and how
//! the cost grows with backends and live flows (`scale`).

pub mod scale;

use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::ProgramInput;
use serde::Serialize;

use crate::bpf::bounce::BounceSkelBuilder;
use inband_core::shared as c;
use inband_core::bpfmap::{count, get, put};
use inband_core::net::Protocol;
use inband_lb::maps::*;
use inband_lb::private::{PrivateBalancer, XDP_PASS, XDP_TX};
use inband_lb::tables::{backend_endpoint, ktime_ns, vip_key};
use crate::packet::{PacketBuilder, IPPROTO_TCP, TCP_ACK, TCP_FIN, TCP_PSH};
use inband_core::pod::{be_ip, be_port, port_of};
use inband_core::wire::{Conn, InbandOption, Key};

const LB: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const LB6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);
const BACKENDS: u8 = 3;
/// A small request segment: per-packet cost dominates.
const PAYLOAD: usize = 64;
const FLOW_TABLE_SIZE: u32 = c::INBAND_FLOW_TABLE_SIZE;
const KEY: Key = Key(*b"inband-bench-key");
const KEY_ID: u8 = 1;
/// The server id the QUIC rows' first backend puts in its connection IDs.
const QUIC_SERVER_ID: u16 = 7;

#[derive(Debug, Serialize)]
pub struct Row {
    pub path: &'static str,
    /// IPv4, IPv6, or UDP (QUIC) over IPv4.
    pub traffic: &'static str,
    pub mode: &'static str,
    pub verdict: &'static str,
    pub ns_per_packet: f64,
    pub mpps: f64,
    pub ratio_to_floor: f64,
}

/// The addresses of one VIP's measurements: its family, transport, VIP id
/// and backend ids.
#[derive(Clone, Copy)]
struct VipPlan {
    vid: u32,
    vip: SocketAddr,
    proto: Protocol,
    /// Backend ids first_id .. first_id + BACKENDS.
    first_id: u32,
}

const TCP4: VipPlan = VipPlan { vid: 0, vip: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 100)), 80), proto: Protocol::Tcp, first_id: 0 };
const TCP6: VipPlan = VipPlan {
    vid: 1,
    vip: SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x100)), 80),
    proto: Protocol::Tcp,
    first_id: 4,
};
const QUIC4: VipPlan =
    VipPlan { vid: 2, vip: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 100)), 443), proto: Protocol::Udp, first_id: 8 };

impl VipPlan {
    fn v4(&self) -> bool {
        self.vip.is_ipv4()
    }
    fn lb(&self) -> IpAddr {
        if self.v4() {
            IpAddr::V4(LB)
        } else {
            IpAddr::V6(LB6)
        }
    }
    fn backend(&self, i: u8) -> SocketAddr {
        let port = if self.proto == Protocol::Udp { 8443 } else { 8080 };
        if self.v4() {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 1, i + 1)), port)
        } else {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 1, 0, 0, 0, 0, u16::from(i) + 1)), port)
        }
    }
    /// A distinct client per `i`.
    fn client(&self, i: u32) -> SocketAddr {
        let port = 1024 + (i % 60000) as u16;
        if self.v4() {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0xc0a8_0000 | (i >> 8 << 8) | 0x0100 | (i & 0xff))), port)
        } else {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, (i >> 16) as u16, i as u16)), port)
        }
    }
    fn packet(&self, from: SocketAddr, to: SocketAddr) -> PacketBuilder {
        match self.proto {
            Protocol::Tcp => PacketBuilder::tcp(from, to),
            Protocol::Udp => PacketBuilder::udp(from, to),
        }
    }
    /// A 64-byte request segment (a QUIC short header naming the first
    /// backend, for UDP).
    fn data(&self, client: SocketAddr) -> Vec<u8> {
        let mut payload = vec![b'x'; PAYLOAD];
        if self.proto == Protocol::Udp {
            payload[..4].copy_from_slice(&[0x40, c::INBAND_QUIC_CID_FIRST as u8, (QUIC_SERVER_ID >> 8) as u8, QUIC_SERVER_ID as u8]);
        }
        self.packet(client, self.vip).flags(TCP_ACK | TCP_PSH).payload(payload).build()
    }
    fn key(&self, client: SocketAddr) -> FlowKey {
        FlowKey {
            client_addr: be_ip(client.ip()),
            vip_addr: be_ip(self.vip.ip()),
            client_port: be_port(client.port()),
            vip_port: be_port(self.vip.port()),
            proto: self.proto.number(),
            pad: [0; 3],
        }
    }
}

fn lb_config(auth: u32) -> DataPathConfig {
    DataPathConfig {
        self4: be_ip(IpAddr::V4(LB)),
        self6: be_ip(IpAddr::V6(LB6)),
        mtu: 1500,
        auth_mode: auth as u8,
        sign_key: KEY_ID,
        maglev_size: 0,
        snat_key: [7, 11],
        ..Default::default()
    }
}

/// A private balancer with the bench key and one VIP of each plan, each
/// with `backends` ACTIVE backends (scores 0, 1, ..., fresh).
fn load(storage: &mut MaybeUninit<libbpf_rs::OpenObject>, backends: u8, auth: u32) -> Result<PrivateBalancer<'_>> {
    let lb = PrivateBalancer::load(storage, FLOW_TABLE_SIZE, &lb_config(auth))?;
    inband_core::auth::write_keys(&lb.skel.maps.auth_keys, &[(KEY_ID, KEY)])?;
    for plan in [TCP4, TCP6, QUIC4] {
        for i in 0..backends {
            let b = plan.backend(i);
            let entry = Backend {
                addr: be_ip(b.ip()),
                port: be_port(b.port()),
                mac: [2, 0, 0, 0, 1, i],
                flags: BACKEND_ACTIVE,
                quic_server_id: if i == 0 { QUIC_SERVER_ID } else { 0 },
                ..Default::default()
            };
            let id = plan.first_id + u32::from(i);
            lb.set_backend(id, &entry)?;
            put(&lb.skel.maps.scores, &id, &BackendScore { score: u32::from(i), updated_ns: ktime_ns(), ..Default::default() })?;
        }
        set_vip(&lb, plan, Mode::DsrDynamic, 0, backends)?;
    }
    Ok(lb)
}

fn set_vip(lb: &PrivateBalancer, plan: VipPlan, mode: Mode, probe_interval: u32, backends: u8) -> Result<()> {
    let slots: Vec<u32> = (0..u32::from(backends)).map(|i| plan.first_id + i).collect();
    lb.set_vip(plan.vid, vip_key(plan.vip, plan.proto), &vip_entry(plan, mode, probe_interval), &slots)
}

/// The plan's VIP, least-score: what every measurement runs under.
fn vip_entry(plan: VipPlan, mode: Mode, probe_interval: u32) -> Vip {
    Vip {
        mode: mode as u8,
        policy: Policy::LeastScore as u8,
        flags: VIP_ACTIVE | if plan.proto == Protocol::Udp { VIP_QUIC } else { 0 },
        proto: plan.proto.number(),
        probe_interval,
        probe_interval_max: probe_interval,
        // Long enough that nothing goes stale or expires while measured.
        score_max_age_ns: 3_600_000_000_000,
        syn_timeout_ns: 5_000_000_000,
        idle_timeout_ns: 900_000_000_000,
        closing_timeout_ns: 10_000_000_000,
        ..Default::default()
    }
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

/// Opens `client`'s connection (TCP: SYN, then the handshake's ACK; UDP:
/// two datagrams) and returns (backend, SNAT port).
fn connect(lb: &PrivateBalancer, plan: VipPlan, client: SocketAddr) -> Result<(SocketAddr, u16)> {
    let first = plan.packet(client, plan.vip);
    lb.run(&if plan.proto == Protocol::Tcp { first.syn(1440).build() } else { first.payload(vec![0xc0; 40]).build() })?;
    lb.run(&plan.packet(client, plan.vip).flags(TCP_ACK).build())?;
    let f: Flow = get(&lb.skel.maps.flows, &plan.key(client))?.context("the handshake created no flow")?;
    let b = Backend { addr: f.backend_addr, port: f.backend_port, ..Default::default() };
    Ok((backend_endpoint(&b), port_of(f.snat_port)))
}

/// Clears `client`'s outstanding 124, as if its 125 had come: a flow asks
/// again only then.
fn answered(lb: &PrivateBalancer, plan: VipPlan, client: SocketAddr) -> Result<()> {
    let k = plan.key(client);
    let mut f: Flow = get(&lb.skel.maps.flows, &k)?.context("no flow")?;
    f.flags &= !(FLOW_PROBE_OUTSTANDING | c::INBAND_FLOW_PROBE_OLD as u8);
    put(&lb.skel.maps.flows, &k, &f)
}

/// Marks `client`'s flow as having an outstanding 124 with `nonce`, as if
/// the balancer had just sent one.
fn expect_score(lb: &PrivateBalancer, plan: VipPlan, client: SocketAddr, nonce: [u8; 4]) -> Result<()> {
    let k = plan.key(client);
    let mut f: Flow = get(&lb.skel.maps.flows, &k)?.context("no flow")?;
    f.flags |= FLOW_PROBE_OUTSTANDING;
    f.probe_nonce = u32::from_ne_bytes(nonce);
    f.probe_key = KEY_ID;
    put(&lb.skel.maps.flows, &k, &f)
}

type Measured = (&'static str, &'static str, &'static str, u32, f64);

/// The rows every family shares: a new connection, an established packet,
/// one that asks for a score, and a score coming back.
fn connection_rows(lb: &PrivateBalancer, plan: VipPlan, auth: u32, traffic: &'static str, samples: u32, rows: &mut Vec<Measured>) -> Result<()> {
    let authed = auth == c::INBAND_AUTH_SIPHASH;
    let client = plan.client(u32::MAX);
    let first = |i| {
        let p = plan.packet(plan.client(i), plan.vip);
        if plan.proto == Protocol::Tcp {
            p.syn(1440).build()
        } else {
            // A QUIC Initial: a long header (its ID the client's), padded.
            p.payload(vec![0xc0; 1200]).build()
        }
    };
    let new_conn = match (plan.proto, authed) {
        (Protocol::Tcp, true) => "new connection (SYN: select, SNAT, 155 + MAC)",
        (Protocol::Tcp, false) => "new connection (SYN: select, SNAT, seed 155)",
        (Protocol::Udp, _) => "new flow (first datagram: select, SNAT, 155 + stamp + MAC)",
    };
    // A distinct client per run, so every first packet is new.
    let (v, ns) = time(lb, samples.min(3000), first)?;
    rows.push((new_conn, traffic, "dsr-dynamic", v, ns));
    if authed {
        let (v, ns) = time(lb, samples.min(3000), |i| plan.packet(plan.client(i), plan.vip).flags(TCP_ACK).build())?;
        rows.push(("handshake done (second packet: half-open -> flows)", traffic, "dsr-dynamic", v, ns));
    }
    let (backend, snat) = connect(lb, plan, client)?;
    if authed {
        let (v, ns) = time(lb, samples, |_| plan.data(client))?;
        rows.push(("established (client -> backend)", traffic, "dsr-dynamic", v, ns));
    }
    set_vip(lb, plan, Mode::DsrDynamic, 1, BACKENDS)?;
    let request = if authed { "established + score request (124 + MAC)" } else { "established + score request (seed 124)" };
    let (v, ns) = time(lb, samples, |_| {
        answered(lb, plan, client).expect("flow");
        plan.data(client)
    })?;
    rows.push((request, traffic, "dsr-dynamic", v, ns));
    set_vip(lb, plan, Mode::DsrDynamic, 0, BACKENDS)?;

    // Score returns: the flow expects a 125 before every run.
    let lb_end = SocketAddr::new(plan.lb(), snat);
    let conn = Conn { lb: lb_end, backend, udp: plan.proto == Protocol::Udp };
    let nonce = [1, 2, 3, 4];
    let opt = if authed { InbandOption::auth_score(&KEY, KEY_ID, nonce, conn, 7) } else { InbandOption::Score(7) };
    let score = if authed { "score return (125: checksums, MAC, record, strip)" } else { "score return (seed 125: checksums, record, strip)" };
    let (v, ns) = time(lb, samples, |_| {
        expect_score(lb, plan, client, nonce).expect("flow");
        plan.packet(backend, lb_end).flags(TCP_ACK | TCP_PSH).payload(vec![b'y'; PAYLOAD]).inband(&opt.encode()).build()
    })?;
    rows.push((score, traffic, "dsr-dynamic", v, ns));
    Ok(())
}

pub fn measure(samples: u32) -> Result<Vec<Row>> {
    let mut rows: Vec<Measured> = Vec::new();
    for auth in [c::INBAND_AUTH_SIPHASH, c::INBAND_AUTH_NONE] {
        let mut storage = MaybeUninit::uninit();
        let lb = load(&mut storage, BACKENDS, auth)?;
        connection_rows(&lb, TCP4, auth, "IPv4", samples, &mut rows)?;
        if auth == c::INBAND_AUTH_SIPHASH {
            let client = TCP4.client(u32::MAX);
            let reply = || TCP4.packet(TCP4.backend(0), SocketAddr::new(TCP4.lb(), 0)).flags(TCP_ACK | TCP_PSH);
            set_vip(&lb, TCP4, Mode::Passthrough, 0, BACKENDS)?;
            let (v, ns) = time(&lb, samples, |_| TCP4.data(client))?;
            rows.push(("established (client -> backend)", "IPv4", "passthrough", v, ns));
            let f: Flow = get(&lb.skel.maps.flows, &TCP4.key(client))?.context("no flow")?;
            let back = Backend { addr: f.backend_addr, port: f.backend_port, ..Default::default() };
            let (v, ns) = time(&lb, samples, |_| {
                let mut r = reply();
                r.src = backend_endpoint(&back);
                r.dst.set_port(port_of(f.snat_port));
                r.payload(vec![b'y'; PAYLOAD]).build()
            })?;
            rows.push(("return (backend -> client, NAT back)", "IPv4", "passthrough", v, ns));
            let other = PacketBuilder::tcp(client, SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)), 22)).payload(vec![0; PAYLOAD]).build();
            let (v, ns) = time(&lb, samples, |_| other.clone())?;
            rows.push(("not for a VIP (pass to the kernel)", "any", "any", v, ns));

            connection_rows(&lb, TCP6, auth, "IPv6", samples, &mut rows)?;
            connection_rows(&lb, QUIC4, auth, "UDP (QUIC)", samples, &mut rows)?;
            // A migrated QUIC client: a short header from a tuple with no
            // flow, sent where its connection ID says.
            let (v, ns) = time(&lb, samples.min(3000), |i| QUIC4.data(QUIC4.client(i + 100_000)))?;
            rows.push(("short header, no flow (routed by connection ID)", "UDP (QUIC)", "dsr-dynamic", v, ns));
            let routed = lb.events()?[event_index("quic_cid_routed")];
            if routed < u64::from(samples.min(3000)) {
                bail!("only {routed} short headers were routed by their connection ID");
            }
        }
    }

    let (bounce, lookup) = floors(samples)?;
    rows.push(("floor + the flow's lookup (IPv4 and TCP read, LRU hash of the flow table's type)", "IPv4", "-", XDP_TX, lookup));
    rows.push(("floor: bounce (swap MACs, XDP_TX)", "IPv4", "-", XDP_TX, bounce));
    let floor = rows.last().map_or(0.0, |r| r.4);

    Ok(rows
        .into_iter()
        .map(|(path, traffic, mode, v, ns)| Row {
            path,
            traffic,
            mode,
            verdict: verdict_name(v),
            ns_per_packet: ns,
            mpps: if ns > 0.0 { 1000.0 / ns } else { 0.0 },
            ratio_to_floor: ns / floor,
        })
        .collect())
}

/// The floors, on an established packet's frame: `bounce` (the least any
/// XDP forwarder costs here) and `bounce_lookup` with that packet's flow
/// in a table of the balancer's type and size (the least a forwarder that
/// keeps per-flow state costs for an established packet). Median ns each.
fn floors(samples: u32) -> Result<(f64, f64)> {
    let mut storage = MaybeUninit::uninit();
    let skel = BounceSkelBuilder::default().open(&mut storage)?.load()?;
    put(&skel.maps.lookup_flows, &TCP4.key(TCP4.client(0)), &Flow::default())?;
    let median = |prog: &libbpf_rs::ProgramMut<'_>, what: &str| -> Result<f64> {
        let mut ns = Vec::new();
        for _ in 0..samples.max(1) {
            let frame = TCP4.data(TCP4.client(0));
            let mut out = vec![0u8; frame.len()];
            let input = ProgramInput { data_in: Some(&frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
            let o = prog.test_run(input)?;
            if o.return_value != XDP_TX {
                bail!("{what} did not forward the packet (verdict {})", o.return_value);
            }
            ns.push(o.duration.as_nanos() as f64);
        }
        ns.sort_by(f64::total_cmp);
        match ns[ns.len() / 2] {
            m if m > 0.0 => Ok(m),
            _ => bail!("{what} took no time"),
        }
    };
    Ok((median(&skel.progs.bounce, "the bounce floor")?, median(&skel.progs.bounce_lookup, "the lookup floor (its flow not found?)")?))
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

fn flood_client(i: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0a80_0000 | (i >> 6))), 1024 + (i & 63) as u16)
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
    set_vip(&lb, TCP4, Mode::DsrRr, 0, backends)?;
    let (mut forwarded, mut dropped, mut ns) = (0u32, 0u32, 0f64);
    for i in 0..syns {
        let r = lb.run(&PacketBuilder::tcp(flood_client(i), TCP4.vip).syn(1460).build())?;
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
            n += u32::from(get::<FlowKey, Flow>(&lb.skel.maps.half_open, &TCP4.key(flood_client(i)))?.is_some());
        }
        Ok(n)
    };
    let events = lb.events()?;
    Ok(TableScale {
        syns,
        backends,
        half_open_table: inband_lb::attach::table_sizes(FLOW_TABLE_SIZE, 0, 0)[1].1,
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
    set_vip(&lb, TCP4, Mode::DsrDynamic, 0, backends)?;
    let start = Instant::now();
    let vip = TCP4.vip;
    let mut ns = 0f64;
    let mut refused = 0u64;
    for i in 0..connections {
        // Distinct client tuples: 64 ports on each of many addresses.
        let c = SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0b00_0000 | (i >> 6))), 20000 + (i & 63) as u16);
        let steps = [
            PacketBuilder::tcp(c, vip).syn(1460).build(),
            PacketBuilder::tcp(c, vip).flags(TCP_ACK).build(),
            PacketBuilder::tcp(c, vip).flags(TCP_ACK | TCP_FIN).build(),
            PacketBuilder::tcp(c, vip).flags(TCP_ACK).build(),
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
        let k = TCP4.key(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0c00_0000 | i)), 5000));
        let port = 1024 + (i % SNAT_PORTS) as u16;
        let b = (i % u32::from(BACKENDS)) as u8;
        let f = Flow {
            backend_addr: be_ip(TCP4.backend(b).ip()),
            backend_port: be_port(8080),
            proto: IPPROTO_TCP,
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
    let _ = writeln!(o, "| path | traffic | mode | verdict | ns/packet | Mpps (1 core) | × floor |");
    let _ = writeln!(o, "|---|---|---|---|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {:.1} | {:.2} | {:.2} |",
            r.path, r.traffic, r.mode, r.verdict, r.ns_per_packet, r.mpps, r.ratio_to_floor
        );
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

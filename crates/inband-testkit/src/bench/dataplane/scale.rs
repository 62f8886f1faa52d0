//! How the per-packet cost grows with the tables: a new connection (SYN)
//! and an established packet at several backends per VIP and live flows
//! in the flow table, each table sized as `flow_table_size` would size it,
//! with the memory its maps take as the kernel accounts it and one
//! sweeper pass over it; and what the daemon's configuration path
//! (`LbConfig::parse`, `tables::apply`) takes for the largest
//! configurations the limits allow.
//!
//! The flows are written from user space in batches, with their SNAT
//! reservations, as established flows of the measured VIP spread over
//! 4,096 backends: a backend has 31,744 SNAT ports, so a million flows
//! cannot be held by 8 backends, and spreading them keeps every cell's
//! port search meeting the same share of taken ports. Each established
//! sample is a different flow, picked across the whole table, so the
//! lookup pays the cache misses a table larger than the caches costs;
//! traffic that keeps returning to a few hot flows would cost less.

use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::Skel;
use libbpf_rs::{MapCore, MapHandle, ObjectBuilder};
use serde::Serialize;

use super::{lb_config, time, verdict_name, vip_entry, KEY, KEY_ID, PAYLOAD, TCP4};
use crate::packet::{PacketBuilder, IPPROTO_TCP, TCP_ACK, TCP_PSH};
use inband_core::bpfmap::{count, get, put, put_batch, remove_pin_dir, PinDir};
use inband_core::map_upgrade::Upgrade;
use inband_core::shared as c;
use inband_lb::config::LbConfig;
use inband_lb::maps::*;
use inband_lb::private::{PrivateBalancer, XDP_TX};
use inband_lb::tables::{self, ktime_ns, vip_key};
use inband_core::pod::{be_ip, be_port};

/// The backends the flows are spread over, and the most a VIP may have.
const POOL: u32 = c::INBAND_MAX_BACKENDS_PER_VIP;
/// New connections timed per cell: each is a distinct client, and each
/// leaves a handshake in the half-open table (a quarter of the flow table,
/// at least 65,536 here) for the cells after it.
const SYN_SAMPLES: u32 = 3000;
/// Entries per batch update: big enough that the system call is not the
/// cost, small enough that the buffers stay a few MiB.
const BATCH: usize = 65_536;

/// One cell of the sweep.
#[derive(Debug, Serialize)]
pub struct Cell {
    pub flow_table_size: u32,
    /// Flows written before the cell.
    pub flows: u32,
    /// Flows in the table after the cell was measured: none evicted if
    /// equal to `flows`.
    pub flows_in_table: usize,
    pub backends: u32,
    pub syn_ns: f64,
    pub syn_ratio: f64,
    /// A different flow each packet, scattered over the table, each met
    /// for the first time since it was written.
    pub established_ns: f64,
    /// How many such packets (flows) the median is of.
    pub established_samples: u32,
    pub established_ratio: f64,
    /// One flow again and again (as the main table's established row):
    /// the instructions without the table's cache misses.
    pub established_one_flow_ns: f64,
}

/// What one flow table size takes, from the kernel's own accounting of
/// each map (`memlock` in /proc/self/fdinfo: bpf_map_memory_usage), and
/// what filling and sweeping it took.
#[derive(Debug, Serialize)]
pub struct Memory {
    pub flow_table_size: u32,
    /// (map, bytes) of the maps sized from flow_table_size.
    pub maps: Vec<(String, u64)>,
    /// Those maps together.
    pub flow_tables_bytes: u64,
    /// Every map of the loaded program (its Maglev map has one entry here:
    /// the daemon's adds maglev_tables × maglev_table_size × 8 bytes).
    pub all_maps_bytes: u64,
    /// Flows written (with their SNAT reservations), and the time it took.
    pub flows: u32,
    pub fill_s: f64,
    /// One pass of the sweeper (the daemon runs one a second) over the
    /// tables as the cells left them.
    pub sweep_ms: f64,
}

/// Control-plane time, through `LbConfig::parse` and `tables::apply`.
#[derive(Debug, Serialize)]
pub struct ControlPlane {
    pub steps: Vec<ControlStep>,
}

/// One configuration applied: its size, the time to parse and validate
/// its text, and the time to write it into the maps.
#[derive(Debug, Serialize)]
pub struct ControlStep {
    pub step: &'static str,
    pub vips: usize,
    pub backends: usize,
    pub parse_ms: f64,
    pub apply_ms: f64,
}

/// An upgrade of the balancer holding a size's flows to a build whose
/// flow tables are CARRY_GROWTH entries larger, by map_upgrade as `inband
/// lb` runs it (attach.rs), the switch itself left out: what happens
/// before it (the first copy and the catch-up, while the old program
/// serves) and after it (two merges 50 ms apart and the renames).
#[derive(Debug, Serialize)]
pub struct Carry {
    pub flows: u32,
    pub maps: Vec<String>,
    pub before_switch_s: f64,
    pub after_switch_ms: f64,
    /// Flows in the new table: all of them if equal to `flows`.
    pub flows_carried: usize,
}

#[derive(Debug, Serialize)]
pub struct Scale {
    pub floor_ns: f64,
    pub cells: Vec<Cell>,
    pub memory: Vec<Memory>,
}

/// What the upgrade in `Carry` adds to the flow table: any change of size
/// makes the four flow tables new maps.
const CARRY_GROWTH: u32 = 65_536;

/// Carries `lb`'s maps (sized for `size`) over to the built-in object
/// sized CARRY_GROWTH larger, through a pin directory of its own.
fn carry_over(lb: &PrivateBalancer, size: u32, flows: u32) -> Result<Carry> {
    let dir = PinDir(PathBuf::from(format!("/sys/fs/bpf/inband-bench-carry-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
    let result = (|| -> Result<Carry> {
        for m in lb.skel.object().maps() {
            let name = m.name().to_string_lossy().into_owned();
            if !name.contains('.') {
                MapHandle::try_from(&m)?.pin(dir.path(&name)).with_context(|| format!("pinning {name}"))?;
            }
        }
        let mut open = ObjectBuilder::default().open_memory(inband_lb::bpf::OBJECT)?;
        let sizes = inband_lb::attach::table_sizes(size + CARRY_GROWTH, lb_config(c::INBAND_AUTH_SIPHASH).maglev_size, c::INBAND_MAGLEV_DEFAULT_TABLES);
        for mut m in open.maps_mut() {
            let name = m.name().to_string_lossy().into_owned();
            if let Some((_, n)) = sizes.iter().find(|(k, _)| *k == name) {
                m.set_max_entries(*n)?;
            }
        }
        let mut up = Upgrade::stage(&mut open, &dir, |n| !n.contains('.') && n != "csum_scratch")?;
        let obj = open.load().context("loading the balancer object for the upgrade")?;
        let start = Instant::now();
        up.copy(&obj)?;
        up.catch_up()?;
        let before_switch_s = start.elapsed().as_secs_f64();
        let maps = up.maps().iter().map(|m| m.to_string()).collect();
        let start = Instant::now();
        up.finish()?;
        let after_switch_ms = start.elapsed().as_secs_f64() * 1e3;
        let carried = MapHandle::from_pinned_path(dir.path("flows"))?;
        Ok(Carry { flows, maps, before_switch_s, after_switch_ms, flows_carried: count(&carried) })
    })();
    remove_pin_dir(&dir.0)?;
    result
}

/// The flow table `flow_table_size` a deployment sets for `flows`: the
/// next power of two, never below the default.
pub fn table_for(flows: u32) -> u32 {
    flows.checked_next_power_of_two().unwrap_or(u32::MAX).max(c::INBAND_FLOW_TABLE_SIZE)
}

fn pool_backend(b: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0a80_0000 + b)), 8080)
}

/// The client of filled flow `j` (16 ports per address).
fn filled_client(j: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0d00_0000 | (j >> 4))), 1024 + (j & 15) as u16)
}

/// The client of new connection `i` of cell `cell`: never one before it.
fn new_client(cell: u32, i: u32) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0e00_0000 | (cell << 16) | (i & 0xffff))), 4000)
}

/// A 64-byte request segment of a filled flow's client.
fn established(client: SocketAddr) -> Vec<u8> {
    PacketBuilder::tcp(client, TCP4.vip).flags(TCP_ACK | TCP_PSH).payload(vec![b'x'; PAYLOAD]).build()
}

/// The POOL backends, ACTIVE, with fresh scores.
fn add_pool(lb: &PrivateBalancer) -> Result<()> {
    let now = ktime_ns();
    for b in 0..POOL {
        let ep = pool_backend(b);
        let entry = Backend {
            addr: be_ip(ep.ip()),
            port: be_port(ep.port()),
            mac: [2, 0, 0, 1, (b >> 8) as u8, b as u8],
            flags: BACKEND_ACTIVE,
            ..Default::default()
        };
        lb.set_backend(b, &entry)?;
        put(&lb.skel.maps.scores, &b, &BackendScore { score: b % 7, updated_ns: now, ..Default::default() })?;
    }
    Ok(())
}

/// Writes established flows `from..to` of the measured VIP, flow j on
/// backend j % POOL, each with its SNAT reservation (a port of its own on
/// that backend).
fn fill(lb: &PrivateBalancer, from: u32, to: u32) -> Result<()> {
    let now = ktime_ns();
    let mut j = from;
    while j < to {
        let end = to.min(j + BATCH as u32);
        let mut keys = Vec::with_capacity(BATCH);
        let mut flows = Vec::with_capacity(BATCH);
        let mut nat = Vec::with_capacity(BATCH);
        let mut owners = Vec::with_capacity(BATCH);
        for j in j..end {
            let b = j % POOL;
            let port = c::INBAND_SNAT_PORT_MIN + j / POOL;
            if port > c::INBAND_SNAT_PORT_MAX {
                bail!("{to} flows over {POOL} backends exceed their SNAT ports");
            }
            let backend = pool_backend(b);
            let k = TCP4.key(filled_client(j));
            let f = Flow {
                backend_addr: be_ip(backend.ip()),
                backend_port: be_port(backend.port()),
                snat_port: be_port(port as u16),
                backend_id: b as u16,
                vip_id: TCP4.vid as u16,
                state: FLOW_ESTABLISHED,
                proto: IPPROTO_TCP,
                mode: Mode::DsrDynamic as u8,
                last_seen_ns: now,
                // Where the packets below are in the client's sequence
                // space (PacketBuilder's default).
                client_seq: 1000u32.to_be(),
                ..Default::default()
            };
            nat.push(NatKey {
                backend_addr: f.backend_addr,
                backend_port: f.backend_port,
                snat_port: f.snat_port,
                proto: IPPROTO_TCP,
                ..Default::default()
            });
            owners.push(SnatOwner { flow: k });
            keys.push(k);
            flows.push(f);
        }
        put_batch(&lb.skel.maps.flows, &keys, &flows)?;
        put_batch(&lb.skel.maps.snat, &nat, &owners)?;
        j = end;
    }
    Ok(())
}

/// `memlock` of each map of the loaded program, from /proc/self/fdinfo.
fn map_memory(lb: &PrivateBalancer) -> Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    for m in lb.skel.object().maps() {
        let fd = m.as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).context("reading a map's fdinfo")?;
        let bytes = info
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse().ok())
            .context("no memlock in a map's fdinfo")?;
        out.push((m.name().to_string_lossy().into_owned(), bytes));
    }
    Ok(out)
}

/// The VIP with slots 0..backends of the pool, least-score dsr-dynamic
/// without score requests (as the established rows of the main table).
fn set_pool_vip(lb: &PrivateBalancer, backends: u32) -> Result<()> {
    let slots: Vec<u32> = (0..backends).collect();
    lb.set_vip(TCP4.vid, vip_key(TCP4.vip, TCP4.proto), &vip_entry(TCP4, Mode::DsrDynamic, 0), &slots)
}

/// The sweep: for each flow count (ascending), one balancer sized for it,
/// filled to it, and each backend count measured on it.
pub fn measure(flows: &[u32], backends: &[u32], samples: u32, floor_ns: f64) -> Result<Scale> {
    if let Some(b) = backends.iter().find(|b| !(1..=POOL).contains(*b)) {
        bail!("--scale-backends {b}: expected 1-{POOL}");
    }
    let mut cells = Vec::new();
    let mut memory = Vec::new();
    let mut cell = 0u32;
    for &n in flows {
        let size = table_for(n);
        let mut storage = MaybeUninit::uninit();
        let lb = PrivateBalancer::load(&mut storage, size, &lb_config(c::INBAND_AUTH_SIPHASH))?;
        inband_core::auth::write_keys(&lb.skel.maps.auth_keys, &[(KEY_ID, KEY)])?;
        add_pool(&lb)?;
        let start = Instant::now();
        fill(&lb, 0, n)?;
        let fill_s = start.elapsed().as_secs_f64();
        let maps = map_memory(&lb)?;
        let sized: Vec<(String, u64)> = maps
            .iter()
            .filter(|(m, _)| ["flows", "half_open", "half_open_ports", "snat"].contains(&m.as_str()))
            .cloned()
            .collect();
        memory.push(Memory {
            flow_table_size: size,
            flow_tables_bytes: sized.iter().map(|(_, b)| b).sum(),
            all_maps_bytes: maps.iter().map(|(_, b)| b).sum(),
            maps: sized,
            flows: n,
            fill_s,
            sweep_ms: 0.0,
        });
        // Each cell's established packets go to flows no packet has met
        // since they were written (the first packet of a flow since the
        // sweeper last looked at it writes its `seen` byte: a flow met
        // again would cost less), its share of the table.
        let share = (n / backends.len() as u32).clamp(1, samples.max(1));
        for (k, &b) in backends.iter().enumerate() {
            set_pool_vip(&lb, b)?;
            let (v, syn) = time(&lb, SYN_SAMPLES, |i| PacketBuilder::tcp(new_client(cell, i), TCP4.vip).syn(1440).build())?;
            if v != XDP_TX {
                bail!("{n} flows, {b} backends: a new connection was {}", verdict_name(v));
            }
            // Positions times a prime above any flow count, modulo the
            // count: distinct flows for distinct positions, scattered over
            // the table.
            let (v, est) = time(&lb, share, |i| {
                let p = u64::from(k as u32 * share + i);
                established(filled_client((p * 2_654_435_761 % u64::from(n.max(1))) as u32))
            })?;
            if v != XDP_TX {
                bail!("{n} flows, {b} backends: an established packet was {}", verdict_name(v));
            }
            let one = established(filled_client(n / 2));
            let (v, hot) = time(&lb, samples, |_| one.clone())?;
            if v != XDP_TX {
                bail!("{n} flows, {b} backends: an established packet was {}", verdict_name(v));
            }
            cells.push(Cell {
                flow_table_size: size,
                flows: n,
                flows_in_table: count(&lb.skel.maps.flows),
                backends: b,
                syn_ns: syn,
                syn_ratio: syn / floor_ns,
                established_ns: est,
                established_samples: share,
                established_ratio: est / floor_ns,
                established_one_flow_ns: hot,
            });
            cell += 1;
        }
        lb.sweep(0)?;
        let st: SweepStats = get(&lb.skel.maps.sweep_stats, &0u32)?.context("no sweep_stats entry")?;
        if let Some(m) = memory.last_mut() {
            m.sweep_ms = st.last_duration_ns as f64 / 1e6;
        }
    }
    Ok(Scale { floor_ns, cells, memory })
}

/// A config of `vips` VIPs (IPv4, port 80, dsr-dynamic least-score) of
/// `per_vip` backends each, backends numbered across VIPs, as lb.toml text.
fn config_text(vips: u32, per_vip: u32) -> String {
    use std::fmt::Write;
    // No key files to read: the keys are written apart from the tables.
    let mut t = String::from("interface = \"lo\"\naddress = \"10.0.0.2\"\n\n[auth]\nmode = \"none\"\n");
    for v in 0..vips {
        let _ = write!(t, "\n[[vip]]\naddress = \"{}\"\nport = 80\nmode = \"dsr-dynamic\"\n", Ipv4Addr::from(0x0ac8_0000 + v));
        for b in 0..per_vip {
            let _ = write!(t, "[[vip.backend]]\naddress = \"{}\"\nport = 8080\n", pool_backend(v * per_vip + b).ip());
        }
    }
    t
}

/// Parses `text` and applies it to `lb`'s maps as the daemon does; the
/// times of each, in ms.
fn parse_and_apply(lb: &PrivateBalancer, text: &str) -> Result<(LbConfig, f64, f64)> {
    let start = Instant::now();
    let cfg = LbConfig::parse(text)?;
    let parse_ms = start.elapsed().as_secs_f64() * 1e3;
    let maps = lb.maps()?;
    let start = Instant::now();
    tables::apply(&maps, &cfg.vips, cfg.drain_timeout_ms, 0, false)?;
    Ok((cfg, parse_ms, start.elapsed().as_secs_f64() * 1e3))
}

/// What the control plane takes: a VIP going from no backends to the most
/// it may have, a full configuration of the limits written onto empty
/// maps, and that configuration applied again unchanged (a reload).
pub fn control_plane() -> Result<ControlPlane> {
    let mut steps = Vec::new();
    let mut storage = MaybeUninit::uninit();
    let lb = PrivateBalancer::load(&mut storage, c::INBAND_FLOW_TABLE_SIZE, &lb_config(c::INBAND_AUTH_SIPHASH))?;
    parse_and_apply(&lb, &config_text(1, 0))?;
    let (cfg, parse_ms, apply_ms) = parse_and_apply(&lb, &config_text(1, POOL))?;
    let written = tables::read(&lb.maps()?)?;
    if written.len() != 1 || written[0].slots.len() != POOL as usize {
        bail!("the VIP was written with {} backends, not {POOL}", written.first().map_or(0, |v| v.slots.len()));
    }
    steps.push(ControlStep { step: "add 4,096 backends to a VIP", vips: 1, backends: cfg.vips[0].backends.len(), parse_ms, apply_ms });
    drop(lb);

    let mut storage = MaybeUninit::uninit();
    let lb = PrivateBalancer::load(&mut storage, c::INBAND_FLOW_TABLE_SIZE, &lb_config(c::INBAND_AUTH_SIPHASH))?;
    let (vips, per_vip) = (c::INBAND_MAX_VIPS, c::INBAND_MAX_BACKENDS / c::INBAND_MAX_VIPS);
    let text = config_text(vips, per_vip);
    let (cfg, parse_ms, apply_ms) = parse_and_apply(&lb, &text)?;
    let written = tables::read(&lb.maps()?)?;
    let slots: usize = written.iter().map(|v| v.slots.len()).sum();
    if written.len() != vips as usize || slots != (vips * per_vip) as usize {
        bail!("the full configuration was written as {} VIPs and {slots} backends", written.len());
    }
    let backends = cfg.vips.iter().map(|v| v.backends.len()).sum();
    steps.push(ControlStep { step: "full configuration onto empty tables", vips: cfg.vips.len(), backends, parse_ms, apply_ms });
    let (_, parse_ms, apply_ms) = parse_and_apply(&lb, &text)?;
    steps.push(ControlStep { step: "the same configuration again (a reload)", vips: cfg.vips.len(), backends, parse_ms, apply_ms });
    Ok(ControlPlane { steps })
}

pub fn render(s: &Scale) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "| flow table | live flows | backends | SYN ns | SYN × floor | established ns | established × floor | one flow ns |"
    );
    let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &s.cells {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} |",
            r.flow_table_size,
            r.flows_in_table,
            r.backends,
            r.syn_ns,
            r.syn_ratio,
            r.established_ns,
            r.established_ratio,
            r.established_one_flow_ns
        );
    }
    let _ = writeln!(o, "\n| flow table | flow tables MiB | all maps MiB | fill s | one sweep, ms |\n|---:|---:|---:|---:|---:|");
    for m in &s.memory {
        let _ = writeln!(
            o,
            "| {} | {:.1} | {:.1} | {:.2} | {:.1} |",
            m.flow_table_size,
            m.flow_tables_bytes as f64 / 1048576.0,
            m.all_maps_bytes as f64 / 1048576.0,
            m.fill_s,
            m.sweep_ms
        );
    }
    o
}

/// `inband bench upgrade`: for each number of live flows, a private
/// instance sized and filled as for the growth sweep, carried over.
pub fn carry(flows: &[u32]) -> Result<Vec<Carry>> {
    let mut out = Vec::new();
    for &n in flows {
        let size = table_for(n);
        let mut storage = MaybeUninit::uninit();
        let lb = PrivateBalancer::load(&mut storage, size, &lb_config(c::INBAND_AUTH_SIPHASH))?;
        add_pool(&lb)?;
        fill(&lb, 0, n)?;
        out.push(carry_over(&lb, size, count(&lb.skel.maps.flows) as u32)?);
    }
    Ok(out)
}

pub fn render_carry(rows: &[Carry]) -> String {
    use std::fmt::Write;
    let mut o = String::from("| live flows | maps carried | before the switch s | after the switch ms | flows carried |\n|---:|---|---:|---:|---:|\n");
    for c in rows {
        let _ = writeln!(o, "| {} | {} | {:.2} | {:.0} | {} |", c.flows, c.maps.join(", "), c.before_switch_s, c.after_switch_ms, c.flows_carried);
    }
    o
}

pub fn render_control(c: &ControlPlane) -> String {
    use std::fmt::Write;
    let mut o = String::from("| step | VIPs | backends | parse ms | apply ms |\n|---|---:|---:|---:|---:|\n");
    for s in &c.steps {
        let _ = writeln!(o, "| {} | {} | {} | {:.1} | {:.1} |", s.step, s.vips, s.backends, s.parse_ms, s.apply_ms);
    }
    o
}

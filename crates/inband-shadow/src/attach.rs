//! The server side: the conditional End.DT6 program on the interface
//! toward the router, beside the two End.DT6 SIDs the routing set up.
//!
//! Lifetime: like the balancer, and unlike the agent, nothing here needs a
//! process: `attach` loads, pins the maps under `pin_dir(interface)`,
//! attaches and exits; the tc filter keeps the program, the pins keep the
//! counters for `status`. Attaching again replaces the filter in place and
//! keeps the counters; `detach` removes the filter and the pins (the
//! clsact qdisc stays: the agent may share it; the SIDs stay: the routing
//! owns them, and without the program they deliver everything).

use std::mem::MaybeUninit;
use std::net::Ipv6Addr;
use std::os::fd::AsFd;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, TC_INGRESS};
use tracing::info;

use crate::bpf::shadow::ShadowSkelBuilder;
use crate::Program;
use inband_core::shared as c;
use inband_core::bpfmap::{remove_pin_dir, PinDir};
use inband_core::command::ip;

pub type Config = c::inband_shadow_config;
pub type Count = c::inband_shadow_count;

/// Before the agent's filter (0x1b0), whose packets this one passes on.
const TC_HANDLE: u32 = 0x1a0;
const TC_PRIORITY: u32 = 0x1a0;

/// Counter names, in the order of `enum inband_shadow_counter`.
pub const COUNTERS: [&str; c::INBAND_SHADOW_COUNTERS as usize] =
    ["other", "new_flow", "not_tcp", "local", "chained", "malformed", "chained_named"];

pub struct Sids {
    pub cond: Ipv6Addr,
    pub direct: Ipv6Addr,
    pub shadow: Ipv6Addr,
}

pub fn pin_dir(interface: &str) -> PinDir {
    PinDir(inband_core::bpfmap::pin_root().join("shadow").join(interface))
}

fn slot(ifindex: i32) -> inband_core::tc::Slot {
    inband_core::tc::Slot { ifindex, handle: TC_HANDLE, priority: TC_PRIORITY }
}

pub fn attach(interface: &str, sids: Sids) -> Result<()> {
    inband_core::bpfmap::require_bpffs()?;
    if sids.cond == sids.direct {
        bail!("--sid and --direct-sid must differ: chained packets arrive at the direct SID, which is never chained again");
    }
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    // The SIDs' routes belong to the routing software (seed 002: FRR's
    // bgpd installs End.DT routes; the program sits beside them), so they
    // are checked here, not made.
    for sid in [sids.cond, sids.direct] {
        if !sid_routed(sid, interface)? {
            bail!(
                "no End.DT6 route for SID {sid} on {interface}: install it first (`ip -6 route add {sid} encap seg6local \
                 action End.DT6 table local dev {interface}`, and `sysctl net.ipv6.conf.{interface}.seg6_enabled=1`)"
            );
        }
    }
    // Strays leave by the kernel's forwarding path.
    std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").context("turning IPv6 forwarding on")?;
    let pins = pin_dir(interface);
    std::fs::create_dir_all(&pins.0).with_context(|| format!("creating {}", pins.0.display()))?;
    let mut storage = MaybeUninit::uninit();
    let mut open = ShadowSkelBuilder::default().open(&mut storage).context("opening the shadow BPF object")?;
    for mut map in open.open_object_mut().maps_mut() {
        let name = map.name().to_string_lossy().into_owned();
        if !name.contains('.') {
            map.set_pin_path(pins.path(&name)).with_context(|| format!("pin path for {name}"))?;
        }
    }
    let skel = open.load().context(
        "loading the shadow program (the verifier refused it, or maps pinned by an incompatible version exist: run \
         `inband shadow detach --interface IF` and retry)",
    )?;
    let cfg = Config { cond_sid: sids.cond.octets(), shadow_sid: sids.shadow.octets(), direct_sid: sids.direct.octets() };
    inband_core::bpfmap::put(&skel.maps.shadow_config, &0u32, &cfg)?;
    inband_core::tc::create_clsact(ifindex).with_context(|| format!("creating a clsact qdisc on {interface}"))?;
    slot(ifindex)
        .attach(skel.progs.shadow_ingress.as_fd(), TC_INGRESS)
        .with_context(|| format!("attaching the shadow program to {interface} (tc ingress)"))?;
    info!(interface, sid = %sids.cond, direct_sid = %sids.direct, shadow_sid = %sids.shadow, "shadow program attached");
    Ok(())
}

/// Whether `sid` has a seg6local End.DT6 route through `interface`.
fn sid_routed(sid: Ipv6Addr, interface: &str) -> Result<bool> {
    let out = ip(&["-6", "-j", "-d", "route", "show", &format!("{sid}/128"), "dev", interface])?;
    let routes: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).context("reading `ip -j route` output")?;
    Ok(routes.iter().any(|r| r["encap"] == "seg6local" && r["action"] == "End.DT6"))
}

pub fn detach(interface: &str) -> Result<()> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    let mut errors = Vec::new();
    if let Err(e) = slot(ifindex).detach(TC_INGRESS) {
        errors.push(format!("detaching the tc filter: {e:#}"));
    }
    let pins = pin_dir(interface);
    if let Err(e) = remove_pin_dir(&pins.0) {
        errors.push(format!("removing the pinned maps: {e:#}"));
    }
    if !errors.is_empty() {
        bail!("{}", errors.join("; "));
    }
    info!(interface, "shadow program detached, pinned maps removed");
    Ok(())
}

/// The interfaces with a shadow program's pins in this network namespace.
pub fn attached() -> Result<Vec<String>> {
    let root = inband_core::bpfmap::pin_root().join("shadow");
    let entries = match std::fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", root.display())),
    };
    let mut out: Vec<String> = entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    out.sort();
    Ok(out)
}

/// The program in this module's filter slot on `interface`, with its run
/// count and time; none if the filter is gone (the pins may outlive it:
/// `tc qdisc del` removes the filter, not the pins) or the interface is.
pub fn program(interface: &str) -> Result<Option<Program>> {
    let Ok(ifindex) = inband_core::netif::ifindex(interface) else { return Ok(None) };
    let Some(id) = slot(ifindex as i32).query(TC_INGRESS).with_context(|| format!("reading the tc filters of {interface}"))? else {
        return Ok(None);
    };
    let stats = inband_core::prog_stats::of_id("shadow", id)?;
    Ok(Some(Program { stats, interfaces: vec![interface.to_string()] }))
}

/// Each counter summed over the CPUs, by name.
pub fn counters(interface: &str) -> Result<Vec<(&'static str, Count)>> {
    let pins = pin_dir(interface);
    if !pins.exists() {
        bail!("no shadow program on {interface} in this network namespace (run `inband shadow attach`)");
    }
    let map = pins.open("shadow_stats")?;
    read_counters(&map)
}

pub fn read_counters(map: &dyn MapCore) -> Result<Vec<(&'static str, Count)>> {
    read_named(map, &COUNTERS)
}

/// The per-CPU counters of `map`, entry i named `names[i]`, summed over
/// CPUs: the layout of every shadow program's stats (this one's and dt4's).
pub fn read_named(map: &dyn MapCore, names: &[&'static str]) -> Result<Vec<(&'static str, Count)>> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let per_cpu: Vec<Count> = inband_core::bpfmap::get_percpu(map, &(i as u32))?;
            let sum = per_cpu
                .iter()
                .fold(Count::default(), |a, v| Count { packets: a.packets + v.packets, bytes: a.bytes + v.bytes });
            Ok((*name, sum))
        })
        .collect()
}

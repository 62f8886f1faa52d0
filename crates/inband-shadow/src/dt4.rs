//! The router's shadow SIDs for IPv4 VIPs: bpf/shadow_dt4.bpf.c on tc
//! ingress of every next hop's link, which unwraps a stray (IPv4 in IPv6
//! to a shadow SID) and marks it for its generation's `fwmark` rule. The
//! kernel's End.DT4 would do it, but only into a VRF device
//! (docs/decisions.md).
//!
//! Lifetime: as the routes it serves, nothing here needs a process. Each
//! `route` run loads the program over the pinned maps under [`pin_dir`]
//! (so the counters carry on), writes this config's shadow SIDs into
//! `dt4_sids`, removes its SIDs of generations it no longer keeps, and
//! attaches the program to every next hop's link, replacing what an
//! earlier run left there; a link that is missing is skipped (its
//! instance is dead and sends nothing), one made later gets it on the
//! next run. The filters and pins stay when the process exits, as the
//! routes do; `inband shadow status --router` reads the counters.

use std::mem::MaybeUninit;
use std::net::Ipv6Addr;
use std::os::fd::AsFd;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, TC_INGRESS};
use std::collections::BTreeMap;

use crate::attach::Count;
use crate::Program;
use crate::bpf::shadow_dt4::ShadowDt4SkelBuilder;
use inband_core::bpfmap::PinDir;
use inband_core::pod::Pod;
use inband_core::shared as c;

pub type Dt4 = c::inband_shadow_dt4;

/// After the servers' program's slot (0x1a0) and the agent's (0x1b0):
/// a router may run either on the same link.
const TC_HANDLE: u32 = 0x1c0;
const TC_PRIORITY: u32 = 0x1c0;

/// Counter names, in the order of `enum inband_shadow_dt4_counter`.
pub const COUNTERS: [&str; c::INBAND_SHADOW_DT4_COUNTERS as usize] = ["unwrapped", "not_taken", "failed"];

pub fn pin_dir() -> PinDir {
    PinDir(inband_core::bpfmap::pin_root().join("shadow_dt4"))
}

/// Loads the program over the pinned maps, writes the shadow SIDs `sids`
/// (each with its generation's mark), removes those of generations no
/// longer kept (`gone`) and attaches it to each interface of `links`.
pub fn install(sids: &[(Ipv6Addr, u32)], gone: &[Ipv6Addr], links: &[&str]) -> Result<()> {
    inband_core::bpfmap::require_bpffs()?;
    let pins = pin_dir();
    std::fs::create_dir_all(&pins.0).with_context(|| format!("creating {}", pins.0.display()))?;
    let mut storage = MaybeUninit::uninit();
    let mut open = ShadowDt4SkelBuilder::default().open(&mut storage).context("opening the shadow_dt4 BPF object")?;
    for mut map in open.open_object_mut().maps_mut() {
        let name = map.name().to_string_lossy().into_owned();
        if !name.contains('.') {
            map.set_pin_path(pins.path(&name)).with_context(|| format!("pin path for {name}"))?;
        }
    }
    let skel = open.load().with_context(|| {
        format!(
            "loading the shadow_dt4 program (the verifier refused it, or maps pinned by an incompatible version exist: remove {} \
             and run again)",
            pins.0.display()
        )
    })?;
    for (sid, mark) in sids {
        if let Err(e) = skel.maps.dt4_sids.update(&sid.octets(), Dt4 { mark: *mark }.as_bytes(), MapFlags::ANY) {
            bail!("writing shadow SID {sid} into dt4_sids: {e:#} (it holds at most {} SIDs for all the router's IPv4 configs)", c::INBAND_SHADOW_DT4_SIDS);
        }
    }
    for sid in gone {
        match skel.maps.dt4_sids.delete(&sid.octets()) {
            Err(e) if e.kind() != libbpf_rs::ErrorKind::NotFound => return Err(e).context("removing an old generation's shadow SID"),
            _ => {}
        }
    }
    for dev in links {
        let ifindex = inband_core::netif::ifindex(dev)? as i32;
        inband_core::tc::create_clsact(ifindex).with_context(|| format!("creating a clsact qdisc on {dev}"))?;
        slot(ifindex).attach(skel.progs.shadow_dt4.as_fd(), TC_INGRESS).with_context(|| format!("attaching the IPv4 shadow program to {dev} (tc ingress)"))?;
    }
    Ok(())
}

fn slot(ifindex: i32) -> inband_core::tc::Slot {
    inband_core::tc::Slot { ifindex, handle: TC_HANDLE, priority: TC_PRIORITY }
}

/// The programs in this module's filter slot on this namespace's links,
/// each with the links it is on. Usually one, loaded by the last `route`
/// run; a link that run no longer names keeps the one before, which
/// still runs for what arrives there. Read from the links, not from the
/// pins: the program is not pinned, and only the filters say what runs.
pub fn programs() -> Result<Vec<Program>> {
    let mut by_id: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for dev in inband_core::netif::names()? {
        let Ok(ifindex) = inband_core::netif::ifindex(&dev) else { continue };
        if let Some(id) = slot(ifindex as i32).query(TC_INGRESS).with_context(|| format!("reading the tc filters of {dev}"))? {
            by_id.entry(id).or_default().push(dev);
        }
    }
    by_id
        .into_iter()
        .map(|(id, interfaces)| Ok(Program { stats: inband_core::prog_stats::of_id("shadow_dt4", id)?, interfaces }))
        .collect()
}

/// Each counter summed over the CPUs, by name.
pub fn counters() -> Result<Vec<(&'static str, Count)>> {
    let pins = pin_dir();
    if !pins.exists() {
        bail!("no IPv4 shadow program in this network namespace (`inband shadow route` with an IPv4 VIP sets it up)");
    }
    read_counters(&pins.open("dt4_stats")?)
}

pub fn read_counters(map: &dyn MapCore) -> Result<Vec<(&'static str, Count)>> {
    crate::attach::read_named(map, &COUNTERS)
}

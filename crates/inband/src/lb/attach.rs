//! Loading the balancer program, pinning its maps and attaching it to the
//! interface — and the explicit detach that undoes all of it.
//!
//! The XDP attachment is made through netlink, so it outlives the `inband lb`
//! process: a restart (or a crash) of the daemon does not interrupt the data
//! path, and the next daemon reuses the pinned maps (flows included).

use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Xdp, XdpFlags};
use tracing::{info, warn};

use super::config::XdpMode;
use crate::bpf::balancer::BalancerSkelBuilder;
use crate::bpfmap::{remove_pin_dir, PinDir};

/// Balancers of this network namespace, one directory per interface.
pub fn pin_parent() -> PathBuf {
    crate::bpfmap::pin_root().join("lb")
}

pub fn pin_dir(interface: &str) -> PinDir {
    PinDir(pin_parent().join(interface))
}

/// Which XDP mode ended up attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    Native,
    Generic,
}

/// Loads the program (reusing maps already pinned for `interface`) and
/// attaches it, replacing an earlier instance of itself. On failure nothing
/// new stays attached; maps pinned by this call are removed again.
pub fn load_and_attach(interface: &str, mode: XdpMode) -> Result<Attached> {
    let ifindex = crate::netif::ifindex(interface)? as i32;
    let dir = pin_dir(interface);
    let fresh = !dir.exists();
    std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
    let result = load_and_attach_inner(interface, ifindex, mode, &dir);
    if result.is_err() && fresh {
        let _ = remove_pin_dir(&dir.0);
    }
    result
}

fn load_and_attach_inner(interface: &str, ifindex: i32, mode: XdpMode, dir: &PinDir) -> Result<Attached> {
    let mut storage = MaybeUninit::uninit();
    let mut open = BalancerSkelBuilder::default().open(&mut storage).context("opening the balancer BPF object")?;
    for mut map in open.open_object_mut().maps_mut() {
        let name = map.name().to_string_lossy().into_owned();
        if name.contains('.') {
            continue; // <obj>.rodata/.bss: per instance, never shared
        }
        map.set_pin_path(dir.path(&name)).with_context(|| format!("pin path for {name}"))?;
    }
    let skel = open.load().context(
        "loading the balancer program (the kernel verifier refused it, or pinned maps from an incompatible \
         version exist: run `inband lb detach --interface IF` and retry)",
    )?;
    let xdp = Xdp::new(skel.progs.balancer.as_fd());
    let try_mode = |flags: XdpFlags| xdp.attach(ifindex, flags);
    let attached = match mode {
        XdpMode::Native => {
            try_mode(XdpFlags::DRV_MODE).with_context(|| native_hint(interface))?;
            Attached::Native
        }
        XdpMode::Generic => {
            try_mode(XdpFlags::SKB_MODE).context("attaching XDP in generic mode")?;
            Attached::Generic
        }
        XdpMode::Auto => match try_mode(XdpFlags::DRV_MODE) {
            Ok(()) => Attached::Native,
            Err(e) => {
                warn!(interface, error = %e, "native XDP refused; falling back to generic XDP (slower)");
                try_mode(XdpFlags::SKB_MODE).context("attaching XDP in generic mode")?;
                Attached::Generic
            }
        },
    };
    info!(interface, mode = ?attached, pins = %dir.0.display(), "balancer attached");
    Ok(attached)
}

fn native_hint(interface: &str) -> String {
    format!(
        "attaching XDP in native mode to {interface}: the driver does not support it (set xdp_mode = \"auto\" or \"generic\"), \
         or a generic-mode program is attached already (run `inband lb detach --interface {interface}`)"
    )
}

/// Removes the balancer from `interface`: XDP program (both modes) and pins.
pub fn detach(interface: &str, force: bool) -> Result<()> {
    let ifindex = crate::netif::ifindex(interface)? as i32;
    // Detaching goes by ifindex and mode; libbpf-rs only wants some fd to
    // build its handle, which it does not use for detach or query.
    let devnull = std::fs::File::open("/dev/null")?;
    let xdp = Xdp::new(devnull.as_fd());
    let dir = pin_dir(interface);
    if !dir.exists() && !force {
        bail!(
            "no inband balancer state for {interface} ({} is missing); if an XDP program is attached it is \
             not ours: use --force to remove it anyway",
            dir.0.display()
        );
    }
    let mut any = false;
    for mode in [XdpFlags::DRV_MODE.bits(), XdpFlags::SKB_MODE.bits()] {
        let flags = || XdpFlags::from_bits_truncate(mode);
        if xdp.query_id(ifindex, flags()).map(|id| id != 0).unwrap_or(false) {
            xdp.detach(ifindex, flags()).with_context(|| format!("detaching XDP from {interface}"))?;
            any = true;
        }
    }
    let had_pins = dir.exists();
    remove_pin_dir(&dir.0)?;
    if !any && !had_pins {
        bail!("nothing to detach: no balancer is attached to {interface}");
    }
    info!(interface, "balancer detached and its maps unpinned");
    Ok(())
}

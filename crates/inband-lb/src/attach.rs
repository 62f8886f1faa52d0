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
use libbpf_rs::{OpenObject, Xdp, XdpFlags};
use tracing::{info, warn};

use super::config::XdpMode;
use crate::bpf::balancer::{BalancerSkel, BalancerSkelBuilder};
use inband_core::bpfmap::{remove_pin_dir, PinDir};

/// Balancers of this network namespace, one directory per interface.
fn pin_parent() -> PathBuf {
    inband_core::bpfmap::pin_root().join("lb")
}

pub fn pin_dir(interface: &str) -> PinDir {
    PinDir(pin_parent().join(interface))
}

/// A balancer found on this host: its namespace ("" = the host's), its
/// interface and its pins.
pub struct Found {
    pub netns: String,
    pub interface: String,
    pub pins: PinDir,
}

/// Every balancer on the host, in every network namespace: bpffs is one per
/// host, and pins of a named namespace live under inband/netns/NAME.
pub fn discover() -> Vec<Found> {
    let list = |dir: PathBuf, netns: String| -> Vec<Found> {
        std::fs::read_dir(&dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| Found { netns: netns.clone(), interface: e.file_name().to_string_lossy().into_owned(), pins: PinDir(e.path()) })
                    .collect()
            })
            .unwrap_or_default()
    };
    let root = std::path::Path::new("/sys/fs/bpf/inband");
    let mut out = list(root.join("lb"), String::new());
    if let Ok(d) = std::fs::read_dir(root.join("netns")) {
        for e in d.filter_map(|e| e.ok()) {
            out.extend(list(e.path().join("lb"), e.file_name().to_string_lossy().into_owned()));
        }
    }
    out.sort_by(|a, b| (&a.netns, &a.interface).cmp(&(&b.netns, &b.interface)));
    out
}

/// Where the lock of the balancer daemon on `interface` lives.
pub fn run_dir(interface: &str) -> PathBuf {
    inband_core::runlock::state_dir("lb", interface)
}

/// Sizes of the flow tables derived from `flow_table_size`
/// (docs/architecture.md, "Flow lifecycle"), and of the Maglev tables
/// (`maglev_tables` of `maglev_size` entries, handed to the VIPs that read
/// one: tables.rs).
pub fn table_sizes(flow_table_size: u32, maglev_size: u32, maglev_tables: u32) -> [(&'static str, u32); 5] {
    let half_open = (flow_table_size / 4).max(1024);
    [
        ("flows", flow_table_size),
        ("half_open", half_open),
        ("half_open_ports", half_open),
        ("snat", 2 * flow_table_size),
        // 0: no Maglev table (private fixtures); a map needs an entry.
        ("maglev", maglev_tables.max(1) * maglev_size.max(1)),
    ]
}

/// Whether an XDP program is attached to `interface` (either mode).
pub fn attached(interface: &str) -> Result<bool> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    let devnull = std::fs::File::open("/dev/null")?;
    let xdp = Xdp::new(devnull.as_fd());
    Ok([XdpFlags::DRV_MODE, XdpFlags::SKB_MODE].into_iter().any(|f| xdp.query_id(ifindex, f).map(|id| id != 0).unwrap_or(false)))
}

/// Which XDP mode ended up attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    Native,
    Generic,
}

/// Loads the program (reusing maps already pinned for `interface`) and
/// attaches it, replacing an earlier instance of itself. On failure nothing
/// new stays attached; maps pinned by this call are removed again. The
/// loaded object is returned: its `sweep` program ages the pinned tables
/// for as long as the daemon runs.
pub fn load_and_attach<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    interface: &str,
    mode: XdpMode,
    flow_table_size: u32,
    maglev_size: u32,
    maglev_tables: u32,
) -> Result<(BalancerSkel<'obj>, Attached)> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    let dir = pin_dir(interface);
    let fresh = !dir.exists();
    std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
    let result = load(storage, interface, &dir, flow_table_size, maglev_size, maglev_tables).and_then(|skel| {
        let attached = attach(&skel, interface, ifindex, mode)?;
        info!(interface, mode = ?attached, pins = %dir.0.display(), "balancer attached");
        Ok((skel, attached))
    });
    if result.is_err() && fresh {
        let _ = remove_pin_dir(&dir.0);
    }
    result
}

fn load<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    interface: &str,
    dir: &PinDir,
    flow_table_size: u32,
    maglev_size: u32,
    maglev_tables: u32,
) -> Result<BalancerSkel<'obj>> {
    let mut open = BalancerSkelBuilder::default().open(storage).context("opening the balancer BPF object")?;
    let sizes = table_sizes(flow_table_size, maglev_size, maglev_tables);
    for mut map in open.open_object_mut().maps_mut() {
        let name = map.name().to_string_lossy().into_owned();
        // <obj>.rodata/.bss and the checksum scratch space: per instance.
        if name.contains('.') || name == "csum_scratch" {
            continue;
        }
        if let Some((_, n)) = sizes.iter().find(|(m, _)| *m == name) {
            map.set_max_entries(*n).with_context(|| format!("sizing map {name}"))?;
        }
        map.set_pin_path(dir.path(&name)).with_context(|| format!("pin path for {name}"))?;
    }
    open.load().with_context(|| {
        format!(
            "loading the balancer program: the kernel verifier refused it, or maps pinned by another version \
             or with another flow_table_size, maglev_table_size or maglev_tables exist (tables cannot be resized under live flows): \
             run `inband lb detach --interface {interface}` and retry"
        )
    })
}

fn attach(skel: &BalancerSkel, interface: &str, ifindex: i32, mode: XdpMode) -> Result<Attached> {
    let xdp = Xdp::new(skel.progs.balancer.as_fd());
    let try_mode = |flags: XdpFlags| xdp.attach(ifindex, flags);
    Ok(match mode {
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
    })
}

fn native_hint(interface: &str) -> String {
    format!(
        "attaching XDP in native mode to {interface}: the driver does not support it (set xdp_mode = \"auto\" or \"generic\"), \
         or a generic-mode program is attached already (run `inband lb detach --interface {interface}`)"
    )
}

/// Removes the balancer from `interface`: XDP program (both modes) and pins.
pub fn detach(interface: &str, force: bool) -> Result<()> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    // Detaching goes by ifindex and mode; libbpf-rs only wants some fd to
    // build its handle, which it does not use for detach or query.
    let devnull = std::fs::File::open("/dev/null")?;
    let xdp = Xdp::new(devnull.as_fd());
    let dir = pin_dir(interface);
    if let Some(pid) = inband_core::runlock::holder(&run_dir(interface)) {
        bail!(
            "inband lb (pid {pid}) is running on {interface}: stop it first (SIGTERM; the data path stays up), \
             then detach"
        );
    }
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

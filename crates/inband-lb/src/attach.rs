//! Loading the balancer program, pinning its maps and attaching it to the
//! interface — and the explicit detach that undoes all of it.
//!
//! The XDP attachment is made through netlink, so it outlives the `inband lb`
//! process: a restart (or a crash) of the daemon does not interrupt the data
//! path, and the next daemon reuses the pinned maps (flows included).

use std::os::fd::AsFd;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use libbpf_rs::{Object, ObjectBuilder, Xdp, XdpFlags};
use tracing::{info, warn};

use super::config::XdpMode;
use inband_core::bpfmap::{remove_pin_dir, PinDir};
use inband_core::map_upgrade::{self, Upgrade};

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
pub fn table_sizes(flow_table_size: u32, maglev_size: u32, maglev_tables: u32) -> [(&'static str, u32); 6] {
    let half_open = (flow_table_size / 4).max(1024);
    [
        ("flows", flow_table_size),
        ("half_open", half_open),
        ("half_open_ports", half_open),
        ("snat", 2 * flow_table_size),
        // A peer's connections this instance may adopt: as many as it holds.
        ("peer_choices", flow_table_size),
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

/// The balancer's BPF object as built (bpf/balancer.bpf.c), or the file
/// `INBAND_LB_OBJECT` names: the upgrade test loads a build of it whose
/// map layouts differ, as a newer release's would.
fn object_bytes() -> Result<std::borrow::Cow<'static, [u8]>> {
    match std::env::var_os("INBAND_LB_OBJECT") {
        Some(path) => Ok(std::fs::read(&path).with_context(|| format!("reading INBAND_LB_OBJECT {}", path.to_string_lossy()))?.into()),
        None => Ok(crate::bpf::OBJECT.into()),
    }
}

/// Loads the program (reusing maps already pinned for `interface`, and
/// carrying over those whose layout this build changed: map_upgrade) and
/// attaches it, replacing an earlier instance of itself. On failure nothing
/// new stays attached and the running data path keeps its maps; maps pinned
/// by this call are removed again. The loaded object is returned: its
/// `sweep` program ages the pinned tables for as long as the daemon runs.
pub fn load_and_attach(
    interface: &str,
    mode: XdpMode,
    flow_table_size: u32,
    maglev_size: u32,
    maglev_tables: u32,
) -> Result<(Object, Attached)> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    let dir = pin_dir(interface);
    let fresh = !dir.exists();
    std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
    if map_upgrade::recover(&dir, &attached_map_ids(ifindex))? {
        warn!(interface, "an interrupted upgrade had switched the data path already: its new maps now hold the pins");
    }
    let result = load(interface, &dir, flow_table_size, maglev_size, maglev_tables).and_then(|(obj, mut upgrade)| {
        let attached = match upgrade.copy(&obj).and_then(|()| upgrade.catch_up()).and_then(|()| attach(&obj, interface, ifindex, mode)) {
            Ok(a) => a,
            Err(e) => {
                upgrade.abandon();
                return Err(e);
            }
        };
        let carried = upgrade.maps().join(", ");
        upgrade.finish().context("carrying the maps over to the new layout after the switch")?;
        if !carried.is_empty() {
            info!(interface, maps = %carried, "maps carried over to this build's layout");
        }
        info!(interface, mode = ?attached, pins = %dir.0.display(), "balancer attached");
        Ok((obj, attached))
    });
    if result.is_err() && fresh {
        let _ = remove_pin_dir(&dir.0);
    }
    result
}

/// The maps the XDP program attached to `ifindex` uses (none attached: empty).
fn attached_map_ids(ifindex: i32) -> Vec<u32> {
    let Ok(devnull) = std::fs::File::open("/dev/null") else { return Vec::new() };
    let xdp = Xdp::new(devnull.as_fd());
    let Some(id) = [XdpFlags::DRV_MODE, XdpFlags::SKB_MODE].into_iter().find_map(|f| xdp.query_id(ifindex, f).ok().filter(|&id| id != 0)) else {
        return Vec::new();
    };
    map_upgrade::program_maps(id)
}

fn load(interface: &str, dir: &PinDir, flow_table_size: u32, maglev_size: u32, maglev_tables: u32) -> Result<(Object, Upgrade)> {
    let bytes = object_bytes()?;
    let mut open = ObjectBuilder::default().open_memory(&bytes).context("opening the balancer BPF object")?;
    let sizes = table_sizes(flow_table_size, maglev_size, maglev_tables);
    for mut map in open.maps_mut() {
        let name = map.name().to_string_lossy().into_owned();
        if let Some((_, n)) = sizes.iter().find(|(m, _)| *m == name) {
            map.set_max_entries(*n).with_context(|| format!("sizing map {name}"))?;
        }
    }
    // <obj>.rodata/.bss and the checksum scratch space: per instance.
    let upgrade = Upgrade::stage(&mut open, dir, |name| !name.contains('.') && name != "csum_scratch").with_context(|| {
        format!(
            "the maps pinned for {interface} cannot be carried over to this build; nothing was changed and the data path \
             runs on: start the previous version again, or drain this balancer and run `inband lb detach --interface {interface}` \
             to start afresh (that drops its flows)"
        )
    })?;
    match open.load() {
        Ok(obj) => Ok((obj, upgrade)),
        Err(e) => {
            upgrade.abandon();
            Err(anyhow::Error::from(e).context(format!(
                "loading the balancer program on {interface}: the kernel verifier refused it, or a pinned map could not be reused"
            )))
        }
    }
}

/// A program of the loaded balancer object, by name.
pub fn program<'a>(obj: &'a Object, name: &str) -> Result<libbpf_rs::ProgramMut<'a>> {
    obj.progs_mut().find(|p| p.name() == name).ok_or_else(|| anyhow::anyhow!("the balancer object has no program {name}"))
}

fn attach(obj: &Object, interface: &str, ifindex: i32, mode: XdpMode) -> Result<Attached> {
    let prog = program(obj, "balancer")?;
    let xdp = Xdp::new(prog.as_fd());
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

//! Loading the agent program, pinning its maps, attaching it to the
//! interface (tc ingress + egress on a clsact qdisc, tracepoints) — and the
//! clean-up that removes all of it again.
//!
//! Lifetime: unlike the balancer, the agent does not leave its data path
//! behind when it stops. The tracepoints that count connections live only
//! as long as the process (their links are fds), so tc programs left
//! attached would keep answering 124s with a count nobody maintains. A clean
//! stop therefore detaches both tc filters, removes the clsact qdisc if the
//! agent created it, and unpins every map: nothing is left. Responses of
//! connections that were using DSR then simply go back through the balancer,
//! which NATs them like pass-through traffic (docs/architecture.md).
//!
//! The getpeername programs (`client_address`) are attached to a cgroup by
//! links this process holds, like the tracepoints: they go with it, and a
//! crashed agent leaves none behind.
//!
//! The maps are still pinned while the agent runs, for `inband agent status`
//! and for the two cases where state must survive: after a crash (SIGKILL,
//! OOM), and after a stop for an upgrade (SIGUSR2, `Attachment::leave`),
//! the tc filters stay attached with their pinned maps, and the next
//! agent reuses those maps — so client tuples of live DSR connections
//! survive — carrying them over if its build changed their layout
//! (inband_core::map_upgrade), and replaces the filters in place (same
//! handle and priority).

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, OpenObject, TcHook, TC_EGRESS, TC_INGRESS};
use tracing::{info, warn};

use crate::bpf::agent::{AgentSkel, AgentSkelBuilder};
use crate::config::ScoreSource;
use inband_core::bpfmap::{remove_pin_dir, PinDir};
use inband_core::map_upgrade::{self, Upgrade};
use inband_core::runlock::{self, RunLock};

/// Handle and priority of the agent's tc filters. Fixed, so a restarted agent
/// replaces the filters of a crashed one instead of stacking a second pair,
/// and chosen away from 1 and from the kernel's automatic priorities (49152
/// downwards) so that they do not collide with filters other tools add.
pub const TC_HANDLE: u32 = 0x1b0;
pub const TC_PRIORITY: u32 = 0x1b0;

/// Agents of this network namespace, one directory per interface.
pub fn pin_parent() -> PathBuf {
    inband_core::bpfmap::pin_root().join("agent")
}

pub fn pin_dir(interface: &str) -> PinDir {
    PinDir(pin_parent().join(interface))
}

/// Run-time state outside bpffs, which holds only BPF objects: the lock that
/// keeps two agents off one interface (inband_core::runlock), and the record that
/// the agent created the clsact qdisc (so that it removes it, and only
/// then). It sits under /run, which is emptied on reboot together with
/// every qdisc.
pub fn state_dir(interface: &str) -> PathBuf {
    runlock::state_dir("agent", interface)
}

const QDISC_MARKER: &str = "clsact-created";

/// Takes the interface for this process, or says who has it. Released
/// when the agent stops before attaching (`RunLock::release`: a crashed
/// agent's qdisc marker stays, as the qdisc does).
pub fn lock_interface(interface: &str) -> Result<RunLock> {
    RunLock::take(&state_dir(interface), &format!("another inband agent is running on {interface}"))
}

/// Whether an agent process holds the interface right now.
pub fn interface_locked(interface: &str) -> bool {
    runlock::holder(&state_dir(interface)).is_some()
}

/// The loaded and attached agent. `detach` undoes everything.
pub struct Attachment<'obj> {
    pub interface: String,
    pub pins: PinDir,
    skel: AgentSkel<'obj>,
    ifindex: i32,
    tracepoints: Vec<Link>,
    client_address: Option<PathBuf>,
    peer_links: Vec<Link>,
}

/// Loads the program with its maps pinned under `pin_dir(interface)` (reusing
/// maps pinned there by a crashed agent), then attaches ingress, egress and
/// the tracepoints, in that order. If loading fails, maps this call pinned
/// are removed; if attaching fails, everything of the agent on the interface
/// is (`cleanup`), a crashed agent's reused maps included: no process would
/// maintain them, and without the filters their connections fall back to
/// the balancer path anyway.
/// `score` sets what a 125 carries, and whether data packets pay for the
/// per-packet request accounting (only when it counts requests); `client_address`
/// names the cgroup whose processes see their DSR connections' clients.
pub fn attach<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    interface: &str,
    score: ScoreSource,
    client_address: Option<&Path>,
) -> Result<Attachment<'obj>> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    let pins = pin_dir(interface);
    let reused_pins = pins.exists();
    std::fs::create_dir_all(&pins.0).with_context(|| format!("creating {}", pins.0.display()))?;
    if reused_pins && map_upgrade::recover(&pins, &filter_maps(ifindex))? {
        warn!(interface, "an interrupted upgrade had switched the tc programs already: its new maps now hold the pins");
    }
    let (skel, mut upgrade) = match load(storage, &pins, score) {
        Ok(s) => s,
        Err(e) => {
            if !reused_pins {
                let _ = remove_pin_dir(&pins.0);
            }
            return Err(e);
        }
    };
    if reused_pins {
        info!(
            interface,
            pins = %pins.0.display(),
            carried = %if upgrade.maps().is_empty() { "none (same layouts)".to_string() } else { upgrade.maps().join(", ") },
            "taking over the maps of an earlier agent that handed over or did not stop cleanly (client tuples of its DSR connections are kept)"
        );
    }
    let mut a = Attachment {
        interface: interface.to_string(),
        pins,
        skel,
        ifindex,
        tracepoints: Vec::new(),
        client_address: client_address.map(Path::to_path_buf),
        peer_links: Vec::new(),
    };
    if let Err(e) = upgrade.copy(a.skel.object()).and_then(|()| upgrade.catch_up()).and_then(|()| a.attach_all()).and_then(|()| upgrade.finish()) {
        let undo = cleanup(interface, ifindex);
        return Err(match undo {
            Ok(()) => {
                e.context(format!("attaching the agent to {interface} failed; everything attached so far was removed"))
            }
            Err(u) => e.context(format!(
                "attaching the agent to {interface} failed, and undoing it failed too ({u:#}): run \
                 `inband agent detach --interface {interface}`"
            )),
        });
    }
    match &a.client_address {
        Some(cgroup) => info!(
            interface,
            pins = %a.pins.0.display(),
            cgroup = %cgroup.display(),
            "agent attached (tc ingress + egress, tracepoints, getpeername4/6 on the cgroup)"
        ),
        None => info!(interface, pins = %a.pins.0.display(), "agent attached (tc ingress + egress, tracepoints)"),
    }
    Ok(a)
}

/// The maps the agent's tc ingress program uses (none attached: empty).
fn filter_maps(ifindex: i32) -> Vec<u32> {
    let Ok(devnull) = File::open("/dev/null") else { return Vec::new() };
    match slot(ifindex).hook(devnull.as_fd(), TC_INGRESS).query() {
        Ok(id) => map_upgrade::program_maps(id),
        Err(_) => Vec::new(),
    }
}

fn load<'obj>(storage: &'obj mut MaybeUninit<OpenObject>, pins: &PinDir, score: ScoreSource) -> Result<(AgentSkel<'obj>, Upgrade)> {
    let mut open = AgentSkelBuilder::default().open(storage).context("opening the agent BPF object")?;
    // <obj>.rodata/.bss: per instance, never shared.
    let upgrade = Upgrade::stage(open.open_object_mut(), pins, |name| !name.contains('.')).context(
        "the maps an earlier agent left cannot be carried over to this build; nothing was changed and its tc programs run on: \
         start the previous version again, or run `inband agent detach --interface IF` to start afresh (its DSR connections \
         then answer through the balancer)",
    )?;
    // The tracepoints and the cgroup programs see every namespace; they
    // must act on ours only.
    let netns = std::fs::metadata("/proc/self/ns/net").context("reading /proc/self/ns/net")?;
    let cookie = netns_cookie()?;
    if let Some(ro) = open.maps.rodata_data.as_mut() {
        ro.agent_netns_ino = std::os::unix::fs::MetadataExt::ino(&netns) as u32;
        ro.agent_netns_cookie = cookie;
        ro.score_source = score.data_path();
    }
    match open.load() {
        Ok(skel) => Ok((skel, upgrade)),
        Err(e) => {
            upgrade.abandon();
            Err(anyhow::Error::from(e).context("loading the agent program (the kernel verifier refused it)"))
        }
    }
}

impl Attachment<'_> {
    fn attach_all(&mut self) -> Result<()> {
        let created =
            inband_core::tc::create_clsact(self.ifindex).with_context(|| format!("creating a clsact qdisc on {}", self.interface))?;
        if created {
            let marker = state_dir(&self.interface).join(QDISC_MARKER);
            std::fs::write(&marker, b"").with_context(|| format!("writing {}", marker.display()))?;
        }
        for (point, fd, name) in [
            (TC_INGRESS, self.skel.progs.agent_ingress.as_fd(), "ingress"),
            (TC_EGRESS, self.skel.progs.agent_egress.as_fd(), "egress"),
        ] {
            slot(self.ifindex)
                .attach(fd, point)
                .with_context(|| format!("attaching the tc {name} program to {}", self.interface))?;
        }
        for (prog, point) in [
            (&self.skel.progs.agent_sock_state, "sock/inet_sock_set_state"),
            (&self.skel.progs.agent_sock_destroy, "tcp/tcp_destroy_sock"),
        ] {
            let link = prog.attach().with_context(|| {
                format!("attaching to the tracepoint {point} (BTF-typed: needs /sys/kernel/btf/vmlinux, a kernel built with CONFIG_DEBUG_INFO_BTF)")
            })?;
            self.tracepoints.push(link);
        }
        if let Some(path) = &self.client_address {
            let cgroup = File::open(path).with_context(|| format!("opening the cgroup {}", path.display()))?;
            for (prog, what) in
                [(&self.skel.progs.agent_peer4, "getpeername4"), (&self.skel.progs.agent_peer6, "getpeername6")]
            {
                let link = prog
                    .attach_cgroup(cgroup.as_raw_fd())
                    .with_context(|| format!("attaching the {what} program to the cgroup {}", path.display()))?;
                self.peer_links.push(link);
            }
        }
        Ok(())
    }

    /// Each attached program, by our name, for its run counts (`bpf_stats`).
    pub fn programs(&self) -> Result<Vec<(&'static str, std::os::fd::OwnedFd)>> {
        let p = &self.skel.progs;
        let mut all = vec![
            ("ingress", p.agent_ingress.as_fd()),
            ("egress", p.agent_egress.as_fd()),
            ("sock_state", p.agent_sock_state.as_fd()),
            ("sock_destroy", p.agent_sock_destroy.as_fd()),
        ];
        if self.client_address.is_some() {
            all.extend([("getpeername4", p.agent_peer4.as_fd()), ("getpeername6", p.agent_peer6.as_fd())]);
        }
        all.into_iter()
            .map(|(name, fd)| Ok((name, fd.try_clone_to_owned().with_context(|| format!("duplicating the {name} program's fd"))?)))
            .collect()
    }

    /// Stops for an upgrade: the tc programs stay attached with their
    /// pinned maps, for the next agent to take over (see the module
    /// comment); only what lives with the process goes (tracepoints,
    /// getpeername links). Connections that open or close until the next
    /// agent attaches are counted by its seed from /proc/net/tcp.
    pub fn leave(self) {
        let Attachment { interface, pins, tracepoints, skel, peer_links, .. } = self;
        drop(peer_links);
        drop(tracepoints);
        drop(skel);
        info!(interface = %interface, pins = %pins.0.display(), "agent stopped for a hand-over: tc programs and pinned maps left for the next agent");
    }

    /// Detaches everything and removes the pins (see the module comment).
    pub fn detach(self) -> Result<()> {
        let Attachment { interface, ifindex, tracepoints, skel, peer_links, .. } = self;
        // Applications see the balancer's address again before the flows go.
        drop(peer_links);
        // tc first: the tracepoints must keep counting as long as a program
        // may still put the count in a 125.
        let result = cleanup(&interface, ifindex);
        drop(tracepoints);
        drop(skel);
        result?;
        info!(interface = %interface, "agent detached: tc filters, qdisc and pinned maps removed");
        Ok(())
    }
}

/// The cookie of this process's network namespace, as
/// bpf_get_netns_cookie() gives it to the cgroup programs.
fn netns_cookie() -> Result<u64> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // Any socket of the namespace carries its cookie; an unbound one needs
    // no address (a namespace's loopback may be down).
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("opening a socket to read the network namespace's cookie");
    }
    // SAFETY: fd is a new socket that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, (&raw mut cookie).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .context("reading the network namespace's cookie (SO_NETNS_COOKIE, Linux 5.14 or later)");
    }
    Ok(cookie)
}

fn slot(ifindex: i32) -> inband_core::tc::Slot {
    inband_core::tc::Slot { ifindex, handle: TC_HANDLE, priority: TC_PRIORITY }
}

/// Removes every trace of the agent from `interface`: its two tc filters,
/// the clsact qdisc if the agent created it, the pinned maps and the state
/// directory. Idempotent; what is already gone is skipped.
fn cleanup(interface: &str, ifindex: i32) -> Result<()> {
    let mut errors = Vec::new();
    for (point, name) in [(TC_INGRESS, "ingress"), (TC_EGRESS, "egress")] {
        if let Err(e) = slot(ifindex).detach(point) {
            errors.push(format!("detaching the tc {name} filter: {e:#}"));
        }
    }
    let state = state_dir(interface);
    if state.join(QDISC_MARKER).exists() {
        let devnull = File::open("/dev/null")?;
        let mut h = TcHook::new(devnull.as_fd());
        h.ifindex(ifindex).attach_point(TC_INGRESS | TC_EGRESS);
        match h.destroy() {
            Ok(()) => {}
            Err(e) if inband_core::tc::is_absent(&e) => {}
            Err(e) => errors.push(format!("removing the clsact qdisc: {e}")),
        }
        let _ = std::fs::remove_file(state.join(QDISC_MARKER));
    }
    if let Err(e) = remove_pin_dir(&pin_dir(interface).0) {
        errors.push(format!("removing the pinned maps: {e:#}"));
    }
    // The lock file goes with the directory; a holder keeps its open fd.
    let _ = std::fs::remove_file(state.join("lock"));
    runlock::remove_run_dirs(&state);
    if !errors.is_empty() {
        bail!("{}", errors.join("; "));
    }
    Ok(())
}


/// `inband agent detach`: the clean-up of a clean stop, for an agent that
/// did not get to do it (killed, crashed).
pub fn detach(interface: &str) -> Result<()> {
    let ifindex = inband_core::netif::ifindex(interface)? as i32;
    if interface_locked(interface) {
        bail!("an inband agent is running on {interface}: stop it (SIGINT/SIGTERM) and it detaches itself");
    }
    let had_pins = pin_dir(interface).exists();
    let had_state = state_dir(interface).exists();
    cleanup(interface, ifindex)?;
    if !had_pins && !had_state {
        info!(interface, "no agent state found; removed the agent's tc filters if any were attached");
    } else {
        info!(interface, "agent detached: tc filters, qdisc and pinned maps removed");
    }
    Ok(())
}

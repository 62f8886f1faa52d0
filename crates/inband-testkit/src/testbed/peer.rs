//! Attaches the pass-everything XDP program to a veth inside another
//! network namespace (the testbed's switch).

use std::mem::MaybeUninit;
use std::os::fd::AsFd;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Xdp, XdpFlags};

use crate::bpf::veth_peer::VethPeerSkelBuilder;

/// The attachment is made through netlink and outlives this process; it
/// goes away with the namespace.
pub fn attach_pass(netns: &str, ifname: &str) -> Result<()> {
    let ns = std::fs::File::open(format!("/run/netns/{netns}")).with_context(|| format!("opening netns {netns}"))?;
    let ifname = ifname.to_string();
    // setns moves only the calling thread: do it on a thread of its own.
    std::thread::spawn(move || -> Result<()> {
        // SAFETY: a valid namespace fd; only this short-lived thread moves.
        if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
            anyhow::bail!("setns: {}", std::io::Error::last_os_error());
        }
        let ifindex = inband_core::netif::ifindex(&ifname)? as i32;
        let mut storage = MaybeUninit::uninit();
        let skel = VethPeerSkelBuilder::default().open(&mut storage)?.load()?;
        Xdp::new(skel.progs.veth_peer.as_fd())
            .attach(ifindex, XdpFlags::DRV_MODE)
            .with_context(|| format!("attaching the pass program to {ifname}"))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("attach thread panicked"))?
}

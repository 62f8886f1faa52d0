//! tc clsact filters by fixed handle and priority, for every program that
//! attaches at tc (the agent, the daisy-chaining program): fixed, so a
//! restarted process replaces its own filter in place instead of stacking
//! a second one, and detaching needs nothing but the interface.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};

use anyhow::Result;
use libbpf_rs::libbpf_sys;
use libbpf_rs::{TcAttachPoint, TcHook, TcHookBuilder};

/// A filter slot: where one program sits on an interface.
#[derive(Clone, Copy)]
pub struct Slot {
    pub ifindex: i32,
    pub handle: u32,
    pub priority: u32,
}

impl Slot {
    pub fn hook(&self, fd: BorrowedFd<'_>, point: TcAttachPoint) -> TcHook {
        let mut b = TcHookBuilder::new(fd);
        b.ifindex(self.ifindex).handle(self.handle).priority(self.priority);
        b.hook(point)
    }

    /// Attaches `fd` here, replacing what an earlier run left.
    pub fn attach(&self, fd: BorrowedFd<'_>, point: TcAttachPoint) -> Result<()> {
        let mut hook = self.hook(fd, point);
        hook.replace(true);
        hook.attach()?;
        Ok(())
    }

    /// The id of the program in this slot, if there is one.
    pub fn query(&self, point: TcAttachPoint) -> Result<Option<u32>> {
        let devnull = File::open("/dev/null")?;
        match self.hook(devnull.as_fd(), point).query() {
            Ok(id) => Ok(Some(id)),
            Err(e) if is_absent(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the filter; one that is not there (or no clsact qdisc at
    /// all) is not an error.
    pub fn detach(&self, point: TcAttachPoint) -> Result<()> {
        // libbpf only wants some fd to build its handle; detach goes by
        // ifindex, handle and priority.
        let devnull = File::open("/dev/null")?;
        match self.hook(devnull.as_fd(), point).detach() {
            Ok(()) => Ok(()),
            Err(e) if is_absent(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// No such filter (ENOENT), or no clsact qdisc at all (EINVAL).
pub fn is_absent(e: &libbpf_rs::Error) -> bool {
    matches!(e.kind(), libbpf_rs::ErrorKind::NotFound | libbpf_rs::ErrorKind::InvalidInput)
}

/// Creates the clsact qdisc; false if the interface had one already.
pub fn create_clsact(ifindex: i32) -> Result<bool> {
    let mut h = libbpf_sys::bpf_tc_hook {
        sz: std::mem::size_of::<libbpf_sys::bpf_tc_hook>() as _,
        ifindex,
        attach_point: libbpf_sys::BPF_TC_INGRESS,
        ..Default::default()
    };
    // SAFETY: h is a valid, sized bpf_tc_hook.
    let err = unsafe { libbpf_sys::bpf_tc_hook_create(&mut h) };
    match -err {
        0 => Ok(true),
        libc::EEXIST => Ok(false),
        e => Err(std::io::Error::from_raw_os_error(e).into()),
    }
}

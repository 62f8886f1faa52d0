//! A network namespace of one fixture test, for helpers that answer from
//! the current namespace (`bpf_fib_lookup`, `bpf_skc_lookup_tcp`): the
//! test run gives the packet that namespace's loopback device, so they
//! see only the routes and sockets the test made.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;

/// A network namespace owned by one test, entered by the test's thread; the
/// thread goes back and the namespace is deleted on drop, also on panic.
pub struct TestNetns {
    pub name: String,
    orig: File,
}

fn setns(fd: &File) {
    // SAFETY: a valid namespace fd; affects only the calling thread.
    let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl TestNetns {
    pub fn enter(tag: &str) -> TestNetns {
        let orig = File::open("/proc/thread-self/ns/net").unwrap();
        let name = format!("ibt-{}-{tag}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        // From here on the guard exists, so a failure below still cleans up.
        let ns = TestNetns { name, orig };
        setns(&File::open(format!("/run/netns/{}", ns.name)).unwrap());
        ns
    }

    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// Adds IPv6 `cidr` to `dev` (up already) without duplicate address
    /// detection and returns once connections can use it: its local route
    /// comes from a kernel work item, after `ip` has returned.
    pub fn add_ipv6(&self, dev: &str, cidr: &str) {
        self.ip(&["-6", "addr", "add", cidr, "dev", dev, "nodad"]);
        inband_testkit::testbed::netns::wait_ipv6_usable(&self.name).unwrap();
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        // SAFETY: as in setns(); no assert here, this may run while unwinding.
        unsafe { libc::setns(self.orig.as_raw_fd(), libc::CLONE_NEWNET) };
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

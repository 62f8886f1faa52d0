//! Network namespaces for building testbeds: commands inside one, and
//! its removal.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use inband_core::command::ip;

/// A command in `netns`'s network namespace only. Not `ip netns exec`: that
/// also mounts a private /sys, which hides bpffs and so every pinned map.
pub fn in_netns(netns: &str, argv: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{netns}")).arg("--").args(argv);
    c
}

pub fn exists(netns: &str) -> bool {
    std::path::Path::new("/run/netns").join(netns).exists()
}

/// Kills every process in the namespace, then deletes it.
pub fn delete(netns: &str) -> Result<()> {
    if !exists(netns) {
        return Ok(());
    }
    if let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: plain kill(2) on a pid the kernel listed for this namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    ip(&["netns", "del", netns]).map(|_| ())
}

/// How long `wait_ipv6_usable` waits: the kernel's work item runs within
/// milliseconds unless the machine is starved.
const IPV6_USABLE_WITHIN: Duration = Duration::from_secs(10);

/// Waits until every global IPv6 address in `netns` has its local route,
/// at most `IPV6_USABLE_WITHIN`. `ip addr add ... nodad` lists an address
/// at once, but the kernel may insert its local route (which connect(2)
/// and the input path look up) later, from addrconf's DAD work item; until
/// then a connection from or to the address fails with ENETUNREACH.
/// Measured: in 10 to 12 of 100 fresh namespaces the route was not in yet
/// when the next command of the same `ip -batch` looked.
pub fn wait_ipv6_usable(netns: &str) -> Result<()> {
    wait_ipv6_usable_within(netns, IPV6_USABLE_WITHIN)
}

fn wait_ipv6_usable_within(netns: &str, within: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        let missing = ipv6_without_local_route(netns)?;
        if missing.is_empty() {
            return Ok(());
        }
        if start.elapsed() >= within {
            bail!("{netns}: no local route after {within:?} for {}", missing.join(", "));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The global IPv6 addresses of `netns` whose local route is not in yet.
pub fn ipv6_without_local_route(netns: &str) -> Result<Vec<String>> {
    let json = |args: &[&str]| -> Result<serde_json::Value> {
        let mut all = vec!["-n", netns, "-j", "-6"];
        all.extend_from_slice(args);
        Ok(serde_json::from_slice(&ip(&all)?.stdout)?)
    };
    let routes = json(&["route", "show", "table", "local", "type", "local"])?;
    let local: Vec<&str> = routes.as_array().into_iter().flatten().filter_map(|r| r["dst"].as_str()).collect();
    let links = json(&["addr", "show", "scope", "global"])?;
    let addrs = links.as_array().into_iter().flatten().flat_map(|l| l["addr_info"].as_array().into_iter().flatten());
    Ok(addrs.filter_map(|a| a["local"].as_str()).filter(|a| !local.contains(a)).map(str::to_string).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::net::{Ipv6Addr, SocketAddrV6, TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, FromRawFd};

    struct Gone(String);

    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = delete(&self.0);
        }
    }

    /// Runs `f` on a thread inside `netns` (setns moves only that thread).
    fn inside<T: Send + 'static>(netns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let fd = File::open(format!("/run/netns/{netns}")).unwrap();
        std::thread::spawn(move || {
            // SAFETY: a namespace fd held open for the call; this thread only.
            assert_eq!(unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap()
    }

    /// A connection from `from` to `to` (both IPv6), as the tests make
    /// one: the source bound first.
    fn connect_from(from: Ipv6Addr, to: SocketAddrV6) -> std::io::Result<TcpStream> {
        let sa = |ip: &Ipv6Addr, port: u16| libc::sockaddr_in6 {
            sin6_family: libc::AF_INET6 as libc::sa_family_t,
            sin6_port: port.to_be(),
            sin6_flowinfo: 0,
            sin6_addr: libc::in6_addr { s6_addr: ip.octets() },
            sin6_scope_id: 0,
        };
        let len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        let check = |rc: libc::c_int| if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(rc) };
        // SAFETY: socket(2); the descriptor is owned by the stream from here.
        let s = unsafe { TcpStream::from_raw_fd(check(libc::socket(libc::AF_INET6, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0))?) };
        let (me, peer) = (sa(&from, 0), sa(to.ip(), to.port()));
        // SAFETY: bind and connect with sockaddr_in6 structs of `len` bytes.
        check(unsafe { libc::bind(s.as_raw_fd(), (&me as *const libc::sockaddr_in6).cast(), len) })?;
        check(unsafe { libc::connect(s.as_raw_fd(), (&peer as *const libc::sockaddr_in6).cast(), len) })?;
        Ok(s)
    }

    /// A connection to an address whose local route is not in yet fails at
    /// once with ENETUNREACH (the kernel's window after `ip addr add`, made
    /// here by removing the route), and the wait waits for it; with the
    /// route back the wait returns and the connection is made.
    #[test]
    fn an_ipv6_address_is_waited_for_until_its_local_route_is_in() {
        let (from, to): (Ipv6Addr, Ipv6Addr) = ("fd00:77::1".parse().unwrap(), "fd00:77::2".parse().unwrap());
        let ns = format!("ibk-{}-v6", std::process::id());
        let _ = delete(&ns);
        ip(&["netns", "add", &ns]).unwrap();
        let _gone = Gone(ns.clone());
        ip(&["-n", &ns, "link", "set", "lo", "up"]).unwrap();
        for a in [from, to] {
            ip(&["-n", &ns, "-6", "addr", "add", &format!("{a}/128"), "dev", "lo", "nodad"]).unwrap();
        }
        wait_ipv6_usable(&ns).unwrap();
        let l = inside(&ns, move || TcpListener::bind((to, 0)).unwrap());
        let to = SocketAddrV6::new(to, l.local_addr().unwrap().port(), 0, 0);

        ip(&["-n", &ns, "-6", "route", "del", "local", &to.ip().to_string(), "table", "local"]).unwrap();
        assert_eq!(ipv6_without_local_route(&ns).unwrap(), [to.ip().to_string()]);
        let err = wait_ipv6_usable_within(&ns, Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains("fd00:77::2"), "{err:#}");
        let err = inside(&ns, move || connect_from(from, to).unwrap_err());
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");

        ip(&["-n", &ns, "-6", "route", "add", "local", &to.ip().to_string(), "dev", "lo", "table", "local"]).unwrap();
        wait_ipv6_usable(&ns).unwrap();
        inside(&ns, move || connect_from(from, to).unwrap());
        assert!(l.accept().is_ok());
    }
}

//! Facts about this host's interfaces and addresses, read through libc so
//! configuration can be checked before anything is attached.

use std::ffi::{CStr, CString};
use std::net::{IpAddr, Ipv4Addr};

use anyhow::{bail, Result};

/// The interface's index, or an error naming the interface.
pub fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name)?;
    // SAFETY: c is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("interface {name:?} does not exist on this host (see `ip link`)");
    }
    Ok(idx)
}

/// Asks this network namespace's kernel about an interface: `request` is
/// a SIOCGIF* ioctl that fills in an ifreq. Not /sys/class/net: that answers
/// for the namespace sysfs was mounted in, which under `nsenter --net` (how
/// the testbed runs hosts) is another one.
fn ifreq(name: &str, request: libc::c_ulong, what: &str) -> Result<libc::ifreq> {
    // SAFETY: an all-zero ifreq is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        bail!("interface name {name:?} is too long");
    }
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: socket() has no memory preconditions; the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        bail!("socket for reading the {what} of {name}: {}", std::io::Error::last_os_error());
    }
    // SAFETY: req is a NUL-terminated ifreq the kernel fills in.
    let rc = unsafe { libc::ioctl(fd, request, &mut req) };
    let err = std::io::Error::last_os_error();
    // SAFETY: fd came from socket() above.
    unsafe { libc::close(fd) };
    if rc != 0 {
        bail!("reading the {what} of interface {name:?}: {err}");
    }
    Ok(req)
}

/// The interface's MTU as the data paths use it. An IPv4 packet is at most
/// 65535 bytes whatever the interface allows (loopback's MTU is 65536).
pub fn mtu(name: &str) -> Result<u16> {
    let req = ifreq(name, libc::SIOCGIFMTU, "MTU")?;
    // SAFETY: SIOCGIFMTU filled the ifru_mtu member.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    Ok(mtu.clamp(0, i32::from(u16::MAX)) as u16)
}

/// The interface's MAC address.
pub fn mac(name: &str) -> Result<[u8; 6]> {
    let req = ifreq(name, libc::SIOCGIFHWADDR, "MAC")?;
    // SAFETY: SIOCGIFHWADDR filled ifru_hwaddr with a sockaddr.
    let sa = unsafe { req.ifr_ifru.ifru_hwaddr };
    Ok(std::array::from_fn(|i| sa.sa_data[i] as u8))
}

/// The names of this network namespace's interfaces (if_nameindex, which
/// asks the kernel: see `ifreq` on /sys/class/net).
pub fn names() -> Result<Vec<String>> {
    // SAFETY: no preconditions; the array is freed below.
    let head = unsafe { libc::if_nameindex() };
    if head.is_null() {
        bail!("listing the interfaces: {}", std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    // SAFETY: the array ends with an entry of index 0 and a null name.
    while unsafe { (*cur).if_index } != 0 {
        // SAFETY: a nonzero entry's name is a C string of the array.
        out.push(unsafe { CStr::from_ptr((*cur).if_name) }.to_string_lossy().into_owned());
        // SAFETY: not past the terminating entry.
        cur = unsafe { cur.add(1) };
    }
    // SAFETY: head came from if_nameindex.
    unsafe { libc::if_freenameindex(head) };
    Ok(out)
}

/// Whether the kernel takes packets to `a` as its own: an address of an
/// interface, or one inside a `local` route (`ip route add local P dev
/// lo`, which owns a whole block without an address per entry). Asks the
/// kernel's route lookup, as a packet would.
pub fn is_local(a: IpAddr) -> bool {
    crate::command::ip(&["-o", "route", "get", &a.to_string()]).is_ok_and(|o| String::from_utf8_lossy(&o.stdout).starts_with("local "))
}

/// Every IPv4 and IPv6 address of this host (in this network namespace) with its interface.
pub fn local_addrs() -> Result<Vec<(String, IpAddr)>> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills head; freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        bail!("getifaddrs: {}", std::io::Error::last_os_error());
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur walks the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a C string of the list.
        let name = || unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: family is AF_INET, so the address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push((name(), IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))));
            }
            libc::AF_INET6 => {
                // SAFETY: family is AF_INET6, so the address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push((name(), IpAddr::V6(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr))));
            }
            _ => {}
        }
    }
    // SAFETY: head came from getifaddrs.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        bail!("not a MAC address: {s:?}");
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).map_err(|_| anyhow::anyhow!("not a MAC address: {s:?}"))?;
    }
    Ok(mac)
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_mtu_fits_an_ipv4_length() {
        // Loopback's MTU is 65536: one more than an IPv4 packet can be.
        assert_eq!(super::mtu("lo").unwrap(), 65535);
        assert!(super::mtu("no-such-if0").is_err());
    }
}

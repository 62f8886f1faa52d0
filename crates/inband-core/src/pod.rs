//! Plain-old-data views of the `#[repr(C)]` map keys and values shared with
//! the BPF programs, so they can be handed to libbpf as bytes.

use crate::shared::*;

/// # Safety
/// Implement only for `#[repr(C)]` structs of integers whose every bit
/// pattern is valid and that have no implicit padding (the C headers pad
/// explicitly; `layout` tests check the sizes against C).
pub unsafe trait Pod: Copy + Default {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Pod types are padding-free integer structs.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), std::mem::size_of::<Self>()) }
    }

    /// Reads a value from map bytes; short input is zero-extended so a
    /// truncated read can never produce uninitialised memory.
    fn from_bytes(bytes: &[u8]) -> Self {
        let mut v = Self::default();
        let n = bytes.len().min(std::mem::size_of::<Self>());
        // SAFETY: any bit pattern is a valid Pod; n bounds both buffers.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (&mut v as *mut Self).cast::<u8>(), n) };
        v
    }
}

macro_rules! pod {
    ($($t:ty),* $(,)?) => { $(unsafe impl $crate::pod::Pod for $t {})* };
}

unsafe impl Pod for u8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}
unsafe impl Pod for i64 {}

// Every map key and value of the programs. Listed here, in the crate that
// generates the types, because the orphan rule allows the impls nowhere else.
pod!(
    inband_addr,
    inband_auth_key,
    inband_mac_msg,
    inband_mac_msg6,
    // the balancer
    inband_vip_key,
    inband_vip,
    inband_vip_eligible,
    inband_vip_slots,
    inband_backend,
    inband_backend_score,
    inband_lb_config,
    inband_flow_key,
    inband_flow,
    inband_nat_key,
    inband_snat_owner,
    inband_port_hold,
    inband_backend_stats,
    inband_vip_stats,
    inband_flow_gauges,
    inband_sweep_stats,
    inband_control_stats,
    inband_backend_health,
    inband_query_req,
    inband_choice_rec,
    inband_move_counts_args,
    inband_peer_choice,
    inband_capture_conf,
    inband_capture_state,
    inband_capture_rec,
    // the agent
    inband_service,
    inband_service_key,
    inband_balancer,
    inband_balancer_net,
    inband_conn_key,
    inband_dsr_flow,
    inband_agent_config,
    // the mesh
    inband_mesh_config,
    inband_mesh_service_key,
    inband_mesh_service,
    inband_mesh_backend,
    inband_mesh_slot,
    inband_mesh_conn_key,
    inband_mesh_conn,
    // the shadow decider
    inband_shadow_config,
    inband_shadow_count,
    inband_shadow_dt4,
);

/// An IPv4 address as an IPv4 header holds it: network-order bytes in a u32.
pub fn be_addr(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}
pub fn addr_of(be: u32) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(be.to_ne_bytes())
}

/// An address as every BPF map holds it (`struct inband_addr`,
/// bpf/include/inband/addr.h): IPv6, or IPv4 mapped (::ffff:a.b.c.d).
pub fn be_ip(ip: std::net::IpAddr) -> inband_addr {
    let v6 = match ip {
        std::net::IpAddr::V4(a) => a.to_ipv6_mapped(),
        std::net::IpAddr::V6(a) => a,
    };
    let o = v6.octets();
    let word = |i: usize| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]);
    inband_addr { w: [word(0), word(1), word(2), word(3)] }
}

/// The address a map's `struct inband_addr` holds; IPv4-mapped is IPv4.
pub fn ip_of(a: &inband_addr) -> std::net::IpAddr {
    let mut o = [0u8; 16];
    for (i, w) in a.w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
    }
    let v6 = std::net::Ipv6Addr::from(o);
    match v6.to_ipv4_mapped() {
        Some(v4) => std::net::IpAddr::V4(v4),
        None => std::net::IpAddr::V6(v6),
    }
}
/// A port as the BPF maps hold it: network-order bytes in a u16.
pub fn be_port(port: u16) -> u16 {
    port.to_be()
}
pub fn port_of(be: u16) -> u16 {
    u16::from_be(be)
}

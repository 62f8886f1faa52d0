//! The transparent handoff's use of the real-server agent's maps, through
//! their pins (docs/agent.md): on the balancer's host, which client a
//! connection from `inband lb` stands for and which VIP it was sent to, and
//! the freeze that keeps the connection's segments from its frozen socket;
//! on the server's host, the entry that sends the rebuilt connection's
//! responses straight to the client. The layouts are the agent's own
//! (bpf/include/inband/agent/types.h, through inband-core's `shared`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use inband_core::bpfmap::{self, PinDir};
use inband_core::pod::{be_ip, ip_of};
use inband_core::shared::{inband_conn_key, inband_dsr_flow, inband_service, inband_service_key};
use libbpf_rs::MapHandle;

const TCP: u8 = 6;

/// The maps of one agent (its pin directory).
pub struct AgentFlows {
    flows: MapHandle,
    services: MapHandle,
}

fn key(peer: SocketAddr, local_port: u16) -> inband_conn_key {
    inband_conn_key { peer_addr: be_ip(peer.ip()), peer_port: peer.port().to_be(), local_port: local_port.to_be(), proto: TCP, pad: [0; 3] }
}

/// CLOCK_MONOTONIC in milliseconds modulo 2^32: the clock of the data
/// path's bpf_ktime_get_ns(), as `frozen_until_ms` holds it.
fn monotonic_ms() -> u32 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a live timespec; CLOCK_MONOTONIC cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000) as u32
}

/// A connection from the balancer as the agent knows it.
#[derive(Clone, Copy, Debug)]
pub struct DsrEntry {
    pub client: SocketAddr,
    pub ts_shift: u32,
    raw: inband_dsr_flow,
}

impl AgentFlows {
    pub fn open(pins: &Path) -> Result<AgentFlows> {
        let dir = PinDir(pins.to_path_buf());
        Ok(AgentFlows { flows: dir.open("dsr_flows")?, services: dir.open("services")? })
    }

    /// The client that the connection from `peer` (the balancer's tuple)
    /// to `local_port` stands for; None if the agent took no client tuple
    /// for it (not a DSR connection of `inband lb`).
    pub fn entry(&self, peer: SocketAddr, local_port: u16) -> Result<Option<DsrEntry>> {
        let Some(raw) = bpfmap::get::<_, inband_dsr_flow>(&self.flows, &key(peer, local_port))? else { return Ok(None) };
        let ip = ip_of(&raw.client_addr);
        if ip.is_unspecified() {
            return Ok(None);
        }
        Ok(Some(DsrEntry { client: SocketAddr::new(ip, u16::from_be(raw.client_port)), ts_shift: raw.ts_shift, raw }))
    }

    /// The VIP the agent's service on `local_port` answers as.
    pub fn vip(&self, local_port: u16, v4: bool) -> Result<Option<SocketAddr>> {
        let k = inband_service_key { port: local_port.to_be(), proto: TCP, family: if v4 { 4 } else { 6 } };
        Ok(bpfmap::get::<_, inband_service>(&self.services, &k)?.map(|s| SocketAddr::new(ip_of(&s.vip_addr), u16::from_be(s.vip_port))))
    }

    /// From now on, for `span`, the agent drops the connection's segments
    /// and keeps its entry when its socket closes.
    pub fn freeze(&self, peer: SocketAddr, local_port: u16, e: &DsrEntry, span: Duration) -> Result<()> {
        let until = monotonic_ms().wrapping_add(span.as_millis().min(u32::MAX as u128 / 2) as u32).max(1);
        bpfmap::put(&self.flows, &key(peer, local_port), &inband_dsr_flow { frozen_until_ms: until, ..e.raw })
    }

    /// Takes a freeze back: the connection stays with its socket here.
    pub fn unfreeze(&self, peer: SocketAddr, local_port: u16, e: &DsrEntry) -> Result<()> {
        bpfmap::put(&self.flows, &key(peer, local_port), &inband_dsr_flow { frozen_until_ms: 0, ..e.raw })
    }

    /// On the server: the rebuilt connection from `peer` to `local_port`
    /// answers `client` directly, as if the balancer's 155 had named it.
    pub fn install(&self, peer: SocketAddr, local_port: u16, client: SocketAddr, ts_shift: u32) -> Result<()> {
        let v = inband_dsr_flow { client_addr: be_ip(client.ip()), client_port: client.port().to_be(), ts_shift, ..Default::default() };
        bpfmap::put(&self.flows, &key(peer, local_port), &v)
    }
}

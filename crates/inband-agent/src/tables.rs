//! The agent's maps as the control plane uses them: handles, the score the
//! egress program would put in a 125 right now, configuration writes, and
//! snapshots for `status` and the score socket's `get`.

use inband_core::prog_stats::{self, ProgStats};
use std::collections::{BTreeMap, HashSet};
use std::mem::size_of;
use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use ipnet::Ipv6Net;
use libbpf_rs::{MapHandle, MapType};
use serde::Serialize;

use super::config::{ScoreSource, ServiceConfig, MAX_BALANCERS, MAX_FLEETS, MAX_SERVICES};
use super::maps::{AgentCounter, AuthKey, Balancer, BalancerNet, ConnKey, DataPathConfig, DsrFlow, Service, ServiceKey, COUNTER_MAX};
use inband_core::auth::AuthMode;
use inband_core::shared as c;
use inband_core::bpfmap::{self, PinDir};
use inband_core::net::{vip_name, Protocol};
use inband_core::pod::{be_ip, be_port, ip_of, port_of, Pod};

/// The `balancer_nets` key of a fleet prefix.
pub fn balancer_net(p: Ipv6Net) -> BalancerNet {
    BalancerNet { prefixlen: u32::from(p.prefix_len()), addr: be_ip(IpAddr::V6(p.network())) }
}

/// `fleet_instances`: each IPv6 balancer address by its flow label, when
/// fleets are trusted (config.rs refuses two addresses with one label).
pub fn fleet_instances(balancers: &[IpAddr], fleets: &[Ipv6Net]) -> BTreeMap<u32, std::net::Ipv6Addr> {
    if fleets.is_empty() {
        return BTreeMap::new();
    }
    balancers
        .iter()
        .filter_map(|b| match b {
            IpAddr::V6(a) => Some((inband_core::wire::fleet_label(*a), *a)),
            IpAddr::V4(_) => None,
        })
        .collect()
}

/// Size of `dsr_flows`.
pub const FLOW_TABLE_SIZE: u32 = c::INBAND_AGENT_FLOW_TABLE_SIZE;
/// Size of `closed_flows`.
pub const CLOSED_FLOW_TABLE_SIZE: u32 = c::INBAND_AGENT_CLOSED_FLOW_TABLE_SIZE;
/// What a 125 option can carry.
pub const SCORE_MAX: u32 = 0xffff;

/// Handles on the agent's maps.
pub struct AgentMaps {
    pub services: MapHandle,
    pub balancers: MapHandle,
    pub balancer_nets: MapHandle,
    pub fleet_instances: MapHandle,
    pub dsr_flows: MapHandle,
    pub closed_flows: MapHandle,
    pub active_conns: MapHandle,
    pub score_override: MapHandle,
    pub inflight: MapHandle,
    pub agent_config: MapHandle,
    pub auth_keys: MapHandle,
    pub agent_stats: MapHandle,
}

impl AgentMaps {
    /// The maps a running agent pinned in `dir`.
    pub fn open(dir: &PinDir) -> Result<AgentMaps> {
        Ok(AgentMaps {
            services: dir.open("services")?,
            balancers: dir.open("balancers")?,
            balancer_nets: dir.open("balancer_nets")?,
            fleet_instances: dir.open("fleet_instances")?,
            dsr_flows: dir.open("dsr_flows")?,
            closed_flows: dir.open("closed_flows")?,
            active_conns: dir.open("active_conns")?,
            score_override: dir.open("score_override")?,
            inflight: dir.open("inflight")?,
            agent_config: dir.open("agent_config")?,
            auth_keys: dir.open("auth_keys")?,
            agent_stats: dir.open("agent_stats")?,
        })
    }

    /// Fresh maps of the same types and sizes as bpf/agent.bpf.c's, attached
    /// to no program: for exercising the control plane (score socket, poll
    /// responder) without an interface.
    pub fn create_detached() -> Result<AgentMaps> {
        let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
            ..Default::default()
        };
        let make = |ty, name: &str, key: usize, value: usize, max: u32| {
            MapHandle::create(ty, Some(name), key as u32, value as u32, max, &opts)
                .with_context(|| format!("creating map {name}"))
        };
        Ok(AgentMaps {
            services: make(MapType::Hash, "services", size_of::<ServiceKey>(), size_of::<Service>(), MAX_SERVICES as u32)?,
            balancers: make(
                MapType::Hash,
                "balancers",
                size_of::<c::inband_addr>(),
                size_of::<Balancer>(),
                MAX_BALANCERS as u32,
            )?,
            balancer_nets: MapHandle::create(
                MapType::LpmTrie,
                Some("balancer_nets"),
                size_of::<BalancerNet>() as u32,
                size_of::<Balancer>() as u32,
                MAX_FLEETS as u32,
                &libbpf_rs::libbpf_sys::bpf_map_create_opts { map_flags: libbpf_rs::libbpf_sys::BPF_F_NO_PREALLOC, ..opts },
            )
            .context("creating map balancer_nets")?,
            fleet_instances: make(MapType::Hash, "fleet_instances", 4, size_of::<c::inband_addr>(), MAX_BALANCERS as u32)?,
            dsr_flows: make(
                MapType::LruHash,
                "dsr_flows",
                size_of::<ConnKey>(),
                size_of::<DsrFlow>(),
                FLOW_TABLE_SIZE,
            )?,
            closed_flows: make(
                MapType::LruHash,
                "closed_flows",
                size_of::<ConnKey>(),
                size_of::<DsrFlow>(),
                CLOSED_FLOW_TABLE_SIZE,
            )?,
            active_conns: make(MapType::Hash, "active_conns", 2, 8, MAX_SERVICES as u32)?,
            score_override: make(MapType::Hash, "score_override", 2, 4, MAX_SERVICES as u32)?,
            inflight: make(MapType::Hash, "inflight", 2, 8, MAX_SERVICES as u32)?,
            agent_config: make(MapType::Array, "agent_config", 4, size_of::<DataPathConfig>(), 1)?,
            auth_keys: make(MapType::Array, "auth_keys", 4, size_of::<AuthKey>(), c::INBAND_AUTH_MAX_KEYS)?,
            agent_stats: make(MapType::PercpuArray, "agent_stats", 4, 8, COUNTER_MAX as u32)?,
        })
    }

    /// Makes `services`, `balancers`, `balancer_nets` and `fleet_instances`
    /// hold exactly the configuration. A balancer that stays keeps its
    /// newest UDP stamp (replays of its older 155s stay refused).
    pub fn apply(&self, services: &[ServiceConfig], balancers: &[IpAddr], fleets: &[Ipv6Net]) -> Result<()> {
        let wanted: HashSet<ServiceKey> = services.iter().map(service_key).collect();
        for s in services {
            let v = Service { vip_addr: be_ip(s.vip.ip()), vip_port: be_port(s.vip.port()), pad: 0 };
            bpfmap::put(&self.services, &service_key(s), &v)?;
        }
        for (k, _) in bpfmap::entries::<ServiceKey, Service>(&self.services)? {
            if !wanted.contains(&k) {
                bpfmap::delete(&self.services, &k)?;
            }
        }
        let wanted: HashSet<c::inband_addr> = balancers.iter().map(|b| be_ip(*b)).collect();
        for b in &wanted {
            if bpfmap::get::<_, Balancer>(&self.balancers, b)?.is_none() {
                bpfmap::put(&self.balancers, b, &Balancer::default())?;
            }
        }
        for (k, _) in bpfmap::entries::<c::inband_addr, Balancer>(&self.balancers)? {
            if !wanted.contains(&k) {
                bpfmap::delete(&self.balancers, &k)?;
            }
        }
        let wanted: Vec<BalancerNet> = fleets.iter().map(|p| balancer_net(*p)).collect();
        for k in &wanted {
            if bpfmap::get::<_, Balancer>(&self.balancer_nets, k)?.is_none() {
                bpfmap::put(&self.balancer_nets, k, &Balancer::default())?;
            }
        }
        for (k, _) in bpfmap::entries::<BalancerNet, Balancer>(&self.balancer_nets)? {
            if !wanted.iter().any(|w| w.as_bytes() == k.as_bytes()) {
                bpfmap::delete(&self.balancer_nets, &k)?;
            }
        }
        let wanted = fleet_instances(balancers, fleets);
        for (label, addr) in &wanted {
            bpfmap::put(&self.fleet_instances, label, &be_ip(IpAddr::V6(*addr)))?;
        }
        for (k, _) in bpfmap::entries::<u32, c::inband_addr>(&self.fleet_instances)? {
            if !wanted.contains_key(&k) {
                bpfmap::delete(&self.fleet_instances, &k)?;
            }
        }
        Ok(())
    }

    pub fn active(&self, port: u16) -> Result<Option<i64>> {
        bpfmap::get(&self.active_conns, &port)
    }

    pub fn override_of(&self, port: u16) -> Result<Option<u32>> {
        bpfmap::get(&self.score_override, &port)
    }

    pub fn set_override(&self, port: u16, score: u32) -> Result<()> {
        bpfmap::put(&self.score_override, &port, &score)
    }

    pub fn clear_override(&self, port: u16) -> Result<()> {
        bpfmap::delete(&self.score_override, &port)
    }

    /// Connections of `port` with a request in flight; None unless the
    /// score source counts them.
    pub fn in_flight(&self, port: u16) -> Result<Option<i64>> {
        bpfmap::get(&self.inflight, &port)
    }

    /// The score a 125 for `port` would carry now under `source`, as the
    /// egress program computes it.
    pub fn score(&self, port: u16, source: ScoreSource) -> Result<u32> {
        let conns = if source == ScoreSource::Requests { None } else { self.active(port)? };
        let requests = if source.counts_requests() { self.in_flight(port)? } else { None };
        Ok(score_from(self.override_of(port)?, &[conns, requests]))
    }

    /// A counter summed over CPUs.
    pub fn counter(&self, c: AgentCounter) -> Result<u64> {
        Ok(bpfmap::get_percpu::<u32, u64>(&self.agent_stats, &(c as u32))?.iter().sum())
    }

    /// Counts `delta` events the daemon saw (the poll responder's); both
    /// families' responders add through this lock.
    pub fn count(&self, c: AgentCounter, delta: u64) -> Result<()> {
        static ONE_WRITER: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE_WRITER.lock().unwrap();
        bpfmap::add_percpu(&self.agent_stats, &(c as u32), delta)
    }

    /// The keys polls are checked and answered with: the data path's own
    /// (`[auth]`, as last applied).
    pub fn poll_keys(&self) -> Result<inband_core::poll_wire::Keys> {
        let config: DataPathConfig = bpfmap::get(&self.agent_config, &0u32)?.unwrap_or_default();
        inband_core::auth::read_keys(config.auth_mode, &self.auth_keys)
    }

    /// The ids `auth_keys` holds a valid key for.
    pub fn auth_key_ids(&self) -> Result<Vec<u8>> {
        let mut ids = Vec::new();
        for id in 0..c::INBAND_AUTH_MAX_KEYS {
            if bpfmap::get::<u32, AuthKey>(&self.auth_keys, &id)?.is_some_and(|k| k.valid != 0) {
                ids.push(id as u8);
            }
        }
        Ok(ids)
    }

    /// Everything `status` and the score socket's `get` report.
    pub fn snapshot(&self, interface: &str, score_source: Option<ScoreSource>) -> Result<AgentSnapshot> {
        let mut ports: BTreeMap<u16, PortStatus> = BTreeMap::new();
        let mut services = bpfmap::entries::<ServiceKey, Service>(&self.services)?;
        services.sort_by_key(|(k, _)| (port_of(k.port), k.proto, k.family));
        for (k, svc) in services {
            let port = port_of(k.port);
            let vip = vip_name(
                SocketAddr::new(ip_of(&svc.vip_addr), port_of(svc.vip_port)),
                Protocol::from_number(k.proto).unwrap_or_default(),
            );
            if let Some(p) = ports.get_mut(&port) {
                p.vips.push(vip);
                continue;
            }
            ports.insert(
                port,
                PortStatus {
                    vips: vec![vip],
                    active_connections: self.active(port)?.unwrap_or(0),
                    requests_in_flight: self.in_flight(port)?,
                    score_override: self.override_of(port)?,
                    score: self.score(port, score_source.unwrap_or_default())?,
                },
            );
        }
        let mut balancers: Vec<IpAddr> = bpfmap::entries::<c::inband_addr, Balancer>(&self.balancers)?
            .into_iter()
            .map(|(k, _)| ip_of(&k))
            .collect();
        balancers.sort();
        let mut counters = BTreeMap::new();
        for c in AgentCounter::ALL {
            counters.insert(c.name(), self.counter(c)?);
        }
        let config: DataPathConfig = bpfmap::get(&self.agent_config, &0u32)?.unwrap_or_default();
        Ok(AgentSnapshot {
            interface: interface.to_string(),
            score_source,
            balancers,
            auth: AuthStatus { mode: AuthMode::from_c(config.auth_mode), key_ids: self.auth_key_ids()? },
            mtu: config.mtu,
            ports,
            dsr_flows: bpfmap::count(&self.dsr_flows),
            closed_flows: bpfmap::count(&self.closed_flows),
            counters,
            bpf_stats: prog_stats::enabled(),
            programs: Vec::new(),
        })
    }
}

/// The egress program's score (bpf/agent.bpf.c `current_score`): the
/// override if one is set, else the sum of the counts the source adds (a
/// negative count adds nothing), saturating at what a 125 carries.
pub fn score_from(score_override: Option<u32>, counts: &[Option<i64>]) -> u32 {
    match score_override {
        Some(o) => o.min(SCORE_MAX),
        None => counts.iter().flatten().map(|&n| n.max(0)).sum::<i64>().min(i64::from(SCORE_MAX)) as u32,
    }
}

/// The services map's key of a configured service.
fn service_key(s: &ServiceConfig) -> ServiceKey {
    ServiceKey { port: be_port(s.port), proto: s.protocol.number(), family: if s.vip.is_ipv4() { 4 } else { 6 } }
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PortStatus {
    /// The VIPs this port serves (one per transport and family).
    pub vips: Vec<String>,
    pub active_connections: i64,
    /// Present when the score source counts requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_in_flight: Option<i64>,
    pub score_override: Option<u32>,
    /// What a 125 (and a poll reply) for this port carries now. `status`
    /// does not know the source (the running agent's `get` and /metrics
    /// do): it shows the connections' score, the counts beside it.
    pub score: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct AgentSnapshot {
    pub interface: String,
    /// Known to the running agent only (`get`), not to `status`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score_source: Option<ScoreSource>,
    pub balancers: Vec<IpAddr>,
    /// The option format and the ids of the keys loaded (never the keys).
    pub auth: AuthStatus,
    /// The MTU no 125 makes a packet exceed.
    pub mtu: u16,
    /// Local port → its state (JSON object keys are the port numbers).
    pub ports: BTreeMap<u16, PortStatus>,
    /// Entries in `dsr_flows`: connections whose client tuple (155) was
    /// accepted, told apart by their balancer tuple.
    pub dsr_flows: usize,
    /// Entries in `closed_flows`: connections the server closed first
    /// whose TIME_WAIT may still send (of CLOSED_FLOW_TABLE_SIZE; when
    /// full, the oldest goes).
    pub closed_flows: usize,
    pub counters: BTreeMap<&'static str, u64>,
    /// Whether the kernel counts programs' run time now (`bpf_stats`).
    pub bpf_stats: bool,
    /// The running agent's programs with the kernel's counts (its
    /// endpoint only: `status` reads pins, not programs).
    pub programs: Vec<ProgStats>,
}

/// What `status` shows of the `[auth]` settings: never key bytes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct AuthStatus {
    pub mode: AuthMode,
    pub key_ids: Vec<u8>,
}

impl AgentSnapshot {
    pub fn render_table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let balancers: Vec<String> = self.balancers.iter().map(|b| b.to_string()).collect();
        let _ = writeln!(s, "agent on {}  (balancers: {})", self.interface, balancers.join(", "));
        if let Some(src) = self.score_source {
            let _ = writeln!(s, "score source: {}", src.name());
        }
        let ids: Vec<String> = self.auth.key_ids.iter().map(|id| id.to_string()).collect();
        let ids = if ids.is_empty() { "none".to_string() } else { ids.join(", ") };
        let _ = writeln!(s, "auth: {}  key ids: {ids}  mtu: {}", self.auth.mode.name(), self.mtu);
        let _ = writeln!(s, "{:>6}  {:<30}  {:>8}  {:>9}  {:>8}  {:>6}", "port", "vip", "active", "in flight", "override", "score");
        for (port, p) in &self.ports {
            let o = p.score_override.map(|o| o.to_string()).unwrap_or_else(|| "-".into());
            let f = p.requests_in_flight.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "{port:>6}  {:<30}  {:>8}  {f:>9}  {o:>8}  {:>6}",
                p.vips.join(", "),
                p.active_connections,
                p.score
            );
        }
        let _ = writeln!(s, "dsr_flows: {} (connections with a client tuple)", self.dsr_flows);
        let _ = writeln!(s, "closed_flows: {} of {CLOSED_FLOW_TABLE_SIZE} (closed by the server first, kept for their TIME_WAIT)", self.closed_flows);
        for (name, v) in &self.counters {
            let _ = writeln!(s, "  {name:<18} {v}");
        }
        s
    }
}

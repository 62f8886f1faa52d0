//! `lb.toml`: parsing and every check that must pass before the balancer
//! touches the kernel (see docs/configuration.md).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use super::maps::{Mode, Policy, MAX_BACKENDS, MAX_BACKENDS_PER_VIP, MAX_VIPS, SCAN_MAX, SNAT_POOL_BITS};
use inband_core::auth::{AuthConfig, AuthMode};
use inband_core::shared as c;
use inband_core::net::{unicast, vip_name, Protocol};
pub use inband_core::lb_control::{default_control_socket, default_weight, Encap};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum XdpMode {
    /// Native (driver) mode if the interface supports it, else generic.
    #[default]
    Auto,
    Native,
    Generic,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbConfig {
    pub interface: String,
    /// The balancer's IPv4 address on `interface`: the source of what it
    /// sends to IPv4 backends. Needed for IPv4 VIPs.
    #[serde(default)]
    pub address: Option<Ipv4Addr>,
    /// Its IPv6 address there, for IPv6 VIPs.
    #[serde(default)]
    pub address6: Option<Ipv6Addr>,
    /// More source addresses toward IPv4 backends (docs/configuration.md,
    /// "SNAT pool"): each brings its own SNAT ports, so a backend can hold
    /// that many times more live connections from this balancer.
    #[serde(default)]
    pub snat_prefix: Option<Ipv4Net>,
    /// The same toward IPv6 backends.
    #[serde(default)]
    pub snat_prefix6: Option<Ipv6Net>,
    #[serde(default)]
    pub xdp_mode: XdpMode,
    #[serde(default = "default_control_socket")]
    pub control_socket: PathBuf,
    #[serde(default)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Established flows the balancer can hold (the half-open table is a
    /// quarter of it, SNAT reservations twice it); fixed while the data
    /// path stays attached.
    #[serde(default = "default_flow_table_size")]
    pub flow_table_size: u32,
    /// How long a removed VIP or backend keeps its established flows; 0 =
    /// until they end or go idle.
    #[serde(default)]
    pub drain_timeout_ms: u64,
    /// A backend found losing inband options on its path is polled instead;
    /// after this long it gets options again to see whether the path healed
    /// (doubling while it has not, up to 20 times this).
    #[serde(default = "default_options_retry_s")]
    pub options_retry_s: u64,
    /// Have the kernel count the balancer's programs' runs and run time
    /// while the daemon runs (`inband_bpf_program_*` metrics): two clock
    /// reads per packet, so off by default.
    #[serde(default)]
    pub bpf_stats: bool,
    /// Entries of each VIP's Maglev table (policy = "maglev"): a prime,
    /// fixed while the data path stays attached.
    #[serde(default = "default_maglev_table_size")]
    pub maglev_table_size: u32,
    /// How many Maglev tables the data path holds (memory: this ×
    /// maglev_table_size × 4 bytes): at most this many VIPs may read one
    /// (VipConfig::uses_maglev_table). Fixed while the data path stays attached.
    #[serde(default = "default_maglev_tables")]
    pub maglev_tables: u32,
    #[serde(default)]
    pub auth: AuthConfig,
    /// One of several instances behind an ECMP router (docs/architecture.md,
    /// "Several balancers behind ECMP").
    #[serde(default)]
    pub scale_out: Option<ScaleOutConfig>,
    /// Flow moves (moves.rs): a backend may ask, at this address, that its
    /// connection's next packets go to another backend of the VIP.
    #[serde(default)]
    pub moves: Option<MovesConfig>,
    #[serde(default, rename = "vip")]
    pub vips: Vec<VipConfig>,
}

/// `[scale_out]`: the router reaches this instance by SRv6 (one segment),
/// and a TCP packet of a connection this instance does not hold goes back
/// to the router's shadow table, which knows the previous next-hop set.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleOutConfig {
    /// The SID the router's ECMP route sends this instance's share to.
    pub sid: Ipv6Addr,
    /// The SID the router's shadow table sends chained packets to: they are
    /// not chained again.
    pub direct_sid: Ipv6Addr,
    /// The router's SID that looks the VIP up in its shadow table.
    pub shadow_sid: Ipv6Addr,
    /// Fleet tuples (docs/architecture.md, "Fleet tuples"): every instance
    /// sends a connection of a TCP DSR VIP to its backend from the same
    /// server-side tuple, so any of them can carry it.
    #[serde(default)]
    pub fleet: bool,
    /// The fleet's source addresses toward backends: an IPv6 /96, the same
    /// on every instance.
    #[serde(default)]
    pub fleet_prefix: Option<Ipv6Net>,
    /// A key file (as `inband keygen` writes) every instance of the fleet
    /// shares: the fleet tuple is a SipHash of the client side under it.
    #[serde(default)]
    pub fleet_key: Option<PathBuf>,
    /// Strays of fleet connections (another instance's, after its crash)
    /// taken over a second, per CPU: bounds how fast forged strays to the
    /// direct SID can fill the flow table.
    #[serde(default = "default_adopt_per_s")]
    pub adopt_per_s: u32,
    /// The other instances of the fleet, by the address each sends from
    /// (its `address6`): a new connection's backend, on a VIP whose policy
    /// is not Maglev, is announced to each, so that any of them can adopt
    /// the connection if this instance's host dies (peers.rs). Datagrams
    /// from any other address are refused.
    #[serde(default)]
    pub peers: Vec<Ipv6Addr>,
    /// The UDP port the instances announce to each other on.
    #[serde(default = "default_peer_port")]
    pub peer_port: u16,
}

/// `[moves]`: where the balancer takes flow moves (inband_core::flow_move).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MovesConfig {
    /// The UDP addresses requests come to: the balancer's own, one per
    /// family its VIPs serve (a connection's owner asks in the
    /// connection's family).
    pub listen: Vec<SocketAddr>,
}

fn default_peer_port() -> u16 {
    7155
}
/// A datagram's sender is one of these; the receiver keeps a sequence
/// number per peer.
pub const MAX_PEERS: usize = 255;

fn default_adopt_per_s() -> u32 {
    20_000
}
const ADOPT_PER_S: std::ops::RangeInclusive<u32> = 0..=1_000_000;

/// The prefix length of `fleet_prefix`: a 32-bit suffix per connection.
pub const FLEET_PREFIX_LEN: u8 = 96;

impl ScaleOutConfig {
    /// The fleet's prefix and key file when fleet tuples are on.
    pub fn fleet(&self) -> Option<(Ipv6Net, &Path)> {
        match (self.fleet, self.fleet_prefix, &self.fleet_key) {
            (true, Some(p), Some(k)) => Some((p, k.as_path())),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VipConfig {
    pub address: IpAddr,
    pub port: u16,
    #[serde(default)]
    pub protocol: Protocol,
    /// A UDP VIP carrying QUIC: packets after the handshake are routed by
    /// the server id in their connection ID (backends' `quic_server_id`).
    #[serde(default)]
    pub quic: bool,
    pub mode: Mode,
    #[serde(default = "default_policy")]
    pub policy: Policy,
    /// dsr-dynamic: a backend is asked for its score every n-th packet;
    /// this n, or the lower bound of the adaptive n.
    #[serde(default = "default_probe_interval")]
    pub probe_interval: u32,
    /// The upper bound of the adaptive n (probes are spaced out while the
    /// score holds still); absent or equal to probe_interval: a fixed n.
    #[serde(default)]
    pub probe_interval_max: Option<u32>,
    /// At most this many score requests a second per backend; 0 = no bound.
    #[serde(default)]
    pub probe_budget: u32,
    /// dsr-query: how long a SYN waits for the backends' answers before it
    /// is balanced on what came.
    #[serde(default = "default_query_timeout_ms")]
    pub query_timeout_ms: u64,
    /// dsr-dynamic: a SYN that finds every active backend's score older
    /// than score_max_age_ms (after a pause in the traffic) waits for a
    /// query of the backends, as every SYN of dsr-query does.
    #[serde(default)]
    pub query_when_stale: bool,
    #[serde(default = "default_score_max_age_ms")]
    pub score_max_age_ms: u64,
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    #[serde(default = "default_poll_port")]
    pub poll_port: u16,
    /// A handshake the client does not complete in this time is forgotten.
    #[serde(default = "default_syn_timeout_ms")]
    pub syn_timeout_ms: u64,
    /// An established connection without a packet for this long is ended
    /// (default: 900 s for TCP, 120 s for UDP).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// After a FIN or RST, the flow and its port are kept this long.
    #[serde(default = "default_closing_timeout_ms")]
    pub closing_timeout_ms: u64,
    /// How its backends are checked, and what a down backend means for
    /// its flows and for the VIP (`[vip.health]`, docs/configuration.md).
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default, rename = "backend")]
    pub backends: Vec<BackendConfig>,
}

/// `[vip.health]`: active checks of each backend by the lb daemon
/// (crates/inband-lb/src/health.rs), passive detection from what the data
/// path sees of its handshakes, and what being down means.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// `tcp` (a connection is accepted), `http` (a GET answers with an
    /// expected status) or `none`; absent: tcp for TCP VIPs, none for UDP.
    #[serde(default)]
    pub check: Option<CheckKind>,
    /// The port checked; absent: the backend's own.
    #[serde(default)]
    pub port: Option<u16>,
    /// http: the path asked for.
    #[serde(default = "default_health_path")]
    pub path: String,
    /// http: the Host header; absent: the backend's address and port.
    #[serde(default)]
    pub host: Option<String>,
    /// http: the statuses that pass; absent: 200-399.
    #[serde(default)]
    pub expect: Option<Vec<u16>>,
    /// Between two checks of a backend whose state is settled.
    #[serde(default = "default_health_interval_ms")]
    pub interval_ms: u64,
    /// Between checks while a backend's results disagree with its state
    /// (HAProxy's fastinter): a change is confirmed within rise or fall of these.
    #[serde(default = "default_health_fast_interval_ms")]
    pub fast_interval_ms: u64,
    /// A check that has not connected (tcp) or seen a status line (http)
    /// by then fails.
    #[serde(default = "default_health_timeout_ms")]
    pub timeout_ms: u64,
    /// Passes in a row that bring a down backend back.
    #[serde(default = "default_rise")]
    pub rise: u32,
    /// Failures in a row that take a backend down.
    #[serde(default = "default_fall")]
    pub fall: u32,
    /// Each interval varies by up to this percentage, so a balancer's checks
    /// do not arrive at all backends (or from all balancers) at once.
    #[serde(default = "default_jitter_pct")]
    pub jitter_pct: u32,
    /// Handshakes the data path saw the backend refuse (a RST to the SYN)
    /// or leave unanswered (the SYN sent again), with none completed in
    /// between, that take it down until its active checks pass `rise`
    /// times; 0 = no passive detection.
    #[serde(default = "default_passive_fall")]
    pub passive_fall: u32,
    /// How long checks that time out are taken for a busy backend, not a
    /// gone one, while the data path sees clients complete handshakes with
    /// it (a full listen queue drops the check's SYN, not the clients'
    /// ones it has room for). Bounded because those handshakes are the
    /// clients' word: a client can acknowledge a SYN-ACK it never got.
    /// 0 = every timeout counts toward `fall`.
    #[serde(default = "default_busy_max_ms")]
    pub busy_max_ms: u64,
    /// What a down backend's established flows do.
    #[serde(default)]
    pub on_down: OnDown,
    /// What new connections do when every backend of the VIP is down.
    #[serde(default)]
    pub all_down: AllDown,
}

impl Default for HealthConfig {
    fn default() -> Self {
        toml::from_str("").expect("every field has a default")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    Tcp,
    Http,
    None,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnDown {
    /// They go on: a backend that stopped answering checks may still serve
    /// the connections it has (a check path that broke, a full accept queue).
    #[default]
    Keep,
    /// The client's next packet is answered with a RST from the VIP and the
    /// flow ends: clients reconnect at once, to a backend that is up.
    Reset,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllDown {
    /// Every backend takes connections again as if none were down (Envoy's
    /// panic mode): when the checks themselves are what broke, service goes on.
    #[default]
    FailOpen,
    /// A TCP SYN is answered with a RST from the VIP (UDP is dropped, counted
    /// `no_backend`): clients learn at once instead of retrying into silence.
    Refuse,
}

impl HealthConfig {
    /// The check that runs for a VIP of `protocol`.
    pub fn kind(&self, protocol: Protocol) -> CheckKind {
        self.check.unwrap_or(match protocol {
            Protocol::Tcp => CheckKind::Tcp,
            Protocol::Udp => CheckKind::None,
        })
    }

    fn validate(&self, ep: &str, protocol: Protocol) -> Result<()> {
        in_range(&format!("vip {ep}: health.interval_ms"), self.interval_ms, &HEALTH_INTERVAL_MS)?;
        in_range(&format!("vip {ep}: health.fast_interval_ms"), self.fast_interval_ms, &HEALTH_INTERVAL_MS)?;
        in_range(&format!("vip {ep}: health.timeout_ms"), self.timeout_ms, &HEALTH_TIMEOUT_MS)?;
        in_range(&format!("vip {ep}: health.busy_max_ms"), self.busy_max_ms, &HEALTH_BUSY_MAX_MS)?;
        in_range(&format!("vip {ep}: health.rise"), self.rise, &HEALTH_IN_A_ROW)?;
        in_range(&format!("vip {ep}: health.fall"), self.fall, &HEALTH_IN_A_ROW)?;
        in_range(&format!("vip {ep}: health.jitter_pct"), self.jitter_pct, &(0..=50))?;
        if self.passive_fall > *HEALTH_IN_A_ROW.end() {
            bail!("vip {ep}: health.passive_fall = {} is above {}", self.passive_fall, HEALTH_IN_A_ROW.end());
        }
        if self.port == Some(0) {
            bail!("vip {ep}: health.port 0 is not a port to check");
        }
        let kind = self.kind(protocol);
        if kind == CheckKind::Http {
            if !self.path.starts_with('/') || self.path.bytes().any(|b| b <= b' ' || b == 0x7f) {
                bail!("vip {ep}: health.path {:?} must start with / and hold no spaces or control characters", self.path);
            }
            if let Some(h) = &self.host {
                if h.is_empty() || h.bytes().any(|b| b <= b' ' || b == 0x7f) {
                    bail!("vip {ep}: health.host {h:?} is not a host name");
                }
            }
            if let Some(codes) = &self.expect {
                if codes.is_empty() {
                    bail!("vip {ep}: health.expect is empty: no answer could pass");
                }
                if let Some(c) = codes.iter().find(|c| !(100..=599).contains(*c)) {
                    bail!("vip {ep}: health.expect holds {c}, which is not an HTTP status (100-599)");
                }
            }
        } else if self.host.is_some() || self.expect.is_some() {
            bail!("vip {ep}: health.host and health.expect are for check = \"http\"");
        }
        if protocol == Protocol::Udp && kind != CheckKind::None && self.port.is_none() {
            bail!(
                "vip {ep}: a UDP VIP's backends are checked over TCP: set health.port to a TCP port they serve \
                 (or check = \"none\")"
            );
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub address: IpAddr,
    pub port: u16,
    #[serde(default)]
    pub drain: bool,
    /// QUIC VIPs: the server id this backend puts in its connection IDs
    /// (1-65535, unique within the VIP).
    #[serde(default)]
    pub quic_server_id: Option<u16>,
    /// How inband options travel to it: in the IP header (default), or,
    /// for a path that strips or drops IPv4 options, inside IP-in-IP.
    #[serde(default)]
    pub encap: Encap,
    /// Its capacity relative to the VIP's other backends: every policy
    /// gives it new connections in proportion (0: none, as if drained).
    #[serde(default = "default_weight")]
    pub weight: u32,
}


impl BackendConfig {
    pub fn endpoint(&self) -> SocketAddr {
        SocketAddr::new(self.address, self.port)
    }

    /// Whether new connections may go to it: not drained, and a weight.
    pub fn takes_new(&self) -> bool {
        !self.drain && self.weight > 0
    }
}

fn default_policy() -> Policy {
    Policy::LeastScore
}
fn default_probe_interval() -> u32 {
    100
}
fn default_score_max_age_ms() -> u64 {
    2000
}
// One poll a second per backend: already twice as often as HAProxy's
// agent-check default (2 s), and polling traffic grows with backends ×
// balancers. In-band feedback needs no such trade (docs/decisions.md).
fn default_poll_interval_ms() -> u64 {
    1000
}
pub fn default_poll_port() -> u16 {
    9137
}
fn default_health_path() -> String {
    "/".into()
}
// With fast_interval_ms and fall = 2, a backend whose application stops
// (its port refuses) is out within interval + fast interval (0.6 s), one
// whose host goes silent within interval + 2 timeouts + fast interval
// (2.6 s): the targets of issue 27 at 20 new connections a second. Four
// connections a second per backend per balancer.
fn default_health_interval_ms() -> u64 {
    500
}
fn default_health_fast_interval_ms() -> u64 {
    100
}
// Above a LAN round trip by far; a lost SYN (retransmitted at 1 s) fails a
// check, which one more confirms before anything changes (fall = 2).
fn default_health_timeout_ms() -> u64 {
    1000
}
fn default_rise() -> u32 {
    2
}
fn default_fall() -> u32 {
    2
}
fn default_jitter_pct() -> u32 {
    10
}
fn default_passive_fall() -> u32 {
    3
}
// Overload fills listen queues for moments (checks between them pass and
// end the span); a host that died under forged acknowledgements is still
// taken down within seconds.
fn default_busy_max_ms() -> u64 {
    10_000
}
pub fn default_maglev_tables() -> u32 {
    crate::maps::MAGLEV_DEFAULT_TABLES
}

pub fn default_maglev_table_size() -> u32 {
    crate::maglev::DEFAULT_SIZE
}
// Long enough that a lossy path costs little (each retry risks a few
// retransmissions), short enough that a healed path is used again soon.
fn default_options_retry_s() -> u64 {
    30
}
pub fn default_flow_table_size() -> u32 {
    262_144
}
// A client retransmits an unanswered SYN after 1 and 3 s and each retransmission
// refreshes the handshake; its ACK follows the SYN-ACK by one round trip.
// Under a SYN flood the half-open table churns regardless (docs/decisions.md).
fn default_syn_timeout_ms() -> u64 {
    5_000
}
// IPVS's established timeout. conntrack's 5 days keeps dead connections'
// ports for days; cloud balancers cut idle connections at 4-10 minutes.
// Applications with longer idle periods use TCP keepalive or raise this.
const TCP_IDLE_TIMEOUT_S: u64 = 900;
// UDP has no close: a flow ends when it goes quiet. AWS NLB's UDP idle
// timeout; QUIC's own idle timeout is shorter (quinn: 30 s) and a QUIC
// connection that outlives it keeps its server through its connection ID.
const UDP_IDLE_TIMEOUT_S: u64 = 120;
// A query is two LAN round trips at most; beyond that the SYN is better
// balanced on the estimate than held (the client retransmits at 1 s).
fn default_query_timeout_ms() -> u64 {
    20
}
// Retransmitted FINs and the last ACK come within seconds. A port whose
// connection closed is preferred last for reuse anyway (nat.h).
fn default_closing_timeout_ms() -> u64 {
    10_000
}

/// Limits of the per-VIP timeouts (a flow's timestamp is refreshed at most
/// every second, so shorter idle timeouts would be imprecise).
pub const SYN_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 500..=120_000;
pub const IDLE_TIMEOUT_S: std::ops::RangeInclusive<u64> = 10..=7 * 24 * 3600;
pub const CLOSING_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 1_000..=600_000;
pub const FLOW_TABLE_SIZE: std::ops::RangeInclusive<u32> = 4_096..=16_777_216;
pub const SCORE_MAX_AGE_MS: std::ops::RangeInclusive<u64> = 10..=3_600_000;
pub const QUERY_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 1..=1_000;
pub const OPTIONS_RETRY_S: std::ops::RangeInclusive<u64> = 1..=3_600;
pub const MAGLEV_TABLE_SIZE: std::ops::RangeInclusive<u64> = 251..=1_000_003;
pub const WEIGHT_MAX: u32 = 65_535;
pub const HEALTH_INTERVAL_MS: std::ops::RangeInclusive<u64> = 50..=600_000;
pub const HEALTH_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 10..=60_000;
pub const HEALTH_BUSY_MAX_MS: std::ops::RangeInclusive<u64> = 0..=600_000;
pub const HEALTH_IN_A_ROW: std::ops::RangeInclusive<u32> = 1..=100;

fn in_range<T: PartialOrd + std::fmt::Display>(what: &str, v: T, r: &std::ops::RangeInclusive<T>) -> Result<()> {
    if !r.contains(&v) {
        bail!("{what} = {v} is out of range: use {}..={}", r.start(), r.end());
    }
    Ok(())
}

impl VipConfig {
    pub fn endpoint(&self) -> SocketAddr {
        SocketAddr::new(self.address, self.port)
    }

    /// How it is named in messages and status: `[2001:db8::1]:443/udp`.
    pub fn name(&self) -> String {
        vip_name(self.endpoint(), self.protocol)
    }

    /// The policy the data path runs: the round-robin modes ignore a
    /// score policy (they have no scores), not Maglev or least-connections
    /// (they need none).
    pub fn effective_policy(&self) -> Policy {
        match self.mode {
            Mode::Passthrough | Mode::DsrRr if matches!(self.policy, Policy::Maglev | Policy::LeastConnections) => self.policy,
            Mode::Passthrough | Mode::DsrRr => Policy::RoundRobin,
            Mode::DsrPolling | Mode::DsrDynamic | Mode::DsrQuery => self.policy,
        }
    }

    /// Whether the backends that take new connections differ in weight: the VIP
    /// then says VIP_WEIGHTED (least-score and power-of-two weigh any VIP's
    /// backends; round-robin needs the table for it).
    pub fn weighted(&self) -> bool {
        let mut weights = self.backends.iter().filter(|b| b.takes_new()).map(|b| b.weight);
        weights.next().is_some_and(|first| weights.any(|w| w != first))
    }

    /// Whether the data path reads the VIP's Maglev table: policy maglev,
    /// weighted round-robin, which walks it in turn, and a weighted VIP too
    /// large to walk, whose two choices are drawn from it (select.h).
    /// Whether its connections get fleet tuples when `[scale_out] fleet` is
    /// on: TCP in a DSR mode (the 155 tells the agent the client; a
    /// pass-through backend answers the fleet address, which only the
    /// opener could translate), IPv6 (the fleet prefix is). The others keep
    /// the instance's own tuples and, with them, lose their connections
    /// when it crashes.
    pub fn fleet_tuples(&self) -> bool {
        self.protocol == Protocol::Tcp && self.mode != Mode::Passthrough && self.address.is_ipv6()
    }

    pub fn uses_maglev_table(&self) -> bool {
        match self.effective_policy() {
            Policy::Maglev => true,
            Policy::RoundRobin => self.weighted(),
            Policy::LeastScore | Policy::PowerOfTwo | Policy::LeastConnections => self.weighted() && self.backends.len() > SCAN_MAX as usize,
        }
    }

    pub fn idle_timeout_s(&self) -> u64 {
        self.idle_timeout_s.unwrap_or(match self.protocol {
            Protocol::Tcp => TCP_IDLE_TIMEOUT_S,
            Protocol::Udp => UDP_IDLE_TIMEOUT_S,
        })
    }

    pub fn probe_interval_max(&self) -> u32 {
        self.probe_interval_max.unwrap_or(self.probe_interval)
    }

    /// Checks that need no kernel: limits and duplicates within the VIP.
    pub fn validate(&self) -> Result<()> {
        let ep = self.name();
        if self.port == 0 {
            bail!("vip {ep}: port 0 is not a service port");
        }
        if !unicast(self.address) {
            bail!("vip {ep}: {} is not a unicast address clients can reach", self.address);
        }
        in_range(&format!("vip {ep}: score_max_age_ms"), self.score_max_age_ms, &SCORE_MAX_AGE_MS)?;
        in_range(&format!("vip {ep}: syn_timeout_ms"), self.syn_timeout_ms, &SYN_TIMEOUT_MS)?;
        in_range(&format!("vip {ep}: idle_timeout_s"), self.idle_timeout_s(), &IDLE_TIMEOUT_S)?;
        in_range(&format!("vip {ep}: closing_timeout_ms"), self.closing_timeout_ms, &CLOSING_TIMEOUT_MS)?;
        in_range(&format!("vip {ep}: query_timeout_ms"), self.query_timeout_ms, &QUERY_TIMEOUT_MS)?;
        if self.poll_port == 0 {
            bail!("vip {ep}: poll_port 0 is not a port the agents can answer on (their default is 9137)");
        }
        if self.mode == Mode::DsrDynamic && self.probe_interval == 0 {
            bail!("vip {ep}: mode dsr-dynamic needs probe_interval >= 1 (every n-th packet asks for the score)");
        }
        if self.probe_interval_max() < self.probe_interval {
            bail!(
                "vip {ep}: probe_interval_max = {} is below probe_interval = {}: the adaptive n runs between them",
                self.probe_interval_max(),
                self.probe_interval
            );
        }
        if self.mode.scored() && self.policy == Policy::LeastConnections {
            bail!(
                "vip {ep}: policy least-connections ranks by the balancer's own connection counts, in passthrough and dsr-rr; \
                 mode {} ranks by the servers' scores plus those counts: use least-score",
                self.mode.name()
            );
        }
        if self.query_when_stale && self.mode != Mode::DsrDynamic {
            bail!(
                "vip {ep}: query_when_stale is for mode dsr-dynamic, whose scores come with the traffic and go stale in its pauses; \
                 mode {} {}",
                self.mode.name(),
                if self.mode == Mode::DsrQuery { "asks before every connection already" } else { "takes no in-band scores" }
            );
        }
        if self.mode == Mode::DsrPolling && self.poll_interval_ms == 0 {
            bail!("vip {ep}: mode dsr-polling needs poll_interval_ms >= 1");
        }
        self.health.validate(&ep, self.protocol)?;
        if self.quic && self.protocol != Protocol::Udp {
            bail!("vip {ep}: quic = true needs protocol = \"udp\" (QUIC runs over UDP)");
        }
        if self.backends.len() > MAX_BACKENDS_PER_VIP as usize {
            bail!("vip {ep}: {} backends, at most {MAX_BACKENDS_PER_VIP} per VIP", self.backends.len());
        }
        let mut seen = HashSet::new();
        let mut ids = HashSet::new();
        for b in &self.backends {
            let be = b.endpoint();
            if b.port == 0 {
                bail!("vip {ep}: backend {be} has port 0");
            }
            if !unicast(b.address) {
                bail!("vip {ep}: backend {be} is not a unicast address");
            }
            if b.address.is_ipv4() != self.address.is_ipv4() {
                bail!(
                    "vip {ep}: backend {be} is of the other address family: a VIP's backends share its family \
                     (the balancer translates addresses, not protocols)"
                );
            }
            if b.address == self.address {
                bail!("vip {ep}: backend {be} is the VIP itself");
            }
            if !seen.insert(be) {
                bail!("vip {ep}: backend {be} is listed twice; remove the duplicate");
            }
            if b.weight > WEIGHT_MAX {
                bail!("vip {ep}: backend {be}: weight = {} is above {WEIGHT_MAX}", b.weight);
            }
            if b.encap == Encap::Ipip && b.address.is_ipv6() {
                bail!(
                    "vip {ep}: backend {be}: encap = \"ipip\" is for IPv4 backends (IPv6 options ride in a \
                     destination options header, which has no such carrier yet): remove it"
                );
            }
            match (b.quic_server_id, self.quic) {
                (Some(0), _) => bail!("vip {ep}: backend {be}: quic_server_id 0 is not an id (use 1-65535)"),
                (Some(id), true) if !ids.insert(id) => {
                    bail!("vip {ep}: quic_server_id {id} is given to two backends; each needs its own")
                }
                (Some(_), false) => bail!("vip {ep}: backend {be} has a quic_server_id but the VIP is not quic = true"),
                _ => {}
            }
        }
        Ok(())
    }
}

impl LbConfig {
    pub fn load(path: &Path) -> Result<LbConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<LbConfig> {
        let cfg: LbConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that need no kernel state: run by `parse`.
    pub fn validate(&self) -> Result<()> {
        if self.vips.len() > MAX_VIPS as usize {
            bail!("{} VIPs configured, at most {MAX_VIPS}", self.vips.len());
        }
        if self.address.is_none() && self.address6.is_none() {
            bail!(
                "no balancer address: set `address` (IPv4) and/or `address6` (IPv6) to this host's address on {}",
                self.interface
            );
        }
        for a in self.addresses() {
            if !unicast(a) {
                bail!("address {a} is not a unicast address: set it to this host's address on {}", self.interface);
            }
        }
        self.validate_snat_pools()?;
        in_range("flow_table_size", self.flow_table_size, &FLOW_TABLE_SIZE)?;
        in_range("options_retry_s", self.options_retry_s, &OPTIONS_RETRY_S)?;
        in_range("maglev_table_size", u64::from(self.maglev_table_size), &MAGLEV_TABLE_SIZE)?;
        in_range("maglev_tables", self.maglev_tables, &(1..=MAX_VIPS))?;
        let reading = self.vips.iter().filter(|v| v.uses_maglev_table()).count();
        if reading > self.maglev_tables as usize {
            bail!(
                "{reading} VIPs read a Maglev table (maglev, weighted round-robin, weighted VIPs of more than {} backends), \
                 at most maglev_tables = {}: raise maglev_tables (each table takes maglev_table_size × 4 bytes)",
                crate::maps::SCAN_MAX,
                self.maglev_tables
            );
        }
        if !crate::maglev::is_prime(self.maglev_table_size) {
            bail!(
                "maglev_table_size = {} is not a prime: Maglev needs one (every backend's permutation must visit every entry); \
                 65537 is the default, 251, 4099, 16381 and 1000003 are others",
                self.maglev_table_size
            );
        }
        self.auth.validate(true).context("[auth]")?;
        if let Some(so) = &self.scale_out {
            if self.address6.is_none() {
                bail!("[scale_out]: chained packets leave in IPv6 from the balancer's own address: set `address6`");
            }
            let sids = [so.sid, so.direct_sid, so.shadow_sid];
            if let Some(bad) = sids.iter().find(|s| !unicast(IpAddr::V6(**s))) {
                bail!("[scale_out]: {bad} is not a unicast address a router can route to");
            }
            if sids[0] == sids[1] || sids[0] == sids[2] || sids[1] == sids[2] {
                bail!("[scale_out]: sid, direct_sid and shadow_sid must be three different addresses (a chained packet must not be chained again)");
            }
            self.validate_fleet(so)?;
        }
        if let Some(m) = &self.moves {
            self.validate_moves(m)?;
        }
        let mut seen = HashSet::new();
        let mut backends = 0;
        for v in &self.vips {
            v.validate()?;
            let Some(own) = self.address_for(v.address) else {
                let (key, family) = if v.address.is_ipv4() { ("address", "IPv4") } else { ("address6", "IPv6") };
                bail!(
                    "vip {} is {family}, and the balancer has no {family} address: set `{key}` to its {family} address on {}",
                    v.name(),
                    self.interface
                );
            };
            if v.address == own {
                bail!(
                    "vip {} is the balancer's own address: backends answer that address, so give the VIP one of its own (e.g. on lo)",
                    v.name()
                );
            }
            if let Some(b) = v.backends.iter().find(|b| b.address == own) {
                bail!("vip {}: backend {} is the balancer itself", v.name(), b.endpoint());
            }
            if !seen.insert((v.endpoint(), v.protocol)) {
                bail!("vip {} is listed twice", v.name());
            }
            backends += v.backends.len();
        }
        if backends > MAX_BACKENDS as usize {
            bail!("{backends} backends in all, at most {MAX_BACKENDS}");
        }
        Ok(())
    }

    /// Each SNAT pool's (key, addresses).
    pub fn snat_pools(&self) -> Vec<(&'static str, Vec<IpAddr>)> {
        let mut out = Vec::new();
        if let Some(p) = self.snat_prefix {
            let first = u32::from(p.network());
            out.push(("snat_prefix", (0..1u32 << (32 - p.prefix_len())).map(|i| IpAddr::V4(Ipv4Addr::from(first + i))).collect()));
        }
        if let Some(p) = self.snat_prefix6 {
            let first = u128::from(p.network());
            out.push(("snat_prefix6", (0..1u128 << (128 - p.prefix_len())).map(|i| IpAddr::V6(Ipv6Addr::from(first + i))).collect()));
        }
        out
    }

    /// A pool holds at most SNAT_POOL_MAX addresses (the index a flow keeps
    /// and the data path's bound), aligned, of a family the balancer has an
    /// address of, and overlaps none of the addresses traffic is told by.
    fn validate_fleet(&self, so: &ScaleOutConfig) -> Result<()> {
        in_range("[scale_out] adopt_per_s", so.adopt_per_s, &ADOPT_PER_S)?;
        if !so.fleet {
            if so.fleet_prefix.is_some() || so.fleet_key.is_some() || !so.peers.is_empty() {
                bail!("[scale_out]: fleet_prefix, fleet_key and peers take effect only with fleet = true: set it, or remove them");
            }
            return Ok(());
        }
        if so.peers.len() > MAX_PEERS {
            bail!("[scale_out]: {} peers: at most {MAX_PEERS}", so.peers.len());
        }
        if so.peer_port == 0 {
            bail!("[scale_out]: peer_port = 0: name the UDP port every instance announces on");
        }
        if let Some(p) = so.peers.iter().find(|p| Some(**p) == self.address6) {
            bail!("[scale_out]: peers holds {p}, this instance's own address6: list the other instances only");
        }
        if let Some(p) = so.peers.iter().find(|p| !unicast(IpAddr::V6(**p))) {
            bail!("[scale_out]: peer {p} is not a unicast address");
        }
        let (Some(net), Some(_)) = (so.fleet_prefix, &so.fleet_key) else {
            bail!("[scale_out]: fleet = true needs fleet_prefix (an IPv6 /96, the same on every instance) and fleet_key (a key file every instance shares; `inband keygen --out FILE`)");
        };
        if net.prefix_len() != FLEET_PREFIX_LEN {
            bail!("[scale_out]: fleet_prefix = {net} must be a /{FLEET_PREFIX_LEN}: the fleet tuple's address is the prefix and 32 bits of the hash");
        }
        if net.trunc() != net {
            bail!("[scale_out]: fleet_prefix = {net} has host bits set: write the block's first address, {}", net.trunc());
        }
        if !unicast(IpAddr::V6(net.network())) {
            bail!("[scale_out]: fleet_prefix = {net} is not unicast: backends answer its addresses");
        }
        let own = self.address6.into_iter().chain([so.sid, so.direct_sid, so.shadow_sid]);
        if let Some(a) = own.into_iter().find(|a| net.contains(a)) {
            bail!("[scale_out]: fleet_prefix = {net} holds {a}, an address of this instance or its router: the fleet's addresses must be its own");
        }
        if self.snat_prefix6.is_some_and(|p| p.contains(&net.network()) || net.contains(&p.network())) {
            bail!("[scale_out]: fleet_prefix = {net} overlaps snat_prefix6: two flows could share a tuple");
        }
        let net = IpNet::V6(net);
        for v in &self.vips {
            if net.contains(&v.address) {
                bail!("[scale_out]: fleet_prefix = {net} holds vip {}", v.name());
            }
            if let Some(b) = v.backends.iter().find(|b| net.contains(&b.address)) {
                bail!("[scale_out]: fleet_prefix = {net} holds backend {} of vip {}", b.endpoint(), v.name());
            }
        }
        Ok(())
    }

    /// Moves exist only authenticated (a move redirects a live connection),
    /// and come to an address of this balancer's, apart from the peers' port.
    fn validate_moves(&self, m: &MovesConfig) -> Result<()> {
        if self.auth.mode == AuthMode::None {
            bail!("[moves]: flow moves exist only in the authenticated format, and [auth] mode = \"none\": set mode = \"siphash\" with keys, or remove [moves]");
        }
        if m.listen.is_empty() {
            bail!("[moves]: listen = []: name the balancer's address (and `address6`) with the UDP port the backends send their requests to");
        }
        for (i, listen) in m.listen.iter().enumerate() {
            if m.listen[..i].iter().any(|l| l.ip() == listen.ip()) {
                bail!("[moves]: listen names {} twice: one port per address", listen.ip());
            }
            if !self.addresses().contains(&listen.ip()) {
                bail!(
                    "[moves]: listen = {listen} is not one of the balancer's addresses ({}): listen on `address` or `address6`",
                    self.addresses().iter().map(IpAddr::to_string).collect::<Vec<_>>().join(", ")
                );
            }
            if listen.port() == 0 {
                bail!("[moves]: listen = {listen}: name the UDP port the backends send their requests to");
            }
            if let Some(so) = self.scale_out.as_ref().filter(|so| so.fleet().is_some()) {
                if Some(listen.ip()) == self.address6.map(IpAddr::V6) && listen.port() == so.peer_port {
                    bail!("[moves]: listen = {listen} is [scale_out] peer_port's address: give moves another port");
                }
            }
        }
        Ok(())
    }

    fn validate_snat_pools(&self) -> Result<()> {
        let pools = [
            self.snat_prefix.map(|p| (IpNet::V4(p), "snat_prefix", 32 - SNAT_POOL_BITS, self.address.map(IpAddr::V4), "address")),
            self.snat_prefix6.map(|p| (IpNet::V6(p), "snat_prefix6", 128 - SNAT_POOL_BITS, self.address6.map(IpAddr::V6), "address6")),
        ];
        for (net, key, min_len, own, own_key) in pools.into_iter().flatten() {
            if net.prefix_len() < min_len {
                bail!("{key} = {net} has more than {} addresses; the most a pool may hold is a /{min_len}", 1u32 << SNAT_POOL_BITS);
            }
            if net.trunc() != net {
                bail!("{key} = {net} has host bits set: write the block's first address, {}", net.trunc());
            }
            let Some(own) = own else {
                bail!("{key} needs `{own_key}`: the pool adds source addresses to it");
            };
            if net.contains(&own) {
                bail!("{key} = {net} holds the balancer's `{own_key}` {own}: a pool must not repeat it (two flows could share a tuple)");
            }
            for v in &self.vips {
                if net.contains(&v.address) {
                    bail!("{key} = {net} holds vip {}", v.name());
                }
                if let Some(b) = v.backends.iter().find(|b| net.contains(&b.address)) {
                    bail!("{key} = {net} holds backend {} of vip {}", b.endpoint(), v.name());
                }
            }
        }
        Ok(())
    }

    /// The balancer's addresses, IPv4 first.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.address.map(IpAddr::V4).into_iter().chain(self.address6.map(IpAddr::V6)).collect()
    }

    /// The balancer's address of `a`'s family, if it has one.
    pub fn address_for(&self, a: IpAddr) -> Option<IpAddr> {
        match a {
            IpAddr::V4(_) => self.address.map(IpAddr::V4),
            IpAddr::V6(_) => self.address6.map(IpAddr::V6),
        }
    }

    /// Checks against this host: run before anything is attached.
    pub fn check_host(&self) -> Result<()> {
        inband_core::netif::ifindex(&self.interface)?;
        let locals = inband_core::netif::local_addrs()?;
        for (a, key) in self.address.map(|a| (IpAddr::V4(a), "address")).into_iter().chain(self.address6.map(|a| (IpAddr::V6(a), "address6"))) {
            if !locals.iter().any(|(ifn, l)| *l == a && *ifn == self.interface) {
                bail!(
                    "{key} {a} is not configured on interface {}: set `{key}` to this host's address there (see `ip addr show {}`)",
                    self.interface,
                    self.interface
                );
            }
        }
        // Behind an ECMP router the VIP's packets come to this instance's
        // Backends answer the pool's addresses: the host must own them
        // (answer ARP and neighbour discovery for them).
        for (key, addrs) in self.snat_pools() {
            if let Some(a) = addrs.iter().find(|a| !inband_core::netif::is_local(**a)) {
                let net = if key == "snat_prefix" { self.snat_prefix.map(|p| p.to_string()) } else { self.snat_prefix6.map(|p| p.to_string()) };
                bail!(
                    "{key}: {a} is not a local address of this host, so backends' answers to it would go nowhere: make the block local, e.g. `ip route add local {} dev lo`",
                    net.unwrap_or_default()
                );
            }
        }
        // SIDs: nobody asks for the VIP's link-layer address.
        for v in self.vips.iter().filter(|_| self.scale_out.is_none()) {
            if !locals.iter().any(|(_, a)| *a == v.address) {
                let prefix = if v.address.is_ipv4() { 32 } else { 128 };
                bail!(
                    "vip {} is not a local address of this host, so nobody answers ARP or neighbour discovery for it: add it, e.g. `ip addr add {}/{prefix} dev lo`",
                    v.name(),
                    v.address
                );
            }
        }
        if let Some((lo, hi)) = ephemeral_ports().filter(|(lo, _)| u32::from(*lo) <= c::INBAND_SNAT_PORT_MAX) {
            tracing::warn!(
                "this host's ephemeral ports ({lo}-{hi}, net.ipv4.ip_local_port_range) overlap the balancer's SNAT ports \
                 ({}-{}): its health checks may take a port a client's flow to the same backend holds, and agents count \
                 them as load; start the range above {}",
                c::INBAND_SNAT_PORT_MIN,
                c::INBAND_SNAT_PORT_MAX,
                c::INBAND_SNAT_PORT_MAX
            );
        }
        inband_core::bpfmap::require_bpffs()
    }
}

/// The kernel's ephemeral port range, where this host's own connections
/// (the health checks) take their source ports; None if unreadable.
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|n| n.parse().ok());
    Some((it.next()??, it.next()??))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
interface = "eth0"
address = "10.77.0.2"
[auth]
mode = "none"
[[vip]]
address = "10.77.0.100"
port = 80
mode = "dsr-dynamic"
[[vip.backend]]
address = "10.77.0.21"
port = 8080
[[vip.backend]]
address = "10.77.0.22"
port = 8080
"#;

    fn err(text: &str) -> String {
        format!("{:#}", LbConfig::parse(text).unwrap_err())
    }

    #[test]
    fn a_snat_pool_is_a_small_aligned_block_apart_from_every_other_address() {
        let with = |line: &str| GOOD.replace("address = \"10.77.0.2\"\n", &format!("address = \"10.77.0.2\"\n{line}\n"));
        let c = LbConfig::parse(&with("snat_prefix = \"10.77.0.224/29\"")).unwrap();
        let pools = c.snat_pools();
        assert_eq!((pools[0].0, pools[0].1.len()), ("snat_prefix", 8));
        assert_eq!((pools[0].1[0].to_string(), pools[0].1[7].to_string()), ("10.77.0.224".into(), "10.77.0.231".into()));
        assert!(err(&with("snat_prefix = \"10.77.0.192/26\"")).contains("the most a pool may hold is a /27"));
        assert!(err(&with("snat_prefix = \"10.77.0.225/29\"")).contains("write the block's first address, 10.77.0.224/29"));
        assert!(err(&with("snat_prefix = \"10.77.0.0/29\"")).contains("holds the balancer's `address` 10.77.0.2"));
        assert!(err(&with("snat_prefix = \"10.77.0.96/27\"")).contains("holds vip 10.77.0.100:80"));
        assert!(err(&with("snat_prefix = \"10.77.0.16/28\"")).contains("holds backend 10.77.0.21:8080"));
        assert!(err(&with("snat_prefix6 = \"fd00::e0/123\"")).contains("snat_prefix6 needs `address6`"));
        assert!(err(&with("snat_prefix = \"fd00::e0/123\"")).contains("snat_prefix"), "an IPv6 block as snat_prefix");
    }

    #[test]
    fn parses_defaults() {
        let c = LbConfig::parse(GOOD).unwrap();
        assert_eq!(c.vips[0].mode, Mode::DsrDynamic);
        assert_eq!(c.vips[0].policy, Policy::LeastScore);
        assert_eq!(c.vips[0].probe_interval, 100);
        assert_eq!(c.vips[0].poll_interval_ms, 1000);
        assert_eq!((c.vips[0].syn_timeout_ms, c.vips[0].idle_timeout_s(), c.vips[0].closing_timeout_ms), (5_000, 900, 10_000));
        assert_eq!((c.vips[0].protocol, c.vips[0].quic), (Protocol::Tcp, false));
        assert_eq!((c.vips[0].probe_interval_max(), c.vips[0].probe_budget, c.vips[0].query_timeout_ms), (100, 0, 20));
        assert_eq!((c.address, c.address6), (Some("10.77.0.2".parse().unwrap()), None));
        assert_eq!((c.flow_table_size, c.drain_timeout_ms), (262_144, 0));
        assert_eq!(c.vips[0].backends.len(), 2);
        assert_eq!(c.xdp_mode, XdpMode::Auto);
        assert_eq!(c.control_socket, PathBuf::from("/run/inband/lb.sock"));
    }

    #[test]
    fn health_defaults_and_refusals() {
        let h = LbConfig::parse(GOOD).unwrap().vips[0].health.clone();
        assert_eq!(h.kind(Protocol::Tcp), CheckKind::Tcp, "TCP VIPs are checked by default");
        assert_eq!(h.kind(Protocol::Udp), CheckKind::None, "UDP VIPs are not, unless told how");
        assert_eq!((h.interval_ms, h.fast_interval_ms, h.timeout_ms, h.rise, h.fall), (500, 100, 1000, 2, 2));
        assert_eq!((h.on_down, h.all_down, h.passive_fall), (OnDown::Keep, AllDown::FailOpen, 3));
        let health = |lines: &str| GOOD.replacen("[[vip.backend]]", &format!("[vip.health]\n{lines}\n[[vip.backend]]"), 1);
        let ok = LbConfig::parse(&health("check = \"http\"\npath = \"/healthz\"\nexpect = [200, 204]\nhost = \"svc\"\non_down = \"reset\"\nall_down = \"refuse\"")).unwrap();
        let h = &ok.vips[0].health;
        assert_eq!((h.kind(Protocol::Tcp), h.expect.clone(), h.on_down, h.all_down), (CheckKind::Http, Some(vec![200, 204]), OnDown::Reset, AllDown::Refuse));
        assert!(err(&health("interval_ms = 10")).contains("health.interval_ms = 10 is out of range"));
        assert!(err(&health("fall = 0")).contains("health.fall = 0 is out of range"));
        assert!(err(&health("check = \"http\"\npath = \"healthz\"")).contains("must start with /"));
        assert!(err(&health("check = \"http\"\npath = \"/a b\"")).contains("must start with /"));
        assert!(err(&health("check = \"http\"\nexpect = []")).contains("health.expect is empty"));
        assert!(err(&health("check = \"http\"\nexpect = [99]")).contains("not an HTTP status"));
        assert!(err(&health("expect = [200]")).contains("are for check = \"http\""));
        assert!(err(&health("port = 0")).contains("health.port 0"));
        assert!(err(&health("on_down = \"drop\"")).contains("unknown variant `drop`"));
        assert!(err(&health("checks = \"tcp\"")).contains("unknown field `checks`"));
        let udp = health("check = \"tcp\"").replace("port = 80\n", "port = 80\nprotocol = \"udp\"\n");
        assert!(err(&udp).contains("set health.port"));
    }

    #[test]
    fn refuses_unknown_mode_duplicates_and_typos() {
        assert!(err(&GOOD.replace("dsr-dynamic", "dsr-magic")).contains("unknown variant `dsr-magic`"));
        let dup = GOOD.replace("10.77.0.22", "10.77.0.21");
        assert!(err(&dup).contains("backend 10.77.0.21:8080 is listed twice"));
        assert!(err(&GOOD.replace("interface =", "interfce =")).contains("unknown field `interfce`"));
        let zero = GOOD.replace("port = 80\n", "port = 80\nprobe_interval = 0\n");
        assert!(err(&zero).contains("probe_interval >= 1"));
    }

    /// Every value an operator can get wrong is refused with what to fix.
    #[test]
    fn refuses_values_that_cannot_work() {
        let vip = |line: &str| GOOD.replace("port = 80\n", &format!("port = 80\n{line}\n"));
        assert!(err(&GOOD.replace("10.77.0.100", "10.77.0.2")).contains("is the balancer's own address"));
        assert!(err(&GOOD.replace("10.77.0.21", "0.0.0.0")).contains("not a unicast address"));
        assert!(err(&GOOD.replace("10.77.0.21", "10.77.0.2")).contains("is the balancer itself"));
        assert!(err(&GOOD.replace("10.77.0.21", "10.77.0.100")).contains("is the VIP itself"));
        assert!(err(&GOOD.replace("10.77.0.100", "224.0.0.1")).contains("not a unicast address"));
        assert!(err(&vip("score_max_age_ms = 0")).contains("score_max_age_ms = 0 is out of range"));
        assert!(err(&vip("poll_port = 0")).contains("poll_port 0"));
        assert!(err(&vip("idle_timeout_s = 1")).contains("idle_timeout_s = 1 is out of range"));
        assert!(err(&vip("syn_timeout_ms = 0")).contains("syn_timeout_ms = 0 is out of range"));
        assert!(err(&vip("closing_timeout_ms = 99999999")).contains("closing_timeout_ms"));
        assert!(err(&GOOD.replace("[auth]\nmode = \"none\"\n", "")).contains("no auth key configured"));
        let table = GOOD.replace("address = \"10.77.0.2\"\n", "address = \"10.77.0.2\"\nflow_table_size = 10\n");
        assert!(err(&table).contains("flow_table_size = 10 is out of range"));
        assert!(LbConfig::parse(&vip("query_when_stale = true")).unwrap().vips[0].query_when_stale);
        let query = vip("query_when_stale = true").replace("dsr-dynamic", "dsr-query");
        assert!(err(&query).contains("query_when_stale is for mode dsr-dynamic") && err(&query).contains("asks before every connection already"));
        assert!(err(&vip("query_when_stale = true").replace("dsr-dynamic", "dsr-rr")).contains("mode dsr-rr takes no in-band scores"));
    }

    const DUAL: &str = r#"
interface = "eth0"
address = "10.77.0.2"
address6 = "fd00:77::2"
[auth]
mode = "none"
[[vip]]
address = "fd00:77::100"
port = 80
mode = "dsr-dynamic"
probe_interval = 10
probe_interval_max = 400
probe_budget = 50
[[vip.backend]]
address = "fd00:77::21"
port = 8080
[[vip]]
address = "10.77.0.100"
port = 443
protocol = "udp"
quic = true
mode = "dsr-dynamic"
[[vip.backend]]
address = "10.77.0.21"
port = 8443
quic_server_id = 1
[[vip.backend]]
address = "10.77.0.22"
port = 8443
quic_server_id = 2
"#;

    #[test]
    fn takes_ipv6_and_quic_vips_with_their_defaults() {
        let c = LbConfig::parse(DUAL).unwrap();
        assert_eq!(c.addresses().len(), 2);
        let (v6, quic) = (&c.vips[0], &c.vips[1]);
        assert_eq!(v6.name(), "[fd00:77::100]:80");
        assert_eq!((v6.probe_interval, v6.probe_interval_max(), v6.probe_budget), (10, 400, 50));
        assert_eq!(c.address_for(v6.address), Some("fd00:77::2".parse().unwrap()));
        assert_eq!(quic.name(), "10.77.0.100:443/udp");
        assert_eq!((quic.protocol, quic.quic, quic.idle_timeout_s()), (Protocol::Udp, true, 120));
        assert_eq!(quic.backends[1].quic_server_id, Some(2));
        // A TCP and a UDP VIP on one address and port are two VIPs.
        let both = DUAL.replace("port = 443\nprotocol = \"udp\"\nquic = true", "port = 80\nprotocol = \"udp\"");
        let both = both.replace("quic_server_id = 1\n", "").replace("quic_server_id = 2\n", "").replace("10.77.0.100", "fd00:77::100");
        let both = both.replace("10.77.0.21", "fd00:77::31").replace("10.77.0.22", "fd00:77::32");
        assert_eq!(LbConfig::parse(&both).unwrap().vips.len(), 2);
    }

    /// `vips` VIPs of `per_vip` backends each (distinct addresses), policy
    /// `policy`, backend 0 of each weighted `w0`.
    fn sized(vips: u32, per_vip: u32, policy: &str, w0: u32) -> String {
        let mut text = String::from("interface = \"eth0\"\naddress = \"10.77.0.2\"\n[auth]\nmode = \"none\"\n");
        let mut b = 0u32;
        for v in 0..vips {
            text += &format!("[[vip]]\naddress = \"10.78.{}.{}\"\nport = 80\nmode = \"dsr-rr\"\npolicy = \"{policy}\"\n", v / 256, v % 256);
            for j in 0..per_vip {
                let w = if j == 0 { w0 } else { 1 };
                text += &format!("[[vip.backend]]\naddress = \"10.{}.{}.{}\"\nport = 8080\nweight = {w}\n", 80 + b / 65536, (b / 256) % 256, b % 256);
                b += 1;
            }
        }
        text
    }

    #[test]
    fn takes_the_limits_and_refuses_beyond_each_naming_it() {
        assert_eq!((MAX_VIPS, MAX_BACKENDS_PER_VIP, MAX_BACKENDS), (1024, 4096, 16384));
        LbConfig::parse(&sized(MAX_VIPS, 1, "round-robin", 1)).unwrap();
        LbConfig::parse(&sized(4, MAX_BACKENDS_PER_VIP, "round-robin", 1)).unwrap();
        let e = err(&sized(MAX_VIPS + 1, 1, "round-robin", 1));
        assert!(e.contains("1025 VIPs configured, at most 1024"), "{e}");
        let e = err(&sized(1, MAX_BACKENDS_PER_VIP + 1, "round-robin", 1));
        assert!(e.contains("4097 backends, at most 4096 per VIP"), "{e}");
        let e = err(&sized(5, MAX_BACKENDS_PER_VIP, "round-robin", 1));
        assert!(e.contains("20480 backends in all, at most 16384"), "{e}");
        // Maglev tables: one per VIP that reads one, at most maglev_tables.
        LbConfig::parse(&sized(64, 1, "maglev", 1)).unwrap();
        let e = err(&sized(65, 1, "maglev", 1));
        assert!(e.contains("65 VIPs read a Maglev table") && e.contains("at most maglev_tables = 64"), "{e}");
        let more = sized(65, 1, "maglev", 1).replace("[auth]", "maglev_tables = 65\n[auth]");
        assert_eq!(LbConfig::parse(&more).unwrap().maglev_tables, 65);
        // Weighted round-robin reads one too; unweighted round-robin does not.
        let e = err(&sized(65, 2, "round-robin", 3));
        assert!(e.contains("at most maglev_tables = 64"), "{e}");
        let e = err(&GOOD.replace("[auth]", "maglev_tables = 1025\n[auth]"));
        assert!(e.contains("maglev_tables = 1025 is out of range: use 1..=1024"), "{e}");
    }

    #[test]
    fn takes_maglev_with_weights_and_a_prime_table() {
        let text = GOOD.replace("mode = \"dsr-dynamic\"", "mode = \"dsr-rr\"\npolicy = \"maglev\"").replace(
            "address = \"10.77.0.22\"\nport = 8080",
            "address = \"10.77.0.22\"\nport = 8080\nweight = 3",
        );
        let c = LbConfig::parse(&text).unwrap();
        assert_eq!(c.maglev_table_size, 65537);
        assert_eq!((c.vips[0].backends[0].weight, c.vips[0].backends[1].weight), (1, 3));
        // Maglev needs no scores: the round-robin modes keep it.
        assert_eq!(c.vips[0].effective_policy(), Policy::Maglev);
        let size = |n: &str| text.replace("address = \"10.77.0.2\"\n", &format!("address = \"10.77.0.2\"\nmaglev_table_size = {n}\n"));
        assert!(LbConfig::parse(&size("251")).is_ok());
        assert!(err(&size("65536")).contains("not a prime"), "{}", err(&size("65536")));
        assert!(err(&size("7")).contains("out of range"), "{}", err(&size("7")));
        assert!(err(&text.replace("weight = 3", "weight = 70000")).contains("weight = 70000 is above 65535"));
    }

    #[test]
    fn takes_scale_out_with_three_sids_and_an_ipv6_address() {
        let v6_only = DUAL.split("[[vip]]\naddress = \"10.77.0.100\"").next().unwrap().to_string();
        let so = |sids: &str| v6_only.replace("[auth]", &format!("[scale_out]\n{sids}\n[auth]"));
        let good = so("sid = \"fd00:51::b\"\ndirect_sid = \"fd00:51::d\"\nshadow_sid = \"fd00:5f::5\"");
        let c = LbConfig::parse(&good).unwrap();
        assert_eq!(c.scale_out.unwrap().shadow_sid, "fd00:5f::5".parse::<Ipv6Addr>().unwrap());
        let same = so("sid = \"fd00:51::b\"\ndirect_sid = \"fd00:51::b\"\nshadow_sid = \"fd00:5f::5\"");
        assert!(err(&same).contains("three different addresses"), "{}", err(&same));
        let missing = so("sid = \"fd00:51::b\"\nshadow_sid = \"fd00:5f::5\"");
        assert!(err(&missing).contains("missing field `direct_sid`"), "{}", err(&missing));
        let multicast = good.replace("fd00:5f::5", "ff02::5");
        assert!(err(&multicast).contains("ff02::5 is not a unicast address"), "{}", err(&multicast));
        // IPv4 VIPs too: they reach the instance as IPv4 in IPv6, and strays go back that way.
        let with_v4 = DUAL.replace("[auth]", "[scale_out]\nsid = \"fd00:51::b\"\ndirect_sid = \"fd00:51::d\"\nshadow_sid = \"fd00:5f::5\"\n[auth]");
        assert!(LbConfig::parse(&with_v4).is_ok(), "{}", err(&with_v4));
        let v4_without_address6 = with_v4.replace("address6 = \"fd00:77::2\"\n", "");
        assert!(err(&v4_without_address6).contains("[scale_out]: chained packets leave in IPv6"), "{}", err(&v4_without_address6));
    }

    #[test]
    fn fleet_tuples_need_a_96_of_their_own_and_a_key() {
        let sids = "sid = \"fd00:51::b\"\ndirect_sid = \"fd00:51::d\"\nshadow_sid = \"fd00:5f::5\"";
        let rr = DUAL.replacen("mode = \"dsr-dynamic\"", "mode = \"dsr-rr\"", 1);
        let so = |text: &str, extra: &str| text.replace("[auth]", &format!("[scale_out]\n{sids}\n{extra}\n[auth]"));
        let keyed = |prefix: &str| format!("fleet = true\nfleet_prefix = \"{prefix}\"\nfleet_key = \"/etc/inband/fleet.key\"");
        let good = LbConfig::parse(&so(&rr, &keyed("fd00:f1ee::/96"))).unwrap();
        let (prefix, key) = good.scale_out.as_ref().unwrap().fleet().unwrap();
        // Announcements: no peers and port 7155 unless told.
        let so_good = good.scale_out.as_ref().unwrap();
        assert_eq!((so_good.peers.len(), so_good.peer_port), (0, 7155));
        let peered = LbConfig::parse(&so(&rr, &format!("{}\npeers = [\"fd00:77::3\"]", keyed("fd00:f1ee::/96")))).unwrap();
        assert_eq!(peered.scale_out.unwrap().peers, ["fd00:77::3".parse::<Ipv6Addr>().unwrap()]);
        assert_eq!((prefix.to_string(), key), ("fd00:f1ee::/96".to_string(), Path::new("/etc/inband/fleet.key")));
        // Which VIPs take fleet tuples: the IPv6 TCP DSR one, not the IPv4 QUIC one.
        assert_eq!(good.vips.iter().map(VipConfig::fleet_tuples).collect::<Vec<_>>(), [true, false]);
        let cases = [
            (so(&rr, "fleet = true"), "needs fleet_prefix"),
            (so(&rr, "fleet_prefix = \"fd00:f1ee::/96\""), "only with fleet = true"),
            (so(&rr, &keyed("fd00:f1ee::/104")), "must be a /96"),
            (so(&rr, &keyed("fd00:f1ee::1/96")), "has host bits set"),
            (so(&rr, &keyed("fd00:77::/96")), "holds fd00:77::2"),
            (so(&rr, &keyed("fd00:51::/96")), "holds fd00:51::b"),
            (so(&DUAL.replace("fd00:77::21", "fd00:f1ee::21"), &keyed("fd00:f1ee::/96")), "holds backend"),
            (so(&rr, "peers = [\"fd00:77::3\"]"), "only with fleet = true"),
            (so(&rr, &format!("{}\npeers = [\"fd00:77::3\", \"fd00:77::2\"]", keyed("fd00:f1ee::/96"))), "this instance's own address6"),
            (so(&rr, &format!("{}\npeers = [\"fd00:77::3\"]\npeer_port = 0", keyed("fd00:f1ee::/96"))), "peer_port = 0"),
        ];
        for (text, want) in cases {
            assert!(err(&text).contains(want), "want {want:?}, got {}", err(&text));
        }
        // dsr-dynamic takes them too (its agents steer the 125s to the
        // instance that asked), and stays accepted with fleet off.
        let dynamic = LbConfig::parse(&so(DUAL, &keyed("fd00:f1ee::/96"))).unwrap();
        assert_eq!((dynamic.vips[0].mode, dynamic.vips[0].fleet_tuples()), (Mode::DsrDynamic, true));
        assert!(LbConfig::parse(&so(DUAL, "")).is_ok());
    }

    #[test]
    fn moves_listen_on_a_balancer_address_and_only_authenticated() {
        let signed = DUAL.replace("[auth]\nmode = \"none\"\n", "[auth]\nkeys = [{ id = 1, file = \"/etc/inband/auth-1.key\" }]\n");
        let moves = |text: &str, listen: &str| text.replace("[auth]", &format!("[moves]\nlisten = [\"{}\"]\n[auth]", listen.replace(',', "\", \"")));
        assert_eq!(LbConfig::parse(&signed).unwrap().moves, None, "absent: no worker");
        let v4 = LbConfig::parse(&moves(&signed, "10.77.0.2:7156")).unwrap();
        assert_eq!(v4.moves.unwrap().listen, vec!["10.77.0.2:7156".parse::<SocketAddr>().unwrap()]);
        assert!(LbConfig::parse(&moves(&signed, "[fd00:77::2]:7156")).is_ok());
        let both = LbConfig::parse(&moves(&signed, "10.77.0.2:7156,[fd00:77::2]:7156")).unwrap();
        assert_eq!(both.moves.unwrap().listen.len(), 2);
        let sids = "sid = \"fd00:51::b\"\ndirect_sid = \"fd00:51::d\"\nshadow_sid = \"fd00:5f::5\"";
        let fleet = format!("[scale_out]\n{sids}\nfleet = true\nfleet_prefix = \"fd00:f1ee::/96\"\nfleet_key = \"/k\"\n[auth]");
        let fleet = signed.replacen("mode = \"dsr-dynamic\"", "mode = \"dsr-rr\"", 1).replace("[auth]", &fleet);
        assert!(LbConfig::parse(&moves(&fleet, "[fd00:77::2]:7156")).is_ok(), "{}", err(&moves(&fleet, "[fd00:77::2]:7156")));
        let cases = [
            (moves(DUAL, "10.77.0.2:7156"), "only in the authenticated format"),
            (moves(&signed, "10.77.0.9:7156"), "not one of the balancer's addresses (10.77.0.2, fd00:77::2)"),
            (moves(&signed, "0.0.0.0:7156"), "not one of the balancer's addresses"),
            (moves(&signed, "10.77.0.2:0"), "name the UDP port"),
            (moves(&fleet, "[fd00:77::2]:7155"), "peer_port's address"),
            (moves(&signed, "10.77.0.2:7156,10.77.0.2:7157"), "names 10.77.0.2 twice"),
            (signed.replace("[auth]", "[moves]\nlisten = []\n[auth]"), "listen = []"),
            (signed.replace("[auth]", "[moves]\nlisten = [\"10.77.0.2:7156\"]\nport = 1\n[auth]"), "unknown field `port`"),
        ];
        for (text, want) in cases {
            assert!(err(&text).contains(want), "want {want:?}, got {}", err(&text));
        }
    }

    #[test]
    fn takes_ipip_for_ipv4_backends_only() {
        let c = LbConfig::parse(&DUAL.replace("quic_server_id = 2\n", "quic_server_id = 2\nencap = \"ipip\"\n")).unwrap();
        assert_eq!((c.vips[1].backends[0].encap, c.vips[1].backends[1].encap), (Encap::None, Encap::Ipip));
        let v6 = DUAL.replace("address = \"fd00:77::21\"\nport = 8080\n", "address = \"fd00:77::21\"\nport = 8080\nencap = \"ipip\"\n");
        assert!(err(&v6).contains("encap = \"ipip\" is for IPv4 backends"), "{}", err(&v6));
        let typo = DUAL.replace("quic_server_id = 2\n", "quic_server_id = 2\nencap = \"gre\"\n");
        assert!(err(&typo).contains("unknown variant `gre`"), "{}", err(&typo));
    }

    #[test]
    fn refuses_mixed_families_and_bad_quic_settings() {
        let no6 = DUAL.replace("address6 = \"fd00:77::2\"\n", "");
        assert!(err(&no6).contains("the balancer has no IPv6 address: set `address6`"), "{}", err(&no6));
        let none = DUAL.replace("address = \"10.77.0.2\"\naddress6 = \"fd00:77::2\"\n", "");
        assert!(err(&none).contains("no balancer address"));
        let mixed = DUAL.replace("fd00:77::21", "10.77.0.31");
        assert!(err(&mixed).contains("is of the other address family"), "{}", err(&mixed));
        assert!(err(&DUAL.replace("quic_server_id = 2", "quic_server_id = 1")).contains("quic_server_id 1 is given to two backends"));
        assert!(err(&DUAL.replace("quic_server_id = 2", "quic_server_id = 0")).contains("quic_server_id 0 is not an id"));
        assert!(err(&DUAL.replace("protocol = \"udp\"\n", "")).contains("quic = true needs protocol = \"udp\""));
        assert!(err(&DUAL.replace("quic = true\n", "")).contains("has a quic_server_id but the VIP is not quic = true"));
        assert!(err(&DUAL.replace("probe_interval_max = 400", "probe_interval_max = 5")).contains("probe_interval_max = 5 is below"));
        assert!(err(&DUAL.replace("fd00:77::21", "fe80::21")).contains("not a unicast address"));
        assert!(err(&DUAL.replace("fd00:77::21", "::ffff:10.77.0.21")).contains("not a unicast address"));
    }

    #[test]
    fn round_robin_modes_ignore_policy() {
        let c = LbConfig::parse(&GOOD.replace("dsr-dynamic", "dsr-rr")).unwrap();
        assert_eq!(c.vips[0].effective_policy(), Policy::RoundRobin);
    }

    #[test]
    fn least_connections_is_for_the_modes_without_scores() {
        for mode in ["dsr-rr", "passthrough"] {
            let text = GOOD.replace("mode = \"dsr-dynamic\"", &format!("mode = \"{mode}\"\npolicy = \"least-connections\""));
            let c = LbConfig::parse(&text).unwrap();
            assert_eq!(c.vips[0].effective_policy(), Policy::LeastConnections, "{mode}");
        }
        let err = LbConfig::parse(&GOOD.replace("mode = \"dsr-dynamic\"", "mode = \"dsr-dynamic\"\npolicy = \"least-connections\"")).unwrap_err();
        assert!(format!("{err:#}").contains("policy least-connections ranks by the balancer's own connection counts") && format!("{err:#}").contains("use least-score"), "{err:#}");
    }

    #[test]
    fn host_check_names_the_missing_interface() {
        let c = LbConfig::parse(&GOOD.replace("eth0", "nosuchif0")).unwrap();
        let e = format!("{:#}", c.check_host().unwrap_err());
        assert!(e.contains("interface \"nosuchif0\" does not exist"), "{e}");
    }
}

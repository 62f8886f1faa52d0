//! `lb.toml`: parsing and every check that must pass before the balancer
//! touches the kernel (see docs/configuration.md).

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::maps::{Mode, Policy, MAX_BACKENDS, MAX_BACKENDS_PER_VIP, MAX_VIPS};
use crate::auth::AuthConfig;

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
    pub address: Ipv4Addr,
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
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default, rename = "vip")]
    pub vips: Vec<VipConfig>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VipConfig {
    pub address: Ipv4Addr,
    pub port: u16,
    pub mode: Mode,
    #[serde(default = "default_policy")]
    pub policy: Policy,
    #[serde(default = "default_probe_interval")]
    pub probe_interval: u32,
    #[serde(default = "default_score_max_age_ms")]
    pub score_max_age_ms: u64,
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    #[serde(default = "default_poll_port")]
    pub poll_port: u16,
    /// A handshake the client does not complete in this time is forgotten.
    #[serde(default = "default_syn_timeout_ms")]
    pub syn_timeout_ms: u64,
    /// An established connection without a packet for this long is ended.
    #[serde(default = "default_idle_timeout_s")]
    pub idle_timeout_s: u64,
    /// After a FIN or RST, the flow and its port are kept this long.
    #[serde(default = "default_closing_timeout_ms")]
    pub closing_timeout_ms: u64,
    #[serde(default, rename = "backend")]
    pub backends: Vec<BackendConfig>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub address: Ipv4Addr,
    pub port: u16,
    #[serde(default)]
    pub drain: bool,
}

pub fn default_control_socket() -> PathBuf {
    PathBuf::from("/run/inband/lb.sock")
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
fn default_idle_timeout_s() -> u64 {
    900
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

/// An address that can be a unicast peer: not 0.0.0.0, broadcast,
/// multicast or loopback.
fn unicast(a: Ipv4Addr) -> bool {
    !(a.is_unspecified() || a.is_broadcast() || a.is_multicast() || a.is_loopback())
}

fn in_range<T: PartialOrd + std::fmt::Display>(what: &str, v: T, r: &std::ops::RangeInclusive<T>) -> Result<()> {
    if !r.contains(&v) {
        bail!("{what} = {v} is out of range: use {}..={}", r.start(), r.end());
    }
    Ok(())
}

impl VipConfig {
    pub fn endpoint(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.address, self.port)
    }

    /// The policy the data path runs: the round-robin modes ignore `policy`.
    pub fn effective_policy(&self) -> Policy {
        match self.mode {
            Mode::Passthrough | Mode::DsrRr => Policy::RoundRobin,
            Mode::DsrPolling | Mode::DsrDynamic => self.policy,
        }
    }

    /// Checks that need no kernel: limits and duplicates within the VIP.
    pub fn validate(&self) -> Result<()> {
        let ep = self.endpoint();
        if self.port == 0 {
            bail!("vip {ep}: port 0 is not a service port");
        }
        if !unicast(self.address) {
            bail!("vip {ep}: {} is not a unicast address clients can reach", self.address);
        }
        in_range(&format!("vip {ep}: score_max_age_ms"), self.score_max_age_ms, &SCORE_MAX_AGE_MS)?;
        in_range(&format!("vip {ep}: syn_timeout_ms"), self.syn_timeout_ms, &SYN_TIMEOUT_MS)?;
        in_range(&format!("vip {ep}: idle_timeout_s"), self.idle_timeout_s, &IDLE_TIMEOUT_S)?;
        in_range(&format!("vip {ep}: closing_timeout_ms"), self.closing_timeout_ms, &CLOSING_TIMEOUT_MS)?;
        if self.poll_port == 0 {
            bail!("vip {ep}: poll_port 0 is not a port the agents can answer on (their default is 9137)");
        }
        if self.mode == Mode::DsrDynamic && self.probe_interval == 0 {
            bail!("vip {ep}: mode dsr-dynamic needs probe_interval >= 1 (every n-th packet asks for the score)");
        }
        if self.mode == Mode::DsrPolling && self.poll_interval_ms == 0 {
            bail!("vip {ep}: mode dsr-polling needs poll_interval_ms >= 1");
        }
        if self.backends.len() > MAX_BACKENDS_PER_VIP as usize {
            bail!("vip {ep}: {} backends, at most {MAX_BACKENDS_PER_VIP} per VIP", self.backends.len());
        }
        let mut seen = HashSet::new();
        for b in &self.backends {
            let be = SocketAddrV4::new(b.address, b.port);
            if b.port == 0 {
                bail!("vip {ep}: backend {be} has port 0");
            }
            if !unicast(b.address) {
                bail!("vip {ep}: backend {be} is not a unicast address");
            }
            if b.address == self.address {
                bail!("vip {ep}: backend {be} is the VIP itself");
            }
            if !seen.insert(be) {
                bail!("vip {ep}: backend {be} is listed twice; remove the duplicate");
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
        if !unicast(self.address) {
            bail!("address {} is not a unicast address: set it to this host's address on {}", self.address, self.interface);
        }
        in_range("flow_table_size", self.flow_table_size, &FLOW_TABLE_SIZE)?;
        self.auth.validate(true).context("[auth]")?;
        let mut seen = HashSet::new();
        let mut backends = 0;
        for v in &self.vips {
            v.validate()?;
            if v.address == self.address {
                bail!(
                    "vip {} is the balancer's own address: backends answer that address, so give the VIP one of its own (e.g. on lo)",
                    v.endpoint()
                );
            }
            if let Some(b) = v.backends.iter().find(|b| b.address == self.address) {
                bail!("vip {}: backend {}:{} is the balancer itself", v.endpoint(), b.address, b.port);
            }
            if !seen.insert(v.endpoint()) {
                bail!("vip {} is listed twice", v.endpoint());
            }
            backends += v.backends.len();
        }
        if backends > MAX_BACKENDS as usize {
            bail!("{backends} backends in all, at most {MAX_BACKENDS}");
        }
        Ok(())
    }

    /// Checks against this host: run before anything is attached.
    pub fn check_host(&self) -> Result<()> {
        crate::netif::ifindex(&self.interface)?;
        let locals = crate::netif::local_ipv4()?;
        if !locals.iter().any(|(ifn, a)| *a == self.address && *ifn == self.interface) {
            bail!(
                "address {} is not configured on interface {}: set `address` to this host's address there (see `ip -4 addr show {}`)",
                self.address,
                self.interface,
                self.interface
            );
        }
        for v in &self.vips {
            if !locals.iter().any(|(_, a)| *a == v.address) {
                bail!(
                    "vip {} is not a local address of this host, so nobody answers ARP for it: add it, e.g. `ip addr add {}/32 dev lo`",
                    v.endpoint(),
                    v.address
                );
            }
        }
        crate::bpfmap::require_bpffs()
    }
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
    fn parses_defaults() {
        let c = LbConfig::parse(GOOD).unwrap();
        assert_eq!(c.vips[0].mode, Mode::DsrDynamic);
        assert_eq!(c.vips[0].policy, Policy::LeastScore);
        assert_eq!(c.vips[0].probe_interval, 100);
        assert_eq!(c.vips[0].poll_interval_ms, 1000);
        assert_eq!((c.vips[0].syn_timeout_ms, c.vips[0].idle_timeout_s, c.vips[0].closing_timeout_ms), (5_000, 900, 10_000));
        assert_eq!((c.flow_table_size, c.drain_timeout_ms), (262_144, 0));
        assert_eq!(c.vips[0].backends.len(), 2);
        assert_eq!(c.xdp_mode, XdpMode::Auto);
        assert_eq!(c.control_socket, PathBuf::from("/run/inband/lb.sock"));
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
    }

    #[test]
    fn round_robin_modes_ignore_policy() {
        let c = LbConfig::parse(&GOOD.replace("dsr-dynamic", "dsr-rr")).unwrap();
        assert_eq!(c.vips[0].effective_policy(), Policy::RoundRobin);
    }

    #[test]
    fn host_check_names_the_missing_interface() {
        let c = LbConfig::parse(&GOOD.replace("eth0", "nosuchif0")).unwrap();
        let e = format!("{:#}", c.check_host().unwrap_err());
        assert!(e.contains("interface \"nosuchif0\" does not exist"), "{e}");
    }
}

//! `weights.toml`: what the weights controller probes, how it learns and
//! where it writes the weights (docs/weights.md).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use inband_core::net::Protocol;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsConfig {
    /// The service URL's path, sent straight to every backend.
    #[serde(default = "default_probe_path")]
    pub probe_path: String,
    /// Latency probes per backend per second (the seed's 20).
    #[serde(default = "default_probe_rate")]
    pub probe_rate: u32,
    /// A probe without a complete response in this time counts as a drop.
    #[serde(default = "default_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
    /// One measurement round while learning: weights applied, then the
    /// latency of the round's second half is the point's latency.
    #[serde(default = "default_round_ms")]
    pub round_ms: u64,
    /// Learning stops after this many rounds even if some backend's
    /// search has not converged (it is then fitted on what it has).
    #[serde(default = "default_max_rounds")]
    pub max_rounds: u32,
    /// In steady state each backend's latency is the mean of this window,
    /// compared with its curve every `check_ms`.
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    #[serde(default = "default_check_ms")]
    pub check_ms: u64,
    /// A backend is off its curve when its latency differs from the curve
    /// by more than this fraction (the seed's 20%) in `confirm` checks in a row.
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
    #[serde(default = "default_confirm")]
    pub confirm: u32,
    /// Candidate weights per backend in each ILP step (the seed's 10).
    #[serde(default = "default_levels")]
    pub levels: u32,
    /// Optional spread bound θ: the largest weight minus the smallest.
    #[serde(default)]
    pub theta: Option<f64>,
    #[serde(default)]
    pub objective: Objective,
    /// What a balancer that ranks backends by load (inband least-score or
    /// power-of-two in a scored mode) is given as weights.
    #[serde(default)]
    pub load_aware: LoadAware,
    /// The seed's α: how fast a backend's weight grows while it has room.
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// Where the controller's state (weights, curves, decisions) is written.
    #[serde(default = "default_status_file")]
    pub status_file: PathBuf,
    pub target: Target,
    #[serde(rename = "backend")]
    pub backends: Vec<BackendConfig>,
}

/// What the ILP minimises over the candidate weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Σ w·latency(w): the mean latency of a request.
    #[default]
    Mean,
    /// Σ latency(w): the seed's objective, every backend counted alike.
    Sum,
}

/// The ILP answers which *fixed* split of the traffic has the least mean
/// latency. A balancer that ranks backends by their load, as (estimate +
/// 1) / weight, does not split by fixed shares: it needs each backend's
/// capacity to compare loads with, and the learned w_max (the share at
/// which a backend reaches its knee) is that capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadAware {
    /// Capacities for an inband VIP that ranks by score, the ILP's weights
    /// otherwise (HAProxy included).
    #[default]
    Auto,
    Capacity,
    Ilp,
}

/// The balancer the weights are written to.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Target {
    /// `inband lb`'s control socket (`set-weights` on one VIP).
    Inband {
        #[serde(default = "inband_core::lb_control::default_control_socket")]
        socket: PathBuf,
        vip: SocketAddr,
        #[serde(default)]
        protocol: Protocol,
    },
    /// HAProxy's runtime API (`set weight BACKEND/SERVER N`) on its admin
    /// stats socket.
    Haproxy { socket: PathBuf, backend: String },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub address: SocketAddr,
    /// Its server name in HAProxy's backend section.
    #[serde(default)]
    pub name: Option<String>,
}

impl BackendConfig {
    pub fn label(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.address.to_string())
    }
}

fn default_probe_path() -> String {
    "/".into()
}
fn default_probe_rate() -> u32 {
    20
}
fn default_probe_timeout_ms() -> u64 {
    2_000
}
fn default_round_ms() -> u64 {
    2_000
}
fn default_max_rounds() -> u32 {
    16
}
fn default_window_ms() -> u64 {
    5_000
}
fn default_check_ms() -> u64 {
    1_000
}
fn default_tolerance() -> f64 {
    0.2
}
fn default_confirm() -> u32 {
    3
}
fn default_levels() -> u32 {
    10
}
fn default_alpha() -> f64 {
    1.0
}
fn default_status_file() -> PathBuf {
    PathBuf::from("/run/inband/weights.json")
}

impl WeightsConfig {
    pub fn load(path: &Path) -> Result<WeightsConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<WeightsConfig> {
        let cfg: WeightsConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        if self.backends.is_empty() {
            bail!("no [[backend]]: list the backends whose weights this controller sets");
        }
        let mut seen = HashSet::new();
        for b in &self.backends {
            if !seen.insert(b.address) {
                bail!("backend {} is listed twice", b.address);
            }
        }
        if !self.probe_path.starts_with('/') || self.probe_path.bytes().any(|c| c <= b' ' || c == 0x7f) {
            bail!("probe_path = {:?}: expected an absolute path without spaces or control characters, e.g. \"/\"", self.probe_path);
        }
        if !(1..=1000).contains(&self.probe_rate) {
            bail!("probe_rate = {}: expected 1-1000 probes per backend per second", self.probe_rate);
        }
        for (name, v, lo, hi) in [
            ("probe_timeout_ms", self.probe_timeout_ms, 10, 60_000),
            ("round_ms", self.round_ms, 200, 600_000),
            ("window_ms", self.window_ms, 200, 600_000),
            ("check_ms", self.check_ms, 100, 600_000),
        ] {
            if !(lo..=hi).contains(&v) {
                bail!("{name} = {v}: expected {lo}-{hi}");
            }
        }
        // At least two probes per half round, or a round measures nothing.
        if u64::from(self.probe_rate) * self.round_ms < 4_000 {
            bail!("round_ms = {} at probe_rate = {}: a round needs at least 4 probes; raise either", self.round_ms, self.probe_rate);
        }
        if !(1..=1000).contains(&self.max_rounds) {
            bail!("max_rounds = {}: expected 1-1000", self.max_rounds);
        }
        if !(0.01..=10.0).contains(&self.tolerance) {
            bail!("tolerance = {}: expected 0.01-10 (a fraction: 0.2 is 20%)", self.tolerance);
        }
        if !(1..=100).contains(&self.confirm) {
            bail!("confirm = {}: expected 1-100 checks", self.confirm);
        }
        if !(2..=100).contains(&self.levels) {
            bail!("levels = {}: expected 2-100 candidate weights per step", self.levels);
        }
        if !(self.alpha > 0.0 && self.alpha <= 10.0) {
            bail!("alpha = {}: expected a number in (0, 10]", self.alpha);
        }
        if let Some(t) = self.theta {
            if !(t > 0.0 && t <= 1.0) {
                bail!("theta = {t}: expected a spread in (0, 1]");
            }
        }
        if let Target::Haproxy { backend, .. } = &self.target {
            if backend.is_empty() || backend.contains(['/', ' ']) {
                bail!("target.backend = {backend:?}: expected HAProxy's backend section name");
            }
            for b in &self.backends {
                match &b.name {
                    Some(n) if !n.is_empty() && !n.contains(['/', ' ']) => {}
                    _ => bail!("backend {}: HAProxy targets need its server `name` (as in haproxy.cfg)", b.address),
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[target]
kind = "inband"
vip = "10.0.0.100:80"
[[backend]]
address = "10.0.1.2:8080"
[[backend]]
address = "10.0.1.3:8080"
"#;

    fn err(text: &str) -> String {
        format!("{:#}", WeightsConfig::parse(text).unwrap_err())
    }

    #[test]
    fn takes_a_minimal_config_with_the_seeds_defaults() {
        let c = WeightsConfig::parse(GOOD).unwrap();
        assert_eq!((c.probe_rate, c.levels, c.tolerance, c.alpha), (20, 10, 0.2, 1.0));
        assert_eq!(c.objective, Objective::Mean);
        assert_eq!(c.load_aware, LoadAware::Auto);
        assert_eq!(WeightsConfig::parse(&format!("load_aware = \"ilp\"\n{GOOD}")).unwrap().load_aware, LoadAware::Ilp);
        assert!(matches!(c.target, Target::Inband { protocol: Protocol::Tcp, .. }));
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        assert!(err(&GOOD.replace("[[backend]]\naddress = \"10.0.1.3:8080\"", "[[backend]]\naddress = \"10.0.1.2:8080\"")).contains("listed twice"));
        assert!(err(&format!("probe_rate = 0\n{GOOD}")).contains("probe_rate = 0"));
        assert!(err(&format!("probe_path = \"a b\"\n{GOOD}")).contains("probe_path"));
        assert!(err(&format!("theta = 2.0\n{GOOD}")).contains("theta = 2"));
        assert!(err(&format!("round_ms = 200\nprobe_rate = 5\n{GOOD}")).contains("at least 4 probes"));
        assert!(err(&format!("colour = 1\n{GOOD}")).contains("unknown field"));
        let haproxy = GOOD.replace("kind = \"inband\"\nvip = \"10.0.0.100:80\"", "kind = \"haproxy\"\nsocket = \"/run/h.sock\"\nbackend = \"servers\"");
        assert!(err(&haproxy).contains("server `name`"));
        let named = haproxy.replace("8080\"\n", "8080\"\nname = \"s\"\n").replacen("name = \"s\"", "name = \"s1\"", 1);
        assert!(WeightsConfig::parse(&named).is_ok());
    }
}

//! The controller's state as others read it: a JSON file rewritten
//! atomically after every change (`inband weights status`, `inband status`
//! and the benchmark read it), and its rendering as a table.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::learn::Point;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Learning,
    Steady,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendState {
    Learning,
    Ready,
    Failed,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ControllerStatus {
    pub phase: Phase,
    pub target: String,
    pub last_solve: Option<SolveRecord>,
    pub backends: Vec<BackendStatus>,
    /// The latest decisions, oldest first (at most `DECISIONS_KEPT`).
    pub decisions: Vec<Decision>,
}

pub const DECISIONS_KEPT: usize = 100;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SolveRecord {
    pub unix_ms: u64,
    pub reason: String,
    pub solve_ms: f64,
    pub steps: u32,
    pub objective_ms: f64,
    pub fallback: Option<String>,
    /// "ilp": the program's weights; "capacity": the learned capacities
    /// (w_max), for a balancer that ranks by load (`load_aware`).
    pub weights_from: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendStatus {
    pub address: String,
    pub name: Option<String>,
    pub state: BackendState,
    /// The weight asked of the balancer (weights sum to 1).
    pub weight: f64,
    /// The integer written to the balancer.
    pub applied: u32,
    pub l0_ms: Option<f64>,
    pub w_max: Option<f64>,
    /// latency_ms = c0 + c1·w + c2·w², forced monotone.
    pub curve: Option<[f64; 3]>,
    pub points: Vec<Point>,
    /// Its latest measured mean probe latency.
    pub latency_ms: Option<f64>,
    /// The share of new connections it was given then (an inband
    /// balancer's counters; the weight where they cannot be read).
    pub share: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Decision {
    pub unix_ms: u64,
    pub what: String,
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Written to a temporary file and renamed over, so a reader never sees
/// half a file.
pub fn write(path: &Path, status: &ControllerStatus) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(status)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

pub fn read(path: &Path) -> Result<ControllerStatus> {
    let text = std::fs::read(path).with_context(|| {
        format!("reading {} (is `inband weights` running with this status_file?)", path.display())
    })?;
    serde_json::from_slice(&text).with_context(|| format!("{} is not a weights controller's status", path.display()))
}

pub fn render(s: &ControllerStatus) -> String {
    let mut out = format!("weights controller for {}: {}\n", s.target, match s.phase {
        Phase::Learning => "learning",
        Phase::Steady => "steady",
    });
    match &s.last_solve {
        Some(r) => {
            let ago = unix_ms().saturating_sub(r.unix_ms) as f64 / 1e3;
            out += &format!(
                "  last solve {ago:.1} s ago ({}), {:.1} ms, {} step(s); weights from {}\n",
                r.reason, r.solve_ms, r.steps, r.weights_from
            );
            if let Some(f) = &r.fallback {
                out += &format!("  fallback: {f}\n");
            }
        }
        None => out += "  not solved yet\n",
    }
    out += &format!(
        "  {:<24} {:<9} {:>7} {:>7} {:>7} {:>8} {:>7} {:>10}  curve (ms = c0 + c1·w + c2·w²)\n",
        "backend", "state", "weight", "applied", "share", "l0 ms", "w_max", "latency ms"
    );
    for b in &s.backends {
        let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        out += &format!(
            "  {:<24} {:<9} {:>7.4} {:>7} {:>7} {:>8} {:>7} {:>10}  {}\n",
            b.name.clone().unwrap_or_else(|| b.address.clone()),
            format!("{:?}", b.state).to_lowercase(),
            b.weight,
            b.applied,
            opt(b.share, 4),
            opt(b.l0_ms, 2),
            opt(b.w_max, 3),
            opt(b.latency_ms, 2),
            b.curve.map_or("-".into(), |c| format!("{:.2} + {:.2}·w + {:.2}·w²", c[0], c[1], c[2])),
        );
    }
    if let Some(d) = s.decisions.last() {
        out += &format!("  latest decision: {}\n", d.what);
    }
    out
}

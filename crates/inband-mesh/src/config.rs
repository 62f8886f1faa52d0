//! `inband mesh` configuration (docs/mesh.md, "Configuration"): which
//! cgroup's connections are balanced, the services they may call, and each
//! service's routes, clusters and backends. Checked in full before anything
//! is loaded, so a mistake is one clear error, not a half-built data path.

use std::collections::BTreeMap;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use inband_health::HttpCheckConfig;
use serde::Deserialize;

use inband_core::shared as c;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The cgroup (v2) of the client applications, e.g.
    /// /sys/fs/cgroup/unified/app. Their connects to a service address are
    /// balanced; nothing else on the host is touched.
    pub cgroup: PathBuf,
    /// The daemon's anchor listener, where connections to a service are
    /// sent and where whatever the kernel path does not handle arrives.
    #[serde(default = "default_anchor")]
    pub anchor: SocketAddrV4,
    /// Pre-connected sockets per backend at start: at most this many
    /// requests are in flight to one backend through the kernel path.
    #[serde(default = "default_pool")]
    pub pool: u32,
    /// What a backend's pool may grow to when all its sockets are busy.
    /// Default: 4 × pool, within 256 and the 16,384 sockets of all
    /// backends.
    pub pool_max: Option<u32>,
    /// Prometheus metrics and the status JSON (`/metrics`, `/status`).
    pub metrics: Option<std::net::SocketAddr>,
    /// The kernel counts the mesh programs' runs and run time while the
    /// daemon runs (two clock reads per run), for `/metrics` and `/status`.
    #[serde(default)]
    pub bpf_stats: bool,
    /// Active HTTP health checks of every backend, beside the pools' own
    /// connect and TCP-state checks; none when absent.
    /// The same `[health]` table as `inband proxy`'s (docs/configuration.md).
    pub health: Option<HttpCheckConfig>,
    /// Names the pin directory (several daemons on one host need distinct names).
    #[serde(default = "default_name")]
    pub name: String,
    #[serde(rename = "service", default)]
    pub services: Vec<Service>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    pub name: String,
    pub address: SocketAddrV4,
    /// The policy of routes that do not name one.
    #[serde(default)]
    pub policy: Policy,
    /// Shorthand for the cluster named "default".
    #[serde(default)]
    pub backends: Vec<SocketAddrV4>,
    #[serde(default)]
    pub clusters: BTreeMap<String, Vec<SocketAddrV4>>,
    /// Tried in order; the first whose prefix and header match takes the
    /// request. None: one route "/" to the cluster "default".
    #[serde(rename = "route", default)]
    pub routes: Vec<Route>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    #[serde(default = "default_prefix")]
    pub path_prefix: String,
    pub header: Option<HeaderMatch>,
    /// Cluster name -> weight (canary: `{ stable = 95, canary = 5 }`).
    /// None: the cluster "default" alone.
    #[serde(default)]
    pub clusters: BTreeMap<String, u32>,
    pub policy: Option<Policy>,
    /// A request not answered in this time gets a 504 (or, if part of the
    /// response was sent, a reset connection). 0: no limit.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    pub name: String,
    pub value: String,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    #[default]
    RoundRobin,
    Random,
    LeastRequest,
}

impl Policy {
    pub fn as_c(self) -> u32 {
        match self {
            Policy::RoundRobin => c::INBAND_MESH_ROUND_ROBIN,
            Policy::Random => c::INBAND_MESH_RANDOM,
            Policy::LeastRequest => c::INBAND_MESH_LEAST_REQUEST,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::LeastRequest => "least-request",
        }
    }
}

fn default_anchor() -> SocketAddrV4 {
    "127.0.0.1:15001".parse().unwrap()
}
fn default_pool() -> u32 {
    16
}
fn default_name() -> String {
    "default".into()
}
fn default_prefix() -> String {
    "/".into()
}
fn default_timeout() -> u32 {
    15_000
}

pub const DEFAULT_CLUSTER: &str = "default";

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Config::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Config> {
        let cfg: Config = toml::from_str(text)?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<()> {
        if self.pool == 0 || self.pool > c::INBAND_MESH_MAX_POOL {
            bail!(
                "pool = {}: must be 1..={}",
                self.pool,
                c::INBAND_MESH_MAX_POOL
            );
        }
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
        {
            bail!("name = {:?}: letters, digits, '-' and '_' only (it names a directory under /sys/fs/bpf)", self.name);
        }
        if let Some(h) = &self.health {
            if !h.path.starts_with('/') || h.path.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                bail!("health.path = {:?}: a path starting with '/', without spaces or control characters", h.path);
            }
            if h.interval_ms < 100 || h.timeout_ms == 0 || h.timeout_ms > h.interval_ms {
                bail!("health: interval_ms >= 100 and 0 < timeout_ms <= interval_ms");
            }
            if h.unhealthy_after == 0 || h.healthy_after == 0 {
                bail!("health: unhealthy_after and healthy_after must be at least 1");
            }
        }
        if self.anchor.port() == 0 {
            bail!("anchor = {}: needs a port", self.anchor);
        }
        if self.services.len() > c::INBAND_MESH_MAX_SERVICES as usize {
            bail!(
                "{} services: at most {}",
                self.services.len(),
                c::INBAND_MESH_MAX_SERVICES
            );
        }
        let mut seen = std::collections::HashSet::new();
        for s in &self.services {
            if !seen.insert(s.address) {
                bail!("service address {} appears twice", s.address);
            }
            if s.address == self.anchor {
                bail!("service {}: its address is the anchor's", s.name);
            }
            s.check().with_context(|| format!("service {:?}", s.name))?;
        }
        let n = self.backends().len();
        let max = self.pool_max();
        if max < self.pool || max > c::INBAND_MESH_MAX_POOL {
            bail!(
                "pool_max = {max}: must be pool ({})..={}",
                self.pool,
                c::INBAND_MESH_MAX_POOL
            );
        }
        if n > c::INBAND_MESH_MAX_BACKENDS as usize
            || n * max as usize > c::INBAND_MESH_MAX_SLOTS as usize
        {
            bail!(
                "{n} distinct backends with pool_max = {max}: at most {} backends and {} sockets in all",
                c::INBAND_MESH_MAX_BACKENDS,
                c::INBAND_MESH_MAX_SLOTS
            );
        }
        Ok(())
    }

    /// The most sockets a backend's pool may have; each backend's slots are
    /// [i × pool_max, (i + 1) × pool_max).
    pub fn pool_max(&self) -> u32 {
        self.pool_max.unwrap_or_else(|| {
            let share = c::INBAND_MESH_MAX_SLOTS / (self.backends().len() as u32).max(1);
            (self.pool * 4)
                .min(c::INBAND_MESH_MAX_POOL)
                .min(share)
                .max(self.pool)
        })
    }

    /// Every distinct backend address, in first-seen order: its index is its
    /// entry in mesh_backends.
    pub fn backends(&self) -> Vec<SocketAddrV4> {
        let mut out: Vec<SocketAddrV4> = Vec::new();
        for s in &self.services {
            for (_, list) in s.all_clusters() {
                for b in list {
                    if !out.contains(b) {
                        out.push(*b);
                    }
                }
            }
        }
        out
    }
}

impl Service {
    /// Named clusters plus the `backends` shorthand as "default".
    pub fn all_clusters(&self) -> Vec<(&str, &Vec<SocketAddrV4>)> {
        let mut out: Vec<(&str, &Vec<SocketAddrV4>)> = Vec::new();
        if !self.backends.is_empty() {
            out.push((DEFAULT_CLUSTER, &self.backends));
        }
        for (name, list) in &self.clusters {
            out.push((name.as_str(), list));
        }
        out
    }

    pub fn cluster(&self, name: &str) -> Option<&Vec<SocketAddrV4>> {
        self.all_clusters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, l)| l)
    }

    /// The routes as configured, or the one implicit route.
    pub fn effective_routes(&self) -> Vec<Route> {
        if !self.routes.is_empty() {
            return self
                .routes
                .iter()
                .map(|r| Route {
                    path_prefix: r.path_prefix.clone(),
                    header: r.header.as_ref().map(|h| HeaderMatch {
                        name: h.name.clone(),
                        value: h.value.clone(),
                    }),
                    clusters: r.weights(),
                    policy: Some(r.policy.unwrap_or(self.policy)),
                    timeout_ms: r.timeout_ms,
                })
                .collect();
        }
        vec![Route {
            path_prefix: "/".into(),
            header: None,
            clusters: BTreeMap::from([(DEFAULT_CLUSTER.to_string(), 1)]),
            policy: Some(self.policy),
            timeout_ms: default_timeout(),
        }]
    }

    fn check(&self) -> Result<()> {
        if self.name.is_empty() {
            bail!("needs a name");
        }
        if self.address.port() == 0 {
            bail!("address {}: needs a port", self.address);
        }
        if self.backends.is_empty() && self.clusters.is_empty() {
            bail!("no backends: give `backends = [...]` or `[service.clusters]`");
        }
        if self.clusters.contains_key(DEFAULT_CLUSTER) && !self.backends.is_empty() {
            bail!("both `backends` and a cluster named \"default\": use one");
        }
        for (name, list) in self.all_clusters() {
            if list.is_empty() || list.len() > c::INBAND_MESH_MAX_CLUSTER as usize {
                bail!(
                    "cluster {name:?}: 1..={} backends",
                    c::INBAND_MESH_MAX_CLUSTER
                );
            }
        }
        let routes = self.effective_routes();
        if routes.len() > c::INBAND_MESH_MAX_ROUTES as usize {
            bail!(
                "{} routes: at most {}",
                routes.len(),
                c::INBAND_MESH_MAX_ROUTES
            );
        }
        for (i, r) in routes.iter().enumerate() {
            r.check(self)
                .with_context(|| format!("route {} (path_prefix {:?})", i + 1, r.path_prefix))?;
        }
        Ok(())
    }
}

impl Route {
    fn weights(&self) -> BTreeMap<String, u32> {
        if self.clusters.is_empty() {
            BTreeMap::from([(DEFAULT_CLUSTER.to_string(), 1)])
        } else {
            self.clusters.clone()
        }
    }

    fn check(&self, svc: &Service) -> Result<()> {
        if !self.path_prefix.starts_with('/') && !self.path_prefix.is_empty() {
            bail!("path_prefix must start with '/'");
        }
        if self.path_prefix.len() > c::INBAND_MESH_PREFIX_MAX as usize {
            bail!(
                "path_prefix longer than {} bytes",
                c::INBAND_MESH_PREFIX_MAX
            );
        }
        if let Some(h) = &self.header {
            if h.name.is_empty()
                || h.name.len() > c::INBAND_MESH_HNAME_MAX as usize
                || !h
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
            {
                bail!(
                    "header name {:?}: a token of 1..={} bytes",
                    h.name,
                    c::INBAND_MESH_HNAME_MAX
                );
            }
            if h.value.len() > c::INBAND_MESH_HVALUE_MAX as usize || h.value.trim() != h.value {
                bail!(
                    "header value {:?}: at most {} bytes, no leading or trailing white space",
                    h.value,
                    c::INBAND_MESH_HVALUE_MAX
                );
            }
        }
        let weights = self.weights();
        if weights.len() > c::INBAND_MESH_MAX_SPLITS as usize {
            bail!(
                "{} clusters: at most {} per route",
                weights.len(),
                c::INBAND_MESH_MAX_SPLITS
            );
        }
        if weights.values().all(|w| *w == 0) {
            bail!("every cluster weight is 0");
        }
        for name in weights.keys() {
            if svc.cluster(name).is_none() {
                bail!("no cluster named {name:?} in this service");
            }
        }
        Ok(())
    }
}

/// FNV-1a 64, as bpf/mesh.bpf.c hashes header names (case-folded with
/// `| 0x20`, as the program folds them) and values.
pub fn fnv(bytes: &[u8], fold: bool) -> u64 {
    let mut x = c::INBAND_MESH_FNV_OFFSET as u64;
    for b in bytes {
        let b = if fold { b | 0x20 } else { *b };
        x = (x ^ b as u64).wrapping_mul(c::INBAND_MESH_FNV_PRIME as u64);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "cgroup = \"/sys/fs/cgroup/unified/app\"\n";

    #[test]
    fn a_service_with_only_backends_gets_one_route_to_them() {
        let cfg = Config::parse(&format!(
            "{BASE}[[service]]\nname = \"web\"\naddress = \"10.96.0.1:80\"\nbackends = [\"10.0.0.2:8080\", \"10.0.0.3:8080\"]\n"
        ))
        .unwrap();
        let routes = cfg.services[0].effective_routes();
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[0].path_prefix, "/");
        assert_eq!(
            routes[0].clusters,
            BTreeMap::from([("default".to_string(), 1)])
        );
        assert_eq!(cfg.backends().len(), 2);
        assert_eq!(cfg.anchor, "127.0.0.1:15001".parse().unwrap());
    }

    #[test]
    fn mistakes_are_named() {
        let svc = "[[service]]\nname = \"web\"\naddress = \"10.96.0.1:80\"\n";
        for (extra, needle) in [
            ("", "no backends"),
            ("backends = [\"10.0.0.2:80\"]\n[[service.route]]\nclusters = { canary = 1 }\n", "no cluster named \"canary\""),
            ("backends = [\"10.0.0.2:80\"]\n[[service.route]]\npath_prefix = \"api\"\n", "must start with '/'"),
            (
                "backends = [\"10.0.0.2:80\"]\n[[service.route]]\nheader = { name = \"x y\", value = \"1\" }\n",
                "a token",
            ),
            ("backends = [\"10.0.0.2:80\"]\npolicy = \"fastest\"\n", "unknown variant"),
            ("backends = [\"10.0.0.2:80\"]\nbackend = []\n", "unknown field"),
        ] {
            let err = format!("{:#}", Config::parse(&format!("{BASE}{svc}{extra}")).unwrap_err());
            assert!(err.contains(needle), "{extra:?}: {err}");
        }
        let err = format!(
            "{:#}",
            Config::parse(&format!("{BASE}pool = 0\n")).unwrap_err()
        );
        assert!(err.contains("pool = 0"), "{err}");
    }

    #[test]
    fn health_checks_are_checked() {
        let svc =
            "[[service]]\nname = \"w\"\naddress = \"10.96.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n";
        let cfg = Config::parse(&format!("{BASE}[health]\npath = \"/healthz\"\n{svc}")).unwrap();
        let h = cfg.health.unwrap();
        assert_eq!((h.path.as_str(), h.interval_ms, h.timeout_ms), ("/healthz", 2000, 1000));
        assert_eq!((h.unhealthy_after, h.healthy_after), (3, 2));
        for (h, needle) in [
            ("path = \"healthz\"", "health.path"),
            ("path = \"/\"\ninterval_ms = 10", "interval_ms >= 100"),
            ("path = \"/\"\nunhealthy_after = 0", "at least 1"),
        ] {
            let err = format!(
                "{:#}",
                Config::parse(&format!("{BASE}[health]\n{h}\n{svc}")).unwrap_err()
            );
            assert!(err.contains(needle), "{h}: {err}");
        }
    }

    #[test]
    fn pool_max_defaults_to_four_pools_within_the_bounds() {
        let svc =
            "[[service]]\nname = \"w\"\naddress = \"10.96.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n";
        assert_eq!(
            Config::parse(&format!("{BASE}pool = 16\n{svc}"))
                .unwrap()
                .pool_max(),
            64
        );
        assert_eq!(
            Config::parse(&format!("{BASE}pool = 100\n{svc}"))
                .unwrap()
                .pool_max(),
            256
        );
        assert_eq!(
            Config::parse(&format!("{BASE}pool = 8\npool_max = 8\n{svc}"))
                .unwrap()
                .pool_max(),
            8
        );
        let err = format!(
            "{:#}",
            Config::parse(&format!("{BASE}pool = 8\npool_max = 4\n{svc}")).unwrap_err()
        );
        assert!(
            err.contains("pool_max = 4: must be pool (8)..=256"),
            "{err}"
        );
    }

    #[test]
    fn a_backend_in_two_services_has_one_pool() {
        let cfg = Config::parse(&format!(
            "{BASE}[[service]]\nname = \"a\"\naddress = \"10.96.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n\
             [[service]]\nname = \"b\"\naddress = \"10.96.0.2:80\"\nbackends = [\"10.0.0.2:80\", \"10.0.0.3:80\"]\n"
        ))
        .unwrap();
        assert_eq!(
            cfg.backends(),
            vec![
                "10.0.0.2:80".parse().unwrap(),
                "10.0.0.3:80".parse::<SocketAddrV4>().unwrap()
            ]
        );
    }

    #[test]
    fn fnv_folds_names_like_the_program() {
        assert_eq!(fnv(b"X-Canary", true), fnv(b"x-canary", true));
        assert_ne!(fnv(b"X-Canary", false), fnv(b"x-canary", false));
        assert_eq!(fnv(b"", false), c::INBAND_MESH_FNV_OFFSET as u64);
    }
}

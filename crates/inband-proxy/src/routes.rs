//! `[[route]]`: several backend pools, each chosen by the request's host
//! and path, with its own balancing, health checks, cache use, header
//! rewrites and rate limit. The top-level `backends` are the default
//! route, taken when no route matches. The rules, and why, are in
//! docs/proxy.md "Routes".

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderValue;
use inband_health::HttpCheckConfig;
use prometheus_client::metrics::counter::Counter;

use crate::backend::{Backend, HedgeBudget};
use crate::client_limits::ClientLimits;
use crate::config::{HashKey, HostPattern, Rewrite, RouteSpec, DEFAULT_ROUTE};
use crate::uri_path::normalize_path;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::upstream::Transport;

/// The request's host as routes compare it: the Host header without its
/// port, lowercased, without a trailing dot. None when it is not a name
/// or IP literal (no `hosts` entry can match it then).
pub fn request_host(h: &HeaderValue) -> Option<Cow<'_, str>> {
    let s = h.to_str().ok()?;
    let host = if s.starts_with('[') {
        &s[..s.find(']')? + 1]
    } else {
        match s.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => s,
        }
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || host.starts_with('.') || host.contains("..") || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b)) {
        return None;
    }
    Some(if host.bytes().any(|b| b.is_ascii_uppercase()) { Cow::Owned(host.to_ascii_lowercase()) } else { Cow::Borrowed(host) })
}

/// Whether `prefix` covers `path`: whole segments, so `/api` takes `/api`
/// and `/api/x` but not `/apix`; a prefix ending in `/` takes what starts
/// with it.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    path.starts_with(prefix) && (prefix.ends_with('/') || path.len() == prefix.len() || path.as_bytes()[prefix.len()] == b'/')
}

/// A backend pool with its balancing.
pub struct BackendPool {
    pub backends: Vec<Arc<Backend>>,
    pub addrs: Vec<SocketAddr>,
    pub policy: Policy,
    pub hash_key: HashKey,
    pub health: Option<HttpCheckConfig>,
    /// How the backends are spoken to, and each worker's connections.
    pub transport: Arc<Transport>,
    pub hedges: HedgeBudget,
}

/// A route as it runs.
pub struct Route {
    pub name: String,
    hosts: Vec<HostPattern>,
    path_prefix: String,
    pub pool: BackendPool,
    pub cache: bool,
    /// Below the store's own bound.
    pub max_object_bytes: Option<u64>,
    pub request_headers: Rewrite,
    pub response_headers: Rewrite,
    /// Has a non-empty rewrite, so the response path skips an empty one.
    pub rewrites_responses: bool,
    pub limits: Option<Arc<ClientLimits>>,
    requests: Counter,
}

impl Route {
    fn new(spec: &RouteSpec, metrics: &Metrics, label: Option<&str>, connect_timeout: Duration, busy_margin: u32) -> anyhow::Result<Route> {
        let at = label.map(|l| format!("route {l:?}: ")).unwrap_or_default();
        let transport = Arc::new(Transport::new(spec.protocol, spec.backend_tls.as_ref(), connect_timeout).map_err(|e| anyhow::anyhow!("{at}{e:#}"))?);
        let backends: Vec<Arc<Backend>> = spec.backends.iter().map(|&a| Arc::new(Backend::new(a, label))).collect();
        for b in &backends {
            metrics.add_backend(b);
        }
        let limits = spec.rate_limit.map(|(rate, burst)| Arc::new(ClientLimits::new(0, rate, burst, metrics.clients_untracked.clone())));
        Ok(Route {
            name: spec.name.clone(),
            hosts: spec.hosts.clone(),
            path_prefix: spec.path_prefix.clone(),
            pool: BackendPool { backends, addrs: spec.backends.clone(), policy: Policy::new(spec.policy, busy_margin), hash_key: spec.hash_key.clone(), health: spec.health.clone(), transport, hedges: HedgeBudget::new() },
            cache: spec.cache,
            max_object_bytes: spec.max_object_bytes,
            rewrites_responses: !spec.response_headers.is_empty(),
            request_headers: spec.request_headers.clone(),
            response_headers: spec.response_headers.clone(),
            limits,
            requests: metrics.route_requests(&spec.name),
        })
    }

    /// Takes one of the client's requests from the route's rate limit, or
    /// says how long until one is allowed.
    pub fn admit(&self, client: IpAddr) -> Result<(), Duration> {
        self.requests.inc();
        match &self.limits {
            Some(l) => l.take(client),
            None => Ok(()),
        }
    }
}

/// Every route and the default one.
pub struct Router {
    routes: Vec<Arc<Route>>,
    default: Option<Arc<Route>>,
}

impl Router {
    pub fn new(cfg: &crate::config::Checked, metrics: &Metrics) -> anyhow::Result<Router> {
        let (timeout, margin) = (cfg.connect_timeout(), cfg.raw.scores.busy_margin);
        let routes =
            cfg.routes.iter().map(|s| Route::new(s, metrics, Some(&s.name), timeout, margin).map(Arc::new)).collect::<anyhow::Result<_>>()?;
        let default = (!cfg.backends.is_empty()).then(|| {
            let spec = RouteSpec {
                name: DEFAULT_ROUTE.into(),
                hosts: Vec::new(),
                path_prefix: "/".into(),
                backends: cfg.backends.clone(),
                policy: cfg.raw.policy,
                hash_key: cfg.hash_key.clone(),
                health: cfg.raw.health.clone(),
                protocol: cfg.raw.backend_protocol,
                backend_tls: cfg.raw.backend_tls.clone(),
                cache: true,
                max_object_bytes: None,
                request_headers: Rewrite::default(),
                response_headers: Rewrite::default(),
                rate_limit: None,
            };
            // The top-level pool's series keep the labels they had before
            // routes existed.
            Route::new(&spec, metrics, None, timeout, margin).map(Arc::new)
        });
        Ok(Router { routes, default: default.transpose()? })
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.routes.iter().chain(&self.default)
    }

    /// The route for a request: of the routes whose hosts and prefix both
    /// match, the one whose host matched most specifically (exact name,
    /// then the longest wildcard, then a route for any host), then the one
    /// with the longest prefix; the default route when none matches.
    pub fn choose(&self, host: Option<&HeaderValue>, path: &str) -> Option<&Arc<Route>> {
        if self.routes.is_empty() {
            return self.default.as_ref();
        }
        let host = host.and_then(request_host);
        let path = normalize_path(path);
        let mut best: Option<((usize, usize), &Arc<Route>)> = None;
        for r in &self.routes {
            if !prefix_matches(&r.path_prefix, &path) {
                continue;
            }
            let host_rank = if r.hosts.is_empty() {
                0
            } else {
                match host.as_deref().and_then(|h| r.hosts.iter().filter_map(|p| p.rank(h)).max()) {
                    Some(rank) => rank,
                    None => continue,
                }
            };
            let rank = (host_rank, r.path_prefix.len());
            if best.as_ref().is_none_or(|(b, _)| rank > *b) {
                best = Some((rank, r));
            }
        }
        best.map(|(_, r)| r).or(self.default.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_for_matching_only() {
        for (p, want) in [
            ("/a/b", "/a/b"),
            ("/a/../b", "/b"),
            ("/a/./b/", "/a/b/"),
            ("/../..", "/"),
            ("/a//b", "/a/b"),
            ("/%61dmin", "/admin"),
            ("/%2e%2E/admin", "/admin"),
            ("/a%2Fb", "/a%2Fb"),
            ("/a/..", "/"),
            ("/%", "/%"),
            ("/%4", "/%4"),
            ("/x%zz", "/x%zz"),
            ("/é/../%41", "/A"),
            ("/é/./x", "/é/x"),
        ] {
            assert_eq!(normalize_path(p), want, "{p}");
        }
    }

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(prefix_matches("/api", "/api"));
        assert!(prefix_matches("/api", "/api/x"));
        assert!(!prefix_matches("/api", "/apix"));
        assert!(prefix_matches("/api/", "/api/x"));
        assert!(!prefix_matches("/api/", "/api"));
        assert!(prefix_matches("/", "/anything"));
    }

    #[test]
    fn hosts_lose_port_case_and_trailing_dot_and_odd_bytes_match_nothing() {
        let h = |s: &[u8]| request_host(&HeaderValue::from_bytes(s).unwrap()).map(|c| c.into_owned());
        assert_eq!(h(b"WWW.Example.COM:8080").as_deref(), Some("www.example.com"));
        assert_eq!(h(b"example.com.").as_deref(), Some("example.com"));
        assert_eq!(h(b"[::1]:80").as_deref(), Some("[::1]"));
        assert_eq!(h(b"[::1"), None);
        assert_eq!(h("bücher.example".as_bytes()), None);
        assert_eq!(h(b"a b"), None);
        assert_eq!(h(b""), None);
        assert_eq!(h(b":80"), None);
        assert_eq!(h(b"a..example.com"), None, "an empty label is no name");
    }
}

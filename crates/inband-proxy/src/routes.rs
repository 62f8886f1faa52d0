//! `[[route]]`: several backend pools, each chosen by the request's host
//! and path, with its own balancing, health checks, cache use, header
//! rewrites and rate limit. The top-level `backends` are the default
//! route, taken when no route matches. The rules, and why, are in
//! docs/proxy.md "Routes".

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use inband_health::HttpCheckConfig;
use prometheus_client::metrics::counter::Counter;

use crate::backend::Backend;
use crate::client_limits::ClientLimits;
use crate::config::{check_health, parse_hash_key, pool_addrs, Config, HashKey, PolicyKind};
use crate::metrics::Metrics;
use crate::policy::Policy;

/// Routes a config may have: each is a `route` label value on a few
/// metric families, so this bounds their series.
pub const MAX_ROUTES: usize = 256;

/// The route label of the top-level pool.
pub const DEFAULT_ROUTE: &str = "default";

/// A host pattern, lowercased, without a trailing dot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HostPattern {
    Exact(String),
    /// `*.example.com`, kept as `.example.com`: one or more labels before it.
    Suffix(String),
}

impl HostPattern {
    /// How specific a match of `host` is, more is more specific; None for
    /// no match. An exact name beats every wildcard; of two wildcards, the
    /// longer suffix wins (`*.a.example.com` over `*.example.com`).
    fn rank(&self, host: &str) -> Option<usize> {
        match self {
            HostPattern::Exact(h) => (h == host).then_some(usize::MAX),
            HostPattern::Suffix(s) => (host.len() > s.len() && host.ends_with(s.as_str())).then_some(s.len()),
        }
    }
}

/// A header rewrite, parsed and checked.
#[derive(Clone, Debug, Default)]
pub struct Rewrite {
    remove: Vec<HeaderName>,
    set: Vec<(HeaderName, HeaderValue)>,
    add: Vec<(HeaderName, HeaderValue)>,
}

impl Rewrite {
    pub fn apply(&self, h: &mut HeaderMap) {
        for n in &self.remove {
            h.remove(n);
        }
        for (n, v) in &self.set {
            h.insert(n, v.clone());
        }
        for (n, v) in &self.add {
            h.append(n, v.clone());
        }
    }

    fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.set.is_empty() && self.add.is_empty()
    }
}

/// Headers a rewrite may not touch: the connection's own (RFC 9110
/// §7.6.1) and the message framing, which the proxy and hyper manage, and
/// Host, which routing and the cache key are made of.
const FORBIDDEN: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
    "proxy-authenticate",
    "proxy-authorization",
];

/// A route as the config gives it, checked.
#[derive(Clone, Debug)]
pub struct RouteSpec {
    pub name: String,
    pub hosts: Vec<HostPattern>,
    pub path_prefix: String,
    pub backends: Vec<SocketAddr>,
    pub policy: PolicyKind,
    pub hash_key: HashKey,
    pub health: Option<HttpCheckConfig>,
    pub cache: bool,
    pub max_object_bytes: Option<u64>,
    pub request_headers: Rewrite,
    pub response_headers: Rewrite,
    /// Requests a second and burst.
    pub rate_limit: Option<(f64, f64)>,
}

/// Checks every `[[route]]`, adding what is wrong to `problems`.
pub fn check(raw: &Config, problems: &mut Vec<String>) -> Vec<RouteSpec> {
    if raw.routes.len() > MAX_ROUTES {
        problems.push(format!("{} routes: at most {MAX_ROUTES}", raw.routes.len()));
    }
    let mut specs = Vec::new();
    let mut names = std::collections::HashSet::new();
    // (host pattern or None for any, prefix) → the route that has it.
    let mut claimed: std::collections::HashMap<(Option<HostPattern>, String), String> = std::collections::HashMap::new();
    if !raw.backends.is_empty() {
        claimed.insert((None, "/".into()), "the default route (top-level backends)".into());
    }
    for r in &raw.routes {
        let at = format!("route {:?}: ", r.name);
        let n0 = problems.len();
        if r.name.is_empty() || r.name.len() > 64 || !r.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            problems.push(format!("{at}name must be 1 to 64 letters, digits, '-' or '_'"));
        } else if r.name == DEFAULT_ROUTE {
            problems.push(format!("{at}the name {DEFAULT_ROUTE:?} is the top-level pool's"));
        } else if !names.insert(r.name.clone()) {
            problems.push(format!("{at}two routes have this name"));
        }
        if r.backends.is_empty() {
            problems.push(format!("{at}backends is empty"));
        }
        let backends = pool_addrs(&at, &r.backends, problems);
        let hash_key = parse_hash_key(&at, &r.hash_key, problems);
        if let Some(h) = &r.health {
            check_health(&at, h, problems);
        }
        let mut hosts = Vec::new();
        for h in &r.hosts {
            match host_pattern(h) {
                Ok(p) if hosts.contains(&p) => problems.push(format!("{at}host {h:?} is listed twice")),
                Ok(p) => hosts.push(p),
                Err(e) => problems.push(format!("{at}host {h:?}: {e}")),
            }
        }
        let prefix = &r.path_prefix;
        if !prefix.starts_with('/') || prefix.bytes().any(|b| !b.is_ascii_graphic() || b == b'?' || b == b'#') || normalize_path(prefix) != *prefix {
            problems.push(format!(
                "{at}path_prefix {prefix:?} must start with / and be a plain path: no query, no spaces, no . or .. segments, no //, no %-encoded letters or digits"
            ));
        }
        let mut keys: Vec<Option<HostPattern>> = hosts.iter().cloned().map(Some).collect();
        if keys.is_empty() {
            keys.push(None);
        }
        for k in keys {
            let shown = match &k {
                None => "any host".to_string(),
                Some(HostPattern::Exact(h)) => format!("host {h:?}"),
                Some(HostPattern::Suffix(s)) => format!("host \"*{s}\""),
            };
            if let Some(other) = claimed.get(&(k.clone(), prefix.clone())) {
                problems.push(format!("{at}{shown} with path_prefix {prefix:?} is already {other}'s: one of them would never be used"));
            } else {
                claimed.insert((k, prefix.clone()), format!("route {:?}", r.name));
            }
        }
        if let Some(m) = r.max_object_bytes {
            match &raw.cache {
                None => problems.push(format!("{at}max_object_bytes needs a [cache]")),
                Some(c) if m > c.max_object_bytes => {
                    problems.push(format!("{at}max_object_bytes {m} is above cache.max_object_bytes {}", c.max_object_bytes))
                }
                _ => {}
            }
        }
        let request_headers = rewrite(&format!("{at}request_headers"), &r.request_headers, problems);
        let response_headers = rewrite(&format!("{at}response_headers"), &r.response_headers, problems);
        let rate_limit = r.rate_limit.as_ref().map(|l| {
            if !(l.requests_per_s.is_finite() && l.requests_per_s > 0.0) {
                problems.push(format!("{at}rate_limit.requests_per_s = {} must be above 0", l.requests_per_s));
            }
            let burst = l.burst.unwrap_or(l.requests_per_s);
            if !(burst.is_finite() && burst >= 1.0) {
                problems.push(format!("{at}rate_limit.burst = {burst} must be at least 1 (a client may always send one request)"));
            }
            (l.requests_per_s, burst)
        });
        if problems.len() > n0 {
            continue;
        }
        specs.push(RouteSpec {
            name: r.name.clone(),
            hosts,
            path_prefix: prefix.clone(),
            backends,
            policy: r.policy,
            hash_key: hash_key.unwrap_or(HashKey::Path),
            health: r.health.clone(),
            cache: r.cache,
            max_object_bytes: r.max_object_bytes,
            request_headers,
            response_headers,
            rate_limit,
        });
    }
    specs
}

/// A config host: a DNS name (IDNs in their `xn--` form) or an IP
/// address, or `*.` and a name.
fn host_pattern(h: &str) -> Result<HostPattern, String> {
    let lower = h.to_ascii_lowercase();
    let lower = lower.strip_suffix('.').unwrap_or(&lower);
    // Compared as a request's Host writes them: IPv6 in brackets.
    let unbracketed = lower.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(lower);
    match unbracketed.parse::<IpAddr>() {
        Ok(IpAddr::V6(a)) => return Ok(HostPattern::Exact(format!("[{a}]"))),
        Ok(IpAddr::V4(a)) if unbracketed == lower => return Ok(HostPattern::Exact(a.to_string())),
        _ => {}
    }
    let (wild, name) = match lower.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, lower),
    };
    if !h.is_ascii() {
        return Err("not ASCII: write an internationalised name in its xn-- form".into());
    }
    if name.contains('*') {
        return Err("a wildcard is only allowed as the whole first label, \"*.example.com\"".into());
    }
    if !is_dns_name(name) {
        return Err("not a host name (letters, digits, '-' and '_' in dot-separated labels of at most 63)".into());
    }
    Ok(if wild { HostPattern::Suffix(format!(".{name}")) } else { HostPattern::Exact(name.to_string()) })
}

fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty() && l.len() <= 63 && !l.starts_with('-') && !l.ends_with('-') && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

fn rewrite(at: &str, c: &crate::config::HeaderRewriteConfig, problems: &mut Vec<String>) -> Rewrite {
    let name = |n: &str, problems: &mut Vec<String>| -> Option<HeaderName> {
        match HeaderName::from_bytes(n.as_bytes()) {
            Ok(h) if FORBIDDEN.contains(&h.as_str()) => {
                problems.push(format!("{at}: {n:?} may not be rewritten: the proxy manages the connection, framing and Host headers itself"));
                None
            }
            Ok(h) => Some(h),
            Err(_) => {
                problems.push(format!("{at}: {n:?} is not a header name"));
                None
            }
        }
    };
    let mut out = Rewrite::default();
    for n in &c.remove {
        out.remove.extend(name(n, problems));
    }
    for (list, into) in [(&c.set, &mut out.set), (&c.add, &mut out.add)] {
        for (n, v) in list {
            let h = name(n, problems);
            match HeaderValue::from_str(v) {
                Ok(v) => into.extend(h.map(|h| (h, v))),
                Err(_) => problems.push(format!("{at}: the value of {n:?} has a byte a header value may not have")),
            }
        }
    }
    out
}

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

/// The path as routes compare it, RFC 3986 §6.2.2: unreserved characters
/// percent-decoded, `.` and `..` segments removed, and `//` merged (as
/// nginx does). A backend that normalises `/public/../admin` to `/admin`
/// must not receive it through the `/public` route, past `/admin`'s rate
/// limit. The request is forwarded as it came; only the choice uses this.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let b = path.as_bytes();
    let needs = b.contains(&b'%') || path.contains("/.") || path.contains("//");
    if !needs {
        return Cow::Borrowed(path);
    }
    let mut decoded = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                let c = (h * 16 + l) as u8;
                if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                    decoded.push(c);
                    i += 3;
                    continue;
                }
            }
        }
        decoded.push(b[i]);
        i += 1;
    }
    // Only ASCII was decoded into a valid string: still valid.
    let decoded = String::from_utf8(decoded).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = decoded.split('/').collect();
    let last = segments.len() - 1;
    for (k, seg) in segments.iter().enumerate() {
        match *seg {
            "" if k != 0 && k != last => {}
            "." => {}
            ".." => {
                if out.len() > 1 {
                    out.pop();
                }
            }
            s => out.push(s),
        }
    }
    // A path ending in a dot segment ends in a slash.
    if matches!(segments[last], "." | "..") {
        out.push("");
    }
    let joined = out.join("/");
    Cow::Owned(if joined.starts_with('/') { joined } else { format!("/{joined}") })
}

/// Whether `prefix` covers `path`: whole segments, so `/api` takes `/api`
/// and `/api/x` but not `/apix`; a prefix ending in `/` takes what starts
/// with it.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    path.starts_with(prefix) && (prefix.ends_with('/') || path.len() == prefix.len() || path.as_bytes()[prefix.len()] == b'/')
}

/// A backend pool with its balancing.
pub struct Pool {
    pub backends: Vec<Arc<Backend>>,
    pub addrs: Vec<SocketAddr>,
    pub policy: Policy,
    pub hash_key: HashKey,
    pub health: Option<HttpCheckConfig>,
}

/// A route as it runs.
pub struct Route {
    pub name: String,
    hosts: Vec<HostPattern>,
    path_prefix: String,
    pub pool: Pool,
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
    fn new(spec: &RouteSpec, metrics: &Metrics, label: Option<&str>) -> Route {
        let backends: Vec<Arc<Backend>> = spec.backends.iter().map(|&a| Arc::new(Backend::new(a, label))).collect();
        for b in &backends {
            metrics.add_backend(b);
        }
        let limits = spec.rate_limit.map(|(rate, burst)| Arc::new(ClientLimits::new(0, rate, burst, metrics.clients_untracked.clone())));
        Route {
            name: spec.name.clone(),
            hosts: spec.hosts.clone(),
            path_prefix: spec.path_prefix.clone(),
            pool: Pool { backends, addrs: spec.backends.clone(), policy: Policy::new(spec.policy), hash_key: spec.hash_key.clone(), health: spec.health.clone() },
            cache: spec.cache,
            max_object_bytes: spec.max_object_bytes,
            rewrites_responses: !spec.response_headers.is_empty(),
            request_headers: spec.request_headers.clone(),
            response_headers: spec.response_headers.clone(),
            limits,
            requests: metrics.route_requests(&spec.name),
        }
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
    pub fn new(cfg: &crate::config::Checked, metrics: &Metrics) -> Router {
        let routes = cfg.routes.iter().map(|s| Arc::new(Route::new(s, metrics, Some(&s.name)))).collect();
        let default = (!cfg.backends.is_empty()).then(|| {
            let spec = RouteSpec {
                name: DEFAULT_ROUTE.into(),
                hosts: Vec::new(),
                path_prefix: "/".into(),
                backends: cfg.backends.clone(),
                policy: cfg.raw.policy,
                hash_key: cfg.hash_key.clone(),
                health: cfg.raw.health.clone(),
                cache: true,
                max_object_bytes: None,
                request_headers: Rewrite::default(),
                response_headers: Rewrite::default(),
                rate_limit: None,
            };
            // The top-level pool's series keep the labels they had before
            // routes existed.
            Arc::new(Route::new(&spec, metrics, None))
        });
        Router { routes, default }
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

    #[test]
    fn wildcards_take_one_or_more_labels_but_not_the_bare_name() {
        let p = host_pattern("*.Example.com").unwrap();
        assert!(p.rank("www.example.com").is_some());
        assert!(p.rank("a.b.example.com").is_some());
        assert!(p.rank("example.com").is_none());
        assert!(p.rank("badexample.com").is_none());
        for bad in ["www.*.com", "*example.com", "*", "a..b", "-a.com", "bücher.example"] {
            assert!(host_pattern(bad).is_err(), "{bad}");
        }
        assert_eq!(host_pattern("10.0.0.1").unwrap(), HostPattern::Exact("10.0.0.1".into()));
        for v6 in ["::1", "[::1]", "[0:0::1]"] {
            assert_eq!(host_pattern(v6).unwrap().rank("[::1]"), Some(usize::MAX), "{v6}");
        }
    }
}

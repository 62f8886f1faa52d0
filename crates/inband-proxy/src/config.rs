//! `proxy.toml`: parsed with serde (unknown keys refused), then checked as a
//! whole so every mistake is reported before the proxy listens.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::uri_path::normalize_path;
use inband_health::HttpCheckConfig;
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the proxy accepts clients on.
    pub listen: String,
    /// Prometheus text endpoint (`GET /metrics`); none when absent.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// Backend addresses, `IP:port`: the default route's pool, for requests
    /// no `[[route]]` matches. May be empty when routes are given (those
    /// requests are then 404).
    #[serde(default)]
    pub backends: Vec<String>,
    #[serde(default)]
    pub policy: PolicyKind,
    /// What consistent hashing hashes: `path`, `client` or `header:NAME`.
    #[serde(default = "default_hash_key")]
    pub hash_key: String,
    /// Largest request head (request line + headers) accepted; more is 431.
    /// hyper's minimum is 8192.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// Largest request body accepted; more is 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    /// Time a client has to send its whole request body; 408 after.
    #[serde(default = "default_client_body_timeout_ms")]
    pub client_body_timeout_ms: u64,
    /// Time from accept (or from a later request's first byte) to a whole
    /// request head: 408 and close after, or a silent close when nothing
    /// came at all.
    #[serde(default = "default_client_header_timeout_ms")]
    pub client_header_timeout_ms: u64,
    /// How long a keep-alive connection may wait for its next request.
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// How long a response write may wait for a client that does not read.
    #[serde(default = "default_send_timeout_ms")]
    pub send_timeout_ms: u64,
    /// Client connections open at once; more wait in the listen backlog.
    /// 0: from the open-files limit, (limit − 64) / 2, as each client may
    /// need a backend connection too.
    #[serde(default)]
    pub max_connections: usize,
    /// Threads serving clients, each with its own event loop; 0: one per CPU.
    #[serde(default)]
    pub workers: usize,
    /// A new connection goes to the first worker that has fewer than this
    /// many more open than the least loaded one and is less than half
    /// busy; otherwise to the one with the fewest open. 0 spreads evenly.
    #[serde(default = "default_pack_connections")]
    pub pack_connections: usize,
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Time from sending a request to a backend until its response head; 504 after.
    #[serde(default = "default_backend_timeout_ms")]
    pub backend_timeout_ms: u64,
    /// Extra attempts on other backends for an idempotent request whose
    /// connection failed.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// How long shutdown waits for in-flight requests.
    #[serde(default = "default_shutdown_timeout_ms")]
    pub shutdown_timeout_ms: u64,
    /// Clients allowed to send `PURGE`.
    #[serde(default = "default_purge_allow")]
    pub purge_allow: Vec<IpAddr>,
    /// Active health checks; none when absent.
    #[serde(default)]
    pub health: Option<HttpCheckConfig>,
    /// How the default route's backends are spoken to.
    #[serde(default)]
    pub backend_protocol: BackendProtocol,
    /// TLS to the default route's backends; plaintext when absent.
    #[serde(default)]
    pub backend_tls: Option<BackendTlsConfig>,
    #[serde(default)]
    pub passive: PassiveConfig,
    /// The response cache; none when absent.
    #[serde(default)]
    pub cache: Option<CacheConfig>,
    /// An HTTPS listener besides `listen`; none when absent.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Per client (an IPv4 address or an IPv6 /64).
    #[serde(default)]
    pub client_limits: ClientLimitsConfig,
    /// HTTP/2 from clients.
    #[serde(default)]
    pub client_http2: ClientHttp2Config,
    /// HTTP/1.1 `Upgrade` (WebSocket) tunnels.
    #[serde(default)]
    pub upgrade: UpgradeConfig,
    /// Backend pools chosen by Host and path (routes.rs).
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteConfig>,
    /// How `least-score` pools poll their backends' agents.
    #[serde(default)]
    pub scores: ScoresConfig,
    /// The keys score polls are signed with, as `inband lb`'s `[auth]`;
    /// needed only when a pool uses `least-score`.
    #[serde(default)]
    pub auth: Option<inband_core::auth::AuthConfig>,
    /// Connection handoff to the backends' takeover servers (TCPE,
    /// tcpe.rs); none when absent.
    #[serde(default)]
    pub tcpe: Option<TcpeConfig>,
}

/// `[tcpe]`: hand connections of TCPE clients to the chosen backend's
/// `inband tcpe serve`. One section for the whole proxy: the sockops
/// program and the listener that answers TCPE are the process's, and a
/// backend's takeover server is the host's, whatever route it is in.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpeConfig {
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The cgroup v2 directory to attach the sockops program to; the proxy
    /// must run in it (or below it). Absent: the proxy's own cgroup.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// The key shared with the takeover servers (`inband keygen`).
    pub key: PathBuf,
    /// How long a server waits for the client's join.
    #[serde(default = "default_tcpe_deadline_ms")]
    pub deadline_ms: u64,
    /// Each step on the takeover channel; the wait for the server's answer
    /// is `deadline_ms` plus this.
    #[serde(default = "default_tcpe_io_timeout_ms")]
    pub io_timeout_ms: u64,
    /// The takeover server of each backend that has one.
    #[serde(default, rename = "server")]
    pub servers: Vec<TcpeServerConfig>,
    /// Clients without TCPE moved at L4 (docs/tcpe.md, "The transparent
    /// handoff"); none when absent.
    #[serde(default)]
    pub transparent: Option<TransparentConfig>,
}

/// `[tcpe.transparent]`: a plain client's connection that reached the
/// proxy through `inband lb` in a DSR mode is frozen and moved to the
/// chosen backend's takeover server, and the balancer is asked to send it
/// there (signed with `[auth]`'s key).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransparentConfig {
    /// The pin directory of this host's `inband agent`, e.g.
    /// /sys/fs/bpf/inband/agent/eth0.
    pub agent_pins: PathBuf,
    /// The balancers' `[moves] listen` port.
    pub balancer_port: u16,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpeServerConfig {
    /// A backend address of some pool, as listed there.
    pub backend: String,
    /// Its takeover channel (`inband tcpe serve --control`).
    pub control: String,
    /// Where clients join it (`--join`), as clients reach it.
    pub join: String,
    /// With `[tcpe.transparent]`: the server's IPv6 address and port as
    /// `inband lb` lists it, for moving IPv6 connections (the pool lists
    /// it by one address; absent, IPv6 connections to it are proxied).
    #[serde(default)]
    pub backend6: Option<String>,
}

/// `[tcpe]` checked: the key read, the addresses parsed.
#[derive(Clone, Debug)]
pub struct TcpeSpec {
    pub cgroup: Option<PathBuf>,
    pub key: inband_core::wire::Key,
    pub deadline: Duration,
    pub io_timeout: Duration,
    /// By backend address: the takeover channel, the join address, and
    /// the server's IPv6 address as the L4 balancer lists it.
    pub servers: std::collections::HashMap<SocketAddr, (SocketAddr, SocketAddr, Option<SocketAddr>)>,
    pub transparent: Option<TransparentSpec>,
}

/// `[tcpe.transparent]` checked, with the key moves are signed with.
#[derive(Clone, Debug)]
pub struct TransparentSpec {
    pub agent_pins: PathBuf,
    pub balancer_port: u16,
    pub key: (u8, inband_core::wire::Key),
}

/// `[scores]`: the agents' poll protocol (docs/agent.md), asked by the
/// proxy for every backend of a `least-score` pool.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoresConfig {
    /// The agents' `poll_port`.
    #[serde(default = "default_score_poll_port")]
    pub poll_port: u16,
    /// Time between polls of every backend, and how long a round waits
    /// for its answers.
    #[serde(default = "default_score_interval_ms")]
    pub interval_ms: u64,
    /// Rounds without an answer after which a backend's score is stale:
    /// it is then ranked by the proxy's own requests in flight alone.
    #[serde(default = "default_score_stale_after")]
    pub stale_after: u32,
    /// A backend whose ranked load is this many requests above the least
    /// loaded one's is busy: a least-score draw landing on it takes the
    /// least loaded instead (policy.rs), and a GET or HEAD waiting on it is
    /// also sent to the least loaded (forward.rs, `hedge`); 0: neither.
    #[serde(default = "default_busy_margin")]
    pub busy_margin: u32,
}

impl Default for ScoresConfig {
    fn default() -> Self {
        ScoresConfig {
            poll_port: default_score_poll_port(),
            interval_ms: default_score_interval_ms(),
            stale_after: default_score_stale_after(),
            busy_margin: default_busy_margin(),
        }
    }
}

impl ScoresConfig {
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// How long a score counts after its answer.
    pub fn valid_for(&self) -> Duration {
        self.interval() * self.stale_after
    }
}

/// `[[route]]`: a pool of its own, chosen by `hosts` and `path_prefix`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The `route` label of its metrics and the name in messages.
    pub name: String,
    /// Exact names and `*.suffix` wildcards; absent or empty: any host.
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default = "default_path_prefix")]
    pub path_prefix: String,
    pub backends: Vec<String>,
    #[serde(default)]
    pub policy: PolicyKind,
    #[serde(default = "default_hash_key")]
    pub hash_key: String,
    /// Active health checks of this pool; none when absent (the top-level
    /// `[health]` is the default route's).
    #[serde(default)]
    pub health: Option<HttpCheckConfig>,
    #[serde(default)]
    pub backend_protocol: BackendProtocol,
    #[serde(default)]
    pub backend_tls: Option<BackendTlsConfig>,
    /// Whether this route's GETs go through the `[cache]` store.
    #[serde(default = "default_true")]
    pub cache: bool,
    /// Below `cache.max_object_bytes`: a smaller bound for this route.
    #[serde(default)]
    pub max_object_bytes: Option<u64>,
    #[serde(default)]
    pub request_headers: HeaderRewriteConfig,
    #[serde(default)]
    pub response_headers: HeaderRewriteConfig,
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
}

/// Applied in this order: `remove`, `set` (replaces every value), `add`
/// (one more value).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderRewriteConfig {
    #[serde(default)]
    pub remove: Vec<String>,
    #[serde(default)]
    pub set: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub add: std::collections::BTreeMap<String, String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Requests a second one client may send to this route.
    pub requests_per_s: f64,
    /// Requests above the rate at once; absent: one second's worth.
    pub burst: Option<f64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpgradeConfig {
    /// Protocols a client may upgrade to, as named in `Upgrade` (a name
    /// matches every version of it, `name/version` only that one; case
    /// does not matter); `"*"` for any, `[]` for none. Any other
    /// protocol offered is dropped from the request, which goes on as a
    /// plain one.
    #[serde(default = "default_upgrade_protocols")]
    pub protocols: Vec<String>,
    /// No byte either way through a tunnel for this long closes it;
    /// absent: `idle_timeout_ms`.
    pub idle_timeout_ms: Option<u64>,
}

impl Default for UpgradeConfig {
    fn default() -> Self {
        UpgradeConfig { protocols: default_upgrade_protocols(), idle_timeout_ms: None }
    }
}

/// `[client_http2]`: the limits on one client's HTTP/2 connection
/// (http2_guard.rs says which h2 keeps itself).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientHttp2Config {
    /// Streams a client may have open at once on one connection (the
    /// SETTINGS_MAX_CONCURRENT_STREAMS it is sent); more are refused.
    #[serde(default = "default_http2_max_concurrent_streams")]
    pub max_concurrent_streams: u32,
    /// PING, SETTINGS, RST_STREAM and PRIORITY frames a client may send in
    /// a second on one connection; more end it. 0: no limit.
    #[serde(default = "default_http2_control_frames_per_s")]
    pub control_frames_per_s: u32,
}

impl Default for ClientHttp2Config {
    fn default() -> Self {
        ClientHttp2Config { max_concurrent_streams: default_http2_max_concurrent_streams(), control_frames_per_s: default_http2_control_frames_per_s() }
    }
}

// nginx's http2_max_concurrent_streams.
fn default_http2_max_concurrent_streams() -> u32 {
    128
}
fn default_http2_control_frames_per_s() -> u32 {
    100
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientLimitsConfig {
    /// Connections one client may hold open; more are closed at once.
    /// Absent: an eighth of `max_connections`, so no one client can hold
    /// the proxy; 0: no limit.
    pub connections: Option<u32>,
    /// Requests a second one client may send, on all its connections
    /// together; more are answered 429. 0 (the default): no limit.
    #[serde(default)]
    pub requests_per_s: f64,
    /// Requests a client may send at once above the rate; absent: one
    /// second's worth.
    pub burst: Option<f64>,
}

impl ClientLimitsConfig {
    pub fn connections_for(&self, max_connections: usize) -> u32 {
        self.connections.unwrap_or_else(|| u32::try_from(max_connections / 8).unwrap_or(u32::MAX).max(1))
    }

    pub fn burst(&self) -> f64 {
        self.burst.unwrap_or(self.requests_per_s)
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Address of the TLS listener, `IP:port`.
    pub listen: String,
    /// Chosen by the name a client sends (SNI); the first is for clients
    /// that send none or a name no certificate has.
    pub certificate: Vec<CertificateConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateConfig {
    /// PEM: the certificate, then any intermediates.
    pub cert: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 RSA or SEC1 EC).
    pub key: PathBuf,
    /// DER: an OCSP response for the certificate, stapled to handshakes
    /// that ask for one; read again with the certificate on reload.
    #[serde(default)]
    pub ocsp: Option<PathBuf>,
}

/// The protocol a pool's backends are spoken to in: over TLS it is the
/// one protocol offered by ALPN, in plaintext `h2` is h2c by prior
/// knowledge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum BackendProtocol {
    #[default]
    #[serde(rename = "http1")]
    Http1,
    #[serde(rename = "h2")]
    H2,
}

/// `backend_tls`: TLS to a pool's backends, always verified.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendTlsConfig {
    /// PEM: the CA certificates backends' certificates must chain to;
    /// absent: the system's.
    pub ca: Option<PathBuf>,
    /// The name (or IP address) certificates are verified against and
    /// sent as SNI; absent: the backend's IP address.
    pub server_name: Option<String>,
    /// PEM: a client certificate (then intermediates) and its key, for
    /// backends that ask for one.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl BackendTlsConfig {
    fn check(&self, at: &str, problems: &mut Vec<String>) {
        if self.cert.is_some() != self.key.is_some() {
            problems.push(format!("{at}backend_tls: cert and key go together (a client certificate needs its key)"));
        }
        if let Some(n) = &self.server_name {
            if rustls::pki_types::ServerName::try_from(n.as_str()).is_err() {
                problems.push(format!("{at}backend_tls.server_name {n:?} is neither a DNS name nor an IP address"));
            }
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[default]
    RoundRobin,
    LeastRequest,
    ConsistentHash,
    /// Least of the agent's score plus the proxy's own requests in flight.
    LeastScore,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassiveConfig {
    /// Consecutive connection failures, timeouts or 5xx that eject a
    /// backend; 0 turns passive ejection off.
    #[serde(default = "default_passive_failures")]
    pub failures: u32,
    #[serde(default = "default_passive_cooldown_ms")]
    pub cooldown_ms: u64,
}

impl Default for PassiveConfig {
    fn default() -> Self {
        PassiveConfig { failures: default_passive_failures(), cooldown_ms: default_passive_cooldown_ms() }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    #[serde(default)]
    pub backend: inband_cache::BackendKind,
    /// Directory of the store; required for every backend but `memory`.
    #[serde(default)]
    pub path: Option<PathBuf>,
    #[serde(default = "default_cache_capacity")]
    pub capacity_bytes: u64,
    /// Responses with a larger body are passed through, not stored.
    #[serde(default = "default_max_object_bytes")]
    pub max_object_bytes: u64,
    /// fsync every write (see inband-cache); off by default.
    #[serde(default)]
    pub fsync: bool,
    /// Responses with Set-Cookie: `skip` (the default) does not store
    /// them, as nginx and Varnish do not; `strip` stores them without the
    /// Set-Cookie header (the client that caused the fetch still gets it).
    #[serde(default)]
    pub set_cookie: SetCookie,
    /// Store uncompressed responses compressed (docs/proxy.md); none when absent.
    #[serde(default)]
    pub compression: Option<crate::compression::CompressionConfig>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SetCookie {
    #[default]
    Skip,
    Strip,
}

impl CacheConfig {
    pub fn store_config(&self) -> inband_cache::Config {
        let mut c = inband_cache::Config::new(self.backend, self.path.clone(), self.capacity_bytes);
        c.fsync = self.fsync;
        c
    }
}

fn default_tcpe_deadline_ms() -> u64 {
    500
}
fn default_tcpe_io_timeout_ms() -> u64 {
    1000
}
fn default_path_prefix() -> String {
    "/".into()
}
fn default_true() -> bool {
    true
}
fn default_upgrade_protocols() -> Vec<String> {
    vec!["websocket".into()]
}
fn default_hash_key() -> String {
    "path".into()
}
fn default_max_header_bytes() -> usize {
    16 * 1024
}
fn default_max_body_bytes() -> u64 {
    8 << 20
}
fn default_client_body_timeout_ms() -> u64 {
    30_000
}
fn default_client_header_timeout_ms() -> u64 {
    10_000
}
fn default_idle_timeout_ms() -> u64 {
    60_000
}
fn default_send_timeout_ms() -> u64 {
    60_000
}
fn default_pack_connections() -> usize {
    8
}
fn default_connect_timeout_ms() -> u64 {
    1000
}
fn default_backend_timeout_ms() -> u64 {
    30_000
}
fn default_retries() -> u32 {
    2
}
fn default_shutdown_timeout_ms() -> u64 {
    10_000
}
fn default_purge_allow() -> Vec<IpAddr> {
    vec![IpAddr::from([127, 0, 0, 1]), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)]
}
fn default_passive_failures() -> u32 {
    5
}
fn default_passive_cooldown_ms() -> u64 {
    10_000
}
fn default_score_poll_port() -> u16 {
    9137
}
fn default_score_interval_ms() -> u64 {
    20
}
fn default_score_stale_after() -> u32 {
    5
}
/// Four requests: a burst that fills a small server's workers, well above
/// the one or two by which scores of equally loaded backends differ.
fn default_busy_margin() -> u32 {
    4
}
fn default_cache_capacity() -> u64 {
    1 << 30
}
fn default_max_object_bytes() -> u64 {
    8 << 20
}

/// What consistent hashing hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashKey {
    Path,
    ClientAddr,
    /// A request header; requests without it hash the client address.
    Header(http::HeaderName),
}

/// The upgrade protocols allowed, lowercased.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpgradeAllow {
    Any,
    Only(Vec<String>),
}

impl UpgradeAllow {
    /// `protocol` is one of `Upgrade`'s list: `name` or `name/version`.
    pub fn allows(&self, protocol: &str) -> bool {
        let name = protocol.split_once('/').map_or(protocol, |(n, _)| n);
        match self {
            UpgradeAllow::Any => true,
            UpgradeAllow::Only(list) => list.iter().any(|a| a.eq_ignore_ascii_case(protocol) || a.eq_ignore_ascii_case(name)),
        }
    }
}

/// RFC 9110 §5.6.2 token.
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A config that passed every check, with addresses parsed.
#[derive(Clone, Debug)]
pub struct Checked {
    pub raw: Config,
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    pub tls_listen: Option<SocketAddr>,
    /// The default route's pool (top-level `backends`); may be empty.
    pub backends: Vec<SocketAddr>,
    pub hash_key: HashKey,
    pub upgrade_allow: UpgradeAllow,
    pub routes: Vec<RouteSpec>,
    /// `[tcpe]` when present and enabled.
    pub tcpe: Option<TcpeSpec>,
}

impl Checked {
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.raw.connect_timeout_ms)
    }
    pub fn client_body_timeout(&self) -> Duration {
        Duration::from_millis(self.raw.client_body_timeout_ms)
    }
    pub fn backend_timeout(&self) -> Duration {
        Duration::from_millis(self.raw.backend_timeout_ms)
    }
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.raw.shutdown_timeout_ms)
    }
    pub fn timeouts(&self) -> crate::conn::Timeouts {
        crate::conn::Timeouts {
            header: Duration::from_millis(self.raw.client_header_timeout_ms),
            idle: Duration::from_millis(self.raw.idle_timeout_ms),
            send: Duration::from_millis(self.raw.send_timeout_ms),
        }
    }
    pub fn tunnel_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.raw.upgrade.idle_timeout_ms.unwrap_or(self.raw.idle_timeout_ms))
    }
}

pub fn load(path: &Path) -> Result<Checked> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

pub fn parse(text: &str) -> Result<Checked> {
    check(deserialize(text)?)
}

/// Syntax errors, unknown keys and wrong types, all of them: serde stops
/// at the first, so each one's line is blanked and the text parsed again,
/// up to a bound. A table header's error ends the search, since blanking
/// it would file its keys under the table before and invent errors.
fn deserialize(text: &str) -> Result<Config> {
    const MAX_REPORTED: usize = 20;
    let mut lines: Vec<&str> = text.lines().collect();
    let mut problems = Vec::new();
    loop {
        let attempt = lines.join("\n");
        let e = match toml::from_str::<Config>(&attempt) {
            Ok(c) if problems.is_empty() => return Ok(c),
            Ok(_) => break,
            Err(e) => e,
        };
        let line = e.span().map(|s| attempt[..s.start].matches('\n').count());
        let message = e.message().trim_end().to_string();
        match line {
            Some(l) => problems.push(format!("line {}: {message}", l + 1)),
            None => problems.push(message),
        }
        match line {
            Some(l) if problems.len() < MAX_REPORTED && !lines[l].trim_start().starts_with('[') && !lines[l].trim().is_empty() => lines[l] = "",
            _ => break,
        }
    }
    bail!("invalid proxy config:\n  - {}", problems.join("\n  - "))
}

fn socket_addr(what: &str, s: &str) -> Result<SocketAddr> {
    // No DNS: a name could resolve differently at every restart, and a
    // pool member should be one fixed address.
    s.parse().with_context(|| format!("{what} {s:?} is not IP:port (e.g. 127.0.0.1:8080 or [::1]:8080); host names are not resolved"))
}

pub fn check(raw: Config) -> Result<Checked> {
    let mut problems = Vec::new();
    let note = |problems: &mut Vec<String>, r: Result<()>| {
        if let Err(e) = r {
            problems.push(format!("{e:#}"));
        }
    };
    let listen = socket_addr("listen", &raw.listen);
    let metrics_listen = raw.metrics_listen.as_deref().map(|m| socket_addr("metrics_listen", m)).transpose();
    let tls_listen = raw.tls.as_ref().map(|t| socket_addr("tls.listen", &t.listen)).transpose();
    let limits = &raw.client_limits;
    if !(limits.requests_per_s.is_finite() && limits.requests_per_s >= 0.0) {
        note(&mut problems, Err(anyhow::anyhow!("client_limits.requests_per_s = {} must be 0 (no limit) or more", limits.requests_per_s)));
    }
    if let Some(b) = limits.burst.filter(|b| !(b.is_finite() && *b >= 1.0)) {
        note(&mut problems, Err(anyhow::anyhow!("client_limits.burst = {b} must be at least 1 (a client may always send one request)")));
    }
    if raw.client_http2.max_concurrent_streams == 0 {
        note(&mut problems, Err(anyhow::anyhow!("client_http2.max_concurrent_streams = 0 would refuse every HTTP/2 request")));
    }
    if raw.tls.as_ref().is_some_and(|t| t.certificate.is_empty()) {
        note(&mut problems, Err(anyhow::anyhow!("tls needs at least one [[tls.certificate]] with cert and key files")));
    }
    if raw.backends.is_empty() && raw.routes.is_empty() {
        note(&mut problems, Err(anyhow::anyhow!("backends is empty: list at least one backend, e.g. backends = [\"127.0.0.1:8081\"]")));
    }
    let backends = pool_addrs("", &raw.backends, &mut problems);
    let hash_key = parse_hash_key("", &raw.hash_key, &mut problems);
    let routes = check_routes(&raw, &mut problems);
    if raw.max_header_bytes < 8192 {
        note(&mut problems, Err(anyhow::anyhow!("max_header_bytes {} is below 8192, the smallest buffer hyper accepts", raw.max_header_bytes)));
    }
    for (name, v) in [
        ("client_body_timeout_ms", raw.client_body_timeout_ms),
        ("client_header_timeout_ms", raw.client_header_timeout_ms),
        ("idle_timeout_ms", raw.idle_timeout_ms),
        ("send_timeout_ms", raw.send_timeout_ms),
        ("connect_timeout_ms", raw.connect_timeout_ms),
        ("backend_timeout_ms", raw.backend_timeout_ms),
    ] {
        if v == 0 {
            note(&mut problems, Err(anyhow::anyhow!("{name} must be above 0")));
        }
    }
    if raw.upgrade.idle_timeout_ms == Some(0) {
        note(&mut problems, Err(anyhow::anyhow!("upgrade.idle_timeout_ms must be above 0")));
    }
    let mut upgrade_allow = UpgradeAllow::Only(Vec::new());
    for p in &raw.upgrade.protocols {
        if p == "*" {
            upgrade_allow = UpgradeAllow::Any;
        } else if !p.split_once('/').map_or(is_token(p), |(n, v)| is_token(n) && is_token(v)) {
            note(&mut problems, Err(anyhow::anyhow!("upgrade.protocols: {p:?} is not a protocol name (e.g. \"websocket\" or \"name/version\") nor \"*\"")));
        } else if let UpgradeAllow::Only(list) = &mut upgrade_allow {
            list.push(p.to_ascii_lowercase());
        }
    }
    if let Some(h) = &raw.health {
        check_health("", h, &mut problems);
    }
    if let Some(t) = &raw.backend_tls {
        t.check("", &mut problems);
    }
    if let Some(c) = &raw.cache {
        if c.backend.durable() && c.path.is_none() {
            note(&mut problems, Err(anyhow::anyhow!("cache.backend {} needs cache.path (a directory)", c.backend)));
        }
        if c.max_object_bytes >= c.capacity_bytes {
            note(&mut problems, Err(anyhow::anyhow!("cache.max_object_bytes must be below cache.capacity_bytes")));
        }
        for p in c.compression.iter().flat_map(|z| z.problems()) {
            note(&mut problems, Err(anyhow::anyhow!(p)));
        }
    }
    check_scores(&raw, &routes, &mut problems);
    let tcpe = raw.tcpe.as_ref().filter(|t| t.enabled).and_then(|t| check_tcpe(t, raw.auth.as_ref(), &backends, &routes, &mut problems));
    let listen = listen.map_err(|e| problems.push(format!("{e:#}"))).ok();
    let metrics_listen = metrics_listen.map_err(|e| problems.push(format!("{e:#}"))).ok().flatten();
    let tls_listen = tls_listen.map_err(|e| problems.push(format!("{e:#}"))).ok().flatten();
    if !problems.is_empty() {
        bail!("invalid proxy config:\n  - {}", problems.join("\n  - "));
    }
    Ok(Checked { listen: listen.unwrap(), metrics_listen, tls_listen, backends, hash_key: hash_key.unwrap_or(HashKey::Path), upgrade_allow, routes, tcpe, raw })
}

/// `[tcpe]`: every server names a backend of some pool, once, with
/// addresses; the key file is read here so that a bad one is reported
/// with the rest.
fn check_tcpe(t: &TcpeConfig, auth: Option<&inband_core::auth::AuthConfig>, backends: &[SocketAddr], routes: &[RouteSpec], problems: &mut Vec<String>) -> Option<TcpeSpec> {
    let before = problems.len();
    let key = inband_core::auth::read_key(&t.key).map_err(|e| problems.push(format!("tcpe.key: {e:#}"))).ok();
    if t.deadline_ms == 0 || t.deadline_ms > 60_000 {
        problems.push(format!("tcpe.deadline_ms = {} must be 1 to 60000 (the takeover server cuts it to its --max-deadline-ms)", t.deadline_ms));
    }
    if t.io_timeout_ms == 0 {
        problems.push("tcpe.io_timeout_ms must be above 0".into());
    }
    if t.cgroup.as_ref().is_some_and(|c| !c.is_absolute()) {
        problems.push(format!("tcpe.cgroup {:?} must be an absolute path (a cgroup v2 directory)", t.cgroup.as_ref().unwrap()));
    }
    if t.servers.is_empty() {
        problems.push("tcpe: list at least one [[tcpe.server]] (backend, control, join), or set enabled = false".into());
    }
    let pooled: HashSet<SocketAddr> = backends.iter().chain(routes.iter().flat_map(|r| &r.backends)).copied().collect();
    let mut servers = std::collections::HashMap::new();
    for s in &t.servers {
        let parsed = (
            socket_addr("tcpe.server backend", &s.backend),
            socket_addr("tcpe.server control", &s.control),
            socket_addr("tcpe.server join", &s.join),
            s.backend6.as_deref().map(|b6| socket_addr("tcpe.server backend6", b6)).transpose(),
        );
        match parsed {
            (Ok(b), Ok(c), Ok(j), Ok(b6)) => {
                if b6.is_some_and(|b6| !b6.is_ipv6()) {
                    problems.push(format!("tcpe.server backend6 {:?} is not an IPv6 address", s.backend6.as_deref().unwrap_or_default()));
                } else if !pooled.contains(&b) {
                    problems.push(format!("tcpe.server backend {:?} is in no pool: list it in backends or a route's backends", s.backend));
                } else if servers.insert(b, (c, j, b6)).is_some() {
                    problems.push(format!("tcpe.server backend {:?} is listed twice: one takeover server per backend", s.backend));
                }
            }
            (b, c, j, b6) => {
                for e in [b.err(), c.err(), j.err(), b6.err()].into_iter().flatten() {
                    problems.push(format!("{e:#}"));
                }
            }
        }
    }
    let transparent = t.transparent.as_ref().and_then(|tr| {
        if !tr.agent_pins.is_absolute() {
            problems.push(format!("tcpe.transparent.agent_pins {:?} must be an absolute path (the agent's pin directory)", tr.agent_pins));
        }
        if tr.balancer_port == 0 {
            problems.push("tcpe.transparent.balancer_port must be the balancers' [moves] listen port".into());
        }
        // Moves are signed with a key of the balancers' [auth]; the
        // unauthenticated format does not exist for them.
        let key = match auth {
            Some(a) if a.mode == inband_core::auth::AuthMode::Siphash => {
                let id = a.signing_key();
                a.load_keys().map_err(|e| problems.push(format!("[auth]: {e:#}"))).ok()?.into_iter().find(|(k, _)| *k == id)
            }
            _ => {
                problems.push("tcpe.transparent: moves are signed with the balancers' key: add an [auth] section with it (keys = [{ id = 1, file = \"...\" }])".into());
                None
            }
        };
        Some(TransparentSpec { agent_pins: tr.agent_pins.clone(), balancer_port: tr.balancer_port, key: key? })
    });
    (problems.len() == before).then(|| TcpeSpec {
        cgroup: t.cgroup.clone(),
        key: key.expect("no problem means the key was read"),
        deadline: Duration::from_millis(t.deadline_ms),
        io_timeout: Duration::from_millis(t.io_timeout_ms),
        servers,
        transparent,
    })
}

/// `[scores]` and `[auth]`, when some pool ranks by score: bounds that keep
/// the poll traffic and the staleness window sane.
fn check_scores(raw: &Config, routes: &[RouteSpec], problems: &mut Vec<String>) {
    let scored = (raw.policy == PolicyKind::LeastScore && !raw.backends.is_empty()) || routes.iter().any(|r| r.policy == PolicyKind::LeastScore);
    let s = &raw.scores;
    if !(1..=10_000).contains(&s.interval_ms) {
        problems.push(format!("scores.interval_ms = {} must be 1 to 10000", s.interval_ms));
    }
    // One interval would expire a score just before the next answer
    // whenever that answer comes later in its round than the last did.
    if !(2..=1000).contains(&s.stale_after) {
        problems.push(format!("scores.stale_after = {} must be 2 to 1000 (intervals)", s.stale_after));
    }
    if s.poll_port == 0 {
        problems.push("scores.poll_port must be the agents' poll_port (default 9137), not 0".into());
    }
    match (&raw.auth, scored) {
        (None, true) => problems.push(
            "policy least-score polls the backends' agents: add an [auth] section with the agents' keys (keys = [{ id = 1, file = \"...\" }]), or mode = \"none\" for agents that take unsigned polls".into(),
        ),
        (Some(a), _) => {
            if let Err(e) = a.validate(true) {
                problems.push(format!("[auth]: {e:#}"));
            }
        }
        (None, false) => {}
    }
}

/// A pool's addresses; `route` names the route in messages ("" for the
/// top-level pool).
pub(crate) fn pool_addrs(route: &str, list: &[String], problems: &mut Vec<String>) -> Vec<SocketAddr> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for b in list {
        match socket_addr(&format!("{route}backend"), b) {
            Ok(a) if !seen.insert(a) => problems.push(format!("{route}backend {b:?} is listed twice: remove the duplicate")),
            Ok(a) => out.push(a),
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    out
}

pub(crate) fn parse_hash_key(route: &str, k: &str, problems: &mut Vec<String>) -> Option<HashKey> {
    match k {
        "path" => Some(HashKey::Path),
        "client" => Some(HashKey::ClientAddr),
        k => match k.strip_prefix("header:").map(|h| http::HeaderName::from_bytes(h.as_bytes())) {
            Some(Ok(h)) => Some(HashKey::Header(h)),
            _ => {
                problems.push(format!("{route}hash_key {k:?}: use \"path\", \"client\" or \"header:NAME\""));
                None
            }
        },
    }
}

pub(crate) fn check_health(route: &str, h: &HttpCheckConfig, problems: &mut Vec<String>) {
    if !h.path.starts_with('/') {
        problems.push(format!("{route}health.path {:?} must start with /", h.path));
    }
    if h.interval_ms == 0 || h.timeout_ms == 0 || h.unhealthy_after == 0 || h.healthy_after == 0 {
        problems.push(format!("{route}health: interval_ms, timeout_ms, unhealthy_after and healthy_after must be above 0"));
    }
}

// ---- [[route]] tables, checked (crates/inband-proxy/src/routes.rs uses them)

/// The route label of the top-level pool.
pub const DEFAULT_ROUTE: &str = "default";

/// Routes a config may have: each is a `route` label value on a few
/// metric families, so this bounds their series.
pub const MAX_ROUTES: usize = 256;

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
    pub fn rank(&self, host: &str) -> Option<usize> {
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

    pub fn is_empty(&self) -> bool {
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
    pub protocol: BackendProtocol,
    pub backend_tls: Option<BackendTlsConfig>,
    pub cache: bool,
    pub max_object_bytes: Option<u64>,
    pub request_headers: Rewrite,
    pub response_headers: Rewrite,
    /// Requests a second and burst.
    pub rate_limit: Option<(f64, f64)>,
}

/// Checks every `[[route]]`, adding what is wrong to `problems`.
pub fn check_routes(raw: &Config, problems: &mut Vec<String>) -> Vec<RouteSpec> {
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
        if let Some(t) = &r.backend_tls {
            t.check(&at, problems);
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
            protocol: r.backend_protocol,
            backend_tls: r.backend_tls.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]").unwrap();
        assert_eq!(c.raw.policy, PolicyKind::RoundRobin);
        assert_eq!(c.hash_key, HashKey::Path);
        assert_eq!(c.raw.retries, 2);
        assert!(c.raw.cache.is_none());
    }

    #[test]
    fn refuses_with_a_message_per_problem() {
        let e = parse("listen = \"nowhere\"\nbackends = [\"127.0.0.1:1\", \"127.0.0.1:1\", \"x:80\"]\nhash_key = \"cookie\"")
            .unwrap_err();
        let msg = format!("{e:#}");
        for want in ["listen \"nowhere\"", "listed twice", "backend \"x:80\"", "hash_key \"cookie\""] {
            assert!(msg.contains(want), "{want:?} missing in {msg}");
        }
    }

    #[test]
    fn refuses_unknown_keys_and_empty_pools() {
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\nretry = 3").unwrap_err();
        assert!(format!("{e:#}").contains("unknown field `retry`"), "{e:#}");
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = []").unwrap_err();
        assert!(format!("{e:#}").contains("backends is empty"), "{e:#}");
    }

    #[test]
    fn every_syntax_and_type_error_is_reported_at_once() {
        let text = "listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\nretries = \"many\"\nbogus = 1\nidle_timeout_ms = = 3\n[cache]\nset_cookie = \"keep\"\n";
        let msg = format!("{:#}", parse(text).unwrap_err());
        for want in ["line 3:", "line 4: unknown field `bogus`", "line 5:", "line 7: unknown variant `keep`"] {
            assert!(msg.contains(want), "{want:?} missing in {msg}");
        }
    }

    #[test]
    fn tls_section_is_checked_with_the_rest() {
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[tls]\nlisten = \"[::1]:8443\"\n[[tls.certificate]]\ncert = \"a.pem\"\nkey = \"a.key\"\n").unwrap();
        assert_eq!(c.tls_listen, Some("[::1]:8443".parse().unwrap()));
        assert_eq!(c.raw.tls.unwrap().certificate[0].key, PathBuf::from("a.key"));
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = []\n[tls]\nlisten = \"localhost:443\"\ncertificate = []\n").unwrap_err();
        let msg = format!("{e:#}");
        for want in ["backends is empty", "tls.listen \"localhost:443\"", "at least one [[tls.certificate]]"] {
            assert!(msg.contains(want), "{want:?} missing in {msg}");
        }
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[tls]\nlisten = \"127.0.0.1:0\"\n[[tls.certificate]]\ncert = \"a.pem\"\n").unwrap_err();
        assert!(format!("{e:#}").contains("missing field `key`"), "{e:#}");
    }

    #[test]
    fn upgrade_protocols() {
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]").unwrap();
        assert_eq!(c.upgrade_allow, UpgradeAllow::Only(vec!["websocket".into()]));
        assert!(c.upgrade_allow.allows("WebSocket") && !c.upgrade_allow.allows("h2c"));
        assert_eq!(c.tunnel_idle_timeout(), Duration::from_millis(60_000));
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[upgrade]\nprotocols = [\"Foo/2\", \"bar\"]\nidle_timeout_ms = 5").unwrap();
        assert!(c.upgrade_allow.allows("foo/2") && !c.upgrade_allow.allows("foo/3") && !c.upgrade_allow.allows("foo"));
        assert!(c.upgrade_allow.allows("bar/1") && c.upgrade_allow.allows("BAR"));
        assert_eq!(c.tunnel_idle_timeout(), Duration::from_millis(5));
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[upgrade]\nprotocols = [\"*\"]").unwrap();
        assert!(c.upgrade_allow.allows("anything/1"));
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[upgrade]\nprotocols = []").unwrap();
        assert!(!c.upgrade_allow.allows("websocket"));
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[upgrade]\nprotocols = [\"web socket\", \"a/\"]\nidle_timeout_ms = 0").unwrap_err();
        let msg = format!("{e:#}");
        for want in ["\"web socket\" is not a protocol name", "\"a/\" is not", "upgrade.idle_timeout_ms must be above 0"] {
            assert!(msg.contains(want), "{want:?} missing in {msg}");
        }
    }

    /// The whole example in docs/proxy.md "Configuration" is a config the
    /// proxy takes, routes included.
    #[test]
    fn the_documented_example_parses() {
        let doc = include_str!("../../../docs/proxy.md");
        let section = &doc[doc.find("\n## Configuration").unwrap()..];
        let start = section.find("```toml\n").unwrap() + 8;
        let example = &section[start..start + section[start..].find("```").unwrap()];
        // The one file the config check reads is the [tcpe] key: one made
        // here stands in for the documented path.
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("tcpe.key");
        inband_core::auth::keygen(&key).unwrap();
        let example = example.replace("/etc/inband/tcpe.key", key.to_str().unwrap());
        let c = parse(&example).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(c.tcpe.is_some(), "the example's [tcpe] was not taken");
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.routes[0].health.as_ref().map(|h| h.path.as_str()), Some("/healthz"));
        assert_eq!(c.routes[0].rate_limit, Some((50.0, 100.0)));
    }

    #[test]
    fn least_score_needs_auth_and_bounded_polls() {
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\npolicy = \"least-score\"\n[scores]\ninterval_ms = 0\nstale_after = 0\n").unwrap_err();
        let msg = format!("{e:#}");
        for want in ["add an [auth] section", "scores.interval_ms = 0", "scores.stale_after = 0"] {
            assert!(msg.contains(want), "{want:?} missing in {msg}");
        }
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\npolicy = \"least-score\"\n[auth]\n").unwrap_err();
        assert!(format!("{e:#}").contains("[auth]: no auth key configured"), "{e:#}");
        let c = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\npolicy = \"least-score\"\n[auth]\nmode = \"none\"\n").unwrap();
        assert_eq!((c.raw.scores.poll_port, c.raw.scores.interval_ms, c.raw.scores.stale_after), (9137, 20, 5));
        assert_eq!(c.raw.scores.valid_for(), Duration::from_millis(100));
        // Only a pool that ranks by score needs keys.
        parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\npolicy = \"least-request\"\n").unwrap();
    }

    #[test]
    fn transparent_moves_need_the_balancers_key_and_their_port() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k");
        inband_core::auth::keygen(&key).unwrap();
        let base = format!(
            "listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[tcpe]\nkey = \"{k}\"\n[[tcpe.server]]\nbackend = \"127.0.0.1:1\"\ncontrol = \"127.0.0.1:2\"\njoin = \"127.0.0.1:3\"\n",
            k = key.display()
        );
        let e = parse(&format!("{base}[tcpe.transparent]\nagent_pins = \"pins\"\nbalancer_port = 0\n")).unwrap_err();
        let msg = format!("{e:#}");
        for want in ["agent_pins \"pins\" must be an absolute path", "balancer_port must be", "add an [auth] section"] {
            assert!(msg.contains(want), "{want:?} missing in {msg}");
        }
        let auth = |mode: &str| format!("[auth]\nmode = \"{mode}\"\n");
        let e = parse(&format!("{base}[tcpe.transparent]\nagent_pins = \"/p\"\nbalancer_port = 7156\n{}", auth("none"))).unwrap_err();
        assert!(format!("{e:#}").contains("moves are signed"), "{e:#}");
        let ok = format!(
            "{base}[tcpe.transparent]\nagent_pins = \"/p\"\nbalancer_port = 7156\n[auth]\nkeys = [{{ id = 3, file = \"{}\" }}]\n",
            key.display()
        );
        let t = parse(&ok).unwrap().tcpe.unwrap().transparent.unwrap();
        assert_eq!((t.agent_pins, t.balancer_port, t.key), (PathBuf::from("/p"), 7156, (3, inband_core::auth::read_key(&key).unwrap())));
        // Without the subsection, no moves.
        assert!(parse(&format!("{base}")).unwrap().tcpe.unwrap().transparent.is_none());
        // A server's IPv6 address for IPv6 connections: IPv6, or refused.
        let six = |b6: &str| base.replace("join = \"127.0.0.1:3\"\n", &format!("join = \"127.0.0.1:3\"\nbackend6 = \"{b6}\"\n"));
        let servers = parse(&six("[fd00::21]:8080")).unwrap().tcpe.unwrap().servers;
        assert_eq!(servers[&"127.0.0.1:1".parse().unwrap()].2, Some("[fd00::21]:8080".parse().unwrap()));
        let e = parse(&six("10.0.0.21:8080")).unwrap_err();
        assert!(format!("{e:#}").contains("backend6 \"10.0.0.21:8080\" is not an IPv6 address"), "{e:#}");
    }

    #[test]
    fn durable_cache_needs_a_path() {
        let e = parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[cache]\nbackend = \"lmdb\"").unwrap_err();
        assert!(format!("{e:#}").contains("needs cache.path"), "{e:#}");
    }
}

//! The registry of the proxy's metrics endpoint (prometheus-client; served
//! by inband-http).

use std::time::Duration;

use http::StatusCode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::backend::Backend;
use crate::cache_outcome::Outcome;
use crate::conn::Expiry;
use crate::http2_guard::Abuse;
use crate::interim::Fate;
use crate::upgrade::{Close, Upgrade};

pub(crate) type Labels = Vec<(&'static str, String)>;

/// Requests the proxy answered itself, by why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Malformed request line or headers (400, written by hyper).
    BadRequest,
    /// HTTP/1.1 without Host, or two Host headers (400).
    BadHost,
    /// `only-if-cached` and nothing stored to answer with (504).
    NotCached,
    /// Request head over `max_header_bytes` (431, written by hyper).
    HeadersTooLarge,
    /// Body over `max_body_bytes` (413).
    BodyTooLarge,
    /// Body not complete within `client_body_timeout_ms` (408).
    BodyTimeout,
    /// No backend is healthy (503).
    NoHealthyBackend,
    /// Every attempt failed to connect or broke off (502).
    BackendDown,
    /// No response head within `backend_timeout_ms` (504).
    BackendTimeout,
    /// The client is over `[client_limits] requests_per_s` (429).
    ClientRate,
    /// A 101 to a request that offered no upgrade, or switching to a
    /// protocol the request did not offer (502).
    BackendBadUpgrade,
    /// No `[[route]]` matches and there is no default pool (404).
    NoRoute,
    /// The client is over its route's `rate_limit` (429).
    RouteRate,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::BadRequest => "bad_request",
            Refusal::BadHost => "bad_host",
            Refusal::NotCached => "only_if_cached",
            Refusal::HeadersTooLarge => "headers_too_large",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::NoHealthyBackend => "no_healthy_backend",
            Refusal::BackendDown => "backend_down",
            Refusal::BackendTimeout => "backend_timeout",
            Refusal::ClientRate => "client_rate",
            Refusal::BackendBadUpgrade => "backend_bad_upgrade",
            Refusal::NoRoute => "no_route",
            Refusal::RouteRate => "route_rate",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Refusal::BadRequest | Refusal::BadHost => StatusCode::BAD_REQUEST,
            Refusal::NotCached => StatusCode::GATEWAY_TIMEOUT,
            Refusal::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Refusal::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Refusal::NoHealthyBackend => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::BackendDown | Refusal::BackendBadUpgrade => StatusCode::BAD_GATEWAY,
            Refusal::BackendTimeout => StatusCode::GATEWAY_TIMEOUT,
            Refusal::ClientRate | Refusal::RouteRate => StatusCode::TOO_MANY_REQUESTS,
            Refusal::NoRoute => StatusCode::NOT_FOUND,
        }
    }
}

pub struct Metrics {
    registry: Registry,
    refusals: Family<Labels, Counter>,
    route_requests: Family<Labels, Counter>,
    route_refusals: Family<Labels, Counter>,
    origin_requests: Family<Labels, Counter>,
    ejection_overridden: Family<Labels, Counter>,
    backend_tls_errors: Family<Labels, Counter>,
    backend_resent: Family<Labels, Counter>,
    hedges: Family<Labels, Counter>,
    hedges_won: Family<Labels, Counter>,
    score_polls: Family<Labels, Counter>,
    score_stale: Family<Labels, Counter>,
    score_replies_unauthenticated: Counter,
    backend_score: Family<Labels, Gauge>,
    pub request_bytes: Counter,
    pub response_bytes: Counter,
    latency: Histogram,
    backend_up: Family<Labels, Gauge>,
    cache_store: Family<Labels, Gauge>,
    pub connections: Gauge,
    worker_connections: Family<Labels, Gauge>,
    worker_busy: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    accept_errors: Counter,
    /// Connections a worker accepted and handed to the one packing chose
    /// (the kernel's steering was behind a burst, or could not be set).
    connections_handed_over: Counter,
    /// Connections closed at once: their client had `[client_limits]
    /// connections` open already.
    client_connections_refused: Counter,
    pub clients_untracked: Counter,
    tls_handshake_errors: Counter,
    tls_reloads: Family<Labels, Counter>,
    tls_expiry: Family<Labels, Gauge>,
    connection_timeouts: Family<Labels, Counter>,
    http2_abuse: [Counter; Abuse::ALL.len()],
    upgrades: [Counter; Upgrade::ALL.len()],
    /// Interim (1xx) responses of origins, by fate (the relay counts).
    pub interim: [Counter; Fate::ALL.len()],
    pub tunnels_open: Gauge,
    tunnel_closes: [Counter; Close::ALL.len()],
    /// Bytes read from the client, and from the backend.
    pub tunnel_bytes: [Counter; 2],
    /// Handles into `requests` and `cache` for the per-request path: a
    /// family lookup hashes a label set under a lock.
    by_class: [Counter; 5],
    by_outcome: [Counter; Outcome::ALL.len()],
    pub compression: crate::compression::Counters,
    pub ranges: crate::ranges::Counters,
    /// By `inband_tcpe::handoff::COUNTERS` then
    /// `inband_tcpe::transparent::COUNTERS`, set from their counters at
    /// each scrape.
    tcpe_handoffs: Vec<Counter>,
    tcpe_kept: [Counter; crate::tcpe_kept::Kept::ALL.len()],
    /// By `inband_tcpe::sockops::COUNTERS`, set from the sockops
    /// program's counter map at each scrape.
    tcpe_options: Vec<Counter>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("inband_proxy");
        let requests = Family::<Labels, Counter>::default();
        let refusals = Family::<Labels, Counter>::default();
        let origin_requests = Family::<Labels, Counter>::default();
        let ejection_overridden = Family::<Labels, Counter>::default();
        let score_polls = Family::<Labels, Counter>::default();
        let score_stale = Family::<Labels, Counter>::default();
        let score_replies_unauthenticated = Counter::default();
        let backend_score = Family::<Labels, Gauge>::default();
        registry.register("score_polls", "Score polls of least-score backends' agents by result: answered, unanswered (no authentic reply within the interval), send_failed", score_polls.clone());
        registry.register(
            "score_stale",
            "Times a least-score backend's score went stale (no answer for scores.stale_after intervals): it is ranked by requests in flight alone until its agent answers",
            score_stale.clone(),
        );
        registry.register("score_replies_unauthenticated", "Score poll replies refused: the other [auth] mode, an unknown key or a MAC that does not verify", score_replies_unauthenticated.clone());
        registry.register("backend_score", "A least-score backend's last score from its agent, -1 while stale", backend_score.clone());
        let backend_tls_errors = Family::<Labels, Counter>::default();
        let backend_resent = Family::<Labels, Counter>::default();
        registry.register(
            "backend_tls_errors",
            "TLS handshakes with a backend that failed: a certificate that does not verify, no common version, the pool's ALPN protocol refused",
            backend_tls_errors.clone(),
        );
        registry.register(
            "backend_resent",
            "Requests an HTTP/2 backend refused unprocessed (REFUSED_STREAM, GOAWAY, its connection closed) and sent again on a new connection",
            backend_resent.clone(),
        );
        let hedges = Family::<Labels, Counter>::default();
        let hedges_won = Family::<Labels, Counter>::default();
        registry.register(
            "hedges",
            "GET and HEAD requests also sent to a second backend because a new score made this one (the first) busy: scores.busy_margin above the least loaded",
            hedges.clone(),
        );
        registry.register("hedges_won", "Hedged requests whose answer came first from the second backend (labelled by the first)", hedges_won.clone());
        let request_bytes = Counter::default();
        let response_bytes = Counter::default();
        // 0.5 ms .. ~16 s: a cache hit on loopback to a slow origin.
        let latency = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let backend_up = Family::<Labels, Gauge>::default();
        registry.register("requests", "Responses to clients by status class", requests.clone());
        registry.register("refusals", "Requests answered by the proxy itself, by reason", refusals.clone());
        let route_requests = Family::<Labels, Counter>::default();
        let route_refusals = Family::<Labels, Counter>::default();
        registry.register("route_requests", "Requests by the route that took them (`default`: the top-level backends)", route_requests.clone());
        registry.register("route_refusals", "Requests answered by the proxy itself after a route was chosen, by route and reason (also in refusals)", route_refusals.clone());
        registry.register("origin_requests", "Requests sent to backends, every attempt counted, health checks not", origin_requests.clone());
        registry.register(
            "ejection_overridden",
            "Requests sent to a passively ejected backend because every backend passing its health checks was ejected",
            ejection_overridden.clone(),
        );
        registry.register("request_body_bytes", "Request body bytes received from clients", request_bytes.clone());
        registry.register("response_body_bytes", "Response body bytes sent to clients", response_bytes.clone());
        registry.register("request_duration_seconds", "Time from request head to response head (the access log has the time to the last byte too)", latency.clone());
        registry.register(
            "backend_up",
            "1 when the backend passes its health checks and is not passively ejected (when every backend passing its checks is ejected, they all take requests: ejection_overridden)",
            backend_up.clone(),
        );
        let cache = Family::<Labels, Counter>::default();
        let cache_store = Family::<Labels, Gauge>::default();
        registry.register("cache", "GET requests through the cache by outcome", cache.clone());
        registry.register("cache_store", "The cache store: entries, bytes, capacity_bytes, corrupt, evictions", cache_store.clone());
        let connections = Gauge::default();
        let accept_errors = Counter::default();
        let connections_handed_over = Counter::default();
        let client_connections_refused = Counter::default();
        let clients_untracked = Counter::default();
        let connection_timeouts = Family::<Labels, Counter>::default();
        let tls_handshake_errors = Counter::default();
        let tls_reloads = Family::<Labels, Counter>::default();
        let tls_expiry = Family::<Labels, Gauge>::default();
        registry.register("tls_certificate_expiry_timestamp_seconds", "notAfter of each certificate in use, by its file, in seconds since the epoch", tls_expiry.clone());
        registry.register("tls_handshake_errors", "TLS handshakes that failed (malformed records, no common version or cipher); those that ran out of time are connection_timeouts", tls_handshake_errors.clone());
        registry.register("tls_reloads", "Certificate reloads (SIGHUP) by result: ok, or failed and the previous certificates kept", tls_reloads.clone());
        registry.register("connections", "Client connections open", connections.clone());
        let worker_connections = Family::<Labels, Gauge>::default();
        let worker_busy = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register("worker_connections", "Client connections open on each worker thread", worker_connections.clone());
        registry.register("worker_busy_ratio", "Share of the last 100 ms each worker thread spent running tasks", worker_busy.clone());
        registry.register("accept_errors", "Failed accepts (out of file descriptors and the like), each followed by a backoff", accept_errors.clone());
        registry.register(
            "connections_handed_over",
            "Client connections accepted by one worker and served by another that packing chose (steering was behind, e.g. in a burst)",
            connections_handed_over.clone(),
        );
        registry.register("client_connections_refused", "Connections closed at once because their client held [client_limits] connections already", client_connections_refused.clone());
        registry.register("clients_untracked", "New clients served without per-client limits because the client table was full", clients_untracked.clone());
        registry.register("connection_timeouts", "Client connections closed by a timeout: header, idle or send", connection_timeouts.clone());
        for e in [Expiry::Header, Expiry::Idle, Expiry::Send] {
            let _ = connection_timeouts.get_or_create(&vec![("kind", e.label().to_string())]);
        }
        let http2_abuse = Family::<Labels, Counter>::default();
        registry.register(
            "http2_abuse",
            "HTTP/2 client connections ended for abuse, by kind: ping, settings, reset, priority (floods over client_http2.control_frames_per_s or h2's limit on resets), continuation, header_list, stream_errors, small_data, other (h2's ENHANCE_YOUR_CALM limits)",
            http2_abuse.clone(),
        );
        let http2_abuse = Abuse::ALL.map(|a| http2_abuse.get_or_create(&vec![("kind", a.label().to_string())]).clone());
        let upgrades = Family::<Labels, Counter>::default();
        let tunnels_open = Gauge::default();
        let tunnel_closes = Family::<Labels, Counter>::default();
        let tunnel_bytes = Family::<Labels, Counter>::default();
        registry.register("upgrades", "HTTP/1.1 requests with Upgrade by outcome: switched (101 forwarded), declined by the backend (its answer forwarded), not_allowed (sent on without Upgrade), failed (no usable answer)", upgrades.clone());
        registry.register("tunnels_open", "Upgraded connections (WebSocket and the like) open", tunnels_open.clone());
        registry.register("tunnel_closes", "Tunnels closed by reason: ended (both sides closed), error, idle or send (timeouts)", tunnel_closes.clone());
        registry.register("tunnel_bytes", "Bytes carried through tunnels, by the side they came from", tunnel_bytes.clone());
        let upgrades = Upgrade::ALL.map(|u| upgrades.get_or_create(&vec![("outcome", u.label().to_string())]).clone());
        let interim = Family::<Labels, Counter>::default();
        registry.register(
            "interim_responses",
            "Interim (1xx) responses of HTTP/1.1 origins by outcome: forwarded to the HTTP/1.1 client ahead of the final response, dropped (the connection was mid-write, the request had ended, or too many bytes waited)",
            interim.clone(),
        );
        let interim = Fate::ALL.map(|f| interim.get_or_create(&vec![("outcome", f.label().to_string())]).clone());
        let tunnel_closes = Close::ALL.map(|c| tunnel_closes.get_or_create(&vec![("reason", c.label().to_string())]).clone());
        let tunnel_bytes = ["client", "backend"].map(|f| tunnel_bytes.get_or_create(&vec![("from", f.to_string())]).clone());
        // Every outcome exported from the start, so a rate() sees its 0.
        let by_outcome = Outcome::ALL.map(|o| cache.get_or_create(&vec![("result", o.label().to_string())]).clone());
        let by_class = [1, 2, 3, 4, 5].map(|c| requests.get_or_create(&vec![("class", format!("{c}xx"))]).clone());
        let tcpe_handoffs = Family::<Labels, Counter>::default();
        let tcpe_kept = Family::<Labels, Counter>::default();
        registry.register(
            "tcpe_handoffs",
            "First requests of TCPE-capable connections (and plain connections, as fallback_not_capable) by what the handoff did: handed_off, or the fallback_* reason it was proxied for. With [tcpe.transparent], plain connections by what the move did: moved, or the move_fallback_* reason; move_lost: switched at the balancer, the server not told",
            tcpe_handoffs.clone(),
        );
        registry.register(
            "tcpe_kept",
            "First requests of TCPE connections proxied without trying a handoff, by the proxy's rule that kept them: not_simple, cached, route, limits, no_backend, no_server",
            tcpe_kept.clone(),
        );
        let tcpe_options = Family::<Labels, Counter>::default();
        registry.register(
            "tcpe_options",
            "What the TCPE sockops program on the proxy's cgroup did with the options of its connections, by event (docs/proxy.md \"Connection handoff\"): offers answered, notifications written, and every fallback and refusal (path_bad_mac: a forged notification)",
            tcpe_options.clone(),
        );
        let tcpe_options = inband_tcpe::sockops::COUNTERS.iter().map(|(n, _)| tcpe_options.get_or_create(&vec![("event", n.to_string())]).clone()).collect();
        let tcpe_handoffs = inband_tcpe::handoff::COUNTERS
            .iter()
            .chain(inband_tcpe::transparent::COUNTERS)
            .map(|(n, _)| tcpe_handoffs.get_or_create(&vec![("result", n.to_string())]).clone())
            .collect();
        let tcpe_kept = crate::tcpe_kept::Kept::ALL.map(|k| tcpe_kept.get_or_create(&vec![("reason", k.label().to_string())]).clone());
        let compression = crate::compression::Counters::register(&mut registry);
        let ranges = crate::ranges::Counters::register(&mut registry);
        Metrics {
            registry,
            refusals,
            route_requests,
            route_refusals,
            origin_requests,
            ejection_overridden,
            backend_tls_errors,
            backend_resent,
            hedges,
            hedges_won,
            score_polls,
            score_stale,
            score_replies_unauthenticated,
            backend_score,
            request_bytes,
            response_bytes,
            latency,
            backend_up,
            cache_store,
            connections,
            worker_connections,
            worker_busy,
            accept_errors,
            connections_handed_over,
            client_connections_refused,
            clients_untracked,
            tls_handshake_errors,
            tls_reloads,
            tls_expiry,
            connection_timeouts,
            http2_abuse,
            upgrades,
            interim,
            tunnels_open,
            tunnel_closes,
            tunnel_bytes,
            by_class,
            by_outcome,
            compression,
            ranges,
            tcpe_handoffs,
            tcpe_kept,
            tcpe_options,
        }
    }

    pub fn tcpe_kept(&self, k: crate::tcpe_kept::Kept) {
        self.tcpe_kept[k as usize].inc();
    }

    /// The handoff routine keeps its own counts (inband-tcpe's `Counters`);
    /// the exported counters take their values.
    pub fn set_tcpe_handoffs(&self, handoffs: &inband_tcpe::relay::Counters, moves: &inband_tcpe::relay::Counters) {
        for (counter, (_, v)) in self.tcpe_handoffs.iter().zip(handoffs.all().into_iter().chain(moves.all())) {
            counter.inner().store(v, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The sockops program's counters (summed over CPUs), in the order of
    /// `inband_tcpe::sockops::COUNTERS`.
    pub fn set_tcpe_options(&self, values: &[(&'static str, u64)]) {
        for (counter, (_, v)) in self.tcpe_options.iter().zip(values) {
            counter.inner().store(*v, std::sync::atomic::Ordering::Relaxed);
        }
    }

    pub fn accept_error(&self) {
        self.accept_errors.inc();
    }

    pub fn connection_handed_over(&self) {
        self.connections_handed_over.inc();
    }

    pub fn client_connection_refused(&self) {
        self.client_connections_refused.inc();
    }

    pub fn tls_handshake_error(&self) {
        self.tls_handshake_errors.inc();
    }

    pub fn tls_reload(&self, ok: bool) {
        self.tls_reloads.get_or_create(&vec![("result", if ok { "ok" } else { "failed" }.to_string())]).inc();
    }

    /// A header timeout with bytes sent got a 408: it counts as a response.
    pub fn connection_timeout(&self, e: Expiry) {
        self.connection_timeouts.get_or_create(&vec![("kind", e.label().to_string())]).inc();
        if e == Expiry::Header {
            self.by_class[3].inc();
        }
    }

    pub fn http2_abuse(&self, a: Abuse) {
        self.http2_abuse[Abuse::ALL.iter().position(|x| *x == a).expect("ALL has every kind")].inc();
    }

    pub fn upgrade(&self, u: Upgrade) {
        self.upgrades[u as usize].inc();
    }

    pub fn tunnel_close(&self, c: Close) {
        self.tunnel_closes[c as usize].inc();
    }

    pub fn response(&self, status: StatusCode, took: Duration) {
        let class = (status.as_u16() / 100).clamp(1, 5) as usize - 1;
        self.by_class[class].inc();
        self.latency.observe(took.as_secs_f64());
    }

    /// A 400 or 431 hyper wrote before the request reached the proxy.
    pub fn refused_by_parser(&self, r: Refusal) {
        self.by_class[3].inc();
        self.refusal(r);
    }

    pub fn refusal(&self, r: Refusal) {
        self.refusals.get_or_create(&vec![("reason", r.label().to_string())]).inc();
    }

    pub fn origin_request(&self, b: &Backend) {
        self.origin_requests.get_or_create(&b.labels).inc();
    }

    /// Every per-backend counter exported from the start, so a rate()
    /// sees its 0 and a dashboard its series.
    pub fn add_backend(&self, b: &Backend) {
        drop(self.origin_requests.get_or_create(&b.labels));
        drop(self.ejection_overridden.get_or_create(&b.labels));
        drop(self.backend_tls_errors.get_or_create(&b.labels));
        drop(self.backend_resent.get_or_create(&b.labels));
        drop(self.hedges.get_or_create(&b.labels));
        drop(self.hedges_won.get_or_create(&b.labels));
    }

    pub fn backend_tls_error(&self, b: &Backend) {
        self.backend_tls_errors.get_or_create(&b.labels).inc();
    }

    pub fn backend_resent(&self, b: &Backend) {
        self.backend_resent.get_or_create(&b.labels).inc();
    }

    pub fn hedge(&self, from: &Backend) {
        self.hedges.get_or_create(&from.labels).inc();
    }

    pub fn hedge_won(&self, from: &Backend) {
        self.hedges_won.get_or_create(&from.labels).inc();
    }

    /// Counted for each pool's entry of the backend, so a route's series
    /// are complete.
    pub fn score_poll(&self, backends: &[std::sync::Arc<Backend>], result: &str) {
        for b in backends {
            let mut l = b.labels.clone();
            l.push(("result", result.to_string()));
            self.score_polls.get_or_create(&l).inc();
        }
    }

    pub fn score_stale(&self, backends: &[std::sync::Arc<Backend>]) {
        for b in backends {
            self.score_stale.get_or_create(&b.labels).inc();
        }
    }

    pub fn score_reply_unauthenticated(&self) {
        self.score_replies_unauthenticated.inc();
    }

    pub fn set_backend_score(&self, b: &Backend, score: Option<u32>) {
        self.backend_score.get_or_create(&b.labels).set(score.map_or(-1, i64::from));
    }

    /// A least-score backend's series, exported from the start.
    pub fn add_scored_backend(&self, b: &Backend) {
        for r in ["answered", "unanswered", "send_failed"] {
            let mut l = b.labels.clone();
            l.push(("result", r.to_string()));
            drop(self.score_polls.get_or_create(&l));
        }
        drop(self.score_stale.get_or_create(&b.labels));
    }

    pub fn ejection_overridden(&self, b: &Backend) {
        self.ejection_overridden.get_or_create(&b.labels).inc();
    }

    /// A route's request counter, exported from the start; the route keeps
    /// the handle, so counting takes no family lookup.
    pub fn route_requests(&self, route: &str) -> Counter {
        self.route_requests.get_or_create(&vec![("route", route.to_string())]).clone()
    }

    pub fn route_refusal(&self, route: &str, r: Refusal) {
        self.route_refusals.get_or_create(&vec![("route", route.to_string()), ("reason", r.label().to_string())]).inc();
    }

    pub fn set_tls_expiry(&self, cert_file: &str, not_after: u64) {
        self.tls_expiry.get_or_create(&vec![("cert", cert_file.to_string())]).set(not_after as i64);
    }

    pub fn set_backend_up(&self, b: &Backend, up: bool) {
        self.backend_up.get_or_create(&b.labels).set(up as i64);
    }

    pub fn cache(&self, o: Outcome) {
        self.by_outcome[o as usize].inc();
    }

    pub fn set_cache_store(&self, s: &inband_cache::Stats) {
        for (what, v) in [
            ("entries", s.entries),
            ("bytes", s.size_bytes),
            ("capacity_bytes", s.capacity_bytes),
            ("corrupt", s.corrupt),
            ("evictions", s.evictions),
        ] {
            self.cache_store.get_or_create(&vec![("what", what.to_string())]).set(v as i64);
        }
    }

    pub fn set_worker_load(&self, worker: usize, open: usize, busy_permille: u32) {
        let labels = vec![("worker", worker.to_string())];
        self.worker_connections.get_or_create(&labels).set(open as i64);
        self.worker_busy.get_or_create(&labels).set(f64::from(busy_permille) / 1000.0);
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

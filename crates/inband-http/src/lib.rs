//! The one HTTP server of inband's `/metrics` and status endpoints (`inband
//! lb`, `inband mesh`, `inband proxy`) and the one way they encode
//! Prometheus metrics (prometheus-client, OpenMetrics text: every family
//! with `# HELP` and `# TYPE`, counters ending in `_total`).
//!
//! hyper's HTTP/1.1 server, the one the proxy serves its clients with:
//! keep-alive, HEAD and bad requests handled by a maintained parser, and a
//! stalled scraper bounded by timeouts. A handler gets the request's path
//! and returns a whole [`Reply`]: every endpoint here renders a small
//! document at once.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::{DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};

pub use hyper::StatusCode;

/// What Prometheus asks for first and prometheus-client writes.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A scraper that stalls must not hold a descriptor for ever.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: Bytes,
}

impl Reply {
    /// The registry in OpenMetrics text, or a 500 if a value cannot be
    /// encoded (prometheus-client refuses a `u64::MAX` gauge).
    pub fn metrics(registry: &Registry) -> Reply {
        match encode(registry) {
            Ok(text) => Reply { status: StatusCode::OK, content_type: OPENMETRICS, body: text.into() },
            Err(_) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, "a metric could not be encoded\n"),
        }
    }

    pub fn json(body: String) -> Reply {
        Reply { status: StatusCode::OK, content_type: "application/json", body: body.into() }
    }

    pub fn text(status: StatusCode, body: impl Into<String>) -> Reply {
        Reply { status, content_type: "text/plain; charset=utf-8", body: body.into().into() }
    }
}

/// The registry in OpenMetrics text, `# EOF` included.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// Families of numbers read at scrape time (from pinned maps, a snapshot
/// the process does not count itself), written through prometheus-client's
/// collector API: each family gets its `# HELP` and `# TYPE`, and a counter
/// its `_total`, from the same encoder as the proxy's live metrics.
pub struct Families<'a>(pub DescriptorEncoder<'a>);

impl Families<'_> {
    /// A counter family, `name` without `_total` (the encoder adds it).
    pub fn counters<L: EncodeLabelSet, V: EncodeCounterValue>(&mut self, name: &str, help: &str, samples: impl IntoIterator<Item = (L, V)>) -> std::fmt::Result {
        let mut family = self.0.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, v) in samples {
            ConstCounter::new(v).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    pub fn gauges<L: EncodeLabelSet, V: EncodeGaugeValue>(&mut self, name: &str, help: &str, samples: impl IntoIterator<Item = (L, V)>) -> std::fmt::Result {
        let mut family = self.0.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (labels, v) in samples {
            ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// One counter without labels (an empty label set would print `{}`).
    pub fn counter(&mut self, name: &str, help: &str, v: u64) -> std::fmt::Result {
        ConstCounter::new(v).encode(self.0.encode_descriptor(name, help, None, MetricType::Counter)?)
    }

    pub fn gauge(&mut self, name: &str, help: &str, v: impl EncodeGaugeValue) -> std::fmt::Result {
        ConstGauge::new(v).encode(self.0.encode_descriptor(name, help, None, MetricType::Gauge)?)
    }

    /// `bpf_program_runs` and `bpf_program_run_seconds` of `owner`'s
    /// programs, each (name, runs, run time in ns) as the kernel counts
    /// them while run-time statistics are on: the same two families for
    /// the balancer, the agent and the mesh.
    pub fn programs<'p>(&mut self, owner: &str, programs: impl IntoIterator<Item = (&'p str, u64, u64)>) -> std::fmt::Result {
        let labelled: Vec<_> = programs.into_iter().map(|(p, runs, ns)| ([("program", p)], runs, ns)).collect();
        self.programs_labelled(&format!("the {owner}'s"), labelled)
    }

    /// The same two families with labels of the caller's (`program` and
    /// more: the shadow programs are one per interface), `whose` opening
    /// their help.
    pub fn programs_labelled<L: EncodeLabelSet>(&mut self, whose: &str, programs: impl IntoIterator<Item = (L, u64, u64)> + Clone) -> std::fmt::Result {
        self.counters(
            "bpf_program_runs",
            &format!("Runs of {whose} BPF programs, counted by the kernel while bpf_stats is on"),
            programs.clone().into_iter().map(|(l, runs, _)| (l, runs)),
        )?;
        self.counters(
            "bpf_program_run_seconds",
            &format!("Time spent in {whose} BPF programs, counted by the kernel while bpf_stats is on"),
            programs.into_iter().map(|(l, _, ns)| (l, ns as f64 / 1e9)),
        )
    }
}

/// A gauge read from a map as u64: prometheus-client's gauges are signed
/// (and refuse `u64::MAX`), so a value past `i64::MAX` is shown as that.
pub fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// What a scraper needs of an exposition, for the tests of every endpoint:
/// a `# HELP` then a `# TYPE` for every family, declared once; every
/// sample inside the family before it and named as its type says
/// (`_total` for a counter, `_bucket`/`_sum`/`_count` for a histogram), with
/// a number for value; `# EOF` last. (openmetrics-parser 0.5 takes a family
/// with no samples yet, which OpenMetrics allows, as part of the next one.)
pub fn check_exposition(text: &str) -> Result<(), String> {
    let body = text.strip_suffix("# EOF\n").ok_or("no # EOF at the end")?;
    let mut seen = std::collections::HashSet::new();
    let mut family: Option<(&str, &str)> = None;
    let mut lines = body.lines();
    while let Some(line) = lines.next() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').ok_or_else(|| format!("HELP without text: {line}"))?;
            if help.trim().is_empty() || !seen.insert(name) {
                return Err(format!("empty or repeated HELP: {line}"));
            }
            let ty = lines.next().and_then(|l| l.strip_prefix("# TYPE ")).and_then(|t| t.strip_prefix(name)).and_then(|t| t.strip_prefix(' '));
            let ty = ty.ok_or_else(|| format!("no # TYPE {name} right after its HELP"))?;
            family = Some((name, ty));
            continue;
        }
        if line.starts_with('#') {
            return Err(format!("a comment outside HELP/TYPE/EOF: {line}"));
        }
        let (series, value) = line.rsplit_once(' ').ok_or_else(|| format!("no value: {line}"))?;
        value.parse::<f64>().map_err(|_| format!("not a number: {line}"))?;
        let name = series.split('{').next().unwrap_or(series);
        let (fam, ty) = family.ok_or_else(|| format!("a sample before any TYPE: {line}"))?;
        let suffixes: &[&str] = match ty {
            "counter" => &["_total"],
            "gauge" | "unknown" => &[""],
            "histogram" => &["_bucket", "_sum", "_count"],
            "info" => &["_info"],
            other => return Err(format!("type {other} of {fam}")),
        };
        if !suffixes.iter().any(|s| name.strip_prefix(fam) == Some(s)) {
            return Err(format!("{name} is not a sample of the {ty} {fam}: {line}"));
        }
    }
    Ok(())
}

type Handler = Arc<dyn Fn(&str) -> Reply + Send + Sync>;

/// Serves `GET`/`HEAD` on `listener` with `handler` (given the path) until
/// the future is dropped; connections are tasks of the current runtime.
pub async fn serve(listener: TcpListener, handler: impl Fn(&str) -> Reply + Send + Sync + 'static) {
    let handler: Handler = Arc::new(handler);
    let mut backoff = Backoff::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                backoff.wait(&e, "accept on a metrics endpoint failed").await;
                continue;
            }
        };
        backoff.reset();
        tokio::spawn(connection(handler.clone(), stream));
    }
}

/// Binds `addr` (the error is the caller's) and serves it on a thread of
/// its own with a single-threaded runtime until `until` completes: a
/// handler that reads maps blocks only that thread, and a daemon made of
/// threads (`inband lb`) or whose runtime carries the data path (`inband
/// mesh`) gets an endpoint no scraper can slow. Returns the bound address
/// (so port 0 works) and the thread.
pub fn spawn(
    name: &str,
    addr: SocketAddr,
    handler: impl Fn(&str) -> Reply + Send + Sync + 'static,
    until: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, std::thread::JoinHandle<()>)> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
        rt.block_on(async move {
            match TcpListener::from_std(listener) {
                Ok(l) => tokio::select! {
                    _ = serve(l, handler) => {}
                    _ = until => {}
                },
                Err(e) => tracing::error!(error = %e, "metrics endpoint {bound} not served"),
            }
        })
    })?;
    Ok((bound, thread))
}

async fn connection(handler: Handler, stream: TcpStream) {
    let service = service_fn(move |req: Request<Incoming>| {
        let handler = handler.clone();
        async move { Ok::<_, Infallible>(respond(&handler, &req)) }
    });
    let conn = http1::Builder::new().timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT).serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
}

fn respond(handler: &Handler, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = if req.method() == Method::GET || req.method() == Method::HEAD {
        handler(req.uri().path())
    } else {
        Reply::text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD\n")
    };
    let mut resp = Response::new(Full::new(reply.body));
    *resp.status_mut() = reply.status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    if reply.status == StatusCode::METHOD_NOT_ALLOWED {
        resp.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
    }
    resp
}

/// Out of descriptors (EMFILE, ENFILE) or memory, accept fails at once
/// every time it is called: waiting, doubling up to a second, keeps an
/// accept loop from spinning while connections close.
#[derive(Default)]
pub struct Backoff {
    delay_ms: u64,
}

impl Backoff {
    pub async fn wait(&mut self, e: &std::io::Error, what: &str) {
        self.delay_ms = (self.delay_ms * 2).clamp(10, 1000);
        tracing::warn!(error = %e, retry_in_ms = self.delay_ms, "{what}");
        tokio::time::sleep(Duration::from_millis(self.delay_ms)).await;
    }

    pub fn reset(&mut self) {
        self.delay_ms = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn exchange(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await.expect("the server closed in time").unwrap();
        String::from_utf8(out).unwrap()
    }

    fn handler(path: &str) -> Reply {
        match path {
            "/metrics" => {
                let mut r = Registry::with_prefix("t");
                let c: prometheus_client::metrics::counter::Counter = Default::default();
                c.inc_by(7);
                r.register("hits", "Hits", c);
                Reply::metrics(&r)
            }
            "/status" => Reply::json("{\"ok\":true}".into()),
            _ => Reply::text(StatusCode::NOT_FOUND, "/metrics or /status\n"),
        }
    }

    #[test]
    fn the_check_refuses_what_a_scraper_would() {
        let ok = "# HELP a_x X\n# TYPE a_x counter\na_x_total{k=\"v\"} 1\n# HELP a_e Empty\n# TYPE a_e gauge\n# HELP a_g G\n# TYPE a_g gauge\na_g 0.5\n# EOF\n";
        assert_eq!(check_exposition(ok), Ok(()));
        for (bad, why) in [
            (ok.replace("# EOF\n", ""), "no EOF"),
            (ok.replace("# HELP a_x X\n", ""), "no HELP"),
            (ok.replace("# HELP a_x X\n# TYPE a_x counter\n", ""), "no TYPE"),
            (ok.replace("a_x_total", "a_x"), "a counter without _total"),
            (ok.replace("a_g 0.5", "a_x_total 1"), "a sample outside its family"),
            (ok.replace("a_g 0.5", "a_g x"), "not a number"),
            (ok.replace("# HELP a_g G", "# HELP a_x G"), "a family twice"),
            // What `inband mesh` and `inband lb` wrote before prometheus-client.
            ("inband_mesh_request_kernel_total 2\n".to_string(), "no TYPE, no EOF"),
            ("# TYPE inband_sweeps_total counter\ninband_sweeps_total{interface=\"eth0\"} 9\n# EOF\n".to_string(), "a TYPE without HELP"),
        ] {
            assert!(check_exposition(&bad).is_err(), "{why} passed");
        }
    }

    #[tokio::test]
    async fn serves_paths_keeps_alive_and_refuses_other_methods() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, handler));
        // Two requests on one connection, the second closing it.
        let out = exchange(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert_eq!(out.matches("HTTP/1.1 200 OK").count(), 2, "{out}");
        assert!(out.contains(&format!("content-type: {OPENMETRICS}")), "{out}");
        assert!(out.contains("# HELP t_hits Hits.\n# TYPE t_hits counter\nt_hits_total 7\n# EOF\n"), "{out}");
        assert!(out.contains("content-type: application/json") && out.ends_with("{\"ok\":true}"), "{out}");
        let out = exchange(addr, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(out.starts_with("HTTP/1.1 404 Not Found") && out.ends_with("/metrics or /status\n"), "{out}");
        let out = exchange(addr, "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(out.starts_with("HTTP/1.1 200 OK") && out.ends_with("\r\n\r\n"), "HEAD has no body: {out}");
        let out = exchange(addr, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
        assert!(out.starts_with("HTTP/1.1 405 Method Not Allowed") && out.contains("allow: GET, HEAD"), "{out}");
        let out = exchange(addr, "GARBAGE\r\n\r\n").await;
        assert!(out.starts_with("HTTP/1.1 400 Bad Request"), "{out}");
        server.abort();
    }

    #[test]
    fn a_spawned_server_stops_when_told() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (addr, thread) = spawn("test-metrics", "127.0.0.1:0".parse().unwrap(), handler, async move {
            let _ = rx.await;
        })
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let out = rt.block_on(exchange(addr, "GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        tx.send(()).unwrap();
        thread.join().unwrap();
        assert!(std::net::TcpStream::connect(addr).is_err(), "the listener is closed once stopped");
    }

    #[test]
    fn a_taken_address_is_the_callers_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let err = spawn("test-metrics", taken.local_addr().unwrap(), handler, std::future::pending()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    }

    /// What a snapshot collector writes: HELP and TYPE per family, `_total`
    /// on counters, no `{}` on a sample without labels.
    #[test]
    fn families_write_help_type_and_samples() {
        #[derive(Debug)]
        struct Snap;
        impl prometheus_client::collector::Collector for Snap {
            fn encode(&self, e: DescriptorEncoder) -> std::fmt::Result {
                let mut f = Families(e);
                f.counters("drops", "Packets dropped", [([("reason", "bad")], 3u64), ([("reason", "worse")], 0)])?;
                f.gauge("flows", "Flows now", gauge_value(u64::MAX))?;
                f.counter("sweeps", "Sweeps", 9)?;
                f.gauges("ratio", "A share", [([("k", "a")], 0.5f64)])
            }
        }
        let mut r = Registry::with_prefix("x");
        r.register_collector(Box::new(Snap));
        check_exposition(&encode(&r).unwrap()).unwrap();
        assert_eq!(
            encode(&r).unwrap(),
            "# HELP x_drops Packets dropped\n# TYPE x_drops counter\nx_drops_total{reason=\"bad\"} 3\nx_drops_total{reason=\"worse\"} 0\n\
             # HELP x_flows Flows now\n# TYPE x_flows gauge\nx_flows 9223372036854775807\n\
             # HELP x_sweeps Sweeps\n# TYPE x_sweeps counter\nx_sweeps_total 9\n\
             # HELP x_ratio A share\n# TYPE x_ratio gauge\nx_ratio{k=\"a\"} 0.5\n# EOF\n"
        );
    }
}

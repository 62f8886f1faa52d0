//! How one pool's backends are spoken to: HTTP/1.1 or HTTP/2, in
//! plaintext or over verified TLS (docs/proxy.md "Backend protocols and
//! TLS"). Every worker thread has connections of its own, as a pooled
//! connection is driven by a task on the runtime that opened it.
//!
//! HTTP/1.1 goes through hyper-util's pooled client. HTTP/2 does not: that
//! client takes the connection's address from the request's URI, so the
//! `:authority` a backend sees would be its own address instead of the
//! client's host (RFC 9113 §8.3.1 forbids sending a `Host` that differs
//! from it). Each worker therefore keeps one HTTP/2 connection per
//! backend here, and every request to that backend is a stream on it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::error::Error as StdError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HOST;
use http::uri::{self, Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, ResolveServerName};
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tower_service::Service;

use crate::backend::Backend;
use crate::config::{BackendProtocol, BackendTlsConfig};

/// An HTTP/2 connection whose streams carry requests is pinged this often
/// and dropped when an answer takes `H2_PING_TIMEOUT`: a backend host that
/// vanished without a reset would otherwise hold every request on it for
/// the whole `backend_timeout_ms`.
const H2_PING_INTERVAL: Duration = Duration::from_secs(10);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Idle pooled HTTP/1.1 connections are closed after this long.
const IDLE_POOLED: Duration = Duration::from_secs(60);

/// Why a request did not get a response head from a backend.
#[derive(Debug)]
pub enum Failure {
    /// No connection could be made (refused, unreachable, connect
    /// timeout): the request was not sent.
    Connect(String),
    /// The TLS handshake failed (a certificate that does not verify, no
    /// common version or ALPN protocol): the request was not sent.
    Tls(String),
    /// The backend did not process the request (HTTP/2 REFUSED_STREAM or
    /// a GOAWAY below its stream, RFC 9113 §8.7), also after it was sent
    /// again on a fresh connection.
    NotProcessed,
    /// The request went out and the connection broke before a response
    /// head: the backend may have acted on it.
    Broken(String),
}

impl Failure {
    /// The request is known not to have reached the application.
    pub fn not_sent(&self) -> bool {
        !matches!(self, Failure::Broken(_))
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Connect(e) => write!(f, "connect: {e}"),
            Failure::Tls(e) => write!(f, "TLS: {e}"),
            Failure::NotProcessed => f.write_str("refused unprocessed twice (HTTP/2 REFUSED_STREAM or GOAWAY)"),
            Failure::Broken(e) => write!(f, "{e}"),
        }
    }
}

/// A pool's way to its backends, shared by the workers.
pub struct Transport {
    /// Unique in the process: the key of a worker's connections to the pool.
    id: u64,
    pub protocol: BackendProtocol,
    http: HttpConnector,
    /// With `backend_tls`: the verifying connector.
    tls: Option<HttpsConnector<HttpConnector>>,
}

/// A worker's connections to one pool.
enum Conns {
    Plain(Client<HttpConnector, Full<Bytes>>),
    Tls(Client<HttpsConnector<HttpConnector>, Full<Bytes>>),
    /// By backend index: the backend's one HTTP/2 connection, if open.
    H2(Vec<Arc<tokio::sync::Mutex<Option<H2Conn>>>>),
}

#[derive(Clone)]
struct H2Conn {
    send: SendRequest<Full<Bytes>>,
    /// Tells this connection from the one that replaced it, so a request
    /// that failed on the old one does not drop the new one.
    serial: u64,
}

thread_local! {
    static CONNS: RefCell<HashMap<u64, Arc<Conns>>> = RefCell::new(HashMap::new());
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(0);

impl Transport {
    pub fn new(protocol: BackendProtocol, tls: Option<&BackendTlsConfig>, connect_timeout: Duration) -> anyhow::Result<Transport> {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        // The URI scheme says whether to speak TLS; the connector must not
        // refuse https.
        http.enforce_http(false);
        let tls = match tls {
            Some(t) => {
                let config = crate::tls::backend_client_config(t, protocol)?;
                let resolver: Arc<dyn ResolveServerName + Send + Sync> = match &t.server_name {
                    Some(n) => Arc::new(FixedServerNameResolver::new(
                        rustls::pki_types::ServerName::try_from(n.clone()).map_err(|e| anyhow::anyhow!("backend_tls.server_name {n:?}: {e}"))?,
                    )),
                    // The URI's host: the backend's IP address.
                    None => Arc::new(hyper_rustls::DefaultServerNameResolver::default()),
                };
                Some(HttpsConnector::new(http.clone(), config, true, resolver))
            }
            None => None,
        };
        Ok(Transport { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), protocol, http, tls })
    }

    pub fn scheme(&self) -> Scheme {
        if self.tls.is_some() {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        }
    }

    /// This worker's connections to the pool, made on first use.
    fn conns(&self, backends: usize) -> Arc<Conns> {
        CONNS.with(|c| {
            c.borrow_mut()
                .entry(self.id)
                .or_insert_with(|| {
                    Arc::new(match (self.protocol, &self.tls) {
                        (BackendProtocol::H2, _) => Conns::H2((0..backends).map(|_| Arc::default()).collect()),
                        (BackendProtocol::Http1, None) => Conns::Plain(pooled(self.http.clone())),
                        (BackendProtocol::Http1, Some(t)) => Conns::Tls(pooled(t.clone())),
                    })
                })
                .clone()
        })
    }

    /// Sends a request to backend `i` of a pool of `n`. `req` is the
    /// request as HTTP/1.1 writes it (URI of the backend's address, the
    /// client's `Host`), made again if it must be sent again. `resent` is
    /// called when an HTTP/2 backend refused the request unprocessed and
    /// it went out once more on a fresh connection.
    pub async fn send(
        &self,
        i: usize,
        n: usize,
        b: &Backend,
        req: impl Fn() -> Request<Full<Bytes>>,
        resent: impl FnOnce(),
    ) -> Result<Response<Incoming>, Failure> {
        let conns = self.conns(n);
        match &*conns {
            Conns::Plain(c) => c.request(req()).await.map_err(|e| classify(&e, e.is_connect())),
            Conns::Tls(c) => c.request(req()).await.map_err(|e| classify(&e, e.is_connect())),
            Conns::H2(slots) => {
                let slot = &slots[i];
                match self.send_h2(slot, b, as_h2(req())).await {
                    Err(Failure::NotProcessed) => {
                        resent();
                        self.send_h2(slot, b, as_h2(req())).await
                    }
                    r => r,
                }
            }
        }
    }

    async fn send_h2(&self, slot: &tokio::sync::Mutex<Option<H2Conn>>, b: &Backend, req: Request<Full<Bytes>>) -> Result<Response<Incoming>, Failure> {
        let mut conn = {
            let mut s = slot.lock().await;
            match &*s {
                Some(c) if !c.send.is_closed() => c.clone(),
                _ => {
                    let c = H2Conn { send: self.connect_h2(b).await?, serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed) };
                    *s = Some(c.clone());
                    c
                }
            }
        };
        let failure = match conn.send.ready().await {
            Err(_) => Failure::NotProcessed,
            Ok(()) => match conn.send.try_send_request(req).await {
                Ok(resp) => return Ok(resp),
                // Handed back: it never left this process.
                Err(e) if e.message().is_some() => Failure::NotProcessed,
                Err(e) => classify_h2(e.error()),
            },
        };
        // A connection that refused a request is going away; one stream's
        // error (a reset of that stream alone) leaves the others be.
        if matches!(failure, Failure::NotProcessed) || conn.send.is_closed() {
            let mut s = slot.lock().await;
            if s.as_ref().is_some_and(|c| c.serial == conn.serial) {
                *s = None;
            }
        }
        Err(failure)
    }

    /// A new HTTP/2 connection to `b`, its driver spawned on this worker.
    async fn connect_h2(&self, b: &Backend) -> Result<SendRequest<Full<Bytes>>, Failure> {
        let uri = self.backend_uri(b, PathAndQuery::from_static("/"));
        match &self.tls {
            Some(tls) => {
                let io = tls.clone().call(uri).await.map_err(|e| classify(&*e, true))?;
                // The backend must have chosen h2, the one protocol offered:
                // rustls lets a server that answers no ALPN through.
                if !io.connected().is_negotiated_h2() {
                    return Err(Failure::Tls("the backend did not accept h2 by ALPN".into()));
                }
                handshake_h2(io).await
            }
            None => handshake_h2(self.http.clone().call(uri).await.map_err(|e| classify(&e, true))?).await,
        }
    }

    /// The URI a request to `b` is written with.
    pub fn backend_uri(&self, b: &Backend, path: PathAndQuery) -> Uri {
        let mut u = uri::Parts::default();
        u.scheme = Some(self.scheme());
        u.authority = Some(b.authority.clone());
        u.path_and_query = Some(path);
        Uri::from_parts(u).expect("a scheme, an authority and a path form a URI")
    }

    /// An active health check over the pool's own protocol and TLS, on a
    /// fresh connection (as `inband_health`'s checks of plaintext pools):
    /// `GET path` with the backend's address as Host, 2xx or 3xx passes.
    pub async fn check(&self, b: &Backend, path: &str) -> Result<(), String> {
        let path = PathAndQuery::try_from(path).map_err(|e| format!("health.path {path:?}: {e}"))?;
        let uri = self.backend_uri(b, path.clone());
        let mut req = Request::get(uri).body(Full::new(Bytes::new())).expect("a GET of a URI is a request");
        let resp = match (self.protocol, &self.tls) {
            (BackendProtocol::H2, _) => {
                let mut send = self.connect_h2(b).await.map_err(|e| e.to_string())?;
                send.send_request(as_h2(req)).await
            }
            (BackendProtocol::Http1, tls) => {
                req.headers_mut().insert(HOST, http::HeaderValue::from_str(b.authority.as_str()).expect("an authority is a header value"));
                *req.uri_mut() = Uri::from(path);
                let mut send = match tls {
                    Some(t) => handshake_http1(t.clone().call(self.backend_uri(b, PathAndQuery::from_static("/"))).await.map_err(|e| classify(&*e, true).to_string())?).await,
                    None => handshake_http1(self.http.clone().call(self.backend_uri(b, PathAndQuery::from_static("/"))).await.map_err(|e| e.to_string())?).await,
                }
                .map_err(|e| e.to_string())?;
                send.send_request(req).await
            }
        };
        match resp {
            Ok(r) if r.status().is_success() || r.status().is_redirection() => Ok(()),
            Ok(r) => Err(format!("status {}", r.status().as_u16())),
            Err(e) => Err(classify_h2(&e).to_string()),
        }
    }
}

fn pooled<C>(connector: C) -> Client<C, Full<Bytes>>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
{
    Client::builder(TokioExecutor::new()).timer(TokioTimer::new()).pool_timer(TokioTimer::new()).pool_idle_timeout(IDLE_POOLED).build(connector)
}

/// HTTP/2 carries the client's host as `:authority` (the URI) and no
/// `Host`; the connection is already the backend's.
fn as_h2(mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    *req.version_mut() = Version::HTTP_2;
    if let Some(host) = req.headers_mut().remove(HOST) {
        if let Ok(a) = Authority::try_from(host.as_bytes()) {
            let mut parts = req.uri().clone().into_parts();
            parts.authority = Some(a);
            if let Ok(u) = Uri::from_parts(parts) {
                *req.uri_mut() = u;
            }
        }
    }
    req
}

async fn handshake_h2<T>(io: T) -> Result<SendRequest<Full<Bytes>>, Failure>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_PING_INTERVAL)
        .keep_alive_timeout(H2_PING_TIMEOUT)
        .handshake(io)
        .await
        .map_err(|e| Failure::Connect(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "HTTP/2 backend connection ended");
        }
    });
    Ok(send)
}

async fn handshake_http1<T>(io: T) -> hyper::Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    Ok(send)
}

/// A failure of a connection attempt or of a pooled request: TLS when
/// rustls is among its causes.
fn classify(e: &(dyn StdError + 'static), connecting: bool) -> Failure {
    let shown = chain(e);
    if find::<rustls::Error>(e).is_some() {
        Failure::Tls(shown)
    } else if connecting {
        Failure::Connect(shown)
    } else {
        classify_h2(e)
    }
}

/// RFC 9113 §8.7: a stream the server refused, or one above the last
/// stream its GOAWAY says it processed, was not acted on and may go again.
fn classify_h2(e: &(dyn StdError + 'static)) -> Failure {
    match find::<h2::Error>(e) {
        Some(h) if h.reason() == Some(h2::Reason::REFUSED_STREAM) || (h.is_go_away() && h.is_remote()) => Failure::NotProcessed,
        _ => Failure::Broken(chain(e)),
    }
}

/// The first error of type `E` among `e` and its causes. `io::Error`'s
/// `source` skips the error it wraps (it gives that one's source), so
/// that one is looked into explicitly.
fn find<'a, E: StdError + 'static>(e: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut cur = Some(e);
    while let Some(x) = cur {
        if let Some(found) = x.downcast_ref::<E>() {
            return Some(found);
        }
        cur = match x.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => x.source(),
        };
    }
    None
}

/// An error and its causes on one line.
fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(x) = cur {
        s.push_str(": ");
        s.push_str(&x.to_string());
        cur = x.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http2_requests_carry_the_client_host_as_authority_and_no_host() {
        let req = |host: &[u8]| {
            let mut r = Request::get("http://10.0.0.1:8080/p?q").body(Full::new(Bytes::new())).unwrap();
            r.headers_mut().insert(HOST, http::HeaderValue::from_bytes(host).unwrap());
            as_h2(r)
        };
        let r = req(b"site.test:8443");
        assert_eq!((r.uri().to_string().as_str(), r.headers().get(HOST), r.version()), ("http://site.test:8443/p?q", None, Version::HTTP_2));
        // A Host that is no authority leaves the backend's address, and
        // is not sent beside it.
        let r = req(b"a b");
        assert_eq!((r.uri().to_string().as_str(), r.headers().get(HOST)), ("http://10.0.0.1:8080/p?q", None));
    }
}

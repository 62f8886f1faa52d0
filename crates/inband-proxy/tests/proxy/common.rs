//! Test origins, a client, and proxy start-up, all on 127.0.0.1 ephemeral
//! ports inside the test's own runtime: dropping them ends every task.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use inband_proxy::{config, Proxy};

/// What an origin answers; `delay` before the response head.
#[derive(Clone, Default)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub delay: Duration,
}

pub fn ok(body: &str) -> Reply {
    Reply { status: 200, body: body.as_bytes().to_vec(), ..Default::default() }
}

impl Reply {
    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Reply {
        self.headers.push((name, value.into()));
        self
    }
    pub fn delay(mut self, d: Duration) -> Reply {
        self.delay = d;
        self
    }
    pub fn status(mut self, s: u16) -> Reply {
        self.status = s;
        self
    }
}

/// A request as the origin saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

type Handler = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

pub struct Origin {
    pub addr: SocketAddr,
    /// Requests counted, except to `/health`.
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Origin {
    pub async fn start(handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler: Handler = Arc::new(handler);
        let (h, s) = (hits.clone(), seen.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (handler, hits, seen) = (handler.clone(), h.clone(), s.clone());
                let service = service_fn(move |req: Request<Incoming>| {
                    let (handler, hits, seen) = (handler.clone(), hits.clone(), seen.clone());
                    async move {
                        let (parts, body) = req.into_parts();
                        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        let s = Seen { method: parts.method.to_string(), path: parts.uri.to_string(), headers: parts.headers, body };
                        if s.path != "/health" {
                            hits.fetch_add(1, Ordering::SeqCst);
                            seen.lock().unwrap().push(s.clone());
                        }
                        let reply = handler(&s);
                        tokio::time::sleep(reply.delay).await;
                        let mut resp = Response::new(Full::new(Bytes::from(reply.body)));
                        *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap();
                        for (k, v) in reply.headers {
                            resp.headers_mut().append(k, v.parse().unwrap());
                        }
                        Ok::<_, Infallible>(resp)
                    }
                });
                // In the JoinSet so aborting the origin ends its connections too.
                conns.spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
            }
        });
        Origin { addr, hits, seen, task }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// An address that refuses connections for as long as it lives: bound but
/// never listening, so no other socket of this or another test process
/// can take the port (a port bound and then closed can be handed to the
/// next `bind(0)`, and the "dead" backend would answer).
pub struct Dead {
    pub addr: SocketAddr,
    _socket: tokio::net::TcpSocket,
}

pub fn dead_addr() -> Dead {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    Dead { addr: socket.local_addr().unwrap(), _socket: socket }
}

pub async fn start_proxy(backends: &[SocketAddr], extra: &str) -> Proxy {
    let list: Vec<String> = backends.iter().map(|a| format!("\"{a}\"")).collect();
    let toml = format!("listen = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nbackends = [{}]\n{extra}", list.join(", "));
    let cfg = config::parse(&toml).unwrap_or_else(|e| panic!("{e:#}\n{toml}"));
    Proxy::start(cfg).await.unwrap()
}

pub struct Reply2 {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
}

/// One request on a fresh connection, bounded by 10 s.
pub async fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply2 {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http();
    let mut req = Request::builder().method(method).uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req)).await.expect("proxy answered in time").unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply2 { status, headers, body: String::from_utf8_lossy(&body).into_owned() }
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply2 {
    send(addr, "GET", path, &[], b"").await
}

/// Writes raw bytes and returns whatever comes back until the proxy
/// closes (or 5 s pass).
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

pub async fn metrics(p: &Proxy) -> String {
    get(p.metrics_addr.unwrap(), "/metrics").await.body
}

/// Polls the metrics until `series` reads `want`; panics after 5 s.
pub async fn wait_for_sample(p: &Proxy, series: &str, want: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = metrics(p).await;
        if sample(&m, series) == want {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{series} never reached {want}:\n{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of one sample line in Prometheus text, 0 if absent.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

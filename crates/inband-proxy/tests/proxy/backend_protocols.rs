//! How the proxy speaks to its backends: HTTP/2 by prior knowledge (h2c)
//! to a hyper server and to an `h2` server that refuses streams, and TLS
//! with verification (h2 and HTTP/1.1 by ALPN, a client certificate) to a
//! real nginx.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::common::*;
use crate::tls::Ca;
use inband_proxy::{config, Proxy};

/// An h2c origin (hyper, HTTP/2 only) answering with the version,
/// `:authority` and `Host` it saw; `/hang` never answers but reports that
/// it arrived. Counts connections.
struct H2Origin {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    hangs: tokio::sync::mpsc::UnboundedReceiver<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for H2Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn h2_origin() -> H2Origin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let (hung, hangs) = tokio::sync::mpsc::unbounded_channel();
    let count = connections.clone();
    let task = tokio::spawn(async move {
        // Dropped with the task: aborting the origin resets its connections.
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            let hung = hung.clone();
            let service = service_fn(move |req: Request<Incoming>| {
                let hung = hung.clone();
                async move {
                    if req.uri().path() == "/hang" {
                        let _ = hung.send(());
                        std::future::pending::<()>().await;
                    }
                    let host = req.headers().get("host").map(|h| h.to_str().unwrap().to_string()).unwrap_or_default();
                    let body = format!("{:?} authority={} host={host}", req.version(), req.uri().authority().map(|a| a.as_str()).unwrap_or(""));
                    let mut resp = Response::new(Full::new(Bytes::from(body)));
                    resp.headers_mut().insert("cache-control", "max-age=60".parse().unwrap());
                    Ok::<_, Infallible>(resp)
                }
            });
            conns.spawn(hyper::server::conn::http2::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), service));
        }
    });
    H2Origin { addr, connections, hangs, task }
}

#[tokio::test]
async fn h2c_backends_get_http2_with_the_client_host_as_authority_on_one_connection() {
    let origin = h2_origin().await;
    let p = start_proxy(&[origin.addr], "workers = 1\nbackend_protocol = \"h2\"\n[cache]\nbackend = \"memory\"\n").await;
    let r = send(p.addr, "GET", "/a", &[("host", "site.test")], b"").await;
    assert_eq!(r.status, 200);
    // No Host beside :authority (RFC 9113 §8.3.1).
    assert_eq!(r.body, "HTTP/2.0 authority=site.test host=");
    // 20 at once, each a miss on its own path: streams on the one
    // connection of the one worker.
    let addr = p.addr;
    let all: Vec<_> = (0..20).map(|i| tokio::spawn(async move { send(addr, "GET", &format!("/m{i}"), &[("host", "site.test")], b"").await })).collect();
    for a in all {
        let r = a.await.unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "HTTP/2.0 authority=site.test host="));
    }
    assert_eq!(origin.connections.load(Ordering::SeqCst), 1, "every request a stream on one connection");
    // The cache works as over HTTP/1.1: a hit, no new request.
    let m = metrics(&p).await;
    let before = sample(&m, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", origin.addr));
    assert_eq!(send(p.addr, "GET", "/a", &[("host", "site.test")], b"").await.status, 200);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", origin.addr)), before);
    p.shutdown().await;
}

#[tokio::test]
async fn an_h2_backend_that_dies_mid_request_gives_a_502_counted() {
    let mut origin = h2_origin().await;
    let p = start_proxy(&[origin.addr], "backend_protocol = \"h2\"\nretries = 2\n").await;
    let addr = p.addr;
    let req = tokio::spawn(async move { send(addr, "GET", "/hang", &[], b"").await });
    tokio::time::timeout(Duration::from_secs(5), origin.hangs.recv()).await.expect("the request reached the backend").unwrap();
    // The backend process goes: its connections are reset.
    origin.task.abort();
    let r = tokio::time::timeout(Duration::from_secs(5), req).await.expect("no hang").unwrap();
    assert_eq!(r.status, 502);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"backend_down\"}"), 1.0, "{m}");
    // Sent once: a request that reached the backend is not sent again.
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", origin.addr)), 1.0);
    p.shutdown().await;
}

/// An `h2` server whose first connection refuses every stream
/// (REFUSED_STREAM: not processed, RFC 9113 §8.7) and whose later ones
/// answer `connection N`.
async fn refusing_origin() -> (SocketAddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let n = count.fetch_add(1, Ordering::SeqCst) + 1;
            conns.spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else { return };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    if n == 1 {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let mut send = respond.send_response(Response::new(()), false).unwrap();
                    send.send_data(Bytes::from(format!("connection {n}")), true).unwrap();
                }
            });
        }
    });
    (addr, connections, task)
}

#[tokio::test]
async fn a_refused_h2_stream_is_sent_again_on_a_new_connection_and_counted() {
    let (addr, connections, task) = refusing_origin().await;
    let p = start_proxy(&[addr], "backend_protocol = \"h2\"\nworkers = 1\n").await;
    // A POST too: a refused stream was not processed, so it may go again.
    let r = send(p.addr, "POST", "/r", &[], b"body").await;
    assert_eq!((r.status, r.body.as_str()), (200, "connection 2"));
    assert_eq!(connections.load(Ordering::SeqCst), 2);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, &format!("inband_proxy_backend_resent_total{{backend=\"{addr}\"}}")), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"backend_down\"}"), 0.0);
    task.abort();
    p.shutdown().await;
}

/// nginx on 127.0.0.1 with TLS and HTTP/2, its certificate from `ca` for
/// `backend.test` and 127.0.0.1, answering with `$server_protocol`, the
/// host it saw and whether the client's certificate verified.
struct Nginx {
    addr: SocketAddr,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn nginx(ca: &Ca, verify_client: bool, directives: &str) -> Nginx {
    let (cert, key) = ca.leaf("nginx", "backend.test", &["backend.test", "127.0.0.1"], false);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let verify = if verify_client { format!("ssl_verify_client on;\nssl_client_certificate {};", ca.pem().display()) } else { String::new() };
    // A port found free may be taken before nginx binds it: a few tries.
    for _ in 0..5 {
        let port = free_port();
        let conf = format!(
            "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{}}\nhttp {{\n\
             access_log off;\nclient_body_temp_path {d};\nproxy_temp_path {d};\nfastcgi_temp_path {d};\nuwsgi_temp_path {d};\nscgi_temp_path {d};\n\
             server {{\nlisten 127.0.0.1:{port} ssl http2;\nssl_certificate {};\nssl_certificate_key {};\n{verify}\n{directives}\n\
             location / {{ add_header x-client-verify $ssl_client_verify always; return 200 \"$server_protocol $host $request_uri\"; }}\n}}\n}}\n",
            cert.display(),
            key.display()
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
        let mut child = std::process::Command::new("nginx")
            .args(["-p", &d, "-e", &format!("{d}/error.log"), "-c", &format!("{d}/nginx.conf")])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nginx is installed (scripts/setup.sh)");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        for _ in 0..100 {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Nginx { addr, child, _dir: dir };
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("nginx did not start: {}", std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default());
}

fn tls_keys(ca: &Path, server_name: Option<&str>, client: Option<&(PathBuf, PathBuf)>) -> String {
    let mut s = format!("[backend_tls]\nca = \"{}\"\n", ca.display());
    if let Some(n) = server_name {
        s.push_str(&format!("server_name = \"{n}\"\n"));
    }
    if let Some((c, k)) = client {
        s.push_str(&format!("cert = \"{}\"\nkey = \"{}\"\n", c.display(), k.display()));
    }
    s
}

async fn start(n: &Nginx, extra: &str) -> Proxy {
    let toml = format!("listen = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nbackends = [\"{}\"]\nretries = 0\n{extra}", n.addr);
    Proxy::start(config::parse(&toml).unwrap_or_else(|e| panic!("{e:#}\n{toml}"))).await.unwrap()
}

#[tokio::test]
async fn nginx_over_verified_tls_gets_h2_or_http1_as_the_pool_says_and_checks_pass_over_it() {
    let ca = Ca::new();
    let n = nginx(&ca, false, "").await;
    // Checks every 50 ms, one failure ejects: a check that failed over
    // TLS or h2 would leave no backend (503).
    let health = "[health]\npath = \"/health\"\ninterval_ms = 50\ntimeout_ms = 1000\nunhealthy_after = 1\nhealthy_after = 1\n";
    let p = start(&n, &format!("backend_protocol = \"h2\"\n{health}{}", tls_keys(&ca.pem(), None, None))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = send(p.addr, "GET", "/x?q=1", &[("host", "site.test")], b"").await;
    assert_eq!((r.status, r.body.as_str()), (200, "HTTP/2.0 site.test /x?q=1"));
    p.shutdown().await;
    // Verified by name instead of by address; HTTP/1.1 by ALPN.
    let p = start(&n, &format!("{health}{}", tls_keys(&ca.pem(), Some("backend.test"), None))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = send(p.addr, "GET", "/y", &[("host", "site.test")], b"").await;
    assert_eq!((r.status, r.body.as_str()), (200, "HTTP/1.1 site.test /y"));
    let m = metrics(&p).await;
    assert_eq!(sample(&m, &format!("inband_proxy_backend_tls_errors_total{{backend=\"{}\"}}", n.addr)), 0.0);
    p.shutdown().await;
}

#[tokio::test]
async fn a_backend_certificate_that_does_not_verify_is_a_502_counted_for_both_protocols() {
    let ca = Ca::new();
    let n = nginx(&ca, false, "").await;
    let other = Ca::new();
    for (protocol, tls) in [
        ("http1", tls_keys(&other.pem(), None, None)),
        ("h2", tls_keys(&other.pem(), None, None)),
        // The right CA, the wrong name.
        ("h2", tls_keys(&ca.pem(), Some("elsewhere.test"), None)),
        ("http1", tls_keys(&ca.pem(), Some("elsewhere.test"), None)),
    ] {
        let p = start(&n, &format!("backend_protocol = \"{protocol}\"\n{tls}")).await;
        let r = send(p.addr, "GET", "/z", &[], b"").await;
        assert_eq!(r.status, 502, "{protocol} {tls}");
        let m = metrics(&p).await;
        assert_eq!(sample(&m, &format!("inband_proxy_backend_tls_errors_total{{backend=\"{}\"}}", n.addr)), 1.0, "{protocol} {tls}\n{m}");
        assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"backend_down\"}"), 1.0);
        p.shutdown().await;
    }
}

#[tokio::test]
async fn a_client_certificate_is_presented_to_a_backend_that_asks() {
    let ca = Ca::new();
    let n = nginx(&ca, true, "").await;
    let client = ca.leaf("client", "proxy.test", &["proxy.test"], false);
    let p = start(&n, &format!("backend_protocol = \"h2\"\n{}", tls_keys(&ca.pem(), None, Some(&client)))).await;
    let r = send(p.addr, "GET", "/c", &[("host", "site.test")], b"").await;
    assert_eq!((r.status, r.body.as_str()), (200, "HTTP/2.0 site.test /c"));
    assert_eq!(r.headers["x-client-verify"], "SUCCESS");
    p.shutdown().await;
    // Without one nginx refuses the request.
    let p = start(&n, &format!("backend_protocol = \"h2\"\n{}", tls_keys(&ca.pem(), None, None))).await;
    assert_eq!(send(p.addr, "GET", "/c", &[], b"").await.status, 400);
    p.shutdown().await;
}

#[tokio::test]
async fn a_backend_ca_file_that_is_missing_or_not_pem_refuses_the_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let missing = dir.path().join("missing.pem");
    for (file, why) in [(&missing, "cannot read"), (&garbage, "no CERTIFICATE block")] {
        let toml = format!("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[[route]]\nname = \"api\"\npath_prefix = \"/api\"\nbackends = [\"127.0.0.1:2\"]\n[route.backend_tls]\nca = \"{}\"\n", file.display());
        let e = match Proxy::start(config::parse(&toml).unwrap()).await {
            Ok(_) => panic!("started with {}", file.display()),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains(&file.display().to_string()) && e.contains(why) && e.contains("route \"api\""), "{e}");
    }
    // Half a client certificate is a config error.
    let e = config::parse("listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[backend_tls]\ncert = \"/c.pem\"\n").unwrap_err();
    assert!(format!("{e:#}").contains("cert and key go together"), "{e:#}");
}

#[tokio::test]
async fn nginx_closing_h2_connections_with_goaway_loses_no_request() {
    let ca = Ca::new();
    // nginx ends an HTTP/2 connection with GOAWAY after this many streams.
    let n = nginx(&ca, false, "keepalive_requests 4;").await;
    let p = start(&n, &format!("workers = 1\nbackend_protocol = \"h2\"\n{}", tls_keys(&ca.pem(), None, None))).await;
    let addr = p.addr;
    for round in 0..6 {
        let all: Vec<_> = (0..3).map(|i| tokio::spawn(async move { send(addr, "GET", &format!("/g{round}-{i}"), &[("host", "site.test")], b"").await })).collect();
        for (i, a) in all.into_iter().enumerate() {
            let r = a.await.unwrap();
            assert_eq!((r.status, r.body), (200, format!("HTTP/2.0 site.test /g{round}-{i}")));
        }
    }
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"backend_down\"}"), 0.0, "{m}");
    p.shutdown().await;
}

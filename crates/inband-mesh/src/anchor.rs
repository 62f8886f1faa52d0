//! The anchor: the listener every connection to a service address reaches
//! (connect4 sends it here). While the kernel path serves a connection,
//! no byte arrives on it; the daemon writes only what it relays or answers.
//! Once the request program hands a connection over (docs/mesh.md,
//! "Fallback"), its bytes arrive here and the daemon routes its first
//! request, connects to that backend and relays both directions for the
//! rest of the connection's life, as a TCP sidecar would.

use std::net::{SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::config::{Route, Service};
use super::state::{Client, MeshState};
use super::programs::Conn;

const MAX_HEAD: usize = 64 * 1024;
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n";
/// After the last kernel-path response of a connection handed over by
/// pipelining, how long its redirected bytes may still be on their way to
/// the client's queue: the daemon's first bytes must not overtake them.
const HANDOVER_GRACE: Duration = Duration::from_millis(20);

pub async fn serve(sh: Rc<MeshState>, listener: TcpListener) {
    let mut backoff = Duration::from_millis(10);
    loop {
        match listener.accept().await {
            Ok((stream, SocketAddr::V4(peer))) => {
                backoff = Duration::from_millis(10);
                tokio::task::spawn_local(connection(sh.clone(), stream, peer));
            }
            Ok(_) => {}
            Err(e) => {
                // EMFILE and the like: wait for descriptors instead of spinning.
                warn!("anchor accept failed, retrying in {backoff:?}: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

async fn connection(sh: Rc<MeshState>, stream: TcpStream, peer: SocketAddrV4) {
    let accepted = match sh.dp.conn(peer) {
        Ok(Some(c)) => c,
        _ => {
            // Not a connect to a service from the cgroup (someone dialled the
            // anchor itself, or the connection table was full).
            debug!(%peer, "anchor connection without a service: closed");
            return;
        }
    };
    let fd = stream.as_raw_fd();
    let (mut rd, wr) = stream.into_split();
    let client = Rc::new(Client {
        writer: tokio::sync::Mutex::new(wr),
        close: Notify::new(),
        rst: std::cell::Cell::new(false),
        fd,
    });
    sh.clients.borrow_mut().insert(peer, client.clone());
    let mut first = vec![0u8; 16 * 1024];
    let n = tokio::select! {
        r = rd.read(&mut first) => r.unwrap_or(0),
        _ = client.close.notified() => 0,
    };
    if n > 0 && !client.rst.get() {
        first.truncate(n);
        fallback(&sh, peer, accepted, &client, rd, first).await;
    }
    sh.clients.borrow_mut().remove(&peer);
}

/// The connection's bytes come to the daemon from now on.
/// `accepted` is its mesh_conns entry at accept, for the service if the
/// LRU has since evicted the entry (which is also why its bytes came here).
async fn fallback(
    sh: &Rc<MeshState>,
    peer: SocketAddrV4,
    accepted: Conn,
    client: &Rc<Client>,
    mut rd: OwnedReadHalf,
    mut buf: Vec<u8>,
) {
    let conn = sh.dp.conn(peer).ok().flatten().unwrap_or(accepted);
    let svc_addr = SocketAddrV4::new(
        std::net::Ipv4Addr::from(u32::from_be(conn.vip4)),
        u16::from_be(conn.vport as u16),
    );
    let backend = {
        let cfg = sh.cfg.borrow();
        let Some(svc) = cfg.services.iter().find(|s| s.address == svc_addr) else {
            drop(cfg);
            return answer(client, 503, "no such service\n").await;
        };
        if buf.starts_with(H2_PREFACE) {
            // HTTP/2 carries no path before its frames: the first route
            // without a header condition takes the connection.
            svc.effective_routes()
                .iter()
                .find(|r| r.header.is_none())
                .and_then(|r| pick(svc, r))
        } else {
            drop(cfg);
            loop {
                let mut headers = [httparse::EMPTY_HEADER; 100];
                let mut req = httparse::Request::new(&mut headers);
                match req.parse(&buf) {
                    Ok(httparse::Status::Complete(_)) => {
                        if !content_length_valid(req.headers) {
                            // RFC 9112 §6.3: the message's length is unknown.
                            return answer(client, 400, "invalid Content-Length\n").await;
                        }
                        let cfg = sh.cfg.borrow();
                        let Some(svc) = cfg.services.iter().find(|s| s.address == svc_addr) else {
                            return;
                        };
                        let path = req.path.unwrap_or("/");
                        let routes = svc.effective_routes();
                        match routes.iter().find(|r| route_matches(r, path, req.headers)) {
                            Some(r) => break pick(svc, r),
                            None => {
                                drop(cfg);
                                return answer(client, 404, "no route\n").await;
                            }
                        }
                    }
                    Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {
                        let mut more = [0u8; 16 * 1024];
                        match rd.read(&mut more).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&more[..n]),
                        }
                    }
                    Ok(httparse::Status::Partial) => {
                        return answer(client, 431, "request head too large\n").await
                    }
                    Err(_) => return answer(client, 400, "malformed request\n").await,
                }
            }
        }
    };
    let Some(backend) = backend else {
        return answer(client, 503, "no backend\n").await;
    };
    let upstream =
        match tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(backend)).await {
            Ok(Ok(s)) => s,
            _ => return answer(client, 502, "upstream connection failed\n").await,
        };
    let _ = upstream.set_nodelay(true);
    // A pipelined request arrives while the kernel path still answers the
    // one before it: that answer goes first.
    let started = std::time::Instant::now();
    let mut waited = false;
    while let Ok(Some(c)) = sh.dp.conn(peer) {
        if !sh.dp.request_in_flight(&c) || started.elapsed() > Duration::from_secs(60) {
            break;
        }
        waited = true;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    if waited {
        tokio::time::sleep(HANDOVER_GRACE).await;
    }
    let (mut up_rd, mut up_wr) = upstream.into_split();
    if up_wr.write_all(&buf).await.is_err() {
        return answer(client, 502, "upstream connection failed\n").await;
    }
    let mut w = client.writer.lock().await;
    tokio::select! {
        _ = async {
            let to_backend = async {
                let _ = tokio::io::copy(&mut rd, &mut up_wr).await;
                let _ = up_wr.shutdown().await;
            };
            let to_client = async {
                let _ = tokio::io::copy(&mut up_rd, &mut *w).await;
                let _ = w.shutdown().await;
            };
            tokio::join!(to_backend, to_client);
        } => {}
        _ = client.close.notified() => {}
    }
}

/// The kernel path's route choice, for the requests it hands over: the
/// first route whose header (name in any case, value exact) and path
/// prefix match.
pub fn route_matches(r: &Route, path: &str, headers: &[httparse::Header]) -> bool {
    if let Some(h) = &r.header {
        if !headers
            .iter()
            .any(|x| x.name.eq_ignore_ascii_case(&h.name) && x.value == h.value.as_bytes())
        {
            return false;
        }
    }
    path.as_bytes().starts_with(r.path_prefix.as_bytes())
}

/// Every Content-Length is one decimal, and all agree (RFC 9112 §6.3;
/// requests that disagree are how smuggling starts).
fn content_length_valid(headers: &[httparse::Header]) -> bool {
    let mut seen: Option<&[u8]> = None;
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        let v = h.value.trim_ascii();
        if v.is_empty() || !v.iter().all(u8::is_ascii_digit) || seen.is_some_and(|s| s != v) {
            return false;
        }
        seen = Some(v);
    }
    true
}

/// A backend of the route: a cluster by weight, then one of its backends
/// at random (the connection stays with it).
fn pick(svc: &Service, r: &Route) -> Option<SocketAddrV4> {
    use rand::Rng;
    let total: u32 = r.clusters.values().sum();
    let mut x = rand::thread_rng().gen_range(0..total.max(1));
    for (name, w) in &r.clusters {
        if x < *w {
            let list = svc.cluster(name)?;
            return list
                .get(rand::thread_rng().gen_range(0..list.len()))
                .copied();
        }
        x -= w;
    }
    None
}

async fn answer(client: &Client, status: u16, body: &str) {
    let reason = match status {
        400 => "Bad Request",
        404 => "Not Found",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        _ => "Service Unavailable",
    };
    let msg = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\nvia: 1.1 inband-mesh\r\n\r\n{body}",
        body.len()
    );
    let mut w = client.writer.lock().await;
    let _ = w.write_all(msg.as_bytes()).await;
    let _ = w.shutdown().await;
}

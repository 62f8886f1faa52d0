//! HTTP/1.1 `Upgrade` through the proxy: a real WebSocket client and
//! echo server (tokio-tungstenite) on either side of the tunnel, frames
//! of a few bytes and of megabytes both ways, the idle and send timeouts
//! closing tunnels, and upgrades kept out of the cache; what happens to
//! refused, disallowed and unasked-for upgrades.


use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use futures_util::{SinkExt, StreamExt};
use http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

#[derive(Clone, Copy)]
enum Mode {
    /// Sends every text and binary message back.
    Echo,
    /// Sends 1 MiB messages without reading until a send fails.
    Flood,
}

/// A WebSocket server: counts handshakes, keeps their request headers.
struct WsBackend {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<HeaderMap>>>,
    /// Flood: bytes of the messages sent, and whether a send failed.
    sent: Arc<AtomicU64>,
    flood_ended: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WsBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const FLOOD_MESSAGE: usize = 1 << 20;
/// How much a flood tries to send before giving up on being stopped.
const FLOOD_LIMIT: u64 = 2 << 30;

impl WsBackend {
    async fn start(mode: Mode) -> WsBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hits, heads, sent, flood_ended) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (h, hd, s, e) = (hits.clone(), heads.clone(), sent.clone(), flood_ended.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (h, hd, s, e) = (h.clone(), hd.clone(), s.clone(), e.clone());
                conns.spawn(async move {
                    // The signature is tungstenite's handshake callback's.
                    #[allow(clippy::result_large_err)]
                    let seen = move |req: &Request, mut resp: Response| -> Result<Response, ErrorResponse> {
                        h.fetch_add(1, Ordering::SeqCst);
                        hd.lock().unwrap().push(req.headers().clone());
                        // A cache that stored 101s would store this one.
                        resp.headers_mut().insert("cache-control", "public, max-age=600".parse().unwrap());
                        Ok(resp)
                    };
                    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, seen).await else { return };
                    match mode {
                        Mode::Echo => {
                            while let Some(Ok(m)) = ws.next().await {
                                if (m.is_text() || m.is_binary()) && ws.send(m).await.is_err() {
                                    break;
                                }
                            }
                        }
                        Mode::Flood => {
                            let chunk = bytes::Bytes::from(vec![b'f'; FLOOD_MESSAGE]);
                            while s.load(Ordering::SeqCst) < FLOOD_LIMIT && ws.send(Message::Binary(chunk.clone())).await.is_ok() {
                                s.fetch_add(FLOOD_MESSAGE as u64, Ordering::SeqCst);
                            }
                            e.store(true, Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        WsBackend { addr, hits, heads, sent, flood_ended, task }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

type Client = WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

async fn ws_connect(p: &inband_proxy::Proxy, path: &str) -> (Client, http::Response<Option<Vec<u8>>>) {
    let url = format!("ws://{}{path}", p.addr);
    tokio::time::timeout(Duration::from_secs(10), tokio_tungstenite::connect_async(url)).await.expect("handshake in time").expect("handshake through the proxy")
}

/// The next text or binary message, bounded by 10 s.
async fn next_data(ws: &mut Client) -> Message {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("a message in time").expect("open").expect("no error");
        if m.is_text() || m.is_binary() {
            return m;
        }
    }
}

fn upgrades(m: &str, outcome: &str) -> f64 {
    sample(m, &format!("inband_proxy_upgrades_total{{outcome=\"{outcome}\"}}"))
}

fn closes(m: &str, reason: &str) -> f64 {
    sample(m, &format!("inband_proxy_tunnel_closes_total{{reason=\"{reason}\"}}"))
}

#[tokio::test]
async fn a_websocket_exchange_goes_both_ways_through_the_proxy() {
    let b = WsBackend::start(Mode::Echo).await;
    let p = start_proxy(&[b.addr], "").await;
    let (mut ws, resp) = ws_connect(&p, "/chat?room=1").await;
    assert_eq!(resp.status(), 101);
    assert_eq!(resp.headers()["upgrade"].to_str().unwrap().to_ascii_lowercase(), "websocket");
    ws.send(Message::text("hello through the proxy")).await.unwrap();
    assert_eq!(next_data(&mut ws).await, Message::text("hello through the proxy"));
    let bin: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
    ws.send(Message::binary(bin.clone())).await.unwrap();
    assert_eq!(next_data(&mut ws).await.into_data(), bin);
    // The backend saw the offer and the forwarding headers.
    let head = b.heads.lock().unwrap()[0].clone();
    assert_eq!(head["upgrade"], "websocket");
    assert_eq!(head["connection"], "upgrade");
    assert_eq!(head["x-forwarded-for"], "127.0.0.1");
    let m = metrics(&p).await;
    assert_eq!(upgrades(&m, "switched"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_tunnels_open"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_connections"), 1.0, "a tunnel is a client connection: {m}");
    // The client's frames carry a mask key each, the echoes none.
    let (up, down) = (sample(&m, "inband_proxy_tunnel_bytes_total{from=\"client\"}"), sample(&m, "inband_proxy_tunnel_bytes_total{from=\"backend\"}"));
    assert!(down > 5000.0 && up == down + 8.0, "{m}");
    // The closing handshake goes through too, then both ends close.
    ws.close(None).await.unwrap();
    while let Some(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), ws.next()).await.expect("closed in time") {}
    drop(ws);
    wait_for_sample(&p, "inband_proxy_tunnel_closes_total{reason=\"ended\"}", 1.0).await;
    wait_for_sample(&p, "inband_proxy_tunnels_open", 0.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn multi_megabyte_frames_cross_both_ways() {
    let b = WsBackend::start(Mode::Echo).await;
    let p = start_proxy(&[b.addr], "").await;
    let (mut ws, _) = ws_connect(&p, "/big").await;
    let mut total = 0;
    for (i, size) in [3 << 20, 8 << 20, 12 << 20].into_iter().enumerate() {
        let frame: Vec<u8> = (0..size).map(|j: usize| (j.wrapping_mul(31) ^ i) as u8).collect();
        ws.send(Message::binary(frame.clone())).await.unwrap();
        let back = next_data(&mut ws).await.into_data();
        assert_eq!(back.len(), size);
        assert!(back == frame, "frame {i} of {size} bytes came back altered");
        total += size;
    }
    let m = metrics(&p).await;
    for from in ["client", "backend"] {
        let n = sample(&m, &format!("inband_proxy_tunnel_bytes_total{{from=\"{from}\"}}"));
        assert!(n >= total as f64, "{from}: {n} < {total}");
    }
    p.shutdown().await;
}

#[tokio::test]
async fn a_silent_tunnel_is_closed_at_the_idle_timeout_and_a_busy_one_is_not() {
    let b = WsBackend::start(Mode::Echo).await;
    let p = start_proxy(&[b.addr], "idle_timeout_ms = 400").await;
    let (mut ws, _) = ws_connect(&p, "/").await;
    // Three idle timeouts long, with a message every 150 ms: the clock
    // runs from the last byte, not from the upgrade.
    let busy = Instant::now();
    let mut i = 0;
    while busy.elapsed() < Duration::from_millis(1200) {
        tokio::time::sleep(Duration::from_millis(150)).await;
        ws.send(Message::text(format!("ping {i}"))).await.unwrap();
        assert_eq!(next_data(&mut ws).await, Message::text(format!("ping {i}")));
        i += 1;
    }
    assert_eq!(closes(&metrics(&p).await, "idle"), 0.0);
    let silent = Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("closed within 10 s");
    let took = silent.elapsed();
    assert!(!matches!(end, Some(Ok(Message::Text(_) | Message::Binary(_)))), "{end:?}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
    wait_for_sample(&p, "inband_proxy_tunnel_closes_total{reason=\"idle\"}", 1.0).await;
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_tunnels_open"), 0.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_connections"), 0.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn a_client_that_never_reads_is_closed_at_the_send_timeout() {
    let b = WsBackend::start(Mode::Flood).await;
    // The idle timeout far off: only the send timeout can close it.
    let p = start_proxy(&[b.addr], "send_timeout_ms = 300\nidle_timeout_ms = 60000").await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 << 10).unwrap();
    let stream = socket.connect(p.addr).await.unwrap();
    let (_ws, resp) = tokio_tungstenite::client_async(format!("ws://{}/feed", p.addr), stream).await.unwrap();
    assert_eq!(resp.status(), 101);
    let start = Instant::now();
    // Never read: the proxy's writes to the client wait, then its reads
    // from the backend, then the backend's writes.
    wait_for_sample(&p, "inband_proxy_tunnel_closes_total{reason=\"send\"}", 1.0).await;
    let took = start.elapsed();
    // The flood starts with the 101, a little before the client has read
    // it, so the writes may have been waiting a few ms by then.
    assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(5), "{took:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !b.flood_ended.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the backend's side stayed open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // What the backend got rid of sits in socket buffers (the kernel's,
    // bounded by tcp_rmem/tcp_wmem) and in the proxy's two 16 KiB copy
    // buffers: a proxy that buffered what its client does not read would
    // have taken hundreds of megabytes in that time on loopback.
    let sent = b.sent.load(Ordering::SeqCst);
    assert!(sent < 32 << 20, "the backend pushed {} MiB into a tunnel whose client reads nothing", sent >> 20);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_tunnels_open"), 0.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_connections"), 0.0, "{m}");
    assert_eq!(closes(&m, "idle"), 0.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn an_upgrade_is_never_cached_nor_coalesced() {
    let b = WsBackend::start(Mode::Echo).await;
    // A cache that would store the 101 (it says max-age=600) and coalesce
    // concurrent misses of one URL.
    let p = start_proxy(&[b.addr], "[cache]\nbackend = \"memory\"").await;
    let ((mut one, r1), (mut two, r2)) = tokio::join!(ws_connect(&p, "/same"), ws_connect(&p, "/same"));
    let (mut three, r3) = ws_connect(&p, "/same").await;
    for r in [&r1, &r2, &r3] {
        assert_eq!(r.status(), 101);
    }
    assert_eq!(b.hits(), 3, "every upgrade reaches the backend");
    for (i, ws) in [&mut one, &mut two, &mut three].into_iter().enumerate() {
        ws.send(Message::text(format!("to {i}"))).await.unwrap();
        assert_eq!(next_data(ws).await, Message::text(format!("to {i}")));
    }
    let m = metrics(&p).await;
    assert_eq!(upgrades(&m, "switched"), 3.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_cache_store{what=\"entries\"}"), 0.0, "{m}");
    p.shutdown().await;
}

/// An HTTP/1.1 upgrade request by hand: the status line and head, and
/// whatever body came with the connection closed.
async fn raw_upgrade(addr: SocketAddr, path: &str, upgrade: &str) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {upgrade}\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n");
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0; 4096];
    // Up to the end of a head and its short body; keep-alive keeps the
    // connection, so stop at a short quiet time.
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn an_upgrade_the_backend_refuses_gets_its_answer_as_it_is() {
    let o = Origin::start(|_| Reply { status: 403, body: b"no sockets here\n".to_vec(), ..Default::default() }.header("x-why", "policy")).await;
    let p = start_proxy(&[o.addr], "").await;
    let out = raw_upgrade(p.addr, "/ws", "websocket").await;
    assert!(out.starts_with("HTTP/1.1 403"), "{out:?}");
    assert!(out.contains("x-why: policy\r\n"), "{out:?}");
    assert!(out.ends_with("no sockets here\n"), "{out:?}");
    // It was offered, and the backend said no.
    let seen = &o.seen()[0];
    assert_eq!(seen.headers["upgrade"], "websocket");
    assert_eq!(seen.headers["connection"], "upgrade");
    let m = metrics(&p).await;
    assert_eq!(upgrades(&m, "declined"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_tunnels_open"), 0.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn a_protocol_not_allowed_goes_on_as_a_plain_request() {
    let o = Origin::start(|_| ok("plain answer")).await;
    let p = start_proxy(&[o.addr], "").await;
    // h2c is not on the default list: the client gets the plain answer,
    // as RFC 9110 §7.8 lets a server ignore an upgrade.
    let out = raw_upgrade(p.addr, "/page", "h2c").await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out:?}");
    assert!(out.ends_with("plain answer"), "{out:?}");
    let seen = &o.seen()[0];
    assert!(seen.headers.get("upgrade").is_none() && seen.headers.get("connection").is_none(), "{:?}", seen.headers);
    // With no protocol allowed, a WebSocket request goes on plain too.
    let p2 = start_proxy(&[o.addr], "[upgrade]\nprotocols = []").await;
    let out = raw_upgrade(p2.addr, "/page", "websocket").await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out:?}");
    assert!(o.seen()[1].headers.get("upgrade").is_none());
    for p in [&p, &p2] {
        let m = metrics(p).await;
        assert_eq!(upgrades(&m, "not_allowed"), 1.0, "{m}");
        assert_eq!(upgrades(&m, "switched") + upgrades(&m, "declined"), 0.0, "{m}");
    }
    p.shutdown().await;
    p2.shutdown().await;
}

/// A backend that answers every request with `head` and then echoes
/// whatever comes after, spoken by hand as the protocol is our own.
async fn raw_backend(head: &'static str) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else { continue };
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn any_protocol_when_allowed_and_only_as_offered() {
    let (addr, task) = raw_backend("HTTP/1.1 101 Switching Protocols\r\nUpgrade: chat/2\r\nConnection: Upgrade\r\n\r\n").await;
    let p = start_proxy(&[addr], "[upgrade]\nprotocols = [\"*\"]").await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    s.write_all(b"GET /room HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: chat/2\r\n\r\n").await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut byte)).await.expect("a head in time").unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head:?}");
    assert!(head.contains("upgrade: chat/2\r\n") && head.contains("connection: upgrade\r\n"), "{head:?}");
    // Not WebSocket, not HTTP: bytes, both ways.
    s.write_all(b"\x00\x01 not http \xff").await.unwrap();
    let mut back = [0; 13];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back)).await.unwrap().unwrap();
    assert_eq!(&back, b"\x00\x01 not http \xff");
    // A 101 to something not offered, or to a request offering nothing,
    // would hand the client a connection it cannot speak on: 502.
    let out = raw_upgrade(p.addr, "/room", "websocket").await;
    assert!(out.starts_with("HTTP/1.1 502"), "{out:?}");
    assert_eq!(get(p.addr, "/room").await.status, 502);
    let m = metrics(&p).await;
    assert_eq!(upgrades(&m, "switched"), 1.0, "{m}");
    assert_eq!(upgrades(&m, "failed"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"backend_bad_upgrade\"}"), 2.0, "{m}");
    drop(s);
    task.abort();
    p.shutdown().await;
}

#[tokio::test]
async fn least_request_counts_an_open_tunnel_as_load() {
    let (x, y) = (WsBackend::start(Mode::Echo).await, WsBackend::start(Mode::Echo).await);
    let p = start_proxy(&[x.addr, y.addr], "policy = \"least-request\"").await;
    let (mut held, _) = ws_connect(&p, "/long").await;
    let (busy, other) = if x.hits() == 1 { (&x, &y) } else { (&y, &x) };
    // Short sessions one after another: with two backends both are
    // compared every time, and the one holding a tunnel has one more in flight.
    for i in 0..10 {
        let (mut ws, _) = ws_connect(&p, "/short").await;
        ws.send(Message::text("x")).await.unwrap();
        next_data(&mut ws).await;
        ws.close(None).await.unwrap();
        while let Some(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), ws.next()).await.expect("closed in time") {}
        drop(ws);
        wait_for_sample(&p, "inband_proxy_tunnel_closes_total{reason=\"ended\"}", f64::from(i + 1)).await;
    }
    assert_eq!((busy.hits(), other.hits()), (1, 10));
    held.send(Message::text("still here")).await.unwrap();
    assert_eq!(next_data(&mut held).await, Message::text("still here"));
    p.shutdown().await;
}

#[tokio::test]
async fn a_websocket_over_the_tls_listener() {
    let b = WsBackend::start(Mode::Echo).await;
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["ws.test".to_string()]).unwrap().self_signed(&key).unwrap();
    let (c, k) = (dir.path().join("ws.pem"), dir.path().join("ws.key"));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    let p = start_proxy(&[b.addr], &format!("[tls]\nlisten = \"127.0.0.1:0\"\n[[tls.certificate]]\ncert = \"{}\"\nkey = \"{}\"\n", c.display(), k.display())).await;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().unwrap().with_root_certificates(roots).with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(p.tls_addr.unwrap()).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("ws.test").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async("wss://ws.test/secure", tls).await.unwrap();
    assert_eq!(resp.status(), 101);
    ws.send(Message::text("over tls")).await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(m, Message::text("over tls"));
    let big: Vec<u8> = (0..(4usize << 20)).map(|i| (i % 251) as u8).collect();
    ws.send(Message::binary(big.clone())).await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.unwrap().unwrap().unwrap();
    assert!(m.into_data() == big, "4 MiB came back altered");
    // The backend learnt the client came over TLS.
    assert_eq!(b.heads.lock().unwrap()[0]["x-forwarded-proto"], "https");
    p.shutdown().await;
}

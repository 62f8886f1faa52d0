//! HTTP/2 clients that abuse the protocol: each is counted in
//! `inband_proxy_http2_abuse_total` (or, for one that stops reading, the
//! send timeout) and its connection closed, while a well-behaved HTTP/2
//! client is served beside it and after.
//!
//! The abusive clients are written frame by frame: a real client (the h2
//! crate's, curl's) keeps to the protocol — one PING outstanding, no more
//! streams than the server allows, no resets of streams it still wants —
//! and an HTTP/2 frame is a 9-byte header and a payload (RFC 9113 §4.1),
//! the requests here HPACK literals from the static table (RFC 7541).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const PRIORITY: u8 = 0x2;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ENHANCE_YOUR_CALM: u32 = 0xb;
const CANCEL: u32 = 0x8;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A request's header block: `:method`, `:scheme http` and `:path` from the
/// static table or as literals without indexing, `:authority` a literal.
fn request_block(method: &str, path: &str, authority: &str) -> Vec<u8> {
    let mut b = vec![if method == "POST" { 0x83 } else { 0x82 }, 0x86];
    for (index, value) in [(4u8, path), (1, authority)] {
        b.push(index);
        b.push(value.len() as u8);
        b.extend_from_slice(value.as_bytes());
    }
    b
}

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// Reads one frame; None when the connection closed (or was reset).
async fn read_frame(s: &mut TcpStream) -> Option<Frame> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await.ok()?;
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let mut payload = vec![0; len];
    s.read_exact(&mut payload).await.ok()?;
    Some(Frame { kind: head[3], flags: head[4], stream: u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff, payload })
}

/// A connection past the handshake: our SETTINGS (`settings`, id-value
/// pairs) sent, the proxy's received and acknowledged, so its limits are
/// in force.
async fn connect(addr: SocketAddr, settings: &[(u16, u32)]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut hello = PREFACE.to_vec();
    let payload: Vec<u8> = settings.iter().flat_map(|(id, v)| [id.to_be_bytes().as_slice(), v.to_be_bytes().as_slice()].concat()).collect();
    hello.extend(frame(SETTINGS, 0, 0, &payload));
    s.write_all(&hello).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let f = read_frame(&mut s).await.expect("the proxy's SETTINGS");
            if f.kind == SETTINGS && f.flags & ACK == 0 {
                break;
            }
        }
    })
    .await
    .unwrap();
    s.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
    s
}

/// Writes `bytes` (the proxy may close before taking them all) and reads
/// frames until the connection closes; panics if it is still open after 5 s.
async fn flood_until_closed(mut s: TcpStream, bytes: &[u8]) -> Vec<Frame> {
    let (mut rd, mut wr) = s.split();
    let start = Instant::now();
    let mut frames = Vec::new();
    let write = async {
        let _ = wr.write_all(bytes).await;
    };
    let read = async {
        let mut buf = Vec::new();
        let _ = rd.read_to_end(&mut buf).await;
        buf
    };
    let (_, buf) = tokio::time::timeout(Duration::from_secs(5), async { tokio::join!(write, read) }).await.expect("the proxy closed the connection");
    let mut rest = &buf[..];
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let Some(payload) = rest.get(9..9 + len) else { break };
        frames.push(Frame { kind: rest[3], flags: rest[4], stream: u32::from_be_bytes(rest[5..9].try_into().unwrap()) & 0x7fff_ffff, payload: payload.to_vec() });
        rest = &rest[9 + len..];
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    frames
}

fn goaway_code(frames: &[Frame]) -> Option<u32> {
    frames.iter().find(|f| f.kind == GOAWAY).map(|f| u32::from_be_bytes(f.payload[4..8].try_into().unwrap()))
}

fn abuse(m: &str, kind: &str) -> f64 {
    sample(m, &format!("inband_proxy_http2_abuse_total{{kind=\"{kind}\"}}"))
}

/// A well-behaved HTTP/2 client: `n` GETs on one h2c connection, each
/// answered 200.
async fn served(addr: SocketAddr, n: usize) {
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).http2_only(true).build_http();
    for i in 0..n {
        let req = http::Request::get(format!("http://{addr}/ok/{i}")).body(Full::default()).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req)).await.expect("answered in time").unwrap();
        assert_eq!((resp.status().as_u16(), resp.version()), (200, http::Version::HTTP_2));
        resp.into_body().collect().await.unwrap();
    }
}

/// `flood` on one connection while a normal client is served beside it;
/// returns the frames the flooder got back.
async fn flood_beside_a_client(p: &inband_proxy::Proxy, settings: &[(u16, u32)], flood: Vec<u8>) -> Vec<Frame> {
    let s = connect(p.addr, settings).await;
    let (frames, ()) = tokio::join!(flood_until_closed(s, &flood), served(p.addr, 20));
    served(p.addr, 1).await;
    frames
}

#[tokio::test]
async fn ping_settings_and_priority_floods_end_the_connection() {
    let o = Origin::start(|_| ok("fine")).await;
    let p = start_proxy(&[o.addr], "").await;
    for (kind, label, payload) in [(PING, "ping", vec![0u8; 8]), (SETTINGS, "settings", vec![]), (PRIORITY, "priority", vec![0, 0, 0, 0, 16])] {
        let stream = if kind == PRIORITY { 1 } else { 0 };
        let flood: Vec<u8> = (0..2000).flat_map(|_| frame(kind, 0, stream, &payload)).collect();
        let frames = flood_beside_a_client(&p, &[], flood).await;
        let answers = frames.iter().filter(|f| f.kind == kind && f.flags & ACK != 0).count();
        // The default limit, 100 a second, and not one answer past it.
        assert!(answers <= 100, "{label}: {answers} answered");
        wait_for_sample(&p, &format!("inband_proxy_http2_abuse_total{{kind=\"{label}\"}}"), 1.0).await;
    }
    wait_for_sample(&p, "inband_proxy_connections", 0.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn with_the_limit_off_a_ping_flood_is_answered_in_full() {
    let o = Origin::start(|_| ok("fine")).await;
    let p = start_proxy(&[o.addr], "[client_http2]\ncontrol_frames_per_s = 0\n").await;
    let mut s = connect(p.addr, &[]).await;
    let flood: Vec<u8> = (0..2000).flat_map(|_| frame(PING, 0, 0, &[0; 8])).collect();
    s.write_all(&flood).await.unwrap();
    let mut pongs = 0;
    while pongs < 2000 {
        let f = tokio::time::timeout(Duration::from_secs(5), read_frame(&mut s)).await.unwrap().expect("the connection stays open");
        pongs += usize::from(f.kind == PING && f.flags & ACK != 0);
    }
    assert_eq!(abuse(&metrics(&p).await, "ping"), 0.0);
    drop(s);
    p.shutdown().await;
}

#[tokio::test]
async fn rapid_reset_ends_the_connection_before_the_origin_sees_more_than_the_limit() {
    let o = Origin::start(|_| ok("fine").delay(Duration::from_millis(50))).await;
    let p = start_proxy(&[o.addr], "").await;
    let authority = p.addr.to_string();
    let mut flood = Vec::new();
    for i in 0..1000u32 {
        let id = 2 * i + 1;
        flood.extend(frame(HEADERS, END_HEADERS | END_STREAM, id, &request_block("GET", &format!("/r/{i}"), &authority)));
        flood.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    flood_beside_a_client(&p, &[], flood).await;
    wait_for_sample(&p, "inband_proxy_http2_abuse_total{kind=\"reset\"}", 1.0).await;
    let reset_requests = o.seen().iter().filter(|s| s.path.starts_with("/r/")).count();
    assert!(reset_requests <= 100, "{reset_requests} cancelled requests reached the origin");
    p.shutdown().await;
}

#[tokio::test]
async fn a_continuation_flood_gets_goaway_enhance_your_calm() {
    let o = Origin::start(|_| ok("fine")).await;
    let p = start_proxy(&[o.addr], "").await;
    let block = request_block("GET", "/c", &p.addr.to_string());
    let mut flood = frame(HEADERS, END_STREAM, 1, &block[..2]);
    for _ in 0..5000 {
        flood.extend(frame(CONTINUATION, 0, 1, &[]));
    }
    let frames = flood_beside_a_client(&p, &[], flood).await;
    assert_eq!(goaway_code(&frames), Some(ENHANCE_YOUR_CALM));
    wait_for_sample(&p, "inband_proxy_http2_abuse_total{kind=\"continuation\"}", 1.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn streams_over_the_limit_are_refused_until_goaway() {
    let o = Origin::start(|_| ok("fine")).await;
    let p = start_proxy(&[o.addr], "[client_http2]\nmax_concurrent_streams = 4\n").await;
    let authority = p.addr.to_string();
    // Requests whose bodies never come: each holds its stream open.
    let flood: Vec<u8> =
        (0..1200u32).flat_map(|i| frame(HEADERS, END_HEADERS, 2 * i + 1, &request_block("POST", &format!("/s/{i}"), &authority))).collect();
    let frames = flood_beside_a_client(&p, &[], flood).await;
    let refused = frames.iter().filter(|f| f.kind == RST_STREAM && f.payload == 7u32.to_be_bytes()).count();
    assert!(refused >= 1000, "{refused} streams refused");
    assert_eq!(goaway_code(&frames), Some(ENHANCE_YOUR_CALM));
    wait_for_sample(&p, "inband_proxy_http2_abuse_total{kind=\"stream_errors\"}", 1.0).await;
    assert_eq!(o.seen().iter().filter(|s| s.path.starts_with("/s/")).count(), 0, "no body came, so no request went on");
    p.shutdown().await;
}

#[tokio::test]
async fn a_client_whose_window_stays_shut_is_closed_at_the_send_timeout() {
    let o = Origin::start(|_| ok(&"x".repeat(10_000))).await;
    let p = start_proxy(&[o.addr], "send_timeout_ms = 300\n").await;
    // SETTINGS_INITIAL_WINDOW_SIZE 0: no stream may be sent a byte of DATA.
    let mut s = connect(p.addr, &[(0x4, 0)]).await;
    s.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &request_block("GET", "/big", &p.addr.to_string()))).await.unwrap();
    let start = Instant::now();
    let mut head = false;
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(f) = read_frame(&mut s).await {
            head |= f.kind == HEADERS && f.stream == 1;
            assert!(!(f.kind == DATA && !f.payload.is_empty()), "DATA sent past a shut window");
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection is still open after 5 s");
    assert!(head, "the response head came first");
    assert!(start.elapsed() >= Duration::from_millis(300));
    wait_for_sample(&p, "inband_proxy_connection_timeouts_total{kind=\"send\"}", 1.0).await;
    served(p.addr, 1).await;
    p.shutdown().await;
}

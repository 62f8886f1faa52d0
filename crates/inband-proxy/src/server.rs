//! Accepting clients, the per-request handler, and the metrics endpoint.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::{cache_layer, forward};
use crate::metrics::Refusal;
use crate::Shared;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// A slow client gets this long to send its request head, so idle or
/// trickling connections cannot hold the proxy open forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

pub fn full(body: impl Into<Bytes>) -> ProxyBody {
    Full::new(body.into()).map_err(|never| match never {}).boxed()
}

pub fn refusal_response(r: Refusal) -> Response<ProxyBody> {
    let text = match r {
        Refusal::BadRequest => "bad request\n",
        Refusal::HeadersTooLarge => "request headers too large\n",
        Refusal::BodyTooLarge => "request body too large\n",
        Refusal::BodyTimeout => "request body too slow\n",
        Refusal::NoHealthyBackend => "no healthy backend\n",
        Refusal::BackendDown => "backend unreachable\n",
        Refusal::BackendTimeout => "backend timed out\n",
    };
    let mut resp = Response::new(full(text));
    *resp.status_mut() = r.status();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    if matches!(r, Refusal::BodyTooLarge | Refusal::BodyTimeout) {
        // The unread rest of the body would be taken for the next request.
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// Accepts until `stop` fires, then lets in-flight requests finish for up
/// to the shutdown timeout.
pub async fn serve(shared: Arc<Shared>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let graceful = GracefulShutdown::new();
    // HTTP/1.1, and HTTP/2 with prior knowledge (h2c) on the same port:
    // hyper-util tells them apart by the connection preface.
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let max_head = shared.cfg.raw.max_header_bytes;
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT).max_buf_size(max_head);
    builder.http2().timer(TokioTimer::new()).max_header_list_size(max_head as u32);
    let builder = Arc::new(builder);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: back off, don't spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // On a dual-stack listener IPv4 clients appear as ::ffff:a.b.c.d;
        // purge_allow, X-Forwarded-For and hashing want a.b.c.d.
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        let s = shared.clone();
        let service = service_fn(move |req| handle(s.clone(), req, peer));
        let (s, builder, watcher) = (shared.clone(), builder.clone(), graceful.watcher());
        tokio::spawn(async move {
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn).await {
                let parse = e.downcast_ref::<hyper::Error>();
                let refusal = if parse.is_some_and(|e| e.is_parse_too_large()) {
                    Some(Refusal::HeadersTooLarge)
                } else if parse.is_some_and(|e| e.is_parse()) {
                    Some(Refusal::BadRequest)
                } else {
                    None
                };
                match refusal {
                    Some(r) => {
                        s.metrics.refused_by_parser(r);
                        tracing::info!(target: "inband_proxy::access", client = %peer, status = r.status().as_u16(), error = %e, "refused");
                    }
                    None => tracing::debug!(client = %peer, error = %e, "connection ended with an error"),
                }
            }
        });
    }
    drop(listener);
    let timeout = shared.cfg.shutdown_timeout();
    if tokio::time::timeout(timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(?timeout, "shutdown timeout: closing connections with requests still in flight");
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>, peer: SocketAddr) -> Result<Response<ProxyBody>, Infallible> {
    let start = Instant::now();
    let method = req.method().clone();
    let uri = req.uri().clone();
    let resp = respond(&shared, req, peer).await;
    let took = start.elapsed();
    shared.metrics.response(resp.status(), took);
    let cache = resp.headers().get("x-cache").and_then(|v| v.to_str().ok()).unwrap_or("-");
    tracing::info!(
        target: "inband_proxy::access",
        client = %peer, %method, %uri, status = resp.status().as_u16(), cache, ms = took.as_secs_f64() * 1e3
    );
    let counter = shared.metrics.response_bytes.clone();
    Ok(resp.map(|b| {
        b.map_frame(move |f| {
            if let Some(d) = f.data_ref() {
                counter.inc_by(d.len() as u64);
            }
            f
        })
        .boxed()
    }))
}

async fn respond(shared: &Arc<Shared>, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
    let limit = shared.cfg.raw.max_body_bytes;
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return refuse(shared, Refusal::BodyTooLarge);
    }
    let (mut parts, body) = req.into_parts();
    // HTTP/2 (and an absolute-form HTTP/1.1 request line) carry the host in
    // the URI: move it to Host so the backend, the cache key and the stored
    // policy see one form whatever the client spoke.
    if let Some(authority) = parts.uri.authority() {
        if !parts.headers.contains_key(header::HOST) {
            if let Ok(v) = HeaderValue::from_str(authority.as_str()) {
                parts.headers.insert(header::HOST, v);
            }
        }
        if let Some(pq) = parts.uri.path_and_query() {
            parts.uri = pq.as_str().parse().expect("a path-and-query is a URI");
        }
    }
    // Buffered so a retry can resend it; the limit bounds the memory.
    let read = tokio::time::timeout(shared.cfg.client_body_timeout(), Limited::new(body, limit as usize).collect());
    let body = match read.await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return refuse(shared, Refusal::BodyTooLarge),
        Ok(Err(_)) => return refuse(shared, Refusal::BadRequest),
        Err(_) => return refuse(shared, Refusal::BodyTimeout),
    };
    shared.metrics.request_bytes.inc_by(body.len() as u64);
    if parts.method.as_str() == "PURGE" {
        return purge(shared, &parts, peer).await;
    }
    forward::strip_hop_by_hop(&mut parts.headers);
    forward::add_forwarding(&mut parts.headers, peer);
    let key = forward::hash_key(&shared.cfg.hash_key, &parts, peer);
    let result = match &shared.cache {
        Some(cache) if cache_layer::applies(&parts) => cache_layer::serve(shared, cache, parts, &key).await,
        _ => {
            let sent = forward::send(shared, &parts, body, &key).await;
            if let (Some(cache), Ok(resp)) = (&shared.cache, &sent) {
                let ok = resp.status().is_success() || resp.status().is_redirection();
                if ok && cache_layer::invalidates(&parts.method) {
                    if let Err(e) = cache.invalidate(&parts).await {
                        tracing::warn!(error = %e, "cache invalidation failed");
                    }
                }
            }
            sent.map(|resp| resp.map(|b| b.map_err(BoxError::from).boxed()))
        }
    };
    result.unwrap_or_else(|r| refuse(shared, r))
}

/// `PURGE /path` (with the Host of the cached URL) from an allowed client
/// deletes that URL's entry and all its variants.
async fn purge(shared: &Shared, parts: &http::request::Parts, peer: SocketAddr) -> Response<ProxyBody> {
    let text = |status: StatusCode, t: String| {
        let mut r = Response::new(full(t));
        *r.status_mut() = status;
        r
    };
    if !shared.cfg.raw.purge_allow.contains(&peer.ip()) {
        return text(StatusCode::FORBIDDEN, format!("PURGE not allowed from {}\n", peer.ip()));
    }
    let Some(cache) = &shared.cache else {
        return text(StatusCode::NOT_FOUND, "no cache configured\n".into());
    };
    match cache.purge(parts).await {
        Ok(0) => text(StatusCode::NOT_FOUND, "not cached\n".into()),
        Ok(n) => text(StatusCode::OK, format!("purged {n} entries\n")),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("purge failed: {e:#}\n")),
    }
}

fn refuse(shared: &Shared, r: Refusal) -> Response<ProxyBody> {
    shared.metrics.refusal(r);
    refusal_response(r)
}

/// `GET /metrics` in Prometheus text format; anything else is 404.
pub async fn serve_metrics(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let s = shared.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let s = s.clone();
            async move {
                let resp = if req.uri().path() == "/metrics" {
                    let mut r = Response::new(full(s.render_metrics()));
                    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
                    r
                } else {
                    let mut r = Response::new(full("see /metrics\n"));
                    *r.status_mut() = StatusCode::NOT_FOUND;
                    r
                };
                Ok::<_, Infallible>(resp)
            }
        });
        tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
    }
}

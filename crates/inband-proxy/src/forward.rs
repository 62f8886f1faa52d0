//! Sending a request to a backend: choice by policy, forwarding headers,
//! the backend timeout, bounded retries and passive health bookkeeping
//! (how the bytes travel, HTTP/1.1 or HTTP/2, plaintext or TLS: upstream.rs).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{request, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::config::{HashKey, PolicyKind};
use crate::metrics::Refusal;
use crate::routes::BackendPool;
use crate::upstream::Failure;
use crate::Shared;

/// What a backend made of a request.
type Sent = Result<Response<Incoming>, Failure>;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// X-Forwarded-For (appended to any the client sent), X-Forwarded-Proto,
/// RFC 7239 Forwarded and RFC 9110 §7.6.3 Via (the protocol the client
/// spoke, then our pseudonym); `https` when the client came over TLS.
pub fn add_forwarding(headers: &mut HeaderMap, client: SocketAddr, version: http::Version, https: bool) {
    let proto = if https { "https" } else { "http" };
    let via = match version {
        http::Version::HTTP_10 => "1.0 inband",
        http::Version::HTTP_2 => "2 inband",
        _ => "1.1 inband",
    };
    headers.append(header::VIA, HeaderValue::from_static(via));
    let ip = client.ip();
    let xff = match headers.get(X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {ip}"),
        None => ip.to_string(),
    };
    let node = if ip.is_ipv6() { format!("\"[{ip}]\"") } else { ip.to_string() };
    let mut fwd = format!("for={node};proto={proto}");
    if let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) {
        fwd.push_str(";host=\"");
        fwd.push_str(host);
        fwd.push('"');
    }
    let fwd = match headers.get(header::FORWARDED).and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {fwd}"),
        None => fwd,
    };
    for (name, value) in [(X_FORWARDED_FOR, xff), (header::FORWARDED, fwd)] {
        if let Ok(v) = HeaderValue::try_from(value) {
            headers.insert(name, v);
        }
    }
    // Only this hop knows how the client came: a client's own claim (a
    // plaintext client saying `https`) would mislead the backend.
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
}

fn idempotent(m: &Method) -> bool {
    matches!(*m, Method::GET | Method::HEAD | Method::PUT | Method::DELETE | Method::OPTIONS)
}

pub fn hash_key(key: &HashKey, parts: &request::Parts, client: SocketAddr) -> Vec<u8> {
    match key {
        HashKey::Path => parts.uri.path().as_bytes().to_vec(),
        HashKey::ClientAddr => client.ip().to_string().into_bytes(),
        HashKey::Header(h) => match parts.headers.get(h) {
            Some(v) => v.as_bytes().to_vec(),
            None => client.ip().to_string().into_bytes(),
        },
    }
}

/// Sends `parts` + `body` (headers already prepared) to a backend and
/// returns its response head and streaming body. Idempotent requests whose
/// connection fails go to another backend, up to `retries` more times.
pub async fn send(shared: &Shared, pool: &BackendPool, parts: &request::Parts, body: Bytes, key: &[u8]) -> Result<Response<Incoming>, Refusal> {
    crate::probe::origin_fetch();
    let backends = &pool.backends;
    let mut tried = vec![false; backends.len()];
    let attempts = if idempotent(&parts.method) { 1 + shared.cfg.raw.retries } else { 1 };
    let mut last = Refusal::NoHealthyBackend;
    for _ in 0..attempts {
        let now = Instant::now();
        let Some(i) = pool.policy.pick(backends, |i| !tried[i] && backends[i].is_healthy(now), key).or_else(|| panic_pick(shared, pool, &tried, key, now))
        else {
            break;
        };
        tried[i] = true;
        pool.hedges.earn();
        let path = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let transport = &pool.transport;
        let attempt = |i: usize| {
            let b = &backends[i];
            let uri = transport.backend_uri(b, path.clone());
            let body = &body;
            let req = move || {
                let mut req = Request::new(Full::new(body.clone()));
                *req.method_mut() = parts.method.clone();
                *req.uri_mut() = uri.clone();
                *req.headers_mut() = parts.headers.clone();
                crate::cache_control::restore_request(req.headers_mut(), &parts.extensions);
                if let Some(interim) = parts.extensions.get::<crate::interim::Interim>() {
                    interim.watch(&mut req);
                }
                req
            };
            shared.metrics.origin_request(b);
            let in_flight = b.start_request();
            async move {
                let _in_flight = in_flight;
                transport.send(i, backends.len(), b, req, || shared.metrics.backend_resent(b)).await
            }
        };
        let passive = &shared.cfg.raw.passive;
        let margin = shared.cfg.raw.scores.busy_margin;
        let hedged = margin > 0 && pool.policy.kind() == PolicyKind::LeastScore && matches!(parts.method, Method::GET | Method::HEAD);
        let outcome = match hedged {
            true => tokio::time::timeout(shared.cfg.backend_timeout(), hedge(shared, pool, i, margin, &mut tried, attempt)).await,
            false => tokio::time::timeout(shared.cfg.backend_timeout(), attempt(i)).await.map(|r| (i, r)),
        };
        let (i, outcome) = match outcome {
            Ok((i, r)) => (i, Ok(r)),
            Err(e) => (i, Err(e)),
        };
        let b = &backends[i];
        match outcome {
            Ok(Ok(mut resp)) => {
                // What a 101 switches to is the one hop-by-hop header
                // that goes on, and only if the request offered it.
                let switched = match resp.status() {
                    StatusCode::SWITCHING_PROTOCOLS => Some(resp.headers_mut().remove(header::UPGRADE)),
                    _ => None,
                };
                if let Some(chosen) = &switched {
                    if !crate::upgrade::switched_as_offered(parts.headers.get(header::UPGRADE), chosen.as_ref()) {
                        note_ejection(b.record_failure(passive, Instant::now()), &b.name, "101 not as offered");
                        tracing::debug!(backend = %b.name, offered = ?parts.headers.get(header::UPGRADE), chosen = ?chosen, "backend switched protocols unasked");
                        return Err(Refusal::BackendBadUpgrade);
                    }
                }
                if resp.status().is_server_error() {
                    note_ejection(b.record_failure(passive, Instant::now()), &b.name, "5xx");
                } else {
                    b.record_success();
                }
                crate::hop_by_hop::strip(resp.headers_mut());
                crate::compression::strip_internal(resp.headers_mut());
                resp.extensions_mut().insert(crate::backend::Upstream(b.clone()));
                if let Some(Some(chosen)) = switched {
                    resp.headers_mut().insert(header::UPGRADE, chosen);
                    resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                    resp.extensions_mut().insert(crate::backend::TunnelInFlight::new(b));
                }
                return Ok(resp);
            }
            Ok(Err(e)) => {
                if let Failure::Tls(_) = e {
                    shared.metrics.backend_tls_error(b);
                }
                // A backend that refused a request unprocessed twice is
                // shedding load, not failing.
                if !matches!(e, Failure::NotProcessed) {
                    note_ejection(b.record_failure(passive, Instant::now()), &b.name, "connection failure");
                }
                tracing::debug!(backend = %b.name, error = %e, "backend request failed");
                last = Refusal::BackendDown;
                // A request that reached the backend may have had effects;
                // only one known not to have been sent or processed goes
                // to another backend.
                if !e.not_sent() {
                    break;
                }
            }
            Err(_) => {
                note_ejection(b.record_failure(passive, Instant::now()), &b.name, "timeout");
                // Waiting the timeout again on another backend doubles the
                // client's wait for what is most likely an overloaded pool.
                return Err(Refusal::BackendTimeout);
            }
        }
    }
    Err(last)
}

/// Least-score's hedge: waits for backend `i`'s answer (`attempt(i)`) and,
/// whenever a new score says others' load on it grew so that it now ranks
/// `margin` requests above another eligible backend, sends the request to
/// the least loaded one too (once, within the pool's budget); the first
/// answer is the request's, the other is dropped (its connection closed, or
/// its HTTP/2 stream reset). Only GET and HEAD come here: sent twice, they
/// change nothing. Scores see load the proxy does not (other clients), but
/// only once polled: a request placed on a backend just before its burst
/// showed in the scores would wait behind the burst; this moves it.
/// Returns which backend answered, and how.
async fn hedge<F, A>(shared: &Shared, pool: &BackendPool, i: usize, margin: u32, tried: &mut [bool], attempt: F) -> (usize, Sent)
where
    F: Fn(usize) -> A,
    A: Future<Output = Sent>,
{
    let backends = &pool.backends;
    let first = attempt(i);
    tokio::pin!(first);
    let j = loop {
        let busier = backends[i].busier();
        tokio::pin!(busier);
        busier.as_mut().enable();
        tokio::select! {
            r = &mut first => return (i, r),
            _ = &mut busier => {}
        }
        let now = Instant::now();
        let load = backends[i].scored_load(now);
        let best = (0..backends.len())
            .filter(|&j| !tried[j] && backends[j].is_healthy(now))
            .min_by_key(|&j| backends[j].scored_load(now))
            .filter(|&j| backends[j].scored_load(now) + u64::from(margin) <= load);
        if let Some(j) = best {
            if pool.hedges.spend() {
                break j;
            }
        }
    };
    tried[j] = true;
    shared.metrics.hedge(&backends[i]);
    let second = attempt(j);
    tokio::pin!(second);
    // The first good answer; a failed one leaves the other to answer.
    tokio::select! {
        r = &mut first => {
            if r.is_ok() {
                return (i, r);
            }
            shared.metrics.hedge_won(&backends[i]);
            (j, second.await)
        }
        r = &mut second => {
            if r.is_ok() {
                shared.metrics.hedge_won(&backends[i]);
                return (j, r);
            }
            (i, first.await)
        }
    }
}

/// Passive ejection judges a backend by the requests it was sent, so it
/// may not take the last backends that pass their health checks out of
/// service: a pool of one whose application answers a few 5xx in a row
/// (nginx never ejects a sole server), or a pool all of whose backends
/// failed at once (an origin-wide incident, or our own network), would
/// answer 503 for a whole cool-down though the backends may well answer
/// now. When every backend that passes its checks is ejected, they are all
/// eligible again (Envoy's panic routing); the active checks still decide
/// who is down.
fn panic_pick(shared: &Shared, pool: &BackendPool, tried: &[bool], key: &[u8], now: Instant) -> Option<usize> {
    let backends = &pool.backends;
    if backends.iter().any(|b| b.is_healthy(now)) {
        return None;
    }
    let i = pool.policy.pick(backends, |i| !tried[i] && backends[i].is_checked_up(), key)?;
    shared.metrics.ejection_overridden(&backends[i]);
    Some(i)
}

fn note_ejection(ejected: bool, backend: &str, why: &str) {
    if ejected {
        tracing::warn!(backend, why, "backend ejected (passive)");
    }
}

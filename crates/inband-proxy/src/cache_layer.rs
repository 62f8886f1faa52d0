//! The HTTP cache in front of the backends: RFC 9111 semantics from
//! `http-cache-semantics` (storable? fresh? revalidation headers? 304
//! merge?), RFC 5861 stale serving, request coalescing; entries kept by
//! `cache_store`.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{header, request, response, HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body_util::BodyExt;
use http_cache_semantics::{AfterResponse, BeforeRequest, CachePolicy};
use inband_cache::EntryBody;
use hyper::body::Incoming;

use crate::body::{full, BoxError, ProxyBody};
use crate::cache_control;
use crate::cache_outcome::Outcome;
use crate::cache_store::{base_key, options, unix_ms, Buffered, Fetched, Found, HttpCache, Leader, Stored, Turn};
use crate::metrics::Refusal;
use crate::ranges::{self, Answer, Asked};
use crate::routes::Route;
use crate::{forward, Shared};

/// Whether the cache looks at this request at all.
pub fn applies(parts: &request::Parts) -> bool {
    parts.method == Method::GET
}

/// Whether this method's success invalidates the stored URL: every
/// method not known to be safe (RFC 9111 §4.4, RFC 9110 §9.2.1), so an
/// extension method (`M-SEARCH`) too.
pub fn invalidates(method: &Method) -> bool {
    !method.is_safe()
}


fn cached(head: response::Parts, body: ProxyBody, outcome: Outcome) -> Response<ProxyBody> {
    let mut resp = Response::from_parts(head, body);
    outcome.mark(&mut resp);
    resp
}

/// Whether the library would serve the entry to this request as it is.
/// The head served is the stored one ([`Stored::head`]), not the
/// library's.
fn fresh(stored: &Stored, parts: &request::Parts) -> bool {
    matches!(stored.policy.before_request(parts, SystemTime::now()), BeforeRequest::Fresh(_))
}

/// Answers a GET through the cache. `parts` carries the forwarding
/// headers already; `key` is the balancing hash key. A client's own
/// conditional request is answered 304 when the 200 it would get matches.
pub async fn serve(shared: &Arc<Shared>, cache: &HttpCache, route: &Arc<Route>, mut parts: request::Parts, key: &[u8]) -> Result<Response<ProxyBody>, Refusal> {
    // A range is cut from the complete response when one is stored (its
    // revalidation included); without one, from a stored part, or the
    // origin is asked for the range and its 206 stored (RFC 9111 §3.3).
    let asked = Asked::take(&mut parts.headers);
    if let Some(asked) = &asked {
        if cache.lookup(&parts).await.is_none() {
            return partial(shared, cache, route, parts, asked, key).await;
        }
    }
    let conditional = [header::IF_NONE_MATCH, header::IF_MODIFIED_SINCE].iter().any(|h| parts.headers.contains_key(h));
    let req_headers = conditional.then(|| parts.headers.clone());
    // The origin is asked for the whole response, which can be stored:
    // passing the client's validators on would get a 304 the cache cannot
    // keep, and a browser revalidating would never fill the cache.
    parts.headers.remove(header::IF_NONE_MATCH);
    parts.headers.remove(header::IF_MODIFIED_SINCE);
    let accept = parts.headers.get(header::ACCEPT_ENCODING).cloned();
    // Before the 304 check: a validator names the representation sent.
    let resp = crate::compression::for_client(accept.as_ref(), &shared.metrics.compression, lookup_or_fetch(shared, cache, route, parts, key).await?);
    // RFC 9110 §13.2.2: the client's validators before its range.
    match (req_headers, asked) {
        (Some(req), _) if resp.status() == StatusCode::OK && not_modified(&req, resp.headers()) => {
            let (mut head, _) = resp.into_parts();
            head.status = StatusCode::NOT_MODIFIED;
            head.headers.remove(header::CONTENT_LENGTH);
            Ok(Response::from_parts(head, full(Bytes::new())))
        }
        (_, Some(asked)) => Ok(ranges::cut(&asked, resp, &shared.metrics.ranges)),
        _ => Ok(resp),
    }
}

/// A range of a URL with no complete response stored: from the stored
/// part when it holds the range, else from the origin, whose 206 is
/// stored, combined with the stored part when the two adjoin under the
/// same strong validator (RFC 9111 §3.4).
async fn partial(shared: &Arc<Shared>, cache: &HttpCache, route: &Arc<Route>, parts: request::Parts, asked: &Asked, key: &[u8]) -> Result<Response<ProxyBody>, Refusal> {
    let stored_part = cache.lookup_partial(&parts).await;
    let held = stored_part.as_ref().and_then(|found| holds(found, &parts, asked));
    match (stored_part, held) {
        (Some(Found { stored, body }), Some((from, to, complete, first))) => {
            shared.metrics.cache(Outcome::Hit);
            shared.metrics.ranges.count(Answer::FromPartial);
            let resp = cached(stored.head(), cache.response_body(body), Outcome::Hit);
            Ok(ranges::slice(resp, from, to, complete, first))
        }
        _ if cache_control::directive(&parts.headers, "only-if-cached").is_some() => Err(Refusal::NotCached),
        // Boxed like every trip to the origin here: the forward path's future
        // is ~19 KB, and held inline it would make every hit's future (from
        // the connection's down) that large, copied at each await.
        (stored_part, _) => Box::pin(fetch_range(shared, cache, route, &parts, asked, key, stored_part)).await,
    }
}

/// The range asked for, when the stored part is fresh, its validator
/// satisfies If-Range and it holds the one range: (first and last byte
/// asked, complete length, the part's first byte).
fn holds(found: &Found, parts: &request::Parts, asked: &Asked) -> Option<(u64, u64, u64, u64)> {
    let head = found.stored.head();
    let (first, last, complete) = ranges::content_range(&head.headers)?;
    if !fresh(&found.stored, parts) || !ranges::if_range_holds(asked.if_range.as_ref(), &head.headers) || found.body.len() != last - first + 1 {
        return None;
    }
    match ranges::resolve(&asked.range, complete) {
        ranges::Resolved::One(from, to) if first <= from && to <= last => Some((from, to, complete, first)),
        _ => None,
    }
}

/// Asks the origin for the client's range. A 206 of one part is stored
/// when the rules allow; a 200 (the origin ignored the range, or
/// If-Range did not hold) goes the way of any miss, and the range is cut
/// from it.
async fn fetch_range(
    shared: &Arc<Shared>,
    cache: &HttpCache,
    route: &Arc<Route>,
    parts: &request::Parts,
    asked: &Asked,
    key: &[u8],
    stored_part: Option<Found>,
) -> Result<Response<ProxyBody>, Refusal> {
    let mut req = parts.clone();
    asked.restore(&mut req.headers);
    let resp = forward::send(shared, &route.pool, &req, Bytes::new(), key).await?;
    match resp.status() {
        StatusCode::OK => {
            let accept = parts.headers.get(header::ACCEPT_ENCODING);
            let resp = crate::compression::for_client(accept, &shared.metrics.compression, keep(shared, cache, route, parts, resp, None, Outcome::Miss).await?);
            Ok(ranges::cut(asked, resp, &shared.metrics.ranges))
        }
        StatusCode::PARTIAL_CONTENT => keep_part(shared, cache, route, parts, resp, stored_part).await,
        _ => {
            shared.metrics.cache(Outcome::Miss);
            let mut resp = resp.map(|b| b.map_err(BoxError::from).boxed());
            Outcome::Miss.mark(&mut resp);
            Ok(resp)
        }
    }
}

/// A 206 from the origin, stored when it may be and its Content-Range
/// describes its body. A stored part with the same strong validator and
/// the same complete length that overlaps or adjoins it is combined with
/// it, under the new response's fields (RFC 9111 §3.4); parts that make
/// up the whole are stored as the complete 200.
async fn keep_part(
    shared: &Arc<Shared>,
    cache: &HttpCache,
    route: &Arc<Route>,
    parts: &request::Parts,
    resp: Response<Incoming>,
    stored_part: Option<Found>,
) -> Result<Response<ProxyBody>, Refusal> {
    shared.metrics.cache(Outcome::Miss);
    let (head, body) = resp.into_parts();
    let mut view = cache_control::library_response(&head);
    view.status = StatusCode::OK;
    let policy = CachePolicy::new_options(parts, &view, SystemTime::now(), options());
    let limit = route.max_object_bytes.unwrap_or_else(|| cache.max_object_bytes());
    let pass = |head, body| Ok(cached(head, body, Outcome::Miss));
    let Some((first, last, complete)) = ranges::content_range(&head.headers) else {
        // Several parts (multipart/byteranges) or no length known: passed
        // on as they came.
        shared.metrics.ranges.count(Answer::Malformed);
        return pass(head, body.map_err(BoxError::from).boxed());
    };
    if !cache.worth_storing(&policy, &head, limit) {
        return pass(head, body.map_err(BoxError::from).boxed());
    }
    let bytes = match cache.buffer(body, limit).await {
        Buffered::Whole(b) => b,
        Buffered::TooLarge(body) => return pass(head, body),
        Buffered::Broken => return Err(Refusal::BackendDown),
    };
    if bytes.len() as u64 != last - first + 1 {
        shared.metrics.ranges.count(Answer::Malformed);
        return pass(head, full(bytes));
    }
    let combined = match stored_part {
        Some(found) => combine(cache, &head, (first, last, complete), &bytes, found, limit).await,
        None => None,
    };
    match combined {
        Some((whole_head, whole)) => {
            cache.put(parts, &whole_head, whole).await;
        }
        None => {
            cache.put(parts, &head, bytes.clone()).await;
        }
    }
    shared.metrics.ranges.count(Answer::Stored);
    pass(head, full(bytes))
}

/// The stored part and the new one as one response: a 206 of the span
/// they cover, or the 200 when they cover the whole. `None` when they do
/// not go together (another validator, length, a gap between them, or a
/// span over the object bound).
async fn combine(
    cache: &HttpCache,
    head: &response::Parts,
    (first, last, complete): (u64, u64, u64),
    bytes: &Bytes,
    stored: Found,
    limit: u64,
) -> Option<(response::Parts, Bytes)> {
    let old_head = stored.stored.head();
    let (o_first, o_last, o_complete) = ranges::content_range(&old_head.headers)?;
    let strong = |h: &HeaderMap| h.get(header::ETAG).filter(|e| e.as_bytes().starts_with(b"\"")).cloned();
    let same = strong(&head.headers).is_some() && strong(&head.headers) == strong(&old_head.headers) && o_complete == complete;
    let (lo, hi) = (first.min(o_first), last.max(o_last));
    if !same || o_first > last + 1 || first > o_last + 1 || hi - lo + 1 > limit {
        return None;
    }
    let old = cache.entry_bytes(stored.body).await?;
    if old.len() as u64 != o_last - o_first + 1 {
        return None;
    }
    // The stored bytes, then the new ones over them: where the two
    // overlap, the new response's bytes win, as its fields do.
    let mut out = vec![0; (hi - lo + 1) as usize];
    out[(o_first - lo) as usize..=(o_last - lo) as usize].copy_from_slice(&old);
    out[(first - lo) as usize..=(last - lo) as usize].copy_from_slice(bytes);
    let mut merged = stored.stored.freshened(head);
    merged.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(hi - lo + 1));
    if lo == 0 && hi + 1 == complete {
        merged.status = StatusCode::OK;
        merged.headers.remove(header::CONTENT_RANGE);
    } else {
        merged.status = StatusCode::PARTIAL_CONTENT;
        merged.headers.insert(header::CONTENT_RANGE, HeaderValue::try_from(format!("bytes {lo}-{hi}/{complete}")).ok()?);
    }
    Some((merged, out.into()))
}

/// RFC 9110 §13.1.2-3: If-None-Match (weak comparison, `*` matches any)
/// decides when present; otherwise If-Modified-Since against Last-Modified.
/// The caching library only writes conditional requests toward the origin,
/// so evaluating a client's is written here.
fn not_modified(req: &HeaderMap, resp: &HeaderMap) -> bool {
    let text = |m: &HeaderMap, h| m.get(h).and_then(|v: &HeaderValue| v.to_str().ok()).map(str::to_string);
    if let Some(inm) = text(req, header::IF_NONE_MATCH) {
        let Some(etag) = text(resp, header::ETAG) else { return false };
        let opaque = |t: &str| t.trim().trim_start_matches("W/").to_string();
        return inm.split(',').any(|t| t.trim() == "*" || opaque(t) == opaque(&etag));
    }
    let date = |m: &HeaderMap, h| text(m, h).and_then(|d| httpdate::parse_http_date(&d).ok());
    match (date(req, header::IF_MODIFIED_SINCE), date(resp, header::LAST_MODIFIED)) {
        (Some(since), Some(modified)) => modified <= since,
        _ => false,
    }
}

/// The trips to the origin are boxed: inline, their state would make every
/// request's future, a hit's too, several kilobytes that hyper moves
/// around (into the HTTP/2 stream's task, for one) before it is polled.
async fn lookup_or_fetch(shared: &Arc<Shared>, cache: &HttpCache, route: &Arc<Route>, parts: request::Parts, key: &[u8]) -> Result<Response<ProxyBody>, Refusal> {
    // RFC 9111 §5.2.1.7: a stored response (fresh, or within the request's
    // max-stale, as the library decides) or 504, never the origin.
    if cache_control::directive(&parts.headers, "only-if-cached").is_some() {
        return match cache.lookup(&parts).await {
            Some(Found { stored, body }) if fresh(&stored, &parts) => {
                shared.metrics.cache(Outcome::Hit);
                Ok(cached(stored.head(), cache.response_body(body), Outcome::Hit))
            }
            _ => Err(Refusal::NotCached),
        };
    }
    if let Some(Found { stored, body }) = cache.lookup(&parts).await {
        let now = SystemTime::now();
        if stored.plainly_fresh(&parts, now) {
            shared.metrics.cache(Outcome::Hit);
            return Ok(cached(stored.head(), cache.response_body(body), Outcome::Hit));
        }
        match stored.policy.before_request(&parts, now) {
            BeforeRequest::Fresh(_) => {
                shared.metrics.cache(Outcome::Hit);
                return Ok(cached(stored.head(), cache.response_body(body), Outcome::Hit));
            }
            BeforeRequest::Stale { request, matches: true } if unix_ms(now) < stored.swr_until_ms => {
                shared.metrics.cache(Outcome::Stale);
                let resp = cached(stored.head(), cache.response_body(body), Outcome::Stale);
                revalidate_in_background(shared.clone(), route.clone(), parts, stored, request, key.to_vec());
                return Ok(resp);
            }
            BeforeRequest::Stale { request, matches: true } => {
                let fallback = (unix_ms(now) < stored.sie_until_ms).then(|| (stored.head(), body));
                let result = Box::pin(revalidate(shared, cache, route, &parts, &stored, request, key)).await;
                let failed = match &result {
                    Ok(resp) => resp.status().is_server_error(),
                    Err(_) => true,
                };
                return match fallback {
                    Some((head, body)) if failed => {
                        shared.metrics.cache(Outcome::Stale);
                        Ok(cached(head, cache.response_body(body), Outcome::Stale))
                    }
                    _ if failed => {
                        shared.metrics.cache(Outcome::Error);
                        result.map(|mut r| {
                            Outcome::Error.mark(&mut r);
                            r
                        })
                    }
                    _ => result,
                };
            }
            // Stored for another variant than this request's: a miss.
            BeforeRequest::Stale { matches: false, .. } => {}
        }
    }
    let base = base_key(&parts);
    match cache.join(&base) {
        Turn::Wait(mut rx) => {
            if let Ok(Some(f)) = rx.recv().await {
                if fresh(&f.stored, &parts) {
                    shared.metrics.cache(Outcome::Coalesced);
                    return Ok(cached(f.stored.head(), full(f.body.clone()), Outcome::Coalesced));
                }
            }
            // The leader's response was not shareable (or not for this
            // variant): fetch our own.
            Box::pin(fetch(shared, cache, route, &parts, key, None, Outcome::Miss)).await
        }
        Turn::Lead(leader) => {
            // A leader that finished between our lookup and join has
            // stored its response already.
            if let Some(Found { stored, body }) = cache.lookup(&parts).await {
                if fresh(&stored, &parts) {
                    // Waiters share a body in memory; a large one each
                    // streams from the store themselves.
                    let shared_body = match &body {
                        EntryBody::Whole(b) => Some(Arc::new(Fetched { stored: stored.clone(), body: b.clone() })),
                        EntryBody::Chunks(_) => None,
                    };
                    leader.finish(shared_body);
                    shared.metrics.cache(Outcome::Hit);
                    return Ok(cached(stored.head(), cache.response_body(body), Outcome::Hit));
                }
            }
            Box::pin(fetch(shared, cache, route, &parts, key, Some(leader), Outcome::Miss)).await
        }
    }
}

/// Origin fetch after a miss.
async fn fetch(
    shared: &Shared,
    cache: &HttpCache,
    route: &Route,
    parts: &request::Parts,
    key: &[u8],
    leader: Option<Leader<'_>>,
    outcome: Outcome,
) -> Result<Response<ProxyBody>, Refusal> {
    let resp = forward::send(shared, &route.pool, parts, Bytes::new(), key).await?;
    keep(shared, cache, route, parts, resp, leader, outcome).await
}

/// Stores an origin response if it may be stored, hands it to the
/// coalesced waiters, and returns it for the client.
async fn keep(
    shared: &Shared,
    cache: &HttpCache,
    route: &Route,
    parts: &request::Parts,
    resp: Response<Incoming>,
    leader: Option<Leader<'_>>,
    outcome: Outcome,
) -> Result<Response<ProxyBody>, Refusal> {
    shared.metrics.cache(outcome);
    let (head, body) = resp.into_parts();
    let limit = route.max_object_bytes.unwrap_or_else(|| cache.max_object_bytes());
    let storable = !cache_control::forbids_storing(&parts.headers, &head.headers) && {
        let policy = CachePolicy::new_options(parts, &cache_control::library_response(&head), SystemTime::now(), options());
        cache.worth_storing(&policy, &head, limit)
    };
    if !storable {
        drop(leader);
        let mut resp = Response::from_parts(head, body.map_err(BoxError::from).boxed());
        outcome.mark(&mut resp);
        return Ok(resp);
    }
    match cache.buffer(body, limit).await {
        Buffered::Whole(bytes) => {
            let compression = shared.cfg.raw.cache.as_ref().and_then(|c| c.compression.as_ref());
            let (head, bytes) = crate::compression::stored(compression, &shared.metrics.compression, head, bytes).await;
            // Waiters are served from the policy as stored: without the
            // leader's Set-Cookie and request headers.
            let stored = cache.put(parts, &head, bytes.clone()).await;
            if let Some(l) = leader {
                l.finish(Some(Arc::new(Fetched { stored, body: bytes.clone() })));
            }
            Ok(cached(head, full(bytes), outcome))
        }
        Buffered::TooLarge(body) => {
            let mut resp = Response::from_parts(head, body);
            outcome.mark(&mut resp);
            Ok(resp)
        }
        Buffered::Broken => Err(Refusal::BackendDown),
    }
}

/// `stale-while-revalidate`: the client already has the stale entry; one
/// background request per URL refreshes it.
fn revalidate_in_background(shared: Arc<Shared>, route: Arc<Route>, parts: request::Parts, stored: Arc<Stored>, conditional: request::Parts, key: Vec<u8>) {
    tokio::spawn(async move {
        let Some(cache) = &shared.cache else { return };
        let Turn::Lead(leader) = cache.join(&base_key(&parts)) else { return };
        if let Err(r) = revalidate(&shared, cache, &route, &parts, &stored, conditional, &key).await {
            tracing::info!(reason = r.label(), "background revalidation failed; the stale entry stays");
        }
        leader.finish(None);
    });
}

/// A stale entry: ask the origin with its validators; a 304 refreshes the
/// entry and the client gets the stored body.
async fn revalidate(
    shared: &Shared,
    cache: &HttpCache,
    route: &Route,
    parts: &request::Parts,
    stored: &Stored,
    mut conditional: request::Parts,
    key: &[u8],
) -> Result<Response<ProxyBody>, Refusal> {
    // The library built this request from the client's: the fields the
    // client sent go to the origin as sent.
    conditional.extensions = parts.extensions.clone();
    let resp = forward::send(shared, &route.pool, &conditional, Bytes::new(), key).await?;
    if resp.status().is_server_error() {
        // Not stored and not counted here: the caller may answer with the
        // stale entry instead (stale-if-error).
        return Ok(resp.map(|b| b.map_err(BoxError::from).boxed()));
    }
    if resp.status() != StatusCode::NOT_MODIFIED {
        return keep(shared, cache, route, parts, resp, None, Outcome::Updated).await;
    }
    let (head, _) = resp.into_parts();
    // The library applies RFC 9111 §4.3.4's choice among several stored
    // responses, where a 304 without validators selects none that has
    // one. Here one entry was validated, with its own validators, and a
    // 304 without any (as many origins send) answers for that entry.
    let no_validators = !head.headers.contains_key(header::ETAG) && !head.headers.contains_key(header::LAST_MODIFIED);
    let selected = no_validators
        || matches!(stored.policy.after_response(parts, &cache_control::library_response(&head), SystemTime::now()), AfterResponse::NotModified(..));
    // A 304 whose validators match nothing stored: the entry cannot be
    // trusted, so fetch it whole.
    if !selected {
        return fetch(shared, cache, route, parts, key, None, Outcome::Updated).await;
    }
    // The entry is rewritten with the refreshed head and its body, read
    // again (the entry may have changed or gone since it was looked up).
    match cache.body_bytes(parts).await {
        Some(body) => {
            shared.metrics.cache(Outcome::Revalidated);
            let fresh = cache.put(parts, &stored.freshened(&head), body.clone()).await;
            Ok(cached(fresh.head(), full(body), Outcome::Revalidated))
        }
        None => fetch(shared, cache, route, parts, key, None, Outcome::Updated).await,
    }
}

//! The HTTP cache in front of the backends: RFC 9111 semantics from
//! `http-cache-semantics` (storable? fresh? revalidation headers? 304
//! merge?), entries in an `inband-cache` [`Store`], request coalescing.
//!
//! Keys: `GET <host><path?query>` holds either a response or, when the
//! response has `Vary`, a marker naming the varied request headers; each
//! variant then lives under the base key + `\n` + those headers' values.
//! A response is found with one or two reads, and a purge finds the
//! variants by prefix.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use bytes::{Bytes, BytesMut};
use http::{header, request, response, HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body_util::BodyExt;
use http_cache_semantics::{AfterResponse, BeforeRequest, CacheOptions, CachePolicy};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use inband_cache::Store;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::config::CacheConfig;
use crate::metrics::Refusal;
use crate::server::{full, BoxError, ProxyBody};
use crate::{forward, Shared};

/// What the header blob of a stored record holds.
#[derive(Serialize, Deserialize)]
enum Head {
    /// A response: the policy carries status, headers and timing.
    Response(Box<Stored>),
    /// The response at this URL varies on these request headers.
    Vary(Vec<String>),
}

#[derive(Serialize, Deserialize)]
struct Stored {
    policy: CachePolicy,
    /// Unix ms until which a stale entry may be served while it is
    /// revalidated (`stale-while-revalidate`); 0 for never.
    swr_until_ms: u64,
    /// Unix ms until which a stale entry may be served when the origin
    /// fails (`stale-if-error`); 0 for never.
    #[serde(default)]
    sie_until_ms: u64,
    /// The response head as the origin sent it, for serving it stale: the
    /// library builds a head only for a fresh entry.
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
}

/// How a request was served, for metrics and the `X-Cache` header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Fresh entry served, origin not asked.
    Hit,
    /// Nothing usable stored; origin asked.
    Miss,
    /// A stale entry served: at once under `stale-while-revalidate`
    /// (revalidated in the background), or under `stale-if-error` because
    /// the origin failed.
    Stale,
    /// A stale entry the origin replaced with a new response.
    Updated,
    /// A stale entry the origin confirmed with 304.
    Revalidated,
    /// Served the result of a concurrent request's origin fetch.
    Coalesced,
}

impl Outcome {
    pub const ALL: [Outcome; 6] =
        [Outcome::Hit, Outcome::Miss, Outcome::Stale, Outcome::Updated, Outcome::Revalidated, Outcome::Coalesced];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Miss => "miss",
            Outcome::Stale => "stale",
            Outcome::Updated => "updated",
            Outcome::Revalidated => "revalidated",
            Outcome::Coalesced => "coalesced",
        }
    }

    fn header(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Outcome::Hit | Outcome::Coalesced => "HIT",
            Outcome::Miss => "MISS",
            Outcome::Stale => "STALE",
            Outcome::Updated => "UPDATED",
            Outcome::Revalidated => "REVALIDATED",
        })
    }
}

/// A storable response fetched once, handed to every coalesced waiter.
struct Fetched {
    policy: CachePolicy,
    body: Bytes,
}

type Waiters = broadcast::Sender<Option<Arc<Fetched>>>;

pub struct HttpCache {
    store: Arc<dyn Store>,
    max_object_bytes: u64,
    inflight: Mutex<HashMap<Vec<u8>, Waiters>>,
}

/// A stored response found for a request.
struct Found {
    policy: CachePolicy,
    body: Bytes,
    swr_until_ms: u64,
    sie_until_ms: u64,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
}

impl Found {
    /// The stored response as it is now, stale: Age says how stale.
    fn stale_head(&self) -> response::Parts {
        let mut resp = Response::new(());
        *resp.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        for (k, v) in &self.headers {
            if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_bytes(v)) {
                resp.headers_mut().append(k, v);
            }
        }
        let age = self.policy.age(SystemTime::now()).as_secs();
        resp.headers_mut().insert(header::AGE, HeaderValue::from(age));
        resp.into_parts().0
    }
}

/// `stale-while-revalidate=N` or `stale-if-error=N` (RFC 5861) of a
/// response's Cache-Control, in seconds. http-cache-semantics parses
/// Cache-Control but neither acts on nor exposes these, so they are read here.
fn stale_directive(headers: &HeaderMap, directive: &str) -> Option<u64> {
    headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|d| {
            let (name, value) = d.trim().split_once('=')?;
            name.trim().eq_ignore_ascii_case(directive).then(|| value.trim().trim_matches('"').parse().ok())?
        })
}

/// The one request fetching a key; dropping it (done or cancelled)
/// releases the key so no waiter waits on a fetch that will not come.
struct Leader<'a> {
    cache: &'a HttpCache,
    key: Vec<u8>,
    tx: Waiters,
}

impl Leader<'_> {
    fn finish(self, result: Option<Arc<Fetched>>) {
        self.cache.inflight.lock().unwrap().remove(&self.key);
        let _ = self.tx.send(result);
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.cache.inflight.lock().unwrap().remove(&self.key);
    }
}

enum Turn<'a> {
    Lead(Leader<'a>),
    Wait(broadcast::Receiver<Option<Arc<Fetched>>>),
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn options() -> CacheOptions {
    // A proxy is a shared cache: `private` is not stored, `s-maxage` wins.
    CacheOptions { shared: true, ..Default::default() }
}

fn base_key(parts: &request::Parts) -> Vec<u8> {
    let host = parts.headers.get(header::HOST).map_or(&b""[..], |h| h.as_bytes());
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut k = b"GET ".to_vec();
    k.extend_from_slice(host);
    k.extend_from_slice(path.as_bytes());
    k
}

fn variant_key(base: &[u8], names: &[String], headers: &HeaderMap) -> Vec<u8> {
    let mut k = base.to_vec();
    k.push(b'\n');
    for n in names {
        k.extend_from_slice(n.as_bytes());
        k.push(b'=');
        let values: Vec<&[u8]> = headers.get_all(n.as_str()).iter().map(|v| v.as_bytes()).collect();
        k.extend_from_slice(&values.join(&b","[..]));
        k.push(b'\n');
    }
    k
}

/// `Vary`'s header names, lower-cased and sorted; `None` without Vary.
fn vary_names(headers: &HeaderMap) -> Option<Vec<String>> {
    let mut names: Vec<String> = headers
        .get_all(header::VARY)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    names.sort();
    names.dedup();
    (!names.is_empty()).then_some(names)
}

/// The request as the stored policy keeps it: only what matching a later
/// request needs (Host, the Vary'd headers), so cookies and credentials of
/// the first client never reach the disk. Storability was decided on the
/// full request before this.
fn persisted_request(parts: &request::Parts, vary: Option<&[String]>) -> request::Parts {
    let mut req = http::Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    let (mut p, ()) = req.into_parts();
    let keep = |n: &str| n == "host" || vary.is_some_and(|v| v.iter().any(|x| x == n));
    for (name, value) in &parts.headers {
        if keep(name.as_str()) {
            p.headers.append(name, value.clone());
        }
    }
    p
}

/// Whether the cache looks at this request at all. Range requests go to
/// the origin: the library does not understand partial content.
pub fn applies(parts: &request::Parts) -> bool {
    parts.method == Method::GET && !parts.headers.contains_key(header::RANGE)
}

/// Whether this method's success invalidates the stored URL (RFC 9111 §4.4).
pub fn invalidates(method: &Method) -> bool {
    matches!(*method, Method::POST | Method::PUT | Method::DELETE | Method::PATCH)
}

enum Buffered {
    Whole(Bytes),
    /// Over `max_object_bytes`: what was read, then the rest, streamed.
    TooLarge(ProxyBody),
    Broken,
}

impl HttpCache {
    pub fn open(cfg: &CacheConfig) -> Result<HttpCache> {
        let store: Arc<dyn Store> = Arc::from(inband_cache::open(&cfg.store_config())?);
        tracing::info!(backend = %cfg.backend, entries = store.len(), bytes = store.size_bytes(), "cache opened");
        Ok(HttpCache { store, max_object_bytes: cfg.max_object_bytes, inflight: Mutex::new(HashMap::new()) })
    }

    pub fn stats(&self) -> inband_cache::Stats {
        self.store.stats()
    }

    /// Store I/O runs on the blocking pool: an LMDB or RocksDB write can
    /// wait on the disk, and a file read always does.
    async fn blocking<T: Send + 'static>(&self, f: impl FnOnce(&dyn Store) -> Result<T> + Send + 'static) -> Result<T> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&*store)).await?
    }

    pub async fn flush(&self) {
        if let Err(e) = self.blocking(|s| s.flush()).await {
            tracing::warn!(error = %e, "cache flush failed");
        }
    }

    async fn get(&self, key: Vec<u8>) -> Option<(Head, Bytes)> {
        let entry = match self.blocking(move |s| s.get(&key)).await {
            Ok(e) => e?,
            Err(e) => {
                tracing::warn!(error = %e, "cache read failed");
                return None;
            }
        };
        Some((serde_json::from_slice(&entry.header).ok()?, entry.body.into()))
    }

    /// The stored response for this request, following a Vary marker.
    async fn lookup(&self, parts: &request::Parts) -> Option<Found> {
        let base = base_key(parts);
        let (head, body) = match self.get(base.clone()).await? {
            (Head::Vary(names), _) => self.get(variant_key(&base, &names, &parts.headers)).await?,
            found => found,
        };
        match head {
            Head::Response(st) => {
                let st = *st;
                Some(Found {
                    policy: st.policy,
                    body,
                    swr_until_ms: st.swr_until_ms,
                    sie_until_ms: st.sie_until_ms,
                    status: st.status,
                    headers: st.headers,
                })
            }
            Head::Vary(_) => None,
        }
    }

    /// Stores a response (and the Vary marker it needs). A failure is
    /// logged: a response not stored is only a later miss.
    async fn put(&self, parts: &request::Parts, resp: &response::Parts, policy: &CachePolicy, body: Bytes) {
        let now = SystemTime::now();

        let base = base_key(parts);
        let vary = vary_names(&resp.headers);
        let persisted = CachePolicy::new_options(&persisted_request(parts, vary.as_deref()), resp, now, options());
        let fresh_until = now + policy.time_to_live(now);
        let until = |d| stale_directive(&resp.headers, d).map_or(0, |s| unix_ms(fresh_until + Duration::from_secs(s)));
        let (swr_until_ms, sie_until_ms) = (until("stale-while-revalidate"), until("stale-if-error"));
        let stored = Stored {
            policy: persisted,
            swr_until_ms,
            sie_until_ms,
            status: resp.status.as_u16(),
            headers: resp.headers.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect(),
        };
        let mut writes = Vec::new();
        let key = match vary {
            Some(names) => {
                let key = variant_key(&base, &names, &parts.headers);
                writes.push((base, Head::Vary(names), Bytes::new()));
                key
            }
            None => base,
        };
        writes.push((key, Head::Response(Box::new(stored)), body));
        let stored_at = unix_ms(now);
        let expires = unix_ms(fresh_until);
        let r = self
            .blocking(move |s| {
                for (k, head, b) in writes {
                    s.put(&k, stored_at, expires, &serde_json::to_vec(&head)?, &b)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "cache write failed");
        }
    }

    /// Deletes the entry for this URL and all its variants; returns how
    /// many records went.
    pub async fn purge(&self, parts: &request::Parts) -> Result<u64> {
        let base = base_key(parts);
        self.blocking(move |s| {
            let mut prefix = base.clone();
            prefix.push(b'\n');
            let mut victims = vec![base];
            s.for_each_meta(&mut |k, _| {
                if k.starts_with(&prefix) {
                    victims.push(k.to_vec());
                }
            })?;
            let mut n = 0;
            for k in victims {
                n += s.delete(&k)? as u64;
            }
            Ok(n)
        })
        .await
    }

    /// Become the one request that fetches `key`, or wait for the one that is.
    fn join(&self, key: &[u8]) -> Turn<'_> {
        let mut inflight = self.inflight.lock().unwrap();
        if let Some(tx) = inflight.get(key) {
            return Turn::Wait(tx.subscribe());
        }
        let (tx, _) = broadcast::channel(1);
        inflight.insert(key.to_vec(), tx.clone());
        Turn::Lead(Leader { cache: self, key: key.to_vec(), tx })
    }

    /// Reads a body that may be stored, up to `max_object_bytes`.
    async fn buffer(&self, mut body: Incoming) -> Buffered {
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return Buffered::Broken };
            if let Ok(data) = frame.into_data() {
                buf.extend_from_slice(&data);
                if buf.len() as u64 > self.max_object_bytes {
                    return Buffered::TooLarge(Replay { prefix: Some(buf.freeze()), rest: body }.boxed());
                }
            }
        }
        Buffered::Whole(buf.freeze())
    }

    /// Whether a response goes into the store at all: storable by the
    /// rules, fresh for a while, and not declared too large. One that is
    /// stale on arrival (no-cache, max-age=0, Set-Cookie without public)
    /// would only cost a write and a revalidation.
    fn worth_storing(&self, policy: &CachePolicy, resp: &response::Parts) -> bool {
        let declared = resp.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        policy.is_storable()
            && policy.time_to_live(SystemTime::now()) > Duration::ZERO
            && declared.is_none_or(|n| n <= self.max_object_bytes)
    }
}

fn cached(head: response::Parts, body: Bytes, outcome: Outcome) -> Response<ProxyBody> {
    let mut resp = Response::from_parts(head, full(body));
    resp.headers_mut().insert("x-cache", outcome.header());
    resp
}

fn fresh_head(policy: &CachePolicy, parts: &request::Parts) -> Option<response::Parts> {
    match policy.before_request(parts, SystemTime::now()) {
        BeforeRequest::Fresh(head) => Some(head),
        BeforeRequest::Stale { .. } => None,
    }
}

/// Answers a GET through the cache. `parts` carries the forwarding
/// headers already; `key` is the balancing hash key. A client's own
/// conditional request is answered 304 when the 200 it would get matches.
pub async fn serve(shared: &Arc<Shared>, cache: &HttpCache, parts: request::Parts, key: &[u8]) -> Result<Response<ProxyBody>, Refusal> {
    let conditional = [header::IF_NONE_MATCH, header::IF_MODIFIED_SINCE].iter().any(|h| parts.headers.contains_key(h));
    let req_headers = conditional.then(|| parts.headers.clone());
    let resp = lookup_or_fetch(shared, cache, parts, key).await?;
    match req_headers {
        Some(req) if resp.status() == StatusCode::OK && not_modified(&req, resp.headers()) => {
            let (mut head, _) = resp.into_parts();
            head.status = StatusCode::NOT_MODIFIED;
            head.headers.remove(header::CONTENT_LENGTH);
            Ok(Response::from_parts(head, full(Bytes::new())))
        }
        _ => Ok(resp),
    }
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

async fn lookup_or_fetch(shared: &Arc<Shared>, cache: &HttpCache, parts: request::Parts, key: &[u8]) -> Result<Response<ProxyBody>, Refusal> {
    if let Some(found) = cache.lookup(&parts).await {
        let now = SystemTime::now();
        match found.policy.before_request(&parts, now) {
            BeforeRequest::Fresh(head) => {
                shared.metrics.cache(Outcome::Hit);
                return Ok(cached(head, found.body, Outcome::Hit));
            }
            BeforeRequest::Stale { request, matches: true } if unix_ms(now) < found.swr_until_ms => {
                shared.metrics.cache(Outcome::Stale);
                let resp = cached(found.stale_head(), found.body.clone(), Outcome::Stale);
                revalidate_in_background(shared.clone(), parts, found, request, key.to_vec());
                return Ok(resp);
            }
            BeforeRequest::Stale { request, matches: true } => {
                let fallback = (unix_ms(now) < found.sie_until_ms).then(|| (found.stale_head(), found.body.clone()));
                let result = revalidate(shared, cache, &parts, found, request, key).await;
                let failed = match &result {
                    Ok(resp) => resp.status().is_server_error(),
                    Err(_) => true,
                };
                return match fallback {
                    Some((head, body)) if failed => {
                        shared.metrics.cache(Outcome::Stale);
                        Ok(cached(head, body, Outcome::Stale))
                    }
                    _ => {
                        if failed {
                            shared.metrics.cache(Outcome::Updated);
                        }
                        result
                    }
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
                if let Some(head) = fresh_head(&f.policy, &parts) {
                    shared.metrics.cache(Outcome::Coalesced);
                    return Ok(cached(head, f.body.clone(), Outcome::Coalesced));
                }
            }
            // The leader's response was not shareable (or not for this
            // variant): fetch our own.
            fetch(shared, cache, &parts, key, None, Outcome::Miss).await
        }
        Turn::Lead(leader) => {
            // A leader that finished between our lookup and join has
            // stored its response already.
            if let Some(found) = cache.lookup(&parts).await {
                if let Some(head) = fresh_head(&found.policy, &parts) {
                    leader.finish(Some(Arc::new(Fetched { policy: found.policy, body: found.body.clone() })));
                    shared.metrics.cache(Outcome::Hit);
                    return Ok(cached(head, found.body, Outcome::Hit));
                }
            }
            fetch(shared, cache, &parts, key, Some(leader), Outcome::Miss).await
        }
    }
}

/// Origin fetch after a miss.
async fn fetch(
    shared: &Shared,
    cache: &HttpCache,
    parts: &request::Parts,
    key: &[u8],
    leader: Option<Leader<'_>>,
    outcome: Outcome,
) -> Result<Response<ProxyBody>, Refusal> {
    let resp = forward::send(shared, parts, Bytes::new(), key).await?;
    keep(shared, cache, parts, resp, leader, outcome).await
}

/// Stores an origin response if it may be stored, hands it to the
/// coalesced waiters, and returns it for the client.
async fn keep(
    shared: &Shared,
    cache: &HttpCache,
    parts: &request::Parts,
    resp: Response<Incoming>,
    leader: Option<Leader<'_>>,
    outcome: Outcome,
) -> Result<Response<ProxyBody>, Refusal> {
    shared.metrics.cache(outcome);
    let (head, body) = resp.into_parts();
    let policy = CachePolicy::new_options(parts, &head, SystemTime::now(), options());
    if !cache.worth_storing(&policy, &head) {
        drop(leader);
        let mut resp = Response::from_parts(head, body.map_err(BoxError::from).boxed());
        resp.headers_mut().insert("x-cache", outcome.header());
        return Ok(resp);
    }
    match cache.buffer(body).await {
        Buffered::Whole(bytes) => {
            cache.put(parts, &head, &policy, bytes.clone()).await;
            if let Some(l) = leader {
                l.finish(Some(Arc::new(Fetched { policy, body: bytes.clone() })));
            }
            Ok(cached(head, bytes, outcome))
        }
        Buffered::TooLarge(body) => Ok(Response::from_parts(head, body)),
        Buffered::Broken => Err(Refusal::BackendDown),
    }
}

/// `stale-while-revalidate`: the client already has the stale entry; one
/// background request per URL refreshes it.
fn revalidate_in_background(shared: Arc<Shared>, parts: request::Parts, found: Found, conditional: request::Parts, key: Vec<u8>) {
    tokio::spawn(async move {
        let Some(cache) = &shared.cache else { return };
        let Turn::Lead(leader) = cache.join(&base_key(&parts)) else { return };
        if let Err(r) = revalidate(&shared, cache, &parts, found, conditional, &key).await {
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
    parts: &request::Parts,
    found: Found,
    conditional: request::Parts,
    key: &[u8],
) -> Result<Response<ProxyBody>, Refusal> {
    let resp = forward::send(shared, &conditional, Bytes::new(), key).await?;
    if resp.status().is_server_error() {
        // Not stored and not counted here: the caller may answer with the
        // stale entry instead (stale-if-error).
        return Ok(resp.map(|b| b.map_err(BoxError::from).boxed()));
    }
    if resp.status() != StatusCode::NOT_MODIFIED {
        return keep(shared, cache, parts, resp, None, Outcome::Updated).await;
    }
    let (head, _) = resp.into_parts();
    match found.policy.after_response(parts, &head, SystemTime::now()) {
        AfterResponse::NotModified(policy, merged) => {
            shared.metrics.cache(Outcome::Revalidated);
            cache.put(parts, &merged, &policy, found.body.clone()).await;
            Ok(cached(merged, found.body, Outcome::Revalidated))
        }
        // A 304 whose validators match nothing stored: the entry cannot be
        // trusted, so fetch it whole.
        AfterResponse::Modified(..) => fetch(shared, cache, parts, key, None, Outcome::Updated).await,
    }
}

/// Bytes already read, then the rest of the origin's body. http-body-util
/// has no concatenation of two bodies, so this small one is written here.
struct Replay {
    prefix: Option<Bytes>,
    rest: Incoming,
}

impl Body for Replay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        Pin::new(&mut self.rest).poll_frame(cx).map_err(BoxError::from)
    }

    fn size_hint(&self) -> SizeHint {
        let mut h = self.rest.size_hint();
        if let Some(p) = &self.prefix {
            let n = p.len() as u64;
            h.set_lower(h.lower() + n);
            if let Some(u) = h.upper() {
                h.set_upper(u + n);
            }
        }
        h
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }
}

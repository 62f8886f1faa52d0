//! Cache entries in an `inband-cache` [`Store`]: keys, the stored record,
//! reads and writes on the blocking pool, purge, and the coalescing table.
//!
//! Keys: `GET <host><path?query>` holds either a response or, when the
//! response has `Vary`, a marker naming the varied request headers; each
//! variant then lives under the base key + `\n` + those headers' values.
//! A response is found with one or two reads, and a purge finds the
//! variants by prefix.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use bytes::{Bytes, BytesMut};
use http::{header, request, response, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use http_cache_semantics::{CacheOptions, CachePolicy};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use inband_cache::{BodyChunks, EntryBody, NoWait, Store};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::body::{full, BoxError, ProxyBody};
use crate::cache_control;
use crate::config::{CacheConfig, SetCookie};

/// What the header blob of a stored record holds.
#[derive(Serialize, Deserialize)]
enum Head {
    /// A response: the policy carries status, headers and timing.
    Response(Box<Stored>),
    /// The response at this URL varies on these request headers.
    Vary(Vec<String>),
}

#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct Stored {
    pub(crate) policy: CachePolicy,
    /// Unix ms until which a stale entry may be served while it is
    /// revalidated (`stale-while-revalidate`); 0 for never.
    pub(crate) swr_until_ms: u64,
    /// Unix ms until which a stale entry may be served when the origin
    /// fails (`stale-if-error`); 0 for never.
    #[serde(default)]
    pub(crate) sie_until_ms: u64,
    /// The response head as the origin sent it (less Set-Cookie, plus the
    /// Date it lacked), which every response from this entry carries:
    /// the library's own head of a fresh entry has Cache-Control as it was
    /// shown (lower-cased, CDN-Cache-Control in its place) and the time of
    /// the hit as Date, where RFC 9110 §6.6.1 wants the origin's.
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    /// `headers` parsed, once per decoded record (hits reuse the decoded
    /// record, see [`Memo`]): a hit then copies a map, not re-parses names.
    #[serde(skip)]
    parsed: std::sync::OnceLock<HeaderMap>,
    /// Until when the entry is fresh, and whether its response has Vary:
    /// [`Stored::plainly_fresh`], once per decoded record.
    #[serde(skip)]
    plain: std::sync::OnceLock<(SystemTime, bool)>,
}

/// A storable response fetched once, handed to every coalesced waiter.
pub(crate) struct Fetched {
    pub(crate) stored: Arc<Stored>,
    pub(crate) body: Bytes,
}

type Waiters = broadcast::Sender<Option<Arc<Fetched>>>;

pub struct HttpCache {
    store: Arc<dyn Store>,
    max_object_bytes: u64,
    set_cookie: SetCookie,
    inline_reads: bool,
    inline_writes: bool,
    memo: Memo,
    inflight: Mutex<HashMap<Vec<u8>, Waiters>>,
}

/// A stored response found for a request.
pub(crate) struct Found {
    pub(crate) stored: Arc<Stored>,
    pub(crate) body: EntryBody,
}

impl Stored {
    /// Whether the caching library would answer `Fresh` for this request
    /// now, decided without it where the answer is certain: a GET with
    /// neither Cache-Control nor Pragma, found under its own key (so the
    /// same URI and Host as the stored request: the record's key says
    /// both), for a response without Vary. For such a request the
    /// library's check comes down to "not stale", and the moment an entry
    /// goes stale is fixed when it is stored (its age grows with the
    /// clock). `false` means "ask the library", which decides every other
    /// case. The library's `before_request` was a seventh of a hit's CPU
    /// (`perf`: it parses the stored headers again and builds a response
    /// head the proxy does not use).
    pub(crate) fn plainly_fresh(&self, parts: &request::Parts, now: SystemTime) -> bool {
        let (fresh_until, varies) = *self.plain.get_or_init(|| {
            let varies = self.headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("vary"));
            (now + self.policy.time_to_live(now), varies)
        });
        parts.method == http::Method::GET
            && !varies
            && !parts.headers.contains_key(header::CACHE_CONTROL)
            && !parts.headers.contains_key(header::PRAGMA)
            && now < fresh_until
    }

    /// The stored response as it is now: Age says how old.
    pub(crate) fn head(&self) -> response::Parts {
        let mut resp = self.origin_head();
        let age = self.policy.age(SystemTime::now()).as_secs();
        resp.headers.insert(header::AGE, HeaderValue::from(age));
        resp
    }

    fn origin_head(&self) -> response::Parts {
        let mut resp = Response::new(());
        *resp.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        *resp.headers_mut() = self
            .parsed
            .get_or_init(|| {
                let mut h = HeaderMap::with_capacity(self.headers.len());
                for (k, v) in &self.headers {
                    if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_bytes(v)) {
                        h.append(k, v);
                    }
                }
                h
            })
            .clone();
        resp.into_parts().0
    }

    /// The stored head freshened by a 304 (RFC 9111 §4.3.4): each field
    /// the 304 carries replaces the stored one, or is added, but those
    /// that describe the stored body. The library's merge updates only
    /// fields already stored and works on the view of the fields, not
    /// the fields as sent, so it is done here.
    pub(crate) fn freshened(&self, not_modified: &response::Parts) -> response::Parts {
        const BODY_FIELDS: [HeaderName; 4] = [header::CONTENT_LENGTH, header::CONTENT_ENCODING, header::TRANSFER_ENCODING, header::CONTENT_RANGE];
        let mut head = self.origin_head();
        for name in not_modified.headers.keys() {
            if BODY_FIELDS.contains(name) {
                continue;
            }
            head.headers.remove(name);
            for v in not_modified.headers.get_all(name) {
                head.headers.append(name, v.clone());
            }
        }
        head
    }
}

/// A record's header blob, decoded.
#[derive(Clone)]
enum Decoded {
    Response(Arc<Stored>),
    Vary(Arc<Vec<String>>),
}

/// Decoded header blobs, by which record they came from. Decoding the JSON
/// of a cache policy took a tenth of a hit's CPU, and hot entries are read
/// over and over. Keyed by the key's hash, the record's store time and its
/// CRC (which covers the header): a record replaced in the store is
/// another key here, so no invalidation is needed.
///
/// Bounded at [`MEMO_ENTRIES`] (a decoded entry, its policy's header maps
/// and the stored head, grew the heap by 4 KiB each for the benchmark's
/// objects: about 32 MiB when full). When full, an arbitrary eighth goes:
/// clearing it all, as it first did, made a working set just over the
/// bound decode again and again (5,000 objects over 4,096 entries: 4% of a
/// hit's CPU in JSON decoding and freeing), while hot entries evicted at
/// random come straight back.
#[derive(Default)]
struct Memo {
    map: Mutex<HashMap<(u128, u64, u32), Decoded, xxhash_rust::xxh3::Xxh3DefaultBuilder>>,
}

const MEMO_ENTRIES: usize = 8192;

impl Memo {
    fn decode(&self, key: &[u8], entry: &inband_cache::Entry) -> Option<Decoded> {
        let id = (xxhash_rust::xxh3::xxh3_128(key), entry.meta.stored_at_ms, entry.crc);
        let blob = &entry.header;
        if let Some(d) = self.map.lock().unwrap().get(&id) {
            return Some(d.clone());
        }
        let d = match serde_json::from_slice(blob).ok()? {
            Head::Response(st) => Decoded::Response(Arc::new(*st)),
            Head::Vary(names) => Decoded::Vary(Arc::new(names)),
        };
        let mut map = self.map.lock().unwrap();
        if map.len() >= MEMO_ENTRIES {
            let mut n = 0u32;
            map.retain(|_, _| {
                n += 1;
                !n.is_multiple_of(8)
            });
        }
        map.insert(id, d.clone());
        Some(d)
    }
}

/// `stale-while-revalidate=N` or `stale-if-error=N` (RFC 5861) of a
/// response's Cache-Control, in seconds: http-cache-semantics parses
/// Cache-Control but neither acts on nor exposes these.
fn stale_directive(headers: &HeaderMap, directive: &str) -> Option<u64> {
    cache_control::directive(headers, directive)??.parse().ok()
}

/// The one request fetching a key; dropping it (done or cancelled)
/// releases the key so no waiter waits on a fetch that will not come.
pub(crate) struct Leader<'a> {
    cache: &'a HttpCache,
    key: Vec<u8>,
    tx: Waiters,
}

impl Leader<'_> {
    pub(crate) fn finish(self, result: Option<Arc<Fetched>>) {
        self.release();
        let _ = self.tx.send(result);
    }

    /// Removes the key's entry only while it is still this leader's: once
    /// released, a newer request may lead the same key, and `finish`
    /// followed by `drop` must not remove that one.
    fn release(&self) {
        let mut inflight = self.cache.inflight.lock().unwrap();
        if inflight.get(&self.key).is_some_and(|tx| tx.same_channel(&self.tx)) {
            inflight.remove(&self.key);
        }
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

pub(crate) enum Turn<'a> {
    Lead(Leader<'a>),
    Wait(broadcast::Receiver<Option<Arc<Fetched>>>),
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub(crate) fn options() -> CacheOptions {
    // A proxy is a shared cache: `private` is not stored, `s-maxage` wins.
    CacheOptions { shared: true, ..Default::default() }
}

pub(crate) fn base_key(parts: &request::Parts) -> Vec<u8> {
    let host = parts.headers.get(header::HOST).map_or(&b""[..], |h| h.as_bytes());
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut k = b"GET ".to_vec();
    k.extend_from_slice(host);
    k.extend_from_slice(path.as_bytes());
    k
}

/// Where a stored 206 lives: beside the complete response, never in its
/// place (a variant's key has `name=` after the newline, this none), so
/// a request without Range never finds it, and a purge's prefix scan
/// does.
fn partial_key(base: &[u8]) -> Vec<u8> {
    let mut k = base.to_vec();
    k.extend_from_slice(b"\n206");
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

pub(crate) enum Buffered {
    Whole(Bytes),
    /// Over `max_object_bytes`: what was read, then the rest, streamed.
    TooLarge(ProxyBody),
    Broken,
}

impl HttpCache {
    pub fn open(cfg: &CacheConfig) -> Result<HttpCache> {
        let store: Arc<dyn Store> = Arc::from(inband_cache::open(&cfg.store_config())?);
        tracing::info!(backend = %cfg.backend, entries = store.len(), bytes = store.size_bytes(), "cache opened");
        let (inline_reads, inline_writes) = (!store.reads_block(), !store.writes_block());
        Ok(HttpCache {
            store,
            max_object_bytes: cfg.max_object_bytes,
            set_cookie: cfg.set_cookie,
            inline_reads,
            inline_writes,
            memo: Memo::default(),
            inflight: Mutex::new(HashMap::new()),
        })
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

    /// Reads that cannot wait on a disk (LMDB's mapped pages, memory) run
    /// right here on the runtime thread: a hop to the blocking pool and
    /// back costs more than the read (two thread wake-ups, half the CPU
    /// of a hit when it was done for every read).
    ///
    /// A key the store's in-memory index does not hold is a miss with no
    /// hop at all: a miss looks its key up twice (before and after joining
    /// the fetch), and `inband trace` showed RocksDB's misses making nine
    /// `futex` calls each, the blocking pool's wake-ups. An entry put
    /// between this check and the fetch is at worst one more origin
    /// request, as any miss racing a store is.
    async fn read(&self, key: Vec<u8>) -> Result<Option<inband_cache::Entry>> {
        if self.inline_reads {
            return self.store.get(&key);
        }
        if !self.store.contains(&key) {
            return Ok(None);
        }
        // A record the page cache holds (files) is read here as well.
        if let NoWait::Ready(entry) = self.store.get_nowait(&key)? {
            return Ok(entry);
        }
        self.blocking(move |s| s.get(&key)).await
    }

    async fn get(&self, key: Vec<u8>) -> Option<(Decoded, EntryBody)> {
        let entry = match self.read(key.clone()).await {
            Ok(e) => e?,
            Err(e) => {
                tracing::warn!(error = %e, "cache read failed");
                return None;
            }
        };
        Some((self.memo.decode(&key, &entry)?, entry.body))
    }

    /// A stored body as a response body: whole, or chunk by chunk from the
    /// store (on the blocking pool for stores whose reads can wait on a
    /// disk), so a hit on a large object holds one chunk at a time.
    pub(crate) fn response_body(&self, body: EntryBody) -> ProxyBody {
        match body {
            EntryBody::Whole(b) => full(b),
            EntryBody::Chunks(c) => StoreBody { chunks: Some(c), pending: None, blocking: !self.inline_reads, done: false }.boxed(),
        }
    }

    /// The whole stored body of this request's entry, read again: a 304
    /// rewrites the entry, body included, and the client gets it.
    pub(crate) async fn body_bytes(&self, parts: &request::Parts) -> Option<Bytes> {
        self.entry_bytes(self.lookup(parts).await?.body).await
    }

    /// A stored body whole in memory (one no larger than the object
    /// bound, as every stored body is).
    pub(crate) async fn entry_bytes(&self, body: EntryBody) -> Option<Bytes> {
        let read = match body {
            EntryBody::Whole(b) => return Some(b),
            c if self.inline_reads => c.into_bytes(),
            c => tokio::task::spawn_blocking(move || c.into_bytes()).await.map_err(anyhow::Error::from).and_then(|r| r),
        };
        read.map_err(|e| tracing::warn!(error = %e, "cache read failed")).ok()
    }

    /// The stored response for this request, following a Vary marker.
    pub(crate) async fn lookup(&self, parts: &request::Parts) -> Option<Found> {
        // Before the first await: once per lookup, not once per poll.
        crate::probe::cache_lookup();
        let base = base_key(parts);
        let (head, body) = match self.get(base.clone()).await? {
            (Decoded::Vary(names), _) => self.get(variant_key(&base, &names, &parts.headers)).await?,
            found => found,
        };
        match head {
            Decoded::Response(stored) => Some(Found { stored, body }),
            Decoded::Vary(_) => None,
        }
    }

    /// The stored 206 for this request's URL, if any.
    pub(crate) async fn lookup_partial(&self, parts: &request::Parts) -> Option<Found> {
        match self.get(partial_key(&base_key(parts))).await? {
            (Decoded::Response(stored), body) => Some(Found { stored, body }),
            (Decoded::Vary(_), _) => None,
        }
    }

    /// Stores a response as the origin sent it (and the Vary marker it
    /// needs) and returns the entry as stored, the one to serve other
    /// clients from. A 206 (of one part: the caller checks) is kept beside
    /// the complete response, one per URL and without a Vary marker (its
    /// stored request has the Vary'd fields, so the library refuses it to
    /// another variant); a complete 200 replaces it. A failure is logged:
    /// a response not stored is only a later miss.
    pub(crate) async fn put(&self, parts: &request::Parts, resp: &response::Parts, body: Bytes) -> Arc<Stored> {
        let now = SystemTime::now();
        let mut r = Response::new(());
        *r.status_mut() = resp.status;
        *r.version_mut() = resp.version;
        *r.headers_mut() = resp.headers.clone();
        // One client's cookie is never replayed to another: whatever the
        // mode, a stored head has no Set-Cookie (a 304 could bring one).
        r.headers_mut().remove(header::SET_COOKIE);
        // RFC 9110 §6.6.1: a response cached without Date gets the time
        // it was received.
        if !r.headers().contains_key(header::DATE) {
            let date = HeaderValue::from_str(&httpdate::fmt_http_date(now)).expect("an HTTP-date is a valid header value");
            r.headers_mut().insert(header::DATE, date);
        }
        let resp = r.into_parts().0;
        let mut view = cache_control::library_response(&resp);
        let partial = resp.status == StatusCode::PARTIAL_CONTENT;
        // The library refuses every 206 (it does not combine parts); the
        // freshness of the part is the response's, as for a 200.
        if partial {
            view.status = StatusCode::OK;
        }

        let base = base_key(parts);
        let vary = vary_names(&resp.headers);
        let persisted = CachePolicy::new_options(&persisted_request(parts, vary.as_deref()), &view, now, options());
        let fresh_until = now + persisted.time_to_live(now);
        let until = |d| stale_directive(&view.headers, d).map_or(0, |s| unix_ms(fresh_until + Duration::from_secs(s)));
        let (swr_until_ms, sie_until_ms) = (until("stale-while-revalidate"), until("stale-if-error"));
        let stored = Arc::new(Stored {
            policy: persisted,
            swr_until_ms,
            sie_until_ms,
            status: resp.status.as_u16(),
            headers: resp.headers.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect(),
            parsed: std::sync::OnceLock::new(),
            plain: std::sync::OnceLock::new(),
        });
        let mut writes = Vec::new();
        let superseded = (resp.status == StatusCode::OK).then(|| partial_key(&base)).filter(|k| self.store.contains(k));
        let key = match vary {
            _ if partial => partial_key(&base),
            Some(names) => {
                let key = variant_key(&base, &names, &parts.headers);
                writes.push((base, Head::Vary(names), Bytes::new()));
                key
            }
            None => base,
        };
        writes.push((key, Head::Response(Box::new((*stored).clone())), body));
        let stored_at = unix_ms(now);
        let expires = unix_ms(fresh_until);
        let write = move |s: &dyn Store| {
            for (k, head, b) in writes {
                s.put(&k, stored_at, expires, &serde_json::to_vec(&head)?, &b)?;
            }
            if let Some(k) = superseded {
                s.delete(&k)?;
            }
            Ok(())
        };
        // A write that cannot wait on a disk is done here: the blocking
        // pool's hop was two thread wake-ups per miss, as it was per hit
        // before reads moved onto the worker.
        let r = if self.inline_writes { write(&*self.store) } else { self.blocking(write).await };
        if let Err(e) = r {
            tracing::warn!(error = %e, "cache write failed");
        }
        stored
    }

    /// Deletes the entry for this URL and all its variants; returns how
    /// many responses went (a Vary marker is not one).
    pub async fn purge(&self, parts: &request::Parts) -> Result<u64> {
        let base = base_key(parts);
        let marker = matches!(self.get(base.clone()).await, Some((Decoded::Vary(_), _)));
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
            Ok(n.saturating_sub(marker as u64))
        })
        .await
    }

    /// Drops the URL's entries after a successful unsafe request. Cheaper
    /// than [`HttpCache::purge`] on the common path: only a URL whose base
    /// record is a Vary marker needs the scan for its variants.
    pub async fn invalidate(&self, parts: &request::Parts) -> Result<()> {
        let base = base_key(parts);
        let partial = partial_key(&base);
        if self.store.contains(&partial) {
            self.blocking(move |s| s.delete(&partial).map(drop)).await?;
        }
        let b = base.clone();
        let varies = self.blocking(move |s| Ok(s.get(&b)?.map(|e| matches!(serde_json::from_slice(&e.header), Ok(Head::Vary(_)))))).await?;
        match varies {
            Some(true) => self.purge(parts).await.map(drop),
            Some(false) => self.blocking(move |s| s.delete(&base).map(drop)).await,
            None => Ok(()),
        }
    }

    /// Become the one request that fetches `key`, or wait for the one that is.
    pub(crate) fn join(&self, key: &[u8]) -> Turn<'_> {
        let mut inflight = self.inflight.lock().unwrap();
        if let Some(tx) = inflight.get(key) {
            return Turn::Wait(tx.subscribe());
        }
        let (tx, _) = broadcast::channel(1);
        inflight.insert(key.to_vec(), tx.clone());
        Turn::Lead(Leader { cache: self, key: key.to_vec(), tx })
    }

    /// The store's bound on a body; a route may have a smaller one.
    pub(crate) fn max_object_bytes(&self) -> u64 {
        self.max_object_bytes
    }

    /// Reads a body that may be stored, up to `limit` bytes.
    pub(crate) async fn buffer(&self, mut body: Incoming, limit: u64) -> Buffered {
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return Buffered::Broken };
            if let Ok(data) = frame.into_data() {
                buf.extend_from_slice(&data);
                if buf.len() as u64 > limit {
                    return Buffered::TooLarge(Replay { prefix: Some(buf.freeze()), rest: body }.boxed());
                }
            }
        }
        Buffered::Whole(buf.freeze())
    }

    /// Whether a response goes into the store at all: storable by the
    /// rules, fresh for a while, not declared too large, and without
    /// Set-Cookie unless `set_cookie = "strip"`. One that is stale on arrival (no-cache, max-age=0, Set-Cookie without public)
    /// would only cost a write and a revalidation.
    pub(crate) fn worth_storing(&self, policy: &CachePolicy, resp: &response::Parts, limit: u64) -> bool {
        let declared = resp.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let cookie = resp.headers.contains_key(header::SET_COOKIE);
        !(cookie && self.set_cookie == SetCookie::Skip)
            && policy.is_storable()
            && policy.time_to_live(SystemTime::now()) > Duration::ZERO
            && declared.is_none_or(|n| n <= limit)
    }
}

/// A large stored body, chunk by chunk.
struct StoreBody {
    /// Out while a blocking read of the next chunk runs.
    chunks: Option<BodyChunks>,
    pending: Option<tokio::task::JoinHandle<(BodyChunks, Result<Option<Bytes>>)>>,
    blocking: bool,
    done: bool,
}

impl Body for StoreBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let next = if self.blocking {
            if self.pending.is_none() {
                let mut c = self.chunks.take().expect("chunks are here when no read is pending");
                self.pending = Some(tokio::task::spawn_blocking(move || {
                    let r = c.next_chunk();
                    (c, r)
                }));
            }
            let polled = Pin::new(self.pending.as_mut().expect("just set")).poll(cx);
            let Poll::Ready(joined) = polled else { return Poll::Pending };
            self.pending = None;
            match joined {
                Ok((c, r)) => {
                    self.chunks = Some(c);
                    r
                }
                Err(e) => Err(e.into()),
            }
        } else {
            self.chunks.as_mut().expect("inline reads keep the chunks").next_chunk()
        };
        Poll::Ready(match next {
            Ok(Some(b)) => Some(Ok(Frame::data(b))),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                // The client sees a body cut short (its length was
                // declared): never bytes that failed their checksum.
                self.done = true;
                tracing::warn!(error = %e, "stored body unreadable; response cut short");
                Some(Err(e.into()))
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        match &self.chunks {
            Some(c) if !self.done => SizeHint::with_exact(c.remaining()),
            _ => SizeHint::default(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn vary_entry(names: &[&str], crc: u32) -> inband_cache::Entry {
        let head = Head::Vary(names.iter().map(|n| n.to_string()).collect());
        inband_cache::Entry {
            meta: inband_cache::Meta { stored_at_ms: 1, expires_at_ms: u64::MAX, size: 0 },
            crc,
            header: serde_json::to_vec(&head).unwrap().into(),
            body: EntryBody::Whole(Bytes::new()),
        }
    }

    fn vary_names_of(d: Option<Decoded>) -> Vec<String> {
        match d {
            Some(Decoded::Vary(names)) => names.to_vec(),
            _ => panic!("not a decoded Vary marker"),
        }
    }

    #[test]
    fn a_full_memo_drops_an_eighth_and_still_decodes_every_record_right() {
        let memo = Memo::default();
        let key = |i: usize| format!("GET m.test/{i}").into_bytes();
        for i in 0..MEMO_ENTRIES + 100 {
            assert_eq!(vary_names_of(memo.decode(&key(i), &vary_entry(&["accept"], i as u32))), ["accept"]);
        }
        let len = memo.map.lock().unwrap().len();
        // Full at MEMO_ENTRIES: an eighth went, then the last inserts came in.
        assert!((MEMO_ENTRIES - MEMO_ENTRIES / 8..=MEMO_ENTRIES).contains(&len), "{len}");
        // Every record decodes again, evicted or not.
        for i in 0..MEMO_ENTRIES + 100 {
            assert_eq!(vary_names_of(memo.decode(&key(i), &vary_entry(&["accept"], i as u32))), ["accept"], "record {i}");
        }
        assert!(memo.map.lock().unwrap().len() <= MEMO_ENTRIES);
        // A record replaced under the same key (a new CRC) is decoded anew,
        // never answered from the old one's memo.
        assert_eq!(vary_names_of(memo.decode(&key(7), &vary_entry(&["accept-language"], 1 << 30))), ["accept-language"]);
    }

    /// The blocking pool's one thread is held: a read that hopped to it
    /// could not finish before the hold ends.
    #[test]
    fn a_files_read_waits_for_the_blocking_pool_only_when_the_disk_must_be_read() {
        let dir = tempfile::tempdir().unwrap();
        let cfg: CacheConfig = toml::from_str(&format!("backend = \"files\"\npath = {:?}", dir.path())).unwrap();
        let cache = HttpCache::open(&cfg).unwrap();
        assert!(!cache.inline_reads, "the files store's reads block: the case under test");
        let (key, absent) = (b"GET m.test/here".to_vec(), b"GET m.test/absent".to_vec());
        cache.store.put(&key, 1, u64::MAX, b"{}", b"body").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().max_blocking_threads(1).enable_time().build().unwrap();
        rt.block_on(async {
            let (release, held) = std::sync::mpsc::channel::<()>();
            let hold = tokio::task::spawn_blocking(move || held.recv());
            let within = |ms| Duration::from_millis(ms);
            let miss = tokio::time::timeout(within(2000), cache.read(absent)).await;
            assert!(matches!(miss, Ok(Ok(None))), "a miss waited for the blocking pool");
            let hit = tokio::time::timeout(within(2000), cache.read(key.clone())).await;
            assert!(matches!(hit, Ok(Ok(Some(_)))), "a record in the page cache waited for the blocking pool");
            // Out of the page cache, the read goes to the pool: it waits.
            // The refused read starts the disk read, which a virtual disk
            // can finish inside the call (then the loop's answer came
            // without a wait), so the record is dropped and read again
            // until one read waits; a read made on the event loop never does.
            let mut waited = false;
            for _ in 0..5 {
                inband_cache::bench::drop_cached_pages(dir.path()).unwrap();
                if tokio::time::timeout(within(200), cache.read(key.clone())).await.is_err() {
                    waited = true;
                    break;
                }
            }
            assert!(waited, "a record not in the page cache was read on the event loop five times");
            release.send(()).unwrap();
            hold.await.unwrap().unwrap();
            assert!(cache.read(key).await.unwrap().is_some());
        });
    }

    /// `plainly_fresh` says yes only where the library says `Fresh`, and
    /// says it for the plain GET of a fresh entry.
    #[test]
    fn plainly_fresh_agrees_with_the_library_where_it_answers() {
        let cfg: CacheConfig = toml::from_str("backend = \"memory\"").unwrap();
        let cache = HttpCache::open(&cfg).unwrap();
        let req = |uri: &str, extra: &[(&str, &str)]| {
            let mut b = http::Request::get(uri).header("host", "m.test");
            for (k, v) in extra {
                b = b.header(*k, *v);
            }
            b.body(()).unwrap().into_parts().0
        };
        let resp = |cc: &str, vary: Option<&str>| {
            let mut b = http::Response::builder().status(200).header("cache-control", cc);
            if let Some(v) = vary {
                b = b.header("vary", v);
            }
            b.body(()).unwrap().into_parts().0
        };
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let stored = [
                ("/fresh", resp("max-age=600", None)),
                ("/stale", resp("max-age=0", None)),
                ("/varies", resp("max-age=600", Some("accept-language"))),
            ];
            for (uri, r) in &stored {
                cache.put(&req(uri, &[]), r, Bytes::from_static(b"x")).await;
            }
            let now = SystemTime::now();
            let cases: [(&str, &[(&str, &str)], bool); 6] = [
                ("/fresh", &[], true),
                ("/fresh", &[("cache-control", "no-cache")], false),
                ("/fresh", &[("cache-control", "max-age=0")], false),
                ("/fresh", &[("pragma", "no-cache")], false),
                ("/stale", &[], false),
                ("/varies", &[], false),
            ];
            for (uri, extra, plain) in cases {
                let parts = req(uri, extra);
                let found = cache.lookup(&parts).await.unwrap_or_else(|| panic!("{uri} not stored"));
                let library = matches!(found.stored.policy.before_request(&parts, now), http_cache_semantics::BeforeRequest::Fresh(_));
                assert_eq!(found.stored.plainly_fresh(&parts, now), plain, "{uri} {extra:?}");
                assert!(!plain || library, "{uri} {extra:?}: plainly fresh where the library says stale");
            }
            // A request the fast path leaves to the library is still fresh
            // there when it is: the plain one's twin with a harmless field.
            let parts = req("/fresh", &[("accept", "*/*")]);
            let found = cache.lookup(&parts).await.unwrap();
            assert!(found.stored.plainly_fresh(&parts, now));
            assert!(matches!(found.stored.policy.before_request(&parts, now), http_cache_semantics::BeforeRequest::Fresh(_)));
        });
    }

    #[test]
    fn a_released_leader_never_removes_its_successor() {
        let cfg: CacheConfig = toml::from_str("backend = \"memory\"").unwrap();
        let cache = HttpCache::open(&cfg).unwrap();
        let Turn::Lead(first) = cache.join(b"k") else { panic!("the first request leads") };
        first.release();
        let Turn::Lead(second) = cache.join(b"k") else { panic!("a released key is free to lead") };
        // `finish` releases and then drops: the drop must leave `second`.
        drop(first);
        assert!(matches!(cache.join(b"k"), Turn::Wait(_)), "the second leader was removed by the first");
        second.finish(None);
        assert!(matches!(cache.join(b"k"), Turn::Lead(_)));
    }
}

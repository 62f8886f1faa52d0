//! Compression of stored responses (`[cache.compression]`): a response the
//! origin sent uncompressed is compressed once, when it is stored, in one
//! encoding (gzip by default), and every response from that entry is
//! chosen by the client's Accept-Encoding: the stored bytes to a client
//! that accepts the encoding, the origin's bytes, decoded as they are
//! sent, to one that does not (as Varnish keeps gzip and gunzips).
//!
//! One encoding is stored, not one per client coding: the cache's Vary
//! handling would otherwise keep a variant per Accept-Encoding string
//! (browsers and tools send dozens of spellings), each a miss. gzip by
//! default because every client that accepts any coding accepts gzip, so
//! decoding per request is left to clients that accept none (scripts,
//! probes); `br` or `zstd` store smaller entries for a browser audience
//! and decode for the others.
//!
//! The stored head keeps the origin's validators: the cache revalidates
//! with the origin's ETag, and a client decoding to identity gets the
//! origin's bytes under the origin's ETag. Only the encoded variant's ETag
//! is changed as it leaves (RFC 9110 §8.8.3: another representation needs
//! another entity tag), by a suffix inside the quotes. The identity length
//! rides in [`IDENTITY_LENGTH`], which never leaves the proxy.

use std::io::Write;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{header, response, HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;

use crate::body::{BoxError, ProxyBody};
use crate::cache_control;

/// Set on a stored head this module encoded: the body's length before.
const IDENTITY_LENGTH: &str = "inband-identity-length";

/// Decoded in steps of this much input: a deflate stream inflates up to
/// about 1000 times, so a step yields a few megabytes at most, whatever a
/// stored chunk (256 KiB) holds.
const DECODE_STEP: usize = 4096;

/// Removes what only the proxy may set from an origin's response: an
/// origin's `inband-identity-length` would make the proxy decode its body
/// and trust its length.
pub(crate) fn strip_internal(headers: &mut HeaderMap) {
    headers.remove(IDENTITY_LENGTH);
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressionConfig {
    /// The one encoding entries are stored in.
    #[serde(default)]
    pub encoding: Encoding,
    /// The encoder's level; the encoding's default when absent (gzip 6,
    /// brotli 5, zstd 3: a stored entry is compressed once, served many
    /// times, but a miss waits for it).
    #[serde(default)]
    pub level: Option<u32>,
    /// Smaller bodies are stored as they are: their frames would not shrink.
    #[serde(default = "default_min_bytes")]
    pub min_bytes: u64,
    /// Media types compressed: `type/subtype`, or `type/*`.
    #[serde(default = "default_types")]
    pub types: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Gzip,
    Br,
    Zstd,
}

const ENCODINGS: [Encoding; 3] = [Encoding::Gzip, Encoding::Br, Encoding::Zstd];

/// What storing a compressible response came to.
#[derive(Clone, Copy)]
enum Stored {
    Compressed,
    /// The encoded body was not smaller: stored as it came.
    NotSmaller,
    Failed,
}

/// The counters of this module, per encoding (by `Encoding as usize`):
/// handles taken once, so counting takes no family lookup.
pub(crate) struct Counters {
    stored: [[Counter; 3]; 3],
    /// Identity bytes in, encoded bytes out, of the responses stored compressed.
    bytes: [[Counter; 2]; 3],
    /// Responses from compressed entries sent as stored, and decoded for
    /// a client that does not accept the encoding.
    served: [[Counter; 2]; 3],
}

impl Counters {
    /// Registers the families, every series exported from the start.
    pub(crate) fn register(registry: &mut Registry) -> Counters {
        let stored = Family::<Vec<(&'static str, String)>, Counter>::default();
        let bytes = Family::<Vec<(&'static str, String)>, Counter>::default();
        let served = Family::<Vec<(&'static str, String)>, Counter>::default();
        registry.register(
            "compression_stored",
            "Compressible responses stored by [cache.compression], by encoding and result: compressed, not_smaller (stored as they came), failed (stored as they came)",
            stored.clone(),
        );
        registry.register("compression_bytes", "Body bytes of the responses stored compressed: identity (before) and encoded (after), by encoding", bytes.clone());
        registry.register(
            "compression_served",
            "Responses from compressed cache entries: encoded (the client accepts the encoding) or decoded (sent as the origin's bytes to a client that does not)",
            served.clone(),
        );
        let of = |f: &Family<Vec<(&'static str, String)>, Counter>, e: Encoding, k: &'static str, v: &str| {
            f.get_or_create(&vec![("encoding", e.token().to_string()), (k, v.to_string())]).clone()
        };
        Counters {
            stored: ENCODINGS.map(|e| ["compressed", "not_smaller", "failed"].map(|r| of(&stored, e, "result", r))),
            bytes: ENCODINGS.map(|e| ["identity", "encoded"].map(|r| of(&bytes, e, "side", r))),
            served: ENCODINGS.map(|e| ["encoded", "decoded"].map(|r| of(&served, e, "as", r))),
        }
    }

    fn stored(&self, e: Encoding, result: Stored) {
        self.stored[e as usize][result as usize].inc();
    }
}

fn default_min_bytes() -> u64 {
    1024
}

fn default_types() -> Vec<String> {
    [
        "text/*",
        "application/json",
        "application/javascript",
        "application/xml",
        "application/xhtml+xml",
        "application/rss+xml",
        "application/atom+xml",
        "application/wasm",
        "image/svg+xml",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

impl Encoding {
    /// Its content-coding token.
    fn token(self) -> &'static str {
        match self {
            Encoding::Gzip => "gzip",
            Encoding::Br => "br",
            Encoding::Zstd => "zstd",
        }
    }

    fn from_token(t: &str) -> Option<Encoding> {
        [Encoding::Gzip, Encoding::Br, Encoding::Zstd].into_iter().find(|e| t.trim().eq_ignore_ascii_case(e.token()))
    }

    fn levels(self) -> std::ops::RangeInclusive<u32> {
        match self {
            Encoding::Gzip => 1..=9,
            Encoding::Br => 0..=11,
            Encoding::Zstd => 1..=19,
        }
    }

    fn default_level(self) -> u32 {
        match self {
            Encoding::Gzip => 6,
            Encoding::Br => 5,
            Encoding::Zstd => 3,
        }
    }
}

impl CompressionConfig {
    /// What `config::check` refuses.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(l) = self.level.filter(|l| !self.encoding.levels().contains(l)) {
            let r = self.encoding.levels();
            out.push(format!("cache.compression.level = {l}: {} takes {}–{}", self.encoding.token(), r.start(), r.end()));
        }
        for t in &self.types {
            let ok = t.split_once('/').is_some_and(|(a, b)| !a.is_empty() && !b.is_empty() && a != "*" && !t.contains([';', ' ']));
            if !ok {
                out.push(format!("cache.compression.types: {t:?} is not a media type (type/subtype or type/*)"));
            }
        }
        out
    }

    fn compresses(&self, media_type: &str) -> bool {
        self.types.iter().any(|t| match t.strip_suffix("/*") {
            Some(top) => media_type.split_once('/').is_some_and(|(a, _)| a.eq_ignore_ascii_case(top)),
            None => media_type.eq_ignore_ascii_case(t),
        })
    }

    /// Whether a response may be stored compressed: a 200 sent without a
    /// coding, of a listed type, large enough, which the origin did not
    /// forbid to transform (RFC 9111 §5.2.2.6).
    fn applies(&self, head: &response::Parts, len: usize) -> bool {
        let h = &head.headers;
        let identity = h.get_all(header::CONTENT_ENCODING).iter().all(|v| v.to_str().is_ok_and(|v| v.split(',').all(|c| c.trim().eq_ignore_ascii_case("identity"))));
        let media = h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(|v| v.split(';').next().unwrap_or("").trim());
        head.status == StatusCode::OK
            && identity
            && !h.contains_key(header::CONTENT_RANGE)
            && len as u64 >= self.min_bytes
            && media.is_some_and(|m| self.compresses(m))
            && cache_control::directive(h, "no-transform").is_none()
    }
}

/// The response to store: compressed when `cfg` applies to it and the
/// result is smaller, otherwise as it came. Runs on the blocking pool: a
/// megabyte takes milliseconds to compress, and a runtime thread serves
/// other connections meanwhile.
pub(crate) async fn stored(cfg: Option<&CompressionConfig>, counters: &Counters, mut head: response::Parts, body: Bytes) -> (response::Parts, Bytes) {
    let Some(cfg) = cfg.filter(|c| c.applies(&head, body.len())) else { return (head, body) };
    let (encoding, level) = (cfg.encoding, cfg.level.unwrap_or(cfg.encoding.default_level()));
    let input = body.clone();
    let encoded = tokio::task::spawn_blocking(move || encode(encoding, level, &input)).await;
    match encoded {
        Ok(Ok(e)) if e.len() < body.len() => {
            counters.stored(encoding, Stored::Compressed);
            let [identity, encoded] = &counters.bytes[encoding as usize];
            identity.inc_by(body.len() as u64);
            encoded.inc_by(e.len() as u64);
            let h = &mut head.headers;
            h.remove(header::CONTENT_ENCODING);
            h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(encoding.token()));
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(e.len()));
            h.insert(IDENTITY_LENGTH, HeaderValue::from(body.len()));
            (head, Bytes::from(e))
        }
        Ok(Ok(_)) => {
            counters.stored(encoding, Stored::NotSmaller);
            (head, body)
        }
        Ok(Err(e)) => {
            counters.stored(encoding, Stored::Failed);
            tracing::warn!(error = %e, "compressing a response failed; stored as it came");
            (head, body)
        }
        Err(e) => {
            counters.stored(encoding, Stored::Failed);
            tracing::warn!(error = %e, "compressing a response failed; stored as it came");
            (head, body)
        }
    }
}

fn encode(encoding: Encoding, level: u32, input: &[u8]) -> std::io::Result<Vec<u8>> {
    match encoding {
        Encoding::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::with_capacity(input.len() / 3), flate2::Compression::new(level));
            e.write_all(input)?;
            e.finish()
        }
        Encoding::Br => {
            let mut out = Vec::with_capacity(input.len() / 3);
            {
                let mut w = brotli::CompressorWriter::new(&mut out, 4096, level, 22);
                w.write_all(input)?;
                w.flush()?;
            }
            Ok(out)
        }
        Encoding::Zstd => zstd::bulk::compress(input, level as i32),
    }
}

/// A response from the cache as this client gets it: unchanged unless
/// this module encoded the entry; then with `Vary: Accept-Encoding`, and
/// either encoded (the client accepts the coding: ETag suffixed) or
/// decoded while it is sent (origin's length and ETag).
pub(crate) fn for_client(accept: Option<&HeaderValue>, counters: &Counters, resp: Response<ProxyBody>) -> Response<ProxyBody> {
    let (mut head, body) = resp.into_parts();
    let length = head.headers.remove(IDENTITY_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let encoding = head.headers.get(header::CONTENT_ENCODING).and_then(|v| Encoding::from_token(v.to_str().ok()?));
    let (Some(length), Some(encoding)) = (length, encoding) else { return Response::from_parts(head, body) };
    add_vary(&mut head.headers);
    let accepted = accepts(accept, encoding);
    counters.served[encoding as usize][usize::from(!accepted)].inc();
    if accepted {
        if let Some(etag) = head.headers.remove(header::ETAG) {
            // An entity tag that does not parse is dropped, never shared
            // with the identity representation.
            if let Some(tag) = suffixed(&etag, encoding) {
                head.headers.insert(header::ETAG, tag);
            }
        }
        return Response::from_parts(head, body);
    }
    head.headers.remove(header::CONTENT_ENCODING);
    head.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    Response::from_parts(head, Decoding { inner: body, decoder: Some(Decoder::new(encoding)), input: Bytes::new(), remaining: length }.boxed())
}

fn add_vary(h: &mut HeaderMap) {
    let varies = h.get_all(header::VARY).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(|n| {
        let n = n.trim();
        n == "*" || n.eq_ignore_ascii_case("accept-encoding")
    });
    if !varies {
        h.append(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    }
}

/// RFC 9110 §12.5.3: the coding is acceptable if named (or `x-gzip` for
/// gzip), else if `*` is, with a quality above 0. No field: identity only
/// (a client that sends none may not decode anything).
fn accepts(accept: Option<&HeaderValue>, encoding: Encoding) -> bool {
    let Some(list) = accept.and_then(|v| v.to_str().ok()) else { return false };
    let (mut named, mut star) = (None, None);
    for item in list.split(',') {
        let mut parts = item.split(';');
        let coding = parts.next().unwrap_or("").trim();
        let q = parts
            .filter_map(|p| p.trim().strip_prefix("q=").or_else(|| p.trim().strip_prefix("Q=")))
            .find_map(|q| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        if coding.eq_ignore_ascii_case(encoding.token()) || (encoding == Encoding::Gzip && coding.eq_ignore_ascii_case("x-gzip")) {
            named = Some(named.map_or(q, |n: f32| n.max(q)));
        } else if coding == "*" {
            star = Some(q);
        }
    }
    named.or(star).is_some_and(|q| q > 0.0)
}

/// `"x"` → `"x-gzip"`, `W/"x"` → `W/"x-gzip"`.
fn suffixed(etag: &HeaderValue, encoding: Encoding) -> Option<HeaderValue> {
    let s = etag.to_str().ok()?;
    let (weak, opaque) = match s.strip_prefix("W/") {
        Some(rest) => ("W/", rest),
        None => ("", s),
    };
    let inner = opaque.strip_prefix('"')?.strip_suffix('"')?;
    HeaderValue::from_str(&format!("{weak}\"{inner}-{}\"", encoding.token())).ok()
}

enum Decoder {
    Gzip(flate2::write::GzDecoder<Vec<u8>>),
    Br(Box<brotli::DecompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Decoder<'static, Vec<u8>>),
}

impl Decoder {
    fn new(encoding: Encoding) -> Decoder {
        match encoding {
            Encoding::Gzip => Decoder::Gzip(flate2::write::GzDecoder::new(Vec::new())),
            Encoding::Br => Decoder::Br(Box::new(brotli::DecompressorWriter::new(Vec::new(), 4096))),
            Encoding::Zstd => Decoder::Zstd(zstd::stream::write::Decoder::new(Vec::new()).expect("a zstd decoder with default parameters")),
        }
    }

    /// Decodes `data`; returns what came out so far.
    fn push(&mut self, data: &[u8]) -> std::io::Result<Vec<u8>> {
        match self {
            Decoder::Gzip(d) => {
                d.write_all(data)?;
                d.flush()?;
                Ok(std::mem::take(d.get_mut()))
            }
            Decoder::Br(d) => {
                d.write_all(data)?;
                d.flush()?;
                Ok(std::mem::take(d.get_mut()))
            }
            Decoder::Zstd(d) => {
                d.write_all(data)?;
                d.flush()?;
                Ok(std::mem::take(d.get_mut()))
            }
        }
    }

    /// The end of the input: the rest, or an error if it was cut short.
    fn finish(self) -> std::io::Result<Vec<u8>> {
        match self {
            Decoder::Gzip(d) => d.finish(),
            Decoder::Br(d) => d.into_inner().map_err(|_| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "brotli stream cut short")),
            Decoder::Zstd(mut d) => {
                d.flush()?;
                Ok(d.into_inner())
            }
        }
    }
}

/// A stored encoded body decoded as it is sent.
struct Decoding {
    inner: ProxyBody,
    /// Taken at the end of the input.
    decoder: Option<Decoder>,
    /// Input not decoded yet: it goes in [`DECODE_STEP`] bytes at a time.
    input: Bytes,
    /// Identity bytes still to send: what size_hint says.
    remaining: u64,
}

impl Decoding {
    /// The stored length is checked as the bytes go (a 304's fields are
    /// merged into the stored head, so it is not ours alone): more or
    /// fewer bytes than declared cut the response short.
    fn out(&mut self, bytes: Vec<u8>, last: bool) -> Option<Result<Frame<Bytes>, BoxError>> {
        let n = bytes.len() as u64;
        if n > self.remaining || (last && n != self.remaining) {
            self.decoder = None;
            tracing::warn!(declared_left = self.remaining, decoded = n, "stored body decodes to another length; response cut short");
            return Some(Err("decoded length differs from the stored one".into()));
        }
        self.remaining -= n;
        Some(Ok(Frame::data(Bytes::from(bytes))))
    }
}

impl Body for Decoding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if self.decoder.is_none() {
                return Poll::Ready(None);
            }
            if !self.input.is_empty() {
                let n = self.input.len().min(DECODE_STEP);
                let step = self.input.split_to(n);
                let pushed = self.decoder.as_mut().expect("checked above").push(&step);
                match pushed {
                    Ok(out) if out.is_empty() => continue,
                    Ok(out) => return Poll::Ready(self.out(out, false)),
                    Err(e) => {
                        // The client sees a body cut short (its length
                        // was declared), never wrong bytes.
                        self.decoder = None;
                        tracing::warn!(error = %e, "stored body does not decode; response cut short");
                        return Poll::Ready(Some(Err(e.into())));
                    }
                }
            }
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.input = data,
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                Some(Err(e)) => {
                    self.decoder = None;
                    return Poll::Ready(Some(Err(e)));
                }
                None => {
                    let last = self.decoder.take().expect("checked above").finish();
                    return Poll::Ready(match last {
                        Ok(out) if out.is_empty() && self.remaining == 0 => None,
                        Ok(out) => self.out(out, true),
                        Err(e) => {
                            tracing::warn!(error = %e, "stored body does not decode; response cut short");
                            Some(Err(e.into()))
                        }
                    });
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.decoder.is_none() {
            return SizeHint::with_exact(0);
        }
        SizeHint::with_exact(self.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters() -> Counters {
        Counters::register(&mut Registry::default())
    }

    fn cfg(encoding: Encoding) -> CompressionConfig {
        CompressionConfig { encoding, level: None, min_bytes: default_min_bytes(), types: default_types() }
    }

    fn head(headers: &[(&str, &str)]) -> response::Parts {
        let mut r = Response::builder().status(200);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.body(()).unwrap().into_parts().0
    }

    /// xorshift64: bytes no coder can shrink.
    fn noise(n: usize) -> Bytes {
        let mut x = 0x9e3779b97f4a7c15u64;
        Bytes::from(
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect::<Vec<_>>(),
        )
    }

    fn text() -> Bytes {
        Bytes::from((0..2000).map(|i| format!("line {i} of a compressible body\n")).collect::<String>())
    }

    async fn served(accept: Option<&str>, head: response::Parts, body: Bytes) -> (response::Parts, Bytes) {
        let accept = accept.map(|a| HeaderValue::from_str(a).unwrap());
        let resp = for_client(accept.as_ref(), &counters(), Response::from_parts(head, crate::body::full(body)));
        let (h, b) = resp.into_parts();
        (h, b.collect().await.unwrap().to_bytes())
    }

    #[tokio::test]
    async fn each_encoding_round_trips_and_identity_gets_the_origins_bytes_and_etag() {
        for enc in [Encoding::Gzip, Encoding::Br, Encoding::Zstd] {
            let origin = text();
            let h = head(&[("content-type", "text/plain; charset=utf-8"), ("etag", "\"v1\"")]);
            let (h, stored) = stored(Some(&cfg(enc)), &counters(), h, origin.clone()).await;
            assert!(stored.len() < origin.len() / 4, "{enc:?}: {} of {}", stored.len(), origin.len());
            assert_eq!(h.headers[header::CONTENT_ENCODING], enc.token());
            assert_eq!(h.headers[IDENTITY_LENGTH], origin.len().to_string().as_str());
            assert_eq!(h.headers[header::ETAG], "\"v1\"", "the stored head keeps the origin's validator");
            // A client that accepts it: the stored bytes, a suffixed tag.
            let (got, body) = served(Some(&format!("deflate, {}", enc.token())), h.clone(), stored.clone()).await;
            assert_eq!(body, stored);
            assert_eq!(got.headers[header::ETAG], format!("\"v1-{}\"", enc.token()).as_str());
            assert_eq!(got.headers[header::VARY], "Accept-Encoding");
            assert!(!got.headers.contains_key(IDENTITY_LENGTH));
            // One that does not: the origin's bytes, length and tag.
            for accept in [None, Some("identity"), Some(&format!("{};q=0, *", enc.token())[..])] {
                let (got, body) = served(accept, h.clone(), stored.clone()).await;
                assert_eq!(body, origin, "{enc:?} {accept:?}");
                assert!(!got.headers.contains_key(header::CONTENT_ENCODING));
                assert_eq!(got.headers[header::CONTENT_LENGTH], origin.len().to_string().as_str());
                assert_eq!(got.headers[header::ETAG], "\"v1\"");
                assert_eq!(got.headers[header::VARY], "Accept-Encoding");
            }
        }
    }

    #[tokio::test]
    async fn what_is_not_compressed() {
        let c = cfg(Encoding::Gzip);
        let cases: [(&str, response::Parts, Bytes); 6] = [
            ("already encoded", head(&[("content-type", "text/plain"), ("content-encoding", "gzip")]), text()),
            ("not a listed type", head(&[("content-type", "image/png")]), text()),
            ("no type", head(&[]), text()),
            ("too small", head(&[("content-type", "text/plain")]), Bytes::from_static(b"short")),
            ("no-transform", head(&[("content-type", "text/plain"), ("cache-control", "max-age=60, no-transform")]), text()),
            ("incompressible", head(&[("content-type", "text/plain")]), noise(4096)),
        ];
        for (why, h, body) in cases {
            let before = h.headers.clone();
            let (h, out) = stored(Some(&c), &counters(), h, body.clone()).await;
            assert!(out == body && h.headers == before, "{why}: {:?}", h.headers);
            // And it leaves the proxy as it came, Vary untouched.
            let (got, b) = served(None, h, body.clone()).await;
            assert!(b == body && got.headers == before, "{why}: {:?}", got.headers);
        }
        let mut partial = head(&[("content-type", "text/plain")]);
        partial.status = StatusCode::PARTIAL_CONTENT;
        assert_eq!(stored(Some(&c), &counters(), partial, text()).await.1, text(), "a 206");
        assert_eq!(stored(None, &counters(), head(&[("content-type", "text/plain")]), text()).await.1, text(), "no [cache.compression]");
    }

    #[test]
    fn accept_encoding_is_read_as_rfc_9110_says() {
        let a = |s: &str, e| accepts(Some(&HeaderValue::from_str(s).unwrap()), e);
        assert!(a("gzip", Encoding::Gzip) && a("x-gzip", Encoding::Gzip) && a("GZIP;q=0.5", Encoding::Gzip));
        assert!(a("deflate, gzip, br, zstd", Encoding::Zstd) && a("*", Encoding::Br));
        assert!(!a("gzip;q=0", Encoding::Gzip) && !a("*, gzip;q=0", Encoding::Gzip) && !a("*;q=0", Encoding::Br));
        assert!(!a("br", Encoding::Gzip) && !a("identity", Encoding::Gzip) && !a("", Encoding::Gzip));
        assert!(!accepts(None, Encoding::Gzip));
    }

    #[test]
    fn etags_are_suffixed_inside_the_quotes_or_dropped() {
        let s = |t: &str| suffixed(&HeaderValue::from_str(t).unwrap(), Encoding::Br).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(s("\"abc\"").as_deref(), Some("\"abc-br\""));
        assert_eq!(s("W/\"abc\"").as_deref(), Some("W/\"abc-br\""));
        assert_eq!(s("abc"), None);
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = cfg(Encoding::Gzip);
        c.level = Some(12);
        c.types = vec!["text".into(), "*/*".into(), "text/html; charset=utf-8".into(), "application/json".into()];
        let p = c.problems().join("\n");
        assert!(p.contains("level = 12: gzip takes 1–9"), "{p}");
        assert_eq!(p.matches("is not a media type").count(), 3, "{p}");
    }

    #[tokio::test]
    async fn a_corrupt_stored_body_is_cut_short_not_served_wrong() {
        let h = head(&[("content-type", "text/plain")]);
        let (h, stored) = stored(Some(&cfg(Encoding::Gzip)), &counters(), h, text()).await;
        let mut bad = stored.to_vec();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        let resp = for_client(None, &counters(), Response::from_parts(h, crate::body::full(Bytes::from(bad))));
        assert!(resp.into_body().collect().await.is_err());
    }
}

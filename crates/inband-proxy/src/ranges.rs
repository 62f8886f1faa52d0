//! Byte ranges (RFC 9110 §14): a client's `Range` and `If-Range` read,
//! a stored response cut to the range asked for, and a 206 from the
//! origin checked before it is stored (RFC 9111 §3.3).
//!
//! One range is answered 206 with that part of the body; several are
//! answered with the whole 200, as RFC 9110 §14.2 allows a server to
//! ignore Range. A multipart/byteranges answer is where the range
//! denial-of-service lies (many small or overlapping ranges make a
//! response many times the body, CVE-2011-3192), and a streamed body
//! would have to be read once per part; clients that ask for several
//! ranges (PDF viewers) take the whole body as well.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::body::{full, BoxError, ProxyBody};

/// The most range-specs of one Range field that are read. A client that
/// asks for more gets the whole body; parsing stops here, so a field of
/// thousands costs no more than this.
pub(crate) const MAX_RANGES: usize = 64;

/// A client's Range, taken off its request: the cache fetches and
/// stores whole responses, and answers the range itself.
#[derive(Clone)]
pub(crate) struct Asked {
    pub(crate) range: HeaderValue,
    pub(crate) if_range: Option<HeaderValue>,
}

impl Asked {
    /// Removes Range and If-Range from a request (If-Range without Range
    /// means nothing, RFC 9110 §13.1.5, and goes too).
    pub(crate) fn take(headers: &mut HeaderMap) -> Option<Asked> {
        let if_range = headers.remove(header::IF_RANGE);
        let range = headers.remove(header::RANGE)?;
        Some(Asked { range, if_range })
    }

    /// Puts them back on a request to the origin.
    pub(crate) fn restore(&self, headers: &mut HeaderMap) {
        headers.insert(header::RANGE, self.range.clone());
        if let Some(v) = &self.if_range {
            headers.insert(header::IF_RANGE, v.clone());
        }
    }
}

/// What a Range field asks of a representation of `len` bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// One range, first and last byte positions, inclusive.
    One(u64, u64),
    /// Several satisfiable ranges: the whole body is sent.
    Several,
    /// No range is satisfiable: 416.
    Unsatisfiable,
    /// Not a byte range set (another unit, bad syntax): ignored.
    Invalid,
    /// More than [`MAX_RANGES`] range-specs, or overlapping ones: the
    /// whole body is sent, and it is counted.
    Refused,
}

enum Spec {
    From(u64, Option<u64>),
    Suffix(u64),
}

/// RFC 9110 §14.1.1-2, against a representation of `len` bytes.
pub(crate) fn resolve(field: &HeaderValue, len: u64) -> Resolved {
    let Ok(text) = field.to_str() else { return Resolved::Invalid };
    let Some((unit, set)) = text.split_once('=') else { return Resolved::Invalid };
    if !unit.trim().eq_ignore_ascii_case("bytes") {
        return Resolved::Invalid;
    }
    let mut specs = Vec::new();
    // A #list may have empty elements (RFC 9110 §5.6.1).
    for item in set.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if specs.len() == MAX_RANGES {
            return Resolved::Refused;
        }
        let Some((first, last)) = item.split_once('-') else { return Resolved::Invalid };
        let num = |s: &str| (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse::<u64>().ok()).flatten();
        let spec = match (first.trim(), last.trim()) {
            ("", n) => Spec::Suffix(match num(n) {
                Some(n) => n,
                None => return Resolved::Invalid,
            }),
            (f, "") => match num(f) {
                Some(f) => Spec::From(f, None),
                None => return Resolved::Invalid,
            },
            (f, l) => match (num(f), num(l)) {
                (Some(f), Some(l)) if f <= l => Spec::From(f, Some(l)),
                _ => return Resolved::Invalid,
            },
        };
        specs.push(spec);
    }
    if specs.is_empty() {
        return Resolved::Invalid;
    }
    let mut satisfiable: Vec<(u64, u64)> = specs
        .iter()
        .filter_map(|s| match *s {
            Spec::From(f, l) if f < len => Some((f, l.map_or(len - 1, |l| l.min(len - 1)))),
            Spec::Suffix(n) if n > 0 && len > 0 => Some((len - n.min(len), len - 1)),
            _ => None,
        })
        .collect();
    match satisfiable.len() {
        0 => Resolved::Unsatisfiable,
        1 => Resolved::One(satisfiable[0].0, satisfiable[0].1),
        _ => {
            satisfiable.sort_unstable();
            if satisfiable.windows(2).any(|w| w[1].0 <= w[0].1) {
                Resolved::Refused
            } else {
                Resolved::Several
            }
        }
    }
}

/// RFC 9110 §13.1.5: an entity-tag matches by strong comparison (a weak
/// tag on either side never does), a date only the Last-Modified it
/// equals. No If-Range: the range applies.
pub(crate) fn if_range_holds(if_range: Option<&HeaderValue>, resp: &HeaderMap) -> bool {
    let Some(cond) = if_range.and_then(|v| v.to_str().ok()) else { return if_range.is_none() };
    let cond = cond.trim();
    if cond.starts_with('"') || cond.starts_with("W/") {
        let etag = resp.get(header::ETAG).and_then(|v| v.to_str().ok()).map(str::trim);
        return !cond.starts_with("W/") && etag.is_some_and(|e| e.starts_with('"') && e == cond);
    }
    let date = |s: &str| httpdate::parse_http_date(s).ok();
    match (date(cond), resp.get(header::LAST_MODIFIED).and_then(|v| date(v.to_str().ok()?))) {
        (Some(since), Some(modified)) => since == modified,
        _ => false,
    }
}

/// `bytes first-last/complete` of a 206 with one part (RFC 9110 §14.4).
pub(crate) fn content_range(headers: &HeaderMap) -> Option<(u64, u64, u64)> {
    let text = headers.get(header::CONTENT_RANGE)?.to_str().ok()?;
    let (unit, rest) = text.trim().split_once(' ')?;
    if !unit.eq_ignore_ascii_case("bytes") {
        return None;
    }
    let (span, complete) = rest.trim().split_once('/')?;
    let (first, last) = span.split_once('-')?;
    let num = |s: &str| (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse::<u64>().ok()).flatten();
    let (first, last, complete) = (num(first)?, num(last)?, num(complete)?);
    (first <= last && last < complete).then_some((first, last, complete))
}

fn content_range_value(first: u64, last: u64, complete: u64) -> HeaderValue {
    HeaderValue::try_from(format!("bytes {first}-{last}/{complete}")).expect("digits make a header value")
}

/// A 200 cut to the range asked for (206 or 416), or the 200 as it is
/// when the range does not apply; counted either way.
pub(crate) fn cut(asked: &Asked, resp: Response<ProxyBody>, counters: &Counters) -> Response<ProxyBody> {
    if resp.status() != StatusCode::OK {
        return resp;
    }
    if !if_range_holds(asked.if_range.as_ref(), resp.headers()) {
        counters.count(Answer::Whole);
        return resp;
    }
    let Some(len) = resp.body().size_hint().exact() else {
        counters.count(Answer::Whole);
        return resp;
    };
    match resolve(&asked.range, len) {
        Resolved::One(first, last) => {
            counters.count(Answer::Partial);
            slice(resp, first, last, len, 0)
        }
        Resolved::Unsatisfiable => {
            counters.count(Answer::Unsatisfiable);
            let (mut head, _) = resp.into_parts();
            head.status = StatusCode::RANGE_NOT_SATISFIABLE;
            head.headers.insert(header::CONTENT_RANGE, HeaderValue::try_from(format!("bytes */{len}")).expect("digits make a header value"));
            head.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(head, full(Bytes::new()))
        }
        Resolved::Several => {
            counters.count(Answer::Several);
            resp
        }
        Resolved::Invalid => {
            counters.count(Answer::Invalid);
            resp
        }
        Resolved::Refused => {
            counters.count(Answer::Refused);
            resp
        }
    }
}

/// A 206 of bytes `first..=last` of a representation of `complete`
/// bytes, from a response whose body starts at byte `offset` of it.
pub(crate) fn slice(resp: Response<ProxyBody>, first: u64, last: u64, complete: u64, offset: u64) -> Response<ProxyBody> {
    let (mut head, body) = resp.into_parts();
    head.status = StatusCode::PARTIAL_CONTENT;
    head.headers.insert(header::CONTENT_RANGE, content_range_value(first, last, complete));
    head.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(last - first + 1));
    Response::from_parts(head, Slice { inner: body, skip: first - offset, left: last - first + 1 }.boxed())
}

/// Bytes `skip..skip + left` of a body. The bytes before are read and
/// dropped as they come (a stored body one chunk at a time, so a range
/// at the end of a large object holds one chunk in memory, not the
/// object); the body is not read past the range.
struct Slice {
    inner: ProxyBody,
    skip: u64,
    left: u64,
}

impl Body for Slice {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => f,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                // The body ended before the range did: its length was
                // promised, so the client must see it cut short.
                Poll::Ready(None) => return Poll::Ready(Some(Err("the body ended before the range asked for".into()))),
                Poll::Pending => return Poll::Pending,
            };
            let Ok(mut data) = frame.into_data() else { continue };
            let n = data.len() as u64;
            if self.skip >= n {
                self.skip -= n;
                continue;
            }
            let from = self.skip as usize;
            self.skip = 0;
            let to = (from as u64 + self.left).min(n) as usize;
            self.left -= (to - from) as u64;
            data = data.slice(from..to);
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

/// How a Range request was answered, or what became of a 206.
#[derive(Clone, Copy)]
pub(crate) enum Answer {
    /// 206 from a stored (or just fetched) complete response.
    Partial,
    /// 206 from a stored partial response.
    FromPartial,
    /// 416: no range within the body.
    Unsatisfiable,
    /// The whole 200: If-Range did not match, or the body's length is
    /// not known before it is sent (decoded for the client).
    Whole,
    /// The whole 200: several ranges asked.
    Several,
    /// The whole 200: the Range field is not a byte range set.
    Invalid,
    /// The whole 200: more than [`MAX_RANGES`] ranges, or overlapping ones.
    Refused,
    /// A 206 from the origin stored (alone, or combined with the stored
    /// part it adjoins).
    Stored,
    /// A 206 from the origin whose Content-Range does not match its body
    /// (or names several parts): passed on, not stored.
    Malformed,
}

const RESULTS: [(Answer, &str); 9] = [
    (Answer::Partial, "partial"),
    (Answer::FromPartial, "from_partial"),
    (Answer::Unsatisfiable, "unsatisfiable"),
    (Answer::Whole, "whole"),
    (Answer::Several, "several"),
    (Answer::Invalid, "invalid"),
    (Answer::Refused, "refused"),
    (Answer::Stored, "stored"),
    (Answer::Malformed, "malformed"),
];

/// `cache_ranges`, a handle per result taken once.
pub(crate) struct Counters([Counter; RESULTS.len()]);

impl Counters {
    pub(crate) fn register(registry: &mut Registry) -> Counters {
        let family = Family::<Vec<(&'static str, String)>, Counter>::default();
        registry.register(
            "cache_ranges",
            "Range requests through the cache by answer: partial (206 from a complete response), from_partial (206 from a stored 206), unsatisfiable (416), whole (200: If-Range did not match or the length was not known), several (200: several ranges), invalid (200: not a byte range set), refused (200: too many or overlapping ranges); and 206s from the origin: stored, malformed (not stored)",
            family.clone(),
        );
        Counters(RESULTS.map(|(_, label)| family.get_or_create(&vec![("result", label.to_string())]).clone()))
    }

    pub(crate) fn count(&self, r: Answer) {
        self.0[r as usize].inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(field: &str, len: u64) -> Resolved {
        resolve(&HeaderValue::from_str(field).unwrap(), len)
    }

    #[test]
    fn ranges_resolve_as_rfc_9110_says() {
        assert_eq!(r("bytes=0-1", 11), Resolved::One(0, 1));
        assert_eq!(r("bytes=1-", 11), Resolved::One(1, 10));
        assert_eq!(r("bytes=-1", 11), Resolved::One(10, 10));
        assert_eq!(r("bytes=-100", 11), Resolved::One(0, 10));
        assert_eq!(r("bytes=5-100", 11), Resolved::One(5, 10));
        assert_eq!(r("BYTES = 2-3", 11), Resolved::One(2, 3));
        assert_eq!(r("bytes=, 2-3 ,", 11), Resolved::One(2, 3));
        // One satisfiable among unsatisfiable ones.
        assert_eq!(r("bytes=20-30,2-3", 11), Resolved::One(2, 3));
        assert_eq!(r("bytes=11-", 11), Resolved::Unsatisfiable);
        assert_eq!(r("bytes=-0", 11), Resolved::Unsatisfiable);
        assert_eq!(r("bytes=0-", 0), Resolved::Unsatisfiable);
        assert_eq!(r("bytes=-5", 0), Resolved::Unsatisfiable);
        assert_eq!(r("bytes=0-1,5-6", 11), Resolved::Several);
        assert_eq!(r("bytes=0-5,5-6", 11), Resolved::Refused);
        assert_eq!(r("bytes=0-1,0-1", 11), Resolved::Refused);
        for bad in ["bytes=3-2", "bytes=a-", "bytes=1", "bytes=", "items=0-1", "bytes=--1", "bytes=+1-2", "bytes=0-1-2", "0-1"] {
            assert_eq!(r(bad, 11), Resolved::Invalid, "{bad}");
        }
        let many = (0..MAX_RANGES + 1).map(|i| format!("{}-{}", 2 * i, 2 * i)).collect::<Vec<_>>().join(",");
        assert_eq!(r(&format!("bytes={many}"), 10_000), Resolved::Refused);
        let most = (0..MAX_RANGES).map(|i| format!("{}-{}", 2 * i, 2 * i)).collect::<Vec<_>>().join(",");
        assert_eq!(r(&format!("bytes={most}"), 10_000), Resolved::Several);
    }

    #[test]
    fn if_range_compares_strongly() {
        let mut h = HeaderMap::new();
        h.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
        h.insert(header::LAST_MODIFIED, HeaderValue::from_static("Tue, 15 Nov 1994 12:45:26 GMT"));
        let holds = |v: &str, h: &HeaderMap| if_range_holds(Some(&HeaderValue::from_str(v).unwrap()), h);
        assert!(if_range_holds(None, &h));
        assert!(holds("\"v1\"", &h));
        assert!(!holds("\"v2\"", &h));
        assert!(!holds("W/\"v1\"", &h));
        assert!(holds("Tue, 15 Nov 1994 12:45:26 GMT", &h));
        assert!(!holds("Tue, 15 Nov 1994 12:45:27 GMT", &h));
        assert!(!holds("garbage", &h));
        h.insert(header::ETAG, HeaderValue::from_static("W/\"v1\""));
        assert!(!holds("W/\"v1\"", &h));
    }

    /// A body of `chunks` frames of `size` bytes (byte i is `i % 251`),
    /// counting the frames it handed out.
    struct Frames {
        size: usize,
        chunks: usize,
        polled: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            let i = self.polled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if i == self.chunks {
                return Poll::Ready(None);
            }
            let data: Vec<u8> = (i * self.size..(i + 1) * self.size).map(|b| (b % 251) as u8).collect();
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(data)))))
        }
    }

    /// The slice drops the frames before the range as they come and reads
    /// none after it: a range at the start of a large body reads one
    /// chunk, one in its middle reads up to the chunk that ends it.
    #[test]
    fn a_slice_reads_no_further_than_its_range() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (size, chunks) = (1000, 50);
        for (first, last, frames) in [(0, 99, 1), (2500, 2600, 3), (999, 1000, 2), (49_000, 49_999, 50)] {
            let polled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let body = Frames { size, chunks, polled: polled.clone() }.boxed();
            let resp = slice(Response::new(body), first, last, (size * chunks) as u64, 0);
            assert_eq!(resp.headers()[header::CONTENT_RANGE], format!("bytes {first}-{last}/50000"));
            let got = rt.block_on(resp.into_body().collect()).unwrap().to_bytes();
            let want: Vec<u8> = (first..=last).map(|b| (b % 251) as u8).collect();
            assert_eq!(&got[..], &want[..], "{first}-{last}");
            assert_eq!(polled.load(std::sync::atomic::Ordering::SeqCst), frames, "{first}-{last}: frames read");
        }
    }

    #[test]
    fn content_range_is_read_strictly() {
        let of = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_RANGE, HeaderValue::from_str(v).unwrap());
            content_range(&h)
        };
        assert_eq!(of("bytes 4-9/10"), Some((4, 9, 10)));
        assert_eq!(of("bytes 4-10/10"), None);
        assert_eq!(of("bytes 5-4/10"), None);
        assert_eq!(of("bytes 0-4/*"), None);
        assert_eq!(of("bytes */10"), None);
        assert_eq!(of("items 0-4/10"), None);
    }
}

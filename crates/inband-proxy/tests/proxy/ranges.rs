//! Range requests through the cache (RFC 9110 §14, RFC 9111 §3.3-3.4):
//! ranges cut from a stored complete response, small and streamed, 206s
//! from the origin stored and combined, hostile Range fields.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::*;
use inband_proxy::Proxy;

const HOST: &str = "ranges.test";

/// Printable bytes in no repeating pattern, so a slice from the wrong
/// offset never equals the right one.
fn pattern(n: usize) -> Vec<u8> {
    let mut x: u32 = 0x9e37_79b9;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            b'a' + (x % 26) as u8
        })
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` against `len`, as a test
/// origin that honours one range reads it.
fn one_range(field: &str, len: usize) -> (usize, usize) {
    let spec = field.strip_prefix("bytes=").unwrap();
    let (a, b) = spec.split_once('-').unwrap();
    match (a, b) {
        ("", n) => (len - n.parse::<usize>().unwrap(), len - 1),
        (a, "") => (a.parse().unwrap(), len - 1),
        (a, b) => (a.parse().unwrap(), b.parse::<usize>().unwrap().min(len - 1)),
    }
}

fn cache_section(dir: &std::path::Path, backend: &str, max_object_bytes: u64) -> String {
    format!("[cache]\nbackend = \"{backend}\"\npath = \"{}\"\ncapacity_bytes = 67108864\nmax_object_bytes = {max_object_bytes}", dir.display())
}

async fn rget(p: &Proxy, path: &str, extra: &[(&str, &str)]) -> Reply2 {
    let mut h = vec![("host", HOST)];
    h.extend_from_slice(extra);
    send(p.addr, "GET", path, &h, b"").await
}

fn field<'a>(r: &'a Reply2, name: &str) -> &'a str {
    r.headers.get(name).map_or("-", |v| v.to_str().unwrap())
}

fn ranges_counter(m: &str, result: &str) -> f64 {
    sample(m, &format!("inband_proxy_cache_ranges_total{{result=\"{result}\"}}"))
}

/// A stored 200 answers ranges itself: one range 206 with exactly those
/// bytes, none satisfiable 416, several the whole 200, If-Range by strong
/// comparison; the origin is asked once.
#[tokio::test]
async fn ranges_are_cut_from_a_stored_complete_response() {
    let o = Origin::start(|_| ok("0123456789A").header("cache-control", "max-age=60").header("etag", "\"v1\"").header("a", "1")).await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section(dir.path(), "lmdb", 4096)).await;
    // The first request is a range too: the origin ignores it (a 200),
    // which is stored whole and cut.
    let r = rget(&p, "/c", &[("range", "bytes=0-1")]).await;
    assert_eq!((r.status, r.body.as_str(), field(&r, "content-range")), (206, "01", "bytes 0-1/11"));
    for (range, body, content_range) in [
        ("bytes=0-1", "01", "bytes 0-1/11"),
        ("bytes=1-", "123456789A", "bytes 1-10/11"),
        ("bytes=-1", "A", "bytes 10-10/11"),
        ("bytes=3-100", "3456789A", "bytes 3-10/11"),
    ] {
        let r = rget(&p, "/c", &[("range", range)]).await;
        assert_eq!(r.status, 206, "{range}");
        assert_eq!(r.body, body, "{range}");
        assert_eq!(field(&r, "content-range"), content_range, "{range}");
        assert_eq!(field(&r, "content-length"), body.len().to_string(), "{range}");
        assert_eq!((field(&r, "x-cache"), field(&r, "a"), field(&r, "etag")), ("HIT", "1", "\"v1\""), "{range}");
    }
    let r = rget(&p, "/c", &[("range", "bytes=11-")]).await;
    assert_eq!((r.status, r.body.as_str(), field(&r, "content-range")), (416, "", "bytes */11"));
    let r = rget(&p, "/c", &[("range", "bytes=0-1,5-6")]).await;
    assert_eq!((r.status, r.body.as_str(), field(&r, "content-range")), (200, "0123456789A", "-"));
    let r = rget(&p, "/c", &[("range", "bytes=2-3"), ("if-range", "\"v1\"")]).await;
    assert_eq!((r.status, r.body.as_str()), (206, "23"));
    for stale in ["\"v2\"", "W/\"v1\"", "Tue, 15 Nov 1994 12:45:26 GMT"] {
        let r = rget(&p, "/c", &[("range", "bytes=2-3"), ("if-range", stale)]).await;
        assert_eq!((r.status, r.body.as_str()), (200, "0123456789A"), "If-Range {stale}");
    }
    // Another unit, or no valid byte range set: the Range is ignored.
    let r = rget(&p, "/c", &[("range", "items=0-1")]).await;
    assert_eq!((r.status, r.body.as_str()), (200, "0123456789A"));
    // The client's validators come before its range (RFC 9110 §13.2.2).
    let r = rget(&p, "/c", &[("range", "bytes=0-1"), ("if-none-match", "\"v1\"")]).await;
    assert_eq!(r.status, 304);
    assert_eq!(o.hits(), 1);
    assert!(o.seen().iter().all(|s| !s.headers.contains_key("if-range")));
    let m = metrics(&p).await;
    for (result, n) in [("partial", 6.0), ("unsatisfiable", 1.0), ("several", 1.0), ("whole", 3.0), ("invalid", 1.0), ("refused", 0.0)] {
        assert_eq!(ranges_counter(&m, result), n, "{result}\n{m}");
    }
    p.shutdown().await;
}

/// An object over STREAM_THRESHOLD is read from the store chunk by
/// chunk; a range of it, at its start, across a chunk boundary and at
/// its end, has exactly the bytes of the object, for the store that
/// reads on the event loop (LMDB) and the one whose reads block (files).
#[tokio::test]
async fn a_range_of_a_large_streamed_entry_has_exactly_its_bytes() {
    let len = 3 * inband_cache::CHUNK_BYTES + 12_345;
    assert!(len as u64 > inband_cache::STREAM_THRESHOLD);
    let want = pattern(len);
    let body = want.clone();
    let o = Origin::start(move |_| Reply { status: 200, body: body.clone(), ..Default::default() }.header("cache-control", "max-age=60")).await;
    for backend in ["lmdb", "files"] {
        let dir = tempfile::tempdir().unwrap();
        let p = start_proxy(&[o.addr], &cache_section(dir.path(), backend, 8 << 20)).await;
        let path = format!("/big-{backend}");
        let whole = rget(&p, &path, &[]).await;
        assert_eq!(whole.body.as_bytes(), &want[..]);
        let chunk = inband_cache::CHUNK_BYTES;
        for (first, last) in [(0, 99), (chunk - 10, chunk + 10), (2 * chunk + 7, 3 * chunk + 5000), (len - 1, len - 1), (5, len - 1)] {
            let range = format!("bytes={first}-{last}");
            let r = rget(&p, &path, &[("range", &range)]).await;
            assert_eq!((r.status, field(&r, "x-cache")), (206, "HIT"), "{backend} {range}");
            assert_eq!(field(&r, "content-range"), format!("bytes {first}-{last}/{len}"), "{backend} {range}");
            assert!(r.body.as_bytes() == &want[first..=last], "{backend} {range}: wrong bytes");
        }
        let r = rget(&p, &path, &[("range", "bytes=-70000")]).await;
        assert!(r.body.as_bytes() == &want[len - 70_000..], "{backend} suffix: wrong bytes");
        p.shutdown().await;
    }
    assert_eq!(o.hits(), 2, "one fetch per store");
}

/// An origin that answers one range with a 206 of `pattern(len)`, under
/// one strong ETag; `x-serial` counts its responses, `x-first` is on the
/// first only.
async fn ranged_origin(len: usize) -> Origin {
    let n = Arc::new(AtomicUsize::new(0));
    Origin::start(move |s| {
        let i = n.fetch_add(1, Ordering::SeqCst);
        let whole = pattern(len);
        let mut reply = match s.headers.get("range").map(|v| v.to_str().unwrap()) {
            Some(range) => {
                let (a, b) = one_range(range, len);
                Reply { status: 206, body: whole[a..=b].to_vec(), ..Default::default() }.header("content-range", format!("bytes {a}-{b}/{len}"))
            }
            None => Reply { status: 200, body: whole, ..Default::default() },
        };
        reply = reply.header("cache-control", "max-age=60").header("etag", "\"p1\"").header("x-serial", i.to_string());
        if i == 0 {
            reply = reply.header("x-first", "yes");
        }
        reply
    })
    .await
}

/// A 206 from the origin is stored and answers ranges within it; parts
/// under one strong validator are combined, the newest fields winning
/// and the others kept (RFC 9111 §3.4), until the whole is stored as the
/// complete 200. A POST drops the stored part.
#[tokio::test]
async fn partial_responses_are_stored_combined_and_completed() {
    const LEN: usize = 1000;
    let o = ranged_origin(LEN).await;
    let want = pattern(LEN);
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section(dir.path(), "lmdb", 4096)).await;
    let part = |first: usize, last: usize| format!("bytes={first}-{last}");
    let check = |r: &Reply2, first: usize, last: usize, x_cache: &str| {
        assert_eq!(r.status, 206, "{first}-{last}");
        assert_eq!(field(r, "content-range"), format!("bytes {first}-{last}/{LEN}"));
        assert_eq!(field(r, "x-cache"), x_cache, "{first}-{last}");
        assert!(r.body.as_bytes() == &want[first..=last], "{first}-{last}: wrong bytes");
    };
    check(&rget(&p, "/p", &[("range", &part(100, 199))]).await, 100, 199, "MISS");
    assert_eq!(o.seen()[0].headers.get("range").unwrap(), "bytes=100-199", "the client's range goes to the origin");
    check(&rget(&p, "/p", &[("range", &part(120, 150))]).await, 120, 150, "HIT");
    check(&rget(&p, "/p", &[("range", "bytes=100-199")]).await, 100, 199, "HIT");
    assert_eq!(o.hits(), 1);
    // Beyond the stored part: asked of the origin, then combined.
    check(&rget(&p, "/p", &[("range", &part(150, 250))]).await, 150, 250, "MISS");
    check(&rget(&p, "/p", &[("range", &part(100, 250))]).await, 100, 250, "HIT");
    check(&rget(&p, "/p", &[("range", &part(0, 99))]).await, 0, 99, "MISS");
    let r = rget(&p, "/p", &[("range", &part(0, 250))]).await;
    check(&r, 0, 250, "HIT");
    assert_eq!((field(&r, "x-serial"), field(&r, "x-first")), ("2", "yes"), "newest fields, the others kept");
    assert_eq!(o.hits(), 3);
    // A request without Range never gets a part.
    let r = rget(&p, "/p", &[]).await;
    assert_eq!((r.status, r.body.as_bytes() == &want[..]), (200, true));
    assert_eq!(o.hits(), 4);
    let m = metrics(&p).await;
    assert_eq!((ranges_counter(&m, "stored"), ranges_counter(&m, "from_partial")), (3.0, 4.0), "{m}");

    // Another URL, completed by parts: stored as the complete 200.
    check(&rget(&p, "/q", &[("range", &part(0, 499))]).await, 0, 499, "MISS");
    check(&rget(&p, "/q", &[("range", &part(500, 999))]).await, 500, 999, "MISS");
    let r = rget(&p, "/q", &[]).await;
    assert_eq!((r.status, field(&r, "x-cache"), field(&r, "content-range")), (200, "HIT", "-"));
    assert!(r.body.as_bytes() == &want[..]);
    assert_eq!(field(&r, "content-length"), LEN.to_string());
    assert_eq!(o.hits(), 6);

    // A successful unsafe request drops the stored part (RFC 9111 §4.4).
    check(&rget(&p, "/r", &[("range", &part(10, 20))]).await, 10, 20, "MISS");
    check(&rget(&p, "/r", &[("range", &part(10, 20))]).await, 10, 20, "HIT");
    assert_eq!(send(p.addr, "POST", "/r", &[("host", HOST)], b"x").await.status, 200);
    check(&rget(&p, "/r", &[("range", &part(10, 20))]).await, 10, 20, "MISS");
    assert_eq!(o.hits(), 9);
    p.shutdown().await;
}

/// A 206 whose Content-Range does not describe its body (the public
/// suite's own: `bytes 4-9/10` with five bytes) is passed on and never
/// served again.
#[tokio::test]
async fn a_206_that_contradicts_its_content_range_is_not_stored() {
    let o = Origin::start(|_| ok("01234").status(206).header("cache-control", "max-age=3600").header("content-range", "bytes 4-9/10")).await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section(dir.path(), "lmdb", 4096)).await;
    for _ in 0..2 {
        let r = rget(&p, "/m", &[("range", "bytes=-5")]).await;
        assert_eq!((r.status, r.body.as_str(), field(&r, "x-cache")), (206, "01234", "MISS"));
    }
    assert_eq!(o.hits(), 2);
    assert_eq!(ranges_counter(&metrics(&p).await, "malformed"), 2.0);
    p.shutdown().await;
}

/// Thousands of ranges, or overlapping ones (the range denial of
/// service): the whole body once, at most, and a counter.
#[tokio::test]
async fn a_hostile_range_field_gets_the_whole_body_once_and_a_counter() {
    let body = text(&pattern(5000));
    let b = body.clone();
    let o = Origin::start(move |_| ok(&b).header("cache-control", "max-age=60")).await;
    let dir = tempfile::tempdir().unwrap();
    // Room in the request head for the field: the Range itself is what is
    // under test, not the head's bound.
    let p = start_proxy(&[o.addr], &format!("max_header_bytes = 65536\n{}", cache_section(dir.path(), "lmdb", 8192))).await;
    assert_eq!(rget(&p, "/h", &[]).await.body, body);
    let thousands = (0..3000).map(|i| format!("{}-{}", i, i)).collect::<Vec<_>>().join(",");
    let overlapping = (0..50).map(|_| "0-4999").collect::<Vec<_>>().join(",");
    for hostile in [format!("bytes={thousands}"), format!("bytes={overlapping}"), "bytes=0-10,5-20".to_string()] {
        let r = rget(&p, "/h", &[("range", &hostile)]).await;
        assert_eq!((r.status, field(&r, "content-range")), (200, "-"));
        assert_eq!(r.body, body, "the whole body, once");
        assert_eq!(field(&r, "content-length"), "5000");
    }
    assert_eq!(ranges_counter(&metrics(&p).await, "refused"), 3.0);
    assert_eq!(o.hits(), 1);
    p.shutdown().await;
}

/// With `[cache.compression]`, a range is of the representation the
/// client gets: of the stored gzip bytes (with their own ETag) for a
/// client that accepts gzip, of the origin's bytes, decoded up to the
/// range's end, for one that does not; on the miss that stores the
/// entry as on a hit.
#[tokio::test]
async fn a_range_of_a_compressed_entry_is_of_the_representation_sent() {
    let page: String = (0..400).map(|i| format!("<p>paragraph {i} of a page that compresses</p>\n")).collect();
    let b = page.clone();
    let o = Origin::start(move |_| ok(&b).header("content-type", "text/html").header("cache-control", "max-age=60").header("etag", "\"z1\"")).await;
    let toml = "[cache]\nbackend = \"memory\"\ncapacity_bytes = 16777216\n\n[cache.compression]\nencoding = \"gzip\"\n";
    let p = start_proxy(&[o.addr], toml).await;
    for want in ["MISS", "HIT"] {
        let r = rget(&p, "/z", &[("range", "bytes=1000-1099")]).await;
        assert_eq!((r.status, field(&r, "x-cache"), field(&r, "content-encoding")), (206, want, "-"));
        assert_eq!(field(&r, "content-range"), format!("bytes 1000-1099/{}", page.len()));
        assert_eq!((r.body.as_str(), field(&r, "etag")), (&page[1000..1100], "\"z1\""));
    }
    // The client that accepts gzip: a range of the gzip bytes, which
    // are the start of the whole gzip body it would get.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<http_body_util::Empty<bytes::Bytes>>();
    let gz = |range: Option<&'static str>| {
        let mut req = http::Request::get(format!("http://{}/z", p.addr)).header("host", HOST).header("accept-encoding", "gzip");
        if let Some(r) = range {
            req = req.header("range", r);
        }
        let client = client.clone();
        async move {
            let resp = client.request(req.body(http_body_util::Empty::new()).unwrap()).await.unwrap();
            let (head, body) = resp.into_parts();
            (head, http_body_util::BodyExt::collect(body).await.unwrap().to_bytes())
        }
    };
    let (whole_head, whole) = gz(None).await;
    assert_eq!(whole_head.headers["content-encoding"], "gzip");
    let (head, part) = gz(Some("bytes=0-99")).await;
    assert_eq!(head.status, 206);
    assert_eq!((head.headers["content-encoding"].to_str().unwrap(), head.headers["etag"].to_str().unwrap()), ("gzip", "\"z1-gzip\""));
    assert_eq!(head.headers["content-range"].to_str().unwrap(), format!("bytes 0-99/{}", whole.len()));
    assert_eq!(&part[..], &whole[..100]);
    assert_eq!(o.hits(), 1);
    p.shutdown().await;
}

/// Parts whose span would be over `max_object_bytes` are not combined:
/// the newer part is kept alone, the older one asked for again.
#[tokio::test]
async fn parts_are_not_combined_past_the_object_bound() {
    let o = ranged_origin(5000).await;
    let want = pattern(5000);
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section(dir.path(), "lmdb", 4096)).await;
    for (range, x_cache) in [("bytes=0-2999", "MISS"), ("bytes=2500-4999", "MISS"), ("bytes=3000-3099", "HIT"), ("bytes=0-99", "MISS")] {
        let r = rget(&p, "/s", &[("range", range)]).await;
        assert_eq!((r.status, field(&r, "x-cache")), (206, x_cache), "{range}");
        let (a, b) = one_range(range, 5000);
        assert!(r.body.as_bytes() == &want[a..=b], "{range}: wrong bytes");
    }
    assert_eq!(o.hits(), 3);
    p.shutdown().await;
}

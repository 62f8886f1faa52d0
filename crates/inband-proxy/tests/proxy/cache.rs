//! HTTP cache semantics through the proxy: what is stored, expiry, Vary,
//! 304 revalidation, coalescing, purge, invalidation and restart durability.


use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use inband_proxy::Proxy;

const HOST: &str = "cache.test";

/// An origin whose answers depend on the path; bodies carry a serial
/// number so a cached body is told apart from a fresh one.
async fn origin() -> Origin {
    let n = Arc::new(AtomicUsize::new(0));
    Origin::start(move |s| {
        let i = n.fetch_add(1, Ordering::SeqCst);
        let first = !s.headers.contains_key("x-origin-fails");
        let path = s.path.split('?').next().unwrap();
        let body = format!("{path} #{i}");
        match path {
            "/public-auth" => ok(&body).header("cache-control", "public, max-age=60"),
            "/max-age" | "/auth" | "/head" | "/purge-me" | "/durable" => ok(&body).header("cache-control", "max-age=60"),
            "/s-maxage" => ok(&body).header("cache-control", "max-age=0, s-maxage=60"),
            "/expires" => ok(&body).header("expires", httpdate(Duration::from_secs(60))),
            "/no-store" => ok(&body).header("cache-control", "no-store, max-age=60"),
            "/private" => ok(&body).header("cache-control", "private, max-age=60"),
            "/no-cache" => ok(&body).header("cache-control", "no-cache, max-age=60"),
            "/cookie" => ok(&body).header("cache-control", "max-age=60").header("set-cookie", "session=secret"),
            "/public-cookie" => ok(&body).header("cache-control", "public, max-age=60").header("set-cookie", format!("session={i}")),
            "/Private" => ok(&body).header("cache-control", "Private, max-age=60"),
            "/No-Store" => ok(&body).header("cache-control", "No-Store, max-age=60"),
            "/MAX-AGE" => ok(&body).header("cache-control", "MAX-AGE=60"),
            "/S-MAXAGE" => ok(&body).header("cache-control", "max-age=0, S-MaxAge=60"),
            "/short" => ok(&body).header("cache-control", "max-age=1"),
            "/sie" | "/sie-none" if !first => ok("origin failure").status(503),
            "/sie" => ok(&body).header("cache-control", "max-age=1, stale-if-error=60"),
            "/sie-none" => ok(&body).header("cache-control", "max-age=1"),
            "/swr" => ok(&body).header("cache-control", "max-age=1, stale-while-revalidate=30").delay(Duration::from_millis(1000)),
            "/vary" => {
                let lang = s.headers.get("accept-language").map_or("none", |v| v.to_str().unwrap());
                ok(&format!("{lang} #{i}")).header("cache-control", "max-age=60").header("vary", "Accept-Language")
            }
            "/etag" => {
                if s.headers.get("if-none-match").is_some_and(|v| v == "\"v1\"") {
                    ok("").status(304).header("etag", "\"v1\"").header("cache-control", "max-age=1")
                } else {
                    ok(&body).header("etag", "\"v1\"").header("cache-control", "max-age=1")
                }
            }
            "/slow" => ok(&body).header("cache-control", "max-age=60").delay(Duration::from_millis(300)),
            "/validators" => ok(&body)
                .header("cache-control", "max-age=60")
                .header("etag", "W/\"v9\"")
                .header("last-modified", "Tue, 01 Jul 2025 10:00:00 GMT"),
            "/big" => ok(&"x".repeat(5000)).header("cache-control", "max-age=60"),
            p if p.starts_with("/e/") => ok(&format!("{p} {}", "x".repeat(2000))).header("cache-control", "max-age=60"),
            _ => ok(&body),
        }
    })
    .await
}

fn httpdate(from_now: Duration) -> String {
    // RFC 7231 IMF-fixdate, formatted by hand to keep a date crate out of
    // the tests: the origin needs exactly one Expires value.
    let t = std::time::SystemTime::now() + from_now;
    let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if mo <= 2 { 1 } else { 0 };
    let wd = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    let mon = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"][mo as usize - 1];
    format!("{wd}, {d:02} {mon} {y} {h:02}:{m:02}:{s:02} GMT")
}

fn cache_section(backend: &str, dir: &std::path::Path) -> String {
    format!(
        "[cache]\nbackend = \"{backend}\"\npath = \"{}\"\ncapacity_bytes = 16777216\nmax_object_bytes = 4096",
        dir.display()
    )
}

async fn cget(p: &Proxy, path: &str) -> Reply2 {
    send(p.addr, "GET", path, &[("host", HOST)], b"").await
}

async fn lang(p: &Proxy, l: &str) -> Reply2 {
    send(p.addr, "GET", "/vary", &[("host", HOST), ("accept-language", l)], b"").await
}

fn x_cache(r: &Reply2) -> &str {
    r.headers.get("x-cache").map_or("-", |v| v.to_str().unwrap())
}

#[tokio::test]
async fn stores_what_the_rules_allow_and_nothing_else() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    for (path, stored) in [
        ("/max-age", true),
        ("/s-maxage", true),
        ("/expires", true),
        ("/no-store", false),
        ("/private", false),
        ("/no-cache", false),
        ("/cookie", false),
        ("/plain", false),
    ] {
        let before = o.hits();
        let first = cget(&p, path).await;
        let second = cget(&p, path).await;
        assert_eq!((first.status, second.status), (200, 200), "{path}");
        assert_eq!(x_cache(&first), "MISS", "{path}");
        if stored {
            assert_eq!(second.body, first.body, "{path} served from the cache");
            assert_eq!(x_cache(&second), "HIT", "{path}");
            assert!(second.headers.contains_key("age"), "{path}: a hit carries Age");
            let date = second.headers.get("date").map(|d| d.to_str().unwrap().to_string()).unwrap_or_default();
            assert!(httpdate::parse_http_date(&date).is_ok(), "{path}: a hit's Date is an HTTP-date: {date:?}");
            assert_eq!(o.hits(), before + 1, "{path}");
        } else {
            assert_ne!(second.body, first.body, "{path} must not be served from the cache");
            assert_eq!(o.hits(), before + 2, "{path}");
        }
    }
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"hit\"}"), 3.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"miss\"}"), 13.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_cache_store{what=\"entries\"}"), 3.0, "{m}");
    assert!(sample(&m, "inband_proxy_cache_store{what=\"bytes\"}") > 0.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn authorization_and_head_are_kept_out_of_the_cache() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let auth = |path| send(p.addr, "GET", path, &[("host", HOST), ("authorization", "Bearer x")], b"");
    // A shared cache stores an authorized response only when it says public.
    let a = auth("/auth").await;
    assert_ne!(auth("/auth").await.body, a.body);
    let b = auth("/public-auth").await;
    assert_eq!(auth("/public-auth").await.body, b.body);
    // HEAD goes to the origin and stores nothing (Range: ranges.rs).
    assert_eq!(send(p.addr, "HEAD", "/head", &[("host", HOST)], b"").await.status, 200);
    assert_eq!(x_cache(&cget(&p, "/head").await), "MISS");
    assert_eq!(o.hits(), 5);
    p.shutdown().await;
}

#[tokio::test]
async fn max_age_expires() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let a = cget(&p, "/short").await;
    assert_eq!(cget(&p, "/short").await.body, a.body);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let b = cget(&p, "/short").await;
    assert_ne!(b.body, a.body, "expired entry not served");
    assert_eq!(x_cache(&b), "UPDATED");
    assert_eq!(o.hits(), 2);
    p.shutdown().await;
}

#[tokio::test]
async fn stale_while_revalidate_serves_stale_and_refreshes_in_the_background() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let a = cget(&p, "/swr").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let t = std::time::Instant::now();
    let b = cget(&p, "/swr").await;
    assert_eq!((b.body.as_str(), x_cache(&b)), (a.body.as_str(), "STALE"));
    // Waiting for the origin takes at least its 1 s; below that, 900 ms
    // leaves a stale answer from the cache room on a loaded machine.
    assert!(t.elapsed() < Duration::from_millis(900), "served without waiting for the 1 s origin");
    assert!(b.headers["age"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    // Stale answers go on until the background fetch (1 s at the origin)
    // has stored the new response; none of them asks the origin.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let c = loop {
        let c = cget(&p, "/swr").await;
        if x_cache(&c) != "STALE" {
            break c;
        }
        assert!(std::time::Instant::now() < deadline, "the entry was never refreshed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!((c.body.as_str(), x_cache(&c)), ("/swr #1", "HIT"));
    assert_eq!(o.hits(), 2);
    p.shutdown().await;
}

#[tokio::test]
async fn stale_if_error_serves_the_stale_entry_when_the_origin_fails() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let failing = |path| send(p.addr, "GET", path, &[("host", HOST), ("x-origin-fails", "1")], b"");
    let a = cget(&p, "/sie").await;
    let none = cget(&p, "/sie-none").await;
    assert_eq!((a.status, none.status), (200, 200));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let b = failing("/sie").await;
    assert_eq!((b.status, b.body.as_str(), x_cache(&b)), (200, a.body.as_str(), "STALE"));
    let c = failing("/sie-none").await;
    assert_eq!((c.status, c.body.as_str()), (503, "origin failure"), "no stale-if-error: the error goes through");
    assert_eq!(o.hits(), 4);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"stale\"}"), 1.0, "{m}");
    // The 503 passed on is an error, not a stale entry the origin updated.
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"error\"}"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"updated\"}"), 0.0, "{m}");
    assert_eq!(x_cache(&c), "ERROR");
    p.shutdown().await;
}

#[tokio::test]
async fn client_conditional_requests_get_304_from_the_cache() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    // A conditional first request still fills the cache: the origin is
    // asked without the client's validators.
    let first = send(p.addr, "GET", "/validators", &[("host", HOST), ("if-none-match", "W/\"v9\"")], b"").await;
    assert_eq!((first.status, x_cache(&first)), (304, "MISS"));
    assert!(!o.seen()[0].headers.contains_key("if-none-match"));
    let a = cget(&p, "/validators").await;
    assert_eq!(x_cache(&a), "HIT");
    for (h, v, want) in [
        ("if-none-match", "\"v9\"", 304),
        ("if-none-match", "\"other\", W/\"v9\"", 304),
        ("if-none-match", "*", 304),
        ("if-none-match", "\"v8\"", 200),
        ("if-modified-since", "Wed, 02 Jul 2025 10:00:00 GMT", 304),
        ("if-modified-since", "Mon, 30 Jun 2025 10:00:00 GMT", 200),
    ] {
        let r = send(p.addr, "GET", "/validators", &[("host", HOST), (h, v)], b"").await;
        assert_eq!(r.status, want, "{h}: {v}");
        if want == 304 {
            assert_eq!((r.body.as_str(), r.headers["etag"].to_str().unwrap()), ("", "W/\"v9\""), "{h}: {v}");
        } else {
            assert_eq!(r.body, a.body);
        }
    }
    assert_eq!(o.hits(), 1, "all answered from the cache");
    p.shutdown().await;
}

#[tokio::test]
async fn vary_keeps_one_entry_per_header_value() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let en = lang(&p, "en").await;
    let de = lang(&p, "de").await;
    assert!(en.body.starts_with("en #") && de.body.starts_with("de #"), "{} / {}", en.body, de.body);
    assert_eq!(lang(&p, "en").await.body, en.body);
    assert_eq!(lang(&p, "de").await.body, de.body);
    assert_eq!(o.hits(), 2);
    // Purging the URL takes every variant.
    let r = send(p.addr, "PURGE", "/vary", &[("host", HOST)], b"").await;
    assert_eq!((r.status, r.body.as_str()), (200, "purged 2 entries\n"), "two variants; the Vary marker is not counted");
    assert_ne!(lang(&p, "en").await.body, en.body);
    assert_eq!(o.hits(), 3);
    p.shutdown().await;
}

#[tokio::test]
async fn stale_entry_revalidates_with_304() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let first = cget(&p, "/etag").await;
    assert_eq!(first.body, "/etag #0");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = cget(&p, "/etag").await;
    assert_eq!((second.status, second.body.as_str(), x_cache(&second)), (200, "/etag #0", "REVALIDATED"));
    let seen = o.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].headers["if-none-match"], "\"v1\"", "origin asked conditionally");
    // The 304 refreshed the entry: fresh again for its max-age.
    let third = cget(&p, "/etag").await;
    assert_eq!((third.body.as_str(), x_cache(&third)), ("/etag #0", "HIT"));
    assert_eq!(o.hits(), 2);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"revalidated\"}"), 1.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn concurrent_misses_make_one_origin_request() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let addr = p.addr;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        tasks.spawn(async move { send(addr, "GET", "/slow", &[("host", HOST)], b"").await });
    }
    let mut bodies = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let r = r.unwrap();
        assert_eq!(r.status, 200);
        bodies.push(r.body);
    }
    assert_eq!(bodies.len(), 50);
    assert!(bodies.iter().all(|b| b == "/slow #0"), "{bodies:?}");
    assert_eq!(o.hits(), 1, "one origin request for 50 concurrent misses");
    let m = metrics(&p).await;
    let served: f64 = ["hit", "miss", "coalesced"].iter().map(|r| sample(&m, &format!("inband_proxy_cache_total{{result=\"{r}\"}}"))).sum();
    assert_eq!(served, 50.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"miss\"}"), 1.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn purge_and_unsafe_methods_invalidate() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let a = cget(&p, "/purge-me").await;
    assert_eq!(cget(&p, "/purge-me").await.body, a.body);
    let r = send(p.addr, "PURGE", "/purge-me", &[("host", HOST)], b"").await;
    assert_eq!((r.status, r.body.as_str()), (200, "purged 1 entries\n"));
    assert_eq!(send(p.addr, "PURGE", "/purge-me", &[("host", HOST)], b"").await.status, 404);
    let b = cget(&p, "/purge-me").await;
    assert_ne!(b.body, a.body);
    assert_eq!(cget(&p, "/purge-me").await.body, b.body);
    // A successful POST to the URL drops it too.
    assert_eq!(send(p.addr, "POST", "/purge-me", &[("host", HOST)], b"new").await.status, 200);
    let c = cget(&p, "/purge-me").await;
    assert_ne!(c.body, b.body);
    assert_eq!(o.hits(), 4);
    // A DELETE drops every variant of a Vary'd URL.
    let (en, de) = (lang(&p, "en").await, lang(&p, "de").await);
    assert_eq!((lang(&p, "en").await.body, lang(&p, "de").await.body), (en.body.clone(), de.body.clone()));
    assert_eq!(send(p.addr, "DELETE", "/vary", &[("host", HOST)], b"").await.status, 200);
    assert_ne!(lang(&p, "en").await.body, en.body);
    assert_ne!(lang(&p, "de").await.body, de.body);
    assert_eq!(o.hits(), 9);
    p.shutdown().await;
}

#[tokio::test]
async fn purge_from_a_client_not_allowed_is_403() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let extra = format!("purge_allow = [\"127.0.0.2\"]\n{}", cache_section("lmdb", dir.path()));
    let p = start_proxy(&[o.addr], &extra).await;
    let a = cget(&p, "/purge-me").await;
    assert_eq!(send(p.addr, "PURGE", "/purge-me", &[("host", HOST)], b"").await.status, 403);
    assert_eq!(cget(&p, "/purge-me").await.body, a.body);
    p.shutdown().await;
}

#[tokio::test]
async fn large_objects_pass_through_unstored() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    for _ in 0..2 {
        let r = cget(&p, "/big").await;
        assert_eq!((r.status, r.body.len()), (200, 5000));
    }
    assert_eq!(o.hits(), 2);
    p.shutdown().await;
}

#[tokio::test]
async fn the_size_bound_holds_by_eviction() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let extra = format!("[cache]\nbackend = \"lmdb\"\npath = \"{}\"\ncapacity_bytes = 65536\nmax_object_bytes = 4096", dir.path().display());
    let p = start_proxy(&[o.addr], &extra).await;
    for i in 0..100 {
        assert_eq!(cget(&p, &format!("/e/{i}")).await.status, 200);
    }
    let m = metrics(&p).await;
    let bytes = sample(&m, "inband_proxy_cache_store{what=\"bytes\"}");
    let entries = sample(&m, "inband_proxy_cache_store{what=\"entries\"}");
    assert!(bytes > 0.0 && bytes <= 65536.0, "{m}");
    assert!(entries < 100.0 && sample(&m, "inband_proxy_cache_store{what=\"evictions\"}") > 0.0, "{m}");
    // The newest entry survived the evictions.
    assert_eq!(x_cache(&cget(&p, "/e/99").await), "HIT");
    assert_eq!(o.hits(), 100);
    p.shutdown().await;
}

#[tokio::test]
async fn restart_serves_the_stored_entries_from_the_first_request() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let a = cget(&p, "/durable").await;
    assert_eq!(x_cache(&a), "MISS");
    p.shutdown().await;
    let p = start_proxy(&[o.addr], &cache_section("lmdb", dir.path())).await;
    let b = cget(&p, "/durable").await;
    assert_eq!((b.body.as_str(), x_cache(&b)), (a.body.as_str(), "HIT"));
    assert_eq!(o.hits(), 1, "no origin request after the restart");
    p.shutdown().await;
}

#[tokio::test]
async fn every_store_backend_serves_hits() {
    for backend in ["lmdb", "rocksdb", "memory", "files"] {
        let o = origin().await;
        let dir = tempfile::tempdir().unwrap();
        let p = start_proxy(&[o.addr], &cache_section(backend, dir.path())).await;
        let a = cget(&p, "/max-age").await;
        let b = cget(&p, "/max-age").await;
        assert_eq!((b.body.as_str(), x_cache(&b)), (a.body.as_str(), "HIT"), "{backend}");
        assert_eq!(o.hits(), 1, "{backend}");
        p.shutdown().await;
    }
}

#[tokio::test]
async fn http2_clients_share_the_cache_with_http1_clients() {
    use http_body_util::{BodyExt, Full};
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let p = start_proxy(&[o.addr], &cache_section("memory", dir.path())).await;
    let a = cget(&p, "/max-age").await;
    let h2: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).http2_only(true).build_http();
    for path in ["/max-age", "/plain"] {
        let req = http::Request::get(format!("http://{}{path}", p.addr)).header("host", HOST).body(Full::default()).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), h2.request(req)).await.unwrap().unwrap();
        assert_eq!((resp.status().as_u16(), resp.version()), (200, http::Version::HTTP_2), "{path}");
        let x = resp.headers().get("x-cache").map(|v| v.to_str().unwrap().to_string());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        if path == "/max-age" {
            assert_eq!((body, x.as_deref()), (bytes::Bytes::from(a.body.clone()), Some("HIT")));
        } else {
            assert!(body.starts_with(b"/plain #"));
        }
    }
    let seen = o.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].headers["host"], HOST, "the backend sees the client's host over HTTP/1.1");
    p.shutdown().await;
}

#[tokio::test]
async fn cache_control_directives_are_read_in_any_letter_case() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], "[cache]\nbackend = \"memory\"").await;
    for (path, stored) in [("/Private", false), ("/No-Store", false), ("/MAX-AGE", true), ("/S-MAXAGE", true)] {
        let before = o.hits();
        let (a, b) = (cget(&p, path).await, cget(&p, path).await);
        assert_eq!((a.status, b.status), (200, 200), "{path}");
        assert_eq!(b.body == a.body, stored, "{path}: {} / {}", a.body, b.body);
        assert_eq!(o.hits(), before + if stored { 1 } else { 2 }, "{path}");
    }
    // A client's NO-CACHE makes the cache ask the origin.
    let before = o.hits();
    let r = send(p.addr, "GET", "/MAX-AGE", &[("host", HOST), ("cache-control", "NO-CACHE")], b"").await;
    assert_eq!(r.status, 200);
    assert_eq!(o.hits(), before + 1, "NO-CACHE went to the origin");
    p.shutdown().await;
}

#[tokio::test]
async fn set_cookie_responses_are_not_stored_by_default() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], "[cache]\nbackend = \"memory\"").await;
    let (a, b) = (cget(&p, "/public-cookie").await, cget(&p, "/public-cookie").await);
    let cookie = |r: &Reply2| r.headers.get("set-cookie").map(|v| v.to_str().unwrap().to_string());
    assert_eq!(o.hits(), 2, "not stored");
    assert_ne!(cookie(&a), cookie(&b), "each client gets its own cookie: {:?}", cookie(&a));
    assert_eq!(sample(&metrics(&p).await, "inband_proxy_cache_store{what=\"entries\"}"), 0.0);
    p.shutdown().await;
}

#[tokio::test]
async fn set_cookie_strip_stores_the_response_without_the_cookie() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], "[cache]\nbackend = \"memory\"\nset_cookie = \"strip\"").await;
    let a = cget(&p, "/public-cookie").await;
    assert_eq!(a.headers.get("set-cookie").unwrap(), "session=0", "the client that caused the fetch gets its cookie");
    let b = cget(&p, "/public-cookie").await;
    assert_eq!((x_cache(&b), b.body.as_str()), ("HIT", a.body.as_str()));
    assert!(!b.headers.contains_key("set-cookie"), "another client's cookie replayed: {:?}", b.headers);
    assert_eq!(o.hits(), 1);
    p.shutdown().await;
}

#[tokio::test]
async fn only_if_cached_is_504_on_a_miss_and_never_asks_the_origin() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], "[cache]\nbackend = \"memory\"").await;
    let oic = || send(p.addr, "GET", "/max-age", &[("host", HOST), ("cache-control", "Only-If-Cached")], b"");
    let r = oic().await;
    assert_eq!(r.status, 504);
    assert_eq!(o.hits(), 0);
    let filled = cget(&p, "/max-age").await;
    let r = oic().await;
    assert_eq!((r.status, x_cache(&r), r.body.as_str()), (200, "HIT", filled.body.as_str()));
    assert_eq!(o.hits(), 1);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"only_if_cached\"}"), 1.0, "{m}");
    p.shutdown().await;
}

/// An origin that sends 103 Early Hints and 102 Processing before its
/// 200 (as the public suite's does): an HTTP/1.1 client gets both ahead
/// of the final response (hop-by-hop fields removed), and nothing of them
/// is stored: a hit carries neither them nor their fields, and an
/// HTTP/1.0 client never gets one (docs/proxy.md, "Interim responses").
#[tokio::test]
async fn interim_responses_from_the_origin_are_relayed_and_never_stored() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let origin = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else { continue };
            let h = h.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut chunk).await else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        h.fetch_add(1, Ordering::SeqCst);
                        let reply = "HTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\nx-hint: early\r\nkeep-alive: timeout=5\r\n\r\n\
                                     HTTP/1.1 102 Processing\r\n\r\n\
                                     HTTP/1.1 200 OK\r\ncache-control: max-age=60\r\ncontent-length: 5\r\n\r\nfinal";
                        if s.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    let p = start_proxy(&[addr], "[cache]\nbackend = \"memory\"").await;
    let ask = |path: &str, version: &str| format!("GET {path} {version}\r\nhost: {HOST}\r\nconnection: close\r\n\r\n");
    let miss = raw(p.addr, ask("/interim", "HTTP/1.1").as_bytes()).await;
    let (interim, last) = miss.split_at(miss.find("HTTP/1.1 200 OK").unwrap_or_else(|| panic!("no final response: {miss:?}")));
    assert_eq!(
        interim,
        "HTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\nx-hint: early\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n",
        "the interim responses as the client got them"
    );
    assert!(last.ends_with("\r\n\r\nfinal") && last.contains("x-cache: MISS"), "{last:?}");
    assert!(!last.contains("x-hint") && !last.contains("link:"), "an interim response's fields in the final one: {last:?}");
    for want in ["HIT", "HIT"] {
        let r = cget(&p, "/interim").await;
        assert_eq!((r.status, r.body.as_str(), x_cache(&r)), (200, "final", want));
        assert!(!r.headers.contains_key("x-hint") && !r.headers.contains_key("link"), "an interim response's fields: {:?}", r.headers);
    }
    let hit = raw(p.addr, ask("/interim", "HTTP/1.1").as_bytes()).await;
    assert!(hit.starts_with("HTTP/1.1 200 OK\r\n"), "a hit relays nothing: {hit:?}");
    let old = raw(p.addr, ask("/interim-1.0", "HTTP/1.0").as_bytes()).await;
    assert!(old.starts_with("HTTP/1.0 200 OK\r\n") || old.starts_with("HTTP/1.1 200 OK\r\n"), "an HTTP/1.0 client gets none: {old:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_interim_responses_total{outcome=\"forwarded\"}"), 2.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_interim_responses_total{outcome=\"dropped\"}"), 0.0, "{m}");
    p.shutdown().await;
    origin.abort();
}

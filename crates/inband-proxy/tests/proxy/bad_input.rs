//! Every refusal the proxy makes, its status code, and its counter.


use std::time::Duration;

use crate::common::*;

fn refusals(m: &str, reason: &str) -> f64 {
    sample(m, &format!("inband_proxy_refusals_total{{reason=\"{reason}\"}}"))
}

#[tokio::test]
async fn malformed_request_line_is_400() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "").await;
    let out = raw(p.addr, b"NOT A REQUEST LINE AT ALL\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out:?}");
    let out = raw(p.addr, b"GET /x HTTP/1.1\r\nbad header line\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out:?}");
    assert_eq!(o.hits(), 0);
    // Counted when the connection ends, which can be just after the
    // client saw the proxy shut its side.
    wait_for_sample(&p, "inband_proxy_refusals_total{reason=\"bad_request\"}", 2.0).await;
    // Still serving after garbage.
    assert_eq!(get(p.addr, "/").await.status, 200);
    p.shutdown().await;
}

#[tokio::test]
async fn oversize_headers_are_431() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "max_header_bytes = 8192").await;
    let big = "a".repeat(20_000);
    let out = raw(p.addr, format!("GET / HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n").as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 431"), "{out:?}");
    assert_eq!(o.hits(), 0);
    wait_for_sample(&p, "inband_proxy_refusals_total{reason=\"headers_too_large\"}", 1.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn body_over_the_limit_is_413_declared_or_chunked() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "max_body_bytes = 1000").await;
    assert_eq!(send(p.addr, "POST", "/", &[], &[b'x'; 1000]).await.status, 200);
    assert_eq!(send(p.addr, "POST", "/", &[], &[b'x'; 1001]).await.status, 413);
    let chunk = "y".repeat(600);
    let req = format!("POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n");
    let out = raw(p.addr, req.as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 413"), "{out:?}");
    assert_eq!(o.hits(), 1);
    assert_eq!(refusals(&metrics(&p).await, "body_too_large"), 2.0);
    p.shutdown().await;
}

#[tokio::test]
async fn a_body_that_never_completes_is_408() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "client_body_timeout_ms = 200").await;
    let t = std::time::Instant::now();
    let out = raw(p.addr, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nonly ten b").await;
    assert!(out.starts_with("HTTP/1.1 408"), "{out:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "answered by the timeout, not by the test's read limit");
    assert_eq!(o.hits(), 0);
    assert_eq!(refusals(&metrics(&p).await, "body_timeout"), 1.0);
    p.shutdown().await;
}

#[tokio::test]
async fn backend_down_after_retries_is_502() {
    let (d1, d2) = (dead_addr(), dead_addr());
    let p = start_proxy(&[d1.addr, d2.addr], "retries = 1\n[passive]\nfailures = 0").await;
    let r = get(p.addr, "/").await;
    assert_eq!((r.status, r.body.as_str()), (502, "backend unreachable\n"));
    let m = metrics(&p).await;
    assert_eq!(refusals(&m, "backend_down"), 1.0);
    // The first try and one retry, one per backend.
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", d1.addr)), 1.0, "{m}");
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", d2.addr)), 1.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn no_healthy_backend_is_503() {
    let o = Origin::start(|s| if s.path == "/health" { ok("no").status(500) } else { ok("x") }).await;
    let p = start_proxy(&[o.addr], "[health]\npath = \"/health\"\ninterval_ms = 20\nunhealthy_after = 1").await;
    wait_for_sample(&p, &format!("inband_proxy_backend_up{{backend=\"{}\"}}", o.addr), 0.0).await;
    let r = get(p.addr, "/").await;
    assert_eq!((r.status, r.body.as_str()), (503, "no healthy backend\n"));
    assert_eq!(o.hits(), 0);
    assert_eq!(refusals(&metrics(&p).await, "no_healthy_backend"), 1.0);
    p.shutdown().await;
}

/// Passive ejection cannot empty the pool: with every backend ejected, the
/// next request still goes to one (counted), and its failure is the
/// backend's own 502, never the proxy's 503.
#[tokio::test]
async fn a_pool_passive_ejection_emptied_is_still_tried() {
    let (d1, d2) = (dead_addr(), dead_addr());
    let p = start_proxy(&[d1.addr, d2.addr], "retries = 1\n[passive]\nfailures = 1\ncooldown_ms = 60000").await;
    let overridden = |m: &str, d: &Dead| sample(m, &format!("inband_proxy_ejection_overridden_total{{backend=\"{}\"}}", d.addr));
    // Both refuse: each is tried once and ejected.
    assert_eq!(get(p.addr, "/").await.status, 502);
    let m = metrics(&p).await;
    assert_eq!(overridden(&m, &d1) + overridden(&m, &d2), 0.0, "{m}");
    // Both ejected, both tried again.
    assert_eq!(get(p.addr, "/").await.status, 502);
    let m = metrics(&p).await;
    assert_eq!((overridden(&m, &d1), overridden(&m, &d2)), (1.0, 1.0), "{m}");
    assert_eq!(refusals(&m, "no_healthy_backend"), 0.0);
    p.shutdown().await;
}

#[tokio::test]
async fn backend_timeout_is_504() {
    let o = Origin::start(|_| ok("late").delay(Duration::from_secs(3))).await;
    let p = start_proxy(&[o.addr], "backend_timeout_ms = 200").await;
    let t = std::time::Instant::now();
    let r = get(p.addr, "/").await;
    assert_eq!((r.status, r.body.as_str()), (504, "backend timed out\n"));
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(o.hits(), 1, "a timed-out request is not retried");
    assert_eq!(refusals(&metrics(&p).await, "backend_timeout"), 1.0);
    p.shutdown().await;
}

#[tokio::test]
async fn http11_without_host_or_with_two_is_400_and_http10_without_is_served() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "").await;
    let out = raw(p.addr, b"GET / HTTP/1.1\r\nconnection: close\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out:?}");
    let out = raw(p.addr, b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\nconnection: close\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out:?}");
    assert_eq!(o.hits(), 0);
    let out = raw(p.addr, b"GET / HTTP/1.0\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"), "{out:?}");
    assert_eq!(o.hits(), 1);
    assert_eq!(refusals(&metrics(&p).await, "bad_host"), 2.0);
    p.shutdown().await;
}

#[tokio::test]
async fn via_is_added_toward_the_backend_and_toward_the_client() {
    let o = Origin::start(|_| ok("x").header("via", "1.1 origin-cdn")).await;
    let p = start_proxy(&[o.addr], "").await;
    let r = send(p.addr, "GET", "/", &[("via", "1.0 client-proxy")], b"").await;
    let via: Vec<String> = r.headers.get_all("via").iter().map(|v| v.to_str().unwrap().to_string()).collect();
    assert_eq!(via, ["1.1 origin-cdn", "1.1 inband"]);
    let seen = o.seen();
    let via: Vec<&str> = seen[0].headers.get_all("via").iter().map(|v| v.to_str().unwrap()).collect();
    assert_eq!(via, ["1.0 client-proxy", "1.1 inband"]);
    p.shutdown().await;
}

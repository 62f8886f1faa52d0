//! Policies, retries, health checking, forwarding headers and graceful
//! shutdown, through a real proxy to real origins on loopback.


use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

async fn origins(n: usize) -> Vec<Origin> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(Origin::start(move |_| ok(&format!("origin{i}"))).await);
    }
    v
}

#[tokio::test]
async fn round_robin_splits_evenly() {
    let o = origins(3).await;
    let p = start_proxy(&o.iter().map(|o| o.addr).collect::<Vec<_>>(), "").await;
    for _ in 0..30 {
        assert_eq!(get(p.addr, "/").await.status, 200);
    }
    assert_eq!(o.iter().map(|o| o.hits()).collect::<Vec<_>>(), vec![10, 10, 10]);
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_requests_total{class=\"2xx\"}"), 30.0, "{m}");
    p.shutdown().await;
}

/// `/metrics` is OpenMetrics as prometheus-client writes it (a HELP and a
/// TYPE for every family, `# EOF`), served with its content type by the
/// shared endpoint server, which answers 404 elsewhere.
#[tokio::test]
async fn the_metrics_endpoint_serves_openmetrics_with_help_and_type() {
    let o = origins(1).await;
    let p = start_proxy(&[o[0].addr], "").await;
    assert_eq!(get(p.addr, "/").await.status, 200);
    let r = get(p.metrics_addr.unwrap(), "/metrics").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/openmetrics-text; version=1.0.0; charset=utf-8");
    inband_http::check_exposition(&r.body).unwrap_or_else(|e| panic!("{e}\n{}", r.body));
    for (family, kind) in [
        ("inband_proxy_requests", "counter"),
        ("inband_proxy_origin_requests", "counter"),
        ("inband_proxy_backend_up", "gauge"),
        ("inband_proxy_connections", "gauge"),
        ("inband_proxy_request_duration_seconds", "histogram"),
    ] {
        assert!(r.body.contains(&format!("# TYPE {family} {kind}\n")), "{family}:\n{}", r.body);
    }
    assert_eq!(sample(&r.body, "inband_proxy_requests_total{class=\"2xx\"}"), 1.0, "{}", r.body);
    assert_eq!(sample(&r.body, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", o[0].addr)), 1.0, "{}", r.body);
    assert_eq!(get(p.metrics_addr.unwrap(), "/other").await.status, 404);
    p.shutdown().await;
}

#[tokio::test]
async fn consistent_hash_keeps_a_key_on_one_backend() {
    let o = origins(3).await;
    let p = start_proxy(&o.iter().map(|o| o.addr).collect::<Vec<_>>(), "policy = \"consistent-hash\"\nhash_key = \"header:x-user\"").await;
    let mut owner: HashMap<String, String> = HashMap::new();
    for round in 0..3 {
        for u in 0..20 {
            let user = format!("user{u}");
            let r = send(p.addr, "GET", &format!("/r{round}"), &[("x-user", &user)], b"").await;
            assert_eq!(r.status, 200);
            let prev = owner.entry(user.clone()).or_insert(r.body.clone());
            assert_eq!(*prev, r.body, "{user} moved between backends");
        }
    }
    let used: std::collections::HashSet<&String> = owner.values().collect();
    assert!(used.len() >= 2, "20 users all hashed to one backend: {owner:?}");
    p.shutdown().await;
}

#[tokio::test]
async fn least_request_prefers_the_idle_backend() {
    let slow = |s: &Seen| if s.path == "/slow" { ok("slow").delay(Duration::from_millis(1500)) } else { ok("fast") };
    let (a, b) = (Origin::start(slow).await, Origin::start(slow).await);
    let p = start_proxy(&[a.addr, b.addr], "policy = \"least-request\"").await;
    let addr = p.addr;
    let pending = tokio::spawn(async move { get(addr, "/slow").await });
    while a.hits() + b.hits() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy_is_a = a.hits() == 1;
    for _ in 0..20 {
        assert_eq!(get(p.addr, "/fast").await.status, 200);
    }
    let (busy, idle) = if busy_is_a { (&a, &b) } else { (&b, &a) };
    assert_eq!((busy.hits(), idle.hits()), (1, 20), "every request went to the backend without one in flight");
    assert_eq!(pending.await.unwrap().body, "slow");
    p.shutdown().await;
}

#[tokio::test]
async fn idempotent_requests_retry_on_connection_refused_others_do_not() {
    let live = Origin::start(|_| ok("live")).await;
    let dead = dead_addr();
    // Passive ejection off: every request meets the dead backend in turn.
    let p = start_proxy(&[dead.addr, live.addr], "[passive]\nfailures = 0").await;
    for _ in 0..6 {
        let r = get(p.addr, "/").await;
        assert_eq!((r.status, r.body.as_str()), (200, "live"));
    }
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(send(p.addr, "POST", "/", &[], b"x").await.status);
    }
    statuses.sort();
    assert_eq!(statuses, vec![200, 200, 502, 502]);
    // A PUT is retried with its body.
    for _ in 0..2 {
        assert_eq!(send(p.addr, "PUT", "/doc", &[], b"payload").await.status, 200);
    }
    assert_eq!(live.hits(), 10);
    let puts: Vec<_> = live.seen().into_iter().filter(|s| s.method == "PUT").collect();
    assert_eq!(puts.len(), 2);
    assert!(puts.iter().all(|s| s.body == "payload"), "{puts:?}");
    p.shutdown().await;
}

#[tokio::test]
async fn health_checks_eject_and_readmit() {
    let up = Arc::new(AtomicBool::new(true));
    let u = up.clone();
    let a = Origin::start(move |s| {
        if s.path == "/health" && !u.load(Ordering::SeqCst) {
            ok("down").status(503)
        } else {
            ok("a")
        }
    })
    .await;
    let b = Origin::start(|_| ok("b")).await;
    let extra = "[health]\npath = \"/health\"\ninterval_ms = 30\ntimeout_ms = 200\nunhealthy_after = 2\nhealthy_after = 3";
    let p = start_proxy(&[a.addr, b.addr], extra).await;
    let series = format!("inband_proxy_backend_up{{backend=\"{}\"}}", a.addr);
    wait_for_sample(&p, &series, 1.0).await;
    up.store(false, Ordering::SeqCst);
    wait_for_sample(&p, &series, 0.0).await;
    for _ in 0..10 {
        assert_eq!(get(p.addr, "/").await.body, "b");
    }
    assert_eq!(a.hits(), 0);
    up.store(true, Ordering::SeqCst);
    wait_for_sample(&p, &series, 1.0).await;
    for _ in 0..10 {
        get(p.addr, "/").await;
    }
    assert_eq!((a.hits(), b.hits()), (5, 15));
    p.shutdown().await;
}

#[tokio::test]
async fn passive_ejection_on_5xx_for_a_cooldown() {
    let a = Origin::start(|_| ok("broken").status(500)).await;
    let b = Origin::start(|_| ok("b")).await;
    let p = start_proxy(&[a.addr, b.addr], "[passive]\nfailures = 2\ncooldown_ms = 500").await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get(p.addr, "/").await.status);
    }
    // a, b, a (second failure: ejected), b
    assert_eq!(statuses, vec![500, 200, 500, 200]);
    for _ in 0..10 {
        assert_eq!(get(p.addr, "/").await.status, 200);
    }
    assert_eq!(a.hits(), 2);
    tokio::time::sleep(Duration::from_millis(600)).await;
    for _ in 0..4 {
        get(p.addr, "/").await;
    }
    assert!(a.hits() > 2, "backend readmitted after the cool-down");
    p.shutdown().await;
}

/// A sole backend whose application answers 5xx for a while (a deploy,
/// a dependency down) is never taken out of service by its own answers:
/// every request reaches it, and it serves again the moment it recovers
/// (nginx ignores max_fails for a sole server; the proxy used to answer
/// 503 for the whole cool-down).
#[tokio::test]
async fn a_sole_backend_answering_5xx_keeps_getting_requests() {
    let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let o = Origin::start({
        let n = n.clone();
        move |_| if n.fetch_add(1, Ordering::SeqCst) < 7 { ok("failing").status(500) } else { ok("back") }
    })
    .await;
    let p = start_proxy(&[o.addr], "[passive]\nfailures = 5\ncooldown_ms = 60000").await;
    let mut statuses = Vec::new();
    for _ in 0..9 {
        statuses.push(get(p.addr, "/").await.status);
    }
    assert_eq!(statuses, [500, 500, 500, 500, 500, 500, 500, 200, 200]);
    assert_eq!(o.hits(), 9);
    let m = metrics(&p).await;
    let overridden = sample(&m, &format!("inband_proxy_ejection_overridden_total{{backend=\"{}\"}}", o.addr));
    assert_eq!(overridden, 4.0, "requests 6 to 9 found it ejected: {m}");
    p.shutdown().await;
}

#[tokio::test]
async fn origin_sees_forwarding_headers_and_no_hop_by_hop() {
    let o = Origin::start(|_| ok("x")).await;
    let p = start_proxy(&[o.addr], "").await;
    let hdrs = [
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-proto", "https"),
        ("connection", "x-secret"),
        ("x-secret", "1"),
        ("keep-alive", "timeout=5"),
    ];
    let r = send(p.addr, "GET", "/a?b=c", &hdrs, b"").await;
    assert_eq!(r.status, 200);
    let seen = &o.seen()[0];
    assert_eq!(seen.path, "/a?b=c");
    assert_eq!(seen.headers["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(seen.headers["x-forwarded-proto"], "http", "a plaintext client's claim of https is replaced");
    let fwd = seen.headers["forwarded"].to_str().unwrap();
    assert_eq!(fwd, format!("for=127.0.0.1;proto=http;host=\"{}\"", p.addr));
    assert!(!seen.headers.contains_key("x-secret"), "a header named by Connection is hop-by-hop");
    assert!(!seen.headers.contains_key("keep-alive"), "Keep-Alive is hop-by-hop");
    p.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_the_slow_request_in_flight() {
    let o = Origin::start(|_| ok("finished").delay(Duration::from_millis(700))).await;
    let p = start_proxy(&[o.addr], "").await;
    let addr = p.addr;
    let pending = tokio::spawn(async move { get(addr, "/slow").await });
    while o.hits() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = std::time::Instant::now();
    p.shutdown().await;
    assert!(t.elapsed() >= Duration::from_millis(400), "shutdown waited for the request");
    let r = pending.await.unwrap();
    assert_eq!((r.status, r.body.as_str()), (200, "finished"));
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "no longer accepting");
}

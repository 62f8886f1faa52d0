//! `[[route]]`: pools chosen by host and path prefix, each with its own
//! health, cache use, header rewrites and rate limit; the top-level
//! backends as the default route.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;
use inband_proxy::{config, Proxy};

/// An origin that answers its own name.
async fn named(name: &'static str) -> Origin {
    Origin::start(move |_| ok(name)).await
}

/// A proxy with `default` as its top-level pool (none when empty) and
/// `rest` after it: routes and other tables.
async fn start(default: &[SocketAddr], rest: &str) -> Proxy {
    let list: Vec<String> = default.iter().map(|a| format!("\"{a}\"")).collect();
    let toml = format!("listen = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nbackends = [{}]\n{rest}", list.join(", "));
    let cfg = config::parse(&toml).unwrap_or_else(|e| panic!("{e:#}\n{toml}"));
    Proxy::start(cfg).await.unwrap()
}

fn route(name: &str, body: &str, backends: &[SocketAddr]) -> String {
    let list: Vec<String> = backends.iter().map(|a| format!("\"{a}\"")).collect();
    format!("[[route]]\nname = \"{name}\"\nbackends = [{}]\n{body}\n", list.join(", "))
}

async fn get_host(p: &Proxy, host: &str, path: &str) -> Reply2 {
    send(p.addr, "GET", path, &[("host", host)], b"").await
}

#[tokio::test]
async fn an_exact_host_beats_a_wildcard_which_beats_any_host_then_the_default() {
    let (exact, wild, deeper, any, default) = (named("exact").await, named("wild").await, named("deeper").await, named("any").await, named("default").await);
    let routes = [
        route("exact", "hosts = [\"api.example.com\"]", &[exact.addr]),
        route("wild", "hosts = [\"*.example.com\"]", &[wild.addr]),
        route("deeper", "hosts = [\"*.b.example.com\"]", &[deeper.addr]),
        route("static", "path_prefix = \"/static\"", &[any.addr]),
    ];
    let p = start(&[default.addr], &routes.concat()).await;
    for (host, path, want) in [
        ("api.example.com", "/", "exact"),
        ("API.Example.COM:8080", "/", "exact"),
        ("api.example.com.", "/", "exact"),
        // The host decides before the path: exact's "/" over static's "/static".
        ("api.example.com", "/static/a", "exact"),
        ("www.example.com", "/", "wild"),
        ("a.c.example.com", "/x", "wild"),
        ("a.b.example.com", "/", "deeper"),
        ("x.y.b.example.com", "/", "deeper"),
        // A wildcard does not take the bare name.
        ("example.com", "/", "default"),
        ("badexample.com", "/", "default"),
        ("other.org", "/static/app.js", "any"),
        ("other.org", "/static", "any"),
        ("other.org", "/staticx", "default"),
        ("www.example.com", "/static/a", "wild"),
    ] {
        let r = get_host(&p, host, path).await;
        assert_eq!((r.status, r.body.as_str()), (200, want), "{host}{path}");
    }
    // A Host with bytes no name has (raw UTF-8, a space) matches no hosts
    // entry, and is served by what takes any host.
    let r = raw(p.addr, "GET /static/x HTTP/1.1\r\nHost: bücher.example.com\r\nConnection: close\r\n\r\n".as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("any"), "{r}");
    // HTTP/2 is routed by its host as HTTP/1.1 is.
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).http2_only(true).build_http();
    let req = http::Request::get(format!("http://{}/", p.addr)).header("host", "api.example.com").body(Default::default()).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), h2.request(req)).await.unwrap().unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes(), "exact");
    let r = raw(p.addr, b"GET / HTTP/1.1\r\nHost: [::1\r\nConnection: close\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("default"), "{r}");
    let m = metrics(&p).await;
    for (route, n) in [("exact", 5.0), ("wild", 3.0), ("deeper", 2.0), ("static", 3.0), ("default", 4.0)] {
        assert_eq!(sample(&m, &format!("inband_proxy_route_requests_total{{route=\"{route}\"}}")), n, "{route}\n{m}");
    }
    // The top-level pool's series keep their labels; a route's carry its name.
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{backend=\"{}\"}}", default.addr)), 4.0, "{m}");
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{route=\"wild\",backend=\"{}\"}}", wild.addr)), 3.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn the_longest_prefix_wins_by_whole_segments_and_unmatched_requests_are_404() {
    let (api, v2) = (named("api").await, named("v2").await);
    let routes = [route("api", "path_prefix = \"/api\"", &[api.addr]), route("v2", "path_prefix = \"/api/v2\"", &[v2.addr])];
    let p = start(&[], &routes.concat()).await;
    for (path, want) in [
        ("/api", "api"),
        ("/api/x", "api"),
        ("/api/v2", "v2"),
        ("/api/v2/users?x=1", "v2"),
        ("/api/v2x", "api"),
        // Chosen on the normalised path, as a backend that resolves dot
        // segments and %-encoded letters would read it.
        ("/api/v2/../x", "api"),
        ("/api/%76%32/y", "v2"),
        ("/api//v2/y", "v2"),
    ] {
        let r = get_host(&p, "h", path).await;
        assert_eq!((r.status, r.body.as_str()), (200, want), "{path}");
    }
    assert_eq!(v2.seen().iter().map(|s| s.path.as_str()).collect::<Vec<_>>(), ["/api/v2", "/api/v2/users?x=1", "/api/%76%32/y", "/api//v2/y"], "forwarded as sent");
    for path in ["/", "/apix", "/other/api", "/api/../other"] {
        let r = get_host(&p, "h", path).await;
        assert_eq!((r.status, r.body.as_str()), (404, "no route for this host and path\n"), "{path}");
    }
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"no_route\"}"), 4.0, "{m}");
    assert_eq!(api.hits() + v2.hits(), 8);
    p.shutdown().await;
}

#[tokio::test]
async fn a_dead_pool_does_not_affect_another_route() {
    let live = named("live").await;
    let d = dead_addr();
    let health = "[route.health]\npath = \"/health\"\ninterval_ms = 50\ntimeout_ms = 200\nunhealthy_after = 1\nhealthy_after = 1";
    // The live origin is in both pools: each pool keeps its own state of it.
    let routes = [route("dead", &format!("path_prefix = \"/dead\"\n{health}"), &[d.addr, live.addr]), route("live", &format!("path_prefix = \"/live\"\n{health}"), &[live.addr])];
    let p = start(&[], &routes.concat()).await;
    wait_for_sample(&p, &format!("inband_proxy_backend_up{{route=\"dead\",backend=\"{}\"}}", d.addr), 0.0).await;
    for _ in 0..6 {
        let r = get_host(&p, "h", "/live/x").await;
        assert_eq!((r.status, r.body.as_str()), (200, "live"));
        let r = get_host(&p, "h", "/dead/x").await;
        assert_eq!((r.status, r.body.as_str()), (200, "live"), "the dead route's checked-down member is skipped");
    }
    let m = metrics(&p).await;
    assert_eq!(sample(&m, &format!("inband_proxy_backend_up{{route=\"live\",backend=\"{}\"}}", live.addr)), 1.0, "{m}");
    assert_eq!(sample(&m, &format!("inband_proxy_backend_up{{route=\"dead\",backend=\"{}\"}}", live.addr)), 1.0, "{m}");
    assert_eq!(sample(&m, &format!("inband_proxy_origin_requests_total{{route=\"dead\",backend=\"{}\"}}", d.addr)), 0.0, "{m}");
    p.shutdown().await;

    // A pool with nothing alive: its route answers 502, the other 200.
    let routes = [route("dead", "path_prefix = \"/dead\"", &[d.addr]), route("live", "path_prefix = \"/live\"", &[live.addr])];
    let p = start(&[], &routes.concat()).await;
    for _ in 0..3 {
        assert_eq!(get_host(&p, "h", "/dead").await.status, 502);
        assert_eq!(get_host(&p, "h", "/live").await.status, 200);
    }
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_route_refusals_total{route=\"dead\",reason=\"backend_down\"}"), 3.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_route_refusals_total{route=\"live\",reason=\"backend_down\"}"), 0.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn the_cache_serves_one_route_and_never_another() {
    let o = Origin::start(|s| {
        let body = if s.path.ends_with("/big") { "x".repeat(5000) } else { s.path.clone() };
        ok(&body).header("cache-control", "max-age=60")
    })
    .await;
    let routes = [
        route("cached", "path_prefix = \"/c\"", &[o.addr]),
        route("uncached", "path_prefix = \"/u\"\ncache = false", &[o.addr]),
        route("small", "path_prefix = \"/s\"\nmax_object_bytes = 1000", &[o.addr]),
    ];
    let p = start(&[], &format!("{}[cache]\nbackend = \"memory\"\n", routes.concat())).await;
    let x_cache = |r: &Reply2| r.headers.get("x-cache").map(|v| v.to_str().unwrap().to_string());
    let a = get_host(&p, "h", "/c/x").await;
    let b = get_host(&p, "h", "/c/x").await;
    assert_eq!((a.body.as_str(), x_cache(&a).as_deref(), x_cache(&b).as_deref()), ("/c/x", Some("MISS"), Some("HIT")));
    assert_eq!(o.hits(), 1);
    for _ in 0..3 {
        let r = get_host(&p, "h", "/u/x").await;
        assert_eq!((r.status, x_cache(&r)), (200, None), "no cache outcome: the store is not looked at");
    }
    assert_eq!(o.hits(), 4, "every request of the uncached route reaches the origin");
    // The route's bound, below the store's: the 5000-byte body is not kept.
    for _ in 0..2 {
        assert_eq!(get_host(&p, "h", "/s/big").await.body.len(), 5000);
    }
    assert_eq!(o.hits(), 6);
    get_host(&p, "h", "/c/big").await;
    get_host(&p, "h", "/c/big").await;
    assert_eq!(o.hits(), 7, "the store's own bound keeps it for the other route");
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"hit\"}"), 2.0, "{m}");
    p.shutdown().await;
}

#[tokio::test]
async fn header_rewrites_apply_on_a_miss_and_a_hit_and_the_stored_response_stays_as_sent() {
    let o = Origin::start(|_| ok("body").header("cache-control", "max-age=60").header("x-origin", "secret").header("x-keep", "1")).await;
    let body = "path_prefix = \"/r\"\n\
        [route.request_headers]\nremove = [\"x-client-secret\"]\nset = { \"x-route\" = \"r\" }\nadd = { \"x-added\" = \"yes\" }\n\
        [route.response_headers]\nremove = [\"x-origin\"]\nset = { \"x-keep\" = \"2\" }\nadd = { \"x-served-by\" = \"inband\" }";
    let p = start(&[], &format!("{}[cache]\nbackend = \"memory\"\n", route("r", body, &[o.addr]))).await;
    let headers = [("host", "h"), ("x-client-secret", "s"), ("x-route", "client"), ("x-added", "client")];
    for want_cache in ["MISS", "HIT"] {
        let r = send(p.addr, "GET", "/r/x", &headers, b"").await;
        assert_eq!((r.status, r.body.as_str()), (200, "body"));
        assert_eq!(r.headers["x-cache"], want_cache);
        assert!(!r.headers.contains_key("x-origin"), "{want_cache}: {:?}", r.headers);
        let all = |n: &str| r.headers.get_all(n).iter().map(|v| v.to_str().unwrap().to_string()).collect::<Vec<_>>();
        assert_eq!(all("x-keep"), ["2"], "{want_cache}");
        // Added once: had the rewrite gone into the store, a hit would
        // carry it twice.
        assert_eq!(all("x-served-by"), ["inband"], "{want_cache}");
    }
    assert_eq!(o.hits(), 1);
    let seen = &o.seen()[0].headers;
    assert!(!seen.contains_key("x-client-secret"));
    assert_eq!(seen.get_all("x-route").iter().collect::<Vec<_>>(), ["r"]);
    assert_eq!(seen.get_all("x-added").iter().collect::<Vec<_>>(), ["client", "yes"]);
    p.shutdown().await;
}

/// One GET on a fresh connection from the loopback address `from`.
async fn get_from(from: &str, to: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = s.connect(to).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await.expect("answered within 5 s").unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_route_rate_limit_answers_429_per_client_and_recovers() {
    let o = named("served").await;
    let routes = [
        route("limited", "path_prefix = \"/l\"\n[route.rate_limit]\nrequests_per_s = 4\nburst = 2", &[o.addr]),
        route("free", "path_prefix = \"/f\"", &[o.addr]),
    ];
    let p = start(&[], &routes.concat()).await;
    let status = |r: &str| r[9..12].to_string();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(get_from("127.0.0.1", p.addr, "/l").await);
    }
    assert_eq!(got.iter().map(|r| status(r)).collect::<Vec<_>>(), ["200", "200", "429"], "the burst, then refused");
    assert!(got[2].to_ascii_lowercase().contains("retry-after: 1\r\n"), "{}", got[2]);
    assert!(got[2].ends_with("too many requests from this client to this route\n"), "{}", got[2]);
    assert_eq!(status(&get_from("127.0.0.1", p.addr, "/f").await), "200", "another route is not limited");
    assert_eq!(status(&get_from("127.0.0.2", p.addr, "/l").await), "200", "another client has its own bucket");
    // 4 a second: a token every 250 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(status(&get_from("127.0.0.1", p.addr, "/l").await), "200", "recovered at the rate");
    assert_eq!(status(&get_from("127.0.0.1", p.addr, "/l").await), "429");
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_route_refusals_total{route=\"limited\",reason=\"route_rate\"}"), 2.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_refusals_total{reason=\"route_rate\"}"), 2.0, "{m}");
    assert_eq!(o.hits(), 5, "refused requests never reach the origin");
    p.shutdown().await;
}

#[tokio::test]
async fn bad_routes_are_refused_at_start_with_a_message_each() {
    let b = "backends = [\"127.0.0.1:9\"]";
    for (top, routes, want) in [
        ("", format!("[[route]]\nname = \"a\"\n{b}\n[[route]]\nname = \"b\"\n{b}"), "route \"b\": any host with path_prefix \"/\" is already route \"a\"'s"),
        (b, format!("[[route]]\nname = \"a\"\n{b}"), "route \"a\": any host with path_prefix \"/\" is already the default route (top-level backends)'s"),
        ("", format!("[[route]]\nname = \"a\"\nhosts = [\"X.com\"]\npath_prefix = \"/p\"\n{b}\n[[route]]\nname = \"b\"\nhosts = [\"y.com\", \"x.com.\"]\npath_prefix = \"/p\"\n{b}"), "route \"b\": host \"x.com\" with path_prefix \"/p\" is already route \"a\"'s"),
        ("", format!("[[route]]\nname = \"a\"\nhosts = [\"www.*.com\"]\n{b}"), "route \"a\": host \"www.*.com\": a wildcard is only allowed as the whole first label"),
        ("", format!("[[route]]\nname = \"a\"\nhosts = [\"*x.com\"]\n{b}"), "route \"a\": host \"*x.com\": a wildcard is only allowed"),
        ("", format!("[[route]]\nname = \"a\"\nhosts = [\"bücher.de\"]\n{b}"), "write an internationalised name in its xn-- form"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\n[route.request_headers]\nset = {{ \"Content-Length\" = \"1\" }}"), "route \"a\": request_headers: \"Content-Length\" may not be rewritten"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\n[route.response_headers]\nremove = [\"transfer-encoding\"]"), "route \"a\": response_headers: \"transfer-encoding\" may not be rewritten"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\n[route.request_headers]\nadd = {{ \"Host\" = \"x\" }}"), "\"Host\" may not be rewritten"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\n[route.request_headers]\nadd = {{ \"x-a\" = \"1\\n2\" }}"), "the value of \"x-a\" has a byte"),
        ("", format!("[[route]]\nname = \"a\"\npath_prefix = \"api\"\n{b}"), "path_prefix \"api\" must start with /"),
        ("", format!("[[route]]\nname = \"a\"\npath_prefix = \"/a/../b\"\n{b}"), "no . or .. segments"),
        ("", format!("[[route]]\nname = \"default\"\n{b}"), "the name \"default\" is the top-level pool's"),
        ("", format!("[[route]]\nname = \"a b\"\n{b}"), "name must be 1 to 64 letters"),
        ("", "[[route]]\nname = \"a\"\nbackends = []".to_string(), "route \"a\": backends is empty"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\n[route.rate_limit]\nrequests_per_s = 0"), "rate_limit.requests_per_s = 0 must be above 0"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\nmax_object_bytes = 10"), "max_object_bytes needs a [cache]"),
        ("", format!("[[route]]\nname = \"a\"\n{b}\nhash_key = \"cookie\""), "route \"a\": hash_key \"cookie\""),
        ("", format!("[[route]]\nname = \"a\"\n{b}\npolcy = \"x\""), "unknown field `polcy`"),
        ("", String::new(), "backends is empty: list at least one backend"),
    ] {
        let toml = format!("listen = \"127.0.0.1:0\"\n{top}\n{routes}");
        let e = format!("{:#}", config::parse(&toml).unwrap_err());
        assert!(e.contains(want), "{want:?} missing in:\n{e}\n--- config:\n{toml}");
    }
    // Routes alone, without top-level backends, are a whole config.
    config::parse(&format!("listen = \"127.0.0.1:0\"\n[[route]]\nname = \"a\"\n{b}")).unwrap();
}

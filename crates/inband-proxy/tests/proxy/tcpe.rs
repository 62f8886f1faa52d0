//! Connection handoff (`[tcpe]`): a TCPE client (inband-tcpe's client
//! library) through the proxy to a backend with a takeover server in front
//! of a real HTTP origin gets its 1 MiB body by the handoff; a plain client
//! through the same proxy gets it proxied; a cached object is served from
//! the cache, never handed off; a takeover server that refuses (its origin
//! is down) leaves the body on the proxy. Every case is checked by the
//! body's bytes and the counters on both sides.
//!
//! The proxy and the client each load the sockops program onto a cgroup v2
//! this test makes and moves the test process into (and out of, with the
//! cgroup removed, on every exit path: Drop). Everything else is on
//! 127.0.0.1.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inband_core::wire::Key;
use inband_proxy::Proxy;
use inband_tcpe::client::{self, Client};
use inband_tcpe::handoff;
use inband_tcpe::sockops::Tcpe;
use inband_tcpe::takeover::{self, Takeover};

use crate::common::*;

const KEY: Key = Key([0x3c; 16]);
const WAIT: Duration = Duration::from_secs(5);

/// A cgroup v2 holding this process until dropped.
struct Cgroup {
    dir: PathBuf,
    home: PathBuf,
}

impl Cgroup {
    fn enter() -> Cgroup {
        let pid = std::process::id();
        let home = inband_tcpe::cli::own_cgroup().expect("this process's cgroup v2");
        let dir = PathBuf::from(format!("/sys/fs/cgroup/unified/inband-test-proxy-tcpe-{pid}"));
        std::fs::create_dir(&dir).expect("cgroup v2 at /sys/fs/cgroup/unified");
        let cg = Cgroup { dir, home };
        std::fs::write(cg.dir.join("cgroup.procs"), pid.to_string()).unwrap();
        cg
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.home.join("cgroup.procs"), std::process::id().to_string());
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A free port on 127.0.0.1 (the takeover server binds the addresses it
/// is given, which the proxy's config must name).
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

fn free_addr6() -> SocketAddr {
    std::net::TcpListener::bind("[::1]:0").unwrap().local_addr().unwrap()
}

fn big_body() -> Vec<u8> {
    (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
}

/// /big: 1 MiB, not stored; /cached: small, stored for a minute.
async fn origin() -> Origin {
    Origin::start(|s| match s.path.as_str() {
        "/big" => Reply { status: 200, body: big_body(), ..Default::default() }.header("cache-control", "no-store"),
        _ => ok("a cached object").header("cache-control", "max-age=60"),
    })
    .await
}

/// GET `path` for `host` over `conn` (TCPE or plain): status and body.
async fn fetch<C: std::io::Read + std::io::Write + Send + 'static>(mut conn: C, host: &'static str, path: &'static str) -> (u16, Vec<u8>, C) {
    tokio::task::spawn_blocking(move || {
        let mut body = Vec::new();
        let status = client::get(&mut conn, host, path, &mut body).unwrap();
        (status, body, conn)
    })
    .await
    .unwrap()
}

/// An origin that dies in the middle of a body: the first response to
/// each URL of /dies (any query) and to /changes stops after a quarter of its 1 MiB (the
/// connection closed, as when the server's process or host goes); after
/// that /dies answers a range of itself under its unchanged ETag, while
/// /changes has a new ETag every time. The first request to each URL of
/// /silent gets no answer at all (the connection closed before the head),
/// the next the whole body. Anything else is a short 200. One
/// request per connection (`Connection: close`); blocking threads, since
/// the takeover server and the proxy both dial it.
struct Dying {
    addr: SocketAddr,
    /// The request heads it received, in order.
    heads: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Dying {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Dying {
    fn start() -> Dying {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let (addr, heads, stop) = (l.local_addr().unwrap(), Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        let (h, st) = (heads.clone(), stop.clone());
        std::thread::spawn(move || {
            let served: Arc<Mutex<std::collections::HashMap<String, usize>>> = Default::default();
            while !st.load(Ordering::Relaxed) {
                let Ok((s, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let (h, served) = (h.clone(), served.clone());
                std::thread::spawn(move || Dying::answer(s, &h, &served));
            }
        });
        Dying { addr, heads, stop }
    }

    fn answer(mut s: TcpStream, heads: &Mutex<Vec<String>>, served: &Mutex<std::collections::HashMap<String, usize>>) {
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut b) {
                Ok(n) if n > 0 => head.extend_from_slice(&b[..n]),
                _ => return,
            }
        }
        let head = String::from_utf8_lossy(&head).to_string();
        heads.lock().unwrap().push(head.clone());
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
        let header = |name: &str| {
            head.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string()))
        };
        let n = {
            let mut m = served.lock().unwrap();
            let n = m.entry(path.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let body = big_body();
        let etag = if path == "/changes" { format!("\"v{n}\"") } else { "\"v1\"".to_string() };
        let object = path.split('?').next().unwrap_or_default();
        let common = format!("ETag: {etag}\r\nAccept-Ranges: bytes\r\nCache-Control: no-store\r\nConnection: close\r\n");
        let reply = match (object, n) {
            ("/silent", 1) => return,
            ("/silent", _) => {
                let mut r = format!("HTTP/1.1 200 OK\r\n{common}Content-Length: {}\r\n\r\n", body.len()).into_bytes();
                r.extend_from_slice(&body);
                r
            }
            ("/dies" | "/changes", 1) => {
                let mut r = format!("HTTP/1.1 200 OK\r\n{common}Content-Length: {}\r\n\r\n", body.len()).into_bytes();
                r.extend_from_slice(&body[..body.len() / 4]);
                r
            }
            ("/dies" | "/changes", _) => {
                let from = header("range").and_then(|r| r.strip_prefix("bytes=")?.strip_suffix('-')?.parse::<usize>().ok());
                match from.filter(|&f| f < body.len() && header("if-range").as_deref() == Some(etag.as_str())) {
                    Some(f) => {
                        let mut r = format!(
                            "HTTP/1.1 206 Partial Content\r\n{common}Content-Range: bytes {f}-{}/{}\r\nContent-Length: {}\r\n\r\n",
                            body.len() - 1,
                            body.len(),
                            body.len() - f
                        )
                        .into_bytes();
                        r.extend_from_slice(&body[f..]);
                        r
                    }
                    None => {
                        let mut r = format!("HTTP/1.1 200 OK\r\n{common}Content-Length: {}\r\n\r\n", body.len()).into_bytes();
                        r.extend_from_slice(&body);
                        r
                    }
                }
            }
            _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".to_vec(),
        };
        let _ = s.write_all(&reply);
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

fn tcpe_client(tcpe: &Arc<Tcpe>, p: &Proxy) -> Client {
    Client::connect(tcpe.clone(), p.addr, WAIT).unwrap()
}

fn handoffs(m: &str, result: &str) -> f64 {
    sample(m, &format!("inband_proxy_tcpe_handoffs_total{{result=\"{result}\"}}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcpe_clients_are_handed_off_and_everything_else_proxied() {
    let cg = Cgroup::enter();
    let (moved_origin, refusing_origin, dead) = (origin().await, origin().await, dead_addr());
    let server = |origin: SocketAddr| takeover::Config {
        control: free_addr(),
        join: free_addr(),
        origin,
        key: KEY,
        max_pending: 16,
        max_sessions: 16,
        max_deadline: Duration::from_secs(1),
        io_timeout: Duration::from_secs(1),
        early_join_hold: Duration::from_millis(250),
        idle: WAIT,
        agent: None,
    };
    let dying = Dying::start();
    let (moves, refuses, dies) = (server(moved_origin.addr), server(dead.addr), server(dying.addr));
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("tcpe.key");
    std::fs::write(&key, KEY.0.iter().map(|b| format!("{b:02x}")).collect::<String>()).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let moves_t = Takeover::start(moves.clone()).unwrap();
    let refuses_t = Takeover::start(refuses.clone()).unwrap();
    let dies_t = Takeover::start(dies.clone()).unwrap();
    let p = start_proxy(
        &[moved_origin.addr],
        &format!(
            "[cache]\nbackend = \"memory\"\n\
             [[route]]\nname = \"refusing\"\nhosts = [\"refusing.test\"]\nbackends = [\"{}\"]\n\
             [[route]]\nname = \"dying\"\nhosts = [\"dying.test\"]\nbackends = [\"{}\"]\n\
             [tcpe]\ncgroup = \"{}\"\nkey = \"{}\"\ndeadline_ms = 500\n\
             [[tcpe.server]]\nbackend = \"{}\"\ncontrol = \"{}\"\njoin = \"{}\"\n\
             [[tcpe.server]]\nbackend = \"{}\"\ncontrol = \"{}\"\njoin = \"{}\"\n\
             [[tcpe.server]]\nbackend = \"{}\"\ncontrol = \"{}\"\njoin = \"{}\"\n",
            refusing_origin.addr,
            dying.addr,
            cg.dir.display(),
            key.display(),
            moved_origin.addr,
            moves.control,
            moves.join,
            refusing_origin.addr,
            refuses.control,
            refuses.join,
            dying.addr,
            dies.control,
            dies.join,
        ),
    )
    .await;
    let tcpe = Arc::new(Tcpe::attach(&cg.dir).unwrap());
    let big = big_body();
    let hash = xxhash_rust::xxh3::xxh3_64(&big);

    // A TCPE client: moved to the takeover server, which relays the origin.
    // A machine too busy to route the request and send the HANDOFF within
    // the delayed-ACK timer's 40 ms leaves no ACK to carry the
    // notification: the proxy then falls back at once (counted) and
    // proxies that attempt's body; another attempt is made.
    let mut attempt = 0;
    loop {
        let (status, body, c) = fetch(tcpe_client(&tcpe, &p), "tcpe.test", "/big").await;
        assert_eq!((status, body.len(), xxhash_rust::xxh3::xxh3_64(&body)), (200, big.len(), hash));
        if c.counters().get("moved") == 1 {
            break;
        }
        attempt += 1;
        let m = metrics(&p).await;
        assert_eq!(handoffs(&m, "fallback_no_ack"), attempt as f64, "{m}");
        assert!(attempt < 3, "no handoff in 3 attempts:\n{m}");
    }
    // The client moved at the JOIN-OK; the proxy counts the handoff when the
    // server's verdict reaches it, which the client does not wait for.
    wait_for_sample(&p, "inband_proxy_tcpe_handoffs_total{result=\"handed_off\"}", 1.0).await;
    let m = metrics(&p).await;
    // The sockops program's own counts: every attempt's offer answered, one
    // notification written per handoff tried.
    assert!(sample(&m, "inband_proxy_tcpe_options_total{event=\"syn_answered\"}") >= attempt as f64 + 1.0, "{m}");
    assert!(sample(&m, "inband_proxy_tcpe_options_total{event=\"path_written\"}") >= 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_tcpe_options_total{event=\"path_bad_mac\"}"), 0.0, "{m}");
    let tc = moves_t.counters();
    assert_eq!((tc.get("handoffs_accepted"), tc.get("join_accepted")), (attempt + 1, 1), "{:?}", tc.all());
    // The origin saw each attempt's request once: the handed-off one from
    // the takeover server, none twice.
    assert_eq!(moved_origin.hits(), attempt as usize + 1);

    // A plain client: proxied, counted as not capable.
    let plain = TcpStream::connect(p.addr).unwrap();
    plain.set_read_timeout(Some(WAIT)).unwrap();
    let (status, body, _) = fetch(plain, "tcpe.test", "/big").await;
    assert_eq!((status, xxhash_rust::xxh3::xxh3_64(&body)), (200, hash));
    assert_eq!(handoffs(&metrics(&p).await, "fallback_not_capable"), 1.0);

    // A cached object: stored by a plain client's request, then served to
    // a TCPE client from the cache, not handed off.
    let plain = TcpStream::connect(p.addr).unwrap();
    plain.set_read_timeout(Some(WAIT)).unwrap();
    let (status, body, _) = fetch(plain, "tcpe.test", "/cached").await;
    assert_eq!((status, body.as_slice()), (200, &b"a cached object"[..]));
    let hits = moved_origin.hits();
    let (status, body, c) = fetch(tcpe_client(&tcpe, &p), "tcpe.test", "/cached").await;
    assert_eq!((status, body.as_slice(), c.counters().get("moved")), (200, &b"a cached object"[..], 0));
    assert_eq!(moved_origin.hits(), hits, "the cached object went to the origin");
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_tcpe_kept_total{reason=\"cached\"}"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_cache_total{result=\"hit\"}"), 1.0, "{m}");
    assert_eq!((handoffs(&m, "handed_off"), tc.get("handoffs_accepted")), (1.0, attempt + 1));

    // A server that refuses (its origin is down): the proxy keeps the
    // connection and the body comes from the route's backend. The client
    // heard of the path beside the HANDOFF, and its join was reset at once
    // (the server remembers what it refused). An attempt whose
    // notification found no ACK fell back before the answer (counted, as
    // above): another is made.
    let no_ack = handoffs(&metrics(&p).await, "fallback_no_ack");
    let mut refused_at = 0;
    let c = loop {
        let (status, body, c) = fetch(tcpe_client(&tcpe, &p), "refusing.test", "/big").await;
        assert_eq!((status, xxhash_rust::xxh3::xxh3_64(&body), c.counters().get("moved")), (200, hash, 0));
        if handoffs(&metrics(&p).await, "fallback_refused") == 1.0 {
            assert_eq!(c.counters().get("join_refused"), 1, "{:?}", c.counters().all());
            break c;
        }
        refused_at += 1;
        assert!(refused_at < 3, "no refusal in 3 attempts:\n{}", metrics(&p).await);
    };
    let m = metrics(&p).await;
    assert_eq!(handoffs(&m, "fallback_no_ack"), no_ack + refused_at as f64, "{m}");
    let rc = refuses_t.counters();
    assert_eq!((rc.get("handoff_no_origin"), rc.get("join_unknown")), (refused_at + 1, 1), "{:?}", rc.all());
    assert_eq!(refusing_origin.hits(), refused_at as usize + 1);
    assert_eq!(handoffs(&m, "handed_off"), 1.0, "{m}");
    // The replayed connection goes on with hyper: a keep-alive request.
    let (status, body, _) = fetch(c, "refusing.test", "/small").await;
    assert_eq!((status, body.as_slice()), (200, &b"a cached object"[..]));
    assert_eq!(refusing_origin.hits(), refused_at as usize + 2);

    // A request with a body is not moved: its bytes, read before hyper,
    // reach the origin whole.
    let c = tcpe_client(&tcpe, &p);
    let (status, _, c) = tokio::task::spawn_blocking(move || {
        let mut c = c;
        use std::io::Write;
        c.write_all(b"POST /form HTTP/1.1\r\nHost: tcpe.test\r\nContent-Length: 11\r\n\r\nhello world").unwrap();
        let status = client::response(&mut c, &mut Vec::new()).unwrap();
        (status, (), c)
    })
    .await
    .unwrap();
    assert_eq!((status, c.counters().get("moved")), (200, 0));
    let seen = moved_origin.seen();
    let form = seen.iter().find(|s| s.method == "POST").expect("the POST reached the origin");
    assert_eq!((form.path.as_str(), &form.body[..]), ("/form", &b"hello world"[..]));
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_tcpe_kept_total{reason=\"not_simple\"}"), 1.0, "{m}");

    // The server dies in the middle of the body: the client asks the
    // proxy for the rest by a range under the same ETag, and the file is
    // whole. Had the object changed, the fetch fails rather than join two
    // versions.
    let fetch_via = |path: &'static str| {
        let (tcpe, addr) = (tcpe.clone(), p.addr);
        tokio::task::spawn_blocking(move || {
            let mut body = Vec::new();
            let got = client::fetch(&tcpe, addr, "dying.test", path, WAIT, &mut body);
            (got, body)
        })
    };
    // Who asked the origin: the takeover server sends a GET with each
    // HANDOFF it accepts, and the proxy forwards the request on each
    // fallback, so a handoff that fell back after the server took it
    // (a busy machine: the deadline, or no ACK for the notification) asks
    // twice. The count is waited for: a server that took a HANDOFF the
    // proxy no longer waits for may send its GET after the client is done.
    let fallbacks = |m: &str| handoff::COUNTERS.iter().filter(|(n, _)| n.starts_with("fallback_")).map(|(n, _)| handoffs(m, n) as u64).sum::<u64>();
    let asked_by_both = |path: &'static str, before: (u64, u64)| {
        let (dying, dies_t, p) = (&dying, &dies_t, &p);
        async move {
            let deadline = Instant::now() + WAIT;
            loop {
                let heads: Vec<String> = dying.heads().into_iter().filter(|h| h.starts_with(&format!("GET {path} "))).map(|h| h.to_ascii_lowercase()).collect();
                let m = metrics(p).await;
                let senders = (dies_t.counters().get("handoffs_accepted") - before.0) + (fallbacks(&m) - before.1);
                if heads.len() as u64 == senders || Instant::now() >= deadline {
                    assert_eq!(heads.len() as u64, senders, "{heads:?}\n{:?}\n{m}", dies_t.counters().all());
                    return heads;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let counts = || async { (dies_t.counters().get("handoffs_accepted"), fallbacks(&metrics(&p).await)) };
    // A body cut on the proxy (its handoff fell back on a busy machine,
    // as above) is continued the same way; another object is tried until
    // the cut came after a move. A handoff that fell back after the
    // server sent its GET leaves the cut to the server's GET, which nobody
    // reads: the proxy's GET gets the whole body, nothing is resumed.
    let quarter = big.len() / 4;
    for attempt in 0.. {
        let path: &'static str = ["/dies?0", "/dies?1", "/dies?2"][attempt];
        let before = counts().await;
        let (got, body) = fetch_via(path).await.unwrap();
        let got = got.unwrap();
        assert_eq!((got.status, body.len(), xxhash_rust::xxh3::xxh3_64(&body)), (200, big.len(), hash), "{got:?}");
        let asked = asked_by_both(path, before).await;
        let resumed = |h: &String| h.contains(&format!("range: bytes={quarter}-")) && h.contains("if-range: \"v1\"");
        match got.resumed {
            1 => assert!(asked[1..].iter().any(resumed), "{asked:?}"),
            // Not resumed: the cut went to the server's GET, the body to
            // the proxy's.
            _ => assert!(asked.len() == 2 && !asked.iter().any(|h| h.contains("range:")), "{got:?} {asked:?}"),
        }
        if got.cut_after_move {
            assert_eq!(got.resumed, 1, "{got:?}");
            break;
        }
        assert!(attempt < 2, "no cut after a move in 3 attempts:\n{}", metrics(&p).await);
    }
    // The server dies before the head: nothing to continue, the GET is
    // sent again on a new connection. (Kept on the proxy, the same cut is
    // the proxy's 502, or, when the server's GET took it, the proxy's GET
    // gets the body: another object is tried until it moved.)
    for attempt in 0.. {
        let path: &'static str = ["/silent?0", "/silent?1", "/silent?2"][attempt];
        let before = counts().await;
        let (got, body) = fetch_via(path).await.unwrap();
        let got = got.unwrap();
        let asked = asked_by_both(path, before).await.len();
        if got.cut_after_move {
            assert_eq!((got.status, got.resumed, body.len(), xxhash_rust::xxh3::xxh3_64(&body)), (200, 1, big.len(), hash), "{got:?}");
            assert!(asked >= 2, "{asked}");
            break;
        }
        match got.status {
            502 => assert_eq!((got.resumed, asked), (0, 1), "{got:?}"),
            _ => assert_eq!((got.status, got.resumed, body.len(), asked), (200, 0, big.len(), 2), "{got:?}"),
        }
        assert!(attempt < 2, "no move in 3 attempts:\n{}", metrics(&p).await);
    }
    let (got, body) = fetch_via("/changes").await.unwrap();
    let e = format!("{:#}", got.unwrap_err());
    assert!(e.contains("got 200") && e.contains("the object changed"), "{e}");
    assert_eq!(body.len(), quarter, "bytes of the new version were appended to the old");
    assert!(dies_t.counters().get("join_accepted") >= 1, "{:?}", dies_t.counters().all());

    // Over IPv6: a proxy listening on ::1 hands the client to a takeover
    // server whose join address is ::1 (the 28-byte path option). It is a
    // second proxy with its own program on the same cgroup: each program
    // answers only its own listeners' SYNs (the callbacks run for every
    // program once any set a listener's flags; before tcpe_listeners the
    // first program attached answered with its own key half, and the
    // client refused the second one's notifications).
    let answered = |m: &str| sample(m, "inband_proxy_tcpe_options_total{event=\"syn_answered\"}");
    let p_answered = answered(&metrics(&p).await);
    let moves6 = takeover::Config { join: free_addr6(), ..server(moved_origin.addr) };
    let moves6_t = Takeover::start(moves6.clone()).unwrap();
    let cfg6 = format!(
        "listen = \"[::1]:0\"\nmetrics_listen = \"127.0.0.1:0\"\nbackends = [\"{}\"]\n\
         [tcpe]\ncgroup = \"{}\"\nkey = \"{}\"\ndeadline_ms = 500\n\
         [[tcpe.server]]\nbackend = \"{}\"\ncontrol = \"{}\"\njoin = \"{}\"\n",
        moved_origin.addr,
        cg.dir.display(),
        key.display(),
        moved_origin.addr,
        moves6.control,
        moves6.join,
    );
    let p6 = Proxy::start(inband_proxy::config::parse(&cfg6).unwrap()).await.unwrap();
    assert!(p6.addr.is_ipv6());
    for attempt in 0.. {
        let (status, body, c) = fetch(tcpe_client(&tcpe, &p6), "tcpe.test", "/big").await;
        assert_eq!((status, xxhash_rust::xxh3::xxh3_64(&body)), (200, hash));
        if c.counters().get("moved") == 1 {
            assert_eq!(c.current().peer_addr().unwrap(), moves6.join, "the stream went on on the IPv6 join");
            break;
        }
        assert!(attempt < 2, "no IPv6 handoff in 3 attempts:\n{}", metrics(&p6).await);
    }
    wait_for_sample(&p6, "inband_proxy_tcpe_handoffs_total{result=\"handed_off\"}", 1.0).await;
    let m6 = metrics(&p6).await;
    assert_eq!(moves6_t.counters().get("join_accepted"), 1, "{:?}", moves6_t.counters().all());
    assert!(answered(&m6) >= 1.0, "{m6}");
    assert_eq!(sample(&m6, "inband_proxy_tcpe_options_total{event=\"fallback_no_space\"}"), 0.0, "{m6}");
    assert_eq!(answered(&metrics(&p).await), p_answered, "the first proxy's program answered the second's SYNs");
    p6.shutdown().await;

    p.shutdown().await;
    drop((moves_t, refuses_t, dies_t, moves6_t, tcpe));
    drop(cg);
}

#[test]
fn bad_tcpe_config_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let open_key = dir.path().join("open.key");
    std::fs::write(&open_key, "00".repeat(16)).unwrap();
    std::fs::set_permissions(&open_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:8081\"]\n\
         [tcpe]\ncgroup = \"relative/dir\"\nkey = \"{}\"\ndeadline_ms = 0\nio_timeout_ms = 0\n\
         [[tcpe.server]]\nbackend = \"127.0.0.1:9999\"\ncontrol = \"127.0.0.1:7000\"\njoin = \"127.0.0.1:7001\"\n\
         [[tcpe.server]]\nbackend = \"127.0.0.1:8081\"\ncontrol = \"here\"\njoin = \"127.0.0.1:7001\"\n",
        open_key.display()
    );
    let e = format!("{:#}", inband_proxy::config::parse(&toml).unwrap_err());
    for want in [
        "tcpe.key: auth key",
        "readable by group or others",
        "tcpe.deadline_ms = 0 must be 1 to 60000",
        "tcpe.io_timeout_ms must be above 0",
        "tcpe.cgroup \"relative/dir\" must be an absolute path",
        "tcpe.server backend \"127.0.0.1:9999\" is in no pool",
        "tcpe.server control \"here\" is not IP:port",
    ] {
        assert!(e.contains(want), "{want:?} not in:\n{e}");
    }
    // Switched off, the section is not checked beyond its syntax.
    let off = toml.replace("[tcpe]\n", "[tcpe]\nenabled = false\n");
    assert!(inband_proxy::config::parse(&off).unwrap().tcpe.is_none());
    // An unknown key in it is an error naming its line.
    let e = format!("{:#}", inband_proxy::config::parse(&toml.replace("deadline_ms = 0", "deadline = 5")).unwrap_err());
    assert!(e.contains("unknown field `deadline`"), "{e}");
}

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

use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use inband_core::wire::Key;
use inband_proxy::Proxy;
use inband_tcpe::client::{self, Client};
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
        idle: WAIT,
    };
    let (moves, refuses) = (server(moved_origin.addr), server(dead.addr));
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("tcpe.key");
    std::fs::write(&key, KEY.0.iter().map(|b| format!("{b:02x}")).collect::<String>()).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let moves_t = Takeover::start(moves.clone()).unwrap();
    let refuses_t = Takeover::start(refuses.clone()).unwrap();
    let p = start_proxy(
        &[moved_origin.addr],
        &format!(
            "[cache]\nbackend = \"memory\"\n\
             [[route]]\nname = \"refusing\"\nhosts = [\"refusing.test\"]\nbackends = [\"{}\"]\n\
             [tcpe]\ncgroup = \"{}\"\nkey = \"{}\"\ndeadline_ms = 500\n\
             [[tcpe.server]]\nbackend = \"{}\"\ncontrol = \"{}\"\njoin = \"{}\"\n\
             [[tcpe.server]]\nbackend = \"{}\"\ncontrol = \"{}\"\njoin = \"{}\"\n",
            refusing_origin.addr,
            cg.dir.display(),
            key.display(),
            moved_origin.addr,
            moves.control,
            moves.join,
            refusing_origin.addr,
            refuses.control,
            refuses.join,
        ),
    )
    .await;
    let tcpe = Arc::new(Tcpe::attach(&cg.dir).unwrap());
    let big = big_body();
    let hash = xxhash_rust::xxh3::xxh3_64(&big);

    // A TCPE client: moved to the takeover server, which relays the origin.
    // A machine too busy to finish the takeover channel's exchange within
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
    let m = metrics(&p).await;
    assert_eq!(handoffs(&m, "handed_off"), 1.0, "{m}");
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
    // connection and the body comes from the route's backend.
    let (status, body, c) = fetch(tcpe_client(&tcpe, &p), "refusing.test", "/big").await;
    assert_eq!((status, xxhash_rust::xxh3::xxh3_64(&body), c.counters().get("moved")), (200, hash, 0));
    let m = metrics(&p).await;
    assert_eq!(handoffs(&m, "fallback_refused"), 1.0, "{m}");
    assert_eq!(refuses_t.counters().get("handoff_no_origin"), 1, "{:?}", refuses_t.counters().all());
    assert_eq!(refusing_origin.hits(), 1);
    assert_eq!(handoffs(&m, "handed_off"), 1.0, "{m}");
    // The replayed connection goes on with hyper: a keep-alive request.
    let (status, body, _) = fetch(c, "refusing.test", "/small").await;
    assert_eq!((status, body.as_slice()), (200, &b"a cached object"[..]));
    assert_eq!(refusing_origin.hits(), 2);

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

    p.shutdown().await;
    drop((moves_t, refuses_t, tcpe));
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

//! `inband mesh` end to end: a network namespace with HTTP backends (threads
//! of this test entered into it), a cgroup whose processes (curl, python)
//! call a service address, and the daemon. Requests are counted at the
//! backends and in the programs' maps: per-request balancing, routes and
//! canary weights, least-request, every fallback completing, bad input,
//! backends that die or hang, clients that leave mid-request, and no slot
//! or socket left behind after churn.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use inband_core::bpfmap::PinDir;
use inband_mesh::status::{self, Status};

const VIP: &str = "10.96.0.10:80";

fn enter_netns(netns: &str) {
    let f = std::fs::File::open(format!("/run/netns/{netns}")).expect("netns");
    // SAFETY: setns on this thread only, with a namespace fd we hold.
    assert_eq!(
        unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) },
        0,
        "setns"
    );
}

/// An HTTP/1.1 keep-alive backend in the namespace. One named `slow` takes
/// 100 ms for every request; one named `sick` fails `/healthz` (503). Paths: `/eof` answers with a body that ends
/// with the connection, `/chunked` answers chunked, `/die` sends part of a
/// response and closes, `/hang` never answers, `/close` answers with
/// Connection: close; anything else gets "NAME METHOD PATH BODYLEN".
struct Backend {
    addr: SocketAddrV4,
    hits: Arc<AtomicUsize>,
    conns: Arc<AtomicUsize>,
    /// First bytes of requests it could not parse (an HTTP/2 preface).
    unparsed: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn backend(netns: &str, name: &'static str, port: u16) -> Backend {
    let hits = Arc::new(AtomicUsize::new(0));
    let conns = Arc::new(AtomicUsize::new(0));
    let unparsed = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (h, c, u, s) = (hits.clone(), conns.clone(), unparsed.clone(), stop.clone());
    let netns = netns.to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        enter_netns(&netns);
        let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
        if name == "narrow" {
            // A small receive window (its connections inherit it): what the
            // pool socket sends it piles up in the pool socket's buffer.
            let v: libc::c_int = 32 * 1024;
            // SAFETY: setsockopt(2) with a pointer to a c_int and its size.
            let rc = unsafe {
                libc::setsockopt(l.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, (&v as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t)
            };
            assert_eq!(rc, 0);
        }
        l.set_nonblocking(true).unwrap();
        tx.send(()).unwrap();
        while !s.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((conn, _)) => {
                    c.fetch_add(1, Ordering::SeqCst);
                    let (h, u, s) = (h.clone(), u.clone(), s.clone());
                    thread::spawn(move || serve(conn, name, h, u, s));
                }
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("backend listening");
    Backend {
        addr: SocketAddrV4::new([127, 0, 0, 1].into(), port),
        hits,
        conns,
        unparsed,
        stop,
    }
}

fn serve(
    mut conn: TcpStream,
    name: &str,
    hits: Arc<AtomicUsize>,
    unparsed: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
) {
    conn.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        // One request head.
        let (head_len, method, path, length, chunked) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let get = |k: &str| {
                        req.headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case(k))
                            .map(|h| String::from_utf8_lossy(h.value).to_string())
                    };
                    let length = get("content-length")
                        .and_then(|v| v.parse::<usize>().ok())
                        .unwrap_or(0);
                    let chunked = get("transfer-encoding").is_some();
                    break (
                        n,
                        req.method.unwrap().to_string(),
                        req.path.unwrap().to_string(),
                        length,
                        chunked,
                    );
                }
                Ok(httparse::Status::Partial) => {}
                Err(_) => {
                    unparsed.lock().unwrap().push(buf.clone());
                    let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    return;
                }
            }
            match conn.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(_) if !stop.load(Ordering::SeqCst) => {}
                Err(_) => return,
            }
        };
        buf.drain(..head_len);
        if path == "/early" {
            // Answers at once, then reads the body it did not wait for
            // (as a server refusing an upload, or nginx's `return`, does).
            let msg = format!("HTTP/1.1 200 OK\r\nx-backend: {name}\r\ncontent-length: 6\r\n\r\nearly\n");
            if conn.write_all(msg.as_bytes()).is_err() {
                return;
            }
            hits.fetch_add(1, Ordering::SeqCst);
            if !fill_to(&mut conn, &mut buf, length, &stop, false) {
                return;
            }
            buf.drain(..length);
            continue;
        }
        // Its body.
        let body_len = if chunked {
            let mut total = 0;
            loop {
                if let Ok(httparse::Status::Complete((n, size))) = httparse::parse_chunk_size(&buf)
                {
                    if buf.len() >= n + size as usize + 2 {
                        total += size as usize;
                        buf.drain(..n + size as usize + 2);
                        if size == 0 {
                            break total;
                        }
                        continue;
                    }
                }
                match conn.read(&mut chunk) {
                    Ok(0) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    Err(_) if stop.load(Ordering::SeqCst) => return,
                    Err(_) => {}
                }
            }
        } else {
            // "/slow-body": a backend slower than its client, so the pool
            // socket's send buffer fills.
            if !fill_to(&mut conn, &mut buf, length, &stop, path == "/slow-body") {
                return;
            }
            buf.drain(..length);
            length
        };
        hits.fetch_add(1, Ordering::SeqCst);
        let reply = |conn: &mut TcpStream, extra: &str, body: &str| {
            let b = if method == "HEAD" { "" } else { body };
            let msg = format!(
                "HTTP/1.1 200 OK\r\nx-backend: {name}\r\ncontent-length: {}\r\n{extra}\r\n{b}",
                body.len()
            );
            conn.write_all(msg.as_bytes())
        };
        let body = format!("{name} {method} {path} {body_len}\n");
        if name == "slow" {
            thread::sleep(Duration::from_millis(100));
        }
        let ok = if path == "/chunked" {
            let msg = format!(
                "HTTP/1.1 200 OK\r\nx-backend: {name}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                body.len()
            );
            conn.write_all(msg.as_bytes())
        } else if path == "/die" {
            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n");
            let _ = conn.write_all(&[b'x'; 1000]);
            let _ = conn.shutdown(std::net::Shutdown::Both);
            return;
        } else if path == "/hang" {
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(20));
            }
            return;
        } else if name == "sick" && path == "/healthz" {
            let _ =
                conn.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n");
            Ok(())
        } else if path == "/extra" {
            // More than the response: a backend out of step, or forging.
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\nforged",
            );
            Ok(())
        } else if path == "/later" {
            // Bytes nobody asked for, on the idle connection.
            let _ = reply(&mut conn, "", &body);
            thread::sleep(Duration::from_millis(200));
            conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged")
        } else if path == "/eof" {
            // No length: the body ends with the connection.
            let _ = conn.write_all(
                format!("HTTP/1.1 200 OK\r\nx-backend: {name}\r\n\r\n{body}").as_bytes(),
            );
            return;
        } else if path == "/close" {
            let _ = reply(&mut conn, "connection: close\r\n", &body);
            return;
        } else {
            reply(&mut conn, "", &body)
        };
        if ok.is_err() {
            return;
        }
    }
}

/// Reads until `buf` holds `length` bytes; false if the connection ended,
/// or the test is stopping, first. `slow`: 2 ms before each read.
fn fill_to(conn: &mut TcpStream, buf: &mut Vec<u8>, length: usize, stop: &AtomicBool, slow: bool) -> bool {
    let mut chunk = [0u8; 16384];
    while buf.len() < length {
        if slow {
            thread::sleep(Duration::from_millis(2));
        }
        match conn.read(&mut chunk) {
            Ok(0) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) if stop.load(Ordering::SeqCst) => return false,
            Err(_) => {}
        }
    }
    true
}

/// Polls `ok` every 50 ms for up to `secs` seconds; fails with `what` and
/// `state()`.
fn wait_until(what: &str, secs: u64, ok: impl Fn() -> bool, state: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "not {what}: {}", state());
        thread::sleep(Duration::from_millis(50));
    }
}

/// One namespace, one cgroup, backends, a daemon; all removed on drop.
struct Mesh {
    netns: String,
    cgroup: PathBuf,
    dir: tempfile::TempDir,
    daemon: Option<Child>,
    backends: Vec<Backend>,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            // SAFETY: kill(2) on our child.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
            let _ = d.wait();
        }
        self.backends.clear();
        let _ = inband_testkit::testbed::netns::delete(&self.netns);
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Mesh {
    /// `services`: the TOML after the top-level keys; `{B0}`, `{B1}`...
    /// stand for the backends' addresses.
    fn start(tag: &str, names: &[&'static str], pool: u32, services: &str) -> Mesh {
        inband_core::bpfmap::require_bpffs().expect("bpffs");
        let netns = format!("imesh-{tag}");
        let _ = inband_testkit::testbed::netns::delete(&netns);
        inband_core::command::ip(&["netns", "add", &netns]).unwrap();
        inband_core::command::ip(&["-n", &netns, "link", "set", "lo", "up"]).unwrap();
        let cgroup = PathBuf::from(format!("/sys/fs/cgroup/unified/inband-test-mesh-{tag}"));
        std::fs::create_dir_all(&cgroup).expect("cgroup v2 at /sys/fs/cgroup/unified");
        let mut mesh = Mesh {
            netns: netns.clone(),
            cgroup,
            dir: tempfile::tempdir().unwrap(),
            daemon: None,
            backends: Vec::new(),
        };
        let mut text = services.to_string();
        for (i, n) in names.iter().enumerate() {
            let b = backend(&netns, n, 9001 + i as u16);
            text = text.replace(&format!("{{B{i}}}"), &b.addr.to_string());
            mesh.backends.push(b);
        }
        let config = format!(
            "cgroup = \"{}\"\npool = {pool}\nmetrics = \"127.0.0.1:9105\"\n{text}",
            mesh.cgroup.display()
        );
        let path = mesh.dir.path().join("mesh.toml");
        std::fs::write(&path, config).unwrap();
        let log = std::fs::File::create(mesh.dir.path().join("daemon.log")).unwrap();
        let daemon = inband_testkit::testbed::netns::in_netns(
            &netns,
            &[
                env!("CARGO_BIN_EXE_inband"),
                "mesh",
                "run",
                "--config",
                path.to_str().unwrap(),
            ],
        )
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
        mesh.daemon = Some(daemon);
        wait_until(
            "daemon ready",
            10,
            || {
                mesh.status().is_ok_and(|st| {
                    st.backends.len() == names.len() && st.backends.iter().all(|b| b.free == pool)
                })
            },
            || mesh.log(),
        );
        mesh
    }

    fn pins(&self) -> PinDir {
        PinDir(
            inband_core::bpfmap::pin_root_of(&self.netns)
                .join("mesh")
                .join("default"),
        )
    }

    fn status(&self) -> anyhow::Result<Status> {
        status::read(&self.pins())
    }

    fn counter(&self, name: &str) -> u64 {
        self.status()
            .unwrap()
            .counters
            .iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Connections waiting in the anchor's accept queue (the listener's
    /// Recv-Q), by `ss` in the namespace; the anchor is the default
    /// 127.0.0.1:15001.
    fn accept_queue(&self) -> usize {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.netns, "ss", "-Hltn", "sport = :15001"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let queue = text.split_whitespace().nth(1).and_then(|q| q.parse().ok());
        queue.unwrap_or_else(|| panic!("no anchor listener in {}: {text}", self.netns))
    }

    /// Runs argv in the cgroup and the namespace, bounded to 30 s.
    fn client(&self, argv: &[&str]) -> Output {
        let script = format!(
            "echo $$ > {}/cgroup.procs && exec nsenter --net=/run/netns/{} timeout 30 \"$@\"",
            self.cgroup.display(),
            self.netns
        );
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("sh")
            .args(argv)
            .output()
            .unwrap()
    }

    fn python(&self, code: &str) -> String {
        let out = self.client(&["python3", "-c", code]);
        assert!(
            out.status.success(),
            "python failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits up to 5 s for the daemon's status to satisfy `ok`.
    fn wait_for(&self, what: &str, ok: impl Fn(&Status) -> bool) {
        wait_until(
            what,
            5,
            || self.status().is_ok_and(|st| ok(&st)),
            || format!("{:?}\n{}", self.status(), self.log()),
        );
    }

    /// curl in the cgroup; its output must contain `want`.
    fn curl_expect(&self, args: &[&str], want: &str) {
        let mut argv = vec!["curl", "-sS"];
        argv.extend_from_slice(args);
        let out = self.client(&argv);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(want),
            "curl {args:?}: {out:?}\n{}",
            self.log()
        );
    }

    fn hits(&self) -> Vec<usize> {
        self.backends
            .iter()
            .map(|b| b.hits.load(Ordering::SeqCst))
            .collect()
    }
}

fn curl_urls(paths: &[&str]) -> Vec<String> {
    paths.iter().map(|p| format!("http://{VIP}{p}")).collect()
}

/// Counts, per backend name, the lines of output that start with it.
fn by_backend(out: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for line in out.lines() {
        if let Some(name) = line.split_whitespace().next() {
            *m.entry(name.to_string()).or_insert(0) += 1;
        }
    }
    m
}

const ONE: &str = "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\nbackends = [\"{B0}\"]\n";

const TWO: &str =
    "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\nbackends = [\"{B0}\", \"{B1}\"]\n";

#[test]
fn requests_on_one_connection_are_balanced_per_request() {
    let m = Mesh::start("rr", &["alpha", "beta"], 4, TWO);
    let paths: Vec<String> = (0..20).map(|i| format!("/r{i}")).collect();
    let urls = curl_urls(&paths.iter().map(String::as_str).collect::<Vec<_>>());
    let mut argv = vec![
        "curl",
        "-sS",
        "--fail",
        "-w",
        "%{remote_ip}:%{remote_port} %{num_connects}\\n",
    ];
    argv.extend(urls.iter().map(String::as_str));
    let out = m.client(&argv);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // Every response, in order, from alternating backends on one connection.
    let bodies: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("alpha") || l.starts_with("beta"))
        .collect();
    assert_eq!(bodies.len(), 20, "{text}");
    for (i, line) in bodies.iter().enumerate() {
        assert!(line.ends_with(&format!("GET /r{i} 0")), "{line}");
    }
    assert_eq!(
        by_backend(&bodies.join("\n")),
        HashMap::from([("alpha".into(), 10), ("beta".into(), 10)])
    );
    // The application sees the service's address as its peer, one connect in all.
    let connects: usize = text
        .lines()
        .filter_map(|l| l.strip_prefix("10.96.0.10:80 "))
        .map(|n| n.parse::<usize>().unwrap())
        .sum();
    assert_eq!(connects, 1, "{text}");
    assert_eq!(m.hits(), vec![10, 10]);
    assert_eq!(m.counter("connect_redirected"), 1);
    assert_eq!(m.counter("request_kernel"), 20);
    assert_eq!(m.counter("response_kernel"), 20);
    let st = m.status().unwrap();
    assert!(
        st.backends
            .iter()
            .all(|b| b.in_flight == 0 && b.requests == 10 && b.free == 4),
        "{st:?}"
    );
    // The pools' sockets carried them: no backend saw a connection beyond its pool.
    assert!(m
        .backends
        .iter()
        .all(|b| b.conns.load(Ordering::SeqCst) == 4));
}

/// Responses are redirected into the client socket's psock queue, where
/// receive autotuning does not grow its buffer: the mesh raises it when the
/// socket enters (never lowers it), or a large response waits a jiffy each
/// time it finds the buffer full. A client that asked for a small buffer
/// before connecting gets the mesh's; one that forced a larger one (33 is
/// SO_RCVBUFFORCE, past rmem_max: the test runs as root) keeps it.
#[test]
fn a_client_socket_gets_the_receive_buffer_large_responses_need() {
    let m = Mesh::start("rb", &["alpha"], 2, ONE);
    let script = "import socket, sys\n\
        cap = int(open('/proc/sys/net/core/rmem_max').read())\n\
        for opt, asked in ((0, 0), (socket.SO_RCVBUF, 65536), (33, 4 * cap)):\n\
        \x20   s = socket.socket()\n\
        \x20   if asked: s.setsockopt(socket.SOL_SOCKET, opt, asked)\n\
        \x20   before = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)\n\
        \x20   s.connect(('10.96.0.10', 80))\n\
        \x20   print(cap, before, s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))\n\
        \x20   s.close()\n";
    let out = m.client(&["python3", "-c", script]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Vec<u64>> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().map(|n| n.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    // The kernel doubles what SO_RCVBUF asks for, and caps the ask at rmem_max.
    let mesh = 2 * (4u64 << 20).min(rows[0][0]);
    assert_eq!(rows[0][2], mesh, "the default buffer raised: {rows:?}");
    assert_eq!(rows[1][2], mesh, "a small buffer asked for raised: {rows:?}");
    assert!(rows[1][1] < mesh && rows[2][1] > mesh, "the asks took effect before the connect: {rows:?}");
    assert_eq!(rows[2][2], rows[2][1], "a larger buffer kept: {rows:?}");
    assert_eq!(m.counter("connect_redirected"), 3);
}

#[test]
fn routes_match_path_and_header_and_split_by_weight() {
    let services = "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\n\
        [service.clusters]\nstable = [\"{B0}\"]\ncanary = [\"{B1}\"]\napi = [\"{B2}\"]\n\
        [[service.route]]\npath_prefix = \"/api/\"\nclusters = { api = 1 }\n\
        [[service.route]]\npath_prefix = \"/\"\nheader = { name = \"X-Canary\", value = \"yes\" }\nclusters = { canary = 1 }\n\
        [[service.route]]\npath_prefix = \"/\"\nclusters = { stable = 80, canary = 20 }\n";
    let m = Mesh::start("routes", &["stable", "canary", "api"], 4, services);
    let code = format!(
        "import http.client\n\
         c = http.client.HTTPConnection('{}', 80)\n\
         def get(p, h={{}}):\n  c.request('GET', p, headers=h); r = c.getresponse(); return r.read().decode().split()[0]\n\
         print('api', {{get('/api/x%d' % i) for i in range(20)}})\n\
         print('hdr', {{get('/x', {{'x-canary': 'yes'}}) for i in range(20)}})\n\
         print('wrongvalue', {{get('/x', {{'X-CANARY': 'YES'}}) for i in range(5)}} <= {{'stable', 'canary'}})\n\
         names = [get('/page%d' % i) for i in range(400)]\n\
         print('split', names.count('stable'), names.count('canary'), names.count('api'))\n",
        VIP.split(':').next().unwrap()
    );
    let out = m.python(&code);
    assert!(out.contains("api {'api'}"), "{out}");
    assert!(out.contains("hdr {'canary'}"), "{out}");
    assert!(out.contains("wrongvalue True"), "{out}");
    let split: Vec<usize> = out
        .lines()
        .find(|l| l.starts_with("split"))
        .unwrap()
        .split_whitespace()
        .skip(1)
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(split[2], 0, "{out}");
    // 20% canary over 400: 80 expected; 50..110 is beyond 3.5 sigma.
    assert!((50..=110).contains(&split[1]), "canary share {split:?}");
    assert_eq!(m.counter("request_kernel"), 445);
    // The routes as the maps hold them, in `inband mesh status`.
    let out = inband_testkit::testbed::netns::in_netns(
        &m.netns,
        &[env!("CARGO_BIN_EXE_inband"), "mesh", "status"],
    )
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let (b0, b1, b2) = (m.backends[0].addr, m.backends[1].addr, m.backends[2].addr);
    assert!(
        text.contains(&format!(
            "    /api/ -> 1 × {b2} (round-robin, timeout 15000 ms)"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("    / [X-Canary: yes] -> 1 × {b1}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("    / -> 20 × {b1}, 80 × {b0}")),
        "{text}"
    );
    assert_eq!(m.counter("fallback_no_route"), 0);
}

#[test]
fn least_request_sends_less_to_a_slow_backend() {
    let services =
        "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\npolicy = \"least-request\"\n\
        backends = [\"{B0}\", \"{B1}\"]\n";
    let m = Mesh::start("least", &["fast", "slow"], 8, services);
    // 4 clients for 2 s: round-robin would give each backend half.
    let code = format!(
        "import http.client, threading, time\n\
         out = []\n\
         def run():\n  c = http.client.HTTPConnection('{}', 80)\n  end = time.time() + 2\n  while time.time() < end:\n    \
         c.request('GET', '/x'); r = c.getresponse(); out.append(r.getheader('x-backend')); r.read()\n\
         ts = [threading.Thread(target=run) for _ in range(4)]\n\
         [t.start() for t in ts]; [t.join() for t in ts]\n\
         print(out.count('fast'), out.count('slow'))\n",
        VIP.split(':').next().unwrap()
    );
    let out = m.python(&code);
    let n: Vec<usize> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert!(n[0] > 100, "{out}");
    // At most one client waits on the slow one at a time: ~20 of ~2000.
    assert!(n[1] * 20 < n[0], "slow got {} of {}", n[1], n[0] + n[1]);
    assert_eq!(m.counter("request_kernel") as usize, n[0] + n[1]);
}

#[test]
fn every_fallback_completes_correctly() {
    let m = Mesh::start("fallback", &["alpha", "beta"], 4, TWO);
    let host = VIP.split(':').next().unwrap();
    // Pipelining: two requests in one send, answered in order.
    let out = m.python(&format!(
        "import socket\n\
         s = socket.create_connection(('{host}', 80))\n\
         s.sendall(b'GET /p1 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\nGET /p2 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n\
         data = b''\n\
         while data.count(b'GET /p') < 2:\n  d = s.recv(65536)\n  assert d, data\n  data += d\n\
         print(data.decode())\n"
    ));
    let p1 = out.find("GET /p1").expect(&out);
    let p2 = out.find("GET /p2").expect(&out);
    assert!(p1 < p2, "{out}");
    assert_eq!(m.counter("fallback_pipelined"), 1);
    // A chunked request body: handed over, the backend gets every byte.
    m.curl_expect(
        &[
            "-H",
            "Transfer-Encoding: chunked",
            "--data-binary",
            "0123456789",
            &format!("http://{VIP}/up"),
        ],
        "POST /up 10",
    );
    assert_eq!(m.counter("fallback_chunked"), 1);
    // Upgrade and Expect: handed over, answered.
    m.curl_expect(
        &[
            "-H",
            "Upgrade: websocket",
            "-H",
            "Connection: Upgrade",
            &format!("http://{VIP}/ws"),
        ],
        "GET /ws 0",
    );
    m.curl_expect(
        &[
            "-H",
            "Expect: 100-continue",
            "--data-binary",
            "abc",
            &format!("http://{VIP}/e"),
        ],
        "POST /e 3",
    );
    // An HTTP/2 preface reaches a backend byte for byte.
    let _ = m.client(&[
        "curl",
        "-sS",
        "--http2-prior-knowledge",
        "-m",
        "3",
        &format!("http://{VIP}/h2"),
    ]);
    let prefaces: usize = m
        .backends
        .iter()
        .map(|b| {
            b.unparsed
                .lock()
                .unwrap()
                .iter()
                .filter(|u| u.starts_with(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
                .count()
        })
        .sum();
    assert_eq!(prefaces, 1);
    assert_eq!(m.counter("fallback_upgrade"), 3);
    // A chunked response: relayed by the daemon, then the kernel path again.
    let out = m.client(&[
        "curl",
        "-sS",
        &format!("http://{VIP}/chunked"),
        &format!("http://{VIP}/after"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("GET /chunked 0") && text.contains("GET /after 0"),
        "{text}"
    );
    assert_eq!(m.counter("response_user"), 1);
    // Connection: close from the backend: delivered by the kernel path, the
    // socket retired and replaced. A body that ends with the connection:
    // relayed, and the client's connection closed to end it.
    m.curl_expect(&[&format!("http://{VIP}/close")], "GET /close 0");
    m.curl_expect(&[&format!("http://{VIP}/eof")], "GET /eof 0");
    assert_eq!(m.counter("response_user"), 2);
    m.wait_for("pool refilled", |st| {
        st.backends.iter().all(|b| b.free == 4)
    });
    // HEAD: a response with Content-Length and no body.
    let out = m.client(&[
        "curl",
        "-sS",
        "-I",
        &format!("http://{VIP}/h"),
        &format!("http://{VIP}/h2nd"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
    let st = m.status().unwrap();
    assert!(
        st.backends
            .iter()
            .all(|b| b.in_flight == 0 && b.kernel == 0 && b.user == 0),
        "{st:?}"
    );
}

#[test]
fn bad_input_gets_an_answer_and_a_counter() {
    let m = Mesh::start("bad", &["alpha", "beta"], 4, TWO);
    let host = VIP.split(':').next().unwrap();
    let send = |raw: &str| {
        m.python(&format!(
            "import socket\n\
             s = socket.create_connection(('{host}', 80)); s.settimeout(5)\n\
             s.sendall({raw})\n\
             data = b''\n\
             while b'\\r\\n\\r\\n' not in data:\n  d = s.recv(65536)\n  if not d: break\n  data += d\n\
             print(data.split(b'\\r\\n')[0].decode())\n"
        ))
    };
    // A header line without a colon: the daemon's parser answers 400.
    assert_eq!(
        send("b'GET / HTTP/1.1\\r\\nHost x\\r\\n\\r\\n'").trim(),
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(m.counter("fallback_malformed"), 1);
    // Two different Content-Lengths (smuggling): refused.
    assert_eq!(
        send("b'POST / HTTP/1.1\\r\\nContent-Length: 1\\r\\nContent-Length: 2\\r\\n\\r\\nab'")
            .trim(),
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(m.counter("fallback_malformed"), 2);
    // A 4 KiB header: too long for the kernel parser, served by the daemon.
    assert_eq!(
        send(&format!(
            "b'GET /big HTTP/1.1\\r\\nX-Big: {}\\r\\n\\r\\n'",
            "a".repeat(4096)
        ))
        .trim(),
        "HTTP/1.1 200 OK"
    );
    assert_eq!(m.counter("fallback_head_too_big"), 1);
    // A body of 4 GiB announced: longer than the kernel path carries, so
    // handed over; the backend then waits for it, the client sees its head sent.
    let raw = "b'POST /huge HTTP/1.1\\r\\nContent-Length: 4294967400\\r\\n\\r\\nabc'";
    m.python(&format!(
        "import socket\ns = socket.create_connection(('{host}', 80))\ns.sendall({raw})\ns.close()\n"
    ));
    assert_eq!(m.counter("fallback_large_body"), 1);
    // HTTP/1.0: handed over, answered.
    assert_eq!(
        send("b'GET /old HTTP/1.0\\r\\n\\r\\n'").trim(),
        "HTTP/1.1 200 OK"
    );
    // A path no route takes: 404 from the daemon.
    let only_api =
        "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\nbackends = [\"{B0}\"]\n\
        [[service.route]]\npath_prefix = \"/api\"\n";
    drop(m);
    let m = Mesh::start("bad2", &["alpha"], 2, only_api);
    let out = m.client(&[
        "curl",
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &format!("http://{VIP}/other"),
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "404");
    assert_eq!(m.counter("fallback_no_route"), 1);
    assert_eq!(m.hits(), vec![0]);
}

#[test]
fn a_backend_that_dies_or_hangs_gives_the_client_an_error_not_a_hang() {
    let services =
        "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\nbackends = [\"{B0}\"]\n\
        [[service.route]]\npath_prefix = \"/\"\ntimeout_ms = 500\n";
    let m = Mesh::start("die", &["alpha"], 2, services);
    // Dies mid-response: curl sees a short body (exit 18), quickly.
    let t = Instant::now();
    let out = m.client(&[
        "curl",
        "-sS",
        "-o",
        "/dev/null",
        &format!("http://{VIP}/die"),
    ]);
    assert!(!out.status.success(), "{out:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // Never answers: 504 at the route's timeout.
    let t = Instant::now();
    let out = m.client(&[
        "curl",
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &format!("http://{VIP}/hang"),
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "504");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // The pool heals: later requests are served by the kernel path.
    m.wait_for("pool refilled", |st| st.backends[0].free == 2);
    m.curl_expect(&[&format!("http://{VIP}/ok")], "GET /ok 0");
    assert_eq!(m.status().unwrap().backends[0].in_flight, 0);
}

#[test]
fn a_client_that_leaves_mid_request_frees_its_slot() {
    let m = Mesh::start(
        "leave",
        &["alpha"],
        2,
        ONE,
    );
    let host = VIP.split(':').next().unwrap();
    // Announces 100 bytes of body, sends 10, leaves.
    m.python(&format!(
        "import socket\n\
         s = socket.create_connection(('{host}', 80))\n\
         s.sendall(b'POST /half HTTP/1.1\\r\\nContent-Length: 100\\r\\n\\r\\n0123456789')\n\
         s.close()\n"
    ));
    m.wait_for("slot freed", |st| {
        st.counters
            .iter()
            .any(|(n, v)| n == "client_gone_in_flight" && *v == 1)
            && st.backends[0].free == 2
            && st.backends[0].in_flight == 0
    });
    // The half request never reached a handler; the next one is whole.
    m.curl_expect(&[&format!("http://{VIP}/next")], "GET /next 0");
    assert_eq!(m.hits(), vec![1]);
}

#[test]
fn an_answer_before_the_body_ends_keeps_the_next_requests_whole() {
    // One pool socket: the next request can only go where the upload's
    // body is still flowing.
    let m = Mesh::start(
        "early",
        &["alpha"],
        1,
        &format!("pool_max = 1\n{ONE}"),
    );
    let host = VIP.split(':').next().unwrap();
    // A: a 1.9 MiB upload (the kernel path's) the backend answers after its
    // head, sent in 64 KiB pieces 5 ms apart, its head first so that it has the slot. B, once
    // it has: a new connection per GET, every 10 ms, while the upload
    // lasts; every answer must be its own.
    let out = m.python(&format!(
        "import socket, threading, time\n\
         def read_response(s):\n\
         \x20   data = b''\n\
         \x20   while b'\\r\\n\\r\\n' not in data:\n\
         \x20       c = s.recv(65536)\n\
         \x20       if not c: return data\n\
         \x20       data += c\n\
         \x20   head, body = data.split(b'\\r\\n\\r\\n', 1)\n\
         \x20   n = int([l.split(b':')[1] for l in head.split(b'\\r\\n') if l.lower().startswith(b'content-length')][0])\n\
         \x20   while len(body) < n:\n\
         \x20       c = s.recv(65536)\n\
         \x20       if not c: break\n\
         \x20       body += c\n\
         \x20   return head.split(b'\\r\\n')[0] + b' ' + body\n\
         done = threading.Event()\n\
         started = threading.Event()\n\
         def upload():\n\
         \x20   s = socket.create_connection(('{host}', 80))\n\
         \x20   n = 30 * 65536\n\
         \x20   s.sendall(b'POST /early HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: %d\\r\\n\\r\\n' % n)\n\
         \x20   started.set()\n\
         \x20   for _ in range(n // 65536):\n\
         \x20       s.sendall(b'u' * 65536)\n\
         \x20       time.sleep(0.005)\n\
         \x20   s.settimeout(10)\n\
         \x20   print('upload', read_response(s).decode())\n\
         \x20   s.close()\n\
         \x20   done.set()\n\
         t = threading.Thread(target=upload)\n\
         t.start()\n\
         started.wait()\n\
         ok = bad = 0\n\
         while not done.is_set():\n\
         \x20   s = socket.create_connection(('{host}', 80))\n\
         \x20   s.settimeout(3)\n\
         \x20   s.sendall(b'GET /next HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n\
         \x20   try:\n\
         \x20       r = read_response(s)\n\
         \x20   except OSError as e:\n\
         \x20       r = repr(e).encode()\n\
         \x20   s.close()\n\
         \x20   if r == b'HTTP/1.1 200 OK alpha GET /next 0\\n': ok += 1\n\
         \x20   else:\n\
         \x20       bad += 1\n\
         \x20       print('bad', r[:200])\n\
         \x20   time.sleep(0.01)\n\
         t.join()\n\
         print('gets', ok, bad)\n"
    ));
    assert!(out.contains("upload HTTP/1.1 200 OK early"), "{out}\n{}", m.log());
    let gets: Vec<usize> = out
        .lines()
        .find_map(|l| l.strip_prefix("gets "))
        .map(|l| l.split_whitespace().map(|n| n.parse().unwrap()).collect())
        .unwrap_or_default();
    assert!(gets.len() == 2 && gets[0] > 2 && gets[1] == 0, "{out}\n{}", m.log());
    assert!(m.backends[0].unparsed.lock().unwrap().is_empty(), "the backend saw bytes out of step");
    assert_eq!(m.hits(), vec![1 + gets[0]]);
    // The upload's client closed after its answer: whether all of its body
    // went is not known to the programs, so its slot was retired, and the
    // pool refilled.
    m.wait_for("the upload's slot retired and replaced", |st| {
        st.counters.iter().any(|(n, v)| n == "client_gone_body" && *v == 1) && st.backends[0].free == 1
    });
    m.curl_expect(&[&format!("http://{VIP}/after")], "alpha GET /after 0");
}

#[test]
fn large_bodies_from_a_nonblocking_client_arrive_whole() {
    let m = Mesh::start(
        "upload",
        &["narrow"],
        2,
        ONE,
    );
    let host = VIP.split(':').next().unwrap();
    // A client that writes without blocking, all it has left each time (as
    // wrk does), to a backend with a small window that reads slowly, so
    // that the body piles up in the pool socket's send buffer: a body up to
    // INBAND_MESH_KERNEL_REQUEST_MAX (mesh/consts.h) goes by the kernel
    // path whole, a longer one to the daemon. (Before the pool sockets got
    // their large send buffer, bench.mesh's sweep lost such bodies from
    // 128 KiB up: wrk's POSTs to nginx came back 4xx and the mesh counted
    // them pipelined; `bench/tests/test_mesh.py` runs that sweep.)
    for (size, kernel) in [(1_500_000usize, true), (3_000_000, false)] {
        let before = (m.counter("request_kernel"), m.counter("fallback_large_body"));
        let out = m.python(&format!(
            "import select, socket\n\
             s = socket.create_connection(('{host}', 80))\n\
             s.setblocking(False)\n\
             data = b'POST /slow-body HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: {size}\\r\\n\\r\\n' + b'b' * {size}\n\
             sent = 0\n\
             while sent < len(data):\n\
             \x20   select.select([], [s], [], 5)\n\
             \x20   try:\n\
             \x20       sent += s.send(data[sent:])\n\
             \x20   except BlockingIOError:\n\
             \x20       pass\n\
             s.setblocking(True)\n\
             s.settimeout(10)\n\
             got = b''\n\
             while not got.endswith(b'\\n') or b'\\r\\n\\r\\n' not in got:\n\
             \x20   c = s.recv(65536)\n\
             \x20   if not c: break\n\
             \x20   got += c\n\
             print(got.split(b'\\r\\n\\r\\n', 1)[-1].decode())\n"
        ));
        assert_eq!(out.trim(), format!("narrow POST /slow-body {size}"), "{}", m.log());
        let after = (m.counter("request_kernel"), m.counter("fallback_large_body"));
        assert_eq!(after, if kernel { (before.0 + 1, before.1) } else { (before.0, before.1 + 1) }, "{size} bytes");
    }
    assert_eq!(m.counter("fallback_pipelined"), 0);
    assert!(m.backends[0].unparsed.lock().unwrap().is_empty());
    assert_eq!(m.hits(), vec![2]);
}

#[test]
fn churn_leaves_no_connection_slot_or_socket_behind() {
    // A pool as large as the clients' concurrency, which it may not grow
    // past: every request finds a free socket (none goes to user space),
    // and a socket the daemon holds after the churn is one it leaked, not
    // one the watchdog added when a tick saw every slot busy.
    let m = Mesh::start("churn", &["alpha", "beta"], 8, &format!("pool_max = 8\n{TWO}"));
    let daemon = m.daemon.as_ref().unwrap().id();
    let fds = || {
        std::fs::read_dir(format!("/proc/{daemon}/fd"))
            .unwrap()
            .count()
    };
    let before = fds();
    // 300 connections of 3 requests, 8 at a time, some closing abruptly.
    let out = m.python(&format!(
        "import http.client, threading, socket\n\
         ok = []\n\
         def run(k):\n  for i in range(k, 300, 8):\n    c = http.client.HTTPConnection('{}', 80)\n    \
         for j in range(3):\n      c.request('GET', '/c%d' % i); r = c.getresponse(); r.read(); ok.append(r.status)\n    \
         if i % 3 == 0: c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b'\\x01\\0\\0\\0\\0\\0\\0\\0')\n    c.close()\n\
         ts = [threading.Thread(target=run, args=(k,)) for k in range(8)]\n\
         [t.start() for t in ts]; [t.join() for t in ts]\n\
         print(len(ok), ok.count(200))\n",
        VIP.split(':').next().unwrap()
    ));
    assert_eq!(out.trim(), "900 900");
    assert_eq!(m.counter("connect_redirected"), 300);
    assert_eq!(m.counter("request_kernel"), 900);
    let conns = || inband_core::bpfmap::count(&m.pins().open("mesh_conns").unwrap());
    wait_until(
        "nothing left behind",
        5,
        || {
            m.status()
                .unwrap()
                .backends
                .iter()
                .all(|b| b.pool == 8 && b.free == 8 && b.in_flight == 0)
                && conns() == 0
                && fds() <= before + 2
        },
        || {
            format!(
                "{} conns, {} fds (from {before}), {:?}",
                conns(),
                fds(),
                m.status().unwrap()
            )
        },
    );
    // The pools' connections are the ones made at start.
    assert!(m
        .backends
        .iter()
        .all(|b| b.conns.load(Ordering::SeqCst) == 8));
    assert_eq!(m.counter("fallback_no_slot"), 0);
}

#[test]
fn status_and_metrics_show_services_backends_and_counters() {
    let m = Mesh::start("status", &["alpha", "beta"], 3, &format!("bpf_stats = true\n{TWO}"));
    let out = m.client(&[
        "curl",
        "-sS",
        &format!("http://{VIP}/a"),
        &format!("http://{VIP}/b"),
    ]);
    assert!(out.status.success());
    let out = inband_testkit::testbed::netns::in_netns(
        &m.netns,
        &[env!("CARGO_BIN_EXE_inband"), "mesh", "status", "--json"],
    )
    .output()
    .unwrap();
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["services"][0]["address"], "10.96.0.10:80");
    let route = &st["services"][0]["routes"][0];
    assert_eq!(route["path_prefix"], "/");
    assert_eq!(route["policy"], "round-robin");
    assert_eq!(
        route["clusters"][0],
        serde_json::json!([
            1,
            [
                m.backends[0].addr.to_string(),
                m.backends[1].addr.to_string()
            ]
        ])
    );
    assert_eq!(st["backends"][0]["requests"], 1);
    assert_eq!(st["backends"][1]["pool"], 3);
    // `inband status` lists the mesh beside any balancer.
    let out = Command::new(env!("CARGO_BIN_EXE_inband"))
        .args(["status", "--netns", &m.netns])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains(&format!(
            "inband mesh default (network namespace {})",
            m.netns
        )),
        "{text}"
    );
    assert!(text.contains("request_kernel           2"), "{text}");
    let metrics = m.client(&["curl", "-sS", "http://127.0.0.1:9105/metrics"]);
    let text = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        text.contains("inband_mesh_request_kernel_total 2"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "inband_mesh_pool_slots{{backend=\"{}\",state=\"free\"}} 3",
            m.backends[0].addr
        )),
        "{text}"
    );
    // OpenMetrics: a HELP and a TYPE for every family, `# EOF` at the end.
    assert!(
        text.contains("# TYPE inband_mesh_request_kernel counter\n")
            && text.contains("# TYPE inband_mesh_pool_slots gauge\n"),
        "{text}"
    );
    inband_http::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    // bpf_stats: the kernel counted the programs that carried the requests.
    let runs = |program: &str| -> u64 {
        let prefix = format!("inband_mesh_bpf_program_runs_total{{program=\"{program}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(prefix.as_str())).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no {prefix}in {text}"))
    };
    assert!(runs("connect4") >= 1 && runs("request") >= 2 && runs("sockops") >= 1, "{text}");
    let status = m.client(&["curl", "-sS", "http://127.0.0.1:9105/status"]);
    let st: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(st["backends"][0]["requests"], 1, "{st}");
    assert_eq!((st["bpf_stats"].as_bool(), st["programs"].as_array().map(Vec::len)), (Some(true), Some(5)), "{st}");
}

#[test]
fn a_bad_config_is_refused_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "cgroup = \"/nonexistent/cg\"\n[[service]]\nname = \"w\"\naddress = \"10.96.0.10:80\"\nbackends = [\"127.0.0.1:1\"]\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_inband"))
        .args(["mesh", "run", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("opening the cgroup /nonexistent/cg"), "{err}");
    std::fs::write(&path, "cgroup = \"/sys/fs/cgroup/unified\"\npool = 9999\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_inband"))
        .args(["mesh", "run", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pool = 9999: must be 1..=256"),
        "{out:?}"
    );
}

#[test]
fn sighup_reloads_weights_and_refuses_a_new_backend_set() {
    let services = "[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\n\
        [service.clusters]\nblue = [\"{B0}\"]\ngreen = [\"{B1}\"]\n\
        [[service.route]]\nclusters = { blue = 1 }\n";
    let m = Mesh::start("reload", &["blue", "green"], 2, services);
    let run = |n: usize| {
        let code = format!(
            "import http.client\nc = http.client.HTTPConnection('{}', 80)\nfor i in range({n}):\n  \
             c.request('GET', '/'); r = c.getresponse(); print(r.getheader('x-backend')); r.read()\n",
            VIP.split(':').next().unwrap()
        );
        by_backend(&m.python(&code))
    };
    assert_eq!(run(20), HashMap::from([("blue".into(), 20)]));
    // All to green, through SIGHUP.
    let path = m.dir.path().join("mesh.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("clusters = { blue = 1 }", "clusters = { green = 1 }"),
    )
    .unwrap();
    let pid = m.daemon.as_ref().unwrap().id() as i32;
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_until(
        "config reloaded",
        5,
        || m.log().contains("config reloaded"),
        || m.log(),
    );
    assert_eq!(run(20), HashMap::from([("green".into(), 20)]));
    // A backend the pools do not have: refused, the running config stays.
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace(&m.backends[1].addr.to_string(), "127.0.0.1:9999"),
    )
    .unwrap();
    unsafe { libc::kill(pid, libc::SIGHUP) };
    wait_until(
        "reload refused",
        5,
        || m.log().contains("config not reloaded"),
        || m.log(),
    );
    assert_eq!(run(10), HashMap::from([("green".into(), 10)]));
}

#[test]
fn a_busy_pool_grows_up_to_pool_max() {
    let services = "pool_max = 4\n[[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\nbackends = [\"{B0}\"]\n";
    let m = Mesh::start("grow", &["slow"], 1, services);
    // 4 clients at once on a backend that takes 100 ms: one socket is not
    // enough. The pool grows by the requests that found no free socket in
    // a tick (50 ms); a connection that found none stays on the daemon's
    // path, so how far one burst grows the pool depends on how close
    // together its connections start. Bursts of new connections go on
    // until the pool reaches pool_max, and it never goes past it.
    let burst = |rounds: u32| {
        m.python(&format!(
            "import http.client, threading\n\
             ok = []\n\
             def run():\n  c = http.client.HTTPConnection('{}', 80)\n  for i in range({rounds}):\n    \
             c.request('GET', '/g'); r = c.getresponse(); r.read(); ok.append(r.status)\n\
             ts = [threading.Thread(target=run) for _ in range(4)]\n\
             [t.start() for t in ts]; [t.join() for t in ts]\n\
             print(len(ok), ok.count(200))\n",
            VIP.split(':').next().unwrap()
        ))
    };
    for _ in 0..5 {
        assert_eq!(burst(6).trim(), "24 24");
        if m.status().is_ok_and(|st| st.backends[0].pool == 4) {
            break;
        }
    }
    m.wait_for("pool grown to 4", |st| {
        st.backends[0].pool == 4 && st.backends[0].free == 4
    });
    assert!(m.log().contains("pool grown"), "{}", m.log());
    // Grown, it takes the next burst without handing anything to the daemon.
    let before = m.counter("fallback_no_slot");
    let kernel = m.counter("request_kernel");
    assert_eq!(burst(6).trim(), "24 24");
    assert_eq!(m.counter("fallback_no_slot"), before);
    assert_eq!(m.counter("request_kernel"), kernel + 24);
}

#[test]
fn a_backend_failing_its_health_checks_gets_no_requests() {
    let services = "[health]\npath = \"/healthz\"\ninterval_ms = 100\ntimeout_ms = 100\nunhealthy_after = 2\nhealthy_after = 1\n\
        [[service]]\nname = \"web\"\naddress = \"10.96.0.10:80\"\nbackends = [\"{B0}\", \"{B1}\"]\n";
    let m = Mesh::start("health", &["alpha", "sick"], 2, services);
    m.wait_for("sick taken out", |st| {
        st.backends[0].up && !st.backends[1].up
    });
    assert!(
        m.log().contains("health checks fail (status 503)"),
        "{}",
        m.log()
    );
    let code = format!(
        "import http.client\nc = http.client.HTTPConnection('{}', 80)\nfor i in range(20):\n  \
         c.request('GET', '/h%d' % i); r = c.getresponse(); print(r.getheader('x-backend')); r.read()\n",
        VIP.split(':').next().unwrap()
    );
    assert_eq!(
        by_backend(&m.python(&code)),
        HashMap::from([("alpha".into(), 20)])
    );
}

#[test]
fn bytes_a_backend_was_not_asked_for_never_reach_a_client() {
    let m = Mesh::start("forged", &["alpha"], 1, &format!("pool_max = 1\n{ONE}"));
    // Past the response's end: cut there; the socket is retired.
    let out = m.client(&[
        "curl",
        "-sS",
        &format!("http://{VIP}/extra"),
        &format!("http://{VIP}/next"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("hello") && !text.contains("forged"),
        "{text}"
    );
    assert_eq!(m.counter("response_excess"), 1);
    // On an idle pool socket: the daemon retires it.
    m.wait_for("pool refilled", |st| st.backends[0].free == 1);
    m.curl_expect(&[&format!("http://{VIP}/later")], "GET /later 0");
    wait_until(
        "unexpected bytes seen",
        5,
        || m.counter("response_unexpected") == 1,
        || m.log(),
    );
    m.wait_for("pool refilled", |st| st.backends[0].free == 1);
    let out = m.client(&["curl", "-sS", &format!("http://{VIP}/after")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("GET /after 0") && !text.contains("forged"),
        "{text}"
    );
}

#[test]
fn a_connection_whose_table_entry_was_evicted_is_still_served() {
    let m = Mesh::start(
        "evict",
        &["alpha"],
        2,
        ONE,
    );
    let script = format!(
        "import http.client, time\nc = http.client.HTTPConnection('{}', 80)\n\
         c.request('GET', '/one'); r = c.getresponse(); print(r.read().decode().strip(), flush=True)\n\
         time.sleep(1)\nc.request('GET', '/two'); r = c.getresponse(); print(r.read().decode().strip(), flush=True)\n",
        VIP.split(':').next().unwrap()
    );
    let cmd = format!(
        "echo $$ > {}/cgroup.procs && exec nsenter --net=/run/netns/{} timeout 30 python3 -c \"$0\"",
        m.cgroup.display(),
        m.netns
    );
    let child = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .arg(script)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // As the LRU does when mesh_conns is full: the entry goes mid-connection,
    // once the daemon has accepted the connection and kept its entry. The
    // kernel carries the first request whether or not the daemon has
    // accepted yet; on a loaded machine it may not have, and a connection
    // the daemon accepts without an entry is closed.
    wait_until(
        "first request",
        5,
        || m.counter("request_kernel") == 1,
        || m.log(),
    );
    wait_until(
        "the daemon accepted the connection",
        5,
        || m.accept_queue() == 0,
        || m.log(),
    );
    let conns = m.pins().open("mesh_conns").unwrap();
    let keys: Vec<Vec<u8>> = libbpf_rs::MapCore::keys(&conns).collect();
    assert_eq!(keys.len(), 1);
    for k in keys {
        libbpf_rs::MapCore::delete(&conns, &k).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["alpha GET /one 0", "alpha GET /two 0"],
        "{}",
        m.log()
    );
    // The second went by the daemon, from the entry it kept at accept.
    assert_eq!(m.counter("request_kernel"), 1);
    assert_eq!(m.hits(), vec![2]);
}

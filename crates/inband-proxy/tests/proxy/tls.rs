//! The TLS listener with real clients (curl, openssl s_client) and
//! certificates made here by a test CA: HTTP/1.1 and h2 by ALPN, h2c,
//! SNI, TLS 1.2 and 1.3, resumption, reload, OCSP stapling, and refusals
//! at start.


use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use tokio::net::TcpStream;

use crate::common::*;
use inband_proxy::{config, Proxy};

pub(crate) struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
    dir: tempfile::TempDir,
}

impl Ca {
    pub(crate) fn new() -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, "inband test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), cert.pem()).unwrap();
        Ca { cert, key, dir }
    }

    pub(crate) fn pem(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A leaf for `names` with common name `cn`, written as `<file>.pem`
    /// and `<file>.key`; `expired` puts notAfter in the past.
    pub(crate) fn leaf(&self, file: &str, cn: &str, names: &[&str], expired: bool) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        let (c, k) = (self.dir.path().join(format!("{file}.pem")), self.dir.path().join(format!("{file}.key")));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }
}

fn tls_section(certs: &[(PathBuf, PathBuf)]) -> String {
    let mut s = "[tls]\nlisten = \"127.0.0.1:0\"\n".to_string();
    for (c, k) in certs {
        s.push_str(&format!("[[tls.certificate]]\ncert = \"{}\"\nkey = \"{}\"\n", c.display(), k.display()));
    }
    s
}

/// Runs a client to completion off the runtime (the proxy's acceptor
/// shares it), with `stdin` as its input; returns stdout and stderr.
pub(crate) async fn run(cmd: &str, args: &[&str], stdin: &[u8]) -> String {
    let (cmd, args, stdin) = (cmd.to_string(), args.iter().map(|a| a.to_string()).collect::<Vec<_>>(), stdin.to_vec());
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let mut child = Command::new(&cmd).args(&args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(&stdin).unwrap();
        child.wait_with_output().unwrap()
    });
    let out = tokio::time::timeout(Duration::from_secs(20), out).await.expect("client finished in time").unwrap();
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// curl to `https://NAME:PORT/PATH` pinned to 127.0.0.1; returns the
/// body, a newline and the HTTP version curl used (stderr is empty on
/// success with -sS).
async fn curl(ca: &Ca, p: &Proxy, name: &str, path: &str, extra: &[&str]) -> String {
    let port = p.tls_addr.unwrap().port();
    let resolve = format!("{name}:{port}:127.0.0.1");
    let url = format!("https://{name}:{port}{path}");
    let ca_file = ca.pem();
    let mut args = vec!["-sS", "--max-time", "10", "--cacert", ca_file.to_str().unwrap(), "--resolve", &resolve, "-w", "\n%{http_version}"];
    args.extend_from_slice(extra);
    args.push(&url);
    run("curl", &args, b"").await
}

async fn s_client(p: &Proxy, args: &[&str], stdin: &[u8]) -> String {
    let connect = p.tls_addr.unwrap().to_string();
    let mut all = vec!["s_client", "-connect", &connect];
    all.extend_from_slice(args);
    run("openssl", &all, stdin).await
}

/// The `subject=` line openssl prints for the server's certificate.
fn subject(out: &str) -> &str {
    out.lines().find(|l| l.starts_with("subject=")).unwrap_or_else(|| panic!("no subject in:\n{out}"))
}

#[tokio::test]
async fn curl_gets_the_cached_body_over_https_with_http1_and_h2() {
    let origin = Origin::start(|_| ok("over tls").header("cache-control", "max-age=60")).await;
    let ca = Ca::new();
    let leaf = ca.leaf("a", "a.test", &["a.test"], false);
    let p = start_proxy(&[origin.addr], &format!("[cache]\nbackend = \"memory\"\n{}", tls_section(&[leaf]))).await;
    assert_eq!(curl(&ca, &p, "a.test", "/x", &["--http1.1"]).await, "over tls\n1.1");
    assert_eq!(curl(&ca, &p, "a.test", "/x", &["--http2"]).await, "over tls\n2");
    // The second came from the cache over h2.
    assert_eq!(origin.hits(), 1);
    let seen = &origin.seen()[0];
    assert_eq!(seen.headers["x-forwarded-proto"], "https");
    assert!(seen.headers["forwarded"].to_str().unwrap().contains("proto=https"), "{:?}", seen.headers);
    p.shutdown().await;
}

#[tokio::test]
async fn plaintext_port_speaks_h2c_by_prior_knowledge() {
    let origin = Origin::start(|_| ok("cleartext h2")).await;
    let p = start_proxy(&[origin.addr], "").await;
    let url = format!("http://{}/y", p.addr);
    let out = run("curl", &["-sS", "--max-time", "10", "--http2-prior-knowledge", "-w", "\n%{http_version}", &url], b"").await;
    assert_eq!(out, "cleartext h2\n2");
    assert_eq!(origin.seen()[0].headers["x-forwarded-proto"], "http");
    p.shutdown().await;
}

#[tokio::test]
async fn sni_picks_the_certificate_and_no_sni_gets_the_first() {
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let a = ca.leaf("a", "first.test", &["a.test", "www.a.test"], false);
    let b = ca.leaf("b", "second.test", &["*.b.test"], false);
    let c = ca.leaf("c", "third.test", &["c.test"], false);
    let p = start_proxy(&[origin.addr], &tls_section(&[a, b, c])).await;
    let cases = [("a.test", "first.test"), ("www.a.test", "first.test"), ("c.test", "third.test"), ("x.b.test", "second.test"), ("unknown.test", "first.test")];
    for (sni, want) in cases {
        let out = s_client(&p, &["-servername", sni], b"").await;
        assert!(subject(&out).ends_with(&format!("CN = {want}")), "SNI {sni}: {}", subject(&out));
    }
    // A wildcard covers one label only.
    let out = s_client(&p, &["-servername", "y.x.b.test"], b"").await;
    assert!(subject(&out).ends_with("CN = first.test"), "{}", subject(&out));
    let out = s_client(&p, &["-noservername"], b"").await;
    assert!(subject(&out).ends_with("CN = first.test"), "{}", subject(&out));
    p.shutdown().await;
}

#[tokio::test]
async fn tls12_and_tls13_negotiate_h2_by_alpn_and_resume_sessions() {
    let origin = Origin::start(|_| ok("resumed")).await;
    let ca = Ca::new();
    let leaf = ca.leaf("a", "a.test", &["a.test"], false);
    let p = start_proxy(&[origin.addr], &tls_section(&[leaf])).await;
    let ca_file = ca.pem();
    let ca_file = ca_file.to_str().unwrap();
    for (flag, version) in [("-tls1_2", "TLSv1.2"), ("-tls1_3", "TLSv1.3")] {
        let out = s_client(&p, &[flag, "-servername", "a.test", "-CAfile", ca_file, "-alpn", "h2,http/1.1"], b"").await;
        assert!(out.contains(&format!("New, {version}")), "{flag}:\n{out}");
        assert!(out.contains("ALPN protocol: h2"), "{flag}:\n{out}");
        assert!(out.contains("Verify return code: 0 (ok)"), "{flag}:\n{out}");
        // A request that reads to the close, so TLS 1.3's tickets (sent
        // after the handshake) reach the client before it saves the session.
        let sess = ca.dir.path().join(format!("session{flag}"));
        let sess = sess.to_str().unwrap();
        let req = b"GET /r HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n";
        let base = [flag, "-servername", "a.test", "-CAfile", ca_file, "-alpn", "http/1.1", "-ign_eof"];
        let first = s_client(&p, &[&base[..], &["-sess_out", sess]].concat(), req).await;
        assert!(first.contains(&format!("New, {version}")) && first.contains("resumed"), "{flag} first:\n{first}");
        let second = s_client(&p, &[&base[..], &["-sess_in", sess]].concat(), req).await;
        assert!(second.contains(&format!("Reused, {version}")), "{flag} second:\n{second}");
        assert!(second.contains("resumed"), "{flag} second:\n{second}");
    }
    p.shutdown().await;
}

/// A TLS client trusting `ca`, for connections held across a reload.
async fn connect(p: &Proxy, ca: &Ca, name: &str) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca.pem()).unwrap();
    for c in CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().unwrap().with_root_certificates(roots).with_no_client_auth();
    let tcp = TcpStream::connect(p.tls_addr.unwrap()).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.unwrap()
}

fn served_cert(s: &tokio_rustls::client::TlsStream<TcpStream>) -> Vec<u8> {
    s.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn pem_der(path: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(path).unwrap().to_vec()
}

#[tokio::test]
async fn reload_swaps_certificates_and_keeps_connections_and_bad_files_keep_the_old() {
    let origin = Origin::start(|s| ok(&s.path)).await;
    let ca = Ca::new();
    let (cert, key) = ca.leaf("site", "old.test", &["a.test"], false);
    let old = pem_der(&cert);
    let p = start_proxy(&[origin.addr], &tls_section(&[(cert.clone(), key.clone())])).await;

    let held = connect(&p, &ca, "a.test").await;
    assert_eq!(served_cert(&held), old);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(held)).await.unwrap();
    tokio::spawn(conn);
    let get = |path: &str| http::Request::get(path).header("host", "a.test").body(Empty::<Bytes>::new()).unwrap();
    let body = sender.send_request(get("/before")).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "/before");

    // New files in place, then the reload.
    let (new_cert, new_key) = ca.leaf("next", "new.test", &["a.test"], false);
    std::fs::copy(&new_cert, &cert).unwrap();
    std::fs::copy(&new_key, &key).unwrap();
    p.reload_tls().unwrap();
    let fresh = connect(&p, &ca, "a.test").await;
    assert_eq!(served_cert(&fresh), pem_der(&new_cert));
    // The connection from before the reload still serves requests.
    let body = sender.send_request(get("/after")).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "/after");

    // A key that does not match: refused, named, and the last good
    // certificate stays.
    let (_, other_key) = ca.leaf("other", "other.test", &["a.test"], false);
    std::fs::copy(&other_key, &key).unwrap();
    let e = format!("{:#}", p.reload_tls().unwrap_err());
    assert!(e.contains(&key.display().to_string()) && e.contains("does not match"), "{e}");
    assert_eq!(served_cert(&connect(&p, &ca, "a.test").await), pem_der(&new_cert));
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_tls_reloads_total{result=\"ok\"}"), 1.0, "{m}");
    assert_eq!(sample(&m, "inband_proxy_tls_reloads_total{result=\"failed\"}"), 1.0, "{m}");
    // rcgen's default notAfter, 4096-01-01, from the certificate in use.
    let expiry = format!("inband_proxy_tls_certificate_expiry_timestamp_seconds{{cert=\"{}\"}}", cert.display());
    assert_eq!(sample(&m, &expiry), 67_090_118_400.0, "{m}");
    drop(sender);
    p.shutdown().await;
}

/// A TLS connection counts twice toward `pack_connections`: with 4, three
/// TLS clients go two and one where three plaintext ones would share one
/// worker (tests/proxy/workers.rs).
#[tokio::test]
async fn a_tls_connection_counts_twice_toward_packing() {
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let p = start_proxy(&[origin.addr], &format!("workers = 2\npack_connections = 4\n{}", tls_section(&[ca.leaf("site", "a.test", &["a.test"], false)]))).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(connect(&p, &ca, "a.test").await);
    }
    let m = metrics(&p).await;
    let split = (sample(&m, "inband_proxy_worker_connections{worker=\"0\"}"), sample(&m, "inband_proxy_worker_connections{worker=\"1\"}"));
    assert_eq!(split, (2.0, 1.0), "{m}");
    drop(held);
    p.shutdown().await;
}

#[tokio::test]
async fn a_client_that_is_not_tls_is_counted_and_closed() {
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let leaf = ca.leaf("a", "a.test", &["a.test"], false);
    let p = start_proxy(&[origin.addr], &tls_section(&[leaf])).await;
    let out = raw(p.tls_addr.unwrap(), b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n").await;
    // A TLS alert at most, never an HTTP answer in the clear.
    assert!(!out.contains("HTTP/1.1"), "{out}");
    wait_for_sample(&p, "inband_proxy_tls_handshake_errors_total", 1.0).await;
    assert_eq!(origin.hits(), 0);
    p.shutdown().await;
}

async fn start_error(origin: &Origin, tls: &str) -> String {
    let toml = format!("listen = \"127.0.0.1:0\"\nbackends = [\"{}\"]\n{tls}", origin.addr);
    let cfg = config::parse(&toml).unwrap_or_else(|e| panic!("{e:#}"));
    match Proxy::start(cfg).await {
        Ok(_) => panic!("started with {tls}"),
        Err(e) => format!("{e:#}"),
    }
}

#[tokio::test]
async fn bad_certificates_and_keys_are_refused_at_start_naming_the_file() {
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let (cert, key) = ca.leaf("good", "a.test", &["a.test"], false);
    let (expired, expired_key) = ca.leaf("expired", "a.test", &["a.test"], true);
    let (_, other_key) = ca.leaf("other", "b.test", &["b.test"], false);
    let missing = ca.dir.path().join("missing.pem");
    let garbage = ca.dir.path().join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n").unwrap();
    let empty = ca.dir.path().join("empty.pem");
    std::fs::write(&empty, "nothing here\n").unwrap();
    let cases = [
        (missing.clone(), key.clone(), missing.clone(), "cannot read"),
        (cert.clone(), missing.clone(), missing.clone(), "cannot read"),
        (garbage.clone(), key.clone(), garbage.clone(), "does not parse"),
        (empty.clone(), key.clone(), empty.clone(), "no CERTIFICATE"),
        (cert.clone(), empty.clone(), empty.clone(), "no PEM private key"),
        (cert.clone(), other_key.clone(), other_key.clone(), "does not match"),
        (expired.clone(), expired_key.clone(), expired.clone(), "expired on"),
    ];
    for (c, k, named, why) in cases {
        let e = start_error(&origin, &tls_section(&[(c, k)])).await;
        assert!(e.contains(&named.display().to_string()) && e.contains(why), "want {why} naming {}: {e}", named.display());
    }
    // A good certificate listed first does not hide a bad one after it.
    let e = start_error(&origin, &tls_section(&[(cert.clone(), key.clone()), (expired.clone(), expired_key)])).await;
    assert!(e.contains(&expired.display().to_string()), "{e}");
    let e = config::parse(&format!("listen = \"127.0.0.1:0\"\nbackends = [\"{}\"]\n[tls]\nlisten = \"127.0.0.1:0\"\ncertificate = []\n", origin.addr)).unwrap_err();
    assert!(format!("{e:#}").contains("at least one [[tls.certificate]]"), "{e:#}");
}

#[tokio::test]
async fn a_stalled_handshake_is_closed_by_the_header_timeout_without_a_cleartext_408() {
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let leaf = ca.leaf("a", "a.test", &["a.test"], false);
    let p = start_proxy(&[origin.addr], &format!("client_header_timeout_ms = 300\n{}", tls_section(&[leaf]))).await;
    // The header of a handshake record whose body never comes.
    let started = std::time::Instant::now();
    let out = raw(p.tls_addr.unwrap(), &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).await;
    assert!(started.elapsed() < Duration::from_secs(3), "closed after {:?}", started.elapsed());
    assert!(!out.contains("408"), "{out:?}");
    wait_for_sample(&p, "inband_proxy_connection_timeouts_total{kind=\"header\"}", 1.0).await;
    p.shutdown().await;
}

#[tokio::test]
async fn sighup_reloads_the_certificates() {
    // SIGHUP's default action ends the process: a handler is in place
    // before the signal whatever the order below.
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).unwrap();
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let (cert, key) = ca.leaf("site", "old.test", &["a.test"], false);
    let p = start_proxy(&[origin.addr], &tls_section(&[(cert.clone(), key.clone())])).await;
    let (new_cert, new_key) = ca.leaf("next", "new.test", &["a.test"], false);
    std::fs::copy(&new_cert, &cert).unwrap();
    std::fs::copy(&new_key, &key).unwrap();
    assert_ne!(served_cert(&connect(&p, &ca, "a.test").await), pem_der(&new_cert), "no reload without the signal");
    let check = async {
        // `biased` below: until_stopped has registered its handlers by now.
        // SAFETY: kill(2) on this process with a signal that has handlers.
        assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGHUP) }, 0);
        hup.recv().await;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while served_cert(&connect(&p, &ca, "a.test").await) != pem_der(&new_cert) {
            assert!(std::time::Instant::now() < deadline, "the certificate was not swapped");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        biased;
        r = p.until_stopped() => panic!("stopped: {r:?}"),
        _ = check => {}
    }
    p.shutdown().await;
}

/// Runs openssl with `args` and returns its stdout; panics on failure.
fn openssl(args: &[&str]) -> String {
    let out = std::process::Command::new("openssl").args(args).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A DER OCSP response saying `leaf` is good, signed by the CA with
/// `openssl ocsp` from an index file, written to `out`.
fn ocsp_response(ca: &Ca, leaf: &Path, out: &Path) {
    let dir = ca.dir.path();
    let (ca_pem, ca_key, index, req) = (ca.pem(), dir.join("ca.key"), dir.join("index.txt"), dir.join("req.der"));
    std::fs::write(&ca_key, ca.key.serialize_pem()).unwrap();
    let serial = openssl(&["x509", "-serial", "-noout", "-in", leaf.to_str().unwrap()]);
    let serial = serial.trim().strip_prefix("serial=").unwrap();
    std::fs::write(&index, format!("V\t300101000000Z\t\t{serial}\tunknown\t/CN=a.test\n")).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    openssl(&["ocsp", "-issuer", &s(&ca_pem), "-cert", &s(leaf), "-no_nonce", "-reqout", &s(&req)]);
    openssl(&["ocsp", "-index", &s(&index), "-rsigner", &s(&ca_pem), "-rkey", &s(&ca_key), "-CA", &s(&ca_pem), "-reqin", &s(&req), "-respout", &s(out), "-ndays", "1"]);
}

/// The signature of the (first) OCSP response in openssl's text: ECDSA
/// signatures are random, so equal ones mean the same response's bytes.
fn ocsp_signature(text: &str) -> String {
    let after = &text[text.find("Signature Value:").unwrap_or_else(|| panic!("no OCSP response in:\n{text}"))..];
    after.lines().skip(1).take_while(|l| l.trim().split(':').all(|b| b.is_empty() || (b.len() == 2 && b.bytes().all(|c| c.is_ascii_hexdigit())))).collect()
}

#[tokio::test]
async fn the_ocsp_response_file_is_stapled_and_reloaded_with_the_certificate() {
    let origin = Origin::start(|_| ok("x")).await;
    let ca = Ca::new();
    let (cert, key) = ca.leaf("a", "a.test", &["a.test"], false);
    let (plain_cert, plain_key) = ca.leaf("b", "b.test", &["b.test"], false);
    let ocsp = ca.dir.path().join("a.ocsp.der");
    ocsp_response(&ca, &cert, &ocsp);
    let first = ocsp_signature(&openssl(&["ocsp", "-respin", ocsp.to_str().unwrap(), "-resp_text", "-noverify"]));
    assert!(first.len() > 100, "{first:?}");
    let tls = format!(
        "[tls]\nlisten = \"127.0.0.1:0\"\n[[tls.certificate]]\ncert = \"{}\"\nkey = \"{}\"\nocsp = \"{}\"\n[[tls.certificate]]\ncert = \"{}\"\nkey = \"{}\"\n",
        cert.display(),
        key.display(),
        ocsp.display(),
        plain_cert.display(),
        plain_key.display()
    );
    let p = start_proxy(&[origin.addr], &tls).await;
    for version in ["-tls1_3", "-tls1_2"] {
        let out = s_client(&p, &["-servername", "a.test", "-status", version], b"").await;
        assert!(out.contains("OCSP Response Status: successful") && out.contains("Cert Status: good"), "{out}");
        assert_eq!(ocsp_signature(&out), first, "{version}");
    }
    // A certificate without a file staples nothing.
    let out = s_client(&p, &["-servername", "b.test", "-status"], b"").await;
    assert!(out.contains("OCSP response: no response sent"), "{out}");
    // A renewed response is read with the certificates.
    ocsp_response(&ca, &cert, &ocsp);
    let second = ocsp_signature(&openssl(&["ocsp", "-respin", ocsp.to_str().unwrap(), "-resp_text", "-noverify"]));
    assert_ne!(first, second);
    p.reload_tls().unwrap();
    assert_eq!(ocsp_signature(&s_client(&p, &["-servername", "a.test", "-status"], b"").await), second);
    // One that is not an OCSP response keeps the previous one, named.
    std::fs::write(&ocsp, b"not DER").unwrap();
    let e = format!("{:#}", p.reload_tls().unwrap_err());
    assert!(e.contains(&ocsp.display().to_string()) && e.contains("not a DER OCSPResponse"), "{e}");
    assert_eq!(ocsp_signature(&s_client(&p, &["-servername", "a.test", "-status"], b"").await), second);
    p.shutdown().await;
    // And refuses the start.
    let e = start_error(&origin, &tls).await;
    assert!(e.contains(&ocsp.display().to_string()) && e.contains("not a DER OCSPResponse"), "{e}");
}

//! `[cache.compression]` with real clients: curl (`--compressed`, which
//! offers and decodes gzip, br and zstd; and without it, which offers
//! nothing) against the proxy in front of an origin that sends identity
//! bodies. Bytes and headers are checked: a client that offers nothing
//! gets the origin's bytes exactly, one that offers the stored coding
//! gets fewer bytes that decode to them, and the origin is asked once.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

/// A compressible page, distinct per path, 20 KB.
fn page(path: &str) -> String {
    (0..400).map(|i| format!("<p>{path} paragraph {i} of a page that compresses</p>\n")).collect()
}

async fn origin() -> Origin {
    let revalidations = Arc::new(AtomicUsize::new(0));
    Origin::start(move |s| {
        let path = s.path.split('?').next().unwrap().to_string();
        let html = |p: &str| ok(&page(p)).header("content-type", "text/html; charset=utf-8").header("cache-control", "max-age=60");
        match path.as_str() {
            "/page" => html(&path).header("etag", "\"p1\""),
            "/weak" => html(&path).header("etag", "W/\"w1\""),
            "/png" => ok(&page(&path)).header("content-type", "image/png").header("cache-control", "max-age=60"),
            "/no-transform" => html(&path).header("cache-control", "max-age=60, no-transform"),
            "/tiny" => ok("<p>tiny</p>").header("content-type", "text/html").header("cache-control", "max-age=60"),
            // Bytes no encoder shrinks.
            "/random" => Reply { status: 200, body: noise(4096), ..Default::default() }
                .header("content-type", "application/json")
                .header("cache-control", "max-age=60"),
            "/pre-encoded" => {
                // Already gzip: stored and sent as the origin made it.
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                std::io::Write::write_all(&mut e, page(&path).as_bytes()).unwrap();
                Reply { status: 200, body: e.finish().unwrap(), ..Default::default() }
                    .header("content-type", "text/html")
                    .header("content-encoding", "gzip")
                    .header("cache-control", "max-age=60")
                    // What the proxy marks its own entries with: not an origin's to set.
                    .header("inband-identity-length", "5")
            }
            "/revalidated" => {
                let base = ok(&page(&path)).header("content-type", "text/html").header("cache-control", "max-age=1").header("etag", "\"r1\"");
                if s.headers.get("if-none-match").is_some_and(|v| v == "\"r1\"") {
                    revalidations.fetch_add(1, Ordering::SeqCst);
                    ok("").status(304).header("etag", "\"r1\"").header("cache-control", "max-age=1")
                } else {
                    base
                }
            }
            "/large" => Reply { status: 200, body: large(), ..Default::default() }.header("content-type", "text/plain").header("cache-control", "max-age=60"),
            _ => ok("not found").status(404),
        }
    })
    .await
}

/// 4 MB of hex digits from xorshift64: about half compressible, so the
/// stored entry is larger than the stores' streaming threshold too.
fn large() -> Vec<u8> {
    let mut x = 0x2545f4914f6cdd1du64;
    (0..4 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b"0123456789abcdef"[(x & 15) as usize]
        })
        .collect()
}

/// `n` bytes of xorshift64 output, whole bytes: incompressible.
fn noise(n: usize) -> Vec<u8> {
    let mut x = 0x9e3779b97f4a7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn section(encoding: &str) -> String {
    format!("[cache]\nbackend = \"memory\"\ncapacity_bytes = 16777216\n\n[cache.compression]\nencoding = \"{encoding}\"\n")
}

struct Got {
    status: u16,
    /// Lower-cased names, values as sent; the last response's only.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// curl with `args`, headers and body apart.
async fn curl(addr: SocketAddr, path: &str, args: &[&str]) -> Got {
    let url = format!("http://{addr}{path}");
    let mut argv: Vec<String> = vec!["-sS".into(), "--max-time".into(), "10".into(), "-D".into(), "-".into(), "-o".into()];
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("body");
    argv.push(out.display().to_string());
    argv.extend(args.iter().map(|a| a.to_string()));
    argv.push(url);
    let run = tokio::task::spawn_blocking(move || Command::new("curl").args(&argv).output().unwrap()).await.unwrap();
    assert!(run.status.success(), "curl: {}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    // A 304 writes no body file (and with -I the file holds the head).
    let body = std::fs::read(&out).unwrap_or_default();
    let block = text.trim_end().rsplit("\r\n\r\n").next().unwrap().to_string();
    let mut lines = block.lines();
    let status = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers = lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())).collect();
    Got { status, headers, body }
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(b), &mut out).unwrap();
    out
}

#[tokio::test]
async fn gzip_is_stored_once_and_every_client_gets_what_it_accepts() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], &section("gzip")).await;
    let origin_bytes = page("/page").into_bytes();

    // curl --compressed: gzip on the wire, the origin's bytes once decoded.
    let c = curl(p.addr, "/page", &["--compressed"]).await;
    assert_eq!((c.status, c.header("x-cache")), (200, Some("MISS")));
    assert_eq!(c.body, origin_bytes);
    assert_eq!(c.header("content-encoding"), Some("gzip"));
    assert_eq!(c.header("vary"), Some("Accept-Encoding"));
    assert_eq!(c.header("etag"), Some("\"p1-gzip\""), "the encoded representation's own tag");
    assert!(c.header("inband-identity-length").is_none());

    // No Accept-Encoding: the origin's bytes, length and tag, from the store.
    let plain = curl(p.addr, "/page", &[]).await;
    assert_eq!((plain.status, plain.header("x-cache")), (200, Some("HIT")));
    assert_eq!(plain.body, origin_bytes, "identity bytes equal the origin's");
    assert_eq!(plain.header("content-length"), Some(origin_bytes.len().to_string().as_str()));
    assert_eq!(plain.header("content-encoding"), None);
    assert_eq!(plain.header("etag"), Some("\"p1\""));
    assert_eq!(plain.header("vary"), Some("Accept-Encoding"));

    // The stored bytes as they are: smaller, and gzip of the origin's.
    let raw = curl(p.addr, "/page", &["-H", "Accept-Encoding: gzip"]).await;
    let declared: usize = raw.header("content-length").unwrap().parse().unwrap();
    assert_eq!(declared, raw.body.len());
    assert!(raw.body.len() * 5 < origin_bytes.len(), "{} of {}", raw.body.len(), origin_bytes.len());
    assert_eq!(gunzip(&raw.body), origin_bytes);
    // A client that refuses gzip by q=0 gets identity.
    let refused = curl(p.addr, "/page", &["-H", "Accept-Encoding: br, gzip;q=0"]).await;
    assert_eq!((&refused.body, refused.header("content-encoding")), (&origin_bytes, None));
    assert_eq!(o.hits(), 1, "stored once, served to all");
    // Counted: one entry stored compressed, its bytes before and after;
    // two responses sent encoded (the miss and the gzip one), two decoded.
    let m = metrics(&p).await;
    let series = |name: &str, labels: &str| sample(&m, &format!("inband_proxy_compression_{name}_total{{encoding=\"gzip\",{labels}}}"));
    assert_eq!(series("stored", "result=\"compressed\""), 1.0, "{m}");
    assert_eq!(series("stored", "result=\"not_smaller\""), 0.0);
    assert_eq!(series("bytes", "side=\"identity\""), origin_bytes.len() as f64);
    assert_eq!(series("bytes", "side=\"encoded\""), raw.body.len() as f64);
    assert_eq!((series("served", "as=\"encoded\""), series("served", "as=\"decoded\"")), (2.0, 2.0));

    // Conditionals: each representation's own tag gets its 304.
    let inm = |t: &'static str| format!("If-None-Match: {t}");
    assert_eq!(curl(p.addr, "/page", &["--compressed", "-H", &inm("\"p1-gzip\"")]).await.status, 304);
    assert_eq!(curl(p.addr, "/page", &["-H", &inm("\"p1\"")]).await.status, 304);
    let other = curl(p.addr, "/page", &["--compressed", "-H", &inm("\"p1\"")]).await;
    assert_eq!((other.status, &other.body), (200, &origin_bytes), "the identity tag does not validate the gzip one");
    // A weak tag stays weak.
    assert_eq!(curl(p.addr, "/weak", &["--compressed"]).await.header("etag"), Some("W/\"w1-gzip\""));

    // HEAD goes to the origin, as before: identity.
    let head = curl(p.addr, "/page", &["--compressed", "-I"]).await;
    assert_eq!((head.status, head.header("content-encoding")), (200, None));
    assert_eq!(head.header("content-length"), Some(origin_bytes.len().to_string().as_str()));
    // A range is of the representation sent: the stored gzip bytes to a
    // client that accepts gzip, the origin's bytes to one that does not.
    let range = curl(p.addr, "/page", &["-H", "Accept-Encoding: gzip", "-r", "0-9"]).await;
    assert_eq!((range.status, range.header("content-encoding")), (206, Some("gzip")));
    assert_eq!((&range.body[..], range.header("content-range")), (&raw.body[..10], Some(format!("bytes 0-9/{}", raw.body.len()).as_str())));
    let range = curl(p.addr, "/page", &["-r", "10-19"]).await;
    assert_eq!((range.status, range.header("content-encoding")), (206, None));
    assert_eq!(&range.body[..], &origin_bytes[10..20]);
    assert_eq!(o.hits(), 3, "/page once, /weak and the HEAD: the ranges came from the entry");
    p.shutdown().await;
}

#[tokio::test]
async fn what_is_left_as_the_origin_sent_it() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], &section("gzip")).await;
    for path in ["/png", "/no-transform", "/tiny"] {
        curl(p.addr, path, &["--compressed"]).await;
        let c = curl(p.addr, path, &["-H", "Accept-Encoding: gzip"]).await;
        assert_eq!(c.header("x-cache"), Some("HIT"), "{path}");
        assert_eq!((c.header("content-encoding"), c.header("vary")), (None, None), "{path}");
        let want = if path == "/tiny" { b"<p>tiny</p>".to_vec() } else { page(path).into_bytes() };
        assert_eq!(c.body, want, "{path}");
    }
    // Tried, not smaller: stored as it came, and counted so.
    curl(p.addr, "/random", &["--compressed"]).await;
    let c = curl(p.addr, "/random", &["-H", "Accept-Encoding: gzip"]).await;
    assert_eq!((c.header("x-cache"), c.header("content-encoding"), c.body.len()), (Some("HIT"), None, 4096));
    let m = metrics(&p).await;
    assert_eq!(sample(&m, "inband_proxy_compression_stored_total{encoding=\"gzip\",result=\"not_smaller\"}"), 1.0, "{m}");
    // The others were not even tried; no entry is compressed, none served so.
    assert_eq!(sample(&m, "inband_proxy_compression_stored_total{encoding=\"gzip\",result=\"compressed\"}"), 0.0);
    assert_eq!(sample(&m, "inband_proxy_compression_served_total{encoding=\"gzip\",as=\"encoded\"}"), 0.0);
    // Already encoded by the origin: never re-compressed; its bytes as sent.
    let first = curl(p.addr, "/pre-encoded", &["-H", "Accept-Encoding: gzip"]).await;
    let again = curl(p.addr, "/pre-encoded", &["-H", "Accept-Encoding: gzip"]).await;
    assert_eq!(again.header("x-cache"), Some("HIT"));
    assert_eq!(again.body, first.body);
    assert_eq!(gunzip(&again.body), page("/pre-encoded").into_bytes(), "gzip once, not twice");
    assert_eq!(again.header("vary"), None);
    // Not decoded for a client without Accept-Encoding on the origin's
    // word: it gets what the origin sent, as it would without the proxy.
    let plain = curl(p.addr, "/pre-encoded", &[]).await;
    assert!(plain.body == first.body && plain.header("content-encoding") == Some("gzip"), "{:?}", plain.headers);
    assert!(plain.header("inband-identity-length").is_none());
    p.shutdown().await;
}

#[tokio::test]
async fn brotli_and_zstd_entries_decode_for_curl_and_for_clients_without_them() {
    let o = origin().await;
    for (encoding, offer) in [("br", "br"), ("zstd", "zstd")] {
        let p = start_proxy(&[o.addr], &section(encoding)).await;
        let path = "/page";
        let origin_bytes = page(path).into_bytes();
        let c = curl(p.addr, path, &["--compressed"]).await;
        assert_eq!((c.header("content-encoding"), c.body.clone()), (Some(encoding), origin_bytes.clone()), "{encoding}");
        assert_eq!(c.header("etag"), Some(format!("\"p1-{encoding}\"").as_str()));
        let raw = curl(p.addr, path, &["-H", &format!("Accept-Encoding: {offer}")]).await;
        assert!(raw.body.len() * 5 < origin_bytes.len(), "{encoding}: {} bytes", raw.body.len());
        // gzip only, or nothing: identity, decoded by the proxy.
        for args in [&["-H", "Accept-Encoding: gzip"][..], &[]] {
            let plain = curl(p.addr, path, args).await;
            assert_eq!((plain.header("x-cache"), plain.header("content-encoding")), (Some("HIT"), None), "{encoding} {args:?}");
            assert_eq!(plain.body, origin_bytes, "{encoding} {args:?}");
        }
        p.shutdown().await;
    }
}

#[tokio::test]
async fn revalidation_keeps_the_compressed_entry() {
    let o = origin().await;
    let p = start_proxy(&[o.addr], &section("gzip")).await;
    let origin_bytes = page("/revalidated").into_bytes();
    assert_eq!(curl(p.addr, "/revalidated", &["--compressed"]).await.body, origin_bytes);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    // Stale: the origin is asked with its own tag and answers 304.
    let c = curl(p.addr, "/revalidated", &["--compressed"]).await;
    assert_eq!(c.header("x-cache"), Some("REVALIDATED"));
    assert_eq!((c.header("content-encoding"), c.header("etag")), (Some("gzip"), Some("\"r1-gzip\"")));
    assert_eq!(c.body, origin_bytes);
    let seen = o.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].headers.get("if-none-match").map(|v| v.to_str().unwrap()), Some("\"r1\""), "revalidated with the origin's tag");
    let plain = curl(p.addr, "/revalidated", &[]).await;
    assert_eq!((plain.header("x-cache"), &plain.body), (Some("HIT"), &origin_bytes));
    p.shutdown().await;
}

#[tokio::test]
async fn bad_compression_settings_are_refused_by_name() {
    let toml = "listen = \"127.0.0.1:0\"\nbackends = [\"127.0.0.1:1\"]\n[cache]\nbackend = \"memory\"\n[cache.compression]\nencoding = \"zstd\"\nlevel = 30\ntypes = [\"*/*\"]\n";
    let e = format!("{:#}", inband_proxy::config::parse(toml).unwrap_err());
    assert!(e.contains("cache.compression.level = 30: zstd takes 1–19") && e.contains("\"*/*\" is not a media type"), "{e}");
    let e = format!("{:#}", inband_proxy::config::parse(&toml.replace("\"zstd\"", "\"deflate\"")).unwrap_err());
    assert!(e.contains("deflate"), "{e}");
}

#[tokio::test]
async fn a_multi_megabyte_entry_decodes_chunk_by_chunk_from_a_durable_store() {
    let o = origin().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "[cache]\nbackend = \"lmdb\"\npath = \"{}\"\ncapacity_bytes = 67108864\n\n[cache.compression]\nencoding = \"gzip\"\n",
        dir.path().display()
    );
    let p = start_proxy(&[o.addr], &cfg).await;
    let want = large();
    let first = curl(p.addr, "/large", &["--compressed"]).await;
    assert!(first.body == want && first.header("content-encoding") == Some("gzip"), "{} bytes", first.body.len());
    // Read back in chunks from LMDB: the stored bytes, and their decoding.
    let raw = curl(p.addr, "/large", &["-H", "Accept-Encoding: gzip"]).await;
    assert_eq!(raw.header("x-cache"), Some("HIT"));
    assert!(raw.body.len() as u64 > inband_cache::STREAM_THRESHOLD && raw.body.len() < want.len() * 3 / 4, "{} stored bytes", raw.body.len());
    assert!(gunzip(&raw.body) == want);
    let plain = curl(p.addr, "/large", &[]).await;
    assert_eq!(plain.header("content-length"), Some(want.len().to_string().as_str()));
    assert!(plain.body == want, "identity: {} bytes of {}", plain.body.len(), want.len());
    assert_eq!(o.hits(), 1);
    p.shutdown().await;
}

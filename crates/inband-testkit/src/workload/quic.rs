//! `inband quic`: a QUIC server and client (quinn) for UDP and QUIC VIPs
//! (docs/workload.md, section "inband quic"). The server issues connection
//! IDs the balancer can route by; the client does its requests on one
//! connection and can move it to a new local socket half-way, the case
//! routing by connection ID exists for.
//!
//! The request protocol, one request per bidirectional stream: the client
//! sends `GET /` or `GET /<n>`, a newline, and finishes its side; the
//! server answers `OK <name> <server-id> <peer> <n>\n` (`peer`: the
//! client's address as the server sees it) followed by n body bytes, or
//! `ERR <reason>\n`, and finishes its side.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{ConnectionId, ConnectionIdGenerator, Endpoint, EndpointConfig, TokioRuntime, TransportConfig};
use rand::Rng;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::Serialize;
use tracing::{debug, info};

use inband_core::shared::{INBAND_QUIC_CID_FIRST, INBAND_QUIC_CID_LEN};

const ALPN: &[u8] = b"inband";
/// The largest body a request may ask for.
const MAX_BODY: u64 = 64 << 20;
/// A request line is short; anything longer is not one.
const MAX_REQUEST: usize = 1024;

#[derive(clap::Subcommand, Clone, Debug)]
pub enum QuicCommand {
    /// A QUIC server whose connection IDs name it (the server id).
    Serve(QuicServeArgs),
    /// Write a self-signed certificate and its key (DER) for servers and clients.
    Cert {
        #[arg(long)]
        cert: PathBuf,
        #[arg(long)]
        key: PathBuf,
        /// The name (DNS name or address) clients give as --server-name.
        #[arg(long)]
        name: String,
    },
    /// Requests on one QUIC connection, optionally moved to a new local socket.
    Get(QuicGetArgs),
}

#[derive(clap::Args, Clone, Debug)]
pub struct QuicServeArgs {
    /// Address to serve on; a wildcard ([::] is dual-stack) answers from
    /// whichever local address each datagram was sent to.
    #[arg(long, default_value = "[::]:8080")]
    pub listen: SocketAddr,
    /// The backend's quic_server_id in lb.toml (1-65535).
    #[arg(long)]
    pub server_id: u16,
    /// Certificate (DER or PEM).
    #[arg(long)]
    pub cert: PathBuf,
    /// Its private key (PKCS#8, DER or PEM).
    #[arg(long)]
    pub key: PathBuf,
    /// The name in every answer (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct QuicGetArgs {
    #[arg(long)]
    pub connect: SocketAddr,
    /// The certificate the server must present (DER or PEM): the only one trusted.
    #[arg(long)]
    pub cert: PathBuf,
    /// The name the certificate was made for.
    #[arg(long)]
    pub server_name: String,
    #[arg(long, default_value_t = 1)]
    pub requests: u32,
    /// Body bytes each request asks for.
    #[arg(long, default_value_t = 0)]
    pub bytes: u64,
    /// After this many requests, move the connection to a new local UDP
    /// socket (a new source port).
    #[arg(long)]
    pub migrate_after: Option<u32>,
    /// The new socket's local address (default: the wildcard, new port only).
    #[arg(long, requires = "migrate_after")]
    pub migrate_to: Option<IpAddr>,
    /// Bound on the handshake and on each request, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub timeout_s: f64,
    /// One JSON object per request, then one for the outcome.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: QuicCommand) -> Result<()> {
    match cmd {
        QuicCommand::Serve(args) => serve(args),
        QuicCommand::Cert { cert, key, name } => write_cert(&cert, &key, &name),
        QuicCommand::Get(args) => get(args),
    }
}

/// Connection IDs in the layout of bpf/include/inband/quic.h, which this
/// shares with the balancer (lb/quic.h): byte 0 = config rotation << 5 |
/// length, bytes 1-2 the server id (big endian), the rest random. The
/// balancer reads the server id from the ID of a short header that finds
/// no flow and sends it to the backend with that quic_server_id.
pub struct ServerIds {
    id: u16,
}

const CID_LEN: usize = INBAND_QUIC_CID_LEN as usize;

impl ServerIds {
    pub fn new(id: u16) -> ServerIds {
        ServerIds { id }
    }
}

impl ConnectionIdGenerator for ServerIds {
    fn generate_cid(&mut self) -> ConnectionId {
        let mut b = [0u8; CID_LEN];
        b[0] = INBAND_QUIC_CID_FIRST as u8;
        b[1..3].copy_from_slice(&self.id.to_be_bytes());
        rand::thread_rng().fill(&mut b[3..]);
        ConnectionId::new(&b)
    }

    /// Only our own IDs: another server's ID reached us because the
    /// balancer could not route it (quic = false, or that server left). A
    /// stateless reset would not help: its token is derived from the
    /// other server's key, so the client would ignore it.
    fn validate(&self, cid: &ConnectionId) -> Result<(), quinn_proto::InvalidCid> {
        if cid.len() == CID_LEN && cid[0] == INBAND_QUIC_CID_FIRST as u8 && cid[1..3] == self.id.to_be_bytes() {
            Ok(())
        } else {
            Err(quinn_proto::InvalidCid)
        }
    }

    fn cid_len(&self) -> usize {
        CID_LEN
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading certificate {}", path.display()))?;
    if bytes.starts_with(b"-----BEGIN") {
        let certs = CertificateDer::pem_slice_iter(&bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("certificate {}: {e:?}", path.display()))?;
        ensure!(!certs.is_empty(), "certificate {}: no CERTIFICATE in the PEM file", path.display());
        return Ok(certs);
    }
    Ok(vec![CertificateDer::from(bytes)])
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading key {}", path.display()))?;
    if bytes.starts_with(b"-----BEGIN") {
        return PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| anyhow::anyhow!("key {}: {e:?}", path.display()));
    }
    Ok(PrivatePkcs8KeyDer::from(bytes).into())
}

fn write_cert(cert: &Path, key: &Path, name: &str) -> Result<()> {
    let made = rcgen::generate_simple_self_signed(vec![name.to_string()]).context("making the certificate")?;
    std::fs::write(cert, made.cert.der()).with_context(|| format!("writing {}", cert.display()))?;
    // The key is a secret: owner only, from the start.
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(key)
        .and_then(|mut f| f.write_all(&made.key_pair.serialize_der()))
        .with_context(|| format!("writing {}", key.display()))?;
    Ok(())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

struct Identity {
    name: String,
    server_id: u16,
}

pub fn serve(args: QuicServeArgs) -> Result<()> {
    ensure!(args.server_id != 0, "--server-id 0 is not a server id: use 1-65535 (the backend's quic_server_id in lb.toml)");
    let name = args.name.clone().unwrap_or_else(hostname);
    ensure!(!name.is_empty() && !name.contains(char::is_whitespace), "--name {name:?}: one word, it is a field of every answer");
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(load_certs(&args.cert)?, load_key(&args.key)?)
        .context("certificate and key do not go together")?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let server = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    let mut endpoint_cfg = EndpointConfig::default();
    let id = args.server_id;
    endpoint_cfg.cid_generator(move || Box::new(ServerIds::new(id)));
    // Not advertised, so clients keep the fixed bit at 1: the balancer
    // takes only packets with it set for short headers (lb/quic.h).
    endpoint_cfg.grease_quic_bit(false);
    let rt = runtime()?;
    let me = Arc::new(Identity { name, server_id: id });
    rt.block_on(async move {
        let socket = UdpSocket::bind(args.listen).with_context(|| format!("listening on udp {}", args.listen))?;
        let endpoint = Endpoint::new(endpoint_cfg, Some(server), socket, Arc::new(TokioRuntime))?;
        info!(listen = %args.listen, server_id = id, name = %me.name, "inband quic serve");
        while let Some(incoming) = endpoint.accept().await {
            tokio::spawn(connection(incoming, Arc::clone(&me)));
        }
        Ok(())
    })
}

async fn connection(incoming: quinn::Incoming, me: Arc<Identity>) {
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => return debug!("handshake failed: {e}"),
    };
    while let Ok((send, recv)) = conn.accept_bi().await {
        // The address now, not at the handshake: it changes when the client
        // moves. An IPv4 client of a dual-stack socket in its own notation.
        let peer = conn.remote_address();
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        tokio::spawn(answer(send, recv, peer, Arc::clone(&me)));
    }
}

/// The body size a request line asks for.
fn parse_request(req: &[u8]) -> Result<u64, String> {
    let line = std::str::from_utf8(req).map_err(|_| "request is not UTF-8".to_string())?;
    let line = line.strip_suffix('\n').ok_or("request line does not end with a newline")?;
    let path = line.strip_prefix("GET /").ok_or("expected `GET /` or `GET /<bytes>`")?;
    if path.is_empty() {
        return Ok(0);
    }
    match path.parse::<u64>() {
        Ok(n) if n <= MAX_BODY => Ok(n),
        Ok(n) => Err(format!("{n} bytes asked, at most {MAX_BODY}")),
        Err(_) => Err(format!("path /{path} is not a byte count")),
    }
}

async fn answer(mut send: quinn::SendStream, mut recv: quinn::RecvStream, peer: SocketAddr, me: Arc<Identity>) {
    let reply = match recv.read_to_end(MAX_REQUEST).await {
        Ok(req) => parse_request(&req),
        Err(e) => Err(format!("reading the request: {e}")),
    };
    let sent = async {
        match reply {
            Ok(n) => {
                send.write_all(format!("OK {} {} {peer} {n}\n", me.name, me.server_id).as_bytes()).await?;
                let chunk = vec![b'x'; 16 * 1024];
                let mut left = n;
                while left > 0 {
                    let k = left.min(chunk.len() as u64) as usize;
                    send.write_all(&chunk[..k]).await?;
                    left -= k as u64;
                }
            }
            Err(e) => send.write_all(format!("ERR {e}\n").as_bytes()).await?,
        }
        send.finish()?;
        anyhow::Ok(())
    };
    if let Err(e) = sent.await {
        debug!(%peer, "answer not sent: {e}");
    }
}

/// One answered request, as `get --json` prints it.
#[derive(Serialize, Debug)]
struct Answer {
    request: u32,
    server: String,
    server_id: u16,
    /// The client's address as the server saw it (behind the balancer: the
    /// balancer's address and the flow's SNAT port).
    peer: String,
    /// The client's socket when it asked.
    local: String,
    bytes: u64,
    ms: f64,
}

#[derive(Serialize, Debug)]
struct Outcome {
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    remote: String,
    requests: u32,
    answered: u32,
    migrated: bool,
    server_ids: Vec<u16>,
}

fn wildcard(of: SocketAddr) -> IpAddr {
    if of.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    }
}

fn bind_client(ip: IpAddr) -> Result<UdpSocket> {
    UdpSocket::bind(SocketAddr::new(ip, 0)).with_context(|| format!("binding a UDP socket on {ip}"))
}

pub fn get(args: QuicGetArgs) -> Result<()> {
    ensure!(args.requests >= 1, "--requests must be >= 1");
    ensure!(args.timeout_s > 0.0 && args.timeout_s <= 600.0, "--timeout-s must be in (0, 600]");
    ensure!(args.bytes <= MAX_BODY, "--bytes {}: at most {MAX_BODY}", args.bytes);
    if let Some(k) = args.migrate_after {
        ensure!(k >= 1 && k < args.requests, "--migrate-after {k}: needs 1 <= K < --requests ({})", args.requests);
    }
    if let Some(to) = args.migrate_to {
        ensure!(to.is_ipv4() == args.connect.is_ipv4(), "--migrate-to {to} is not of the family of --connect {}", args.connect);
    }
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certs(&args.cert)? {
        roots.add(c).with_context(|| format!("certificate {}", args.cert.display()))?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let mut transport = TransportConfig::default();
    // Idle for longer than a request may take is a dead connection.
    transport.max_idle_timeout(Some(timeout.try_into()?));
    client.transport_config(Arc::new(transport));

    let rt = runtime()?;
    rt.block_on(async move {
        let endpoint = Endpoint::new(EndpointConfig::default(), None, bind_client(wildcard(args.connect))?, Arc::new(TokioRuntime))?;
        let mut out = Outcome {
            outcome: "ok",
            error: None,
            remote: args.connect.to_string(),
            requests: args.requests,
            answered: 0,
            migrated: false,
            server_ids: Vec::new(),
        };
        let result = requests(&endpoint, &client, &args, timeout, &mut out).await;
        if let Err(e) = &result {
            out.outcome = "error";
            out.error = Some(format!("{e:#}"));
        }
        endpoint.close(0u32.into(), b"done");
        // The close is best effort: the outcome is known already.
        let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        if args.json {
            println!("{}", serde_json::to_string(&out)?);
        } else {
            println!(
                "{}: {} of {} requests answered, server ids {:?}{}{}",
                out.remote,
                out.answered,
                out.requests,
                out.server_ids,
                if out.migrated { ", migrated" } else { "" },
                out.error.as_deref().map_or(String::new(), |e| format!("; {e}"))
            );
        }
        result
    })
}

async fn requests(endpoint: &Endpoint, client: &quinn::ClientConfig, args: &QuicGetArgs, timeout: Duration, out: &mut Outcome) -> Result<()> {
    let connecting = endpoint.connect_with(client.clone(), args.connect, &args.server_name)?;
    let conn = match tokio::time::timeout(timeout, connecting).await {
        Ok(c) => c.with_context(|| format!("QUIC handshake with {}", args.connect))?,
        Err(_) => bail!("no QUIC handshake with {} within {:?}", args.connect, timeout),
    };
    for i in 1..=args.requests {
        if args.migrate_after == Some(i - 1) {
            endpoint.rebind(bind_client(args.migrate_to.unwrap_or(wildcard(args.connect)))?).context("moving to the new socket")?;
            out.migrated = true;
        }
        let local = endpoint.local_addr()?.to_string();
        let t0 = Instant::now();
        let (header, bytes) = match tokio::time::timeout(timeout, request(&conn, args.bytes)).await {
            Ok(r) => r.with_context(|| format!("request {i}"))?,
            Err(_) => bail!("request {i}: no answer within {timeout:?} (local {local})"),
        };
        let a = parse_answer(&header, bytes, args.bytes).with_context(|| format!("request {i}"))?;
        let a = Answer { request: i, local, ms: t0.elapsed().as_secs_f64() * 1e3, ..a };
        if args.json {
            println!("{}", serde_json::to_string(&a)?);
        } else {
            println!("request {}: {} (server id {}), {} bytes, seen from {}, local {}", i, a.server, a.server_id, a.bytes, a.peer, a.local);
        }
        out.answered += 1;
        out.server_ids.push(a.server_id);
    }
    conn.close(0u32.into(), b"done");
    Ok(())
}

/// The answer's header line and how many body bytes followed it.
async fn request(conn: &quinn::Connection, bytes: u64) -> Result<(String, u64)> {
    let (mut send, mut recv) = conn.open_bi().await?;
    let path = if bytes == 0 { String::new() } else { bytes.to_string() };
    send.write_all(format!("GET /{path}\n").as_bytes()).await?;
    send.finish()?;
    let mut header = Vec::new();
    let mut body = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    while let Some(n) = recv.read(&mut buf).await? {
        let mut data = &buf[..n];
        if !header.ends_with(b"\n") {
            let cut = data.iter().position(|&b| b == b'\n').map_or(data.len(), |p| p + 1);
            header.extend_from_slice(&data[..cut]);
            ensure!(header.len() <= MAX_REQUEST, "the answer's first line is over {MAX_REQUEST} bytes");
            data = &data[cut..];
        }
        body += data.len() as u64;
    }
    Ok((String::from_utf8_lossy(&header).into_owned(), body))
}

fn parse_answer(header: &str, got: u64, asked: u64) -> Result<Answer> {
    let line = header.strip_suffix('\n').with_context(|| format!("answer {header:?} is not a whole line"))?;
    if let Some(e) = line.strip_prefix("ERR ") {
        bail!("the server refused: {e}");
    }
    let f: Vec<&str> = line.split(' ').collect();
    let [ok, name, id, peer, n] = f[..] else { bail!("answer {line:?} is not `OK <name> <server-id> <peer> <bytes>`") };
    ensure!(ok == "OK", "answer {line:?} is not `OK ...`");
    let n: u64 = n.parse().with_context(|| format!("answer {line:?}: byte count"))?;
    ensure!(n == asked && got == n, "asked {asked} bytes, the server announced {n} and sent {got}");
    Ok(Answer {
        request: 0,
        server: name.to_string(),
        server_id: id.parse().with_context(|| format!("answer {line:?}: server id"))?,
        peer: peer.to_string(),
        local: String::new(),
        bytes: got,
        ms: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_the_server_id_in_the_balancers_layout() {
        let mut g = ServerIds::new(0x1234);
        let a = g.generate_cid();
        let b = g.generate_cid();
        assert_eq!(a.len(), 8);
        assert_eq!(&a[..3], &[0x08, 0x12, 0x34]);
        assert_ne!(a, b, "the rest is random");
        assert!(g.validate(&a).is_ok());
        assert!(ServerIds::new(0x1235).validate(&a).is_err(), "another server's ID is not ours");
        assert!(g.validate(&ConnectionId::new(&[0x09, 0x12, 0x34, 0, 0, 0, 0, 0])).is_err());
        assert!(g.validate(&ConnectionId::new(&a[..7])).is_err());
    }

    #[test]
    fn requests_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_request(b"GET /\n"), Ok(0));
        assert_eq!(parse_request(b"GET /4096\n"), Ok(4096));
        assert!(parse_request(b"GET /4096").unwrap_err().contains("newline"));
        assert!(parse_request(b"PUT /\n").is_err());
        assert!(parse_request(b"GET /x\n").unwrap_err().contains("not a byte count"));
        assert!(parse_request(format!("GET /{}\n", MAX_BODY + 1).as_bytes()).is_err());
        let a = parse_answer("OK s1 3 10.0.0.1:1024 5\n", 5, 5).unwrap();
        assert_eq!((a.server.as_str(), a.server_id, a.peer.as_str()), ("s1", 3, "10.0.0.1:1024"));
        assert!(parse_answer("OK s1 3 10.0.0.1:1024 5\n", 4, 5).is_err(), "a short body");
        assert!(parse_answer("ERR no\n", 0, 0).unwrap_err().to_string().contains("refused"));
    }
}

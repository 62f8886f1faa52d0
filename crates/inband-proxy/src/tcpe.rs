//! Connection handoff (TCPE, `[tcpe]`): the first request of a connection
//! whose client finished TCPE's handshake is read here, before hyper sees
//! the connection. When it is a plain GET or HEAD that the cache does not
//! hold, for a route that changes nothing in it, and the backend the
//! route's policy picks has a takeover server, the connection is handed
//! to that server (`inband_tcpe::handoff::hand_off`) and the proxy is done
//! with it. Otherwise, and on every fallback of the handoff, the bytes read
//! are given back to hyper ([`crate::conn::Io::replay`]) and the request is
//! proxied as without TCPE. docs/decisions.md, "TCPE handoff (issue 29):
//! the proxy's side".
//!
//! With `[tcpe.transparent]`, a connection whose client did not offer TCPE
//! goes the same way, and is moved at L4 instead
//! (`inband_tcpe::transparent::move_connection`): frozen here, rebuilt by
//! the backend's takeover server, switched by `inband lb`.

use std::collections::HashMap;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http::{header, request, HeaderName, HeaderValue, Method};
use inband_tcpe::handoff::{self, hand_off, Outcome, Target};
use inband_tcpe::relay::Counters;
use inband_tcpe::repair::Connected;
use inband_tcpe::sockops::{hold_acks, State, Tcpe};
use inband_tcpe::transparent::{self, Mover};
use tokio::io::{AsyncRead, ReadBuf};

use crate::backend::Backend;
use crate::config::TcpeSpec;
use crate::conn::Io;
use crate::routes::Route;
use crate::tcpe_kept::Kept;
use crate::{cache_control, forward, Shared};

/// The proxy's handoff state: the sockops program (attached while this
/// lives), each backend's takeover server, the handoff routine's counts.
pub struct Handoffs {
    tcpe: Arc<Tcpe>,
    pub counters: Arc<Counters>,
    targets: HashMap<SocketAddr, Target>,
    /// `fallback_not_capable` in the counters: a plain connection is
    /// counted here without a call to the routine.
    not_capable: usize,
    /// `[tcpe.transparent]`: plain connections are moved at L4.
    mover: Option<Arc<Mover>>,
    /// By backend address: the server's IPv6 address as the L4 balancer
    /// lists it, where `[[tcpe.server]]` names one.
    backends6: HashMap<SocketAddr, SocketAddr>,
    pub moves: Arc<Counters>,
}

impl Handoffs {
    /// Attaches the sockops program to `[tcpe] cgroup`, which must hold
    /// this process (a socket is seen by the programs of its creator's
    /// cgroup and those above it).
    pub fn start(spec: &TcpeSpec) -> Result<Handoffs> {
        let own = inband_tcpe::cli::own_cgroup();
        let cgroup = match (&spec.cgroup, &own) {
            (Some(c), _) => c.clone(),
            (None, Ok(o)) => o.clone(),
            (None, Err(e)) => bail!("tcpe: the proxy's own cgroup v2 is unknown ({e:#}): set tcpe.cgroup"),
        };
        match &own {
            Ok(o) if !under(o, &cgroup) => bail!(
                "tcpe.cgroup {}: the proxy runs in {}, outside it, so its sockets would not see the TCPE program: start the proxy in that cgroup, or leave tcpe.cgroup out",
                cgroup.display(),
                o.display()
            ),
            Ok(_) => {}
            // Under `ip netns exec`, whose private /sys has no cgroup2 mount.
            Err(e) => tracing::warn!("tcpe: the proxy's own cgroup v2 is unknown ({e:#}): make sure it runs in {}", cgroup.display()),
        }
        let tcpe = Tcpe::attach(&cgroup).with_context(|| format!("tcpe.cgroup {}", cgroup.display()))?;
        let targets = spec
            .servers
            .iter()
            .map(|(&backend, &(control, join, _))| {
                (backend, Target { control, join, key: spec.key, deadline: spec.deadline, io_timeout: spec.io_timeout, channels: Default::default() })
            })
            .collect();
        let backends6 = spec.servers.iter().filter_map(|(&backend, &(_, _, b6))| Some((backend, b6?))).collect();
        let not_capable = handoff::COUNTERS.iter().position(|(n, _)| *n == "fallback_not_capable").expect("a counter of inband-tcpe's handoff");
        let mover = match &spec.transparent {
            Some(t) => Some(Arc::new(
                Mover::new(&t.agent_pins, t.balancer_port, t.key)
                    .with_context(|| format!("tcpe.transparent.agent_pins {} (is `inband agent` running there?)", t.agent_pins.display()))?,
            )),
            None => None,
        };
        Ok(Handoffs {
            tcpe: Arc::new(tcpe),
            counters: Arc::new(handoff::counters()),
            targets,
            not_capable,
            mover,
            moves: Arc::new(transparent::counters()),
            backends6,
        })
    }

    /// With `[tcpe.transparent]`, the client a connection from `inband
    /// lb` stands for: the kernel's peer is the balancer's tuple there.
    pub fn client_of(&self, peer: SocketAddr, local_port: u16) -> Option<SocketAddr> {
        self.mover.as_ref()?.client_of(peer, local_port)
    }

    /// The sockops program's own counts (offers, notifications, forged
    /// options refused), for the metrics.
    pub fn option_counters(&self) -> Result<Vec<(&'static str, u64)>> {
        self.tcpe.counters()
    }

    /// The plaintext listener's sockets, one per worker
    /// ([`crate::workers::bind`]), answering TCPE. Their ACKs are held
    /// after listen() (which resets TCP_QUICKACK) so that connections
    /// inherit it: a client's request often arrives before accept(), and an
    /// ACK sent for it at once would leave none owed to carry the
    /// notification (docs/decisions.md, "Getting the notification out").
    pub fn listen(&self, addr: SocketAddr, workers: usize) -> Result<Vec<std::net::TcpListener>> {
        crate::workers::bind(
            addr,
            workers,
            |s| Ok(self.tcpe.answer(s.as_fd())?),
            |l| {
                hold_acks(l.as_fd())?;
                let bound = l.local_addr()?;
                if !self.tcpe.answers(bound)? {
                    bail!(
                        "tcpe: the program does not answer for the listener on {bound}: the proxy is not in tcpe.cgroup (or its table of listeners is full: fallback_listeners_full)"
                    );
                }
                Ok(())
            },
        )
    }
}

/// Whether cgroup directory `own` is `dir` or below it.
fn under(own: &Path, dir: &Path) -> bool {
    let canon = |p: &Path| p.canonicalize().unwrap_or_else(|_| PathBuf::from(p));
    canon(own).starts_with(canon(dir))
}

/// What became of a connection's first request.
pub enum First {
    /// Serve the connection with hyper; what was read is replayed.
    Proxy(Io),
    /// Handed off, or lost: nothing more to do.
    Done,
}

/// Reads into `buf` from `io`; the bytes read, 0 at the end or on an error
/// (hyper meets either again when it reads).
async fn read_some(io: &mut Io, chunk: &mut [u8]) -> usize {
    poll_fn(|cx| {
        let mut rb = ReadBuf::new(chunk);
        Pin::new(&mut *io).poll_read(cx, &mut rb).map(|r| r.map_or(0, |()| rb.filled().len()))
    })
    .await
}

/// Runs on a plaintext connection of a proxy with `[tcpe]`, under the
/// connection's clocks (conn.rs): the header timeout bounds the read of
/// the head as it bounds hyper's.
pub async fn first_request(shared: &Arc<Shared>, mut io: Io, peer: SocketAddr) -> First {
    let h = shared.tcpe.as_ref().expect("called with [tcpe] only");
    // The handshake is over by accept(): a connection that did not offer
    // TCPE, or fell back, never will. Its head is left to hyper.
    let offered = matches!(h.tcpe.state(io.as_fd()), Ok(Some(s)) if !matches!(s.state, State::Fallback(_)));
    if !offered && h.mover.is_none() {
        h.counters.bump(h.not_capable);
        return First::Proxy(io);
    }
    let max = shared.cfg.raw.max_header_bytes;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 4096];
    let head_len = loop {
        let n = read_some(&mut io, &mut chunk).await;
        if n == 0 {
            break None;
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 64];
        match httparse::Request::new(&mut headers).parse(&buf) {
            Ok(httparse::Status::Complete(len)) => break Some(len),
            Ok(httparse::Status::Partial) if buf.len() < max => {}
            _ => break None,
        }
    };
    // Closed (or timed out) before its first byte, as a balancer's TCP
    // health check is: there was no request to keep or move.
    if buf.is_empty() {
        return First::Proxy(io);
    }
    let buf = Bytes::from(buf);
    match choose(shared, h, &buf, head_len, peer).await {
        Ok(chosen) => Box::pin(move_connection(h, io, buf, peer, chosen, !offered)).await,
        Err(k) => {
            shared.metrics.tcpe_kept(k);
            io.replay(buf);
            First::Proxy(io)
        }
    }
}

/// Where a request that may move goes.
struct Chosen<'a> {
    parts: request::Parts,
    route: &'a Arc<Route>,
    target: &'a Target,
    backend: Arc<Backend>,
    /// The backend's address, as the pool (and the L4 balancer) lists it.
    addr: SocketAddr,
}

/// The route, the backend and its takeover server for a request that may
/// be handed off, or the rule that keeps it.
async fn choose<'a>(shared: &'a Arc<Shared>, h: &'a Handoffs, buf: &[u8], head_len: Option<usize>, peer: SocketAddr) -> Result<Chosen<'a>, Kept> {
    let parts = head_len.filter(|&n| n == buf.len()).and_then(|_| simple_request(buf)).ok_or(Kept::NotSimple)?;
    if shared.cfg.raw.client_limits.requests_per_s > 0.0 {
        return Err(Kept::Limits);
    }
    let route = shared.router.choose(parts.headers.get(header::HOST), parts.uri.path()).ok_or(Kept::Route)?;
    if !route.request_headers.is_empty() || route.rewrites_responses || route.limits.is_some() {
        return Err(Kept::Route);
    }
    if let Some(cache) = shared.cache.as_ref().filter(|_| route.cache && parts.method == Method::GET) {
        if cache_control::directive(&parts.headers, "only-if-cached").is_some() || cache.lookup(&parts).await.is_some() {
            return Err(Kept::Cached);
        }
    }
    let pool = &route.pool;
    let key = forward::hash_key(&pool.hash_key, &parts, peer);
    let now = Instant::now();
    let i = pool.policy.pick(&pool.backends, |i| pool.backends[i].is_healthy(now), &key).ok_or(Kept::NoBackend)?;
    let target = h.targets.get(&pool.addrs[i]).ok_or(Kept::NoServer)?;
    Ok(Chosen { parts, route, target, backend: pool.backends[i].clone(), addr: pool.addrs[i] })
}

/// The head in `buf` (all of it) as request parts, if it is a GET or HEAD
/// in origin form with exactly one Host, no body and no Upgrade: what
/// the server can be given as it came. hyper answers the others as
/// usual.
fn simple_request(buf: &[u8]) -> Option<request::Parts> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    req.parse(buf).ok()?;
    let method = match req.method? {
        "GET" => Method::GET,
        "HEAD" => Method::HEAD,
        _ => return None,
    };
    let path = req.path.filter(|p| p.starts_with('/'))?;
    let version = match req.version? {
        0 => http::Version::HTTP_10,
        _ => http::Version::HTTP_11,
    };
    let mut b = http::Request::builder().method(method).uri(path).version(version);
    for h in req.headers.iter() {
        b = b.header(HeaderName::from_bytes(h.name.as_bytes()).ok()?, HeaderValue::from_bytes(h.value).ok()?);
    }
    let (mut parts, ()) = b.body(()).ok()?.into_parts();
    let body_or_upgrade = [header::CONTENT_LENGTH, header::TRANSFER_ENCODING, header::UPGRADE].iter().any(|n| parts.headers.contains_key(n));
    if body_or_upgrade || parts.headers.get_all(header::HOST).iter().count() != 1 {
        return None;
    }
    cache_control::normalize_request(&mut parts);
    Some(parts)
}

/// Hands the connection to `target` (the routine waits on the channel and
/// for the join, or for the balancer's switch, as this connection's task);
/// on a fallback gives it back to hyper with the head to replay. `plain`:
/// the client did not offer TCPE, and the connection is moved at L4.
async fn move_connection(h: &Handoffs, mut io: Io, head: Bytes, peer: SocketAddr, chosen: Chosen<'_>, plain: bool) -> First {
    let Chosen { parts, route, target, backend, addr } = chosen;
    let start = Instant::now();
    // A request in progress for the connection's clocks: the send timeout,
    // not the header one, bounds the wait.
    let guard = io.state().begin_request(false);
    let outcome = match h.mover.as_ref().filter(|_| plain) {
        Some(m) => {
            // The balancer knows the server in the connection's family.
            let v6 = io.local_addr().is_ok_and(|a| a.ip().to_canonical().is_ipv6());
            let to = if v6 { h.backends6.get(&addr).copied().unwrap_or(addr) } else { addr };
            transparent::move_connection(m, &io, &head, target, to, &h.moves).await
        }
        None => hand_off(&h.tcpe, &mut io, &head, target, &h.counters).await,
    };
    drop(guard);
    match outcome {
        Outcome::HandedOff => {
            // The route's request count; it has no rate limit (choose).
            let _ = route.admit(peer.ip());
            tracing::info!(
                target: "inband_proxy::access",
                client = %peer,
                method = %parts.method,
                uri = %parts.uri,
                upstream = %backend.name,
                ms = start.elapsed().as_secs_f64() * 1000.0,
                "handed off"
            );
            First::Done
        }
        Outcome::Fallback(why) => {
            tracing::debug!(client = %peer, upstream = %backend.name, why, "tcpe: handoff fell back, proxying");
            io.replay(head);
            First::Proxy(io)
        }
    }
}

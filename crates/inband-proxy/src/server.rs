//! Accepting clients and the per-request handler.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};

use crate::body::{full, BoxError, ProxyBody};
use crate::cache_outcome::Outcome;
use crate::client_limits::{ClientSlot, Refused};
use crate::conn::{self, State};
use crate::http2_guard::{Guarded, Verdict};
use crate::interim::{Relay, RelayIo};
use crate::metrics::Refusal;
use crate::routes::Route;
use crate::tcpe::{self, First};
use crate::tunnel::{self, Offer};
use crate::upgrade::Upgrade;
use crate::workers::{WorkerLoad, BUSY_INTERVAL};
use crate::{access, cache_control, cache_layer, forward, Shared};

pub fn refusal_response(r: Refusal) -> Response<ProxyBody> {
    let text = match r {
        Refusal::BadRequest => "bad request\n",
        Refusal::BadHost => "a request needs exactly one Host header\n",
        Refusal::NotCached => "not cached (only-if-cached)\n",
        Refusal::HeadersTooLarge => "request headers too large\n",
        Refusal::BodyTooLarge => "request body too large\n",
        Refusal::BodyTimeout => "request body too slow\n",
        Refusal::NoHealthyBackend => "no healthy backend\n",
        Refusal::BackendDown => "backend unreachable\n",
        Refusal::BackendTimeout => "backend timed out\n",
        Refusal::ClientRate => "too many requests from this client\n",
        Refusal::BackendBadUpgrade => "the backend switched to a protocol the request did not offer\n",
        Refusal::NoRoute => "no route for this host and path\n",
        Refusal::RouteRate => "too many requests from this client to this route\n",
    };
    let mut resp = Response::new(full(text));
    *resp.status_mut() = r.status();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    if matches!(r, Refusal::BodyTooLarge | Refusal::BodyTimeout) {
        // The unread rest of the body would be taken for the next request.
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A connection accepted by a worker, for the worker that serves it.
pub struct Accepted {
    stream: Stream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
    client: ClientSlot,
    /// From the TLS listener.
    tls: bool,
}

/// A registration with a runtime's reactor belongs to that runtime: a
/// connection served where it was accepted keeps its own, one handed to
/// another worker leaves it and registers there.
enum Stream {
    Here(TcpStream),
    Moved(std::net::TcpStream),
}

/// Where a worker's connections are sent, by itself or by the worker
/// that accepted them.
#[derive(Clone)]
pub struct WorkerSlot {
    pub tx: mpsc::UnboundedSender<Accepted>,
    pub load: Arc<WorkerLoad>,
}

/// Keeps `load.busy_permille` at the share of each [`BUSY_INTERVAL`] this
/// worker's runtime spent running tasks; packing skips a busy worker, so
/// the steering follows.
pub async fn measure_busy(shared: Arc<Shared>, load: Arc<WorkerLoad>) {
    let metrics = tokio::runtime::Handle::current().metrics();
    let mut last = metrics.worker_total_busy_duration(0);
    let mut tick = tokio::time::interval(BUSY_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let total = metrics.worker_total_busy_duration(0);
        let permille = (total.saturating_sub(last).as_micros() * 1000 / BUSY_INTERVAL.as_micros()).min(1000);
        load.busy_permille.store(permille as u32, Ordering::Relaxed);
        last = total;
        shared.steering.update();
    }
}

/// Accepts on worker `me`'s own socket of one listening address until
/// `stop` fires; `tls` marks the TLS listener's. The kernel steers each new
/// connection to the worker packing chooses ([`crate::workers`]); one
/// that arrives where packing no longer would put it (a burst queued
/// before the steering moved) is handed to the worker it chooses now, as
/// an acceptor thread would have done with every connection.
pub async fn accept(shared: Arc<Shared>, listener: TcpListener, tls: bool, me: usize, workers: Arc<[WorkerSlot]>, mut stop: watch::Receiver<bool>) {
    let slots = shared.connection_slots.clone();
    let mut backoff = inband_http::Backoff::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                shared.metrics.accept_error();
                backoff.wait(&e, "accept failed").await;
                continue;
            }
        };
        backoff.reset();
        let _ = stream.set_nodelay(true);
        // On a dual-stack listener IPv4 clients appear as ::ffff:a.b.c.d;
        // purge_allow, X-Forwarded-For and hashing want a.b.c.d.
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        // Under [tcpe.transparent] the host's agent does not show the
        // proxy its clients (the moves need the balancer's tuple): the
        // client comes from the agent's entry, for the limits, the logs,
        // X-Forwarded-For and hashing alike.
        let peer = match (&shared.tcpe, stream.local_addr()) {
            (Some(t), Ok(local)) => t.client_of(peer, local.port()).unwrap_or(peer),
            _ => peer,
        };
        let client = match shared.client_limits.open(peer.ip()) {
            Ok(c) => c,
            Err(Refused::Connections) => {
                // Closed before a byte is read: the slot goes to the next.
                shared.metrics.client_connection_refused();
                continue;
            }
        };
        // At max_connections a new client waits, accepted but not read,
        // and the ones behind it in the listen backlog, until a connection
        // closes (the timeouts make sure one does). Taken after accept, so
        // that a worker whose socket gets no connections holds no slot.
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = stop.wait_for(|s| *s) => break,
        };
        let to = shared.steering.choose();
        let stream = if to == me {
            Stream::Here(stream)
        } else {
            shared.metrics.connection_handed_over();
            match stream.into_std() {
                Ok(s) => Stream::Moved(s),
                Err(_) => continue,
            }
        };
        let w = &workers[to];
        w.load.opened(tls);
        shared.steering.update();
        if w.tx.send(Accepted { stream, peer, permit, client, tls }).is_err() {
            w.load.closed(tls);
            shared.steering.update();
        }
    }
}

/// A worker's loop: serves the connections it accepted, and those other
/// workers handed it, until `stop` fires, then lets in-flight requests
/// finish for up to the shutdown timeout.
pub async fn serve(shared: Arc<Shared>, mut conns: mpsc::UnboundedReceiver<Accepted>, load: Arc<WorkerLoad>, mut stop: watch::Receiver<bool>) {
    let graceful = GracefulShutdown::new();
    // HTTP/1.1, and HTTP/2 with prior knowledge (h2c) on the same port:
    // hyper-util tells them apart by the connection preface.
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let max_head = shared.cfg.raw.max_header_bytes;
    // The header timeout is conn.rs's, from accept and with a 408.
    builder.http1().timer(TokioTimer::new()).header_read_timeout(None).max_buf_size(max_head);
    let h2 = &shared.cfg.raw.client_http2;
    builder.http2().timer(TokioTimer::new()).max_header_list_size(max_head as u32).max_concurrent_streams(h2.max_concurrent_streams);
    let control_frames_per_s = h2.control_frames_per_s;
    let builder = Arc::new(builder);
    loop {
        let Accepted { stream, peer, permit, client, tls } = tokio::select! {
            c = conns.recv() => match c {
                Some(c) => c,
                None => break,
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        let stream = match stream {
            Stream::Here(s) => Ok(s),
            Stream::Moved(s) => TcpStream::from_std(s),
        };
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                load.closed(tls);
                shared.steering.update();
                tracing::warn!(error = %e, "a worker could not register a connection");
                continue;
            }
        };
        let (io, sock, state) = conn::Io::new(stream, shared.cfg.timeouts(), tls);
        let s = shared.clone();
        let st = state.clone();
        let client = Arc::new(client);
        // A tunnel outlives hyper's connection: its task keeps the
        // client's slot as it keeps the connection permit.
        let client_slot = client.clone();
        let relay = Relay::new(shared.metrics.interim.clone());
        let relay_io = relay.clone();
        let service = service_fn(move |req| handle(s.clone(), req, peer, tls, st.clone(), client.clone(), relay.clone()));
        let (s, builder, watcher, load) = (shared.clone(), builder.clone(), graceful.watcher(), load.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _client = client_slot;
            s.metrics.connections.inc();
            // The handshake runs under the connection's clocks like a
            // request head, and outside the graceful watcher, which needs
            // a hyper connection: shutdown does not wait for handshakes.
            let verdict = Arc::new(Verdict::default());
            let conn = async {
                match s.tls.as_ref().filter(|_| tls) {
                    None => {
                        // The plaintext listener's connections only: it is
                        // the one answering TCPE. Boxed: the handoff's
                        // future is not carried by every connection's.
                        let io = match s.tcpe.is_some() {
                            true => match Box::pin(tcpe::first_request(&s, io, peer)).await {
                                First::Proxy(io) => io,
                                First::Done => return Ok(()),
                            },
                            false => io,
                        };
                        watcher.watch(builder.serve_connection_with_upgrades(TokioIo::new(RelayIo::new(Guarded::new(io, control_frames_per_s, verdict.clone()), relay_io)), service)).await
                    }
                    Some(t) => match t.acceptor.accept(io).await {
                        Ok(io) => watcher.watch(builder.serve_connection_with_upgrades(TokioIo::new(RelayIo::new(Guarded::new(io, control_frames_per_s, verdict.clone()), relay_io)), service)).await,
                        Err(e) => {
                            s.metrics.tls_handshake_error();
                            tracing::debug!(client = %peer, error = %e, "TLS handshake failed");
                            Ok(())
                        }
                    },
                }
            };
            // Pinned here, not moved into `watch`: the connection (and
            // with it the socket) is dropped at the end of this task, after
            // its timeout was counted, so a client that sees the close
            // finds it in the metrics.
            tokio::pin!(conn);
            let mut ends = None;
            match conn::watch(conn.as_mut(), sock, &state).await {
                // Shutdown does not wait for tunnels: they end with the
                // worker's runtime.
                Ok(Ok(())) => {
                    if let Some(t) = state.take_tunnel() {
                        ends = tunnel::run(t, &s, peer).await;
                    }
                }
                Ok(Err(e)) => match verdict.get() {
                    Some(a) => {
                        s.metrics.http2_abuse(a);
                        tracing::info!(client = %peer, kind = a.label(), error = %e, "HTTP/2 connection ended for abuse");
                    }
                    None => connection_error(&s, peer, e),
                },
                Err(expiry) => {
                    s.metrics.connection_timeout(expiry);
                    tracing::debug!(client = %peer, timeout = expiry.label(), "connection closed by a timeout");
                }
            }
            s.metrics.connections.dec();
            load.closed(tls);
            s.steering.update();
            drop(ends);
        });
    }
    let timeout = shared.cfg.shutdown_timeout();
    if tokio::time::timeout(timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(?timeout, "shutdown timeout: closing connections with requests still in flight");
    }
}

fn connection_error(s: &Shared, peer: SocketAddr, e: BoxError) {
    let parse = e.downcast_ref::<hyper::Error>();
    let refusal = if parse.is_some_and(|e| e.is_parse_too_large()) {
        Some(Refusal::HeadersTooLarge)
    } else if parse.is_some_and(|e| e.is_parse()) {
        Some(Refusal::BadRequest)
    } else {
        None
    };
    match refusal {
        Some(r) => {
            s.metrics.refused_by_parser(r);
            tracing::info!(target: "inband_proxy::access", client = %peer, status = r.status().as_u16(), error = %e, "refused");
        }
        None => tracing::debug!(client = %peer, error = %e, "connection ended with an error"),
    }
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    peer: SocketAddr,
    https: bool,
    conn: Arc<State>,
    client: Arc<ClientSlot>,
    relay: Arc<Relay>,
) -> Result<Response<access::Tracked>, Infallible> {
    crate::probe::request_in();
    let mut req = req;
    let guard = conn.begin_request(req.version() == http::Version::HTTP_2);
    // Interim responses go to HTTP/1.1 clients only (RFC 9110 §15: never
    // to HTTP/1.0; HTTP/2 cannot through hyper), until the final one.
    let _interim = (req.version() == http::Version::HTTP_11).then(|| relay.begin(&mut req));
    let info = access::Request { client: peer, method: req.method().clone(), uri: req.uri().clone(), start: Instant::now() };
    let mut resp = if client.request() {
        respond(&shared, req, peer, https, &conn).await
    } else {
        let mut r = refuse(&shared, Refusal::ClientRate);
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    };
    shared.metrics.response(resp.status(), info.start.elapsed());
    // RFC 9110 §7.6.3: the hop this response took through us.
    resp.headers_mut().append(header::VIA, HeaderValue::from_static("1.1 inband"));
    let cache = resp.extensions().get::<Outcome>().map_or("-", |o| o.label());
    let status = resp.status().as_u16();
    let upstream = resp.extensions().get::<crate::backend::Upstream>().map(|u| u.0.clone());
    let counter = shared.metrics.response_bytes.clone();
    crate::probe::response_out();
    // Not boxed again: hyper takes the body type as it is.
    Ok(resp.map(|b| access::Tracked::new(b, info, status, cache, upstream, guard, counter)))
}

async fn respond(shared: &Arc<Shared>, req: Request<Incoming>, peer: SocketAddr, https: bool, conn: &State) -> Response<ProxyBody> {
    let limit = shared.cfg.raw.max_body_bytes;
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return refuse(shared, Refusal::BodyTooLarge);
    }
    let (mut parts, body) = req.into_parts();
    cache_control::normalize_request(&mut parts);
    // HTTP/2 (and an absolute-form HTTP/1.1 request line) carry the host in
    // the URI: move it to Host so the backend, the cache key and the stored
    // policy see one form whatever the client spoke.
    if let Some(authority) = parts.uri.authority() {
        if !parts.headers.contains_key(header::HOST) {
            if let Ok(v) = HeaderValue::from_str(authority.as_str()) {
                parts.headers.insert(header::HOST, v);
            }
        }
        if let Some(pq) = parts.uri.path_and_query() {
            parts.uri = pq.as_str().parse().expect("a path-and-query is a URI");
        }
    }
    // RFC 9112 §3.2: an HTTP/1.1 request without Host, or any request with
    // two, is 400 — forwarded, it would reach the backend with our choice
    // of Host and be cached under it.
    let hosts = parts.headers.get_all(header::HOST).iter().count();
    if hosts > 1 || (hosts == 0 && parts.version != http::Version::HTTP_10) {
        return refuse(shared, Refusal::BadHost);
    }
    // Buffered so a retry can resend it; the limit bounds the memory.
    let read = tokio::time::timeout(shared.cfg.client_body_timeout(), Limited::new(body, limit as usize).collect());
    let body = match read.await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return refuse(shared, Refusal::BodyTooLarge),
        Ok(Err(_)) => return refuse(shared, Refusal::BadRequest),
        Err(_) => return refuse(shared, Refusal::BodyTimeout),
    };
    shared.metrics.request_bytes.inc_by(body.len() as u64);
    if parts.method.as_str() == "PURGE" {
        return Box::pin(purge(shared, &parts, peer)).await;
    }
    let Some(route) = shared.router.choose(parts.headers.get(header::HOST), parts.uri.path()) else {
        return refuse(shared, Refusal::NoRoute);
    };
    let mut resp = match route.admit(peer.ip()) {
        Ok(()) => forward_on(shared, route, parts, body, peer, https, conn).await.unwrap_or_else(|r| refuse_route(shared, route, r)),
        Err(wait) => {
            let mut r = refuse_route(shared, route, Refusal::RouteRate);
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(wait.as_secs_f64().ceil().max(1.0) as u64));
            r
        }
    };
    // On what the client gets, after the cache: a stored response stays as
    // the origin sent it.
    if route.rewrites_responses {
        route.response_headers.apply(resp.headers_mut());
    }
    resp
}

/// A request to `route`'s pool, through the cache when the route uses it.
async fn forward_on(
    shared: &Arc<Shared>,
    route: &Arc<Route>,
    mut parts: http::request::Parts,
    body: bytes::Bytes,
    peer: SocketAddr,
    https: bool,
    conn: &State,
) -> Result<Response<ProxyBody>, Refusal> {
    // hyper gives an HTTP/1.1 request with Upgrade (or a CONNECT) the
    // means to take the connection over; no other request has one.
    let upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>().map(|on| (tunnel::offer(&shared.cfg.upgrade_allow, &parts.headers), on));
    crate::hop_by_hop::strip(&mut parts.headers);
    forward::add_forwarding(&mut parts.headers, peer, parts.version, https);
    route.request_headers.apply(&mut parts.headers);
    let key = forward::hash_key(&route.pool.hash_key, &parts, peer);
    match upgrade {
        // Past the cache: a 101 is for this connection alone.
        Some((Offer::Allowed(offered), on)) => {
            return Box::pin(tunnel::forward(shared, &route.pool, parts, body, &key, (offered, on), conn)).await;
        }
        Some((Offer::NotAllowed, _)) => shared.metrics.upgrade(Upgrade::NotAllowed),
        Some((Offer::None, _)) | None => {}
    }
    // A route with the cache off neither reads nor writes the store.
    let cache = shared.cache.as_ref().filter(|_| route.cache);
    match cache {
        Some(cache) if cache_layer::applies(&parts) => cache_layer::serve(shared, cache, route, parts, &key).await,
        _ => {
            let sent = Box::pin(forward::send(shared, &route.pool, &parts, body, &key)).await;
            if let (Some(cache), Ok(resp)) = (cache, &sent) {
                let ok = resp.status().is_success() || resp.status().is_redirection();
                if ok && cache_layer::invalidates(&parts.method) {
                    if let Err(e) = Box::pin(cache.invalidate(&parts)).await {
                        tracing::warn!(error = %e, "cache invalidation failed");
                    }
                }
            }
            sent.map(|resp| resp.map(|b| b.map_err(BoxError::from).boxed()))
        }
    }
}

/// `PURGE /path` (with the Host of the cached URL) from an allowed client
/// deletes that URL's entry and all its variants.
async fn purge(shared: &Shared, parts: &http::request::Parts, peer: SocketAddr) -> Response<ProxyBody> {
    let text = |status: StatusCode, t: String| {
        let mut r = Response::new(full(t));
        *r.status_mut() = status;
        r
    };
    if !shared.cfg.raw.purge_allow.contains(&peer.ip()) {
        return text(StatusCode::FORBIDDEN, format!("PURGE not allowed from {}\n", peer.ip()));
    }
    let Some(cache) = &shared.cache else {
        return text(StatusCode::NOT_FOUND, "no cache configured\n".into());
    };
    match cache.purge(parts).await {
        Ok(0) => text(StatusCode::NOT_FOUND, "not cached\n".into()),
        Ok(n) => text(StatusCode::OK, format!("purged {n} entries\n")),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("purge failed: {e:#}\n")),
    }
}

fn refuse(shared: &Shared, r: Refusal) -> Response<ProxyBody> {
    shared.metrics.refusal(r);
    refusal_response(r)
}

fn refuse_route(shared: &Shared, route: &Route, r: Refusal) -> Response<ProxyBody> {
    shared.metrics.route_refusal(&route.name, r);
    refuse(shared, r)
}

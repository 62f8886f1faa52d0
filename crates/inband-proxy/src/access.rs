//! The response body as sent to the client: counts its bytes, ends the
//! request for the connection's timeouts, and writes the access log line
//! when the last byte has gone (or the client went away), with both the
//! time to the response head and the time to the last byte.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Uri};
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;

use crate::backend::Backend;
use crate::body::{BoxError, ProxyBody};
use crate::conn::RequestGuard;

pub struct Request {
    pub client: SocketAddr,
    pub method: Method,
    pub uri: Uri,
    pub start: Instant,
}

pub struct Tracked {
    inner: ProxyBody,
    log: Option<Line>,
    counter: Counter,
}

struct Line {
    req: Request,
    status: u16,
    cache: &'static str,
    /// The backend that answered; none for an answer of the proxy's own
    /// (a hit, a refusal).
    upstream: Option<Arc<Backend>>,
    head_ms: f64,
    bytes: u64,
    guard: RequestGuard,
}

impl Tracked {
    pub fn new(
        inner: ProxyBody,
        req: Request,
        status: u16,
        cache: &'static str,
        upstream: Option<Arc<Backend>>,
        guard: RequestGuard,
        counter: Counter,
    ) -> Tracked {
        let head_ms = req.start.elapsed().as_secs_f64() * 1e3;
        Tracked { inner, log: Some(Line { req, status, cache, upstream, head_ms, bytes: 0, guard }), counter }
    }

    fn finish(&mut self, complete: bool) {
        if let Some(l) = self.log.take() {
            tracing::info!(
                target: "inband_proxy::access",
                client = %l.req.client, method = %l.req.method, uri = %l.req.uri, status = l.status, cache = l.cache,
                upstream = %l.upstream.as_ref().map_or("-", |b| b.name.as_str()), head_ms = l.head_ms, ms = l.req.start.elapsed().as_secs_f64() * 1e3, bytes = l.bytes, complete
            );
        }
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(l) = &mut self.log {
            l.guard.waiting_for_client(false);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    let n = d.len() as u64;
                    self.counter.inc_by(n);
                    if let Some(l) = &mut self.log {
                        l.bytes += n;
                        // hyper asks for the next chunk once the client's
                        // window has room for this one (conn.rs).
                        l.guard.waiting_for_client(n > 0);
                    }
                }
            }
            Poll::Ready(None) => self.finish(true),
            Poll::Ready(Some(Err(_))) => self.finish(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // hyper drops an empty body (304, HEAD) without polling it.
        let complete = self.inner.is_end_stream();
        self.finish(complete);
    }
}

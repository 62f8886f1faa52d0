//! The one health-check client of inband: `inband lb`'s checks, `inband
//! mesh`'s and `inband proxy`'s all probe backends with [`probe`] and count
//! the results with [`Verdicts`], so a backend is judged the same way
//! wherever it is checked. `inband weights` times its latency probes with
//! [`timed`], the same exchange read to the end of the body.
//!
//! A probe is one fresh connection (as HAProxy's and Envoy's checks are):
//! a pooled connection that still works says nothing about whether a new
//! one would be accepted, which is what a new client needs.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;

/// What a probe asks of a backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The connection is accepted.
    Tcp,
    /// `GET path` with `Host: host` answers with a status in `expect`.
    Http { path: String, host: String, expect: Expect },
}

/// The statuses an HTTP check accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// 200-399, as HAProxy's `httpchk` and Envoy's default.
    SuccessOrRedirect,
    Codes(Vec<u16>),
    /// Any status below 500: the server answered. A latency probe counts a
    /// 4xx as served; only a 5xx says it could not serve (a full queue).
    Answered,
}

impl Expect {
    pub fn accepts(&self, status: u16) -> bool {
        match self {
            Expect::SuccessOrRedirect => (200..400).contains(&status),
            Expect::Codes(c) => c.contains(&status),
            Expect::Answered => status < 500,
        }
    }
}

/// Why a probe failed, in the words status and metrics use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The SYN was answered with a RST: nothing listens.
    Refused,
    /// No connection, or no complete answer, within the timeout.
    Timeout,
    /// No route or no neighbour to the backend.
    Unreachable,
    /// An HTTP status the check does not accept.
    BadStatus,
    /// What came back is not an HTTP response.
    Malformed,
    /// The connection closed before a status line.
    Closed,
    /// Any other socket error.
    Error,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    /// The status an HTTP check saw, if one came.
    pub status: Option<u16>,
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

/// A passed probe: the HTTP status, if the check asked for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Passed {
    pub status: Option<u16>,
}

/// A passed [`timed`] probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timed {
    pub status: Option<u16>,
    /// From the connect to the last byte of the body.
    pub elapsed: Duration,
}

/// Probes `target` once, from `source` if given (the address the caller's
/// traffic to it comes from), within `timeout` for the whole exchange.
/// A check needs only the status line; the body is not read.
pub async fn probe(target: SocketAddr, source: Option<IpAddr>, what: &Probe, timeout: Duration) -> Result<Passed, Failure> {
    within(timeout, exchange(target, source, what, Body::Skip)).await
}

/// [`probe`] read to the end of the response's body, and timed: a latency
/// probe measures what a client waits for, the whole response.
pub async fn timed(target: SocketAddr, source: Option<IpAddr>, what: &Probe, timeout: Duration) -> Result<Timed, Failure> {
    let started = std::time::Instant::now();
    let passed = within(timeout, exchange(target, source, what, Body::Read)).await?;
    Ok(Timed { status: passed.status, elapsed: started.elapsed() })
}

async fn within(timeout: Duration, exchange: impl std::future::Future<Output = Result<Passed, Failure>>) -> Result<Passed, Failure> {
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(Failure {
            kind: FailureKind::Timeout,
            status: None,
            detail: format!("no answer within {} ms", timeout.as_millis()),
        }),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Body {
    Skip,
    Read,
}

async fn exchange(target: SocketAddr, source: Option<IpAddr>, what: &Probe, body: Body) -> Result<Passed, Failure> {
    let socket = if target.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }.map_err(io_failure)?;
    if let Some(src) = source {
        socket.bind(SocketAddr::new(src, 0)).map_err(io_failure)?;
    }
    let stream = socket.connect(target).await.map_err(io_failure)?;
    let (path, host, expect) = match what {
        Probe::Tcp => return Ok(Passed { status: None }),
        Probe::Http { path, host, expect } => (path, host, expect),
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(http_failure)?;
    // The connection's task ends with the probe, also when the timeout
    // drops this future first: a backend that never answers holds nothing.
    let _conn = AbortOnDrop(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let request = hyper::Request::get(path.as_str())
        .header(hyper::header::HOST, host.as_str())
        .header(hyper::header::USER_AGENT, "inband-health")
        .header(hyper::header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| Failure { kind: FailureKind::Error, status: None, detail: format!("check request: {e}") })?;
    let response = sender.send_request(request).await.map_err(http_failure)?;
    let status = response.status().as_u16();
    if body == Body::Read {
        // However it breaks (hyper reports a short body as an I/O error),
        // a body cut short means the client got no whole answer.
        response.into_body().collect().await.map_err(|e| Failure {
            kind: FailureKind::Closed,
            status: Some(status),
            detail: format!("the body broke off: {e}"),
        })?;
    }
    if expect.accepts(status) {
        Ok(Passed { status: Some(status) })
    } else {
        Err(Failure { kind: FailureKind::BadStatus, status: Some(status), detail: format!("status {status}") })
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn io_failure(e: std::io::Error) -> Failure {
    let kind = match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => FailureKind::Refused,
        Some(libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EADDRNOTAVAIL) => FailureKind::Unreachable,
        Some(libc::ETIMEDOUT) => FailureKind::Timeout,
        _ => FailureKind::Error,
    };
    Failure { kind, status: None, detail: e.to_string() }
}

fn http_failure(e: hyper::Error) -> Failure {
    let kind = if e.is_parse() || e.is_parse_status() {
        FailureKind::Malformed
    } else if e.is_incomplete_message() || e.is_closed() || e.is_canceled() {
        FailureKind::Closed
    } else {
        FailureKind::Error
    };
    let detail = match kind {
        FailureKind::Malformed => format!("not an HTTP response ({e})"),
        FailureKind::Closed => "connection closed before a status line".into(),
        _ => e.to_string(),
    };
    Failure { kind, status: None, detail }
}

/// Results in a row against the thresholds: a backend goes down after
/// `fall` failures in a row and comes back after `rise` passes in a row.
#[derive(Clone, Copy, Debug, Default)]
pub struct Verdicts {
    fails: u32,
    passes: u32,
}

impl Verdicts {
    /// Records one result for a backend that is now `up`; the new state
    /// when it changes.
    pub fn record(&mut self, rise: u32, fall: u32, up: bool, ok: bool) -> Option<bool> {
        if ok {
            (self.fails, self.passes) = (0, self.passes.saturating_add(1));
            (!up && self.passes >= rise).then_some(true)
        } else {
            (self.fails, self.passes) = (self.fails.saturating_add(1), 0);
            (up && self.fails >= fall).then_some(false)
        }
    }

    /// Results in a row that agree with the last one.
    pub fn in_a_row(&self) -> u32 {
        self.fails.max(self.passes)
    }
}

/// The `[health]` table of `inband proxy` and `inband mesh`: a GET of
/// `path` on every backend each `interval_ms`, 2xx or 3xx passing. Each
/// checks the bounds it needs when it loads its config.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpCheckConfig {
    #[serde(default = "default_health_path")]
    pub path: String,
    #[serde(default = "default_health_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "default_health_timeout_ms")]
    pub timeout_ms: u64,
    /// Consecutive failed checks that eject a backend.
    #[serde(default = "default_unhealthy_after")]
    pub unhealthy_after: u32,
    /// Consecutive passed checks that readmit it.
    #[serde(default = "default_healthy_after")]
    pub healthy_after: u32,
}

fn default_health_path() -> String {
    "/".into()
}
fn default_health_interval_ms() -> u64 {
    2000
}
fn default_health_timeout_ms() -> u64 {
    1000
}
fn default_unhealthy_after() -> u32 {
    3
}
fn default_healthy_after() -> u32 {
    2
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn http(expect: Expect) -> Probe {
        Probe::Http { path: "/health".into(), host: "svc.example".into(), expect }
    }

    /// A server that answers one connection with `reply` (after reading the
    /// request head), then closes; returns its address.
    async fn answering(reply: &'static [u8]) -> (SocketAddr, tokio::task::JoinHandle<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 512];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut b).await.unwrap();
                if n == 0 {
                    break;
                }
                head.extend_from_slice(&b[..n]);
            }
            s.write_all(reply).await.unwrap();
            head
        });
        (addr, task)
    }

    const T: Duration = Duration::from_secs(2);

    #[tokio::test]
    async fn http_checks_pass_on_an_expected_status_and_send_path_and_host() {
        let (addr, server) = answering(b"HTTP/1.1 204 No Content\r\n\r\n").await;
        let r = probe(addr, None, &http(Expect::SuccessOrRedirect), T).await;
        assert_eq!(r, Ok(Passed { status: Some(204) }));
        let head = String::from_utf8(server.await.unwrap()).unwrap();
        assert!(head.starts_with("GET /health HTTP/1.1\r\n"), "{head}");
        assert!(head.to_ascii_lowercase().contains("host: svc.example\r\n"), "{head}");
    }

    #[tokio::test]
    async fn a_status_outside_expect_fails_with_it() {
        let (addr, _s) = answering(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
        let e = probe(addr, None, &http(Expect::SuccessOrRedirect), T).await.unwrap_err();
        assert_eq!((e.kind, e.status), (FailureKind::BadStatus, Some(503)));
        let (addr, _s) = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
        let e = probe(addr, None, &http(Expect::Codes(vec![204])), T).await.unwrap_err();
        assert_eq!((e.kind, e.status), (FailureKind::BadStatus, Some(200)));
    }

    #[tokio::test]
    async fn garbage_is_malformed_and_a_silent_close_is_closed() {
        let (addr, _s) = answering(b"SSH-2.0-OpenSSH_9.2\r\n\r\n").await;
        let e = probe(addr, None, &http(Expect::SuccessOrRedirect), T).await.unwrap_err();
        assert_eq!(e.kind, FailureKind::Malformed, "{e}");
        let (addr, _s) = answering(b"").await;
        let e = probe(addr, None, &http(Expect::SuccessOrRedirect), T).await.unwrap_err();
        assert_eq!(e.kind, FailureKind::Closed, "{e}");
    }

    #[tokio::test]
    async fn a_server_that_accepts_and_never_answers_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _hold = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        });
        let t0 = std::time::Instant::now();
        let e = probe(addr, None, &http(Expect::SuccessOrRedirect), Duration::from_millis(300)).await.unwrap_err();
        assert_eq!(e.kind, FailureKind::Timeout);
        assert!(t0.elapsed() < Duration::from_secs(2), "the timeout bounds the probe: {:?}", t0.elapsed());
        // TCP checks pass on the accept alone.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        assert_eq!(probe(l.local_addr().unwrap(), None, &Probe::Tcp, T).await, Ok(Passed { status: None }));
    }

    #[tokio::test]
    async fn nothing_listening_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let e = probe(addr, None, &Probe::Tcp, T).await.unwrap_err();
        assert_eq!(e.kind, FailureKind::Refused);
    }

    #[tokio::test]
    async fn a_timed_probe_waits_for_the_whole_body_and_fails_only_on_5xx() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _slow = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 512];
            let _ = s.read(&mut b).await.unwrap();
            s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nab").await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            s.write_all(b"cd").await.unwrap();
        });
        let answered = Probe::Http { path: "/".into(), host: "h".into(), expect: Expect::Answered };
        let t = timed(addr, None, &answered, T).await.unwrap();
        assert_eq!(t.status, Some(404));
        assert!(t.elapsed >= Duration::from_millis(200), "the body's last bytes came 200 ms after the head: {t:?}");
        let (addr, _s) = answering(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
        let e = timed(addr, None, &answered, T).await.unwrap_err();
        assert_eq!((e.kind, e.status), (FailureKind::BadStatus, Some(503)));
        let (addr, _s) = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort").await;
        let e = timed(addr, None, &answered, T).await.unwrap_err();
        assert_eq!(e.kind, FailureKind::Closed, "a body cut short is no answer: {e}");
    }

    #[test]
    fn verdicts_change_state_only_after_rise_or_fall_in_a_row() {
        let mut v = Verdicts::default();
        assert_eq!(v.record(2, 3, true, false), None);
        assert_eq!(v.record(2, 3, true, false), None);
        assert_eq!(v.record(2, 3, true, true), None, "a pass breaks the run of failures");
        assert_eq!(v.record(2, 3, true, false), None);
        assert_eq!(v.record(2, 3, true, false), None);
        assert_eq!(v.record(2, 3, true, false), Some(false));
        assert_eq!(v.in_a_row(), 3);
        assert_eq!(v.record(2, 3, false, true), None);
        assert_eq!(v.record(2, 3, false, false), None, "a failure breaks the run of passes");
        assert_eq!(v.record(2, 3, false, true), None);
        assert_eq!(v.record(2, 3, false, true), Some(true));
    }
}

//! `inband bench openloop`: HTTP/1.1 requests at a fixed rate, each on a
//! new connection, whatever the answers' pace (an open loop, like wrk2):
//! latency counts from each request's scheduled send time, so a server
//! that falls behind is charged for the queue it built instead of slowing
//! the load down (coordinated omission). Balancers are compared at equal
//! throughput this way.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use inband_health::{FailureKind, Probe};

#[derive(clap::Args, Debug)]
pub struct OpenLoopArgs {
    /// http://IP:PORT/PATH (an address, not a name: no resolver in the loop).
    #[arg(long)]
    pub url: String,
    /// Requests per second.
    #[arg(long)]
    pub rate: f64,
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// A request without its whole answer by then is an error.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Requests outstanding at most; one due beyond it is counted as shed
    /// rather than sent (bounds the generator's memory when the target stalls).
    #[arg(long, default_value_t = 4096)]
    pub max_in_flight: usize,
}

#[derive(Debug, Default, Serialize)]
pub struct OpenLoopResult {
    pub rate: f64,
    pub seconds: f64,
    pub sent: u64,
    pub ok: u64,
    pub errors: u64,
    pub connect_errors: u64,
    pub exchange_errors: u64,
    pub timeouts: u64,
    pub status_5xx: u64,
    pub shed: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub achieved_rps: f64,
}

fn target(url: &str) -> Result<(SocketAddr, String)> {
    let uri: hyper::Uri = url.parse().with_context(|| format!("--url {url:?} is not a URL"))?;
    if uri.scheme_str() != Some("http") {
        bail!("--url {url:?}: only http:// URLs");
    }
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    let addr: SocketAddr = authority
        .parse()
        .or_else(|_| format!("{authority}:80").parse())
        .with_context(|| format!("--url {url:?}: the host must be an IP address (with an optional port)"))?;
    let path = uri.path_and_query().map_or("/".to_string(), |p| p.as_str().to_string());
    Ok((addr, path))
}

pub fn run(a: &OpenLoopArgs) -> Result<OpenLoopResult> {
    let (addr, path) = target(&a.url)?;
    if !(a.rate > 0.0 && a.rate <= 100_000.0) {
        bail!("--rate {}: expected 0 < rate <= 100000", a.rate);
    }
    if !(a.seconds > 0.0 && a.seconds <= 3600.0) {
        bail!("--seconds {}: expected 0 < seconds <= 3600", a.seconds);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(drive(a, addr, path))
}

async fn drive(a: &OpenLoopArgs, addr: SocketAddr, path: String) -> Result<OpenLoopResult> {
    let total = (a.rate * a.seconds).round() as u64;
    let timeout = Duration::from_millis(a.timeout_ms);
    let probe = Probe::Http { path, host: addr.to_string(), expect: inband_health::Expect::Answered };
    let done: Arc<Mutex<Vec<Result<f64, FailureKind>>>> = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut out = OpenLoopResult { rate: a.rate, seconds: a.seconds, ..Default::default() };
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / a.rate);
        tokio::time::sleep_until(due.into()).await;
        out.sent += 1;
        if in_flight.load(std::sync::atomic::Ordering::Relaxed) >= a.max_in_flight {
            out.shed += 1;
            continue;
        }
        in_flight.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (done, in_flight, probe) = (done.clone(), in_flight.clone(), probe.clone());
        tasks.push(tokio::spawn(async move {
            let r = inband_health::timed(addr, None, &probe, timeout).await.map(|_| due.elapsed().as_secs_f64() * 1e3).map_err(|f| f.kind);
            done.lock().unwrap().push(r);
            in_flight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }));
    }
    // Every request ends by its timeout: this wait is bounded.
    for t in tasks {
        let _ = t.await;
    }
    let mut lat = Vec::new();
    for r in done.lock().unwrap().iter() {
        match r {
            Ok(ms) => lat.push(*ms),
            Err(FailureKind::Refused | FailureKind::Unreachable) => out.connect_errors += 1,
            Err(FailureKind::Closed | FailureKind::Malformed | FailureKind::Error) => out.exchange_errors += 1,
            Err(FailureKind::Timeout) => out.timeouts += 1,
            Err(FailureKind::BadStatus) => out.status_5xx += 1,
        }
    }
    out.ok = lat.len() as u64;
    out.errors = out.sent - out.ok;
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| if lat.is_empty() { f64::NAN } else { lat[((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1] };
    out.mean_ms = if lat.is_empty() { f64::NAN } else { lat.iter().sum::<f64>() / lat.len() as f64 };
    out.p50_ms = pct(0.50);
    out.p90_ms = pct(0.90);
    out.p99_ms = pct(0.99);
    out.max_ms = lat.last().copied().unwrap_or(f64::NAN);
    out.achieved_rps = out.ok as f64 / a.seconds;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_an_address_and_a_path() {
        assert_eq!(target("http://10.0.0.1:8080/x?y=1").unwrap(), ("10.0.0.1:8080".parse().unwrap(), "/x?y=1".into()));
        assert_eq!(target("http://10.0.0.1/").unwrap().0.port(), 80);
        assert!(target("https://10.0.0.1/").is_err());
        assert!(format!("{:#}", target("http://example.com/").unwrap_err()).contains("IP address"));
    }
}

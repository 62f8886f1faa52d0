//! Active health checks: one task per backend, GET of a path at an interval.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;

use crate::backend::Backend;
use crate::config::HealthConfig;
use crate::forward::BackendClient;

pub fn spawn(cfg: HealthConfig, client: BackendClient, backend: Arc<Backend>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut verdicts = Verdicts::default();
        loop {
            tick.tick().await;
            let ok = check(&cfg, &client, &backend).await;
            match verdicts.record(&cfg, backend.is_checked_up(), ok) {
                Some(true) => {
                    backend.set_checked_up(true);
                    tracing::info!(backend = %backend.name, "backend readmitted (health check)");
                }
                Some(false) => {
                    backend.set_checked_up(false);
                    tracing::warn!(backend = %backend.name, "backend ejected (health check)");
                }
                None => {}
            }
        }
    })
}

/// Checks in a row against the thresholds, for the proxy's checks and
/// `inband mesh`'s: a backend goes out after `unhealthy_after` failures in
/// a row and comes back after `healthy_after` passes in a row.
#[derive(Default)]
pub struct Verdicts {
    fails: u32,
    passes: u32,
}

impl Verdicts {
    /// Records one check of a backend that is now `up`; the new state when
    /// it changes.
    pub fn record(&mut self, cfg: &HealthConfig, up: bool, ok: bool) -> Option<bool> {
        if ok {
            (self.fails, self.passes) = (0, self.passes + 1);
            (!up && self.passes >= cfg.healthy_after).then_some(true)
        } else {
            (self.fails, self.passes) = (self.fails + 1, 0);
            (up && self.fails >= cfg.unhealthy_after).then_some(false)
        }
    }
}

/// Passes on a 2xx or 3xx within the timeout.
async fn check(cfg: &HealthConfig, client: &BackendClient, b: &Backend) -> bool {
    let uri = format!("http://{}{}", b.name, cfg.path);
    let Ok(req) = Request::get(uri).header("user-agent", "inband-proxy-health").body(Full::new(Bytes::new())) else {
        return false;
    };
    match tokio::time::timeout(Duration::from_millis(cfg.timeout_ms), client.request(req)).await {
        Ok(Ok(resp)) => {
            let s = resp.status();
            // Drain so the pooled connection can be reused for the next check.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            s.is_success() || s.is_redirection()
        }
        _ => false,
    }
}

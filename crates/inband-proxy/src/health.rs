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
        let (mut fails, mut passes) = (0u32, 0u32);
        loop {
            tick.tick().await;
            let ok = check(&cfg, &client, &backend).await;
            if ok {
                fails = 0;
                passes += 1;
                if !backend.is_checked_up() && passes >= cfg.healthy_after {
                    backend.set_checked_up(true);
                    tracing::info!(backend = %backend.name, passes, "backend readmitted (health check)");
                }
            } else {
                passes = 0;
                fails += 1;
                if backend.is_checked_up() && fails >= cfg.unhealthy_after {
                    backend.set_checked_up(false);
                    tracing::warn!(backend = %backend.name, fails, "backend ejected (health check)");
                }
            }
        }
    })
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

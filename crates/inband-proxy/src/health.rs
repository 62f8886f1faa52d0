//! Active health checks: one task per backend, a GET of a path at an
//! interval, through the project's one health-check client
//! (`inband_health`): a fresh connection per check, 2xx or 3xx passes.

use std::sync::Arc;
use std::time::Duration;

use inband_health::{Expect, HttpCheckConfig, Probe, Verdicts};

use crate::backend::Backend;

pub fn spawn(cfg: HttpCheckConfig, backend: Arc<Backend>, addr: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let probe = Probe::Http { path: cfg.path.clone(), host: backend.name.clone(), expect: Expect::SuccessOrRedirect };
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let mut verdicts = Verdicts::default();
        loop {
            tick.tick().await;
            let outcome = inband_health::probe(addr, None, &probe, timeout).await;
            match verdicts.record(cfg.healthy_after, cfg.unhealthy_after, backend.is_checked_up(), outcome.is_ok()) {
                Some(true) => {
                    backend.set_checked_up(true);
                    tracing::info!(backend = %backend.name, "backend readmitted (health check)");
                }
                Some(false) => {
                    backend.set_checked_up(false);
                    let why = outcome.err().map(|f| f.to_string()).unwrap_or_default();
                    tracing::warn!(backend = %backend.name, reason = %why, "backend ejected (health check)");
                }
                None => {}
            }
        }
    })
}

//! Active health checks: one task per backend, a GET of a path at an
//! interval, on a fresh connection each time, 2xx or 3xx passes. A
//! plaintext HTTP/1.1 pool is checked by the project's one health-check
//! client (`inband_health`); a pool spoken to over TLS or HTTP/2 by its own
//! transport, so a check proves what requests need: the handshake, the
//! certificate's verification, the protocol.

use std::sync::Arc;
use std::time::Duration;

use inband_health::{Expect, HttpCheckConfig, Probe, Verdicts};

use crate::backend::Backend;
use crate::config::BackendProtocol;
use crate::upstream::Transport;

pub(crate) fn spawn(cfg: HttpCheckConfig, backend: Arc<Backend>, addr: std::net::SocketAddr, transport: Arc<Transport>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let probe = Probe::Http { path: cfg.path.clone(), host: backend.name.clone(), expect: Expect::SuccessOrRedirect };
        let plain = transport.protocol == BackendProtocol::Http1 && transport.scheme() == http::uri::Scheme::HTTP;
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let mut verdicts = Verdicts::default();
        loop {
            tick.tick().await;
            let outcome: Result<(), String> = if plain {
                inband_health::probe(addr, None, &probe, timeout).await.map(drop).map_err(|f| f.to_string())
            } else {
                match tokio::time::timeout(timeout, transport.check(&backend, &cfg.path)).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("no answer within {} ms", cfg.timeout_ms)),
                }
            };
            match verdicts.record(cfg.healthy_after, cfg.unhealthy_after, backend.is_checked_up(), outcome.is_ok()) {
                Some(true) => {
                    backend.set_checked_up(true);
                    tracing::info!(backend = %backend.name, "backend readmitted (health check)");
                }
                Some(false) => {
                    backend.set_checked_up(false);
                    let why = outcome.err().unwrap_or_default();
                    tracing::warn!(backend = %backend.name, reason = %why, "backend ejected (health check)");
                }
                None => {}
            }
        }
    })
}

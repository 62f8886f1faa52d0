//! Active HTTP health checks (`[health]`): a GET of one path on each
//! backend, on a connection of its own, every interval. A backend that
//! fails `unhealthy_after` checks in a row is taken out (no slot of it is
//! claimed) until it passes `healthy_after` in a row. The pools' own
//! checks (connect, TCP state) catch a dead backend; these catch one that
//! accepts connections but answers errors.

use std::net::SocketAddrV4;
use std::rc::Rc;
use std::time::Duration;

use inband_health::{Expect, HttpCheckConfig, Probe, Verdicts};
use tracing::{info, warn};

use super::state::MeshState;

pub async fn check(sh: Rc<MeshState>, backend: u32, addr: SocketAddrV4, hc: HttpCheckConfig) {
    let mut tick = tokio::time::interval(Duration::from_millis(hc.interval_ms));
    let probe = Probe::Http { path: hc.path.clone(), host: addr.to_string(), expect: Expect::SuccessOrRedirect };
    let timeout = Duration::from_millis(hc.timeout_ms);
    let (mut passing, mut verdicts) = (true, Verdicts::default());
    loop {
        tick.tick().await;
        let outcome = inband_health::probe(addr.into(), None, &probe, timeout).await;
        match verdicts.record(hc.healthy_after, hc.unhealthy_after, passing, outcome.is_ok()) {
            Some(true) => info!(%addr, "health checks pass again: backend back in"),
            Some(false) => {
                let why = outcome.err().map(|f| f.to_string()).unwrap_or_default();
                warn!(%addr, "health checks fail ({why}): backend taken out");
            }
            None => continue,
        }
        passing = !passing;
        sh.health.checked(&sh.dp, backend, passing);
    }
}

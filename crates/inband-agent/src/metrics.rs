//! `metrics = "addr:port"` in agent.toml: `/metrics` (Prometheus) and
//! `/status` (the JSON of `inband agent status --json`, with the programs'
//! run counts), read from the pins at each request on a thread of its own
//! (`inband_http::spawn`), so a scraper never slows the agent's loop.

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use inband_core::bpfmap::PinDir;
use inband_core::prog_stats;
use inband_http::{gauge_value as g, Families, Reply, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;
use tracing::info;

use super::config::ScoreSource;
use super::tables::{AgentMaps, AgentSnapshot};

/// What the endpoint reads: the agent's pins and programs.
pub struct Source {
    pub interface: String,
    pub pins: PinDir,
    pub score: ScoreSource,
    pub programs: Vec<(&'static str, OwnedFd)>,
    /// The agent turned run-time statistics on (the sysctl does not show it).
    pub bpf_stats: bool,
}

impl Source {
    fn read(&self) -> Result<AgentSnapshot> {
        let mut s = AgentMaps::open(&self.pins)?.snapshot(&self.interface, Some(self.score))?;
        s.bpf_stats |= self.bpf_stats;
        for (name, fd) in &self.programs {
            s.programs.push(prog_stats::of_fd(name, fd.as_fd())?);
        }
        Ok(s)
    }
}

/// Serves until `stop`.
pub fn serve(addr: SocketAddr, source: Source, stop: &Arc<AtomicBool>) -> Result<std::thread::JoinHandle<()>> {
    let stop = Arc::clone(stop);
    let until = async move {
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let handler = move |path: &str| match (path, source.read()) {
        ("/metrics", Ok(s)) => Reply::metrics(&prometheus(s)),
        ("/status", Ok(s)) => Reply::json(serde_json::to_string(&s).unwrap_or_default()),
        ("/metrics" | "/status", Err(e)) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
        _ => Reply::text(StatusCode::NOT_FOUND, "/metrics or /status\n"),
    };
    let (addr, thread) = inband_http::spawn("agent-metrics", addr, handler, until).with_context(|| format!("metrics endpoint {addr}"))?;
    info!(%addr, "metrics at http://{addr}/metrics, status at http://{addr}/status");
    Ok(thread)
}

pub fn prometheus(s: AgentSnapshot) -> Registry {
    let mut r = Registry::with_prefix("inband_agent");
    r.register_collector(Box::new(Exposition(s)));
    r
}

#[derive(Debug)]
struct Exposition(AgentSnapshot);

impl Collector for Exposition {
    fn encode(&self, encoder: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let mut f = Families(encoder);
        f.counters(
            "events",
            "What the agent's programs counted, by event (docs/agent.md, the counters of `inband agent status`)",
            s.counters.iter().map(|(name, n)| ([("event", *name)], *n)),
        )?;
        f.gauge("dsr_flows", "Connections whose client tuple (155) was accepted", g(s.dsr_flows as u64))?;
        f.gauge("closed_flows", "Client tuples of connections the server closed first, kept for their TIME_WAIT", g(s.closed_flows as u64))?;
        let port = |p: &u16| [("port", p.to_string())];
        f.gauges(
            "port_active_connections",
            "Connections the port counts now (the score of connection-counting services)",
            s.ports.iter().map(|(p, st)| (port(p), st.active_connections)),
        )?;
        f.gauges("port_score", "What a 125 or a poll reply for the port carries now", s.ports.iter().map(|(p, st)| (port(p), i64::from(st.score))))?;
        f.programs("agent", s.programs.iter().map(|p| (p.program.as_str(), p.runs, p.run_time_ns)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::{AuthStatus, PortStatus};
    use inband_core::auth::AuthMode;
    use inband_core::prog_stats::ProgStats;

    /// OpenMetrics with a HELP and TYPE for every family, under the names
    /// the dashboard and docs use.
    #[test]
    fn the_metrics_parse_with_help_and_type() {
        let s = AgentSnapshot {
            interface: "eth0".into(),
            score_source: Some(ScoreSource::Connections),
            balancers: vec!["10.0.0.2".parse().unwrap()],
            auth: AuthStatus { mode: AuthMode::Siphash, key_ids: vec![1] },
            mtu: 1500,
            ports: [(8080, PortStatus { vips: vec!["10.0.0.100:80".into()], active_connections: 3, requests_in_flight: None, score_override: None, score: 3 })].into(),
            dsr_flows: 3,
            closed_flows: 2,
            counters: [("tuples_stored", 4), ("scores_sent", 2)].into(),
            bpf_stats: true,
            programs: vec![ProgStats { program: "egress".into(), id: 9, runs: 10, run_time_ns: 2_000 }],
        };
        let text = inband_http::encode(&prometheus(s)).unwrap();
        inband_http::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        for line in [
            "# TYPE inband_agent_events counter",
            "inband_agent_events_total{event=\"tuples_stored\"} 4",
            "inband_agent_dsr_flows 3",
            "inband_agent_closed_flows 2",
            "inband_agent_port_score{port=\"8080\"} 3",
            "inband_agent_port_active_connections{port=\"8080\"} 3",
            "inband_agent_bpf_program_runs_total{program=\"egress\"} 10",
            "inband_agent_bpf_program_run_seconds_total{program=\"egress\"} 0.000002",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
    }
}

//! `inband shadow follow`: next hops that join and leave by BGP.
//!
//! In a fabric, the VIP's next hops announce it (each balancer instance,
//! or each server, through its own BGP speaker) and the router's routing
//! daemon installs what it learns. If the daemon wrote the VIP's route
//! itself, every change would be plain ECMP. So the daemon installs the
//! learned routes into a table of their own (BIRD's `kernel table N`,
//! FRR's `table N`), and this loop carries each change of that set into
//! the VIP's real route through [`route::apply`], which writes the shadow
//! table first. The kernel's tables are the only state: a restarted loop
//! compares the learned set with the route it finds and goes on.
//!
//! A server the routing daemon still lists is alive as far as this loop
//! knows (its hold time decides); one it no longer lists may die later,
//! or come back, with nothing learned changing: so the loop also watches
//! those servers' links, and a change rewrites their shadow hops.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tracing::{info, warn};

use super::route::{self, RouterConfig};
use inband_core::command::ip;

/// The next hops the routing daemon installed for the VIP in `table`, as
/// config names in config order (the order the VIP's route lists them),
/// and the gateways no `[[server]]` has (announced by someone unknown).
pub fn learned(cfg: &RouterConfig, table: u32) -> Result<(Vec<String>, Vec<IpAddr>)> {
    let out = match ip(&[cfg.family(), "-j", "route", "show", "table", &table.to_string(), &cfg.vip_prefix()]) {
        Ok(out) => out,
        // The kernel makes a table with its first route: none learned yet.
        Err(e) if format!("{e:#}").contains("table does not exist") => return Ok((Vec::new(), Vec::new())),
        Err(e) => return Err(e),
    };
    parse_learned(cfg, &out.stdout)
}

/// `learned` from `ip -j route show` output.
fn parse_learned(cfg: &RouterConfig, json: &[u8]) -> Result<(Vec<String>, Vec<IpAddr>)> {
    let routes: Vec<serde_json::Value> = serde_json::from_slice(json).context("reading `ip -j route` output")?;
    let Some(route) = routes.first() else { return Ok((Vec::new(), Vec::new())) };
    let hops = match route["nexthops"].as_array() {
        Some(h) => h.clone(),
        None => vec![route.clone()],
    };
    // An IPv4 VIP's route has IPv6 next hops (BGP's extended next hop,
    // RFC 8950), printed as "via" instead of "gateway". An IPv4 gateway
    // is no server's `via`: unknown.
    let gateways: Vec<IpAddr> = hops.iter().filter_map(|h| h["gateway"].as_str().or(h["via"]["host"].as_str())?.parse().ok()).collect();
    let names = cfg.server.iter().filter(|s| gateways.contains(&IpAddr::V6(s.via))).map(|s| s.name.clone()).collect();
    let unknown = gateways.into_iter().filter(|g| !cfg.server.iter().any(|s| IpAddr::V6(s.via) == *g)).collect();
    Ok((names, unknown))
}

/// Follows `table` every `interval` until `stop`; each change of the
/// learned set becomes one shadow-preserving change of the VIP's route,
/// and every `liveness` a death or revival of a server outside it a
/// rewrite of its shadow hops.
pub fn follow(cfg: &RouterConfig, table: u32, interval: Duration, liveness: Duration, stop: &AtomicBool) -> Result<()> {
    info!(vip = %cfg.vip, table, "following the next hops the routing daemon learns");
    // The learned set last applied, and the servers dead then.
    let mut applied: Option<(Vec<String>, BTreeSet<String>)> = None;
    let mut checked = Instant::now();
    let mut warned: Vec<IpAddr> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match learned(cfg, table) {
            Ok((names, unknown)) => {
                for g in unknown.iter().filter(|g| !warned.contains(g)) {
                    warn!(gateway = %g, table, "the VIP is announced from a next hop no [[server]] in the config has: ignored");
                }
                warned = unknown;
                let mut due = applied.as_ref().is_none_or(|(set, _)| *set != names);
                if !due && checked.elapsed() >= liveness {
                    checked = Instant::now();
                    match route::dead(cfg, &names) {
                        Ok(dead) => due = applied.as_ref().is_some_and(|(_, was)| *was != dead),
                        Err(e) => warn!(error = %format!("{e:#}"), "reading the servers' links failed"),
                    }
                }
                if due {
                    match route::apply(cfg, &names, true, &[]) {
                        Ok(dead) => applied = Some((names, dead)),
                        // Tried again on the next pass; the route stays as it was.
                        Err(e) => warn!(error = %format!("{e:#}"), "changing the VIP's next hops failed"),
                    }
                }
            }
            Err(e) => warn!(error = %format!("{e:#}"), table, "reading the learned next hops failed"),
        }
        std::thread::sleep(interval);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learned_next_hops_are_read_from_gateways_and_from_an_ipv4_routes_ipv6_next_hops() {
        let text = "vip = \"10.81.0.100\"\nanchor = \"inb0\"\nshadow_sid = \"fd00:81:5f::5\"\n\
            [[server]]\nname = \"b1\"\nsid = \"fd00:81:51::b\"\ndirect_sid = \"fd00:81:51::d\"\nvia = \"fd00:81:31::2\"\ndev = \"b1\"\n\
            [[server]]\nname = \"b2\"\nsid = \"fd00:81:52::b\"\ndirect_sid = \"fd00:81:52::d\"\nvia = \"fd00:81:32::2\"\ndev = \"b2\"\n";
        let cfg: RouterConfig = toml::from_str(text).unwrap();
        // As `ip -4 -j route` prints an RFC 8950 multipath route, with an IPv4 gateway among them.
        let v4 = br#"[{"dst":"10.81.0.100","flags":[],"nexthops":[{"via":{"family":"inet6","host":"fd00:81:32::2"},"dev":"b2","weight":1,"flags":[]},{"gateway":"10.81.33.2","dev":"b3","weight":1,"flags":[]}]}]"#;
        let (names, unknown) = parse_learned(&cfg, v4).unwrap();
        assert_eq!((names, unknown), (vec!["b2".to_string()], vec!["10.81.33.2".parse::<IpAddr>().unwrap()]));
        let v6 = br#"[{"dst":"fd00:81::100","gateway":"fd00:81:31::2","dev":"b1","flags":[]}]"#;
        assert_eq!(parse_learned(&cfg, v6).unwrap(), (vec!["b1".to_string()], vec![]));
        assert_eq!(parse_learned(&cfg, b"[]").unwrap(), (vec![], vec![]));
    }
}

//! What a running mesh daemon's maps say, read from its pins (no daemon
//! round trip): `inband mesh status`, the `/status` JSON and `/metrics`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Result};
use serde::Serialize;

use super::dataplane::{
    backend_line, pin_dir, read_counters, MeshBackend, ServiceKey, ServiceValue, Slot,
};
use crate::bpf::shared as c;
use crate::bpfmap::PinDir;

#[derive(Debug, Serialize)]
pub struct Status {
    pub services: Vec<ServiceStatus>,
    pub backends: Vec<BackendStatus>,
    pub counters: Vec<(String, u64)>,
}

#[derive(Debug, Serialize)]
pub struct ServiceStatus {
    pub address: String,
    pub routes: Vec<RouteStatus>,
}

#[derive(Debug, Serialize)]
pub struct RouteStatus {
    pub path_prefix: String,
    /// `name: value`, if the route matches a header.
    pub header: Option<String>,
    pub policy: String,
    pub timeout_ms: u32,
    /// (weight, backend addresses) per cluster.
    pub clusters: Vec<(u32, Vec<String>)>,
}

#[derive(Debug, Serialize)]
pub struct BackendStatus {
    pub address: String,
    pub up: bool,
    pub in_flight: i32,
    pub requests: u64,
    pub pool: u32,
    /// Slots by state: connected and free, carrying a request by the
    /// kernel, relayed by the daemon, down (connecting or retired).
    pub free: u32,
    pub kernel: u32,
    pub user: u32,
    pub down: u32,
}

pub fn read(pins: &PinDir) -> Result<Status> {
    if !pins.exists() {
        bail!("no inband mesh running with pins at {} (start one with `inband mesh run --config FILE`)", pins.0.display());
    }
    let counters = read_counters(&pins.open("mesh_stats")?)?
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
    let services_map = pins.open("mesh_services")?;
    let backends_map = pins.open("mesh_backends")?;
    let address_of = |i: u32| -> Result<String> {
        let b: MeshBackend = crate::bpfmap::get(&backends_map, &i)?.unwrap_or_default();
        Ok(backend_line(&b).0.to_string())
    };
    let mut services = Vec::new();
    for (k, v) in crate::bpfmap::entries::<ServiceKey, ServiceValue>(&services_map)? {
        let mut routes = Vec::new();
        for rt in v.routes.iter().take(v.n_routes as usize) {
            let text = |bytes: &[std::os::raw::c_char], n: u32| {
                String::from_utf8_lossy(
                    &bytes
                        .iter()
                        .take(n as usize)
                        .map(|b| *b as u8)
                        .collect::<Vec<u8>>(),
                )
                .into_owned()
            };
            let mut clusters = Vec::new();
            for split in rt.splits.iter().filter(|s| s.weight > 0) {
                let list = split
                    .backends
                    .iter()
                    .take(split.n_backends as usize)
                    .map(|i| address_of(*i))
                    .collect::<Result<_>>()?;
                clusters.push((split.weight, list));
            }
            routes.push(RouteStatus {
                path_prefix: text(&rt.prefix, rt.prefix_len),
                header: (rt.hname_len > 0).then(|| {
                    format!(
                        "{}: {}",
                        text(&rt.hname, rt.hname_len),
                        text(&rt.hvalue, rt.hvalue_len)
                    )
                }),
                policy: match rt.policy {
                    c::INBAND_MESH_RANDOM => "random",
                    c::INBAND_MESH_LEAST_REQUEST => "least-request",
                    _ => "round-robin",
                }
                .into(),
                timeout_ms: rt.timeout_ms,
                clusters,
            });
        }
        services.push(ServiceStatus {
            address: format!(
                "{}:{}",
                std::net::Ipv4Addr::from(u32::from_be(k.ip4)),
                u16::from_be(k.port as u16)
            ),
            routes,
        });
    }
    services.sort_by(|a, b| a.address.cmp(&b.address));
    let slots_map = pins.open("mesh_slots")?;
    let mut backends = Vec::new();
    for i in 0..c::INBAND_MESH_MAX_BACKENDS {
        let Some(b) = crate::bpfmap::get::<u32, MeshBackend>(&backends_map, &i)? else {
            break;
        };
        if b.pool == 0 {
            break;
        }
        let (addr, in_flight, requests) = backend_line(&b);
        let mut st = BackendStatus {
            address: addr.to_string(),
            up: b.up != 0,
            in_flight,
            requests,
            pool: b.pool,
            free: 0,
            kernel: 0,
            user: 0,
            down: 0,
        };
        for k in 0..b.pool {
            let s: Slot = crate::bpfmap::get(&slots_map, &(b.slot_base + k))?.unwrap_or_default();
            match s.state {
                c::INBAND_MESH_SLOT_FREE => st.free += 1,
                c::INBAND_MESH_SLOT_KERNEL => st.kernel += 1,
                c::INBAND_MESH_SLOT_USER => st.user += 1,
                _ => st.down += 1,
            }
        }
        backends.push(st);
    }
    Ok(Status {
        services,
        backends,
        counters,
    })
}

pub fn print(name: &str, json: bool) -> Result<()> {
    let st = read(&pin_dir(name))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
    } else {
        print!("{}", render(&format!("inband mesh {name}"), &st));
    }
    Ok(())
}

/// Every running mesh daemon's pins on this host: (title, pins), the host's
/// own namespace first, then each named one.
pub fn discover() -> Vec<(String, PinDir)> {
    let mut out = Vec::new();
    let mut roots = vec![("host".to_string(), PathBuf::from("/sys/fs/bpf/inband"))];
    if let Ok(rd) = std::fs::read_dir("/sys/fs/bpf/inband/netns") {
        let mut named: Vec<_> = rd
            .filter_map(|e| e.ok())
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .collect();
        named.sort();
        roots.extend(named);
    }
    for (netns, root) in roots {
        let Ok(rd) = std::fs::read_dir(root.join("mesh")) else {
            continue;
        };
        let mut names: Vec<_> = rd
            .filter_map(|e| e.ok())
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .collect();
        names.sort();
        for (name, dir) in names {
            out.push((
                format!("inband mesh {name} (network namespace {netns})"),
                PinDir(dir),
            ));
        }
    }
    out
}

pub fn render(title: &str, st: &Status) -> String {
    let mut out = format!("{title}\nservices:\n");
    for s in &st.services {
        out += &format!("  {}\n", s.address);
        for r in &s.routes {
            let header = r
                .header
                .as_ref()
                .map_or(String::new(), |h| format!(" [{h}]"));
            let clusters: Vec<String> = r
                .clusters
                .iter()
                .map(|(w, list)| format!("{w} × {}", list.join(" ")))
                .collect();
            out += &format!(
                "    {}{header} -> {} ({}, timeout {} ms)\n",
                r.path_prefix,
                clusters.join(", "),
                r.policy,
                r.timeout_ms
            );
        }
    }
    out += &format!(
        "backends:{:>20} {:>4} {:>9} {:>10} {:>5} {:>5} {:>6} {:>5} {:>5}\n",
        "", "up", "in_flight", "requests", "pool", "free", "kernel", "user", "down"
    );
    for b in &st.backends {
        out += &format!(
            "  {:<26} {:>4} {:>9} {:>10} {:>5} {:>5} {:>6} {:>5} {:>5}\n",
            b.address,
            if b.up { "yes" } else { "no" },
            b.in_flight,
            b.requests,
            b.pool,
            b.free,
            b.kernel,
            b.user,
            b.down
        );
    }
    out += "counters:\n";
    for (n, v) in &st.counters {
        out += &format!("  {n:<24} {v}\n");
    }
    out
}

fn prometheus(st: &Status) -> String {
    let mut out = String::new();
    for (n, v) in &st.counters {
        out.push_str(&format!("inband_mesh_{n}_total {v}\n"));
    }
    for b in &st.backends {
        let l = format!("backend=\"{}\"", b.address);
        out.push_str(&format!("inband_mesh_backend_up{{{l}}} {}\n", b.up as u8));
        out.push_str(&format!(
            "inband_mesh_backend_in_flight{{{l}}} {}\n",
            b.in_flight
        ));
        out.push_str(&format!(
            "inband_mesh_backend_requests_total{{{l}}} {}\n",
            b.requests
        ));
        for (state, n) in [
            ("free", b.free),
            ("kernel", b.kernel),
            ("user", b.user),
            ("down", b.down),
        ] {
            out.push_str(&format!(
                "inband_mesh_pool_slots{{{l},state=\"{state}\"}} {n}\n"
            ));
        }
    }
    out
}

/// `/metrics` (Prometheus text) and `/status` (JSON), from the pins, on a
/// thread of its own so a slow scraper never holds the daemon.
pub fn serve_metrics(addr: SocketAddr, pins: PathBuf) -> Result<()> {
    let server = tiny_http::Server::http(addr)
        .map_err(|e| anyhow::anyhow!("metrics endpoint {addr}: {e}"))?;
    std::thread::spawn(move || {
        let pins = PinDir(pins);
        for req in server.incoming_requests() {
            let reply = match (req.url(), read(&pins)) {
                ("/metrics", Ok(st)) => tiny_http::Response::from_string(prometheus(&st)),
                ("/status", Ok(st)) => {
                    tiny_http::Response::from_string(serde_json::to_string(&st).unwrap_or_default())
                }
                (_, Err(e)) => {
                    tiny_http::Response::from_string(format!("{e:#}\n")).with_status_code(500)
                }
                _ => {
                    tiny_http::Response::from_string("/metrics or /status\n").with_status_code(404)
                }
            };
            let _ = req.respond(reply);
        }
    });
    Ok(())
}

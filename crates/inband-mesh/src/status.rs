//! What a running mesh daemon's maps say, read from its pins (no daemon
//! round trip): `inband mesh status`, the `/status` JSON and `/metrics`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use inband_http::{Families, Reply, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;
use serde::Serialize;

use super::programs::{
    backend_line, pin_dir, read_counters, MeshBackend, ServiceKey, ServiceValue, Slot, COUNTERS,
};
use inband_core::shared as c;
use inband_core::bpfmap::PinDir;
use inband_core::prog_stats::{self, ProgStats};

#[derive(Debug, Serialize)]
pub struct Status {
    pub services: Vec<ServiceStatus>,
    pub backends: Vec<BackendStatus>,
    pub counters: Vec<(String, u64)>,
    /// Whether the kernel counts programs' run time now (`bpf_stats`).
    pub bpf_stats: bool,
    /// The daemon's programs with the kernel's counts (from the daemon's
    /// endpoint only: `inband mesh status` reads pins, not programs).
    pub programs: Vec<ProgStats>,
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
        let b: MeshBackend = inband_core::bpfmap::get(&backends_map, &i)?.unwrap_or_default();
        Ok(backend_line(&b).0.to_string())
    };
    let mut services = Vec::new();
    for (k, v) in inband_core::bpfmap::entries::<ServiceKey, ServiceValue>(&services_map)? {
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
        let Some(b) = inband_core::bpfmap::get::<u32, MeshBackend>(&backends_map, &i)? else {
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
            let s: Slot = inband_core::bpfmap::get(&slots_map, &(b.slot_base + k))?.unwrap_or_default();
            match s.state {
                c::INBAND_MESH_SLOT_FREE => st.free += 1,
                // BODY: answered, its request's body maybe still going to it.
                c::INBAND_MESH_SLOT_KERNEL | c::INBAND_MESH_SLOT_BODY => st.kernel += 1,
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
        bpf_stats: prog_stats::enabled(),
        programs: Vec::new(),
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

/// The same numbers for Prometheus: a registry made per scrape around one
/// collector of the status (prometheus-client's collector API), since they
/// are read from the pins when scraped, not counted by this process.
pub fn prometheus(st: Status) -> Registry {
    let mut r = Registry::with_prefix("inband_mesh");
    r.register_collector(Box::new(Exposition(st)));
    r
}

#[derive(Debug)]
struct Exposition(Status);

impl Collector for Exposition {
    fn encode(&self, encoder: DescriptorEncoder) -> std::fmt::Result {
        let st = &self.0;
        let mut f = Families(encoder);
        // read() reads the counters in the order of COUNTERS.
        for ((name, help), (_, v)) in COUNTERS.iter().zip(&st.counters) {
            f.counter(name, help, *v)?;
        }
        f.programs("mesh", st.programs.iter().map(|p| (p.program.as_str(), p.runs, p.run_time_ns)))?;
        let label = |b: &BackendStatus| [("backend", b.address.clone())];
        f.gauges(
            "backend_up",
            "1 while the backend passes its health checks",
            st.backends.iter().map(|b| (label(b), i64::from(b.up))),
        )?;
        f.gauges(
            "backend_in_flight",
            "Requests at the backend now",
            st.backends.iter().map(|b| (label(b), i64::from(b.in_flight))),
        )?;
        f.counters(
            "backend_requests",
            "Requests sent to the backend by the kernel",
            st.backends.iter().map(|b| (label(b), b.requests)),
        )?;
        f.gauges(
            "pool_slots",
            "The backend's pooled connections by state: free, carrying a request by the kernel, relayed by the daemon, down",
            st.backends.iter().flat_map(|b| {
                [
                    ("free", b.free),
                    ("kernel", b.kernel),
                    ("user", b.user),
                    ("down", b.down),
                ]
                .map(|(state, n)| {
                    (
                        [("backend", b.address.clone()), ("state", state.to_string())],
                        i64::from(n),
                    )
                })
            }),
        )
    }
}

/// `/metrics` (Prometheus) and `/status` (JSON), from the pins, on a
/// thread of its own: reading every slot must not hold the runtime that
/// relays the mesh's requests. It ends with the process.
pub fn serve_metrics(addr: SocketAddr, pins: PathBuf, programs: Vec<(&'static str, std::os::fd::OwnedFd)>, bpf_stats: bool) -> Result<()> {
    let pins = PinDir(pins);
    let read = move |pins: &PinDir| -> Result<Status> {
        let mut st = read(pins)?;
        // The sysctl does not show what BPF_ENABLE_STATS turned on.
        st.bpf_stats |= bpf_stats;
        for (name, fd) in &programs {
            st.programs.push(prog_stats::of_fd(name, std::os::fd::AsFd::as_fd(fd))?);
        }
        Ok(st)
    };
    let handler = move |path: &str| match (path, read(&pins)) {
        ("/metrics", Ok(st)) => Reply::metrics(&prometheus(st)),
        ("/status", Ok(st)) => Reply::json(serde_json::to_string(&st).unwrap_or_default()),
        ("/metrics" | "/status", Err(e)) => {
            Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n"))
        }
        _ => Reply::text(StatusCode::NOT_FOUND, "/metrics or /status\n"),
    };
    inband_http::spawn("mesh-metrics", addr, handler, std::future::pending())
        .with_context(|| format!("metrics endpoint {addr}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exposition parses as OpenMetrics (TYPE before every sample, HELP
    /// for every family, `# EOF`) with the names tests and docs read.
    #[test]
    fn the_metrics_parse_with_help_and_type() {
        use openmetrics_parser::OpenMetricsType::{Counter, Gauge};
        let st = Status {
            services: Vec::new(),
            backends: vec![BackendStatus {
                address: "127.0.0.1:8080".into(),
                up: true,
                in_flight: 1,
                requests: 12,
                pool: 4,
                free: 3,
                kernel: 1,
                user: 0,
                down: 0,
            }],
            counters: COUNTERS
                .iter()
                .enumerate()
                .map(|(i, (n, _))| (n.to_string(), i as u64))
                .collect(),
            bpf_stats: true,
            programs: vec![ProgStats { program: "request".into(), id: 7, runs: 3, run_time_ns: 1500 }],
        };
        let text = inband_http::encode(&prometheus(st)).unwrap();
        inband_http::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        // A strict parser too (the fixture has no empty family, which it mistakes).
        let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&text)
            .unwrap_or_else(|e| panic!("{e:?}\n{text}"));
        assert_eq!(parsed.families.len(), COUNTERS.len() + 6, "{text}");
        for (name, family) in &parsed.families {
            assert!(!family.help.is_empty(), "{name} has no HELP:\n{text}");
        }
        for (family, kind) in [
            ("inband_mesh_request_kernel", Counter),
            ("inband_mesh_fallback_large_body", Counter),
            ("inband_mesh_backend_up", Gauge),
            ("inband_mesh_backend_in_flight", Gauge),
            ("inband_mesh_backend_requests", Counter),
            ("inband_mesh_pool_slots", Gauge),
            ("inband_mesh_bpf_program_runs", Counter),
            ("inband_mesh_bpf_program_run_seconds", Counter),
        ] {
            assert_eq!(
                parsed.families.get(family).map(|f| f.family_type),
                Some(kind),
                "{family}:\n{text}"
            );
        }
        for line in [
            "inband_mesh_request_kernel_total 3",
            "inband_mesh_fallback_large_body_total 19",
            "inband_mesh_backend_up{backend=\"127.0.0.1:8080\"} 1",
            "inband_mesh_backend_requests_total{backend=\"127.0.0.1:8080\"} 12",
            "inband_mesh_pool_slots{backend=\"127.0.0.1:8080\",state=\"free\"} 3",
            "inband_mesh_pool_slots{backend=\"127.0.0.1:8080\",state=\"kernel\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line}:\n{text}");
        }
    }
}

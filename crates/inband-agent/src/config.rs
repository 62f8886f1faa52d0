//! `agent.toml`: parsing and every check that must pass before the agent
//! touches the kernel (see docs/configuration.md, section `inband agent`).

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ipnet::Ipv6Net;
use serde::{Deserialize, Deserializer, Serialize};

use inband_core::auth::AuthConfig;
use inband_core::net::{unicast, Protocol};
use inband_core::shared as c;
use inband_core::wire::Key;

/// Where the score the agent reports comes from (docs/agent.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScoreSource {
    /// Active TCP connections per service port, counted by the BPF tracepoint.
    #[default]
    Connections,
    /// Runnable tasks per CPU ×100, written by the agent every 100 ms.
    Cpu,
    /// Whatever the application sets through the score socket.
    App,
    /// Connections with a request in flight (client bytes in, no response
    /// byte out since), counted by the tc programs per service port.
    Requests,
    /// Both counts added (`connections+requests`): on kept-alive
    /// connections an idle one still brings requests and a busy one has
    /// work now, so neither count alone ranks the servers.
    #[serde(rename = "connections+requests")]
    ConnectionsAndRequests,
}

impl ScoreSource {
    pub fn name(self) -> &'static str {
        match self {
            ScoreSource::Connections => "connections",
            ScoreSource::Cpu => "cpu",
            ScoreSource::App => "app",
            ScoreSource::Requests => "requests",
            ScoreSource::ConnectionsAndRequests => "connections+requests",
        }
    }

    /// The data path's `score_source` (enum inband_score_source): cpu and
    /// app scores are overrides, so the programs see connections.
    pub fn data_path(self) -> u8 {
        (match self {
            ScoreSource::Requests => c::INBAND_SCORE_REQUESTS,
            ScoreSource::ConnectionsAndRequests => c::INBAND_SCORE_CONNECTIONS_AND_REQUESTS,
            ScoreSource::Connections | ScoreSource::Cpu | ScoreSource::App => c::INBAND_SCORE_CONNECTIONS,
        }) as u8
    }

    /// Whether the tc programs count requests in flight for it.
    pub fn counts_requests(self) -> bool {
        self.data_path() != c::INBAND_SCORE_CONNECTIONS as u8
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub interface: String,
    /// Every address a balancer sends from (its lb.toml `address` and
    /// `address6`, and the blocks of its `snat_prefix` and `snat_prefix6`,
    /// written as prefixes: "10.0.0.16/28"), one entry per address here.
    #[serde(deserialize_with = "addresses_or_blocks")]
    pub balancers: Vec<IpAddr>,
    /// The fleet prefixes of balancers that run `[scale_out] fleet = true`
    /// (their lb.toml `fleet_prefix`, a /96 each): every address inside may
    /// send options here, as a `balancers` address may.
    #[serde(default)]
    pub fleet_prefixes: Vec<Ipv6Net>,
    #[serde(default)]
    pub score: ScoreSource,
    #[serde(default = "default_score_socket")]
    pub score_socket: PathBuf,
    /// Group allowed to use the score socket (mode 0660); without it only
    /// root may (mode 0600).
    #[serde(default)]
    pub score_socket_group: Option<String>,
    #[serde(default = "default_poll_port")]
    pub poll_port: u16,
    #[serde(default, rename = "service")]
    pub services: Vec<ServiceConfig>,
    /// A UDP client tuple unused this long is forgotten (its responses go
    /// back through the balancer). Keep it below the balancers' UDP
    /// idle_timeout_s (120 s by default): past that, the balancer may give
    /// the flow's port to another client.
    #[serde(default = "default_udp_idle_timeout_s")]
    pub udp_idle_timeout_s: u32,
    /// The server application sees the client, not the balancer, in
    /// accept() and getpeername() of its DSR connections (docs/agent.md,
    /// "The client's address in the application").
    #[serde(default = "default_client_address")]
    pub client_address: bool,
    /// The cgroup v2 directory whose processes see it; none: the root of
    /// the cgroup2 hierarchy, every process of the host.
    #[serde(default)]
    pub client_address_cgroup: Option<PathBuf>,
    /// Prometheus metrics and the status JSON (`/metrics`, `/status`);
    /// none: no endpoint.
    #[serde(default)]
    pub metrics: Option<std::net::SocketAddr>,
    /// The kernel counts the agent programs' runs and run time while the
    /// agent runs (two clock reads per run), for `/metrics` and `/status`.
    #[serde(default)]
    pub bpf_stats: bool,
    /// The option format and the keys that authenticate 155/124 and sign
    /// 125 (shared with the balancers).
    #[serde(default)]
    pub auth: AuthConfig,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    pub port: u16,
    #[serde(deserialize_with = "vip_endpoint")]
    pub vip: SocketAddr,
    #[serde(default)]
    pub protocol: Protocol,
}

/// The limits of the BPF maps (bpf/include/inband/agent/consts.h).
pub const MAX_SERVICES: usize = 64;
pub const MAX_BALANCERS: usize = c::INBAND_AGENT_MAX_BALANCERS as usize;
pub const MAX_FLEETS: usize = c::INBAND_AGENT_MAX_FLEETS as usize;
/// The largest block one `balancers` entry may name: a balancer's SNAT
/// pool is at most 32 addresses, several balancers' pools may be one block.
const MAX_BLOCK: u32 = 256;

/// `balancers`: addresses, or blocks of them ("10.0.0.16/28"), expanded.
fn addresses_or_blocks<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<IpAddr>, D::Error> {
    use serde::de::Error;
    let mut out = Vec::new();
    for entry in Vec::<String>::deserialize(d)? {
        if let Ok(a) = entry.parse::<IpAddr>() {
            out.push(a);
            continue;
        }
        let net: ipnet::IpNet =
            entry.parse().map_err(|_| D::Error::custom(format!("balancers: {entry:?} is neither an address nor a block of them (10.0.0.16/28)")))?;
        let bits = net.max_prefix_len() - net.prefix_len();
        if bits > MAX_BLOCK.ilog2() as u8 || net.trunc() != net {
            return Err(D::Error::custom(format!(
                "balancers: {net} is not a block of at most {MAX_BLOCK} addresses starting at its first (write {})",
                net.trunc()
            )));
        }
        out.extend(net.subnets(net.max_prefix_len()).map_err(D::Error::custom)?.map(|one| one.addr()));
    }
    Ok(out)
}

pub fn default_score_socket() -> PathBuf {
    PathBuf::from("/run/inband/agent.sock")
}
pub fn default_poll_port() -> u16 {
    9137
}
fn default_udp_idle_timeout_s() -> u32 {
    110
}
fn default_client_address() -> bool {
    true
}

fn vip_endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(|_| {
        serde::de::Error::custom(format!(
            "vip {s:?} is not an address:port (write it as the clients see it, e.g. \"10.77.0.100:80\" or \"[2001:db8::100]:443\")"
        ))
    })
}

impl AgentConfig {
    pub fn load(path: &Path) -> Result<AgentConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<AgentConfig> {
        let cfg: AgentConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that need no kernel state: run by `parse`.
    pub fn validate(&self) -> Result<()> {
        if self.interface.is_empty() {
            bail!("interface is empty: name the interface the server's traffic uses (see `ip link`)");
        }
        if self.balancers.is_empty() {
            bail!(
                "balancers is empty: list the address every balancer sends from (its lb.toml `address`); \
                 options 155/124 from any other host are ignored"
            );
        }
        if self.balancers.len() > MAX_BALANCERS {
            bail!("{} balancers listed, at most {MAX_BALANCERS}", self.balancers.len());
        }
        if self.fleet_prefixes.len() > MAX_FLEETS {
            bail!("{} fleet_prefixes listed, at most {MAX_FLEETS}", self.fleet_prefixes.len());
        }
        for (i, p) in self.fleet_prefixes.iter().enumerate() {
            if p.prefix_len() != 96 || p.trunc() != *p {
                bail!(
                    "fleet_prefixes: {p} is not a /96 starting at its first address: write the balancers' `fleet_prefix` as they have it"
                );
            }
            if self.fleet_prefixes[..i].iter().any(|q| q.contains(p)) {
                bail!("fleet_prefixes: {p} is listed twice; remove the duplicate");
            }
        }
        if !self.fleet_prefixes.is_empty() {
            // A fleet flow's 125s and RSTs go to the balancer whose flow
            // label its 124s carry: one label must name one address.
            let mut named = std::collections::HashMap::new();
            for b in &self.balancers {
                if let IpAddr::V6(a) = b {
                    if let Some(other) = named.insert(inband_core::wire::fleet_label(*a), *a) {
                        if other != *a {
                            bail!(
                                "balancers {other} and {a} have the same fleet flow label, which names the instance a fleet \
                                 connection's scores go back to: give one of them another address (a chance of about one in \
                                 a million per pair of addresses)"
                            );
                        }
                    }
                }
            }
        }
        let mut seen = HashSet::new();
        for b in &self.balancers {
            if !unicast(*b) {
                bail!("balancer {b} is not an address a balancer can send from");
            }
            if !seen.insert(*b) {
                bail!("balancer {b} is listed twice; remove the duplicate");
            }
        }
        if self.services.is_empty() {
            bail!("no [[service]]: add one per local port the application listens on, with the VIP clients connect to");
        }
        if self.services.len() > MAX_SERVICES {
            bail!("{} services configured, at most {MAX_SERVICES}", self.services.len());
        }
        let mut ports = HashSet::new();
        for s in &self.services {
            if s.port == 0 {
                bail!("service port 0 is not a port an application listens on (vip {})", s.vip);
            }
            // One VIP per local port, transport and family: a port may serve
            // an IPv4 and an IPv6 VIP, or TCP and UDP ones.
            if !ports.insert((s.port, s.protocol, s.vip.is_ipv4())) {
                bail!(
                    "service port {}/{} is listed twice for {} VIPs; each local port maps to one VIP per transport and family",
                    s.port,
                    s.protocol.name(),
                    if s.vip.is_ipv4() { "IPv4" } else { "IPv6" }
                );
            }
            if s.vip.port() == 0 {
                bail!("service {}: vip {} has port 0", s.port, s.vip);
            }
            if !unicast(s.vip.ip()) {
                bail!(
                    "service {}: vip {} is not a unicast address; DSR responses need the VIP as their source",
                    s.port,
                    s.vip
                );
            }
        }
        if self.udp_idle_timeout_s == 0 {
            bail!("udp_idle_timeout_s = 0 would forget every UDP client tuple at once: use 1 or more (default 110)");
        }
        if !self.client_address && self.client_address_cgroup.is_some() {
            bail!("client_address_cgroup is set but client_address = false: remove one of them");
        }
        if self.score_socket.as_os_str().is_empty() {
            bail!("score_socket is empty: give a path, e.g. /run/inband/agent.sock");
        }
        self.auth.validate(false).context("[auth]")
    }

    /// Reads the key files `[auth]` names: run before anything is attached,
    /// and again on SIGHUP.
    pub fn load_keys(&self) -> Result<Vec<(u8, Key)>> {
        self.auth.load_keys().context("[auth]")
    }

    /// Checks against this host: run before anything is attached.
    pub fn check_host(&self) -> Result<()> {
        inband_core::netif::ifindex(&self.interface)?;
        if let Some(g) = &self.score_socket_group {
            group_id(g)?;
        }
        inband_core::bpfmap::require_bpffs()?;
        require_tracefs()?;
        self.client_address_cgroup().map(|_| ())
    }

    /// The cgroup the getpeername programs attach to, if `client_address`.
    pub fn client_address_cgroup(&self) -> Result<Option<PathBuf>> {
        if !self.client_address {
            return Ok(None);
        }
        let path = match &self.client_address_cgroup {
            Some(p) => p.clone(),
            None => cgroup2_mount().context(
                    "client_address needs a cgroup v2 hierarchy and none is mounted: mount one (`mount -t cgroup2 none \
                     /sys/fs/cgroup/unified`), name it in client_address_cgroup, or set client_address = false",
            )?,
        };
        if !is_cgroup2(&path) {
            bail!(
                "client_address_cgroup {} is not a cgroup v2 directory (see `grep cgroup2 /proc/self/mounts`)",
                path.display()
            );
        }
        Ok(Some(path))
    }

    /// The distinct local ports served (a port serving several VIPs once).
    pub fn service_ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = self.services.iter().map(|s| s.port).collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }
}

/// The mount point of the first cgroup2 file system, read with libc's
/// mount table reader (it undoes the table's octal escapes).
fn cgroup2_mount() -> Option<PathBuf> {
    use std::ffi::{CStr, OsStr};
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: both arguments are NUL-terminated; a null result is checked.
    let table = unsafe { libc::setmntent(c"/proc/self/mounts".as_ptr(), c"r".as_ptr()) };
    if table.is_null() {
        return None;
    }
    let mut entry = std::mem::MaybeUninit::<libc::mntent>::uninit();
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut found = None;
    loop {
        // SAFETY: table is open; entry and buf outlive the call and the
        // strings it points into buf, which are read before the next one.
        let e = unsafe { libc::getmntent_r(table, entry.as_mut_ptr(), buf.as_mut_ptr(), buf.len() as libc::c_int) };
        if e.is_null() {
            break;
        }
        // SAFETY: a non-null result has NUL-terminated fields in buf.
        let (fs, dir) = unsafe { (CStr::from_ptr((*e).mnt_type), CStr::from_ptr((*e).mnt_dir)) };
        if fs.to_bytes() == b"cgroup2" {
            found = Some(PathBuf::from(OsStr::from_bytes(dir.to_bytes())));
            break;
        }
    }
    // SAFETY: table came from setmntent and is closed once.
    unsafe { libc::endmntent(table) };
    found
}

fn is_cgroup2(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: c is NUL-terminated and st is written by statfs before it is read.
    let ok = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } == 0;
    // SAFETY: statfs succeeded, so st is initialised.
    ok && unsafe { st.assume_init() }.f_type == libc::CGROUP2_SUPER_MAGIC
}


/// The gid of a group name, or an error naming it.
pub fn group_id(name: &str) -> Result<libc::gid_t> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: c is NUL-terminated; getgrnam's result is read before any
    // other call could reuse its static buffer.
    let gr = unsafe { libc::getgrnam(c.as_ptr()) };
    if gr.is_null() {
        bail!("score_socket_group {name:?} is not a group on this host (see /etc/group)");
    }
    // SAFETY: non-null result of getgrnam.
    Ok(unsafe { (*gr).gr_gid })
}

/// The connection-counting tracepoint is attached through its tracefs id, so
/// tracefs must be reachable (it is not mounted on every machine).
fn require_tracefs() -> Result<()> {
    const EVENT: &str = "events/sock/inet_sock_set_state/id";
    if ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"].iter().any(|d| Path::new(d).join(EVENT).exists()) {
        return Ok(());
    }
    bail!(
        "tracefs is not mounted, so the connection-counting tracepoint cannot be attached: run \
         `mount -t tracefs tracefs /sys/kernel/tracing` (as root) and retry"
    )
}

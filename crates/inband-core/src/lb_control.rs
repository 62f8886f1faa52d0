//! The balancer's control protocol: what `inband lb ctl`, `inband weights`
//! and anything else that steers a running `inband lb` send over its unix
//! socket (one JSON request per line, one JSON reply per line), and the
//! names of the modes, policies and encapsulations they and the config file
//! use. The balancer serves it (`inband_lb::control`); its clients need
//! only this module, not the balancer.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::net::Protocol;
use crate::shared as c;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum Mode {
    Passthrough = c::INBAND_MODE_PASSTHROUGH as u8,
    DsrRr = c::INBAND_MODE_DSR_RR as u8,
    DsrPolling = c::INBAND_MODE_DSR_POLLING as u8,
    DsrDynamic = c::INBAND_MODE_DSR_DYNAMIC as u8,
    DsrQuery = c::INBAND_MODE_DSR_QUERY as u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum Policy {
    RoundRobin = c::INBAND_POLICY_ROUND_ROBIN as u8,
    LeastScore = c::INBAND_POLICY_LEAST_SCORE as u8,
    PowerOfTwo = c::INBAND_POLICY_POWER_OF_TWO as u8,
    Maglev = c::INBAND_POLICY_MAGLEV as u8,
    LeastConnections = c::INBAND_POLICY_LEAST_CONNECTIONS as u8,
}

impl Mode {
    pub fn from_u8(v: u8) -> Option<Mode> {
        [Mode::Passthrough, Mode::DsrRr, Mode::DsrPolling, Mode::DsrDynamic, Mode::DsrQuery].into_iter().find(|m| *m as u8 == v)
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Passthrough => "passthrough",
            Mode::DsrRr => "dsr-rr",
            Mode::DsrPolling => "dsr-polling",
            Mode::DsrDynamic => "dsr-dynamic",
            Mode::DsrQuery => "dsr-query",
        }
    }
    /// The modes that rank backends by their scores.
    pub fn scored(self) -> bool {
        matches!(self, Mode::DsrPolling | Mode::DsrDynamic | Mode::DsrQuery)
    }
}

impl Policy {
    pub fn from_u8(v: u8) -> Option<Policy> {
        [Policy::RoundRobin, Policy::LeastScore, Policy::PowerOfTwo, Policy::Maglev, Policy::LeastConnections].into_iter().find(|p| *p as u8 == v)
    }
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastScore => "least-score",
            Policy::PowerOfTwo => "power-of-two",
            Policy::Maglev => "maglev",
            Policy::LeastConnections => "least-connections",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Encap {
    #[default]
    None,
    /// Packets with an option are wrapped in an outer IPv4 header without
    /// options (bpf/include/inband/ipip.h).
    Ipip,
}

pub fn default_control_socket() -> PathBuf {
    PathBuf::from("/run/inband/lb.sock")
}

pub fn default_weight() -> u32 {
    1
}

#[derive(Clone, Debug, Serialize, Deserialize, clap::Subcommand)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum ControlRequest {
    /// Add a backend to a VIP (new connections may go to it at once).
    AddBackend {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long)]
        backend: SocketAddr,
        /// QUIC VIPs: the server id the backend writes into its connection IDs.
        #[arg(long)]
        #[serde(default)]
        quic_server_id: Option<u16>,
        /// How options travel to it: none (in the IP header) or ipip
        /// (wrapped, for a path that strips IPv4 options).
        #[arg(long, value_parser = parse_encap, default_value = "none")]
        #[serde(default)]
        encap: Encap,
        /// Its capacity relative to the VIP's other backends (0: no new
        /// connections).
        #[arg(long, default_value_t = default_weight())]
        #[serde(default = "default_weight")]
        weight: u32,
    },
    /// Remove a backend: no new connections; its established ones continue
    /// until they end (or `drain_timeout_ms`).
    RemoveBackend {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long)]
        backend: SocketAddr,
    },
    /// Drain a backend: keeps its connections, gets no new ones.
    DrainBackend {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long)]
        backend: SocketAddr,
    },
    /// Put a drained backend back in service.
    UndrainBackend {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long)]
        backend: SocketAddr,
    },
    /// Switch a VIP's mode (passthrough, dsr-rr, dsr-polling, dsr-dynamic, dsr-query).
    SetMode {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long, value_parser = parse_mode)]
        mode: Mode,
    },
    /// Set a VIP's selection policy (least-score, power-of-two, round-robin, maglev, least-connections).
    SetPolicy {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long, value_parser = parse_policy)]
        policy: Policy,
    },
    /// Set backends' weights (their capacity relative to the VIP's other
    /// backends; 0: no new connections), all at once; backends not named
    /// keep theirs.
    SetWeights {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        /// A backend and its weight, ADDR=W (repeat for more backends).
        #[arg(long = "weight", value_name = "ADDR=W", value_parser = parse_weight, required = true)]
        weights: Vec<(SocketAddr, u32)>,
    },
    /// Ask for the score on every n-th packet to a backend.
    SetProbeInterval {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        #[arg(long)]
        n: u32,
    },
    /// Re-read the config file the daemon was started with and apply it.
    Reload,
    /// Which backend a client side's packets go to and why: its entry in
    /// the flow table, or what the VIP's policy would choose for it now
    /// (changing nothing).
    Flow {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
        /// The client's address and source port.
        #[arg(long)]
        client: SocketAddr,
    },
    /// New connections each backend of a VIP was given so far (what
    /// `inband weights` measures its shares by), changing nothing.
    Counts {
        #[arg(long)]
        vip: SocketAddr,
        /// The VIP's transport (tcp or udp).
        #[arg(long, value_parser = parse_protocol, default_value = "tcp")]
        #[serde(default)]
        protocol: Protocol,
    },
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|_| {
        format!("unknown mode {s:?}: expected passthrough, dsr-rr, dsr-polling or dsr-dynamic")
    })
}
fn parse_protocol(s: &str) -> Result<Protocol, String> {
    serde_json::from_value(serde_json::Value::String(s.into()))
        .map_err(|_| format!("unknown protocol {s:?}: expected tcp or udp"))
}
fn parse_encap(s: &str) -> Result<Encap, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|_| format!("unknown encap {s:?}: expected none or ipip"))
}
fn parse_weight(s: &str) -> Result<(SocketAddr, u32), String> {
    let (addr, w) = s.split_once('=').ok_or_else(|| format!("{s:?} is not ADDR=W (e.g. 10.0.1.2:8080=3)"))?;
    let addr = addr.parse().map_err(|_| format!("{addr:?} is not a backend address and port"))?;
    let w = w.parse().map_err(|_| format!("weight {w:?} of {addr} is not a number"))?;
    Ok((addr, w))
}
fn parse_policy(s: &str) -> Result<Policy, String> {
    serde_json::from_value(serde_json::Value::String(s.into()))
        .map_err(|_| format!("unknown policy {s:?}: expected least-score, power-of-two, round-robin, maglev or least-connections"))
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ControlReply {
    pub ok: bool,
    pub message: String,
    /// The answer to `Counts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counts: Option<VipCounts>,
    /// The answer to `Flow`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow: Option<FlowRoute>,
}

impl ControlReply {
    pub fn applied() -> ControlReply {
        ControlReply { ok: true, message: "applied".into(), counts: None, flow: None }
    }
    pub fn refused(message: String) -> ControlReply {
        ControlReply { ok: false, message, counts: None, flow: None }
    }
}

/// Where a client side's packets go (`Flow`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowRoute {
    pub vip: String,
    pub client: SocketAddr,
    /// `established`, `closing` or `handshake` (in the balancer's tables),
    /// or `new` (what the policy would choose now).
    pub state: String,
    /// None: no backend can take a new connection.
    pub backend: Option<SocketAddr>,
    /// The balancer's source port toward the backend (NAT modes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snat_port: Option<u16>,
    pub why: String,
    /// New flows: every backend of the VIP as the policy sees it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<FlowCandidate>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowCandidate {
    pub backend: SocketAddr,
    pub eligible: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
    pub weight: u32,
    /// What least-score and power-of-two rank by.
    pub load_estimate: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VipCounts {
    /// Whether the VIP ranks backends by their load (least-score or
    /// power-of-two in a mode with scores): then the scores, not only the
    /// weights, decide the shares.
    pub ranks_by_load: bool,
    /// Every backend the VIP lists, with the new connections it was given.
    pub new_conns: Vec<(SocketAddr, u64)>,
}

/// Client side: sends one request and returns the reply.
pub fn send(socket: &PathBuf, req: &ControlRequest) -> Result<ControlReply> {
    let mut s = UnixStream::connect(socket).with_context(|| {
        format!("connecting to {} (is `inband lb` running? set --socket if it uses another path)", socket.display())
    })?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    writeln!(s, "{}", serde_json::to_string(req)?)?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).with_context(|| format!("bad reply from the balancer: {line:?}"))
}


//! Rust mirrors of bpf/include/inband/balancer_maps.h. Field names match C;
//! address/port fields hold network-order bytes (see `pod::be_addr`).

use crate::pod::pod;

pub const MAX_VIPS: u32 = 64;
pub const MAX_BACKENDS_PER_VIP: u32 = 32;
pub const MAX_BACKENDS: u32 = 1024;

pub const BACKEND_ACTIVE: u16 = 1;
pub const BACKEND_DRAINING: u16 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum Mode {
    Passthrough = 0,
    DsrRr = 1,
    DsrPolling = 2,
    DsrDynamic = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum Policy {
    RoundRobin = 0,
    LeastScore = 1,
    PowerOfTwo = 2,
}

impl Mode {
    pub fn from_u8(v: u8) -> Option<Mode> {
        [Mode::Passthrough, Mode::DsrRr, Mode::DsrPolling, Mode::DsrDynamic].into_iter().find(|m| *m as u8 == v)
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Passthrough => "passthrough",
            Mode::DsrRr => "dsr-rr",
            Mode::DsrPolling => "dsr-polling",
            Mode::DsrDynamic => "dsr-dynamic",
        }
    }
}

impl Policy {
    pub fn from_u8(v: u8) -> Option<Policy> {
        [Policy::RoundRobin, Policy::LeastScore, Policy::PowerOfTwo].into_iter().find(|p| *p as u8 == v)
    }
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastScore => "least-score",
            Policy::PowerOfTwo => "power-of-two",
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VipKey {
    pub addr: u32,
    pub port: u16,
    pub proto: u8,
    pub pad: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vip {
    pub id: u32,
    pub mode: u8,
    pub policy: u8,
    pub backend_count: u16,
    pub probe_interval: u32,
    pub pad: u32,
    pub score_max_age_ns: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    pub addr: u32,
    pub port: u16,
    pub mac: [u8; 6],
    pub flags: u16,
    pub pad: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendScore {
    pub score: u32,
    pub assigned_since: u32,
    pub updated_ns: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbConfig {
    pub self_addr: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub client_addr: u32,
    pub vip_addr: u32,
    pub client_port: u16,
    pub vip_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    pub backend_addr: u32,
    pub backend_port: u16,
    pub snat_port: u16,
    pub backend_id: u32,
    pub vip_id: u32,
    pub client_mac: [u8; 6],
    pub mode: u8,
    pub pad: u8,
    pub syn_seq: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatKey {
    pub backend_addr: u32,
    pub backend_port: u16,
    pub snat_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatBack {
    pub client_addr: u32,
    pub vip_addr: u32,
    pub client_port: u16,
    pub vip_port: u16,
    pub backend_id: u32,
    pub vip_id: u32,
    pub client_mac: [u8; 6],
    pub pad: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackendStats {
    pub packets: u64,
    pub bytes: u64,
    pub return_packets: u64,
    pub return_bytes: u64,
    pub new_conns: u64,
    pub probes_sent: u64,
    pub scores_received: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct VipStats {
    pub packets: u64,
    pub bytes: u64,
    pub return_packets: u64,
    pub return_bytes: u64,
    pub new_conns: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ControlStats {
    pub polls_sent: u64,
    pub poll_replies: u64,
    pub poll_bytes: u64,
    pub poll_failures: u64,
}

pod!(VipKey, Vip, Backend, BackendScore, LbConfig, FlowKey, Flow, NatKey, NatBack, BackendStats, VipStats, ControlStats);

/// Index into the `drops` map; names as `inband status` and metrics show them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum DropReason {
    MalformedIp = 0,
    MalformedOption = 1,
    TruncatedL4 = 2,
    Fragment = 3,
    NoBackend = 4,
    FlowTableFull = 5,
    SnatExhausted = 6,
    NoFlow = 7,
    ScoreNotOwner = 8,
    NoRoute = 9,
    IpOptions = 10,
    AdjustFailed = 11,
    UnexpectedOption = 12,
}

impl DropReason {
    pub const ALL: [DropReason; 13] = [
        DropReason::MalformedIp,
        DropReason::MalformedOption,
        DropReason::TruncatedL4,
        DropReason::Fragment,
        DropReason::NoBackend,
        DropReason::FlowTableFull,
        DropReason::SnatExhausted,
        DropReason::NoFlow,
        DropReason::ScoreNotOwner,
        DropReason::NoRoute,
        DropReason::IpOptions,
        DropReason::AdjustFailed,
        DropReason::UnexpectedOption,
    ];
    pub fn name(self) -> &'static str {
        match self {
            DropReason::MalformedIp => "malformed_ip",
            DropReason::MalformedOption => "malformed_option",
            DropReason::TruncatedL4 => "truncated_l4",
            DropReason::Fragment => "fragment",
            DropReason::NoBackend => "no_backend",
            DropReason::FlowTableFull => "flow_table_full",
            DropReason::SnatExhausted => "snat_exhausted",
            DropReason::NoFlow => "no_flow",
            DropReason::ScoreNotOwner => "score_not_owner",
            DropReason::NoRoute => "no_route",
            DropReason::IpOptions => "ip_options",
            DropReason::AdjustFailed => "adjust_failed",
            DropReason::UnexpectedOption => "unexpected_option",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// Sizes from balancer_maps.h (a padding mistake on either side shows here
    /// before it shows as garbage in a map).
    #[test]
    fn sizes_match_the_c_header() {
        assert_eq!(size_of::<VipKey>(), 8);
        assert_eq!(size_of::<Vip>(), 24);
        assert_eq!(size_of::<Backend>(), 16);
        assert_eq!(size_of::<BackendScore>(), 16);
        assert_eq!(size_of::<LbConfig>(), 8);
        assert_eq!(size_of::<FlowKey>(), 16);
        assert_eq!(size_of::<Flow>(), 28);
        assert_eq!(size_of::<NatKey>(), 12);
        assert_eq!(size_of::<NatBack>(), 28);
        assert_eq!(size_of::<BackendStats>(), 56);
        assert_eq!(size_of::<VipStats>(), 40);
        assert_eq!(size_of::<ControlStats>(), 32);
    }
}

//! Rust mirrors of bpf/include/inband/agent_maps.h. Address/port fields hold
//! network-order bytes (see `pod::be_addr`).

use crate::pod::pod;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    pub vip_addr: u32,
    pub vip_port: u16,
    pub pad: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub peer_addr: u32,
    pub peer_port: u16,
    pub local_port: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsrFlow {
    pub client_addr: u32,
    pub client_port: u16,
    pub score_requested: u8,
    pub pad: u8,
}

pod!(Service, ConnKey, DsrFlow);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum AgentCounter {
    TuplesStored = 0,
    ProbesSeen = 1,
    ScoresSent = 2,
    DsrRewrites = 3,
    UntrustedOption = 4,
    Malformed = 5,
    NoRoute = 6,
    AdjustFailed = 7,
    FlowsClosed = 8,
    MssClamped = 9,
}

impl AgentCounter {
    pub const ALL: [AgentCounter; 10] = [
        AgentCounter::TuplesStored,
        AgentCounter::ProbesSeen,
        AgentCounter::ScoresSent,
        AgentCounter::DsrRewrites,
        AgentCounter::UntrustedOption,
        AgentCounter::Malformed,
        AgentCounter::NoRoute,
        AgentCounter::AdjustFailed,
        AgentCounter::FlowsClosed,
        AgentCounter::MssClamped,
    ];
    pub fn name(self) -> &'static str {
        match self {
            AgentCounter::TuplesStored => "tuples_stored",
            AgentCounter::ProbesSeen => "probes_seen",
            AgentCounter::ScoresSent => "scores_sent",
            AgentCounter::DsrRewrites => "dsr_rewrites",
            AgentCounter::UntrustedOption => "untrusted_option",
            AgentCounter::Malformed => "malformed",
            AgentCounter::NoRoute => "no_route",
            AgentCounter::AdjustFailed => "adjust_failed",
            AgentCounter::FlowsClosed => "flows_closed",
            AgentCounter::MssClamped => "mss_clamped",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    #[test]
    fn sizes_match_the_c_header() {
        assert_eq!(size_of::<Service>(), 8);
        assert_eq!(size_of::<ConnKey>(), 8);
        assert_eq!(size_of::<DsrFlow>(), 8);
    }
}

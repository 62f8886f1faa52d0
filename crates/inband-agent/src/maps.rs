//! The agent's map keys and values: the types bindgen generates from
//! bpf/include/inband/agent/{types,consts}.h (build.rs), under the names the control
//! plane uses, and a name for each data-path counter. Address/port fields
//! hold network-order bytes (see `pod::be_ip`).

use inband_core::shared as c;

pub type Service = c::inband_service;
pub type ServiceKey = c::inband_service_key;
pub type Balancer = c::inband_balancer;
pub type BalancerNet = c::inband_balancer_net;
pub type ConnKey = c::inband_conn_key;
pub type DsrFlow = c::inband_dsr_flow;
/// `agent_config[0]`: the option format and the interface MTU.
pub type DataPathConfig = c::inband_agent_config;
/// `auth_keys[id]` (its Pod impl lives with the key handling in `inband_core::auth`).
pub type AuthKey = c::inband_auth_key;


/// The counters of `agent_stats`, indexed by `enum inband_agent_counter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum AgentCounter {
    TuplesStored = c::INBAND_AGENT_TUPLES_STORED,
    ProbesSeen = c::INBAND_AGENT_PROBES_SEEN,
    ScoresSent = c::INBAND_AGENT_SCORES_SENT,
    DsrRewrites = c::INBAND_AGENT_DSR_REWRITES,
    UntrustedOption = c::INBAND_AGENT_UNTRUSTED_OPTION,
    Malformed = c::INBAND_AGENT_MALFORMED,
    NoRoute = c::INBAND_AGENT_NO_ROUTE,
    AdjustFailed = c::INBAND_AGENT_ADJUST_FAILED,
    FlowsClosed = c::INBAND_AGENT_FLOWS_CLOSED,
    MssClamped = c::INBAND_AGENT_MSS_CLAMPED,
    AuthFailed = c::INBAND_AGENT_AUTH_FAILED,
    BadChecksum = c::INBAND_AGENT_BAD_CHECKSUM,
    NotSyn = c::INBAND_AGENT_NOT_SYN,
    TupleInUse = c::INBAND_AGENT_TUPLE_IN_USE,
    ProbeUnknownFlow = c::INBAND_AGENT_PROBE_UNKNOWN_FLOW,
    WrongFormat = c::INBAND_AGENT_WRONG_FORMAT,
    ScoreDeferredMtu = c::INBAND_AGENT_SCORE_DEFERRED_MTU,
    StaleTuplesForgotten = c::INBAND_AGENT_STALE_TUPLES_FORGOTTEN,
    StaleStamp = c::INBAND_AGENT_STALE_STAMP,
    UdpTuplesExpired = c::INBAND_AGENT_UDP_TUPLES_EXPIRED,
    UnwalkedExtHeaders = c::INBAND_AGENT_UNWALKED_EXT_HEADERS,
    Decapsulated = c::INBAND_AGENT_DECAPSULATED,
    Encapsulated = c::INBAND_AGENT_ENCAPSULATED,
    PollsAnswered = c::INBAND_AGENT_POLLS_ANSWERED,
    PollsUnauthenticated = c::INBAND_AGENT_POLLS_UNAUTHENTICATED,
    PollsRefused = c::INBAND_AGENT_POLLS_REFUSED,
    TimeWaitReopened = c::INBAND_AGENT_TIME_WAIT_REOPENED,
    ClientAddressShown = c::INBAND_AGENT_CLIENT_ADDRESS_SHOWN,
    ScoreCarriers = c::INBAND_AGENT_SCORE_CARRIERS,
    ScoreDeferredNoRoom = c::INBAND_AGENT_SCORE_DEFERRED_NO_ROOM,
    ScoreDeferredUdpBurst = c::INBAND_AGENT_SCORE_DEFERRED_UDP_BURST,
    ScoreDeferredCarrierFailed = c::INBAND_AGENT_SCORE_DEFERRED_CARRIER_FAILED,
    ResetsViaBalancer = c::INBAND_AGENT_RESETS_VIA_BALANCER,
    FleetCollisions = c::INBAND_AGENT_FLEET_COLLISIONS,
    FleetSteered = c::INBAND_AGENT_FLEET_STEERED,
    FleetUnnamed = c::INBAND_AGENT_FLEET_UNNAMED,
    FrozenDropped = c::INBAND_AGENT_FROZEN_DROPPED,
    ClosedFlowSegments = c::INBAND_AGENT_CLOSED_FLOW_SEGMENTS,
}

/// Entries of `agent_stats`.
pub const COUNTER_MAX: usize = c::INBAND_AGENT_COUNTER_MAX as usize;

impl AgentCounter {
    /// Every counter with its name in status and `get`. The length is
    /// INBAND_AGENT_COUNTER_MAX, so a counter added in C without one here
    /// does not compile; the test below checks every index is named once.
    const TABLE: [(AgentCounter, &'static str); COUNTER_MAX] = [
        (AgentCounter::TuplesStored, "tuples_stored"),
        (AgentCounter::ProbesSeen, "probes_seen"),
        (AgentCounter::ScoresSent, "scores_sent"),
        (AgentCounter::DsrRewrites, "dsr_rewrites"),
        (AgentCounter::UntrustedOption, "untrusted_option"),
        (AgentCounter::Malformed, "malformed"),
        (AgentCounter::NoRoute, "no_route"),
        (AgentCounter::AdjustFailed, "adjust_failed"),
        (AgentCounter::FlowsClosed, "flows_closed"),
        (AgentCounter::MssClamped, "mss_clamped"),
        (AgentCounter::AuthFailed, "auth_failed"),
        (AgentCounter::BadChecksum, "bad_checksum"),
        (AgentCounter::NotSyn, "not_syn"),
        (AgentCounter::TupleInUse, "tuple_in_use"),
        (AgentCounter::ProbeUnknownFlow, "probe_unknown_flow"),
        (AgentCounter::WrongFormat, "wrong_format"),
        (AgentCounter::ScoreDeferredMtu, "score_deferred_mtu"),
        (AgentCounter::StaleTuplesForgotten, "stale_tuples_forgotten"),
        (AgentCounter::StaleStamp, "stale_stamp"),
        (AgentCounter::UdpTuplesExpired, "udp_tuples_expired"),
        (AgentCounter::UnwalkedExtHeaders, "unwalked_ext_headers"),
        (AgentCounter::Decapsulated, "decapsulated"),
        (AgentCounter::Encapsulated, "encapsulated"),
        (AgentCounter::PollsAnswered, "polls_answered"),
        (AgentCounter::PollsUnauthenticated, "polls_unauthenticated"),
        (AgentCounter::PollsRefused, "polls_refused"),
        (AgentCounter::TimeWaitReopened, "time_wait_reopened"),
        (AgentCounter::ClientAddressShown, "client_address_shown"),
        (AgentCounter::ScoreCarriers, "score_carriers"),
        (AgentCounter::ScoreDeferredNoRoom, "score_deferred_no_room"),
        (AgentCounter::ScoreDeferredUdpBurst, "score_deferred_udp_burst"),
        (AgentCounter::ScoreDeferredCarrierFailed, "score_deferred_carrier_failed"),
        (AgentCounter::ResetsViaBalancer, "resets_via_balancer"),
        (AgentCounter::FleetCollisions, "fleet_collisions"),
        (AgentCounter::FleetSteered, "fleet_steered"),
        (AgentCounter::FleetUnnamed, "fleet_unnamed"),
        (AgentCounter::FrozenDropped, "frozen_dropped"),
        (AgentCounter::ClosedFlowSegments, "closed_flow_segments"),
    ];

    pub const ALL: [AgentCounter; COUNTER_MAX] = {
        let mut all = [AgentCounter::TuplesStored; COUNTER_MAX];
        let mut i = 0;
        while i < COUNTER_MAX {
            all[i] = Self::TABLE[i].0;
            i += 1;
        }
        all
    };

    pub fn name(self) -> &'static str {
        Self::TABLE.iter().find(|(c, _)| *c == self).map(|(_, n)| *n).expect("every counter is in TABLE")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_counter_index_has_one_name() {
        for index in 0..COUNTER_MAX as u32 {
            let named: Vec<&str> =
                AgentCounter::TABLE.iter().filter(|(c, _)| *c as u32 == index).map(|(_, n)| *n).collect();
            assert_eq!(named.len(), 1, "counter index {index} is named {named:?}");
        }
        let names: HashSet<&str> = AgentCounter::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), COUNTER_MAX, "names are unique");
        assert!(names.iter().all(|n| n.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_')));
        assert_eq!(AgentCounter::ScoreDeferredMtu.name(), "score_deferred_mtu");
    }
}

//! The balancer's map types: the structs bindgen generates from
//! bpf/include/inband/lb/{types,consts}.h (inband_core::shared), under the names
//! the control plane uses, plus the modes, policies and counter names that
//! status and metrics print. Address/port fields hold network-order bytes
//! (see `pod::be_addr`).

use inband_core::shared as c;

pub const MAX_VIPS: u32 = c::INBAND_MAX_VIPS;
pub const MAX_BACKENDS_PER_VIP: u32 = c::INBAND_MAX_BACKENDS_PER_VIP;
pub const MAX_BACKENDS: u32 = c::INBAND_MAX_BACKENDS;
pub const SCAN_MAX: u32 = c::INBAND_SCAN_MAX;
pub const SNAT_POOL_BITS: u8 = c::INBAND_SNAT_POOL_BITS as u8;
pub const SNAT_FLEET: u8 = c::INBAND_SNAT_FLEET as u8;
pub const MAGLEV_DEFAULT_TABLES: u32 = c::INBAND_MAGLEV_DEFAULT_TABLES;
pub const SNAT_PORTS: u32 = c::INBAND_SNAT_PORT_MAX - c::INBAND_SNAT_PORT_MIN + 1;

pub const BACKEND_ACTIVE: u16 = c::INBAND_BACKEND_ACTIVE as u16;
pub const BACKEND_DRAINING: u16 = c::INBAND_BACKEND_DRAINING as u16;
pub const VIP_ACTIVE: u16 = c::INBAND_VIP_ACTIVE as u16;
pub const VIP_DRAINING: u16 = c::INBAND_VIP_DRAINING as u16;
pub const VIP_QUIC: u16 = c::INBAND_VIP_QUIC as u16;
pub const VIP_WEIGHTED: u16 = c::INBAND_VIP_WEIGHTED as u16;
pub const BACKEND_OPTIONS_LOST: u16 = c::INBAND_BACKEND_OPTIONS_LOST as u16;
pub const BACKEND_ENCAP: u16 = c::INBAND_BACKEND_ENCAP as u16;
pub const BACKEND_DOWN: u16 = c::INBAND_BACKEND_DOWN as u16;
pub const VIP_RESET_DOWN: u16 = c::INBAND_VIP_RESET_DOWN as u16;
pub const VIP_REFUSE_EMPTY: u16 = c::INBAND_VIP_REFUSE_EMPTY as u16;
pub const VIP_FLEET: u16 = c::INBAND_VIP_FLEET as u16;
pub const VIP_ANNOUNCE: u16 = c::INBAND_VIP_ANNOUNCE as u16;
pub const VIP_QUERY_STALE: u16 = c::INBAND_VIP_QUERY_STALE as u16;
pub const HEALTH_UP: u8 = c::INBAND_HEALTH_UP as u8;
pub const HEALTH_DOWN: u8 = c::INBAND_HEALTH_DOWN as u8;

/// A removed backend (a tombstone kept for its flows): neither active nor
/// draining, whatever the daemon found about its path.
pub fn backend_removed(b: &Backend) -> bool {
    b.flags & (BACKEND_ACTIVE | BACKEND_DRAINING) == 0
}

pub const FLOW_SYN_SENT: u32 = c::INBAND_FLOW_SYN_SENT;
pub const FLOW_ESTABLISHED: u32 = c::INBAND_FLOW_ESTABLISHED;
pub const FLOW_CLOSING: u32 = c::INBAND_FLOW_CLOSING;
pub const FLOW_PROBE_OUTSTANDING: u8 = c::INBAND_FLOW_PROBE_OUTSTANDING as u8;
pub const PROBE_DUE: u32 = c::INBAND_PROBE_DUE;
pub const EXPLORE: u32 = c::INBAND_EXPLORE;

pub const GAUGE_TOTAL: u32 = c::INBAND_GAUGE_TOTAL;
pub const GAUGE_VIP0: u32 = c::INBAND_GAUGE_VIP0;
pub const GAUGE_BACKEND0: u32 = c::INBAND_GAUGE_BACKEND0;
pub const GAUGES: u32 = c::INBAND_GAUGES;

pub type VipKey = c::inband_vip_key;
pub type Vip = c::inband_vip;
pub type VipEligible = c::inband_vip_eligible;
pub type VipSlots = c::inband_vip_slots;
pub type Backend = c::inband_backend;
pub type BackendScore = c::inband_backend_score;
/// `lb_config`: what the data path knows of the instance (addresses, MTU,
/// auth, SIDs), as opposed to `config::LbConfig`, the file it comes from.
pub type DataPathConfig = c::inband_lb_config;
pub type FlowKey = c::inband_flow_key;
pub type Flow = c::inband_flow;
pub type NatKey = c::inband_nat_key;
pub type SnatOwner = c::inband_snat_owner;
pub type PortHold = c::inband_port_hold;
pub type BackendStats = c::inband_backend_stats;
pub type VipStats = c::inband_vip_stats;
pub type FlowGauges = c::inband_flow_gauges;
pub type SweepStats = c::inband_sweep_stats;
pub type ControlStats = c::inband_control_stats;
pub type BackendHealth = c::inband_backend_health;
pub type QueryReq = c::inband_query_req;
pub type ChoiceRec = c::inband_choice_rec;
pub type MoveCountsArgs = c::inband_move_counts_args;
pub type PeerChoice = c::inband_peer_choice;
pub type CaptureConf = c::inband_capture_conf;
pub type CaptureState = c::inband_capture_state;
pub type CaptureRec = c::inband_capture_rec;
pub type Addr = c::inband_addr;


/// A per-CPU counter struct: summed over CPUs, printed by field name.
pub trait Counted: inband_core::pod::Pod {
    fn add(&mut self, other: &Self);
    fn named(&self) -> Vec<(&'static str, u64)>;
}

/// One list of fields per struct gives both the sum and the names, so a
/// counter added in C shows up in status and metrics once it is listed here.
macro_rules! counted {
    ($ty:ty: $($field:ident),+ $(,)?) => {
        impl Counted for $ty {
            fn add(&mut self, x: &Self) {
                $(self.$field += x.$field;)+
            }
            fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field)),+]
            }
        }
    };
}

counted!(
    BackendStats: packets,
    bytes,
    return_packets,
    return_bytes,
    new_conns,
    closed_conns,
    probes_sent,
    scores_received,
    syn_retries,
    handshakes_completed,
    handshakes_refused,
    handshakes_retried,
    flows_reset
);
counted!(VipStats: packets, bytes, return_packets, return_bytes, new_conns, closed_conns);

pub use inband_core::lb_control::{Mode, Policy};

/// Names of `enum inband_drop_reason`, by index, as status and metrics show them.
pub const DROP_NAMES: [&str; c::INBAND_DROP_MAX as usize] = [
    "malformed_ip",
    "malformed_option",
    "truncated_l4",
    "fragment",
    "no_backend",
    "flow_table_full",
    "snat_exhausted",
    "no_flow",
    "score_not_owner",
    "no_route",
    "ip_options",
    "adjust_failed",
    "unexpected_option",
    "flow_expired",
    "vip_draining",
    "bad_checksum",
    "ttl_exceeded",
    "vlan",
    "family",
    "query_pending",
    "chained_no_flow",
    "srv6_unsupported",
    "adopt_budget",
    "steered_not_owner",
];

/// Names of `enum inband_event`, by index.
pub const EVENT_NAMES: [&str; c::INBAND_EV_MAX as usize] = [
    "score_unsolicited",
    "score_bad_mac",
    "score_wrong_format",
    "probe_deferred_mtu",
    "tuple_skipped_mtu",
    "flows_promoted",
    "flows_closed",
    "flows_expired",
    "snat_preempt_half_open",
    "snat_preempt_closing",
    "snat_orphans_reclaimed",
    "syn_on_live_flow",
    "icmp_to_backend",
    "icmp_to_client",
    "backend_full",
    "drained_flows_ended",
    "quic_cid_routed",
    "quic_cid_unknown",
    "probe_budget",
    "probe_faster",
    "query_skipped",
    "query_answered",
    "ipv6_chain_unwalked",
    "encapsulated",
    "decapsulated",
    "srv6_cond",
    "srv6_direct",
    "chained",
    "chained_named",
    "later_connection",
    "out_of_window",
    "reset_no_backend",
    "reset_backend_down",
    "sid_echo",
    "fleet_tuples",
    "fleet_pinned",
    "adopted_maglev",
    "fleet_steered",
    "adopted_announced",
    "adopt_no_choice",
    "choice_unannounced",
];

/// Names of `enum inband_health_reason`, by index, as status and metrics show them.
pub const HEALTH_REASON_NAMES: [&str; c::INBAND_HEALTH_REASON_MAX as usize] = [
    "unchecked",
    "passing",
    "refused",
    "timeout",
    "unreachable",
    "bad_status",
    "malformed",
    "closed",
    "error",
    "passive_refused",
    "passive_unanswered",
    "not_checked",
    "busy",
];

pub fn health_reason_name(r: u8) -> &'static str {
    HEALTH_REASON_NAMES.get(usize::from(r)).copied().unwrap_or("unknown")
}

pub fn drop_name(r: u32) -> &'static str {
    DROP_NAMES.get(r as usize).copied().unwrap_or("unknown")
}

/// The index of a drop reason by name (tests and benchmarks look them up so).
pub fn drop_index(name: &str) -> usize {
    DROP_NAMES.iter().position(|n| *n == name).unwrap_or_else(|| panic!("no drop reason {name}"))
}

pub fn event_index(name: &str) -> usize {
    EVENT_NAMES.iter().position(|n| *n == name).unwrap_or_else(|| panic!("no event {name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names follow the C enums' order: a reason added in C without a
    /// name here fails to compile (array length); one in the wrong place
    /// fails here.
    #[test]
    fn names_follow_the_c_enums() {
        assert_eq!(drop_index("no_flow"), c::INBAND_DROP_NO_FLOW as usize);
        assert_eq!(drop_index("vlan"), c::INBAND_DROP_VLAN as usize);
        assert_eq!(drop_index("bad_checksum"), c::INBAND_DROP_BAD_CHECKSUM as usize);
        assert_eq!(event_index("score_bad_mac"), c::INBAND_EV_SCORE_BAD_MAC as usize);
        assert_eq!(event_index("drained_flows_ended"), c::INBAND_EV_DRAINED_FLOWS_ENDED as usize);
        assert_eq!(event_index("icmp_to_client"), c::INBAND_EV_ICMP_TO_CLIENT as usize);
        assert_eq!(event_index("out_of_window"), c::INBAND_EV_OUT_OF_WINDOW as usize);
        assert_eq!(event_index("reset_backend_down"), c::INBAND_EV_RESET_BACKEND_DOWN as usize);
        assert_eq!(HEALTH_REASON_NAMES[c::INBAND_HEALTH_PASSIVE_REFUSED as usize], "passive_refused");
        assert_eq!(HEALTH_REASON_NAMES[c::INBAND_HEALTH_NOT_CHECKED as usize], "not_checked");
    }
}

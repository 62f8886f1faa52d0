/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The balancer's numbers that are not a map's layout: limits and default
 * table sizes, the SNAT port range, VIP modes and policies, the Maglev
 * key, and the indices of its counter arrays (drop reasons, events,
 * gauges). Apart from types.h so that what the control plane and the data
 * path agree on by number reads as one list; the Rust side gets both
 * through bindgen (crates/inband/build.rs), so this is the only definition.
 */
#ifndef INBAND_LB_CONSTS_H
#define INBAND_LB_CONSTS_H

/* Limits ("Limits" in docs/architecture.md; config.rs refuses beyond them). */
#define INBAND_MAX_VIPS 1024
#define INBAND_MAX_BACKENDS_PER_VIP 4096
/* Backend ids are global, 0 .. INBAND_MAX_BACKENDS-1: they index scores and
 * stats; also the bound on backends summed over VIPs. */
#define INBAND_MAX_BACKENDS 16384
/* A SNAT pool (lb.toml `snat_prefix`, `snat_prefix6`) holds at most
 * 2^this addresses (a /27, a /123): a flow's snat_index is 1 + its offset. */
#define INBAND_SNAT_POOL_BITS 5
/* snat_index of a fleet tuple: the source is lb_config's fleet_prefix with
 * the flow's fleet_suffix as its last 32 bits. Above any pool index. */
#define INBAND_SNAT_FLEET 255
/* A VIP of at most this many backends is picked for by walking all its
 * slots (exact least-score); a larger one by sampling its eligible set
 * (select.h). At most 32: the retry mask of a pick is a bit per slot. */
#define INBAND_SCAN_MAX 32
/* Default number of Maglev tables (lb.toml `maglev_tables`): one per VIP
 * that reads one (Maglev, weighted round-robin, weighted sampling). */
#define INBAND_MAGLEV_DEFAULT_TABLES 64
/* Default sizes; the control plane sets the real ones at load (lb.toml
 * `flow_table_size`): half-open = 1/4, SNAT reservations = 2× (see
 * "Flow lifecycle" in docs/architecture.md for why). */
#define INBAND_FLOW_TABLE_SIZE 262144
#define INBAND_HALF_OPEN_TABLE_SIZE 65536
#define INBAND_SNAT_TABLE_SIZE 524288

#define INBAND_SNAT_TRIES 16
/* A port search stops once it has seen this many ports held by handshakes
 * and takes the oldest preemptible one seen: under a SYN flood every
 * candidate is a handshake's, and examining all 16 cost more than the rest
 * of the SYN. Closing flows do not stop it: under churn a free port is
 * usually further down the list, and a closing flow's port taken early
 * may still meet its connection's last packets at the server. */
#define INBAND_SNAT_HOLDS_SEEN 4

enum inband_mode {
	INBAND_MODE_PASSTHROUGH = 0, /* NAT both ways, no options */
	INBAND_MODE_DSR_RR = 1, /* 155 on SYN, responses direct */
	INBAND_MODE_DSR_POLLING = 2, /* as DSR, scores written by user space polling */
	INBAND_MODE_DSR_DYNAMIC = 3, /* as DSR, every n-th packet carries 124 */
	INBAND_MODE_DSR_QUERY = 4, /* as DSR, the backends are asked before each new connection */
};

enum inband_policy {
	INBAND_POLICY_ROUND_ROBIN = 0, /* slots in turn; INBAND_VIP_WEIGHTED: the Maglev table's entries in turn */
	INBAND_POLICY_LEAST_SCORE = 1, /* lowest load estimate per weight, random among ties */
	INBAND_POLICY_POWER_OF_TWO = 2, /* two random backends, lower load estimate per weight */
	INBAND_POLICY_MAGLEV = 3, /* weighted Maglev consistent hashing of the client side (select.h) */
	/* lowest count of the connections this balancer opened and has not seen
	 * close, per weight: least-score with no score (passthrough and dsr-rr,
	 * the control for what feedback adds) */
	INBAND_POLICY_LEAST_CONNECTIONS = 4,
};

/*
 * Maglev: each VIP's lookup table is `maglev_size` (lb_config; a prime)
 * entries of map `maglev` from its vip_conf.maglev_table * maglev_size
 * (tables are handed to the VIPs that read one), each a slot of the
 * VIP, written by the control plane (crates/inband/src/lb/maglev.rs). A
 * new connection's slot is entry SipHash-2-4(flow key) % maglev_size under
 * this fixed key: the same on every balancer, so instances behind ECMP
 * agree without sharing state.
 */
#define INBAND_MAGLEV_DEFAULT_SIZE 65537
#define INBAND_MAGLEV_K0 0x6d2d646e61626e69ULL /* "inband-maglev-v1", little endian */
#define INBAND_MAGLEV_K1 0x31762d76656c6761ULL

/* Index into the drops per-CPU array; names in crates/inband/src/lb/maps.rs. */
enum inband_drop_reason {
	INBAND_DROP_MALFORMED_IP = 0, /* IHL < 5, header beyond packet, bad total length */
	INBAND_DROP_MALFORMED_OPTION = 1, /* option length 0/1/overrunning */
	INBAND_DROP_TRUNCATED_L4 = 2,
	INBAND_DROP_FRAGMENT = 3,
	INBAND_DROP_NO_BACKEND = 4,
	INBAND_DROP_FLOW_TABLE_FULL = 5,
	INBAND_DROP_SNAT_EXHAUSTED = 6,
	INBAND_DROP_NO_FLOW = 7, /* non-SYN to a VIP with no connection entry */
	INBAND_DROP_SCORE_NOT_OWNER = 8, /* 155/124 from a backend, or 125 for no connection */
	INBAND_DROP_NO_ROUTE = 9, /* backend's next-hop MAC not resolved yet */
	INBAND_DROP_IP_OPTIONS = 10, /* client packet to a VIP already carrying options */
	INBAND_DROP_ADJUST_FAILED = 11, /* bpf_xdp_adjust_head refused */
	INBAND_DROP_UNEXPECTED_OPTION = 12, /* 155/124 arriving at the balancer from outside */
	INBAND_DROP_FLOW_EXPIRED = 13, /* a packet of a flow past its timeout */
	INBAND_DROP_VIP_DRAINING = 14, /* a new connection to a VIP being removed */
	INBAND_DROP_BAD_CHECKSUM = 15, /* a 125 on a packet whose IPv4 or TCP checksum is wrong */
	INBAND_DROP_TTL_EXCEEDED = 16, /* TTL would reach 0 on the routed hop */
	INBAND_DROP_VLAN = 17, /* an 802.1Q/802.1ad-tagged frame to a VIP */
	INBAND_DROP_FAMILY = 18, /* a packet of a family the balancer has no address for */
	INBAND_DROP_QUERY_PENDING = 19, /* dsr-query: a SYN handed to the daemon to ask the backends */
	INBAND_DROP_CHAINED_NO_FLOW = 20, /* chained here by another instance, and no connection here either */
	INBAND_DROP_SRV6_UNSUPPORTED = 21, /* to our SID, but not one segment carrying IPv6 or IPv4: not unwrapped */
	/* A stray of a fleet flow at the direct SID beyond the adoption
	 * budget ([scale_out] adopt_per_s): its retransmission may be taken. */
	INBAND_DROP_ADOPT_BUDGET = 22,
	/* A backend's packet its agent wrapped to this instance (the flow
	 * label of its 155 or 124 named it), for a fleet tuple this instance
	 * holds no connection of. */
	INBAND_DROP_STEERED_NOT_OWNER = 23,
	INBAND_DROP_MAX = 24,
};

/* Things the data path did or refused that are not drops; per-CPU array,
 * names in crates/inband/src/lb/maps.rs. */
enum inband_event {
	INBAND_EV_SCORE_UNSOLICITED = 0, /* 125 with no outstanding 124 on its flow: not recorded */
	INBAND_EV_SCORE_BAD_MAC = 1, /* 125 whose MAC or nonce does not verify: not recorded */
	INBAND_EV_SCORE_WRONG_FORMAT = 2, /* seed 125 under auth, or authenticated 125 without */
	INBAND_EV_PROBE_DEFERRED_MTU = 3, /* a 124 would exceed the MTU: next packet asks */
	INBAND_EV_TUPLE_SKIPPED_MTU = 4, /* a 155 would exceed the MTU: sent without it */
	INBAND_EV_FLOWS_PROMOTED = 5, /* handshakes completed: half_open -> flows */
	INBAND_EV_FLOWS_CLOSED = 6, /* first FIN/RST of a flow */
	INBAND_EV_FLOWS_EXPIRED = 7, /* removed by the sweeper or found expired */
	INBAND_EV_SNAT_PREEMPT_HALF_OPEN = 8, /* port taken over from an unfinished handshake */
	INBAND_EV_SNAT_PREEMPT_CLOSING = 9, /* port taken over from a closing flow */
	INBAND_EV_SNAT_ORPHANS_RECLAIMED = 10, /* reservation whose owner was gone, reused */
	INBAND_EV_SYN_ON_LIVE_FLOW = 11, /* SYN with a new sequence number on a live flow: kept */
	INBAND_EV_ICMP_TO_BACKEND = 12, /* ICMP error about a VIP flow sent to its backend */
	INBAND_EV_ICMP_TO_CLIENT = 13, /* ICMP error about a NATed packet sent to its client */
	INBAND_EV_BACKEND_FULL = 14, /* chosen backend had no free port: next choice taken */
	INBAND_EV_DRAINED_FLOWS_ENDED = 15, /* flows ended by the sweeper at a drain deadline */
	INBAND_EV_QUIC_CID_ROUTED = 16, /* QUIC short header without a flow, sent to the server its CID names */
	INBAND_EV_QUIC_CID_UNKNOWN = 17, /* ... naming no active backend: balanced as a new flow */
	INBAND_EV_PROBE_BUDGET = 18, /* a 124 due but the backend's probe budget spent: later */
	INBAND_EV_PROBE_FASTER = 19, /* a 125 moved the score: that backend's n halved */
	INBAND_EV_QUERY_SKIPPED = 20, /* dsr-query: the daemon's queue full, balanced on the estimate */
	INBAND_EV_QUERY_ANSWERED = 21, /* dsr-query: a held SYN balanced after its query */
	INBAND_EV_IPV6_CHAIN_UNWALKED = 22, /* IPv6 with more extension headers than the walk takes: passed */
	INBAND_EV_ENCAPSULATED = 23, /* packets with an option sent to an encap backend in IP-in-IP */
	INBAND_EV_DECAPSULATED = 24, /* IP-in-IP from a backend unwrapped (its 125 inside) */
	INBAND_EV_SRV6_COND = 25, /* from the ECMP router to the conditional SID: unwrapped */
	INBAND_EV_SRV6_DIRECT = 26, /* ... to the direct SID (chained by another instance): unwrapped */
	INBAND_EV_CHAINED = 27, /* TCP without a connection here sent to the router's (first) shadow table */
	INBAND_EV_CHAINED_NAMED = 28, /* ... to the later shadow generation the router's SRH named */
	INBAND_EV_LATER_CONNECTION = 29, /* past a finished client's sequence space: handled as no flow */
	INBAND_EV_OUT_OF_WINDOW = 30, /* a FIN or RST far from its sender's sequence space: forwarded, flow unchanged */
	INBAND_EV_RESET_NO_BACKEND = 31, /* a SYN no backend could take, answered with a RST (refusing VIP) */
	INBAND_EV_RESET_BACKEND_DOWN = 32, /* a packet of a DOWN backend's flow answered with a RST (on_down = reset) */
	INBAND_EV_SID_ECHO = 33, /* an echo request to the direct SID answered (the router's liveness probe) */
	INBAND_EV_FLEET_TUPLES = 34, /* new connections given the fleet tuple ([scale_out] fleet) */
	/* A fleet VIP's connection given one of this balancer's own tuples:
	 * its fleet tuple was held here by another connection (a collision),
	 * or no 155 goes with it (options lost, IP-in-IP, beyond the MTU). */
	INBAND_EV_FLEET_PINNED = 35,
	/* A stray at the direct SID taken over as a fleet flow: its backend is
	 * its Maglev primary, its tuple the fleet's, as on the instance that
	 * opened it (handshake.h adopt()). */
	INBAND_EV_ADOPTED_MAGLEV = 36,
	/* A backend's packet to a fleet address that its agent wrapped in
	 * IPv6 to this instance's address (a 125, a RST): unwrapped and taken
	 * on the return path (scale_out.h decap_steered()). */
	INBAND_EV_FLEET_STEERED = 37,
	/* A stray at the direct SID taken over as a fleet flow of a VIP whose
	 * policy is not Maglev: its backend is the one the instance that
	 * opened it announced (peer_choices.h). */
	INBAND_EV_ADOPTED_ANNOUNCED = 38,
	/* ... not taken over: no announced choice here for its client side,
	 * or the backend named no longer serves the VIP. */
	INBAND_EV_ADOPT_NO_CHOICE = 39,
	/* A new connection's choice not announced to the peers: choice_ring
	 * was full (the lb daemon not draining it). */
	INBAND_EV_CHOICE_UNANNOUNCED = 40,
	INBAND_EV_MAX = 41,
};

/* gauges[0] = whole table (plus half_open count), [1 + vip id], [1 + INBAND_MAX_VIPS + backend id]. */
#define INBAND_GAUGE_TOTAL 0
#define INBAND_GAUGE_VIP0 1
#define INBAND_GAUGE_BACKEND0 (1 + INBAND_MAX_VIPS)
#define INBAND_GAUGES (1 + INBAND_MAX_VIPS + INBAND_MAX_BACKENDS)

#endif /* INBAND_LB_CONSTS_H */

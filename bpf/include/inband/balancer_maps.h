/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the balancer program (bpf/balancer.bpf.c), shared
 * with its control plane. The Rust mirror is crates/inband/src/lb/maps.rs; a
 * test there checks every size against this header's sizeof()s
 * (tests/vectors/layout.txt is generated from it by the C vector test).
 *
 * Addresses and ports are kept in network order (as in the packet) so the
 * data path never byte-swaps; counters and ids are host order.
 */
#ifndef INBAND_BALANCER_MAPS_H
#define INBAND_BALANCER_MAPS_H

#include <linux/types.h>

#define INBAND_MAX_VIPS 64
#define INBAND_MAX_BACKENDS_PER_VIP 32
/* Backend ids are global, 0 .. INBAND_MAX_BACKENDS-1: they index scores and stats. */
#define INBAND_MAX_BACKENDS 1024
#define INBAND_FLOW_TABLE_SIZE 262144

/* Source ports the balancer uses toward backends; kept below Linux's default
 * ephemeral range (32768-60999) so they never collide with the balancer
 * host's own connections to the same backend. */
#define INBAND_SNAT_PORT_MIN 1024
#define INBAND_SNAT_PORT_MAX 32767
#define INBAND_SNAT_TRIES 16

enum inband_mode {
	INBAND_MODE_PASSTHROUGH = 0, /* NAT both ways, no options */
	INBAND_MODE_DSR_RR = 1, /* 155 on SYN, responses direct */
	INBAND_MODE_DSR_POLLING = 2, /* as DSR, scores written by user space polling */
	INBAND_MODE_DSR_DYNAMIC = 3, /* as DSR, every n-th packet carries 124 */
};

enum inband_policy {
	INBAND_POLICY_ROUND_ROBIN = 0,
	INBAND_POLICY_LEAST_SCORE = 1, /* lowest effective score, random among ties */
	INBAND_POLICY_POWER_OF_TWO = 2, /* two random backends, lower effective score */
};

struct inband_vip_key {
	__be32 addr;
	__be16 port;
	__u8 proto; /* IPPROTO_TCP */
	__u8 pad;
};

struct inband_vip {
	__u32 id; /* 0 .. INBAND_MAX_VIPS-1: indexes vip_backends, vip_stats, rr */
	__u8 mode; /* enum inband_mode */
	__u8 policy; /* enum inband_policy */
	__u16 backend_count; /* slots [0, backend_count) of this VIP are valid */
	__u32 probe_interval; /* n: every n-th packet to a backend carries 124; 0 = never */
	__u32 pad;
	__u64 score_max_age_ns; /* older scores count as stale */
};

#define INBAND_BACKEND_ACTIVE 1 /* may receive new connections */
#define INBAND_BACKEND_DRAINING 2 /* keeps its flows, gets no new ones */

/* backends[id]. The balancer forwards on the one interface it is attached
 * to (XDP_TX); `mac` is the backend's (or its gateway's) L2 address,
 * resolved by the lb daemon from the kernel's neighbour table, so the hot
 * path needs no route lookup and fixtures need no routes. An id is not
 * reused while the daemon runs, so flows to a removed backend keep their
 * next hop. All-zero mac = not resolved yet: drop `no_route`. */
struct inband_backend {
	__be32 addr;
	__be16 port;
	__u8 mac[6];
	__u16 flags;
	__u16 pad;
};

/* vip_backends[vip id * INBAND_MAX_BACKENDS_PER_VIP + slot] = backend id. */

/* Written by the data path (in-band 125) or by user space (polling). */
struct inband_backend_score {
	__u32 score;
	/* New connections given to this backend since `score` was measured: the
	 * selection adds it so a burst of SYNs between two reports does not
	 * all land on the one backend that looked idle. */
	__u32 assigned_since;
	__u64 updated_ns; /* bpf_ktime_get_ns() clock; 0 = never */
};



struct inband_lb_config {
	__be32 self_addr; /* balancer address: source of packets to backends */
	__u32 flags;
};

struct inband_flow_key {
	__be32 client_addr;
	__be32 vip_addr;
	__be16 client_port;
	__be16 vip_port;
	__u8 proto;
	__u8 pad[3];
};

struct inband_flow {
	__be32 backend_addr;
	__be16 backend_port;
	__be16 snat_port;
	__u32 backend_id;
	__u32 vip_id;
	__u8 client_mac[6]; /* L2 source the client's packets came from: return next hop */
	__u8 mode; /* the VIP's mode when the flow started */
	__u8 pad;
	/* The SYN's sequence number: a SYN with another one on the same tuple
	 * is a new connection reusing the client port, not a retransmission. */
	__be32 syn_seq;
};

struct inband_nat_key {
	__be32 backend_addr;
	__be16 backend_port;
	__be16 snat_port;
	__u8 proto;
	__u8 pad[3];
};

struct inband_nat_back {
	__be32 client_addr;
	__be32 vip_addr;
	__be16 client_port;
	__be16 vip_port;
	__u32 backend_id;
	__u32 vip_id;
	__u8 client_mac[6];
	__u8 pad[2];
};

struct inband_backend_stats {
	__u64 packets; /* client -> backend */
	__u64 bytes;
	__u64 return_packets; /* backend -> client through the balancer */
	__u64 return_bytes;
	__u64 new_conns;
	__u64 probes_sent;
	__u64 scores_received;
};

struct inband_vip_stats {
	__u64 packets;
	__u64 bytes;
	__u64 return_packets;
	__u64 return_bytes;
	__u64 new_conns;
};

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
	INBAND_DROP_SCORE_NOT_OWNER = 8, /* 125 from a host that does not own the connection */
	INBAND_DROP_NO_ROUTE = 9, /* backend's next-hop MAC not resolved yet */
	INBAND_DROP_IP_OPTIONS = 10, /* client packet to a VIP already carrying options */
	INBAND_DROP_ADJUST_FAILED = 11, /* bpf_xdp_adjust_head refused */
	INBAND_DROP_UNEXPECTED_OPTION = 12, /* 155/124 arriving at the balancer from outside */
	INBAND_DROP_MAX = 13,
};

/* Written by the lb daemon (out-of-band work), read by `inband status`. */
struct inband_control_stats {
	__u64 polls_sent;
	__u64 poll_replies;
	__u64 poll_bytes; /* request + reply bytes on the wire, UDP payload + headers */
	__u64 poll_failures;
};

#endif /* INBAND_BALANCER_MAPS_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the real-server agent (bpf/agent.bpf.c). The
 * control plane's Rust types are generated from this header at build time
 * (crates/inband/build.rs), so this is the only definition.
 */
#ifndef INBAND_AGENT_MAPS_H
#define INBAND_AGENT_MAPS_H

#include <linux/types.h>

#define INBAND_AGENT_MAX_SERVICES 64
#define INBAND_AGENT_MAX_BALANCERS 16
#define INBAND_AGENT_FLOW_TABLE_SIZE 262144

/* Key: the local port the server application listens on (network order). */
struct inband_service {
	__be32 vip_addr; /* what the client connected to: source of DSR responses */
	__be16 vip_port;
	__u16 pad;
};

/* A connection as the server sees it: peer = the balancer's NAT address. */
struct inband_conn_key {
	__be32 peer_addr;
	__be16 peer_port;
	__be16 local_port;
};

/* dsr_flows[conn]: created by an accepted 155, deleted when the socket
 * closes (tracepoint), when a balancer's SYN without 155 reuses the ports
 * of a handshake that never became a socket, or by the LRU. */
struct inband_dsr_flow {
	__be32 client_addr;
	__be16 client_port;
	__u8 score_requested; /* set by an accepted 124, cleared when the 125 is sent */
	__u8 probe_key; /* key id of that 124: the 125 is signed with it */
	__be32 probe_nonce; /* nonce of that 124: the 125 echoes it */
	__u32 pad;
};

/* agent_config[0], written by the control plane. */
struct inband_agent_config {
	__u8 auth_mode; /* enum inband_auth_mode (wire.h) */
	__u8 pad;
	__u16 mtu; /* L3 MTU of the interface: no 125 is added beyond it */
	__u32 pad2;
};

/* Key for active_conns and score_override: local port, host order. */

enum inband_agent_counter {
	INBAND_AGENT_TUPLES_STORED = 0,
	INBAND_AGENT_PROBES_SEEN = 1,
	INBAND_AGENT_SCORES_SENT = 2,
	INBAND_AGENT_DSR_REWRITES = 3,
	INBAND_AGENT_UNTRUSTED_OPTION = 4, /* 155/124 from a host that is not a balancer */
	INBAND_AGENT_MALFORMED = 5, /* bad IPv4 header or option: passed on unchanged */
	INBAND_AGENT_NO_ROUTE = 6, /* DSR rewrite had no route to the client: sent via balancer */
	INBAND_AGENT_ADJUST_FAILED = 7,
	INBAND_AGENT_FLOWS_CLOSED = 8,
	INBAND_AGENT_MSS_CLAMPED = 9,
	INBAND_AGENT_AUTH_FAILED = 10, /* 155/124 whose MAC does not verify (or unknown key): dropped */
	INBAND_AGENT_BAD_CHECKSUM = 11, /* 155 on a packet with a wrong IPv4 or TCP checksum: dropped */
	INBAND_AGENT_NOT_SYN = 12, /* 155 on anything but a SYN: dropped */
	INBAND_AGENT_TUPLE_IN_USE = 13, /* 155 for a tuple a live socket owns: not stored */
	INBAND_AGENT_PROBE_UNKNOWN_FLOW = 14, /* 124 on a connection with no accepted 155: ignored */
	INBAND_AGENT_WRONG_FORMAT = 15, /* option of the format not configured: dropped */
	INBAND_AGENT_SCORE_DEFERRED_MTU = 16, /* a 125 would exceed the MTU: a later packet carries it */
	INBAND_AGENT_STALE_TUPLES_FORGOTTEN = 17, /* a balancer's SYN without 155 over an unfinished handshake's tuple */
	INBAND_AGENT_COUNTER_MAX = 18,
};

#endif /* INBAND_AGENT_MAPS_H */

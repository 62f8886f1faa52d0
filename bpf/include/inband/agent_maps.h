/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the real-server agent (bpf/agent.bpf.c), shared with
 * its control plane (crates/inband/src/agent/maps.rs).
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

struct inband_dsr_flow {
	__be32 client_addr;
	__be16 client_port;
	__u8 score_requested; /* set by a 124, cleared when the 125 is sent */
	__u8 pad;
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
	INBAND_AGENT_COUNTER_MAX = 10,
};

#endif /* INBAND_AGENT_MAPS_H */

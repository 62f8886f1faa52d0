/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The maps of the real-server agent (bpf/agent.bpf.c), pinned by name under
 * the agent's pin directory (docs/architecture.md, "Maps"), and its load-time
 * constants. Keys and values are defined in agent/types.h.
 */
#ifndef INBAND_AGENT_MAPS_H
#define INBAND_AGENT_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/types.h"
#include "inband/auth.h"
#include "inband/pinned.h"

INBAND_PINNED(services, BPF_MAP_TYPE_HASH, struct inband_service_key, struct inband_service, INBAND_AGENT_MAX_SERVICES);

INBAND_PINNED(balancers, BPF_MAP_TYPE_HASH, struct inband_addr, struct inband_balancer, INBAND_AGENT_MAX_BALANCERS);

/* Written by the control plane only (tables.rs), from the configuration. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, INBAND_AGENT_MAX_FLEETS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct inband_balancer_net);
	__type(value, struct inband_balancer);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} balancer_nets SEC(".maps");

/* fleet_instances[label] = the `balancers` IPv6 address whose flow label
 * (inband-core wire.rs fleet_label) it is: where a fleet flow's answers
 * go. Written by the control plane only (tables.rs), from `balancers`
 * when `fleet_prefixes` is set. */
INBAND_PINNED(fleet_instances, BPF_MAP_TYPE_HASH, __u32, struct inband_addr, INBAND_AGENT_MAX_BALANCERS);

INBAND_PINNED(dsr_flows, BPF_MAP_TYPE_LRU_HASH, struct inband_conn_key, struct inband_dsr_flow, INBAND_AGENT_FLOW_TABLE_SIZE);

/* The client tuples of connections the server closed first, kept for
 * their TIME_WAIT (agent_sock_state): apart from dsr_flows, so that a
 * high rate of closes evicts only other closed connections, never an
 * idle live one (whose answers, with fleet tuples, reach no instance
 * without its tuple). A balancer's next SYN on the ports deletes the
 * entry; the LRU bounds the rest. */
INBAND_PINNED(closed_flows, BPF_MAP_TYPE_LRU_HASH, struct inband_conn_key, struct inband_dsr_flow, INBAND_AGENT_CLOSED_FLOW_TABLE_SIZE);

INBAND_PINNED(active_conns, BPF_MAP_TYPE_HASH, __u16, __s64, INBAND_AGENT_MAX_SERVICES);

INBAND_PINNED(score_override, BPF_MAP_TYPE_HASH, __u16, __u32, INBAND_AGENT_MAX_SERVICES);

/* Score sources that count requests: connections with a request in flight
 * (client bytes arrived, no response byte sent since), per served port
 * (host order), and the per-connection flag behind the count. */
INBAND_PINNED(inflight, BPF_MAP_TYPE_HASH, __u16, __s64, INBAND_AGENT_MAX_SERVICES);

INBAND_PINNED(inflight_conns, BPF_MAP_TYPE_LRU_HASH, struct inband_conn_key, __u32, INBAND_AGENT_FLOW_TABLE_SIZE);

/* The option format and the interface MTU. An array, not load-time
 * constants: SIGHUP and MTU changes rewrite it under a running program. */
INBAND_PINNED(agent_config, BPF_MAP_TYPE_ARRAY, __u32, struct inband_agent_config, 1);

/* Indexed by the key id an option names; ids absent from the config have
 * valid = 0, so rotation is a rewrite of single entries. */
INBAND_PINNED(auth_keys, BPF_MAP_TYPE_ARRAY, __u32, struct inband_auth_key, INBAND_AUTH_MAX_KEYS);

INBAND_PINNED(agent_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, __u64, INBAND_AGENT_COUNTER_MAX);

/* enum inband_score_source, set by the control plane at load: data
 * packets pay for the per-connection bookkeeping only when the score
 * counts requests. */
const volatile __u8 score_source = INBAND_SCORE_CONNECTIONS;

static __always_inline int score_counts_requests(void)
{
	return score_source != INBAND_SCORE_CONNECTIONS;
}

static __always_inline void count(__u32 counter)
{
	__u64 *v = bpf_map_lookup_elem(&agent_stats, &counter);

	if (v)
		*v += 1;
}

static __always_inline const struct inband_agent_config *agent_cfg(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&agent_config, &zero);
}

/* A valid key, or NULL. Id 0 is never written valid (auth.rs refuses it). */
static __always_inline const struct inband_auth_key *auth_key(__u8 id)
{
	__u32 k = id;
	const struct inband_auth_key *key = bpf_map_lookup_elem(&auth_keys, &k);

	return key && key->valid ? key : NULL;
}

#endif /* INBAND_AGENT_MAPS_H */

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The maps of the real-server agent (bpf/agent.bpf.c), pinned by name under
 * the agent's pin directory (docs/architecture.md, "Maps"), and its load-time
 * constants. Keys and values are defined in inband/agent_maps.h.
 */
#ifndef INBAND_AGENT_MAPS_DEF_H
#define INBAND_AGENT_MAPS_DEF_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent_maps.h"
#include "inband/auth.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_AGENT_MAX_SERVICES);
	__type(key, __be16);
	__type(value, struct inband_service);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_AGENT_MAX_BALANCERS);
	__type(key, __be32);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} balancers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, INBAND_AGENT_FLOW_TABLE_SIZE);
	__type(key, struct inband_conn_key);
	__type(value, struct inband_dsr_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dsr_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_AGENT_MAX_SERVICES);
	__type(key, __u16);
	__type(value, __s64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} active_conns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_AGENT_MAX_SERVICES);
	__type(key, __u16);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} score_override SEC(".maps");

/* Score source "requests": connections with a request in flight (client
 * bytes arrived, no response byte sent since), per served port (host
 * order), and the per-connection flag behind the count. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_AGENT_MAX_SERVICES);
	__type(key, __u16);
	__type(value, __s64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} inflight SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, INBAND_AGENT_FLOW_TABLE_SIZE);
	__type(key, struct inband_conn_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} inflight_conns SEC(".maps");

/* The option format and the interface MTU. An array, not load-time
 * constants: SIGHUP and MTU changes rewrite it under a running program. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_agent_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agent_config SEC(".maps");

/* Indexed by the key id an option names; ids absent from the config have
 * valid = 0, so rotation is a rewrite of single entries. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, INBAND_AUTH_MAX_KEYS);
	__type(key, __u32);
	__type(value, struct inband_auth_key);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} auth_keys SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_AGENT_COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} agent_stats SEC(".maps");

/* Set by the control plane at load when the score source is "requests":
 * only then do data packets pay for the per-connection bookkeeping. */
const volatile __u8 score_requests = 0;

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

#endif /* INBAND_AGENT_MAPS_DEF_H */

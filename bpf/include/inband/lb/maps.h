/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The balancer's maps (keys and values in lb/types.h). Included once, by
 * bpf/balancer.bpf.c. Every map here is pinned by name under the
 * interface's pin directory, so a restarted daemon takes over the running
 * data path's state; the control plane sizes the flow tables at load
 * (lb.toml `flow_table_size`), and a build whose sizes or layouts differ
 * carries the pinned maps over (inband_core::map_upgrade: fields by name,
 * a new field starting at zero, so a field added here must mean "as
 * before" at zero). The per-CPU scratch maps, which hold no state between
 * packets, are defined next to the code that uses them (parse.h, verify.h,
 * nat.h, score.h, handshake.h).
 */
#ifndef INBAND_LB_MAPS_H
#define INBAND_LB_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/auth.h"
#include "inband/lb/types.h"
#include "inband/pinned.h"

#define INBAND_PINNED_ARRAY(name, type_, n) INBAND_PINNED(name, BPF_MAP_TYPE_ARRAY, __u32, type_, n)
#define INBAND_PINNED_PERCPU(name, type_, n) INBAND_PINNED(name, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, type_, n)

INBAND_PINNED_ARRAY(lb_config, struct inband_lb_config, 1);
INBAND_PINNED_ARRAY(auth_keys, struct inband_auth_key, INBAND_AUTH_MAX_KEYS);
INBAND_PINNED_ARRAY(vip_conf, struct inband_vip, INBAND_MAX_VIPS);
INBAND_PINNED_ARRAY(backends, struct inband_backend, INBAND_MAX_BACKENDS);
INBAND_PINNED_ARRAY(vip_backends, struct inband_vip_slots, INBAND_MAX_VIPS);
/* Written by the control plane only (tables.rs, and health.rs when a
 * backend goes DOWN or comes back), under its config lock. */
INBAND_PINNED_ARRAY(vip_eligible, struct inband_vip_eligible, INBAND_MAX_VIPS);
INBAND_PINNED_ARRAY(scores, struct inband_backend_score, INBAND_MAX_BACKENDS);
/* Shared, not per-CPU: operators expect strict rotation, and one atomic add
 * per new connection is cheap next to the rest of the SYN path. */
INBAND_PINNED_ARRAY(rr_cursor, __u32, INBAND_MAX_VIPS);
/* Two halves, written alternately by the sweeper (see lifecycle.h). */
INBAND_PINNED_ARRAY(gauges, struct inband_flow_gauges, 2 * INBAND_GAUGES);
INBAND_PINNED_ARRAY(sweep_stats, struct inband_sweep_stats, 1);
/* Only the lb daemon writes it; it lives here so it is pinned with the rest
 * of this interface's state and `inband status` finds it in one place. */
INBAND_PINNED_ARRAY(control_stats, struct inband_control_stats, 1);
/* Only the lb daemon's health checker writes it (the data path reads the
 * verdict as INBAND_BACKEND_DOWN in `backends`); pinned for `inband status`
 * and for a restarted daemon to carry the state on. */
INBAND_PINNED_ARRAY(backend_health, struct inband_backend_health, INBAND_MAX_BACKENDS);

/* Packets to each backend since its last 124, per CPU: no atomic on the
 * hot path. */
INBAND_PINNED_PERCPU(probe_count, __u32, INBAND_MAX_BACKENDS);
/* INBAND_PROBE_DUE | INBAND_EXPLORE bits per backend (select.h, score.h):
 * set by the sweeper (and PROBE_DUE by the control plane for a new
 * backend), each cleared by the packet or the connection that uses it. */
INBAND_PINNED_ARRAY(probe_due, __u32, INBAND_MAX_BACKENDS);
INBAND_PINNED_PERCPU(backend_stats, struct inband_backend_stats, INBAND_MAX_BACKENDS);
INBAND_PINNED_PERCPU(vip_stats, struct inband_vip_stats, INBAND_MAX_VIPS);
INBAND_PINNED_PERCPU(drops, __u64, INBAND_DROP_MAX);
INBAND_PINNED_PERCPU(events, __u64, INBAND_EV_MAX);

INBAND_PINNED(vips, BPF_MAP_TYPE_HASH, struct inband_vip_key, __u32, INBAND_MAX_VIPS);
/* Sized maglev_tables * maglev_size when the program is loaded. */
INBAND_PINNED_ARRAY(maglev, __u32, INBAND_MAGLEV_DEFAULT_TABLES *INBAND_MAGLEV_DEFAULT_SIZE);

/* Established and closing connections. LRU: when it is full the least
 * recently used flow (the longest idle) is the one that goes. */
INBAND_PINNED(flows, BPF_MAP_TYPE_LRU_HASH, struct inband_flow_key, struct inband_flow, INBAND_FLOW_TABLE_SIZE);

/* Handshakes in progress, apart from `flows` so that a SYN flood churns
 * only this table and never evicts an established connection. */
INBAND_PINNED(half_open, BPF_MAP_TYPE_LRU_HASH, struct inband_flow_key, struct inband_flow, INBAND_HALF_OPEN_TABLE_SIZE);

/* The SNAT port a handshake holds, server side -> client side: lets the
 * SYN-ACK of a pass-through flow find its client and keeps two handshakes
 * off one port. Evicted with its half-open flow, or on its own (then the
 * hold is simply gone). */
INBAND_PINNED(half_open_ports, BPF_MAP_TYPE_LRU_HASH, struct inband_nat_key, struct inband_port_hold, INBAND_HALF_OPEN_TABLE_SIZE);

/* SNAT reservations of established flows, server side -> client side. Not
 * an LRU: a reservation is removed only when its owner is found gone
 * (ended, expired, evicted from `flows`), so the port of a live flow is
 * never handed to a second client. */
INBAND_PINNED(snat, BPF_MAP_TYPE_HASH, struct inband_nat_key, struct inband_snat_owner, INBAND_SNAT_TABLE_SIZE);

/* dsr-query (query.h): SYNs handed to the lb daemon, and the connections
 * whose query it answered (their next SYN goes ahead). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} query_ring SEC(".maps");

INBAND_PINNED(query_done, BPF_MAP_TYPE_LRU_HASH, struct inband_flow_key, __u64, 16384);

/* Announced choices (peer_choices.h): new connections' backends handed to
 * the lb daemon, which sends them to the peers; and what the peers sent
 * here, sized with `flows` at load (LRU: the least recently written or
 * read goes first; the daemon is its only writer). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} choice_ring SEC(".maps");

INBAND_PINNED(peer_choices, BPF_MAP_TYPE_LRU_HASH, struct inband_flow_key, struct inband_peer_choice, INBAND_FLOW_TABLE_SIZE);

/* Sampled capture of dropped packets (capture.h): off until `inband lb
 * capture` writes capture_conf; the ring is bounded, a full one is counted. */
INBAND_PINNED_ARRAY(capture_conf, struct inband_capture_conf, 1);
INBAND_PINNED_PERCPU(capture_state, struct inband_capture_state, 1);
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} capture_ring SEC(".maps");

#endif /* INBAND_LB_MAPS_H */

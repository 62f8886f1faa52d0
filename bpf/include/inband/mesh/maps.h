/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The maps of the socket-layer balancer (bpf/mesh.bpf.c). The daemon pins
 * them under its pin directory (crates/inband/src/mesh/dataplane.rs),
 * except the socket maps and the socket storage, whose entries die with
 * their sockets; docs/mesh.md says who writes what. Keys and values are in
 * types.h.
 */
#ifndef INBAND_MESH_MAPS_H
#define INBAND_MESH_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/mesh/types.h"
#include "inband/pinned.h"

INBAND_PINNED(mesh_config, BPF_MAP_TYPE_ARRAY, __u32, struct inband_mesh_config, 1);
INBAND_PINNED(mesh_services, BPF_MAP_TYPE_HASH, struct inband_mesh_service_key, struct inband_mesh_service,
	      INBAND_MESH_MAX_SERVICES);
/* Memory-mapped by the daemon: it moves slots and in-flight counts with
 * atomics, as the programs do. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, INBAND_MESH_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct inband_mesh_backend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, INBAND_MESH_MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct inband_mesh_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_slots SEC(".maps");
INBAND_PINNED(mesh_slot_of, BPF_MAP_TYPE_HASH, __u64, __u32, INBAND_MESH_MAX_SLOTS);
INBAND_PINNED(mesh_conns, BPF_MAP_TYPE_LRU_HASH, struct inband_mesh_conn_key, struct inband_mesh_conn,
	      INBAND_MESH_MAX_CONNS);
INBAND_PINNED(mesh_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, __u64, INBAND_MESH_COUNTERS);

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, INBAND_MESH_MAX_CONNS);
	__type(key, __u64); /* socket cookie */
	__type(value, __u64);
} mesh_clients SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, INBAND_MESH_MAX_SLOTS);
	__type(key, __u32); /* slot */
	__type(value, __u64);
} mesh_pool SEC(".maps");

/* Slots the daemon must look at now (a response handed to it, bytes no
 * request asked for): the daemon sleeps on this instead of on every pool
 * socket, which the kernel wakes for each response it redirects. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} mesh_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inband_mesh_dst);
} mesh_dst SEC(".maps");

#endif /* INBAND_MESH_MAPS_H */

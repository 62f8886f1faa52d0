/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The maps of the router's IPv4 shadow program (bpf/shadow_dt4.bpf.c),
 * pinned by name under its pin directory, where `inband shadow route`
 * writes the shadow SIDs and `inband shadow status --router` reads the
 * counters. Keys and values are in types.h.
 */
#ifndef INBAND_SHADOW_DT4_MAPS_H
#define INBAND_SHADOW_DT4_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/pinned.h"
#include "inband/shadow/types.h"

/* Keyed by the shadow SID's 16 bytes, as they are in the packet. */
INBAND_PINNED(dt4_sids, BPF_MAP_TYPE_HASH, struct in6_addr, struct inband_shadow_dt4, INBAND_SHADOW_DT4_SIDS);
INBAND_PINNED(dt4_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct inband_shadow_count, INBAND_SHADOW_DT4_COUNTERS);

#endif /* INBAND_SHADOW_DT4_MAPS_H */

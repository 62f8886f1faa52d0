/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The maps of the daisy-chaining program (bpf/shadow.bpf.c), pinned by
 * name under its pin directory, where `inband shadow` writes the
 * configuration and reads the counters. Keys and values are in types.h.
 */
#ifndef INBAND_SHADOW_MAPS_H
#define INBAND_SHADOW_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/pinned.h"
#include "inband/shadow/types.h"

INBAND_PINNED(shadow_config, BPF_MAP_TYPE_ARRAY, __u32, struct inband_shadow_config, 1);
INBAND_PINNED(shadow_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct inband_shadow_count, INBAND_SHADOW_COUNTERS);

#endif /* INBAND_SHADOW_MAPS_H */

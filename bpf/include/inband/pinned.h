/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * A map pinned by name under its program's pin directory, so that a
 * restarted daemon (or `inband status`) finds the running data path's
 * state: the one shape every inband map has.
 */
#ifndef INBAND_PINNED_H
#define INBAND_PINNED_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define INBAND_PINNED(name, map_type, key_type, value_type, n) \
	struct {                                               \
		__uint(type, map_type);                        \
		__uint(max_entries, n);                        \
		__type(key, key_type);                         \
		__type(value, value_type);                     \
		__uint(pinning, LIBBPF_PIN_BY_NAME);           \
	} name SEC(".maps")

#endif /* INBAND_PINNED_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The maps of bpf/tcpe.bpf.c. None is pinned: the process that loads the
 * program holds them (crates/inband-tcpe/src/sockops.rs). The socket
 * storages' entries die with their sockets, so no table fills up;
 * tcpe_listeners is bounded, and its entries go when their listeners
 * close.
 */
#ifndef INBAND_TCPE_MAPS_H
#define INBAND_TCPE_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/tcpe/types.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_tcpe_config);
} tcpe_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_TCPE_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} tcpe_stats SEC(".maps");

/* Written by user space only (opt-in, the queued notification). */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inband_tcpe_ctl);
} tcpe_ctl SEC(".maps");

/* Written by the program only. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inband_tcpe_sock);
} tcpe_sock SEC(".maps");

/*
 * The listeners this program's user opted in (struct inband_tcpe_listener),
 * with how many sockets share each (SO_REUSEPORT). The callbacks of a
 * listener's SYN-ACKs and of its accepted connections run for every
 * sockops program on the cgroup once any program has set the listener's
 * flags (the flags are the socket's), and a request socket has no storage
 * to tell whose listener it came from: so each program answers only the
 * addresses here. Added at listen(), removed when the listener closes
 * (its state callback).
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_TCPE_MAX_LISTENERS);
	__type(key, struct inband_tcpe_listener);
	__type(value, __u32);
} tcpe_listeners SEC(".maps");

/*
 * A wake-up for a client's reader per notification accepted on one of its
 * connections: the socket's storage raises no event of its own, and a
 * notification rides a pure ACK, which does not make the socket readable.
 * The content is the connection ID; a reader only takes it as a cue to
 * look at its connections' storage. Drained by the client; when full, the
 * wake-up is counted lost (INBAND_TCPE_PATH_EVENT_LOST) and the reader
 * finds the notification at its next periodic look.
 */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} tcpe_paths SEC(".maps");

#endif /* INBAND_TCPE_MAPS_H */

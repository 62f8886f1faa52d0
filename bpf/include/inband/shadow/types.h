/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the daisy-chaining program (bpf/shadow.bpf.c,
 * seed 002's End.DT4.COND as End.DT6.COND). The Rust types are generated
 * from this header (crates/inband/build.rs); the maps themselves are in
 * maps.h. Its few constants live here: there is no consts.h.
 */
#ifndef INBAND_SHADOW_TYPES_H
#define INBAND_SHADOW_TYPES_H

#include <linux/types.h>

/* shadow_config[0], written by `inband shadow attach`. All zero: matches
 * no packet (not configured yet). */
struct inband_shadow_config {
	__u8 cond_sid[16]; /* this server's conditional SID: packets to it are checked */
	__u8 shadow_sid[16]; /* the router's SID for its (first) shadow table: strays go there
			      * (shadow_generations.h: the later ones' SIDs follow from it) */
	__u8 direct_sid[16]; /* this server's plain SID (chained packets): not read by the
			      * program; kept so `status` and `detach` know it */
};

/* shadow_stats[counter]: per CPU, packets and bytes (of the outer packet). */
enum inband_shadow_counter {
	INBAND_SHADOW_OTHER = 0, /* not to the conditional SID: not ours to judge */
	INBAND_SHADOW_NEW_FLOW, /* inner TCP SYN: a new connection, delivered */
	INBAND_SHADOW_NOT_TCP, /* inner packet not TCP: delivered (no socket to ask) */
	INBAND_SHADOW_LOCAL, /* a local socket (not a listener) has it: delivered */
	INBAND_SHADOW_CHAINED, /* no local socket: sent to the (first) shadow table */
	INBAND_SHADOW_MALFORMED, /* to the SID but not an SRv6 hop the router sends with an inner IPv6: left to the kernel */
	INBAND_SHADOW_CHAINED_NAMED, /* no local socket: sent to the shadow table the SRH named (a later generation) */
	INBAND_SHADOW_COUNTERS,
};

struct inband_shadow_count {
	__u64 packets;
	__u64 bytes;
};

/*
 * The router's side for IPv4 VIPs (bpf/shadow_dt4.bpf.c, tc ingress on
 * the router's links to its next hops): what End.DT4 would do without
 * the VRF device it needs. dt4_sids[generation k's shadow SID] is written
 * by `inband shadow route` for a config whose VIP is IPv4; the mark is
 * the one a `fwmark` rule sends to generation k's table. Bounded: a
 * router holds at most INBAND_SHADOW_DT4_SIDS shadow SIDs (8 generations
 * of 8 configs with shadow SIDs of their own); `route` refuses more.
 */
#define INBAND_SHADOW_DT4_SIDS 64

struct inband_shadow_dt4 {
	__u32 mark;
};

/* dt4_stats[counter]: per CPU, packets and bytes. */
enum inband_shadow_dt4_counter {
	INBAND_SHADOW_DT4_UNWRAPPED = 0, /* IPv4 in IPv6 to a shadow SID: unwrapped, marked, routed */
	INBAND_SHADOW_DT4_NOT_TAKEN, /* to a shadow SID, not IPv4 in a plain or spent-SRH IPv6 header: left to the kernel */
	INBAND_SHADOW_DT4_FAILED, /* the outer header could not be removed: dropped */
	INBAND_SHADOW_DT4_COUNTERS,
};

#endif /* INBAND_SHADOW_TYPES_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Shadow generations (scale-out behind ECMP; "Shadow generations" in
 * docs/architecture.md). The router keeps up to INBAND_SHADOW_GENERATIONS
 * earlier next-hop sets, each in a table of its own behind an End.DT6 SID.
 * Generation k's SID (k from 0) is the first generation's with k added to
 * its last 16 bits (wrapping), so a server or an instance configured with
 * the first SID knows them all. The router tells a next hop where a stray
 * goes next by a second segment in the SRH (segments left 1); this header
 * is how both programs check that the segment is one of the router's
 * shadow SIDs, so that a forged SRH cannot make them relay packets to an
 * address of the sender's choosing.
 *
 * Shared by bpf/shadow.bpf.c (tc, servers) and bpf/balancer.bpf.c (XDP,
 * instances); crates/inband/src/shadow/route.rs derives the same SIDs.
 */
#ifndef INBAND_SHADOW_GENERATIONS_H
#define INBAND_SHADOW_GENERATIONS_H

#include <linux/types.h>

#define INBAND_SHADOW_GENERATIONS 8

/* An SRH (RFC 8754) of two segments: 8 bytes and two addresses. Its
 * segment 0 is the last of the path: the shadow SID a stray goes to. */
#define INBAND_SRH2_LEN (8 + 2 * 16)
#define INBAND_SRH2_NEXT_SEGMENT 8

/* k if `seg` is generation k's SID for the first generation's `first`,
 * else -1. An all-zero `first` (scale-out off) matches nothing. */
static inline __attribute__((always_inline)) int inband_shadow_generation(const __u8 *first, const __u8 *seg)
{
	__u16 a, b, k;
	__u8 any = 0;
	int i;

	for (i = 0; i < 16; i++)
		any |= first[i];
	if (!any)
		return -1;
	for (i = 0; i < 14; i++)
		if (first[i] != seg[i])
			return -1;
	a = (__u16)first[14] << 8 | first[15];
	b = (__u16)seg[14] << 8 | seg[15];
	k = (__u16)(b - a);
	return k < INBAND_SHADOW_GENERATIONS ? k : -1;
}

/* Generation k's SID into `out`. */
static inline __attribute__((always_inline)) void inband_shadow_sid(__u8 *out, const __u8 *first, __u32 k)
{
	__u16 low = (__u16)(((__u16)first[14] << 8 | first[15]) + k);
	int i;

	for (i = 0; i < 14; i++)
		out[i] = first[i];
	out[14] = low >> 8;
	out[15] = low & 0xff;
}

#endif /* INBAND_SHADOW_GENERATIONS_H */

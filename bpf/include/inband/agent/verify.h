/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Software checksum verification of a packet at tc ingress, which
 * runs before the kernel checks either checksum: a packet the stack would
 * discard as corrupt must not change what the agent stores (a 155 on it
 * would otherwise overwrite a client tuple and then vanish). Only packets
 * with a 155 pay for it.
 */
#ifndef INBAND_AGENT_VERIFY_H
#define INBAND_AGENT_VERIFY_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/packet.h"
#include "inband/agent/skb.h"
#include "inband/csum.h"
#include "inband/wire.h"

/* Small enough for the loop callback's own stack frame; a SYN's segment is
 * a few chunks. */
#define CSUM_CHUNK 64

struct csum_walk {
	struct __sk_buff *skb;
	__u32 off; /* next byte to sum, from the start of the frame */
	__u32 left;
	__s64 sum; /* running 32-bit partial sum; < 0 after a failed load */
};

/*
 * One chunk per call. Every chunk but the last is full (an even length),
 * so each starts at an even offset of the summed data; the zeroed tail of
 * the last one is RFC 1071's padding of an odd length and adds nothing.
 */
static long csum_step(__u64 index, void *arg)
{
	struct csum_walk *w = arg;
	__u8 buf[CSUM_CHUNK];
	__u32 n = w->left;

	if (!n || w->sum < 0)
		return 1;
	if (n > CSUM_CHUNK)
		n = CSUM_CHUNK;
	__builtin_memset(buf, 0, sizeof(buf));
	if (bpf_skb_load_bytes(w->skb, w->off, buf, n)) {
		w->sum = -1;
		return 1;
	}
	w->sum = bpf_csum_diff(0, 0, (__be32 *)buf, sizeof(buf), (__wsum)w->sum);
	w->off += n;
	w->left -= n;
	return 0;
}

/* The IPv4 header (`hlen` bytes) sums to zero. */
static __always_inline int ipv4_csum_ok(struct __sk_buff *skb, __u32 hlen)
{
	__u8 hdr[INBAND_IPV4_MAX_HDR] = {};
	__s64 sum;

	if (hlen < INBAND_IPV4_MIN_HDR || hlen > INBAND_IPV4_MAX_HDR)
		return 0;
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, hdr, hlen))
		return 0;
	sum = bpf_csum_diff(0, 0, (__be32 *)hdr, sizeof(hdr), 0);
	return sum >= 0 && csum_fold((__u32)sum) == 0xffff;
}

/* The transport segment (`l4_len` bytes at `l4_off`) of `a` with its
 * pseudo-header (IPv4 or IPv6) sums to zero. A UDP datagram over IPv4
 * without a checksum (0) has nothing to check. */
static __always_inline int l4_csum_ok(struct __sk_buff *skb, __u32 l4_off, __u32 l4_len, const struct apkt *a)
{
	struct csum_walk w = { .skb = skb, .off = l4_off, .left = l4_len };

	if (a->proto == INBAND_IPPROTO_UDP && a->family == 4) {
		__be16 check;

		if (bpf_skb_load_bytes(skb, l4_off + 6, &check, sizeof(check)))
			return 0;
		if (check == 0)
			return 1;
	}
	if (l4_len > 0xffff)
		return 0;
	bpf_loop(0x10000 / CSUM_CHUNK, csum_step, &w, 0);
	if (w.sum < 0 || w.left)
		return 0;
	return csum_l4_ok((__u32)w.sum, &a->saddr, &a->daddr, a->proto, l4_len);
}

#endif /* INBAND_AGENT_VERIFY_H */

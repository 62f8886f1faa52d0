/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Checksum verification of a whole packet, for the packets whose contents
 * the balancer acts on beyond forwarding (a 125 changes a score): a packet
 * a receiver would discard as corrupt must not change state here either.
 * Off the fast path: only score-carrying packets pay for it.
 */
#ifndef INBAND_LB_VERIFY_H
#define INBAND_LB_VERIFY_H

#include "inband/csum.h"
#include "inband/lb/parse.h"

#define CSUM_CHUNK 256

/* The chunk buffer is too big for the BPF stack next to the rest of the
 * path: a per-CPU scratch slot instead (XDP does not nest on a CPU). */
struct csum_chunk {
	__u8 buf[CSUM_CHUNK];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct csum_chunk);
} csum_scratch SEC(".maps");

struct csum_walk {
	struct xdp_md *ctx;
	__u8 *buf; /* csum_scratch */
	__u32 off; /* next byte to sum, from the start of the frame */
	__u32 left;
	__s64 sum; /* running 32-bit partial sum; < 0 after a failed load */
};

/* One chunk per call. Chunks are multiples of 4 bytes, so each starts at an
 * even offset of the summed data; the last one is zero-padded, which is
 * how RFC 1071 pads an odd length. */
static long csum_step(__u32 index, void *arg)
{
	struct csum_walk *w = arg;
	__u32 n = w->left;

	if (!n || w->sum < 0)
		return 1;
	if (n > CSUM_CHUNK)
		n = CSUM_CHUNK;
	if (bpf_xdp_load_bytes(w->ctx, w->off, w->buf, n)) {
		w->sum = -1;
		return 1;
	}
	__u32 padded = (n + 3) & ~3U;

	for (__u32 i = n; i < padded && i < CSUM_CHUNK; i++)
		w->buf[i] = 0;
	if (padded > CSUM_CHUNK)
		padded = CSUM_CHUNK;
	w->sum = bpf_csum_diff(0, 0, (__be32 *)w->buf, padded, (__wsum)w->sum);
	w->off += n;
	w->left -= n;
	return 0;
}

/* The IPv4 header (hlen bytes at the front of the packet) sums to zero. */
static __always_inline int ipv4_csum_ok(struct xdp_md *ctx, __u32 hlen)
{
	__u8 hdr[INBAND_IPV4_MAX_HDR] = {};

	if (hlen < INBAND_IPV4_MIN_HDR || hlen > INBAND_IPV4_MAX_HDR || (hlen & 3))
		return 0;
	if (bpf_xdp_load_bytes(ctx, ETH_HLEN, hdr, hlen))
		return 0;
	__s64 sum = bpf_csum_diff(0, 0, (__be32 *)hdr, hlen, 0);

	return sum >= 0 && csum_fold((__u32)sum) == 0xffff;
}

/* The transport segment of `l4_len` bytes at `l4_off` of packet `p` sums to
 * zero with its pseudo-header (IPv4 or IPv6). A UDP datagram over IPv4
 * without a checksum (0) has nothing to check. Global: a frame of its own. */
__noinline int l4_csum_ok(struct xdp_md *ctx, __u32 l4_off, __u32 l4_len, const struct pkt *p)
{
	__u32 zero = 0;

	if (!p)
		return 0;
	struct csum_chunk *chunk = bpf_map_lookup_elem(&csum_scratch, &zero);
	struct csum_walk w = { .ctx = ctx, .off = l4_off, .left = l4_len };

	if (p->proto == IPPROTO_UDP && p->family == 4) {
		__be16 check;

		if (bpf_xdp_load_bytes(ctx, l4_off + 6, &check, sizeof(check)))
			return 0;
		if (check == 0)
			return 1;
	}
	if (l4_len > 0xffff || !chunk)
		return 0;
	w.buf = chunk->buf;
	/* 64 KiB in 256-byte chunks at most. */
	bpf_loop(0x10000 / CSUM_CHUNK, csum_step, &w, 0);
	if (w.sum < 0 || w.left)
		return 0;
	return csum_l4_ok((__u32)w.sum, &p->saddr, &p->daddr, p->proto, l4_len);
}

#endif /* INBAND_LB_VERIFY_H */

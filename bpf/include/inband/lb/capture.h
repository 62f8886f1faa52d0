/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Sampled capture of dropped packets, for `inband lb capture` (Katran's
 * pcap introspection): when the walk's verdict is XDP_DROP, the frame's
 * first INBAND_CAPTURE_SNAPLEN bytes and the reason drop() noted go to
 * capture_ring. Bounded three ways: only while the command's lease in
 * capture_conf runs, at most per_second records a second per CPU, and
 * by the ring's size; what each bound cost is counted in capture_state.
 * It runs after the walk, on drops only: a forwarded packet pays one
 * comparison of its verdict.
 */
#ifndef INBAND_LB_CAPTURE_H
#define INBAND_LB_CAPTURE_H

#include "inband/lb/common.h"

/* Global (verified once, with a frame of its own). */
__noinline int capture_drop(struct xdp_md *ctx)
{
	__u32 zero = 0;
	struct inband_capture_conf *cc = bpf_map_lookup_elem(&capture_conf, &zero);
	struct inband_capture_state *st = bpf_map_lookup_elem(&capture_state, &zero);

	if (!ctx || !cc || !st || !cc->per_second)
		return 0;
	__u64 now = bpf_ktime_get_ns();

	if (now >= cc->until_ns)
		return 0;
	if (now - st->window_ns >= 1000000000ULL) {
		st->window_ns = now;
		st->used = 0;
	}
	if (st->used >= cc->per_second) {
		st->limited++;
		return 0;
	}
	struct inband_capture_rec *r = bpf_ringbuf_reserve(&capture_ring, sizeof(*r), 0);

	if (!r) {
		st->lost++;
		return 0;
	}
	__u32 len = ctx->data_end - ctx->data;
	__u32 cap = len < INBAND_CAPTURE_SNAPLEN ? len : INBAND_CAPTURE_SNAPLEN;
	/* The same value for cap in [1, SNAPLEN], written so the verifier
	 * sees the bound (SNAPLEN is a power of two). */
	__u64 n = ((__u64)(cap - 1) & (INBAND_CAPTURE_SNAPLEN - 1)) + 1;

	r->ts_ns = now;
	r->reason = st->reason;
	r->len = len;
	r->caplen = cap;
	r->ifindex = ctx->ingress_ifindex;
	if (cap < 1 || bpf_xdp_load_bytes(ctx, 0, r->data, n)) {
		bpf_ringbuf_discard(r, 0);
		return 0;
	}
	bpf_ringbuf_submit(r, 0);
	st->used++;
	st->captured++;
	return 0;
}

#endif /* INBAND_LB_CAPTURE_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * dsr-query, the seed paper's "request busyness" baseline: the balancer
 * asks the backends for their load before it forwards a new connection.
 * XDP cannot hold a packet while it waits, so the SYN is handed to the lb
 * daemon through `query_ring` and dropped here; the daemon asks the VIP's
 * backends (the polling protocol), writes their answers into `scores`,
 * marks the connection in `query_done` and runs the SYN through this
 * program again (BPF_PROG_RUN on live frames), which then balances it on
 * the fresh scores. docs/decisions.md says why, and what it costs.
 *
 * A SYN is never lost to a missing daemon: without a sweep in the last
 * three seconds (no daemon), or with the ring full, it is balanced on the
 * estimate at once (`query_skipped`).
 */
#ifndef INBAND_LB_QUERY_H
#define INBAND_LB_QUERY_H

#include "inband/lb/parse.h"

#define QUERY_DAEMON_GONE_NS (3ULL * 1000000000ULL)

/*
 * Whether the SYN of the new connection `fk` to VIP `vid` is balanced now
 * (0) or held for a query (a drop verdict: the daemon has it).
 */
static __always_inline int query_first(struct xdp_md *ctx, const struct inband_flow_key *fk, __u32 vid,
				       const struct pkt *p)
{
	__u32 zero = 0;
	struct inband_sweep_stats *st = bpf_map_lookup_elem(&sweep_stats, &zero);

	if (bpf_map_lookup_elem(&query_done, fk)) {
		bpf_map_delete_elem(&query_done, fk);
		event(INBAND_EV_QUERY_ANSWERED);
		return 0;
	}
	if (!st || !st->last_ns || (__s64)(p->now - st->last_ns) > (__s64)QUERY_DAEMON_GONE_NS ||
	    p->len > INBAND_QUERY_FRAME_MAX || p->len < ETH_HLEN) {
		event(INBAND_EV_QUERY_SKIPPED);
		return 0;
	}
	struct inband_query_req *r = bpf_ringbuf_reserve(&query_ring, sizeof(*r), 0);

	if (!r) {
		event(INBAND_EV_QUERY_SKIPPED);
		return 0;
	}
	/* Bounded again, in 64 bits, where the verifier can see it. */
	__u64 len = p->len;

	if (len > INBAND_QUERY_FRAME_MAX || len < ETH_HLEN) {
		bpf_ringbuf_discard(r, 0);
		event(INBAND_EV_QUERY_SKIPPED);
		return 0;
	}
	if (bpf_xdp_load_bytes(ctx, 0, r->frame, len)) {
		bpf_ringbuf_discard(r, 0);
		event(INBAND_EV_QUERY_SKIPPED);
		return 0;
	}
	r->key = *fk;
	r->vip_id = vid;
	r->len = len;
	r->held_ns = bpf_ktime_get_ns();
	bpf_ringbuf_submit(r, 0);
	return drop(INBAND_DROP_QUERY_PENDING);
}

#endif /* INBAND_LB_QUERY_H */

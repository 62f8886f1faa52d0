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
 * A dsr-dynamic VIP with `query_when_stale` does the same with a SYN that
 * finds every score stale: after a pause no report is current, and its
 * first connections would otherwise be placed blind (the exploration
 * tickets send one to each backend, a busy one included).
 *
 * A SYN is never lost to a missing daemon: without a sweep in the last
 * three seconds (no daemon), or with the ring full, it is balanced on the
 * estimate at once (`query_skipped`).
 */
#ifndef INBAND_LB_QUERY_H
#define INBAND_LB_QUERY_H

#include "inband/lb/parse.h"

#define QUERY_DAEMON_GONE_NS (3ULL * 1000000000ULL)

struct stale_walk {
	__u64 now;
	__u64 max_age_ns;
	__u32 vid;
	__u32 count;
	__u32 active; /* active backends met */
	__u32 fresh; /* an active backend's score is younger than max_age */
};

static long stale_step(__u32 slot, void *data)
{
	struct stale_walk *w = data;
	__u32 vid = w->vid;

	if (slot >= w->count)
		return 1;
	const struct inband_vip_slots *slots = bpf_map_lookup_elem(&vip_backends, &vid);

	if (!slots)
		return 1;
	__u32 id = slots->backend[slot & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
	const struct inband_backend *be = bpf_map_lookup_elem(&backends, &id);
	const struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

	if (!be || !s || (be->flags & (INBAND_BACKEND_ACTIVE | INBAND_BACKEND_DOWN)) != INBAND_BACKEND_ACTIVE)
		return 0;
	w->active++;
	/* Reports are stamped with the fine clock and `now` is the coarse
	 * one, a tick behind at most: a report newer than `now` is fresh. */
	if (s->updated_ns && (__s64)(w->now - s->updated_ns) < (__s64)w->max_age_ns) {
		w->fresh = 1;
		return 1;
	}
	return 0;
}

/* Whether VIP `vid` has active backends and every one of them has a stale
 * score (or none). Walked on SYNs of INBAND_VIP_QUERY_STALE VIPs only; a
 * VIP larger than INBAND_SCAN_MAX is not walked (a SYN there costs the
 * same at any size) and counts as fresh, as does one with no active
 * backend (there is nobody to ask: its SYNs do not go to the daemon). */
static __always_inline int scores_stale(const struct inband_vip *vc, __u32 vid, __u64 now)
{
	struct stale_walk w = { .now = now, .max_age_ns = vc->score_max_age_ns, .vid = vid, .count = vc->backend_count };

	if (w.count > INBAND_SCAN_MAX)
		return 0;
	bpf_loop(INBAND_SCAN_MAX, stale_step, &w, 0);
	return w.active && !w.fresh;
}

/*
 * Whether the SYN of the new connection `fk` to VIP `vid` is balanced now
 * (0) or held for a query (a drop verdict: the daemon has it). A dsr-query
 * VIP holds every SYN, a dsr-dynamic one with INBAND_VIP_QUERY_STALE only
 * those that find its scores stale.
 */
static __always_inline int query_first(struct xdp_md *ctx, const struct inband_flow_key *fk, __u32 vid,
				       const struct inband_vip *vc, const struct pkt *p)
{
	__u32 zero = 0;
	struct inband_sweep_stats *st = bpf_map_lookup_elem(&sweep_stats, &zero);

	if (bpf_map_lookup_elem(&query_done, fk)) {
		bpf_map_delete_elem(&query_done, fk);
		event(INBAND_EV_QUERY_ANSWERED);
		return 0;
	}
	if (vc->mode != INBAND_MODE_DSR_QUERY && !scores_stale(vc, vid, p->now))
		return 0;
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

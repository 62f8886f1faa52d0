/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The sweeper: the balancer object's second program (SEC("syscall")),
 * which the lb daemon runs every second ("Flow lifecycle" in
 * docs/architecture.md). It shares the walk's maps, so it is in the same
 * object; libbpf-cargo builds one object from one source file, so it is a
 * header included at the end of bpf/balancer.bpf.c rather than a
 * translation unit of its own. Nothing in the packet walk calls it.
 */
#ifndef INBAND_LB_SWEEP_H
#define INBAND_LB_SWEEP_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/lb/lifecycle.h"

/* The map argument of bpf_for_each_map_elem callbacks (unused here) and
 * of the kfunc below. Defined, not only declared: libbpf checks the
 * kfunc's prototype against the kernel's kind by kind, and to it a
 * forward declaration is no struct. Nothing here reads a member. */
struct bpf_map {
	int unused;
};

/* The kernel's count of a hash map's elements (kept per CPU since 6.6). */
extern __s64 bpf_map_sum_elem_count(const struct bpf_map *map) __ksym;

/* A walk visits every bucket, filled or not: over the empty tables of an
 * idle balancer the walks were most of the daemon's CPU (262,144 buckets
 * of `flows` alone). A table the kernel counts empty is not walked; an
 * element inserted meanwhile is walked by the next pass, as one inserted
 * right after the walk would be. */
#define SWEEP_WALK(map, fn, ctx)                                                  \
	do {                                                                      \
		if (bpf_map_sum_elem_count((const struct bpf_map *)&(map)) > 0) \
			bpf_for_each_map_elem(&(map), fn, ctx, 0);                \
	} while (0)

struct sweep_ctx {
	__u64 now;
	__u32 half; /* gauge half this pass writes */
	__u32 pad;
	__u64 half_open;
	__u64 snat_entries;
};

/* What the daemon passes to a run (BPF_PROG_RUN's ctx_in). */
struct sweep_args {
	__u64 now; /* 0 = the current time; tests pass a time to sweep "later" */
};

static __always_inline void gauge_add(__u32 half, __u32 idx, int closing)
{
	__u32 i = half * INBAND_GAUGES + idx;
	struct inband_flow_gauges *g = bpf_map_lookup_elem(&gauges, &i);

	if (!g)
		return;
	if (closing)
		g->closing++;
	else
		g->established++;
}

static long gauge_clear(__u32 i, void *arg)
{
	__u32 idx = *(__u32 *)arg * INBAND_GAUGES + i;
	struct inband_flow_gauges *g = bpf_map_lookup_elem(&gauges, &idx);

	if (g) {
		g->established = 0;
		g->closing = 0;
	}
	return 0;
}

static __always_inline int past(__u64 deadline, __u64 now)
{
	return deadline && (__s64)(now - deadline) > 0;
}

static long sweep_flow(struct bpf_map *map, struct inband_flow_key *key, struct inband_flow *f, struct sweep_ctx *c)
{
	__u32 vid = f->vip_id, bid = f->backend_id;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (f->seen) {
		/* A packet since the last pass: idle from now on at most. */
		f->seen = 0;
		f->last_seen_ns = c->now;
	}
	/* A score request unanswered for a whole pass (its answer lost, or no
	 * response to carry it) is given up, so the flow may ask again. */
	if (f->flags & INBAND_FLOW_PROBE_OLD)
		f->flags &= ~(INBAND_FLOW_PROBE_OUTSTANDING | INBAND_FLOW_PROBE_OLD);
	else if (f->flags & INBAND_FLOW_PROBE_OUTSTANDING)
		f->flags |= INBAND_FLOW_PROBE_OLD;
	struct inband_flow copy = *f;

	if (flow_expired(&copy, c->now)) {
		flow_end(key, &copy);
		event(INBAND_EV_FLOWS_EXPIRED);
		return 0;
	}
	if ((be && !(be->flags & INBAND_BACKEND_ACTIVE) && past(be->drain_deadline_ns, c->now)) ||
	    (vc && (vc->flags & INBAND_VIP_DRAINING) && past(vc->drain_deadline_ns, c->now))) {
		flow_end(key, &copy);
		event(INBAND_EV_DRAINED_FLOWS_ENDED);
		return 0;
	}
	int closing = copy.state == INBAND_FLOW_CLOSING;

	gauge_add(c->half, INBAND_GAUGE_TOTAL, closing);
	if (vid < INBAND_MAX_VIPS)
		gauge_add(c->half, INBAND_GAUGE_VIP0 + vid, closing);
	if (bid < INBAND_MAX_BACKENDS)
		gauge_add(c->half, INBAND_GAUGE_BACKEND0 + bid, closing);
	return 0;
}

static long sweep_half_open(struct bpf_map *map, struct inband_flow_key *key, struct inband_flow *f,
			    struct sweep_ctx *c)
{
	struct inband_flow copy = *f;

	if (flow_expired(&copy, c->now)) {
		half_open_end(key, &copy);
		event(INBAND_EV_FLOWS_EXPIRED);
		return 0;
	}
	c->half_open++;
	return 0;
}

/* A reservation whose owner is not a live flow with this port is an orphan
 * (its flow was evicted from the LRU, or ended in a way that left it). */
static long sweep_snat(struct bpf_map *map, struct inband_nat_key *key, struct inband_snat_owner *o,
		       struct sweep_ctx *c)
{
	struct inband_flow *f = bpf_map_lookup_elem(&flows, &o->flow);

	if (!f || !flow_has_port(f, key)) {
		bpf_map_delete_elem(&snat, key);
		event(INBAND_EV_SNAT_ORPHANS_RECLAIMED);
		return 0;
	}
	c->snat_entries++;
	return 0;
}

static long sweep_hold(struct bpf_map *map, struct inband_nat_key *key, struct inband_port_hold *h,
		       struct sweep_ctx *c)
{
	struct inband_flow *f = bpf_map_lookup_elem(&half_open, &h->flow);

	if (!f || !flow_has_port(f, key))
		bpf_map_delete_elem(&half_open_ports, key);
	return 0;
}

/* For each backend of a dsr-dynamic VIP: a score older than half the
 * VIP's max age (or none yet) → its next packet asks for one; a score
 * older than the max age (stale: the backend is not being picked) → also
 * an exploration ticket, one new connection whatever its estimate
 * (select.h). Both bits are cleared by what uses them, so a backend gets
 * at most one exploration per pass while stale. */
struct probes_walk {
	struct sweep_ctx *c;
	__u32 vid;
	__u32 slot;
};

/* One step of the walk over the slots of active dsr-dynamic VIPs: a step
 * per such slot and per VIP, not per possible slot (4M). */
static long mark_probes_due(__u32 i, struct probes_walk *w)
{
	__u32 vid = w->vid, slot = w->slot;

	if (vid >= INBAND_MAX_VIPS)
		return 1;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);

	if (!vc || vc->mode != INBAND_MODE_DSR_DYNAMIC || !(vc->flags & INBAND_VIP_ACTIVE) ||
	    slot >= vc->backend_count || slot >= INBAND_MAX_BACKENDS_PER_VIP) {
		w->vid++;
		w->slot = 0;
		return 0;
	}
	w->slot++;
	const struct inband_vip_slots *slots = bpf_map_lookup_elem(&vip_backends, &vid);

	if (!slots)
		return 0;
	__u32 id = slots->backend[slot & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);
	__u32 *due = bpf_map_lookup_elem(&probe_due, &id);

	struct inband_backend *be = bpf_map_lookup_elem(&backends, &id);

	/* Options do not reach it: the daemon polls it instead. */
	if (!s || !due || !be || (be->flags & INBAND_BACKEND_OPTIONS_LOST))
		return 0;
	/* Reports are stamped with the fine clock and `now` is the coarse
	 * one, a tick behind at most: a report newer than `now` is fresh. */
	__s64 age = (__s64)(w->c->now - s->updated_ns);

	if (!s->updated_ns || age >= (__s64)(vc->score_max_age_ns / 2))
		__sync_fetch_and_or(due, INBAND_PROBE_DUE);
	if (s->updated_ns && age >= (__s64)vc->score_max_age_ns)
		__sync_fetch_and_or(due, INBAND_EXPLORE);
	return 0;
}

/*
 * One pass over the flow tables, run by the lb daemon every second (and by
 * tests): ages established flows (their `seen` byte), deletes dead flows
 * with their SNAT reservations, orphaned reservations and port holds, and
 * flows past a drain deadline; counts what is live into `gauges`; marks
 * backends whose score is getting old. Without it flows do not age (the
 * LRU still bounds them) and ports are reclaimed only by a port search
 * that finds them unseen and past their timeout.
 */
SEC("syscall")
int sweep(struct sweep_args *args)
{
	__u32 zero = 0;
	struct inband_sweep_stats *st = bpf_map_lookup_elem(&sweep_stats, &zero);
	__u64 start = bpf_ktime_get_ns();
	struct sweep_ctx c = { .now = args->now ? args->now : start };

	if (!st)
		return 1;
	c.half = (st->passes + 1) & 1;
	bpf_loop(INBAND_GAUGES, gauge_clear, &c.half, 0);
	SWEEP_WALK(flows, sweep_flow, &c);
	SWEEP_WALK(half_open, sweep_half_open, &c);
	SWEEP_WALK(snat, sweep_snat, &c);
	SWEEP_WALK(half_open_ports, sweep_hold, &c);
	struct probes_walk w = { .c = &c };

	/* Active VIPs hold at most INBAND_MAX_BACKENDS slots in all (config.rs). */
	bpf_loop(INBAND_MAX_VIPS + INBAND_MAX_BACKENDS, mark_probes_due, &w, 0);
	st->half_open = c.half_open;
	st->snat_entries = c.snat_entries;
	st->last_ns = bpf_ktime_get_ns();
	st->last_duration_ns = st->last_ns - start;
	st->passes++; /* readers use half passes & 1, complete from here */
	return 0;
}

#endif /* INBAND_LB_SWEEP_H */

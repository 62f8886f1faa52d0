/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The load estimate's side of a flow move (crates/inband-lb/src/moves.rs,
 * docs/decisions.md "Flow moves: the balancer's side"): a program of the
 * balancer object (SEC("syscall"), run by the lb daemon with BPF_PROG_RUN
 * right after it rewrote a flow to another backend), included at the end
 * of bpf/balancer.bpf.c as the sweeper is.
 *
 * The moved connection's opening is in its old backend's `opened`, and its
 * close will be counted under its new backend (flow_close reads the flow's
 * backend_id). Left so, the old backend would carry it until its next
 * report, and forever under least-connections, which has no reports; the
 * new one would be one short. So the move counts as an end on the old
 * backend and an opening on the new, for the flows whose close is counted
 * at all. The data path adds to these counters concurrently: only atomic
 * adds keep both sides' counts, which user space cannot do on an array
 * map, hence a program.
 */
#ifndef INBAND_LB_MOVES_H
#define INBAND_LB_MOVES_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/lb/lifecycle.h"

SEC("syscall")
int move_counts(struct inband_move_counts_args *a)
{
	struct inband_flow f = { .mode = a->mode, .flags = a->flags };
	__u32 from = a->from_id, to = a->to_id;
	struct inband_backend_score *s;

	/* flow_close's rule: an adopted flow's opening was counted on another
	 * instance, so its close is not counted here either. */
	if (!flow_counted(&f) || (f.flags & INBAND_FLOW_ADOPTED))
		return 0;
	s = bpf_map_lookup_elem(&scores, &from);
	if (s)
		__sync_fetch_and_add(&s->closed, 1);
	s = bpf_map_lookup_elem(&scores, &to);
	if (s)
		__sync_fetch_and_add(&s->opened, 1);
	return 0;
}

#endif /* INBAND_LB_MOVES_H */

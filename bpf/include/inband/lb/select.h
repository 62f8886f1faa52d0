/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Backend selection for new connections.
 *
 * The load estimate of a backend (least-score and power-of-two rank by it):
 *
 *     estimate = reported score (halved for every score_max_age it is old)
 *                + connections given to it since the report
 *                - of its connections, those that ended since the report
 *
 * The balancer sees every connection it opens and the client's FIN or RST
 * that ends it (or the handshake that ends unfinished, lifecycle.h), so
 * between two reports the estimate follows the backend's connections by
 * itself, as long as a report counts the same span of each connection
 * (agent.bpf.c is_active, score.h record_score, and no 124 on a closing
 * flow): an idle backend's estimate falls back as its
 * connections end instead of growing with every connection it ever got,
 * and a backend that went without a report (no traffic, hence no probe)
 * is ranked by what is known rather than exiled. A report that is old
 * decays (halved per max age). And a backend whose report is stale (older
 * than the VIP's max age: not picked, so not asked) is explored: at each
 * pass (every second) the sweeper gives it a ticket, and the next new
 * connection to the VIP takes it there whatever the estimates say; that
 * connection's first packet asks for a score (score.h), so a backend once
 * reported busy is back in the ranking a round trip after it was
 * explored. The cost: at most one connection a second per stale backend
 * (a backend that answers is stale again only a max age later).
 * docs/decisions.md has the reasoning and the alternatives.
 *
 * Weights (relative capacity, struct inband_backend): a backend of weight 4
 * is as loaded as one of weight 1 when it holds four times the
 * connections, so least-score and power-of-two rank by
 *
 *     (estimate + 1) / weight
 *
 * compared by cross-multiplication, (a + 1) * wb < (b + 1) * wa, without a
 * division (estimates stay below 2^33 and weights below 2^16: the products
 * fit in 64 bits). The + 1 is the connection about to be given (HAProxy's
 * weighted leastconn ranks the same way): among idle backends the largest
 * weight wins instead of all tying at 0. With equal weights both sides
 * scale alike, so the ranking and the ties are those of the bare estimate.
 *
 * Ties go to the backend given a new connection least recently
 * (`picked_ns`), as HAProxy's leastconn and nginx's least_conn rotate
 * among equals: at light load, where every idle backend ties at 0, the
 * connections take turns instead of following a coin (a coin gave splits
 * like 9/31 of 40 sequential connections between two idle backends).
 * Backends never picked, or picked in the same nanosecond, tie on and are
 * drawn at random.
 *
 * Round-robin cannot rank; on a VIP whose weights differ it walks the VIP's
 * Maglev table in turn, which holds each backend in proportion to its
 * weight, interleaved (maglev.rs).
 *
 * Large VIPs (more than INBAND_SCAN_MAX slots) are not walked: a new
 * connection costs the same at 33 backends as at 4,096. The control plane
 * keeps each VIP's eligible slots (ACTIVE, not DOWN) dense in
 * vip_eligible; least-score and power-of-two both become two random
 * choices from it (drawn from the Maglev table instead, so in proportion
 * to weight, when the weights differ), compared as above; round-robin
 * takes the eligible entry its ticket names. An entry the control plane
 * has not caught up with yet (a backend just gone DOWN) is passed over
 * for the next one, so every pick is still checked eligible.
 * docs/decisions.md ("Selection at scale") has the costs.
 */
#ifndef INBAND_LB_SELECT_H
#define INBAND_LB_SELECT_H

#include "inband/lb/lifecycle.h"
#include "inband/siphash.h"

_Static_assert(sizeof(struct inband_flow_key) % 8 == 0, "the Maglev hash reads the flow key in 8-byte words");
_Static_assert(INBAND_SCAN_MAX <= 32, "a pick's retry mask is a bit per walked slot");
_Static_assert((INBAND_MAX_BACKENDS_PER_VIP & (INBAND_MAX_BACKENDS_PER_VIP - 1)) == 0,
	       "a slot is bounded by a mask");
_Static_assert(INBAND_MAX_BACKENDS <= 65536, "vip_backends holds backend ids in 16 bits");

static __always_inline __u64 load_estimate(const struct inband_backend_score *s, __u64 now, __u64 max_age_ns)
{
	__u64 base = s->score;
	__u64 updated = s->updated_ns;

	if (updated && max_age_ns && now > updated + max_age_ns) {
		__u64 halvings = (now - updated) / max_age_ns;

		base = halvings >= 32 ? 0 : base >> halvings;
	}
	base += s->opened;
	return base > s->closed ? base - s->closed : 0;
}

/*
 * Selection walks the VIP's slots with bpf_loop: one verification of the
 * step instead of one per slot and per outcome of every earlier slot. It
 * runs on new connections only.
 */
struct pick {
	__u64 now;
	__u64 max_age_ns;
	__u64 best; /* least-score: the estimate of the lightest so far */
	__u64 best_picked; /* least-score: its picked_ns */
	__u32 vid;
	__u32 count; /* valid slots, <= INBAND_MAX_BACKENDS_PER_VIP */
	__u32 eligible; /* large VIPs: entries of its dense eligible set */
	__u32 table; /* its Maglev table (weighted sampling) */
	__u32 weighted; /* large VIPs: sample from the Maglev table */
	__u32 skip; /* slots excluded (bit per slot; small VIPs): backends found without a free port */
	__u32 start; /* round-robin: first slot to try */
	__u32 seen; /* candidates met so far (least-score: ties of best) */
	__u32 id; /* chosen backend id */
	__u32 slot; /* the chosen slot */
	__u32 weight; /* id's weight */
	__u32 other; /* power-of-two: the second sampled id */
	__u32 other_slot;
	__u32 other_weight;
	__u32 found;
	__u32 explored; /* the pick is an exploration ticket */
	__u32 how; /* PICK_* */
};

/* The backend in `slot` of VIP `vid` (its id in `id_out`) if it may take a
 * new connection (active, and not taken down by its health checks), else
 * NULL. Every policy asks this, so a down backend's Maglev entries fall to
 * the next eligible slot: the least disruption of the table. */
static __always_inline const struct inband_backend *active_slot(const struct pick *p, __u32 slot, __u32 *id_out)
{
	if (slot < INBAND_SCAN_MAX && (p->skip & (1U << slot)))
		return NULL;
	__u32 vid = p->vid;
	const struct inband_vip_slots *slots = bpf_map_lookup_elem(&vip_backends, &vid);

	if (!slots)
		return NULL;
	__u32 bid = slots->backend[slot & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (!be || (be->flags & (INBAND_BACKEND_ACTIVE | INBAND_BACKEND_DOWN)) != INBAND_BACKEND_ACTIVE)
		return NULL;
	*id_out = bid;
	return be;
}

/* 0 counts as 1: entries written before weights existed keep their share. */
static __always_inline __u32 weight_of(const struct inband_backend *be)
{
	return be->weight ? be->weight : 1;
}

/* The sign of (a + 1) / wa - (b + 1) / wb: which of two loads is lighter
 * per unit of weight (see the top of this file). */
static __always_inline int cmp_load(__u64 a, __u32 wa, __u64 b, __u32 wb)
{
	__u64 x = (a + 1) * wb, y = (b + 1) * wa;

	return x < y ? -1 : x > y;
}

/* Takes `id`'s exploration ticket if it has one (one CPU wins it): then
 * `id` in `slot` is the pick and the walk stops. */
static __always_inline int explore(struct pick *p, __u32 id, __u32 slot)
{
	__u32 *due = bpf_map_lookup_elem(&probe_due, &id);

	if (!due || !(*due & INBAND_EXPLORE) || !(__sync_fetch_and_and(due, ~INBAND_EXPLORE) & INBAND_EXPLORE))
		return 0;
	p->id = id;
	p->slot = slot;
	p->found = 1;
	p->seen = 1;
	p->explored = 1;
	return 1;
}

/* Takes `slot` (where a Maglev table points) if it is eligible. */
static __always_inline int take_slot(struct pick *p, __u32 slot)
{
	__u32 id;

	if (slot >= p->count || !active_slot(p, slot, &id))
		return 0;
	p->id = id;
	p->slot = slot;
	p->found = 1;
	return 1;
}

/* The slot in entry `i` (modulo its size) of Maglev table `table`
 * (INBAND_MAX_BACKENDS_PER_VIP if there is no table). */
static __always_inline __u32 maglev_entry(__u32 table, __u64 i)
{
	__u32 zero = 0;
	struct inband_lb_config *cfg = bpf_map_lookup_elem(&lb_config, &zero);

	if (!cfg || !cfg->maglev_size)
		return INBAND_MAX_BACKENDS_PER_VIP;
	__u32 idx = table * cfg->maglev_size + (__u32)(i % cfg->maglev_size);
	__u32 *slot = bpf_map_lookup_elem(&maglev, &idx);

	return slot ? *slot : INBAND_MAX_BACKENDS_PER_VIP;
}

/* Entry `i` (modulo its size) of a large VIP's eligible set. */
static __always_inline __u32 eligible_slot(const struct pick *p, __u32 i)
{
	__u32 vid = p->vid;
	const struct inband_vip_eligible *e = bpf_map_lookup_elem(&vip_eligible, &vid);

	if (!e || !p->eligible)
		return INBAND_MAX_BACKENDS_PER_VIP;
	return e->slot[(i % p->eligible) & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
}

/* `id`'s estimate, and when it was last picked in `picked` (0 = never). */
static __always_inline __u64 estimate_of(__u32 id, const struct pick *p, __u64 *picked)
{
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

	*picked = s ? s->picked_ns : 0;
	return s ? load_estimate(s, p->now, p->max_age_ns) : 0;
}

/* cmp_load, with a tie going to the backend picked less recently. */
static __always_inline int cmp_rank(__u64 a, __u32 wa, __u64 picked_a, __u64 b, __u32 wb, __u64 picked_b)
{
	int cmp = cmp_load(a, wa, b, wb);

	if (cmp || picked_a == picked_b)
		return cmp;
	return picked_a < picked_b ? -1 : 1;
}

static __always_inline long round_robin_step(__u32 i, void *arg)
{
	struct pick *p = arg;
	__u32 id;

	if (i >= p->count)
		return 1;
	/* The cursor may point past a VIP that shrank since; % folds it back. */
	__u32 slot = (p->start + i) % p->count;

	if (!active_slot(p, slot, &id))
		return 0;
	p->id = id;
	p->slot = slot;
	p->found = 1;
	return 1;
}

static __always_inline long least_score_step(__u32 slot, void *arg)
{
	struct pick *p = arg;
	const struct inband_backend *be;
	__u32 id;

	if (slot >= p->count)
		return 1;
	be = active_slot(p, slot, &id);
	if (!be)
		return 0;
	if (explore(p, id, slot))
		return 1;
	__u64 picked;
	__u64 est = estimate_of(id, p, &picked);
	__u32 w = weight_of(be);
	int cmp = p->found ? cmp_rank(est, w, picked, p->best, p->weight, p->best_picked) : -1;

	if (cmp < 0) {
		p->best = est;
		p->best_picked = picked;
		p->weight = w;
		p->id = id;
		p->slot = slot;
		p->seen = 1;
		p->found = 1;
	} else if (cmp == 0) {
		/* Reservoir sampling: each of k backends tied on both counts
		 * is kept with probability 1/k in a single pass. */
		p->seen++;
		if (bpf_get_prandom_u32() % p->seen == 0) {
			p->id = id;
			p->slot = slot;
		}
	}
	return 0;
}

/* Reservoir sampling of size two: a uniformly random pair of distinct
 * eligible slots, in one pass and without storing the candidates. */
static __always_inline long two_choices_step(__u32 slot, void *arg)
{
	struct pick *p = arg;
	const struct inband_backend *be;
	__u32 id;

	if (slot >= p->count)
		return 1;
	be = active_slot(p, slot, &id);
	if (!be)
		return 0;
	if (explore(p, id, slot))
		return 1;
	p->seen++;
	__u32 r = p->seen <= 2 ? p->seen - 1 : bpf_get_prandom_u32() % p->seen;

	if (r == 0) {
		p->id = id;
		p->slot = slot;
		p->weight = weight_of(be);
	} else if (r == 1) {
		p->other = id;
		p->other_slot = slot;
		p->other_weight = weight_of(be);
	}
	return 0;
}

/* Large VIPs, round-robin and what Maglev passes on: the eligible set in
 * turn from `start`. */
static __always_inline long eligible_step(__u32 i, void *arg)
{
	struct pick *p = arg;

	return take_slot(p, eligible_slot(p, p->start + i));
}

/* Large VIPs, least-score and power-of-two: two distinct eligible backends
 * drawn at random (from the Maglev table if weighted: in proportion to
 * weight), the second step's draw compared with the first's after the
 * loop. A draw that is not eligible (the set not yet rewritten after a
 * change) or repeats the first is drawn again. */
static __always_inline long sample_step(__u32 i, void *arg)
{
	struct pick *p = arg;
	const struct inband_backend *be;
	__u32 r = bpf_get_prandom_u32(), id;
	__u32 slot = p->weighted ? maglev_entry(p->table, r) : INBAND_MAX_BACKENDS_PER_VIP;

	be = slot < p->count ? active_slot(p, slot, &id) : NULL;
	if (!be) {
		/* Unweighted, or the table's entry is not eligible (a DOWN
		 * backend keeps its entries): the dense set answers. */
		slot = eligible_slot(p, r);
		be = slot < p->count ? active_slot(p, slot, &id) : NULL;
	}
	if (!be || (p->seen && id == p->id))
		return 0;
	if (explore(p, id, slot))
		return 1;
	if (!p->seen) {
		p->id = id;
		p->slot = slot;
		p->weight = weight_of(be);
		p->seen = 1;
		return 0;
	}
	p->other = id;
	p->other_slot = slot;
	p->other_weight = weight_of(be);
	p->seen = 2;
	return 1;
}

#define PICK_ROUND_ROBIN 0
#define PICK_LEAST_SCORE 1
#define PICK_TWO_CHOICES 2
#define PICK_ELIGIBLE 3
#define PICK_SAMPLE 4

/* One bpf_loop call site for every policy: the verifier inlines each call
 * site with stack slots of its own, and a new connection's path needs the
 * stack for other things. */
static long pick_step(__u32 slot, void *arg)
{
	struct pick *p = arg;

	if (p->how == PICK_LEAST_SCORE)
		return least_score_step(slot, arg);
	if (p->how == PICK_TWO_CHOICES)
		return two_choices_step(slot, arg);
	if (p->how == PICK_ELIGIBLE)
		return eligible_step(slot, arg);
	if (p->how == PICK_SAMPLE)
		return sample_step(slot, arg);
	return round_robin_step(slot, arg);
}

/* The choice select_backend() returns. */
struct picked {
	__u32 id;
	__u32 slot;
};

/*
 * Picks a backend for a new connection to `vip`, skipping the slots in
 * `skip`; `fk` is its client side (Maglev hashes it); 0 if no slot is
 * eligible. `out->slot` is the chosen slot (for the
 * caller to add to `skip` if the backend turns out to have no free port).
 * Global (verified once, not at each of its caller's attempts).
 */
__noinline int select_backend(const struct inband_vip *vip, __u32 vid, __u32 skip, const struct inband_flow_key *fk,
			  struct picked *out)
{
	if (!vip || !out || !fk)
		return 0;
	struct pick p = {
		.vid = vid,
		.count = vip->backend_count,
		.eligible = vip->eligible_count,
		.table = vip->maglev_table,
		.max_age_ns = vip->score_max_age_ns,
		.skip = skip,
		/* The clock here, not the caller's: five arguments at most. */
		.now = coarse_now(),
	};

	if (p.count > INBAND_MAX_BACKENDS_PER_VIP)
		p.count = INBAND_MAX_BACKENDS_PER_VIP;
	if (!p.count || vid >= INBAND_MAX_VIPS)
		return 0;
	/* passthrough and dsr-rr have no score feedback to rank by. */
	int by_score = score_mode(vip->mode);
	int large = p.count > INBAND_SCAN_MAX;
	int taken = 0;

	if (large) {
		/* The retry mask names slots below 32 only: a retry after a
		 * backend without a free port draws again instead. */
		p.skip = 0;
		p.weighted = !!(vip->flags & INBAND_VIP_WEIGHTED);
		if (!p.eligible)
			return 0;
	}
	/* least-connections is least-score over the balancer's own counts:
	 * with no score, the estimate is opened - closed. */
	if ((by_score && vip->policy == INBAND_POLICY_LEAST_SCORE) || vip->policy == INBAND_POLICY_LEAST_CONNECTIONS) {
		p.how = large ? PICK_SAMPLE : PICK_LEAST_SCORE;
	} else if (by_score && vip->policy == INBAND_POLICY_POWER_OF_TWO) {
		p.how = large ? PICK_SAMPLE : PICK_TWO_CHOICES;
	} else if (vip->policy == INBAND_POLICY_MAGLEV) {
		__u64 h = inband_siphash24_words(INBAND_MAGLEV_K0, INBAND_MAGLEV_K1, (const __u8 *)fk, sizeof(*fk) / 8);
		__u32 slot = maglev_entry(p.table, h);

		/* If its slot is not eligible (no table yet, a backend without
		 * a free port, a change not yet written), the walk takes the
		 * next eligible slot after it: such connections spread rather
		 * than pile up on one backend. */
		if (!(large && skip))
			taken = take_slot(&p, slot);
		p.start = slot + 1;
		if (large) {
			p.how = PICK_ELIGIBLE;
			p.start = skip ? bpf_get_prandom_u32() : (__u32)h;
		}
	} else {
		__u32 *cursor = bpf_map_lookup_elem(&rr_cursor, &vid);

		if (!cursor)
			return 0;
		/* Each new connection takes the next ticket; ineligible slots
		 * are skipped from there. */
		__u32 ticket = __sync_fetch_and_add(cursor, 1);

		p.start = ticket;
		if (vip->flags & INBAND_VIP_WEIGHTED) {
			/* Consecutive tickets meet each backend as often as
			 * the table holds it; an ineligible entry passes on
			 * as under Maglev. */
			__u32 slot = maglev_entry(p.table, ticket);

			taken = take_slot(&p, slot);
			if (!large)
				p.start = slot + 1;
		}
		if (large)
			p.how = PICK_ELIGIBLE;
	}
	if (!taken)
		bpf_loop(INBAND_SCAN_MAX, pick_step, &p, 0);
	if (p.how == PICK_TWO_CHOICES || p.how == PICK_SAMPLE) {
		p.found = p.seen > 0;
		if (p.seen > 1 && !p.explored) {
			__u64 picked_other, picked_id;
			__u64 other = estimate_of(p.other, &p, &picked_other);
			__u64 id = estimate_of(p.id, &p, &picked_id);
			int cmp = cmp_rank(other, p.other_weight, picked_other, id, p.weight, picked_id);

			if (cmp < 0 || (cmp == 0 && (bpf_get_prandom_u32() & 1))) {
				p.id = p.other;
				p.slot = p.other_slot;
			}
		}
	}
	out->id = p.id;
	out->slot = p.slot;
	return p.found;
}

#endif /* INBAND_LB_SELECT_H */

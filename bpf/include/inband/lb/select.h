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
 * that ends it, so between two reports the estimate follows the backend's
 * connections by itself: an idle backend's estimate falls back as its
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
 */
#ifndef INBAND_LB_SELECT_H
#define INBAND_LB_SELECT_H

#include "inband/lb/lifecycle.h"
#include "inband/siphash.h"

_Static_assert(sizeof(struct inband_flow_key) % 8 == 0, "the Maglev hash reads the flow key in 8-byte words");

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
	__u64 best; /* least-score: lowest estimate so far */
	__u32 vid;
	__u32 count; /* valid slots, <= INBAND_MAX_BACKENDS_PER_VIP */
	__u32 skip; /* slots excluded (bit per slot): backends found without a free port */
	__u32 start; /* round-robin: first slot to try */
	__u32 seen; /* candidates met so far (least-score: ties of best) */
	__u32 id; /* chosen backend id */
	__u32 slot; /* the chosen slot */
	__u32 other; /* power-of-two: the second sampled id */
	__u32 other_slot;
	__u32 found;
	__u32 explored; /* the pick is an exploration ticket */
	__u32 how; /* PICK_* */
};

/* Backend id in `slot` of VIP `vid` if that backend may take a new connection. */
static __always_inline int active_slot(const struct pick *p, __u32 slot, __u32 *id_out)
{
	if (slot < 32 && (p->skip & (1U << slot)))
		return 0;
	__u32 idx = p->vid * INBAND_MAX_BACKENDS_PER_VIP + slot;
	__u32 *id = bpf_map_lookup_elem(&vip_backends, &idx);

	if (!id)
		return 0;
	__u32 bid = *id;
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (!be || !(be->flags & INBAND_BACKEND_ACTIVE))
		return 0;
	*id_out = bid;
	return 1;
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

static __always_inline __u64 estimate_of(__u32 id, const struct pick *p)
{
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

	return s ? load_estimate(s, p->now, p->max_age_ns) : 0;
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
	__u32 id;

	if (slot >= p->count)
		return 1;
	if (!active_slot(p, slot, &id))
		return 0;
	if (explore(p, id, slot))
		return 1;
	__u64 est = estimate_of(id, p);

	if (!p->found || est < p->best) {
		p->best = est;
		p->id = id;
		p->slot = slot;
		p->seen = 1;
		p->found = 1;
	} else if (est == p->best) {
		/* Reservoir sampling: each of k tied backends is kept with
		 * probability 1/k in a single pass. */
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
	__u32 id;

	if (slot >= p->count)
		return 1;
	if (!active_slot(p, slot, &id))
		return 0;
	if (explore(p, id, slot))
		return 1;
	p->seen++;
	if (p->seen == 1) {
		p->id = id;
		p->slot = slot;
	} else if (p->seen == 2) {
		p->other = id;
		p->other_slot = slot;
	} else {
		__u32 r = bpf_get_prandom_u32() % p->seen;

		if (r == 0) {
			p->id = id;
			p->slot = slot;
		} else if (r == 1) {
			p->other = id;
			p->other_slot = slot;
		}
	}
	return 0;
}

#define PICK_ROUND_ROBIN 0
#define PICK_LEAST_SCORE 1
#define PICK_TWO_CHOICES 2

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
	return round_robin_step(slot, arg);
}

/* The slot the VIP's Maglev table gives the connection `fk`
 * (INBAND_MAX_BACKENDS_PER_VIP if there is no table). */
static __always_inline __u32 maglev_slot(__u32 vid, const struct inband_flow_key *fk)
{
	__u32 zero = 0;
	struct inband_lb_config *cfg = bpf_map_lookup_elem(&lb_config, &zero);

	if (!cfg || !cfg->maglev_size)
		return INBAND_MAX_BACKENDS_PER_VIP;
	__u64 h = inband_siphash24_words(INBAND_MAGLEV_K0, INBAND_MAGLEV_K1, (const __u8 *)fk,
					 sizeof(*fk) / 8);
	__u32 idx = vid * cfg->maglev_size + (__u32)(h % cfg->maglev_size);
	__u32 *slot = bpf_map_lookup_elem(&maglev, &idx);

	return slot ? *slot : INBAND_MAX_BACKENDS_PER_VIP;
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

	if (by_score && vip->policy == INBAND_POLICY_LEAST_SCORE) {
		p.how = PICK_LEAST_SCORE;
	} else if (by_score && vip->policy == INBAND_POLICY_POWER_OF_TWO) {
		p.how = PICK_TWO_CHOICES;
	} else if (vip->policy == INBAND_POLICY_MAGLEV) {
		__u32 slot = maglev_slot(vid, fk);
		__u32 id;

		if (slot < p.count && active_slot(&p, slot, &id)) {
			out->id = id;
			out->slot = slot;
			return 1;
		}
		/* Its slot is not eligible (no table yet, a backend without a
		 * free port, a change not yet written): the next eligible slot
		 * after it, so such connections spread rather than pile up. */
		p.start = slot + 1;
	} else {
		__u32 *cursor = bpf_map_lookup_elem(&rr_cursor, &vid);

		if (!cursor)
			return 0;
		/* Each new connection takes the next ticket; ineligible slots
		 * are skipped from there. */
		p.start = __sync_fetch_and_add(cursor, 1);
	}
	bpf_loop(INBAND_MAX_BACKENDS_PER_VIP, pick_step, &p, 0);
	if (p.how == PICK_TWO_CHOICES) {
		p.found = p.seen > 0;
		if (p.seen > 1 && !p.explored) {
			__u64 a = estimate_of(p.id, &p), b = estimate_of(p.other, &p);

			if (b < a || (b == a && (bpf_get_prandom_u32() & 1))) {
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

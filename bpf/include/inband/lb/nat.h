/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * SNAT ports toward a backend.
 *
 * A new connection's candidates are INBAND_SNAT_TRIES ports (each on one
 * of the balancer's source addresses when it has a SNAT pool) derived from
 * a SipHash of its client side under a key only this balancer knows, so an
 * outsider cannot aim a connection at a chosen port, and the same client
 * tuple gets the same port again (a client that reuses its port meets the
 * server's TIME_WAIT with a sequence number it accepts; another client's
 * SYN that meets one has its timestamp raised by the agent,
 * agent/time_wait.h).
 *
 * A candidate is free when no live flow owns it: no reservation in `snat`
 * whose owner is live in `flows`, and no hold in `half_open_ports`.
 * Reservations whose owner is gone are reclaimed on the way. A held port
 * and a closing flow's are preemptible: the search stops at the first free
 * candidate, or once it has seen INBAND_SNAT_HOLDS_SEEN held ones, and
 * then takes the longest-idle preemptible one seen — an unfinished
 * handshake (a SYN flood is made of them) or a closing flow. An
 * established flow's port is never taken.
 *
 * Holds are ranked by the age they carry, not by their handshake's entry:
 * under a flood every candidate is held, and one lookup per candidate
 * instead of two halves the cache misses that dominate a SYN's cost. Only
 * the port finally taken is checked against its handshake.
 */
#ifndef INBAND_LB_NAT_H
#define INBAND_LB_NAT_H

#include "inband/lb/common.h"
#include "inband/lb/lifecycle.h"

_Static_assert(sizeof(struct inband_flow_key) % 8 == 0, "the SNAT hash covers the whole client side");

#define VICTIM_HALF_OPEN 1
#define VICTIM_CLOSING 2

struct port_search {
	struct inband_flow_key fk; /* the new connection */
	struct inband_nat_key nk; /* backend filled in; snat_port per candidate */
	__u64 hash;
	__u64 now;
	__u64 victim_seen; /* last activity of the preemption victim */
	struct inband_flow_key victim; /* its client side */
	__be16 port; /* chosen port, 0 = none yet */
	__be16 victim_port;
	__u16 victim_kind; /* VICTIM_*, 0 = none */
	__u16 holds; /* candidates held by handshakes */
	__u8 addrs; /* source addresses toward the backend: 1 + its family's pool */
	__u8 index; /* the chosen port's address */
	__u8 victim_index;
};

/* The search lives in a per-CPU slot rather than on the stack, which the
 * rest of a new connection's path needs (XDP does not nest on a CPU);
 * bpf_loop's callbacks reach it through a pointer on the stack. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct port_search);
} search_scratch SEC(".maps");

struct search_ref {
	struct port_search *s;
};

static __always_inline __be16 candidate(__u64 hash, __u32 i)
{
	__u32 h = mix32((__u32)hash + i * 0x9e3779b9) ^ (__u32)(hash >> 32);

	return bpf_htons((__u16)(INBAND_SNAT_PORT_MIN + h % SNAT_PORT_RANGE));
}

/* The address of candidate i: from other bits of the hash than its port,
 * so that the same client side gets the same address and port again. */
static __always_inline __u8 candidate_index(__u64 hash, __u32 i, __u8 addrs)
{
	if (addrs <= 1)
		return 0;
	return (__u8)(mix32((__u32)(hash >> 32) + i * 0x85ebca6b) % addrs);
}

static __always_inline void consider_victim(struct port_search *s, __u16 kind, const struct inband_flow_key *owner,
					    __u64 last_seen)
{
	if (s->victim_kind && (__s64)(last_seen - s->victim_seen) >= 0)
		return;
	s->victim_kind = kind;
	s->victim_seen = last_seen;
	s->victim = *owner;
	s->victim_port = s->nk.snat_port;
	s->victim_index = s->nk.snat_index;
}

/* Takes the candidate in s->nk if it is free (1), or records it as a
 * possible victim (0; 1 also once enough held ones were seen). */
static __always_inline long try_candidate(struct port_search *s)
{
	struct inband_port_hold *hold;
	struct inband_snat_owner *res;
	struct inband_flow *owner;

	hold = bpf_map_lookup_elem(&half_open_ports, &s->nk);
	if (hold) {
		if (same_flow_key(&hold->flow, &s->fk)) {
			/* Ours already: a new attempt of the same client. */
			hold->since_ns = s->now;
			s->port = s->nk.snat_port;
			s->index = s->nk.snat_index;
			return 1;
		}
		consider_victim(s, VICTIM_HALF_OPEN, &hold->flow, hold->since_ns);
		return ++s->holds >= INBAND_SNAT_HOLDS_SEEN;
	}
	res = bpf_map_lookup_elem(&snat, &s->nk);
	if (res) {
		owner = bpf_map_lookup_elem(&flows, &res->flow);
		if (owner && flow_has_port(owner, &s->nk)) {
			if (!flow_expired(owner, s->now)) {
				if (owner->state == INBAND_FLOW_CLOSING)
					consider_victim(s, VICTIM_CLOSING, &res->flow, owner->last_seen_ns);
				return 0;
			}
			bpf_map_delete_elem(&flows, &res->flow);
			event(INBAND_EV_FLOWS_EXPIRED);
		} else {
			event(INBAND_EV_SNAT_ORPHANS_RECLAIMED);
		}
		bpf_map_delete_elem(&snat, &s->nk);
	}
	struct inband_port_hold mine = { .flow = s->fk, .since_ns = s->now };

	/* NOEXIST: another CPU may claim the same free port right now. */
	if (bpf_map_update_elem(&half_open_ports, &s->nk, &mine, BPF_NOEXIST))
		return 0;
	s->port = s->nk.snat_port;
	s->index = s->nk.snat_index;
	return 1;
}

static long port_step(__u32 i, void *arg)
{
	struct port_search *s = ((struct search_ref *)arg)->s;

	s->nk.snat_port = candidate(s->hash, i);
	s->nk.snat_index = candidate_index(s->hash, i, s->addrs);
	return try_candidate(s);
}

/*
 * The fleet tuple of the connection `fk` into `nk` (its backend filled
 * in): fleet_prefix + a 32-bit suffix and a port, all from one SipHash of
 * the client side under the fleet's key, so every instance computes the
 * same one. A suffix of 0 would be the prefix's Subnet-Router anycast
 * address (RFC 4291): it becomes 1.
 */
static __always_inline void fleet_tuple(const struct inband_lb_config *cfg, const struct inband_flow_key *fk,
					struct inband_nat_key *nk)
{
	__u64 h = inband_siphash24_words(cfg->fleet_key[0], cfg->fleet_key[1], (const __u8 *)fk,
					 sizeof(struct inband_flow_key) / 8);
	__u32 suffix = (__u32)(h >> 32);

	nk->snat_port = candidate(h, 0);
	nk->snat_index = INBAND_SNAT_FLEET;
	nk->fleet_suffix = bpf_htonl(suffix | !suffix);
}

/* Only this one candidate: if a connection here holds it (two client
 * sides that hash alike), the new one searches this balancer's own tuples
 * instead, and only an instance that holds nothing on it can carry it. */
static __always_inline int try_fleet(const struct inband_lb_config *cfg, struct port_search *s)
{
	fleet_tuple(cfg, &s->fk, &s->nk);
	try_candidate(s);
	if (s->port)
		return 1;
	/* Held or owned here: no victim is taken from the fleet tuple, and the
	 * search over the own tuples starts afresh. */
	s->victim_kind = 0;
	s->holds = 0;
	s->nk.snat_index = 0;
	s->nk.fleet_suffix = 0;
	return 0;
}

/*
 * Frees the port of the search's victim: no hold and no reservation left
 * on it. A handshake is ended if it still holds the port; a hold whose
 * handshake is gone (evicted, promoted, timed out before the sweeper saw
 * it) is only a stale hold, and is removed unless, against every
 * invariant, a live flow has reserved the port meanwhile. Returns 0 when
 * the port cannot be taken.
 */
static __always_inline int free_victim_port(const struct port_search *s)
{
	if (s->victim_kind == VICTIM_CLOSING) {
		bpf_map_delete_elem(&flows, &s->victim);
		bpf_map_delete_elem(&snat, &s->nk);
		event(INBAND_EV_SNAT_PREEMPT_CLOSING);
		return 1;
	}
	struct inband_flow *owner = bpf_map_lookup_elem(&half_open, &s->victim);

	if (owner && flow_has_port(owner, &s->nk)) {
		struct inband_flow victim = *owner;

		if (!bpf_map_delete_elem(&half_open, &s->victim))
			handshake_abandoned(&victim);
		bpf_map_delete_elem(&half_open_ports, &s->nk);
		event(INBAND_EV_SNAT_PREEMPT_HALF_OPEN);
		return 1;
	}
	struct inband_snat_owner *res = bpf_map_lookup_elem(&snat, &s->nk);

	if (res) {
		struct inband_flow *f = bpf_map_lookup_elem(&flows, &res->flow);

		if (f && flow_has_port(f, &s->nk))
			return 0;
	}
	bpf_map_delete_elem(&half_open_ports, &s->nk);
	return 1;
}

/*
 * Finds a port toward the backend in `nk` for the connection `fk` and
 * holds it for the handshake (half_open_ports). Returns the port (network
 * order), with its source address's index in nk->snat_index (and a fleet
 * tuple's suffix in nk->fleet_suffix), or 0 when every candidate belongs
 * to a live established flow. `fleet`: try the fleet tuple first.
 * Global (verified once, not at each of its caller's attempts).
 */
__noinline int reserve_snat_port(const struct inband_lb_config *cfg, const struct inband_flow_key *fk,
				 struct inband_nat_key *nk, __u64 now, __u32 fleet)
{
	__u32 zero = 0;
	struct port_search *s = bpf_map_lookup_elem(&search_scratch, &zero);

	if (!s || !cfg || !fk || !nk)
		return 0;
	__builtin_memset(s, 0, sizeof(*s));
	s->fk = *fk;
	s->nk = *nk;
	s->now = now;
	s->addrs = 1 + (inband_addr_is4(&nk->backend_addr) ? cfg->snat_pool4_n : cfg->snat_pool6_n);
	s->hash = inband_siphash24_words(cfg->snat_key[0], cfg->snat_key[1], (const __u8 *)fk,
					 sizeof(struct inband_flow_key) / 8);
	if (fleet) {
		if (try_fleet(cfg, s)) {
			nk->snat_index = INBAND_SNAT_FLEET;
			nk->fleet_suffix = s->nk.fleet_suffix;
			event(INBAND_EV_FLEET_TUPLES);
			return s->port;
		}
		event(INBAND_EV_FLEET_PINNED);
	}
	struct search_ref ref = { .s = s };

	bpf_loop(INBAND_SNAT_TRIES, port_step, &ref, 0);
	if (s->port || !s->victim_kind) {
		nk->snat_index = s->index;
		return s->port;
	}

	s->nk.snat_port = s->victim_port;
	s->nk.snat_index = s->victim_index;
	if (!free_victim_port(s))
		return 0;
	struct inband_port_hold mine = { .flow = *fk, .since_ns = now };

	/* NOEXIST: another CPU's SYN may have picked the same victim; one of
	 * them gets the port, the other none (its caller tries another
	 * backend). Replacing the hold in place would give it to both. */
	if (bpf_map_update_elem(&half_open_ports, &s->nk, &mine, BPF_NOEXIST))
		return 0;
	nk->snat_index = s->victim_index;
	return s->victim_port;
}

#endif /* INBAND_LB_NAT_H */

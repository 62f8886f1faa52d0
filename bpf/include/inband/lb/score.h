/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * In-band feedback on the balancer: when a packet toward a backend asks for
 * its score (124), building the options it sends (155, 124) in the
 * configured format, and deciding whether a 125 that comes back is taken.
 *
 * A 125 is taken only from the backend that owns the connection it rides
 * on (the caller found it through `snat`), on a flow with an outstanding
 * 124, in the configured format, with valid checksums (the caller checks)
 * and, when authenticated, with the 124's nonce and a valid MAC. Anything
 * else is counted and not recorded.
 */
#ifndef INBAND_LB_SCORE_H
#define INBAND_LB_SCORE_H

#include "inband/auth.h"
#include "inband/lb/common.h"

/*
 * Whether this packet toward a dsr-dynamic flow's backend should carry a
 * 124: every n-th packet to the backend on this CPU, and the first packet
 * after the sweeper found the backend's score older than half its max age
 * (probe_due), so under light load a quiet backend's first packet asks
 * (select.h relies on it). n is the backend's adaptive interval
 * (adapt_interval), within the VIP's bounds. Returns the CPU's counter to
 * reset once the 124 is really added.
 */
static __always_inline __u32 *probe_wanted(const struct inband_flow *f, const struct inband_vip *vc)
{
	__u32 id = f->backend_id;
	__u32 *count = bpf_map_lookup_elem(&probe_count, &id);
	__u32 *due = bpf_map_lookup_elem(&probe_due, &id);
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

	if (!count || !due || !s || !vc->probe_interval)
		return NULL;
	*count += 1;
	/* One request per flow at a time: a second would replace the nonce
	 * while the first one's answer may be on its way. The count stays
	 * due, so the next packet of another flow to the backend asks. */
	if (f->flags & INBAND_FLOW_PROBE_OUTSTANDING)
		return NULL;
	__u32 n = s->interval;

	if (n < vc->probe_interval || n > vc->probe_interval_max)
		n = vc->probe_interval;
	if (*count >= n || (*due & INBAND_PROBE_DUE))
		return count;
	return NULL;
}

/*
 * The VIP's probe budget (124s per second per backend), as a generic cell
 * rate: each 124 moves the backend's budget_ns one emission interval on
 * from max(now, budget_ns); a 124 is allowed while budget_ns is less than
 * four intervals ahead of now (a burst of four). Read with the coarse
 * clock, and only when a 124 is due. Concurrent CPUs may both spend the
 * same slot: the bound holds to within a packet per CPU.
 */
static __always_inline int probe_budget_ok(const struct inband_vip *vc, __u32 backend_id)
{
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &backend_id);

	if (!vc->probe_budget)
		return 1;
	if (!s)
		return 0;
	__u64 now = coarse_now();
	__u64 step = 1000000000ULL / vc->probe_budget;
	__u64 tat = s->budget_ns;

	if (tat < now)
		tat = now;
	if (tat > now + 4 * step) {
		event(INBAND_EV_PROBE_BUDGET);
		return 0;
	}
	s->budget_ns = tat + step;
	return 1;
}

static __always_inline void probe_sent(__u32 *count, __u32 backend_id)
{
	__u32 *due = bpf_map_lookup_elem(&probe_due, &backend_id);
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &backend_id);

	*count = 0;
	if (due && (*due & INBAND_PROBE_DUE))
		__sync_fetch_and_and(due, ~INBAND_PROBE_DUE);
	if (s)
		__sync_fetch_and_add(&s->unanswered, 1);
}

static __always_inline struct inband_auth_key *signing_key(const struct inband_lb_config *cfg)
{
	__u32 id = cfg->sign_key;
	struct inband_auth_key *k = bpf_map_lookup_elem(&auth_keys, &id);

	return k && k->valid ? k : NULL;
}

/* What a MAC is over besides the connection: BPF calls take five
 * arguments at most. */
struct mac_req {
	const struct inband_auth_key *key;
	__be32 nonce;
	__u16 score; /* 125 only, host order */
	__u8 kind;
	__u8 key_id;
};

/* The MAC messages live in a per-CPU slot: the paths that sign are deep
 * enough without 96 more bytes of stack. */
struct mac_msgs {
	struct inband_mac_msg6 v6;
	struct inband_mac_msg v4;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mac_msgs);
} mac_scratch SEC(".maps");

/*
 * The MAC of an option on flow `f`, over its connection as the backend
 * sees it (the balancer's address and SNAT port -> the backend): the IPv4
 * or IPv6 message by the flow's family, the transport tag by its protocol.
 * `fk`: the client side, for a 155; NULL otherwise.
 */
static __noinline __u64 flow_mac(const struct mac_req *r, const struct inband_lb_config *cfg,
				 const struct inband_flow *f, const struct inband_flow_key *fk)
{
	const struct inband_addr *self = snat_addr(cfg, &f->backend_addr, f->snat_index, f->fleet_suffix);
	__u32 zero = 0;
	struct mac_msgs *ms = bpf_map_lookup_elem(&mac_scratch, &zero);

	if (!ms || !self)
		return 0;
	if (inband_addr_is4(&f->backend_addr)) {
		struct inband_mac_msg *m = &ms->v4;

		inband_mac_msg_init(m, r->kind, r->key_id, r->nonce, self->w[3], f->snat_port, f->backend_addr.w[3],
				    f->backend_port);
		m->tag[1] = inband_mac_tag(f->proto);
		if (fk) {
			m->client_addr = fk->client_addr.w[3];
			m->client_port = fk->client_port;
		}
		m->score = bpf_htons(r->score);
		return inband_mac(r->key, m);
	}
	struct inband_mac_msg6 *m = &ms->v6;

	inband_mac_msg6_init(m, r->kind, r->key_id, r->nonce, (const __u8 *)self, f->snat_port,
			     (const __u8 *)&f->backend_addr, f->backend_port);
	m->tag[1] = inband_mac_tag(f->proto);
	if (fk) {
		__builtin_memcpy(m->client_addr, &fk->client_addr, 16);
		m->client_port = fk->client_port;
	}
	m->score = bpf_htons(r->score);
	return inband_mac6(r->key, m);
}

/*
 * The 155 for the connection `fk` forwarded as `f`, in the configured
 * format and the flow's family, bound to `nonce` (the SYN's sequence
 * number; UDP: the flow's first packet's time). Returns its length, 0 if
 * there is no signing key (never, once configured).
 */
static __noinline int build_tuple(__u8 *out, const struct inband_lb_config *cfg, const struct inband_flow_key *fk,
				  const struct inband_flow *f, __be32 nonce)
{
	int v4 = inband_addr_is4(&fk->client_addr);

	if (cfg->auth_mode == INBAND_AUTH_NONE) {
		if (v4) {
			inband_encode_client_tuple(out, fk->client_addr.w[3], fk->client_port);
			return INBAND_OPT_CLIENT_TUPLE_LEN;
		}
		inband_encode_client_tuple6(out, (const __u8 *)&fk->client_addr, fk->client_port);
		return INBAND_OPT6_CLIENT_TUPLE_LEN;
	}
	struct inband_auth_key *k = signing_key(cfg);

	if (!k)
		return 0;
	struct mac_req r = { .key = k, .nonce = nonce, .kind = INBAND_OPT_CLIENT_TUPLE, .key_id = cfg->sign_key };
	__u64 mac = flow_mac(&r, cfg, f, fk);
	const void *a4 = &fk->client_addr.w[3], *a6 = &fk->client_addr;

	/* UDP has no sequence number: the nonce (the flow's start, ms) rides
	 * in the option as its stamp. */
	if (f->proto == IPPROTO_UDP) {
		if (v4) {
			inband_encode_auth_client_tuple(out, cfg->sign_key, a4, 4, fk->client_port, 1, nonce, mac);
			return INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN;
		}
		inband_encode_auth_client_tuple(out, cfg->sign_key, a6, 16, fk->client_port, 1, nonce, mac);
		return INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN;
	}
	if (v4) {
		inband_encode_auth_client_tuple(out, cfg->sign_key, a4, 4, fk->client_port, 0, 0, mac);
		return INBAND_OPT_AUTH_CLIENT_TUPLE_LEN;
	}
	inband_encode_auth_client_tuple(out, cfg->sign_key, a6, 16, fk->client_port, 0, 0, mac);
	return INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN;
}

/* The length of the 155 build_tuple makes for a flow of this family and
 * transport, before it is made (the MTU check needs it). */
static __always_inline __u32 tuple_len(const struct inband_lb_config *cfg, int v4, __u8 proto)
{
	if (cfg->auth_mode == INBAND_AUTH_NONE)
		return v4 ? INBAND_OPT_CLIENT_TUPLE_LEN : INBAND_OPT6_CLIENT_TUPLE_LEN;
	if (proto == IPPROTO_UDP)
		return v4 ? INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN : INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN;
	return v4 ? INBAND_OPT_AUTH_CLIENT_TUPLE_LEN : INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN;
}

static __always_inline __u32 request_len(const struct inband_lb_config *cfg)
{
	return cfg->auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_REQUEST_LEN : INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
}

/* The 124 for flow `f` in the configured format; records an authenticated
 * one's nonce and key in `f`. Returns its length, 0 without a signing key. */
static __noinline int build_request(__u8 *out, const struct inband_lb_config *cfg, struct inband_flow *f)
{
	if (cfg->auth_mode == INBAND_AUTH_NONE) {
		inband_encode_score_request(out);
		return INBAND_OPT_SCORE_REQUEST_LEN;
	}
	struct inband_auth_key *k = signing_key(cfg);
	__be32 nonce = bpf_get_prandom_u32();

	if (!k)
		return 0;
	struct mac_req r = { .key = k, .nonce = nonce, .kind = INBAND_OPT_SCORE_REQUEST, .key_id = cfg->sign_key };

	inband_encode_auth_score_request(out, cfg->sign_key, nonce, flow_mac(&r, cfg, f, NULL));
	f->probe_nonce = nonce;
	f->probe_key = cfg->sign_key;
	return INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
}

/*
 * Decides about the 125 in `opt` (`len` bytes) on flow `f`. Returns 1 and
 * the score (host order) if it is to be recorded; else counts why not.
 */
static __noinline int score_accepted(const struct inband_lb_config *cfg, const struct inband_flow *f,
				     const __u8 *opt, __u32 len, __u16 *score)
{
	if (cfg->auth_mode == INBAND_AUTH_NONE ? len != INBAND_OPT_SCORE_LEN : len != INBAND_OPT_AUTH_SCORE_LEN) {
		event(INBAND_EV_SCORE_WRONG_FORMAT);
		return 0;
	}
	if (!(f->flags & INBAND_FLOW_PROBE_OUTSTANDING)) {
		event(INBAND_EV_SCORE_UNSOLICITED);
		return 0;
	}
	*score = (__u16)opt[2] << 8 | opt[3];
	if (cfg->auth_mode == INBAND_AUTH_NONE)
		return 1;

	__be32 nonce = load32(opt + INBAND_AUTH_SCORE_NONCE_OFF);
	__u32 kid = f->probe_key;
	struct inband_auth_key *k = bpf_map_lookup_elem(&auth_keys, &kid);

	if (!k || !k->valid || nonce != f->probe_nonce) {
		event(INBAND_EV_SCORE_BAD_MAC);
		return 0;
	}
	struct mac_req r = { .key = k, .nonce = nonce, .score = *score, .kind = INBAND_OPT_SCORE, .key_id = f->probe_key };

	if (flow_mac(&r, cfg, f, NULL) != inband_get_mac(opt + INBAND_AUTH_SCORE_MAC_OFF)) {
		event(INBAND_EV_SCORE_BAD_MAC);
		return 0;
	}
	return 1;
}

/*
 * The adaptive interval: a report that moved the score by more than an
 * eighth (at least 1) halves the backend's n, down to the VIP's
 * probe_interval; a report within that grows it by a quarter (+1), up to
 * probe_interval_max. Freshness is bought where the score moves and
 * packets are saved where it does not (docs/decisions.md). Equal bounds:
 * a fixed n, as in the seed.
 */
static __always_inline void adapt_interval(struct inband_backend_score *s, const struct inband_vip *vc, __u16 score)
{
	__u32 lo = vc->probe_interval, hi = vc->probe_interval_max;
	__u32 n = s->interval;

	if (hi <= lo) {
		s->interval = lo;
		return;
	}
	if (n < lo || n > hi)
		n = lo;
	__u32 old = s->score;
	__u32 delta = score > old ? score - old : old - score;
	__u32 tolerance = old / 8 > 1 ? old / 8 : 1;

	if (s->updated_ns && delta > tolerance) {
		n = n / 2 > lo ? n / 2 : lo;
		s->changes++;
		event(INBAND_EV_PROBE_FASTER);
	} else {
		n = n + n / 4 + 1 < hi ? n + n / 4 + 1 : hi;
	}
	s->interval = n;
}

static __always_inline void record_score(struct inband_flow *f, __u16 score, __u64 now)
{
	__u32 bid = f->backend_id, vid = f->vip_id;
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &bid);
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);

	if (s) {
		if (vc)
			adapt_interval(s, vc, score);
		/* Plain aligned stores: a racing SYN's `opened` increment is
		 * either counted against the new score or not, both fine for a
		 * load estimate. */
		s->score = score;
		s->opened = 0;
		/* A 125 on a closing flow rides the backend's answer to the
		 * client's FIN (or its own FIN that crossed it), sent before
		 * that FIN ended the connection there: the score still counts
		 * the connection whose close was counted here already. Its
		 * close is carried over, or it stayed counted until the next
		 * report (at light load, seconds of an idle backend looking
		 * busy). */
		s->closed = f->state == INBAND_FLOW_CLOSING;
		s->unanswered = 0;
		s->updated_ns = now;
	}
	/* The sweeper gave the backend an exploration ticket for a stale
	 * report; this one is fresh, and a ticket taken now would send a
	 * connection to a backend the report may show busy. */
	__u32 *due = bpf_map_lookup_elem(&probe_due, &bid);

	if (due && (*due & INBAND_EXPLORE))
		__sync_fetch_and_and(due, ~INBAND_EXPLORE);
	f->flags &= ~(INBAND_FLOW_PROBE_OUTSTANDING | INBAND_FLOW_PROBE_OLD);
}

#endif /* INBAND_LB_SCORE_H */

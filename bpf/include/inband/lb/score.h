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
 * 124: every probe_interval-th packet to the backend on this CPU, and the
 * first packet after the sweeper found the backend's score older than half
 * its max age (probe_due), so under light load a quiet backend's first
 * packet asks (select.h relies on it). Returns the CPU's counter to reset
 * once the 124 is really added.
 */
static __always_inline __u32 *probe_wanted(const struct inband_flow *f, const struct inband_vip *vc)
{
	__u32 id = f->backend_id;
	__u32 *count = bpf_map_lookup_elem(&probe_count, &id);
	__u32 *due = bpf_map_lookup_elem(&probe_due, &id);

	if (!count || !due || !vc->probe_interval)
		return NULL;
	*count += 1;
	/* One request per flow at a time: a second would replace the nonce
	 * while the first one's answer may be on its way. The count stays
	 * due, so the next packet of another flow to the backend asks. */
	if (f->flags & INBAND_FLOW_PROBE_OUTSTANDING)
		return NULL;
	if (*count >= vc->probe_interval || (*due & INBAND_PROBE_DUE))
		return count;
	return NULL;
}

static __always_inline void probe_sent(__u32 *count, __u32 backend_id)
{
	__u32 *due = bpf_map_lookup_elem(&probe_due, &backend_id);

	*count = 0;
	if (due && (*due & INBAND_PROBE_DUE))
		__sync_fetch_and_and(due, ~INBAND_PROBE_DUE);
}

static __always_inline struct inband_auth_key *signing_key(const struct inband_lb_config *cfg)
{
	__u32 id = cfg->sign_key;
	struct inband_auth_key *k = bpf_map_lookup_elem(&auth_keys, &id);

	return k && k->valid ? k : NULL;
}

/* The authenticated 155 for a SYN from `fk` with sequence number `seq`,
 * forwarded as `f`. 0 if there is no signing key (never, once configured). */
static __noinline int build_auth_tuple(__u8 *out, const struct inband_lb_config *cfg,
					    const struct inband_flow_key *fk, const struct inband_flow *f,
					    __be32 seq)
{
	struct inband_auth_key *k = signing_key(cfg);
	struct inband_mac_msg m;

	if (!k)
		return 0;
	inband_mac_msg_init(&m, INBAND_OPT_CLIENT_TUPLE, cfg->sign_key, seq, cfg->self_addr, f->snat_port,
			    f->backend_addr, f->backend_port);
	m.client_addr = fk->client_addr;
	m.client_port = fk->client_port;
	inband_encode_auth_client_tuple(out, cfg->sign_key, fk->client_addr, fk->client_port, inband_mac(k, &m));
	return 1;
}

/* The authenticated 124 for flow `f`; records its nonce and key in `f`. */
static __noinline int build_auth_request(__u8 *out, const struct inband_lb_config *cfg, struct inband_flow *f)
{
	struct inband_auth_key *k = signing_key(cfg);
	struct inband_mac_msg m;
	__be32 nonce = bpf_get_prandom_u32();

	if (!k)
		return 0;
	inband_mac_msg_init(&m, INBAND_OPT_SCORE_REQUEST, cfg->sign_key, nonce, cfg->self_addr, f->snat_port,
			    f->backend_addr, f->backend_port);
	inband_encode_auth_score_request(out, cfg->sign_key, nonce, inband_mac(k, &m));
	f->probe_nonce = nonce;
	f->probe_key = cfg->sign_key;
	return 1;
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
	struct inband_mac_msg m;

	if (!k || !k->valid || nonce != f->probe_nonce) {
		event(INBAND_EV_SCORE_BAD_MAC);
		return 0;
	}
	inband_mac_msg_init(&m, INBAND_OPT_SCORE, f->probe_key, nonce, cfg->self_addr, f->snat_port, f->backend_addr,
			    f->backend_port);
	m.score = bpf_htons(*score);
	if (inband_mac(k, &m) != inband_get_mac(opt + INBAND_AUTH_SCORE_MAC_OFF)) {
		event(INBAND_EV_SCORE_BAD_MAC);
		return 0;
	}
	return 1;
}

static __always_inline void record_score(struct inband_flow *f, __u16 score, __u64 now)
{
	__u32 bid = f->backend_id;
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &bid);

	if (s) {
		/* Plain aligned stores: a racing SYN's `opened` increment is
		 * either counted against the new score or not, both fine for a
		 * load estimate. */
		s->score = score;
		s->opened = 0;
		s->closed = 0;
		s->updated_ns = now;
	}
	f->flags &= ~(INBAND_FLOW_PROBE_OUTSTANDING | INBAND_FLOW_PROBE_OLD);
}

#endif /* INBAND_LB_SCORE_H */

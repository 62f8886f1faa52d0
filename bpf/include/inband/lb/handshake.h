/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Step 2 of the walk: a client packet to a VIP with no established flow.
 * The TCP handshake (a SYN, a retransmitted SYN, the client's first ACK or
 * its RST), a UDP flow's first two datagrams, and how a client's FIN or RST
 * ends its side of a flow (client_end) or starts a later connection on the
 * tuple (later_connection), which established() uses too. The states and
 * tables a flow moves through are lifecycle.h's; this is what moves it
 * there. Apart from the walk because handshake() has a stack frame of its
 * own (not inlined): it answers the walk with the verdicts below instead
 * of calling forward() or open_flow() itself.
 */
#ifndef INBAND_LB_HANDSHAKE_H
#define INBAND_LB_HANDSHAKE_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

#include "inband/lb/common.h"
#include "inband/lb/lifecycle.h"
#include "inband/lb/parse.h"
#include "inband/lb/peer_choices.h"
#include "inband/lb/query.h"
#include "inband/lb/quic.h"
#include "inband/lb/scale_out.h"

/* The walk's own verdicts, next to XDP_*: what established() and
 * handshake() tell balancer() to do next. */
/* What established() returns when the packet opens a new connection on the
 * tuple instead (its flow ended): the caller balances it afresh. */
#define REBALANCE (-1)
/* What handshake() returns when the packet is to be forwarded: on the flow
 * copy in `flow_scratch`, or on its entry in `flows`. The walk forwards it,
 * so handshake's frame and forward's are never on one call chain (512
 * bytes of stack for the whole chain). */
#define FWD_COPY (-2)
#define FWD_FLOW (-3)
/* ... or when it opens a new connection: the walk calls open_flow() (with
 * p->named), for the same reason. */
#define OPEN_FLOW (-4)

/* ... or when the packet is to be chained to the router's shadow table
 * (scale-out): the walk wraps it and sends it back. */
#define CHAIN (-5)

/* ... or when a stray at the direct SID may be adopted: the walk calls
 * adopt(), for the same reason (its walk of a VIP's slots needs stack). */
#define ADOPT (-7)

/* ... or when the packet belongs to a later connection on the flow's tuple
 * (later_connection()): the caller handles it as if there were no flow. */
#define LATER_CONNECTION (-6)

/* How far past a finished client's FIN or RST a segment of the same
 * connection can still start: that segment's payload and the FIN's one
 * sequence number. */
#define LATER_SEQ_MARGIN 65536

/* The flow a handshake forwards a packet on when it is not (yet) in
 * `flows`: a new handshake, a retransmitted SYN's, one ending; forward(),
 * open_flow() and the return path use it for their copies too. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_flow);
} flow_scratch SEC(".maps");

static __always_inline struct inband_flow *scratch_flow(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&flow_scratch, &zero);
}

/* How a backend's handshakes end, for the lb daemon's passive health
 * checks (health.rs). */
#define HS_RETRIED 0
#define HS_REFUSED 1
static __always_inline void count_handshake(__u32 backend_id, int how)
{
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &backend_id);

	if (!bs)
		return;
	if (how == HS_REFUSED)
		bs->handshakes_refused++;
	else
		bs->handshakes_retried++;
}

/* open_flow's choice of backend: one a QUIC connection ID named, packed
 * as (slot << 16) | (id + 1); 0 = choose one. */
#define NAMED(id, slot) (((slot) << 16) | ((id) + 1))

/* A UDP datagram to VIP `vid` with no established flow: the first opens
 * one (a QUIC short header goes where its ID says), the second completes
 * it. A flow that never sees a second datagram stays half-open until
 * syn_timeout: its answers still find their way back through it. */
static __always_inline int udp_handshake(struct xdp_md *ctx, const struct inband_lb_config *cfg, __u32 vid,
					 const struct inband_vip *vc, struct inband_flow *ho, struct pkt *p)
{
	if (ho)
		return promote(&p->fk, ho, p->now) ? FWD_FLOW : XDP_DROP;
	__u32 id = 0, slot = 0, named = 0;

	if (vc->flags & INBAND_VIP_QUIC) {
		int found = quic_backend(ctx, p, vc, vid, &id, &slot);

		if (found > 0) {
			named = NAMED(id, slot);
			event(INBAND_EV_QUIC_CID_ROUTED);
		} else if (found == 0) {
			event(INBAND_EV_QUIC_CID_UNKNOWN);
		}
	}
	p->named = named;
	return OPEN_FLOW;
}

/* The client's FIN or RST: where its sequence space ends. */
static __always_inline void client_finished(struct inband_flow *f, const struct pkt *p)
{
	f->client_seq = p->seq;
	f->client_done = 1;
}

/* A client's FIN or RST on flow `f`: it ends the client's side only inside
 * the client's sequence window (lifecycle.h); outside it (a guess at the
 * tuple, or a segment of some other connection) it is still forwarded, the
 * backend's stack judging it as it would without us (RFC 5961), and the
 * flow is left as it was. */
static __always_inline void client_end(struct inband_flow *f, const struct pkt *p)
{
	if (!seq_in_window(f, p->seq)) {
		event(INBAND_EV_OUT_OF_WINDOW);
		return;
	}
	flow_close(f);
	client_finished(f, p);
}

/*
 * A client segment past the end its FIN or RST set is a later connection on
 * the same tuple: a client that reused its port while the old flow is still
 * closing. Its SYN made no way here (a SYN on a closing flow re-balances),
 * so behind ECMP it went to another instance, which owns it; sent to the old
 * backend, it would meet a TIME-WAIT socket and the connection would hang.
 * Serial-number arithmetic: a reused tuple's new sequence numbers run ahead
 * of the old ones (RFC 6528's clock, what TIME-WAIT reuse relies on too). A
 * flow the server closed is left alone: its client may still send.
 */
static __always_inline int later_connection(const struct inband_flow *f, const struct pkt *p)
{
	return f->client_done && seq_after(p->seq, f->client_seq) > LATER_SEQ_MARGIN;
}

struct adopt_bucket {
	__u64 refill_ns;
	__u32 tokens;
	__u32 pad;
};

/* Adoptions left this second, per CPU; not pinned: a restart refills it. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct adopt_bucket);
} adopt_tokens SEC(".maps");

/* Takes one of this CPU's adoptions (a bucket of adopt_per_s, refilled
 * as time passes); 0 when spent. */
static __always_inline int adopt_token(const struct inband_lb_config *cfg, __u64 now)
{
	__u32 zero = 0, rate = cfg->adopt_per_s;
	struct adopt_bucket *b = bpf_map_lookup_elem(&adopt_tokens, &zero);

	if (!b || !rate)
		return 0;
	__u64 elapsed = now - b->refill_ns;

	if (elapsed >= 1000000000ULL) {
		b->tokens = rate;
		b->refill_ns = now;
	} else {
		__u64 add = elapsed * rate / 1000000000ULL;

		if (add) {
			b->tokens = b->tokens + add > rate ? rate : b->tokens + (__u32)add;
			b->refill_ns += add * 1000000000ULL / rate;
		}
	}
	if (!b->tokens)
		return 0;
	b->tokens--;
	return 1;
}

/*
 * A TCP segment that reached the end of the chain (the direct SID) with no
 * flow here: its opener is gone (an instance's host crashed) or had it
 * before the router's oldest generation. A fleet VIP's connection can be
 * carried from here: its tuple is the fleet tuple, and its backend the
 * VIP's Maglev primary for the client side (Maglev), or the one its opener
 * announced (any other policy: peer_choices.h). Adopted, it becomes an
 * established flow here (FWD_FLOW); the backend's socket sees the same
 * tuple as before. A connection the opener pinned to its own tuple (a
 * local collision), or whose Maglev primary was not eligible then, cannot
 * be reproduced: the backend answers the adopted flow's segments with a
 * RST, as it would have answered the drop
 * with a timeout. No eligibility test: the connection lives at its
 * backend whatever this instance's health view says. Forged strays to the
 * direct SID can create flows only at adopt_per_s a CPU (`adopt_budget`).
 * Global: its own frame, not the walk's; called by the walk (ADOPT).
 */
__noinline int adopt(struct xdp_md *ctx, const struct inband_lb_config *cfg, __u32 vid, struct pkt *p)
{
	if (!cfg || !p)
		return XDP_DROP;
	const struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);
	const struct inband_vip_slots *slots = bpf_map_lookup_elem(&vip_backends, &vid);
	const struct inband_flow_key *fk = &p->fk;

	if (!vc || !slots || !(vc->flags & INBAND_VIP_FLEET))
		return drop(INBAND_DROP_CHAINED_NO_FLOW);
	int maglev = vc->policy == INBAND_POLICY_MAGLEV;
	__u32 id = 0;
	const struct inband_backend *be;

	if (maglev) {
		__u64 h = inband_siphash24_words(INBAND_MAGLEV_K0, INBAND_MAGLEV_K1, (const __u8 *)fk, sizeof(*fk) / 8);
		__u32 slot = maglev_entry(vc->maglev_table, h);

		if (slot >= vc->backend_count || slot >= INBAND_MAX_BACKENDS_PER_VIP)
			return drop(INBAND_DROP_CHAINED_NO_FLOW);
		id = slots->backend[slot & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
		be = bpf_map_lookup_elem(&backends, &id);
	} else {
		be = announced_backend(vid, vc, fk, &id);
	}

	/* Toward such a backend the opener pinned its own tuple (open_flow). */
	if (!be || (be->flags & (INBAND_BACKEND_OPTIONS_LOST | INBAND_BACKEND_ENCAP)) || inband_addr_is4(&be->addr))
		return drop(INBAND_DROP_CHAINED_NO_FLOW);
	if (!adopt_token(cfg, p->now))
		return drop(INBAND_DROP_ADOPT_BUDGET);
	struct inband_nat_key nk = { .backend_addr = be->addr, .backend_port = be->port, .proto = IPPROTO_TCP };
	struct inband_snat_owner owner = { .flow = *fk };

	fleet_tuple(cfg, fk, &nk);
	if (bpf_map_update_elem(&snat, &nk, &owner, BPF_NOEXIST)) {
		/* Held: by a live flow of another client here (two client
		 * sides with one fleet tuple), which keeps it; or a stale
		 * reservation, taken over. */
		struct inband_snat_owner *res = bpf_map_lookup_elem(&snat, &nk);
		struct inband_flow *other = res ? bpf_map_lookup_elem(&flows, &res->flow) : NULL;

		if (other && flow_has_port(other, &nk) && !flow_expired(other, p->now))
			return drop(INBAND_DROP_CHAINED_NO_FLOW);
		if (bpf_map_update_elem(&snat, &nk, &owner, BPF_ANY))
			return drop(INBAND_DROP_FLOW_TABLE_FULL);
	}
	struct inband_flow *f = scratch_flow();
	struct ethhdr *eth = (void *)(long)ctx->data;

	if (!f || (void *)(eth + 1) > (void *)(long)ctx->data_end) {
		bpf_map_delete_elem(&snat, &nk);
		return XDP_DROP;
	}
	__builtin_memset(f, 0, sizeof(*f));
	f->backend_addr = be->addr;
	f->backend_port = be->port;
	f->snat_port = nk.snat_port;
	f->snat_index = INBAND_SNAT_FLEET;
	f->fleet_suffix = nk.fleet_suffix;
	f->backend_id = (__u16)id;
	f->vip_id = (__u16)vid;
	f->mode = vc->mode;
	f->state = INBAND_FLOW_ESTABLISHED;
	f->proto = IPPROTO_TCP;
	f->flags = INBAND_FLOW_ADOPTED;
	f->client_seq = p->seq;
	f->last_seen_ns = p->now;
	f->seen = 1;
	__builtin_memcpy(f->client_mac, eth->h_source, ETH_ALEN);
	if (bpf_map_update_elem(&flows, fk, f, BPF_ANY)) {
		bpf_map_delete_elem(&snat, &nk);
		return drop(INBAND_DROP_FLOW_TABLE_FULL);
	}
	event(maglev ? INBAND_EV_ADOPTED_MAGLEV : INBAND_EV_ADOPTED_ANNOUNCED);
	f = bpf_map_lookup_elem(&flows, fk);
	if (f && (p->flags & (TCP_FLAG_FIN | TCP_FLAG_RST)))
		client_end(f, p);
	return FWD_FLOW;
}

/* Step 2 of the walk: a packet whose (dst, dport, proto) is a VIP, with no
 * established flow. Returns a verdict, or FWD_COPY / FWD_FLOW / OPEN_FLOW / CHAIN / ADOPT. */
__noinline int handshake(struct xdp_md *ctx, const struct inband_lb_config *cfg, __u32 vid, struct pkt *p)
{
	if (!cfg || !p)
		return XDP_DROP;
	const struct inband_flow_key *fk = &p->fk;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);
	struct inband_flow *ho = bpf_map_lookup_elem(&half_open, fk);
	struct inband_flow *copy = scratch_flow();
	int syn = p->proto == IPPROTO_TCP && is_syn(p->flags);

	if (!vc || !copy)
		return drop(INBAND_DROP_NO_BACKEND);
	p->now = coarse_now();
	if (ho && flow_expired(ho, p->now)) {
		*copy = *ho;
		half_open_end(fk, copy);
		event(INBAND_EV_FLOWS_EXPIRED);
		ho = NULL;
		/* A UDP datagram after that is a new flow's first. */
		if (p->proto == IPPROTO_TCP && !syn)
			return drop(INBAND_DROP_FLOW_EXPIRED);
	}
	if (p->proto == IPPROTO_UDP)
		return udp_handshake(ctx, cfg, vid, vc, ho, p);
	if (syn) {
		if (ho && ho->syn_seq == p->seq) {
			/* A retransmitted SYN follows its handshake, and makes
			 * its port hold young again (the age port searches rank). */
			ho->last_seen_ns = p->now;
			count_handshake(ho->backend_id, HS_RETRIED);
			*copy = *ho;
			refresh_hold(fk, copy, p->now);
			return FWD_COPY;
		}
		if (vc->mode == INBAND_MODE_DSR_QUERY ||
		    (vc->mode == INBAND_MODE_DSR_DYNAMIC && (vc->flags & INBAND_VIP_QUERY_STALE))) {
			int held = query_first(ctx, fk, vid, vc, p);

			if (held)
				return held;
		}
		return OPEN_FLOW;
	}
	if (!ho) {
		/* Scale-out: the connection may live on the instance the
		 * router's previous next-hop set sent it to. */
		if (p->via_sid == VIA_COND_SID)
			return CHAIN;
		if (p->via_sid == VIA_DIRECT_SID)
			return ADOPT;
		return drop(INBAND_DROP_NO_FLOW);
	}
	if (p->flags & TCP_FLAG_RST) {
		/* The client gives up the handshake (its RST acknowledges the
		 * SYN-ACK, one past its SYN): the backend hears it too. */
		*copy = *ho;
		if (seq_in_window(ho, p->seq))
			half_open_end(fk, copy);
		else
			event(INBAND_EV_OUT_OF_WINDOW);
		return FWD_COPY;
	}
	struct inband_flow *f = promote(fk, ho, p->now);

	if (!f)
		return XDP_DROP;
	if (p->flags & TCP_FLAG_FIN)
		client_end(f, p);
	return FWD_FLOW;
}

#endif /* INBAND_LB_HANDSHAKE_H */

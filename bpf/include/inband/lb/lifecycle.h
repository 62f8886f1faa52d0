/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The life of a flow ("Flow lifecycle" in docs/architecture.md):
 *
 *   SYN        -> half_open[client side] (SYN_SENT) + half_open_ports[server side]
 *   1st non-SYN -> promoted: flows[client side] (ESTABLISHED) + snat[server side]
 *   FIN or RST -> CLOSING (closing timeout from then on), if it falls in
 *                 the client's sequence window (seq_in_window)
 *   timeout    -> dead: ended by the sweeper, or by a port search that needs
 *                 its port, together with its SNAT reservation
 *
 * Timeouts are per VIP (vip_conf); each state has its own. Established
 * flows are aged by the sweeper through their `seen` byte, so the packet
 * path reads no clock: a flow is idle since the last sweep that found it
 * unseen. A handshake is stamped with the time of its SYN and checked on
 * its packets (those paths are not the hot one).
 */
#ifndef INBAND_LB_LIFECYCLE_H
#define INBAND_LB_LIFECYCLE_H

#include "inband/lb/common.h"

static __always_inline int same_flow_key(const struct inband_flow_key *a, const struct inband_flow_key *b)
{
	return inband_addr_eq(&a->client_addr, &b->client_addr) && inband_addr_eq(&a->vip_addr, &b->vip_addr) &&
	       a->client_port == b->client_port && a->vip_port == b->vip_port && a->proto == b->proto;
}

static __always_inline struct inband_nat_key nat_key_of(const struct inband_flow *f)
{
	struct inband_nat_key nk = {
		.backend_addr = f->backend_addr,
		.backend_port = f->backend_port,
		.snat_port = f->snat_port,
		.proto = f->proto,
		.snat_index = f->snat_index,
		.fleet_suffix = f->fleet_suffix,
	};
	return nk;
}

/* The flow uses the server-side tuple `nk`. */
static __always_inline int flow_has_port(const struct inband_flow *f, const struct inband_nat_key *nk)
{
	return inband_addr_eq(&f->backend_addr, &nk->backend_addr) && f->backend_port == nk->backend_port &&
	       f->snat_port == nk->snat_port && f->proto == nk->proto && f->snat_index == nk->snat_index &&
	       f->fleet_suffix == nk->fleet_suffix;
}

static __always_inline __u64 flow_timeout(const struct inband_flow *f, const struct inband_vip *vc)
{
	if (f->state == INBAND_FLOW_SYN_SENT)
		return vc->syn_timeout_ns;
	if (f->state == INBAND_FLOW_CLOSING)
		return vc->closing_timeout_ns;
	return vc->idle_timeout_ns;
}

/* Past its state's timeout at `now`. A flow seen since the last sweep is
 * alive whatever its stamp says (with no daemon sweeping, flows then do
 * not age: the LRU still bounds them). */
static __always_inline int flow_expired(const struct inband_flow *f, __u64 now)
{
	__u32 vid = f->vip_id;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);

	if (f->seen)
		return 0;
	if (!vc)
		return 1;
	return (__s64)(now - f->last_seen_ns) > (__s64)flow_timeout(f, vc);
}

/* A packet of the flow: one byte, written only when it changes, so a busy
 * flow's entry is not dirtied on every packet. */
static __always_inline void flow_touch(struct inband_flow *f)
{
	if (!f->seen)
		f->seen = 1;
}

/*
 * The client's sequence window. Every client segment passes the balancer in
 * every mode (a backend's do not, in the DSR modes), so a flow records
 * where the client's sequence numbers are (`client_seq`): its SYN's, then a
 * segment's each time the client has moved more than SEQ_STEP past the
 * number recorded, so an upload writes the entry once per 64 KiB and a
 * download (the client's number still) never. A FIN or RST changes the
 * flow's state only within SEQ_BEHIND before to SEQ_AHEAD after the
 * recorded number (serial arithmetic, RFC 1982): a client's FIN or RST
 * carries its next sequence number, at most a step and a segment past what
 * was recorded, plus what it sent that did not pass here (reordered, lost
 * on the way); a client that lost its socket resets with the number the
 * backend acknowledged, which may lag what passed here. An attacker who
 * knows the tuple but not the numbers hits the 320 KiB window once in
 * about 13,000 tries. Only a segment inside the window moves it, so a
 * forged one cannot first carry it to where a forged RST then falls.
 */
#define SEQ_STEP (1 << 16)
#define SEQ_AHEAD (1 << 18)
#define SEQ_BEHIND (1 << 16)

/* How far `seq` is past `ref` (negative: before it), modulo 2^32. */
static __always_inline __s32 seq_after(__be32 seq, __be32 ref)
{
	return (__s32)(bpf_ntohl(seq) - bpf_ntohl(ref));
}

static __always_inline int seq_in_window(const struct inband_flow *f, __be32 seq)
{
	__s32 d = seq_after(seq, f->client_seq);

	return d >= -SEQ_BEHIND && d <= SEQ_AHEAD;
}

/* A client segment of a live connection: recorded only once the client has
 * moved a step on (the one write an established packet may cost). */
static __always_inline void seq_advance(struct inband_flow *f, __be32 seq)
{
	__s32 d = seq_after(seq, f->client_seq);

	if (d > SEQ_STEP && d <= SEQ_AHEAD)
		f->client_seq = seq;
}

/* The modes that rank backends by their scores. */
static __always_inline int score_mode(__u8 mode)
{
	return mode == INBAND_MODE_DSR_POLLING || mode == INBAND_MODE_DSR_DYNAMIC || mode == INBAND_MODE_DSR_QUERY;
}

/* Whether the flow's opening was counted in its backend's `opened`. */
static __always_inline int flow_counted(const struct inband_flow *f)
{
	return score_mode(f->mode) || (f->flags & INBAND_FLOW_COUNTED);
}

/* Deletes an established flow and its SNAT reservation (if it owns it). */
static __always_inline void flow_end(const struct inband_flow_key *fk, const struct inband_flow *f)
{
	struct inband_nat_key nk = nat_key_of(f);
	struct inband_snat_owner *o = bpf_map_lookup_elem(&snat, &nk);

	if (o && same_flow_key(&o->flow, fk))
		bpf_map_delete_elem(&snat, &nk);
	bpf_map_delete_elem(&flows, fk);
}

/* A handshake that ends without completing (the client's RST, the
 * backend's, a timeout, its port taken over) loses its backend the
 * connection its SYN was counted as (`opened`), as a FIN would: else each
 * such SYN stayed in the estimate until the next report. A SYN that meets
 * the backend's TIME_WAIT of an earlier connection on the same SNAT port
 * is answered with an ACK, the client resets and sends it again, and the
 * balancer counts it twice: in the quick benchmark of issue 13, 6% of
 * SYNs, enough to keep a 1-worker server looking busy for seconds. */
static __always_inline void handshake_abandoned(const struct inband_flow *f)
{
	__u32 bid = f->backend_id;
	struct inband_backend_score *s;

	if (flow_counted(f) && (s = bpf_map_lookup_elem(&scores, &bid)))
		__sync_fetch_and_add(&s->closed, 1);
}

/* Deletes a handshake and its port hold (if it holds it); one that did not
 * complete (`f` still SYN_SENT) is abandoned, counted by whoever deletes it. */
static __always_inline void half_open_end(const struct inband_flow_key *fk, const struct inband_flow *f)
{
	struct inband_nat_key nk = nat_key_of(f);
	struct inband_port_hold *h = bpf_map_lookup_elem(&half_open_ports, &nk);

	if (h && same_flow_key(&h->flow, fk))
		bpf_map_delete_elem(&half_open_ports, &nk);
	if (!bpf_map_delete_elem(&half_open, fk) && f->state == INBAND_FLOW_SYN_SENT)
		handshake_abandoned(f);
}

/* A handshake's SYN again: its hold ages from now. */
static __always_inline void refresh_hold(const struct inband_flow_key *fk, const struct inband_flow *f, __u64 now)
{
	struct inband_nat_key nk = nat_key_of(f);
	struct inband_port_hold *h = bpf_map_lookup_elem(&half_open_ports, &nk);

	if (h && same_flow_key(&h->flow, fk))
		h->since_ns = now;
}

/* The first FIN or RST of an established flow: the closing timeout from
 * the next sweep on, and the backend's load estimate loses the connection.
 * Counted once. */
static __always_inline void flow_close(struct inband_flow *f)
{
	if (__sync_val_compare_and_swap(&f->state, INBAND_FLOW_ESTABLISHED, INBAND_FLOW_CLOSING) !=
	    INBAND_FLOW_ESTABLISHED)
		return;
	event(INBAND_EV_FLOWS_CLOSED);
	__u32 bid = f->backend_id, vid = f->vip_id;

	/* An adopted flow's opening was counted where it opened. */
	if (flow_counted(f) && !(f->flags & INBAND_FLOW_ADOPTED)) {
		struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &bid);

		if (s)
			__sync_fetch_and_add(&s->closed, 1);
	}
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);
	struct inband_vip_stats *vs = bpf_map_lookup_elem(&vip_stats, &vid);

	if (bs)
		bs->closed_conns++;
	if (vs)
		vs->closed_conns++;
}

/*
 * The handshake of `fk` is complete (its first non-SYN packet): the flow
 * moves to `flows` with its port reserved in `snat`. Returns the flow in
 * `flows`, or NULL (counted) when it cannot be stored.
 */
static __always_inline struct inband_flow *promote(const struct inband_flow_key *fk, struct inband_flow *ho,
						   __u64 now)
{
	struct inband_flow f = *ho;
	struct inband_nat_key nk = nat_key_of(&f);
	struct inband_snat_owner owner = { .flow = *fk };

	f.state = INBAND_FLOW_ESTABLISHED;
	f.last_seen_ns = now;
	f.seen = 1;
	if (bpf_map_update_elem(&snat, &nk, &owner, BPF_ANY)) {
		half_open_end(fk, &f);
		drop(INBAND_DROP_FLOW_TABLE_FULL);
		return NULL;
	}
	if (bpf_map_update_elem(&flows, fk, &f, BPF_ANY)) {
		bpf_map_delete_elem(&snat, &nk);
		half_open_end(fk, &f);
		drop(INBAND_DROP_FLOW_TABLE_FULL);
		return NULL;
	}
	half_open_end(fk, &f);
	event(INBAND_EV_FLOWS_PROMOTED);
	__u32 bid = f.backend_id;
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

	if (bs)
		bs->handshakes_completed++;
	return bpf_map_lookup_elem(&flows, fk);
}

#endif /* INBAND_LB_LIFECYCLE_H */

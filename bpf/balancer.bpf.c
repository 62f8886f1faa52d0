// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * The balancer: the XDP data path ("Balancer packet walk" in
 * docs/architecture.md) and the sweeper that ages its flow tables ("Flow
 * lifecycle"). Client packets to a VIP (IPv4 or IPv6, TCP or UDP) are
 * full-NATed to a backend (src = balancer, dst = backend) and may carry
 * option 155 (client tuple, on a connection's first packet in the DSR
 * modes) or 124 (score request, in dsr-dynamic): as IPv4 options, or in an
 * IPv6 Destination Options header. Backend packets to the balancer are
 * NATed back to VIP -> client; a 125 on them may update the backend's
 * score and is stripped. ICMP and ICMPv6 errors about balanced connections
 * go to whoever can act on them. Anything else passes to the kernel
 * untouched.
 *
 * The parts live in bpf/include/inband/lb/: parse.h (both families),
 * options.h (IPv4 and TCP options), dstopts.h (the IPv6 carrier),
 * rewrite.h (NAT), verify.h (checksums), select.h (backend choice), nat.h
 * (SNAT ports), lifecycle.h (flow states and timeouts), score.h (124/125
 * and the adaptive probe), quic.h (routing by connection ID), query.h
 * (dsr-query), icmp.h.
 */
#include <linux/bpf.h>
#include <linux/errno.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "inband/lb/common.h"
#include "inband/lb/dstopts.h"
#include "inband/lb/icmp.h"
#include "inband/lb/lifecycle.h"
#include "inband/lb/nat.h"
#include "inband/lb/options.h"
#include "inband/lb/parse.h"
#include "inband/lb/query.h"
#include "inband/lb/quic.h"
#include "inband/ipip.h"
#include "inband/shadow_generations.h"
#include "inband/lb/reset.h"
#include "inband/lb/rewrite.h"
#include "inband/lb/score.h"
#include "inband/lb/select.h"
#include "inband/lb/verify.h"

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

/* ... or when the packet belongs to a later connection on the flow's tuple
 * (later_connection()): the caller handles it as if there were no flow. */
#define LATER_CONNECTION (-6)

/* How far past a finished client's FIN or RST a segment of the same
 * connection can still start: that segment's payload and the FIN's one
 * sequence number. */
#define LATER_SEQ_MARGIN 65536

/* How a packet reached this instance through the ECMP router (p->via_sid). */
#define VIA_COND_SID 1
#define VIA_DIRECT_SID 2

/* The SRv6 encapsulation the router adds (seg6 mode encap): an outer
 * IPv6 header, and a Segment Routing Header of one segment, or none
 * (encap.red), or of two whose second names a later shadow generation. */
#define SRV6_OUTER INBAND_IPV6_HDR
#define SRV6_OUTER_SRH (INBAND_IPV6_HDR + 8 + 16)
#define SRV6_OUTER_SRH2 (INBAND_IPV6_HDR + INBAND_SRH2_LEN)
#define IP6_IN_IP6 41
#define SRH_TYPE 4

/* The flow a handshake forwards a packet on when it is not (yet) in
 * `flows`: a new handshake, a retransmitted SYN's, one ending. */
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

static __always_inline void count_forward(__u32 backend_id, __u32 vip_id, __u64 bytes, int new_conn, int probe)
{
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &backend_id);
	struct inband_vip_stats *vs = bpf_map_lookup_elem(&vip_stats, &vip_id);

	if (bs) {
		bs->packets++;
		bs->bytes += bytes;
		bs->new_conns += new_conn;
		bs->probes_sent += probe;
	}
	if (vs) {
		vs->packets++;
		vs->bytes += bytes;
		vs->new_conns += new_conn;
	}
}

/*
 * Puts the option at `opt + INBAND_DOH_PREFIX` (`optlen` bytes) on the
 * packet, whose headers are rewritten already: into the IPv4 header, or in
 * a Destination Options header after the IPv6 one. Every length is a
 * constant in its branch, so each move and copy is too.
 */
static __always_inline int emit(struct xdp_md *ctx, const struct pkt *p, __u8 *opt, int optlen)
{
	__u8 *o = opt + INBAND_DOH_PREFIX;

	if (p->family == 4) {
		switch (optlen) {
		case INBAND_OPT_SCORE_REQUEST_LEN:
			return emit_with_option(ctx, INBAND_OPT_SCORE_REQUEST_LEN, o, p->tot_len);
		case INBAND_OPT_CLIENT_TUPLE_LEN:
			return emit_with_option(ctx, INBAND_OPT_CLIENT_TUPLE_LEN, o, p->tot_len);
		case INBAND_OPT_AUTH_SCORE_REQUEST_LEN:
			return emit_with_option(ctx, INBAND_OPT_AUTH_SCORE_REQUEST_LEN, o, p->tot_len);
		case INBAND_OPT_AUTH_CLIENT_TUPLE_LEN:
			return emit_with_option(ctx, INBAND_OPT_AUTH_CLIENT_TUPLE_LEN, o, p->tot_len);
		case INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN:
			return emit_with_option(ctx, INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN, o, p->tot_len);
		}
		return drop(INBAND_DROP_ADJUST_FAILED);
	}
	switch (optlen) {
	case INBAND_OPT_SCORE_REQUEST_LEN:
		inband_doh_wrap(opt, p->proto, INBAND_OPT_SCORE_REQUEST_LEN);
		return emit_with_doh(ctx, INBAND_DOH_LEN(INBAND_OPT_SCORE_REQUEST_LEN), opt);
	case INBAND_OPT_AUTH_SCORE_REQUEST_LEN:
		inband_doh_wrap(opt, p->proto, INBAND_OPT_AUTH_SCORE_REQUEST_LEN);
		return emit_with_doh(ctx, INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_REQUEST_LEN), opt);
	case INBAND_OPT6_CLIENT_TUPLE_LEN:
		inband_doh_wrap(opt, p->proto, INBAND_OPT6_CLIENT_TUPLE_LEN);
		return emit_with_doh(ctx, INBAND_DOH_LEN(INBAND_OPT6_CLIENT_TUPLE_LEN), opt);
	case INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN:
		inband_doh_wrap(opt, p->proto, INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN);
		return emit_with_doh(ctx, INBAND_DOH_LEN(INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN), opt);
	case INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN:
		inband_doh_wrap(opt, p->proto, INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN);
		return emit_with_doh(ctx, INBAND_DOH_LEN(INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN), opt);
	}
	return drop(INBAND_DROP_ADJUST_FAILED);
}

/* The header bytes an `optlen`-byte option adds to a packet of `p`'s
 * family, the outer IP-in-IP header included toward an encap backend. */
static __always_inline __u32 added_len(const struct pkt *p, __u32 optlen, int encap)
{
	return p->family == 4 ? optlen + (encap ? INBAND_IPIP_HLEN : 0) : INBAND_DOH_LEN(optlen);
}

/*
 * Wraps the finished packet (Ethernet, then an IPv4 packet of `inner_len`
 * bytes) in an outer IPv4 header for an encap backend (ipip.h): the
 * Ethernet header moves to the new front, the outer header goes between.
 */
static __always_inline int encap_ipip(struct xdp_md *ctx, __u32 inner_len)
{
	int bad = open_gap(ctx, ETH_HLEN, INBAND_IPIP_HLEN);

	if (bad)
		return bad;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + ETH_HLEN + INBAND_IPIP_HLEN + INBAND_IPV4_MIN_HDR > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	inband_ipip_outer(data + ETH_HLEN, data + ETH_HLEN + INBAND_IPIP_HLEN, inner_len);
	event(INBAND_EV_ENCAPSULATED);
	return XDP_TX;
}

/*
 * An IPv4 packet to the balancer's address that is IP-in-IP as an encap
 * backend sends its 125 (ipip.h): unwrapped here, then walked as the
 * packet it carries (which must still be a backend's, with a valid MAC, to
 * count). 1 if it was unwrapped (the packet is to be parsed again), 0 if
 * it is not inband's to unwrap (left to the kernel), -1 if unwrapping
 * failed (counted; the packet is dropped).
 */
static __always_inline int decap_ipip(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *outer = data + ETH_HLEN;
	struct iphdr *inner = data + ETH_HLEN + INBAND_IPIP_HLEN;

	if ((void *)(inner + 1) > data_end || !inband_ipip_ours(outer, inner))
		return 0;
	if (close_gap(ctx, ETH_HLEN, INBAND_IPIP_HLEN))
		return -1;
	event(INBAND_EV_DECAPSULATED);
	return 1;
}

/*
 * SRv6 from the ECMP router to one of this instance's SIDs (scale-out):
 * the outer header (and its SRH) comes off and `p` is parsed
 * again as the IPv6 packet inside, to be walked as if it had come
 * straight, with p->via_sid saying how it came. 1 if it was unwrapped, 0
 * if it is not ours (left to the kernel), -1 if it is dropped (counted).
 * Not inlined: the walk's frame is at its limit.
 */
static __noinline int decap_srv6(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct pkt *p)
{
	__u8 via, next[16];
	int generation = 0;

	if (!cfg || !p || inband_addr_is_zero(&cfg->cond_sid))
		return 0;
	if (inband_addr_eq(&p->daddr, &cfg->cond_sid))
		via = VIA_COND_SID;
	else if (inband_addr_eq(&p->daddr, &cfg->direct_sid))
		via = VIA_DIRECT_SID;
	else
		return 0;
	/* Only what the router sends is unwrapped: IPv6 inside, no
	 * fragment, and either no extension header or one SRH whose only
	 * segment is ours (segments left 0), or, to the conditional SID,
	 * one of two segments whose second is a shadow SID (segments left
	 * 1: where a stray goes). Anything else to our SID has no meaning
	 * here. */
	if (p->proto != IP6_IN_IP6 || p->frag)
		goto unsupported;
	if (p->hlen == SRV6_OUTER_SRH2) {
		if (via != VIA_COND_SID || p->ext != 1 || p->srh_type != SRH_TYPE || p->srh_left != 1 ||
		    bpf_xdp_load_bytes(ctx, ETH_HLEN + INBAND_IPV6_HDR + INBAND_SRH2_NEXT_SEGMENT, next, sizeof(next)))
			goto unsupported;
		generation = inband_shadow_generation((const __u8 *)&cfg->shadow_sid, next);
		if (generation < 0)
			goto unsupported;
	} else if (!(p->hlen == SRV6_OUTER || (p->hlen == SRV6_OUTER_SRH && p->ext == 1 && p->srh_type == SRH_TYPE && !p->srh_left))) {
		goto unsupported;
	}
	/* close_gap() takes constants (its copies unroll). */
	if (p->hlen == SRV6_OUTER	   ? close_gap(ctx, ETH_HLEN, SRV6_OUTER)
	    : p->hlen == SRV6_OUTER_SRH ? close_gap(ctx, ETH_HLEN, SRV6_OUTER_SRH)
					: close_gap(ctx, ETH_HLEN, SRV6_OUTER_SRH2))
		return -1;
	event(via == VIA_COND_SID ? INBAND_EV_SRV6_COND : INBAND_EV_SRV6_DIRECT);
	__builtin_memset(p, 0, sizeof(*p));
	p->len = (long)ctx->data_end - (long)ctx->data;
	if (parse6(ctx, p))
		return -1;
	p->via_sid = via;
	p->chain_generation = generation;
	return 1;
unsupported:
	drop(INBAND_DROP_SRV6_UNSUPPORTED);
	return -1;
}

/*
 * Sends a TCP packet that has no connection here back to the router,
 * wrapped in IPv6 to a shadow SID (the generation the router named, or
 * the first; no SRH: the router's End.DT6 takes a plain IPv6-in-IPv6
 * packet), which routes it by that earlier next-hop set to the instance
 * that had it. The router sent it to us, so its MAC
 * is the frame's source. `p` describes the packet as it came (unwrapped).
 */
static __noinline int chain(struct xdp_md *ctx, const struct inband_lb_config *cfg, const struct pkt *p)
{
	if (!cfg || !p)
		return XDP_DROP;
	int bad = open_gap(ctx, ETH_HLEN, SRV6_OUTER);

	if (bad)
		return bad;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *outer = data + ETH_HLEN;

	if ((void *)(outer + 1) > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	__u8 mac[ETH_ALEN];

	__builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, mac, ETH_ALEN);
	eth->h_proto = bpf_htons(ETH_P_IPV6_);
	*(__be32 *)outer = bpf_htonl(0x60000000);
	outer->payload_len = bpf_htons(p->tot_len);
	outer->nexthdr = IP6_IN_IP6;
	outer->hop_limit = 64;
	__builtin_memcpy(&outer->saddr, &cfg->self6, 16);
	inband_shadow_sid((__u8 *)&outer->daddr, (const __u8 *)&cfg->shadow_sid, p->chain_generation);
	event(p->chain_generation ? INBAND_EV_CHAINED_NAMED : INBAND_EV_CHAINED);
	return XDP_TX;
}

/*
 * A client packet of a flow whose backend its health checks took down: on a
 * VIP with on_down = "reset" the flow ends and the client gets a RST (it
 * reconnects, and its new connection goes to a backend that is up). 0:
 * the flow goes on to the backend as before.
 */
static __always_inline int down_backend(struct xdp_md *ctx, struct inband_flow *f, struct pkt *p)
{
	__u32 vid = f->vip_id, bid = f->backend_id;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);

	if (!vc || !(vc->flags & INBAND_VIP_RESET_DOWN))
		return 0;
	struct inband_flow *copy = scratch_flow();

	if (!copy)
		return XDP_DROP;
	*copy = *f;
	if (copy->state == INBAND_FLOW_SYN_SENT) {
		half_open_end(&p->fk, copy);
	} else {
		flow_close(f);
		flow_end(&p->fk, copy);
	}
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

	if (bs)
		bs->flows_reset++;
	event(INBAND_EV_RESET_BACKEND_DOWN);
	return reply_rst(ctx, p);
}

/*
 * Sends a client packet of flow `f` (a copy, or the entry in `flows`: a
 * probe records its nonce there) to the backend: NAT, TTL, MSS clamp on a
 * SYN, and the option this packet carries, if any. `vc` is the flow's VIP
 * (only dsr-dynamic flows need it: NULL otherwise). p->first: the packet
 * opens the connection (a new SYN, a UDP flow's first datagram), the one
 * that carries the 155 in the DSR modes. The IP header is exactly 20 or
 * 40 bytes (the caller dropped options and extension headers).
 */
__noinline int forward(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct inband_flow *f,
			      const struct inband_vip *vc, struct pkt *p)
{
	if (!cfg || !f || !p)
		return XDP_DROP;
	const struct inband_flow_key *fk = &p->fk;
	int first = p->first;
	__u32 bid = f->backend_id;
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (!be || mac_is_zero(be->mac))
		return drop(INBAND_DROP_NO_ROUTE);
	if ((be->flags & INBAND_BACKEND_DOWN) && p->proto == IPPROTO_TCP && !first) {
		int refused = down_backend(ctx, f, p);

		if (refused)
			return refused;
	}
	if (p->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);
	int v4 = p->family == 4;
	int tcp = p->proto == IPPROTO_TCP;
	int syn = tcp && is_syn(p->flags);
	int dsr = f->mode != INBAND_MODE_PASSTHROUGH;
	int options = dsr && !(be->flags & INBAND_BACKEND_OPTIONS_LOST);
	int encap = v4 && (be->flags & INBAND_BACKEND_ENCAP);
	const struct inband_addr *self = self_addr(cfg, &f->backend_addr);
	__u32 l3 = v4 ? INBAND_IPV4_MIN_HDR : INBAND_IPV6_HDR;
	__u32 coff = l4_check_off(p->proto);
	void *data_end = (void *)(long)ctx->data_end;
	__u16 *check = l4_at(ctx, l3 + coff);

	if ((void *)(check + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);

	/* L4: NAT rewrite (pseudo-header addresses and ports), MSS clamp. */
	__u16 old = *check;
	__u32 acc = l4_csum_nat(old, p, self, f->snat_port, &f->backend_addr, f->backend_port);

	if (syn && dsr) {
		struct tcphdr *tcp = l4_at(ctx, l3);

		if ((void *)(tcp + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		acc = clamp_mss(ctx, ETH_HLEN + l3, tcp->doff * 4 - TCP_MIN_HDR, acc,
				v4 ? INBAND_OPT_DATA_MAX_LEN + (encap ? INBAND_IPIP_HLEN : 0) : INBAND_OPT6_DATA_MAX_LEN);
	}
	/* clamp_mss may have re-read the packet: reload what the verifier forgot. */
	data_end = (void *)(long)ctx->data_end;
	__be16 *ports = l4_at(ctx, l3);

	check = l4_at(ctx, l3 + coff);
	if ((void *)(ports + 2) > data_end || (void *)(check + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	ports[0] = f->snat_port;
	ports[1] = f->backend_port;
	*check = l4_csum_store(p->proto, p->family, old, acc);

	/* Which option, if any, this packet carries: the option itself at
	 * opt + INBAND_DOH_PREFIX, room for the IPv6 carrier in front. */
	__u8 opt[DOH_MAX];
	int optlen = 0, probe = 0;
	__u32 *probe_count = NULL;

	if (first && options) {
		if (p->tot_len + added_len(p, tuple_len(cfg, v4, p->proto), encap) > cfg->mtu)
			event(INBAND_EV_TUPLE_SKIPPED_MTU);
		else
			optlen = build_tuple(opt + INBAND_DOH_PREFIX, cfg, fk, f, tcp ? p->seq : f->syn_seq);
	} else if (syn) {
		/* A retransmitted SYN goes without its 155: if the first was
		 * lost to a path that drops packets with options, this one
		 * opens the connection through the balancer instead. (A SYN on
		 * a live flow goes without too: the agent refuses a tuple for a
		 * live socket.) */
		struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

		if (bs && options && f->state == INBAND_FLOW_SYN_SENT)
			bs->syn_retries++;
	} else if (f->mode == INBAND_MODE_DSR_DYNAMIC && options && vc && f->state != INBAND_FLOW_CLOSING &&
		   (probe_count = probe_wanted(f, vc))) {
		/* Not on a closing flow (its FIN or RST, or anything after):
		 * the backend answers on its ACK of that FIN, before the FIN
		 * ends the connection there, so the score counts a connection
		 * whose close was counted here already; the report's reset
		 * then kept it counted until the next report. An idle backend
		 * looked busy for up to a max age, and a small one among large
		 * ones got no connection in that time. */
		if (p->tot_len + added_len(p, request_len(cfg), encap) > cfg->mtu) {
			/* The counter stays due: the next packet that fits asks. */
			event(INBAND_EV_PROBE_DEFERRED_MTU);
		} else if (probe_budget_ok(vc, bid) && (optlen = build_request(opt + INBAND_DOH_PREFIX, cfg, f))) {
			f->flags = (f->flags & ~INBAND_FLOW_PROBE_OLD) | INBAND_FLOW_PROBE_OUTSTANDING;
			probe_sent(probe_count, bid);
			probe = 1;
		}
	}

	/* L2: out of the one interface, toward the backend's next hop. L3. */
	void *data = (void *)(long)ctx->data;
	struct ethhdr *eth = data;

	data_end = (void *)(long)ctx->data_end;
	if (data + ETH_IP6_HLEN > data_end && !(v4 && data + ETH_IP_HLEN <= data_end))
		return drop(INBAND_DROP_TRUNCATED_L4);
	if ((void *)(eth + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, be->mac, ETH_ALEN);
	if (v4) {
		struct iphdr *iph = data + ETH_HLEN;

		if ((void *)(iph + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		ip4_nat(iph, self->w[3], f->backend_addr.w[3]);
	} else {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		if ((void *)(ip6 + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		ip6_nat(ip6, self, &f->backend_addr);
	}

	int verdict = optlen ? emit(ctx, p, opt, optlen) : XDP_TX;

	if (verdict == XDP_TX && optlen && encap)
		verdict = encap_ipip(ctx, p->tot_len + optlen);

	if (verdict == XDP_TX)
		count_forward(bid, f->vip_id, p->len, first, probe);
	return verdict;
}

/* open_flow's choice of backend: one a QUIC connection ID named, packed
 * as (slot << 16) | (id + 1); 0 = choose one. */
#define NAMED(id, slot) (((slot) << 16) | ((id) + 1))

/*
 * A new connection (a SYN, a UDP flow's first datagram): backend, SNAT
 * port, handshake state; FWD_COPY to forward the packet on it. `named`:
 * see NAMED. Global (verified once): its selection and port search loops
 * get stack of their own.
 */
__noinline int open_flow(struct xdp_md *ctx, const struct inband_lb_config *cfg, __u32 vid, struct pkt *p,
			 __u32 named)
{
	if (!cfg || !p)
		return XDP_DROP;
	const struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);
	const struct inband_flow_key *fk = &p->fk;
	__u32 forced = named & 0xffff, forced_slot = named >> 16;
	__u32 skip = 0, id = 0, slot = 0;
	__be16 port = 0;
	struct inband_backend *be = NULL;

	if (!vc)
		return drop(INBAND_DROP_NO_BACKEND);

	/* A connection a QUIC ID names exists already at its server: it
	 * goes there even while the VIP drains. */
	if (!forced && !(vc->flags & INBAND_VIP_ACTIVE))
		return drop(INBAND_DROP_VIP_DRAINING);
	/* A backend without a free port is skipped for the next best; three
	 * tries bound the work a new connection can cause. */
	for (int attempt = 0; attempt < 3; attempt++) {
		struct picked pick = {};

		if (forced) {
			if (attempt)
				break;
			id = forced - 1;
			slot = forced_slot;
		} else if (!select_backend(vc, vid, skip, &p->fk, &pick)) {
			if (attempt)
				return drop(INBAND_DROP_SNAT_EXHAUSTED);
			if ((vc->flags & INBAND_VIP_REFUSE_EMPTY) && p->proto == IPPROTO_TCP) {
				event(INBAND_EV_RESET_NO_BACKEND);
				return reply_rst(ctx, p);
			}
			return drop(INBAND_DROP_NO_BACKEND);
		} else {
			id = pick.id;
			slot = pick.slot;
		}
		be = bpf_map_lookup_elem(&backends, &id);
		if (!be)
			return drop(INBAND_DROP_NO_BACKEND);
		/* No state until the next hop is known: the retransmitted
		 * packet is balanced again once the daemon has resolved it. */
		if (mac_is_zero(be->mac))
			return drop(INBAND_DROP_NO_ROUTE);
		struct inband_nat_key nk = { .backend_addr = be->addr, .backend_port = be->port, .proto = fk->proto };

		port = reserve_snat_port(cfg, fk, &nk, p->now);
		if (port)
			break;
		event(INBAND_EV_BACKEND_FULL);
		skip |= 1U << (slot & 31);
	}
	struct inband_flow *f = scratch_flow();
	struct ethhdr *eth = (void *)(long)ctx->data;

	if (!port || !be || !f)
		return drop(INBAND_DROP_SNAT_EXHAUSTED);
	if ((void *)(eth + 1) > (void *)(long)ctx->data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__builtin_memset(f, 0, sizeof(*f));
	f->backend_addr = be->addr;
	f->backend_port = be->port;
	f->snat_port = port;
	f->backend_id = (__u16)id;
	f->vip_id = (__u8)vid;
	f->mode = vc->mode;
	f->state = INBAND_FLOW_SYN_SENT;
	f->proto = fk->proto;
	f->last_seen_ns = p->now;
	/* TCP binds a 155 to its SYN's sequence number; UDP to the balancer's
	 * clock (TAI, ms), which agents see grow from one flow to the next. */
	f->syn_seq = fk->proto == IPPROTO_TCP ? p->seq : bpf_htonl((__u32)(bpf_ktime_get_tai_ns() / 1000000));
	if (fk->proto == IPPROTO_TCP)
		f->client_seq = p->seq;
	__builtin_memcpy(f->client_mac, eth->h_source, ETH_ALEN);
	if (bpf_map_update_elem(&half_open, fk, f, BPF_ANY))
		return drop(INBAND_DROP_FLOW_TABLE_FULL);
	/* Only the score modes rank by it; counting in the round-robin modes
	 * would leave a stale backlog after a switch to them. */
	if (score_mode(vc->mode)) {
		struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

		if (s)
			__sync_fetch_and_add(&s->opened, 1);
	}
	p->first = 1;
	return FWD_COPY;
}

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

/* Step 2 of the walk: a packet whose (dst, dport, proto) is a VIP, with no
 * established flow. Returns a verdict, or FWD_COPY / FWD_FLOW / OPEN_FLOW. */
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
		if (vc->mode == INBAND_MODE_DSR_QUERY) {
			int held = query_first(ctx, fk, vid, p);

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
		return drop(p->via_sid == VIA_DIRECT_SID ? INBAND_DROP_CHAINED_NO_FLOW : INBAND_DROP_NO_FLOW);
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

/* A client packet of an established or closing flow: the hot path. No
 * clock, one hash lookup (the caller's). */
static __always_inline int established(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct inband_flow *f,
				       struct pkt *p)
{
	struct inband_vip *vc = NULL;

	if (f->mode == INBAND_MODE_DSR_DYNAMIC) {
		__u32 vid = f->vip_id;

		vc = bpf_map_lookup_elem(&vip_conf, &vid);
	}
	if (p->proto == IPPROTO_TCP) {
		int syn = is_syn(p->flags);

		if (syn && p->seq != f->syn_seq) {
			/* A new connection on the tuple once this one is
			 * closing; on a live one, a SYN the backend answers with
			 * a challenge ACK (RFC 5961), as its stack would without
			 * us in between. */
			if (f->state == INBAND_FLOW_CLOSING) {
				struct inband_flow old = *f;

				flow_end(&p->fk, &old);
				return REBALANCE;
			}
			event(INBAND_EV_SYN_ON_LIVE_FLOW);
		} else if (later_connection(f, p)) {
			event(INBAND_EV_LATER_CONNECTION);
			return LATER_CONNECTION;
		}
		if (p->flags & (TCP_FLAG_FIN | TCP_FLAG_RST))
			client_end(f, p);
		else if (!syn && !f->client_done)
			seq_advance(f, p->seq);
	}
	flow_touch(f);
	return forward(ctx, cfg, f, vc, p);
}

/* The 125 (`len` bytes) of a backend packet on flow `f`: checksums, then
 * whether it counts. 0 = forward, else a drop verdict. */
static __always_inline int take_score(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct inband_flow *f,
				      struct pkt *p, const __u8 *opt, __u32 len)
{
	__u16 score = 0;

	if ((p->family == 4 && !ipv4_csum_ok(ctx, p->hlen)) ||
	    !l4_csum_ok(ctx, ETH_HLEN + p->hlen, p->tot_len - p->hlen, p))
		return drop(INBAND_DROP_BAD_CHECKSUM);
	if (score_accepted(cfg, f, opt, len, &score)) {
		__u32 bid = f->backend_id;
		struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

		record_score(f, score, coarse_now());
		if (bs)
			bs->scores_received++;
	}
	return 0;
}

/* Rewrites a backend packet of flow p->fk / `f` back to VIP -> client and
 * sends it. IPv4: without the first option when `strip` (its length) is
 * set; IPv6: its Destination Options header is gone already. */
static __always_inline int rewrite_to_client(struct xdp_md *ctx, const struct inband_flow *f, struct pkt *p,
					     const int strip)
{
	const struct inband_flow_key *fk = &p->fk;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	int v4 = p->family == 4;
	__u32 l3 = v4 ? (p->hlen & 0x3c) : INBAND_IPV6_HDR;
	__be16 *ports = l4_at(ctx, l3);
	__u16 *check = l4_at(ctx, l3 + l4_check_off(p->proto));

	if ((void *)(ports + 2) > data_end || (void *)(check + 1) > data_end || (void *)(eth + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	/* L4: back to VIP:vport -> client:cport. */
	__u16 old = *check;
	__u32 acc = l4_csum_nat(old, p, &fk->vip_addr, fk->vip_port, &fk->client_addr, fk->client_port);

	ports[0] = fk->vip_port;
	ports[1] = fk->client_port;
	*check = l4_csum_store(p->proto, p->family, old, acc);

	if (v4) {
		struct iphdr *iph = data + ETH_HLEN;

		if ((void *)(iph + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		/* The header may carry other options (kept), so update incrementally. */
		acc = csum_start(iph->check);
		acc = csum_replace32(acc, iph->saddr, fk->vip_addr.w[3]);
		acc = csum_replace32(acc, iph->daddr, fk->client_addr.w[3]);
		acc = csum_replace16(acc, load16(&iph->ttl), load16(&iph->ttl) - bpf_htons(0x0100));
		iph->ttl--;
		iph->saddr = fk->vip_addr.w[3];
		iph->daddr = fk->client_addr.w[3];
		if (strip) {
			__u8 *opt = (__u8 *)(iph + 1);

			if ((void *)(opt + strip) > data_end)
				return drop(INBAND_DROP_MALFORMED_OPTION);
			__u16 old_first = load16(iph);
			__be16 new_len = bpf_htons(p->tot_len - strip);

			iph->ihl -= strip / 4;
			acc = csum_replace16(acc, old_first, load16(iph));
			acc = csum_replace16(acc, iph->tot_len, new_len);
#pragma unroll
			for (int i = 0; i < strip / 2; i++)
				acc = csum_replace16(acc, load16(opt + 2 * i), 0);
			iph->tot_len = new_len;
		}
		iph->check = csum_finish(acc);
	} else {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		if ((void *)(ip6 + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		ip6_nat(ip6, &fk->vip_addr, &fk->client_addr);
	}

	/* L2: back to where the client's packets came from. */
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, f->client_mac, ETH_ALEN);

	__u32 bid = f->backend_id, vid = f->vip_id;
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);
	struct inband_vip_stats *vs = bpf_map_lookup_elem(&vip_stats, &vid);

	if (bs) {
		bs->return_packets++;
		bs->return_bytes += p->len;
	}
	if (vs) {
		vs->return_packets++;
		vs->return_bytes += p->len;
	}
	return v4 && strip ? strip_first_option(ctx, strip) : XDP_TX;
}

/* rewrite_to_client() for each length a 125 can have (a constant in each),
 * global: the return path's frame would not fit next to it. */
__noinline int return_to_client(struct xdp_md *ctx, const struct inband_flow *f, struct pkt *p, __u32 strip)
{
	if (!f || !p)
		return XDP_DROP;
	if (strip == INBAND_OPT_AUTH_SCORE_LEN)
		return rewrite_to_client(ctx, f, p, INBAND_OPT_AUTH_SCORE_LEN);
	if (strip == INBAND_OPT_SCORE_LEN)
		return rewrite_to_client(ctx, f, p, INBAND_OPT_SCORE_LEN);
	return rewrite_to_client(ctx, f, p, 0);
}

/*
 * The inband option on a packet, if any: OPT_* found in its IPv4 options,
 * or in the Destination Options header an agent or a balancer puts first
 * on IPv6 (`w` gets a 125). OPT_FOREIGN: IPv6 extension headers that are
 * not exactly one inband header.
 */
#define OPT_FOREIGN 0x10

static __always_inline __u32 backend_option(struct xdp_md *ctx, const struct pkt *p, struct opt_walk *w)
{
	if (p->family == 4)
		return p->hlen > INBAND_IPV4_MIN_HDR ? scan_ip_options(ctx, p->hlen, w) : 0;
	if (!p->ext)
		return 0;
	if (p->ext > 1 || !p->doh_len)
		return OPT_FOREIGN;
	__u32 found = read_doh(ctx, p->doh_len, w);

	return found ? found : OPT_FOREIGN;
}

/* Step 3 of the walk: a packet to the balancer's own address. */
__noinline int backend_to_client(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct pkt *p)
{
	if (!cfg || !p)
		return XDP_PASS;
	struct opt_walk w = {};
	struct inband_nat_key nk = {
		.backend_addr = p->saddr,
		.backend_port = p->sport,
		.snat_port = p->dport,
		.proto = p->proto,
	};
	struct inband_flow *f = flow_by_port(&nk, &p->fk);

	if (!f) {
		/* The balancer host's own traffic; only inband options are ours to judge. */
		__u32 found = backend_option(ctx, p, &w);

		if (found & OPT_SCORE)
			return drop(INBAND_DROP_SCORE_NOT_OWNER);
		if (found & OPT_TUPLE_OR_REQUEST)
			return drop(INBAND_DROP_UNEXPECTED_OPTION);
		return XDP_PASS;
	}
	if (p->frag)
		return drop(INBAND_DROP_FRAGMENT);
	if (p->proto == IPPROTO_TCP ? !tcp_header_ok(ctx, p) : !udp_header_ok(p))
		return drop(INBAND_DROP_TRUNCATED_L4);
	if (p->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);
	if (p->proto == IPPROTO_TCP) {
		/* The acknowledgement number, data offset and flags. */
		__u8 b[6];

		if (bpf_xdp_load_bytes(ctx, ETH_HLEN + p->hlen + 8, b, sizeof(b)))
			return drop(INBAND_DROP_TRUNCATED_L4);
		__builtin_memcpy(&p->ack, b, 4);
		p->flags = b[5];
	}

	__u32 strip = 0;
	__u32 found = backend_option(ctx, p, &w);

	if (found & OPT_FOREIGN)
		return drop(INBAND_DROP_IP_OPTIONS);
	if (found & OPT_MALFORMED)
		return drop(INBAND_DROP_MALFORMED_OPTION);
	if (found & OPT_TUPLE_OR_REQUEST)
		return drop(INBAND_DROP_SCORE_NOT_OWNER);
	if (found & OPT_SCORE) {
		/* A 125 anywhere but where an agent puts it is not ours to parse. */
		if (!(found & OPT_SCORE_STRIPPABLE))
			return drop(INBAND_DROP_MALFORMED_OPTION);
		strip = w.score_len;
		int verdict = take_score(ctx, cfg, f, p, w.buf, strip);

		if (verdict)
			return verdict;
	}
	if (p->family == 6 && p->doh_len) {
		/* The carrier goes first: from here the IPv6 header is 40 bytes. */
		int gone = p->doh_len == INBAND_DOH_LEN(INBAND_OPT_SCORE_LEN)
				   ? strip_doh(ctx, INBAND_DOH_LEN(INBAND_OPT_SCORE_LEN))
				   : strip_doh(ctx, INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN));

		if (gone)
			return gone;
		p->tot_len -= p->doh_len;
		p->hlen = INBAND_IPV6_HDR;
		p->len -= p->doh_len;
		strip = 0;
	}

	int in_handshake = f->state == INBAND_FLOW_SYN_SENT;

	if ((p->flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == (TCP_FLAG_SYN | TCP_FLAG_ACK) &&
	    f->mode != INBAND_MODE_PASSTHROUGH) {
		/* The client's segments get a 124 too: a SYN-ACK that came
		 * this way (no agent, or the agent's fallback) is clamped like
		 * the agent clamps the ones it sends direct. */
		__u32 l4_off = ETH_HLEN + (p->hlen & 0x3c);
		struct tcphdr *tcp = (void *)(long)ctx->data + l4_off;

		if ((void *)(tcp + 1) > (void *)(long)ctx->data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		__u32 acc = clamp_mss(ctx, l4_off, tcp->doff * 4 - TCP_MIN_HDR, csum_start(tcp->check),
				      p->family == 4 ? INBAND_OPT_DATA_MAX_LEN : INBAND_OPT6_DATA_MAX_LEN);

		tcp = (void *)(long)ctx->data + l4_off;
		if ((void *)(tcp + 1) > (void *)(long)ctx->data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		tcp->check = csum_finish(acc);
	}
	int ends = 0;

	if (p->flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) {
		/* The backend can only acknowledge what the client sent: its FIN
		 * or RST counts when it acknowledges a number in the client's
		 * window (a refusal acknowledges the SYN; Linux sets ACK on
		 * every FIN and on the RST of a socket it aborts). Else, like a
		 * client's out of the window, it is forwarded and changes
		 * nothing here. */
		ends = (p->flags & TCP_FLAG_ACK) && seq_in_window(f, p->ack);
		if (!ends)
			event(INBAND_EV_OUT_OF_WINDOW);
	}
	if (!in_handshake) {
		if (ends)
			flow_close(f);
		flow_touch(f);
	}

	struct inband_flow *copy = scratch_flow();

	if (!copy)
		return XDP_DROP;
	*copy = *f;
	if (in_handshake && ends && (p->flags & TCP_FLAG_RST)) {
		half_open_end(&p->fk, copy); /* the backend refused the connection */
		count_handshake(copy->backend_id, HS_REFUSED);
	}
	return return_to_client(ctx, copy, p, strip);
}

/* A client packet to a VIP with IPv4 options or IPv6 extension headers:
 * refused, and counted by what it carried. */
__noinline int client_options(struct xdp_md *ctx, const struct pkt *p)
{
	struct opt_walk w = {};

	if (!p)
		return XDP_DROP;
	__u32 found = backend_option(ctx, p, &w);

	if (found & OPT_MALFORMED)
		return drop(INBAND_DROP_MALFORMED_OPTION);
	if (found & (OPT_TUPLE_OR_REQUEST | OPT_SCORE))
		return drop(INBAND_DROP_UNEXPECTED_OPTION);
	return drop(INBAND_DROP_IP_OPTIONS);
}

/* 802.1Q/802.1ad-tagged frames: the VIPs live on the untagged network, so
 * a tagged frame to a VIP or to the balancer is refused (counted), never
 * balanced and sent on untagged; other tagged traffic is the kernel's. */
__noinline int tagged_frame(struct xdp_md *ctx, const struct inband_lb_config *cfg)
{
	if (!cfg)
		return XDP_PASS;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u32 off = ETH_HLEN;

	if ((void *)(eth + 1) > data_end)
		return XDP_PASS;
	__be16 proto = eth->h_proto;

#pragma unroll
	for (int i = 0; i < 2; i++) {
		if (proto != bpf_htons(ETH_P_8021Q_) && proto != bpf_htons(ETH_P_8021AD_))
			break;
		__be16 *tag = data + off;

		if ((void *)(tag + 2) > data_end)
			return XDP_PASS;
		proto = tag[1];
		off += 4;
	}
	struct inband_vip_key vk = {};
	__be16 *ports;

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *iph = data + (off & 0x1f);

		if ((void *)(iph + 1) > data_end)
			return XDP_PASS;
		vk.addr = inband_addr4(iph->daddr);
		vk.proto = iph->protocol;
		if (iph->ihl < 5)
			return XDP_PASS;
		ports = (void *)iph + ((iph->ihl * 4) & 0x3c);
	} else if (proto == bpf_htons(ETH_P_IPV6_)) {
		struct ipv6hdr *ip6 = data + (off & 0x1f);

		if ((void *)(ip6 + 1) > data_end)
			return XDP_PASS;
		__builtin_memcpy(&vk.addr, &ip6->daddr, 16);
		vk.proto = ip6->nexthdr;
		ports = (void *)(ip6 + 1);
	} else {
		return XDP_PASS;
	}
	if (inband_addr_eq(&vk.addr, self_addr(cfg, &vk.addr)))
		return drop(INBAND_DROP_VLAN);
	if ((vk.proto != IPPROTO_TCP && vk.proto != IPPROTO_UDP) || (void *)(ports + 2) > data_end)
		return XDP_PASS;
	vk.port = ports[1];
	if (bpf_map_lookup_elem(&vips, &vk))
		return drop(INBAND_DROP_VLAN);
	return XDP_PASS;
}

SEC("xdp")
int balancer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct inband_lb_config *cfg = config();

	if ((void *)(eth + 1) > data_end || !cfg)
		return XDP_PASS;
	if (eth->h_proto == bpf_htons(ETH_P_8021Q_) || eth->h_proto == bpf_htons(ETH_P_8021AD_))
		return tagged_frame(ctx, cfg);

	__u32 zero = 0;
	struct pkt *p = bpf_map_lookup_elem(&pkt_scratch, &zero);
	int bad;

	if (!p)
		return XDP_PASS;
	__builtin_memset(p, 0, sizeof(*p));
	p->len = data_end - data;

	if (eth->h_proto == bpf_htons(ETH_P_IP))
		bad = parse4(ctx, p);
	else if (eth->h_proto == bpf_htons(ETH_P_IPV6_))
		bad = parse6(ctx, p);
	else
		return XDP_PASS;
	if (bad)
		return bad;
	/* SRv6 from the ECMP router: walk what it carries. */
	if (p->family == 6) {
		int unwrapped = decap_srv6(ctx, cfg, p);

		if (unwrapped < 0)
			return XDP_DROP;
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
	}
	/* IP-in-IP from an encap backend to this balancer: walk what it carries. */
	if (p->proto == INBAND_IPPROTO_IPIP && p->family == 4 && p->hlen == INBAND_IPV4_MIN_HDR &&
	    inband_addr_eq(&p->daddr, &cfg->self4)) {
		int unwrapped = decap_ipip(ctx);

		if (unwrapped <= 0)
			return unwrapped ? XDP_DROP : XDP_PASS;
		data = (void *)(long)ctx->data;
		data_end = (void *)(long)ctx->data_end;
		__builtin_memset(p, 0, sizeof(*p));
		p->len = data_end - data;
		if ((bad = parse4(ctx, p)))
			return bad;
	}
	if (p->proto == IPPROTO_ICMP && p->family == 4) {
		if (p->hlen != INBAND_IPV4_MIN_HDR || p->frag)
			return XDP_PASS;
		return icmp4_error(ctx, cfg, p);
	}
	if (p->proto == IP6_ICMP && p->family == 6) {
		if (p->ext || p->frag)
			return XDP_PASS;
		return icmp6_error(ctx, cfg, p);
	}
	/* Both directions are identified by the ports: a packet without them
	 * (a later fragment, a transport header cut short) cannot belong to
	 * any VIP or connection of ours; without its first fragment, which is
	 * dropped below, the kernel's reassembly discards a later one. */
	if ((p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP) || !p->ports)
		return XDP_PASS;

	const struct inband_addr *self = self_addr(cfg, &p->daddr);

	/* To the balancer's own address: tested before anything is hashed. */
	if (!inband_addr_is_zero(self) && inband_addr_eq(&p->daddr, self))
		return backend_to_client(ctx, cfg, p);

	client_key(p);
	struct inband_flow *f = bpf_map_lookup_elem(&flows, &p->fk);
	__u32 *vid = NULL;

	if (!f) {
		struct inband_vip_key vk = { .addr = p->daddr, .port = p->dport, .proto = p->proto };

		vid = bpf_map_lookup_elem(&vips, &vk);
		if (!vid)
			return XDP_PASS;
	}
	/* From here the packet belongs to a VIP. */
	if (inband_addr_is_zero(self))
		return drop(INBAND_DROP_FAMILY);
	if (p->frag)
		return drop(INBAND_DROP_FRAGMENT);
	if ((p->family == 4 && p->hlen > INBAND_IPV4_MIN_HDR) || (p->family == 6 && p->ext))
		return client_options(ctx, p);
	/* The IP header is exactly 20 or 40 bytes from here on. */
	if (p->proto == IPPROTO_TCP) {
		if (!tcp_header_ok(ctx, p))
			return drop(INBAND_DROP_TRUNCATED_L4);
		struct tcphdr *tcp = l4_at(ctx, p->hlen & 0x3c);

		if ((void *)(tcp + 1) > (void *)(long)ctx->data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		p->flags = ((__u8 *)tcp)[13];
		p->seq = tcp->seq;
	} else if (!udp_header_ok(p)) {
		return drop(INBAND_DROP_TRUNCATED_L4);
	}

	if (f) {
		int verdict = established(ctx, cfg, f, p);

		if (verdict != REBALANCE && verdict != LATER_CONNECTION)
			return verdict;
		struct inband_vip_key vk = { .addr = p->fk.vip_addr, .port = p->fk.vip_port, .proto = p->fk.proto };

		vid = bpf_map_lookup_elem(&vips, &vk);
		if (!vid)
			return drop(INBAND_DROP_NO_FLOW);
	}
	__u32 id = *vid;
	int verdict = handshake(ctx, cfg, id, p);

	if (verdict == CHAIN)
		return chain(ctx, cfg, p);
	if (verdict == OPEN_FLOW)
		verdict = open_flow(ctx, cfg, id, p, p->named);
	if (verdict == FWD_COPY)
		f = scratch_flow();
	else if (verdict == FWD_FLOW)
		f = bpf_map_lookup_elem(&flows, &p->fk);
	else
		return verdict;
	if (!f)
		return drop(INBAND_DROP_FLOW_TABLE_FULL);
	return forward(ctx, cfg, f, bpf_map_lookup_elem(&vip_conf, &id), p);
}

/* ------------------------------------------------------------------ sweeper */

/* The map argument of bpf_for_each_map_elem callbacks (unused here). */
struct bpf_map;

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
static long mark_probes_due(__u32 i, struct sweep_ctx *c)
{
	__u32 vid = i / INBAND_MAX_BACKENDS_PER_VIP, slot = i % INBAND_MAX_BACKENDS_PER_VIP;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);

	if (!vc || vc->mode != INBAND_MODE_DSR_DYNAMIC || slot >= vc->backend_count)
		return 0;
	__u32 *bid = bpf_map_lookup_elem(&vip_backends, &i);

	if (!bid)
		return 0;
	__u32 id = *bid;
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);
	__u32 *due = bpf_map_lookup_elem(&probe_due, &id);

	struct inband_backend *be = bpf_map_lookup_elem(&backends, &id);

	/* Options do not reach it: the daemon polls it instead. */
	if (!s || !due || !be || (be->flags & INBAND_BACKEND_OPTIONS_LOST))
		return 0;
	__s64 age = s->updated_ns ? (__s64)(c->now - s->updated_ns) : -1;

	if (age < 0 || age >= (__s64)(vc->score_max_age_ns / 2))
		__sync_fetch_and_or(due, INBAND_PROBE_DUE);
	if (age >= (__s64)vc->score_max_age_ns)
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
	bpf_for_each_map_elem(&flows, sweep_flow, &c, 0);
	bpf_for_each_map_elem(&half_open, sweep_half_open, &c, 0);
	bpf_for_each_map_elem(&snat, sweep_snat, &c, 0);
	bpf_for_each_map_elem(&half_open_ports, sweep_hold, &c, 0);
	bpf_loop(INBAND_MAX_VIPS * INBAND_MAX_BACKENDS_PER_VIP, mark_probes_due, &c, 0);
	st->half_open = c.half_open;
	st->snat_entries = c.snat_entries;
	st->last_ns = bpf_ktime_get_ns();
	st->last_duration_ns = st->last_ns - start;
	st->passes++; /* readers use half passes & 1, complete from here */
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

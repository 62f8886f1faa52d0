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
 * This file is the walk: the entry (balancer()), the client's packets of
 * an established flow (established(), the hot path), a new connection
 * (open_flow()) and what sends a client's packet on (forward()). The rest
 * lives in bpf/include/inband/lb/, included below in the order the walk
 * depends on them, and the sweeper (a second program of this object) in
 * lb/sweep.h, included at the end.
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

#include "inband/lb/common.h"      /* the maps (maps.h), counters, header room */
#include "inband/lb/parse.h"       /* IPv4 and IPv6 with extension headers, TCP and UDP */
#include "inband/lb/verify.h"      /* checksums */
#include "inband/lb/rewrite.h"     /* NAT of both families */
#include "inband/lb/options.h"     /* IPv4 and TCP options */
#include "inband/lb/dstopts.h"     /* the IPv6 Destination Options carrier */
#include "inband/lb/lifecycle.h"   /* flow states and timeouts */
#include "inband/lb/nat.h"         /* SNAT ports */
#include "inband/lb/select.h"      /* backend choice and load estimate */
#include "inband/lb/score.h"       /* 124/125, the adaptive probe interval and budget */
#include "inband/lb/quic.h"        /* QUIC routed by connection ID */
#include "inband/lb/query.h"       /* dsr-query */
#include "inband/lb/reset.h"       /* a RST from the VIP */
#include "inband/lb/icmp.h"        /* ICMP and ICMPv6 errors */
#include "inband/lb/encap.h"       /* IP-in-IP to and from encap backends */
#include "inband/lb/scale_out.h"   /* SRv6 from the ECMP router, chaining strays back */
#include "inband/lb/vlan.h"        /* tagged frames */
#include "inband/lb/handshake.h"   /* step 2: no established flow; the walk's own verdicts */
#include "inband/lb/return_path.h" /* step 3: backend -> client */
#include "inband/lb/capture.h"     /* sampled capture of what is dropped */

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
	const struct inband_addr *self = snat_addr(cfg, &f->backend_addr, f->snat_index, f->fleet_suffix);
	__u32 l3 = v4 ? INBAND_IPV4_MIN_HDR : INBAND_IPV6_HDR;
	__u32 coff = l4_check_off(p->proto);
	void *data_end = (void *)(long)ctx->data_end;
	__u16 *check = l4_at(ctx, l3 + coff);

	/* A per-CPU array's slot 0 always exists: for the verifier. */
	if (!self)
		return XDP_ABORTED;
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
	int again = 0;

	if (syn && !first) {
		/* A retransmitted SYN goes without its 155: if the first was
		 * lost to a path that drops packets with options, this one
		 * opens the connection through the balancer instead. (A SYN on
		 * a live flow goes without too: the agent refuses a tuple for a
		 * live socket.) Not on a fleet tuple: no instance is reached
		 * at the fleet address, so a SYN-ACK reaches the client only
		 * through the agent, which must keep the client it learned
		 * (a SYN without a 155 makes it forget a handshake's tuple). */
		struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

		if (bs && options && f->state == INBAND_FLOW_SYN_SENT)
			bs->syn_retries++;
		again = f->snat_index == INBAND_SNAT_FLEET && f->state == INBAND_FLOW_SYN_SENT;
	}
	if ((first || again) && options) {
		if (p->tot_len + added_len(p, tuple_len(cfg, v4, p->proto), encap) > cfg->mtu)
			event(INBAND_EV_TUPLE_SKIPPED_MTU);
		else
			optlen = build_tuple(opt + INBAND_DOH_PREFIX, cfg, fk, f, tcp ? p->seq : f->syn_seq);
	} else if (!syn && f->mode == INBAND_MODE_DSR_DYNAMIC && options && vc && f->state != INBAND_FLOW_CLOSING &&
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
		/* The agent sends what it answers for a fleet flow to the
		 * instance the label of its 155 or 124 names: the fleet
		 * address reaches none (decap_steered). Only packets with an
		 * option carry it, the only ones the agent reads it from. */
		if (optlen && f->snat_index == INBAND_SNAT_FLEET)
			*(__be32 *)ip6 = (*(__be32 *)ip6 & bpf_htonl(0xfff00000)) | bpf_htonl(cfg->fleet_label & 0xfffff);
	}

	int verdict = optlen ? emit(ctx, p, opt, optlen) : XDP_TX;

	if (verdict == XDP_TX && optlen && encap)
		verdict = encap_ipip(ctx, p->tot_len + optlen);

	if (verdict == XDP_TX)
		count_forward(bid, f->vip_id, p->len, first, probe);
	return verdict;
}


/*
 * A fleet VIP's new connection to `be` may take the fleet tuple only if
 * its SYN carries a 155: the agent learns the client from it, and the
 * backend's answer to the fleet address would otherwise come back to
 * whichever instance the router picks. So not toward a backend whose path
 * loses options or needs IP-in-IP (IPv4 only, as fleet prefixes are
 * IPv6), nor when the 155 would pass the MTU. Counted when it may not.
 */
static __always_inline __u32 fleet_tuple_fits(const struct inband_lb_config *cfg, const struct inband_vip *vc,
					      const struct inband_backend *be, const struct pkt *p)
{
	if (!(vc->flags & INBAND_VIP_FLEET) || p->proto != IPPROTO_TCP)
		return 0;
	if ((be->flags & (INBAND_BACKEND_OPTIONS_LOST | INBAND_BACKEND_ENCAP)) || inband_addr_is4(&be->addr) ||
	    p->tot_len + added_len(p, tuple_len(cfg, 0, IPPROTO_TCP), 0) > cfg->mtu) {
		event(INBAND_EV_FLEET_PINNED);
		return 0;
	}
	return 1;
}

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
	__u8 nk_index = 0;
	__be32 suffix = 0;
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

		port = reserve_snat_port(cfg, fk, &nk, p->now, fleet_tuple_fits(cfg, vc, be, p));
		if (port) {
			nk_index = nk.snat_index;
			suffix = nk.fleet_suffix;
			break;
		}
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
	f->snat_index = nk_index;
	f->fleet_suffix = suffix;
	f->backend_id = (__u16)id;
	f->vip_id = (__u16)vid;
	f->mode = vc->mode;
	/* Only the modes with scores and least-connections rank by the count;
	 * counting in the others would leave a stale backlog after a switch to
	 * such a policy. */
	int counted = score_mode(vc->mode) || vc->policy == INBAND_POLICY_LEAST_CONNECTIONS;

	if (counted && !score_mode(vc->mode))
		f->flags |= INBAND_FLOW_COUNTED;
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
	/* Only a fleet tuple can be carried by a peer (adopt()). */
	if ((vc->flags & INBAND_VIP_ANNOUNCE) && nk_index == INBAND_SNAT_FLEET)
		announce_choice(fk, f, p->now);
	if (counted) {
		struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

		if (s) {
			__sync_fetch_and_add(&s->opened, 1);
			s->picked_ns = bpf_ktime_get_ns();
		}
	}
	p->first = 1;
	return FWD_COPY;
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


/* The walk of one frame; its verdict goes to `balancer` below. */
static __always_inline int walk(struct xdp_md *ctx)
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
	/* SRv6 from the ECMP router, or a fleet flow's answer an agent
	 * steered here: walk what it carries. */
	if (p->family == 6) {
		int unwrapped = decap_srv6(ctx, cfg, p);

		if (!unwrapped)
			unwrapped = decap_steered(ctx, cfg, p);
		if (unwrapped < 0)
			return XDP_DROP;
		if (unwrapped == 2)
			return XDP_TX;
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
	/* To one of the balancer's own addresses: tested before anything is hashed. */
	int own = snat_index_of(cfg, &p->daddr);

	if (own >= 0)
		return backend_to_client(ctx, cfg, p, own);

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
	else if (verdict == ADOPT)
		verdict = adopt(ctx, cfg, id, p);
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

SEC("xdp")
int balancer(struct xdp_md *ctx)
{
	int verdict = walk(ctx);

	if (verdict == XDP_DROP)
		capture_drop(ctx);
	return verdict;
}

/* The object's other programs (SEC("syscall")), run by the lb daemon: the
 * sweeper, and the load estimate's side of a flow move. */
#include "inband/lb/sweep.h"
#include "inband/lb/moves.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

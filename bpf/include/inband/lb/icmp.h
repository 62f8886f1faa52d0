/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * ICMP and ICMPv6 errors about balanced connections. A router on the
 * client's path that cannot forward a response (too big for its next hop,
 * unreachable, hop limit) reports it to the response's source, the VIP,
 * which is this host: the kernel here has no such connection and would
 * drop it, and the backend that sent the response would never learn its
 * path MTU (with DSR the backend's packets are the ones too big). So the
 * error is translated to the connection as the backend sees it (balancer
 * address and SNAT port <-> backend) and sent to the backend, as Katran
 * sends it to the real. Errors about the balancer's own NATed packets
 * toward a backend go the other way, to the client, with the MTU lowered
 * by the option bytes the balancer had added.
 *
 * Both families take the same decision (icmp_plan_for); only the byte
 * rewriting differs, because an ICMPv6 checksum also covers the outer
 * addresses and an IPv6 quote has no header checksum.
 */
#ifndef INBAND_LB_ICMP_H
#define INBAND_LB_ICMP_H

#include "inband/csum.h"
#include "inband/lb/common.h"
#include "inband/lb/lifecycle.h"
#include "inband/lb/dstopts.h"
#include "inband/lb/rewrite.h"

/* linux/icmp.h and linux/icmpv6.h pull in libc headers that do not build
 * for the BPF target. */
#define ICMP_DEST_UNREACH 3
#define ICMP_FRAG_NEEDED 4 /* code of DEST_UNREACH */
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12
#define ICMP6_DEST_UNREACH 1
#define ICMP6_PKT_TOOBIG 2
#define ICMP6_TIME_EXCEED 3
#define ICMP6_PARAMPROB 4

struct icmp_err {
	__u8 type;
	__u8 code;
	__be16 check;
	__be16 unused;
	__be16 mtu; /* next-hop MTU of DEST_UNREACH / FRAG_NEEDED (RFC 1191); low half of ICMPv6's */
};

#define ICMP_HLEN 8
#define INNER_OFF (ETH_IP_HLEN + ICMP_HLEN) /* inner IPv4 header, outer header without options */
#define INNER6_OFF (ETH_IP6_HLEN + ICMP_HLEN) /* inner IPv6 header, outer without extension headers */

static __always_inline int icmp_is_error(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED || type == ICMP_PARAMETERPROB;
}

static __always_inline int icmp6_is_error(__u8 type)
{
	return type >= ICMP6_DEST_UNREACH && type <= ICMP6_PARAMPROB;
}

/* Looks a client-side key up among established flows, then handshakes. */
static __always_inline struct inband_flow *any_flow(const struct inband_flow_key *fk)
{
	struct inband_flow *f = bpf_map_lookup_elem(&flows, fk);

	return f ? f : bpf_map_lookup_elem(&half_open, fk);
}

/* The flow that owns the server-side tuple `nk` (its reservation, or its
 * hold during the handshake), and its client side. A flow past its timeout
 * that the sweeper has not ended yet still counts: ageing is the
 * sweeper's, as on the client side. */
static __always_inline struct inband_flow *flow_by_port(const struct inband_nat_key *nk, struct inband_flow_key *fk)
{
	struct inband_snat_owner *o = bpf_map_lookup_elem(&snat, nk);
	struct inband_flow *f;

	if (o) {
		f = bpf_map_lookup_elem(&flows, &o->flow);
		if (f && flow_has_port(f, nk)) {
			*fk = o->flow;
			return f;
		}
	}
	struct inband_port_hold *h = bpf_map_lookup_elem(&half_open_ports, nk);

	if (h) {
		f = bpf_map_lookup_elem(&half_open, &h->flow);
		if (f && flow_has_port(f, nk)) {
			*fk = h->flow;
			return f;
		}
	}
	return NULL;
}

/* What an error is about and where it goes: the quoted packet's new
 * tuple, the outer header's, and the next hop. */
struct icmp_plan {
	struct inband_addr old_src, old_dst; /* the quote as it came */
	struct inband_addr new_src, new_dst;
	struct inband_addr outer_src, outer_dst;
	__be16 old_sport, old_dport;
	__be16 new_sport, new_dport;
	__u8 l2_dst[6];
	__u8 to_backend;
	__u8 proto;
};

/*
 * Fills `pl` for an error sent to `odst` (this balancer or a VIP) that
 * quotes a packet old_src:old_sport -> old_dst:old_dport of `proto` (filled
 * in by the caller). 0 if it is about nothing of ours.
 */
static __always_inline int icmp_plan_for(const struct inband_lb_config *cfg, const struct inband_addr *odst,
					 struct icmp_plan *pl)
{
	int own = snat_index_of(cfg, odst);
	struct inband_flow_key fk = {};
	struct inband_flow *f;

	pl->to_backend = own < 0;
	if (pl->to_backend) {
		/* Quoted: our response VIP:vport -> client:cport. */
		struct inband_vip_key vk = { .addr = pl->old_src, .port = pl->old_sport, .proto = pl->proto };

		if (!inband_addr_eq(&pl->old_src, odst) || !bpf_map_lookup_elem(&vips, &vk))
			return 0;
		fk.client_addr = pl->old_dst;
		fk.vip_addr = pl->old_src;
		fk.client_port = pl->old_dport;
		fk.vip_port = pl->old_sport;
		fk.proto = pl->proto;
		f = any_flow(&fk);
		if (!f)
			return 0;
		__u32 bid = f->backend_id;
		struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

		if (!be || mac_is_zero(be->mac))
			return 0;
		/* As the backend sent it: backend:bport -> balancer:snat port. */
		pl->new_src = f->backend_addr;
		const struct inband_addr *src = snat_addr(cfg, &f->backend_addr, f->snat_index, f->fleet_suffix);

		if (!src)
			return 0;
		pl->new_dst = *src;
		pl->new_sport = f->backend_port;
		pl->new_dport = f->snat_port;
		pl->outer_src = pl->new_dst;
		pl->outer_dst = f->backend_addr;
		__builtin_memcpy(pl->l2_dst, be->mac, ETH_ALEN);
		return 1;
	}
	/* Quoted: our NATed packet balancer:snat port -> backend:bport. */
	struct inband_nat_key nk = {
		.backend_addr = pl->old_dst,
		.backend_port = pl->old_dport,
		.snat_port = pl->old_sport,
		.proto = pl->proto,
		.snat_index = (__u8)own,
		.fleet_suffix = own == INBAND_SNAT_FLEET ? pl->old_src.w[3] : 0,
	};

	if (!inband_addr_eq(&pl->old_src, odst))
		return 0;
	f = flow_by_port(&nk, &fk);
	if (!f)
		return 0;
	/* As the client sent it: client:cport -> VIP:vport. */
	pl->new_src = fk.client_addr;
	pl->new_dst = fk.vip_addr;
	pl->new_sport = fk.client_port;
	pl->new_dport = fk.vip_port;
	pl->outer_src = fk.vip_addr;
	pl->outer_dst = fk.client_addr;
	__builtin_memcpy(pl->l2_dst, f->client_mac, ETH_ALEN);
	return 1;
}

/* The quoted transport header's ports and, when the quote reaches it, its
 * checksum; returns the ICMP checksum accumulator with both changes. */
static __always_inline __u32 rewrite_quoted_l4(struct xdp_md *ctx, __u32 l4_off, const struct icmp_plan *pl,
					       __u32 icmp_acc)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__be16 *ports = data + (l4_off & 0xff);

	if ((void *)(ports + 2) > data_end)
		return icmp_acc;
	__be16 *check = (void *)ports + l4_check_off(pl->proto);

	if ((void *)(check + 1) <= data_end && !(pl->proto == IPPROTO_UDP && *check == 0)) {
		__u32 acc = csum_start(*check);

		acc = csum_addr(acc, &pl->old_src, &pl->new_src);
		acc = csum_addr(acc, &pl->old_dst, &pl->new_dst);
		acc = csum_replace16(acc, ports[0], pl->new_sport);
		acc = csum_replace16(acc, ports[1], pl->new_dport);
		__be16 c = csum_finish(acc);

		if (pl->proto == IPPROTO_UDP && c == 0)
			c = 0xffff;
		icmp_acc = csum_replace16(icmp_acc, *check, c);
		*check = c;
	}
	icmp_acc = csum_replace16(icmp_acc, ports[0], pl->new_sport);
	icmp_acc = csum_replace16(icmp_acc, ports[1], pl->new_dport);
	ports[0] = pl->new_sport;
	ports[1] = pl->new_dport;
	return icmp_acc;
}

/*
 * An ICMP error (outer IPv4 header without options, checked by the caller)
 * to this balancer or to a VIP. XDP_PASS when it is about nothing of ours.
 */
__noinline int icmp4_error(struct xdp_md *ctx, const struct inband_lb_config *cfg, const struct pkt *p)
{
	if (!cfg || !p)
		return XDP_PASS;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *iph = data + ETH_HLEN;
	struct icmp_err *icmp = data + ETH_IP_HLEN;
	struct iphdr *inner = data + INNER_OFF;
	struct icmp_plan pl = {};

	if ((void *)(inner + 1) > data_end || !icmp_is_error(icmp->type) ||
	    (inner->protocol != IPPROTO_TCP && inner->protocol != IPPROTO_UDP))
		return XDP_PASS;
	__u32 ihl = inner->ihl * 4;

	if (inner->version != 4 || ihl < INBAND_IPV4_MIN_HDR || ihl > INBAND_IPV4_MAX_HDR)
		return XDP_PASS;
	__be16 *ports = data + INNER_OFF + (ihl & 0x3c);

	if ((void *)(ports + 2) > data_end)
		return XDP_PASS;
	pl.proto = inner->protocol;
	pl.old_src = inband_addr4(inner->saddr);
	pl.old_dst = inband_addr4(inner->daddr);
	pl.old_sport = ports[0];
	pl.old_dport = ports[1];
	if (!icmp_plan_for(cfg, &p->daddr, &pl))
		return XDP_PASS;
	if (iph->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);

	__u32 icmp_acc = rewrite_quoted_l4(ctx, INNER_OFF + (ihl & 0x3c), &pl, csum_start(icmp->check));

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	iph = data + ETH_HLEN;
	icmp = data + ETH_IP_HLEN;
	inner = data + INNER_OFF;
	if ((void *)(inner + 1) > data_end)
		return XDP_PASS;
	/* Inner IPv4 header. */
	__u32 acc = csum_start(inner->check);

	acc = csum_replace32(acc, inner->saddr, pl.new_src.w[3]);
	acc = csum_replace32(acc, inner->daddr, pl.new_dst.w[3]);
	__be16 inner_check = csum_finish(acc);

	icmp_acc = csum_replace16(icmp_acc, inner->check, inner_check);
	icmp_acc = csum_replace32(icmp_acc, inner->saddr, pl.new_src.w[3]);
	icmp_acc = csum_replace32(icmp_acc, inner->daddr, pl.new_dst.w[3]);
	inner->check = inner_check;
	inner->saddr = pl.new_src.w[3];
	inner->daddr = pl.new_dst.w[3];

	/* The client never sent the option bytes the balancer added. */
	if (!pl.to_backend && icmp->type == ICMP_DEST_UNREACH && icmp->code == ICMP_FRAG_NEEDED &&
	    ihl > INBAND_IPV4_MIN_HDR) {
		__be16 old_mtu = icmp->mtu;
		__u16 mtu = bpf_ntohs(old_mtu);

		if (mtu > ihl - INBAND_IPV4_MIN_HDR + 68) {
			icmp->mtu = bpf_htons(mtu - (ihl - INBAND_IPV4_MIN_HDR));
			icmp_acc = csum_replace16(icmp_acc, old_mtu, icmp->mtu);
		}
	}
	icmp->check = csum_finish(icmp_acc);

	/* Outer header: from us to the new destination, one hop more. */
	ip4_nat(iph, pl.outer_src.w[3], pl.outer_dst.w[3]);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, pl.l2_dst, ETH_ALEN);
	event(pl.to_backend ? INBAND_EV_ICMP_TO_BACKEND : INBAND_EV_ICMP_TO_CLIENT);
	return XDP_TX;
}

/*
 * An ICMPv6 error (outer IPv6 header without extension headers, checked
 * by the caller) to this balancer or to a VIP. The quote may carry the
 * Destination Options header the balancer added (toward a backend); it is
 * kept, and a Packet Too Big for the client is lowered by its length.
 */
__noinline int icmp6_error(struct xdp_md *ctx, const struct inband_lb_config *cfg, const struct pkt *p)
{
	if (!cfg || !p)
		return XDP_PASS;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct icmp_err *icmp = data + ETH_IP6_HLEN;
	struct ipv6hdr *inner = data + INNER6_OFF;
	struct icmp_plan pl = {};
	__u32 added = 0;

	if ((void *)(inner + 1) > data_end || !icmp6_is_error(icmp->type))
		return XDP_PASS;
	__u8 nh = inner->nexthdr;

	if (nh == IP6_DSTOPTS) {
		__u8 h[2];

		if (bpf_xdp_load_bytes(ctx, INNER6_OFF + INBAND_IPV6_HDR, h, sizeof(h)))
			return XDP_PASS;
		nh = h[0];
		added = ((__u32)h[1] + 1) * 8;
		if (added > DOH_MAX)
			return XDP_PASS;
	}
	if (nh != IPPROTO_TCP && nh != IPPROTO_UDP)
		return XDP_PASS;
	__u32 l4_off = INNER6_OFF + INBAND_IPV6_HDR + added;
	__be16 ports[2];

	if (bpf_xdp_load_bytes(ctx, l4_off, ports, sizeof(ports)))
		return XDP_PASS;
	pl.proto = nh;
	__builtin_memcpy(&pl.old_src, &inner->saddr, 16);
	__builtin_memcpy(&pl.old_dst, &inner->daddr, 16);
	pl.old_sport = ports[0];
	pl.old_dport = ports[1];
	if (!icmp_plan_for(cfg, &p->daddr, &pl))
		return XDP_PASS;
	if (p->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);

	/* The ICMPv6 checksum covers the outer addresses (pseudo-header) and
	 * everything quoted. */
	__u32 icmp_acc = rewrite_quoted_l4(ctx, l4_off, &pl, csum_start(icmp->check));

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6 = data + ETH_HLEN;

	icmp = data + ETH_IP6_HLEN;
	inner = data + INNER6_OFF;
	if ((void *)(inner + 1) > data_end)
		return XDP_PASS;
	icmp_acc = csum_addr(icmp_acc, &pl.old_src, &pl.new_src);
	icmp_acc = csum_addr(icmp_acc, &pl.old_dst, &pl.new_dst);
	__builtin_memcpy(&inner->saddr, &pl.new_src, 16);
	__builtin_memcpy(&inner->daddr, &pl.new_dst, 16);
	icmp_acc = csum_addr(icmp_acc, &p->saddr, &pl.outer_src);
	icmp_acc = csum_addr(icmp_acc, &p->daddr, &pl.outer_dst);

	/* The client never sent the option bytes the balancer added. */
	if (!pl.to_backend && icmp->type == ICMP6_PKT_TOOBIG && added) {
		__be16 old_mtu = icmp->mtu;
		__u16 mtu = bpf_ntohs(old_mtu);

		/* 1280 is IPv6's minimum link MTU (RFC 8200): never below it. */
		if (icmp->unused == 0 && mtu >= 1280 + added) {
			icmp->mtu = bpf_htons(mtu - added);
			icmp_acc = csum_replace16(icmp_acc, old_mtu, icmp->mtu);
		}
	}
	icmp->check = csum_finish(icmp_acc);

	ip6_nat(ip6, &pl.outer_src, &pl.outer_dst);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, pl.l2_dst, ETH_ALEN);
	event(pl.to_backend ? INBAND_EV_ICMP_TO_BACKEND : INBAND_EV_ICMP_TO_CLIENT);
	return XDP_TX;
}

#endif /* INBAND_LB_ICMP_H */

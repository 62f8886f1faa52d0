/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * ICMP errors about balanced connections. A router on the client's path
 * that cannot forward a response (too big for its next hop, unreachable,
 * TTL) reports it to the response's source, the VIP, which is this host:
 * the kernel here has no such connection and would drop it, and the
 * backend that sent the response would never learn its path MTU (with DSR
 * the backend's packets are the ones too big). So the error is translated
 * to the connection as the backend sees it (balancer address and SNAT port
 * <-> backend) and sent to the backend, as Katran sends it to the real.
 * Errors about the balancer's own NATed packets toward a backend go the
 * other way, to the client, with the MTU lowered by the option bytes the
 * balancer had added.
 */
#ifndef INBAND_LB_ICMP_H
#define INBAND_LB_ICMP_H

#include "inband/csum.h"
#include "inband/lb/common.h"
#include "inband/lb/lifecycle.h"

/* linux/icmp.h pulls in libc headers that do not build for the BPF target. */
#define ICMP_DEST_UNREACH 3
#define ICMP_FRAG_NEEDED 4 /* code of DEST_UNREACH */
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12

struct icmp_err {
	__u8 type;
	__u8 code;
	__be16 check;
	__be16 unused;
	__be16 mtu; /* next-hop MTU of DEST_UNREACH / FRAG_NEEDED (RFC 1191) */
};

#define ICMP_HLEN 8
#define INNER_OFF (ETH_IP_HLEN + ICMP_HLEN) /* inner IPv4 header, outer header without options */

static __always_inline int icmp_is_error(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED || type == ICMP_PARAMETERPROB;
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

/*
 * An ICMP error (outer header without options, checked by the caller) to
 * `self_addr` or to a VIP. XDP_PASS when it is about nothing of ours.
 */
static __always_inline int icmp_error(struct xdp_md *ctx, const struct inband_lb_config *cfg)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *iph = data + ETH_HLEN;
	struct icmp_err *icmp = data + ETH_IP_HLEN;
	struct iphdr *inner = data + INNER_OFF;

	if ((void *)(inner + 1) > data_end || !icmp_is_error(icmp->type) || inner->protocol != IPPROTO_TCP)
		return XDP_PASS;
	__u32 ihl = inner->ihl * 4;

	if (inner->version != 4 || ihl < INBAND_IPV4_MIN_HDR || ihl > INBAND_IPV4_MAX_HDR)
		return XDP_PASS;
	__be16 *ports = data + INNER_OFF + (ihl & 0x3c);

	if ((void *)(ports + 2) > data_end)
		return XDP_PASS;

	struct inband_flow_key fk = {};
	struct inband_flow *f;
	int to_backend = iph->daddr != cfg->self_addr;
	__be32 new_src, new_dst, outer_src, outer_dst;
	__be16 new_sport, new_dport;
	__u8 *l2_dst;

	if (to_backend) {
		/* Quoted: our response VIP:vport -> client:cport. */
		struct inband_vip_key vk = { .addr = inner->saddr, .port = ports[0], .proto = IPPROTO_TCP };

		if (inner->saddr != iph->daddr || !bpf_map_lookup_elem(&vips, &vk))
			return XDP_PASS;
		fk.client_addr = inner->daddr;
		fk.vip_addr = inner->saddr;
		fk.client_port = ports[1];
		fk.vip_port = ports[0];
		fk.proto = IPPROTO_TCP;
		f = any_flow(&fk);
		if (!f)
			return XDP_PASS;
		__u32 bid = f->backend_id;
		struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

		if (!be || mac_is_zero(be->mac))
			return XDP_PASS;
		/* As the backend sent it: backend:bport -> balancer:snat port. */
		new_src = f->backend_addr;
		new_dst = cfg->self_addr;
		new_sport = f->backend_port;
		new_dport = f->snat_port;
		outer_src = cfg->self_addr;
		outer_dst = f->backend_addr;
		l2_dst = be->mac;
	} else {
		/* Quoted: our NATed packet balancer:snat port -> backend:bport. */
		struct inband_nat_key nk = {
			.backend_addr = inner->daddr,
			.backend_port = ports[1],
			.snat_port = ports[0],
			.proto = IPPROTO_TCP,
		};

		if (inner->saddr != cfg->self_addr)
			return XDP_PASS;
		f = flow_by_port(&nk, &fk);
		if (!f)
			return XDP_PASS;
		/* As the client sent it: client:cport -> VIP:vport. */
		new_src = fk.client_addr;
		new_dst = fk.vip_addr;
		new_sport = fk.client_port;
		new_dport = fk.vip_port;
		outer_src = fk.vip_addr;
		outer_dst = fk.client_addr;
		l2_dst = f->client_mac;
	}
	if (iph->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);

	/* Inner TCP checksum, when the quote reaches it. */
	__u32 icmp_acc = csum_start(icmp->check);
	__be16 *tcp_check = (void *)ports + 16;

	if ((void *)(tcp_check + 1) <= data_end) {
		__u32 acc = csum_start(*tcp_check);

		acc = csum_replace32(acc, inner->saddr, new_src);
		acc = csum_replace32(acc, inner->daddr, new_dst);
		acc = csum_replace16(acc, ports[0], new_sport);
		acc = csum_replace16(acc, ports[1], new_dport);
		__be16 check = csum_finish(acc);

		icmp_acc = csum_replace16(icmp_acc, *tcp_check, check);
		*tcp_check = check;
	}
	/* Inner IPv4 header. */
	__u32 acc = csum_start(inner->check);

	acc = csum_replace32(acc, inner->saddr, new_src);
	acc = csum_replace32(acc, inner->daddr, new_dst);
	__be16 inner_check = csum_finish(acc);

	icmp_acc = csum_replace16(icmp_acc, inner->check, inner_check);
	icmp_acc = csum_replace32(icmp_acc, inner->saddr, new_src);
	icmp_acc = csum_replace32(icmp_acc, inner->daddr, new_dst);
	icmp_acc = csum_replace16(icmp_acc, ports[0], new_sport);
	icmp_acc = csum_replace16(icmp_acc, ports[1], new_dport);
	inner->check = inner_check;
	inner->saddr = new_src;
	inner->daddr = new_dst;
	ports[0] = new_sport;
	ports[1] = new_dport;

	/* The client never sent the option bytes the balancer added. */
	if (!to_backend && icmp->type == ICMP_DEST_UNREACH && icmp->code == ICMP_FRAG_NEEDED &&
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
	acc = csum_start(iph->check);
	acc = csum_replace32(acc, iph->saddr, outer_src);
	acc = csum_replace32(acc, iph->daddr, outer_dst);
	acc = csum_replace16(acc, load16(&iph->ttl), load16(&iph->ttl) - bpf_htons(0x0100));
	iph->ttl--;
	iph->saddr = outer_src;
	iph->daddr = outer_dst;
	iph->check = csum_finish(acc);

	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, l2_dst, ETH_ALEN);
	event(to_backend ? INBAND_EV_ICMP_TO_BACKEND : INBAND_EV_ICMP_TO_CLIENT);
	return XDP_TX;
}

#endif /* INBAND_LB_ICMP_H */

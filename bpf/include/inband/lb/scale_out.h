/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Several balancers behind an ECMP router ("Several balancers behind
 * ECMP" in docs/architecture.md): what the router sends to this
 * instance's SIDs in SRv6 is unwrapped (decap_srv6) and walked as if it
 * had come straight; a TCP packet that belongs to no connection here is
 * sent back to the router's shadow table (chain), which routes it by an
 * earlier next-hop set to the instance that has it. Apart from the walk
 * because it is the ECMP tier's concern, which a balancer without SIDs
 * never uses (decap_srv6 returns at once), and because both functions
 * keep frames of their own (not inlined): the walk's frame is at the
 * verifier's 512-byte limit.
 */
#ifndef INBAND_LB_SCALE_OUT_H
#define INBAND_LB_SCALE_OUT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/lb/common.h"
#include "inband/lb/parse.h"
#include "inband/shadow_generations.h"

/* How a packet reached this instance through the ECMP router (p->via_sid),
 * or from a backend's agent (VIA_STEERED: decap_steered()). */
#define VIA_COND_SID 1
#define VIA_DIRECT_SID 2
#define VIA_STEERED 3

/* The SRv6 encapsulation the router adds (seg6 mode encap): an outer
 * IPv6 header, and a Segment Routing Header of one segment, or none
 * (encap.red), or of two whose second names a later shadow generation. */
#define SRV6_OUTER INBAND_IPV6_HDR
#define SRV6_OUTER_SRH (INBAND_IPV6_HDR + 8 + 16)
#define SRV6_OUTER_SRH2 (INBAND_IPV6_HDR + INBAND_SRH2_LEN)
#define IP6_IN_IP6 41
#define IP4_IN_IP6 4
#define SRH_TYPE 4
#define ICMP6_ECHO_REQUEST 128
#define ICMP6_ECHO_REPLY 129

/*
 * An ICMPv6 echo request to the direct SID, answered here (XDP_TX): the
 * router's liveness probe (`inband shadow route`, a server outside the
 * set whose link is up) asks whether this instance's program runs, which
 * no answer from the host's kernel could tell. 1 if answered; 0 if the
 * packet is no echo request (the caller goes on as before).
 */
static __always_inline int sid_echo(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6 = (void *)(eth + 1);
	__u8 *icmp = (void *)(ip6 + 1);
	__u8 mac[ETH_ALEN];
	struct in6_addr a;

	if ((void *)(icmp + 4) > data_end || icmp[0] != ICMP6_ECHO_REQUEST || icmp[1])
		return 0;
	__builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, mac, ETH_ALEN);
	a = ip6->saddr;
	ip6->saddr = ip6->daddr;
	ip6->daddr = a;
	ip6->hop_limit = 64;
	/* The addresses only swap places in the pseudo-header: the sum stays;
	 * the type byte is the only word that changes. */
	__u16 *check = (__u16 *)(icmp + 2);
	__u16 from = *(__u16 *)icmp;

	icmp[0] = ICMP6_ECHO_REPLY;
	*check = csum_finish(csum_replace16(csum_start(*check), from, *(__u16 *)icmp));
	event(INBAND_EV_SID_ECHO);
	return 1;
}

/*
 * SRv6 from the ECMP router to one of this instance's SIDs (scale-out):
 * the outer header (and its SRH) comes off and `p` is parsed
 * again as the IPv6 or IPv4 packet inside (an IPv4 VIP's route encapsulates
 * IPv4 in IPv6), to be walked as if it had come straight, with p->via_sid
 * saying how it came. 1 if it was unwrapped, 0
 * if it is not ours (left to the kernel), -1 if it is dropped (counted),
 * 2 if it was an echo request to the direct SID, answered in place.
 * Not inlined: the walk's frame is at its limit.
 */
static __noinline int decap_srv6(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct pkt *p)
{
	__u8 via, next[16];
	int generation = 0, inner4;

	if (!cfg || !p || inband_addr_is_zero(&cfg->cond_sid))
		return 0;
	if (inband_addr_eq(&p->daddr, &cfg->cond_sid))
		via = VIA_COND_SID;
	else if (inband_addr_eq(&p->daddr, &cfg->direct_sid))
		via = VIA_DIRECT_SID;
	else
		return 0;
	/* Only what the router sends is unwrapped: IPv6 or IPv4 inside, no
	 * fragment, and either no extension header or one SRH whose only
	 * segment is ours (segments left 0), or, to the conditional SID,
	 * one of two segments whose second is a shadow SID (segments left
	 * 1: where a stray goes). Anything else to our SID has no meaning
	 * here. */
	if (via == VIA_DIRECT_SID && p->proto == IP6_ICMP && !p->ext && !p->frag && sid_echo(ctx))
		return 2;
	if ((p->proto != IP6_IN_IP6 && p->proto != IP4_IN_IP6) || p->frag)
		goto unsupported;
	inner4 = p->proto == IP4_IN_IP6;
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
	if (inner4) {
		/* The walk's IPv4 paths keep the frame's type as it came. */
		struct ethhdr *eth = (void *)(long)ctx->data;

		if ((void *)(eth + 1) > (void *)(long)ctx->data_end) {
			drop(INBAND_DROP_ADJUST_FAILED);
			return -1;
		}
		eth->h_proto = bpf_htons(ETH_P_IP);
		if (parse4(ctx, p))
			return -1;
	} else if (parse6(ctx, p)) {
		return -1;
	}
	p->via_sid = via;
	p->chain_generation = generation;
	return 1;
unsupported:
	drop(INBAND_DROP_SRV6_UNSUPPORTED);
	return -1;
}

/*
 * A backend's packet to a fleet address, which its agent wrapped in IPv6
 * to this instance's address because the flow label of the connection's
 * 155 or 124 named this instance (forward() writes cfg->fleet_label):
 * the fleet address itself reaches no instance. Only the agent's exact
 * wrapping is unwrapped: no extension header or fragment outside, IPv6
 * inside from the same source (the backend) to an address of this
 * instance's fleet prefix, filling the outer packet. The inner packet is
 * then walked with p->via_sid = VIA_STEERED, and only the return path
 * takes it (a 125 there still needs its flow, an outstanding 124 and the
 * MAC; anything else to a fleet address with no connection here is
 * dropped, `steered_not_owner`). Anyone can send such a packet; it
 * carries nothing a packet to a fleet address could not, were that
 * address routed here. 1 if unwrapped, 0 if it is not the agent's (left
 * to the kernel), -1 if dropped (counted). Not inlined: the walk's frame
 * is at its limit.
 */
static __noinline int decap_steered(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct pkt *p)
{
	if (!cfg || !p || !cfg->fleet_label || p->proto != IP6_IN_IP6 || p->ext || p->frag ||
	    !inband_addr_eq(&p->daddr, &cfg->self6))
		return 0;
	struct ipv6hdr in;
	struct inband_addr src, dst;

	if (bpf_xdp_load_bytes(ctx, ETH_HLEN + INBAND_IPV6_HDR, &in, sizeof(in)))
		return 0;
	__builtin_memcpy(&src, &in.saddr, 16);
	__builtin_memcpy(&dst, &in.daddr, 16);
	if (in.version != 6 || bpf_ntohs(in.payload_len) + 2 * INBAND_IPV6_HDR != p->tot_len ||
	    !inband_addr_eq(&src, &p->saddr) || !in_fleet_prefix(cfg, &dst))
		return 0;
	if (close_gap(ctx, ETH_HLEN, SRV6_OUTER))
		return -1;
	event(INBAND_EV_FLEET_STEERED);
	__builtin_memset(p, 0, sizeof(*p));
	p->len = (long)ctx->data_end - (long)ctx->data;
	if (parse6(ctx, p))
		return -1;
	p->via_sid = VIA_STEERED;
	return 1;
}

/*
 * Sends a TCP packet that has no connection here back to the router,
 * wrapped in IPv6 to a shadow SID (the generation the router named, or
 * the first; no SRH: the router's End.DT6 takes a plain IPv6-in-IPv6
 * packet, its shadow_dt4 program a plain IPv4-in-IPv6 one), which routes
 * it by that earlier next-hop set to the instance that had it. The router sent it to us, so its MAC
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
	outer->nexthdr = p->family == 4 ? IP4_IN_IP6 : IP6_IN_IP6;
	outer->hop_limit = 64;
	__builtin_memcpy(&outer->saddr, &cfg->self6, 16);
	inband_shadow_sid((__u8 *)&outer->daddr, (const __u8 *)&cfg->shadow_sid, p->chain_generation);
	event(p->chain_generation ? INBAND_EV_CHAINED_NAMED : INBAND_EV_CHAINED);
	return XDP_TX;
}

#endif /* INBAND_LB_SCALE_OUT_H */

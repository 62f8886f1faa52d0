/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The agent's side of the IP-in-IP carrier (inband/ipip.h): unwrapping a
 * balancer's wrapped packet on ingress, wrapping a 125 on egress when its
 * 124 came wrapped. And the fleet's steering: what a fleet flow sends its
 * balancer goes wrapped in IPv6 to the instance its flow label named.
 */
#ifndef INBAND_AGENT_ENCAP_H
#define INBAND_AGENT_ENCAP_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent/packet.h"
#include "inband/agent/skb.h"
#include "inband/ipip.h"

/* bpf_skb_adjust_room flags (kernel 6.3+) that Debian's UAPI header
 * predates: the skb's encapsulation state follows the removed or added
 * outer IPv4 header. */
#define INBAND_ADJ_ROOM_ENCAP_L3_IPV4 (1ULL << 1)
#define INBAND_ADJ_ROOM_DECAP_L3_IPV4 (1ULL << 7)
#define INBAND_ADJ_ROOM_ENCAP_L3_IPV6 (1ULL << 2)
#define INBAND_IPPROTO_IPV6 41

/*
 * Ingress: a packet a balancer wrapped (outer source a configured
 * balancer, inner header as inband_ipip_ours wants it) loses its outer
 * header and is then walked like any other. 1 if unwrapped, 0 if it is not
 * inband's (another tunnel: left to the kernel untouched), -1
 * if the kernel refused to unwrap it (counted; the caller drops it, as the
 * stack has no tunnel to take it).
 */
static __always_inline int ipip_unwrap(struct __sk_buff *skb)
{
	struct iphdr hdr[2];

	/* The caller parsed an IPv4 packet of protocol 4. */
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, hdr, sizeof(hdr)) || !inband_ipip_ours(&hdr[0], &hdr[1]))
		return 0;
	struct inband_addr from = inband_addr4(hdr[0].saddr);

	if (!bpf_map_lookup_elem(&balancers, &from))
		return 0;
	if (bpf_skb_adjust_room(skb, -INBAND_IPIP_HLEN, BPF_ADJ_ROOM_MAC, INBAND_ADJ_ROOM_DECAP_L3_IPV4)) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return -1;
	}
	count(INBAND_AGENT_DECAPSULATED);
	return 1;
}

/*
 * Egress: wraps the finished IPv4 packet (`inner_len` bytes, its header
 * already final) in an outer header from the same source to the same
 * destination. Returns 0 on success.
 */
static __always_inline int ipip_wrap(struct __sk_buff *skb, __u32 inner_len)
{
	struct iphdr inner, outer;

	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, &inner, sizeof(inner)))
		return -1;
	if (bpf_skb_adjust_room(skb, INBAND_IPIP_HLEN, BPF_ADJ_ROOM_MAC, INBAND_ADJ_ROOM_ENCAP_L3_IPV4))
		return -1;
	inband_ipip_outer(&outer, &inner, inner_len);
	if (bpf_skb_store_bytes(skb, INBAND_ETH_HLEN, &outer, sizeof(outer), BPF_F_RECOMPUTE_CSUM))
		return -1;
	count(INBAND_AGENT_ENCAPSULATED);
	return 0;
}

/*
 * Ingress: the instance a fleet's 155 or 124 (authenticated already) names
 * in its flow label, if `balancers` has an address with that label
 * (fleet_instances), else 0, counted: its answers then go to the fleet
 * address, which reaches no instance. The label is not in the MAC: one
 * altered on the way can only name another configured balancer, which
 * refuses what it does not own (decap_steered, the return path).
 */
static __always_inline __u32 named_instance(const struct apkt *a)
{
	__u32 label = a->label;

	if (label && bpf_map_lookup_elem(&fleet_instances, &label))
		return label;
	count(INBAND_AGENT_FLEET_UNNAMED);
	return 0;
}

/*
 * Egress: a packet of a fleet flow toward its balancer (one carrying a
 * 125, a RST), finished: its destination, the fleet address, reaches no
 * instance (the router has none behind it), so it goes wrapped in IPv6
 * from the same source to the instance its flow label named (lb/scale_out.h
 * decap_steered unwraps it there, and the return path takes the inner
 * packet as if it had come straight). The kernel routes the new outer
 * destination (bpf_redirect_neigh without a next hop), as for DSR on a
 * host that does not forward. Returns the verdict: TC_ACT_OK (unchanged,
 * toward the fleet address) when the flow names no instance.
 */
static __always_inline int steer_to_instance(struct __sk_buff *skb, const struct inband_dsr_flow *flow)
{
	__u32 label = flow->fleet_label;

	if (!label)
		return TC_ACT_OK;
	const struct inband_addr *to = bpf_map_lookup_elem(&fleet_instances, &label);
	struct ipv6hdr outer;

	if (!to) {
		count(INBAND_AGENT_FLEET_UNNAMED);
		return TC_ACT_OK;
	}
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, &outer, sizeof(outer)) || outer.version != 6)
		return TC_ACT_OK;
	if (bpf_skb_adjust_room(skb, INBAND_IPV6_HDR, BPF_ADJ_ROOM_MAC, INBAND_ADJ_ROOM_ENCAP_L3_IPV6)) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return TC_ACT_OK;
	}
	/* Version, traffic class and flow label as the inner packet's. */
	outer.payload_len = bpf_htons(INBAND_IPV6_HDR + bpf_ntohs(outer.payload_len));
	outer.nexthdr = INBAND_IPPROTO_IPV6;
	outer.hop_limit = 64;
	__builtin_memcpy(&outer.daddr, to, sizeof(outer.daddr));
	if (bpf_skb_store_bytes(skb, INBAND_ETH_HLEN, &outer, sizeof(outer), 0)) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return TC_ACT_SHOT;
	}
	count(INBAND_AGENT_FLEET_STEERED);
	return bpf_redirect_neigh(skb->ifindex, NULL, 0, 0);
}

#endif /* INBAND_AGENT_ENCAP_H */

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The agent's side of the IP-in-IP carrier (inband/ipip.h): unwrapping a
 * balancer's wrapped packet on ingress, wrapping a 125 on egress when its
 * 124 came wrapped.
 */
#ifndef INBAND_AGENT_ENCAP_H
#define INBAND_AGENT_ENCAP_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent/skb.h"
#include "inband/ipip.h"

/* bpf_skb_adjust_room flags (kernel 6.3+) that Debian's UAPI header
 * predates: the skb's encapsulation state follows the removed or added
 * outer IPv4 header. */
#define INBAND_ADJ_ROOM_ENCAP_L3_IPV4 (1ULL << 1)
#define INBAND_ADJ_ROOM_DECAP_L3_IPV4 (1ULL << 7)

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

#endif /* INBAND_AGENT_ENCAP_H */

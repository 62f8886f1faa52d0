/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * A packet as the agent's programs see it, either family: addresses
 * (IPv4-mapped or IPv6), ports, transport, and where the inband option
 * sits (IPv4: the first option of the header; IPv6: the Destination
 * Options header right after the fixed one). Loaded with
 * bpf_skb_load_bytes: at tc the headers of a non-linear skb need not sit
 * in the linear area.
 */
#ifndef INBAND_AGENT_PACKET_H
#define INBAND_AGENT_PACKET_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/addr.h"
#include "inband/agent/skb.h"
#include "inband/wire.h"

#define INBAND_ETH_P_IPV6 0x86DD
#define INBAND_IPPROTO_UDP 17
#define INBAND_FLOW_LABEL_MASK 0xfffff

struct apkt {
	struct inband_addr saddr;
	struct inband_addr daddr;
	__u32 hlen; /* IP header: IPv4 IHL * 4, IPv6 40 + the Destination Options header */
	__u32 tot_len; /* IP packet bytes by its header */
	__u32 opt_len; /* IPv4: option bytes in the header; IPv6: the Destination Options header's */
	__be16 ports[2]; /* source, destination */
	__u8 family; /* 4 or 6 */
	__u8 proto; /* transport */
	__u8 frag; /* a fragment (IPv4 MF or offset): never an inband packet */
	__u8 tos; /* IPv4 TOS, for the route lookup */
	__u8 ext_unwalked; /* IPv6: the transport sits behind extension headers not walked (proto 0) */
	__u32 label; /* IPv6: the flow label (host order) */
	struct iphdr ip4; /* IPv4: the fixed header as it came */
};

/* RFC 7045's extension headers but ESP (whose payload is opaque anyway):
 * behind any of them the transport is unknown to the agent. */
static __always_inline int ipv6_is_ext(__u8 nh)
{
	return nh == 0 || nh == 43 || nh == 44 || nh == 51 || nh == INBAND_IPPROTO_DSTOPTS || nh == 135 ||
	       nh == 139 || nh == 140 || nh == 253 || nh == 254;
}

/*
 * Parses the IP header after Ethernet. Returns 0, -1 for a packet that is
 * neither family (or not for us to parse), -2 for a malformed header.
 * IPv6 with any extension header but one Destination Options header right
 * after the fixed one has its transport unknown (proto 0): the agent never
 * touches it.
 */
static __always_inline int apkt_parse(struct __sk_buff *skb, struct apkt *a)
{
	__be16 h_proto;

	if (bpf_skb_load_bytes(skb, offsetof(struct ethhdr, h_proto), &h_proto, sizeof(h_proto)))
		return -1;
	if (h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *iph = &a->ip4;

		if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, iph, sizeof(*iph)))
			return -2;
		a->family = 4;
		a->hlen = iph->ihl * 4;
		a->tot_len = bpf_ntohs(iph->tot_len);
		if (iph->version != 4 || a->hlen < INBAND_IPV4_MIN_HDR || a->tot_len < a->hlen ||
		    INBAND_ETH_HLEN + a->tot_len > skb->len)
			return -2;
		a->opt_len = a->hlen - INBAND_IPV4_MIN_HDR;
		a->saddr = inband_addr4(iph->saddr);
		a->daddr = inband_addr4(iph->daddr);
		a->proto = iph->protocol;
		a->tos = iph->tos;
		a->frag = !!(iph->frag_off & bpf_htons(INBAND_IP_MF | INBAND_IP_OFFSET));
	} else if (h_proto == bpf_htons(INBAND_ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		__u8 doh[2];

		if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, &ip6, sizeof(ip6)))
			return -2;
		a->family = 6;
		a->tot_len = INBAND_IPV6_HDR + bpf_ntohs(ip6.payload_len);
		if (ip6.version != 6 || INBAND_ETH_HLEN + a->tot_len > skb->len)
			return -2;
		__builtin_memcpy(&a->saddr, &ip6.saddr, 16);
		__builtin_memcpy(&a->daddr, &ip6.daddr, 16);
		/* IPv4-mapped addresses never travel in an IPv6 header (RFC
		 * 4291 2.5.5.2); the maps hold IPv4 peers that way, so such a
		 * packet would pass for IPv4 from a balancer's address. */
		if (inband_addr_is4(&a->saddr) || inband_addr_is4(&a->daddr))
			return -2;
		a->hlen = INBAND_IPV6_HDR;
		a->label = bpf_ntohl(*(__be32 *)&ip6) & INBAND_FLOW_LABEL_MASK;
		a->proto = ip6.nexthdr;
		if (ip6.nexthdr == INBAND_IPPROTO_DSTOPTS) {
			if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV6_HDR, doh, sizeof(doh)))
				return -2;
			a->opt_len = ((__u32)doh[1] + 1) * 8;
			a->hlen += a->opt_len;
			a->proto = doh[0];
			if (a->hlen > a->tot_len)
				return -2;
		}
		a->ext_unwalked = ipv6_is_ext(a->proto);
		if (a->proto != IPPROTO_TCP && a->proto != INBAND_IPPROTO_UDP)
			a->proto = 0;
	} else {
		return -1;
	}
	if (!a->frag && (a->proto == IPPROTO_TCP || a->proto == INBAND_IPPROTO_UDP) && a->hlen + 4 <= a->tot_len &&
	    bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen, a->ports, sizeof(a->ports)))
		return -2;
	return 0;
}

#endif /* INBAND_AGENT_PACKET_H */

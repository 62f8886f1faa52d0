// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The router's shadow SIDs for IPv4 VIPs (scale-out behind ECMP; "Several
 * balancers behind ECMP" in docs/architecture.md): tc ingress on the
 * router's link to each next hop, attached by `inband shadow route`.
 *
 * An instance sends a stray of an IPv4 VIP back to the router as IPv4 in
 * IPv6, to the shadow SID of the generation that had it. For IPv6 VIPs the
 * kernel's End.DT6 unwraps such a packet and looks the inner one up in
 * the generation's table. End.DT4 would do the same for IPv4, but Linux
 * builds it only into a VRF device, which this kernel lacks (the choice
 * and its evidence: docs/decisions.md). So this program unwraps it before
 * routing and marks it with the generation's mark; a `fwmark` rule sends
 * it to that generation's table, where the kernel's multipath lookup picks
 * the next hop the older set picked, with the hash the main table uses.
 *
 * Taken: IPv6 to a SID in dt4_sids, with IPv4 next (directly, or after
 * one SRH with no segment left), not a fragment. Anything else goes on
 * untouched (TC_ACT_UNSPEC): IPv6 inside is End.DT6's, and the kernel
 * has no route of ours for the rest.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/shadow/dt4_maps.h"
#include "inband/shadow/types.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define IPV6_SRCRT_TYPE_SRH 4
/* In the kernel since 6.3 (this one's BTF: 128), not in Debian 12's uapi header. */
#ifndef BPF_F_ADJ_ROOM_DECAP_L3_IPV4
#define BPF_F_ADJ_ROOM_DECAP_L3_IPV4 (1ULL << 7)
#endif

static __always_inline int count(struct __sk_buff *skb, __u32 counter, int verdict)
{
	struct inband_shadow_count *c = bpf_map_lookup_elem(&dt4_stats, &counter);

	if (c) {
		c->packets++;
		c->bytes += skb->len;
	}
	return verdict;
}

SEC("tc")
int shadow_dt4(struct __sk_buff *skb)
{
	struct inband_shadow_dt4 *sid;
	struct ipv6hdr out;
	__u8 rh[4]; /* next header, length, routing type, segments left */
	__u8 version;
	__u32 off = sizeof(out);
	__be16 ip = bpf_htons(ETH_P_IP);
	__u8 nh;

	/* Everything else on the link costs one load and one lookup, uncounted. */
	if (skb->protocol != bpf_htons(ETH_P_IPV6) || bpf_skb_load_bytes(skb, ETH_HLEN, &out, sizeof(out)) < 0)
		return TC_ACT_UNSPEC;
	sid = bpf_map_lookup_elem(&dt4_sids, &out.daddr);
	if (!sid)
		return TC_ACT_UNSPEC;
	nh = out.nexthdr;
	if (nh == IPPROTO_ROUTING) {
		if (bpf_skb_load_bytes(skb, ETH_HLEN + off, rh, sizeof(rh)) < 0 || rh[2] != IPV6_SRCRT_TYPE_SRH || rh[3])
			return count(skb, INBAND_SHADOW_DT4_NOT_TAKEN, TC_ACT_UNSPEC);
		nh = rh[0];
		off += ((__u32)rh[1] + 1) * 8;
	}
	if (nh != IPPROTO_IPIP || bpf_skb_load_bytes(skb, ETH_HLEN + off, &version, 1) < 0 || version >> 4 != 4)
		return count(skb, INBAND_SHADOW_DT4_NOT_TAKEN, TC_ACT_UNSPEC);
	/* The inner header's sizes stay what they were: FIXED_GSO. The
	 * kernel's IPv4 receive path checks the rest of the header. */
	if (bpf_skb_adjust_room(skb, -(__s32)off, BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_FIXED_GSO | BPF_F_ADJ_ROOM_DECAP_L3_IPV4) ||
	    bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_proto), &ip, sizeof(ip), 0))
		return count(skb, INBAND_SHADOW_DT4_FAILED, TC_ACT_SHOT);
	skb->mark = sid->mark;
	return count(skb, INBAND_SHADOW_DT4_UNWRAPPED, TC_ACT_OK);
}

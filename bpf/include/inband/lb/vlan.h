/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * VLAN-tagged frames, which the walk hands here before it parses anything.
 * Apart from the walk because the walk takes untagged frames only: this
 * looks past at most two tags, just far enough to refuse what is addressed
 * to a VIP or to the balancer, and has a frame of its own (not inlined).
 */
#ifndef INBAND_LB_VLAN_H
#define INBAND_LB_VLAN_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/lb/common.h"

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

#endif /* INBAND_LB_VLAN_H */

// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * The per-packet floors for benchmarks.
 *
 * `bounce`: parse nothing but Ethernet, swap the MACs and send the frame
 * back out. Whatever the balancer costs on top of this is the balancer's
 * own work.
 *
 * `bounce_lookup`: also read the IPv4 and TCP headers and find the
 * packet's flow in a table of the balancer's own type, key and value
 * (an LRU hash of `struct inband_flow_key` to `struct inband_flow`, the
 * size of its default flow table): what any forwarder that keeps per-flow
 * state must do for an established packet. Without the flow: XDP_DROP,
 * so a benchmark can tell the lookup missed.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/addr.h"
#include "inband/lb/consts.h"
#include "inband/lb/types.h"

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, INBAND_FLOW_TABLE_SIZE);
	__type(key, struct inband_flow_key);
	__type(value, struct inband_flow);
} lookup_flows SEC(".maps");

static __always_inline void swap_macs(struct ethhdr *eth)
{
	__u8 mac[ETH_ALEN];

	__builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, mac, ETH_ALEN);
}

SEC("xdp")
int bounce(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return XDP_DROP;
	swap_macs(eth);
	return XDP_TX;
}

SEC("xdp")
int bounce_lookup(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct inband_flow_key k = {};

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 || ip->protocol != IPPROTO_TCP)
		return XDP_DROP;
	struct tcphdr *tcp = (void *)(ip + 1);

	if ((void *)(tcp + 1) > data_end)
		return XDP_DROP;
	/* An IPv4 address in `struct inband_addr`: ::ffff:a.b.c.d (addr.h). */
	k.client_addr.w[2] = INBAND_V4_MAPPED_WORD;
	k.client_addr.w[3] = ip->saddr;
	k.vip_addr.w[2] = INBAND_V4_MAPPED_WORD;
	k.vip_addr.w[3] = ip->daddr;
	k.client_port = tcp->source;
	k.vip_port = tcp->dest;
	k.proto = IPPROTO_TCP;
	if (!bpf_map_lookup_elem(&lookup_flows, &k))
		return XDP_DROP;
	swap_macs(eth);
	return XDP_TX;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

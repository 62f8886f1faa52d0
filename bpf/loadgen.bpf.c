// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Load-generation helpers for the forwarding benchmark (`inband bench`).
 *
 * `tx` writes a pre-built frame (`tx_frame`) over the packet and returns
 * `tx_verdict`: XDP_TX, or XDP_DROP to time the generator alone. Run
 * through BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES it transmits
 * the frame out of an interface many times a second with no socket or
 * stack in the way. The copy is needed because live frames reuse their
 * pages without resetting the data, and a forwarder that rewrites the
 * packet in place (nftables' NAT does) would otherwise see its own
 * rewrite come back.
 *
 * With `tx_spoof` set, each copy gets a random source address (inside
 * tx_spoof_net/tx_spoof_mask), source port and sequence number, checksums
 * fixed: a SYN flood from random sources, at the rate of the loop above.
 *
 * `sink` counts IPv4 TCP packets to one port at a receiver and drops them
 * (raw load, so the receiver's stack is never the bottleneck) or passes
 * them on (a real server behind). Everything else passes, so ARP and ping
 * keep working on the receiver.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "inband/csum.h"

#define TX_MAX_WORDS 32

const volatile __u64 tx_frame[TX_MAX_WORDS] = {};
const volatile __u32 tx_words = 0; /* frame length / 8 (frames are padded to it) */
const volatile __u32 tx_verdict = XDP_TX;
const volatile __u16 sink_port = 0; /* host order */
const volatile __u8 sink_drop = 0;
const volatile __u8 tx_spoof = 0;
const volatile __be32 tx_spoof_net = 0;
const volatile __be32 tx_spoof_mask = 0; /* bits of the source address that vary */

struct sink_count {
	__u64 packets;
	__u64 bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sink_count);
} sink_counts SEC(".maps");

SEC("xdp")
int sink(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct tcphdr *tcp;
	struct sink_count *c;
	__u32 zero = 0;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->protocol != IPPROTO_TCP)
		return XDP_PASS;
	/* IHL can carry inband's options (a score request on every n-th packet). */
	tcp = (void *)ip + ip->ihl * 4;
	if (ip->ihl < 5 || (void *)(tcp + 1) > data_end || tcp->dest != bpf_htons(sink_port))
		return XDP_PASS;
	c = bpf_map_lookup_elem(&sink_counts, &zero);
	if (c) {
		c->packets++;
		c->bytes += data_end - data;
	}
	return sink_drop ? XDP_DROP : XDP_PASS;
}

SEC("xdp")
int tx(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 *w = data;

	for (int i = 0; i < TX_MAX_WORDS; i++) {
		if (i >= tx_words)
			break;
		if ((void *)(w + i + 1) > data_end)
			return XDP_ABORTED;
		w[i] = tx_frame[i];
	}
	if (tx_spoof) {
		struct iphdr *ip = data + sizeof(struct ethhdr);
		struct tcphdr *tcp = (void *)(ip + 1);

		if ((void *)(tcp + 1) > data_end)
			return XDP_ABORTED;
		__be32 saddr = tx_spoof_net | (bpf_get_prandom_u32() & tx_spoof_mask);
		__u32 r = bpf_get_prandom_u32();
		__be16 sport = (__be16)(r | 0x0400); /* no port below 1024 */
		__be32 seq = bpf_get_prandom_u32();
		__u32 acc = csum_start(ip->check);

		acc = csum_replace32(acc, ip->saddr, saddr);
		ip->check = csum_finish(acc);
		acc = csum_start(tcp->check);
		acc = csum_replace32(acc, ip->saddr, saddr);
		acc = csum_replace16(acc, tcp->source, sport);
		acc = csum_replace32(acc, tcp->seq, seq);
		tcp->check = csum_finish(acc);
		ip->saddr = saddr;
		tcp->source = sport;
		tcp->seq = seq;
	}
	return tx_verdict;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

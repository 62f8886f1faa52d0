/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Refusing a client's TCP packet with a RST from the VIP, in place: the
 * packet at ctx becomes the RST and goes back out the way it came
 * (XDP_TX). Used where a demanding operator wants a client told at once
 * rather than left to retransmit into silence: a SYN no backend can take
 * on a VIP that refuses (`all_down = "refuse"`), and a packet of a flow
 * whose backend its health checks took down (`on_down = "reset"`).
 *
 * The answer is what a TCP stack sends for a segment that reaches no
 * connection (RFC 9293 3.10.7.1): to a segment with ACK, seq = its
 * acknowledgement and RST alone; to one without (a SYN), seq 0 and
 * RST+ACK acknowledging everything it occupied. No options, no payload.
 * The caller has dropped packets with IP options or extension headers:
 * the IP header is 20 or 40 bytes.
 */
#ifndef INBAND_LB_RESET_H
#define INBAND_LB_RESET_H

#include "inband/csum.h"
#include "inband/lb/common.h"
#include "inband/lb/parse.h"

#define RST_HOP_LIMIT 64

/* The TCP checksum of a 20-byte header without payload, from scratch. */
static __always_inline __u16 rst_tcp_csum(const struct tcphdr *tcp, const struct inband_addr *saddr,
					  const struct inband_addr *daddr)
{
	return (__u16)~csum_fold(csum_words(tcp, 10) + csum_pseudo(saddr, daddr, IPPROTO_TCP, sizeof(struct tcphdr)));
}

/* Turns the client's TCP packet described by `p` into the RST that answers
 * it; XDP_TX, or a drop verdict when the frame cannot be rewritten. A
 * function of its own: its frame stays off the new-connection path's
 * stack, which is at the limit already. */
__noinline int reply_rst(struct xdp_md *ctx, const struct pkt *p)
{
	if (!p)
		return XDP_DROP;
	__u32 l3 = p->family == 4 ? INBAND_IPV4_MIN_HDR : INBAND_IPV6_HDR;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct tcphdr *tcp = data + ETH_HLEN + l3;

	if ((void *)(tcp + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__u32 seg_len = p->tot_len - p->hlen - tcp->doff * 4;
	__u32 seq = bpf_ntohl(tcp->seq);
	__be32 ack_seq = tcp->ack_seq;
	int had_ack = tcp->ack;

	seg_len += tcp->syn + tcp->fin; /* each takes a sequence number */
	int shrink = (int)(ETH_HLEN + l3 + sizeof(struct tcphdr)) - (int)(data_end - data);

	if (shrink && bpf_xdp_adjust_tail(ctx, shrink))
		return drop(INBAND_DROP_ADJUST_FAILED);
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;

	tcp = data + ETH_HLEN + l3;
	if ((void *)(tcp + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__u32 mac_hi = *(__u32 *)eth->h_dest;
	__u16 mac_lo = *(__u16 *)(eth->h_dest + 4);

	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	*(__u32 *)eth->h_source = mac_hi;
	*(__u16 *)(eth->h_source + 4) = mac_lo;

	/* From the VIP (the packet's destination) to the client. */
	if (p->family == 4) {
		struct iphdr *ip = data + ETH_HLEN;

		ip->daddr = p->saddr.w[3];
		ip->saddr = p->daddr.w[3];
		ip->tot_len = bpf_htons(INBAND_IPV4_MIN_HDR + sizeof(struct tcphdr));
		ip->ttl = RST_HOP_LIMIT;
		ip->id = 0;
		ip->frag_off = bpf_htons(0x4000); /* DF */
		ip->tos = 0;
		ip->check = 0;
		ip->check = (__u16)~csum_fold(csum_words(ip, 10));
	} else {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		__builtin_memcpy(&ip6->daddr, &p->saddr, 16);
		__builtin_memcpy(&ip6->saddr, &p->daddr, 16);
		ip6->payload_len = bpf_htons(sizeof(struct tcphdr));
		ip6->hop_limit = RST_HOP_LIMIT;
	}

	__be16 port = tcp->source;

	tcp->source = tcp->dest;
	tcp->dest = port;
	/* No options: a data offset of 5 words; flags from nothing. */
	((__u8 *)tcp)[12] = 5 << 4;
	((__u8 *)tcp)[13] = 0;
	tcp->rst = 1;
	if (had_ack) {
		tcp->seq = ack_seq;
		tcp->ack_seq = 0;
	} else {
		tcp->seq = 0;
		tcp->ack_seq = bpf_htonl(seq + seg_len);
		tcp->ack = 1;
	}
	tcp->window = 0;
	tcp->urg_ptr = 0;
	tcp->check = 0;
	tcp->check = rst_tcp_csum(tcp, &p->daddr, &p->saddr);
	return XDP_TX;
}

#endif /* INBAND_LB_RESET_H */

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Option edits of the real-server agent: removing the balancer's option on
 * ingress, inserting a 125 on egress (right after the fixed IPv4 header, or
 * in a Destination Options header after the IPv6 one), finding a TCP
 * option, and clamping the MSS a SYN-ACK announces.
 */
#ifndef INBAND_AGENT_OPTIONS_H
#define INBAND_AGENT_OPTIONS_H

#include <linux/bpf.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent/packet.h"
#include "inband/agent/skb.h"
#include "inband/csum.h"
#include "inband/wire.h"

/* The largest inband option, in 32-bit words: room for the largest
 * IPv6 Destination Options header (which holds the largest option). */
#define OPT_MAX_WORDS (INBAND_DOH_LEN(INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN) / 4)
/* The largest IPv4 option (a UDP 155), in words. */
#define OPT4_MAX_WORDS (INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN / 4)

/*
 * Removes the option (`opt_len` bytes, a multiple of 4, copied in `opt`)
 * that starts right after the fixed header. The header checksum is updated
 * incrementally, so a header that arrived corrupt stays corrupt for the
 * stack to discard.
 */
static __always_inline int strip_option(struct __sk_buff *skb, const struct iphdr *iph,
					 const __u32 *opt, __u32 opt_len)
{
	struct iphdr new_hdr = *iph;
	__u32 acc = csum_start(iph->check);

	new_hdr.ihl -= opt_len / 4;
	new_hdr.tot_len = bpf_htons(bpf_ntohs(iph->tot_len) - opt_len);
	acc = csum_replace32(acc, ipv4_word0(iph), ipv4_word0(&new_hdr));
#pragma unroll
	for (int i = 0; i < OPT4_MAX_WORDS; i++)
		if (i * 4 < opt_len)
			acc = csum_replace32(acc, opt[i], 0);
	if (bpf_skb_adjust_room(skb, -(__s32)opt_len, BPF_ADJ_ROOM_NET, 0)) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return TC_ACT_OK;
	}
	ipv4_store_header(skb, &new_hdr, csum_finish(acc));
	return TC_ACT_OK;
}

/*
 * Inserts the option `opt` (`opt_len` bytes: 4 or 16) right after the fixed
 * header. Returns 0 on success.
 */
static __always_inline int insert_option(struct __sk_buff *skb, const struct iphdr *iph, const __u32 *opt,
					 __u32 opt_len)
{
	struct iphdr new_hdr = *iph;
	__u32 acc = csum_start(iph->check);

	new_hdr.ihl += opt_len / 4;
	new_hdr.tot_len = bpf_htons(bpf_ntohs(iph->tot_len) + opt_len);
	acc = csum_replace32(acc, ipv4_word0(iph), ipv4_word0(&new_hdr));
#pragma unroll
	for (int i = 0; i < INBAND_OPT_AUTH_SCORE_LEN / 4; i++)
		if (i * 4 < opt_len)
			acc = csum_replace32(acc, 0, opt[i]);
	if (bpf_skb_adjust_room(skb, opt_len, BPF_ADJ_ROOM_NET, 0))
		return -1;
	/* Two constant sizes: the verifier bounds the store by them. */
	if (opt_len == INBAND_OPT_AUTH_SCORE_LEN)
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV4_MIN_HDR, opt, INBAND_OPT_AUTH_SCORE_LEN,
				    BPF_F_RECOMPUTE_CSUM);
	else
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV4_MIN_HDR, opt, INBAND_OPT_SCORE_LEN,
				    BPF_F_RECOMPUTE_CSUM);
	ipv4_store_header(skb, &new_hdr, csum_finish(acc));
	return 0;
}

/*
 * Removes the Destination Options header (`doh_len` bytes; its next header
 * `next`) after the fixed IPv6 header: the IPv6 header then names `next`
 * and carries that much less payload.
 */
static __always_inline int strip_doh(struct __sk_buff *skb, __u32 doh_len, __u8 next, __u32 tot_len)
{
	__be16 payload = bpf_htons(tot_len - INBAND_IPV6_HDR - doh_len);

	if (bpf_skb_adjust_room(skb, -(__s32)doh_len, BPF_ADJ_ROOM_NET, 0)) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return TC_ACT_OK;
	}
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct ipv6hdr, payload_len), &payload, sizeof(payload),
			    BPF_F_RECOMPUTE_CSUM);
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct ipv6hdr, nexthdr), &next, 1, BPF_F_RECOMPUTE_CSUM);
	return TC_ACT_OK;
}

/*
 * Inserts the Destination Options header `doh` (`doh_len` bytes: 8 or 24,
 * its next header already the packet's transport) after the fixed IPv6
 * header. Returns 0 on success.
 */
static __always_inline int insert_doh(struct __sk_buff *skb, const __u32 *doh, __u32 doh_len, __u32 tot_len)
{
	__be16 payload = bpf_htons(tot_len - INBAND_IPV6_HDR + doh_len);
	__u8 next = INBAND_IPPROTO_DSTOPTS;

	if (bpf_skb_adjust_room(skb, doh_len, BPF_ADJ_ROOM_NET, 0))
		return -1;
	/* Two constant sizes: the verifier bounds the store by them. */
	if (doh_len == INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN))
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV6_HDR, doh,
				    INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN), 0);
	else
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV6_HDR, doh, INBAND_DOH_LEN(INBAND_OPT_SCORE_LEN),
				    0);
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct ipv6hdr, payload_len), &payload, sizeof(payload), 0);
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct ipv6hdr, nexthdr), &next, 1, 0);
	return 0;
}

/* State of a TCP options walk looking for one option; bpf_loop hands it
 * to each step. */
struct tcpopt_walk {
	/* 40 option bytes + slack: the verifier bounds i but cannot relate it
	 * to opt_len, so reads up to i + 9 are bounded by the array. */
	__u8 opts[56];
	__u32 opt_len;
	__u32 i;
	__u8 kind; /* the option looked for, and its length */
	__u8 len;
	int found; /* opts[i] is that option */
};

static long tcpopt_walk_step(__u64 n, void *ctx)
{
	struct tcpopt_walk *w = ctx;
	__u32 i = w->i;
	__u8 kind, len;

	if (i >= w->opt_len || i >= 40)
		return 1;
	kind = w->opts[i];
	if (kind == INBAND_TCPOPT_EOL)
		return 1;
	if (kind == INBAND_TCPOPT_NOP) {
		w->i = i + 1;
		return 0;
	}
	if (i + 1 >= w->opt_len)
		return 1;
	len = w->opts[i + 1];
	if (len < 2 || i + len > w->opt_len)
		return 1;
	if (kind == w->kind && len == w->len) {
		w->found = 1;
		return 1;
	}
	w->i = i + len;
	return 0;
}

/*
 * Finds option `kind` of length `len` among the options of the TCP header
 * at `l4_off` (`tcp_hlen` bytes long). Returns its offset from the start
 * of the options (below 40, its bytes in w->opts), or -1. The walk runs
 * under bpf_loop: as a plain loop its data-dependent index gives the
 * verifier a state per option layout and takes seconds to load.
 */
static __always_inline int tcpopt_find(struct __sk_buff *skb, __u32 l4_off, __u32 tcp_hlen, struct tcpopt_walk *w,
				       __u8 kind, __u8 len)
{
	__u32 opt_len;

	if (tcp_hlen <= sizeof(struct tcphdr))
		return -1;
	opt_len = tcp_hlen - sizeof(struct tcphdr);
	/* Keeps clang from merging the two range checks into one the
	 * verifier cannot use to bound the load size. */
	barrier_var(opt_len);
	if (opt_len > 40)
		return -1;
	if (bpf_skb_load_bytes(skb, l4_off + sizeof(struct tcphdr), w->opts, opt_len))
		return -1;
	w->opt_len = opt_len;
	w->kind = kind;
	w->len = len;
	/* Every step consumes at least one of at most 40 bytes. */
	bpf_loop(40, tcpopt_walk_step, w, 0);
	if (!w->found || w->i >= 40)
		return -1;
	return w->i;
}

/*
 * Lowers the MSS a SYN-ACK announces by `by` (the largest option the
 * balancer adds to a data packet of its family) so that the client's
 * full-sized segments still fit the path MTU once it is added.
 */
static __always_inline void clamp_mss(struct __sk_buff *skb, __u32 l4_off, __u32 tcp_hlen, __u16 by)
{
	struct tcpopt_walk w = {};
	int i = tcpopt_find(skb, l4_off, tcp_hlen, &w, INBAND_TCPOPT_MSS, INBAND_TCPOLEN_MSS);
	__u16 mss;
	__be16 old_be, new_be;

	if (i < 0 || i >= 40)
		return;
	mss = (__u16)w.opts[i + 2] << 8 | w.opts[i + 3];
	if (mss <= by)
		return;
	old_be = bpf_htons(mss);
	new_be = bpf_htons(mss - by);
	bpf_skb_store_bytes(skb, l4_off + sizeof(struct tcphdr) + i + 2, &new_be, sizeof(new_be), 0);
	bpf_l4_csum_replace(skb, l4_off + offsetof(struct tcphdr, check), old_be, new_be,
			    sizeof(new_be));
	count(INBAND_AGENT_MSS_CLAMPED);
}

#endif /* INBAND_AGENT_OPTIONS_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * IPv4 and TCP options on the balancer: finding inband options on arrival,
 * adding 155/124 toward a backend, stripping 125 on the way back, and
 * clamping the MSS a handshake announces.
 */
#ifndef INBAND_LB_OPTIONS_H
#define INBAND_LB_OPTIONS_H

#include "inband/csum.h"
#include "inband/lb/common.h"

/* What a walk over a packet's IPv4 options found. */
#define OPT_MALFORMED 0x1 /* length 0/1, or an option overrunning the header */
#define OPT_TUPLE_OR_REQUEST 0x2 /* 155 or 124 somewhere */
#define OPT_SCORE 0x4 /* 125 somewhere */
#define OPT_SCORE_STRIPPABLE 0x8 /* exactly one 125, first, of a known length: as an agent adds it */

/*
 * Option walks run over a stack copy with bpf_loop: the callback is verified
 * once, where an open-coded loop over packet offsets multiplies verifier
 * states by every option layout and does not load. Both walks are off the
 * fast path (packets with IP options; SYNs and SYN-ACKs).
 */
struct opt_walk {
	__u8 buf[TCP_MAX_OPT_LEN]; /* IP and TCP options are both at most 40 bytes */
	__u32 len;
	__u32 off;
	__u32 found; /* OPT_* for IP options; offset of the MSS option + 1 for TCP */
	__u32 scores_seen;
	__u32 score_len; /* length of the first option when it is a strippable 125 */
};

/* One option per call, a NOP being the shortest: len calls always suffice. */
static long ip_option_step(__u32 index, void *arg)
{
	struct opt_walk *w = arg;
	__u32 off = w->off;

	if (off >= w->len || off >= sizeof(w->buf))
		return 1;
	__u8 kind = w->buf[off];

	if (kind == IPOPT_END)
		return 1;
	if (kind == IPOPT_NOOP) {
		w->off = off + 1;
		return 0;
	}
	if (off + 2 > w->len || off + 1 >= sizeof(w->buf)) {
		w->found |= OPT_MALFORMED;
		return 1;
	}
	__u8 len = w->buf[off + 1];

	if (len < 2 || off + len > w->len) {
		w->found |= OPT_MALFORMED;
		return 1;
	}
	if (kind == INBAND_OPT_CLIENT_TUPLE || kind == INBAND_OPT_SCORE_REQUEST) {
		w->found |= OPT_TUPLE_OR_REQUEST;
	} else if (kind == INBAND_OPT_SCORE) {
		w->found |= OPT_SCORE;
		w->scores_seen++;
		if (off == 0 && (len == INBAND_OPT_SCORE_LEN || len == INBAND_OPT_AUTH_SCORE_LEN)) {
			w->found |= OPT_SCORE_STRIPPABLE;
			w->score_len = len;
		}
	}
	w->off = off + len;
	return 0;
}

/* Walks the options of the IPv4 header (hlen > 20 bytes, inside the packet)
 * into `w`; a strippable 125 is then w->buf[0 .. w->score_len). */
static __always_inline __u32 scan_ip_options(struct xdp_md *ctx, __u32 hlen, struct opt_walk *w)
{
	__u32 len = hlen - INBAND_IPV4_MIN_HDR;

	if (len == 0 || len > IP_MAX_OPT_LEN)
		return OPT_MALFORMED;
	if (bpf_xdp_load_bytes(ctx, ETH_HLEN + INBAND_IPV4_MIN_HDR, w->buf, len))
		return OPT_MALFORMED;
	w->len = len;
	bpf_loop(IP_MAX_OPT_LEN, ip_option_step, w, 0);
	if (w->scores_seen != 1)
		w->found &= ~OPT_SCORE_STRIPPABLE;
	return w->found;
}

static long tcp_option_step(__u32 index, void *arg)
{
	struct opt_walk *w = arg;
	__u32 off = w->off;

	if (off >= w->len || off >= sizeof(w->buf))
		return 1;
	__u8 kind = w->buf[off];

	if (kind == TCPOPT_EOL)
		return 1;
	if (kind == TCPOPT_NOP) {
		w->off = off + 1;
		return 0;
	}
	if (off + 2 > w->len || off + 1 >= sizeof(w->buf))
		return 1;
	__u8 len = w->buf[off + 1];

	if (len < 2 || off + len > w->len)
		return 1;
	if (kind == TCPOPT_MSS && len == 4) {
		w->found = off + 1;
		return 1;
	}
	w->off = off + len;
	return 0;
}

/*
 * Lowers the MSS option of a SYN or SYN-ACK by `by` (the largest option a
 * data packet of its family gets: INBAND_OPT_DATA_MAX_LEN for IPv4,
 * INBAND_OPT6_DATA_MAX_LEN for IPv6), so that full-sized segments still fit
 * the MTU once an option rides on them, and feeds the change into the TCP
 * checksum accumulator. The TCP header starts `l4_off` bytes into the
 * frame; its `optlen` bytes of options are inside the packet. Global
 * (verified once, with a frame of its own): SYNs and SYN-ACKs only.
 */
__noinline __u32 clamp_mss(struct xdp_md *ctx, __u32 l4_off, __u32 optlen, __u32 acc, __u16 by)
{
	struct opt_walk w = {};

	if (optlen == 0 || optlen > TCP_MAX_OPT_LEN || l4_off > ETH_HLEN + INBAND_IPV4_MAX_HDR)
		return acc;
	if (bpf_xdp_load_bytes(ctx, l4_off + TCP_MIN_HDR, w.buf, optlen))
		return acc;
	w.len = optlen;
	bpf_loop(TCP_MAX_OPT_LEN, tcp_option_step, &w, 0);
	if (!w.found)
		return acc;
	/* found - 1 + 4 <= optlen <= 40: the mask only tells the verifier so. */
	__u32 off = (w.found - 1) & 0x3f;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u8 *field = data + (l4_off & 0x7f) + TCP_MIN_HDR + off + 2;

	if ((void *)(field + 2) > data_end)
		return acc;
	__u16 old = load16(field);
	__u16 mss = bpf_ntohs(old);

	if (mss <= by)
		return acc;
	__u16 new = bpf_htons(mss - by);

	__builtin_memcpy(field, &new, sizeof(new));
	/* The options start at an even offset (20) of the TCP header, so the
	 * field's parity in the checksummed data is off's. */
	if (off & 1)
		return csum_replace16(acc, csum_swab16(old), csum_swab16(new));
	return csum_replace16(acc, old, new);
}

/*
 * Moves the Ethernet and IPv4 fixed header (already rewritten in place)
 * `optlen` bytes toward the front, writes the option `opt` into the gap and
 * finishes the IPv4 header around it. `optlen` is a constant at every call.
 */
static __always_inline int emit_with_option(struct xdp_md *ctx, const int optlen, const __u8 *opt, __u32 tot_len)
{
	int bad = open_gap(ctx, ETH_IP_HLEN, optlen);

	if (bad)
		return bad;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + ETH_IP_HLEN + optlen > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	struct iphdr *iph = data + ETH_HLEN;

	__builtin_memcpy(data + ETH_IP_HLEN, opt, optlen);
	iph->ihl = (INBAND_IPV4_MIN_HDR + optlen) / 4;
	iph->tot_len = bpf_htons(tot_len + optlen);
	iph->check = 0;
	iph->check = csum_finish(csum_words(iph, (INBAND_IPV4_MIN_HDR + optlen) / 2));
	return XDP_TX;
}

/*
 * Removes the `optlen`-byte option right after the fixed IPv4 header of a
 * packet whose headers are already rewritten (the IPv4 header's length,
 * total length and checksum already describe the packet without it): the
 * Ethernet and fixed IPv4 header move back over it.
 */
static __always_inline int strip_first_option(struct xdp_md *ctx, const int optlen)
{
	int bad = close_gap(ctx, ETH_IP_HLEN, optlen);

	return bad ? bad : XDP_TX;
}

#endif /* INBAND_LB_OPTIONS_H */

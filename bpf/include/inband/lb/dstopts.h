/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The IPv6 carrier of the inband options (wire.h): a Destination Options
 * header right after the fixed header, holding one option of type 0x1E
 * whose data is the inband option, then padding. Adding it toward a
 * backend, reading it on a backend's packet, and taking it off.
 *
 * The transport checksum does not cover extension headers (its
 * pseudo-header's length is the transport's), so adding or removing the
 * header changes only the IPv6 payload length and next header.
 */
#ifndef INBAND_LB_DSTOPTS_H
#define INBAND_LB_DSTOPTS_H

#include "inband/lb/options.h"

/* The largest Destination Options header the balancer adds (an
 * authenticated IPv6 155) or reads (an authenticated 125). */
#define DOH_MAX INBAND_DOH_LEN(INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN)

/*
 * Moves the Ethernet and IPv6 fixed header (already rewritten in place)
 * `doh_len` bytes toward the front and writes the header `doh` (its next
 * header already the packet's transport) into the gap. `doh_len` is a
 * constant at every call.
 */
static __always_inline int emit_with_doh(struct xdp_md *ctx, const int doh_len, const __u8 *doh)
{
	int bad = open_gap(ctx, ETH_IP6_HLEN, doh_len);

	if (bad)
		return bad;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + ETH_IP6_HLEN + doh_len > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	struct ipv6hdr *ip6 = data + ETH_HLEN;

	__builtin_memcpy(data + ETH_IP6_HLEN, doh, doh_len);
	ip6->nexthdr = IP6_DSTOPTS;
	ip6->payload_len = bpf_htons(bpf_ntohs(ip6->payload_len) + doh_len);
	return XDP_TX;
}

/*
 * Reads the Destination Options header of `doh_len` bytes that follows
 * the fixed header: OPT_TUPLE_OR_REQUEST or OPT_SCORE(_STRIPPABLE) if it
 * is exactly one inband option and padding, as an agent or a balancer
 * writes it (the option then in w->buf[0 .. w->score_len) for a 125);
 * OPT_MALFORMED if it claims to be one and is not; 0 if it holds no inband
 * option (someone else's header).
 */
static __always_inline __u32 read_doh(struct xdp_md *ctx, __u32 doh_len, struct opt_walk *w)
{
	__u8 *h = w->buf;

	_Static_assert(sizeof(w->buf) >= DOH_MAX, "a whole header fits the walk's buffer");
	if (doh_len < 8 || doh_len > DOH_MAX)
		return 0;
	if (bpf_xdp_load_bytes(ctx, ETH_IP6_HLEN, h, doh_len))
		return OPT_MALFORMED;
	if (h[2] != INBAND_OPT6_TYPE)
		return 0;
	__u32 optlen = h[3];

	/* The option's own length byte agrees with the carrier's, and the
	 * header is exactly that option padded to 8 bytes. */
	if (optlen < 2 || optlen > TCP_MAX_OPT_LEN || h[5] != optlen || INBAND_DOH_LEN(optlen) != doh_len)
		return OPT_MALFORMED;
	__u32 pad = doh_len - INBAND_DOH_PREFIX - optlen;
	__u32 at = INBAND_DOH_PREFIX + optlen;

	if (pad == 1 && (at >= DOH_MAX || h[at] != 0))
		return OPT_MALFORMED;
	if (pad > 1 && (at + 1 >= DOH_MAX || h[at] != 1 || h[at + 1] != pad - 2))
		return OPT_MALFORMED;
	__u8 kind = h[INBAND_DOH_PREFIX];

	if (kind == INBAND_OPT_CLIENT_TUPLE || kind == INBAND_OPT_SCORE_REQUEST)
		return OPT_TUPLE_OR_REQUEST;
	if (kind != INBAND_OPT_SCORE)
		return OPT_MALFORMED;
	if (optlen != INBAND_OPT_SCORE_LEN && optlen != INBAND_OPT_AUTH_SCORE_LEN)
		return OPT_MALFORMED;
	/* The 125 to the front of the buffer, where IPv4's walk leaves it. */
#pragma unroll
	for (int i = 0; i < INBAND_OPT_AUTH_SCORE_LEN; i++)
		h[i] = h[INBAND_DOH_PREFIX + i];
	w->score_len = optlen;
	return OPT_SCORE | OPT_SCORE_STRIPPABLE;
}

/*
 * Takes off the `doh_len`-byte Destination Options header after the fixed
 * IPv6 header: the packet's next header becomes the one it named, the
 * payload shrinks, and the Ethernet and IPv6 header move back over it.
 * `doh_len` is a constant at every call.
 */
static __always_inline int strip_doh(struct xdp_md *ctx, const int doh_len)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + ETH_IP6_HLEN + doh_len > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	struct ipv6hdr *ip6 = data + ETH_HLEN;
	__u8 *doh = data + ETH_IP6_HLEN;

	ip6->nexthdr = doh[0];
	ip6->payload_len = bpf_htons(bpf_ntohs(ip6->payload_len) - doh_len);
	return close_gap(ctx, ETH_IP6_HLEN, doh_len);
}

#endif /* INBAND_LB_DSTOPTS_H */

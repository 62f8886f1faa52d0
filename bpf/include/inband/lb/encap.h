/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * IP-in-IP toward and from an encap backend (lb.toml `encap = "ipip"`,
 * inband/ipip.h): the walk wraps a finished packet that carries an option,
 * and unwraps a backend's packet that carries its 125. Apart from the walk
 * because it is a carrier for the options, not a step of balancing: only
 * forward() (once the option is on) and the walk's entry (an encap
 * backend's 125 comes wrapped) call it.
 */
#ifndef INBAND_LB_ENCAP_H
#define INBAND_LB_ENCAP_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>

#include "inband/ipip.h"
#include "inband/lb/common.h"

/*
 * Wraps the finished packet (Ethernet, then an IPv4 packet of `inner_len`
 * bytes) in an outer IPv4 header for an encap backend (ipip.h): the
 * Ethernet header moves to the new front, the outer header goes between.
 */
static __always_inline int encap_ipip(struct xdp_md *ctx, __u32 inner_len)
{
	int bad = open_gap(ctx, ETH_HLEN, INBAND_IPIP_HLEN);

	if (bad)
		return bad;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + ETH_HLEN + INBAND_IPIP_HLEN + INBAND_IPV4_MIN_HDR > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	inband_ipip_outer(data + ETH_HLEN, data + ETH_HLEN + INBAND_IPIP_HLEN, inner_len);
	event(INBAND_EV_ENCAPSULATED);
	return XDP_TX;
}

/*
 * An IPv4 packet to the balancer's address that is IP-in-IP as an encap
 * backend sends its 125 (ipip.h): unwrapped here, then walked as the
 * packet it carries (which must still be a backend's, with a valid MAC, to
 * count). 1 if it was unwrapped (the packet is to be parsed again), 0 if
 * it is not inband's to unwrap (left to the kernel), -1 if unwrapping
 * failed (counted; the packet is dropped).
 */
static __always_inline int decap_ipip(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *outer = data + ETH_HLEN;
	struct iphdr *inner = data + ETH_HLEN + INBAND_IPIP_HLEN;

	if ((void *)(inner + 1) > data_end || !inband_ipip_ours(outer, inner))
		return 0;
	if (close_gap(ctx, ETH_HLEN, INBAND_IPIP_HLEN))
		return -1;
	event(INBAND_EV_DECAPSULATED);
	return 1;
}

#endif /* INBAND_LB_ENCAP_H */

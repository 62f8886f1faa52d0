/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The carrier for paths that strip or drop IPv4 options (a backend's
 * `encap = "ipip"`): a packet that carries an inband option travels inside
 * an outer IPv4 header without options (IP-in-IP, RFC 2003, protocol 4)
 * with the same source and destination as the inner one, so a router that
 * clears options or drops optioned packets sees a plain one. Only packets
 * with an option are wrapped (a SYN with 155, a packet with 124 toward the
 * backend; one with 125 toward the balancer): the rest of a connection's
 * packets go unwrapped. Shared by the balancer (lb) and the agent, which
 * wrap and unwrap in the same way; docs/decisions.md says why IP-in-IP.
 */
#ifndef INBAND_IPIP_H
#define INBAND_IPIP_H

#include <linux/ip.h>
#include <bpf/bpf_endian.h>

#include "inband/csum.h"

#define INBAND_IPIP_HLEN 20
#define INBAND_IPPROTO_IPIP 4

/* The outer header for `inner` (its first 20 bytes; `inner_len` its total
 * length): DF like the balancer's own packets, TTL 64 (RFC 2003 3.1: a
 * value for reaching the tunnel's end, not the inner one's). */
static __always_inline void inband_ipip_outer(struct iphdr *outer, const struct iphdr *inner, __u32 inner_len)
{
	outer->version = 4;
	outer->ihl = 5;
	outer->tos = inner->tos;
	outer->tot_len = bpf_htons(inner_len + INBAND_IPIP_HLEN);
	outer->id = 0;
	outer->frag_off = bpf_htons(0x4000);
	outer->ttl = 64;
	outer->protocol = INBAND_IPPROTO_IPIP;
	outer->check = 0;
	outer->saddr = inner->saddr;
	outer->daddr = inner->daddr;
	outer->check = csum_finish(csum_words(outer, INBAND_IPIP_HLEN / 2));
}

/* Whether `outer` (a header without options, protocol 4, not a fragment)
 * wraps `inner` the way inband does: an IPv4 header with the same
 * addresses, whose length is the rest of the outer packet. Anything else
 * is someone else's tunnel and is left to the kernel. */
static __always_inline int inband_ipip_ours(const struct iphdr *outer, const struct iphdr *inner)
{
	return outer->ihl == 5 && outer->protocol == INBAND_IPPROTO_IPIP &&
	       !(outer->frag_off & bpf_htons(0x3fff)) && inner->version == 4 && inner->ihl >= 5 &&
	       inner->saddr == outer->saddr && inner->daddr == outer->daddr &&
	       bpf_ntohs(inner->tot_len) + INBAND_IPIP_HLEN == bpf_ntohs(outer->tot_len);
}

#endif /* INBAND_IPIP_H */

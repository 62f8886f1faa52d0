/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Address translation of a packet, either family: the transport header's
 * ports and checksum (whose pseudo-header holds the addresses), and the IP
 * header's addresses and TTL (hop limit), all updated incrementally.
 */
#ifndef INBAND_LB_REWRITE_H
#define INBAND_LB_REWRITE_H

#include "inband/csum.h"
#include "inband/lb/parse.h"

/* A changed address, into a checksum accumulator: one word for IPv4
 * (the mapped prefix is not in any IPv4 checksum), four for IPv6. */
static __always_inline __u32 csum_addr(__u32 acc, const struct inband_addr *from, const struct inband_addr *to)
{
	if (inband_addr_is4(from))
		return csum_replace32(acc, from->w[3], to->w[3]);
#pragma unroll
	for (int i = 0; i < 4; i++)
		acc = csum_replace32(acc, from->w[i], to->w[i]);
	return acc;
}

/* Where the transport checksum sits: TCP 16, UDP 6 bytes in. */
static __always_inline __u32 l4_check_off(__u8 proto)
{
	return proto == IPPROTO_TCP ? 16 : 6;
}

/*
 * The transport checksum accumulator after the packet `p` is rewritten to
 * `saddr:sport -> daddr:dport`, started from the checksum field `check`.
 */
static __always_inline __u32 l4_csum_nat(__u16 check, const struct pkt *p, const struct inband_addr *saddr,
					 __be16 sport, const struct inband_addr *daddr, __be16 dport)
{
	__u32 acc = csum_start(check);

	acc = csum_addr(acc, &p->saddr, saddr);
	acc = csum_addr(acc, &p->daddr, daddr);
	acc = csum_replace16(acc, p->sport, sport);
	return csum_replace16(acc, p->dport, dport);
}

/*
 * The value to store in a transport checksum field that held `old`. A UDP
 * datagram over IPv4 without a checksum (0) keeps none; a computed UDP
 * checksum of 0 goes as 0xffff, since 0 means "none" (RFC 768).
 */
static __always_inline __u16 l4_csum_store(__u8 proto, __u8 family, __u16 old, __u32 acc)
{
	__u16 c = csum_finish(acc);

	if (proto != IPPROTO_UDP)
		return c;
	if (family == 4 && old == 0)
		return 0;
	return c ? c : 0xffff;
}

/* The IPv4 header: new addresses, one hop older; the checksum follows. */
static __always_inline void ip4_nat(struct iphdr *iph, __be32 saddr, __be32 daddr)
{
	__u32 acc = csum_start(iph->check);

	acc = csum_replace32(acc, iph->saddr, saddr);
	acc = csum_replace32(acc, iph->daddr, daddr);
	acc = csum_replace16(acc, load16(&iph->ttl), load16(&iph->ttl) - bpf_htons(0x0100));
	iph->saddr = saddr;
	iph->daddr = daddr;
	iph->ttl--;
	iph->check = csum_finish(acc);
}

/* The IPv6 header: new addresses, one hop older (it has no checksum). */
static __always_inline void ip6_nat(struct ipv6hdr *ip6, const struct inband_addr *saddr,
				    const struct inband_addr *daddr)
{
	__builtin_memcpy(&ip6->saddr, saddr, 16);
	__builtin_memcpy(&ip6->daddr, daddr, 16);
	ip6->hop_limit--;
}

#endif /* INBAND_LB_REWRITE_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The packet as every path of the balancer needs it, whatever its family:
 * addresses (IPv4-mapped or IPv6), ports, transport, fragment state, and
 * for IPv6 the extension headers in front of the transport header.
 *
 * Malformed headers (an IPv4 header length below 20 or beyond the packet,
 * a total or payload length beyond the frame, an IPv6 extension header
 * that runs past the packet) are dropped as `malformed_ip` whatever their
 * destination, as the kernel would drop them: nothing here is passed on
 * that a receiver would not accept.
 */
#ifndef INBAND_LB_PARSE_H
#define INBAND_LB_PARSE_H

#include "inband/lb/common.h"

#define PKT_FRAG_FIRST 1 /* first fragment: ports present, the rest elsewhere */
#define PKT_FRAG_LATER 2 /* later fragment: no ports */

/* IPv6 extension headers walked before giving up on finding the transport
 * header; a chain longer than this is handed to the kernel. */
#define IP6_MAX_EXT 4

/* Passed to the walk's global functions (verified once each, not per call
 * site), and kept in a map: it holds no packet pointer. */
struct pkt {
	/* Client -> VIP: the client side of its connection. Backend ->
	 * balancer: that of the flow owning its port, once found. */
	struct inband_flow_key fk;
	struct inband_addr saddr;
	struct inband_addr daddr;
	__u64 len; /* frame length */
	__u64 now; /* coarse clock, read only on the paths that need it */
	__u32 hlen; /* IP header bytes: IPv4 IHL * 4, IPv6 40 + extension headers */
	__u32 tot_len; /* IP packet bytes by its header */
	__u32 doh_len; /* IPv6: length of the first extension header if it is Destination Options */
	__be32 seq; /* TCP sequence number (valid once the TCP header is checked) */
	__be32 ack; /* TCP acknowledgement number: read on the return path only */
	__be16 sport;
	__be16 dport;
	__u8 family; /* 4 or 6 */
	__u8 proto; /* transport (after any IPv6 extension headers) */
	__u8 flags; /* TCP flags (valid once the TCP header is checked) */
	__u8 frag; /* PKT_FRAG_* or 0 */
	__u8 ext; /* IPv6: extension headers in front of the transport header */
	__u8 ttl; /* TTL / hop limit */
	__u8 ports; /* the transport header's first 4 bytes are in the packet */
	__u8 first; /* toward a backend: the connection's first packet (a new SYN, a UDP flow's first) */
	__u32 named; /* a new connection's backend a QUIC connection ID named (balancer.bpf.c NAMED) */
	__u8 via_sid; /* SRv6 from the ECMP router: VIA_COND_SID, VIA_DIRECT_SID or 0 (balancer.bpf.c) */
	__u8 srh_type; /* IPv6: routing type and segments left of a first Routing header */
	__u8 srh_left;
	__u8 chain_generation; /* the shadow generation a stray of via_sid goes to (shadow_generations.h) */
};

/* The packet being handled lives in a per-CPU slot, not on the stack: the
 * deepest path (a new connection: the walk, the handshake, forwarding, a
 * MAC) needs all of the 512 bytes a BPF call chain may use. XDP does not
 * nest on a CPU, and nothing in it outlives the packet. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pkt);
} pkt_scratch SEC(".maps");

/* Parses an IPv4 packet after the Ethernet header. 0, or a drop verdict. */
static __always_inline int parse4(struct xdp_md *ctx, struct pkt *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *iph = data + ETH_HLEN;

	if ((void *)(iph + 1) > data_end)
		return drop(INBAND_DROP_MALFORMED_IP);
	__u32 avail = data_end - (void *)iph;
	__u16 frag = bpf_ntohs(iph->frag_off);

	p->family = 4;
	p->hlen = iph->ihl * 4;
	p->tot_len = bpf_ntohs(iph->tot_len);
	if (iph->version != 4 || p->hlen < INBAND_IPV4_MIN_HDR || p->hlen > avail || p->tot_len > avail ||
	    p->tot_len < p->hlen)
		return drop(INBAND_DROP_MALFORMED_IP);
	p->saddr = inband_addr4(iph->saddr);
	p->daddr = inband_addr4(iph->daddr);
	p->proto = iph->protocol;
	p->ttl = iph->ttl;
	if (frag & IP_OFFSET_MASK)
		p->frag = PKT_FRAG_LATER;
	else if (frag & IP_FRAG_MASK)
		p->frag = PKT_FRAG_FIRST;
	if (p->frag != PKT_FRAG_LATER && p->hlen + 4 <= p->tot_len) {
		__be16 *ports = (void *)iph + (p->hlen & 0x3c);

		if ((void *)(ports + 2) <= data_end) {
			p->sport = ports[0];
			p->dport = ports[1];
			p->ports = 1;
		}
	}
	return 0;
}

/*
 * Parses an IPv6 packet after the Ethernet header, walking up to
 * IP6_MAX_EXT extension headers to the transport header. 0, or a drop
 * verdict.
 */
static __always_inline int parse6(struct xdp_md *ctx, struct pkt *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip6 = data + ETH_HLEN;

	if ((void *)(ip6 + 1) > data_end)
		return drop(INBAND_DROP_MALFORMED_IP);
	__u32 avail = data_end - (void *)ip6;

	p->family = 6;
	p->tot_len = INBAND_IPV6_HDR + bpf_ntohs(ip6->payload_len);
	/* A payload length of 0 is a jumbogram's, which Ethernet never carries. */
	if (ip6->version != 6 || p->tot_len > avail || p->tot_len == INBAND_IPV6_HDR)
		return drop(INBAND_DROP_MALFORMED_IP);
	__builtin_memcpy(&p->saddr, &ip6->saddr, 16);
	__builtin_memcpy(&p->daddr, &ip6->daddr, 16);
	/* IPv4-mapped addresses never travel in an IPv6 header (RFC 4291
	 * 2.5.5.2), so no sender of ours emits one; the tables hold IPv4
	 * that way, so such a packet would pass for IPv4 traffic between
	 * the same addresses (an IPv6 RST from ::ffff:client closing that
	 * client's IPv4 flow). */
	if (inband_addr_is4(&p->saddr) || inband_addr_is4(&p->daddr))
		return drop(INBAND_DROP_MALFORMED_IP);
	p->ttl = ip6->hop_limit;

	__u32 off = INBAND_IPV6_HDR;
	__u8 nh = ip6->nexthdr;

#pragma unroll
	for (int i = 0; i < IP6_MAX_EXT; i++) {
		if (nh != IP6_HOPOPTS && nh != IP6_ROUTING && nh != IP6_DSTOPTS && nh != IP6_FRAGMENT)
			break;
		__u8 h[4];

		if (off + 8 > p->tot_len || bpf_xdp_load_bytes(ctx, ETH_HLEN + off, h, sizeof(h)))
			return drop(INBAND_DROP_MALFORMED_IP);
		__u32 len = nh == IP6_FRAGMENT ? 8 : ((__u32)h[1] + 1) * 8;

		if (off + len > p->tot_len)
			return drop(INBAND_DROP_MALFORMED_IP);
		if (nh == IP6_FRAGMENT) {
			/* Offset, or more fragments to come; an atomic fragment
			 * (RFC 6946: neither) is a whole packet. */
			if ((h[2] << 8 | h[3]) & 0xfff8)
				p->frag = PKT_FRAG_LATER;
			else if (h[3] & 1)
				p->frag = PKT_FRAG_FIRST;
		}
		if (i == 0 && nh == IP6_DSTOPTS)
			p->doh_len = len;
		if (i == 0 && nh == IP6_ROUTING) {
			p->srh_type = h[2];
			p->srh_left = h[3];
		}
		p->ext++;
		off += len;
		nh = h[0];
	}
	if (nh == IP6_HOPOPTS || nh == IP6_ROUTING || nh == IP6_DSTOPTS || nh == IP6_FRAGMENT) {
		/* Longer than we walk: the kernel's, but counted, since its
		 * transport (and a VIP's port) stays unseen. */
		event(INBAND_EV_IPV6_CHAIN_UNWALKED);
		p->proto = IP6_NONE;
		return 0;
	}
	p->hlen = off;
	p->proto = nh;
	if (p->frag != PKT_FRAG_LATER && off + 4 <= p->tot_len) {
		__be16 ports[2];

		if (!bpf_xdp_load_bytes(ctx, ETH_HLEN + off, ports, sizeof(ports))) {
			p->sport = ports[0];
			p->dport = ports[1];
			p->ports = 1;
		}
	}
	return 0;
}

/* The transport header of a packet whose IP header is exactly `l3` bytes
 * (IPv4 without options, IPv6 without extension headers). */
static __always_inline void *l4_at(struct xdp_md *ctx, __u32 l3)
{
	return (void *)(long)ctx->data + ETH_HLEN + l3;
}

/* The TCP header is whole inside the IP packet. */
static __always_inline int tcp_header_ok(struct xdp_md *ctx, const struct pkt *p)
{
	struct tcphdr *tcp = (void *)(long)ctx->data + ETH_HLEN + (p->hlen & 0x7f);

	if ((void *)(tcp + 1) > (void *)(long)ctx->data_end || p->hlen + TCP_MIN_HDR > p->tot_len || tcp->doff < 5 ||
	    p->hlen + tcp->doff * 4 > p->tot_len)
		return 0;
	return 1;
}

static __always_inline int udp_header_ok(const struct pkt *p)
{
	return p->hlen + UDP_HDR <= p->tot_len;
}

static __always_inline int is_syn(__u8 flags)
{
	return (flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
}

/* The client side of the packet's connection (its source is the client). */
static __always_inline void client_key(struct pkt *p)
{
	struct inband_flow_key *fk = &p->fk;

	fk->client_addr = p->saddr;
	fk->vip_addr = p->daddr;
	fk->client_port = p->sport;
	fk->vip_port = p->dport;
	fk->proto = p->proto;
	fk->pad[0] = fk->pad[1] = fk->pad[2] = 0;
}

#endif /* INBAND_LB_PARSE_H */

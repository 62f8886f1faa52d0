// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Daisy chaining on a server behind an ECMP router (seed 002's
 * End.DT4.COND, here End.DT6.COND): tc ingress on the server's interface
 * toward the router. See "Scale-out behind ECMP" in docs/architecture.md.
 *
 * The router reaches each server through an SRv6 encapsulation to one of
 * two SIDs of that server: the conditional SID for packets routed by the
 * current next-hop set, and a plain End.DT6 SID for packets the router's
 * shadow table (the previous next-hop set) forwards. A packet to the
 * conditional SID is delivered (End.DT6 in the kernel) if its inner packet
 * is a SYN, is not TCP, or belongs to a local socket; otherwise it is a
 * stray of a connection another server owns, and this program readdresses
 * the outer header to the router's shadow SID, so the kernel forwards it
 * back and the router sends it on by the previous mapping. Chained packets
 * arrive at the plain SID, which this program never redirects, so a
 * packet cannot loop (the seed's End.DT4.COND could, after two changes
 * within one connection).
 *
 * With more than one shadow generation (shadow_generations.h), the router
 * reaches the conditional SID of a server in an older set with an SRH of
 * two segments: this SID, then the SID of the next older generation's
 * table. A stray goes to that segment instead, and only the oldest
 * generation's table sends to plain SIDs: a packet is chained at most
 * once per generation.
 *
 * Everything not addressed to the conditional SID goes on untouched with
 * TC_ACT_UNSPEC, so a filter after this one (the agent's) still sees it.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/shadow/maps.h"
#include "inband/shadow/types.h"
#include "inband/shadow_generations.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define IPV6_SRCRT_TYPE_SRH 4

static __always_inline int count(struct __sk_buff *skb, __u32 counter, int verdict)
{
	struct inband_shadow_count *c = bpf_map_lookup_elem(&shadow_stats, &counter);

	if (c) {
		c->packets++;
		c->bytes += skb->len;
	}
	return verdict;
}

static __always_inline int same_addr(const __u8 *a, const __u8 *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;

	return x[0] == y[0] && x[1] == y[1];
}

/* The time-wait socket's next expected sequence number, relocated by name
 * against the kernel's BTF (through sock_common's anonymous unions), as
 * agent.bpf.c's socket fields are: no vmlinux.h beside the UAPI headers. */
struct sock_common {
	__u32 skc_tw_rcv_nxt;
} __attribute__((preserve_access_index));

struct inet_timewait_sock {
	struct sock_common __tw_common;
} __attribute__((preserve_access_index));

struct tcp_timewait_sock {
	struct inet_timewait_sock tw_sk;
} __attribute__((preserve_access_index));

/* A socket that owns the inner TCP packet's connection: an established
 * (or handshaking, closing) socket. A listener matches every client of its
 * port, so it says nothing about this connection. A time-wait socket has
 * seen both FINs: of its connection only a retransmitted FIN, a RST, or an
 * ACK at the very sequence number after the client's FIN can still come
 * (the client's duplicate ACK when this server's tail-loss probe or
 * retransmission reaches it after the close). Anything else with its tuple
 * is a newer connection that reused the client's port and lives on another
 * server, whose initial sequence number is unrelated to the old one's;
 * delivered here it would meet the time-wait socket and stall (bench.ecmp's
 * 1-s flaps showed it: downloads frozen mid-body until curl gave up). */
static __always_inline int owned_locally(struct __sk_buff *skb, const struct ipv6hdr *in, const struct tcphdr *tcp)
{
	struct bpf_sock_tuple t = {};
	struct tcp_timewait_sock *tw;
	struct bpf_sock *sk;
	int owned;

	__builtin_memcpy(t.ipv6.saddr, &in->saddr, 16);
	__builtin_memcpy(t.ipv6.daddr, &in->daddr, 16);
	t.ipv6.sport = tcp->source;
	t.ipv6.dport = tcp->dest;
	sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	if (sk->state == BPF_TCP_LISTEN) {
		owned = 0;
	} else if (sk->state != BPF_TCP_TIME_WAIT || tcp->fin || tcp->rst) {
		owned = 1;
	} else {
		tw = bpf_skc_to_tcp_timewait_sock(sk);
		owned = tw && tw->tw_sk.__tw_common.skc_tw_rcv_nxt == bpf_ntohl(tcp->seq);
	}
	bpf_sk_release(sk);
	return owned;
}

/* Segments left to 0 (at `left_at`, if the SRH had one left): the path
 * ends here, or at the shadow SID just written as the destination. */
static __always_inline int consume_segment(struct __sk_buff *skb, __u32 left_at)
{
	const __u8 none = 0;

	return left_at ? bpf_skb_store_bytes(skb, left_at, &none, 1, 0) : 0;
}

/* Delivered here: the kernel's End.DT6 at the conditional SID takes the
 * inner packet, but only with no segment left. */
static __always_inline int deliver(struct __sk_buff *skb, __u32 left_at, __u32 counter)
{
	if (consume_segment(skb, left_at) < 0)
		return count(skb, INBAND_SHADOW_MALFORMED, TC_ACT_UNSPEC);
	return count(skb, counter, TC_ACT_UNSPEC);
}

SEC("tc")
int shadow_ingress(struct __sk_buff *skb)
{
	const __u32 zero = 0;
	struct inband_shadow_config *cfg = bpf_map_lookup_elem(&shadow_config, &zero);
	struct ipv6hdr out, in;
	struct tcphdr tcp;
	__u8 rh[4]; /* next header, length, routing type, segments left */
	__u8 next[16]; /* with segments left: the shadow SID the router named */
	__u32 off = ETH_HLEN, left_at = 0;
	__u8 nh;

	if (!cfg || skb->protocol != bpf_htons(ETH_P_IPV6))
		return count(skb, INBAND_SHADOW_OTHER, TC_ACT_UNSPEC);
	if (bpf_skb_load_bytes(skb, off, &out, sizeof(out)) < 0 || !same_addr((__u8 *)&out.daddr, cfg->cond_sid))
		return count(skb, INBAND_SHADOW_OTHER, TC_ACT_UNSPEC);
	off += sizeof(out);
	nh = out.nexthdr;
	if (nh == IPPROTO_ROUTING) {
		/* The router's encapsulation: one SRH whose last segment is
		 * ours, or of two segments whose last is a shadow SID. */
		if (bpf_skb_load_bytes(skb, off, rh, sizeof(rh)) < 0 || rh[2] != IPV6_SRCRT_TYPE_SRH || rh[3] > 1)
			return count(skb, INBAND_SHADOW_MALFORMED, TC_ACT_UNSPEC);
		if (rh[3]) {
			if (((__u32)rh[1] + 1) * 8 != INBAND_SRH2_LEN ||
			    bpf_skb_load_bytes(skb, off + INBAND_SRH2_NEXT_SEGMENT, next, sizeof(next)) < 0 ||
			    inband_shadow_generation(cfg->shadow_sid, next) < 0)
				return count(skb, INBAND_SHADOW_MALFORMED, TC_ACT_UNSPEC);
			left_at = off + 3;
		}
		nh = rh[0];
		off += ((__u32)rh[1] + 1) * 8;
	}
	if (nh != IPPROTO_IPV6 || bpf_skb_load_bytes(skb, off, &in, sizeof(in)) < 0)
		return count(skb, INBAND_SHADOW_MALFORMED, TC_ACT_UNSPEC);
	if (in.nexthdr != IPPROTO_TCP)
		return deliver(skb, left_at, INBAND_SHADOW_NOT_TCP);
	if (bpf_skb_load_bytes(skb, off + sizeof(in), &tcp, sizeof(tcp)) < 0)
		return count(skb, INBAND_SHADOW_MALFORMED, TC_ACT_UNSPEC);
	if (tcp.syn && !tcp.ack)
		return deliver(skb, left_at, INBAND_SHADOW_NEW_FLOW);
	if (owned_locally(skb, &in, &tcp))
		return deliver(skb, left_at, INBAND_SHADOW_LOCAL);
	/* A stray: back to the router's shadow table, the one it named or
	 * the first. The outer header has no checksum, and the kernel
	 * forwards the packet by its new destination (the server forwards
	 * IPv6); the router's End.DT6 takes it with no segment left. */
	if (bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, daddr), left_at ? next : cfg->shadow_sid, 16, 0) < 0 ||
	    consume_segment(skb, left_at) < 0)
		return count(skb, INBAND_SHADOW_MALFORMED, TC_ACT_UNSPEC);
	return count(skb, left_at ? INBAND_SHADOW_CHAINED_NAMED : INBAND_SHADOW_CHAINED, TC_ACT_OK);
}

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Constants and skb helpers of the real-server agent (bpf/agent.bpf.c) that
 * the UAPI headers do not provide (they live in the kernel's private net/
 * headers).
 */
#ifndef INBAND_AGENT_SKB_H
#define INBAND_AGENT_SKB_H

#include <linux/bpf.h>
#include <linux/ip.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>

#define INBAND_ETH_HLEN 14
#define INBAND_AF_INET 2

#define INBAND_IP_MF 0x2000
#define INBAND_IP_OFFSET 0x1fff

#define INBAND_TCP_FIN 0x01
#define INBAND_TCP_SYN 0x02
#define INBAND_TCP_RST 0x04
#define INBAND_TCP_PSH 0x08
#define INBAND_TCP_ACK 0x10
#define INBAND_TCP_URG 0x20
#define INBAND_TCP_CWR 0x80
/* A TCP header with every option it can hold (data offset 15). */
#define INBAND_TCP_MAX_HDR 60

#define INBAND_TCPOPT_EOL 0
#define INBAND_TCPOPT_NOP 1
#define INBAND_TCPOPT_MSS 2
#define INBAND_TCPOLEN_MSS 4
#define INBAND_TCPOPT_TIMESTAMP 8
#define INBAND_TCPOLEN_TIMESTAMP 10

/* Kernel TCP states (include/net/tcp_states.h), as the inet_sock_set_state
 * tracepoint and struct bpf_sock report them. */
enum {
	INBAND_TCP_ESTABLISHED = 1,
	INBAND_TCP_SYN_RECV = 3,
	INBAND_TCP_FIN_WAIT1 = 4,
	INBAND_TCP_FIN_WAIT2 = 5,
	INBAND_TCP_TIME_WAIT = 6,
	INBAND_TCP_CLOSE = 7,
	INBAND_TCP_CLOSE_WAIT = 8,
	INBAND_TCP_CLOSING = 11,
	INBAND_TCP_LISTEN = 10,
	INBAND_TCP_NEW_SYN_RECV = 12, /* a request socket: handshake not complete */
};

/* Version/IHL, TOS and total length: the header word an option change
 * rewrites, as it sits in memory (see csum.h). */
static __always_inline __u32 ipv4_word0(const struct iphdr *hdr)
{
	__u32 w;

	__builtin_memcpy(&w, hdr, sizeof(w));
	return w;
}

/*
 * Writes the first header word and the header checksum.
 * BPF_F_RECOMPUTE_CSUM keeps skb->csum of a CHECKSUM_COMPLETE skb in step
 * with the bytes changed here; together with bpf_skb_adjust_room's own update
 * the header again sums to zero, so the stack's receive checksum stays valid.
 */
static __always_inline void ipv4_store_header(struct __sk_buff *skb, const struct iphdr *hdr,
					      __u16 check)
{
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN, hdr, 4, BPF_F_RECOMPUTE_CSUM);
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, check), &check,
			    sizeof(check), BPF_F_RECOMPUTE_CSUM);
}

#endif /* INBAND_AGENT_SKB_H */

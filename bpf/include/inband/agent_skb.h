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

#define INBAND_TCP_SYN 0x02
#define INBAND_TCP_ACK 0x10

#define INBAND_TCPOPT_EOL 0
#define INBAND_TCPOPT_NOP 1
#define INBAND_TCPOPT_MSS 2
#define INBAND_TCPOLEN_MSS 4

/* Kernel TCP states (include/net/tcp_states.h), as the inet_sock_set_state
 * tracepoint reports them. */
enum {
	INBAND_TCP_ESTABLISHED = 1,
	INBAND_TCP_SYN_RECV = 3,
	INBAND_TCP_TIME_WAIT = 6,
	INBAND_TCP_CLOSE = 7,
	INBAND_TCP_CLOSE_WAIT = 8,
};

/*
 * The IPv4 header checksum after the first word (version/IHL, TOS, total
 * length) changes from `old` to `new` and option words are removed or added
 * (RFC 1624: HC' = ~(~HC + ~m + m')). Sums run over raw network-order memory
 * so the result is stored as is. Negative on helper error.
 */
static __always_inline __s64 ipv4_check_after(const struct iphdr *old, const struct iphdr *new_hdr,
					      __u32 *removed, __u32 removed_len, __u32 *added,
					      __u32 added_len)
{
	__u32 w_old, w_new;
	__s64 sum;

	__builtin_memcpy(&w_old, old, sizeof(w_old));
	__builtin_memcpy(&w_new, new_hdr, sizeof(w_new));
	sum = bpf_csum_diff(removed, removed_len, added, added_len, (__u16)~old->check);
	if (sum < 0)
		return sum;
	sum = bpf_csum_diff(&w_old, sizeof(w_old), &w_new, sizeof(w_new), (__u32)sum);
	if (sum < 0)
		return sum;
	sum = (sum & 0xffff) + ((sum >> 16) & 0xffff);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/*
 * Writes the first header word and the checksum computed by
 * ipv4_check_after. BPF_F_RECOMPUTE_CSUM keeps skb->csum of a
 * CHECKSUM_COMPLETE skb in step with the bytes changed here; together with
 * bpf_skb_adjust_room's own update the header again sums to zero, so the
 * stack's receive checksum stays valid.
 */
static __always_inline void ipv4_store_header(struct __sk_buff *skb, const struct iphdr *hdr,
					      __u16 check)
{
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN, hdr, 4, BPF_F_RECOMPUTE_CSUM);
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, check), &check,
			    sizeof(check), BPF_F_RECOMPUTE_CSUM);
}

#endif /* INBAND_AGENT_SKB_H */

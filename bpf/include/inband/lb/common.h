/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Small helpers every part of the balancer uses: counters, loads, clocks. */
#ifndef INBAND_LB_COMMON_H
#define INBAND_LB_COMMON_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "inband/lb/maps.h"

#define ETH_IP_HLEN (ETH_HLEN + INBAND_IPV4_MIN_HDR)
#define IP_MAX_OPT_LEN (INBAND_IPV4_MAX_HDR - INBAND_IPV4_MIN_HDR)
#define TCP_MIN_HDR 20
#define TCP_MAX_OPT_LEN 40
#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04
#define TCP_FLAG_ACK 0x10
#define TCPOPT_EOL 0
#define TCPOPT_NOP 1
#define TCPOPT_MSS 2
#define IP_FRAG_MASK 0x3fff /* MF flag + fragment offset */
#define IP_OFFSET_MASK 0x1fff
#define SNAT_PORT_RANGE (INBAND_SNAT_PORT_MAX - INBAND_SNAT_PORT_MIN + 1)
#define ETH_P_8021Q_ 0x8100
#define ETH_P_8021AD_ 0x88a8

static __always_inline int drop(__u32 reason)
{
	__u64 *count = bpf_map_lookup_elem(&drops, &reason);

	if (count)
		*count += 1; /* per-CPU slot: no other writer */
	return XDP_DROP;
}

static __always_inline void event(__u32 ev)
{
	__u64 *count = bpf_map_lookup_elem(&events, &ev);

	if (count)
		*count += 1;
}

static __always_inline __u16 load16(const void *p)
{
	__u16 v;

	__builtin_memcpy(&v, p, sizeof(v));
	return v;
}

static __always_inline __u32 load32(const void *p)
{
	__u32 v;

	__builtin_memcpy(&v, p, sizeof(v));
	return v;
}

static __always_inline int mac_is_zero(const __u8 *m)
{
	return !(m[0] | m[1] | m[2] | m[3] | m[4] | m[5]);
}

static __always_inline struct inband_lb_config *config(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&lb_config, &zero);
}

/* CLOCK_MONOTONIC at tick resolution: flow timestamps need seconds, not ns. */
static __always_inline __u64 coarse_now(void)
{
	return bpf_ktime_get_coarse_ns();
}

static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

#endif /* INBAND_LB_COMMON_H */

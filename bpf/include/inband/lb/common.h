/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Small helpers every part of the balancer uses: counters, loads, clocks. */
#ifndef INBAND_LB_COMMON_H
#define INBAND_LB_COMMON_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "inband/lb/maps.h"

#define ETH_IP_HLEN (ETH_HLEN + INBAND_IPV4_MIN_HDR)
#define ETH_IP6_HLEN (ETH_HLEN + INBAND_IPV6_HDR)
#define ETH_P_IPV6_ 0x86DD
#define UDP_HDR 8
/* IPv6 next-header values (linux/in6.h has them behind libc guards). */
#define IP6_HOPOPTS 0
#define IP6_ROUTING 43
#define IP6_FRAGMENT 44
#define IP6_ICMP 58
#define IP6_NONE 59
#define IP6_DSTOPTS 60
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

/* Counts a drop and notes its reason for the capture (capture.h), which
 * runs once the walk has returned its verdict. */
static __always_inline int drop(__u32 reason)
{
	__u64 *count = bpf_map_lookup_elem(&drops, &reason);
	__u32 zero = 0;
	struct inband_capture_state *st = bpf_map_lookup_elem(&capture_state, &zero);

	if (count)
		*count += 1; /* per-CPU slot: no other writer */
	if (st)
		st->reason = reason;
	return XDP_DROP;
}

/*
 * Header room in XDP: the first `keep` bytes of the frame (Ethernet and
 * the headers that stay in front) move `gap` bytes toward the front,
 * opening a gap after them (open_gap: an option, a Destination Options
 * header, an outer IP-in-IP header goes there), or back over the `gap`
 * bytes after them (close_gap: taking one off). Both are constants at
 * every call, so the 2-byte moves unroll to fixed offsets; the source is
 * ahead of the destination in the direction of the copy, so no byte is
 * overwritten before it is read. 0, or a drop verdict.
 */
static __always_inline int open_gap(struct xdp_md *ctx, const int keep, const int gap)
{
	if (bpf_xdp_adjust_head(ctx, -gap))
		return drop(INBAND_DROP_ADJUST_FAILED);
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + keep + gap > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	__u16 *dst = data;
	__u16 *src = data + gap;

#pragma unroll
	for (int i = 0; i < keep / 2; i++)
		dst[i] = src[i];
	return 0;
}

static __always_inline int close_gap(struct xdp_md *ctx, const int keep, const int gap)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + keep + gap > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	__u16 *dst = data + gap;
	__u16 *src = data;

#pragma unroll
	for (int i = keep / 2 - 1; i >= 0; i--)
		dst[i] = src[i];
	if (bpf_xdp_adjust_head(ctx, gap))
		return drop(INBAND_DROP_ADJUST_FAILED);
	return 0;
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

/* The balancer's own address in the family of `a`. */
static __always_inline const struct inband_addr *self_addr(const struct inband_lb_config *cfg,
							    const struct inband_addr *a)
{
	return inband_addr_is4(a) ? &cfg->self4 : &cfg->self6;
}

/* A pool address computed for the packet at hand: in a per-CPU slot, not
 * on the stack, which the paths that need it (forward, the MAC, ICMP) have
 * little of left. XDP does not nest on a CPU, and one packet has one flow. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_addr);
} snat_src SEC(".maps");

/* Source address `index` of the balancer toward the family of `a`: 0 its
 * own, 1.. its SNAT pool's (lb_config), INBAND_SNAT_FLEET the fleet's
 * address ending in `suffix`. A pool is aligned and at most
 * 2^INBAND_SNAT_POOL_BITS addresses, so its last word alone counts. NULL
 * only if the per-CPU slot is missing. */
static __always_inline const struct inband_addr *snat_addr(const struct inband_lb_config *cfg,
							    const struct inband_addr *a, __u8 index, __be32 suffix)
{
	if (!index)
		return self_addr(cfg, a);
	__u32 zero = 0;
	struct inband_addr *r = bpf_map_lookup_elem(&snat_src, &zero);

	if (!r)
		return NULL;
	if (index == INBAND_SNAT_FLEET) {
		*r = cfg->fleet_prefix;
		r->w[3] = suffix;
		return r;
	}
	*r = inband_addr_is4(a) ? cfg->snat_pool4 : cfg->snat_pool6;
	r->w[3] = bpf_htonl(bpf_ntohl(r->w[3]) + index - 1);
	return r;
}

/* `a` is inside the fleet's /96 (fleet on: its prefix is not zero). */
static __always_inline int in_fleet_prefix(const struct inband_lb_config *cfg, const struct inband_addr *a)
{
	const struct inband_addr *fp = &cfg->fleet_prefix;

	return (fp->w[0] | fp->w[1] | fp->w[2]) && a->w[0] == fp->w[0] && a->w[1] == fp->w[1] && a->w[2] == fp->w[2];
}

/* Which of the balancer's source addresses `a` is (its index; a fleet
 * address is INBAND_SNAT_FLEET, its suffix being a's last word), or -1. */
static __always_inline int snat_index_of(const struct inband_lb_config *cfg, const struct inband_addr *a)
{
	const struct inband_addr *self = self_addr(cfg, a);

	if (!inband_addr_is_zero(self) && inband_addr_eq(a, self))
		return 0;
	if (in_fleet_prefix(cfg, a))
		return INBAND_SNAT_FLEET;
	int v4 = inband_addr_is4(a);
	__u32 n = v4 ? cfg->snat_pool4_n : cfg->snat_pool6_n;
	const struct inband_addr *base = v4 ? &cfg->snat_pool4 : &cfg->snat_pool6;

	if (!n || a->w[0] != base->w[0] || a->w[1] != base->w[1] || a->w[2] != base->w[2])
		return -1;
	__u32 off = bpf_ntohl(a->w[3]) - bpf_ntohl(base->w[3]);

	return off < n ? (int)off + 1 : -1;
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

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Internet checksum arithmetic for BPF programs that rewrite headers.
 *
 * Every value is a 16- or 32-bit field exactly as it sits in the packet
 * (network order loaded natively, never byte-swapped): the one's-complement
 * sum commutes with byte swapping (RFC 1071 section 2(B)), so a checksum
 * computed over memory-order words and stored back in memory order is the
 * right one on either endianness, and the data path needs no bpf_ntohs().
 *
 * Incremental updates follow RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'), which,
 * unlike the older ~HC - m + m' form, never produces a -0 the receiver would
 * reject.
 */
#ifndef INBAND_CSUM_H
#define INBAND_CSUM_H

#include <linux/types.h>

#include "inband/addr.h"

static inline __attribute__((always_inline)) __u16 csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/* Accumulator of an incremental update of the checksum field `check`. */
static inline __attribute__((always_inline)) __u32 csum_start(__u16 check)
{
	return (__u16)~check;
}

/*
 * A 16-bit word changed from `from` to `to`. A word removed from the covered
 * data is a change to 0; an added one is a change from 0. The accumulator
 * stays far from overflow for the few dozen updates any header rewrite makes.
 */
static inline __attribute__((always_inline)) __u32 csum_replace16(__u32 acc, __u16 from, __u16 to)
{
	return acc + (__u16)~from + to;
}

static inline __attribute__((always_inline)) __u32 csum_replace32(__u32 acc, __u32 from, __u32 to)
{
	acc = csum_replace16(acc, (__u16)(from >> 16), (__u16)(to >> 16));
	return csum_replace16(acc, (__u16)from, (__u16)to);
}

/* The value to store in the checksum field. */
static inline __attribute__((always_inline)) __u16 csum_finish(__u32 acc)
{
	return (__u16)~csum_fold(acc);
}

/*
 * Sum of `n` 16-bit words at `p` (2-byte aligned). `n` must be a
 * compile-time constant so the loop unrolls: the verifier then sees fixed
 * offsets. csum_finish(csum_words(hdr, 10)) with the checksum field zeroed
 * is a fresh IPv4 header checksum.
 */
static inline __attribute__((always_inline)) __u32 csum_words(const void *p, const int n)
{
	const __u16 *w = p;
	__u32 sum = 0;

#pragma unroll
	for (int i = 0; i < n; i++)
		sum += w[i];
	return sum;
}

/*
 * A 16-bit field that starts at an odd offset from the start of the
 * checksummed data straddles two checksum words with its bytes in swapped
 * roles; feeding the swapped values into csum_replace16 accounts for that.
 */
static inline __attribute__((always_inline)) __u16 csum_swab16(__u16 v)
{
	return (__u16)((v << 8) | (v >> 8));
}

/* A 16-bit value as it sits in memory when written big-endian. */
static inline __attribute__((always_inline)) __u16 csum_be16(__u16 v)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	return __builtin_bswap16(v);
#else
	return v;
#endif
}

/*
 * The sum of a TCP or UDP pseudo-header of `l4_len` bytes of `proto` between
 * `saddr` and `daddr`, as 16-bit words in memory order like everything
 * here: an IPv4 pseudo-header has the addresses' last words (RFC 793), an
 * IPv6 one all four and a 32-bit length (RFC 8200 8.1), which sum the same
 * for lengths below 64 KiB. At most 18 words: no carry is lost in 32 bits.
 */
static inline __attribute__((always_inline)) __u32 csum_pseudo(const struct inband_addr *saddr,
							     const struct inband_addr *daddr, __u8 proto, __u32 l4_len)
{
	__u32 acc = 0;

#pragma unroll
	for (int i = 0; i < 4; i++) {
		if (i < 3 && inband_addr_is4(saddr))
			continue;
		acc += (saddr->w[i] >> 16) + (saddr->w[i] & 0xffff);
		acc += (daddr->w[i] >> 16) + (daddr->w[i] & 0xffff);
	}
	return acc + csum_be16(proto) + csum_be16((__u16)l4_len);
}

/*
 * Whether a TCP or UDP segment of `l4_len` bytes of `proto` between `saddr`
 * and `daddr` checks out, given the 32-bit partial sum of its bytes
 * (bpf_csum_diff's result over the whole segment, checksum field included).
 */
static inline __attribute__((always_inline)) int csum_l4_ok(__u32 partial, const struct inband_addr *saddr,
							  const struct inband_addr *daddr, __u8 proto, __u32 l4_len)
{
	__u64 acc = (__u64)partial + csum_pseudo(saddr, daddr, proto, l4_len);

	acc = (acc & 0xffffffff) + (acc >> 32);
	acc = (acc & 0xffffffff) + (acc >> 32);
	return csum_fold((__u32)acc) == 0xffff;
}

#endif /* INBAND_CSUM_H */

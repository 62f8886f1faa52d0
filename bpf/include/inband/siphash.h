/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * SipHash-2-4 (Aumasson & Bernstein), the keyed hash the kernel uses for SYN
 * cookies and port randomisation: inband uses it for the MACs on options
 * 155/124/125 and for the balancer's SNAT port candidates.
 *
 * Written here because BPF programs cannot call the kernel's siphash() and
 * no BPF library provides one. Inputs are whole 64-bit words of a fixed,
 * compile-time count, so the rounds unroll into straight-line code the
 * verifier checks once. The Rust side uses the `siphasher` crate; both are
 * checked against the reference vectors in tests/vectors/siphash.txt.
 *
 * Included by BPF programs and by host C tests: fixed-width types only.
 */
#ifndef INBAND_SIPHASH_H
#define INBAND_SIPHASH_H

#include <linux/types.h>

static inline __attribute__((always_inline)) __u64 inband_rotl64(__u64 x, int b)
{
	return (x << b) | (x >> (64 - b));
}

#define INBAND_SIPROUND(v0, v1, v2, v3)              \
	do {                                         \
		v0 += v1;                            \
		v1 = inband_rotl64(v1, 13);          \
		v1 ^= v0;                            \
		v0 = inband_rotl64(v0, 32);          \
		v2 += v3;                            \
		v3 = inband_rotl64(v3, 16);          \
		v3 ^= v2;                            \
		v0 += v3;                            \
		v3 = inband_rotl64(v3, 21);          \
		v3 ^= v0;                            \
		v2 += v1;                            \
		v1 = inband_rotl64(v1, 17);          \
		v1 ^= v2;                            \
		v2 = inband_rotl64(v2, 32);          \
	} while (0)

/* A little-endian 64-bit load, whatever the host's byte order. */
static inline __attribute__((always_inline)) __u64 inband_le64(const __u8 *p)
{
	__u64 v;

	__builtin_memcpy(&v, p, sizeof(v));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	v = __builtin_bswap64(v);
#endif
	return v;
}

/*
 * SipHash-2-4 of `nwords` * 8 bytes at `msg` (8-byte aligned length; the
 * reference algorithm's final block then holds only the length). `nwords`
 * must be a compile-time constant. `k0`/`k1` are the key's two
 * little-endian halves.
 */
static inline __attribute__((always_inline)) __u64 inband_siphash24_words(__u64 k0, __u64 k1, const __u8 *msg,
									 const int nwords)
{
	__u64 v0 = k0 ^ 0x736f6d6570736575ULL;
	__u64 v1 = k1 ^ 0x646f72616e646f6dULL;
	__u64 v2 = k0 ^ 0x6c7967656e657261ULL;
	__u64 v3 = k1 ^ 0x7465646279746573ULL;
	__u64 b = (__u64)(nwords * 8) << 56;

#pragma unroll
	for (int i = 0; i < nwords; i++) {
		__u64 m = inband_le64(msg + 8 * i);

		v3 ^= m;
		INBAND_SIPROUND(v0, v1, v2, v3);
		INBAND_SIPROUND(v0, v1, v2, v3);
		v0 ^= m;
	}
	v3 ^= b;
	INBAND_SIPROUND(v0, v1, v2, v3);
	INBAND_SIPROUND(v0, v1, v2, v3);
	v0 ^= b;
	v2 ^= 0xff;
	INBAND_SIPROUND(v0, v1, v2, v3);
	INBAND_SIPROUND(v0, v1, v2, v3);
	INBAND_SIPROUND(v0, v1, v2, v3);
	INBAND_SIPROUND(v0, v1, v2, v3);
	return v0 ^ v1 ^ v2 ^ v3;
}

#endif /* INBAND_SIPHASH_H */

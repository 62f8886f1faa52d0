/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The one address type of every inband map, and the few operations on it
 * the programs need. Included by BPF programs, host C tests and bindgen:
 * fixed-width types, no helpers.
 */
#ifndef INBAND_ADDR_H
#define INBAND_ADDR_H

#include <linux/types.h>

/*
 * An IPv4 or IPv6 address in network order. IPv4 is held IPv4-mapped
 * (::ffff:a.b.c.d, RFC 4291 2.5.5.2): one table holds both families, and
 * an IPv4 address can never equal an IPv6 one.
 */
struct inband_addr {
	__be32 w[4];
};

/* ::ffff:0:0/96 in network order, as the third word holds it. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define INBAND_V4_MAPPED_WORD 0xffff0000U
#else
#define INBAND_V4_MAPPED_WORD 0x0000ffffU
#endif

static inline __attribute__((always_inline)) struct inband_addr inband_addr4(__be32 a)
{
	struct inband_addr x = { .w = { 0, 0, INBAND_V4_MAPPED_WORD, a } };

	return x;
}

static inline __attribute__((always_inline)) int inband_addr_is4(const struct inband_addr *a)
{
	return a->w[0] == 0 && a->w[1] == 0 && a->w[2] == INBAND_V4_MAPPED_WORD;
}

static inline __attribute__((always_inline)) int inband_addr_eq(const struct inband_addr *a,
								 const struct inband_addr *b)
{
	return a->w[0] == b->w[0] && a->w[1] == b->w[1] && a->w[2] == b->w[2] && a->w[3] == b->w[3];
}

static inline __attribute__((always_inline)) int inband_addr_is_zero(const struct inband_addr *a)
{
	return !(a->w[0] | a->w[1] | a->w[2] | a->w[3]);
}

#endif /* INBAND_ADDR_H */

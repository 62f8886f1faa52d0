/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The inband wire format: the IPv4 options that carry the client tuple, the
 * score request and the score. This is the only definition in C; the Rust
 * mirror is crates/inband/src/wire.rs and both are checked against
 * tests/vectors/wire.txt.
 *
 * Every option is a multiple of 4 bytes so the IPv4 header stays 32-bit
 * aligned without padding, and a packet carries at most one of them.
 *
 * This header is included by BPF programs and by host C tests, so it uses only
 * fixed-width types and no helpers.
 */
#ifndef INBAND_WIRE_H
#define INBAND_WIRE_H

#include <linux/types.h>

#define INBAND_OPT_CLIENT_TUPLE 155 /* balancer -> server, on the SYN */
#define INBAND_OPT_SCORE_REQUEST 124 /* balancer -> server, every n-th packet */
#define INBAND_OPT_SCORE 125 /* server -> balancer, answer to 124 */

#define INBAND_OPT_CLIENT_TUPLE_LEN 8
#define INBAND_OPT_SCORE_REQUEST_LEN 4
#define INBAND_OPT_SCORE_LEN 4

/* The largest option either side ever adds: what MSS clamping subtracts. */
#define INBAND_OPT_MAX_LEN 8

/* IPv4 header limits (RFC 791). */
#define INBAND_IPV4_MIN_HDR 20
#define INBAND_IPV4_MAX_HDR 60

struct inband_opt_client_tuple {
	__u8 kind; /* INBAND_OPT_CLIENT_TUPLE */
	__u8 len; /* 8 */
	__be32 client_addr;
	__be16 client_port;
} __attribute__((packed));

struct inband_opt_score_request {
	__u8 kind; /* INBAND_OPT_SCORE_REQUEST */
	__u8 len; /* 4 */
	__u16 zero;
} __attribute__((packed));

struct inband_opt_score {
	__u8 kind; /* INBAND_OPT_SCORE */
	__u8 len; /* 4 */
	__be16 score;
} __attribute__((packed));

/*
 * Encoders write the option at `out` in network order. Addresses and ports
 * are passed already in network order, as they sit in packet headers.
 */
static inline void inband_encode_client_tuple(__u8 *out, __be32 addr, __be16 port)
{
	const __u8 *a = (const __u8 *)&addr;
	const __u8 *p = (const __u8 *)&port;

	out[0] = INBAND_OPT_CLIENT_TUPLE;
	out[1] = INBAND_OPT_CLIENT_TUPLE_LEN;
	out[2] = a[0];
	out[3] = a[1];
	out[4] = a[2];
	out[5] = a[3];
	out[6] = p[0];
	out[7] = p[1];
}

static inline void inband_encode_score_request(__u8 *out)
{
	out[0] = INBAND_OPT_SCORE_REQUEST;
	out[1] = INBAND_OPT_SCORE_REQUEST_LEN;
	out[2] = 0;
	out[3] = 0;
}

/* `score` is in host order; the wire carries it big-endian. */
static inline void inband_encode_score(__u8 *out, __u16 score)
{
	out[0] = INBAND_OPT_SCORE;
	out[1] = INBAND_OPT_SCORE_LEN;
	out[2] = (__u8)(score >> 8);
	out[3] = (__u8)(score & 0xff);
}

#endif /* INBAND_WIRE_H */

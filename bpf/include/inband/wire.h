/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The inband wire format: the IPv4 options that carry the client tuple, the
 * score request and the score, in two formats:
 *
 * - authenticated (the default): each option carries a 64-bit SipHash-2-4
 *   MAC over the option and the connection it travels on (auth.h), keyed by
 *   a secret the balancer and the agents share;
 * - seed (compatibility): the paper's plain 8/4/4-byte options, trusted by
 *   source address alone (docs/architecture.md, "Trust model").
 *
 * A deployment uses one format (config `auth.mode`); a receiver refuses the
 * other. This is the only definition in C; crates/inband/src/wire.rs
 * generates its constants from this header and both are checked against
 * tests/vectors/wire.txt and tests/vectors/mac.txt.
 *
 * Every option is a multiple of 4 bytes so the IPv4 header stays 32-bit
 * aligned without padding; a packet carries at most one of them.
 *
 * Included by BPF programs and host C tests: fixed-width types, no helpers.
 */
#ifndef INBAND_WIRE_H
#define INBAND_WIRE_H

#include <linux/types.h>

#define INBAND_OPT_CLIENT_TUPLE 155 /* balancer -> server, on the SYN */
#define INBAND_OPT_SCORE_REQUEST 124 /* balancer -> server, every n-th packet */
#define INBAND_OPT_SCORE 125 /* server -> balancer, answer to 124 */

/* Seed format. */
#define INBAND_OPT_CLIENT_TUPLE_LEN 8 /* kind, len, client addr (4), client port (2) */
#define INBAND_OPT_SCORE_REQUEST_LEN 4 /* kind, len, 0, 0 */
#define INBAND_OPT_SCORE_LEN 4 /* kind, len, score (2) */

/*
 * Authenticated format (byte offsets within the option):
 * 155: kind, 20, key id, 0 | client addr (4) | client port (2), 0, 0 | MAC (8)
 * 124: kind, 16, key id, 0 | nonce (4) | MAC (8)
 * 125: kind, 16, score (2) | nonce (4) | MAC (8)
 * The 125 answers one 124 and is checked with that 124's key and nonce, so
 * it needs no key id of its own. MACs are little-endian on the wire.
 */
#define INBAND_OPT_AUTH_CLIENT_TUPLE_LEN 20
#define INBAND_OPT_AUTH_SCORE_REQUEST_LEN 16
#define INBAND_OPT_AUTH_SCORE_LEN 16
#define INBAND_OPT_MAC_LEN 8

/*
 * The largest option either side adds to a packet that can carry data (124
 * toward the server, 125 toward the balancer): what MSS clamping subtracts,
 * so that full-sized segments still fit the MTU with an option. 155 rides
 * only on the SYN.
 */
#define INBAND_OPT_DATA_MAX_LEN 16

/* IPv4 header limits (RFC 791). */
#define INBAND_IPV4_MIN_HDR 20
#define INBAND_IPV4_MAX_HDR 60

enum inband_auth_mode {
	INBAND_AUTH_SIPHASH = 0, /* authenticated options (default) */
	INBAND_AUTH_NONE = 1, /* the seed's plain options */
};

/* Key ids are one byte on the wire; 0 is never a valid id. */
#define INBAND_AUTH_MAX_KEYS 256

/*
 * Seed-format encoders write the option at `out`. Addresses and ports are
 * passed in network order, as they sit in packet headers.
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

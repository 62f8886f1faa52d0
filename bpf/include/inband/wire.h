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
 * UDP has no sequence number to bind a 155 to: its authenticated 155
 * carries the balancer's clock in milliseconds instead (the stamp, which
 * the MAC covers), and an agent keeps a tuple's newest:
 * 155: kind, 24, key id, 0 | client addr (4) | client port (2), 0, 0 | stamp (4) | MAC (8)
 */
#define INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN 24

/*
 * The largest option either side adds to a packet that can carry data (124
 * toward the server, 125 toward the balancer): what MSS clamping subtracts,
 * so that full-sized segments still fit the MTU with an option. 155 rides
 * only on the SYN.
 */
#define INBAND_OPT_DATA_MAX_LEN 16

/* Source ports the balancer uses toward backends (SNAT); kept below Linux's
 * default ephemeral range (32768-60999) so they never collide with the
 * balancer host's own connections to the same backend (its health checks).
 * The agents tell the two apart by it: a connection from a balancer's
 * address on a port above the range is the balancer's own, not a client's,
 * and is not counted as load (agent.bpf.c, balancer_own). */
#define INBAND_SNAT_PORT_MIN 1024
#define INBAND_SNAT_PORT_MAX 32767

/* IPv4 header limits (RFC 791). */
#define INBAND_IPV4_MIN_HDR 20
#define INBAND_IPV4_MAX_HDR 60

/*
 * IPv6 (RFC 8200). The seed's three extension headers (protocol numbers
 * 27-29) are assigned to other protocols, so the same option, byte for
 * byte as in IPv4 (kind, length, body), rides instead as the data of one
 * option in a Destination Options header (next header 60) placed right
 * after the fixed header:
 *
 *   next header | hdr ext len | 0x1E | option data length | inband option | PadN/Pad1 to 8n
 *
 * 0x1E is an RFC 4727 experimental option type: its top two bits (00)
 * tell a node that does not know it to skip it and still deliver the
 * packet (a server without the agent answers through the balancer, as in
 * IPv4), and its third bit (0) says it does not change en route.
 * docs/decisions.md compares this with the seed's encoding.
 *
 * Only the 155 differs from IPv4: its client address has 16 bytes.
 *   seed:          kind, 20, client addr (16), client port (2)
 *   authenticated: kind, 32, key id, 0 | client addr (16) | client port (2), 0, 0 | MAC (8)
 *   ... on UDP:    kind, 36, key id, 0 | client addr (16) | client port (2), 0, 0 | stamp (4) | MAC (8)
 * 124 and 125 are the IPv4 options unchanged.
 */
#define INBAND_IPV6_HDR 40
#define INBAND_IPPROTO_DSTOPTS 60
#define INBAND_OPT6_TYPE 0x1E
#define INBAND_OPT6_CLIENT_TUPLE_LEN 20
#define INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN 32
#define INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN 36
/* Header bytes around the inband option: next header, length, type, data length. */
#define INBAND_DOH_PREFIX 4
/* The Destination Options header that carries an `optlen`-byte option. */
#define INBAND_DOH_LEN(optlen) ((INBAND_DOH_PREFIX + (optlen) + 7) & ~7)
/* The largest header a data-carrying packet gets (124 or 125, authenticated):
 * what MSS clamping subtracts for IPv6. */
#define INBAND_OPT6_DATA_MAX_LEN 24
_Static_assert(INBAND_OPT6_DATA_MAX_LEN == INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_REQUEST_LEN) &&
		       INBAND_OPT6_DATA_MAX_LEN == INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN),
	       "IPv6 MSS clamp covers the largest data-packet option");

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

/* The seed-format IPv6 155; `addr` is 16 bytes in network order. */
static inline void inband_encode_client_tuple6(__u8 *out, const __u8 *addr, __be16 port)
{
	const __u8 *p = (const __u8 *)&port;

	out[0] = INBAND_OPT_CLIENT_TUPLE;
	out[1] = INBAND_OPT6_CLIENT_TUPLE_LEN;
	for (int i = 0; i < 16; i++)
		out[2 + i] = addr[i];
	out[18] = p[0];
	out[19] = p[1];
}

/*
 * Writes the Destination Options header around the `optlen`-byte option
 * already at `out + INBAND_DOH_PREFIX`: its next header, its length, the
 * option's type and data length, and the padding (one PadN, or a Pad1 for a
 * single byte) up to INBAND_DOH_LEN(optlen).
 */
static inline void inband_doh_wrap(__u8 *out, __u8 next_header, __u32 optlen)
{
	__u32 total = INBAND_DOH_LEN(optlen);
	__u32 pad = total - INBAND_DOH_PREFIX - optlen;
	__u8 *p = out + INBAND_DOH_PREFIX + optlen;

	out[0] = next_header;
	out[1] = (__u8)(total / 8 - 1);
	out[2] = INBAND_OPT6_TYPE;
	out[3] = (__u8)optlen;
	if (pad == 1) {
		p[0] = 0; /* Pad1 */
	} else if (pad > 1) {
		p[0] = 1; /* PadN */
		p[1] = (__u8)(pad - 2);
		for (__u32 i = 2; i < pad && i < 8; i++)
			p[i] = 0;
	}
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

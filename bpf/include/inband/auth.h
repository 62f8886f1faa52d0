/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * MACs of the authenticated options (wire.h): what they cover and how the
 * options that carry them are laid out. Shared by the balancer, the agent
 * and host C tests; crates/inband/src/wire.rs is the Rust side, and both
 * are checked against tests/vectors/mac.txt.
 *
 * Every MAC is SipHash-2-4 over one message per address family (32 bytes
 * for IPv4, 64 for IPv6), so one unrolled hash serves all three options.
 * The message binds the option to the connection it travels on as both
 * ends see it (balancer NAT address and port, backend address and port),
 * to its transport (a TCP option cannot be replayed on UDP), to its kind
 * (a 124 cannot be replayed as a 125), and to a nonce: for a 155 the SYN's
 * sequence number (TCP) or the balancer's clock in milliseconds (UDP, which
 * has no sequence number: the agent keeps the newest), and for a 124 and
 * its 125 a random value the balancer picks per request.
 */
#ifndef INBAND_AUTH_H
#define INBAND_AUTH_H

#include <linux/types.h>

#include "inband/siphash.h"
#include "inband/wire.h"

/* auth_keys[key id] in both programs; written by the control planes from
 * the key files of the `[auth]` config section. */
struct inband_auth_key {
	__u64 k0; /* key bytes 0-7, little-endian */
	__u64 k1; /* key bytes 8-15, little-endian */
	__u32 valid; /* 0: no key has this id */
	__u32 pad;
};

/* tag[1]: the transport. 'b' (TCP) is the original format's tag. */
#define INBAND_MAC_TAG_TCP 'b'
#define INBAND_MAC_TAG_UDP 'u'

struct inband_mac_msg {
	__u8 tag[2]; /* 'i', INBAND_MAC_TAG_* */
	__u8 kind; /* option kind */
	__u8 key_id;
	__be32 nonce;
	__be32 lb_addr;
	__be32 backend_addr;
	__be16 snat_port;
	__be16 backend_port;
	__be32 client_addr; /* 155 only, else 0 */
	__be16 client_port; /* 155 only, else 0 */
	__be16 score; /* 125 only, else 0 */
	__u8 zero[4];
} __attribute__((aligned(8)));

_Static_assert(sizeof(struct inband_mac_msg) == 32, "MAC message is four 64-bit words");

/* The IPv6 message: the same fields with 16-byte addresses. */
struct inband_mac_msg6 {
	__u8 tag[2]; /* 'i', INBAND_MAC_TAG_* */
	__u8 kind;
	__u8 key_id;
	__be32 nonce;
	__u8 lb_addr[16];
	__u8 backend_addr[16];
	__u8 client_addr[16]; /* 155 only, else 0 */
	__be16 snat_port;
	__be16 backend_port;
	__be16 client_port; /* 155 only, else 0 */
	__be16 score; /* 125 only, else 0 */
} __attribute__((aligned(8)));

_Static_assert(sizeof(struct inband_mac_msg6) == 64, "IPv6 MAC message is eight 64-bit words");

static inline __attribute__((always_inline)) __u8 inband_mac_tag(__u8 proto)
{
	return proto == 17 /* IPPROTO_UDP */ ? INBAND_MAC_TAG_UDP : INBAND_MAC_TAG_TCP;
}

static inline __attribute__((always_inline)) void
inband_mac_msg_init(struct inband_mac_msg *m, __u8 kind, __u8 key_id, __be32 nonce, __be32 lb_addr,
		    __be16 snat_port, __be32 backend_addr, __be16 backend_port)
{
	__builtin_memset(m, 0, sizeof(*m));
	m->tag[0] = 'i';
	m->tag[1] = INBAND_MAC_TAG_TCP;
	m->kind = kind;
	m->key_id = key_id;
	m->nonce = nonce;
	m->lb_addr = lb_addr;
	m->backend_addr = backend_addr;
	m->snat_port = snat_port;
	m->backend_port = backend_port;
}

/* Addresses are 16 bytes in network order. */
static inline __attribute__((always_inline)) void
inband_mac_msg6_init(struct inband_mac_msg6 *m, __u8 kind, __u8 key_id, __be32 nonce, const __u8 *lb_addr,
		     __be16 snat_port, const __u8 *backend_addr, __be16 backend_port)
{
	__builtin_memset(m, 0, sizeof(*m));
	m->tag[0] = 'i';
	m->tag[1] = INBAND_MAC_TAG_TCP;
	m->kind = kind;
	m->key_id = key_id;
	m->nonce = nonce;
	__builtin_memcpy(m->lb_addr, lb_addr, 16);
	__builtin_memcpy(m->backend_addr, backend_addr, 16);
	m->snat_port = snat_port;
	m->backend_port = backend_port;
}

static inline __attribute__((always_inline)) __u64 inband_mac(const struct inband_auth_key *key,
							    const struct inband_mac_msg *m)
{
	return inband_siphash24_words(key->k0, key->k1, (const __u8 *)m, 4);
}

static inline __attribute__((always_inline)) __u64 inband_mac6(const struct inband_auth_key *key,
							     const struct inband_mac_msg6 *m)
{
	return inband_siphash24_words(key->k0, key->k1, (const __u8 *)m, 8);
}

static inline __attribute__((always_inline)) void inband_put_mac(__u8 *out, __u64 mac)
{
#pragma unroll
	for (int i = 0; i < INBAND_OPT_MAC_LEN; i++)
		out[i] = (__u8)(mac >> (8 * i));
}

static inline __attribute__((always_inline)) __u64 inband_get_mac(const __u8 *in)
{
	return inband_le64(in);
}

/* Offsets of the fields inside the authenticated options. */
#define INBAND_AUTH_TUPLE_KEY_OFF 2
#define INBAND_AUTH_TUPLE_ADDR_OFF 4
#define INBAND_AUTH_REQUEST_KEY_OFF 2
#define INBAND_AUTH_REQUEST_NONCE_OFF 4
#define INBAND_AUTH_REQUEST_MAC_OFF 8
#define INBAND_AUTH_SCORE_SCORE_OFF 2
#define INBAND_AUTH_SCORE_NONCE_OFF 4
#define INBAND_AUTH_SCORE_MAC_OFF 8
/* In a 155 the port follows the address (4 or 16 bytes), then two zero
 * bytes, the stamp (UDP only) and the MAC. */
#define INBAND_AUTH_TUPLE_PORT_OFF(alen) (INBAND_AUTH_TUPLE_ADDR_OFF + (alen))
#define INBAND_AUTH_TUPLE_STAMP_OFF(alen) (INBAND_AUTH_TUPLE_PORT_OFF(alen) + 4)
#define INBAND_AUTH_TUPLE_MAC_OFF(alen, udp) (INBAND_AUTH_TUPLE_STAMP_OFF(alen) + ((udp) ? 4 : 0))

/*
 * The authenticated 155: `addr` is the client address, `alen` (4 or 16)
 * bytes in network order; `udp` adds the stamp. `alen` and `udp` are
 * constants at every call, so the offsets are too.
 */
static inline __attribute__((always_inline)) void inband_encode_auth_client_tuple(__u8 *out, __u8 key_id,
										  const void *addr, const int alen,
										  __be16 port, const int udp,
										  __be32 stamp, __u64 mac)
{
	const int at = INBAND_AUTH_TUPLE_PORT_OFF(alen);

	out[0] = INBAND_OPT_CLIENT_TUPLE;
	out[1] = (__u8)(INBAND_AUTH_TUPLE_MAC_OFF(alen, udp) + INBAND_OPT_MAC_LEN);
	out[2] = key_id;
	out[3] = 0;
	__builtin_memcpy(out + INBAND_AUTH_TUPLE_ADDR_OFF, addr, alen);
	__builtin_memcpy(out + at, &port, 2);
	out[at + 2] = 0;
	out[at + 3] = 0;
	if (udp)
		__builtin_memcpy(out + INBAND_AUTH_TUPLE_STAMP_OFF(alen), &stamp, 4);
	inband_put_mac(out + INBAND_AUTH_TUPLE_MAC_OFF(alen, udp), mac);
}

_Static_assert(INBAND_AUTH_TUPLE_MAC_OFF(4, 0) + INBAND_OPT_MAC_LEN == INBAND_OPT_AUTH_CLIENT_TUPLE_LEN, "v4 155");
_Static_assert(INBAND_AUTH_TUPLE_MAC_OFF(4, 1) + INBAND_OPT_MAC_LEN == INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN,
	       "v4 UDP 155");
_Static_assert(INBAND_AUTH_TUPLE_MAC_OFF(16, 0) + INBAND_OPT_MAC_LEN == INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN, "v6 155");
_Static_assert(INBAND_AUTH_TUPLE_MAC_OFF(16, 1) + INBAND_OPT_MAC_LEN == INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN,
	       "v6 UDP 155");

static inline __attribute__((always_inline)) void inband_encode_auth_score_request(__u8 *out, __u8 key_id,
										   __be32 nonce, __u64 mac)
{
	out[0] = INBAND_OPT_SCORE_REQUEST;
	out[1] = INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
	out[2] = key_id;
	out[3] = 0;
	__builtin_memcpy(out + INBAND_AUTH_REQUEST_NONCE_OFF, &nonce, 4);
	inband_put_mac(out + INBAND_AUTH_REQUEST_MAC_OFF, mac);
}

/* `score` in host order, big-endian on the wire. */
static inline __attribute__((always_inline)) void inband_encode_auth_score(__u8 *out, __u16 score, __be32 nonce,
									   __u64 mac)
{
	out[0] = INBAND_OPT_SCORE;
	out[1] = INBAND_OPT_AUTH_SCORE_LEN;
	out[2] = (__u8)(score >> 8);
	out[3] = (__u8)(score & 0xff);
	__builtin_memcpy(out + INBAND_AUTH_SCORE_NONCE_OFF, &nonce, 4);
	inband_put_mac(out + INBAND_AUTH_SCORE_MAC_OFF, mac);
}

#endif /* INBAND_AUTH_H */

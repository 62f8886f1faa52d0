/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * TCPE (seed 003, chapter 6; issue 29): the TCP options that group the
 * subflows of one connection and tell a peer to add or remove a path.
 * This is the only definition of their bytes: bpf/tcpe.bpf.c writes and
 * parses them, crates/inband-tcpe/src/wire.rs generates its constants and
 * the MAC message from this header. docs/decisions.md ("TCPE handoff")
 * draws them and gives the trust model.
 *
 * Every option is an RFC 6994 experimental option: kind 254, length, a
 * 16-bit experiment ID (ExID, network order), then its data.
 *
 *   connection ID  FE 08 | 05 89 (1417) | id (4)                       SYN, SYN-ACK, 3rd ACK
 *   key            FE 0C | 05 8B (1419) | key (8)                      SYN, SYN-ACK
 *   path, seed     FE 0C | 05 8A (1418) | addr (4) | port (2) | flags | 0
 *   path, IPv4     FE 10 | 05 8A (1418) | addr (4) | port (2) | flags | serial | MAC (4)
 *   path, IPv6     FE 1C | 05 8C (1420) | addr (16) | port (2) | flags | serial | MAC (4)
 *
 * The seed's path option (length 12) is the seed's format byte for byte;
 * it carries no MAC and receivers refuse it (counted). The authenticated
 * formats are told apart by ExID and length; a path option rides only on
 * pure ACKs (no data, ACK alone), so it never changes a segment that
 * carries sequence space. Addresses and ports are in network order, the
 * key and the MAC little-endian (as auth.h's MACs).
 *
 * Flags: bits 7-4 the path's priority, bit 3 create (1) or remove (0),
 * bits 2-0 zero (a receiver refuses other values).
 *
 * Space (40 option bytes per segment): a SYN or SYN-ACK with MSS, SACK
 * permitted, timestamps and window scale carries 20 bytes of the kernel's
 * options, leaving exactly the 20 of connection ID + key. A pure ACK with
 * timestamps carries 12, leaving 28: the IPv6 path option fills it, which
 * is why its MAC is 4 bytes (and why it cannot ride beside SACK blocks).
 *
 * Included by BPF programs and by bindgen: fixed-width types, no helpers.
 */
#ifndef INBAND_TCPE_WIRE_H
#define INBAND_TCPE_WIRE_H

#include <linux/types.h>

#define INBAND_TCPE_KIND 254
#define INBAND_TCPE_EXID_CONN_ID 1417
#define INBAND_TCPE_EXID_PATH4 1418
#define INBAND_TCPE_EXID_KEY 1419
#define INBAND_TCPE_EXID_PATH6 1420

/* kind, length, ExID */
#define INBAND_TCPE_HDR_LEN 4
#define INBAND_TCPE_CONN_ID_LEN 8
#define INBAND_TCPE_KEY_LEN 12
/* What a SYN and a SYN-ACK carry: connection ID and key. */
#define INBAND_TCPE_HANDSHAKE_LEN (INBAND_TCPE_CONN_ID_LEN + INBAND_TCPE_KEY_LEN)

/* Path options: offsets by address length (4 or 16). */
#define INBAND_TCPE_PATH_ADDR_OFF 4
#define INBAND_TCPE_PATH_PORT_OFF(alen) (INBAND_TCPE_PATH_ADDR_OFF + (alen))
#define INBAND_TCPE_PATH_FLAGS_OFF(alen) (INBAND_TCPE_PATH_PORT_OFF(alen) + 2)
#define INBAND_TCPE_PATH_SERIAL_OFF(alen) (INBAND_TCPE_PATH_FLAGS_OFF(alen) + 1)
#define INBAND_TCPE_PATH_MAC_OFF(alen) (INBAND_TCPE_PATH_SERIAL_OFF(alen) + 1)
#define INBAND_TCPE_MAC_LEN 4
#define INBAND_TCPE_PATH_LEN(alen) (INBAND_TCPE_PATH_MAC_OFF(alen) + INBAND_TCPE_MAC_LEN)
#define INBAND_TCPE_PATH4_SEED_LEN 12
#define INBAND_TCPE_PATH4_LEN 16
#define INBAND_TCPE_PATH6_LEN 28
_Static_assert(INBAND_TCPE_PATH_LEN(4) == INBAND_TCPE_PATH4_LEN, "IPv4 path option");
_Static_assert(INBAND_TCPE_PATH_LEN(16) == INBAND_TCPE_PATH6_LEN, "IPv6 path option");
_Static_assert(INBAND_TCPE_PATH_MAC_OFF(4) == INBAND_TCPE_PATH4_SEED_LEN, "the seed's option is ours without MAC");
/* The largest path option: what a pure ACK with timestamps leaves (40 - 12). */
#define INBAND_TCPE_PATH_MAX_LEN INBAND_TCPE_PATH6_LEN

#define INBAND_TCPE_FLAG_CREATE 0x08
#define INBAND_TCPE_FLAG_RESERVED 0x07
#define INBAND_TCPE_PRIO_SHIFT 4

/* A sender's role, in the MAC message: a notification cannot be reflected
 * back to its sender. */
enum inband_tcpe_role {
	INBAND_TCPE_ACTIVE = 1, /* opened the connection (the client) */
	INBAND_TCPE_PASSIVE = 2, /* accepted it (the balancer, later the server) */
};

/*
 * The MAC of a path option: SipHash-2-4 over this message, keyed by the two
 * halves the handshake exchanged (k0 = the active side's key, k1 = the
 * passive side's, each the little-endian value of its 8 wire bytes); the
 * option carries the low 4 bytes of the result, little-endian.
 */
struct inband_tcpe_mac_msg {
	__u8 tag[4]; /* 'T', 'C', 'P', 'E' */
	__be32 conn_id;
	__u8 dir; /* enum inband_tcpe_role of the sender */
	__u8 family; /* 4 or 6 */
	__u8 flags;
	__u8 serial;
	__be16 port;
	__u8 zero[2];
	__u8 addr[16]; /* an IPv4 address in the first 4 bytes, the rest zero */
} __attribute__((aligned(8)));

_Static_assert(sizeof(struct inband_tcpe_mac_msg) == 32, "TCPE MAC message is four 64-bit words");

/*
 * The passive side's key half is not stored between SYN and accept (a
 * request socket has no storage): it is SipHash-2-4 of this message under
 * the program's secret (inband_tcpe_config), computed again from the saved
 * SYN when the connection is established. Addresses and ports as the
 * kernel's bpf_sock_ops shows them, an IPv4 address as ::ffff:a.b.c.d (so
 * that an IPv6 listener's IPv4-mapped connections agree with its requests).
 */
struct inband_tcpe_key_msg {
	__u8 tag[8]; /* 'T', 'C', 'P', 'E', '-', 'k', 'e', 'y' */
	__u64 key_active;
	__be32 conn_id;
	__u32 local_port;
	__u32 remote_port;
	__u32 zero;
	__u32 local_ip[4];
	__u32 remote_ip[4];
} __attribute__((aligned(8)));

_Static_assert(sizeof(struct inband_tcpe_key_msg) == 64, "TCPE key message is eight 64-bit words");

#endif /* INBAND_TCPE_WIRE_H */

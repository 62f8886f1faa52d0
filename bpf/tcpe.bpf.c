// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * TCPE's first layer (seed 003, chapter 6; issue 29): the options of
 * bpf/include/inband/tcpe/wire.h written and parsed by one sockops program
 * on a cgroup v2. The formats and the trust model are in docs/decisions.md
 * ("TCPE handoff").
 *
 * - A socket opts in through tcpe_ctl before connect() (its SYN offers a
 *   connection ID and a key half) or before listen() (its SYN-ACKs answer
 *   offers with the ID and the passive key half).
 * - The handshake's outcome lives in tcpe_sock, the socket's storage (gone
 *   with the socket): CAPABLE once each side knows the other speaks TCPE.
 *   The client confirms on its third ACK; a connection that does not
 *   finish the exchange is plain TCP for its life, with the reason.
 * - A path notification user space puts in tcpe_ctl.out rides on the
 *   connection's pure ACKs, with a MAC under the two key halves; the peer
 *   verifies it and keeps the newest serial in tcpe_sock.in. Everything
 *   refused is counted in tcpe_stats by reason.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/siphash.h"
#include "inband/tcpe/maps.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AF_INET 2
#define AF_INET6 10
#define SOL_TCP 6
#define ENOENT 2
#define ENOSPC 28

#define TCPHDR_FIN 0x01
#define TCPHDR_SYN 0x02
#define TCPHDR_RST 0x04
#define TCPHDR_PSH 0x08
#define TCPHDR_ACK 0x10
#define TCPHDR_URG 0x20

#define TCPE_CB_FLAGS (BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG | BPF_SOCK_OPS_PARSE_UNKNOWN_HDR_OPT_CB_FLAG)

static __always_inline void count(__u32 counter)
{
	__u64 *c = bpf_map_lookup_elem(&tcpe_stats, &counter);

	if (c)
		(*c)++;
}

/* Byte-wise: option data sits at any offset of a stack buffer, and the
 * verifier refuses misaligned stack loads. */
static __always_inline __u64 get_le64(const __u8 *p)
{
	__u64 v = 0;

#pragma unroll
	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static __always_inline void put_le64(__u8 *p, __u64 v)
{
#pragma unroll
	for (int i = 0; i < 8; i++)
		p[i] = (__u8)(v >> (8 * i));
}

static __always_inline __u32 get_be32(const __u8 *p)
{
	return ((__u32)p[0] << 24) | ((__u32)p[1] << 16) | ((__u32)p[2] << 8) | p[3];
}

static __always_inline void put_be32(__u8 *p, __u32 v)
{
	p[0] = (__u8)(v >> 24);
	p[1] = (__u8)(v >> 16);
	p[2] = (__u8)(v >> 8);
	p[3] = (__u8)v;
}

static __always_inline void put_hdr(__u8 *p, __u8 len, __u16 exid)
{
	p[0] = INBAND_TCPE_KIND;
	p[1] = len;
	p[2] = (__u8)(exid >> 8);
	p[3] = (__u8)exid;
}

/* Finds the option of `exid` in the segment (flags 0) or in the SYN
 * (BPF_LOAD_HDR_OPT_TCP_SYN) and copies it into the array `buf`: its
 * length, or the helper's error (-ENOSPC: longer than the array). */
#define load_opt(skops, exid, buf, flags)                                    \
	({                                                                   \
		__builtin_memset(buf, 0, sizeof(buf));                       \
		put_hdr(buf, INBAND_TCPE_HDR_LEN, exid);                     \
		bpf_load_hdr_opt(skops, buf, sizeof(buf), flags);            \
	})

/* A context field read at its own offset: the verifier refuses a load
 * through a context pointer the compiler moved (base + offset). */
#define ctx_u32(field) (*(volatile __u32 *)&(field))

struct handshake {
	__u32 conn_id; /* host order */
	__u64 key;
};

/* The connection ID and key options of a SYN or SYN-ACK: 0, or the
 * helper's error for the ID (-ENOENT: no SYN saved), or -1. */
static __always_inline int read_handshake(struct bpf_sock_ops *skops, __u64 flags, struct handshake *h)
{
	__u8 id[INBAND_TCPE_CONN_ID_LEN];
	__u8 key[INBAND_TCPE_KEY_LEN];
	int n;

	n = load_opt(skops, INBAND_TCPE_EXID_CONN_ID, id, flags);
	if (n < 0)
		return n;
	if (n != INBAND_TCPE_CONN_ID_LEN)
		return -1;
	if (load_opt(skops, INBAND_TCPE_EXID_KEY, key, flags) != INBAND_TCPE_KEY_LEN)
		return -1;
	h->conn_id = get_be32(id + INBAND_TCPE_HDR_LEN);
	h->key = get_le64(key + INBAND_TCPE_HDR_LEN);
	return 0;
}

/* The passive key half of a connection (wire.h, struct
 * inband_tcpe_key_msg): the same value at the SYN-ACK (a request socket)
 * and when the connection is established (its full socket). IPv4 as
 * ::ffff:a.b.c.d, so an IPv6 listener's IPv4-mapped sockets agree too. */
static __always_inline int passive_key(struct bpf_sock_ops *skops, __u32 conn_id, __u64 key_active, __u64 *out)
{
	struct inband_tcpe_key_msg m;
	struct inband_tcpe_config *cfg;
	__u32 zero = 0, family, l4, r4, l6[4], r6[4];

	cfg = bpf_map_lookup_elem(&tcpe_config, &zero);
	if (!cfg || !(cfg->secret_k0 | cfg->secret_k1))
		return -1;
	__builtin_memset(&m, 0, sizeof(m));
	__builtin_memcpy(m.tag, "TCPE-key", 8);
	m.key_active = key_active;
	m.conn_id = bpf_htonl(conn_id);
	m.local_port = ctx_u32(skops->local_port);
	m.remote_port = ctx_u32(skops->remote_port);
	/* Every address field is read whatever the family: loads in both
	 * arms of a branch are merged into one through a moved pointer. */
	family = ctx_u32(skops->family);
	l4 = ctx_u32(skops->local_ip4);
	r4 = ctx_u32(skops->remote_ip4);
	l6[0] = ctx_u32(skops->local_ip6[0]);
	l6[1] = ctx_u32(skops->local_ip6[1]);
	l6[2] = ctx_u32(skops->local_ip6[2]);
	l6[3] = ctx_u32(skops->local_ip6[3]);
	r6[0] = ctx_u32(skops->remote_ip6[0]);
	r6[1] = ctx_u32(skops->remote_ip6[1]);
	r6[2] = ctx_u32(skops->remote_ip6[2]);
	r6[3] = ctx_u32(skops->remote_ip6[3]);
	if (family == AF_INET) {
		m.local_ip[2] = bpf_htonl(0xffff);
		m.local_ip[3] = l4;
		m.remote_ip[2] = bpf_htonl(0xffff);
		m.remote_ip[3] = r4;
	} else if (family == AF_INET6) {
		__builtin_memcpy(m.local_ip, l6, 16);
		__builtin_memcpy(m.remote_ip, r6, 16);
	} else {
		return -1;
	}
	*out = inband_siphash24_words(cfg->secret_k0, cfg->secret_k1, (const __u8 *)&m, 8);
	return 0;
}

/* The 4-byte MAC of `p` sent by `dir` on the connection of `s`. */
static __always_inline __u32 path_mac(const struct inband_tcpe_sock *s, __u8 dir, const struct inband_tcpe_path *p)
{
	struct inband_tcpe_mac_msg m;

	__builtin_memset(&m, 0, sizeof(m));
	__builtin_memcpy(m.tag, "TCPE", 4);
	m.conn_id = bpf_htonl(s->conn_id);
	m.dir = dir;
	m.family = p->family;
	m.flags = p->flags;
	m.serial = p->serial;
	m.port = p->port;
	if (p->family == 4)
		__builtin_memcpy(m.addr, p->addr, 4);
	else
		__builtin_memcpy(m.addr, p->addr, 16);
	return (__u32)inband_siphash24_words(s->key_active, s->key_passive, (const __u8 *)&m, 4);
}

static __always_inline __u32 path_len(const struct inband_tcpe_path *p)
{
	if (p->flags & INBAND_TCPE_FLAG_RESERVED)
		return 0;
	if (p->family == 4)
		return INBAND_TCPE_PATH4_LEN;
	if (p->family == 6)
		return INBAND_TCPE_PATH6_LEN;
	return 0;
}

/* Writes the path option of `p` (address length `alen`, a constant). */
#define put_path(buf, alen, exid, p, mac)                                                  \
	do {                                                                               \
		put_hdr(buf, INBAND_TCPE_PATH_LEN(alen), exid);                            \
		__builtin_memcpy(buf + INBAND_TCPE_PATH_ADDR_OFF, (p)->addr, alen);        \
		__builtin_memcpy(buf + INBAND_TCPE_PATH_PORT_OFF(alen), &(p)->port, 2);    \
		buf[INBAND_TCPE_PATH_FLAGS_OFF(alen)] = (p)->flags;                        \
		buf[INBAND_TCPE_PATH_SERIAL_OFF(alen)] = (p)->serial;                      \
		buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 0] = (__u8)(mac);                     \
		buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 1] = (__u8)((mac) >> 8);              \
		buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 2] = (__u8)((mac) >> 16);             \
		buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 3] = (__u8)((mac) >> 24);             \
	} while (0)

/* Reads the path option in buf (address length `alen`) into *p; the MAC
 * into *mac. */
#define get_path(buf, alen, p, mac)                                                        \
	do {                                                                               \
		__builtin_memset(p, 0, sizeof(*(p)));                                      \
		(p)->family = (alen) == 4 ? 4 : 6;                                         \
		__builtin_memcpy((p)->addr, buf + INBAND_TCPE_PATH_ADDR_OFF, alen);        \
		__builtin_memcpy(&(p)->port, buf + INBAND_TCPE_PATH_PORT_OFF(alen), 2);    \
		(p)->flags = buf[INBAND_TCPE_PATH_FLAGS_OFF(alen)];                        \
		(p)->serial = buf[INBAND_TCPE_PATH_SERIAL_OFF(alen)];                      \
		*(mac) = (__u32)buf[INBAND_TCPE_PATH_MAC_OFF(alen)] |                      \
			 ((__u32)buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 1] << 8) |           \
			 ((__u32)buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 2] << 16) |          \
			 ((__u32)buf[INBAND_TCPE_PATH_MAC_OFF(alen) + 3] << 24);           \
	} while (0)

/* A pure ACK: no data, and no flag that takes sequence space or asks for
 * anything but acknowledgement (ECN's bits may ride along). */
static __always_inline int pure_ack_flags(__u32 flags)
{
	return (flags & TCPHDR_ACK) && !(flags & (TCPHDR_SYN | TCPHDR_FIN | TCPHDR_RST | TCPHDR_PSH | TCPHDR_URG));
}

static __always_inline void fallback(struct bpf_sock_ops *skops, struct inband_tcpe_sock *s, __u32 reason)
{
	s->state = INBAND_TCPE_STATE_FALLBACK;
	s->reason = reason;
	count(reason);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~TCPE_CB_FLAGS);
}

/* ---- opting in ------------------------------------------------------------ */

/* The key of the socket's local address and port in tcpe_listeners; the
 * wildcard key (no address) if `wildcard`, or if the socket is bound to
 * none (0.0.0.0 or ::: a listener's own key, which an IPv6 listener's
 * IPv4 connections find too). Every field is read whatever the family, as
 * in passive_key. */
static __always_inline void listener_key(struct bpf_sock_ops *skops, struct inband_tcpe_listener *k, int wildcard)
{
	__u32 family = ctx_u32(skops->family), l4 = ctx_u32(skops->local_ip4), l6[4], a[4] = {};

	l6[0] = ctx_u32(skops->local_ip6[0]);
	l6[1] = ctx_u32(skops->local_ip6[1]);
	l6[2] = ctx_u32(skops->local_ip6[2]);
	l6[3] = ctx_u32(skops->local_ip6[3]);
	if (family == AF_INET6) {
		__builtin_memcpy(a, l6, sizeof(a));
	} else {
		a[2] = l4 ? bpf_htonl(0xffff) : 0;
		a[3] = l4;
	}
	if (wildcard)
		__builtin_memset(a, 0, sizeof(a));
	__builtin_memcpy(k->addr, a, sizeof(a));
	k->port = ctx_u32(skops->local_port);
}

/* The segment at hand (a SYN-ACK, or the ACK that completes a passive
 * handshake) belongs to a listener this program's user opted in. */
static __always_inline int own_listener(struct bpf_sock_ops *skops)
{
	struct inband_tcpe_listener k;

	listener_key(skops, &k, 0);
	if (bpf_map_lookup_elem(&tcpe_listeners, &k))
		return 1;
	listener_key(skops, &k, 1);
	return bpf_map_lookup_elem(&tcpe_listeners, &k) != NULL;
}

static __always_inline void on_listen(struct bpf_sock_ops *skops)
{
	struct inband_tcpe_listener k;
	struct inband_tcpe_ctl *ctl;
	struct bpf_sock *sk = skops->sk;
	__u32 one = 1, *n;

	if (!sk)
		return;
	ctl = bpf_sk_storage_get(&tcpe_ctl, sk, 0, 0);
	if (!ctl || !ctl->enable)
		return;
	/* An accepted connection reads the client's offer from its SYN. */
	if (bpf_setsockopt(skops, SOL_TCP, TCP_SAVE_SYN, &one, sizeof(one)))
		return;
	listener_key(skops, &k, 0);
	n = bpf_map_lookup_elem(&tcpe_listeners, &k);
	if (n) {
		__sync_fetch_and_add(n, 1);
	} else if (bpf_map_update_elem(&tcpe_listeners, &k, &one, BPF_NOEXIST)) {
		/* Another socket of the same address may have just added it. */
		n = bpf_map_lookup_elem(&tcpe_listeners, &k);
		if (!n) {
			count(INBAND_TCPE_FALLBACK_LISTENERS_FULL);
			return;
		}
		__sync_fetch_and_add(n, 1);
	}
	/* The state callback removes the entry when the listener closes;
	 * accepted connections drop it (on_passive_established). */
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | TCPE_CB_FLAGS | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/* A listener of this program's user closed: its share of the entry goes. */
static __always_inline void on_listener_close(struct bpf_sock_ops *skops)
{
	struct inband_tcpe_listener k;
	struct inband_tcpe_ctl *ctl;
	struct bpf_sock *sk = skops->sk;
	__u32 *n;

	if (!sk)
		return;
	ctl = bpf_sk_storage_get(&tcpe_ctl, sk, 0, 0);
	if (!ctl || !ctl->enable)
		return;
	listener_key(skops, &k, 0);
	n = bpf_map_lookup_elem(&tcpe_listeners, &k);
	if (n && __sync_fetch_and_add(n, -1) <= 1)
		bpf_map_delete_elem(&tcpe_listeners, &k);
}

static __always_inline void on_connect(struct bpf_sock_ops *skops)
{
	struct inband_tcpe_ctl *ctl;
	struct inband_tcpe_sock *s;
	struct bpf_sock *sk = skops->sk;

	if (!sk)
		return;
	ctl = bpf_sk_storage_get(&tcpe_ctl, sk, 0, 0);
	if (!ctl || !ctl->enable)
		return;
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!s) {
		count(INBAND_TCPE_FALLBACK_NO_MEMORY);
		return;
	}
	__builtin_memset(s, 0, sizeof(*s));
	s->state = INBAND_TCPE_STATE_OFFERED;
	s->role = INBAND_TCPE_ACTIVE;
	s->conn_id = ctl->conn_id;
	s->key_active = ctl->key;
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | TCPE_CB_FLAGS);
}

/* ---- the handshake -------------------------------------------------------- */

/* The state of a connecting socket that offers TCPE on its SYN, or NULL. */
static __always_inline struct inband_tcpe_sock *offering(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct inband_tcpe_sock *s;

	if (!sk)
		return NULL;
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, 0);
	return s && s->state == INBAND_TCPE_STATE_OFFERED ? s : NULL;
}

static __always_inline void syn_len(struct bpf_sock_ops *skops)
{
	struct inband_tcpe_sock *s = offering(skops);

	if (!s)
		return;
	if (bpf_reserve_hdr_opt(skops, INBAND_TCPE_HANDSHAKE_LEN, 0))
		fallback(skops, s, INBAND_TCPE_FALLBACK_NO_SPACE);
}

static __always_inline void syn_write(struct bpf_sock_ops *skops)
{
	__u8 id[INBAND_TCPE_CONN_ID_LEN], key[INBAND_TCPE_KEY_LEN];
	struct inband_tcpe_sock *s = offering(skops);

	if (!s)
		return;
	put_hdr(id, INBAND_TCPE_CONN_ID_LEN, INBAND_TCPE_EXID_CONN_ID);
	put_be32(id + INBAND_TCPE_HDR_LEN, s->conn_id);
	put_hdr(key, INBAND_TCPE_KEY_LEN, INBAND_TCPE_EXID_KEY);
	put_le64(key + INBAND_TCPE_HDR_LEN, s->key_active);
	/* Reserved in syn_len: the key's failure leaves an ID alone, which
	 * a listener does not answer. */
	if (bpf_store_hdr_opt(skops, id, sizeof(id), 0) || bpf_store_hdr_opt(skops, key, sizeof(key), 0))
		return;
	count(INBAND_TCPE_SYN_OFFERED);
}

/* A listener opted in (these callbacks run only then, for every program
 * on the cgroup): if it is this program's, an offer in the SYN is
 * answered unless the kernel answers with a SYN cookie, whose connection
 * keeps no SYN to read the offer from later. */
static __always_inline void synack_len(struct bpf_sock_ops *skops)
{
	struct inband_tcpe_config *cfg;
	struct handshake h;
	__u32 zero = 0;

	if (!own_listener(skops))
		return;
	/* Without the secret there is no key half to answer with. */
	cfg = bpf_map_lookup_elem(&tcpe_config, &zero);
	if (!cfg || !(cfg->secret_k0 | cfg->secret_k1))
		return;
	if (read_handshake(skops, BPF_LOAD_HDR_OPT_TCP_SYN, &h))
		return;
	if (skops->args[0] == BPF_WRITE_HDR_TCP_SYNACK_COOKIE) {
		count(INBAND_TCPE_FALLBACK_SYN_COOKIE);
		return;
	}
	if (bpf_reserve_hdr_opt(skops, INBAND_TCPE_HANDSHAKE_LEN, 0))
		count(INBAND_TCPE_FALLBACK_NO_SPACE);
}

static __always_inline void synack_write(struct bpf_sock_ops *skops)
{
	__u8 id[INBAND_TCPE_CONN_ID_LEN], key[INBAND_TCPE_KEY_LEN];
	struct handshake h;
	__u64 kp;

	/* Another program's listener: its room is that program's to fill. */
	if (skops->args[0] == BPF_WRITE_HDR_TCP_SYNACK_COOKIE || !own_listener(skops))
		return;
	if (read_handshake(skops, BPF_LOAD_HDR_OPT_TCP_SYN, &h) || passive_key(skops, h.conn_id, h.key, &kp))
		return;
	put_hdr(id, INBAND_TCPE_CONN_ID_LEN, INBAND_TCPE_EXID_CONN_ID);
	put_be32(id + INBAND_TCPE_HDR_LEN, h.conn_id);
	put_hdr(key, INBAND_TCPE_KEY_LEN, INBAND_TCPE_EXID_KEY);
	put_le64(key + INBAND_TCPE_HDR_LEN, kp);
	if (bpf_store_hdr_opt(skops, id, sizeof(id), 0) || bpf_store_hdr_opt(skops, key, sizeof(key), 0))
		return;
	count(INBAND_TCPE_SYN_ANSWERED);
}

/* skops->skb is the SYN-ACK. */
static __always_inline void on_active_established(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct inband_tcpe_sock *s;
	struct handshake h;

	if (!sk)
		return;
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, 0);
	if (!s || s->state != INBAND_TCPE_STATE_OFFERED)
		return;
	if (read_handshake(skops, 0, &h) || h.conn_id != s->conn_id) {
		fallback(skops, s, INBAND_TCPE_FALLBACK_NOT_ANSWERED);
		return;
	}
	s->key_passive = h.key;
	s->state = INBAND_TCPE_STATE_CAPABLE;
	s->confirm_pending = 1;
	count(INBAND_TCPE_ACTIVE_CAPABLE);
}

/* The connection ID in the segment at hand is `id`'s: the client's
 * confirmation. */
static __always_inline int confirmed(struct bpf_sock_ops *skops, __u32 id)
{
	__u8 buf[INBAND_TCPE_CONN_ID_LEN];

	return load_opt(skops, INBAND_TCPE_EXID_CONN_ID, buf, 0) == INBAND_TCPE_CONN_ID_LEN &&
	       get_be32(buf + INBAND_TCPE_HDR_LEN) == id;
}

/* skops->skb is the ACK that completed the handshake; the SYN was saved. */
static __always_inline void on_passive_established(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct inband_tcpe_sock *s;
	struct handshake h;
	__u64 kp;
	int err;

	/* A connection inherits its listener's callback flags: without them
	 * the listener did not opt in, and its connections (the host's other
	 * servers in this cgroup) are none of TCPE's business, nor counted;
	 * with them, the listener may be another program's. */
	if (!sk || !(skops->bpf_sock_ops_cb_flags & TCPE_CB_FLAGS) || !own_listener(skops))
		return;
	/* The listener's close callback is not the connection's. */
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_STATE_CB_FLAG);
	err = read_handshake(skops, BPF_LOAD_HDR_OPT_TCP_SYN, &h);
	if (err || passive_key(skops, h.conn_id, h.key, &kp)) {
		count(err == -ENOENT ? INBAND_TCPE_FALLBACK_NO_SYN : INBAND_TCPE_PASSIVE_NOT_OFFERED);
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~TCPE_CB_FLAGS);
		return;
	}
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!s) {
		count(INBAND_TCPE_FALLBACK_NO_MEMORY);
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~TCPE_CB_FLAGS);
		return;
	}
	__builtin_memset(s, 0, sizeof(*s));
	s->role = INBAND_TCPE_PASSIVE;
	s->conn_id = h.conn_id;
	s->key_active = h.key;
	s->key_passive = kp;
	if (confirmed(skops, h.conn_id)) {
		s->state = INBAND_TCPE_STATE_CAPABLE;
		count(INBAND_TCPE_PASSIVE_CAPABLE);
	} else {
		s->state = INBAND_TCPE_STATE_UNCONFIRMED;
	}
}

/* ---- established: confirmation and notifications on pure ACKs ----------- */

static __always_inline void ack_len(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct inband_tcpe_ctl *ctl;
	struct inband_tcpe_sock *s;
	__u32 confirm = 0, plen = 0;

	/* tcp_current_mss() asks without a segment: nothing is added to
	 * data segments, so the MSS stays as it is. */
	if (skops->args[0] == BPF_WRITE_HDR_TCP_CURRENT_MSS || !sk)
		return;
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, 0);
	if (!s)
		return;
	s->reserved_len = 0;
	/* Before the header is pushed skb_len is the payload's length. */
	if (!pure_ack_flags(skops->skb_tcp_flags) || skops->skb_len != 0)
		return;
	if (s->state != INBAND_TCPE_STATE_CAPABLE)
		return;
	if (s->confirm_pending)
		confirm = INBAND_TCPE_CONN_ID_LEN;
	ctl = bpf_sk_storage_get(&tcpe_ctl, sk, 0, 0);
	if (ctl && ctl->out.family) {
		plen = path_len(&ctl->out);
		if (!plen)
			count(INBAND_TCPE_PATH_BAD_QUEUED);
	}
	if (!confirm && !plen)
		return;
	if (!bpf_reserve_hdr_opt(skops, confirm + plen, 0)) {
		s->reserved_len = confirm + plen;
		return;
	}
	if (plen)
		count(INBAND_TCPE_PATH_NO_SPACE);
	if (confirm && !bpf_reserve_hdr_opt(skops, confirm, 0))
		s->reserved_len = confirm;
}

static __always_inline void ack_write(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	__u8 buf[INBAND_TCPE_PATH_MAX_LEN];
	struct inband_tcpe_path p;
	struct inband_tcpe_ctl *ctl;
	struct inband_tcpe_sock *s;
	__u32 len, mac;

	if (!sk)
		return;
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, 0);
	if (!s)
		return;
	len = s->reserved_len;
	s->reserved_len = 0;
	if (!len)
		return;
	if (s->confirm_pending && len >= INBAND_TCPE_CONN_ID_LEN) {
		__u8 id[INBAND_TCPE_CONN_ID_LEN];

		put_hdr(id, INBAND_TCPE_CONN_ID_LEN, INBAND_TCPE_EXID_CONN_ID);
		put_be32(id + INBAND_TCPE_HDR_LEN, s->conn_id);
		if (!bpf_store_hdr_opt(skops, id, sizeof(id), 0)) {
			s->confirm_pending = 0;
			len -= INBAND_TCPE_CONN_ID_LEN;
			count(INBAND_TCPE_CONFIRM_WRITTEN);
		}
	}
	if (!len)
		return;
	ctl = bpf_sk_storage_get(&tcpe_ctl, sk, 0, 0);
	if (!ctl)
		return;
	/* A copy: user space may replace the notification meanwhile, and the
	 * MAC must cover the bytes that go out. */
	__builtin_memcpy(&p, &ctl->out, sizeof(p));
	/* Replaced by a longer one since the space was reserved: the next
	 * pure ACK carries it. */
	if (!path_len(&p) || path_len(&p) > len)
		return;
	mac = path_mac(s, s->role, &p);
	if (p.family == 4) {
		put_path(buf, 4, INBAND_TCPE_EXID_PATH4, &p, mac);
		if (bpf_store_hdr_opt(skops, buf, INBAND_TCPE_PATH4_LEN, 0))
			return;
	} else {
		put_path(buf, 16, INBAND_TCPE_EXID_PATH6, &p, mac);
		if (bpf_store_hdr_opt(skops, buf, INBAND_TCPE_PATH6_LEN, 0))
			return;
	}
	s->out_written++;
	s->out_serial = p.serial;
	count(INBAND_TCPE_PATH_WRITTEN);
}

/* The segment's payload length: skb_len covers the TCP header and data. */
static __always_inline int has_payload(struct bpf_sock_ops *skops)
{
	struct tcphdr *th = skops->skb_data;

	if ((void *)(th + 1) > skops->skb_data_end)
		return 1;
	return skops->skb_len > (__u32)th->doff * 4;
}

/* A path option `n` bytes long (or the helper's error) is in buf. */
static __always_inline void take_path(struct bpf_sock_ops *skops, struct inband_tcpe_sock *s, __u8 *buf, int n,
				      int v6)
{
	struct inband_tcpe_path p;
	__u32 mac, want;
	__u8 ahead;

	if (s->state != INBAND_TCPE_STATE_CAPABLE) {
		count(INBAND_TCPE_PATH_NOT_CAPABLE);
		return;
	}
	if (!pure_ack_flags(skops->skb_tcp_flags) || has_payload(skops)) {
		count(INBAND_TCPE_PATH_ON_DATA);
		return;
	}
	if (!v6 && n == INBAND_TCPE_PATH4_SEED_LEN) {
		count(INBAND_TCPE_PATH_UNAUTHENTICATED);
		return;
	}
	if (v6 ? n != INBAND_TCPE_PATH6_LEN : n != INBAND_TCPE_PATH4_LEN) {
		count(INBAND_TCPE_PATH_MALFORMED);
		return;
	}
	if (v6)
		get_path(buf, 16, &p, &mac);
	else
		get_path(buf, 4, &p, &mac);
	if (p.flags & INBAND_TCPE_FLAG_RESERVED) {
		count(INBAND_TCPE_PATH_MALFORMED);
		return;
	}
	want = path_mac(s, s->role == INBAND_TCPE_ACTIVE ? INBAND_TCPE_PASSIVE : INBAND_TCPE_ACTIVE, &p);
	if (want != mac) {
		count(INBAND_TCPE_PATH_BAD_MAC);
		if (++s->bad_mac >= INBAND_TCPE_MAX_BAD_MAC)
			fallback(skops, s, INBAND_TCPE_FALLBACK_BAD_MAC_LIMIT);
		return;
	}
	ahead = (__u8)(p.serial - s->in.serial);
	if (ahead == 0 && s->in_accepted) {
		s->in_repeats++;
		count(INBAND_TCPE_PATH_REPEAT);
		return;
	}
	if (ahead == 0 || ahead > INBAND_TCPE_SERIAL_WINDOW) {
		count(INBAND_TCPE_PATH_STALE);
		return;
	}
	__builtin_memcpy(&s->in, &p, sizeof(p));
	s->in_accepted++;
	count(INBAND_TCPE_PATH_ACCEPTED);
	if (s->role == INBAND_TCPE_ACTIVE && bpf_ringbuf_output(&tcpe_paths, &s->conn_id, sizeof(s->conn_id), 0))
		count(INBAND_TCPE_PATH_EVENT_LOST);
}

static __always_inline void on_parse(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	__u8 buf[INBAND_TCPE_PATH_MAX_LEN];
	struct inband_tcpe_sock *s;
	int n;

	if (!sk)
		return;
	s = bpf_sk_storage_get(&tcpe_sock, sk, 0, 0);
	if (!s)
		return;
	if (s->state == INBAND_TCPE_STATE_UNCONFIRMED && confirmed(skops, s->conn_id)) {
		s->state = INBAND_TCPE_STATE_CAPABLE;
		count(INBAND_TCPE_PASSIVE_CAPABLE);
	}
	n = load_opt(skops, INBAND_TCPE_EXID_PATH4, buf, 0);
	if (n > 0 || n == -ENOSPC)
		take_path(skops, s, buf, n, 0);
	n = load_opt(skops, INBAND_TCPE_EXID_PATH6, buf, 0);
	if (n > 0 || n == -ENOSPC)
		take_path(skops, s, buf, n, 1);
}

/* Room for an option is reserved (`write` 0), then the option written
 * (`write` 1), for the same segment: its flags decide which option. */
static __always_inline void on_header_option(struct bpf_sock_ops *skops, int write)
{
	__u32 flags = skops->skb_tcp_flags;

	if ((flags & (TCPHDR_SYN | TCPHDR_ACK)) == (TCPHDR_SYN | TCPHDR_ACK))
		write ? synack_write(skops) : synack_len(skops);
	else if (flags & TCPHDR_SYN)
		write ? syn_write(skops) : syn_len(skops);
	else
		write ? ack_write(skops) : ack_len(skops);
}

SEC("sockops")
int tcpe_sockops(struct bpf_sock_ops *skops)
{
	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_LISTEN_CB:
		on_listen(skops);
		break;
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		on_connect(skops);
		break;
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		on_header_option(skops, 0);
		break;
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB:
		on_header_option(skops, 1);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		on_active_established(skops);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		on_passive_established(skops);
		break;
	case BPF_SOCK_OPS_PARSE_HDR_OPT_CB:
		on_parse(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[0] == BPF_TCP_LISTEN && skops->args[1] == BPF_TCP_CLOSE)
			on_listener_close(skops);
		break;
	}
	return 1;
}

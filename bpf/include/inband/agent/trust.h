/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What the agent checks before an option from a balancer may change its
 * state (docs/agent.md, "Trust model"): the configured format, the MACs of
 * the authenticated format, that a TCP client tuple does not take over a
 * connection a socket already owns, and that a UDP one is not older than
 * what its balancer sent since (a replay). The owner of a tuple is also
 * what tells a SYN that reopens a TIME_WAIT (time_wait.h).
 */
#ifndef INBAND_AGENT_TRUST_H
#define INBAND_AGENT_TRUST_H

#include <linux/bpf.h>
#include <linux/ip.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent/packet.h"
#include "inband/agent/skb.h"
#include "inband/auth.h"
#include "inband/wire.h"

/* The length the configured format gives option `kind` (155 or 124) on a
 * packet of this family and transport. */
static __always_inline __u32 configured_len(__u8 kind, __u8 auth_mode, const struct apkt *a)
{
	int v4 = a->family == 4;

	if (kind == INBAND_OPT_CLIENT_TUPLE) {
		if (auth_mode == INBAND_AUTH_NONE)
			return v4 ? INBAND_OPT_CLIENT_TUPLE_LEN : INBAND_OPT6_CLIENT_TUPLE_LEN;
		if (a->proto == INBAND_IPPROTO_UDP)
			return v4 ? INBAND_OPT_AUTH_CLIENT_TUPLE_UDP_LEN : INBAND_OPT6_AUTH_CLIENT_TUPLE_UDP_LEN;
		return v4 ? INBAND_OPT_AUTH_CLIENT_TUPLE_LEN : INBAND_OPT6_AUTH_CLIENT_TUPLE_LEN;
	}
	return auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_REQUEST_LEN : INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
}

/* What a MAC covers (auth.h), as the agent knows it from a packet. */
struct agent_mac {
	struct inband_addr lb;
	struct inband_addr backend;
	struct inband_addr client; /* 155 only */
	__be32 nonce;
	__be16 lb_port;
	__be16 backend_port;
	__be16 client_port; /* 155 only */
	__u16 score; /* 125 only, host order */
	__u8 kind;
	__u8 key_id;
	__u8 proto;
	__u8 pad;
};

/* The MAC of `m` under `key`: the IPv4 or IPv6 message by the balancer's
 * family. Not inlined: one copy of each unrolled SipHash serves 155, 124
 * and 125. */
static __noinline __u64 agent_mac(const struct inband_auth_key *key, const struct agent_mac *m)
{
	if (inband_addr_is4(&m->lb)) {
		struct inband_mac_msg msg;

		inband_mac_msg_init(&msg, m->kind, m->key_id, m->nonce, m->lb.w[3], m->lb_port, m->backend.w[3],
				    m->backend_port);
		msg.tag[1] = inband_mac_tag(m->proto);
		msg.client_addr = m->client.w[3];
		msg.client_port = m->client_port;
		msg.score = bpf_htons(m->score);
		return inband_mac(key, &msg);
	}
	struct inband_mac_msg6 msg;

	inband_mac_msg6_init(&msg, m->kind, m->key_id, m->nonce, (const __u8 *)&m->lb, m->lb_port,
			     (const __u8 *)&m->backend, m->backend_port);
	msg.tag[1] = inband_mac_tag(m->proto);
	__builtin_memcpy(msg.client_addr, &m->client, 16);
	msg.client_port = m->client_port;
	msg.score = bpf_htons(m->score);
	return inband_mac6(key, &msg);
}

/* The connection of a packet from a balancer: it is a->saddr:ports[0],
 * this server a->daddr:ports[1]. */
static __always_inline void mac_from_balancer(struct agent_mac *m, const struct apkt *a, __u8 kind, __u8 key_id,
					      __be32 nonce)
{
	__builtin_memset(m, 0, sizeof(*m));
	m->lb = a->saddr;
	m->backend = a->daddr;
	m->lb_port = a->ports[0];
	m->backend_port = a->ports[1];
	m->nonce = nonce;
	m->kind = kind;
	m->key_id = key_id;
	m->proto = a->proto;
}

/* Whether the 8 bytes at `mac` are the MAC of `m` under the key it names. */
static __always_inline int mac_ok(const struct agent_mac *m, const __u8 *mac)
{
	const struct inband_auth_key *key = auth_key(m->key_id);

	return key && agent_mac(key, m) == inband_get_mac(mac);
}

/* The one field the agent reads of a TIME_WAIT socket, relocated by name
 * against the running kernel's BTF (see the socket fields in agent.bpf.c
 * for why not vmlinux.h). */
struct tcp_timewait_sock {
	__u32 tw_ts_recent;
} __attribute__((preserve_access_index));

/* The socket of this network namespace that owns a packet's TCP tuple, as
 * far as the agent needs it. */
struct tuple_owner {
	__u32 state; /* INBAND_TCP_*; INBAND_TCP_CLOSE: no socket */
	__u32 ts_recent; /* TIME_WAIT: the last timestamp its peer sent; 0: none */
};

static __always_inline struct tuple_owner tuple_owner(struct __sk_buff *skb, const struct apkt *a)
{
	struct tuple_owner o = { .state = INBAND_TCP_CLOSE };
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;

	if (a->family == 4) {
		t.ipv4.saddr = a->saddr.w[3];
		t.ipv4.daddr = a->daddr.w[3];
		t.ipv4.sport = a->ports[0];
		t.ipv4.dport = a->ports[1];
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	} else {
		__builtin_memcpy(t.ipv6.saddr, &a->saddr, 16);
		__builtin_memcpy(t.ipv6.daddr, &a->daddr, 16);
		t.ipv6.sport = a->ports[0];
		t.ipv6.dport = a->ports[1];
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk)
		return o;
	o.state = sk->state;
	if (o.state == INBAND_TCP_TIME_WAIT) {
		struct tcp_timewait_sock *tw = bpf_skc_to_tcp_timewait_sock(sk);

		if (tw)
			o.ts_recent = tw->tw_ts_recent;
	}
	bpf_sk_release(sk);
	return o;
}

/*
 * Whether the owner is live: anything that is not a listener, a TIME_WAIT
 * socket (a new SYN may legitimately reopen its tuple), a request socket
 * (a handshake in progress, whose SYN may be retransmitted) or closed. A
 * SYN for a live socket's tuple starts no connection (the stack answers
 * with a challenge ACK), so a 155 on it could only redirect the responses
 * of the connection that does exist.
 */
static __always_inline int owner_live(const struct tuple_owner *o)
{
	return o->state != INBAND_TCP_LISTEN && o->state != INBAND_TCP_TIME_WAIT &&
	       o->state != INBAND_TCP_NEW_SYN_RECV && o->state != INBAND_TCP_CLOSE;
}

static __always_inline int tuple_owned_by_live_socket(struct __sk_buff *skb, const struct apkt *a)
{
	struct tuple_owner o = tuple_owner(skb, a);

	return owner_live(&o);
}

/*
 * A UDP 155's stamp (host order) is fresh: not more than
 * INBAND_UDP_STAMP_WINDOW_MS behind the newest its balancer `b` sent, and
 * not older than the one the tuple holds (`old`, if any). Serial
 * arithmetic: the stamp is milliseconds mod 2^32.
 */
static __always_inline int stamp_fresh(const struct inband_balancer *b, __u32 stamp, const struct inband_dsr_flow *old)
{
	if (b->stamp && (__s32)(stamp - b->stamp) < -(__s32)INBAND_UDP_STAMP_WINDOW_MS)
		return 0;
	if (old && old->stamp && (__s32)(stamp - bpf_ntohl(old->stamp)) < 0)
		return 0;
	return 1;
}

#endif /* INBAND_AGENT_TRUST_H */

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What the agent checks before an option from a balancer may change its
 * state (docs/agent.md, "Trust model"): the configured format, the MACs of
 * the authenticated format, and that a client tuple does not take over a
 * connection a socket already owns.
 */
#ifndef INBAND_AGENT_TRUST_H
#define INBAND_AGENT_TRUST_H

#include <linux/bpf.h>
#include <linux/ip.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent_skb.h"
#include "inband/auth.h"
#include "inband/wire.h"

/* The length the configured format gives option `kind` (155 or 124). */
static __always_inline __u32 configured_len(__u8 kind, __u8 auth_mode)
{
	if (kind == INBAND_OPT_CLIENT_TUPLE)
		return auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_CLIENT_TUPLE_LEN : INBAND_OPT_AUTH_CLIENT_TUPLE_LEN;
	return auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_REQUEST_LEN : INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
}

/* Whether the 8 bytes at `mac` are the MAC of `m` under the key it names.
 * Not inlined: one copy of the unrolled SipHash serves 155 and 124. */
static __noinline int mac_ok(const struct inband_mac_msg *m, const __u8 *mac)
{
	const struct inband_auth_key *key = auth_key(m->key_id);

	return key && inband_mac(key, m) == inband_get_mac(mac);
}

/* An authenticated 155 (`opt`) on a SYN with sequence number `seq` (as on
 * the wire), from the balancer iph->saddr:ports[0] to us. */
static __always_inline int tuple_mac_ok(const struct iphdr *iph, const __be16 *ports, __be32 seq, const __u8 *opt)
{
	struct inband_mac_msg m;

	inband_mac_msg_init(&m, INBAND_OPT_CLIENT_TUPLE, opt[INBAND_AUTH_TUPLE_KEY_OFF], seq, iph->saddr, ports[0],
			    iph->daddr, ports[1]);
	__builtin_memcpy(&m.client_addr, opt + INBAND_AUTH_TUPLE_ADDR_OFF, sizeof(m.client_addr));
	__builtin_memcpy(&m.client_port, opt + INBAND_AUTH_TUPLE_PORT_OFF, sizeof(m.client_port));
	return mac_ok(&m, opt + INBAND_AUTH_TUPLE_MAC_OFF);
}

/* An authenticated 124 (`opt`), from the balancer iph->saddr:ports[0]. */
static __always_inline int request_mac_ok(const struct iphdr *iph, const __be16 *ports, const __u8 *opt)
{
	struct inband_mac_msg m;
	__be32 nonce;

	__builtin_memcpy(&nonce, opt + INBAND_AUTH_REQUEST_NONCE_OFF, sizeof(nonce));
	inband_mac_msg_init(&m, INBAND_OPT_SCORE_REQUEST, opt[INBAND_AUTH_REQUEST_KEY_OFF], nonce, iph->saddr,
			    ports[0], iph->daddr, ports[1]);
	return mac_ok(&m, opt + INBAND_AUTH_REQUEST_MAC_OFF);
}

/*
 * Whether a live socket of this network namespace owns the connection the
 * packet belongs to. Live: anything that is not a listener, a TIME_WAIT
 * socket (a new SYN may legitimately reopen its tuple), a request socket
 * (a handshake in progress, whose SYN may be retransmitted) or closed. A
 * SYN for a live socket's tuple starts no connection (the stack answers
 * with a challenge ACK), so a 155 on it could only redirect the responses
 * of the connection that does exist.
 */
static __always_inline int tuple_owned_by_live_socket(struct __sk_buff *skb, const struct iphdr *iph,
						       const __be16 *ports)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 state;

	t.ipv4.saddr = iph->saddr;
	t.ipv4.daddr = iph->daddr;
	t.ipv4.sport = ports[0];
	t.ipv4.dport = ports[1];
	sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	state = sk->state;
	bpf_sk_release(sk);
	return state != INBAND_TCP_LISTEN && state != INBAND_TCP_TIME_WAIT && state != INBAND_TCP_NEW_SYN_RECV &&
	       state != INBAND_TCP_CLOSE;
}

#endif /* INBAND_AGENT_TRUST_H */

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * A SYN that reopens a tuple the server holds in TIME_WAIT, and the TCP
 * timestamps of the connection it starts.
 *
 * The balancer picks a backend connection's SNAT port from a hash of the
 * client side (lb/nat.h), so a port comes back to a backend while the
 * backend may still hold the previous connection on it in TIME_WAIT (60 s
 * after the server closed first): at 600 new connections a second to one
 * backend over 31,744 ports, every other SYN does. Linux reopens the tuple
 * only for a SYN whose timestamp is newer than the last one the old
 * connection saw (or, without timestamps, whose sequence number is beyond
 * it). A client's timestamps start at a random offset per pair of
 * addresses, so a SYN from another client than the old connection's is
 * older half the time: the server answers it with an ACK for the old
 * connection, the client resets and tries again a second later.
 *
 * The agent raises such a SYN's TSval just above the TIME_WAIT's last one
 * and keeps the difference in the flow (ts_shift). For the rest of the
 * connection every segment from the client has its TSval raised by it and
 * every segment to the client its TSecr lowered by it: the server sees one
 * clock that started above the old connection's, the client sees its own
 * clock echoed, so both sides' PAWS checks and the client's RTT samples
 * hold. The shift is chosen only from the kernel's own TIME_WAIT socket,
 * on a SYN whose 155 was accepted: nobody else sets it. It outlives the
 * socket (agent.bpf.c, forget_connection): when the server closed first
 * its TIME_WAIT still takes the client's FIN and last ACK, which need it.
 *
 * Not covered: a SYN without timestamps (the kernel then goes by sequence
 * numbers, which the agent does not translate).
 */
#ifndef INBAND_AGENT_TIME_WAIT_H
#define INBAND_AGENT_TIME_WAIT_H

#include <linux/bpf.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent/options.h"
#include "inband/agent/skb.h"
#include "inband/agent/trust.h"

/* Where TSval and TSecr sit in the timestamps option. */
#define TS_VAL 2
#define TS_ECR 6

/* The timestamp field `field` of the TCP segment at `l4_off`: its offset
 * in the packet in *at and its value in *value. Returns 0, or -1 if the
 * segment carries no timestamps. */
static __always_inline int ts_field(struct __sk_buff *skb, __u32 l4_off, __u32 field, __u32 *at, __be32 *value)
{
	struct tcpopt_walk w = {};
	__u8 doff;
	int i;

	if (bpf_skb_load_bytes(skb, l4_off + 12, &doff, 1))
		return -1;
	i = tcpopt_find(skb, l4_off, (doff >> 4) * 4, &w, INBAND_TCPOPT_TIMESTAMP, INBAND_TCPOLEN_TIMESTAMP);
	if (i < 0 || i >= 40)
		return -1;
	__builtin_memcpy(value, &w.opts[i + field], sizeof(*value));
	*at = l4_off + sizeof(struct tcphdr) + i + field;
	return 0;
}

/* Replaces the timestamp field at `at` (value `old`) with `new`, and the
 * TCP checksum with it. The two changes cancel in the segment's sum, so a
 * CHECKSUM_COMPLETE skb's sum stays right. */
static __always_inline void ts_write(struct __sk_buff *skb, __u32 l4_off, __u32 at, __be32 old, __be32 new)
{
	if (bpf_skb_store_bytes(skb, at, &new, sizeof(new), 0))
		return;
	bpf_l4_csum_replace(skb, l4_off + offsetof(struct tcphdr, check), old, new, sizeof(new));
}

/* Adds `by` to the timestamp field `field` of the TCP segment at `l4_off`,
 * if it carries timestamps. */
static __always_inline void ts_shift(struct __sk_buff *skb, __u32 l4_off, __u32 field, __u32 by)
{
	__be32 old;
	__u32 at;

	if (!ts_field(skb, l4_off, field, &at, &old))
		ts_write(skb, l4_off, at, old, bpf_htonl(bpf_ntohl(old) + by));
}

/*
 * The shift the SYN at `l4_off` (whose 155 gave `val`) needs. Over a
 * TIME_WAIT whose last timestamp is not older than the SYN's: what lifts
 * the SYN's just above it (a new connection, whatever flow the old one
 * left). Otherwise, if `old` is this client tuple's flow already, that
 * flow's: a retransmitted SYN whose first one reopened the TIME_WAIT and
 * was answered under that shift. Else 0. The caller writes it once the
 * flow that keeps it is stored.
 */
static __always_inline __u32 reopen_shift(struct __sk_buff *skb, __u32 l4_off, const struct tuple_owner *owner,
					  const struct inband_dsr_flow *old, const struct inband_dsr_flow *val)
{
	__be32 tsval;
	__u32 at;

	if (owner->state != INBAND_TCP_TIME_WAIT) {
		if (old && old->client_port == val->client_port && inband_addr_eq(&old->client_addr, &val->client_addr))
			return old->ts_shift;
		return 0;
	}
	if (!owner->ts_recent || ts_field(skb, l4_off, TS_VAL, &at, &tsval))
		return 0;
	/* The kernel reopens the tuple for a strictly newer TSval. */
	if ((__s32)(bpf_ntohl(tsval) - owner->ts_recent) > 0)
		return 0;
	count(INBAND_AGENT_TIME_WAIT_REOPENED);
	return owner->ts_recent + 1 - bpf_ntohl(tsval);
}

#endif /* INBAND_AGENT_TIME_WAIT_H */

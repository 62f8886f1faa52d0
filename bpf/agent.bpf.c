// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The real-server agent: tc ingress + tc egress on the server's interface and
 * a tracepoint on TCP state changes. See "Real-server agent walk (tc)" in
 * docs/architecture.md. Both address families, TCP and UDP.
 *
 * Packet access goes through bpf_skb_load_bytes/bpf_skb_store_bytes rather
 * than direct packet pointers: at tc the headers of a non-linear skb need not
 * sit in the linear area, and the copies are a few dozen bytes.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/encap.h"
#include "inband/agent/maps.h"
#include "inband/agent/options.h"
#include "inband/agent/packet.h"
#include "inband/agent/skb.h"
#include "inband/agent/time_wait.h"
#include "inband/agent/trust.h"
#include "inband/agent/verify.h"
#include "inband/auth.h"
#include "inband/csum.h"
#include "inband/wire.h"

/* GPL: bpf_fib_lookup is a GPL-only helper. */
char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define INBAND_AF_INET6 10

static __always_inline int malformed(void)
{
	count(INBAND_AGENT_MALFORMED);
	return TC_ACT_OK;
}

/* For packets with an option from a balancer's address that no balancer of
 * this deployment sends: forged, or corrupt on the way. */
static __always_inline int drop(__u32 counter)
{
	count(counter);
	return TC_ACT_SHOT;
}

/* The connection of a packet from (`from_peer`) or to a peer. */
static __always_inline struct inband_conn_key conn_key(const struct apkt *a, int from_peer)
{
	struct inband_conn_key k = {
		.peer_addr = from_peer ? a->saddr : a->daddr,
		.peer_port = from_peer ? a->ports[0] : a->ports[1],
		.local_port = from_peer ? a->ports[1] : a->ports[0],
		.proto = a->proto,
	};
	return k;
}

static __always_inline struct inband_service *service_of(const struct apkt *a, __be16 local_port)
{
	struct inband_service_key k = { .port = local_port, .proto = a->proto, .family = a->family };

	return bpf_map_lookup_elem(&services, &k);
}

/*
 * Request-in-flight accounting for the "requests" score: a TCP connection
 * is busy from the first client payload byte until the server's first
 * payload byte after it. Pipelined requests on one connection count once;
 * a request's body arriving while the response streams does not re-arm it.
 */
static __always_inline void track_request(struct __sk_buff *skb, const struct apkt *a, int from_client)
{
	struct inband_conn_key key = conn_key(a, from_client);
	__u8 doff;
	__u16 port;
	__s64 *count;
	__u32 *busy;

	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen + 12, &doff, 1))
		return;
	if (a->tot_len <= a->hlen + (doff >> 4) * 4)
		return; /* no payload: ACKs, SYNs, FINs do not change it */
	port = bpf_ntohs(key.local_port);
	count = bpf_map_lookup_elem(&inflight, &port);
	if (!count)
		return;
	busy = bpf_map_lookup_elem(&inflight_conns, &key);
	if (from_client) {
		if (!busy) {
			__u32 one = 1;

			if (!bpf_map_update_elem(&inflight_conns, &key, &one, BPF_NOEXIST))
				__sync_fetch_and_add(count, 1);
		} else if (__sync_val_compare_and_swap(busy, 0, 1) == 0) {
			__sync_fetch_and_add(count, 1);
		}
	} else if (busy && __sync_val_compare_and_swap(busy, 1, 0) == 1) {
		__sync_fetch_and_add(count, -1);
	}
}

/* Takes the option off the packet: the IPv4 option after the fixed header,
 * or the whole IPv6 Destination Options header. */
static __always_inline int strip_inband(struct __sk_buff *skb, const struct apkt *a, const __u32 *opt, __u32 len)
{
	if (a->family == 4)
		return strip_option(skb, &a->ip4, opt, len);
	return strip_doh(skb, a->opt_len, a->proto, a->tot_len);
}

/* A UDP tuple last used longer ago than the configured idle timeout: its
 * flow is over at the balancer too, and its port may be another client's
 * now. */
static __always_inline int udp_tuple_expired(const struct inband_dsr_flow *flow, __u64 now)
{
	const struct inband_agent_config *cfg = agent_cfg();

	return cfg && cfg->udp_idle_timeout_s && now - flow->last_ns > cfg->udp_idle_timeout_s * 1000000000ULL;
}

/*
 * The balancer `addr` is, or NULL: one of `balancers`, or an address of a
 * fleet's prefix (`*fleet` set then). IPv4 addresses are never a fleet's.
 */
static __always_inline struct inband_balancer *find_balancer(const struct inband_addr *addr, int *fleet)
{
	struct inband_balancer *b = bpf_map_lookup_elem(&balancers, addr);

	*fleet = 0;
	if (b || inband_addr_is4(addr))
		return b;
	struct inband_balancer_net k = { .prefixlen = 128, .addr = *addr };

	b = bpf_map_lookup_elem(&balancer_nets, &k);
	*fleet = b != NULL;
	return b;
}

/*
 * A 155 from a balancer, in the configured format (`opt`, `len` bytes),
 * on the TCP segment or UDP datagram at a->hlen. Stored only from a packet
 * whose checksums verify and, authenticated, whose MAC does; for TCP only
 * from a SYN and never over a live socket's connection, for UDP only if
 * its stamp is not older than what its balancer sent since.
 */
static __always_inline int take_client_tuple(struct __sk_buff *skb, const struct apkt *a, struct inband_balancer *b,
					     const __u32 *opt, __u32 len, __u8 auth_mode, int fleet)
{
	const __u8 *o = (const __u8 *)opt;
	__u32 l4_off = INBAND_ETH_HLEN + a->hlen;
	struct inband_conn_key key = conn_key(a, 1);
	struct inband_dsr_flow val = {};
	int udp = a->proto == INBAND_IPPROTO_UDP;
	int alen = a->family == 4 ? 4 : 16;
	__be32 nonce = 0;

	if (udp) {
		/* The stamp sits before the MAC (seed format: none). */
		if (auth_mode != INBAND_AUTH_NONE)
			__builtin_memcpy(&nonce, o + len - INBAND_OPT_MAC_LEN - 4, sizeof(nonce));
	} else {
		__u8 flags;

		if (bpf_skb_load_bytes(skb, l4_off + 4, &nonce, sizeof(nonce)) ||
		    bpf_skb_load_bytes(skb, l4_off + 13, &flags, sizeof(flags)))
			return malformed();
		/* A client tuple starts a connection: on any other packet it
		 * could only redirect one that exists. */
		if ((flags & (INBAND_TCP_SYN | INBAND_TCP_ACK)) != INBAND_TCP_SYN)
			return drop(INBAND_AGENT_NOT_SYN);
	}
	if ((a->family == 4 && !ipv4_csum_ok(skb, a->hlen)) || !l4_csum_ok(skb, l4_off, a->tot_len - a->hlen, a))
		return drop(INBAND_AGENT_BAD_CHECKSUM);
	/* Seed: kind, len, address, port; authenticated: kind, len, key id, 0, address, port. */
	__u32 at = auth_mode == INBAND_AUTH_NONE ? 2 : INBAND_AUTH_TUPLE_ADDR_OFF;

	if (alen == 4) {
		val.client_addr = inband_addr4(0);
		__builtin_memcpy(&val.client_addr.w[3], o + (at & 0x7), 4);
		__builtin_memcpy(&val.client_port, o + (at & 0x7) + 4, 2);
	} else {
		__builtin_memcpy(&val.client_addr, o + (at & 0x7), 16);
		__builtin_memcpy(&val.client_port, o + (at & 0x7) + 16, 2);
	}
	if (auth_mode != INBAND_AUTH_NONE) {
		struct agent_mac m;

		mac_from_balancer(&m, a, INBAND_OPT_CLIENT_TUPLE, o[INBAND_AUTH_TUPLE_KEY_OFF], nonce);
		m.client = val.client_addr;
		m.client_port = val.client_port;
		if (!mac_ok(&m, o + len - INBAND_OPT_MAC_LEN))
			return drop(INBAND_AGENT_AUTH_FAILED);
	}
	if (udp) {
		struct inband_dsr_flow *old = bpf_map_lookup_elem(&dsr_flows, &key);
		__u32 stamp = bpf_ntohl(nonce);

		if (auth_mode != INBAND_AUTH_NONE) {
			if (!stamp_fresh(b, stamp, old)) {
				count(INBAND_AGENT_STALE_STAMP);
				return strip_inband(skb, a, opt, len);
			}
			if ((__s32)(stamp - b->stamp) > 0)
				b->stamp = stamp;
		}
		val.stamp = nonce;
		val.last_ns = bpf_ktime_get_coarse_ns();
	} else {
		struct tuple_owner owner = tuple_owner(skb, a);

		if (owner_live(&owner) && fleet) {
			/* Another client's connection has the same fleet tuple
			 * (another instance opened it). The stack's challenge
			 * ACK would reach this SYN's client through the fleet
			 * address, and a RST it answers with, carrying the
			 * acknowledged number, would end the live connection
			 * (RFC 5961 takes it). Dropped, the new client retries
			 * from another port. */
			count(INBAND_AGENT_FLEET_COLLISIONS);
			return TC_ACT_SHOT;
		}
		if (owner_live(&owner)) {
			/* The SYN itself still reaches the stack, which answers
			 * it with a challenge ACK. */
			count(INBAND_AGENT_TUPLE_IN_USE);
			return strip_inband(skb, a, opt, len);
		}
		val.ts_shift = reopen_shift(skb, l4_off, &owner, bpf_map_lookup_elem(&dsr_flows, &key), &val);
		if (fleet)
			val.fleet_label = named_instance(a);
	}
	/* A connection on these ports before this one is over. */
	if (!udp)
		bpf_map_delete_elem(&closed_flows, &key);
	if (!bpf_map_update_elem(&dsr_flows, &key, &val, BPF_ANY)) {
		count(INBAND_AGENT_TUPLES_STORED);
		/* Only a stored shift is applied: the connection's later
		 * segments find it in the flow. */
		if (val.ts_shift)
			ts_shift(skb, l4_off, TS_VAL, val.ts_shift);
	}
	return strip_inband(skb, a, opt, len);
}

static __always_inline int frozen(const struct inband_dsr_flow *flow)
{
	__u32 now_ms = bpf_ktime_get_ns() / 1000000;

	return (__s32)(flow->frozen_until_ms - now_ms) > 0;
}

/*
 * A packet from a balancer that carries no 155 or 124. A TCP SYN opens a
 * connection whose responses go back through the balancer (a pass-through
 * VIP, a retransmitted SYN, the balancer host's own connection): a tuple
 * stored for an earlier handshake on the same ports that never became a
 * socket (a SYN flood's: nothing deletes those until the LRU does) would
 * send them to that handshake's client, so it is forgotten; a live
 * socket's tuple is not, whoever sent the SYN. A UDP datagram keeps its
 * tuple in use, or finds it expired. A TCP segment of a connection that
 * reopened a TIME_WAIT has its timestamp shifted (agent/time_wait.h).
 * Returns TC_ACT_OK: the packet goes on.
 */
static __always_inline int plain_from_peer(struct __sk_buff *skb, const struct apkt *a)
{
	struct inband_conn_key key = conn_key(a, 1);
	struct inband_dsr_flow *flow;
	__u8 flags = 0;
	int tcp = a->proto == IPPROTO_TCP;

	/* Loaded once: a TCP segment whose flags cannot be read goes on
	 * untouched. */
	if (tcp && bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen + 13, &flags, sizeof(flags)))
		return TC_ACT_OK;
	int syn = tcp && (flags & (INBAND_TCP_SYN | INBAND_TCP_ACK)) == INBAND_TCP_SYN;

	/* A SYN without 155 over a closed connection's ports: that
	 * connection's client must not get the new one's answers. */
	if (syn)
		bpf_map_delete_elem(&closed_flows, &key);
	/* Entries are keyed by a balancer's address: no other sender finds one. */
	flow = bpf_map_lookup_elem(&dsr_flows, &key);
	if (!flow)
		return TC_ACT_OK;
	/* A frozen socket must see nothing (in repair mode it would still take
	 * data and acknowledge it), nor a closed one's port answer with a RST:
	 * the client sends the segment again, and the balancer by then takes
	 * it to the connection's new server. */
	if (flow->frozen_until_ms && frozen(flow))
		return drop(INBAND_AGENT_FROZEN_DROPPED);
	if (a->proto == INBAND_IPPROTO_UDP) {
		__u64 now = bpf_ktime_get_coarse_ns();

		if (udp_tuple_expired(flow, now)) {
			if (!bpf_map_delete_elem(&dsr_flows, &key))
				count(INBAND_AGENT_UDP_TUPLES_EXPIRED);
		} else if (now - flow->last_ns > 1000000000ULL) {
			/* To the second: a busy flow's entry is written once a second. */
			flow->last_ns = now;
		}
		return TC_ACT_OK;
	}
	if (!tcp)
		return TC_ACT_OK;
	if (syn && !tuple_owned_by_live_socket(skb, a)) {
		if (!bpf_map_delete_elem(&dsr_flows, &key))
			count(INBAND_AGENT_STALE_TUPLES_FORGOTTEN);
		return TC_ACT_OK;
	}
	if (flow->ts_shift)
		ts_shift(skb, INBAND_ETH_HLEN + a->hlen, TS_VAL, flow->ts_shift);
	return TC_ACT_OK;
}

/*
 * A 124 from a balancer, in the configured format. It asks for a score on
 * a connection whose 155 was accepted; its key and nonce are kept for the
 * 125 that answers it, and from a fleet prefix the instance its flow
 * label names, which the 125 goes to.
 */
static __always_inline int take_score_request(struct __sk_buff *skb, const struct apkt *a, const __u32 *opt,
					      __u32 len, __u8 auth_mode, int wrapped, int fleet)
{
	const __u8 *o = (const __u8 *)opt;
	struct inband_conn_key key = conn_key(a, 1);
	struct inband_dsr_flow *flow;
	__be32 nonce = 0;
	__u8 key_id = 0;

	if (auth_mode != INBAND_AUTH_NONE) {
		struct agent_mac m;

		key_id = o[INBAND_AUTH_REQUEST_KEY_OFF];
		__builtin_memcpy(&nonce, o + INBAND_AUTH_REQUEST_NONCE_OFF, sizeof(nonce));
		mac_from_balancer(&m, a, INBAND_OPT_SCORE_REQUEST, key_id, nonce);
		if (!mac_ok(&m, o + INBAND_AUTH_REQUEST_MAC_OFF))
			return drop(INBAND_AGENT_AUTH_FAILED);
	}
	flow = bpf_map_lookup_elem(&dsr_flows, &key);
	/* No entry is created: entries exist only for accepted 155s, so
	 * packets from a balancer's address cannot fill the table. */
	if (!flow || inband_addr_is_zero(&flow->client_addr)) {
		count(INBAND_AGENT_PROBE_UNKNOWN_FLOW);
		return strip_inband(skb, a, opt, len);
	}
	if (flow->ts_shift)
		ts_shift(skb, INBAND_ETH_HLEN + a->hlen, TS_VAL, flow->ts_shift);
	/* Key and nonce before the flag: egress on another CPU reads them
	 * once it sees the flag. A torn pair from two racing 124s only makes
	 * the balancer refuse one 125. */
	flow->probe_key = key_id;
	flow->probe_nonce = nonce;
	if (fleet)
		flow->fleet_label = named_instance(a);
	flow->score_requested = INBAND_SCORE_REQUESTED | (wrapped ? INBAND_SCORE_ENCAP : 0);
	count(INBAND_AGENT_PROBES_SEEN);
	return strip_inband(skb, a, opt, len);
}

/*
 * The padding after the inband option in its Destination Options header
 * (`pad` bytes at `at`) is exactly what inband_doh_wrap writes: one Pad1,
 * or one PadN of zeros. Anything else there is another option, which
 * stripping the header would hide from the stack (an unknown one whose
 * action bits say discard), or a PadN Linux refuses (non-zero data).
 */
static __always_inline int doh_padding_ok(struct __sk_buff *skb, __u32 at, __u32 pad)
{
	__u8 p[8] = {};

	if (!pad)
		return 1;
	barrier_var(pad);
	if (pad > 7 || bpf_skb_load_bytes(skb, at, p, pad))
		return 0;
	if (pad == 1)
		return p[0] == 0;
	if (p[0] != 1 || p[1] != pad - 2)
		return 0;
	/* Bytes past `pad` stayed zero. */
	return !(p[2] | p[3] | p[4] | p[5] | p[6] | p[7]);
}

/*
 * Where the packet's inband option is and how long: IPv4, the first
 * option of the header; IPv6, the data of the first option of its
 * Destination Options header (type 0x1E), which must be the header's only
 * option but padding. Loads it into `opt`. 0 = found; 1 = none (another
 * option, or none at all); -1 = malformed.
 */
static __always_inline int find_option(struct __sk_buff *skb, const struct apkt *a, __u32 *opt, __u32 *len)
{
	__u8 *o = (__u8 *)opt;
	__u32 at = INBAND_ETH_HLEN + (a->family == 4 ? INBAND_IPV4_MIN_HDR : INBAND_IPV6_HDR);
	__u8 h[4];

	if (!a->opt_len)
		return 1;
	if (a->family == 4) {
		if (bpf_skb_load_bytes(skb, at, h, 2))
			return -1;
		if (h[0] == IPOPT_END || h[0] == IPOPT_NOOP)
			return 1;
		if (h[1] < 2 || h[1] > a->opt_len)
			return -1;
		*len = h[1];
	} else {
		if (a->opt_len < 8 || bpf_skb_load_bytes(skb, at, h, 4))
			return -1;
		if (h[2] != INBAND_OPT6_TYPE)
			return 1;
		/* The inband option is the header's only one: padding after it. */
		if (h[3] < 2 || INBAND_DOH_LEN(h[3]) != a->opt_len)
			return -1;
		*len = h[3];
		at += INBAND_DOH_PREFIX;
	}
	__u32 n = *len;

	barrier_var(n);
	if (n < 2 || n > OPT_MAX_WORDS * 4)
		return -1;
	if (bpf_skb_load_bytes(skb, at, o, n))
		return -1;
	if (o[1] != n)
		return -1;
	if (a->family == 6 && !doh_padding_ok(skb, at + n, a->opt_len - INBAND_DOH_PREFIX - n))
		return -1;
	return o[0] == INBAND_OPT_CLIENT_TUPLE || o[0] == INBAND_OPT_SCORE_REQUEST ? 0 : 1;
}

/*
 * The transport header of a packet with an option is whole and agrees
 * with the IP length: a TCP data offset of 20 bytes or more within the
 * segment, a UDP length equal to the IP payload. The stack drops a
 * segment whose data offset does not fit, and checks a datagram's
 * checksum over its UDP length, not the IP payload the agent sums: on
 * such a packet the agent's own checks would judge something other than
 * what the stack accepts.
 */
static __always_inline int l4_header_ok(struct __sk_buff *skb, const struct apkt *a)
{
	__u32 l4_len = a->tot_len - a->hlen;

	if (a->proto == IPPROTO_TCP) {
		__u8 doff;

		if (l4_len < sizeof(struct tcphdr) || bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen + 12, &doff, 1))
			return 0;
		return (doff >> 4) >= 5 && (doff >> 4) * 4 <= l4_len;
	}
	__be16 ulen;

	if (l4_len < 8 || bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen + 4, &ulen, sizeof(ulen)))
		return 0;
	return bpf_ntohs(ulen) == l4_len;
}

SEC("tc")
int agent_ingress(struct __sk_buff *skb)
{
	const struct inband_agent_config *cfg;
	struct inband_balancer *b;
	int fleet = 0;
	struct apkt a = {};
	__u32 opt[OPT_MAX_WORDS] = {};
	__u32 len = 0;
	__u8 *o = (__u8 *)opt;
	int wrapped = 0;
	int rc = apkt_parse(skb, &a);

	/* Only what parsed as IP-in-IP is looked at again: one header read
	 * per packet on the common path. */
	if (!rc && a.family == 4 && a.proto == INBAND_IPPROTO_IPIP) {
		wrapped = ipip_unwrap(skb);
		if (wrapped < 0)
			return TC_ACT_SHOT;
		if (wrapped) {
			__builtin_memset(&a, 0, sizeof(a));
			rc = apkt_parse(skb, &a);
		}
	}

	if (rc == -1)
		return TC_ACT_OK;
	if (rc == -2)
		return malformed();
	/* A balancer sends IPv6 with one Destination Options header at most:
	 * anything else from its address may hide an option the agent does
	 * not read, so it is counted; the stack judges it as it is. */
	if (a.ext_unwalked && find_balancer(&a.saddr, &fleet))
		count(INBAND_AGENT_UNWALKED_EXT_HEADERS);
	if (score_counts_requests() && a.proto == IPPROTO_TCP && !a.frag)
		track_request(skb, &a, 1);
	/* The balancer sets DF; a fragment is nobody's inband packet, and later
	 * fragments have no ports to check the service against. */
	if (a.frag || !a.proto)
		return TC_ACT_OK;
	rc = find_option(skb, &a, opt, &len);
	if (rc < 0)
		return malformed();
	if (rc > 0)
		return plain_from_peer(skb, &a);
	if (!l4_header_ok(skb, &a))
		return malformed();
	if (!service_of(&a, a.ports[1]))
		return TC_ACT_OK;
	/* Anyone can put a 155 on a packet; only a balancer's may steer where
	 * this server sends its responses. */
	b = find_balancer(&a.saddr, &fleet);
	if (!b) {
		count(INBAND_AGENT_UNTRUSTED_OPTION);
		return TC_ACT_OK;
	}
	cfg = agent_cfg();
	if (!cfg)
		return TC_ACT_OK;
	/* A balancer of this deployment sends only the configured format:
	 * anything else from its address is forged (or a balancer configured
	 * differently, which is found by this counter). */
	if (len != configured_len(o[0], cfg->auth_mode, &a))
		return drop(INBAND_AGENT_WRONG_FORMAT);
	if (o[0] == INBAND_OPT_CLIENT_TUPLE)
		return take_client_tuple(skb, &a, b, opt, len, cfg->auth_mode, fleet);
	return take_score_request(skb, &a, opt, len, cfg->auth_mode, wrapped, fleet);
}

/* Local port in host order: the key of active_conns and score_override. */
static __always_inline __u16 current_score(__u16 port)
{
	__u32 *override = bpf_map_lookup_elem(&score_override, &port);
	__s64 *conns = NULL, *requests = NULL, load = 0;

	if (override)
		return *override > 0xffff ? 0xffff : *override;
	if (score_source != INBAND_SCORE_REQUESTS)
		conns = bpf_map_lookup_elem(&active_conns, &port);
	if (score_counts_requests())
		requests = bpf_map_lookup_elem(&inflight, &port);
	/* Each count on its own may be briefly negative (a close seen before
	 * the open it undoes was counted): it adds nothing then. */
	if (conns && *conns > 0)
		load += *conns;
	if (requests && *requests > 0)
		load += *requests;
	return load > 0xffff ? 0xffff : load;
}

/*
 * Bytes a 125 adds to a packet of this flow (`len`: the option's own): the
 * option, in a Destination Options header of its own on IPv6, and the
 * outer header when its 124 came wrapped or it goes to a fleet's instance
 * (steer_to_instance). 0: this packet's header has no room (IPv4: 60
 * bytes reached; IPv6: extension headers already there), nor has any copy
 * of it.
 */
static __always_inline __u32 score_bytes(const struct apkt *a, const struct inband_dsr_flow *flow, __u32 len)
{
	if (a->family == 4) {
		if (a->hlen + len > INBAND_IPV4_MAX_HDR)
			return 0;
		return len + (flow->score_requested & INBAND_SCORE_ENCAP ? INBAND_IPIP_HLEN : 0);
	}
	return a->opt_len ? 0 : INBAND_DOH_LEN(len) + (flow->fleet_label ? INBAND_IPV6_HDR : 0);
}

/*
 * Adds the 125 the flow owes (`len` bytes; the caller checked the room).
 * Returns 1 if it did; otherwise the flag stays set (a later packet
 * answers) unless the answer cannot be signed at all.
 */
static __always_inline int add_score(struct __sk_buff *skb, const struct apkt *a, struct inband_dsr_flow *flow,
				     const struct inband_agent_config *cfg, __u32 len)
{
	/* The 125 at opt + INBAND_DOH_PREFIX; IPv6 wraps its header around it. */
	__u32 opt[INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN) / 4] = {};
	__u8 *o = (__u8 *)opt + INBAND_DOH_PREFIX;
	__u16 score;
	int wrap = a->family == 4 && (flow->score_requested & INBAND_SCORE_ENCAP);

	score = current_score(bpf_ntohs(a->ports[0]));
	if (cfg->auth_mode == INBAND_AUTH_NONE) {
		inband_encode_score(o, score);
	} else {
		/* Signed with the 124's key and nonce over the connection as
		 * the balancer sees it (it is the destination). */
		const struct inband_auth_key *key = auth_key(flow->probe_key);
		struct agent_mac m = {
			.lb = a->daddr,
			.backend = a->saddr,
			.nonce = flow->probe_nonce,
			.lb_port = a->ports[1],
			.backend_port = a->ports[0],
			.score = score,
			.kind = INBAND_OPT_SCORE,
			.key_id = flow->probe_key,
			.proto = a->proto,
		};

		if (!key) {
			/* The key was removed by a rotation since the 124. */
			flow->score_requested = 0;
			count(INBAND_AGENT_AUTH_FAILED);
			return 0;
		}
		inband_encode_auth_score(o, score, flow->probe_nonce, agent_mac(key, &m));
	}
	int failed;

	if (a->family == 4) {
		failed = insert_option(skb, &a->ip4, (__u32 *)o, len);
	} else {
		/* Constant lengths: the padding's loop unrolls. */
		if (len == INBAND_OPT_AUTH_SCORE_LEN) {
			inband_doh_wrap((__u8 *)opt, a->proto, INBAND_OPT_AUTH_SCORE_LEN);
			failed = insert_doh(skb, opt, INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN), a->tot_len);
		} else {
			inband_doh_wrap((__u8 *)opt, a->proto, INBAND_OPT_SCORE_LEN);
			failed = insert_doh(skb, opt, INBAND_DOH_LEN(INBAND_OPT_SCORE_LEN), a->tot_len);
		}
	}
	if (failed) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return 0;
	}
	/* The option is in: a failed wrap still sends it, unwrapped. */
	if (wrap && ipip_wrap(skb, a->tot_len + len))
		count(INBAND_AGENT_ADJUST_FAILED);
	flow->score_requested = 0;
	count(INBAND_AGENT_SCORES_SENT);
	return 1;
}

/* The carrier handshake on this CPU: answer_score sets CARRIER_WANTED
 * around bpf_clone_redirect, whose clone runs this program again before
 * the helper returns, nested on the same CPU (transmit runs with bottom
 * halves off); that pass takes the request, becomes the carrier and says
 * CARRIER_HANDLED (counted there, whatever came of it). A mark on the skb
 * would be readable, and settable, by whatever else sees the packet
 * (skb->mark is the application's SO_MARK); this slot only the agent
 * writes. */
enum {
	CARRIER_NONE = 0,
	CARRIER_WANTED = 1,
	CARRIER_HANDLED = 2,
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} carrier_slot SEC(".maps");

static __always_inline __u32 *carrier_state(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&carrier_slot, &zero);
}

/*
 * Turns the TCP segment at l4_off (`tcp_hlen` header bytes, `payload`
 * after them) into its headers alone: an ACK at the sequence number after
 * the data, with the segment's ACK number, window and options, and no
 * FIN, PSH, URG or CWR (they belong to the data, which went on without
 * it). A client takes a payload-less segment at or past what it received
 * (and within its window) as a plain ACK. The checksum field of an
 * outgoing TCP segment holds the pseudo-header sum, which the device or
 * the stack completes over what the segment holds then (TCP hands tc
 * CHECKSUM_PARTIAL segments): only its length changes here; flags and
 * sequence number are summed later. Returns 0 on success.
 */
static __always_inline int trim_to_headers(struct __sk_buff *skb, const struct apkt *a, __u32 tcp_hlen, __u32 payload)
{
	__u32 l4_off = INBAND_ETH_HLEN + a->hlen;
	__u32 check_off = l4_off + offsetof(struct tcphdr, check);
	__be16 old_l4 = bpf_htons(a->tot_len - a->hlen), new_l4 = bpf_htons(tcp_hlen);
	__u32 seq;
	__u8 flags;
	__u16 sum;

	/* Linearises the skb and drops its GSO state: one copy of the
	 * burst per answered 124. */
	if (bpf_skb_change_tail(skb, l4_off + tcp_hlen, 0))
		return -1;
	if (bpf_skb_load_bytes(skb, l4_off + 4, &seq, sizeof(seq)) ||
	    bpf_skb_load_bytes(skb, l4_off + 13, &flags, sizeof(flags)) ||
	    bpf_skb_load_bytes(skb, check_off, &sum, sizeof(sum)))
		return -1;
	seq = bpf_htonl(bpf_ntohl(seq) + payload);
	flags &= ~(INBAND_TCP_FIN | INBAND_TCP_PSH | INBAND_TCP_URG | INBAND_TCP_CWR);
	sum = csum_fold(csum_replace16(sum, old_l4, new_l4));
	if (a->family == 4) {
		__be16 old_tot = bpf_htons(a->tot_len), new_tot = bpf_htons(a->tot_len - payload);

		if (bpf_l3_csum_replace(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, check), old_tot, new_tot,
					sizeof(new_tot)) ||
		    bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, tot_len), &new_tot,
					sizeof(new_tot), 0))
			return -1;
	} else {
		__be16 plen = bpf_htons(a->tot_len - payload - INBAND_IPV6_HDR);

		if (bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct ipv6hdr, payload_len), &plen,
					sizeof(plen), 0))
			return -1;
	}
	if (bpf_skb_store_bytes(skb, l4_off + 4, &seq, sizeof(seq), 0) ||
	    bpf_skb_store_bytes(skb, l4_off + 13, &flags, sizeof(flags), 0) ||
	    bpf_skb_store_bytes(skb, check_off, &sum, sizeof(sum), 0))
		return -1;
	return 0;
}

/*
 * The TCP header length and data bytes of the segment, if its data offset
 * is sane; 0 data otherwise.
 */
static __always_inline __u32 tcp_payload(struct __sk_buff *skb, const struct apkt *a, __u8 doff_flags[2],
					 __u32 *tcp_hlen)
{
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen + 12, doff_flags, 2))
		return 0;
	*tcp_hlen = (doff_flags[0] >> 4) * 4;
	if (*tcp_hlen < sizeof(struct tcphdr) || a->hlen + *tcp_hlen >= a->tot_len)
		return 0;
	return a->tot_len - a->hlen - *tcp_hlen;
}

/*
 * The clone answer_score asked for: cut to the segment's headers
 * (trim_to_headers), it takes the 125 to the balancer, which forwards it
 * to the client as a pure ACK. The original goes on with the data.
 */
static __always_inline int make_carrier(struct __sk_buff *skb, struct apkt *a, struct inband_dsr_flow *flow)
{
	const struct inband_agent_config *cfg = agent_cfg();
	__u8 doff_flags[2] = {};
	__u32 tcp_hlen = 0, payload, len;

	/* Another CPU may have answered since the clone was asked for. */
	if (!cfg || a->proto != IPPROTO_TCP || !flow->score_requested)
		return TC_ACT_SHOT;
	payload = tcp_payload(skb, a, doff_flags, &tcp_hlen);
	len = cfg->auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_LEN : INBAND_OPT_AUTH_SCORE_LEN;
	if (!payload || trim_to_headers(skb, a, tcp_hlen, payload) || apkt_parse(skb, a)) {
		count(INBAND_AGENT_SCORE_DEFERRED_CARRIER_FAILED);
		return TC_ACT_SHOT;
	}
	/* Failing, add_score counts why and the flag stays (or, for a key
	 * removed since, goes). */
	if (!add_score(skb, a, flow, cfg, len))
		return TC_ACT_SHOT;
	count(INBAND_AGENT_SCORE_CARRIERS);
	return steer_to_instance(skb, flow);
}

/*
 * Answers the 124 the flow has pending on this packet, if it can. A
 * packet that is one segment on the wire and fits the MTU with the 125
 * carries it toward the balancer. A TCP segment with data that cannot (a
 * GSO burst, whose every segment would copy the option back through the
 * balancer; a full-sized segment) gets a carrier: a clone of it, cut to
 * its headers by the pass it runs (make_carrier), takes the 125 while
 * this packet goes on as if no score were asked, direct to the client,
 * keeping its socket's accounting. Returns the verdict for this packet,
 * or -1: it goes on (answered by a carrier, or not and the flag stays for
 * a later packet, counted by reason).
 */
static __always_inline int answer_score(struct __sk_buff *skb, struct apkt *a, struct inband_dsr_flow *flow)
{
	const struct inband_agent_config *cfg = agent_cfg();
	__u32 len, added, tcp_hlen = 0, payload = 0;
	__u8 doff_flags[2] = {};

	if (!cfg)
		return -1;
	len = cfg->auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_LEN : INBAND_OPT_AUTH_SCORE_LEN;
	added = score_bytes(a, flow, len);
	if (!added) {
		count(INBAND_AGENT_SCORE_DEFERRED_NO_ROOM);
		return -1;
	}
	/* Over the MTU it would be dropped by the stack or fragmented, and
	 * fragments never reach a balancer as a 125. */
	if (skb->gso_segs <= 1 && a->tot_len + added <= cfg->mtu)
		return add_score(skb, a, flow, cfg, len) ? steer_to_instance(skb, flow) : -1;
	/* A UDP burst's datagrams would each reach the application; a carrier
	 * of no data would be one more, empty. */
	if (a->proto != IPPROTO_TCP) {
		count(skb->gso_segs > 1 ? INBAND_AGENT_SCORE_DEFERRED_UDP_BURST : INBAND_AGENT_SCORE_DEFERRED_MTU);
		return -1;
	}
	payload = tcp_payload(skb, a, doff_flags, &tcp_hlen);
	/* A handshake or reset segment stays whole; an ACK with data gets a
	 * carrier if its headers and the 125 fit the MTU. */
	if (!payload || (doff_flags[1] & (INBAND_TCP_SYN | INBAND_TCP_RST | INBAND_TCP_ACK)) != INBAND_TCP_ACK ||
	    a->tot_len - payload + added > cfg->mtu) {
		count(INBAND_AGENT_SCORE_DEFERRED_MTU);
		return -1;
	}
	__u32 *state = carrier_state();

	if (!state) {
		count(INBAND_AGENT_SCORE_DEFERRED_CARRIER_FAILED);
		return -1;
	}
	*state = CARRIER_WANTED;
	bpf_clone_redirect(skb, skb->ifindex, 0);
	/* The clone never reached this program (refused before tc): the
	 * request waits. Its verdict there is counted there. */
	if (*state != CARRIER_HANDLED)
		count(INBAND_AGENT_SCORE_DEFERRED_CARRIER_FAILED);
	*state = CARRIER_NONE;
	return -1;
}

/*
 * The checksum field of a UDP GSO burst holds the pseudo-header sum, not
 * complemented, which segmentation completes for each datagram (adding the
 * ports and payload it finds then). Linux 6.11+ hands a burst for a device
 * without checksum offload to tc as CHECKSUM_NONE, and the csum helpers
 * take that partial sum for a finished checksum: every datagram would
 * leave with a wrong one. So it is updated here as what it is, for the
 * addresses only, which is also what the helpers do for a CHECKSUM_PARTIAL
 * burst.
 */
static __always_inline int gso_pseudo_csum_nat(struct __sk_buff *skb, __u32 check_off, const __be32 *old_addrs,
					       const __be32 *new_addrs, int v4)
{
	__u16 sum;

	if (bpf_skb_load_bytes(skb, check_off, &sum, sizeof(sum)))
		return -1;
	__u32 acc = sum;

	for (int i = 0; i < 8; i++) {
		/* IPv4 sums the last word of each address only. */
		if (!v4 || i == 3 || i == 7)
			acc = csum_replace32(acc, old_addrs[i], new_addrs[i]);
	}
	sum = csum_fold(acc);
	return bpf_skb_store_bytes(skb, check_off, &sum, sizeof(sum), 0) ? -1 : 0;
}

/*
 * Sends the response straight to the client: source = VIP, destination =
 * the client tuple, checksums fixed, a SYN-ACK's MSS clamped, out through
 * the route to the client. Any refusal of the route lookup keeps the
 * connection working through the balancer's NAT.
 */
static __always_inline int dsr(struct __sk_buff *skb, const struct apkt *a, const struct inband_service *svc,
			       const struct inband_dsr_flow *flow)
{
	struct bpf_fib_lookup fib = {};
	__u32 l4_off = INBAND_ETH_HLEN + a->hlen;
	int v4 = a->family == 4;
	int udp = a->proto == INBAND_IPPROTO_UDP;
	__u32 check_off = l4_off + (udp ? 6 : offsetof(struct tcphdr, check));
	__be32 old_addrs[8], new_addrs[8];
	__be16 old_ports[2] = { a->ports[0], a->ports[1] };
	__be16 new_ports[2] = { svc->vip_port, flow->client_port };
	__s64 addr_diff, port_diff;
	__u8 tcp_doff_flags[2] = {};
	long rc;

	fib.l4_protocol = a->proto;
	fib.sport = svc->vip_port;
	fib.dport = flow->client_port;
	/* tot_len = 0 makes the helper check the skb against the MTU itself,
	 * which accepts GSO packets; the IP length of a GSO packet exceeds any
	 * MTU and would send all bulk data via the balancer. */
	fib.tot_len = 0;
	fib.ifindex = skb->ifindex;
	if (v4) {
		fib.family = INBAND_AF_INET;
		fib.tos = a->tos;
		fib.ipv4_src = svc->vip_addr.w[3];
		fib.ipv4_dst = flow->client_addr.w[3];
	} else {
		fib.family = INBAND_AF_INET6;
		__builtin_memcpy(fib.ipv6_src, &svc->vip_addr, 16);
		__builtin_memcpy(fib.ipv6_dst, &flow->client_addr, 16);
	}
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	/* The helper answers only for a device with forwarding on (output
	 * lookups too), and servers rarely forward. Rather than make operators
	 * turn on forwarding, FWD_DISABLED hands the rewritten packet to
	 * bpf_redirect_neigh without a next hop: the kernel then does the route
	 * and neighbour lookup itself. Any other refusal keeps the connection
	 * working through the balancer's NAT. */
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH &&
	    rc != BPF_FIB_LKUP_RET_FWD_DISABLED) {
		count(INBAND_AGENT_NO_ROUTE);
		return TC_ACT_OK;
	}
	if (!udp && bpf_skb_load_bytes(skb, l4_off + 12, tcp_doff_flags, sizeof(tcp_doff_flags)))
		return TC_ACT_OK;

	__builtin_memcpy(old_addrs, &a->saddr, 16);
	__builtin_memcpy(old_addrs + 4, &a->daddr, 16);
	__builtin_memcpy(new_addrs, &svc->vip_addr, 16);
	__builtin_memcpy(new_addrs + 4, &flow->client_addr, 16);
	/* IPv4 sums the last word of each address only. */
	if (v4) {
		addr_diff = bpf_csum_diff(&old_addrs[3], 4, &new_addrs[3], 4, 0);
		addr_diff = bpf_csum_diff(&old_addrs[7], 4, &new_addrs[7], 4, addr_diff);
	} else {
		addr_diff = bpf_csum_diff(old_addrs, sizeof(old_addrs), new_addrs, sizeof(new_addrs), 0);
	}
	port_diff = bpf_csum_diff((__be32 *)old_ports, sizeof(old_ports), (__be32 *)new_ports, sizeof(new_ports), 0);
	if (addr_diff < 0 || port_diff < 0)
		return TC_ACT_OK;
	/* Addresses are in the pseudo-header: BPF_F_PSEUDO_HDR keeps the
	 * partial checksum of a CHECKSUM_PARTIAL (GSO) skb right, where the
	 * ports are summed later by the device and must not be added now. A
	 * UDP checksum of 0 (IPv4: none) stays 0 and a computed 0 goes out as
	 * 0xffff (BPF_F_MARK_MANGLED_0). */
	__u64 mangled = udp ? BPF_F_MARK_MANGLED_0 : 0;

	if (udp && skb->gso_segs > 1) {
		if (gso_pseudo_csum_nat(skb, check_off, old_addrs, new_addrs, v4))
			return TC_ACT_OK;
	} else {
		bpf_l4_csum_replace(skb, check_off, 0, addr_diff, BPF_F_PSEUDO_HDR | mangled);
		bpf_l4_csum_replace(skb, check_off, 0, port_diff, mangled);
	}
	if (v4) {
		bpf_l3_csum_replace(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, check), 0, addr_diff, 0);
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, saddr), &new_addrs[3], 4, 0);
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, daddr), &new_addrs[7], 4, 0);
	} else {
		bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct ipv6hdr, saddr), new_addrs, sizeof(new_addrs),
				    0);
	}
	bpf_skb_store_bytes(skb, l4_off, new_ports, sizeof(new_ports), 0);

	if ((tcp_doff_flags[1] & (INBAND_TCP_SYN | INBAND_TCP_ACK)) == (INBAND_TCP_SYN | INBAND_TCP_ACK))
		clamp_mss(skb, l4_off, (tcp_doff_flags[0] >> 4) * 4, v4 ? INBAND_OPT_DATA_MAX_LEN : INBAND_OPT6_DATA_MAX_LEN);
	count(INBAND_AGENT_DSR_REWRITES);

	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED)
		return bpf_redirect_neigh(skb->ifindex, NULL, 0, 0);
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {};

		if (v4) {
			nh.nh_family = INBAND_AF_INET;
			nh.ipv4_nh = fib.ipv4_dst; /* the gateway, or the client if on-link */
		} else {
			nh.nh_family = INBAND_AF_INET6;
			__builtin_memcpy(nh.ipv6_nh, fib.ipv6_dst, 16);
		}
		return bpf_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), fib.dmac, ETH_ALEN, 0);
	bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_source), fib.smac, ETH_ALEN, 0);
	/* BPF_FIB_LOOKUP_OUTPUT with ifindex = this device only matches routes
	 * through this device, so fib.ifindex is the device the packet already
	 * leaves by: passing it on avoids a bpf_redirect to ourselves, which
	 * would run the egress qdisc and this program a second time. */
	return TC_ACT_OK;
}

/*
 * A server's RST goes back through the balancer, not direct, like a packet
 * of a connection without a tuple. There it ends the flow (in DSR the
 * balancer sees no other sign that the server gave the connection up, and
 * would count it open until it idled out), and a RST answering a SYN — the
 * service is not listening — counts against the backend in the balancer's
 * passive health checks. One small packet per connection at most: DSR's
 * byte share does not notice it.
 */
static __always_inline int is_reset(struct __sk_buff *skb, const struct apkt *a)
{
	__u8 flags = 0;

	return !bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + a->hlen + 13, &flags, sizeof(flags)) && (flags & INBAND_TCP_RST);
}

SEC("tc")
int agent_egress(struct __sk_buff *skb)
{
	struct inband_service *svc;
	struct inband_dsr_flow *flow;
	struct inband_conn_key key;
	struct apkt a = {};
	__u32 *carrier;
	int is_carrier;

	if (apkt_parse(skb, &a) || a.frag || !a.proto)
		return TC_ACT_OK;
	svc = service_of(&a, a.ports[0]);
	if (!svc)
		return TC_ACT_OK;
	/* The clone answer_score sent: everything but the carrier's own
	 * edits was done to it already, as the packet it was cloned from. */
	carrier = carrier_state();
	is_carrier = carrier && *carrier == CARRIER_WANTED;
	if (is_carrier)
		*carrier = CARRIER_HANDLED;
	if (score_counts_requests() && a.proto == IPPROTO_TCP && !is_carrier)
		track_request(skb, &a, 0);
	key = conn_key(&a, 0);
	flow = bpf_map_lookup_elem(&dsr_flows, &key);
	if (!flow && !is_carrier && a.proto == IPPROTO_TCP && a.tot_len - a.hlen <= INBAND_TCP_MAX_HDR) {
		/* A TIME_WAIT's answer: direct like the rest of its
		 * connection (its copy has no score to answer). A TIME_WAIT
		 * sends ACKs and RSTs, never data: a segment that may hold
		 * data (the traffic of peers that are not balancers) skips
		 * this second lookup. */
		flow = bpf_map_lookup_elem(&closed_flows, &key);
		if (flow)
			count(INBAND_AGENT_CLOSED_FLOW_SEGMENTS);
	}
	if (!flow)
		return is_carrier ? TC_ACT_SHOT : TC_ACT_OK;
	if (is_carrier)
		return make_carrier(skb, &a, flow);
	if (a.proto == INBAND_IPPROTO_UDP && udp_tuple_expired(flow, bpf_ktime_get_coarse_ns())) {
		if (!bpf_map_delete_elem(&dsr_flows, &key))
			count(INBAND_AGENT_UDP_TUPLES_EXPIRED);
		return TC_ACT_OK;
	}
	/* Before the score: a 125 moves the transport header. */
	if (a.proto == IPPROTO_TCP && flow->ts_shift)
		ts_shift(skb, INBAND_ETH_HLEN + a.hlen, TS_ECR, -flow->ts_shift);
	if (flow->score_requested) {
		int verdict = answer_score(skb, &a, flow);

		if (verdict >= 0)
			return verdict;
	}
	if (inband_addr_is_zero(&flow->client_addr))
		return TC_ACT_OK;
	if (a.proto == IPPROTO_TCP && is_reset(skb, &a)) {
		count(INBAND_AGENT_RESETS_VIA_BALANCER);
		return steer_to_instance(skb, flow);
	}
	return dsr(skb, &a, svc, flow);
}

/*
 * The socket fields connection counting reads, declared here instead of
 * taken from a generated vmlinux.h: the rest of this file builds on UAPI
 * headers, which clash with vmlinux.h, and checking in a kernel-specific
 * dump of every kernel type for a dozen fields is not worth it.
 * preserve_access_index makes libbpf relocate each field by name against
 * the running kernel's BTF (through its anonymous unions), so a kernel that
 * lays them out differently still works.
 */
struct ns_common {
	unsigned int inum;
} __attribute__((preserve_access_index));

struct net {
	struct ns_common ns;
} __attribute__((preserve_access_index));

typedef struct {
	struct net *net;
} possible_net_t;

struct sock_common {
	__be32 skc_daddr;
	__be16 skc_dport;
	unsigned short skc_family;
	possible_net_t skc_net;
	struct in6_addr skc_v6_daddr;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	__u16 sk_protocol;
} __attribute__((preserve_access_index));

/* The local port: inet_sport, not skc_num, which the kernel zeroes when it
 * unhashes a closing socket, before the change to CLOSE is traced. */
struct inet_sock {
	__be16 inet_sport;
} __attribute__((preserve_access_index));

/* The agent's network namespace (inode), set by the control plane at load.
 * A tracepoint sees every namespace of the host: on a machine with several
 * servers in namespaces (a testbed, containers) each agent must count only
 * its own sockets. 0 = count every namespace. */
const volatile __u32 agent_netns_ino = 0;

/* Active from the handshake until the client's FIN or RST arrives: the span
 * in which the balancer counts the connection open (it counts `closed` at
 * the client's FIN or RST, select.h). A score that counted otherwise would
 * bias the estimate at every report: CLOSE_WAIT (the client closed, the
 * application has not) counted connections the balancer had already
 * closed, and leaving out FIN_WAIT (the server closed first, the client's
 * FIN not yet in) dropped connections whose close the balancer was still
 * to count. The busiest and the fastest-refusing backends looked idlest:
 * a server answering 503 at once drew every new connection. */
static __always_inline int is_active(int state)
{
	return state == INBAND_TCP_SYN_RECV || state == INBAND_TCP_ESTABLISHED ||
	       state == INBAND_TCP_FIN_WAIT1 || state == INBAND_TCP_FIN_WAIT2;
}

/*
 * Whether a socket is in `active_conns`, kept on the socket itself.
 * Counting the deltas of state changes alone drifts: the kernel skips a
 * tracing program that fires while the same program runs on that CPU (a
 * softirq's state change interrupting a process's; bpftool shows them as
 * recursion_misses), and each skipped change stayed in the count for good:
 * a server taking 1,200 new connections a second drifted by one or two
 * every 20 s, and to a 1-worker server among larger ones one phantom
 * connection is its whole capacity. With the mark, a socket is
 * counted by what it is, not by the changes seen: a missed change is made
 * up at its next one, and a socket destroyed while counted is uncounted
 * then. A socket without a mark is one from before the agent started (the
 * /proc seed counted it) or one whose mark could not be allocated: its
 * change counts as a delta, as before.
 */
enum {
	INBAND_CONN_UNMARKED = 0,
	INBAND_CONN_COUNTED = 1,
	INBAND_CONN_UNCOUNTED = 2,
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} conn_counted SEC(".maps");

/* The active_conns entry of `sk` if it is a TCP socket of a served port in
 * this agent's namespace, else NULL. */
static __always_inline __s64 *served_count(const struct sock *sk, __u16 *port)
{
	unsigned short family = sk->__sk_common.skc_family;

	if (sk->sk_protocol != IPPROTO_TCP || (family != INBAND_AF_INET && family != INBAND_AF_INET6))
		return NULL;
	if (agent_netns_ino && sk->__sk_common.skc_net.net->ns.inum != agent_netns_ino)
		return NULL;
	/* Read, not loaded: the field lies past struct sock, where the
	 * verifier lets a BTF pointer to a sock load nothing. */
	*port = bpf_ntohs(BPF_CORE_READ((const struct inet_sock *)sk, inet_sport));
	/* The control plane creates an entry per served port: everything else
	 * (the host's own client connections, other services) is skipped. */
	return bpf_map_lookup_elem(&active_conns, port);
}

/* The socket's peer. An IPv6 socket's peer may be IPv4-mapped (a
 * dual-stack socket serving an IPv4 client): exactly how the maps hold
 * IPv4. */
static __always_inline void peer_addr(const struct sock *sk, struct inband_addr *out)
{
	if (sk->__sk_common.skc_family == INBAND_AF_INET)
		*out = inband_addr4(sk->__sk_common.skc_daddr);
	else
		bpf_probe_read_kernel(out, sizeof(*out), &sk->__sk_common.skc_v6_daddr);
}

/*
 * Whether `sk` is a balancer's own connection (its health checks): from a
 * balancer's address, on a source port above the balancers' SNAT range
 * (wire.h), where the balancer host's kernel picks its ports. Its clients'
 * connections come from that address too, on SNAT ports, and are counted.
 * The balancer never learns when a health check's connection ends, so a
 * report taken while one was open (one in a few hundred at the default
 * 500 ms interval) left the backend an extra connection until the report
 * decayed: under least-score at light load, two seconds in which the
 * other idle backends took every new connection. Every balancer's checks
 * arrive so, not only the reporting one's.
 */
static __always_inline int balancer_own(const struct sock *sk)
{
	struct inband_addr peer;

	if (bpf_ntohs(sk->__sk_common.skc_dport) <= INBAND_SNAT_PORT_MAX)
		return 0;
	peer_addr(sk, &peer);
	return bpf_map_lookup_elem(&balancers, &peer) != NULL;
}

/* Moves `sk`'s mark from `seen` to `to` and the count with it; one CPU
 * wins a race for the same socket. */
static __always_inline void recount(__s64 *active, __u32 *mark, __u32 seen, __u32 to, int delta)
{
	if (mark && __sync_val_compare_and_swap(mark, seen, to) != seen)
		return;
	if (delta)
		__sync_fetch_and_add(active, delta);
}

/* The socket's connection has ended: its request state goes, and its client
 * tuple with it unless its timestamps are translated (below). A socket that
 * closed first (`server_first`: it leaves through FIN_WAIT or CLOSING)
 * becomes a TIME_WAIT, which answers the client's FIN, and the client's
 * retransmissions of it, after the socket is gone. Without the tuple that
 * ACK went to the balancer's tuple: through the balancer at its cost, and
 * with fleet tuples to a fleet address, which reaches no instance; the
 * client then retransmitted its FIN for minutes in LAST_ACK, its port
 * taken. So the tuple moves to closed_flows. */
static __always_inline void forget_connection(struct sock *sk, __u16 port, int server_first)
{
	struct inband_conn_key key;

	__builtin_memset(&key, 0, sizeof(key));
	peer_addr(sk, &key.peer_addr);
	key.peer_port = sk->__sk_common.skc_dport;
	key.local_port = bpf_htons(port);
	key.proto = IPPROTO_TCP;
	struct inband_dsr_flow *flow = bpf_map_lookup_elem(&dsr_flows, &key);

	/* A connection whose timestamps are translated still gets segments
	 * after its socket is gone: its TIME_WAIT takes the client's last FIN
	 * and ACKs, which must carry the same shift or be refused (PAWS); a
	 * frozen one's stray segments must be dropped, not reset.
	 * Its entry stays until the next SYN on these ports replaces it (a
	 * 155) or forgets it (none), or the LRU evicts it. */
	if (flow && (flow->ts_shift || (flow->frozen_until_ms && frozen(flow)))) {
		count(INBAND_AGENT_FLOWS_CLOSED);
	} else {
		if (flow && server_first && !inband_addr_is_zero(&flow->client_addr)) {
			struct inband_dsr_flow closed = *flow;

			closed.score_requested = 0;
			bpf_map_update_elem(&closed_flows, &key, &closed, BPF_ANY);
		}
		if (!bpf_map_delete_elem(&dsr_flows, &key))
			count(INBAND_AGENT_FLOWS_CLOSED);
	}
	if (score_counts_requests()) {
		__u32 *busy = bpf_map_lookup_elem(&inflight_conns, &key);
		__s64 *n = bpf_map_lookup_elem(&inflight, &port);

		/* A connection that ends mid-request stops counting. */
		if (busy && n && __sync_val_compare_and_swap(busy, 1, 0) == 1)
			__sync_fetch_and_add(n, -1);
		bpf_map_delete_elem(&inflight_conns, &key);
	}
}

SEC("tp_btf/inet_sock_set_state")
int agent_sock_state(__u64 *ctx)
{
	struct sock *sk = (void *)ctx[0];
	int oldstate = (int)ctx[1], newstate = (int)ctx[2];
	__u16 port;
	__s64 *active = served_count(sk, &port);

	if (!active)
		return 0;
	/* A balancer's own connection is marked too, uncounted: its first
	 * change to an active state creates the mark, and with it every later
	 * change knows it was never counted. */
	int want = is_active(newstate) && !balancer_own(sk);
	__u32 *mark = bpf_sk_storage_get(&conn_counted, sk, 0, is_active(newstate) ? BPF_SK_STORAGE_GET_F_CREATE : 0);
	__u32 seen = mark ? *mark : INBAND_CONN_UNMARKED;
	/* Unmarked: from before the agent (counted by the seed as its old
	 * state says), or new and its first change missed (a socket leaving
	 * SYN_RECV was created after the agent, which never counted it). */
	int had = seen == INBAND_CONN_COUNTED ||
		  (seen == INBAND_CONN_UNMARKED && oldstate != INBAND_TCP_SYN_RECV && is_active(oldstate));

	recount(active, mark, seen, want ? INBAND_CONN_COUNTED : INBAND_CONN_UNCOUNTED, want - had);
	/* A socket leaving SYN_RECV for CLOSE never carried the connection:
	 * when the handshake's last ACK and the first data segment are taken
	 * on two CPUs at once, each makes a child socket for the same request,
	 * and the one that loses the race to hash it is closed at once
	 * (inet_ehash_nolisten) with the very tuple of the child that won. Its
	 * close must not take the winner's flow: the response would go back
	 * through the balancer. A handshake that truly dies there leaves its
	 * flow to the next SYN on those ports (a 155 replaces it, a SYN
	 * without forgets it) or to the LRU. */
	if ((newstate == INBAND_TCP_CLOSE || newstate == INBAND_TCP_TIME_WAIT) && oldstate != INBAND_TCP_SYN_RECV)
		forget_connection(sk, port,
				  oldstate == INBAND_TCP_FIN_WAIT1 || oldstate == INBAND_TCP_FIN_WAIT2 ||
					  oldstate == INBAND_TCP_CLOSING || newstate == INBAND_TCP_TIME_WAIT);
	return 0;
}

/* The last word on a socket: if it is still counted (the change that ended
 * it was missed), it is uncounted now. */
SEC("tp_btf/tcp_destroy_sock")
int agent_sock_destroy(__u64 *ctx)
{
	struct sock *sk = (void *)ctx[0];
	__u16 port;
	__s64 *active = served_count(sk, &port);

	if (!active)
		return 0;
	__u32 *mark = bpf_sk_storage_get(&conn_counted, sk, 0, 0);

	if (mark && *mark == INBAND_CONN_COUNTED)
		recount(active, mark, INBAND_CONN_COUNTED, INBAND_CONN_UNCOUNTED, -1);
	return 0;
}

/*
 * The client's address for the server application (`client_address`;
 * docs/agent.md, "The client's address in the application"). With full
 * NAT the server's socket is connected to the balancer's SNAT address;
 * getpeername() and accept() (the kernel runs the same hook for both,
 * through inet_getname) then answer with the client the 155 named, from
 * the flow the ingress program stored after checking the option. Nothing
 * else changes: the socket, its packets and everything that reads them
 * keep the balancer's address.
 */

/* The agent's network namespace (cookie), set by the control plane at
 * load. A cgroup holds processes of every namespace, and another agent's
 * namespace may hold a socket with the same ports toward the same
 * balancer: only this agent's flows may answer for this namespace's
 * sockets. */
const volatile __u64 agent_netns_cookie = 0;

/* The client tuple of the socket whose peer is `peer`:`ctx->user_port`,
 * or NULL: not a TCP socket of this namespace, no flow for it, or a
 * socket already closed. A flow is deleted when its socket reaches CLOSE,
 * and another connection may have stored one on the same ports since (an
 * accept() returns a connection reset while it waited in the backlog): a
 * closed socket gets the balancer's address, never that one. Such a
 * socket's local port (skc_num) reads 0 already, since the kernel
 * releases the port of an accepted socket as it closes, and no flow has
 * port 0; the state test holds whatever the port reads. While the socket
 * lives its flow is its own, since a 155 for ports a live socket owns is
 * not stored (trust.h). Only a balancer's address can have a flow, so the
 * peer needs no check against `balancers`. */
static __always_inline const struct inband_dsr_flow *peer_flow(struct bpf_sock_addr *ctx,
							       const struct inband_addr *peer)
{
	struct bpf_sock *sk = ctx->sk;

	if (ctx->protocol != IPPROTO_TCP || !sk || sk->state == INBAND_TCP_CLOSE)
		return NULL;
	if (bpf_get_netns_cookie(ctx) != agent_netns_cookie)
		return NULL;
	struct inband_conn_key key = {
		.peer_addr = *peer,
		.peer_port = (__be16)ctx->user_port,
		.local_port = bpf_htons((__u16)sk->src_port),
		.proto = IPPROTO_TCP,
	};
	const struct inband_dsr_flow *flow = bpf_map_lookup_elem(&dsr_flows, &key);

	if (!flow || inband_addr_is_zero(&flow->client_addr))
		return NULL;
	return flow;
}

SEC("cgroup/getpeername4")
int agent_peer4(struct bpf_sock_addr *ctx)
{
	struct inband_addr peer = inband_addr4(ctx->user_ip4);
	const struct inband_dsr_flow *flow = peer_flow(ctx, &peer);

	/* A VIP's backends share its family (lb config), so an IPv4 socket's
	 * client is IPv4; the test only keeps a corrupt flow out. */
	if (flow && inband_addr_is4(&flow->client_addr)) {
		ctx->user_ip4 = flow->client_addr.w[3];
		ctx->user_port = flow->client_port;
		count(INBAND_AGENT_CLIENT_ADDRESS_SHOWN);
	}
	return 1;
}

/* IPv6 sockets, dual-stack ones serving IPv4 clients included: their peer
 * is IPv4-mapped, which is how the flows hold IPv4, so the client comes
 * out IPv4-mapped as well. */
SEC("cgroup/getpeername6")
int agent_peer6(struct bpf_sock_addr *ctx)
{
	struct inband_addr peer = { .w = { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] } };
	const struct inband_dsr_flow *flow = peer_flow(ctx, &peer);

	if (flow) {
		ctx->user_ip6[0] = flow->client_addr.w[0];
		ctx->user_ip6[1] = flow->client_addr.w[1];
		ctx->user_ip6[2] = flow->client_addr.w[2];
		ctx->user_ip6[3] = flow->client_addr.w[3];
		ctx->user_port = flow->client_port;
		count(INBAND_AGENT_CLIENT_ADDRESS_SHOWN);
	}
	return 1;
}

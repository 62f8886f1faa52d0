// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The real-server agent: tc ingress + tc egress on the server's interface and
 * a tracepoint on TCP state changes. See "Real-server agent walk (tc)" in
 * docs/architecture.md.
 *
 * Packet access goes through bpf_skb_load_bytes/bpf_skb_store_bytes rather
 * than direct packet pointers: at tc the headers of a non-linear skb need not
 * sit in the linear area, and the copies are a few dozen bytes.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>

#include "inband/agent/maps.h"
#include "inband/agent/options.h"
#include "inband/agent/trust.h"
#include "inband/agent/verify.h"
#include "inband/agent_skb.h"
#include "inband/auth.h"
#include "inband/csum.h"
#include "inband/wire.h"

/* GPL: bpf_fib_lookup is a GPL-only helper. */
char LICENSE[] SEC("license") = "Dual BSD/GPL";

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

/*
 * Request-in-flight accounting for the "requests" score: a connection is
 * busy from the first client payload byte until the server's first payload
 * byte after it. Pipelined requests on one connection count once; a
 * request's body arriving while the response streams does not re-arm it.
 */
static __always_inline void track_request(struct __sk_buff *skb, const struct iphdr *iph, __u32 hlen,
					  const __be16 *ports, int from_client)
{
	struct inband_conn_key key;
	__u8 doff;
	__u16 port;
	__s64 *count;
	__u32 *busy;

	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + hlen + 12, &doff, 1))
		return;
	if (bpf_ntohs(iph->tot_len) <= hlen + (doff >> 4) * 4)
		return; /* no payload: ACKs, SYNs, FINs do not change it */
	key.peer_addr = from_client ? iph->saddr : iph->daddr;
	key.peer_port = from_client ? ports[0] : ports[1];
	key.local_port = from_client ? ports[1] : ports[0];
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

/*
 * A 155 from a balancer, in the configured format (`opt`, `len` bytes),
 * on the TCP segment at `l4_off`. Stored only from a SYN whose checksums
 * verify and, authenticated, whose MAC does; never over a live socket's
 * connection.
 */
static __always_inline int take_client_tuple(struct __sk_buff *skb, const struct iphdr *iph, __u32 l4_off,
					     const __be16 *ports, const __u32 *opt, __u32 len, __u8 auth_mode)
{
	const __u8 *o = (const __u8 *)opt;
	struct inband_conn_key key = { .peer_addr = iph->saddr, .peer_port = ports[0], .local_port = ports[1] };
	struct inband_dsr_flow val = {};
	__u8 flags;
	__be32 seq;

	if (bpf_skb_load_bytes(skb, l4_off + 4, &seq, sizeof(seq)) ||
	    bpf_skb_load_bytes(skb, l4_off + 13, &flags, sizeof(flags)))
		return malformed();
	/* A client tuple starts a connection: on any other packet it could
	 * only redirect one that exists. */
	if ((flags & (INBAND_TCP_SYN | INBAND_TCP_ACK)) != INBAND_TCP_SYN)
		return drop(INBAND_AGENT_NOT_SYN);
	if (!ipv4_csum_ok(skb, iph->ihl * 4) ||
	    !tcp_csum_ok(skb, l4_off, bpf_ntohs(iph->tot_len) - iph->ihl * 4, iph->saddr, iph->daddr))
		return drop(INBAND_AGENT_BAD_CHECKSUM);
	if (auth_mode == INBAND_AUTH_NONE) {
		__builtin_memcpy(&val.client_addr, o + 2, sizeof(val.client_addr));
		__builtin_memcpy(&val.client_port, o + 6, sizeof(val.client_port));
	} else {
		if (!tuple_mac_ok(iph, ports, seq, o))
			return drop(INBAND_AGENT_AUTH_FAILED);
		__builtin_memcpy(&val.client_addr, o + INBAND_AUTH_TUPLE_ADDR_OFF, sizeof(val.client_addr));
		__builtin_memcpy(&val.client_port, o + INBAND_AUTH_TUPLE_PORT_OFF, sizeof(val.client_port));
	}
	/* The SYN itself still reaches the stack, which answers it with a
	 * challenge ACK. */
	if (tuple_owned_by_live_socket(skb, iph, ports)) {
		count(INBAND_AGENT_TUPLE_IN_USE);
		return strip_option(skb, iph, opt, len);
	}
	if (!bpf_map_update_elem(&dsr_flows, &key, &val, BPF_ANY))
		count(INBAND_AGENT_TUPLES_STORED);
	return strip_option(skb, iph, opt, len);
}

/*
 * A SYN from a balancer that carries no 155 opens a connection whose
 * responses go back through the balancer (a pass-through VIP, the balancer
 * host's own connection). A tuple stored for an earlier handshake on the
 * same ports that never became a socket (a SYN flood's: nothing deletes
 * those until the LRU does) would send them to that handshake's client, so
 * it is forgotten; a live socket's tuple is not, whoever sent the SYN.
 * Returns TC_ACT_OK: the packet goes on unchanged.
 */
static __always_inline int forget_unfinished_handshake(struct __sk_buff *skb, const struct iphdr *iph, __u32 hlen)
{
	struct inband_conn_key key = { .peer_addr = iph->saddr };
	__be16 ports[2];
	__u8 flags;

	if (iph->protocol != IPPROTO_TCP ||
	    bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + hlen + 13, &flags, sizeof(flags)) ||
	    (flags & (INBAND_TCP_SYN | INBAND_TCP_ACK)) != INBAND_TCP_SYN ||
	    bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + hlen, ports, sizeof(ports)))
		return TC_ACT_OK;
	key.peer_port = ports[0];
	key.local_port = ports[1];
	/* Entries are keyed by a balancer's address: no other sender finds one. */
	if (!bpf_map_lookup_elem(&dsr_flows, &key) || tuple_owned_by_live_socket(skb, iph, ports))
		return TC_ACT_OK;
	if (!bpf_map_delete_elem(&dsr_flows, &key))
		count(INBAND_AGENT_STALE_TUPLES_FORGOTTEN);
	return TC_ACT_OK;
}

/*
 * A 124 from a balancer, in the configured format. It asks for a score on
 * a connection whose 155 was accepted; its key and nonce are kept for the
 * 125 that answers it.
 */
static __always_inline int take_score_request(struct __sk_buff *skb, const struct iphdr *iph,
					      const __be16 *ports, const __u32 *opt, __u32 len, __u8 auth_mode)
{
	const __u8 *o = (const __u8 *)opt;
	struct inband_conn_key key = { .peer_addr = iph->saddr, .peer_port = ports[0], .local_port = ports[1] };
	struct inband_dsr_flow *flow;
	__be32 nonce = 0;
	__u8 key_id = 0;

	if (auth_mode != INBAND_AUTH_NONE) {
		if (!request_mac_ok(iph, ports, o))
			return drop(INBAND_AGENT_AUTH_FAILED);
		key_id = o[INBAND_AUTH_REQUEST_KEY_OFF];
		__builtin_memcpy(&nonce, o + INBAND_AUTH_REQUEST_NONCE_OFF, sizeof(nonce));
	}
	flow = bpf_map_lookup_elem(&dsr_flows, &key);
	/* No entry is created: entries exist only for accepted 155s, so
	 * packets from a balancer's address cannot fill the table. */
	if (!flow || !flow->client_addr) {
		count(INBAND_AGENT_PROBE_UNKNOWN_FLOW);
		return strip_option(skb, iph, opt, len);
	}
	/* Key and nonce before the flag: egress on another CPU reads them
	 * once it sees the flag. A torn pair from two racing 124s only makes
	 * the balancer refuse one 125. */
	flow->probe_key = key_id;
	flow->probe_nonce = nonce;
	flow->score_requested = 1;
	count(INBAND_AGENT_PROBES_SEEN);
	return strip_option(skb, iph, opt, len);
}

SEC("tc")
int agent_ingress(struct __sk_buff *skb)
{
	const struct inband_agent_config *cfg;
	struct iphdr iph;
	__u32 opt[OPT_MAX_WORDS] = {};
	__be16 ports[2];
	__be16 h_proto;
	__u32 hlen, tot, len;
	__u8 *o = (__u8 *)opt;

	if (bpf_skb_load_bytes(skb, offsetof(struct ethhdr, h_proto), &h_proto, sizeof(h_proto)) ||
	    h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, &iph, sizeof(iph)))
		return malformed();
	hlen = iph.ihl * 4;
	tot = bpf_ntohs(iph.tot_len);
	if (iph.version != 4 || hlen < INBAND_IPV4_MIN_HDR || tot < hlen ||
	    INBAND_ETH_HLEN + tot > skb->len)
		return malformed();
	if (score_requests && iph.protocol == IPPROTO_TCP &&
	    !(iph.frag_off & bpf_htons(INBAND_IP_MF | INBAND_IP_OFFSET)) &&
	    !bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + hlen, ports, sizeof(ports)))
		track_request(skb, &iph, hlen, ports, 1);
	/* The balancer sets DF; a fragment is nobody's inband packet, and later
	 * fragments have no ports to check the service against. */
	if (iph.frag_off & bpf_htons(INBAND_IP_MF | INBAND_IP_OFFSET))
		return TC_ACT_OK;
	if (hlen == INBAND_IPV4_MIN_HDR)
		return forget_unfinished_handshake(skb, &iph, hlen);

	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV4_MIN_HDR, o, 2))
		return malformed();
	if (o[0] == IPOPT_END || o[0] == IPOPT_NOOP)
		return forget_unfinished_handshake(skb, &iph, hlen);
	if (o[1] < 2 || o[1] > hlen - INBAND_IPV4_MIN_HDR)
		return malformed();
	if (o[0] != INBAND_OPT_CLIENT_TUPLE && o[0] != INBAND_OPT_SCORE_REQUEST)
		return forget_unfinished_handshake(skb, &iph, hlen);
	if (iph.protocol != IPPROTO_TCP)
		return TC_ACT_OK;
	if (tot < hlen + sizeof(struct tcphdr) ||
	    bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + hlen, ports, sizeof(ports)))
		return malformed();

	if (!bpf_map_lookup_elem(&services, &ports[1]))
		return TC_ACT_OK;
	/* Anyone can put a 155 on a packet; only a balancer's may steer where
	 * this server sends its responses. */
	if (!bpf_map_lookup_elem(&balancers, &iph.saddr)) {
		count(INBAND_AGENT_UNTRUSTED_OPTION);
		return TC_ACT_OK;
	}
	cfg = agent_cfg();
	if (!cfg)
		return TC_ACT_OK;
	/* A balancer of this deployment sends only the configured format:
	 * anything else from its address is forged (or a balancer configured
	 * differently, which is found by this counter). */
	len = o[1];
	if (len != configured_len(o[0], cfg->auth_mode))
		return drop(INBAND_AGENT_WRONG_FORMAT);
	barrier_var(len);
	if (len > sizeof(opt))
		return malformed();
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + INBAND_IPV4_MIN_HDR, opt, len))
		return malformed();
	if (o[0] == INBAND_OPT_CLIENT_TUPLE)
		return take_client_tuple(skb, &iph, INBAND_ETH_HLEN + hlen, ports, opt, len, cfg->auth_mode);
	return take_score_request(skb, &iph, ports, opt, len, cfg->auth_mode);
}

/* Local port in host order: the key of active_conns and score_override. */
static __always_inline __u16 current_score(__u16 port)
{
	__u32 *override = bpf_map_lookup_elem(&score_override, &port);
	__s64 *active;

	if (override)
		return *override > 0xffff ? 0xffff : *override;
	active = bpf_map_lookup_elem(score_requests ? (void *)&inflight : (void *)&active_conns, &port);
	if (!active || *active < 0)
		return 0;
	return *active > 0xffff ? 0xffff : *active;
}

/*
 * The authenticated 125 answering the flow's 124: signed with that 124's
 * key and nonce over the connection as the balancer sees it (it is the
 * destination). Returns 0 if the key is gone (removed by a rotation since
 * the 124 arrived).
 */
static __noinline int sign_score(__u32 *opt, const struct iphdr *iph, const __be16 *ports,
				 const struct inband_dsr_flow *flow, __u16 score)
{
	const struct inband_auth_key *key = auth_key(flow->probe_key);
	struct inband_mac_msg m;

	if (!key)
		return 0;
	inband_mac_msg_init(&m, INBAND_OPT_SCORE, flow->probe_key, flow->probe_nonce, iph->daddr, ports[1],
			    iph->saddr, ports[0]);
	m.score = bpf_htons(score);
	inband_encode_auth_score((__u8 *)opt, score, flow->probe_nonce, inband_mac(key, &m));
	return 1;
}

/*
 * Adds the 125 the flow owes. Returns 1 if it did; otherwise the flag stays
 * set (a later packet answers) unless the answer cannot be signed at all.
 */
static __always_inline int add_score(struct __sk_buff *skb, const struct iphdr *iph, const __be16 *ports,
				     struct inband_dsr_flow *flow)
{
	const struct inband_agent_config *cfg = agent_cfg();
	__u32 opt[INBAND_OPT_AUTH_SCORE_LEN / 4] = {};
	__u32 len;
	__u16 score;

	if (!cfg)
		return 0;
	len = cfg->auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_LEN : INBAND_OPT_AUTH_SCORE_LEN;
	/* No room left in a 60-byte header. */
	if (iph->ihl * 4 + len > INBAND_IPV4_MAX_HDR) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return 0;
	}
	/* The packet would leave bigger than the interface sends: dropped
	 * by the stack or fragmented, and fragments never reach a balancer
	 * as a 125. */
	if (bpf_ntohs(iph->tot_len) + len > cfg->mtu) {
		count(INBAND_AGENT_SCORE_DEFERRED_MTU);
		return 0;
	}
	score = current_score(bpf_ntohs(ports[0]));
	if (cfg->auth_mode == INBAND_AUTH_NONE) {
		inband_encode_score((__u8 *)opt, score);
	} else if (!sign_score(opt, iph, ports, flow, score)) {
		flow->score_requested = 0;
		count(INBAND_AGENT_AUTH_FAILED);
		return 0;
	}
	if (insert_option(skb, iph, opt, len)) {
		count(INBAND_AGENT_ADJUST_FAILED);
		return 0;
	}
	flow->score_requested = 0;
	count(INBAND_AGENT_SCORES_SENT);
	return 1;
}

static __always_inline int dsr(struct __sk_buff *skb, const struct iphdr *iph, __u32 hlen,
			       const struct inband_service *svc,
			       const struct inband_dsr_flow *flow, const __be16 *ports)
{
	struct bpf_fib_lookup fib = {};
	__u32 l4_off = INBAND_ETH_HLEN + hlen;
	__be32 old_addrs[2] = { iph->saddr, iph->daddr };
	__be32 new_addrs[2] = { svc->vip_addr, flow->client_addr };
	__be16 old_ports[2] = { ports[0], ports[1] };
	__be16 new_ports[2] = { svc->vip_port, flow->client_port };
	__s64 addr_diff, port_diff;
	__u8 tcp_doff_flags[2];
	long rc;

	fib.family = INBAND_AF_INET;
	fib.l4_protocol = IPPROTO_TCP;
	fib.sport = svc->vip_port;
	fib.dport = flow->client_port;
	fib.tos = iph->tos;
	/* tot_len = 0 makes the helper check the skb against the MTU itself,
	 * which accepts GSO packets; the IPv4 total length of a GSO packet
	 * exceeds any MTU and would send all bulk data via the balancer. */
	fib.tot_len = 0;
	fib.ifindex = skb->ifindex;
	fib.ipv4_src = svc->vip_addr;
	fib.ipv4_dst = flow->client_addr;
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_OUTPUT);
	/* The helper answers only for a device with IPv4 forwarding on (output
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
	if (bpf_skb_load_bytes(skb, l4_off + 12, tcp_doff_flags, sizeof(tcp_doff_flags)))
		return TC_ACT_OK;

	addr_diff = bpf_csum_diff(old_addrs, sizeof(old_addrs), new_addrs, sizeof(new_addrs), 0);
	port_diff = bpf_csum_diff((__be32 *)old_ports, sizeof(old_ports), (__be32 *)new_ports,
				  sizeof(new_ports), 0);
	if (addr_diff < 0 || port_diff < 0)
		return TC_ACT_OK;
	/* Addresses are in the pseudo-header: BPF_F_PSEUDO_HDR keeps the
	 * partial checksum of a CHECKSUM_PARTIAL (GSO) skb right, where the
	 * ports are summed later by the device and must not be added now. */
	bpf_l4_csum_replace(skb, l4_off + offsetof(struct tcphdr, check), 0, addr_diff,
			    BPF_F_PSEUDO_HDR);
	bpf_l4_csum_replace(skb, l4_off + offsetof(struct tcphdr, check), 0, port_diff, 0);
	bpf_l3_csum_replace(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, check), 0, addr_diff, 0);
	bpf_skb_store_bytes(skb, INBAND_ETH_HLEN + offsetof(struct iphdr, saddr), new_addrs,
			    sizeof(new_addrs), 0);
	bpf_skb_store_bytes(skb, l4_off, new_ports, sizeof(new_ports), 0);

	if ((tcp_doff_flags[1] & (INBAND_TCP_SYN | INBAND_TCP_ACK)) == (INBAND_TCP_SYN | INBAND_TCP_ACK))
		clamp_mss(skb, l4_off, (tcp_doff_flags[0] >> 4) * 4);
	count(INBAND_AGENT_DSR_REWRITES);

	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED)
		return bpf_redirect_neigh(skb->ifindex, NULL, 0, 0);
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {
			.nh_family = INBAND_AF_INET,
			.ipv4_nh = fib.ipv4_dst, /* the gateway, or the client if on-link */
		};

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

SEC("tc")
int agent_egress(struct __sk_buff *skb)
{
	struct inband_service *svc;
	struct inband_dsr_flow *flow;
	struct inband_conn_key key;
	struct iphdr iph;
	__be16 ports[2];
	__be16 h_proto;
	__u32 hlen;

	if (bpf_skb_load_bytes(skb, offsetof(struct ethhdr, h_proto), &h_proto, sizeof(h_proto)) ||
	    h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN, &iph, sizeof(iph)))
		return TC_ACT_OK;
	hlen = iph.ihl * 4;
	if (iph.version != 4 || hlen < INBAND_IPV4_MIN_HDR || iph.protocol != IPPROTO_TCP ||
	    (iph.frag_off & bpf_htons(INBAND_IP_MF | INBAND_IP_OFFSET)))
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, INBAND_ETH_HLEN + hlen, ports, sizeof(ports)))
		return TC_ACT_OK;

	svc = bpf_map_lookup_elem(&services, &ports[0]);
	if (!svc)
		return TC_ACT_OK;
	if (score_requests)
		track_request(skb, &iph, hlen, ports, 0);
	key.peer_addr = iph.daddr;
	key.peer_port = ports[1];
	key.local_port = ports[0];
	flow = bpf_map_lookup_elem(&dsr_flows, &key);
	if (!flow)
		return TC_ACT_OK;
	/* The score rides on a packet that is one segment on the wire: on a
	 * GSO burst every segment would copy the option and return through
	 * the balancer, turning one score into dozens of full-size packets off
	 * the direct path. The burst goes direct; the next small packet (an
	 * ACK, the FIN, the last segment) carries the score. A packet that
	 * cannot carry it goes on as if no score were asked. */
	if (flow->score_requested && skb->gso_segs <= 1 && add_score(skb, &iph, ports, flow))
		return TC_ACT_OK;
	if (!flow->client_addr)
		return TC_ACT_OK;
	return dsr(skb, &iph, hlen, svc, flow, ports);
}

/*
 * The tracepoint record, declared here instead of taken from a generated
 * vmlinux.h: the rest of this file builds on UAPI headers, which clash with
 * vmlinux.h, and checking in a kernel-specific dump of every kernel type for
 * one 72-byte record is not worth it. preserve_access_index makes libbpf
 * relocate each field against the running kernel's BTF (the name matches
 * the kernel's struct), so a kernel that lays the record out differently
 * still works. Layout from
 * /sys/kernel/tracing/events/sock/inet_sock_set_state/format.
 */
struct trace_event_raw_inet_sock_set_state {
	__u64 common; /* common_type/flags/preempt_count/pid: not readable */
	const void *skaddr;
	int oldstate;
	int newstate;
	__u16 sport; /* host order */
	__u16 dport; /* host order */
	__u16 family;
	__u16 protocol;
	__u8 saddr[4];
	__u8 daddr[4];
	__u8 saddr_v6[16];
	__u8 daddr_v6[16];
} __attribute__((preserve_access_index));

/* Just the fields on the way from a socket to its network namespace's
 * inode, relocated by name against the kernel's BTF like the record above. */
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
	possible_net_t skc_net;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
} __attribute__((preserve_access_index));

/* The agent's network namespace (inode), set by the control plane at load.
 * A tracepoint sees every namespace of the host: on a machine with several
 * servers in namespaces (a testbed, containers) each agent must count only
 * its own sockets. 0 = count every namespace. */
const volatile __u32 agent_netns_ino = 0;

static __always_inline int is_active(int state)
{
	return state == INBAND_TCP_SYN_RECV || state == INBAND_TCP_ESTABLISHED ||
	       state == INBAND_TCP_CLOSE_WAIT;
}

SEC("tracepoint/sock/inet_sock_set_state")
int agent_sock_state(struct trace_event_raw_inet_sock_set_state *ctx)
{
	struct inband_conn_key key;
	__u16 port;
	__s64 *active;
	int newstate, delta;

	if (ctx->protocol != IPPROTO_TCP || ctx->family != INBAND_AF_INET)
		return 0;
	if (agent_netns_ino) {
		const struct sock *sk = ctx->skaddr;

		if (BPF_CORE_READ(sk, __sk_common.skc_net.net, ns.inum) != agent_netns_ino)
			return 0;
	}
	port = ctx->sport;
	/* The control plane creates an entry per served port: everything else
	 * (the host's own client connections, other services) is skipped. */
	active = bpf_map_lookup_elem(&active_conns, &port);
	if (!active)
		return 0;
	newstate = ctx->newstate;
	delta = is_active(newstate) - is_active(ctx->oldstate);
	if (delta)
		__sync_fetch_and_add(active, delta);

	if (newstate == INBAND_TCP_CLOSE || newstate == INBAND_TCP_TIME_WAIT) {
		__builtin_memcpy(&key.peer_addr, ctx->daddr, sizeof(key.peer_addr));
		key.peer_port = bpf_htons(ctx->dport);
		key.local_port = bpf_htons(port);
		if (!bpf_map_delete_elem(&dsr_flows, &key))
			count(INBAND_AGENT_FLOWS_CLOSED);
		if (score_requests) {
			__u32 *busy = bpf_map_lookup_elem(&inflight_conns, &key);
			__s64 *n = bpf_map_lookup_elem(&inflight, &port);

			/* A connection that ends mid-request stops counting. */
			if (busy && n && __sync_val_compare_and_swap(busy, 1, 0) == 1)
				__sync_fetch_and_add(n, -1);
			bpf_map_delete_elem(&inflight_conns, &key);
		}
	}
	return 0;
}

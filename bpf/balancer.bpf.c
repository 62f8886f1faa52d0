// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * The balancer: the XDP data path ("Balancer packet walk" in
 * docs/architecture.md) and the sweeper that ages its flow tables ("Flow
 * lifecycle"). Client packets to a VIP are full-NATed to a backend (src =
 * balancer, dst = backend) and may carry option 155 (client tuple, on the
 * SYN of DSR modes) or 124 (score request, in dsr-dynamic). Backend packets
 * to the balancer are NATed back to VIP -> client; a 125 on them may
 * update the backend's score and is stripped. ICMP errors about balanced
 * connections go to whoever can act on them. Anything else passes to the
 * kernel untouched.
 *
 * The parts live in bpf/include/inband/lb/: options.h (IPv4/TCP options),
 * verify.h (checksums), select.h (backend choice), nat.h (SNAT ports),
 * lifecycle.h (flow states and timeouts), score.h (124/125), icmp.h.
 */
#include <linux/bpf.h>
#include <linux/errno.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "inband/lb/common.h"
#include "inband/lb/icmp.h"
#include "inband/lb/lifecycle.h"
#include "inband/lb/nat.h"
#include "inband/lb/options.h"
#include "inband/lb/score.h"
#include "inband/lb/select.h"
#include "inband/lb/verify.h"

/* What established() returns when the packet opens a new connection on the
 * tuple instead (its flow ended): the caller balances it afresh. */
#define REBALANCE (-1)

/* The parsed packet, as every path needs it. */
struct pkt {
	struct ethhdr *eth;
	struct iphdr *iph;
	struct tcphdr *tcp;
	__u32 hlen; /* IPv4 header */
	__u32 tot_len; /* IPv4 total length */
	__u32 frag; /* MF + offset bits */
	__u64 len; /* frame length */
	__u64 now; /* coarse clock, read only on the paths that need it */
	__u8 flags; /* TCP flags (valid once the TCP header is checked) */
};

static __always_inline int tcp_header_ok(const struct pkt *p, void *data_end)
{
	struct tcphdr *tcp = p->tcp;

	if ((void *)(tcp + 1) > data_end || p->hlen + TCP_MIN_HDR > p->tot_len || tcp->doff < 5 ||
	    p->hlen + tcp->doff * 4 > p->tot_len)
		return 0;
	return 1;
}

static __always_inline int is_syn(__u8 flags)
{
	return (flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
}

static __always_inline void count_forward(__u32 backend_id, __u32 vip_id, __u64 bytes, int new_conn, int probe)
{
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &backend_id);
	struct inband_vip_stats *vs = bpf_map_lookup_elem(&vip_stats, &vip_id);

	if (bs) {
		bs->packets++;
		bs->bytes += bytes;
		bs->new_conns += new_conn;
		bs->probes_sent += probe;
	}
	if (vs) {
		vs->packets++;
		vs->bytes += bytes;
		vs->new_conns += new_conn;
	}
}

/*
 * Sends a client packet of flow `f` (a copy, or the entry in `flows`: a
 * probe records its nonce there) to the backend: NAT, TTL, MSS clamp on a
 * SYN, and the option this packet carries, if any. `vc` is the flow's VIP
 * (only dsr-dynamic flows need it: NULL otherwise).
 */
static __always_inline int forward(struct xdp_md *ctx, const struct inband_lb_config *cfg,
				   const struct inband_flow_key *fk, struct inband_flow *f, const struct inband_vip *vc,
				   struct pkt *p, int new_conn)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *iph = p->iph;
	struct tcphdr *tcp = p->tcp;
	__u32 bid = f->backend_id;
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);
	int syn = is_syn(p->flags);

	if (!be || mac_is_zero(be->mac))
		return drop(INBAND_DROP_NO_ROUTE);
	if (iph->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);
	if ((void *)(tcp + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);

	/* L4: NAT rewrite (pseudo-header addresses and ports), MSS clamp. */
	__u32 acc = csum_start(tcp->check);

	acc = csum_replace32(acc, iph->saddr, cfg->self_addr);
	acc = csum_replace32(acc, iph->daddr, f->backend_addr);
	acc = csum_replace16(acc, tcp->source, f->snat_port);
	acc = csum_replace16(acc, tcp->dest, f->backend_port);
	if (syn && f->mode != INBAND_MODE_PASSTHROUGH)
		acc = clamp_mss(ctx, ETH_IP_HLEN, tcp->doff * 4 - TCP_MIN_HDR, acc);
	/* clamp_mss may have re-read the packet: reload what the verifier forgot. */
	data_end = (void *)(long)ctx->data_end;
	tcp = (void *)(long)ctx->data + ETH_IP_HLEN;
	iph = (void *)(long)ctx->data + ETH_HLEN;
	if ((void *)(tcp + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	tcp->source = f->snat_port;
	tcp->dest = f->backend_port;
	tcp->check = csum_finish(acc);

	/* Which option, if any, this packet carries. */
	__u8 opt[INBAND_OPT_AUTH_CLIENT_TUPLE_LEN];
	int optlen = 0, probe = 0;
	__u32 *probe_count = NULL;

	if (syn) {
		if (f->mode != INBAND_MODE_PASSTHROUGH) {
			optlen = cfg->auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_CLIENT_TUPLE_LEN
								    : INBAND_OPT_AUTH_CLIENT_TUPLE_LEN;
			if (p->tot_len + optlen > cfg->mtu) {
				event(INBAND_EV_TUPLE_SKIPPED_MTU);
				optlen = 0;
			} else if (optlen == INBAND_OPT_CLIENT_TUPLE_LEN) {
				inband_encode_client_tuple(opt, fk->client_addr, fk->client_port);
			} else if (!build_auth_tuple(opt, cfg, fk, f, tcp->seq)) {
				optlen = 0;
			}
		}
	} else if (f->mode == INBAND_MODE_DSR_DYNAMIC && vc && (probe_count = probe_wanted(f, vc))) {
		optlen = cfg->auth_mode == INBAND_AUTH_NONE ? INBAND_OPT_SCORE_REQUEST_LEN
							    : INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
		if (p->tot_len + optlen > cfg->mtu) {
			/* The counter stays due: the next packet that fits asks. */
			event(INBAND_EV_PROBE_DEFERRED_MTU);
			optlen = 0;
		} else if (optlen == INBAND_OPT_SCORE_REQUEST_LEN) {
			inband_encode_score_request(opt);
		} else if (!build_auth_request(opt, cfg, f)) {
			optlen = 0;
		}
		if (optlen) {
			f->flags = (f->flags & ~INBAND_FLOW_PROBE_OLD) | INBAND_FLOW_PROBE_OUTSTANDING;
			probe_sent(probe_count, bid);
			probe = 1;
		}
	}

	/* L2: out of the one interface, toward the backend's next hop. */
	struct ethhdr *eth = (void *)(long)ctx->data;

	if ((void *)(eth + 1) > data_end || (void *)(iph + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, be->mac, ETH_ALEN);
	/* L3: incrementally (three words change) unless an option is added,
	 * which rebuilds the header anyway. */
	__u32 l3 = csum_start(iph->check);

	l3 = csum_replace32(l3, iph->saddr, cfg->self_addr);
	l3 = csum_replace32(l3, iph->daddr, f->backend_addr);
	l3 = csum_replace16(l3, load16(&iph->ttl), load16(&iph->ttl) - bpf_htons(0x0100));
	iph->saddr = cfg->self_addr;
	iph->daddr = f->backend_addr;
	iph->ttl--;

	int verdict = XDP_TX;

	if (optlen == INBAND_OPT_AUTH_CLIENT_TUPLE_LEN) {
		verdict = emit_with_option(ctx, INBAND_OPT_AUTH_CLIENT_TUPLE_LEN, opt, p->tot_len);
	} else if (optlen == INBAND_OPT_AUTH_SCORE_REQUEST_LEN) {
		verdict = emit_with_option(ctx, INBAND_OPT_AUTH_SCORE_REQUEST_LEN, opt, p->tot_len);
	} else if (optlen == INBAND_OPT_CLIENT_TUPLE_LEN) {
		verdict = emit_with_option(ctx, INBAND_OPT_CLIENT_TUPLE_LEN, opt, p->tot_len);
	} else if (optlen == INBAND_OPT_SCORE_REQUEST_LEN) {
		verdict = emit_with_option(ctx, INBAND_OPT_SCORE_REQUEST_LEN, opt, p->tot_len);
	} else {
		iph->check = csum_finish(l3);
	}
	if (verdict == XDP_TX)
		count_forward(bid, f->vip_id, p->len, new_conn, probe);
	return verdict;
}

/* A SYN for a new connection: backend, SNAT port, handshake state. */
static __always_inline int open_flow(struct xdp_md *ctx, const struct inband_lb_config *cfg,
				     const struct inband_flow_key *fk, __u32 vid, const struct inband_vip *vc,
				     struct pkt *p)
{
	__u32 skip = 0, id = 0, slot = 0;
	__be16 port = 0;
	struct inband_backend *be = NULL;

	if (!(vc->flags & INBAND_VIP_ACTIVE))
		return drop(INBAND_DROP_VIP_DRAINING);
	/* A backend without a free port is skipped for the next best; three
	 * tries bound the work a SYN can cause. */
	for (int attempt = 0; attempt < 3; attempt++) {
		if (!select_backend(vc, vid, skip, p->now, &id, &slot))
			return drop(attempt ? INBAND_DROP_SNAT_EXHAUSTED : INBAND_DROP_NO_BACKEND);
		be = bpf_map_lookup_elem(&backends, &id);
		if (!be)
			return drop(INBAND_DROP_NO_BACKEND);
		/* No state until the next hop is known: the retransmitted SYN
		 * is balanced again once the daemon has resolved it. */
		if (mac_is_zero(be->mac))
			return drop(INBAND_DROP_NO_ROUTE);
		struct inband_nat_key nk = { .backend_addr = be->addr, .backend_port = be->port, .proto = IPPROTO_TCP };

		port = reserve_snat_port(cfg, fk, &nk, p->now);
		if (port)
			break;
		event(INBAND_EV_BACKEND_FULL);
		skip |= 1U << (slot & 31);
	}
	if (!port || !be)
		return drop(INBAND_DROP_SNAT_EXHAUSTED);

	struct inband_flow f = {
		.backend_addr = be->addr,
		.backend_port = be->port,
		.snat_port = port,
		.backend_id = (__u16)id,
		.vip_id = (__u8)vid,
		.mode = vc->mode,
		.state = INBAND_FLOW_SYN_SENT,
		.syn_seq = p->tcp->seq,
		.last_seen_ns = p->now,
	};
	__builtin_memcpy(f.client_mac, p->eth->h_source, ETH_ALEN);
	if (bpf_map_update_elem(&half_open, fk, &f, BPF_ANY))
		return drop(INBAND_DROP_FLOW_TABLE_FULL);
	/* Only the score modes rank by it; counting in the round-robin modes
	 * would leave a stale backlog after a switch to them. */
	if (score_mode(vc->mode)) {
		struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

		if (s)
			__sync_fetch_and_add(&s->opened, 1);
	}
	return forward(ctx, cfg, fk, &f, vc, p, 1);
}

/* Step 2 of the walk: a TCP packet whose (dst, dport) is a VIP, with no
 * established flow. */
static __always_inline int handshake(struct xdp_md *ctx, const struct inband_lb_config *cfg,
				     const struct inband_flow_key *fk, __u32 vid, struct pkt *p)
{
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);
	struct inband_flow *ho = bpf_map_lookup_elem(&half_open, fk);

	if (!vc)
		return drop(INBAND_DROP_NO_BACKEND);
	p->now = coarse_now();
	if (ho && flow_expired(ho, p->now)) {
		struct inband_flow dead = *ho;

		half_open_end(fk, &dead);
		event(INBAND_EV_FLOWS_EXPIRED);
		ho = NULL;
		if (!is_syn(p->flags))
			return drop(INBAND_DROP_FLOW_EXPIRED);
	}
	if (is_syn(p->flags)) {
		if (ho && ho->syn_seq == p->tcp->seq) {
			/* A retransmitted SYN follows its handshake, and makes
			 * its port hold young again (the age port searches rank). */
			ho->last_seen_ns = p->now;
			struct inband_flow f = *ho;

			refresh_hold(fk, &f, p->now);

			return forward(ctx, cfg, fk, &f, vc, p, 0);
		}
		return open_flow(ctx, cfg, fk, vid, vc, p);
	}
	if (!ho)
		return drop(INBAND_DROP_NO_FLOW);
	if (p->flags & TCP_FLAG_RST) {
		/* The client gives up the handshake: the backend hears it too. */
		struct inband_flow f = *ho;

		half_open_end(fk, &f);
		return forward(ctx, cfg, fk, &f, vc, p, 0);
	}
	struct inband_flow *f = promote(fk, ho, p->now);

	if (!f)
		return XDP_DROP;
	if (p->flags & TCP_FLAG_FIN)
		flow_close(f);
	return forward(ctx, cfg, fk, f, vc, p, 0);
}

/* A client packet of an established or closing flow: the hot path. No
 * clock, one hash lookup (the caller's). */
static __always_inline int established(struct xdp_md *ctx, const struct inband_lb_config *cfg,
				       const struct inband_flow_key *fk, struct inband_flow *f, struct pkt *p)
{
	struct inband_vip *vc = NULL;

	if (f->mode == INBAND_MODE_DSR_DYNAMIC) {
		__u32 vid = f->vip_id;

		vc = bpf_map_lookup_elem(&vip_conf, &vid);
	}
	if (is_syn(p->flags) && p->tcp->seq != f->syn_seq) {
		/* A new connection on the tuple once this one is closing; on a
		 * live one, a SYN the backend answers with a challenge ACK
		 * (RFC 5961), as its stack would without us in between. */
		if (f->state == INBAND_FLOW_CLOSING) {
			struct inband_flow old = *f;

			flow_end(fk, &old);
			return REBALANCE;
		}
		event(INBAND_EV_SYN_ON_LIVE_FLOW);
	}
	if (p->flags & (TCP_FLAG_FIN | TCP_FLAG_RST))
		flow_close(f);
	flow_touch(f);
	return forward(ctx, cfg, fk, f, vc, p, 0);
}

/* The 125 (`len` bytes, first option) of a backend packet on flow `f`:
 * checksums, then whether it counts. 0 = forward, else a drop verdict. */
static __always_inline int take_score(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct inband_flow *f,
				      struct pkt *p, const __u8 *opt, __u32 len)
{
	__u16 score = 0;

	if (!ipv4_csum_ok(ctx, p->hlen) ||
	    !tcp_csum_ok(ctx, ETH_HLEN + p->hlen, p->tot_len - p->hlen, p->iph->saddr, p->iph->daddr))
		return drop(INBAND_DROP_BAD_CHECKSUM);
	if (score_accepted(cfg, f, opt, len, &score)) {
		__u32 bid = f->backend_id;
		struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

		record_score(f, score, coarse_now());
		if (bs)
			bs->scores_received++;
	}
	return 0;
}

/* Rewrites a backend packet of flow `fk`/`f` back to VIP -> client and
 * sends it, without the first option when `strip` (its length) is set. */
static __always_inline int return_to_client(struct xdp_md *ctx, const struct inband_flow_key *fk,
					    const struct inband_flow *f, struct pkt *p, const int strip)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *iph = data + ETH_HLEN;
	struct tcphdr *tcp = data + ETH_HLEN + (p->hlen & 0x3c);

	if ((void *)(tcp + 1) > data_end || (void *)(iph + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	/* L4: back to VIP:vport -> client:cport. */
	__u32 acc = csum_start(tcp->check);

	acc = csum_replace32(acc, iph->saddr, fk->vip_addr);
	acc = csum_replace32(acc, iph->daddr, fk->client_addr);
	acc = csum_replace16(acc, tcp->source, fk->vip_port);
	acc = csum_replace16(acc, tcp->dest, fk->client_port);
	tcp->source = fk->vip_port;
	tcp->dest = fk->client_port;
	tcp->check = csum_finish(acc);

	/* L3: the header may carry other options (kept), so update incrementally. */
	acc = csum_start(iph->check);
	acc = csum_replace32(acc, iph->saddr, fk->vip_addr);
	acc = csum_replace32(acc, iph->daddr, fk->client_addr);
	acc = csum_replace16(acc, load16(&iph->ttl), load16(&iph->ttl) - bpf_htons(0x0100));
	iph->ttl--;
	iph->saddr = fk->vip_addr;
	iph->daddr = fk->client_addr;
	if (strip) {
		__u8 *opt = (__u8 *)(iph + 1);

		if ((void *)(opt + strip) > data_end)
			return drop(INBAND_DROP_MALFORMED_OPTION);
		__u16 old_first = load16(iph);
		__be16 new_len = bpf_htons(p->tot_len - strip);

		iph->ihl -= strip / 4;
		acc = csum_replace16(acc, old_first, load16(iph));
		acc = csum_replace16(acc, iph->tot_len, new_len);
#pragma unroll
		for (int i = 0; i < strip / 2; i++)
			acc = csum_replace16(acc, load16(opt + 2 * i), 0);
		iph->tot_len = new_len;
	}
	iph->check = csum_finish(acc);

	/* L2: back to where the client's packets came from. */
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, f->client_mac, ETH_ALEN);

	__u32 bid = f->backend_id, vid = f->vip_id;
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);
	struct inband_vip_stats *vs = bpf_map_lookup_elem(&vip_stats, &vid);

	if (bs) {
		bs->return_packets++;
		bs->return_bytes += p->len;
	}
	if (vs) {
		vs->return_packets++;
		vs->return_bytes += p->len;
	}
	return strip ? strip_first_option(ctx, strip) : XDP_TX;
}

/* Step 3 of the walk: a TCP packet to the balancer's own address. */
static __always_inline int backend_to_client(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct pkt *p)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *iph = p->iph;
	struct tcphdr *tcp = p->tcp;
	struct opt_walk w = {};
	struct inband_nat_key nk = {
		.backend_addr = iph->saddr,
		.backend_port = tcp->source,
		.snat_port = tcp->dest,
		.proto = IPPROTO_TCP,
	};
	struct inband_flow_key fk = {};
	struct inband_flow *f = flow_by_port(&nk, &fk);

	if (!f) {
		/* The balancer host's own traffic; only inband options are ours to judge. */
		if (p->hlen > INBAND_IPV4_MIN_HDR) {
			__u32 found = scan_ip_options(ctx, p->hlen, &w);

			if (found & OPT_SCORE)
				return drop(INBAND_DROP_SCORE_NOT_OWNER);
			if (found & OPT_TUPLE_OR_REQUEST)
				return drop(INBAND_DROP_UNEXPECTED_OPTION);
		}
		return XDP_PASS;
	}
	if (p->frag & IP_FRAG_MASK)
		return drop(INBAND_DROP_FRAGMENT);
	if (!tcp_header_ok(p, data_end))
		return drop(INBAND_DROP_TRUNCATED_L4);
	if (iph->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);
	p->flags = ((__u8 *)tcp)[13];

	__u32 strip = 0;

	if (p->hlen > INBAND_IPV4_MIN_HDR) {
		__u32 found = scan_ip_options(ctx, p->hlen, &w);

		if (found & OPT_MALFORMED)
			return drop(INBAND_DROP_MALFORMED_OPTION);
		if (found & OPT_TUPLE_OR_REQUEST)
			return drop(INBAND_DROP_SCORE_NOT_OWNER);
		if (found & OPT_SCORE) {
			/* A 125 anywhere but where an agent puts it is not ours to parse. */
			if (!(found & OPT_SCORE_STRIPPABLE))
				return drop(INBAND_DROP_MALFORMED_OPTION);
			strip = w.score_len;
			int verdict = take_score(ctx, cfg, f, p, w.buf, strip);

			if (verdict)
				return verdict;
		}
	}

	int in_handshake = f->state == INBAND_FLOW_SYN_SENT;

	if ((p->flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == (TCP_FLAG_SYN | TCP_FLAG_ACK) &&
	    f->mode != INBAND_MODE_PASSTHROUGH) {
		/* The client's segments get a 124 too: a SYN-ACK that came
		 * this way (no agent, or the agent's fallback) is clamped like
		 * the agent clamps the ones it sends direct. */
		__u32 l4_off = ETH_HLEN + (p->hlen & 0x3c);
		__u32 acc = csum_start(tcp->check);

		acc = clamp_mss(ctx, l4_off, tcp->doff * 4 - TCP_MIN_HDR, acc);
		tcp = (void *)(long)ctx->data + l4_off;
		if ((void *)(tcp + 1) > (void *)(long)ctx->data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		tcp->check = csum_finish(acc);
	}
	if (!in_handshake) {
		if (p->flags & (TCP_FLAG_FIN | TCP_FLAG_RST))
			flow_close(f);
		flow_touch(f);
	}

	struct inband_flow copy = *f;

	if (in_handshake && (p->flags & TCP_FLAG_RST))
		half_open_end(&fk, &copy); /* the backend refused the connection */
	if (strip == INBAND_OPT_AUTH_SCORE_LEN)
		return return_to_client(ctx, &fk, &copy, p, INBAND_OPT_AUTH_SCORE_LEN);
	if (strip == INBAND_OPT_SCORE_LEN)
		return return_to_client(ctx, &fk, &copy, p, INBAND_OPT_SCORE_LEN);
	return return_to_client(ctx, &fk, &copy, p, 0);
}

/* 802.1Q/802.1ad-tagged frames: the VIPs live on the untagged network, so
 * a tagged frame to a VIP or to the balancer is refused (counted), never
 * balanced and sent on untagged; other tagged traffic is the kernel's. */
static __always_inline int tagged_frame(struct xdp_md *ctx, const struct inband_lb_config *cfg)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u32 off = ETH_HLEN;

	if ((void *)(eth + 1) > data_end)
		return XDP_PASS;
	__be16 proto = eth->h_proto;

#pragma unroll
	for (int i = 0; i < 2; i++) {
		if (proto != bpf_htons(ETH_P_8021Q_) && proto != bpf_htons(ETH_P_8021AD_))
			break;
		__be16 *tag = data + off;

		if ((void *)(tag + 2) > data_end)
			return XDP_PASS;
		proto = tag[1];
		off += 4;
	}
	if (proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *iph = data + (off & 0x1f);

	if ((void *)(iph + 1) > data_end)
		return XDP_PASS;
	if (iph->daddr == cfg->self_addr)
		return drop(INBAND_DROP_VLAN);
	if (iph->protocol != IPPROTO_TCP || iph->ihl < 5)
		return XDP_PASS;
	__be16 *ports = (void *)iph + ((iph->ihl * 4) & 0x3c);

	if ((void *)(ports + 2) > data_end)
		return XDP_PASS;
	struct inband_vip_key vk = { .addr = iph->daddr, .port = ports[1], .proto = IPPROTO_TCP };

	if (bpf_map_lookup_elem(&vips, &vk))
		return drop(INBAND_DROP_VLAN);
	return XDP_PASS;
}

SEC("xdp")
int balancer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct inband_lb_config *cfg = config();

	if ((void *)(eth + 1) > data_end || !cfg)
		return XDP_PASS;
	if (eth->h_proto == bpf_htons(ETH_P_8021Q_) || eth->h_proto == bpf_htons(ETH_P_8021AD_))
		return tagged_frame(ctx, cfg);
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;

	struct iphdr *iph = (void *)(eth + 1);

	if ((void *)(iph + 1) > data_end)
		return drop(INBAND_DROP_MALFORMED_IP);
	struct pkt p = {
		.eth = eth,
		.iph = iph,
		.hlen = iph->ihl * 4,
		.tot_len = bpf_ntohs(iph->tot_len),
		.frag = bpf_ntohs(iph->frag_off),
		.len = data_end - data,
	};
	__u32 avail = data_end - (void *)iph;

	if (iph->version != 4 || p.hlen < INBAND_IPV4_MIN_HDR || p.hlen > avail || p.tot_len > avail ||
	    p.tot_len < p.hlen)
		return drop(INBAND_DROP_MALFORMED_IP);
	if (iph->protocol == IPPROTO_ICMP) {
		if (p.hlen != INBAND_IPV4_MIN_HDR || (p.frag & IP_FRAG_MASK))
			return XDP_PASS;
		return icmp_error(ctx, cfg);
	}
	if (iph->protocol != IPPROTO_TCP)
		return XDP_PASS;
	/* A non-first fragment has no ports, so it cannot be matched to a VIP
	 * (keyed by port); without its first fragment, which is dropped below,
	 * the kernel's reassembly discards it. */
	if (p.frag & IP_OFFSET_MASK)
		return XDP_PASS;

	/* Both directions are identified by the ports; L4 shorter than that
	 * cannot belong to any VIP or connection of ours. */
	p.tcp = (void *)iph + p.hlen;
	if ((void *)p.tcp + 4 > data_end || p.hlen + 4 > p.tot_len)
		return XDP_PASS;

	if (iph->daddr == cfg->self_addr)
		return backend_to_client(ctx, cfg, &p);

	struct inband_flow_key fk = {
		.client_addr = iph->saddr,
		.vip_addr = iph->daddr,
		.client_port = p.tcp->source,
		.vip_port = p.tcp->dest,
		.proto = IPPROTO_TCP,
	};
	struct inband_flow *f = bpf_map_lookup_elem(&flows, &fk);
	__u32 *vid = NULL;

	if (!f) {
		struct inband_vip_key vk = { .addr = iph->daddr, .port = p.tcp->dest, .proto = IPPROTO_TCP };

		vid = bpf_map_lookup_elem(&vips, &vk);
		if (!vid)
			return XDP_PASS;
	}
	/* From here the packet belongs to a VIP. */
	if (p.frag & IP_FRAG_MASK)
		return drop(INBAND_DROP_FRAGMENT);
	if (p.hlen > INBAND_IPV4_MIN_HDR) {
		struct opt_walk w = {};
		__u32 found = scan_ip_options(ctx, p.hlen, &w);

		if (found & OPT_MALFORMED)
			return drop(INBAND_DROP_MALFORMED_OPTION);
		if (found & (OPT_TUPLE_OR_REQUEST | OPT_SCORE))
			return drop(INBAND_DROP_UNEXPECTED_OPTION);
		return drop(INBAND_DROP_IP_OPTIONS);
	}
	/* The IPv4 header is exactly 20 bytes from here on. */
	if (!tcp_header_ok(&p, data_end))
		return drop(INBAND_DROP_TRUNCATED_L4);
	p.flags = ((__u8 *)p.tcp)[13];

	if (f) {
		int verdict = established(ctx, cfg, &fk, f, &p);

		if (verdict != REBALANCE)
			return verdict;
		struct inband_vip_key vk = { .addr = fk.vip_addr, .port = fk.vip_port, .proto = IPPROTO_TCP };

		vid = bpf_map_lookup_elem(&vips, &vk);
		if (!vid)
			return drop(INBAND_DROP_NO_FLOW);
	}
	return handshake(ctx, cfg, &fk, *vid, &p);
}

/* ------------------------------------------------------------------ sweeper */

/* The map argument of bpf_for_each_map_elem callbacks (unused here). */
struct bpf_map;

struct sweep_ctx {
	__u64 now;
	__u32 half; /* gauge half this pass writes */
	__u32 pad;
	__u64 half_open;
	__u64 snat_entries;
};

/* What the daemon passes to a run (BPF_PROG_RUN's ctx_in). */
struct sweep_args {
	__u64 now; /* 0 = the current time; tests pass a time to sweep "later" */
};

static __always_inline void gauge_add(__u32 half, __u32 idx, int closing)
{
	__u32 i = half * INBAND_GAUGES + idx;
	struct inband_flow_gauges *g = bpf_map_lookup_elem(&gauges, &i);

	if (!g)
		return;
	if (closing)
		g->closing++;
	else
		g->established++;
}

static long gauge_clear(__u32 i, void *arg)
{
	__u32 idx = *(__u32 *)arg * INBAND_GAUGES + i;
	struct inband_flow_gauges *g = bpf_map_lookup_elem(&gauges, &idx);

	if (g) {
		g->established = 0;
		g->closing = 0;
	}
	return 0;
}

static __always_inline int past(__u64 deadline, __u64 now)
{
	return deadline && (__s64)(now - deadline) > 0;
}

static long sweep_flow(struct bpf_map *map, struct inband_flow_key *key, struct inband_flow *f, struct sweep_ctx *c)
{
	__u32 vid = f->vip_id, bid = f->backend_id;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (f->seen) {
		/* A packet since the last pass: idle from now on at most. */
		f->seen = 0;
		f->last_seen_ns = c->now;
	}
	/* A score request unanswered for a whole pass (its answer lost, or no
	 * response to carry it) is given up, so the flow may ask again. */
	if (f->flags & INBAND_FLOW_PROBE_OLD)
		f->flags &= ~(INBAND_FLOW_PROBE_OUTSTANDING | INBAND_FLOW_PROBE_OLD);
	else if (f->flags & INBAND_FLOW_PROBE_OUTSTANDING)
		f->flags |= INBAND_FLOW_PROBE_OLD;
	struct inband_flow copy = *f;

	if (flow_expired(&copy, c->now)) {
		flow_end(key, &copy);
		event(INBAND_EV_FLOWS_EXPIRED);
		return 0;
	}
	if ((be && !(be->flags & INBAND_BACKEND_ACTIVE) && past(be->drain_deadline_ns, c->now)) ||
	    (vc && (vc->flags & INBAND_VIP_DRAINING) && past(vc->drain_deadline_ns, c->now))) {
		flow_end(key, &copy);
		event(INBAND_EV_DRAINED_FLOWS_ENDED);
		return 0;
	}
	int closing = copy.state == INBAND_FLOW_CLOSING;

	gauge_add(c->half, INBAND_GAUGE_TOTAL, closing);
	if (vid < INBAND_MAX_VIPS)
		gauge_add(c->half, INBAND_GAUGE_VIP0 + vid, closing);
	if (bid < INBAND_MAX_BACKENDS)
		gauge_add(c->half, INBAND_GAUGE_BACKEND0 + bid, closing);
	return 0;
}

static long sweep_half_open(struct bpf_map *map, struct inband_flow_key *key, struct inband_flow *f,
			    struct sweep_ctx *c)
{
	struct inband_flow copy = *f;

	if (flow_expired(&copy, c->now)) {
		half_open_end(key, &copy);
		event(INBAND_EV_FLOWS_EXPIRED);
		return 0;
	}
	c->half_open++;
	return 0;
}

/* A reservation whose owner is not a live flow with this port is an orphan
 * (its flow was evicted from the LRU, or ended in a way that left it). */
static long sweep_snat(struct bpf_map *map, struct inband_nat_key *key, struct inband_snat_owner *o,
		       struct sweep_ctx *c)
{
	struct inband_flow *f = bpf_map_lookup_elem(&flows, &o->flow);

	if (!f || !flow_has_port(f, key)) {
		bpf_map_delete_elem(&snat, key);
		event(INBAND_EV_SNAT_ORPHANS_RECLAIMED);
		return 0;
	}
	c->snat_entries++;
	return 0;
}

static long sweep_hold(struct bpf_map *map, struct inband_nat_key *key, struct inband_port_hold *h,
		       struct sweep_ctx *c)
{
	struct inband_flow *f = bpf_map_lookup_elem(&half_open, &h->flow);

	if (!f || !flow_has_port(f, key))
		bpf_map_delete_elem(&half_open_ports, key);
	return 0;
}

/* For each backend of a dsr-dynamic VIP: a score older than half the
 * VIP's max age (or none yet) → its next packet asks for one; a score
 * older than the max age (stale: the backend is not being picked) → also
 * an exploration ticket, one new connection whatever its estimate
 * (select.h). Both bits are cleared by what uses them, so a backend gets
 * at most one exploration per pass while stale. */
static long mark_probes_due(__u32 i, struct sweep_ctx *c)
{
	__u32 vid = i / INBAND_MAX_BACKENDS_PER_VIP, slot = i % INBAND_MAX_BACKENDS_PER_VIP;
	struct inband_vip *vc = bpf_map_lookup_elem(&vip_conf, &vid);

	if (!vc || vc->mode != INBAND_MODE_DSR_DYNAMIC || slot >= vc->backend_count)
		return 0;
	__u32 *bid = bpf_map_lookup_elem(&vip_backends, &i);

	if (!bid)
		return 0;
	__u32 id = *bid;
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);
	__u32 *due = bpf_map_lookup_elem(&probe_due, &id);

	if (!s || !due)
		return 0;
	__s64 age = s->updated_ns ? (__s64)(c->now - s->updated_ns) : -1;

	if (age < 0 || age >= (__s64)(vc->score_max_age_ns / 2))
		__sync_fetch_and_or(due, INBAND_PROBE_DUE);
	if (age >= (__s64)vc->score_max_age_ns)
		__sync_fetch_and_or(due, INBAND_EXPLORE);
	return 0;
}

/*
 * One pass over the flow tables, run by the lb daemon every second (and by
 * tests): ages established flows (their `seen` byte), deletes dead flows
 * with their SNAT reservations, orphaned reservations and port holds, and
 * flows past a drain deadline; counts what is live into `gauges`; marks
 * backends whose score is getting old. Without it flows do not age (the
 * LRU still bounds them) and ports are reclaimed only by a port search
 * that finds them unseen and past their timeout.
 */
SEC("syscall")
int sweep(struct sweep_args *args)
{
	__u32 zero = 0;
	struct inband_sweep_stats *st = bpf_map_lookup_elem(&sweep_stats, &zero);
	__u64 start = bpf_ktime_get_ns();
	struct sweep_ctx c = { .now = args->now ? args->now : start };

	if (!st)
		return 1;
	c.half = (st->passes + 1) & 1;
	bpf_loop(INBAND_GAUGES, gauge_clear, &c.half, 0);
	bpf_for_each_map_elem(&flows, sweep_flow, &c, 0);
	bpf_for_each_map_elem(&half_open, sweep_half_open, &c, 0);
	bpf_for_each_map_elem(&snat, sweep_snat, &c, 0);
	bpf_for_each_map_elem(&half_open_ports, sweep_hold, &c, 0);
	bpf_loop(INBAND_MAX_VIPS * INBAND_MAX_BACKENDS_PER_VIP, mark_probes_due, &c, 0);
	st->half_open = c.half_open;
	st->snat_entries = c.snat_entries;
	st->last_ns = bpf_ktime_get_ns();
	st->last_duration_ns = st->last_ns - start;
	st->passes++; /* readers use half passes & 1, complete from here */
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

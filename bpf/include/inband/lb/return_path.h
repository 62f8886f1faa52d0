/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The return path (step 3 of the walk): a backend's packet to the
 * balancer's own address, found by its SNAT port, rewritten back to VIP ->
 * client and sent; a 125 on it updates the backend's score (score.h) and is
 * stripped, and the backend's FIN, RST or refusal moves the flow
 * (lifecycle.h). Apart from the client's walk because it shares none of
 * its state: it starts from the server side of a flow, and its global
 * functions get stack of their own.
 */
#ifndef INBAND_LB_RETURN_PATH_H
#define INBAND_LB_RETURN_PATH_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/csum.h"
#include "inband/lb/common.h"
#include "inband/lb/dstopts.h"
#include "inband/lb/handshake.h"
#include "inband/lb/icmp.h"
#include "inband/lb/lifecycle.h"
#include "inband/lb/options.h"
#include "inband/lb/parse.h"
#include "inband/lb/rewrite.h"
#include "inband/lb/scale_out.h"
#include "inband/lb/score.h"
#include "inband/lb/verify.h"

/* The 125 (`len` bytes) of a backend packet on flow `f`: checksums, then
 * whether it counts. 0 = forward, else a drop verdict. */
static __always_inline int take_score(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct inband_flow *f,
				      struct pkt *p, const __u8 *opt, __u32 len)
{
	__u16 score = 0;

	if ((p->family == 4 && !ipv4_csum_ok(ctx, p->hlen)) ||
	    !l4_csum_ok(ctx, ETH_HLEN + p->hlen, p->tot_len - p->hlen, p))
		return drop(INBAND_DROP_BAD_CHECKSUM);
	if (score_accepted(cfg, f, opt, len, &score)) {
		__u32 bid = f->backend_id;
		struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &bid);

		/* The fine clock, as the poller's: a score's age is read
		 * against reports of both kinds, and at most one 125 comes
		 * per n packets, so its cost is not per packet. */
		record_score(f, score, bpf_ktime_get_ns());
		if (bs)
			bs->scores_received++;
	}
	return 0;
}

/* Rewrites a backend packet of flow p->fk / `f` back to VIP -> client and
 * sends it. IPv4: without the first option when `strip` (its length) is
 * set; IPv6: its Destination Options header is gone already. */
static __always_inline int rewrite_to_client(struct xdp_md *ctx, const struct inband_flow *f, struct pkt *p,
					     const int strip)
{
	const struct inband_flow_key *fk = &p->fk;
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	int v4 = p->family == 4;
	__u32 l3 = v4 ? (p->hlen & 0x3c) : INBAND_IPV6_HDR;
	__be16 *ports = l4_at(ctx, l3);
	__u16 *check = l4_at(ctx, l3 + l4_check_off(p->proto));

	if ((void *)(ports + 2) > data_end || (void *)(check + 1) > data_end || (void *)(eth + 1) > data_end)
		return drop(INBAND_DROP_TRUNCATED_L4);
	/* L4: back to VIP:vport -> client:cport. */
	__u16 old = *check;
	__u32 acc = l4_csum_nat(old, p, &fk->vip_addr, fk->vip_port, &fk->client_addr, fk->client_port);

	ports[0] = fk->vip_port;
	ports[1] = fk->client_port;
	*check = l4_csum_store(p->proto, p->family, old, acc);

	if (v4) {
		struct iphdr *iph = data + ETH_HLEN;

		if ((void *)(iph + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		/* The header may carry other options (kept), so update incrementally. */
		acc = csum_start(iph->check);
		acc = csum_replace32(acc, iph->saddr, fk->vip_addr.w[3]);
		acc = csum_replace32(acc, iph->daddr, fk->client_addr.w[3]);
		acc = csum_replace16(acc, load16(&iph->ttl), load16(&iph->ttl) - bpf_htons(0x0100));
		iph->ttl--;
		iph->saddr = fk->vip_addr.w[3];
		iph->daddr = fk->client_addr.w[3];
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
	} else {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		if ((void *)(ip6 + 1) > data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		ip6_nat(ip6, &fk->vip_addr, &fk->client_addr);
	}

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
	return v4 && strip ? strip_first_option(ctx, strip) : XDP_TX;
}

/* rewrite_to_client() for each length a 125 can have (a constant in each),
 * global: the return path's frame would not fit next to it. */
__noinline int return_to_client(struct xdp_md *ctx, const struct inband_flow *f, struct pkt *p, __u32 strip)
{
	if (!f || !p)
		return XDP_DROP;
	if (strip == INBAND_OPT_AUTH_SCORE_LEN)
		return rewrite_to_client(ctx, f, p, INBAND_OPT_AUTH_SCORE_LEN);
	if (strip == INBAND_OPT_SCORE_LEN)
		return rewrite_to_client(ctx, f, p, INBAND_OPT_SCORE_LEN);
	return rewrite_to_client(ctx, f, p, 0);
}

/*
 * The inband option on a packet, if any: OPT_* found in its IPv4 options,
 * or in the Destination Options header an agent or a balancer puts first
 * on IPv6 (`w` gets a 125). OPT_FOREIGN: IPv6 extension headers that are
 * not exactly one inband header.
 */
#define OPT_FOREIGN 0x10

static __always_inline __u32 backend_option(struct xdp_md *ctx, const struct pkt *p, struct opt_walk *w)
{
	if (p->family == 4)
		return p->hlen > INBAND_IPV4_MIN_HDR ? scan_ip_options(ctx, p->hlen, w) : 0;
	if (!p->ext)
		return 0;
	if (p->ext > 1 || !p->doh_len)
		return OPT_FOREIGN;
	__u32 found = read_doh(ctx, p->doh_len, w);

	return found ? found : OPT_FOREIGN;
}

/* Step 3 of the walk: a packet to one of the balancer's own addresses,
 * `index` (lb_config's SNAT pool; 0 = `address`). */
__noinline int backend_to_client(struct xdp_md *ctx, const struct inband_lb_config *cfg, struct pkt *p, __u32 index)
{
	if (!cfg || !p)
		return XDP_PASS;
	struct opt_walk w = {};
	struct inband_nat_key nk = {
		.backend_addr = p->saddr,
		.backend_port = p->sport,
		.snat_port = p->dport,
		.proto = p->proto,
		.snat_index = (__u8)index,
		.fleet_suffix = index == INBAND_SNAT_FLEET ? p->daddr.w[3] : 0,
	};
	struct inband_flow *f = flow_by_port(&nk, &p->fk);

	if (!f) {
		/* An agent steered it here for a connection another instance
		 * holds (or none does): no host of ours has the fleet address. */
		if (p->via_sid == VIA_STEERED)
			return drop(INBAND_DROP_STEERED_NOT_OWNER);
		/* The balancer host's own traffic; only inband options are ours to judge. */
		__u32 found = backend_option(ctx, p, &w);

		if (found & OPT_SCORE)
			return drop(INBAND_DROP_SCORE_NOT_OWNER);
		if (found & OPT_TUPLE_OR_REQUEST)
			return drop(INBAND_DROP_UNEXPECTED_OPTION);
		return XDP_PASS;
	}
	if (p->frag)
		return drop(INBAND_DROP_FRAGMENT);
	if (p->proto == IPPROTO_TCP ? !tcp_header_ok(ctx, p) : !udp_header_ok(p))
		return drop(INBAND_DROP_TRUNCATED_L4);
	if (p->ttl <= 1)
		return drop(INBAND_DROP_TTL_EXCEEDED);
	if (p->proto == IPPROTO_TCP) {
		/* The acknowledgement number, data offset and flags. */
		__u8 b[6];

		if (bpf_xdp_load_bytes(ctx, ETH_HLEN + p->hlen + 8, b, sizeof(b)))
			return drop(INBAND_DROP_TRUNCATED_L4);
		__builtin_memcpy(&p->ack, b, 4);
		p->flags = b[5];
	}

	__u32 strip = 0;
	__u32 found = backend_option(ctx, p, &w);

	if (found & OPT_FOREIGN)
		return drop(INBAND_DROP_IP_OPTIONS);
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
	if (p->family == 6 && p->doh_len) {
		/* The carrier goes first: from here the IPv6 header is 40 bytes. */
		int gone = p->doh_len == INBAND_DOH_LEN(INBAND_OPT_SCORE_LEN)
				   ? strip_doh(ctx, INBAND_DOH_LEN(INBAND_OPT_SCORE_LEN))
				   : strip_doh(ctx, INBAND_DOH_LEN(INBAND_OPT_AUTH_SCORE_LEN));

		if (gone)
			return gone;
		p->tot_len -= p->doh_len;
		p->hlen = INBAND_IPV6_HDR;
		p->len -= p->doh_len;
		strip = 0;
	}

	int in_handshake = f->state == INBAND_FLOW_SYN_SENT;

	if ((p->flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == (TCP_FLAG_SYN | TCP_FLAG_ACK) &&
	    f->mode != INBAND_MODE_PASSTHROUGH) {
		/* The client's segments get a 124 too: a SYN-ACK that came
		 * this way (no agent, or the agent's fallback) is clamped like
		 * the agent clamps the ones it sends direct. */
		__u32 l4_off = ETH_HLEN + (p->hlen & 0x3c);
		struct tcphdr *tcp = (void *)(long)ctx->data + l4_off;

		if ((void *)(tcp + 1) > (void *)(long)ctx->data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		__u32 acc = clamp_mss(ctx, l4_off, tcp->doff * 4 - TCP_MIN_HDR, csum_start(tcp->check),
				      p->family == 4 ? INBAND_OPT_DATA_MAX_LEN : INBAND_OPT6_DATA_MAX_LEN);

		tcp = (void *)(long)ctx->data + l4_off;
		if ((void *)(tcp + 1) > (void *)(long)ctx->data_end)
			return drop(INBAND_DROP_TRUNCATED_L4);
		tcp->check = csum_finish(acc);
	}
	int ends = 0;

	if (p->flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) {
		/* The backend can only acknowledge what the client sent: its FIN
		 * or RST counts when it acknowledges a number in the client's
		 * window (a refusal acknowledges the SYN; Linux sets ACK on
		 * every FIN and on the RST of a socket it aborts). Else, like a
		 * client's out of the window, it is forwarded and changes
		 * nothing here. */
		ends = (p->flags & TCP_FLAG_ACK) && seq_in_window(f, p->ack);
		if (!ends)
			event(INBAND_EV_OUT_OF_WINDOW);
	}
	if (!in_handshake) {
		if (ends)
			flow_close(f);
		flow_touch(f);
	}

	struct inband_flow *copy = scratch_flow();

	if (!copy)
		return XDP_DROP;
	*copy = *f;
	if (in_handshake && ends && (p->flags & TCP_FLAG_RST)) {
		half_open_end(&p->fk, copy); /* the backend refused the connection */
		count_handshake(copy->backend_id, HS_REFUSED);
	}
	return return_to_client(ctx, copy, p, strip);
}

#endif /* INBAND_LB_RETURN_PATH_H */

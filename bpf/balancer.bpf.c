// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * The balancer's XDP data path: the "Balancer packet walk" of
 * docs/architecture.md. Client packets to a VIP are full-NATed to a backend
 * (src = balancer, dst = backend) and may carry option 155 (client tuple, on
 * the SYN of DSR modes) or 124 (score request, every n-th packet in
 * dsr-dynamic). Backend packets to the balancer are NATed back to VIP ->
 * client; an option 125 on them is recorded in `scores` and stripped.
 * Anything else passes to the kernel untouched.
 */
#include <linux/bpf.h>
#include <linux/errno.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "inband/wire.h"
#include "inband/balancer_maps.h"
#include "inband/csum.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_lb_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_MAX_VIPS);
	__type(key, struct inband_vip_key);
	__type(value, struct inband_vip);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} vips SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, INBAND_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct inband_backend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, INBAND_MAX_VIPS * INBAND_MAX_BACKENDS_PER_VIP);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} vip_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, INBAND_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct inband_backend_score);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} scores SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, INBAND_FLOW_TABLE_SIZE);
	__type(key, struct inband_flow_key);
	__type(value, struct inband_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, INBAND_FLOW_TABLE_SIZE);
	__type(key, struct inband_nat_key);
	__type(value, struct inband_nat_back);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} nat_back SEC(".maps");

/* Shared, not per-CPU: operators expect strict rotation, and one atomic add
 * per new connection is cheap next to the rest of the SYN path. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, INBAND_MAX_VIPS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rr_cursor SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} probe_count SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct inband_backend_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} backend_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_MAX_VIPS);
	__type(key, __u32);
	__type(value, struct inband_vip_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} vip_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_DROP_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} drops SEC(".maps");

/* Only the lb daemon writes it; it lives here so it is pinned with the rest
 * of this interface's state and `inband status` finds it in one place. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_control_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} control_stats SEC(".maps");

#define ETH_IP_HLEN (ETH_HLEN + INBAND_IPV4_MIN_HDR)
#define IP_MAX_OPT_LEN (INBAND_IPV4_MAX_HDR - INBAND_IPV4_MIN_HDR)
#define TCP_MIN_HDR 20
#define TCP_MAX_OPT_LEN 40
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_ACK 0x10
#define TCPOPT_EOL 0
#define TCPOPT_NOP 1
#define TCPOPT_MSS 2
#define IP_FRAG_MASK 0x3fff /* MF flag + fragment offset */
#define IP_OFFSET_MASK 0x1fff
#define SNAT_PORT_RANGE (INBAND_SNAT_PORT_MAX - INBAND_SNAT_PORT_MIN + 1)

static __always_inline int drop(__u32 reason)
{
	__u64 *count = bpf_map_lookup_elem(&drops, &reason);

	if (count)
		*count += 1; /* per-CPU slot: no other writer */
	return XDP_DROP;
}

static __always_inline __u16 load16(const void *p)
{
	__u16 v;

	__builtin_memcpy(&v, p, sizeof(v));
	return v;
}

static __always_inline int mac_is_zero(const __u8 *m)
{
	return !(m[0] | m[1] | m[2] | m[3] | m[4] | m[5]);
}

/* What a walk over a packet's IPv4 options found. */
#define OPT_MALFORMED 0x1 /* length 0/1, or an option overrunning the header */
#define OPT_TUPLE_OR_REQUEST 0x2 /* 155 or 124 somewhere */
#define OPT_SCORE 0x4 /* 125 somewhere */
#define OPT_SCORE_STRIPPABLE 0x8 /* exactly one 125, well-formed, first: as the agent adds it */

/*
 * Option walks run over a stack copy with bpf_loop: the callback is verified
 * once, where an open-coded loop over packet offsets multiplies verifier
 * states by every option layout and does not load. Both walks are off the
 * fast path (packets with IP options; SYNs).
 */
struct opt_walk {
	__u8 buf[TCP_MAX_OPT_LEN]; /* IP and TCP options are both at most 40 bytes */
	__u32 len;
	__u32 off;
	__u32 found; /* OPT_* for IP options; offset of the MSS option + 1 for TCP */
	__u32 scores_seen;
};

/* One option per call, a NOP being the shortest: len calls always suffice. */
static long ip_option_step(__u32 index, void *arg)
{
	struct opt_walk *w = arg;
	__u32 off = w->off;

	if (off >= w->len || off >= sizeof(w->buf))
		return 1;
	__u8 kind = w->buf[off];

	if (kind == IPOPT_END)
		return 1;
	if (kind == IPOPT_NOOP) {
		w->off = off + 1;
		return 0;
	}
	if (off + 2 > w->len || off + 1 >= sizeof(w->buf)) {
		w->found |= OPT_MALFORMED;
		return 1;
	}
	__u8 len = w->buf[off + 1];

	if (len < 2 || off + len > w->len) {
		w->found |= OPT_MALFORMED;
		return 1;
	}
	if (kind == INBAND_OPT_CLIENT_TUPLE || kind == INBAND_OPT_SCORE_REQUEST) {
		w->found |= OPT_TUPLE_OR_REQUEST;
	} else if (kind == INBAND_OPT_SCORE) {
		w->found |= OPT_SCORE;
		w->scores_seen++;
		if (off == 0 && len == INBAND_OPT_SCORE_LEN)
			w->found |= OPT_SCORE_STRIPPABLE;
	}
	w->off = off + len;
	return 0;
}

/*
 * Walks the options of the IPv4 header (hlen > 20 bytes, inside the packet).
 * A strippable 125's score (network order) is stored in *score_be.
 */
static __always_inline __u32 scan_ip_options(struct xdp_md *ctx, __u32 hlen, __u16 *score_be)
{
	struct opt_walk w = {};
	__u32 len = hlen - INBAND_IPV4_MIN_HDR;

	if (len == 0 || len > IP_MAX_OPT_LEN)
		return OPT_MALFORMED;
	if (bpf_xdp_load_bytes(ctx, ETH_HLEN + INBAND_IPV4_MIN_HDR, w.buf, len))
		return OPT_MALFORMED;
	w.len = len;
	bpf_loop(IP_MAX_OPT_LEN, ip_option_step, &w, 0);
	if (w.scores_seen != 1)
		w.found &= ~OPT_SCORE_STRIPPABLE;
	if (w.found & OPT_SCORE_STRIPPABLE)
		*score_be = load16(&w.buf[2]);
	return w.found;
}

static long tcp_option_step(__u32 index, void *arg)
{
	struct opt_walk *w = arg;
	__u32 off = w->off;

	if (off >= w->len || off >= sizeof(w->buf))
		return 1;
	__u8 kind = w->buf[off];

	if (kind == TCPOPT_EOL)
		return 1;
	if (kind == TCPOPT_NOP) {
		w->off = off + 1;
		return 0;
	}
	if (off + 2 > w->len || off + 1 >= sizeof(w->buf))
		return 1;
	__u8 len = w->buf[off + 1];

	if (len < 2 || off + len > w->len)
		return 1;
	if (kind == TCPOPT_MSS && len == 4) {
		w->found = off + 1;
		return 1;
	}
	w->off = off + len;
	return 0;
}

/*
 * Lowers the SYN's MSS option by INBAND_OPT_MAX_LEN so the server's segments
 * still fit the MTU once a 125 is added to them, and feeds the change into
 * the TCP checksum accumulator. `tcp` sits right after a 20-byte IPv4
 * header; its `optlen` bytes of options are inside the packet.
 */
static __always_inline __u32 clamp_mss(struct xdp_md *ctx, struct tcphdr *tcp, __u32 optlen, void *data_end,
				       __u32 acc)
{
	struct opt_walk w = {};

	if (optlen == 0 || optlen > TCP_MAX_OPT_LEN)
		return acc;
	if (bpf_xdp_load_bytes(ctx, ETH_IP_HLEN + TCP_MIN_HDR, w.buf, optlen))
		return acc;
	w.len = optlen;
	bpf_loop(TCP_MAX_OPT_LEN, tcp_option_step, &w, 0);
	if (!w.found)
		return acc;
	/* found - 1 + 4 <= optlen <= 40: the mask only tells the verifier so. */
	__u32 off = (w.found - 1) & 0x3f;
	__u8 *field = (__u8 *)(tcp + 1) + off + 2;

	if ((void *)(field + 2) > data_end)
		return acc;
	__u16 old = load16(field);
	__u16 mss = bpf_ntohs(old);

	if (mss <= INBAND_OPT_MAX_LEN)
		return acc;
	__u16 new = bpf_htons(mss - INBAND_OPT_MAX_LEN);

	__builtin_memcpy(field, &new, sizeof(new));
	/* The options start at an even offset (20) of the TCP header, so the
	 * field's parity in the checksummed data is off's. */
	if (off & 1)
		return csum_replace16(acc, csum_swab16(old), csum_swab16(new));
	return csum_replace16(acc, old, new);
}

static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/*
 * Backend selection walks the VIP's slots with bpf_loop for the same reason
 * as the option walks: one verification of the step instead of one per slot
 * and per outcome of every earlier slot. It runs on new connections only.
 */
struct pick {
	__u64 now;
	__u64 max_age_ns;
	__u64 best_score; /* lowest effective score among fresh backends */
	__u64 best_stale; /* lowest assigned_since among stale backends */
	__u64 min_reported; /* lowest reported score among fresh backends */
	__u32 vid;
	__u32 count; /* valid slots, <= INBAND_MAX_BACKENDS_PER_VIP */
	__u32 start; /* round-robin: first slot to try */
	__u32 seen; /* ACTIVE slots met so far (least-score: ties of best_score) */
	__u32 seen_stale; /* least-score: ties of best_stale */
	__u32 id; /* chosen backend id (least-score: best fresh) */
	__u32 stale_id; /* least-score: best stale */
	__u32 other; /* power-of-two: the second sampled id */
	__u32 slot; /* round-robin: the chosen slot */
	__u32 found;
	__u32 found_stale;
};

/*
 * A backend's effective score is its reported score plus the connections
 * assigned to it since that report. A backend with no fresh score (never
 * reported, or older than the VIP's max age) is ranked as if it had
 * reported the lowest fresh score, plus what it was assigned since its last
 * report: a new backend gets connections at once (so it gets probed and
 * reports), while one whose agent went silent attracts fewer and fewer as
 * its assigned count grows, instead of keeping a stale low score forever.
 */
static __always_inline struct inband_backend_score *score_of(__u32 id, const struct pick *p, int *fresh)
{
	struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

	if (s) {
		__u64 updated = s->updated_ns;

		*fresh = updated && !(p->now > updated && p->now - updated > p->max_age_ns);
	}
	return s;
}

/* Backend id in `slot` of VIP `vid` if that backend may take a new connection. */
static __always_inline int active_slot(__u32 vid, __u32 slot, __u32 *id_out)
{
	__u32 idx = vid * INBAND_MAX_BACKENDS_PER_VIP + slot;
	__u32 *id = bpf_map_lookup_elem(&vip_backends, &idx);

	if (!id)
		return 0;
	__u32 bid = *id;
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (!be || !(be->flags & INBAND_BACKEND_ACTIVE))
		return 0;
	*id_out = bid;
	return 1;
}

static long round_robin_step(__u32 i, void *arg)
{
	struct pick *p = arg;
	__u32 id;

	if (i >= p->count)
		return 1;
	/* The cursor may point past a VIP that shrank since; % folds it back. */
	__u32 slot = (p->start + i) % p->count;

	if (!active_slot(p->vid, slot, &id))
		return 0;
	p->id = id;
	p->slot = slot;
	p->found = 1;
	return 1;
}

static long least_score_step(__u32 slot, void *arg)
{
	struct pick *p = arg;
	struct inband_backend_score *s;
	int fresh = 0;
	__u32 id;

	if (slot >= p->count)
		return 1;
	if (!active_slot(p->vid, slot, &id))
		return 0;
	s = score_of(id, p, &fresh);
	if (!s)
		return 0;
	if (fresh) {
		__u64 eff = (__u64)s->score + s->assigned_since;

		if (!p->found || s->score < p->min_reported)
			p->min_reported = s->score;
		if (!p->found || eff < p->best_score) {
			p->best_score = eff;
			p->id = id;
			p->seen = 1;
			p->found = 1;
		} else if (eff == p->best_score) {
			/* Reservoir sampling: each of k tied backends is kept
			 * with probability 1/k in a single pass. */
			p->seen++;
			if (bpf_get_prandom_u32() % p->seen == 0)
				p->id = id;
		}
	} else {
		__u64 assigned = s->assigned_since;

		if (!p->found_stale || assigned < p->best_stale) {
			p->best_stale = assigned;
			p->stale_id = id;
			p->seen_stale = 1;
			p->found_stale = 1;
		} else if (assigned == p->best_stale) {
			p->seen_stale++;
			if (bpf_get_prandom_u32() % p->seen_stale == 0)
				p->stale_id = id;
		}
	}
	return 0;
}

/* Least-score's final choice between the best fresh and the best stale
 * backend (see above); equal ranks are a coin toss. */
static __always_inline void least_score_decide(struct pick *p)
{
	if (!p->found_stale)
		return;
	if (p->found) {
		__u64 stale_eff = p->min_reported + p->best_stale;

		if (stale_eff > p->best_score || (stale_eff == p->best_score && (bpf_get_prandom_u32() & 1)))
			return;
	}
	p->id = p->stale_id;
	p->found = 1;
}

/* Reservoir sampling of size two: a uniformly random pair of distinct ACTIVE
 * slots, in one pass and without storing the candidates. */
static long two_choices_step(__u32 slot, void *arg)
{
	struct pick *p = arg;
	__u32 id;

	if (slot >= p->count)
		return 1;
	if (!active_slot(p->vid, slot, &id))
		return 0;
	p->seen++;
	if (p->seen == 1) {
		p->id = id;
	} else if (p->seen == 2) {
		p->other = id;
	} else {
		__u32 r = bpf_get_prandom_u32() % p->seen;

		if (r == 0)
			p->id = id;
		else if (r == 1)
			p->other = id;
	}
	return 0;
}

/* Power-of-two: the same ranking as least-score over the two samples; a
 * stale sample is ranked at the fresh one's reported score. */
static __always_inline int second_is_better(const struct pick *p)
{
	int fresh_a = 0, fresh_b = 0;
	struct inband_backend_score *a = score_of(p->id, p, &fresh_a);
	struct inband_backend_score *b = score_of(p->other, p, &fresh_b);
	__u64 ea, eb;

	if (!a || !b)
		return !a && b;
	ea = (__u64)a->assigned_since + (fresh_a ? a->score : (fresh_b ? b->score : 0));
	eb = (__u64)b->assigned_since + (fresh_b ? b->score : (fresh_a ? a->score : 0));
	return eb < ea || (eb == ea && (bpf_get_prandom_u32() & 1));
}

/* Picks a backend id for a new connection to `vip`; 0 if no slot is ACTIVE. */
static __always_inline int select_backend(const struct inband_vip *vip, __u32 *id_out)
{
	struct pick p = {
		.vid = vip->id,
		.count = vip->backend_count,
		.max_age_ns = vip->score_max_age_ns,
	};

	if (p.count > INBAND_MAX_BACKENDS_PER_VIP)
		p.count = INBAND_MAX_BACKENDS_PER_VIP;
	if (!p.count)
		return 0;
	/* passthrough and dsr-rr have no score feedback to rank by. */
	int by_score = vip->mode != INBAND_MODE_PASSTHROUGH && vip->mode != INBAND_MODE_DSR_RR;

	if (by_score && vip->policy == INBAND_POLICY_LEAST_SCORE) {
		p.now = bpf_ktime_get_ns();
		bpf_loop(INBAND_MAX_BACKENDS_PER_VIP, least_score_step, &p, 0);
		least_score_decide(&p);
	} else if (by_score && vip->policy == INBAND_POLICY_POWER_OF_TWO) {
		bpf_loop(INBAND_MAX_BACKENDS_PER_VIP, two_choices_step, &p, 0);
		p.found = p.seen > 0;
		if (p.seen > 1) {
			p.now = bpf_ktime_get_ns();
			if (second_is_better(&p))
				p.id = p.other;
		}
	} else {
		__u32 vid = p.vid;
		__u32 *cursor = bpf_map_lookup_elem(&rr_cursor, &vid);

		if (!cursor)
			return 0;
		/* Each new connection takes the next ticket; inactive slots are
		 * skipped from there. */
		p.start = __sync_fetch_and_add(cursor, 1);
		bpf_loop(INBAND_MAX_BACKENDS_PER_VIP, round_robin_step, &p, 0);
	}
	*id_out = p.id;
	return p.found;
}

static __always_inline int same_client(const struct inband_nat_back *a, const struct inband_nat_back *b)
{
	return a->client_addr == b->client_addr && a->client_port == b->client_port &&
	       a->vip_addr == b->vip_addr && a->vip_port == b->vip_port;
}

/*
 * Reserves a SNAT port toward the backend in `nk` for the connection in
 * `nb`: up to INBAND_SNAT_TRIES hash-derived candidates, so the same client
 * tuple lands on the same port again (a retransmitted SYN after a lost flow
 * entry keeps its server-side connection). Returns 0 or a drop reason.
 */
static __always_inline int reserve_snat_port(const struct inband_flow_key *fk, struct inband_nat_key *nk,
					     const struct inband_nat_back *nb)
{
	__u32 h = mix32(fk->client_addr ^ mix32(fk->vip_addr ^ (((__u32)fk->client_port << 16) | fk->vip_port)));

	for (__u32 i = 0; i < INBAND_SNAT_TRIES; i++) {
		__u32 port = INBAND_SNAT_PORT_MIN + mix32(h + i * 0x9e3779b9) % SNAT_PORT_RANGE;

		nk->snat_port = bpf_htons((__u16)port);
		struct inband_nat_back *cur = bpf_map_lookup_elem(&nat_back, nk);

		if (cur) {
			if (!same_client(cur, nb))
				continue;
			if (bpf_map_update_elem(&nat_back, nk, nb, BPF_ANY))
				return INBAND_DROP_FLOW_TABLE_FULL;
			return 0;
		}
		/* NOEXIST: another CPU may claim the same free port right now. */
		long err = bpf_map_update_elem(&nat_back, nk, nb, BPF_NOEXIST);

		if (!err)
			return 0;
		if (err != -EEXIST)
			return INBAND_DROP_FLOW_TABLE_FULL;
	}
	return INBAND_DROP_SNAT_EXHAUSTED;
}

/*
 * Moves the Ethernet and IPv4 fixed header (already rewritten in place)
 * `optlen` bytes toward the front, writes the option into the gap and
 * finishes the IPv4 header around it.
 */
static __always_inline int emit_with_option(struct xdp_md *ctx, const int optlen, __u32 tot_len, __be32 client_addr,
					    __be16 client_port)
{
	if (bpf_xdp_adjust_head(ctx, -optlen))
		return drop(INBAND_DROP_ADJUST_FAILED);
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;

	if (data + ETH_IP_HLEN + optlen > data_end)
		return drop(INBAND_DROP_ADJUST_FAILED);
	__u16 *dst = data;
	__u16 *src = data + optlen;

	/* Ascending 2-byte moves are safe: the source is ahead by >= 4 bytes. */
#pragma unroll
	for (int i = 0; i < ETH_IP_HLEN / 2; i++)
		dst[i] = src[i];

	struct iphdr *iph = data + ETH_HLEN;
	__u8 *opt = data + ETH_IP_HLEN;

	if (optlen == INBAND_OPT_CLIENT_TUPLE_LEN)
		inband_encode_client_tuple(opt, client_addr, client_port);
	else
		inband_encode_score_request(opt);
	iph->ihl = (INBAND_IPV4_MIN_HDR + optlen) / 4;
	iph->tot_len = bpf_htons(tot_len + optlen);
	iph->check = 0;
	iph->check = csum_finish(csum_words(iph, (INBAND_IPV4_MIN_HDR + optlen) / 2));
	return XDP_TX;
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

/* Step 2 of the walk: a TCP packet whose (dst, dport) is a VIP. */
static __always_inline int client_to_backend(struct xdp_md *ctx, struct ethhdr *eth, void *data_end,
					     struct iphdr *iph, __u32 hlen, __u32 tot_len, int fragment,
					     const struct inband_vip *vip, __be32 self_addr)
{
	__u64 pkt_len = data_end - (void *)eth;

	if (fragment)
		return drop(INBAND_DROP_FRAGMENT);
	if (hlen > INBAND_IPV4_MIN_HDR) {
		__u16 unused;
		__u32 found = scan_ip_options(ctx, hlen, &unused);

		if (found & OPT_MALFORMED)
			return drop(INBAND_DROP_MALFORMED_OPTION);
		if (found & (OPT_TUPLE_OR_REQUEST | OPT_SCORE))
			return drop(INBAND_DROP_UNEXPECTED_OPTION);
		return drop(INBAND_DROP_IP_OPTIONS);
	}

	/* From here the IPv4 header is exactly 20 bytes. */
	struct tcphdr *tcp = (void *)(iph + 1);

	if ((void *)(tcp + 1) > data_end || tot_len < INBAND_IPV4_MIN_HDR + TCP_MIN_HDR)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__u32 tcp_hlen = tcp->doff * 4;

	if (tcp_hlen < TCP_MIN_HDR || INBAND_IPV4_MIN_HDR + tcp_hlen > tot_len)
		return drop(INBAND_DROP_TRUNCATED_L4);
	__u8 tcp_flags = ((__u8 *)tcp)[13];
	int syn = (tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;

	struct inband_flow_key fk = {
		.client_addr = iph->saddr,
		.vip_addr = iph->daddr,
		.client_port = tcp->source,
		.vip_port = tcp->dest,
		.proto = IPPROTO_TCP,
	};
	struct inband_flow *existing = bpf_map_lookup_elem(&flows, &fk);
	struct inband_backend *be = NULL;
	struct inband_flow f;
	int new_conn = 0;

	if (existing) {
		f = *existing;
		be = bpf_map_lookup_elem(&backends, &f.backend_id);
		/* A SYN with another sequence number than the flow's is a new
		 * connection reusing the client port (clients do, within minutes)
		 * and is balanced afresh, as is a SYN on the tuple of a removed
		 * backend; draining backends keep retransmitted SYNs of their flows. */
		if (syn && (f.syn_seq != tcp->seq ||
			    !be || !(be->flags & (INBAND_BACKEND_ACTIVE | INBAND_BACKEND_DRAINING))))
			existing = NULL;
	}
	if (!existing) {
		if (!syn)
			return drop(INBAND_DROP_NO_FLOW);
		__u32 id = 0;

		if (!select_backend(vip, &id))
			return drop(INBAND_DROP_NO_BACKEND);
		be = bpf_map_lookup_elem(&backends, &id);
		if (!be)
			return drop(INBAND_DROP_NO_BACKEND);
		/* No state until the next hop is known: the retransmitted SYN is
		 * balanced again once the daemon has resolved it. */
		if (mac_is_zero(be->mac))
			return drop(INBAND_DROP_NO_ROUTE);

		struct inband_nat_key nk = {
			.backend_addr = be->addr,
			.backend_port = be->port,
			.proto = IPPROTO_TCP,
		};
		struct inband_nat_back nb = {
			.client_addr = fk.client_addr,
			.vip_addr = fk.vip_addr,
			.client_port = fk.client_port,
			.vip_port = fk.vip_port,
			.backend_id = id,
			.vip_id = vip->id,
		};
		__builtin_memcpy(nb.client_mac, eth->h_source, ETH_ALEN);
		int reason = reserve_snat_port(&fk, &nk, &nb);

		if (reason)
			return drop(reason);
		f = (struct inband_flow){
			.backend_addr = be->addr,
			.backend_port = be->port,
			.snat_port = nk.snat_port,
			.backend_id = id,
			.vip_id = vip->id,
			.mode = vip->mode,
			.syn_seq = tcp->seq,
		};
		__builtin_memcpy(f.client_mac, eth->h_source, ETH_ALEN);
		if (bpf_map_update_elem(&flows, &fk, &f, BPF_ANY)) {
			bpf_map_delete_elem(&nat_back, &nk);
			return drop(INBAND_DROP_FLOW_TABLE_FULL);
		}
		/* Only the score modes rank by it; counting in the round-robin
		 * modes would leave a stale backlog after a switch to them. */
		if (vip->mode == INBAND_MODE_DSR_POLLING || vip->mode == INBAND_MODE_DSR_DYNAMIC) {
			struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &id);

			if (s)
				__sync_fetch_and_add(&s->assigned_since, 1);
		}
		new_conn = 1;
	}
	if (!be || mac_is_zero(be->mac))
		return drop(INBAND_DROP_NO_ROUTE);
	/* L4: NAT rewrite (pseudo-header addresses and ports), MSS clamp. */
	__u32 acc = csum_start(tcp->check);

	acc = csum_replace32(acc, iph->saddr, self_addr);
	acc = csum_replace32(acc, iph->daddr, f.backend_addr);
	acc = csum_replace16(acc, tcp->source, f.snat_port);
	acc = csum_replace16(acc, tcp->dest, f.backend_port);
	if (syn && f.mode != INBAND_MODE_PASSTHROUGH)
		acc = clamp_mss(ctx, tcp, tcp_hlen - TCP_MIN_HDR, data_end, acc);
	tcp->source = f.snat_port;
	tcp->dest = f.backend_port;
	tcp->check = csum_finish(acc);

	/* Which option, if any, this packet carries. */
	int optlen = 0, probe = 0;

	if (syn) {
		if (f.mode != INBAND_MODE_PASSTHROUGH)
			optlen = INBAND_OPT_CLIENT_TUPLE_LEN;
	} else if (f.mode == INBAND_MODE_DSR_DYNAMIC && vip->probe_interval) {
		__u32 *sent = bpf_map_lookup_elem(&probe_count, &f.backend_id);

		if (sent && ++*sent >= vip->probe_interval) {
			*sent = 0;
			optlen = INBAND_OPT_SCORE_REQUEST_LEN;
			probe = 1;
		}
	}

	/* L2: out of the one interface, toward the backend's next hop. */
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, be->mac, ETH_ALEN);
	iph->saddr = self_addr;
	iph->daddr = f.backend_addr;

	int verdict = XDP_TX;

	if (optlen == INBAND_OPT_CLIENT_TUPLE_LEN) {
		verdict = emit_with_option(ctx, INBAND_OPT_CLIENT_TUPLE_LEN, tot_len, fk.client_addr, fk.client_port);
	} else if (optlen == INBAND_OPT_SCORE_REQUEST_LEN) {
		verdict = emit_with_option(ctx, INBAND_OPT_SCORE_REQUEST_LEN, tot_len, 0, 0);
	} else {
		iph->check = 0;
		iph->check = csum_finish(csum_words(iph, INBAND_IPV4_MIN_HDR / 2));
	}
	if (verdict == XDP_TX)
		count_forward(f.backend_id, f.vip_id, pkt_len, new_conn, probe);
	return verdict;
}

/* Step 3 of the walk: a TCP packet to the balancer's own address. */
static __always_inline int backend_to_client(struct xdp_md *ctx, struct ethhdr *eth, void *data_end,
					     struct iphdr *iph, __u32 hlen, __u32 tot_len, int fragment,
					     struct tcphdr *tcp)
{
	void *data = eth;
	__u64 pkt_len = data_end - data;
	__u16 score_be = 0;

	struct inband_nat_key nk = {
		.backend_addr = iph->saddr,
		.backend_port = tcp->source,
		.snat_port = tcp->dest,
		.proto = IPPROTO_TCP,
	};
	struct inband_nat_back *nb = bpf_map_lookup_elem(&nat_back, &nk);

	if (!nb) {
		/* The balancer host's own traffic; only inband options are ours to judge. */
		if (hlen > INBAND_IPV4_MIN_HDR) {
			__u32 found = scan_ip_options(ctx, hlen, &score_be);

			if (found & OPT_SCORE)
				return drop(INBAND_DROP_SCORE_NOT_OWNER);
			if (found & OPT_TUPLE_OR_REQUEST)
				return drop(INBAND_DROP_UNEXPECTED_OPTION);
		}
		return XDP_PASS;
	}
	if (fragment)
		return drop(INBAND_DROP_FRAGMENT);
	if ((void *)(tcp + 1) > data_end || hlen + TCP_MIN_HDR > tot_len || tcp->doff < 5 ||
	    hlen + tcp->doff * 4 > tot_len)
		return drop(INBAND_DROP_TRUNCATED_L4);

	int strip = 0;

	if (hlen > INBAND_IPV4_MIN_HDR) {
		__u32 found = scan_ip_options(ctx, hlen, &score_be);

		if (found & OPT_MALFORMED)
			return drop(INBAND_DROP_MALFORMED_OPTION);
		if (found & OPT_TUPLE_OR_REQUEST)
			return drop(INBAND_DROP_SCORE_NOT_OWNER);
		if (found & OPT_SCORE) {
			/* A 125 anywhere but where the agent puts it is not ours to parse. */
			if (!(found & OPT_SCORE_STRIPPABLE))
				return drop(INBAND_DROP_MALFORMED_OPTION);
			strip = 1;
		}
	}

	__u32 backend_id = nb->backend_id;
	__u32 vip_id = nb->vip_id;
	__be32 client_addr = nb->client_addr;
	__be32 vip_addr = nb->vip_addr;
	__be16 client_port = nb->client_port;
	__be16 vip_port = nb->vip_port;
	struct inband_backend_stats *bs = bpf_map_lookup_elem(&backend_stats, &backend_id);

	if (strip) {
		struct inband_backend_score *s = bpf_map_lookup_elem(&scores, &backend_id);

		if (s) {
			/* Plain aligned stores: a racing SYN's assigned_since
			 * increment is either counted against the new score or not,
			 * both fine for a load estimate. */
			s->score = bpf_ntohs(score_be);
			s->updated_ns = bpf_ktime_get_ns();
			s->assigned_since = 0;
		}
		if (bs)
			bs->scores_received++;
	}

	/* L4: back to VIP:vport -> client:cport. */
	__u32 acc = csum_start(tcp->check);

	acc = csum_replace32(acc, iph->saddr, vip_addr);
	acc = csum_replace32(acc, iph->daddr, client_addr);
	acc = csum_replace16(acc, tcp->source, vip_port);
	acc = csum_replace16(acc, tcp->dest, client_port);
	tcp->source = vip_port;
	tcp->dest = client_port;
	tcp->check = csum_finish(acc);

	/* L3: the header may carry other options (kept), so update incrementally. */
	acc = csum_start(iph->check);
	acc = csum_replace32(acc, iph->saddr, vip_addr);
	acc = csum_replace32(acc, iph->daddr, client_addr);
	iph->saddr = vip_addr;
	iph->daddr = client_addr;
	if (strip) {
		__u8 *opt = (__u8 *)(iph + 1);

		if ((void *)(opt + INBAND_OPT_SCORE_LEN) > data_end)
			return drop(INBAND_DROP_MALFORMED_OPTION);
		__u16 old_first = load16(iph);
		__be16 new_len = bpf_htons(tot_len - INBAND_OPT_SCORE_LEN);

		iph->ihl -= INBAND_OPT_SCORE_LEN / 4;
		acc = csum_replace16(acc, old_first, load16(iph));
		acc = csum_replace16(acc, iph->tot_len, new_len);
		acc = csum_replace16(acc, load16(opt), 0);
		acc = csum_replace16(acc, load16(opt + 2), 0);
		iph->tot_len = new_len;
	}
	iph->check = csum_finish(acc);

	/* L2: back to where the client's packets came from. */
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, nb->client_mac, ETH_ALEN);

	if (bs) {
		bs->return_packets++;
		bs->return_bytes += pkt_len;
	}
	struct inband_vip_stats *vs = bpf_map_lookup_elem(&vip_stats, &vip_id);

	if (vs) {
		vs->return_packets++;
		vs->return_bytes += pkt_len;
	}

	if (strip) {
		if (data + ETH_IP_HLEN + INBAND_OPT_SCORE_LEN > data_end)
			return drop(INBAND_DROP_ADJUST_FAILED);
		__u16 *dst = data + INBAND_OPT_SCORE_LEN;
		__u16 *src = data;

		/* Descending 2-byte moves: the destination is ahead of the source. */
#pragma unroll
		for (int i = ETH_IP_HLEN / 2 - 1; i >= 0; i--)
			dst[i] = src[i];
		if (bpf_xdp_adjust_head(ctx, INBAND_OPT_SCORE_LEN))
			return drop(INBAND_DROP_ADJUST_FAILED);
	}
	return XDP_TX;
}

SEC("xdp")
int balancer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;

	struct iphdr *iph = (void *)(eth + 1);

	if ((void *)(iph + 1) > data_end)
		return drop(INBAND_DROP_MALFORMED_IP);
	__u32 hlen = iph->ihl * 4;
	__u32 tot_len = bpf_ntohs(iph->tot_len);
	__u32 avail = data_end - (void *)iph;

	if (iph->version != 4 || hlen < INBAND_IPV4_MIN_HDR || hlen > avail || tot_len > avail || tot_len < hlen)
		return drop(INBAND_DROP_MALFORMED_IP);
	if (iph->protocol != IPPROTO_TCP)
		return XDP_PASS;

	__u16 frag = bpf_ntohs(iph->frag_off);

	/* A non-first fragment has no ports, so it cannot be matched to a VIP
	 * (keyed by port); without its first fragment, which is dropped below,
	 * the kernel's reassembly discards it. */
	if (frag & IP_OFFSET_MASK)
		return XDP_PASS;

	/* Both directions are identified by the ports; L4 shorter than that
	 * cannot belong to any VIP or connection of ours. */
	struct tcphdr *tcp = (void *)iph + hlen;

	if ((void *)tcp + 4 > data_end || hlen + 4 > tot_len)
		return XDP_PASS;

	/* An array lookup the verifier inlines: no cost worth avoiding. */
	struct inband_lb_config *cfg = bpf_map_lookup_elem(&lb_config, &(__u32){ 0 });

	if (!cfg)
		return XDP_PASS;
	struct inband_vip_key vk = {
		.addr = iph->daddr,
		.port = tcp->dest,
		.proto = IPPROTO_TCP,
	};
	struct inband_vip *vip = bpf_map_lookup_elem(&vips, &vk);

	if (vip)
		return client_to_backend(ctx, eth, data_end, iph, hlen, tot_len, frag & IP_FRAG_MASK, vip,
					 cfg->self_addr);
	if (iph->daddr == cfg->self_addr)
		return backend_to_client(ctx, eth, data_end, iph, hlen, tot_len, frag & IP_FRAG_MASK, tcp);
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Socket-layer L7 balancing (seed 001, XLB) on a stock kernel; the
 * request path and the maps are described in docs/mesh.md.
 *
 * - connect4 (cgroup): a connect() to a service address goes to the
 *   daemon's anchor listener instead, and the socket remembers the service
 *   (mesh_dst); getpeername4 shows the service address again.
 * - sockops (cgroup): when that connection is established, the client
 *   socket enters mesh_clients (so mesh_request runs on its sends) and
 *   mesh_conns (so the daemon's accept knows its service).
 * - mesh_request (sk_msg on mesh_clients): parses the request head, picks
 *   a route, a cluster (weights), a backend (policy) and a free slot of
 *   its pool, and redirects the request's bytes onto that slot's socket.
 * - mesh_response (sk_skb verdict on mesh_pool): frames the response from
 *   its head (Content-Length) and redirects it into the client socket's
 *   receive queue; the slot is free again after its last byte.
 *
 * Whatever these programs do not handle goes to the daemon unchanged: a
 * request by SK_PASS (its bytes reach the anchor by TCP, and the
 * connection stays with the daemon), a response by SK_PASS on the pool
 * socket (the daemon reads it and relays it).
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "inband/mesh/head.h"
#include "inband/mesh/maps.h"
#include "inband/mesh/types.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define TCP_CLOSE 7
#define SOL_SOCKET 1
#define SO_RCVBUF 8

/*
 * The receive buffer a client socket is given (at least) when it enters
 * the mesh. Responses are redirected into its psock's ingress queue,
 * where receive autotuning did not grow the buffer past tcp_rmem's
 * default (128 KiB), and a redirect that finds it full waits for the
 * psock's work item to retry a jiffy later (skmsg.c, sk_psock_backlog):
 * that bounded 1 MiB responses to a quarter of a sidecar's rate with the
 * CPUs mostly idle (docs/benchmarks.md, "Where a large response's time
 * goes"). 4 MiB is net.core.rmem_max's default, the
 * most SO_RCVBUF may ask for unless the host raised it; the kernel caps a
 * larger value there.
 */
#define MESH_CLIENT_RCVBUF (4 << 20)

static __always_inline void count(__u32 counter)
{
	__u64 *c = bpf_map_lookup_elem(&mesh_stats, &counter);

	if (c)
		(*c)++;
}

/* ---- connect: service address -> anchor ---------------------------------- */

SEC("cgroup/connect4")
int mesh_connect4(struct bpf_sock_addr *ctx)
{
	struct inband_mesh_service_key key = { .ip4 = ctx->user_ip4, .port = ctx->user_port & 0xffff };
	struct inband_mesh_service *svc;
	struct inband_mesh_config *cfg;
	struct inband_mesh_dst *dst;
	__u32 zero = 0;

	if (ctx->protocol != IPPROTO_TCP)
		return 1;
	svc = bpf_map_lookup_elem(&mesh_services, &key);
	cfg = bpf_map_lookup_elem(&mesh_config, &zero);
	if (!svc || !cfg || !cfg->anchor_port)
		return 1;
	dst = bpf_sk_storage_get(&mesh_dst, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!dst)
		return 1; /* no memory: the connection goes to the service address itself */
	dst->service = svc->id;
	dst->vip4 = key.ip4;
	dst->vport = key.port;
	ctx->user_ip4 = cfg->anchor_ip4;
	ctx->user_port = cfg->anchor_port;
	count(INBAND_MESH_CONNECT_REDIRECTED);
	return 1;
}

/* The application asked for the service; it sees the service. */
SEC("cgroup/getpeername4")
int mesh_getpeername4(struct bpf_sock_addr *ctx)
{
	struct inband_mesh_dst *dst = bpf_sk_storage_get(&mesh_dst, ctx->sk, 0, 0);

	if (dst) {
		ctx->user_ip4 = dst->vip4;
		ctx->user_port = dst->vport;
	}
	return 1;
}

/* ---- sockops: track the client connection -------------------------------- */

/* The client is gone with its request still at the backend (a body it
 * never finished, or it did not wait for the answer): the slot's stream
 * is out of step, so the daemon retires it instead of it waiting for the
 * route's timeout. */
static __always_inline void abandon(__u32 slot, __u64 cookie)
{
	struct inband_mesh_slot *s = bpf_map_lookup_elem(&mesh_slots, &slot);

	if (!s || s->client_cookie != cookie)
		return;
	/* Answered before its body had all gone: whether the rest ever went
	 * is not known, so the stream may be out of step too. */
	if (__sync_val_compare_and_swap(&s->state, INBAND_MESH_SLOT_BODY, INBAND_MESH_SLOT_DOWN) ==
	    INBAND_MESH_SLOT_BODY) {
		count(INBAND_MESH_CLIENT_GONE_BODY);
		bpf_ringbuf_output(&mesh_events, &slot, sizeof(slot), 0);
		return;
	}
	if (__sync_val_compare_and_swap(&s->state, INBAND_MESH_SLOT_KERNEL, INBAND_MESH_SLOT_DOWN) !=
	    INBAND_MESH_SLOT_KERNEL)
		return;
	__u32 b = s->backend;
	struct inband_mesh_backend *be = bpf_map_lookup_elem(&mesh_backends, &b);
	if (be)
		__sync_fetch_and_add(&be->in_flight, -1);
	count(INBAND_MESH_CLIENT_GONE_IN_FLIGHT);
	bpf_ringbuf_output(&mesh_events, &slot, sizeof(slot), 0);
}

SEC("sockops")
int mesh_sockops(struct bpf_sock_ops *skops)
{
	struct inband_mesh_conn_key key = { .ip4 = skops->local_ip4, .port = skops->local_port };
	struct bpf_sock *sk = skops->sk;

	if (skops->family != 2 /* AF_INET */ || !sk)
		return 1;
	if (skops->op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB) {
		struct inband_mesh_dst *dst = bpf_sk_storage_get(&mesh_dst, sk, 0, 0);
		if (!dst)
			return 1;
		struct inband_mesh_conn conn = {
			.service = dst->service,
			.vip4 = dst->vip4,
			.vport = dst->vport,
			.cookie = bpf_get_socket_cookie(skops),
		};
		if (bpf_map_update_elem(&mesh_conns, &key, &conn, BPF_ANY)) {
			count(INBAND_MESH_CONN_TABLE_FULL);
			return 1;
		}
		/* Without the sockhash entry the requests reach the anchor by
		 * TCP, and the daemon serves them: slower, still correct. */
		if (bpf_sock_hash_update(skops, &mesh_clients, &conn.cookie, BPF_ANY)) {
			count(INBAND_MESH_CONN_TABLE_FULL);
			return 1;
		}
		bpf_sock_ops_cb_flags_set(skops, BPF_SOCK_OPS_STATE_CB_FLAG);
		count(INBAND_MESH_CONN_TRACKED);
		/* Only ever raised: an application that asked for more keeps it
		 * (the kernel reports the doubled value it set). */
		int rcvbuf = 0, want = MESH_CLIENT_RCVBUF;

		if (!bpf_getsockopt(skops, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf)) && rcvbuf < 2 * want)
			bpf_setsockopt(skops, SOL_SOCKET, SO_RCVBUF, &want, sizeof(want));
	} else if (skops->op == BPF_SOCK_OPS_STATE_CB && skops->args[1] == TCP_CLOSE) {
		/* The sockhash forgets the socket by itself. */
		struct inband_mesh_conn *conn = bpf_map_lookup_elem(&mesh_conns, &key);
		if (conn && conn->last_slot)
			abandon(conn->last_slot - 1, conn->cookie);
		bpf_map_delete_elem(&mesh_conns, &key);
	}
	return 1;
}

/* ---- requests ------------------------------------------------------------ */

struct request_fields {
	struct inband_mesh_service_key svc;
	struct framing fr;
	__u32 header_hits; /* bit r: route r's header matched */
	__u32 header_routes; /* the service has routes with a header match */
};

/* FNV-1a 64 of buf[from .. to), lower-cased if `fold`; 0 if longer than
 * `max` (no route matches it). */
HEAD_FN __u64 fnv(const struct head *h, __u32 from, __u32 to, __u32 max, int fold)
{
	__u64 x = INBAND_MESH_FNV_OFFSET;

	if (!h || to - from > max)
		return 0;
	for (__u32 i = 0; i < INBAND_MESH_HVALUE_MAX; i++) {
		if (from + i >= to)
			break;
		char c = head_at(h, from + i);
		x = (x ^ (__u8)(fold ? lower(c) : c)) * INBAND_MESH_FNV_PRIME;
	}
	return x;
}

/* One header line of a request (bpf_loop callback). */
static long request_header(__u64 i, struct request_fields *f)
{
	__u32 which = SCRATCH_REQUEST;
	struct head *h = bpf_map_lookup_elem(&mesh_scratch, &which);

	if (!h)
		return 1;
	__u32 start, nlen, vfrom, vto;
	if (framing_line(h, i, &f->fr, &start, &nlen, &vfrom, &vto))
		return 1;
	if (!f->header_routes)
		return 0;
	/* Looked up here, not above: a hash lookup per line is the most this
	 * callback costs, and most services have no header routes. */
	struct inband_mesh_service *svc = bpf_map_lookup_elem(&mesh_services, &f->svc);
	if (!svc)
		return 1;
	__u64 name = fnv(h, start, start + nlen, INBAND_MESH_HNAME_MAX, 1);
	__u64 value = fnv(h, vfrom, vto, INBAND_MESH_HVALUE_MAX, 0);
	for (__u32 r = 0; r < INBAND_MESH_MAX_ROUTES; r++) {
		if (r >= svc->n_routes)
			break;
		struct inband_mesh_route *rt = &svc->routes[r];
		if (rt->hname_len && rt->hname_hash == name && rt->hvalue_hash == value)
			f->header_hits |= 1u << r;
	}
	return 0;
}

struct route_ctx {
	struct inband_mesh_service_key svc;
	__u32 target;
	__u32 target_len;
	__u32 header_hits;
	__u32 route; /* the first that matches; INBAND_MESH_MAX_ROUTES: none */
};

/* Route r matches if its header (if any) did and its prefix does
 * (bpf_loop callback: the prefix loop is verified once, not per route). */
static long route_matches(__u64 r, struct route_ctx *c)
{
	__u32 which = SCRATCH_REQUEST;
	struct head *h = bpf_map_lookup_elem(&mesh_scratch, &which);
	struct inband_mesh_service *svc = bpf_map_lookup_elem(&mesh_services, &c->svc);

	if (!h || !svc || r >= INBAND_MESH_MAX_ROUTES)
		return 1;
	struct inband_mesh_route *rt = &svc->routes[r];
	if (rt->hname_len && !(c->header_hits & (1u << r)))
		return 0;
	if (rt->prefix_len > c->target_len)
		return 0;
	for (__u32 i = 0; i < INBAND_MESH_PREFIX_MAX; i++) {
		if (i >= rt->prefix_len)
			break;
		if (head_at(h, c->target + i) != rt->prefix[i])
			return 0;
	}
	c->route = r;
	return 1;
}

struct claim_ctx {
	__u32 base;
	__u32 pool;
	__u32 start;
	__u32 got; /* 1 + slot; 0: none free */
};

static long claim_slot(__u64 k, struct claim_ctx *c)
{
	__u32 idx = c->base + (c->start + (__u32)k) % c->pool;
	struct inband_mesh_slot *s = bpf_map_lookup_elem(&mesh_slots, &idx);

	if (!s)
		return 1;
	if (s->state == INBAND_MESH_SLOT_FREE &&
	    __sync_val_compare_and_swap(&s->state, INBAND_MESH_SLOT_FREE, INBAND_MESH_SLOT_KERNEL) ==
		    INBAND_MESH_SLOT_FREE) {
		c->got = idx + 1;
		return 1;
	}
	return 0;
}

/* A free slot of backend `b`: 1 + slot, or 0. */
static __always_inline __u32 claim(__u32 b)
{
	struct inband_mesh_backend *be = bpf_map_lookup_elem(&mesh_backends, &b);
	struct claim_ctx c = {};

	if (!be || !be->up || !be->pool || be->pool > INBAND_MESH_MAX_POOL)
		return 0;
	c.base = be->slot_base;
	c.pool = be->pool;
	c.start = __sync_fetch_and_add(&be->next_slot, 1);
	bpf_loop(c.pool, claim_slot, &c, 0);
	return c.got;
}

/* The backend (index into split->backends) the policy asks for first. */
static __always_inline __u32 first_choice(struct inband_mesh_split *split, __u32 policy, __u32 n)
{
	if (policy == INBAND_MESH_RANDOM)
		return bpf_get_prandom_u32() % n;
	if (policy == INBAND_MESH_LEAST_REQUEST) {
		__u32 start = __sync_fetch_and_add(&split->rr, 1) % n, best = start;
		__s32 best_load = 0x7fffffff;
		for (__u32 k = 0; k < INBAND_MESH_MAX_CLUSTER; k++) {
			if (k >= n)
				break;
			__u32 j = (start + k) % n;
			__u32 b = split->backends[j & (INBAND_MESH_MAX_CLUSTER - 1)];
			struct inband_mesh_backend *be = bpf_map_lookup_elem(&mesh_backends, &b);
			if (be && be->up && be->in_flight < best_load) {
				best_load = be->in_flight;
				best = j;
			}
		}
		return best;
	}
	return __sync_fetch_and_add(&split->rr, 1) % n;
}

static __always_inline int to_user(struct inband_mesh_conn *conn, __u32 reason)
{
	conn->mode = INBAND_MESH_CONN_USER;
	conn->fallback_reason = reason;
	count(reason);
	return SK_PASS;
}

SEC("sk_msg")
int mesh_request(struct sk_msg_md *msg)
{
	struct inband_mesh_conn_key key = { .ip4 = msg->local_ip4, .port = msg->local_port };
	struct request_fields f = { .fr.content_length = -1 };
	struct inband_mesh_conn *conn = bpf_map_lookup_elem(&mesh_conns, &key);
	struct inband_mesh_service *svc;
	struct head *h;
	__u32 size = msg->size, n, reason = 0;

	if (!conn || conn->mode != INBAND_MESH_CONN_KERNEL)
		return SK_PASS;
	if (conn->last_slot) {
		__u32 last = conn->last_slot - 1;
		struct inband_mesh_slot *ls = bpf_map_lookup_elem(&mesh_slots, &last);
		if (ls && ls->client_cookie == conn->cookie) {
			if (ls->state == INBAND_MESH_SLOT_KERNEL || ls->state == INBAND_MESH_SLOT_USER)
				return to_user(conn, INBAND_MESH_FALLBACK_PIPELINED);
			/* This program runs on the client's writes again only
			 * once the last request's body has all gone its way. */
			if (ls->state == INBAND_MESH_SLOT_BODY) /* no locked op per request otherwise */
				__sync_val_compare_and_swap(&ls->state, INBAND_MESH_SLOT_BODY, INBAND_MESH_SLOT_FREE);
		}
	}
	f.svc.ip4 = conn->vip4;
	f.svc.port = conn->vport;
	svc = bpf_map_lookup_elem(&mesh_services, &f.svc);
	if (!svc)
		return to_user(conn, INBAND_MESH_FALLBACK_NO_ROUTE); /* the service was removed */

	n = size < INBAND_MESH_HEAD_MAX ? size : INBAND_MESH_HEAD_MAX - 1;
	if (n == 0 || bpf_msg_pull_data(msg, 0, n, 0))
		return to_user(conn, INBAND_MESH_FALLBACK_MALFORMED);
	void *data = (void *)(long)msg->data, *data_end = (void *)(long)msg->data_end;
	if (data + 1 > data_end || data_end - data < n)
		return to_user(conn, INBAND_MESH_FALLBACK_MALFORMED);
	h = head_take(SCRATCH_REQUEST);
	if (!h)
		return to_user(conn, INBAND_MESH_FALLBACK_BUSY);
	h->len = n;
	if (bpf_probe_read_kernel(h->buf, n & HEAD_MASK, data)) {
		head_give(h);
		return to_user(conn, INBAND_MESH_FALLBACK_MALFORMED);
	}
	head_walk(h, SCRATCH_REQUEST);

	/* The request line: METHOD SP target SP HTTP/1.1. */
	__u32 sp1 = h->sp1, sp2 = h->sp2, first_end = h->first_end;
	if (h->malformed)
		reason = h->n_lines >= MAX_LINES ? INBAND_MESH_FALLBACK_HEAD_TOO_BIG : INBAND_MESH_FALLBACK_MALFORMED;
	else if (!h->head_len)
		reason = size >= INBAND_MESH_HEAD_MAX - 1 ? INBAND_MESH_FALLBACK_HEAD_TOO_BIG
							  : INBAND_MESH_FALLBACK_PARTIAL_HEAD;
	else if (!sp1 || sp2 <= sp1 + 1 || first_end != sp2 + 9)
		reason = INBAND_MESH_FALLBACK_MALFORMED;
	else if (head_at(h, sp2 + 1) != 'H' || head_at(h, sp2 + 5) != '/' || head_at(h, sp2 + 7) != '.')
		reason = INBAND_MESH_FALLBACK_MALFORMED;
	else if (head_at(h, sp2 + 6) != '1' || head_at(h, sp2 + 8) != '1')
		reason = INBAND_MESH_FALLBACK_UPGRADE; /* HTTP/2 preface, HTTP/1.0 */
	if (reason) {
		head_give(h);
		return to_user(conn, reason);
	}
	f.header_routes = svc->header_routes;
	bpf_loop(h->n_lines, request_header, &f, 0);
	if (f.fr.bad)
		reason = INBAND_MESH_FALLBACK_MALFORMED;
	else if (f.fr.chunked)
		reason = INBAND_MESH_FALLBACK_CHUNKED;
	else if (f.fr.upgrade || f.fr.not_keep_alive)
		reason = INBAND_MESH_FALLBACK_UPGRADE;
	if (reason) {
		head_give(h);
		return to_user(conn, reason);
	}
	__u64 total = h->head_len + (f.fr.content_length > 0 ? f.fr.content_length : 0);
	if (total < size) {
		head_give(h);
		return to_user(conn, INBAND_MESH_FALLBACK_PIPELINED);
	}
	if (total > INBAND_MESH_KERNEL_REQUEST_MAX) {
		head_give(h);
		return to_user(conn, INBAND_MESH_FALLBACK_LARGE_BODY);
	}
	__u32 is_head = sp1 == 4 && head_at(h, 0) == 'H' && head_at(h, 1) == 'E' && head_at(h, 2) == 'A' &&
			head_at(h, 3) == 'D';

	/* Route: the first whose path prefix and header both match. */
	struct route_ctx rc = {
		.svc = f.svc,
		.target = sp1 + 1,
		.target_len = sp2 - sp1 - 1,
		.header_hits = f.header_hits,
		.route = INBAND_MESH_MAX_ROUTES,
	};
	bpf_loop(svc->n_routes < INBAND_MESH_MAX_ROUTES ? svc->n_routes : INBAND_MESH_MAX_ROUTES, route_matches, &rc,
		 0);
	__u32 route = rc.route;
	head_give(h);
	if (route >= INBAND_MESH_MAX_ROUTES)
		return to_user(conn, INBAND_MESH_FALLBACK_NO_ROUTE);
	struct inband_mesh_route *rt = &svc->routes[route];

	/* Cluster by weight (canary), then backend by policy, then a slot. */
	__u32 pick = 0;
	if (rt->total_weight) {
		__u32 x = bpf_get_prandom_u32() % rt->total_weight;
		for (__u32 s = 0; s < INBAND_MESH_MAX_SPLITS; s++) {
			if (x < rt->splits[s].weight) {
				pick = s;
				break;
			}
			x -= rt->splits[s].weight;
		}
	}
	struct inband_mesh_split *split = &rt->splits[pick & (INBAND_MESH_MAX_SPLITS - 1)];
	__u32 nb = split->n_backends, slot = 0, backend = 0;
	if (!nb || nb > INBAND_MESH_MAX_CLUSTER)
		return to_user(conn, INBAND_MESH_FALLBACK_NO_SLOT);
	__u32 first = first_choice(split, rt->policy, nb);
	for (__u32 k = 0; k < INBAND_MESH_MAX_CLUSTER; k++) {
		if (k >= nb)
			break;
		backend = split->backends[((first + k) % nb) & (INBAND_MESH_MAX_CLUSTER - 1)];
		slot = claim(backend);
		if (slot)
			break;
	}
	if (!slot) {
		__u32 wanted = split->backends[first & (INBAND_MESH_MAX_CLUSTER - 1)];
		struct inband_mesh_backend *wb = bpf_map_lookup_elem(&mesh_backends, &wanted);
		if (wb)
			__sync_fetch_and_add(&wb->no_slot, 1);
		return to_user(conn, INBAND_MESH_FALLBACK_NO_SLOT);
	}
	slot -= 1;
	struct inband_mesh_slot *s = bpf_map_lookup_elem(&mesh_slots, &slot);
	struct inband_mesh_backend *be = bpf_map_lookup_elem(&mesh_backends, &backend);
	if (!s || !be)
		return to_user(conn, INBAND_MESH_FALLBACK_NO_SLOT);
	s->backend = backend;
	s->client_cookie = conn->cookie;
	s->client_ip4 = key.ip4;
	s->client_port = key.port;
	s->head_request = is_head;
	s->timeout_ms = rt->timeout_ms;
	s->started_ns = bpf_ktime_get_ns();
	s->remaining = 0;
	s->to_client = 0;
	s->body_phase = 0;
	s->close_after = 0;
	s->body_follows = total > size;
	if (total > size)
		bpf_msg_apply_bytes(msg, total); /* the body's later sends follow the same way */
	if (bpf_msg_redirect_hash(msg, &mesh_pool, &slot, 0) != SK_PASS) {
		/* The daemon is retiring that socket. */
		s->state = INBAND_MESH_SLOT_DOWN;
		return to_user(conn, INBAND_MESH_FALLBACK_NO_SLOT);
	}
	conn->last_slot = slot + 1;
	conn->requests++;
	__sync_fetch_and_add(&be->in_flight, 1);
	__sync_fetch_and_add(&be->requests, 1);
	count(INBAND_MESH_REQUEST_KERNEL);
	return SK_PASS;
}

/* ---- responses ----------------------------------------------------------- */

/* The slot's request is answered: the client may send again, the slot
 * takes the next request (or the daemon retires it). */
static __always_inline void release(struct inband_mesh_slot *s, __u32 retire)
{
	__u32 b = s->backend;
	struct inband_mesh_backend *be = bpf_map_lookup_elem(&mesh_backends, &b);

	__u32 next = retire ? INBAND_MESH_SLOT_DOWN : s->body_follows ? INBAND_MESH_SLOT_BODY : INBAND_MESH_SLOT_FREE;

	s->body_phase = 0;
	/* Whoever moves a slot out of KERNEL counts its request done: here,
	 * abandon(), or the daemon's timeout, whichever comes first. */
	if (__sync_val_compare_and_swap(&s->state, INBAND_MESH_SLOT_KERNEL, next) == INBAND_MESH_SLOT_KERNEL && be)
		__sync_fetch_and_add(&be->in_flight, -1);
}

/* Body length of a response head in the scratch buffer, -1 if it has no
 * length this program can follow (the daemon relays it). */
static __always_inline __s64 response_body(struct head *h, __u32 head_request, __u32 *close)
{
	struct framing f = { .content_length = -1 };

	/* HTTP/1.1 SP 3DIGIT */
	if (h->sp1 != 8 || head_at(h, 0) != 'H' || head_at(h, 5) != '1' || head_at(h, 6) != '.' ||
	    head_at(h, 7) != '1')
		return -1;
	char c0 = head_at(h, 9), c1 = head_at(h, 10), c2 = head_at(h, 11);
	if (c0 < '1' || c0 > '5' || c1 < '0' || c1 > '9' || c2 < '0' || c2 > '9')
		return -1;
	__u32 status = (c0 - '0') * 100 + (c1 - '0') * 10 + (c2 - '0');
	if (status < 200)
		return -1; /* 1xx: a second head follows */
	bpf_loop(h->n_lines, response_line, &f, 0);
	if (f.bad)
		return -1;
	*close = f.not_keep_alive;
	if (head_request || status == 204 || status == 304)
		return 0;
	if (f.chunked || f.content_length < 0)
		return -1; /* chunked or close-delimited */
	return f.content_length;
}

SEC("sk_skb/stream_verdict")
int mesh_response(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	__u32 *slot = bpf_map_lookup_elem(&mesh_slot_of, &cookie);
	struct inband_mesh_slot *s;
	__u32 len = skb->len;

	if (!slot)
		return SK_PASS;
	s = bpf_map_lookup_elem(&mesh_slots, slot);
	if (!s)
		return SK_PASS;
	if (s->state != INBAND_MESH_SLOT_KERNEL) {
		if (s->state == INBAND_MESH_SLOT_FREE && len) {
			count(INBAND_MESH_RESPONSE_UNEXPECTED);
			bpf_ringbuf_output(&mesh_events, slot, sizeof(*slot), 0);
		}
		return SK_PASS;
	}
	if (!len)
		return SK_PASS;
	if (!s->body_phase) {
		struct head *h = head_take(SCRATCH_RESPONSE);
		__u32 n = len < INBAND_MESH_HEAD_MAX ? len : INBAND_MESH_HEAD_MAX - 1, close = 0;
		__s64 body = -1;
		if (h) {
			h->len = n;
			if (!bpf_skb_load_bytes(skb, 0, h->buf, n & HEAD_MASK)) {
				head_walk(h, SCRATCH_RESPONSE);
				if (!h->malformed && h->head_len)
					body = response_body(h, s->head_request, &close);
			}
			if (body >= 0)
				s->remaining = h->head_len + body;
			head_give(h);
		}
		if (body < 0) {
			/* The head is not all in this segment, or its framing is
			 * one the daemon follows: the rest of the response is its. */
			s->state = INBAND_MESH_SLOT_USER;
			count(INBAND_MESH_RESPONSE_USER);
			bpf_ringbuf_output(&mesh_events, slot, sizeof(*slot), 0);
			return SK_PASS;
		}
		s->close_after = close;
		s->body_phase = 1;
	}
	__u32 retire = s->close_after;
	if (len > s->remaining) {
		/* The backend sent more than it was asked for. */
		count(INBAND_MESH_RESPONSE_EXCESS);
		bpf_skb_change_tail(skb, s->remaining, 0);
		len = s->remaining;
		retire = 1;
	}
	s->remaining -= len;
	s->to_client += len;
	__u64 client = s->client_cookie;
	if (!s->remaining) {
		release(s, retire);
		count(INBAND_MESH_RESPONSE_KERNEL);
		if (retire)
			bpf_ringbuf_output(&mesh_events, slot, sizeof(*slot), 0);
	}
	if (bpf_sk_redirect_hash(skb, &mesh_clients, &client, BPF_F_INGRESS) != SK_PASS) {
		count(INBAND_MESH_RESPONSE_CLIENT_GONE);
		return SK_DROP;
	}
	return SK_PASS;
}

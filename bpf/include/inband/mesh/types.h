/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the socket-layer L7 balancer (bpf/mesh.bpf.c,
 * seed 001's XLB on a stock kernel). The Rust types are generated from
 * this header and consts.h (crates/inband/build.rs); the maps themselves
 * are in maps.h. docs/mesh.md tells how a request flows.
 *
 * Names: a "client" socket is the application's socket to a service
 * address (redirected to the daemon's anchor listener at connect time); a
 * "slot" is one pre-connected socket of the daemon's pool to one backend.
 */
#ifndef INBAND_MESH_TYPES_H
#define INBAND_MESH_TYPES_H

#include <linux/types.h>

#include "inband/mesh/consts.h"

/* mesh_config[0]: where connections to a service address are sent. */
struct inband_mesh_config {
	__u32 anchor_ip4; /* network order */
	__u32 anchor_port; /* network order, in the low 16 bits (as bpf_sock_addr.user_port) */
};

/* mesh_services: key. */
struct inband_mesh_service_key {
	__u32 ip4; /* network order */
	__u32 port; /* network order, low 16 bits */
};

struct inband_mesh_split {
	__u32 weight; /* 0: unused */
	__u32 n_backends;
	__u32 rr; /* round-robin ticket */
	__u32 pad;
	__u32 backends[INBAND_MESH_MAX_CLUSTER]; /* indexes into mesh_backends */
};

struct inband_mesh_route {
	__u32 prefix_len; /* 0 matches every path */
	__u32 hname_len; /* 0: no header to match */
	__u32 hvalue_len;
	__u32 policy; /* enum inband_mesh_policy */
	__u32 total_weight;
	__u32 timeout_ms; /* read by the daemon's watchdog */
	/* The header to match, as FNV-1a 64 of its lower-cased name and of its
	 * exact value (one hash per line walk, not a byte loop per route). */
	__u64 hname_hash;
	__u64 hvalue_hash;
	char prefix[INBAND_MESH_PREFIX_MAX];
	/* The header as configured, for status only (the program matches the
	 * hashes): the map is the one place a running daemon's routes are read. */
	char hname[INBAND_MESH_HNAME_MAX];
	char hvalue[INBAND_MESH_HVALUE_MAX];
	struct inband_mesh_split splits[INBAND_MESH_MAX_SPLITS];
};

/* mesh_services: value. */
struct inband_mesh_service {
	__u32 id; /* index of the service in the config, for counters and status */
	__u32 n_routes;
	__u32 header_routes; /* routes with a header match: 0 skips hashing header lines */
	__u32 pad;
	struct inband_mesh_route routes[INBAND_MESH_MAX_ROUTES];
};

/* mesh_backends[i]: written by the daemon (address, pool), counted by the
 * programs (in_flight, requests). Memory-mapped by the daemon, which
 * updates the counters with atomics too (a response it relays). */
struct inband_mesh_backend {
	__u32 ip4; /* network order */
	__u32 port; /* host order */
	__u32 up; /* 0: no slot of it is claimed */
	__u32 slot_base; /* its pool: mesh_slots[slot_base .. slot_base + pool) */
	__u32 pool;
	__u32 next_slot; /* where the next claim starts looking */
	__s32 in_flight; /* requests sent and not yet answered (least-request) */
	__u32 no_slot; /* requests that found no free slot with it as first choice: the daemon grows the pool */
	__u64 requests; /* sent through the kernel path */
};

enum inband_mesh_slot_state {
	INBAND_MESH_SLOT_DOWN = 0, /* no socket, or the daemon is retiring it */
	INBAND_MESH_SLOT_FREE, /* connected, in mesh_pool: may be claimed */
	INBAND_MESH_SLOT_KERNEL, /* a request is in flight; its response goes by the kernel */
	INBAND_MESH_SLOT_USER, /* its response goes to the daemon (framing not known to the parser) */
	/* Answered while its request's body may still be on its way: the
	 * request program sends a body's later writes after it by
	 * bpf_msg_apply_bytes, which no program sees pass, and a backend may
	 * answer before it has read them (a refusal, or nginx's `return`).
	 * Another request must not go in between, so only that client's next
	 * request frees it (the program runs again only once those bytes have
	 * gone), and its close retires it. */
	INBAND_MESH_SLOT_BODY,
};

/* mesh_slots[i]: one pool socket. Claimed by the request program with an
 * atomic FREE -> KERNEL; from then on only its owner writes it (the
 * response program, or the daemon for a USER response), until it is FREE
 * again. Memory-mapped by the daemon. */
struct inband_mesh_slot {
	__u32 state; /* enum inband_mesh_slot_state */
	__u32 backend;
	__u64 client_cookie; /* key of the client socket in mesh_clients */
	__u32 client_ip4; /* network order: key of the client in mesh_conns */
	__u32 client_port; /* host order */
	__u32 head_request; /* the request was HEAD: its response has no body */
	__u32 timeout_ms;
	__u64 started_ns; /* bpf_ktime_get_ns() at the claim */
	__u64 remaining; /* body bytes of the response still to come (kernel path) */
	__u64 to_client; /* response bytes delivered to the client so far */
	__u32 body_phase; /* the head was delivered; `remaining` counts down */
	__u32 close_after; /* the backend said Connection: close: retire after */
	__u32 body_follows; /* the request goes on past the write that claimed the slot */
	__u32 pad;
};

/* mesh_conns, keyed by the client's address (what the daemon's accept sees
 * as the peer). Created at the client's connect completion (sockops),
 * deleted at its close; LRU-bounded. */
struct inband_mesh_conn_key {
	__u32 ip4; /* network order */
	__u32 port; /* host order */
};

enum inband_mesh_conn_mode {
	INBAND_MESH_CONN_KERNEL = 0, /* requests are parsed and redirected */
	INBAND_MESH_CONN_USER, /* every byte goes to the anchor (fallback for the rest of its life) */
};

struct inband_mesh_conn {
	__u32 service; /* inband_mesh_service.id */
	__u32 vip4; /* the service address it connected to */
	__u32 vport; /* network order, low 16 bits */
	__u32 mode; /* enum inband_mesh_conn_mode */
	__u32 last_slot; /* 1 + slot of its latest request (in flight while that slot
			  * is KERNEL or USER for this cookie, its body maybe
			  * while BODY); 0: none */
	__u32 fallback_reason; /* enum inband_mesh_counter of the fallback */
	__u64 cookie;
	__u64 requests; /* through the kernel path */
};

/* Socket storage of a client socket between connect and its completion. */
struct inband_mesh_dst {
	__u32 service;
	__u32 vip4;
	__u32 vport;
	__u32 pad;
};

/* What the head walk and the framing read from a message: written by
 * bpf/mesh_head_probe.bpf.c, the test-run probe that gives the parser's
 * byte-level fixtures (sk_msg and sk_skb programs have no test run). */
struct inband_mesh_head_result {
	__u32 head_len; /* through the empty line; 0: not within the window */
	__u32 sp1, sp2; /* the first line's first two spaces */
	__u32 first_end;
	__u32 n_lines;
	__u32 malformed; /* bare LF, a non-token byte in a name, too many lines */
	__s64 content_length; /* -1: none */
	__u32 chunked;
	__u32 upgrade;
	__u32 not_keep_alive;
	__u32 bad; /* no name, white space before the colon, lengths that differ */
};

#endif /* INBAND_MESH_TYPES_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The socket-layer balancer's numbers that are not a map's layout: its
 * limits, the FNV-1a constants of its header hashes, its policies and the
 * indices of its counters (mesh_stats). Apart from types.h for the same
 * reason as lb/consts.h; Rust gets both through bindgen
 * (crates/inband/build.rs).
 */
#ifndef INBAND_MESH_CONSTS_H
#define INBAND_MESH_CONSTS_H

#define INBAND_MESH_MAX_SERVICES 256
#define INBAND_MESH_MAX_ROUTES 8 /* per service, tried in order */
#define INBAND_MESH_MAX_SPLITS 4 /* weighted clusters per route (canary) */
#define INBAND_MESH_MAX_CLUSTER 16 /* backends per cluster */
#define INBAND_MESH_MAX_BACKENDS 1024
#define INBAND_MESH_MAX_POOL 256 /* slots per backend */
#define INBAND_MESH_MAX_SLOTS 16384
/* The longest request (head and body) the kernel path carries. A body
 * goes after its head by bpf_msg_apply_bytes, which the kernel counts
 * down by what it tried to push into the pool socket, not by what went: a
 * nonblocking client's write that finds the pool socket's send buffer
 * full comes back short, the client writes the rest again, and those
 * bytes are counted twice, so the program would run again mid-body.
 * Pool sockets get a send buffer of INBAND_MESH_POOL_SNDBUF (the daemon
 * sets it), four times this, so that a request of this size and the one
 * before it always fit; a longer one goes to the daemon. */
#define INBAND_MESH_KERNEL_REQUEST_MAX (2u << 20)
#define INBAND_MESH_POOL_SNDBUF (8u << 20)
#define INBAND_MESH_PREFIX_MAX 64
#define INBAND_MESH_HNAME_MAX 32
#define INBAND_MESH_HVALUE_MAX 128
#define INBAND_MESH_FNV_OFFSET 0xcbf29ce484222325ULL
#define INBAND_MESH_FNV_PRIME 0x100000001b3ULL
/* Request and response heads are parsed from the first this many bytes
 * (power of two); a longer head goes to user space. */
#define INBAND_MESH_HEAD_MAX 2048
#define INBAND_MESH_MAX_CONNS 65536

enum inband_mesh_policy {
	INBAND_MESH_ROUND_ROBIN = 0,
	INBAND_MESH_RANDOM,
	INBAND_MESH_LEAST_REQUEST,
};

/* mesh_stats[counter], per CPU. */
enum inband_mesh_counter {
	INBAND_MESH_CONNECT_REDIRECTED = 0, /* connect() to a service address sent to the anchor */
	INBAND_MESH_CONN_TRACKED, /* client connection established and in mesh_clients */
	INBAND_MESH_CONN_TABLE_FULL, /* its mesh_conns entry could not be made: user space serves it */
	INBAND_MESH_REQUEST_KERNEL, /* request redirected to a backend socket */
	INBAND_MESH_RESPONSE_KERNEL, /* response delivered to the client by the kernel */
	INBAND_MESH_FALLBACK_PIPELINED, /* more than one request at once: connection to user space */
	INBAND_MESH_FALLBACK_UPGRADE, /* Upgrade, Expect, HTTP/2 preface, Connection: close */
	INBAND_MESH_FALLBACK_CHUNKED, /* request body without Content-Length */
	INBAND_MESH_FALLBACK_HEAD_TOO_BIG, /* request head longer than INBAND_MESH_HEAD_MAX */
	INBAND_MESH_FALLBACK_PARTIAL_HEAD, /* head not complete in one send */
	INBAND_MESH_FALLBACK_MALFORMED, /* not an HTTP/1.1 request line and headers */
	INBAND_MESH_FALLBACK_NO_ROUTE, /* no route matched: user space answers 404 */
	INBAND_MESH_FALLBACK_NO_SLOT, /* every slot of the chosen cluster busy or down */
	INBAND_MESH_FALLBACK_BUSY, /* scratch buffer in use on this CPU (preempted parse) */
	INBAND_MESH_RESPONSE_USER, /* response framing not known (chunked, close-delimited, 1xx, too long a head): to the daemon */
	INBAND_MESH_RESPONSE_CLIENT_GONE, /* client socket closed: response dropped, slot kept */
	INBAND_MESH_RESPONSE_UNEXPECTED, /* data on a slot with no request: to the daemon, which retires it */
	INBAND_MESH_RESPONSE_EXCESS, /* bytes after the response's end: cut, the slot retired */
	INBAND_MESH_CLIENT_GONE_IN_FLIGHT, /* client closed with its request at the backend: slot retired */
	INBAND_MESH_FALLBACK_LARGE_BODY, /* request longer than INBAND_MESH_KERNEL_REQUEST_MAX */
	INBAND_MESH_CLIENT_GONE_BODY, /* client closed after an answer that came before its body had all gone: slot retired */
	INBAND_MESH_COUNTERS,
};

#endif /* INBAND_MESH_CONSTS_H */

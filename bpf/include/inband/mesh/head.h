/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * HTTP/1.1 message heads, scanned in a per-CPU scratch buffer.
 *
 * Why by hand: no HTTP parser runs in BPF. This one only splits a head
 * into lines and reads the few fields the balancer needs (request line or
 * status, Content-Length, Transfer-Encoding, Connection, Upgrade, Expect,
 * the headers routes match); anything it does not understand sends the
 * message to user space, where a full parser (httparse) handles it.
 *
 * The head is copied once into the scratch buffer (sk_msg has no
 * load_bytes and its data may span pages); bpf_loop callbacks then walk
 * it, so the verifier sees each walk once however long the head is.
 */
#ifndef INBAND_MESH_HEAD_H
#define INBAND_MESH_HEAD_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/mesh/types.h"

#define HEAD_MASK (INBAND_MESH_HEAD_MAX - 1)
#define MAX_LINES 64 /* header lines; more sends the message to user space */

enum head_scratch {
	SCRATCH_REQUEST = 0, /* sk_msg, in the sender's process context */
	SCRATCH_RESPONSE = 1, /* sk_skb, in softirq or the strparser's work */
	SCRATCHES,
};

struct head {
	__u32 busy; /* taken with a compare-and-swap: a preempted parse on this CPU keeps it */
	__u32 len; /* bytes in buf */
	/* The walk. */
	__u32 line_start;
	__u32 colon; /* first ':' of the current line; 0: none yet */
	__u32 first_done;
	__u32 sp1, sp2; /* first two spaces of the first line */
	__u32 first_end; /* the first line's '\r' */
	__u32 n_lines;
	__u32 head_len; /* through the empty line's '\n'; 0: not seen */
	__u32 malformed;
	__u16 starts[MAX_LINES];
	__u16 colons[MAX_LINES];
	__u16 ends[MAX_LINES];
	char buf[INBAND_MESH_HEAD_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SCRATCHES);
	__type(key, __u32);
	__type(value, struct head);
} mesh_scratch SEC(".maps");

static __always_inline struct head *head_take(__u32 which)
{
	struct head *h = bpf_map_lookup_elem(&mesh_scratch, &which);

	if (!h || __sync_val_compare_and_swap(&h->busy, 0, 1) != 0)
		return 0;
	h->line_start = 0;
	h->colon = 0;
	h->first_done = 0;
	h->sp1 = 0;
	h->sp2 = 0;
	h->first_end = 0;
	h->n_lines = 0;
	h->head_len = 0;
	h->malformed = 0;
	return h;
}

static __always_inline void head_give(struct head *h)
{
	__sync_lock_test_and_set(&h->busy, 0);
}

static __always_inline char head_at(const struct head *h, __u32 i)
{
	return h->buf[i & HEAD_MASK];
}

/* Case folding for header names, without a branch (the verifier would
 * walk both sides for every byte of every loop). Exact for names: the walk
 * refuses control characters (a CR but at a line's end), space and DEL in
 * them, and the only other bytes it moves ('@', '[', '\\', ']', '^', '_')
 * land on no letter and not on '-'. */
static __always_inline char lower(char c)
{
	return c | 0x20;
}

struct walk_ctx {
	__u32 which;
};

/* One byte of the walk: records the first line's spaces, each header
 * line's start, colon and end, and stops (1) at the empty line. */
static __always_inline int walk_byte(struct head *h, __u32 p)
{
	if (p >= h->len)
		return 1;
	char c = head_at(h, p);
	if (!h->first_done) {
		if (c == ' ') {
			if (!h->sp1)
				h->sp1 = p;
			else if (!h->sp2)
				h->sp2 = p;
		}
	} else if (!h->colon) {
		if (c == ':') {
			h->colon = p;
		} else if ((c <= ' ' || c >= 0x7f) && c != '\r' && c != '\n') {
			h->malformed = 1; /* not a token character in a field name */
			return 1;
		} else if (c == '\r' && p + 1 < h->len && head_at(h, p + 1) != '\n') {
			/* A bare CR in a name: lower() would fold it to '-', so
			 * "Content\rLength" would read as Content-Length. */
			h->malformed = 1;
			return 1;
		}
	}
	if (c != '\n')
		return 0;
	if (p == 0 || head_at(h, p - 1) != '\r') {
		h->malformed = 1; /* a bare LF: RFC 9112 allows it, this parser sends it to user space */
		return 1;
	}
	__u32 end = p - 1;
	if (!h->first_done) {
		h->first_done = 1;
		h->first_end = end;
	} else if (end == h->line_start) {
		h->head_len = p + 1;
		return 1;
	} else {
		__u32 n = h->n_lines;
		if (n >= MAX_LINES) {
			h->malformed = 1;
			return 1;
		}
		h->starts[n & (MAX_LINES - 1)] = h->line_start;
		h->colons[n & (MAX_LINES - 1)] = h->colon;
		h->ends[n & (MAX_LINES - 1)] = end;
		h->n_lines = n + 1;
	}
	h->line_start = p + 1;
	h->colon = 0;
	return 0;
}

#define WALK_STRIDE 16

/* WALK_STRIDE bytes per call: the call and the scratch lookup cost more
 * than a byte's work, so they are paid once per stride. */
static long walk_stride(__u64 i, struct walk_ctx *ctx)
{
	struct head *h = bpf_map_lookup_elem(&mesh_scratch, &ctx->which);

	if (!h)
		return 1;
#pragma unroll
	for (__u32 k = 0; k < WALK_STRIDE; k++)
		if (walk_byte(h, i * WALK_STRIDE + k))
			return 1;
	return 0;
}

/* Walks h->buf[0 .. h->len). */
static __always_inline void head_walk(struct head *h, __u32 which)
{
	struct walk_ctx ctx = { .which = which };

	bpf_loop((h->len + WALK_STRIDE - 1) / WALK_STRIDE, walk_stride, &ctx, 0);
}

/* The helpers below that loop are global functions: the verifier checks
 * each once on its own, instead of once for every path that reaches a call
 * (which, inside the header-line callbacks, exceeds its budget). */
#define HEAD_FN __attribute__((noinline))

/* Up to 8 bytes of buf from `at`, lower-cased, little-endian. */
HEAD_FN __u64 lower_word(const struct head *h, __u32 at, __u32 k)
{
	__u64 w = 0;

	if (!h)
		return 0;
	for (__u32 i = 0; i < 8; i++) {
		if (i >= k)
			break;
		w |= (__u64)(__u8)lower(head_at(h, at + i)) << (8 * i);
	}
	return w;
}

/* Eight characters as lower_word() reads them. Literals are spelt this way
 * because clang 14 emits string literals of several functions into one
 * .rodata whose BTF the kernel rejects. */
#define W(a, b, c, d, e, f, g, i)                                                                          \
	((__u64)(a) | (__u64)(b) << 8 | (__u64)(c) << 16 | (__u64)(d) << 24 | (__u64)(e) << 32 | (__u64)(f) << 40 | \
	 (__u64)(g) << 48 | (__u64)(i) << 56)

/* buf[at .. at + len) is the `n`-byte name spelt by w0, w1, w2, in any
 * letter case. */
static __always_inline int name_is(const struct head *h, __u32 at, __u32 len, __u32 n, __u64 w0, __u64 w1, __u64 w2)
{
	if (len != n)
		return 0;
	return lower_word(h, at, n) == w0 && (n <= 8 || lower_word(h, at + 8, n - 8) == w1) &&
	       (n <= 16 || lower_word(h, at + 16, n - 16) == w2);
}

#define IS_CONTENT_LENGTH(h, at, len) \
	name_is(h, at, len, 14, W('c', 'o', 'n', 't', 'e', 'n', 't', '-'), W('l', 'e', 'n', 'g', 't', 'h', 0, 0), 0)
#define IS_TRANSFER_ENCODING(h, at, len)                                                                      \
	name_is(h, at, len, 17, W('t', 'r', 'a', 'n', 's', 'f', 'e', 'r'), W('-', 'e', 'n', 'c', 'o', 'd', 'i', 'n'), \
		W('g', 0, 0, 0, 0, 0, 0, 0))
#define IS_CONNECTION(h, at, len) \
	name_is(h, at, len, 10, W('c', 'o', 'n', 'n', 'e', 'c', 't', 'i'), W('o', 'n', 0, 0, 0, 0, 0, 0), 0)
#define IS_UPGRADE(h, at, len) name_is(h, at, len, 7, W('u', 'p', 'g', 'r', 'a', 'd', 'e', 0), 0, 0)
#define IS_EXPECT(h, at, len) name_is(h, at, len, 6, W('e', 'x', 'p', 'e', 'c', 't', 0, 0), 0, 0)
#define IS_KEEP_ALIVE(h, at, len) \
	name_is(h, at, len, 10, W('k', 'e', 'e', 'p', '-', 'a', 'l', 'i'), W('v', 'e', 0, 0, 0, 0, 0, 0), 0)

/* A field value without its optional white space. */
HEAD_FN int trim(const struct head *h, __u32 *from, __u32 *to)
{
	if (!h || !from || !to)
		return 0;
	for (int i = 0; i < 16 && *from < *to; i++) {
		char c = head_at(h, *from);
		if (c != ' ' && c != '\t')
			break;
		(*from)++;
	}
	for (int i = 0; i < 16 && *to > *from; i++) {
		char c = head_at(h, *to - 1);
		if (c != ' ' && c != '\t')
			break;
		(*to)--;
	}
	return 0;
}

/* A decimal of at most 15 digits (Content-Length); -1 if not one. */
HEAD_FN __s64 decimal(const struct head *h, __u32 from, __u32 to)
{
	__s64 v = 0;

	if (!h || to <= from || to - from > 15)
		return -1;
	for (__u32 i = 0; i < 15; i++) {
		if (from + i >= to)
			break;
		char c = head_at(h, from + i);
		if (c < '0' || c > '9')
			return -1;
		v = v * 10 + (c - '0');
	}
	return v;
}

/* What both directions read from their header lines to frame a message. */
struct framing {
	__s64 content_length; /* -1: none */
	__u32 chunked; /* any Transfer-Encoding */
	__u32 upgrade; /* Upgrade or Expect */
	__u32 not_keep_alive; /* a Connection other than keep-alive */
	__u32 bad;
};

/* Header line n: its name and trimmed value, and the framing it sets.
 * Returns 1 (stop) if the line is malformed: no colon, an empty name, or
 * two Content-Lengths that differ. (White space before the colon, RFC 9112
 * §5.1, never gets here: the walk refuses it in a name.) */
static __always_inline int framing_line(const struct head *h, __u32 n, struct framing *f, __u32 *start, __u32 *nlen,
					__u32 *vfrom, __u32 *vto)
{
	n &= MAX_LINES - 1;
	__u32 colon = h->colons[n];

	*start = h->starts[n];
	if (colon <= *start) {
		f->bad = 1;
		return 1;
	}
	*nlen = colon - *start;
	*vfrom = colon + 1;
	*vto = h->ends[n];
	trim(h, vfrom, vto);
	if (IS_CONTENT_LENGTH(h, *start, *nlen)) {
		__s64 v = decimal(h, *vfrom, *vto);
		if (v < 0 || (f->content_length >= 0 && f->content_length != v)) {
			f->bad = 1;
			return 1;
		}
		f->content_length = v;
	} else if (IS_TRANSFER_ENCODING(h, *start, *nlen)) {
		f->chunked = 1;
	} else if (IS_UPGRADE(h, *start, *nlen) || IS_EXPECT(h, *start, *nlen)) {
		f->upgrade = 1;
	} else if (IS_CONNECTION(h, *start, *nlen)) {
		if (!IS_KEEP_ALIVE(h, *vfrom, *vto - *vfrom))
			f->not_keep_alive = 1;
	}
	return 0;
}

/* Header line i of the head in the response scratch buffer (a bpf_loop
 * callback of the response program and the test probe). */
static long response_line(__u64 i, struct framing *f)
{
	__u32 which = SCRATCH_RESPONSE;
	struct head *h = bpf_map_lookup_elem(&mesh_scratch, &which);
	__u32 start, nlen, vfrom, vto;

	if (!h)
		return 1;
	return framing_line(h, i, f, &start, &nlen, &vfrom, &vto);
}

#endif /* INBAND_MESH_HEAD_H */

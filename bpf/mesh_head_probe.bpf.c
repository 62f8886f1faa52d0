// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The mesh's HTTP head walk and framing (bpf/include/inband/mesh/head.h),
 * run on test input: sk_msg and sk_skb programs cannot be test-run
 * (BPF_PROG_TEST_RUN answers ENOTSUPP for them), so the parser's
 * byte-level fixtures (crates/inband/tests/mesh_head_fixtures.rs) run the
 * same code here, as a tc program, and read what it found from
 * mesh_head_result. The input is a 14-byte pad (test runs of tc programs
 * take an Ethernet frame) and then the message. Tests only.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/mesh/head.h"
#include "inband/mesh/types.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define PAD 14

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_mesh_head_result);
} mesh_head_result SEC(".maps");

SEC("tc")
int mesh_head_probe(struct __sk_buff *skb)
{
	struct framing f = { .content_length = -1 };
	__u32 zero = 0, len = skb->len > PAD ? skb->len - PAD : 0;
	struct inband_mesh_head_result *r = bpf_map_lookup_elem(&mesh_head_result, &zero);
	struct head *h;

	if (!r || !len)
		return 1;
	h = head_take(SCRATCH_RESPONSE);
	if (!h)
		return 1;
	__u32 n = len < INBAND_MESH_HEAD_MAX ? len : INBAND_MESH_HEAD_MAX - 1;
	h->len = n;
	/* n is 1..2047; spelt so the verifier sees it is not 0. */
	if (bpf_skb_load_bytes(skb, PAD, h->buf, ((n - 1) & HEAD_MASK) + 1)) {
		head_give(h);
		return 1;
	}
	head_walk(h, SCRATCH_RESPONSE);
	/* As both programs do: header lines only of a complete, sound head. */
	if (!h->malformed && h->head_len)
		bpf_loop(h->n_lines, response_line, &f, 0);
	r->head_len = h->head_len;
	r->sp1 = h->sp1;
	r->sp2 = h->sp2;
	r->first_end = h->first_end;
	r->n_lines = h->n_lines;
	r->malformed = h->malformed;
	r->content_length = f.content_length;
	r->chunked = f.chunked;
	r->upgrade = f.upgrade;
	r->not_keep_alive = f.not_keep_alive;
	r->bad = f.bad;
	head_give(h);
	return 0;
}

// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Passes every packet. Testbeds attach it to the bridge-side peer of the
 * balancer's veth: a veth delivers XDP_TX frames into its peer only when
 * the peer runs an XDP program (which sets up the peer's NAPI ring).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int veth_peer(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Routing QUIC by connection ID (inband/quic.h has the layout). Only a
 * short-header packet (after the handshake) is routed by its ID: the IDs
 * of long-header packets may be ones the client chose, which name no
 * server. A short-header packet that finds no flow (the client moved to a
 * new address or port, or its flow was evicted) goes to the backend its
 * ID names, if that backend still serves the VIP (active or draining);
 * anything else is balanced as a new flow, and the server answers an ID
 * it does not know with a stateless reset, as it would without us.
 */
#ifndef INBAND_LB_QUIC_H
#define INBAND_LB_QUIC_H

#include "inband/quic.h"
#include "inband/lb/parse.h"

struct sid_search {
	__u32 vid;
	__u32 count;
	__u32 sid;
	__u32 id;
	__u32 slot;
	__u32 found;
};

static long sid_step(__u32 slot, void *arg)
{
	struct sid_search *s = arg;

	if (slot >= s->count)
		return 1;
	__u32 vid = s->vid;
	const struct inband_vip_slots *slots = bpf_map_lookup_elem(&vip_backends, &vid);

	if (!slots)
		return 0;
	__u32 bid = slots->backend[slot & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
	struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (!be || be->quic_server_id != s->sid || !(be->flags & (INBAND_BACKEND_ACTIVE | INBAND_BACKEND_DRAINING)))
		return 0;
	s->id = bid;
	s->slot = slot;
	s->found = 1;
	return 1;
}

/*
 * The backend a short-header QUIC packet (UDP payload at p->hlen + 8)
 * names among VIP `vid`'s slots: 1 and its id and slot; 0 if it names
 * none; -1 if the packet is not a short header with one of our IDs.
 */
static __always_inline int quic_backend(struct xdp_md *ctx, const struct pkt *p, const struct inband_vip *vc, __u32 vid,
					__u32 *id, __u32 *slot)
{
	__u8 h[1 + INBAND_QUIC_CID_LEN];

	if (p->hlen + UDP_HDR + sizeof(h) > p->tot_len ||
	    bpf_xdp_load_bytes(ctx, ETH_HLEN + p->hlen + UDP_HDR, h, sizeof(h)))
		return -1;
	/* Short header (RFC 9000 17.3): form bit 0, fixed bit 1. */
	if ((h[0] & 0xc0) != 0x40 || h[1] != INBAND_QUIC_CID_FIRST)
		return -1;
	struct sid_search s = { .vid = vid, .count = vc->backend_count, .sid = (__u32)h[2] << 8 | h[3] };

	if (!s.sid || s.count > INBAND_MAX_BACKENDS_PER_VIP)
		return 0;
	bpf_loop(INBAND_MAX_BACKENDS_PER_VIP, sid_step, &s, 0);
	if (!s.found)
		return 0;
	*id = s.id;
	*slot = s.slot;
	return 1;
}

#endif /* INBAND_LB_QUIC_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Announced choices: how a survivor carries a crashed instance's fleet
 * connections when their backend cannot be computed from the client side
 * (every policy but Maglev). The instance that opens such a connection
 * puts its client side and backend in `choice_ring` (announce_choice);
 * its lb daemon sends them to the peers ([scale_out] peers,
 * crates/inband-lb/src/peers.rs), whose daemons write them into
 * `peer_choices`; a stray of that connection at a peer's direct SID is
 * adopted to the backend named there (announced_backend, from adopt()).
 * XDP cannot send a packet of its own, hence the daemon.
 */
#ifndef INBAND_LB_PEER_CHOICES_H
#define INBAND_LB_PEER_CHOICES_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "inband/lb/common.h"

/* The new connection `fk` went to `f`'s backend: for the peers. A full
 * ring (no daemon draining it) costs only the announcement. */
static __always_inline void announce_choice(const struct inband_flow_key *fk, const struct inband_flow *f, __u64 now)
{
	struct inband_choice_rec *r = bpf_ringbuf_reserve(&choice_ring, sizeof(*r), 0);

	if (!r) {
		event(INBAND_EV_CHOICE_UNANNOUNCED);
		return;
	}
	r->key = *fk;
	r->backend_addr = f->backend_addr;
	r->backend_port = f->backend_port;
	r->pad = 0;
	r->pad1 = 0;
	r->opened_ns = now;
	bpf_ringbuf_submit(r, 0);
}

/* The walk of a VIP's slots for the backend a peer named. */
struct choice_find {
	struct inband_addr addr;
	__be16 port;
	__u16 pad;
	__u32 vid;
	__u32 id;
	__u32 found;
};

static long choice_step(__u32 slot, void *arg)
{
	struct choice_find *c = arg;
	__u32 vid = c->vid;
	const struct inband_vip_slots *slots = bpf_map_lookup_elem(&vip_backends, &vid);

	if (!slots)
		return 1;
	__u32 bid = slots->backend[slot & (INBAND_MAX_BACKENDS_PER_VIP - 1)];
	const struct inband_backend *be = bpf_map_lookup_elem(&backends, &bid);

	if (!be || be->port != c->port || !inband_addr_eq(&be->addr, &c->addr))
		return 0;
	c->id = bid;
	c->found = 1;
	return 1;
}

/*
 * The backend a peer announced for client side `fk` of VIP `vid` (its id
 * in `id_out`), if one of the VIP's slots still holds it; else NULL,
 * counted (`adopt_no_choice`). Whatever that backend's state: the
 * connection lives there whatever this instance's view of it. A walk of
 * the VIP's slots (bpf_loop, up to INBAND_MAX_BACKENDS_PER_VIP), which
 * only an adoption pays, and adoptions are rate-limited.
 */
static __always_inline const struct inband_backend *announced_backend(__u32 vid, const struct inband_vip *vc,
								      const struct inband_flow_key *fk, __u32 *id_out)
{
	const struct inband_peer_choice *pc = bpf_map_lookup_elem(&peer_choices, fk);
	struct choice_find c = { .vid = vid };
	__u32 count = vc->backend_count;

	if (!pc) {
		event(INBAND_EV_ADOPT_NO_CHOICE);
		return NULL;
	}
	c.addr = pc->backend_addr;
	c.port = pc->backend_port;
	if (count > INBAND_MAX_BACKENDS_PER_VIP)
		count = INBAND_MAX_BACKENDS_PER_VIP;
	bpf_loop(count, choice_step, &c, 0);
	if (!c.found) {
		event(INBAND_EV_ADOPT_NO_CHOICE);
		return NULL;
	}
	*id_out = c.id;
	return bpf_map_lookup_elem(&backends, &c.id);
}

#endif /* INBAND_LB_PEER_CHOICES_H */

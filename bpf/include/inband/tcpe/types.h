/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map values of bpf/tcpe.bpf.c: what user space writes to a socket
 * (opt-in, a queued path notification), what the program keeps per socket
 * (the handshake's outcome, the last notification accepted), the secret.
 * The maps are in maps.h, the counters and limits in consts.h. The Rust
 * types are generated from these headers (crates/inband-tcpe/build.rs).
 */
#ifndef INBAND_TCPE_TYPES_H
#define INBAND_TCPE_TYPES_H

#include <linux/types.h>

#include "inband/tcpe/consts.h"
#include "inband/tcpe/wire.h"

/* A path as a notification names it. family 0: none. */
struct inband_tcpe_path {
	__u8 addr[16]; /* network order; IPv4 in the first 4 bytes */
	__be16 port;
	__u8 family; /* 4 or 6 */
	__u8 flags; /* the wire's flags byte */
	__u8 serial;
	__u8 pad[3];
};

/*
 * tcpe_ctl (socket storage), written by user space only:
 * - before connect(): `enable`, `conn_id` and `key` make the SYN offer TCPE;
 * - before listen(): `enable` makes the listener answer offers;
 * - on a connection: `out` is the notification its pure ACKs carry, until
 *   user space replaces or clears it (a new notification takes a new
 *   serial; the peer applies each serial once).
 */
struct inband_tcpe_ctl {
	__u32 enable;
	__u32 conn_id; /* host order */
	__u64 key; /* this side's key half */
	struct inband_tcpe_path out;
};

/* A listener's key in tcpe_listeners: its port and bound address. */
struct inband_tcpe_listener {
	__u8 addr[16]; /* IPv6, IPv4 as ::ffff:a.b.c.d; all zero: bound to no address */
	__u32 port; /* host order */
};
_Static_assert(sizeof(struct inband_tcpe_listener) == 20, "no padding: user space builds the key");

enum inband_tcpe_state {
	INBAND_TCPE_STATE_OFFERED = 1, /* active: the SYN carried the offer */
	INBAND_TCPE_STATE_UNCONFIRMED = 2, /* passive: answered, the client's confirmation not seen yet */
	INBAND_TCPE_STATE_CAPABLE = 3, /* both ends know the other speaks TCPE */
	INBAND_TCPE_STATE_FALLBACK = 4, /* plain TCP for the rest of its life (`reason`) */
};

/* tcpe_sock (socket storage), written by the program only. */
struct inband_tcpe_sock {
	__u32 state; /* enum inband_tcpe_state */
	__u32 role; /* enum inband_tcpe_role */
	__u32 conn_id; /* host order */
	__u32 reason; /* enum inband_tcpe_counter that made it FALLBACK */
	__u64 key_active; /* MAC key k0 */
	__u64 key_passive; /* MAC key k1 */
	struct inband_tcpe_path in; /* the last notification accepted from the peer */
	__u32 in_accepted; /* notifications accepted (new serials) */
	__u32 in_repeats; /* copies of the last one seen again */
	__u32 bad_mac; /* notifications refused for their MAC */
	__u32 out_written; /* pure ACKs this side wrote a notification on */
	__u8 out_serial; /* serial of the last notification written */
	__u8 confirm_pending; /* active: the next pure ACK carries the connection ID */
	__u8 reserved_len; /* bytes reserved for the segment being built */
	__u8 pad[5];
};

/* tcpe_config[0], written by the loader. */
struct inband_tcpe_config {
	__u64 secret_k0; /* the passive key halves' secret */
	__u64 secret_k1;
};

#endif /* INBAND_TCPE_TYPES_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Limits and counter indexes of bpf/tcpe.bpf.c (the Rust names of the
 * counters are in crates/inband-tcpe/src/sockops.rs, in this order).
 */
#ifndef INBAND_TCPE_CONSTS_H
#define INBAND_TCPE_CONSTS_H

/* After this many notifications with a bad MAC a connection stops taking
 * notifications (FALLBACK): a blind forger gets this many 2^-32 tries. */
#define INBAND_TCPE_MAX_BAD_MAC 4

/* Serials ahead of the last accepted by at most this much are new; the
 * rest (behind, or too far ahead) are stale replays. */
#define INBAND_TCPE_SERIAL_WINDOW 127

/* Listeners one program answers for (tcpe_listeners): a proxy has one or
 * two; a full table leaves the next listener plain TCP, counted. */
#define INBAND_TCPE_MAX_LISTENERS 64

/* tcpe_stats (per-CPU array) indexes. */
enum inband_tcpe_counter {
	INBAND_TCPE_SYN_OFFERED = 0, /* active SYNs that carried the offer */
	INBAND_TCPE_SYN_ANSWERED, /* SYN-ACKs that carried the answer */
	INBAND_TCPE_ACTIVE_CAPABLE, /* active connections with TCPE */
	INBAND_TCPE_PASSIVE_CAPABLE, /* passive connections whose client confirmed */
	INBAND_TCPE_PASSIVE_NOT_OFFERED, /* accepted connections from clients without TCPE */
	INBAND_TCPE_FALLBACK_NO_SPACE, /* a SYN or SYN-ACK without room for the options */
	INBAND_TCPE_FALLBACK_NOT_ANSWERED, /* SYN-ACK without the answer, or another connection ID */
	INBAND_TCPE_FALLBACK_SYN_COOKIE, /* listener in SYN-cookie mode: not answered */
	INBAND_TCPE_FALLBACK_NO_SYN, /* accepted, but the SYN was not saved */
	INBAND_TCPE_FALLBACK_NO_MEMORY, /* socket storage could not be made */
	INBAND_TCPE_FALLBACK_BAD_MAC_LIMIT, /* INBAND_TCPE_MAX_BAD_MAC reached */
	INBAND_TCPE_FALLBACK_LISTENERS_FULL, /* a listener left plain: tcpe_listeners full */
	INBAND_TCPE_CONFIRM_WRITTEN, /* active: connection ID on the 3rd ACK */
	INBAND_TCPE_PATH_WRITTEN, /* pure ACKs that carried a notification */
	INBAND_TCPE_PATH_NO_SPACE, /* pure ACKs without room (SACK blocks): the next one carries it */
	INBAND_TCPE_PATH_BAD_QUEUED, /* user space queued a path of no family or with reserved flags */
	INBAND_TCPE_PATH_ACCEPTED, /* notifications verified and exposed */
	INBAND_TCPE_PATH_REPEAT, /* copies of the last accepted notification */
	INBAND_TCPE_PATH_STALE, /* serial behind the last accepted: a replay */
	INBAND_TCPE_PATH_BAD_MAC, /* MAC does not verify: forged or corrupted */
	INBAND_TCPE_PATH_MALFORMED, /* wrong length for its ExID, reserved flags set */
	INBAND_TCPE_PATH_UNAUTHENTICATED, /* the seed's 12-byte option, without MAC */
	INBAND_TCPE_PATH_NOT_CAPABLE, /* on a connection not (yet) CAPABLE: a listener awaiting the confirmation */
	INBAND_TCPE_PATH_ON_DATA, /* on a segment carrying data or flags other than ACK */
	INBAND_TCPE_PATH_EVENT_LOST, /* accepted, its wake-up not queued: tcpe_paths full */
	INBAND_TCPE_COUNTERS,
};

#endif /* INBAND_TCPE_CONSTS_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the balancer program (bpf/balancer.bpf.c), with
 * the flag bits of their fields. The control plane's Rust types are
 * generated from this header and consts.h at build time
 * (crates/inband/build.rs, bindgen), so this is the only definition; the
 * maps themselves are defined in maps.h.
 *
 * Addresses and ports are kept in network order (as in the packet) so the
 * data path never byte-swaps; counters, ids and times are host order. Every
 * address is a `struct inband_addr`, so one table holds IPv4 and IPv6
 * flows alike.
 * Which map holds what, and who creates and deletes each entry: the "Maps"
 * and "Flow lifecycle" sections of docs/architecture.md.
 */
#ifndef INBAND_LB_TYPES_H
#define INBAND_LB_TYPES_H

#include <linux/types.h>

#include "inband/addr.h"
#include "inband/lb/consts.h"

struct inband_vip_key {
	struct inband_addr addr;
	__be16 port;
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;
};

/* vips[key] = VIP id; the rest of the VIP lives in vip_conf[id], which the
 * established path reads by the id a flow carries (an array, no hashing). */

#define INBAND_VIP_ACTIVE 1 /* takes new connections */
#define INBAND_VIP_DRAINING 2 /* removed: keeps its flows, refuses new connections */
#define INBAND_VIP_QUIC 4 /* UDP VIP carrying QUIC: short headers route by connection ID */
/* Its active backends do not all have the same weight: round-robin walks
 * its Maglev table, which holds each backend in proportion to its weight
 * (select.h). Without it round-robin takes the slots in turn. */
#define INBAND_VIP_WEIGHTED 8
/* Health (crates/inband/src/lb/health.rs): a client packet of a flow whose
 * backend is DOWN is answered with a RST and the flow ended (lb.toml
 * `on_down = "reset"`); without it such flows go on. */
#define INBAND_VIP_RESET_DOWN 16
/* A TCP SYN that finds no backend to take it is answered with a RST
 * (`all_down = "refuse"`, and with every backend down the control plane
 * marks them so); without it the SYN is dropped (`no_backend`). */
#define INBAND_VIP_REFUSE_EMPTY 32
/* New TCP connections get the fleet tuple (lb.toml `[scale_out] fleet`):
 * set by the control plane on TCP VIPs in a DSR mode when fleet is on. */
#define INBAND_VIP_FLEET 64
/* A fleet VIP whose policy is not Maglev (set by the control plane with
 * INBAND_VIP_FLEET): each new connection's backend is put in choice_ring
 * for the lb daemon to announce to the peers (peer_choices.h). */
#define INBAND_VIP_ANNOUNCE 128
/* dsr-dynamic (lb.toml `query_when_stale`): a SYN that finds every active
 * backend's score older than score_max_age (the VIP was idle, or has never
 * been scored) is held for a query first, as dsr-query holds every SYN
 * (query.h): in-band scores come with traffic, and after a pause the
 * balancer knows nothing current to place the first connections by. */
#define INBAND_VIP_QUERY_STALE 256

struct inband_vip {
	struct inband_addr addr;
	__be16 port;
	__u16 backend_count; /* slots [0, backend_count) of vip_backends[id] are valid */
	__u8 mode; /* enum inband_mode */
	__u8 policy; /* enum inband_policy */
	__u16 flags; /* INBAND_VIP_* */
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP, as in its key */
	__u8 pad;
	/* Entries [0, eligible_count) of vip_eligible: its slots that may take
	 * a new connection (ACTIVE, not DOWN), kept by the control plane. */
	__u16 eligible_count;
	/* dsr-dynamic: a backend is asked (124) every n-th packet, n between
	 * these two (equal: a fixed n; 0: never); n adapts per backend to how
	 * fast its score changes (score.h). */
	__u32 probe_interval;
	__u32 probe_interval_max;
	/* At most this many 124s a second per backend, whatever n says; 0 = no bound. */
	__u32 probe_budget;
	/* Its Maglev table's index in `maglev`, when it reads one (Maglev,
	 * INBAND_VIP_WEIGHTED round-robin or sampling; select.h). */
	__u32 maglev_table;
	__u32 pad1;
	__u64 score_max_age_ns; /* older scores are stale: they decay (see select.h) */
	__u64 syn_timeout_ns; /* half-open flows (UDP: until the client's second packet) */
	__u64 idle_timeout_ns; /* established flows without a packet */
	__u64 closing_timeout_ns; /* after a FIN or RST */
	__u64 drain_deadline_ns; /* DRAINING: flows still here then are ended; 0 = wait for them */
};

#define INBAND_BACKEND_ACTIVE 1 /* may receive new connections */
#define INBAND_BACKEND_DRAINING 2 /* keeps its flows, gets no new ones */
/* flags 0 = removed: keeps its flows until they end or drain_deadline_ns */
/* Options do not survive the path to it (found by the lb daemon): no option
 * is sent to it, and the daemon polls it for scores instead. */
#define INBAND_BACKEND_OPTIONS_LOST 4
/* Packets with an inband option travel to it wrapped in IP-in-IP (ipip.h):
 * its path strips or drops IPv4 options. Set by the control plane. */
#define INBAND_BACKEND_ENCAP 8
/* Its health checks fail (or the data path saw it refuse handshakes): no
 * new connections in any policy, whatever its configured state. Written
 * only by the lb daemon's health checker; ACTIVE/DRAINING stay the
 * configuration's. */
#define INBAND_BACKEND_DOWN 16

/* backends[id]. The balancer forwards on the one interface it is attached
 * to (XDP_TX); `mac` is the backend's (or its gateway's) L2 address,
 * resolved by the lb daemon from the kernel's neighbour table, so the hot
 * path needs no route lookup and fixtures need no routes. An id is not
 * reused while flows name it. All-zero mac = not resolved yet: drop
 * `no_route`. */
struct inband_backend {
	struct inband_addr addr;
	__be16 port;
	__u8 mac[6];
	__u16 flags;
	/* QUIC VIPs: the server id this backend writes into its connection
	 * IDs (quic.h); 0 = none. */
	__u16 quic_server_id;
	/* Relative capacity (lb.toml `weight`, at most 65535): every policy
	 * gives it new connections in proportion (select.h). 0 counts as 1,
	 * so an entry written without a weight is balanced as before
	 * weights; the control plane never writes 0 for an ACTIVE backend (a
	 * weight-0 backend is written DRAINING). */
	__u32 weight;
	__u64 drain_deadline_ns; /* removed or draining: flows still here then are ended; 0 = wait */
};

/* vip_backends[vip id].backend[slot] = backend id. One value per VIP, u16
 * ids: 8 KiB a VIP where a u32 array entry per slot took 32 KiB (the kernel
 * rounds array values to 8 bytes), and a VIP's slots are written in one
 * update. */
struct inband_vip_slots {
	__u16 backend[INBAND_MAX_BACKENDS_PER_VIP];
};

/* vip_eligible[vip id]: entries [0, eligible_count) are its slots that may
 * take a new connection, the dense set a large VIP picks from (select.h).
 * One value per VIP, as vip_backends. */
struct inband_vip_eligible {
	__u16 slot[INBAND_MAX_BACKENDS_PER_VIP];
};

/* probe_due[backend id] bits. */
#define INBAND_PROBE_DUE 1 /* its next packet asks for a score (report older than max age / 2) */
#define INBAND_EXPLORE 2 /* its report is stale: one new connection may go to it regardless */

/*
 * The load estimate of a backend is built from its last report and what
 * the balancer saw since (select.h): `opened` and `closed` are updated by
 * the data path with atomic adds; a report (125, or a poll) rewrites
 * score, opened, closed and updated_ns. The rest is the in-band probe's
 * state (score.h) and when the backend was last picked (select.h), which
 * only the data path writes.
 */
struct inband_backend_score {
	__u32 score; /* last reported score */
	__u32 opened; /* connections given to this backend since the report */
	__u32 closed; /* of its connections, those that ended (FIN/RST) since the report */
	__u32 interval; /* dsr-dynamic: packets between 124s now (adaptive); 0 = not set yet */
	__u64 updated_ns; /* bpf_ktime_get_ns() of the report; 0 = never */
	__u64 budget_ns; /* probe budget: the time until which its 124s are spent */
	__u32 unanswered; /* 124s sent since the last 125 taken: the lb daemon's sign of lost options */
	__u32 changes; /* 125s that moved the score beyond the tolerance (adaptive n shrank) */
	__u64 picked_ns; /* bpf_ktime_get_ns() when it was last given a new connection (select.h: ties) */
};

struct inband_lb_config {
	/* Balancer addresses, the source of packets to backends: IPv4
	 * (mapped) and IPv6; all zero = that family is not served. */
	struct inband_addr self4;
	struct inband_addr self6;
	__u16 mtu; /* L3 MTU of the interface: no option is added beyond it */
	__u8 auth_mode; /* enum inband_auth_mode (wire.h) */
	__u8 sign_key; /* auth_keys id the balancer signs 155 and 124 with */
	__u32 maglev_size; /* entries of each VIP's Maglev table (a prime; see above) */
	__u64 snat_key[2]; /* SipHash key of the SNAT port candidates, random per balancer */
	/* Scale-out behind an ECMP router (seed 002 one tier up; all zero =
	 * off): the router reaches this instance in SRv6 at `cond_sid`; a TCP
	 * packet that arrives so and belongs to no connection here is sent
	 * back to the router's `shadow_sid` (its previous next-hop set), or to
	 * the later generation's SID the router's SRH names
	 * (shadow_generations.h); the oldest generation delivers it at the
	 * owner's `direct_sid`, where it is not chained again. */
	struct inband_addr cond_sid;
	struct inband_addr direct_sid;
	struct inband_addr shadow_sid;
	/* More source addresses toward backends (lb.toml `snat_prefix`,
	 * `snat_prefix6`): a pool of `snat_pool*_n` consecutive addresses from
	 * `snat_pool*`, each with its own SNAT ports, so that one backend can
	 * hold more live connections from this balancer than one address has
	 * ports. A flow's `snat_index` names its address: 0 = self4/self6,
	 * i = the pool's (i-1)-th. 0 = no pool. */
	struct inband_addr snat_pool4;
	struct inband_addr snat_pool6;
	__u8 snat_pool4_n;
	__u8 snat_pool6_n;
	__u8 pad_pool[6];
	/* Fleet tuples ([scale_out] fleet; all zero = off): every instance of
	 * the fleet sends a connection of a INBAND_VIP_FLEET VIP to its backend
	 * from the same server-side tuple, fleet_prefix (a /96) plus a 32-bit
	 * suffix and a port, both from a SipHash of the client side under
	 * fleet_key, which every instance shares (nat.h). */
	struct inband_addr fleet_prefix;
	__u64 fleet_key[2];
	/* Strays of fleet flows taken over a second, per CPU (handshake.h
	 * adopt()); 0 = none. */
	__u32 adopt_per_s;
	/* The IPv6 flow label (20 bits, host order; 0 = fleet off) that names
	 * this instance on the packets of fleet flows that carry a 155 or a
	 * 124: the agent sends what it answers for such a flow (125s, RSTs)
	 * to the balancer address the label names, wrapped, since the fleet
	 * address reaches no instance (inband-core wire.rs fleet_label). */
	__u32 fleet_label;
};

/* The client side of a connection: key of `flows` and `half_open`. */
struct inband_flow_key {
	struct inband_addr client_addr;
	struct inband_addr vip_addr;
	__be16 client_port;
	__be16 vip_port;
	__u8 proto;
	__u8 pad[3];
};

enum inband_flow_state {
	INBAND_FLOW_SYN_SENT = 1, /* SYN forwarded, handshake not complete: in half_open */
	INBAND_FLOW_ESTABLISHED = 2, /* the client's first non-SYN packet came: in flows */
	INBAND_FLOW_CLOSING = 3, /* a FIN or RST was seen: short timeout, port preemptible */
};

#define INBAND_FLOW_PROBE_OUTSTANDING 1 /* a 124 was sent; its 125 has not come */
#define INBAND_FLOW_PROBE_OLD 2 /* ... and a sweep has passed since: the next one gives up on it */
/* Taken over at the end of a chain (fleet tuples, handshake.h adopt()):
 * another instance opened it and counted it in its load estimate. */
#define INBAND_FLOW_ADOPTED 4
/* Its opening is in its backend's `opened` although its mode has no
 * scores (least-connections): its end goes into `closed`. */
#define INBAND_FLOW_COUNTED 8

/*
 * Established flows are aged without a clock read per packet: a packet sets
 * `seen`; each sweep turns a set `seen` into `last_seen_ns` = the sweep's
 * time and clears it, and ends flows whose `last_seen_ns` is older than
 * their timeout (lifecycle.h). Half-open flows are stamped directly.
 */
struct inband_flow {
	struct inband_addr backend_addr;
	__be16 backend_port;
	__be16 snat_port;
	__u16 backend_id;
	__u16 vip_id;
#ifdef INBAND_LAYOUT_TEST
	/* Only in the build the upgrade test loads (crates/inband/build.rs):
	 * a field inserted mid-struct moves every field after it, as a
	 * release's layout change would, and the running flows must survive
	 * the switch (crates/inband/tests/upgrade.rs). */
	__u32 layout_test;
#endif
	__u32 state; /* enum inband_flow_state; transitions by compare-and-swap */
	__u8 client_mac[6]; /* L2 source the client's packets came from: return next hop */
	__u8 flags; /* INBAND_FLOW_* */
	__u8 probe_key; /* key id the outstanding 124 was signed with */
	/* TCP: the SYN's sequence number (a SYN with the same one is a
	 * retransmission). UDP: the 155's nonce, the time of the first packet. */
	__be32 syn_seq;
	__be32 probe_nonce; /* nonce of the outstanding 124 */
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 mode; /* the VIP's mode when the flow started */
	__u8 snat_index; /* which of the balancer's source addresses (lb_config) */
	__u8 pad0[1];
	__u64 last_seen_ns; /* CLOCK_MONOTONIC: last sweep that found it seen, or the handshake's time */
	__u8 seen; /* a packet came since the last sweep (own byte: written without atomics) */
	__u8 client_done; /* TCP: the client sent its FIN or RST, in its window (own byte, as `seen`) */
	__u8 pad[2];
	/* TCP: where the client's sequence space is, the bound a FIN or RST
	 * must fall near to count (lifecycle.h, seq_in_window): the SYN's number,
	 * then recorded again each time the client's segments have moved past
	 * it by more than a step; once client_done, its FIN's or RST's. */
	__be32 client_seq;
	/* snat_index INBAND_SNAT_FLEET: the last 32 bits of the source address
	 * under lb_config's fleet_prefix (as in the packet); 0 otherwise. */
	__be32 fleet_suffix;
};

/* The server side of a connection: key of `snat` and `half_open_ports`. */
struct inband_nat_key {
	struct inband_addr backend_addr;
	__be16 backend_port;
	__be16 snat_port;
	__u8 proto;
	__u8 snat_index; /* the balancer's source address (lb_config) */
#ifdef INBAND_LAYOUT_TEST
	/* The upgrade test's build: a key field taking padding, as snat_index
	 * did (crates/inband/tests/e2e.rs, an_upgrade_...). */
	__u8 layout_test_key;
	__u8 pad[1];
#else
	__u8 pad[2];
#endif
	__be32 fleet_suffix; /* as the flow's: a fleet tuple's address */
};

/* snat[server side] = the client side of the flow that owns the port. Only
 * an entry whose owner is live in `flows` with this very port reserves it. */
struct inband_snat_owner {
	struct inband_flow_key flow;
};

/* half_open_ports[server side] = the handshake holding the port, and when
 * it last sent a SYN: a port search ranks holds by age without looking up
 * their handshakes. Only a hold whose owner is live in `half_open` with
 * this very port holds it. */
struct inband_port_hold {
	struct inband_flow_key flow;
	__u64 since_ns; /* CLOCK_MONOTONIC: the owner's last SYN */
};

struct inband_backend_stats {
	__u64 packets; /* client -> backend */
	__u64 bytes;
	__u64 return_packets; /* backend -> client through the balancer */
	__u64 return_bytes;
	__u64 new_conns;
	__u64 probes_sent;
	__u64 scores_received;
	__u64 closed_conns; /* FIN/RST seen */
	__u64 syn_retries; /* retransmitted SYNs of handshakes whose SYN carried a 155 */
	/* Passive health (lb daemon, health.rs): how its handshakes ended. */
	__u64 handshakes_completed; /* the client's first non-SYN segment came */
	__u64 handshakes_refused; /* the backend answered the SYN with a RST */
	__u64 handshakes_retried; /* a SYN sent again: its first went unanswered */
	__u64 flows_reset; /* client packets of its flows answered with a RST while it was DOWN (on_down = reset) */
};

struct inband_vip_stats {
	__u64 packets;
	__u64 bytes;
	__u64 return_packets;
	__u64 return_bytes;
	__u64 new_conns;
	__u64 closed_conns;
};

/* Written by the sweeper program at each pass (lifecycle.h), read by
 * `inband status` and the metrics endpoint: no table walk on a scrape. */
struct inband_flow_gauges {
	__u64 established; /* live ESTABLISHED flows */
	__u64 closing; /* live CLOSING flows */
};

/* Written by the sweeper at the end of a pass. */
struct inband_sweep_stats {
	__u64 passes;
	__u64 last_ns; /* bpf_ktime_get_ns() at the end of the last pass */
	__u64 last_duration_ns;
	__u64 half_open; /* half-open flows at the last pass */
	__u64 snat_entries; /* SNAT reservations at the last pass */
};

/* Why a backend's health is what it is (backend_health.reason); names in
 * crates/inband/src/lb/maps.rs. */
enum inband_health_reason {
	INBAND_HEALTH_UNCHECKED = 0, /* no check has finished yet: taken as up */
	INBAND_HEALTH_PASSING = 1,
	INBAND_HEALTH_REFUSED = 2, /* connection refused (RST to the check's SYN) */
	INBAND_HEALTH_TIMEOUT = 3, /* no connection or no answer within timeout_ms */
	INBAND_HEALTH_UNREACHABLE = 4, /* no route or no neighbour (EHOSTUNREACH, ENETUNREACH) */
	INBAND_HEALTH_BAD_STATUS = 5, /* HTTP: a status outside `expect` (last_status) */
	INBAND_HEALTH_MALFORMED = 6, /* HTTP: what came back is not an HTTP response */
	INBAND_HEALTH_CLOSED = 7, /* HTTP: the connection closed before a status line */
	INBAND_HEALTH_ERROR = 8, /* any other socket error */
	INBAND_HEALTH_PASSIVE_REFUSED = 9, /* the data path saw it refuse handshakes (RST to SYNs) */
	INBAND_HEALTH_PASSIVE_UNANSWERED = 10, /* the data path saw its SYNs go unanswered */
	INBAND_HEALTH_NOT_CHECKED = 11, /* checks off for its VIP (`health.check = "none"`) */
	INBAND_HEALTH_BUSY = 12, /* checks time out while clients' handshakes with it complete */
	INBAND_HEALTH_REASON_MAX = 13,
};

#define INBAND_HEALTH_UP 1
#define INBAND_HEALTH_DOWN 2

/* backend_health[backend id]: the lb daemon's health checker writes it
 * (the data path reads only INBAND_BACKEND_DOWN in `backends`), `inband
 * status` and the metrics read it; pinned, so a restarted daemon carries
 * the state on. */
struct inband_backend_health {
	__u8 state; /* INBAND_HEALTH_UP or _DOWN; 0 = never checked (taken as up) */
	__u8 reason; /* enum inband_health_reason of the last verdict */
	__u16 last_status; /* HTTP checks: the last status code seen, 0 = none */
	__u32 in_a_row; /* checks in a row agreeing with `reason` (rise/fall count) */
	__u64 since_ms; /* CLOCK_REALTIME (ms) of the last change of state */
	__u64 checks_passed;
	__u64 checks_failed;
	__u64 transitions; /* changes of state (up <-> down) */
	__u64 passive_ejections; /* downs caused by what the data path saw */
	__u64 last_check_ms; /* CLOCK_REALTIME (ms) of the last finished check */
};

/* Sampled capture of dropped packets (lb/capture.h, `inband lb capture`). */
#define INBAND_CAPTURE_SNAPLEN 256 /* a power of two (capture.h) */

/* capture_conf[0]: written by `inband lb capture`; zero = off. */
struct inband_capture_conf {
	__u64 until_ns; /* CLOCK_MONOTONIC: no capture from then on (a lease the command renews) */
	__u32 per_second; /* records a second per CPU at most */
	__u32 pad;
};

/* capture_state[0], per CPU: the reason of the drop in progress, the rate
 * window, and what the bounds cost. */
struct inband_capture_state {
	__u64 window_ns; /* start of the current one-second window */
	__u32 used; /* records in it */
	__u32 reason; /* enum inband_drop of the last drop on this CPU */
	__u64 captured;
	__u64 limited; /* drops not captured: over per_second */
	__u64 lost; /* drops not captured: the ring was full (nobody reading fast enough) */
};

/* One record of capture_ring: the frame's first bytes as the program held
 * it when it dropped it. */
struct inband_capture_rec {
	__u64 ts_ns; /* bpf_ktime_get_ns() */
	__u32 reason; /* enum inband_drop */
	__u32 len; /* the frame's length */
	__u32 caplen; /* bytes of it in data */
	__u32 ifindex;
	__u8 data[INBAND_CAPTURE_SNAPLEN];
};

/* Written by the lb daemon (out-of-band work), read by `inband status`. */
struct inband_control_stats {
	__u64 polls_sent;
	__u64 poll_replies;
	__u64 poll_bytes; /* request + reply bytes on the wire, UDP payload + headers */
	__u64 poll_failures;
	__u64 poll_unauthenticated; /* replies with a bad MAC, an unknown key or the other [auth] format */
	__u64 queries; /* dsr-query: SYNs the daemon asked the backends for */
	__u64 query_timeouts; /* ... of which some backend did not answer in time */
	__u64 query_ns; /* total time SYNs were held for their query */
	__u64 options_lost; /* times a backend was found losing inband options (then polled) */
	__u64 options_retried; /* times such a backend was given options again to see if its path healed */
	/* Announced choices ([scale_out] peers; crates/inband-lb/src/peers.rs). */
	__u64 peer_datagrams_sent;
	__u64 peer_records_sent;
	__u64 peer_send_failures;
	__u64 peer_records_learned; /* written into peer_choices */
	__u64 peer_unknown_sender; /* datagrams refused: from no address of `peers` */
	__u64 peer_malformed; /* ... not the format (length, magic, count, a record's fields) */
	__u64 peer_bad_mac; /* ... MAC not the fleet key's */
	__u64 peer_replayed; /* ... sequence number not newer than the sender's last */
	/* Flow moves ([moves]; crates/inband-lb/src/moves.rs). */
	__u64 moves; /* flows sent to another backend of their VIP on request */
	__u64 move_malformed; /* requests dropped unanswered: not the format, or a signed field no sender writes */
	__u64 move_bad_mac; /* ... no key of that id, or a MAC that does not verify */
	__u64 move_unknown_sender; /* ... from another address than the `from` it names */
	__u64 move_replayed; /* refused: sequence number not above the sender's last */
	__u64 move_no_flow; /* refused: no established flow of that client side */
	__u64 move_not_owner; /* refused: the flow does not go to `from` */
	__u64 move_not_a_backend; /* refused: `to` is not an up backend of the flow's VIP */
	__u64 move_port_in_use; /* refused: another flow holds the SNAT port toward `to` */
	__u64 move_refused; /* refused otherwise: a fleet flow, or a new sender with the senders' table full */
};

/* dsr-query: a SYN the data path hands to the lb daemon (ring buffer
 * `query_ring`), which asks the VIP's backends for their scores, writes
 * them, marks the flow in `query_done` and runs the SYN through the
 * program again. */
#define INBAND_QUERY_FRAME_MAX 256
struct inband_query_req {
	struct inband_flow_key key; /* the connection, as query_done takes it */
	__u32 vip_id;
	__u32 len; /* bytes of `frame` used */
	__u64 held_ns; /* bpf_ktime_get_ns() when the SYN was held */
	__u8 frame[INBAND_QUERY_FRAME_MAX];
};

/* What the lb daemon passes to a run of `move_counts` (lb/moves.h,
 * BPF_PROG_RUN's ctx_in): a moved flow's backend ids before and after, and
 * its mode and flags as read. */
struct inband_move_counts_args {
	__u16 from_id;
	__u16 to_id;
	__u8 mode;
	__u8 flags;
	__u8 pad[2];
};

/* A new connection of an INBAND_VIP_ANNOUNCE VIP, handed to the lb daemon
 * (ring buffer `choice_ring`), which sends it to the peers. */
struct inband_choice_rec {
	struct inband_flow_key key; /* its client side */
	struct inband_addr backend_addr;
	__be16 backend_port;
	__u16 pad;
	__u32 pad1;
	__u64 opened_ns; /* bpf_ktime_get_coarse_ns() of its SYN */
};

/* peer_choices[client side]: the backend a peer gave a fleet connection,
 * which this instance may adopt (handshake.h adopt()). Written by the lb
 * daemon only. */
struct inband_peer_choice {
	struct inband_addr backend_addr;
	__be16 backend_port;
	__u16 pad;
	__u32 pad1;
	/* CLOCK_MONOTONIC here of its SYN (the sender's age of it subtracted):
	 * an older record does not replace a newer one. */
	__u64 opened_ns;
};

#endif /* INBAND_LB_TYPES_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The agent's numbers that are not a map's layout: its limits, the replay
 * window of UDP client tuples, and the indices of its counters
 * (agent_stats; the daemon's poll responder writes some of them too).
 * Apart from types.h for the same reason as lb/consts.h: what the control
 * plane and the programs agree on by number reads as one list, and Rust
 * gets it through bindgen (crates/inband/build.rs).
 */
#ifndef INBAND_AGENT_CONSTS_H
#define INBAND_AGENT_CONSTS_H

#define INBAND_AGENT_MAX_SERVICES 64
/* Every address a balancer sends from, its SNAT pools included. */
#define INBAND_AGENT_MAX_BALANCERS 256
/* Fleet prefixes (balancer_nets). */
#define INBAND_AGENT_MAX_FLEETS 16
#define INBAND_AGENT_FLOW_TABLE_SIZE 262144
/* Closed connections whose TIME_WAIT may still answer (closed_flows). */
#define INBAND_AGENT_CLOSED_FLOW_TABLE_SIZE 65536

/* A UDP 155 whose stamp is more than this behind the newest one its
 * balancer sent is a replay. */
#define INBAND_UDP_STAMP_WINDOW_MS 5000

/* What a 125 carries when no override is set: the rodata `score_source`,
 * from the agent's `score` (the cpu and app sources set overrides, so
 * the programs see them as connections). */
enum inband_score_source {
	INBAND_SCORE_CONNECTIONS = 0, /* active connections of the port */
	INBAND_SCORE_REQUESTS = 1, /* its connections with a request in flight */
	/* The two added, a busy connection counting twice: an idle kept-alive
	 * connection still brings requests, a busy one has work queued now. */
	INBAND_SCORE_CONNECTIONS_AND_REQUESTS = 2,
};

enum inband_agent_counter {
	INBAND_AGENT_TUPLES_STORED = 0,
	INBAND_AGENT_PROBES_SEEN = 1,
	INBAND_AGENT_SCORES_SENT = 2,
	INBAND_AGENT_DSR_REWRITES = 3,
	INBAND_AGENT_UNTRUSTED_OPTION = 4, /* 155/124 from a host that is not a balancer */
	INBAND_AGENT_MALFORMED = 5, /* bad IP header, extension header, option or L4 header: passed on unchanged */
	INBAND_AGENT_NO_ROUTE = 6, /* DSR rewrite had no route to the client: sent via balancer */
	INBAND_AGENT_ADJUST_FAILED = 7,
	INBAND_AGENT_FLOWS_CLOSED = 8,
	INBAND_AGENT_MSS_CLAMPED = 9,
	INBAND_AGENT_AUTH_FAILED = 10, /* 155/124 whose MAC does not verify (or unknown key): dropped */
	INBAND_AGENT_BAD_CHECKSUM = 11, /* 155 on a packet with a wrong IPv4 or TCP checksum: dropped */
	INBAND_AGENT_NOT_SYN = 12, /* 155 on anything but a SYN: dropped */
	INBAND_AGENT_TUPLE_IN_USE = 13, /* 155 for a tuple a live socket owns: not stored */
	INBAND_AGENT_PROBE_UNKNOWN_FLOW = 14, /* 124 on a connection with no accepted 155: ignored */
	INBAND_AGENT_WRONG_FORMAT = 15, /* option of the format not configured: dropped */
	INBAND_AGENT_SCORE_DEFERRED_MTU = 16, /* a 125 would exceed the MTU on a packet no carrier stands in for */
	INBAND_AGENT_STALE_TUPLES_FORGOTTEN = 17, /* a balancer's SYN without 155 over an unfinished handshake's tuple */
	INBAND_AGENT_STALE_STAMP = 18, /* UDP 155 older than its balancer's newest, or than the tuple's: a replay */
	INBAND_AGENT_UDP_TUPLES_EXPIRED = 19, /* UDP client tuples unused past udp_idle_timeout */
	INBAND_AGENT_UNWALKED_EXT_HEADERS = 20, /* IPv6 from a balancer with extension headers other than one DOH first */
	INBAND_AGENT_DECAPSULATED = 21, /* IP-in-IP from a balancer unwrapped (ipip.h) */
	INBAND_AGENT_ENCAPSULATED = 22, /* 125s sent wrapped in IP-in-IP, as their 124 came */
	/* Written by the daemon's poll responder, not by the programs: */
	INBAND_AGENT_POLLS_ANSWERED = 23, /* out-of-band score polls answered */
	INBAND_AGENT_POLLS_UNAUTHENTICATED = 24, /* polls with a bad MAC, an unknown key or the other [auth] format */
	INBAND_AGENT_POLLS_REFUSED = 25, /* polls from a host not in `balancers`, or for a port not served */
	INBAND_AGENT_TIME_WAIT_REOPENED = 26, /* SYNs whose timestamp was raised above a TIME_WAIT's (agent/time_wait.h) */
	INBAND_AGENT_CLIENT_ADDRESS_SHOWN = 27, /* accept()/getpeername() answered with the client, not the balancer */
	INBAND_AGENT_SCORE_CARRIERS = 28, /* 125s sent on a header-only copy of a burst or full-sized segment (agent walk) */
	INBAND_AGENT_SCORE_DEFERRED_NO_ROOM = 29, /* a 125 not added: 60-byte IPv4 header full, or IPv6 extension headers */
	INBAND_AGENT_SCORE_DEFERRED_UDP_BURST = 30, /* a 125 not added to a UDP GSO burst: datagrams get no carrier */
	INBAND_AGENT_SCORE_DEFERRED_CARRIER_FAILED = 31, /* the burst's clone or its trim to headers refused */
	INBAND_AGENT_RESETS_VIA_BALANCER = 32, /* a server's RST sent back through the balancer, not direct (agent walk) */
	/* A fleet's SYN with a 155 for a tuple a live socket owns: dropped (the
	 * fleet tuples of two clients met; the new client retries on another
	 * port, the live connection is not disturbed by a challenge ACK). */
	INBAND_AGENT_FLEET_COLLISIONS = 33,
	/* A fleet flow's 125 or RST sent wrapped in IPv6 to the instance the
	 * flow label named, not to the fleet address (agent/encap.h). */
	INBAND_AGENT_FLEET_STEERED = 34,
	/* A fleet's 155 or 124 whose flow label names no address of
	 * `balancers` (or a steered packet whose instance left the
	 * configuration since): its answers go to the fleet address, which
	 * reaches no instance. */
	INBAND_AGENT_FLEET_UNNAMED = 35,
	INBAND_AGENT_FROZEN_DROPPED = 36, /* segments dropped for a connection frozen to move (docs/tcpe.md) */
	/* Segments of a connection the server closed first, sent by DSR after
	 * its socket became a TIME_WAIT (closed_flows): the ACK of the
	 * client's FIN, and of its retransmissions. */
	INBAND_AGENT_CLOSED_FLOW_SEGMENTS = 37,
	INBAND_AGENT_COUNTER_MAX = 38,
};

#endif /* INBAND_AGENT_CONSTS_H */

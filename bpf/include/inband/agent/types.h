/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Map keys and values of the real-server agent (bpf/agent.bpf.c), with the
 * flag bits of their fields. The control plane's Rust types are generated
 * from this header and consts.h at build time (crates/inband/build.rs), so
 * this is the only definition; the maps themselves are in maps.h.
 */
#ifndef INBAND_AGENT_TYPES_H
#define INBAND_AGENT_TYPES_H

#include <linux/types.h>

#include "inband/addr.h"
#include "inband/agent/consts.h"

/* services[key]: a local port the server application serves, per
 * transport and family (one port can serve a TCP and a UDP VIP, or an
 * IPv4 and an IPv6 one). */
struct inband_service_key {
	__be16 port; /* network order */
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 family; /* 4 or 6 */
};

struct inband_service {
	struct inband_addr vip_addr; /* what the client connected to: source of DSR responses */
	__be16 vip_port;
	__u16 pad;
};

/* A connection as the server sees it: peer = the balancer's NAT address. */
struct inband_conn_key {
	struct inband_addr peer_addr;
	__be16 peer_port;
	__be16 local_port;
	__u8 proto;
	__u8 pad[3];
};

/* dsr_flows[conn]: created by an accepted 155; deleted when the socket
 * closes (TCP, tracepoint; a connection with a ts_shift keeps it for its
 * TIME_WAIT until the next SYN on its ports), when a balancer's SYN
 * without 155 reuses the ports of a handshake that never became a socket
 * (TCP), when unused for `udp_idle_timeout` (UDP, found on the flow's
 * next response), or by the LRU. */
/* inband_dsr_flow.score_requested */
#define INBAND_SCORE_REQUESTED 1
#define INBAND_SCORE_ENCAP 2 /* the 124 came in IP-in-IP: the 125 goes back the same way */

struct inband_dsr_flow {
	struct inband_addr client_addr; /* all zero: no client tuple */
	__be16 client_port;
	__u8 score_requested; /* INBAND_SCORE_* bits: set by an accepted 124, cleared when the 125 is sent */
	__u8 probe_key; /* key id of that 124: the 125 is signed with it */
	__be32 probe_nonce; /* nonce of that 124: the 125 echoes it */
	__be32 stamp; /* UDP: the 155's nonce (balancer's clock, ms): the newest 155 wins */
	__u32 ts_shift; /* TCP: added to the client's TSvals, taken from TSecrs to it (agent/time_wait.h) */
	__u64 last_ns; /* UDP: bpf_ktime_get_coarse_ns() of the last packet from the balancer, to the second */
	/* From a fleet prefix: the flow label of the accepted 155, then of
	 * each accepted 124, naming the instance that sent it (a key of
	 * fleet_instances); what the agent sends this connection's balancer
	 * (125s, RSTs) goes there, wrapped (agent/encap.h). 0 = not a fleet's,
	 * or a label that named no instance. */
	__u32 fleet_label;
	/* TCP: set by the owner of a connection it froze to move it to another
	 * server (the transparent handoff, docs/tcpe.md): until this time
	 * (bpf_ktime_get_ns() in ms, compared modulo 2^32) the connection's
	 * segments from the balancer are dropped, and its entry outlives the
	 * frozen socket's close. 0: not frozen. */
	__u32 frozen_until_ms;
};

/* balancers[address]: who may send 155/124 here. */
struct inband_balancer {
	__u32 stamp; /* the newest UDP 155 stamp accepted from it: older ones are replays */
	__u32 pad;
};

/* balancer_nets[prefix]: a fleet of balancers' shared source addresses
 * (lb.toml `[scale_out] fleet_prefix`, agent.toml `fleet_prefixes`), a
 * /96 each: any address inside may send 155/124 here, as a `balancers`
 * entry may. */
struct inband_balancer_net {
	__u32 prefixlen; /* bits of addr that count (LPM trie key) */
	struct inband_addr addr;
};

/* agent_config[0], written by the control plane. */
struct inband_agent_config {
	__u8 auth_mode; /* enum inband_auth_mode (wire.h) */
	__u8 pad;
	__u16 mtu; /* L3 MTU of the interface: no 125 is added beyond it */
	__u32 udp_idle_timeout_s; /* a UDP client tuple unused this long is forgotten */
};

/* Key for active_conns and score_override: local port, host order. */

#endif /* INBAND_AGENT_TYPES_H */

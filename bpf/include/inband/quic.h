/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * QUIC connection IDs a balancer can route by, without flow state (so a
 * client that moves to another address keeps its server). The layout is
 * the plaintext one of the QUIC-LB draft (draft-ietf-quic-load-balancers):
 * every connection ID a server of a QUIC VIP issues is
 *
 *   byte 0:     config rotation (top 3 bits, INBAND_QUIC_CONFIG) | length (low 5 bits)
 *   bytes 1-2:  the server id (big endian): the backend's `quic_server_id`, 1-65535
 *   bytes 3-7:  random
 *
 * INBAND_QUIC_CID_LEN bytes in all. A short-header packet carries no
 * connection-ID length, so the balancer reads it with this one. Shared by
 * the balancer (lb/quic.h) and the QUIC servers' ID generator
 * (crates/inband/src/workload/quic.rs).
 */
#ifndef INBAND_QUIC_H
#define INBAND_QUIC_H

#define INBAND_QUIC_CID_LEN 8
#define INBAND_QUIC_CONFIG 0
#define INBAND_QUIC_CID_FIRST ((INBAND_QUIC_CONFIG << 5) | INBAND_QUIC_CID_LEN)

#endif /* INBAND_QUIC_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The TCPE client's C ABI (crates/inband-tcpe/src/ffi.rs): one byte stream
 * over a connection that a TCPE balancer may move to another server
 * (docs/decisions.md, "TCPE handoff: moving a connection"). The functions
 * live in the inband-tcpe Rust library; a failure returns NULL or -1 with
 * errno set.
 *
 * Order of the stream: the bytes of the first subflow that came before
 * the server's JOIN-OK, then those of the subflow the client joined. Send
 * one request and read its response before sending the next.
 */
#ifndef INBAND_TCPE_H
#define INBAND_TCPE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct InbandTcpe inband_tcpe;
typedef struct Client inband_tcpe_conn;

/* Loads the TCPE sockops program on a cgroup v2 directory (root). */
inband_tcpe *inband_tcpe_attach(const char *cgroup);
void inband_tcpe_detach(inband_tcpe *t);

/* addr: "192.0.2.1:80" or "[2001:db8::1]:80". */
inband_tcpe_conn *inband_tcpe_connect(const inband_tcpe *t, const char *addr, uint32_t timeout_ms);
ssize_t inband_tcpe_read(inband_tcpe_conn *c, void *buf, size_t len);
ssize_t inband_tcpe_write(inband_tcpe_conn *c, const void *buf, size_t len);
/* 1 once the stream goes on on a joined subflow. */
int inband_tcpe_moved(const inband_tcpe_conn *c);
void inband_tcpe_close(inband_tcpe_conn *c);

#ifdef __cplusplus
}
#endif

#endif /* INBAND_TCPE_H */

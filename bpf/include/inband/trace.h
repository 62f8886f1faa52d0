/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * `inband trace` (docs/trace.md): the maps bpf/trace.bpf.c fills and the
 * tracer reads. Which system call belongs to which category is decided in
 * Rust (crates/inband-trace/src/categories.rs) and handed to the program as
 * read-only data before load.
 */
#ifndef INBAND_TRACE_H
#define INBAND_TRACE_H

#include <linux/types.h>

/* Phase 0 is "no marker hit yet on this thread"; --phase takes the rest. */
#define INBAND_TRACE_MAX_PHASES 16
/* x86_64 system call numbers stay below 512; any number at or above it
 * (x32 calls carry bit 30) is counted in the last slot. */
#define INBAND_TRACE_NR_SLOTS 512
#define INBAND_TRACE_CATEGORIES 5
/* Threads in the target that can be mid-call, have a phase, or have a
 * per-thread total at once; beyond that the counters below say so. */
#define INBAND_TRACE_MAX_THREADS 16384
#define INBAND_TRACE_THREAD_TOTALS (INBAND_TRACE_MAX_THREADS * INBAND_TRACE_CATEGORIES)

/* A system call the target is in: when, which, and the phase of its thread
 * at entry (the phase the time is charged to). */
struct inband_trace_start {
	__u64 ns;
	__u32 nr;
	__u32 phase;
};

/* `syscalls` (per CPU, indexed phase * NR_SLOTS + nr) and `threads`. */
struct inband_trace_time {
	__u64 count;
	__u64 ns;
};

struct inband_trace_thread_key {
	__u32 tid;
	__u32 category;
};

enum inband_trace_counter {
	/* A call not timed: `starts` was full. */
	INBAND_TRACE_STARTS_FULL,
	/* A call timed in the totals but missing from the per-thread view. */
	INBAND_TRACE_THREADS_FULL,
	/* A phase marker hit on a thread `thread_phase` had no room for: the
	 * thread's calls stay charged to its previous phase. */
	INBAND_TRACE_PHASES_FULL,
	INBAND_TRACE_COUNTERS,
};

#endif

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
/* Threads with a per-thread total; beyond that INBAND_TRACE_THREADS_FULL. */
#define INBAND_TRACE_MAX_THREADS 16384
#define INBAND_TRACE_THREAD_TOTALS (INBAND_TRACE_MAX_THREADS * INBAND_TRACE_CATEGORIES)

/* Each thread of the target, in task storage: its phase, and the system
 * call it is in (when it began, which, and the phase then, the one its time
 * is charged to; ns 0: none). */
struct inband_trace_thread {
	__u64 ns;
	__u32 nr;
	__u32 call_phase;
	__u32 phase;
	__u32 pad;
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

/* Task storage is refused when the kernel has no memory for it, or when
 * another BPF program on the same CPU is using it at that moment. */
enum inband_trace_counter {
	/* A call not timed: no storage for its thread. */
	INBAND_TRACE_UNTIMED,
	/* A call timed in the totals but missing from the per-thread view. */
	INBAND_TRACE_THREADS_FULL,
	/* A marker hit counted but not made the thread's phase: no storage. */
	INBAND_TRACE_PHASE_UNSET,
	INBAND_TRACE_COUNTERS,
};

#endif

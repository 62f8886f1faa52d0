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
/* `category_of` of a call that is the tracer's own cost, not counted:
 * uprobe(2) and uretprobe(2), which the kernel makes the target call for a
 * uprobe on a 5-byte nop (6.18) or a return probe. */
#define INBAND_TRACE_NOT_COUNTED 0xff
/* Processes started by the target (and theirs) traced with --follow;
 * beyond that INBAND_TRACE_PROCESSES_FULL. */
#define INBAND_TRACE_MAX_PROCESSES 4096
/* Threads that exited while traced whose totals are kept (`exited`);
 * beyond that INBAND_TRACE_THREADS_FULL. */
#define INBAND_TRACE_MAX_THREADS 16384

/* `inband trace overhead`'s floors (read-only `floor_pass` of trace.bpf.c):
 * what the passes below the timing pass keep of it, to show what part of
 * its cost no per-call timer avoids. */
enum inband_trace_floor {
	/* The timing pass itself. */
	INBAND_TRACE_FLOOR_NONE,
	/* The programs stop at the process check: the cost of the system-call
	 * tracepoints, which every per-process tracer built on them pays. */
	INBAND_TRACE_FLOOR_TRACEPOINTS,
	/* The programs read the clock at entry and exit and keep the last
	 * call's duration in the thread's storage, and nothing else: the
	 * least a tracer that times every call does. */
	INBAND_TRACE_FLOOR_CLOCKS,
};

/* `syscalls` (per CPU, indexed phase * NR_SLOTS + nr) and a thread's
 * totals by category. */
struct inband_trace_time {
	__u64 count;
	__u64 ns;
};

/* A thread's totals by category since the tracer attached, and when it
 * made its first timed call (bpf_ktime_get_ns; 0: none yet), which tells
 * two threads that had the same thread id apart. */
struct inband_trace_totals {
	__u64 since;
	struct inband_trace_time category[INBAND_TRACE_CATEGORIES];
};

/* Each thread of the target, in task storage: the system call it is in
 * (when it began, which, and the phase then, the one its time is charged
 * to; ns 0: none), its phase, and its totals. The totals live here, in the
 * storage every call reads anyway, so that a call touches no other
 * per-thread memory; the tracer reads them by the thread's pidfd, and
 * `exited` keeps them after the thread ends. */
struct inband_trace_thread {
	__u64 ns;
	__u32 nr;
	__u32 call_phase;
	__u32 phase;
	__u32 pad;
	struct inband_trace_totals totals;
};

/* `last_phase` (per CPU, one slot): the latest marker hit on that CPU,
 * when (bpf_ktime_get_ns, CLOCK_MONOTONIC) and by which thread; the
 * newest over the CPUs is the phase the process was last seen entering,
 * which each snapshot reports. ns 0: no hit yet. */
struct inband_trace_last {
	__u64 ns;
	__u32 phase;
	__u32 tid;
};

/* The memory pass (--memory): the C allocator's functions, by the attach
 * cookie of their uprobe, each call's size in a log2 bucket (bucket b holds
 * sizes of b significant bits: 0, 1, 2-3, 4-7, ...; the last every larger
 * size), and page allocations by order. */
enum inband_trace_alloc_fn {
	INBAND_TRACE_MALLOC,
	INBAND_TRACE_CALLOC,
	INBAND_TRACE_REALLOC,
	INBAND_TRACE_ALIGNED_ALLOC,
	INBAND_TRACE_POSIX_MEMALIGN,
	INBAND_TRACE_FREE,
	INBAND_TRACE_ALLOC_FNS,
};
#define INBAND_TRACE_SIZE_BUCKETS 48
#define INBAND_TRACE_PAGE_ORDERS 11

/* `allocs` (per CPU, indexed (phase * ALLOC_FNS + fn) * SIZE_BUCKETS +
 * bucket), `pages` (per CPU, phase * PAGE_ORDERS + order) and `sites`. */
struct inband_trace_alloc {
	__u64 count;
	__u64 bytes;
};

/* Call sites of the allocating functions (free left out): the return
 * address at the function's entry (the caller, found without frame
 * pointers) and the user stack above it by the frame-pointer chain
 * (`alloc_stacks`; -1 when the kernel could not take one). */
#define INBAND_TRACE_MAX_SITES 16384
#define INBAND_TRACE_STACKS 4096
#define INBAND_TRACE_STACK_DEPTH 16
struct inband_trace_site {
	__u64 caller;
	__s32 stack_id;
	__u32 fn;
};

/* Task storage is refused when the kernel has no memory for it, or when
 * another BPF program on the same CPU is using it at that moment. */
enum inband_trace_counter {
	/* A call not timed: no storage for its thread. */
	INBAND_TRACE_UNTIMED,
	/* A thread that exited while traced whose totals were not kept
	 * (`exited` full): its calls stay in the per-call totals. */
	INBAND_TRACE_THREADS_FULL,
	/* A marker hit counted but not made the thread's phase: no storage. */
	INBAND_TRACE_PHASE_UNSET,
	/* A page allocation of an order beyond INBAND_TRACE_PAGE_ORDERS. */
	INBAND_TRACE_PAGE_ORDER_UNKNOWN,
	/* A process started by a traced one not followed: `processes` full. */
	INBAND_TRACE_PROCESSES_FULL,
	/* An allocation counted, but not under its call site: `sites` full. */
	INBAND_TRACE_SITES_FULL,
	/* An allocation's site without its stack (`alloc_stacks` full, or a
	 * stack the kernel could not walk). */
	INBAND_TRACE_STACK_LOST,
	INBAND_TRACE_COUNTERS,
};

#endif

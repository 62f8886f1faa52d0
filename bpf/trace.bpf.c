// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * `inband trace` (docs/trace.md): times every system call of one process
 * (raw_syscalls enter/exit) and marks its phases (uprobes whose attach cookie
 * is the phase number); with --memory, also counts the C allocator's calls
 * by size and call site (uprobes) and the pages allocated to it
 * (kmem/mm_page_alloc).
 * With --follow, the processes the target starts are traced too, from the
 * fork (sched_process_fork) to the exit of their main thread.
 * Counting happens here, naming and categories' meaning in Rust, which
 * reads the maps at each snapshot.
 *
 * BTF tracepoints rather than the formatted ones: the call number is the
 * second argument of sys_enter, nothing needs the formatted record, and
 * they can keep a thread's state in task storage.
 */
#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>

/* The two fields following children needs, relocated by name against the
 * kernel's BTF (as agent.bpf.c's socket fields): no vmlinux.h, whose
 * definitions clash with the UAPI headers used throughout. */
struct task_struct {
	int pid;
	int tgid;
} __attribute__((preserve_access_index));

#include "inband/trace.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Set by the tracer before load. */
const volatile __u32 target_tgid;
const volatile __u8 category_of[INBAND_TRACE_NR_SLOTS];
/* --follow; when 0 the verifier drops the `processes` lookups. */
const volatile __u8 follow;
/* enum inband_trace_floor: INBAND_TRACE_FLOOR_NONE but in `inband trace
 * overhead`'s floor passes. */
const volatile __u8 floor_pass;

/* --follow: the processes started by traced ones, by process id. Added at
 * the fork, removed at the exit of the process's main thread, so a reused
 * process id is never taken for a traced one; the tracer adds those
 * already running when it attaches. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_TRACE_MAX_PROCESSES);
	__type(key, __u32);
	__type(value, __u8);
} processes SEC(".maps");

/* Created at a thread's first call or marker after attach, freed by the
 * kernel with the thread (or with the map): no bound to keep, no entry
 * left by a thread that died inside a call. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct inband_trace_thread);
} thread_state SEC(".maps");

/* Per CPU so that threads on different CPUs calling the same thing never
 * share a cache line; the tracer sums the CPUs. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_TRACE_MAX_PHASES * INBAND_TRACE_NR_SLOTS);
	__type(key, __u32);
	__type(value, struct inband_trace_time);
} syscalls SEC(".maps");

/* The totals of threads that exited while traced, by thread id, copied
 * from their task storage at the exit so that their last interval is still
 * reported (a thread id used again while traced adds to its entry);
 * bounded, INBAND_TRACE_THREADS_FULL counts what does not fit. Written
 * only at a thread's exit, never per call. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_TRACE_MAX_THREADS);
	__type(key, __u32);
	__type(value, struct inband_trace_totals);
} exited SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_TRACE_MAX_PHASES);
	__type(key, __u32);
	__type(value, __u64);
} phase_hits SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct inband_trace_last);
} last_phase SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_TRACE_MAX_PHASES * INBAND_TRACE_ALLOC_FNS * INBAND_TRACE_SIZE_BUCKETS);
	__type(key, __u32);
	__type(value, struct inband_trace_alloc);
} allocs SEC(".maps");

/* The memory pass's call sites: cumulative, bounded, full counts
 * INBAND_TRACE_SITES_FULL; the stacks they name. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, INBAND_TRACE_MAX_SITES);
	__type(key, struct inband_trace_site);
	__type(value, struct inband_trace_alloc);
} sites SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, INBAND_TRACE_STACKS);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, INBAND_TRACE_STACK_DEPTH * sizeof(__u64));
} alloc_stacks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_TRACE_MAX_PHASES * INBAND_TRACE_PAGE_ORDERS);
	__type(key, __u32);
	__type(value, struct inband_trace_alloc);
} pages SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, INBAND_TRACE_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline void count(__u32 counter)
{
	__u64 *n = bpf_map_lookup_elem(&counters, &counter);

	if (n)
		__sync_fetch_and_add(n, 1);
}

/* The target's thread id, or 0 for every other process. With --follow
 * every call on the host that is not the target's pays a hash lookup. */
static __always_inline __u32 target_tid(void)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32;

	if (tgid == target_tgid)
		return (__u32)id;
	if (follow && bpf_map_lookup_elem(&processes, &tgid))
		return (__u32)id;
	return 0;
}

/* ctx: struct pt_regs *regs, long id */
SEC("tp_btf/sys_enter")
int trace_sys_enter(__u64 *ctx)
{
	__u64 nr = ctx[1];

	if (!target_tid() || floor_pass == INBAND_TRACE_FLOOR_TRACEPOINTS ||
	    (nr < INBAND_TRACE_NR_SLOTS && category_of[nr] == INBAND_TRACE_NOT_COUNTED))
		return 0;
	struct inband_trace_thread *t =
		bpf_task_storage_get(&thread_state, bpf_get_current_task_btf(), 0, BPF_LOCAL_STORAGE_GET_F_CREATE);

	if (!t) {
		count(INBAND_TRACE_UNTIMED);
		return 0;
	}
	__u64 now = bpf_ktime_get_ns();

	t->nr = nr < INBAND_TRACE_NR_SLOTS ? nr : INBAND_TRACE_NR_SLOTS - 1;
	t->call_phase = t->phase;
	t->ns = now;
	if (!t->totals.since)
		t->totals.since = now;
	return 0;
}

SEC("tp_btf/sys_exit")
int trace_sys_exit(__u64 *ctx)
{
	if (!target_tid() || floor_pass == INBAND_TRACE_FLOOR_TRACEPOINTS)
		return 0;
	struct inband_trace_thread *t = bpf_task_storage_get(&thread_state, bpf_get_current_task_btf(), 0, 0);

	/* None (or ns 0) for a call that began before the tracer attached. */
	if (!t || !t->ns)
		return 0;
	__u64 ns = bpf_ktime_get_ns() - t->ns;
	__u32 nr = t->nr, phase = t->call_phase;

	t->ns = 0;
	if (floor_pass == INBAND_TRACE_FLOOR_CLOCKS) {
		t->totals.category[0].ns = ns;
		return 0;
	}
	if (nr >= INBAND_TRACE_NR_SLOTS || phase >= INBAND_TRACE_MAX_PHASES)
		return 0;
	__u32 slot = phase * INBAND_TRACE_NR_SLOTS + nr;
	struct inband_trace_time *time = bpf_map_lookup_elem(&syscalls, &slot);

	if (time) {
		__sync_fetch_and_add(&time->count, 1);
		__sync_fetch_and_add(&time->ns, ns);
	}
	/* Only this thread writes its storage (its own calls, markers and
	 * exit), so plain adds; the tracer's reads of a total may see its
	 * count one call ahead of its time, never a torn value. */
	__u8 category = category_of[nr];

	if (category < INBAND_TRACE_CATEGORIES) {
		t->totals.category[category].count++;
		t->totals.category[category].ns += ns;
	}
	return 0;
}

SEC("uprobe")
int trace_phase(void *ctx)
{
	__u32 phase = bpf_get_attach_cookie(ctx), tid = target_tid(), zero = 0;

	if (!tid || phase == 0 || phase >= INBAND_TRACE_MAX_PHASES)
		return 0;
	__u64 *hits = bpf_map_lookup_elem(&phase_hits, &phase);

	if (hits)
		__sync_fetch_and_add(hits, 1);
	/* Per CPU, so threads on different CPUs never write one line. */
	struct inband_trace_last *last = bpf_map_lookup_elem(&last_phase, &zero);

	if (last) {
		last->ns = bpf_ktime_get_ns();
		last->phase = phase;
		last->tid = tid;
	}
	struct inband_trace_thread *t =
		bpf_task_storage_get(&thread_state, bpf_get_current_task_btf(), 0, BPF_LOCAL_STORAGE_GET_F_CREATE);

	if (t)
		t->phase = phase;
	else
		count(INBAND_TRACE_PHASE_UNSET);
	return 0;
}

/* The phase of the current thread of the target, without creating its
 * storage (a thread that has hit no marker is in phase 0). */
static __always_inline __u32 current_phase(void)
{
	struct inband_trace_thread *t = bpf_task_storage_get(&thread_state, bpf_get_current_task_btf(), 0, 0);

	return t && t->phase < INBAND_TRACE_MAX_PHASES ? t->phase : 0;
}

static __always_inline void add(void *map, __u32 slot, __u64 bytes)
{
	struct inband_trace_alloc *a = bpf_map_lookup_elem(map, &slot);

	if (a) {
		__sync_fetch_and_add(&a->count, 1);
		__sync_fetch_and_add(&a->bytes, bytes);
	}
}

/* By halves: BPF has no count-leading-zeros instruction (and clang 14
 * crashes lowering __builtin_clzll for it). */
static __always_inline __u32 significant_bits(__u64 v)
{
	__u32 n = 0;

	if (v >> 32) {
		n += 32;
		v >>= 32;
	}
	if (v >> 16) {
		n += 16;
		v >>= 16;
	}
	if (v >> 8) {
		n += 8;
		v >>= 8;
	}
	if (v >> 4) {
		n += 4;
		v >>= 4;
	}
	if (v >> 2) {
		n += 2;
		v >>= 2;
	}
	if (v >> 1) {
		n += 1;
		v >>= 1;
	}
	return n + v;
}

/* At a function's entry the caller is the return address on top of the
 * stack; the frame-pointer walk (bpf_get_stackid) starts at the caller's
 * caller, and is only right as far as the code keeps frame pointers. */
static __always_inline void count_site(struct pt_regs *ctx, __u32 fn, __u64 size)
{
	struct inband_trace_site key = { .fn = fn };

	if (bpf_probe_read_user(&key.caller, sizeof(key.caller), (void *)PT_REGS_SP(ctx)))
		key.caller = 0;
	key.stack_id = bpf_get_stackid(ctx, &alloc_stacks, BPF_F_USER_STACK);
	if (key.stack_id < 0) {
		key.stack_id = -1;
		count(INBAND_TRACE_STACK_LOST);
	}
	struct inband_trace_alloc *a = bpf_map_lookup_elem(&sites, &key);

	if (a) {
		__sync_fetch_and_add(&a->count, 1);
		__sync_fetch_and_add(&a->bytes, size);
		return;
	}
	struct inband_trace_alloc first = { .count = 1, .bytes = size };

	/* Two threads of the target may add one site at once: the loser's
	 * EEXIST is retried as an add. */
	if (!bpf_map_update_elem(&sites, &key, &first, BPF_NOEXIST))
		return;
	a = bpf_map_lookup_elem(&sites, &key);
	if (a) {
		__sync_fetch_and_add(&a->count, 1);
		__sync_fetch_and_add(&a->bytes, size);
	} else {
		count(INBAND_TRACE_SITES_FULL);
	}
}

/* The memory pass: one program on every allocator function, the cookie
 * saying which; arguments by the x86_64 calling convention. */
SEC("uprobe")
int trace_alloc(struct pt_regs *ctx)
{
	__u32 fn = bpf_get_attach_cookie(ctx);
	__u64 size;

	if (!target_tid() || fn >= INBAND_TRACE_ALLOC_FNS)
		return 0;
	switch (fn) {
	case INBAND_TRACE_MALLOC:
		size = PT_REGS_PARM1(ctx);
		break;
	case INBAND_TRACE_CALLOC:
		size = PT_REGS_PARM1(ctx) * PT_REGS_PARM2(ctx);
		break;
	case INBAND_TRACE_REALLOC:
	case INBAND_TRACE_ALIGNED_ALLOC:
		size = PT_REGS_PARM2(ctx);
		break;
	case INBAND_TRACE_POSIX_MEMALIGN:
		size = PT_REGS_PARM3(ctx);
		break;
	default:
		size = 0;
	}
	__u32 bucket = significant_bits(size);

	if (bucket >= INBAND_TRACE_SIZE_BUCKETS)
		bucket = INBAND_TRACE_SIZE_BUCKETS - 1;
	add(&allocs, (current_phase() * INBAND_TRACE_ALLOC_FNS + fn) * INBAND_TRACE_SIZE_BUCKETS + bucket, size);
	if (fn != INBAND_TRACE_FREE)
		count_site(ctx, fn, size);
	return 0;
}

/* ctx: struct page *page, unsigned int order, gfp_t gfp_flags, int migratetype */
SEC("tp_btf/mm_page_alloc")
int trace_page_alloc(__u64 *ctx)
{
	__u32 order = ctx[1];

	if (!target_tid())
		return 0;
	if (order >= INBAND_TRACE_PAGE_ORDERS) {
		count(INBAND_TRACE_PAGE_ORDER_UNKNOWN);
		return 0;
	}
	/* x86_64 pages: 4 KiB. */
	add(&pages, current_phase() * INBAND_TRACE_PAGE_ORDERS + order, 4096ULL << order);
	return 0;
}

/* ctx: struct task_struct *parent, struct task_struct *child; runs in the
 * parent. A new thread of a traced process is traced already. */
SEC("tp_btf/sched_process_fork")
int trace_fork(__u64 *ctx)
{
	struct task_struct *child = (struct task_struct *)ctx[1];

	if (!follow || !target_tid())
		return 0;
	__u32 pid = BPF_CORE_READ(child, pid), tgid = BPF_CORE_READ(child, tgid);
	__u8 one = 1;

	if (pid != tgid)
		return 0;
	if (bpf_map_update_elem(&processes, &tgid, &one, BPF_NOEXIST))
		count(INBAND_TRACE_PROCESSES_FULL);
	return 0;
}

/* ctx: struct task_struct *p; runs in the exiting thread, before its task
 * storage goes: its totals are copied to `exited` (then the process, when
 * it is the main thread of a followed one, is forgotten). */
SEC("tp_btf/sched_process_exit")
int trace_exit(__u64 *ctx)
{
	__u32 tid = target_tid();

	if (!tid || floor_pass != INBAND_TRACE_FLOOR_NONE)
		return 0;
	struct inband_trace_thread *t = bpf_task_storage_get(&thread_state, bpf_get_current_task_btf(), 0, 0);

	if (t && t->totals.since) {
		struct inband_trace_totals *e = bpf_map_lookup_elem(&exited, &tid);

		if (!e) {
			if (bpf_map_update_elem(&exited, &tid, &t->totals, BPF_NOEXIST))
				count(INBAND_TRACE_THREADS_FULL);
		} else {
			/* Only the thread with this id writes its entry, and
			 * two threads never have one id at once. */
			e->since = t->totals.since;
			for (int c = 0; c < INBAND_TRACE_CATEGORIES; c++) {
				e->category[c].count += t->totals.category[c].count;
				e->category[c].ns += t->totals.category[c].ns;
			}
		}
	}
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;

	if (follow && tid == tgid)
		bpf_map_delete_elem(&processes, &tgid);
	return 0;
}

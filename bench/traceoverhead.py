"""What `inband trace` costs, as a record: runs `inband trace overhead
--json` (one cell of `inband bench cache` run untraced and under each pass
of the tracer, in turns, throughput compared) for each store, and writes
results.json and results.md into --results (default
bench/results/traceoverhead):

    python -m bench.traceoverhead --cpu 1      # as root; ~6 min
    python -m bench.traceoverhead --backends lmdb --repeats 5

The passes (docs/trace.md, "Overhead"): untraced; two floors, the
system-call tracepoints with programs that stop at the process check, and
programs that also read the clock at entry and exit; the timing pass; the
timing pass with the cache set's markers; the memory pass.

--cpu N runs the benchmark, its tracer and nothing else on CPU N: every
other thread that may move is moved off it for the run and put back after
(on failure and Ctrl-C too). On a 2-vCPU machine shared with builds, a
difference of 1 % is otherwise below the noise of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .lib import preflight, results

# `inband trace overhead`'s passes, in its order; the table's columns.
PASSES = ["untraced", "floor: tracepoints only", "floor: clocks only", "timing", "timing, --phases cache", "timing and --memory"]


def _threads() -> list[int]:
    ids = []
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            ids.append(int(task.name))
        except ValueError:
            continue
    return ids


class Isolated:
    """CPU `cpu` for this process and its children alone while inside:
    every other thread that may move is moved to the other CPUs, and its
    own set put back on the way out. Threads started meanwhile by a moved
    one inherit its set; kernel threads bound to a CPU stay."""

    def __init__(self, cpu: int) -> None:
        self.cpu = cpu
        self.saved: dict[int, set[int]] = {}
        self.own: set[int] = set()

    def __enter__(self) -> "Isolated":
        everything = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
        if self.cpu not in everything or len(everything) < 2:
            raise SystemExit(f"--cpu {self.cpu}: this machine has CPUs {sorted(everything)}; at least two are needed")
        others = everything - {self.cpu}
        me = {int(t.name) for t in Path(f"/proc/{os.getpid()}/task").iterdir()}
        for tid in _threads():
            if tid in me:
                continue
            try:
                was = os.sched_getaffinity(tid)
                if self.cpu in was and was - {self.cpu}:
                    os.sched_setaffinity(tid, was & others)
                    self.saved[tid] = was
            except OSError:
                # Gone meanwhile, or a kernel thread bound to its CPU.
                continue
        self.own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.cpu})
        return self

    def __exit__(self, *exc) -> None:
        os.sched_setaffinity(0, self.own)
        for tid, was in self.saved.items():
            try:
                os.sched_setaffinity(tid, was)
            except OSError:
                pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.traceoverhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="lmdb,rocksdb,files,memory")
    ap.add_argument("--workload", default="95/5")
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=3.0, help="per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per pass; the median is compared")
    ap.add_argument("--cpu", type=int, help="run on this CPU alone (every other thread moved off it for the run)")
    ap.add_argument("--dir", help="parent directory of the stores (default: the temporary directory)")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--results", type=Path, default=results.default_dir("traceoverhead"), help="results.json and results.md (default: the committed ones)")
    args = ap.parse_args(argv)
    # Root: the tracer loads BPF programs.
    refused = preflight.refuse(preflight.problems(inband=args.inband, root=True))
    if refused:
        return refused
    this_run = results.Run("traceoverhead", "bench.traceoverhead", argv)
    rows = []
    isolation = None
    try:
        with Isolated(args.cpu) if args.cpu is not None else _Shared() as iso:
            isolation = iso
            for backend in args.backends.split(","):
                cmd = [args.inband, "trace", "overhead", "--json", "--backend", backend, "--workload", args.workload,
                       "--records", str(args.records), "--seconds", str(args.seconds), "--repeats", str(args.repeats)]
                if args.dir:
                    cmd += ["--dir", args.dir]
                cp = subprocess.run(cmd, capture_output=True, text=True)
                if cp.returncode != 0:
                    print(f"error: {' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip()[-2000:]}", file=sys.stderr)
                    return 1
                report = json.loads(cp.stdout)
                got = [p["pass"] for p in report["passes"]]
                if got != PASSES:
                    print(f"error: {args.inband} ran the passes {got}, this driver knows {PASSES}", file=sys.stderr)
                    return 1
                rows.append(report)
                print(f"{backend}: " + ", ".join(f"{p['pass']} {p['ratio']:.3f}" for p in report["passes"]), file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    profile = {
        "workload": args.workload,
        "records": args.records,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "cpu": args.cpu,
        "moved_threads": len(isolation.saved) if isinstance(isolation, Isolated) else 0,
    }
    record = this_run.record(rows, profile=profile, inband=Path(args.inband))
    results.write(args.results, record, render(record))
    return 0


class _Shared:
    """No isolation: the run shares every CPU."""

    def __enter__(self) -> "_Shared":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _per_op(run: dict, key: str) -> str:
    n = run.get(key)
    return "–" if n is None else f"{n / max(run['ops'], 1):.3g}"


def render(record: dict) -> str:
    """The table of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    p = record["profile"]
    where = (f"the benchmark and the tracer alone on CPU {p['cpu']} ({p['moved_threads']} other threads moved off it for the run)"
             if p["cpu"] is not None else "sharing both CPUs with whatever else ran")
    out = [
        "## Tracing overhead\n",
        f"{results.provenance(record)}  \n`inband bench cache`, workload {p['workload']}, {p['records']:,} records of 10 KiB, "
        f"one thread, {p['seconds']:g} s per run, median of {p['repeats']} runs per pass, the passes in turns; {where}.\n",
        "Throughput under each pass over the untraced median (1.000: no cost). Floors: the system-call tracepoints with "
        "programs that stop at the process check; and programs that also read the clock at a call's entry and exit and "
        "keep its duration, the least any tracer that times every call does. The timing pass is `inband trace`'s default; "
        "beyond the clocks: what it costs over that least.\n",
        "| store | untraced ops/s | " + " | ".join(PASSES[1:]) + " | timing beyond the clocks | calls/op | allocations/op |",
        "|---|---:|" + "---:|" * (len(PASSES) - 1) + "---:|---:|---:|",
    ]
    for r in record["rows"]:
        by = {x["pass"]: x for x in r["passes"]}
        ratios = " | ".join(f"{by[name]['ratio']:.3f}" for name in PASSES[1:])
        beyond = by["timing"]["ratio"] / by["floor: clocks only"]["ratio"] if by["floor: clocks only"]["ratio"] > 0 else 0.0
        timing, memory = by["timing"]["runs"][-1], by["timing and --memory"]["runs"][-1]
        out.append(f"| {r['backend']} | {by['untraced']['median_ops_per_s']:,.0f} | {ratios} | {beyond:.3f} | "
                   f"{_per_op(timing, 'syscalls')} | {_per_op(memory, 'allocs')} |")
    out += [
        "",
        "Per system call, with the CPU caches warm: a loop of getppid(2), the cheapest call, under each pass (ns per call, "
        "median over the repeats of each run's fastest round of a million calls; one loop per store's session). What the "
        "timing pass adds to a call, times the store's calls per second untraced, is its least cost for that store; "
        "the part beyond the clocks is the tracer's own bookkeeping.\n",
        "| session | " + " | ".join(PASSES) + " | timing adds | of it beyond the clocks | least cost at the store's calls/s | of it beyond the clocks |",
        "|---|" + "---:|" * len(PASSES) + "---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        by = {x["pass"]: x for x in r["passes"]}
        ns = {name: by[name]["ns_per_call"] for name in PASSES}
        timing = by["timing"]["runs"][-1]
        calls_per_s = by["untraced"]["median_ops_per_s"] * (timing["syscalls"] or 0) / max(timing["ops"], 1)
        adds, beyond = ns["timing"] - ns["untraced"], ns["timing"] - ns["floor: clocks only"]
        cells = " | ".join(f"{ns[name]:.1f}" for name in PASSES)
        out.append(f"| {r['backend']} | {cells} | {adds:.1f} | {beyond:.1f} | {100 * adds * calls_per_s / 1e9:.2f} % | "
                   f"{100 * beyond * calls_per_s / 1e9:.2f} % |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())

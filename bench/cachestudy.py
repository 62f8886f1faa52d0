"""Seed 003's study on the proxy cache's stores, as a record: runs
`inband trace study --json` (every store × workload mix of `inband bench
cache`, each run traced by its own `inband trace --pid`) and writes
results.json and results.md into --results (default
bench/results/cachestudy):

    python -m bench.cachestudy                      # as root; ~4 min, one ~1.2 GB store on disk at a time
    python -m bench.cachestudy --records 20000 --seconds 1

See docs/benchmarks.md, "Cache study", for the method and the reading,
and docs/trace.md, "Study", for the columns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .lib import preflight, results

CATEGORIES = ["io_read", "io_write", "sync", "memory", "other"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cachestudy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100000)
    ap.add_argument("--seconds", type=float, default=3.0, help="per store × mix")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backends", default="lmdb,rocksdb,memory,files")
    ap.add_argument("--mixes", default="W,A,B,C,D,E,F")
    ap.add_argument("--scan-max", type=int, default=100)
    ap.add_argument("--memory", action="store_true", help="also run each cell under the memory pass (allocations per operation)")
    ap.add_argument("--dir", help="parent directory of the stores (default: inband's)")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--results", type=Path, default=results.default_dir("cachestudy"), help="results.json and results.md (default: the committed ones)")
    args = ap.parse_args(argv)
    # Root: the tracer loads BPF programs.
    refused = preflight.refuse(preflight.problems(inband=args.inband, root=True))
    if refused:
        return refused
    this_run = results.Run("cachestudy", "bench.cachestudy", argv)
    cmd = [args.inband, "trace", "study", "--json", "--records", str(args.records), "--seconds", str(args.seconds),
           "--threads", str(args.threads), "--backends", args.backends, "--mixes", args.mixes, "--scan-max", str(args.scan_max)]
    if args.dir:
        cmd += ["--dir", args.dir]
    if args.memory:
        cmd += ["--memory"]
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        print(f"error: {' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(cp.stdout)
    cells, fills = report.pop("cells"), report.pop("fills")
    profile = {
        "name": "args",
        **report,
        "machine_shared": "2 vCPUs shared with other sessions (builds, tests): off-CPU time includes waiting for a core; "
                          "the load average at the start and the end is in the record",
    }
    record = this_run.record(cells, profile=profile, inband=Path(args.inband), fills=fills)
    results.write(args.results, record, render(record))
    return 0


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}" if whole > 0 else "–"


def _calls_ns(part: dict, cat: str) -> int:
    return part["calls"].get(cat, {}).get("ns", 0)


def _top(cell: dict) -> str:
    """The two calls that took the most time among those the operations
    make (at least one per 100 operations), waits (sync) left out: the
    tracer lists calls for all threads together, and the waits are mostly
    the main thread's sleep and the store's idle threads (the workers'
    are in the sync column)."""
    floor = cell["ops"] / 100
    calls = [c for c in cell["top_calls"] if c["count"] >= floor and c["category"] != "sync"][:2]
    return ", ".join(f"{c['name']} {c['ns'] / max(c['count'], 1) / 1e3:.0f} µs" for c in calls) or "–"


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    p = record["profile"]
    out = [
        "## Cache study\n",
        f"{results.provenance(record)}  \n{p['records']:,} records × {p['value_bytes']:,} B values, zipf {p['zipf']:g}, "
        f"{p['threads']} benchmark thread(s), {p['seconds']:g} s per cell, scans of 1 to {p['scan_max']} records; "
        f"{p['machine_shared']}.\n",
        "Shares of the workers' time (their threads' wall time): user and system CPU, off-CPU (neither: blocked, or waiting "
        "for a core; preempted /s counts how often another thread took the core), and the time from entry to exit of their system calls by category (which overlaps system CPU and "
        "off-CPU). Faults per operation are the workers'; the store's own threads (RocksDB's flushes and compactions) "
        "are counted apart (their CPU, and their time in I/O reads and writes). Top calls: the two that took the most time among those made at least once per 100 "
        "operations, with their mean time.\n",
        "| store | mix | ops/s | p50 µs | p99 µs | user % | sys % | off-CPU % | read % | write % | sync % | memory % | other % "
        "| preempted /s | calls/op | minor faults/op | major faults | store threads CPU ms | store threads I/O ms | top calls |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in record["rows"]:
        if c.get("unsupported"):
            out.append(f"| {c['backend']} | {c['mix']} | not supported: {c['unsupported']} |")
            continue
        w, s = c["workers"], c["store"]
        ops = max(c["ops"], 1)
        wall = w["wall_s"]
        off = max(wall - w["user_s"] - w["sys_s"], 0.0)
        cats = " | ".join(_pct(_calls_ns(w, cat) / 1e9, wall) for cat in CATEGORIES)
        calls = sum(v["count"] for v in w["calls"].values())
        store_io_ms = sum(_calls_ns(s, cat) for cat in ("io_read", "io_write")) / 1e6
        out.append(
            f"| {c['backend']} | {c['mix']} | {c['ops_per_s']:.0f} | {c['p50_us']:.1f} | {c['p99_us']:.1f} | "
            f"{_pct(w['user_s'], wall)} | {_pct(w['sys_s'], wall)} | {_pct(off, wall)} | {cats} | "
            f"{w['involuntary_switches'] / wall if wall > 0 else 0:.0f} | {calls / ops:.2f} | "
            f"{w['minor_faults'] / ops:.2f} | {w['major_faults']} | {(s['user_s'] + s['sys_s']) * 1e3:.0f} | {store_io_ms:.0f} | {_top(c)} |"
        )
    out += ["", "Mixes: " + "; ".join(f"{m} {a}" for m, a in dict((c["mix"], c["about"]) for c in record["rows"]).items()) + ".", ""]
    busy = [(c, t) for c in record["rows"] if not c.get("unsupported") for t in c["by_thread"]
            if t["role"] == "store" and (t["user_s"] + t["sys_s"] > 0 or sum(_calls_ns(t, cat) for cat in ("io_read", "io_write")) >= 1e6)]
    if busy:
        out += ["The store's own threads that worked (some CPU, or 1 ms or more in I/O calls; CPU from /proc in 10 ms ticks; "
                "calls by category, ms):", "",
                "| store | mix | thread | CPU ms | read ms | write ms | sync ms | memory ms | other ms |",
                "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for c, t in busy:
            cats = " | ".join(f"{_calls_ns(t, cat) / 1e6:.1f}" for cat in CATEGORIES)
            out.append(f"| {c['backend']} | {c['mix']} | {t['name']} | {(t['user_s'] + t['sys_s']) * 1e3:.0f} | {cats} |")
        out.append("")
    passes = [c for c in record["rows"] if c.get("memory")]
    if passes:
        out += ["The memory pass (a second run of each cell under `inband trace --memory`, far slower; counts per operation):", "",
                "| store | mix | allocations/op | allocated KiB/op | frees/op | pages/op |", "|---|---|---:|---:|---:|---:|"]
        for c in passes:
            m = c["memory"]
            out.append(f"| {c['backend']} | {c['mix']} | {m['allocs_per_op']:.2f} | {m['alloc_bytes_per_op'] / 1024:.1f} | "
                       f"{m['frees_per_op']:.2f} | {m['pages_per_op']:.2f} |")
        out.append("")
    out += ["| store | load s |", "|---|---:|"]
    for f in record["fills"]:
        out.append(f"| {f['backend']} | {f['load_s']:.1f} |" if f["backend"] != "memory" else "| memory | – (each run fills its heap) |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())

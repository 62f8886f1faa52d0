"""The proxy cache's storage backends (LMDB, RocksDB, memory, files) under
read/update mixes, as a record: runs `inband bench cache --json` and
writes results.json and results.md into --results (default
bench/results/cache), and the plot (bench.cache_plot) into --out:

    python -m bench.cache --out /tmp/cache-run     # ~4 min; one ~1.2 GB store on disk at a time
    python -m bench.cache --out DIR --records 20000 --seconds 1

See docs/benchmarks.md, "Cache storage", for the method.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from . import cache_plot
from .lib import preflight, results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the run's figure (created)")
    ap.add_argument("--records", type=int, default=100000)
    ap.add_argument("--value-bytes", type=int, default=10240)
    ap.add_argument("--seconds", type=float, default=3.0, help="per backend × workload × thread count")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--backends", default="lmdb,rocksdb,memory,files")
    ap.add_argument("--zipf", type=float, default=0.99)
    ap.add_argument("--dir", help="parent directory of the stores (default: inband's)")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--results", type=Path, default=results.default_dir("cache"), help="results.json and results.md (default: the committed ones)")
    args = ap.parse_args(argv)
    refused = preflight.refuse(preflight.problems(inband=args.inband, root=False))
    if refused:
        return refused
    this_run = results.Run("cache", "bench.cache", argv)
    cmd = [args.inband, "bench", "cache", "--json", "--records", str(args.records), "--value-bytes", str(args.value_bytes),
           "--seconds", str(args.seconds), "--zipf", str(args.zipf),
           "--threads", args.threads, "--backends", args.backends]
    if args.dir:
        cmd += ["--dir", args.dir]
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        print(f"error: {' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(cp.stdout)
    rows, fills = report.pop("rows"), report.pop("fills")
    record = this_run.record(rows, profile={"name": "args", **report}, inband=Path(args.inband), fills=fills)
    results.write(args.results, record, render(record))
    args.out.mkdir(parents=True, exist_ok=True)
    cache_plot.plot({**report, "rows": rows}, args.out / "cache.png")
    print(f"figure in {args.out / 'cache.png'}")
    return 0


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    p = record["profile"]
    base = {(r["workload"], r["threads"]): r["ops_per_s"] for r in record["rows"] if r["backend"] == "lmdb"}
    out = [
        "## Cache storage\n",
        f"{results.provenance(record)}  \n{p['records']:,} records × {p['value_bytes']:,} B values, zipf {p['zipf']:g}, "
        f"{p['seconds']:g} s per cell; ratios against lmdb.\n",
        "| backend | workload | threads | ops/s | × lmdb | p50 µs | p99 µs | CPU µs/op | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        b = base.get((r["workload"], r["threads"]))
        ratio = f"{r['ops_per_s'] / b:.2f}" if b else "-"
        out.append(f"| {r['backend']} | {r['workload']} | {r['threads']} | {r['ops_per_s']:.0f} | {ratio} | {r['p50_us']:.1f} | "
                   f"{r['p99_us']:.1f} | {r['cpu_us_per_op']:.1f} | {r['peak_rss_mib']:.0f} |")
    out += ["", "| backend | load s | reopen full store ms | same, file pages not cached | on disk MiB |", "|---|---:|---:|---:|---:|"]
    for f in record["fills"]:
        if f["backend"] == "memory":
            # Nothing to load or reopen: each run process fills its heap.
            out.append("| memory | – | – (not durable) | – (not durable) | 0 |")
            continue
        out.append(f"| {f['backend']} | {f['load_s']:.1f} | {f['reopen_ms']:.1f} | {f['reopen_cold_ms']:.1f} | {f['disk_mib']:.0f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""Plots `inband bench cache --save FILE` (or `--json`) output: ops/s and
CPU per operation per backend for each workload, one panel per thread count.

    python -m bench.cache_plot results/cache.json results/cache.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a server; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

BACKENDS = ["lmdb", "rocksdb", "memory", "files"]
WORKLOADS = ["read-only", "99/1", "95/5", "90/10"]


def plot(report: dict, out: Path) -> None:
    rows = report["rows"]
    threads = sorted({r["threads"] for r in rows})
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    fig, axes = plt.subplots(2, len(threads), figsize=(5.5 * len(threads), 7), squeeze=False)
    width = 0.8 / max(len(backends), 1)
    for col, t in enumerate(threads):
        for row, (metric, label) in enumerate([("ops_per_s", "operations/s"), ("cpu_us_per_op", "CPU µs per operation")]):
            ax = axes[row][col]
            for i, b in enumerate(backends):
                by_wl = {r["workload"]: r[metric] for r in rows if r["backend"] == b and r["threads"] == t}
                xs = [w + (i - (len(backends) - 1) / 2) * width for w in range(len(WORKLOADS))]
                ax.bar(xs, [by_wl.get(w, 0) for w in WORKLOADS], width, label=b)
            ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
            ax.set_ylabel(label)
            ax.set_title(f"{t} thread{'s' if t > 1 else ''}")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small", ncols=2)
    fig.suptitle(
        f"inband-cache backends: {report['records']:,} records × {report['value_bytes']} B, zipf {report['zipf']}"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    plot(json.loads(Path(argv[1]).read_text()), Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

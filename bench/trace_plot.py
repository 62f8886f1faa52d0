"""Plots `inband trace --out FILE` (JSON lines, docs/trace.md "Output"):
per snapshot interval, system call time by category, marker hits by
phase with the phase the process was in at each snapshot, and, from a
memory pass, allocations and pages.

    python -m bench.trace_plot trace.jsonl trace.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a server; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

CATEGORIES = ["io_read", "io_write", "sync", "memory", "other"]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(lines: list[dict]) -> dict:
    """Per snapshot: its end in seconds, the interval's ms by category,
    hits by phase (phases that were never hit left out), the phase the
    process was in, and with a memory pass allocation and page counts."""
    phases = [p for p in lines[-1]["total"]["phases"] if p != "none" and lines[-1]["total"]["phases"][p]["hits"] > 0]
    out = {
        "t_s": [line["elapsed_ms"] / 1e3 for line in lines],
        "ms": {c: [line["interval"]["categories"][c]["ns"] / 1e6 for line in lines] for c in CATEGORIES},
        "hits": {p: [line["interval"]["phases"][p]["hits"] for line in lines] for p in phases},
        "phase": [(line.get("phase") or {}).get("name") for line in lines],
    }
    if "memory" in lines[-1]["total"]:
        out["allocs"] = [
            sum(f["count"] for name, f in line["interval"]["memory"]["allocs"].items() if name != "free") for line in lines
        ]
        out["pages"] = [line["interval"]["memory"]["pages"]["count"] for line in lines]
    return out


def plot(lines: list[dict], out: Path) -> None:
    s = series(lines)
    panels = 3 if "allocs" in s else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.8 * panels + 0.6), sharex=True, squeeze=False)
    axes = [a[0] for a in axes]
    # Bars end at their snapshot and span its interval.
    starts = [0.0] + s["t_s"][:-1]
    widths = [end - start for start, end in zip(starts, s["t_s"])]
    bottom = [0.0] * len(starts)
    for c in CATEGORIES:
        axes[0].bar(starts, s["ms"][c], widths, bottom=bottom, align="edge", label=c)
        bottom = [b + v for b, v in zip(bottom, s["ms"][c])]
    axes[0].set_ylabel("system call ms\nper interval")
    axes[0].legend(fontsize="small", ncols=5)
    # Steps: each value holds from the previous snapshot (or the attach)
    # to its own.
    steps = [0.0] + s["t_s"]
    for p, hits in s["hits"].items():
        axes[1].step(steps, hits[:1] + hits, where="pre", label=p)
    # The phase each snapshot was taken in, above its point in time.
    top = max([max(h) for h in s["hits"].values()], default=0)
    for t, name in zip(s["t_s"], s["phase"]):
        if name:
            axes[1].annotate(name, (t, top), rotation=90, fontsize="x-small", va="top", ha="right", alpha=0.6)
    axes[1].set_ylabel("marker hits\nper interval")
    if s["hits"]:
        axes[1].legend(fontsize="small", ncols=4)
    if "allocs" in s:
        axes[2].step(steps, s["allocs"][:1] + s["allocs"], where="pre", label="allocator calls (free left out)")
        axes[2].step(steps, s["pages"][:1] + s["pages"], where="pre", label="pages allocated")
        axes[2].set_ylabel("per interval")
        axes[2].legend(fontsize="small")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xlabel("seconds since the tracer attached")
    fig.suptitle(f"inband trace of pid {lines[-1]['pid']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    lines = read(Path(argv[1]))
    if not lines:
        print(f"{argv[1]}: no snapshots", file=sys.stderr)
        return 1
    plot(lines, Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

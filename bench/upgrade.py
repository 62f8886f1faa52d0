"""An upgrade that carries the balancer's flow tables over to a build whose
maps differ (docs/architecture.md, "Upgrades"), timed, as a record: runs
`inband bench upgrade --json` (for each number of live flows, a private
balancer sized for them and filled, its maps pinned and carried over by
map_upgrade to the built-in object with flow tables 65,536 entries
larger: every flow table a new map) and writes results.json and
results.md into --results (default bench/results/upgrade):

    python -m bench.upgrade                         # as root; about a minute
    python -m bench.upgrade --flows 10000,100000    # a shorter run

The times are wall-clock times of this process's system calls, so the
machine's load enters them (the record holds the load average).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .lib import preflight, results

# What the docs' numbers are measured with: the growth sweep's flow counts.
FLOWS = "10000,1000000,4000000"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.upgrade", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flows", default=FLOWS, help=f"live flows, comma-separated (default {FLOWS})")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--results", type=Path, default=results.default_dir("upgrade"), help="results.json and results.md (default: the committed ones)")
    args = ap.parse_args(argv)
    refused = preflight.refuse(preflight.problems(inband=args.inband))
    if refused:
        return refused
    this_run = results.Run("upgrade", "bench.upgrade", argv)
    cmd = [args.inband, "bench", "upgrade", "--json", "--flows", args.flows]
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        print(f"error: {' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(cp.stdout)
    record = this_run.record(report["rows"], profile={"name": "args", "flows": args.flows}, inband=Path(args.inband))
    results.write(args.results, record, render(record))
    return 0


def render(record: dict) -> str:
    """The table of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    out = [
        "## Upgrades that carry the flow tables over\n",
        f"{results.provenance(record)}  \nBefore the switch: the first copy and the catch-up, while the old program "
        "serves; after it: the merges, at once and 50 ms later, and the renames of the pins (the switch itself, one "
        "netlink call, is not in either).\n",
        "| live flows | maps carried | before the switch s | after the switch ms | flows carried |",
        "|---:|---|---:|---:|---:|",
    ]
    for c in record["rows"]:
        out.append(f"| {c['flows']:,} | {', '.join(c['maps'])} | {c['before_switch_s']:.2f} | {c['after_switch_ms']:.0f} | "
                   f"{c['flows_carried']:,} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())

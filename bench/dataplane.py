"""The balancer's per-packet cost against the floor, as a record: runs
`inband bench dataplane --json` (BPF_PROG_TEST_RUN of every path of the
XDP program and of a bounce-only program, the floor on this CPU; a SYN
flood, a connection churn and a sweep of a full flow table) and writes
results.json and results.md into --results (default
bench/results/dataplane):

    python -m bench.dataplane                  # as root; under a minute
    python -m bench.dataplane --samples 2000   # a shorter run

The kernel times each program run itself, so the build of the harness
does not enter the times; the machine's load does (the record holds the
load average). See docs/benchmarks.md, "Data path cost".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .lib import preflight, results

# What the docs' numbers are measured with: 20,000 samples a path, a flood
# of 3.2× two backends' SNAT ports, a churn of 1M connections through the
# same two, and a sweep of the default flow table's size.
DEFAULTS = {"samples": 20000, "flood": 200000, "flood_backends": 2, "churn": 1000000, "churn_backends": 2, "sweep": 262144}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dataplane", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--results", type=Path, default=results.default_dir("dataplane"), help="results.json and results.md (default: the committed ones)")
    args = ap.parse_args(argv)
    refused = preflight.refuse(preflight.problems(inband=args.inband))
    if refused:
        return refused
    this_run = results.Run("dataplane", "bench.dataplane", argv)
    cmd = [args.inband, "bench", "dataplane", "--json"]
    for k in DEFAULTS:
        cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        print(f"error: {' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(cp.stdout)
    record = this_run.record(report.pop("paths"), profile={"name": "args", **{k: getattr(args, k) for k in DEFAULTS}},
                             inband=Path(args.inband), **report)
    results.write(args.results, record, render(record))
    return 0


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    p = record["profile"]
    out = [
        "## Data path cost\n",
        f"{results.provenance(record)}  \nEach path: the median of {p['samples']:,} single BPF_PROG_TEST_RUNs "
        "(fewer for new connections, handshakes and short headers without a flow: distinct clients for each).\n",
        "| path | traffic | mode | verdict | ns/packet | Mpps (1 core) | × floor |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in record["rows"]:
        out.append(f"| {r['path']} | {r['traffic']} | {r['mode']} | {r['verdict']} | {r['ns_per_packet']:.0f} | {r['mpps']:.2f} | "
                   f"{r['ratio_to_floor']:.2f} |")
    if f := record.get("flood"):
        out += [
            "",
            "| SYNs, never completed | backends (SNAT ports) | half-open table | forwarded | dropped (by reason) | half-open kept | "
            "established | ports taken from older handshakes | oldest 1000 kept | newest 1000 kept | new conns/s, 1 core |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
            f"| {f['syns']} | {f['backends']} ({f['snat_ports']}) | {f['half_open_table']} | {f['forwarded']} | "
            f"{f['dropped']} ({reasons(f['drops_by_reason'])}) | {f['half_open_in_table']} | {f['established_in_table']} | "
            f"{f['half_open_ports_preempted']} | {f['oldest_1000_kept']} | {f['newest_1000_kept']} | {f['new_conns_per_s_one_core']:.0f} |",
        ]
    if c := record.get("churn"):
        out += [
            "",
            "| connections opened and closed | backends (SNAT ports) | refused (by reason) | ports reused from closing flows | "
            "orphaned reservations reclaimed | flows left in table | connections/s, 1 core | wall s |",
            "|---:|---:|---|---:|---:|---:|---:|---:|",
            f"| {c['connections']} | {c['backends']} ({c['snat_ports']}) | {c['refused']} ({reasons(c['drops_by_reason'])}) | "
            f"{c['closing_ports_reused']} | {c['orphans_reclaimed']} | {c['flows_in_table']} | {c['connections_per_s_one_core']:.0f} | "
            f"{c['wall_s']:.1f} |",
        ]
    if s := record.get("sweep"):
        out += ["", "| flows swept | one sweep, ms | ns per flow |", "|---:|---:|---:|",
                f"| {s['flows']} | {s['sweep_ms']:.1f} | {s['ns_per_flow']:.0f} |"]
    return "\n".join(out) + "\n"


def reasons(by_reason: list) -> str:
    """The drop counters that moved ([name, n] pairs), `name n` each, or `none`."""
    shown = [f"{name} {n}" for name, n in by_reason if n]
    return ", ".join(shown) or "none"


if __name__ == "__main__":
    sys.exit(main())

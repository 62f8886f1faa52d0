"""The balancer's per-packet cost against the floor, as a record: runs
`inband bench dataplane --json` (BPF_PROG_TEST_RUN of every path of the
XDP program and of a bounce-only program, the floor on this CPU; a SYN
flood, a connection churn, a sweep of a full flow table, the cost as
backends and live flows grow, and the control plane's apply of the
largest configurations) and writes
results.json and results.md into --results (default
bench/results/dataplane):

    python -m bench.dataplane                  # as root; about a minute
    python -m bench.dataplane --samples 2000   # a shorter run
    python -m bench.dataplane --scale-flows ""  # without the growth sweep

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
# The growth sweep: live flows (each in a flow table sized for it; empty:
# no sweep) by backends per VIP, the VIP limit the largest.
SCALE = {"scale_flows": "10000,1000000,4000000", "scale_backends": "8,256,4096"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dataplane", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    for k, v in SCALE.items():
        ap.add_argument("--" + k.replace("_", "-"), default=v, help=f"comma-separated (default {v})")
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
    if args.scale_flows:
        cmd += ["--scale-flows", args.scale_flows, "--scale-backends", args.scale_backends]
    cmd.append("--control-plane")
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        print(f"error: {' '.join(cmd)} failed ({cp.returncode}): {cp.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(cp.stdout)
    record = this_run.record(report.pop("paths"), profile={"name": "args", **{k: getattr(args, k) for k in [*DEFAULTS, *SCALE]}},
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
    if g := record.get("scale"):
        out += render_scale(g)
    if c := record.get("control_plane"):
        out += render_control(c)
    return "\n".join(out) + "\n"


def render_scale(g: dict) -> list[str]:
    """The growth sweep's lines: cost by flow table and backends, then the
    memory of each flow table size. The SYNs per cell are scale.rs's
    SYN_SAMPLES."""
    out = [
        "",
        f"Cost as the tables grow (IPv4, dsr-dynamic, least-score; floor {g['floor_ns']:.0f} ns): a new connection "
        f"(the median of 3,000 distinct SYNs) and an established packet (the median over a different flow each packet, "
        f"{min(c['established_samples'] for c in g['cells']):,} to {max(c['established_samples'] for c in g['cells']):,} flows "
        f"a cell, each met for the first time; and over one flow again and again).\n",
        "| flow table | live flows | backends | new connection ns | × floor | established ns | × floor | one flow ns |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in g["cells"]:
        out.append(f"| {c['flow_table_size']:,} | {c['flows_in_table']:,} | {c['backends']:,} | {c['syn_ns']:.0f} | {c['syn_ratio']:.1f} | "
                   f"{c['established_ns']:.0f} | {c['established_ratio']:.1f} | {c['established_one_flow_ns']:.0f} |")
    out += [
        "",
        "| flow table | flows MiB | half_open MiB | half_open_ports MiB | snat MiB | flow tables MiB | all maps MiB | filled with | fill s "
        "| one sweep, ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in g["memory"]:
        by = dict(m["maps"])
        out.append(f"| {m['flow_table_size']:,} | {mib(by['flows'])} | {mib(by['half_open'])} | {mib(by['half_open_ports'])} | "
                   f"{mib(by['snat'])} | {mib(m['flow_tables_bytes'])} | {mib(m['all_maps_bytes'])} | {m['flows']:,} | {m['fill_s']:.1f} "
                   f"| {m['sweep_ms']:.1f} |")
    return out


def render_control(c: dict) -> list[str]:
    """The control plane's times: parsing the configuration, and writing it
    into the maps with the daemon's tables::apply."""
    out = ["", "| control plane | VIPs | backends | parse + validate ms | apply ms |", "|---|---:|---:|---:|---:|"]
    for s in c["steps"]:
        out.append(f"| {s['step']} | {s['vips']:,} | {s['backends']:,} | {s['parse_ms']:.1f} | {s['apply_ms']:.1f} |")
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def reasons(by_reason: list) -> str:
    """The drop counters that moved ([name, n] pairs), `name n` each, or `none`."""
    shown = [f"{name} {n}" for name, n in by_reason if n]
    return ", ".join(shown) or "none"


if __name__ == "__main__":
    sys.exit(main())

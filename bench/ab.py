"""Two builds of inband run alternately by one study's driver, every run's
record kept in one: what a change does to a number that moves from run to
run on this machine (a 1 MiB handoff's balancer CPU has moved between
0.10 and 0.17× proxying over five runs of one build), where one run of
each build, one after the other, can show a difference that is the
machine's.

    python -m bench.ab --study handoff --a NAME=BINARY --b NAME=BINARY [--pairs 2] -- [the study's arguments]

The runs go A B B A, `--pairs` times over: each build runs first as often
as second, so the machine drifting during the series weighs on both
alike. Each run is the study's own command (`python -m bench.STUDY`) with
`--inband` naming the build and `--out`/`--results` under --out. The
record (default bench/results/STUDY-ab) holds every run's record in
order; its tables give, per build, the study's A/B numbers
(`ab_numbers(record)` in the study's module: name -> one value per
round) pooled over its runs, their median and range, and each run's
median.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

from .lib.results import REPO, Run, default_dir, provenance
from .lib.results import write as write_results
from .lib.stats import percentile

STUDIES = ("handoff", "proxy")


def order(pairs: int) -> list[str]:
    """A B B A, `pairs` times over."""
    return ["a", "b", "b", "a"] * (pairs // 2) + ["a", "b"] * (pairs % 2)


def build(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=BINARY")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such binary")
    return name, path


def numbers(study: str, record: dict) -> dict[str, list[float]]:
    return importlib.import_module(f"bench.{study}").ab_numbers(record)


def fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def render(record: dict) -> str:
    study, builds = record["ab_of"], record["builds"]
    runs = [(r["build"], numbers(study, r["record"])) for r in record["runs"]]
    names = list(dict.fromkeys(n for _, vals in runs for n in vals))
    out = [provenance(record), ""]
    out.append(f"Builds: {', '.join(f'**{b}** (`{p}`)' for b, p in builds.items())}; runs in this order: {', '.join(r[0] for r in runs)}.")
    out += ["", "| number | build | runs | rounds | median | range | each run's median |", "|---|---|---|---|---|---|---|"]
    for n in names:
        for b in builds:
            per_run = [vals[n] for bb, vals in runs if bb == b and vals.get(n)]
            pooled = [v for vs in per_run for v in vs]
            if not pooled:
                continue
            out.append(
                f"| {n} | {b} | {len(per_run)} | {len(pooled)} | {fmt(percentile(pooled, 50))} | {fmt(min(pooled))}–{fmt(max(pooled))} | "
                + ", ".join(fmt(percentile(vs, 50)) for vs in per_run)
                + " |"
            )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", choices=STUDIES, required=True)
    ap.add_argument("--a", type=build, required=True, metavar="NAME=BINARY")
    ap.add_argument("--b", type=build, required=True, metavar="NAME=BINARY")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each build (default 2: A B B A)")
    ap.add_argument("--out", type=Path, required=True, help="each run's --out and --results (created)")
    ap.add_argument("--results", type=Path, help="the record (default: bench/results/STUDY-ab)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the study's own arguments")
    args = ap.parse_args(argv)
    if args.a[0] == args.b[0]:
        ap.error("the two builds need different names")
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    this_run = Run(f"{args.study}-ab", "bench.ab", argv)
    builds = {"a": args.a, "b": args.b}
    runs, failed = [], []
    for i, which in enumerate(order(args.pairs), 1):
        name, binary = builds[which]
        out, res = args.out / f"{i}-{name}", args.out / f"{i}-{name}-results"
        cmd = [sys.executable, "-m", f"bench.{args.study}", *rest, "--inband", binary, "--out", str(out), "--results", str(res)]
        print(f"== run {i}: {name}", flush=True)
        cp = subprocess.run(cmd, cwd=REPO)
        if cp.returncode != 0 or not (res / "results.json").exists():
            failed.append(f"run {i} ({name}): exit status {cp.returncode}")
            continue
        runs.append({"build": name, "record": json.loads((res / "results.json").read_text())})
    record = this_run.record([], ab_of=args.study, builds={n: p for n, p in builds.values()}, runs=runs, failed=failed)
    write_results(args.results or default_dir(f"{args.study}-ab"), record, render(record))
    for f in failed:
        print(f"failed: {f}", file=sys.stderr)
    return 1 if failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())

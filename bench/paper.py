"""Reproduces the paper's evaluation (Table 3, Fig. 3, Fig. 4) on a
network-namespace testbed, with HAProxy and nftables beside inband's five
modes under the same load:

    python -m bench.paper --profile quick --servers both --out results/quick-1

One client (Locust), one balancer, and a server set (`inband serve`, each
with `inband agent`): our three heterogeneous servers (`ours`), the paper's
two identical ones (`paper`), or both one after the other (`both`: a
results directory per set). Per configuration the servers
are restarted (so each run sees the same slowdown schedule), the balancer
under test is started, Locust runs headless for the profile's duration,
counters are read, and the balancer is stopped and removed again. At the
end: results.md (Table 3 and friends), results.csv, Fig. 3 and Fig. 4 as
PNG, and the record of the run (commit, machine, load average, the rows)
in --results (bench/results/paper): results.json and results.md. Everything started is torn
down on exit, Ctrl-C and SIGTERM included. See docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .lib import locust, paperbed, plots, preflight, results
from .lib.locust import RunResult
from .lib.procs import stop_signals_interrupt
from .lib.paperbed import BY_KEY, PAPER_ROWS, SERVER_SETS, Bench, option_bytes, run_configs  # noqa: F401 - PAPER_ROWS: the tests' rows


def main(argv=None) -> int:
    args = paperbed.parse_args(argv, __doc__)
    refused = preflight.refuse(paperbed.problems(args))
    if refused:
        return refused
    profile = paperbed.resolve_profile(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs = [BY_KEY[k] for k in args.configs.split(",")]
    # Both sets: the paper's identical servers only need the paper's rows
    # (round-robin is already optimal there), which keeps the demo short.
    paper_configs = [BY_KEY[k] for k in args.paper_configs.split(",")] if args.servers == "both" else configs
    record_run = results.Run("paper", "bench.paper", argv)
    sets = list(SERVER_SETS) if args.servers == "both" else [args.servers]
    stop_signals_interrupt()
    status = 0
    rows, described, failures = [], {}, []
    for name in sets:
        # One set: its raw data straight in --out; both: a directory each.
        set_out = out / name if len(sets) > 1 else out
        set_out.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, profile, set_out, SERVER_SETS[name])
        ran, failed, interrupted, elapsed = run_configs(bench, paper_configs if name == "paper" else configs)
        if interrupted:
            print(f"interrupted ({interrupted}); everything torn down", file=sys.stderr)
        if ran:
            write_raw(ran, set_out, profile.name, bench.duration_s)
            rows += [{"set": name, **r.to_json()} for r in ran]
            described[name] = {"setup": setup_text(bench, elapsed, name), "backend_labels": bench.backend_labels()}
        failures += [f"{name}: {key}: {err}" for key, err in failed]
        for key, err in failed:
            print(f"error: {name}: {key}: {err}", file=sys.stderr)
        if interrupted:
            return 130
        status = status or (1 if failed or not ran else 0)
    if rows:
        record = record_run.record(rows, profile={"name": profile.name, **dataclasses.asdict(profile)}, inband=Path(args.inband),
                                   tools=TOOLS, sets=described, failed=failures)
        results.write(Path(args.results), record, render(record))
    return status


# What the versions of the peers and of the load generator are taken from.
TOOLS = {"locust": [sys.executable, "-m", "locust", "--version"], "haproxy": ["haproxy", "-v"], "nftables": ["nft", "--version"],
         "iproute2": ["ip", "-V"]}


def setup_text(bench: Bench, elapsed_s: float, server_set: str) -> str:
    """What the run was, for the tables' preamble."""
    a, p = bench.args, bench.p
    spec = ", ".join(f"s{i} speed {s.speed:g}{s.describe()}" for i, s in enumerate(bench.specs, 1))
    options = (
        "authenticated options (SipHash, a key made for the run)" if bench.auth_key else "the seed paper's unauthenticated options"
    ) + f", {option_bytes(bench.auth_key is not None)} bytes per probe and per score"
    return (
        f"{a.users or p.users} users, spawn rate {a.spawn_rate or min(p.spawn_rate, a.users or p.users)}/s, {bench.duration_s} s per configuration, "
        f"back-to-back GETs, one connection per request, no warm-up discarded.  \n"
        f"Servers: {p.workers} workers each, service time {p.service_dist} with mean {p.service_ms:g} ms × time scale {p.time_scale:g} ÷ speed; {spec}; "
        f"{p.body_bytes} byte responses.  \n"
        f"Balancer link (traffic into the balancer): TBF {a.tbf_rate_mbit:g} Mbit/s, burst {a.tbf_burst_kb} KB, latency {a.tbf_latency_ms} ms.  \n"
        f"dsr-dynamic probes every {a.probe_interval}th packet per backend with {options}; dsr-polling polls every {a.poll_interval_ms} ms, "
        f"dsr-polling-100ms every {BY_KEY['dsr-polling-100ms'].poll_interval_ms} ms; dsr-query holds each new connection's SYN for a query round "
        "(at most the balancer's default query_timeout_ms, 20 ms).  \n"
        f"Servers started {min(bench.slowdown_offsets, default=0):.1f}–{max(bench.slowdown_offsets, default=0):.1f} s before the load "
        f"(their slowdown windows count from their start). Wall time of the set {elapsed_s:.0f} s.\n"
    )


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    failed = "\n**Failed:** " + "; ".join(record["failed"]) + "\n" if record.get("failed") else ""
    parts = []
    for name, d in record["sets"].items():
        ran = [RunResult.from_json(r) for r in record["rows"] if r["set"] == name]
        preamble = (f"# Paper evaluation, profile `{record['profile']['name']}`, servers `{name}`\n\n"
                    f"{results.provenance(record)}  \n" + d["setup"] + failed)
        parts.append(locust.markdown(ran, d["backend_labels"], preamble=preamble))
    return "\n".join(parts)


def write_raw(ran: list, out: Path, profile: str, duration_s: int) -> None:
    """What the tables do not hold: every configuration's results as CSV,
    requests per second over time, Fig. 3 and Fig. 4."""
    locust.write_csv(ran, out / "results.csv")
    locust.write_timeseries_csv(ran, out / "rps_timeseries.csv")
    suffix = f" — {profile}, {duration_s} s"
    plots.fig3_rps(ran, out / "fig3_rps.png", title_suffix=suffix)
    plots.fig4_ccdf(ran, out / "fig4_ccdf.png", title_suffix=suffix)


if __name__ == "__main__":
    sys.exit(main())

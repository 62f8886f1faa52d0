"""Where does in-band feedback beat asking? Per regime, dsr-dynamic against
the poller with the same packet budget, the best poller, dsr-query and
DSR round-robin, on bench.paper's testbed and machinery:

    python -m bench.regimes --out results/regimes

Budget: dsr-dynamic runs first; its score requests (options 124, counted
by the balancer as `probes_sent`) per second of load give the poll
interval at which the poller sends as many requests to the servers
(`control.polls_sent`, one packet per backend per round, counted over the
balancer's life). Both counts are reported, so the match is measured, not
assumed. The best poller asks every BEST_POLL_MS, packets regardless.

Several balancers cannot share this testbed's servers (one balancer
namespace), so B balancers are modelled: each sees 1/B of the traffic,
so it gets a score every B·n-th packet (dsr-dynamic runs with n = B·100),
and at an equal total budget each polls B times less often (the equal
poller follows from the measured probes as always); packet counts are
multiplied by B for the servers' view. Not modelled: that each balancer
does not see the others' placements.

Prints one table per regime and a summary; writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/regimes). See docs/benchmarks.md, "Regimes".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .lib import paperbed, preflight, profiles, results
from .lib.locust import RunResult, Summary
from .lib.paperbed import Bench, Configuration, ServerSpec
from .lib.procs import Interrupted, stop_signals_interrupt, uninterruptible
from .lib.report import fmt_ratio, fmt_time, table
from .lib.stats import ratio

BEST_POLL_MS = 10  # the freshness table's fastest poller (bench.forwarding)
PROBE_N = 100  # the paper's n
WIN_RPS, WIN_P99 = 1.3, 0.7  # the bar: dynamic ÷ poller


@dataclass(frozen=True)
class Regime:
    key: str
    what: str
    servers: int = 3
    users: int = 150
    slowdowns: bool = True  # random 5x windows on every server
    balancers: int = 1  # modelled, see the module's doc
    probe_n: int = PROBE_N  # dsr-dynamic's n (× balancers), its budget
    probe_max: int | None = None  # the adaptive n's upper bound


REGIMES = (
    Regime("heavy-tail", "lognormal service (σ 0.8), identical servers, nothing slowed", slowdowns=False),
    Regime("slowdowns", "heavy tail + each server 5× slower for 2–4 s, twice, at random"),
    Regime("users-75", "as slowdowns", users=75),
    Regime("users-300", "as slowdowns", users=300),
    Regime("servers-2", "as slowdowns, 2 servers", servers=2),
    Regime("servers-4", "as slowdowns, 4 servers", servers=4),
    Regime("balancers-2", "as slowdowns, 2 balancers (modelled)", balancers=2),
    Regime("balancers-4", "as slowdowns, 4 balancers (modelled)", balancers=4),
    # A tenth of the budget: the equal poller's interval grows past the
    # mean service time, where staleness should start to cost.
    Regime("lean-budget", "as slowdowns, n = 1000", probe_n=1000),
    # The adaptive n spends probes where the score moves.
    Regime("adaptive", "as slowdowns, n = 100..1000 adaptive", probe_max=1000),
)
BY_KEY = {r.key: r for r in REGIMES}


@dataclass(frozen=True)
class Profile:
    paper_profile: str  # bench.paper's profile: time scale, workers, service time
    duration_s: int
    regimes: tuple
    users_scale: float  # the tiny grid runs a fraction of each regime's users


PROFILES = {
    "quick": Profile("quick", 20, tuple(BY_KEY), 1.0),
    # The test: the rows and budgets, not what wins.
    "tiny": Profile("tiny", 5, ("slowdowns", "balancers-2"), 0.15),
}


def users(regime: Regime, profile: Profile) -> int:
    return max(2, round(regime.users * profile.users_scale))


def slowdown_windows(rng: random.Random, duration_s: int, count: int = 2, factor: float = 5.0) -> tuple:
    """`count` windows of 2–4 s (fractions of the run, bench.paper's unit)
    at random places in the run."""
    out = []
    for _ in range(count):
        length = min(rng.uniform(2.0, 4.0), duration_s / 2) / duration_s
        out.append((rng.uniform(0.0, 1.0 - length), length, factor))
    return tuple(sorted(out))


def specs_for(regime: Regime, duration_s: int, seed: int) -> tuple:
    """Identical servers (speed 1): every difference between them is the
    regime's, changing within the run. One schedule per regime, the same for
    every configuration in it."""
    rng = random.Random(f"{seed}-{regime.key}")
    return tuple(ServerSpec(1.0, slowdown_windows(rng, duration_s) if regime.slowdowns else ()) for _ in range(regime.servers))


@dataclass
class Row:
    """One configuration's run in a regime, with what its feedback cost."""

    key: str
    label: str
    interval: str
    result: RunResult
    lifetime_s: float  # balancer start to status read: the polls' period

    @property
    def s(self) -> Summary:
        return self.result.summary()

    @property
    def requests_to_servers(self) -> int:
        """Feedback requests that reached a server: 124 options, or poll and
        query packets."""
        o = self.result.overhead
        return o.probes + o.polls


def equal_poll_ms(servers: int, probes: int, window_s: float) -> int:
    """The poll interval that sends as many requests to the servers as
    `probes` score requests over `window_s`: a round asks every server."""
    if probes <= 0:
        raise RuntimeError("dsr-dynamic sent no score request: there is no budget to match")
    return max(1, round(servers * window_s * 1000 / probes))


def run_regime(bench: Bench, regime: Regime, profile: Profile, out: Path) -> list[Row]:
    bench.out = out / regime.key
    bench.specs = specs_for(regime, profile.duration_s, bench.args.seed)
    bench.args.users = users(regime, profile)
    bench.args.spawn_rate = bench.args.users
    rows: list[Row] = []

    def run(key: str, label: str, interval: str, c: Configuration) -> Row:
        bench.log(f"{regime.key}: {key} ({interval})")
        res = bench.run_config(replace(c, key=key, label=label))
        meta = json.loads((bench.out / key / "meta.json").read_text())
        row = Row(key, label, interval, res, meta["status_read"] - meta["balancer_started"])
        rows.append(row)
        return row

    n = regime.probe_n * regime.balancers
    hi = regime.probe_max and regime.probe_max * regime.balancers
    dyn = run(
        "dsr-dynamic",
        "dsr-dynamic (in-band)",
        f"n = {n}..{hi} adaptive" if hi else f"n = {n}",
        replace(paperbed.BY_KEY["dsr-dynamic"], probe_interval=n, probe_interval_max=hi),
    )
    w = dyn.result.window
    eq_ms = equal_poll_ms(regime.servers, dyn.result.overhead.probes, w[1] - w[0])
    polling = paperbed.BY_KEY["dsr-polling"]
    run("poll-equal", "dsr-polling, equal budget", f"{eq_ms} ms", replace(polling, poll_interval_ms=eq_ms))
    run("poll-best", "dsr-polling, best poller", f"{BEST_POLL_MS} ms", replace(polling, poll_interval_ms=BEST_POLL_MS))
    run("dsr-query", "dsr-query (ask before forwarding)", "per SYN batch", paperbed.BY_KEY["dsr-query"])
    # The control: what the balancer knows by itself, counting its own
    # connections, with no feedback at all.
    run("dsr-leastconn", "DSR least-connections (own counts, no feedback)", "–", replace(paperbed.BY_KEY["dsr-rr"], policy="least-connections"))
    run("dsr-rr", "DSR round-robin", "–", paperbed.BY_KEY["dsr-rr"])
    return rows


# ------------------------------------------------------------------ tables


def budget_match(rows: list[Row]) -> float:
    """Poll requests per second of the equal poller ÷ score requests per
    second of dsr-dynamic: 1.0 is a matched budget."""
    by = {r.key: r for r in rows}
    dyn, eq = by["dsr-dynamic"], by["poll-equal"]
    w = dyn.result.window
    dyn_rate = dyn.result.overhead.probes / (w[1] - w[0])
    return (eq.result.overhead.polls / eq.lifetime_s) / dyn_rate if dyn_rate else float("nan")


def regime_table(regime: Regime, rows: list[Row]) -> str:
    dyn = next(r for r in rows if r.key == "dsr-dynamic").s
    b = regime.balancers
    headers = [
        "configuration",
        "interval",
        "RPS",
        "p50",
        "p99",
        "failures",
        f"feedback requests to servers per request{' (× balancers)' if b > 1 else ''}",
        f"extra packets per request{' (× balancers)' if b > 1 else ''}",
        "dynamic RPS ÷ this",
        "dynamic p99 ÷ this",
    ]
    out = []
    for r in rows:
        s, o = r.s, r.result.overhead
        per = (lambda x: f"{b * x / s.requests:.3f}") if s.requests else (lambda x: "–")
        out.append(
            [
                r.label,
                r.interval,
                f"{s.rps:.1f}",
                fmt_time(s.median_ms),
                fmt_time(s.pct_ms[99]),
                str(s.failures),
                per(r.requests_to_servers),
                per(o.extra_packets),
                fmt_ratio(ratio(dyn.rps, s.rps)),
                fmt_ratio(ratio(dyn.pct_ms[99], s.pct_ms[99])),
            ]
        )
    return table(headers, out)


def verdict(rps_eq: float | None, p99_eq: float | None, rps_best: float | None, p99_best: float | None) -> str:
    """A ratio that could not be taken (None) wins nothing."""

    def beats(rps, p99) -> bool:
        return (rps is not None and rps >= WIN_RPS) or (p99 is not None and p99 <= WIN_P99)

    hits = []
    if beats(rps_eq, p99_eq):
        hits.append("beats the equal-budget poller")
    if beats(rps_best, p99_best):
        hits.append("beats the best poller")
    return "; ".join(hits) or f"no win by the bar (≥ {WIN_RPS}× RPS or ≤ {WIN_P99}× p99)"


def summary_table(by_regime: dict) -> str:
    headers = [
        "regime",
        "dynamic RPS",
        "equal poll interval",
        "budget match (polls ÷ probes per s)",
        "dyn ÷ equal: RPS",
        "p99",
        "dyn ÷ best: RPS",
        "p99",
        "dyn ÷ query: RPS",
        "p99",
        "dyn ÷ least-connections: RPS",
        "p99",
        "dyn ÷ rr: RPS",
        "verdict",
    ]
    out = []
    for key, rows in by_regime.items():
        by = {r.key: r for r in rows}
        d = by["dsr-dynamic"].s

        def against(k: str, what: str) -> float | None:
            if k not in by:
                return None
            s = by[k].s
            return ratio(d.rps, s.rps) if what == "rps" else ratio(d.pct_ms[99], s.pct_ms[99])

        out.append(
            [
                key,
                f"{d.rps:.1f}",
                by["poll-equal"].interval if "poll-equal" in by else "–",
                f"{budget_match(rows):.2f}" if "poll-equal" in by else "–",
                fmt_ratio(against("poll-equal", "rps")),
                fmt_ratio(against("poll-equal", "p99")),
                fmt_ratio(against("poll-best", "rps")),
                fmt_ratio(against("poll-best", "p99")),
                fmt_ratio(against("dsr-query", "rps")),
                fmt_ratio(against("dsr-query", "p99")),
                fmt_ratio(against("dsr-leastconn", "rps")),
                fmt_ratio(against("dsr-leastconn", "p99")),
                fmt_ratio(against("dsr-rr", "rps")),
                verdict(against("poll-equal", "rps"), against("poll-equal", "p99"), against("poll-best", "rps"), against("poll-best", "p99")),
            ]
        )
    return table(headers, out)


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.regimes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the run's raw data: logs, every request (created)")
    ap.add_argument("--results", type=Path, default=results.default_dir("regimes"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--regimes", help=f"comma-separated subset of: {', '.join(BY_KEY)} (default: the profile's)")
    ap.add_argument("--name", default="rg", help="testbed name (namespaces NAME-lb, NAME-c1, ...)")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--seed", type=int, default=1, help="the slowdown schedules")
    args = ap.parse_args(argv)
    keys = (args.regimes or ",".join(PROFILES[args.profile].regimes)).split(",")
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        ap.error(f"unknown regime(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    args.regime_keys = keys
    return args


def paper_args(args, profile: Profile, out: Path):
    """bench.paper's own options for its Bench: its defaults, this run's
    testbed, duration and the paper profile's time scale."""
    pa = paperbed.parse_args(
        ["--out", str(out), "--profile", profile.paper_profile, "--name", args.name, "--inband", args.inband, "--duration", str(profile.duration_s)]
    )
    pa.configs = "dsr-dynamic,dsr-polling,dsr-query,dsr-rr"
    pa.seed = args.seed
    return pa


def main(argv=None) -> int:
    args = parse_args(argv)
    profile = PROFILES[args.profile]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pa = paper_args(args, profile, out)
    refused = preflight.refuse(paperbed.problems(pa))
    if refused:
        return refused
    pprofile = paperbed.resolve_profile(pa)
    this_run = results.Run("regimes", "bench.regimes", argv)
    regimes = [BY_KEY[k] for k in args.regime_keys]
    by_regime: dict[str, list[Row]] = {}
    failed: list[tuple[str, str]] = []
    interrupted = None
    stop_signals_interrupt()
    # One testbed per server count: regimes are grouped by it.
    for servers in dict.fromkeys(r.servers for r in regimes):
        bench = Bench(pa, pprofile, out, tuple(ServerSpec(1.0) for _ in range(servers)))
        try:
            bench.setup()
            for regime in (r for r in regimes if r.servers == servers):
                try:
                    by_regime[regime.key] = run_regime(bench, regime, profile, out)
                    print(f"\n### {regime.key}\n\n{regime_table(regime, by_regime[regime.key])}\n", flush=True)
                except (Interrupted, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 - one broken regime must not hide the others
                    failed.append((regime.key, f"{e.__class__.__name__}: {e}"))
                    bench.log(f"{regime.key}: FAILED: {e}")
        except (Interrupted, KeyboardInterrupt) as e:
            interrupted = str(e) or "SIGINT"
        except Exception as e:  # noqa: BLE001 - set-up failed: report, tear down
            failed.append((f"testbed with {servers} servers", f"{e.__class__.__name__}: {e}"))
        finally:
            with uninterruptible():
                bench.teardown()
            if interrupted is None:
                stop_signals_interrupt()
        if interrupted:
            break

    rows = [{"regime": key, "key": r.key, "label": r.label, "interval": r.interval, "lifetime_s": r.lifetime_s, "result": r.result.to_json()}
            for key, rs in by_regime.items() for r in rs]
    record = this_run.record(rows, profile=profiles.as_json(args.profile, profile), inband=Path(args.inband), paper_profile=asdict(pprofile),
                        regimes=args.regime_keys, failed=[f"{k}: {e}" for k, e in failed])
    results.write(args.results, record, render(record))
    for key, err in failed:
        print(f"error: {key}: {err}", file=sys.stderr)
    if interrupted:
        print(f"interrupted ({interrupted}); everything torn down", file=sys.stderr)
        return 130
    return 1 if failed or not by_regime else 0


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    profile, pp = Profile(**{k: v for k, v in record["profile"].items() if k != "name"}), record["paper_profile"]
    by_regime: dict[str, list[Row]] = {}
    for r in record["rows"]:
        by_regime.setdefault(r["regime"], []).append(Row(r["key"], r["label"], r["interval"], RunResult.from_json(r["result"]), r["lifetime_s"]))
    parts = [
        "# Regimes: in-band feedback against asking\n",
        f"{results.provenance(record)}  \n"
        f"{profile.duration_s} s per run; identical servers, {pp['workers']} workers each, {pp['service_dist']} service with mean "
        f"{pp['service_ms'] * pp['time_scale']:g} ms; dsr-dynamic n = {PROBE_N} (unless the regime says otherwise) × balancers; "
        f"best poller every {BEST_POLL_MS} ms; load generator, balancer and servers share the CPUs.  \n"
        "Ratios are dynamic ÷ the other: RPS > 1 and p99 < 1 favour dynamic. "
        "Budget match: the equal poller's poll requests per second of its balancer's life ÷ dynamic's score requests per second of load.\n",
    ]
    if record["failed"]:
        parts.append("**Failed:** " + "; ".join(record["failed"]) + "\n")
    missing = [k for k in ("dsr-leastconn",) if not any(r["key"] == k for r in record["rows"])]
    if missing:
        parts.append(f"This record predates the row(s) {', '.join(missing)}: their columns read – until the next run.\n")
    parts += ["## Summary\n", summary_table(by_regime) + "\n"]
    for regime in (BY_KEY[k] for k in record["regimes"]):
        if regime.key in by_regime:
            parts += [f"## {regime.key}: {regime.what}, {users(regime, profile)} users\n", regime_table(regime, by_regime[regime.key]) + "\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())

"""Score-ranked backends in `inband proxy` (issue 33, item 6): least-score
against least-request, with round-robin as a control, on heterogeneous
backends that slow down at random:

    python -m bench.scores

A namespace testbed (`inband testbed`): three servers running `inband
serve` (4 workers each, exponential service time; the third at half
speed), each with `inband agent` (`score = "requests"`: connections with
a request in flight; the proxy's own are left out, as its address is in
`balancers`); `inband proxy` in the balancer's namespace over the three;
wrk in the client's namespace, closed loop through the proxy. The random
slowdowns are other clients: bursts of wrk straight to one server at a
time (on for 1–2 s, off for 1–4 s, per server, from a seeded schedule),
which fill its workers with requests the proxy does not see. Each
repetition draws one schedule and runs it under every policy, in an
order that rotates, so the policies meet the same bursts.

Per run: the proxy's throughput, p50 and p99 (wrk's, closed loop: a
request's latency starts when its connection sends it), errors, and the
share of requests each backend got (the proxy's origin_requests). Writes
the record (results.json) and its tables (results.md) into --results
(default bench/results/scores); docs/benchmarks.md ("Score-ranked
backends") holds the same tables (`python -m bench.docs`). Every process
is stopped and the testbed removed at the end, on Ctrl-C and SIGTERM too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .lib import preflight, profiles, results
from .lib.procs import Interrupted, ns_argv, run, stop_signals_interrupt, uninterruptible, wait_until
from .lib.report import table
from .lib.stats import ratio
from .lib.testbed import TestbedRun, alive, new_auth_key
from .lib.tools import WRK_SUMMARY_LUA, parse_wrk

# Each run's proxy: its policy and [scores] busy_margin. least-score with
# 0 is a control: plain two choices and no hedging, what the ranking alone
# gives.
# The floor: the same bursts sent to a fourth server outside the pool, so
# the machine's CPUs carry the same load but no request can meet a burst:
# the p99 no placement can go below on this machine (least-request there).
RUNS = {"least-score": ("least-score", 4), "least-score-unhedged": ("least-score", 0), "least-request": ("least-request", 0),
        "round-robin": ("round-robin", 0), "floor": ("least-request", 0)}  # fmt: skip
POLICIES = tuple(RUNS)
LABELS = {"least-score-unhedged": "`least-score`, `busy_margin = 0` (plain two choices, no hedging)", "floor": "floor: the bursts on a server outside the pool"}
# The server outside the pool, which takes the floor run's bursts.
ELSEWHERE = 4
SERVICE_PORT = 8080
PROXY_PORT = 8000
METRICS_PORT = 8001
TARGET_P99 = 0.8  # the issue's bar: least-score's p99 ÷ least-request's



@dataclass(frozen=True)
class Profile:
    seconds: int  # one run's load
    repetitions: int
    connections: int  # wrk's through the proxy
    service_ms: float  # mean, at speed 1
    slow_speed: float  # the third server's speed
    burst_connections: int  # each burst's wrk, straight to one server
    burst_on_s: tuple  # uniform range
    burst_off_s: tuple
    interval_ms: int  # the proxy's [scores] interval_ms


PROFILES = {
    "default": Profile(seconds=15, repetitions=3, connections=6, service_ms=10.0, slow_speed=0.5, burst_connections=12,
                       burst_on_s=(1.0, 2.0), burst_off_s=(1.0, 4.0), interval_ms=20),
    # No bursts: the floor the machine and the servers set.
    "calm": Profile(seconds=10, repetitions=1, connections=6, service_ms=10.0, slow_speed=0.5, burst_connections=0,
                    burst_on_s=(1.0, 2.0), burst_off_s=(1.0, 4.0), interval_ms=20),
    "quick": Profile(seconds=5, repetitions=1, connections=6, service_ms=10.0, slow_speed=0.5, burst_connections=12,
                     burst_on_s=(1.0, 2.0), burst_off_s=(1.0, 4.0), interval_ms=20),
}  # fmt: skip


def schedule(seed: int, servers: int, seconds: float, p: Profile) -> list:
    """[(start_s, duration_s, server)]: each server's bursts, on and off at
    random from a random phase."""
    rng = random.Random(seed)
    out = []
    if p.burst_connections == 0:
        return out
    for s in range(1, servers + 1):
        t = rng.uniform(0, p.burst_off_s[1])
        while t < seconds:
            on = rng.uniform(*p.burst_on_s)
            out.append((round(t, 3), round(min(on, seconds - t), 3), s))
            t += on + rng.uniform(*p.burst_off_s)
    return sorted(out)


class Bench(TestbedRun):
    def __init__(self, inband, name: str, p: Profile, out: Path) -> None:
        super().__init__(inband, name)
        self.p = p
        self.out = out
        self.lua = out / "bench.lua"

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.lua.write_text(WRK_SUMMARY_LUA)
        self.bring_up(servers=4)
        self.auth_key = new_auth_key(self.inband, self.out)
        for i in (1, 2, 3, ELSEWHERE):
            node = f"s{i}"
            speed = self.p.slow_speed if i == 3 else 1.0
            argv = [str(self.inband), "serve", "--listen", f"0.0.0.0:{SERVICE_PORT}", "--workers", "4", "--service-ms", str(self.p.service_ms), "--service-dist", "constant",
                    "--speed", str(speed), "--keep-alive", "--body-bytes", "1024"]  # fmt: skip
            self.procs.spawn(f"server {node}", self.ns(node), argv, self.out / f"serve-{node}.log")
        self.start_agents(["s1", "s2", "s3", f"s{ELSEWHERE}"], self.out, self.out, SERVICE_PORT, score="requests")
        for i in (1, 2, 3, ELSEWHERE):
            url = f"http://{self.tb.addr(f's{i}')}:{SERVICE_PORT}/stats"
            wait_until(f"server s{i}", lambda url=url: run(self.ns("lb"), ["curl", "-sf", "--max-time", "1", url], check=False).returncode == 0, 30)

    def proxy_toml(self, run: str) -> str:
        lb = self.tb.addr("lb")
        backends = ", ".join(f'"{self.tb.addr(f"s{i}")}:{SERVICE_PORT}"' for i in (1, 2, 3))
        policy, margin = RUNS[run]
        return (
            f'listen = "{lb}:{PROXY_PORT}"\nmetrics_listen = "{lb}:{METRICS_PORT}"\nbackends = [{backends}]\npolicy = "{policy}"\n'
            f"workers = 1\n\n[scores]\ninterval_ms = {self.p.interval_ms}\nbusy_margin = {margin}\n\n"
            f'[auth]\nkeys = [{{ id = 1, file = "{self.auth_key}" }}]\n'
        )

    def metrics(self) -> str:
        url = f"http://{self.tb.addr('lb')}:{METRICS_PORT}/metrics"
        return run(self.ns("lb"), ["curl", "-s", "--max-time", "2", url], check=False).stdout

    def hedges(self) -> list:
        """The proxy's hedges and hedges won, over every backend."""
        text = self.metrics()
        return [sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(f"inband_proxy_{name}_total{{"))
                for name in ("hedges", "hedges_won")]

    def origin_requests(self) -> list:
        text = self.metrics()
        out = []
        for i in (1, 2, 3):
            want = f'backend="{self.tb.addr(f"s{i}")}:{SERVICE_PORT}"'
            line = next(ln for ln in text.splitlines() if ln.startswith("inband_proxy_origin_requests_total{") and want in ln)
            out.append(int(float(line.rsplit(" ", 1)[1])))
        return out

    def one(self, policy: str, bursts: list, rep: int) -> dict:
        cfg = self.out / f"proxy-{policy}.toml"
        cfg.write_text(self.proxy_toml(policy))
        log = self.out / f"proxy-{policy}.log"
        proxy = self.procs.spawn(f"proxy {policy}", self.ns("lb"), [str(self.inband), "proxy", "--config", str(cfg)], log)
        try:
            wait_until("the proxy", lambda: alive(proxy, "inband proxy", log) and "inband_proxy_origin_requests" in self.metrics(), 30)
            if RUNS[policy][0] == "least-score":
                wait_until("every backend's score", lambda: self.metrics().count("inband_proxy_backend_score{") == 3
                           and "-1" not in [ln.rsplit(" ", 1)[1] for ln in self.metrics().splitlines() if ln.startswith("inband_proxy_backend_score{")], 10)  # fmt: skip
            before = self.origin_requests()
            hedges_before = self.hedges()
            stop = threading.Event()
            t0 = time.monotonic()
            wall0 = time.time()

            def background():
                for start, dur, s in bursts:
                    if stop.wait(max(0.0, t0 + start - time.monotonic())):
                        return
                    target = ELSEWHERE if policy == "floor" else s
                    url = f"http://{self.tb.addr(f's{target}')}:{SERVICE_PORT}/"
                    argv = ["wrk", "-t1", f"-c{self.p.burst_connections}", f"-d{max(1, round(dur))}s", url]
                    threading.Thread(target=run, args=(self.ns("c1"), argv), kwargs={"timeout": dur + 30, "check": False}, daemon=True).start()

            # What the proxy held as each backend's score, sampled: whether
            # the scores saw the bursts at all.
            samples = []

            def sample():
                while not stop.wait(0.1):
                    vals = {}
                    for ln in self.metrics().splitlines():
                        if ln.startswith("inband_proxy_backend_score{"):
                            vals[ln.split('backend="', 1)[1].split('"', 1)[0]] = float(ln.rsplit(" ", 1)[1])
                    samples.append([round(time.monotonic() - t0, 2)] + [vals.get(f"{self.tb.addr(f's{i}')}:{SERVICE_PORT}", -1.0) for i in (1, 2, 3)])

            bg = threading.Thread(target=background, daemon=True)
            bg.start()
            # Under every policy, so that each run pays its cost.
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            url = f"http://{self.tb.addr('lb')}:{PROXY_PORT}/"
            argv = ["wrk", "-t1", f"-c{self.p.connections}", f"-d{self.p.seconds}s", "--timeout", "5s", "-s", str(self.lua), url]
            w = parse_wrk(run(self.ns("c1"), argv, timeout=self.p.seconds + 60).stdout)
            stop.set()
            bg.join(timeout=5)
            if sampler.is_alive():
                sampler.join(timeout=5)
            after = self.origin_requests()
            hedges = [a - b for a, b in zip(self.hedges(), hedges_before)]
            stale = sum(float(ln.rsplit(" ", 1)[1]) for ln in self.metrics().splitlines() if ln.startswith("inband_proxy_score_stale_total{"))
        finally:
            self.procs.stop(proxy)
        scored = RUNS[policy][0] == "least-score"
        if scored:
            (self.out / f"scores-{policy}-{rep}.json").write_text(json.dumps({"bursts": bursts, "samples": samples}))
        got = [a - b for a, b in zip(after, before)]
        total = sum(got) or 1
        row = {
            "policy": policy,
            "repetition": rep,
            "requests": w["requests"],
            "rps": round(w["requests"] / (w["duration_us"] / 1e6), 1),
            "p50_ms": w["p50_us"] / 1000,
            "p99_ms": w["p99_us"] / 1000,
            "errors": w["errors"] + w["status_errors"],
            "share": [round(g / total, 3) for g in got],
            "stale": int(stale),
            # least-score: requests also sent to a second backend when a
            # score showed theirs busy, and of them answered from there.
            "hedges": int(hedges[0]),
            "hedges_won": int(hedges[1]),
            # The slowest 1% of the proxy's requests (its access log), and
            # how many of them overlapped a burst on the backend that
            # answered them.
            "tail": slowest_met_bursts(log, wall0, bursts, {f"{self.tb.addr(f's{i}')}:{SERVICE_PORT}": i for i in (1, 2, 3)},
                                       elsewhere=policy == "floor"),
            "bursts": len(bursts),
            # least-score only: per backend, the largest score the proxy
            # held and the share of 100 ms samples with a score above 0.
            "score_max": [max((x[i + 1] for x in samples), default=None) if scored else None for i in range(3)],
            "score_busy": [round(sum(1 for x in samples if x[i + 1] > 0) / len(samples), 3) if scored and samples else None
                           for i in range(3)],
        }
        self.log(f"  {policy}: {row['rps']} req/s, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, share {row['share']}, errors {row['errors']}"
                 + (f", hedged {row['hedges']} ({row['hedges_won']} answered from the second)" if scored else "")
                 + (f", scores max {row['score_max']} busy {row['score_busy']}" if scored else ""))
        return row

    def study(self) -> list:
        rows = []
        for rep in range(self.p.repetitions):
            bursts = schedule(1000 + rep, 3, self.p.seconds, self.p)
            order = POLICIES[rep % len(POLICIES):] + POLICIES[: rep % len(POLICIES)]
            self.log(f"repetition {rep + 1}/{self.p.repetitions}: {len(bursts)} bursts, order {', '.join(order)}")
            for policy in order:
                rows.append(self.one(policy, bursts, rep))
                # The bursts of the run before must be over.
                time.sleep(2)
        return rows


def access_lines(log: Path, since: float) -> list:
    """(start, end, upstream) of each request in the proxy's access log
    that ended after `since` (wall-clock seconds)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "inband_proxy::access" not in line:
            continue
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        try:
            end = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
            ms = float(fields["ms"])
        except (KeyError, ValueError):
            continue
        if end >= since:
            out.append((end - ms / 1e3, end, fields.get("upstream", "-")))
    return out


def slowest_met_bursts(log: Path, wall0: float, bursts: list, server_of: dict, elsewhere: bool = False) -> dict:
    """Of the slowest 1% of the run's requests, how many overlapped a burst
    (as the generator ran it: whole seconds) on the backend that answered."""
    reqs = access_lines(log, wall0)
    reqs.sort(key=lambda r: r[1] - r[0], reverse=True)
    slow = reqs[: max(1, len(reqs) // 100)] if reqs else []

    def met(r) -> bool:
        s = server_of.get(r[2])
        return not elsewhere and any(srv == s and wall0 + b < r[1] and r[0] < wall0 + b + max(1, round(d)) for b, d, srv in bursts)

    return {"n": len(slow), "met_burst": sum(1 for r in slow if met(r)), "min_ms": round((slow[-1][1] - slow[-1][0]) * 1e3, 1) if slow else None}


def spread(xs: list) -> str:
    if not xs:
        return "–"
    m = statistics.mean(xs)
    return f"{m:.1f} ({min(xs):.1f}–{max(xs):.1f})"


def render(r: dict) -> str:
    rows = r["rows"]
    p = r["profile"]
    lines = [
        "## Score-ranked backends: least-score against least-request",
        "",
        results.provenance(r),
        "",
        f"Three `inband serve` backends (4 workers, constant service of {p['service_ms']:g} ms; the third at speed {p['slow_speed']:g}), "
        f"each with `inband agent` (`score = \"requests\"`); other clients' bursts of {p['burst_connections']} connections straight to one "
        f"server at a time (on {p['burst_on_s'][0]:g}–{p['burst_on_s'][1]:g} s, off {p['burst_off_s'][0]:g}–{p['burst_off_s'][1]:g} s, per server); "
        f"wrk, {p['connections']} connections closed loop through `inband proxy` (one worker, debug build) for {p['seconds']} s per run; "
        f"scores polled every {p['interval_ms']} ms. {p['repetitions']} repetitions, each one burst schedule under every policy. "
        "Mean (min–max) over repetitions. The machine has 2 cores shared by the load generators, the proxy, the servers, the agents "
        "and other work.",
        "",
    ]
    body = []
    for policy in POLICIES:
        mine = [x for x in rows if x["policy"] == policy]
        if not mine:
            continue
        share = [statistics.mean(x["share"][i] for x in mine) for i in range(3)]
        requests = sum(x["requests"] for x in mine) or 1
        # Records from before hedging have no count: "–", not 0.
        hedged = f"{100 * sum(x['hedges'] for x in mine) / requests:.2f} % ({sum(x['hedges_won'] for x in mine)})" if all("hedges" in x for x in mine) else "–"
        tail = f"{sum(x['tail']['met_burst'] for x in mine)} of {sum(x['tail']['n'] for x in mine)}" if all("tail" in x for x in mine) else "–"
        body.append([LABELS.get(policy, f"`{policy}`"), spread([x["rps"] for x in mine]), spread([x["p50_ms"] for x in mine]), spread([x["p99_ms"] for x in mine]),
                     " / ".join(f"{s:.2f}" for s in share), hedged, tail, sum(x["errors"] for x in mine)])  # fmt: skip
    lines.append(table(["policy", "req/s", "p50 ms", "p99 ms", "share s1 / s2 / s3 (slow)", "hedged (answered from the second)",
                        "slowest 1% that met a burst on their backend", "errors"], body))
    def ratios(run: str) -> list:
        per_rep = []
        for rep in sorted({x["repetition"] for x in rows}):
            by = {x["policy"]: x for x in rows if x["repetition"] == rep}
            if run in by and "least-request" in by:
                per_rep.append(ratio(by[run]["p99_ms"], by["least-request"]["p99_ms"]))
        return per_rep

    per_rep = ratios("least-score")
    if per_rep:
        mean = statistics.mean(per_rep)
        verdict = "meets" if mean <= TARGET_P99 else "does not meet"
        lines += [
            "",
            f"least-score's p99 ÷ least-request's, per repetition: {', '.join(f'{x:.2f}' for x in per_rep)}; mean {mean:.2f}, "
            f"which {verdict} the target (≤ {TARGET_P99}).",
        ]
    unhedged = ratios("least-score-unhedged")
    if unhedged:
        lines.append(f"With `busy_margin = 0`: {', '.join(f'{x:.2f}' for x in unhedged)}; mean {statistics.mean(unhedged):.2f}.")
    floor = ratios("floor")
    if floor:
        lines.append(f"The floor's p99 ÷ least-request's (the least any placement could reach with these bursts on this machine): "
                     f"{', '.join(f'{x:.2f}' for x in floor)}; mean {statistics.mean(floor):.2f}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scores", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default")
    ap.add_argument("--seconds", type=int)
    ap.add_argument("--repetitions", type=int)
    ap.add_argument("--name", default="scores", help="the testbed's name (1-8 of a-z, 0-9)")
    ap.add_argument("--out", default="/tmp/inband-bench-scores", help="configs and logs")
    ap.add_argument("--results", default=str(results.default_dir("scores")))
    args = ap.parse_args(argv)
    refused = preflight.refuse(preflight.problems(inband=args.inband, tools=("wrk", "curl"), testbed_name=args.name))
    if refused:
        return refused
    p = profiles.choose(PROFILES, args.profile, seconds=args.seconds, repetitions=args.repetitions)
    stop_signals_interrupt()
    bench = Bench(args.inband, args.name, p, Path(args.out))
    record_run = results.Run("scores", "bench.scores", argv)
    try:
        bench.setup()
        rows = bench.study()
    except (KeyboardInterrupt, Interrupted):
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        with uninterruptible():
            bench.teardown()
    record = record_run.record(rows, profile=profiles.as_json(args.profile, p), inband=bench.inband)
    results.write(Path(args.results), record, render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where does in-band feedback beat asking, and beat no feedback at all? Per
regime, dsr-dynamic against the poller with the same packet budget, the
best poller, dsr-query, DSR least-connections with no feedback (the
control), HAProxy leastconn and DSR round-robin, on bench.paper's testbed
and machinery, each cell repeated:

    python -m bench.regimes --out results/regimes              # the issue's regimes (quick)
    python -m bench.regimes --out results/regimes-ten --profile ten  # the first study's ten
    python -m bench.regimes --out DIR --profile fleet --results bench/results/fleet  # several real balancers

The regimes where the balancer cannot know the load by itself (with one
connection per request and nothing else on the servers, its own count of
connections opened and closed since the last score already is the load):

- on-off: the users send for 1–2 s, then pause 3–4 s (seeded), while the
  servers slow down at random. In-band reports come only while traffic
  flows; polls come at a fixed rate, paused or not.
- keep-alive: each user keeps its connection for a mean of 8 requests,
  thinking between them, and requests cost what LLM inference costs: 8
  slots per server (`inband serve --workers`), lognormal service with
  σ 1.5 (a hundredfold between the 5th and 95th percentiles, median ≈ 1 s,
  mean 3 s at time scale 1), and the agents score requests in flight
  (`score = "requests"`; `--agent-score connections+requests` adds the
  connections, which still bring requests while idle).
- hidden-load: a second population (half as many users) goes straight to
  one server at a time, 2–4 s on, 2–4 s off, beside the regular load: the
  agents count it, the balancer never sees it.
- open-hidden (profile `hidden-open`): the same, not zero-sum: an open
  loop the two other servers can carry beside 3 zero-think users per slot
  of the hidden users' server.
- burst-hot-spot, burst-hot-spot-asks (profile `bursts`): an open loop in
  bursts, each burst with such users on one server drawn per burst; in
  the second dsr-dynamic asks the servers after a pause
  (`query_when_stale`), and its polls count in the equal budget.

Budget: dsr-dynamic runs first in each repetition; its score requests
(options 124, counted by the balancer as `probes_sent`, and the polls of
its queries after a pause when it makes them) per second of the load
window, pauses included, give the poll interval at which the poller
sends as many requests to the servers (`control.polls_sent`, one packet per
backend per round, counted over the balancer's life). Both counts are
reported, so the match is measured, not assumed: in on-off, dynamic spends
its budget while traffic flows and the poller evenly over the run. The best
poller asks every BEST_POLL_MS, packets regardless.

Repetitions: every configuration runs `reps` times per regime, in rounds
(each round runs every configuration once), on the same schedules (slowdown
windows, on/off and direct windows: fixed per regime by --seed), so that
the spread is the run-to-run noise. Tables give the mean and min–max; a
ratio counts only when the ranges do not overlap, and the verdict names a
win only where dynamic clears the issue's bar (≥ WIN_RPS× RPS or ≤ WIN_P99×
p99) against both the equal-budget poller and the control, beyond the
spread.

Several balancers sharing the servers: the fleet regimes (fleet-2,
fleet-3) run B real `inband lb` instances behind an ECMP router
(bench/lib/fleetbed.py), each seeing only the connections the router hands
it, so its own counts (the control's, and dynamic's estimate between
scores) miss the others' placements. Every instance runs the
configuration's mode with the same n; the equal poller's interval is B
times the one-balancer one (every instance polls every server). HAProxy
is not run there: the router's SIDs lead to the instances' XDP programs.
The first study's balancers-2 and balancers-4 modelled B balancers on one
(each sees 1/B of the traffic: n = B·100, packet counts × B for the
servers' view) and could not show the others' placements.

Prints one table per regime and a summary; writes the record (results.json:
commit, machine, load average, command, schedules, rows with their
repetition) and its tables (results.md) into --results (default
bench/results/regimes). See docs/benchmarks.md, "Regimes".
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .lib import locust, paperbed, preflight, profiles, results, stats
from .lib.locust import RunResult, Summary
from .lib.fleetbed import FleetBench
from .lib.paperbed import Bench, Configuration, ServerSpec
from .lib.procs import Interrupted, stop_signals_interrupt, uninterruptible
from .lib.report import fmt_ratio, fmt_time, table
from .lib.stats import ratio

BEST_POLL_MS = 10  # the freshness table's fastest poller (bench.forwarding)
PROBE_N = 100  # the paper's n
WIN_RPS, WIN_P99 = 1.3, 0.7  # the bar: dynamic ÷ the other

# on-off: seconds on, then off, each drawn uniformly (× the profile's
# schedule_scale).
ON_S, OFF_S = (1.0, 2.0), (3.0, 4.0)
# hidden-load: the direct population's windows on one server, and the
# pauses between them (the run starts with a pause: balanced).
DIRECT_ON_S, DIRECT_OFF_S = (2.0, 4.0), (2.0, 4.0)
# open loops: slots per server, so that 95% of capacity (3 × 8 slots of
# 0.25 s: 96 requests a second before the slowdowns take their share)
# stays well inside what one Locust process generates on this machine.
OPEN_WORKERS = 8
# keep-alive: LLM-inference-like serving. Times at time scale 1 (the
# profile's scale multiplies them, as every server-side time).
LLM_SLOTS = 8  # requests in service at once per server
LLM_SERVICE_MS = 3000.0  # mean; with σ 1.5 the median is ≈ 1 s
LLM_SIGMA = 1.5
LLM_PER_CONNECTION = 8  # mean requests per connection
LLM_THINK_MS = (0.0, 2000.0)  # a user's pause between its requests
# burst-hot-spot: bursts' and pauses' lengths, and the service's spread.
BURST_S = ((1.0, 2.0), (4.0, 8.0))
BURST_SIGMA = 0.3


@dataclass(frozen=True)
class Regime:
    key: str
    what: str
    servers: int = 3
    users: int = 150
    slowdowns: bool = True  # random 5x windows on every server
    balancers: int = 1  # modelled, see the module's doc
    fleet: int = 0  # real balancer instances behind the ECMP router (0: the one-balancer testbed)
    probe_n: int = PROBE_N  # dsr-dynamic's n (× balancers), its budget
    probe_max: int | None = None  # the adaptive n's upper bound
    onoff: bool = False  # the users send inside ON_S windows only
    keepalive: bool = False  # LLM-like serving over kept connections
    direct: float = 0.0  # a population this many × users straight to the servers
    # ... or this many users straight to the servers (an open loop's
    # arrivals are not users to scale from)
    direct_n: int = 0
    score: str | None = None  # the agents' score source (their default: connections)
    # An open loop at this fraction of the servers' capacity (arrivals on a
    # schedule, not users waiting for answers); 0: Locust's closed loop.
    open_load: float = 0.0
    workers: int | None = None  # slots per server, if not the paper profile's
    schedule: str | None = None  # whose slowdown, on/off and direct schedules it shares (default: its own)
    onoff_s: tuple = (ON_S, OFF_S)  # on-off: the on and off lengths' ranges
    # The direct population comes with the bursts: inside each on-window,
    # to a server drawn per window, instead of on a schedule of its own.
    hot_spot: bool = False
    sigma: float | None = None  # the lognormal service's σ, if not the paper profile's
    # dsr-dynamic with `query_when_stale`: a SYN that finds every score
    # stale (after a pause) waits for a query of the servers.
    query_stale: bool = False


# How a regime's heading names its agents' score source.
SCORE_WORDS = {"requests": "requests in flight", "connections+requests": "connections plus requests in flight"}


def with_score(regime: Regime, score: str | None) -> Regime:
    """`regime` with its agents' score source replaced by `score` (the
    --agent-score option), if it sets one: the regimes that leave the
    agents' default keep it."""
    return replace(regime, score=score) if score and regime.score else regime


REGIMES = (
    # Where the balancer cannot know the load by itself.
    Regime("on-off", "as slowdowns, the users on 1–2 s, off 3–4 s", onoff=True),
    # 40 users against 3 × 8 slots of 0.75 s mean service (quick's time
    # scale): about the servers' capacity with the think time.
    Regime(
        "keep-alive",
        f"as slowdowns, keep-alive (mean {LLM_PER_CONNECTION} requests per connection, think 0–{LLM_THINK_MS[1] / 1000:g} s), "
        f"{LLM_SLOTS} slots per server, lognormal σ {LLM_SIGMA:g} (mean {LLM_SERVICE_MS / 1000:g} s; times × the time scale)",
        users=40,
        keepalive=True,
        score="requests",
    ),
    Regime("hidden-load", "as slowdowns, and half as many users again straight to one server, 2–4 s on, 2–4 s off", direct=0.5),
    # keep-alive below saturation (profile `load`): at 40 users every slot
    # was busy and no placement could matter. 20 and 28 users ask for
    # about 15 and 21 of the 24 slots before the slowdowns take some.
    Regime("keep-alive-20", "as keep-alive, 20 users (below saturation)", users=20, keepalive=True, score="requests"),
    Regime("keep-alive-28", "as keep-alive, 28 users (near saturation)", users=28, keepalive=True, score="requests"),
    # Below saturation, where placement decides the queues: arrivals on a
    # schedule (bench/locustfile.py's open loop), one connection each.
    *(
        Regime(
            f"open-{pct}",
            f"as slowdowns (the same windows at every load), an open loop at {pct}% of the servers' capacity over the run, {OPEN_WORKERS} slots each",
            open_load=pct / 100,
            workers=OPEN_WORKERS,
            schedule="open",
        )
        for pct in (60, 80, 95)
    ),
    # Hidden load that is not zero-sum: in hidden-load the balanced users
    # were a closed loop that kept every server busy, so a placement away
    # from the hidden users' server only moved the queue, and the control
    # won by taking their capacity. Here the balanced load is an open loop
    # the two other servers can carry (40% of all three's capacity is 60%
    # of two's), and the hidden users (3 per slot, no think time, like a
    # batch job's fan-out) fill one server's queue whoever else comes:
    # a request placed there waits behind them. No slowdowns: the hidden
    # load is the only thing that makes a server slow.
    Regime(
        "open-hidden",
        f"identical servers ({OPEN_WORKERS} slots each, nothing slowed), an open loop at 40% of their capacity, "
        f"and {3 * OPEN_WORKERS} users straight to one server at a time (no think time), 2–4 s on, 2–4 s off",
        slowdowns=False,
        open_load=0.4,
        workers=OPEN_WORKERS,
        direct_n=3 * OPEN_WORKERS,
    ),
    # Where in-band reports must be fresher than polls of the same budget:
    # the load comes in bursts (in-band reports come with them, polls are
    # spread over the pauses), and each burst brings a hot spot the
    # balancer cannot see, on a server drawn per burst (requests pinned by
    # session affinity or sent straight to a server by another client of
    # the same event: 3 zero-think users per slot there). A poll taken
    # before the burst says nothing of it; only reports taken during it
    # do. Service times vary little (σ 0.3), so that the p99 is the
    # placements' and not the service's own tail. In burst-hot-spot the
    # first connections of a burst go out on the scores of the last one,
    # which are stale by then: the sweeper's exploration tickets send one
    # to each server, the hot one included. In burst-hot-spot-asks
    # dsr-dynamic asks the servers first (`query_when_stale`), and the
    # query's polls count in the budget the equal poller is given.
    *(
        Regime(
            key,
            f"identical servers ({OPEN_WORKERS} slots each, lognormal σ {BURST_SIGMA:g}, nothing slowed), an open loop at 40% of their capacity "
            f"in bursts of 1–2 s every 5–10 s, each burst with {3 * OPEN_WORKERS} users straight to one server drawn per burst (no think time)"
            + ("; dsr-dynamic asks the servers before a SYN that finds every score stale" if asks else ""),
            slowdowns=False,
            onoff=True,
            onoff_s=BURST_S,
            open_load=0.4,
            workers=OPEN_WORKERS,
            direct_n=3 * OPEN_WORKERS,
            hot_spot=True,
            sigma=BURST_SIGMA,
            schedule="burst-hot-spot",
            query_stale=asks,
        )
        for key, asks in (("burst-hot-spot", False), ("burst-hot-spot-asks", True))
    ),
    # Several real balancers sharing the servers: each places a share of
    # the connections and sees only its own.
    Regime("fleet-2", "as slowdowns, 2 inband instances behind an ECMP router, each seeing only its own placements", fleet=2),
    Regime("fleet-3", "as slowdowns, 3 inband instances behind an ECMP router, each seeing only its own placements", fleet=3),
    # ... with what a single balancer could not see either: bursts, where
    # in-band reports come with the traffic and the others' placements
    # change fastest, and users straight to the servers.
    Regime("fleet-3-on-off", "as fleet-3, the users on 1–2 s, off 3–4 s", fleet=3, onoff=True),
    Regime("fleet-3-hidden", "as fleet-3, and half as many users again straight to one server, 2–4 s on, 2–4 s off", fleet=3, direct=0.5),
    # The first study's ten: one connection per request.
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
# The first study's ten: the regimes from heavy-tail on.
TEN = tuple(BY_KEY)[tuple(BY_KEY).index("heavy-tail") :]


@dataclass(frozen=True)
class Profile:
    paper_profile: str  # bench.paper's profile: time scale, workers, service time
    duration_s: int
    regimes: tuple
    users_scale: float  # the tiny grid runs a fraction of each regime's users
    reps: int = 1  # runs per configuration and regime (records before repetitions: 1)
    schedule_scale: float = 1.0  # multiplies the on/off and direct windows' lengths
    # ((regime, (configuration, ...)), ...): regimes that run only these
    # rows (dsr-dynamic always runs); the others run every row.
    only: tuple = ()
    # dsr-dynamic's n in every regime, when set: the tiny grid's few users
    # send too few packets in 3 s for the paper's n to make a budget that
    # can be matched (5 score requests in a keep-alive run, where one poll
    # round of 3 servers is 60% of it).
    probe_n: int | None = None


PROFILES = {
    # About 40 minutes on the 2-core testbed. A run costs its duration and
    # ≈ 2.2 s more (balancer and servers started, Locust's start and stop:
    # the first study's 50 runs of 20 s took 1108 s). 4 regimes × 7
    # configurations × 3 repetitions = 84 runs × (25 + 2.2) s = 2285 s,
    # and two testbeds (the agents' score source differs) ≈ 30 s: ≈ 39 min.
    # 25 s holds about five on/off cycles and five direct windows, and ~25
    # keep-alive requests per user. slowdowns stays as the first study's
    # reference (one connection per request, nothing hidden).
    "quick": Profile("quick", 25, ("on-off", "keep-alive", "hidden-load", "slowdowns"), 1.0, reps=3),
    # keep-alive below saturation: 2 × 7 × 3 = 42 runs × 27.2 s ≈ 19 min.
    "load": Profile("quick", 25, ("keep-alive-20", "keep-alive-28"), 1.0, reps=3),
    # open loops below and near saturation: 3 × 7 × 3 = 63 runs × 27.2 s ≈ 29 min.
    "open": Profile("quick", 25, ("open-60", "open-80", "open-95"), 1.0, reps=3),
    # Hidden load beside an open loop: 7 × 3 = 21 runs × 27.2 s ≈ 10 min.
    "hidden-open": Profile("quick", 25, ("open-hidden",), 1.0, reps=3),
    # Bursts with a hot spot: 40 s hold about six bursts (≈ 330 balanced
    # requests). Every row with the query when stale, the equal poller
    # and the control without: (7 + 3) × 3 = 30 runs × 42.2 s ≈ 21 min.
    "bursts": Profile(
        "quick", 40, ("burst-hot-spot", "burst-hot-spot-asks"), 1.0, reps=3,
        only=(("burst-hot-spot", ("dsr-dynamic", "poll-equal", "dsr-leastconn")),),
    ),
    # Several real balancers: 2 × 6 × 3 = 36 runs × 27.2 s ≈ 17 min, and
    # two testbeds.
    "fleet": Profile("quick", 25, ("fleet-2", "fleet-3"), 1.0, reps=3),
    # The fleet with bursts and hidden users: 2 × 6 × 3 = 36 runs ≈ 17 min.
    "fleet-load": Profile("quick", 25, ("fleet-3-on-off", "fleet-3-hidden"), 1.0, reps=3),
    # The first study's ten regimes, repeated: 10 × 7 × 3 = 210 runs ×
    # (20 + 2.2) s ≈ 78 min, and three testbeds (2, 3, 4 servers).
    "ten": Profile("quick", 20, TEN, 1.0, reps=3),
    # The test: the rows, budgets and loads, not what wins. Windows at a
    # third of their length so that 3 s hold a few of them; every row in
    # on-off, and in the other two only what their loads are checked by
    # (a run costs ≈ 7 s here, start-up included: 13 runs).
    "tiny": Profile(
        "tiny", 3, ("on-off", "keep-alive", "hidden-load"), 0.15, reps=1, schedule_scale=0.3,
        only=(("keep-alive", ("dsr-dynamic", "poll-equal", "dsr-leastconn")), ("hidden-load", ("dsr-dynamic", "poll-equal", "dsr-leastconn"))),
        probe_n=25,
    ),
    # The fleet's test: two instances, the rows whose budgets it checks.
    "tiny-fleet": Profile("tiny", 3, ("fleet-2",), 0.15, reps=1, only=(("fleet-2", ("dsr-dynamic", "poll-equal", "dsr-leastconn")),)),
}


def users(regime: Regime, profile: Profile) -> int:
    """Locust's users: the open loop's one, or the regime's (scaled)."""
    if regime.open_load:
        return 1
    return max(2, round(regime.users * profile.users_scale))


def capacity(regime: Regime, pprofile: paperbed.Profile, duration_s: int, seed: int) -> float:
    """Requests a second the regime's servers complete with every slot
    busy, averaged over the run: a server inside a slowdown window
    completes `factor` times fewer."""
    per_slot = 1000 / (pprofile.service_ms * pprofile.time_scale)
    steps = 1000
    speed = 0.0
    for spec in specs_for(regime, duration_s, seed):
        for i in range(steps):
            t = (i + 0.5) / steps
            speed += math.prod(f for start, length, f in spec.slowdowns if start <= t < start + length) ** -1 / steps
    return speed * (regime.workers or pprofile.workers) * per_slot


def direct_users(regime: Regime, profile: Profile) -> int:
    if regime.direct_n:
        return max(2, round(regime.direct_n * profile.users_scale))
    return max(2, round(users(regime, profile) * regime.direct)) if regime.direct else 0


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
    every configuration and repetition in it."""
    rng = random.Random(f"{seed}-{regime.schedule or regime.key}")
    return tuple(ServerSpec(1.0, slowdown_windows(rng, duration_s) if regime.slowdowns else ()) for _ in range(regime.servers))


def alternating(rng: random.Random, duration_s: float, on_s: tuple, off_s: tuple, scale: float, on_first: bool) -> list:
    """[(start_s, end_s)] on-windows covering the run, on and off lengths
    drawn uniformly from `on_s` and `off_s` (× `scale`)."""
    out, t = [], 0.0 if on_first else rng.uniform(*off_s) * scale
    while t < duration_s:
        on = rng.uniform(*on_s) * scale
        out.append((round(t, 3), round(min(t + on, duration_s), 3)))
        t += on + rng.uniform(*off_s) * scale
    return out


def onoff_windows(regime: Regime, profile: Profile, seed: int) -> list:
    """When the users send (seconds since the load started); [] when they
    always do."""
    if not regime.onoff:
        return []
    return alternating(random.Random(f"{seed}-{regime.schedule or regime.key}-onoff"), profile.duration_s, *regime.onoff_s, profile.schedule_scale, True)


def direct_windows(regime: Regime, profile: Profile, seed: int) -> list:
    """[(start_s, end_s, server index)]: when the direct population sends,
    and to which server."""
    if not (regime.direct or regime.direct_n):
        return []
    rng = random.Random(f"{seed}-{regime.schedule or regime.key}-direct")
    if regime.hot_spot:
        windows = onoff_windows(regime, profile, seed)
    else:
        windows = alternating(rng, profile.duration_s, DIRECT_ON_S, DIRECT_OFF_S, profile.schedule_scale, False)
    return [(a, b, rng.randrange(regime.servers)) for a, b in windows]


def on_fraction(windows: list, duration_s: float) -> float:
    return sum(w[1] - w[0] for w in windows) / duration_s if windows else 1.0


@dataclass
class Row:
    """One configuration's run in a regime, with what its feedback cost."""

    key: str
    label: str
    interval: str
    result: RunResult
    lifetime_s: float  # balancer up (every instance ready) to status read: the polls' period
    rep: int = 0
    direct_requests: int = 0  # the direct population's, answered inside the window
    # p99 of every answered request inside the window, balanced and direct:
    # the service's tail as all its users see it (hidden-load only).
    all_p99_ms: float | None = None

    @property
    def s(self) -> Summary:
        return self.result.summary()

    @property
    def requests_to_servers(self) -> int:
        """Feedback requests that reached a server: 124 options, or poll and
        query packets."""
        o = self.result.overhead
        return o.probes + o.polls

    @property
    def connections(self) -> int | None:
        """Connections the balancer placed (inband only: HAProxy's are not read)."""
        bs = self.result.at_balancer
        return sum(v["connections"] for v in bs.values()) if bs else None


def equal_poll_ms(servers: int, probes: int, window_s: float, pollers: int = 1) -> int:
    """The poll interval that sends as many requests to the servers as
    `probes` score requests over `window_s`: a round asks every server,
    and each of `pollers` balancers polls on its own."""
    if probes <= 0:
        raise RuntimeError("dsr-dynamic sent no score request: there is no budget to match")
    return max(1, round(pollers * servers * window_s * 1000 / probes))


def dynamic_interval(regime: Regime) -> tuple:
    """dsr-dynamic's n and adaptive upper bound (None: fixed) for the
    regime: × the modelled balancers, each of which sees 1/B of the packets."""
    n = regime.probe_n * regime.balancers
    return n, regime.probe_max and regime.probe_max * regime.balancers


def configure(bench: Bench, regime: Regime, profile: Profile, pprofile: paperbed.Profile) -> None:
    """The testbed's servers, users and load for `regime`."""
    bench.specs = specs_for(regime, profile.duration_s, bench.args.seed)
    bench.args.users = users(regime, profile)
    bench.args.spawn_rate = bench.args.users
    bench.p, bench.serve_extra = pprofile, ()
    # Common random numbers: every configuration is given the same
    # requests, so that a difference between them is the placement's.
    env = {"INBAND_BENCH_DRAW_SEED": str(bench.args.seed)}
    if regime.onoff:
        env["INBAND_BENCH_ONOFF"] = json.dumps(onoff_windows(regime, profile, bench.args.seed))
    if regime.open_load:
        bench.p = replace(pprofile, workers=regime.workers or pprofile.workers)
        env["INBAND_BENCH_OPEN_RATE"] = f"{regime.open_load * capacity(regime, pprofile, profile.duration_s, bench.args.seed):.3f}"
    if regime.sigma:
        bench.serve_extra = ("--service-sigma", f"{regime.sigma:g}")
    if regime.keepalive:
        bench.p = replace(pprofile, workers=LLM_SLOTS, service_ms=LLM_SERVICE_MS, service_dist="lognormal")
        bench.serve_extra = ("--keep-alive", "--service-sigma", f"{LLM_SIGMA:g}")
        env["INBAND_BENCH_KEEPALIVE"] = str(LLM_PER_CONNECTION)
        env["INBAND_BENCH_THINK_S"] = ",".join(f"{t * pprofile.time_scale / 1000:g}" for t in LLM_THINK_MS)
    bench.locust_env = env
    bench.extra_users = direct_users(regime, profile)


# The rows of every regime, in table order.
CONFIG_KEYS = ("dsr-dynamic", "poll-equal", "poll-best", "dsr-query", "dsr-leastconn", "haproxy-leastconn", "dsr-rr")
CONTROL = "dsr-leastconn"


def run_rep(bench: Bench, regime: Regime, profile: Profile, out: Path, rep: int) -> list[Row]:
    """One round: every configuration once, dsr-dynamic first (its probes
    set this round's equal poller)."""
    bench.out = out / regime.key / f"rep{rep + 1}"
    servers = [f"http://{b.address}:{b.port}" for b in bench.backends]
    direct = [[a, b, servers[i]] for a, b, i in direct_windows(regime, profile, bench.args.seed)]
    rows: list[Row] = []
    wanted = dict(profile.only).get(regime.key, CONFIG_KEYS)

    def run(key: str, label: str, interval: str, c: Configuration) -> Row | None:
        if key != "dsr-dynamic" and key not in wanted or (regime.fleet and c.kind != "inband"):
            return None
        bench.log(f"{regime.key} #{rep + 1}: {key} ({interval})")
        d = bench.out / key
        if direct:
            bench.locust_env["INBAND_BENCH_DIRECT"] = json.dumps(
                {"users": bench.extra_users, "windows": direct, "requests": str(d / "direct-requests.csv")}
            )
        res = bench.run_config(replace(c, key=key, label=label))
        meta = json.loads((d / "meta.json").read_text())
        hidden = locust.in_window(locust.read_requests(d / "direct-requests.csv"), *res.window) if direct else []
        everyone = [r.rt_ms for r in locust.in_window(res.requests, *res.window) + hidden if r.ok] if direct else []
        row = Row(
            key, label, interval, res, meta["status_read"] - meta["balancer_started"], rep, sum(1 for r in hidden if r.ok), stats.percentile(everyone, 99)
        )
        rows.append(row)
        return row

    n, hi = dynamic_interval(regime)
    dyn = run(
        "dsr-dynamic",
        "dsr-dynamic (in-band; asks after a pause)" if regime.query_stale else "dsr-dynamic (in-band)",
        (f"n = {n}..{hi} adaptive" if hi else f"n = {n}") + (", query when stale" if regime.query_stale else ""),
        replace(paperbed.BY_KEY["dsr-dynamic"], probe_interval=n, probe_interval_max=hi, query_when_stale=regime.query_stale),
    )
    w = dyn.result.window
    eq_ms = equal_poll_ms(regime.servers, dyn.requests_to_servers, w[1] - w[0], max(1, regime.fleet))
    polling = paperbed.BY_KEY["dsr-polling"]
    run("poll-equal", "dsr-polling, equal budget", f"{eq_ms} ms", replace(polling, poll_interval_ms=eq_ms))
    run("poll-best", "dsr-polling, best poller", f"{BEST_POLL_MS} ms", replace(polling, poll_interval_ms=BEST_POLL_MS))
    run("dsr-query", "dsr-query (ask before forwarding)", "per SYN batch", paperbed.BY_KEY["dsr-query"])
    # The control: what the balancer knows by itself, counting its own
    # connections, with no feedback at all.
    run(CONTROL, "DSR least-connections (own counts, no feedback)", "–", replace(paperbed.BY_KEY["dsr-rr"], policy="least-connections"))
    run("haproxy-leastconn", "HAProxy leastconn (proxy, own counts)", "–", paperbed.BY_KEY["haproxy-leastconn"])
    run("dsr-rr", "DSR round-robin", "–", paperbed.BY_KEY["dsr-rr"])
    return rows


def run_regime(bench: Bench, regime: Regime, profile: Profile, out: Path, pprofile: paperbed.Profile, failed: list) -> list[Row]:
    """Every repetition of the regime; one that fails is reported in
    `failed` and the others are kept (its cells then have fewer runs)."""
    regime = replace(regime, probe_n=profile.probe_n) if profile.probe_n else regime
    configure(bench, regime, profile, pprofile)
    rows: list[Row] = []
    for rep in range(profile.reps):
        try:
            rows += run_rep(bench, regime, profile, out, rep)
        except (Interrupted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - one broken round must not hide the others
            failed.append((f"{regime.key} #{rep + 1}", f"{e.__class__.__name__}: {e}"))
            bench.log(f"{regime.key} #{rep + 1}: FAILED: {e}")
    if not rows:
        raise RuntimeError("no repetition completed")
    return rows


# ------------------------------------------------------------------ tables


@dataclass(frozen=True)
class Spread:
    """A cell over its repetitions: mean, min, max, how many."""

    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, xs) -> "Spread":
        xs = [x for x in xs if x is not None and not math.isnan(x)]
        if not xs:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(sum(xs) / len(xs), min(xs), max(xs), len(xs))

    def fmt(self, f) -> str:
        if self.n == 0:
            return "–"
        lo, hi = f(self.lo), f(self.hi)
        return f(self.mean) if lo == hi else f"{f(self.mean)} ({lo}–{hi})"


def apart(a: Spread, b: Spread) -> bool:
    """The two cells' ranges do not overlap: a difference beyond the spread
    (a cell left with one run, its round having failed, is a point). With
    a single repetition of both there is no spread to judge by (the first
    study's record): every difference counts, as it did there."""
    if a.n == 0 or b.n == 0:
        return False
    if a.n < 2 and b.n < 2:
        return True
    return a.lo > b.hi or a.hi < b.lo


@dataclass(frozen=True)
class Versus:
    """dsr-dynamic against another configuration of the same regime."""

    rps: float | None  # dynamic ÷ other, of the means
    p99: float | None
    rps_apart: bool  # the ranges do not overlap
    p99_apart: bool

    def beaten(self) -> bool:
        """The issue's bar, counted only beyond the spread."""
        return (self.rps is not None and self.rps >= WIN_RPS and self.rps_apart) or (
            self.p99 is not None and self.p99 <= WIN_P99 and self.p99_apart
        )

    def cells(self) -> list[str]:
        """RPS and p99 ratios; in parentheses when within the spread."""
        return [fmt_ratio(x) if ok or x is None else f"({fmt_ratio(x)})" for x, ok in ((self.rps, self.rps_apart), (self.p99, self.p99_apart))]


def rps_of(rows: list[Row]) -> Spread:
    return Spread.of(r.s.rps for r in rows)


def p99_of(rows: list[Row]) -> Spread:
    return Spread.of(r.s.pct_ms[99] for r in rows)


def versus(dyn: list[Row], other: list[Row] | None) -> Versus | None:
    if not other:
        return None
    d, o = (rps_of(dyn), p99_of(dyn)), (rps_of(other), p99_of(other))
    return Versus(ratio(d[0].mean, o[0].mean), ratio(d[1].mean, o[1].mean), apart(d[0], o[0]), apart(d[1], o[1]))


def cells_by_config(rows: list[Row]) -> dict:
    """Configuration key -> its rows (one per repetition), in table order."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.key, []).append(r)
    return out


def budget_match(dyn: Row, eq: Row) -> float:
    """Poll requests per second of the equal poller ÷ feedback requests per
    second of dsr-dynamic (its 124s, and its queries' polls when it asks
    after a pause; in the same repetition): 1.0 is a matched budget."""
    w = dyn.result.window
    dyn_rate = dyn.requests_to_servers / (w[1] - w[0])
    return (eq.result.overhead.polls / eq.lifetime_s) / dyn_rate if dyn_rate else float("nan")


def budget_matches(rows: list[Row]) -> Spread:
    by = {(r.rep, r.key): r for r in rows}
    return Spread.of(budget_match(by[rep, "dsr-dynamic"], by[rep, "poll-equal"]) for rep, k in by if k == "poll-equal" and (rep, "dsr-dynamic") in by)


def intervals(rows: list[Row]) -> str:
    """The interval of a configuration over its repetitions (the equal
    poller's follows each round's probes)."""
    seen = list(dict.fromkeys(r.interval for r in rows))
    if len(seen) > 1 and all(s.endswith(" ms") for s in seen):
        ms = sorted(int(s[:-3]) for s in seen)
        return f"{ms[0]}–{ms[-1]} ms"
    return ", ".join(seen)


def regime_table(regime: Regime, rows: list[Row]) -> str:
    cells = cells_by_config(rows)
    dyn = cells["dsr-dynamic"]
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
        "connections per request",
        "dynamic RPS ÷ this",
        "dynamic p99 ÷ this",
    ]
    # A population past the balancer is served too, out of the same
    # servers: a placement that takes its capacity shows here, not in
    # the balanced rows' RPS.
    direct = any(r.direct_requests for rs in cells.values() for r in rs)
    if direct:
        headers += ["direct requests per run (past the balancer)", "p99 of every user (balanced and direct)"]
    out = []
    for key, rs in cells.items():
        n = sum(r.s.requests for r in rs)
        per = (lambda x: f"{b * x / n:.3f}") if n else (lambda x: "–")
        conns = [r.connections for r in rs]
        vs = versus(dyn, rs)
        out.append(
            [
                rs[0].label,
                intervals(rs),
                rps_of(rs).fmt(lambda x: f"{x:.1f}"),
                Spread.of(r.s.median_ms for r in rs).fmt(fmt_time),
                p99_of(rs).fmt(fmt_time),
                str(sum(r.s.failures for r in rs)),
                per(sum(r.requests_to_servers for r in rs)),
                per(sum(r.result.overhead.extra_packets for r in rs)),
                f"{sum(conns) / n:.2f}" if n and None not in conns else "–",
                *vs.cells(),
            ]
        )
        if direct:
            out[-1].append(Spread.of(r.direct_requests for r in rs).fmt(lambda x: f"{x:.0f}"))
            tails = [r.all_p99_ms for r in rs if r.all_p99_ms is not None]
            out[-1].append(Spread.of(tails).fmt(fmt_time) if tails else "–")
    return table(headers, out)


def verdict(eq: Versus | None, control: Versus | None) -> str:
    """The issue's bar against the equal-budget poller and the no-feedback
    control, each beyond the spread; a comparison that could not be made
    (None) wins nothing."""
    beats = [name for name, v in (("the equal-budget poller", eq), ("the control", control)) if v is not None and v.beaten()]
    if len(beats) == 2:
        return "wins: beats the equal-budget poller and the control"
    if beats:
        return f"beats {beats[0]} only"
    return f"no win by the bar (≥ {WIN_RPS}× RPS or ≤ {WIN_P99}× p99, beyond the spread)"


COMPARED = (
    ("poll-equal", "dyn ÷ equal"),
    (CONTROL, "dyn ÷ control (least-connections)"),
    ("poll-best", "dyn ÷ best"),
    ("dsr-query", "dyn ÷ query"),
    ("haproxy-leastconn", "dyn ÷ HAProxy leastconn"),
    ("dsr-rr", "dyn ÷ rr"),
)


def summary_table(by_regime: dict) -> str:
    headers = ["regime", "reps", "dynamic RPS", "equal poll interval", "budget match (polls ÷ probes per s)"]
    for _k, name in COMPARED:
        headers += [f"{name}: RPS", "p99"]
    headers.append("verdict")
    out = []
    for key, rows in by_regime.items():
        cells = cells_by_config(rows)
        dyn = cells["dsr-dynamic"]
        vs = {k: versus(dyn, cells.get(k)) for k, _n in COMPARED}
        out.append(
            [
                key,
                str(len(dyn)),
                rps_of(dyn).fmt(lambda x: f"{x:.1f}"),
                intervals(cells["poll-equal"]) if "poll-equal" in cells else "–",
                budget_matches(rows).fmt(lambda x: f"{x:.2f}"),
                *[c for k, _n in COMPARED for c in (vs[k].cells() if vs[k] else ["–", "–"])],
                verdict(vs["poll-equal"], vs[CONTROL]),
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
    ap.add_argument("--reps", type=int, help="override the profile's repetitions per cell")
    ap.add_argument("--configs", help=f"comma-separated subset of the rows: {', '.join(CONFIG_KEYS)} (dsr-dynamic always runs: its probes set the equal budget)")
    ap.add_argument("--name", default="rg", help="testbed name (namespaces NAME-lb, NAME-c1, ...)")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    ap.add_argument("--seed", type=int, default=1, help="the slowdown, on/off and direct schedules, and the requests' service-time draws")
    ap.add_argument("--agent-score", choices=sorted(SCORE_WORDS), help="the agents' score source in the regimes that set one (default: theirs)")
    args = ap.parse_args(argv)
    keys = (args.regimes or ",".join(PROFILES[args.profile].regimes)).split(",")
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        ap.error(f"unknown regime(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    configs = args.configs.split(",") if args.configs else []
    if [c for c in configs if c not in CONFIG_KEYS]:
        ap.error(f"unknown row(s) {', '.join(c for c in configs if c not in CONFIG_KEYS)}; choose from {', '.join(CONFIG_KEYS)}")
    args.config_keys = tuple(configs)
    args.regime_keys = keys
    return args


def paper_args(args, profile: Profile, out: Path):
    """bench.paper's own options for its Bench: its defaults, this run's
    testbed, duration and the paper profile's time scale."""
    pa = paperbed.parse_args(
        ["--out", str(out), "--profile", profile.paper_profile, "--name", args.name, "--inband", args.inband, "--duration", str(profile.duration_s)]
    )
    pa.configs = "dsr-dynamic,dsr-polling,dsr-query,dsr-rr,haproxy-leastconn"
    pa.seed = args.seed
    return pa


def schedules(regimes: list[Regime], profile: Profile, pprofile: paperbed.Profile, seed: int) -> dict:
    """What each regime's runs followed, for the record."""
    return {
        r.key: {
            "open_rate": r.open_load * capacity(r, pprofile, profile.duration_s, seed),
            "slowdowns": [list(s.slowdowns) for s in specs_for(r, profile.duration_s, seed)],
            "onoff": onoff_windows(r, profile, seed),
            "direct": direct_windows(r, profile, seed),
            "direct_users": direct_users(r, profile),
        }
        for r in regimes
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    profile = profiles.choose(PROFILES, args.profile, reps=args.reps)
    if args.config_keys:
        profile = replace(profile, only=tuple((k, args.config_keys) for k in args.regime_keys))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pa = paper_args(args, profile, out)
    refused = preflight.refuse(paperbed.problems(pa))
    if refused:
        return refused
    pprofile = paperbed.resolve_profile(pa)
    this_run = results.Run("regimes", "bench.regimes", argv)
    regimes = [with_score(BY_KEY[k], args.agent_score) for k in args.regime_keys]
    by_regime: dict[str, list[Row]] = {}
    failed: list[tuple[str, str]] = []
    interrupted = None
    stop_signals_interrupt()
    # One testbed per server count, score source (the agents start with
    # the testbed) and fleet size: regimes are grouped by them.
    for servers, score, fleet in dict.fromkeys((r.servers, r.score, r.fleet) for r in regimes):
        specs = tuple(ServerSpec(1.0) for _ in range(servers))
        bench = FleetBench(pa, pprofile, out, specs, fleet) if fleet else Bench(pa, pprofile, out, specs)
        bench.agent_score = score
        try:
            bench.setup()
            for regime in (r for r in regimes if (r.servers, r.score, r.fleet) == (servers, score, fleet)):
                try:
                    by_regime[regime.key] = run_regime(bench, regime, profile, out, pprofile, failed)
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

    rows = [
        {"regime": key, "rep": r.rep, "key": r.key, "label": r.label, "interval": r.interval, "lifetime_s": r.lifetime_s,
         "direct_requests": r.direct_requests, "all_p99_ms": r.all_p99_ms, "result": r.result.to_json()}
        for key, rs in by_regime.items() for r in rs
    ]  # fmt: skip
    record = this_run.record(rows, profile=profiles.as_json(args.profile, profile), inband=Path(args.inband), paper_profile=asdict(pprofile),
                             regimes=args.regime_keys, agent_score=args.agent_score, draw_seed=args.seed, schedules=schedules(regimes, profile, pprofile, args.seed), failed=[f"{k}: {e}" for k, e in failed])
    results.write(args.results, record, render(record))
    for key, err in failed:
        print(f"error: {key}: {err}", file=sys.stderr)
    if interrupted:
        print(f"interrupted ({interrupted}); everything torn down", file=sys.stderr)
        return 130
    return 1 if failed or not by_regime else 0


def regime_heading(regime: Regime, profile: Profile, rows: list[Row], schedule: dict) -> str:
    """The regime, its users and, where the load comes and goes, how much
    of the run it covered."""
    extra = []
    if schedule.get("onoff"):
        f = on_fraction(schedule["onoff"], profile.duration_s)
        who = "arrivals" if schedule.get("open_rate") else "users"
        extra.append(f"{who} on {f:.0%} of the run: while they send, dynamic's score requests come at {1 / f:.1f}× their matched average rate")
    if schedule.get("direct"):
        dyn = [r for r in rows if r.key == "dsr-dynamic"]
        mean = sum(r.direct_requests for r in dyn) / len(dyn) if dyn else 0
        extra.append(
            f"{schedule['direct_users']} direct users on {on_fraction(schedule['direct'], profile.duration_s):.0%} of the run "
            f"({mean:.0f} requests per run past the balancer)"
        )
    if regime.score:
        extra.insert(0, f"agents score {SCORE_WORDS[regime.score]}")
    load = f"{schedule['open_rate']:.0f} arrivals a second" if schedule.get("open_rate") else f"{users(regime, profile)} users"
    if schedule.get("open_rate") and schedule.get("onoff"):
        load += " while on"
    return f"## {regime.key}: {regime.what}, {load}{''.join('; ' + e for e in extra)}\n"


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way; a record from before repetitions reads as
    one repetition)."""
    profile, pp = Profile(**{k: v for k, v in record["profile"].items() if k != "name"}), record["paper_profile"]
    by_regime: dict[str, list[Row]] = {}
    for r in record["rows"]:
        by_regime.setdefault(r["regime"], []).append(
            Row(r["key"], r["label"], r["interval"], RunResult.from_json(r["result"]), r["lifetime_s"], r.get("rep", 0), r.get("direct_requests", 0), r.get("all_p99_ms"))
        )
    parts = [
        "# Regimes: in-band feedback against asking and against no feedback\n",
        f"{results.provenance(record)}  \n"
        f"{profile.duration_s} s per run, {profile.reps} repetition{'s' if profile.reps > 1 else ''} per cell; identical servers, "
        f"{pp['workers']} workers each, {pp['service_dist']} service with mean {pp['service_ms'] * pp['time_scale']:g} ms (unless the regime says "
        f"otherwise, at the same time scale {pp['time_scale']:g}); dsr-dynamic n = {PROBE_N} (unless the regime says otherwise) × balancers; "
        f"best poller every {BEST_POLL_MS} ms; load generator, balancer and servers share the CPUs.  \n"
        "Cells are the mean over the repetitions (min–max). Ratios are dynamic ÷ the other, of the means: RPS > 1 and p99 < 1 favour dynamic; "
        "a ratio in parentheses is within the spread (the two ranges overlap) and counts for nothing. "
        "Budget match: the equal poller's poll requests per second of its balancer's life ÷ dynamic's score requests (and its queries' polls, where it asks after a pause) per second of load, "
        "per repetition. The control is DSR least-connections with no feedback: what the balancer's own counting gives. "
        f"Verdict: a win needs ≥ {WIN_RPS}× RPS or ≤ {WIN_P99}× p99 against both the equal-budget poller and the control, beyond the spread.\n",
    ]
    if record.get("draw_seed") is not None:
        parts.append(
            f"Every request carries its service-time draw (seed {record['draw_seed']}, bench/locustfile.py): each user sends the same "
            "requests, in the same order, in every run, so the configurations and repetitions are given the same work to place.\n"
        )
    if profile.reps < 2:
        parts.append("One repetition: no spread to judge by, every difference counts as measured.\n")
    if record["failed"]:
        parts.append("**Failed:** " + "; ".join(record["failed"]) + "\n")
    missing = [k for k in (CONTROL, "haproxy-leastconn") if not any(r["key"] == k for r in record["rows"])]
    if missing:
        parts.append(f"This record predates the row(s) {', '.join(missing)}: their columns read – until the next run.\n")
    by_regime = {k: by_regime[k] for k in record["regimes"] if k in by_regime}
    parts += ["## Summary\n", summary_table(by_regime) + "\n"]
    for regime in (with_score(BY_KEY[k], record.get("agent_score")) for k in record["regimes"]):
        if regime.key in by_regime:
            heading = regime_heading(regime, profile, by_regime[regime.key], record.get("schedules", {}).get(regime.key, {}))
            parts += [heading, regime_table(regime, by_regime[regime.key]) + "\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())

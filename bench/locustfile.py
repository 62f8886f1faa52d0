"""The paper's workload: every virtual user sends back-to-back GETs (no think
time) to the VIP. Run by bench/paper.py as

    INBAND_BENCH_RUN_S=60 locust -f bench/locustfile.py --headless -u 150 -r 150 -H http://VIP:80 ...

Settings come from the environment (the driver sets them):

    INBAND_BENCH_RUN_S      the run's length in seconds, counted from the
                            test's start; the locustfile then stops Locust.
                            Pass it in place of Locust's -t, which arms its
                            timer on gevent's cached loop clock: that clock
                            stands still while Locust starts up without
                            yielding, so on a loaded machine (seconds of
                            start-up) -t ended runs that much early, once
                            0.3 s into a 3 s run
    INBAND_BENCH_REQUESTS   per-request log to write (CSV: start, response ms,
                            ok, bytes); exact latencies for the
                            table and the CCDF, Locust's own CSV rounds them
    INBAND_BENCH_WINDOW     JSON file receiving the measurement window
                            (test start and stop, epoch seconds) and the
                            start of every request still in flight at the
                            stop ("unfinished"), which the per-request log
                            cannot hold
    INBAND_BENCH_TIMEOUT_S  per-request timeout (default 60)
    INBAND_BENCH_PAD_BYTES  size of a padding header that brings the request
                            to about the paper's 1 KB (default 900)

bench.regimes' other loads, each off unless set:

    INBAND_BENCH_ONOFF      JSON [[start_s, end_s], ...]: the users (or the
                            open loop's arrivals) send only inside these
                            windows (seconds since the test started);
                            between them they wait, after the last they
                            stop sending
    INBAND_BENCH_KEEPALIVE  mean requests per connection (each connection
                            draws 1 .. 2·mean−1 and asks for a close with its
                            last); 0 or unset: one request per connection
    INBAND_BENCH_THINK_S    "LO,HI": each user waits a uniform LO..HI
                            seconds between its requests (default 0,0)
    INBAND_BENCH_OPEN_RATE  requests per second: an open loop in place of
                            the users' closed one. One user starts a GET
                            (a connection each) every 1/RATE s whatever the
                            earlier ones are doing, each in a greenlet of
                            its own, so a slow server cannot slow the
                            arrivals down; run it with -u 1
    INBAND_BENCH_DRAW_SEED  every request carries the random numbers its
                            service time is drawn with (X-Service-Draw,
                            `inband serve`), as do the keep-alive lengths
                            and think times: the user spawned k-th draws
                            from a generator seeded with SEED and k, so
                            every run with the same seed sends the same
                            requests in each user's order; unset: the
                            servers draw
    INBAND_BENCH_DIRECT     JSON {"users": N, "windows": [[start_s, end_s,
                            "http://server:port"], ...], "requests": PATH}:
                            N more users that go straight to a server (not
                            the VIP) inside each window, to that window's
                            server, one connection per request; their
                            requests are logged to PATH, not to the
                            per-request log

Each request opens its own TCP connection (`Connection: close`) unless
INBAND_BENCH_KEEPALIVE says otherwise: an L4 balancer decides once per
connection, so with keep-alive for the whole run 150 users would be placed
150 times at the start and never again.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time

import gevent
import gevent.pool
from locust import HttpUser, constant, events, task

RUN_S = float(os.environ.get("INBAND_BENCH_RUN_S") or 0)
REQUESTS_PATH = os.environ.get("INBAND_BENCH_REQUESTS")
WINDOW_PATH = os.environ.get("INBAND_BENCH_WINDOW")
TIMEOUT_S = float(os.environ.get("INBAND_BENCH_TIMEOUT_S", "60"))
PAD_BYTES = int(os.environ.get("INBAND_BENCH_PAD_BYTES", "900"))

ONOFF = json.loads(os.environ.get("INBAND_BENCH_ONOFF") or "null")
KEEPALIVE = int(os.environ.get("INBAND_BENCH_KEEPALIVE") or 0)
THINK_S = tuple(float(x) for x in (os.environ.get("INBAND_BENCH_THINK_S") or "0,0").split(","))
DIRECT = json.loads(os.environ.get("INBAND_BENCH_DIRECT") or "null")
OPEN_RATE = float(os.environ.get("INBAND_BENCH_OPEN_RATE") or 0)
DRAW_SEED = os.environ.get("INBAND_BENCH_DRAW_SEED")
DIRECT_NAME = "direct"  # the request name that keeps direct requests out of the per-request log

HEADERS = {"Connection": "close"}
KEEP = {"Connection": "keep-alive"}
if PAD_BYTES > 0:
    HEADERS["X-Pad"] = KEEP["X-Pad"] = "p" * PAD_BYTES

_log = open(REQUESTS_PATH, "w", buffering=1 << 16) if REQUESTS_PATH else None
if _log:
    _log.write("start,rt_ms,ok,bytes\n")
_direct_log = open(DIRECT["requests"], "w", buffering=1 << 16) if DIRECT and DIRECT.get("requests") else None
if _direct_log:
    _direct_log.write("start,rt_ms,ok,bytes\n")
_window = {}
# user (or open-loop greenlet) -> start of its request in flight. Locust
# kills the users before test_stop, and _stop the open loop's greenlets,
# so what is left here at the stop never completed.
_in_flight: dict[int, float] = {}
_open_requests = gevent.pool.Group()


@events.request.add_listener
def _record(request_type, name, response_time, response_length, exception=None, start_time=None, **_kw):
    log = _direct_log if name == DIRECT_NAME else _log
    if log is None:
        return
    start = start_time if start_time is not None else time.time() - response_time / 1000.0
    log.write(f"{start:.6f},{response_time:.3f},{0 if exception else 1},{int(response_length or 0)}\n")


def wait_for_window(windows: list) -> list | None:
    """Sleeps until `windows` (sorted [start_s, end_s, ...] since the test
    started) holds the present; returns that window, or None after the
    last (the caller stops sending)."""
    now = time.time() - _window["t0"]
    for w in windows:
        if now < w[1]:
            # gevent sleeps from the loop's cached clock, which lags when
            # the loop was busy: a sleep may end early, so sleep until the
            # window has begun by the wall clock.
            while w[0] > now:
                gevent.sleep(w[0] - now)
                now = time.time() - _window["t0"]
            return w
    return None


@events.test_start.add_listener
def _start(environment, **_kw):
    _window["t0"] = time.time()
    if RUN_S > 0:
        # From a fresh loop clock (INBAND_BENCH_RUN_S says why).
        gevent.get_hub().loop.update_now()
        gevent.spawn_later(RUN_S, environment.runner.quit)


@events.test_stop.add_listener
def _stop(**_kw):
    _window["t1"] = time.time()
    _open_requests.kill(block=True, timeout=5)
    for log in (_log, _direct_log):
        if log:
            log.flush()
    _window["unfinished"] = sorted(_in_flight.values())
    if WINDOW_PATH and "t0" in _window:
        with open(WINDOW_PATH, "w") as f:
            json.dump(_window, f)


@events.quitting.add_listener
def _quit(**_kw):
    for log in (_log, _direct_log):
        if log:
            log.flush()


_spawned: dict[str, itertools.count] = {}


def user_rng(population: str) -> random.Random:
    """The random numbers of the next user spawned of `population`:
    seeded when INBAND_BENCH_DRAW_SEED is, by the population and the
    order of spawning within it (the same in every run)."""
    k = next(_spawned.setdefault(population, itertools.count()))
    return random.Random(f"{DRAW_SEED}-{population}-{k}") if DRAW_SEED else random.Random()


def drawn(headers: dict, rng: random.Random) -> dict:
    """`headers` with the request's service-time draw, when the load
    generator draws."""
    if not DRAW_SEED:
        return headers
    return {**headers, "X-Service-Draw": f"{1.0 - rng.random()!r},{rng.random()!r}"}


def _idle() -> None:
    """After the last window: send nothing more (Locust stops the user at
    the end of the run)."""
    gevent.sleep(1e6)


class PaperUser(HttpUser):
    def wait_time(self):
        return self.rng.uniform(*THINK_S) if THINK_S[1] > 0 else 0

    def on_start(self):
        self.rng = user_rng("user")
        self.left = 0  # requests still to send on the current connection

    @task
    def get(self):
        if ONOFF is not None and wait_for_window(ONOFF) is None:
            return _idle()
        headers = HEADERS
        if KEEPALIVE > 0:
            if self.left <= 0:
                self.left = self.rng.randint(1, 2 * KEEPALIVE - 1)
            self.left -= 1
            headers = KEEP if self.left > 0 else HEADERS
        headers = drawn(headers, self.rng)
        _in_flight[id(self)] = time.time()
        self.client.get("/", headers=headers, timeout=TIMEOUT_S)
        del _in_flight[id(self)]


if DIRECT:

    class DirectUser(HttpUser):
        """The load the balancer cannot see: straight to a server."""

        fixed_count = int(DIRECT["users"])
        wait_time = constant(0)

        def on_start(self):
            self.rng = user_rng("direct")

        @task
        def get(self):
            w = wait_for_window(DIRECT["windows"])
            if w is None:
                return _idle()
            # An absolute URL: the session goes to the server, not --host.
            self.client.get(f"{w[2]}/", headers=drawn(HEADERS, self.rng), name=DIRECT_NAME, timeout=TIMEOUT_S)


class OpenLoopUser(HttpUser):
    """INBAND_BENCH_OPEN_RATE's arrivals (the closed-loop users are off)."""

    fixed_count = 1
    wait_time = constant(0)

    @task
    def arrivals(self):
        rng = user_rng("open")
        for w in ONOFF if ONOFF is not None else [[0.0, math.inf]]:
            if wait_for_window([w]) is None:
                continue
            # Arrival k at the window's start + k/RATE: on the schedule,
            # not after the spawn, so arrivals do not drift when the
            # generator itself is slow; counted up front, so that no sum
            # of periods adds one at the window's end.
            start = _window["t0"] + w[0]
            count = itertools.count() if math.isinf(w[1]) else range(math.ceil((w[1] - w[0]) * OPEN_RATE - 1e-9))
            for k in count:
                gevent.sleep(max(0.0, start + k / OPEN_RATE - time.time()))
                _open_requests.spawn(self.one, drawn(HEADERS, rng))
        _idle()

    def one(self, headers: dict):
        me = id(gevent.getcurrent())
        _in_flight[me] = time.time()
        self.client.get("/", headers=headers, timeout=TIMEOUT_S)
        del _in_flight[me]


# Locust spawns every concrete User class of the module: one loop or the
# other.
OpenLoopUser.abstract = not OPEN_RATE
PaperUser.abstract = bool(OPEN_RATE)

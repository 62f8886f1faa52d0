"""The paper's workload: every virtual user sends back-to-back GETs (no think
time) to the VIP. Run by bench/paper.py as

    locust -f bench/locustfile.py --headless -u 150 -r 150 -t 60s -H http://VIP:80 ...

Settings come from the environment (the driver sets them):

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

    INBAND_BENCH_ONOFF      JSON [[start_s, end_s], ...]: the users send only
                            inside these windows (seconds since the test
                            started); between them they wait, after the last
                            they stop sending
    INBAND_BENCH_KEEPALIVE  mean requests per connection (each connection
                            draws 1 .. 2·mean−1 and asks for a close with its
                            last); 0 or unset: one request per connection
    INBAND_BENCH_THINK_S    "LO,HI": each user waits a uniform LO..HI
                            seconds between its requests (default 0,0)
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

import json
import os
import random
import time

import gevent
from locust import HttpUser, between, constant, events, task

REQUESTS_PATH = os.environ.get("INBAND_BENCH_REQUESTS")
WINDOW_PATH = os.environ.get("INBAND_BENCH_WINDOW")
TIMEOUT_S = float(os.environ.get("INBAND_BENCH_TIMEOUT_S", "60"))
PAD_BYTES = int(os.environ.get("INBAND_BENCH_PAD_BYTES", "900"))

ONOFF = json.loads(os.environ.get("INBAND_BENCH_ONOFF") or "null")
KEEPALIVE = int(os.environ.get("INBAND_BENCH_KEEPALIVE") or 0)
THINK_S = tuple(float(x) for x in (os.environ.get("INBAND_BENCH_THINK_S") or "0,0").split(","))
DIRECT = json.loads(os.environ.get("INBAND_BENCH_DIRECT") or "null")
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
# user -> start of its request in flight. Locust kills the users before
# test_stop, so what is left here at the stop never completed.
_in_flight: dict[int, float] = {}


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
            if w[0] > now:
                gevent.sleep(w[0] - now)
            return w
    return None


@events.test_start.add_listener
def _start(**_kw):
    _window["t0"] = time.time()


@events.test_stop.add_listener
def _stop(**_kw):
    _window["t1"] = time.time()
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


def _idle() -> None:
    """After the last window: send nothing more (Locust stops the user at
    the end of the run)."""
    gevent.sleep(1e6)


class PaperUser(HttpUser):
    wait_time = between(*THINK_S) if THINK_S[1] > 0 else constant(0)

    def on_start(self):
        self.left = 0  # requests still to send on the current connection

    @task
    def get(self):
        if ONOFF is not None and wait_for_window(ONOFF) is None:
            return _idle()
        headers = HEADERS
        if KEEPALIVE > 0:
            if self.left <= 0:
                self.left = random.randint(1, 2 * KEEPALIVE - 1)
            self.left -= 1
            headers = KEEP if self.left > 0 else HEADERS
        _in_flight[id(self)] = time.time()
        self.client.get("/", headers=headers, timeout=TIMEOUT_S)
        del _in_flight[id(self)]


if DIRECT:

    class DirectUser(HttpUser):
        """The load the balancer cannot see: straight to a server."""

        fixed_count = int(DIRECT["users"])
        wait_time = constant(0)

        @task
        def get(self):
            w = wait_for_window(DIRECT["windows"])
            if w is None:
                return _idle()
            # An absolute URL: the session goes to the server, not --host.
            self.client.get(f"{w[2]}/", headers=HEADERS, name=DIRECT_NAME, timeout=TIMEOUT_S)

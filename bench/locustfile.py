"""The paper's workload: every virtual user sends back-to-back GETs (no think
time) to the VIP. Run by bench/paper.py as

    locust -f bench/locustfile.py --headless -u 150 -r 150 -t 60s -H http://VIP:80 ...

Settings come from the environment (the driver sets them):

    INBAND_BENCH_REQUESTS   per-request log to write (CSV: start, response ms,
                            ok, bytes); exact latencies for the
                            table and the CCDF, Locust's own CSV rounds them
    INBAND_BENCH_WINDOW     JSON file receiving the measurement window
                            (test start and stop, epoch seconds)
    INBAND_BENCH_TIMEOUT_S  per-request timeout (default 60)
    INBAND_BENCH_PAD_BYTES  size of a padding header that brings the request
                            to about the paper's 1 KB (default 900)

Each request opens its own TCP connection (`Connection: close`): an L4
balancer decides once per connection, so with keep-alive 150 users would be
placed 150 times at the start of the run and never again.
"""

from __future__ import annotations

import json
import os
import time

from locust import HttpUser, constant, events, task

REQUESTS_PATH = os.environ.get("INBAND_BENCH_REQUESTS")
WINDOW_PATH = os.environ.get("INBAND_BENCH_WINDOW")
TIMEOUT_S = float(os.environ.get("INBAND_BENCH_TIMEOUT_S", "60"))
PAD_BYTES = int(os.environ.get("INBAND_BENCH_PAD_BYTES", "900"))

HEADERS = {"Connection": "close"}
if PAD_BYTES > 0:
    HEADERS["X-Pad"] = "p" * PAD_BYTES

_log = open(REQUESTS_PATH, "w", buffering=1 << 16) if REQUESTS_PATH else None
if _log:
    _log.write("start,rt_ms,ok,bytes\n")
_window = {}


@events.request.add_listener
def _record(request_type, name, response_time, response_length, exception=None, start_time=None, **_kw):
    if _log is None:
        return
    start = start_time if start_time is not None else time.time() - response_time / 1000.0
    _log.write(f"{start:.6f},{response_time:.3f},{0 if exception else 1},{int(response_length or 0)}\n")


@events.test_start.add_listener
def _start(**_kw):
    _window["t0"] = time.time()


@events.test_stop.add_listener
def _stop(**_kw):
    _window["t1"] = time.time()
    if _log:
        _log.flush()
    if WINDOW_PATH and "t0" in _window:
        with open(WINDOW_PATH, "w") as f:
            json.dump(_window, f)


@events.quitting.add_listener
def _quit(**_kw):
    if _log:
        _log.flush()


class PaperUser(HttpUser):
    wait_time = constant(0)

    @task
    def get(self):
        self.client.get("/", headers=HEADERS, timeout=TIMEOUT_S)

"""The locustfile against a local HTTP server (no root, no testbed): what it
sends, and the per-request log and window it writes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.lib import locust as report

REPO = Path(__file__).resolve().parents[2]
BODY = b"x" * 47104
RUN_S = 2


class Quiet(BaseHTTPRequestHandler):
    """HTTP/1.1 without a log line per request."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_a):
        pass

    def one_byte(self):
        """200 with the body "x"."""
        self.send_response(200)
        self.send_header("Content-Length", "1")
        self.end_headers()
        self.wfile.write(b"x")


def locust_run(users: int, seconds: float, port: int, env: dict, locustfile: Path = REPO / "bench" / "locustfile.py") -> subprocess.CompletedProcess:
    """The locustfile (or `locustfile`) headless against 127.0.0.1:`port`,
    `users` spawned at once, for `seconds` as the drivers set the length."""
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "--only-summary",
         "-u", str(users), "-r", str(users), "--host", f"http://127.0.0.1:{port}", "--loglevel", "WARNING"],
        capture_output=True, text=True, timeout=60, env={**env, "INBAND_BENCH_RUN_S": str(seconds)},
    )  # fmt: skip


def test_locustfile_logs_every_request(tmp_path):
    seen = []
    completed = {200: 0, 503: 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - http.server's naming
            seen.append((self.path, self.headers.get("Connection"), len(self.headers.get("X-Pad", ""))))
            code = 503 if len(seen) % 10 == 0 else 200
            body = BODY if code == 200 else b""
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            completed[code] += 1

        def log_message(self, *_a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        env = {
            "INBAND_BENCH_REQUESTS": str(tmp_path / "requests.csv"),
            "INBAND_BENCH_WINDOW": str(tmp_path / "window.json"),
            "INBAND_BENCH_TIMEOUT_S": "5",
            "INBAND_BENCH_PAD_BYTES": "900",
            "PATH": "/usr/bin:/bin",
        }
        cp = locust_run(users=3, seconds=RUN_S, port=srv.server_port, env=env)
    finally:
        srv.shutdown()
    assert (tmp_path / "window.json").exists(), cp.stderr[-2000:]
    t0, t1 = report.read_window(tmp_path / "window.json")
    # It ends at the run's length, later only by the timer firing late and
    # the users being stopped before t1 is taken: 2 s of slack covers both
    # on a busy 2-core machine.
    assert RUN_S <= t1 - t0 < RUN_S + 2.0
    reqs = report.read_requests(tmp_path / "requests.csv")
    assert len(reqs) >= 10
    assert {(p, c, pad) for p, c, pad in seen} == {("/", "close", 900)}
    ok = [r for r in reqs if r.ok]
    failed = [r for r in reqs if not r.ok]
    # Every answered request is logged with its outcome; at most one per
    # user was cut off by the stop (answered but never logged).
    assert completed[200] - 3 <= len(ok) <= completed[200]
    assert len(failed) >= completed[503] - 3 and completed[503] > 0
    assert all(r.length == len(BODY) for r in ok)
    assert all(r.rt_ms > 0 for r in reqs)
    # The window brackets every request logged (test_stop fires after the
    # users are stopped), so the report drops none of them. 10 ms: an end
    # is time.time() plus a perf_counter interval, t1 time.time() alone.
    assert report.in_window(reqs, t0, t1 + 0.01) == reqs
    # What the stop cut off is in the window file: every request the server
    # answered was either logged or still in flight, at most one per user.
    window = json.loads((tmp_path / "window.json").read_text())
    assert window.keys() == {"t0", "t1", "unfinished"}
    unfinished = window["unfinished"]
    assert len(unfinished) <= 3 and all(t0 <= s <= t1 for s in unfinished), (unfinished, t0, t1)
    assert completed[200] <= len(ok) + len(unfinished)


def test_a_slow_start_up_does_not_shorten_the_run(tmp_path):
    """Two busy seconds before the test starts, as a loaded machine gives
    Locust's start-up: Locust's -t lost them from a 2 s run, its timer
    being armed on a loop clock that stood still meanwhile; the run's own
    length (INBAND_BENCH_RUN_S) counts from the start."""

    class Handler(Quiet):
        do_GET = Quiet.one_byte  # noqa: N815 - http.server's naming

    slow = tmp_path / "slow_start.py"
    slow.write_text(
        "import time\n\nfrom locust import events\n\nfrom bench.locustfile import *  # noqa: F403\n\n\n"
        "@events.init.add_listener\ndef busy(**_kw):\n    end = time.time() + 2\n    while time.time() < end:\n        pass\n"
    )
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {"INBAND_BENCH_WINDOW": str(tmp_path / "window.json"), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    try:
        cp = locust_run(users=1, seconds=RUN_S, port=srv.server_port, env=env, locustfile=slow)
    finally:
        srv.shutdown()
    assert (tmp_path / "window.json").exists(), cp.stderr[-2000:]
    t0, t1 = report.read_window(tmp_path / "window.json")
    assert RUN_S <= t1 - t0 < RUN_S + 2.0, (t0, t1)


def test_regimes_loads_on_off_keep_alive_and_direct(tmp_path):
    """bench.regimes' loads: users that send only inside their windows,
    keep their connection for several requests, and a direct population
    that goes to another server inside its windows, logged apart."""
    conns = {"vip": [], "direct": []}  # (client port, start) per request, by server

    def server(name):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - http.server's naming
                conns[name].append((self.client_address[1], time.time(), self.headers.get("Connection")))
                time.sleep(0.02)
                self.send_response(200)
                self.send_header("Content-Length", "100")
                if self.headers.get("Connection") == "close":
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(b"x" * 100)

            def log_message(self, *_a):
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv

    vip, direct = server("vip"), server("direct")
    onoff = [[0.0, 0.8], [2.0, 2.8]]
    windows = [[1.0, 1.8, f"http://127.0.0.1:{direct.server_port}"]]
    try:
        env = {
            "INBAND_BENCH_REQUESTS": str(tmp_path / "requests.csv"),
            "INBAND_BENCH_WINDOW": str(tmp_path / "window.json"),
            "INBAND_BENCH_ONOFF": json.dumps(onoff),
            "INBAND_BENCH_KEEPALIVE": "6",
            "INBAND_BENCH_DIRECT": json.dumps({"users": 2, "windows": windows, "requests": str(tmp_path / "direct.csv")}),
            "PATH": "/usr/bin:/bin",
        }
        cp = locust_run(users=5, seconds=3, port=vip.server_port, env=env)
    finally:
        vip.shutdown()
        direct.shutdown()
    assert (tmp_path / "window.json").exists(), cp.stderr[-2000:]
    t0, _t1 = report.read_window(tmp_path / "window.json")

    # The regular users (3 of the 5) sent in both on windows and never
    # between them; the direct ones only inside theirs, only to their server.
    # Judged by each request's send time in the client's own log (with the
    # requests still in flight at the stop): a server's time of receipt
    # adds the scheduling of two processes, without bound on a loaded
    # machine. The slack covers the few statements from the window check
    # to Locust's start time.
    def sent(log):
        return [r.start - t0 for r in report.read_requests(tmp_path / log)]

    def inside(ws, t):
        return any(w[0] <= t <= w[1] + 0.05 for w in ws)

    vip_sent = sent("requests.csv") + [t - t0 for t in json.loads((tmp_path / "window.json").read_text())["unfinished"]]
    assert conns["vip"] and [round(t, 3) for t in vip_sent if not inside(onoff, t)] == []
    assert {any(w[0] <= t <= w[1] for t in vip_sent) for w in onoff} == {True}
    assert conns["direct"] and [round(t, 3) for t in sent("direct.csv") if not inside(windows, t)] == []
    # Keep-alive: many requests per connection, each connection ended by
    # the client's close; direct requests: one connection each.
    ports = {p for p, _t, _c in conns["vip"]}
    assert len(conns["vip"]) >= 3 * len(ports), (len(conns["vip"]), len(ports))
    assert {c for _p, _t, c in conns["vip"]} == {"keep-alive", "close"}
    assert {c for _p, _t, c in conns["direct"]} == {"close"}
    assert len({p for p, _t, _c in conns["direct"]}) == len(conns["direct"])
    # Each population in its own log.
    assert len(report.read_requests(tmp_path / "requests.csv")) <= len(conns["vip"])
    assert 0 < len(report.read_requests(tmp_path / "direct.csv")) <= len(conns["direct"])
    assert len(report.read_requests(tmp_path / "requests.csv")) >= len(conns["vip"]) - 3


def open_loop_run(tmp_path, handler, rate: float, seconds: float, env: dict) -> dict:
    """The locustfile's open loop at `rate` for `seconds` against a server
    of `handler` (with `env` besides), its requests logged in `tmp_path`;
    returns the measurement window it wrote."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = {
            "INBAND_BENCH_REQUESTS": str(tmp_path / "requests.csv"),
            "INBAND_BENCH_WINDOW": str(tmp_path / "window.json"),
            "INBAND_BENCH_OPEN_RATE": str(rate),
            "PATH": "/usr/bin:/bin",
            **env,
        }
        cp = locust_run(users=1, seconds=seconds, port=srv.server_port, env=env)
    finally:
        srv.shutdown()
    assert (tmp_path / "window.json").exists(), cp.stderr[-2000:]
    return json.loads((tmp_path / "window.json").read_text())


def test_open_loop_arrivals_keep_their_rate_while_the_server_is_slow(tmp_path):
    rate, slow_s = 40.0, 0.5
    active, most = [0], [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - http.server's naming
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            time.sleep(slow_s)
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.end_headers()
            self.wfile.write(b"x" * 10)
            with lock:
                active[0] -= 1

        def log_message(self, *_a):
            pass

    window = open_loop_run(tmp_path, Handler, rate, RUN_S, {})
    t0, t1 = window["t0"], window["t1"]
    starts = sorted([r.start for r in report.read_requests(tmp_path / "requests.csv")] + window["unfinished"])
    # A closed loop of one user would have sent t/slow_s requests; the open
    # one started one every 1/rate s from its first, the last slow_s of
    # them still in flight at the stop. (From the first: how late Locust
    # spawns the user after the start is not the generator's rate.)
    expected = rate * (t1 - starts[0])
    assert 0.85 * expected <= len(starts) <= expected + 2, (len(starts), expected)
    assert len(window["unfinished"]) >= rate * slow_s / 2, window["unfinished"]
    assert most[0] >= rate * slow_s / 2, most
    gaps = sorted(b - a for a, b in zip(starts, starts[1:]))
    assert abs(gaps[len(gaps) // 2] - 1 / rate) < 0.25 / rate, gaps[len(gaps) // 2]


def test_open_loop_arrivals_come_only_inside_the_on_windows(tmp_path):
    rate, windows = 40.0, [[0.3, 0.8], [1.4, 1.9]]

    class Handler(Quiet):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.one_byte()

    window = open_loop_run(tmp_path, Handler, rate, 2.5, {"INBAND_BENCH_ONOFF": json.dumps(windows)})
    starts = sorted([r.start - window["t0"] for r in report.read_requests(tmp_path / "requests.csv")] + [t - window["t0"] for t in window["unfinished"]])
    # Each window gets its own rate × length arrivals (the first at its
    # start), none between or after them (a scheduling slack of 20 ms).
    per_window = [[t for t in starts if a - 0.02 <= t < b + 0.02] for a, b in windows]
    assert [len(w) for w in per_window] == [round(rate * (b - a)) for a, b in windows], (per_window, starts)
    assert len(starts) == sum(len(w) for w in per_window), starts
    assert [round(w[0], 1) for w in per_window] == [a for a, _b in windows], per_window


def test_a_draw_seed_sends_the_same_requests_in_every_run(tmp_path):
    def draws(seed: str) -> list[str]:
        seen = []

        class Handler(Quiet):
            def do_GET(self):  # noqa: N802 - http.server's naming
                seen.append(self.headers.get("X-Service-Draw"))
                time.sleep(0.01)
                self.one_byte()

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        env = {"INBAND_BENCH_DRAW_SEED": seed, "PATH": "/usr/bin:/bin"} if seed else {"PATH": "/usr/bin:/bin"}
        try:
            cp = locust_run(users=3, seconds=1, port=srv.server_port, env=env)
        finally:
            srv.shutdown()
        assert len(seen) >= 10, cp.stderr[-2000:]
        return seen

    a, b, other, none = draws("7"), draws("7"), draws("8"), draws("")
    for d in a:
        u, v = (float(x) for x in d.split(","))
        assert 0 < u <= 1 and 0 <= v < 1, d
    # Each user sends its own sequence: whatever the timing, the requests
    # both runs sent are the same ones (each user's first ones), and
    # another seed's share none.
    common = set(a) & set(b)
    assert len(common) >= 0.8 * min(len(set(a)), len(set(b))), (len(common), len(set(a)), len(set(b)))
    assert not set(a) & set(other)
    assert none == [None] * len(none)

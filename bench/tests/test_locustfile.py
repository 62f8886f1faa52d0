"""The locustfile against a local HTTP server (no root, no testbed): what it
sends, and the per-request log and window it writes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.lib import locust as report

REPO = Path(__file__).resolve().parents[2]
BODY = b"x" * 47104
RUN_S = 2


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
        cp = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO / "bench" / "locustfile.py"), "--headless", "--only-summary",
             "-u", "3", "-r", "3", "-t", f"{RUN_S}s", "--host", f"http://127.0.0.1:{srv.server_port}", "--loglevel", "WARNING"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    finally:
        srv.shutdown()
    assert (tmp_path / "window.json").exists(), cp.stderr[-2000:]
    t0, t1 = report.read_window(tmp_path / "window.json")
    # No lower bound: Locust arms -t on gevent's cached loop clock, from
    # before its start-up, so a loaded machine charges start-up to the
    # limit and the window comes out shorter than -t. It ends at the limit,
    # later only by the timer firing late and the users being stopped
    # before t1 is taken: 2 s of slack covers both on a busy 2-core machine.
    assert t1 - t0 < RUN_S + 2.0
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
    assert json.loads((tmp_path / "window.json").read_text()).keys() == {"t0", "t1"}

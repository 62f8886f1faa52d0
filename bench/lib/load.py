"""Closed-loop downloads through a testbed while something changes: how
many complete, how many fail, and when each failure ran."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass

from .procs import ns_argv


@dataclass
class Loads:
    ok: int = 0
    failed: int = 0
    durations: list | None = None
    # Each failed download: when it ran (seconds from the start of the
    # run, so it can be set against the changes), curl's exit code, what
    # it got, and its local port (to find its flow in the balancers' logs).
    failures: list | None = None

    @property
    def failed_pct(self) -> float:
        n = self.ok + self.failed
        return 100.0 * self.failed / n if n else 0.0


def closed_loop(netns: str, vip6: str, clients: int, size_mb: int, seconds: float, changes, max_s: float = 60) -> Loads:
    """`clients` download loops (curl, from `netns`, of http://[vip6]/) for `seconds`; `changes(t)` runs on
    the driver's thread meanwhile. Requests that start before the end are
    all waited for, each at most `max_s` (then it counts as failed)."""
    url = f"http://[{vip6}]/"
    body = size_mb * 1_000_000
    loads, lock, stop = Loads(durations=[], failures=[]), threading.Lock(), threading.Event()
    t0 = time.monotonic()

    def loop():
        while not stop.is_set():
            t = time.monotonic()
            cp = subprocess.run(ns_argv(netns, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{local_port}",
                                "--max-time", f"{max_s:g}", url]), capture_output=True, text=True, timeout=max_s + 30)
            got, _, port = cp.stdout.rpartition(" ")
            with lock:
                if cp.returncode == 0 and got == f"200 {body}":
                    loads.ok += 1
                    loads.durations.append(time.monotonic() - t)
                else:
                    loads.failed += 1
                    loads.failures.append({"start_s": round(t - t0, 3), "end_s": round(time.monotonic() - t0, 3), "curl_exit": cp.returncode,
                                           "got": got, "local_port": port})

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()
    try:
        changes(t0, t0 + seconds)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=max_s + 60)
    return loads

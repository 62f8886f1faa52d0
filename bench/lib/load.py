"""Closed-loop downloads through a testbed while something changes: how
many complete, how many fail, and when each failure ran."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .procs import ns_argv
from .results import REPO


@dataclass
class Loads:
    ok: int = 0
    failed: int = 0
    durations: list | None = None
    # Each failed download: when it ran (seconds from the start of the
    # run, so it can be set against the changes), curl's exit code, what
    # it got, and its local port (to find its flow in the balancers' logs).
    failures: list | None = None
    # With `timed`: every download (start and end as above, its first and
    # last byte on the same scale, its local port, whether it completed,
    # and the longest pause in its body, ms).
    timed: list | None = None

    @property
    def failed_pct(self) -> float:
        n = self.ok + self.failed
        return 100.0 * self.failed / n if n else 0.0


def closed_loop(netns: str, vip6: str, clients: int, size_mb: int, seconds: float, changes, max_s: float = 60,
                timed: bool = False) -> Loads:
    """`clients` download loops (curl, from `netns`, of http://[vip6]/) for `seconds`; `changes(t)` runs on
    the driver's thread meanwhile. Requests that start before the end are
    all waited for, each at most `max_s` (then it counts as failed). With
    `timed`, bench.lib.fetch downloads instead of curl and each download's
    longest pause is kept (Loads.timed)."""
    url = f"http://[{vip6}]/"
    body = size_mb * 1_000_000
    loads, lock, stop = Loads(durations=[], failures=[], timed=[]), threading.Lock(), threading.Event()
    t0 = time.monotonic()
    if timed:
        argv = ns_argv(netns, [sys.executable, "-m", "bench.lib.fetch", url, f"{max_s:g}"])
    else:
        argv = ns_argv(netns, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{local_port}", "--max-time", f"{max_s:g}", url])

    def loop():
        while not stop.is_set():
            t = time.monotonic()
            cp = subprocess.run(argv, capture_output=True, text=True, timeout=max_s + 30, cwd=REPO)
            words = cp.stdout.split()
            got, port = " ".join(words[:2]), words[2] if len(words) > 2 else ""
            ok = cp.returncode == 0 and got == f"200 {body}"
            with lock:
                if ok:
                    loads.ok += 1
                    loads.durations.append(time.monotonic() - t)
                else:
                    loads.failed += 1
                    loads.failures.append({"start_s": round(t - t0, 3), "end_s": round(time.monotonic() - t0, 3), "curl_exit": cp.returncode,
                                           "got": got, "local_port": port})
                if timed and len(words) > 5:
                    first, last = float(words[4]), float(words[5])
                    loads.timed.append({"start_s": round(t - t0, 3), "end_s": round(time.monotonic() - t0, 3),
                                        "first_byte_s": round(first - t0, 3) if first else None,
                                        "last_byte_s": round(last - t0, 3) if last else None,
                                        "local_port": port, "ok": ok, "gap_ms": float(words[3])})

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

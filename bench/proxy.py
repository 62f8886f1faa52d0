"""L7 proxy caches end to end (issue 4, benchmarks 2 and 3), in one run:

    python -m bench.proxy --out results/proxy

`inband proxy` with each cache backend (LMDB, RocksDB, memory, files),
nginx `proxy_cache` and Varnish (malloc storage), all in front of one
origin (nginx serving the objects as files, cacheable for an hour, and
`no-store` for the misses' paths; its stub_status counts the requests
that reach it) on 127.0.0.1.

1. Hits: every cache is filled (each object once) and warmed, then wrk
   requests zipfian-distributed paths from each system in turn, for a few
   interleaved rounds, at each number of connections (8, 50, 500): req/s,
   p50/p99 latency, CPU of the system's processes, with ratios to nginx
   and Varnish.
2. Misses: paths the origin marks `no-store`, so every request passes
   through each system to the origin: req/s, latency, CPU per request.
3. Restart: each system is stopped and started again on the same cache
   directory, and the same workload is replayed from its first response
   for a few seconds: origin requests and hit ratio in that window.

Prints Markdown tables, writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/proxy),
results.csv, restart_timeline.csv and proxy.png into --out. Every process
is stopped and every temporary directory removed at the end, on Ctrl-C and
SIGTERM too. See docs/benchmarks.md ("L7 proxy cache").
"""

from __future__ import annotations

import argparse
import csv
import http.client
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .lib import peers
from .lib.origin import STATS_PATH, body_for
from .lib import preflight, profiles
from .lib.host import others_running, session_cpu_s
from .lib.report import table
from .lib.results import REPO, Run, default_dir, provenance, revive
from .lib.results import write as write_results
from .lib.systems import System
from .lib.tools import parse_wrk
from .lib.outcome import Outcome
from .lib.procs import Fatal, Procs, run, stop_signals_interrupt, wait_until

HOST = "127.0.0.1"
CAPACITY = 1 << 30  # every cache's size bound, far above the data set: nothing is evicted
ORIGIN_MAX_AGE_S = 3600  # far beyond any run: a cached object never goes stale


@dataclass(frozen=True)
class Cache(System):
    durable: bool  # its objects survive a restart


SYSTEMS = [
    Cache("inband-lmdb", "inband LMDB", True),
    Cache("inband-rocksdb", "inband RocksDB", True),
    Cache("inband-memory", "inband memory", False),
    Cache("inband-files", "inband files", True),
    Cache("nginx", "nginx proxy_cache", True),
    Cache("varnish", "Varnish (malloc)", False),
    # Not a cache: the objects as files, served by nginx. The limit.
    Cache("static", "limit: nginx static files", False),
]
BY_KEY = {s.key: s for s in SYSTEMS}
# The misses' limit: wrk's keep-alive connections straight to the origin,
# no proxy. Every system's miss is bounded by what the origin answers.
ORIGIN = Cache("origin", "limit: wrk straight to the origin", False)


@dataclass(frozen=True)
class Profile:
    objects: int
    object_bytes: int
    zipf: float
    rounds: int  # interleaved measurement rounds per system; medians reported
    measure_s: int  # per round (wrk counts whole seconds)
    warm_s: int
    window_s: int  # after a restart
    connections: tuple  # wrk connections, one hits measurement each
    miss_s: int  # per round of pass-through requests


PROFILES = {
    "default": Profile(objects=5000, object_bytes=10240, zipf=0.99, rounds=3, measure_s=5, warm_s=2, window_s=5, connections=(8, 50, 500), miss_s=3),
    # The test: every table filled, nothing measured well.
    "quick": Profile(objects=200, object_bytes=10240, zipf=0.99, rounds=1, measure_s=1, warm_s=1, window_s=1, connections=(4, 20), miss_s=1),
}



# ------------------------------------------------------------------ wrk

# Paths /obj/1 .. /obj/N, rank 1 the most popular, zipfian with exponent s;
# a fixed seed, so every system gets the same sequence.
WRK_LUA = r"""
local n = tonumber(os.getenv("BENCH_OBJECTS"))
local s = tonumber(os.getenv("BENCH_ZIPF"))
local cdf = {}

function init(args)
  local total = 0
  for k = 1, n do
    total = total + 1 / k ^ s
    cdf[k] = total
  end
  for k = 1, n do cdf[k] = cdf[k] / total end
  math.randomseed(tonumber(os.getenv("BENCH_SEED")))
end

local pass = os.getenv("BENCH_PASS") == "1"
local sent = 0

function request()
  if pass then
    -- Every request a path never asked before: a miss everywhere.
    sent = sent + 1
    return wrk.format("GET", "/pass/" .. math.random(1, 1000000000) .. "-" .. sent)
  end
  local u = math.random()
  local lo, hi = 1, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return wrk.format("GET", "/obj/" .. lo)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH requests=%d bytes=%d errors=%d status_errors=%d p50_us=%d p99_us=%d duration_us=%d\n",
    summary.requests, summary.bytes, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), summary.duration))
end
"""


# ------------------------------------------------------------------ counters






# What the recorded measurement waits out: builds take both cores, the
# forwarding benchmark saturates them. bench.paper is a light load and runs
# for hours; it is only reported.
BLOCKING = {"cargo", "rustc", "bench.forwarding"}


def wait_quiet(max_s: float, log, hold_s: float = 5) -> str:
    """Waits until no build and no forwarding benchmark runs for `hold_s`
    seconds in a row (at most `max_s`); says what it found."""
    if max_s <= 0:
        return "not waited for (--wait-quiet 0)"
    deadline = time.monotonic() + max_s
    quiet_since = None
    announced = False
    while True:
        busy = others_running() & BLOCKING
        now = time.monotonic()
        if not busy:
            quiet_since = quiet_since or now
            if now - quiet_since >= hold_s:
                return f"no {', '.join(sorted(BLOCKING))} running for {hold_s:.0f} s"
        else:
            quiet_since = None
            if not announced:
                log(f"waiting (at most {max_s:.0f} s) for {', '.join(sorted(busy))} to end")
                announced = True
        if now >= deadline:
            return f"still running after {max_s:.0f} s: {', '.join(sorted(busy))}"
        time.sleep(min(1.0, hold_s / 2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    return f"{HOST}:{port} " in run(None, ["ss", "-Hltn"]).stdout


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def write_objects(root: Path, objects: int, size: int) -> None:
    """`root/obj/1` ... `root/obj/N`, each the bytes of its path."""
    (root / "obj").mkdir(parents=True, exist_ok=True)
    for k in range(1, objects + 1):
        (root / "obj" / str(k)).write_bytes(body_for(f"/obj/{k}", size))


def stub_status_requests(text: str) -> int:
    """The request count in nginx's stub_status page (the third number
    of the line under "server accepts handled requests")."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == "server accepts handled requests":
            return int(lines[i + 1].split()[2])
    raise RuntimeError(f"not a stub_status page: {text[:200]!r}")


# ------------------------------------------------------------------ results


@dataclass
class Hits:
    key: str
    label: str
    conns: int = 0
    rounds: list = field(default_factory=list)  # wrk summaries, each with cpu_s and origin
    fill_s: float = 0.0
    fill_origin: int = 0
    warm_origin: int = 0

    def _median(self, f) -> float:
        return statistics.median(f(r) for r in self.rounds) if self.rounds else 0.0

    @property
    def rps(self) -> float:
        return self._median(lambda r: r["requests"] / (r["duration_us"] / 1e6))

    @property
    def p50_ms(self) -> float:
        return self._median(lambda r: r["p50_us"] / 1000)

    @property
    def p99_ms(self) -> float:
        return self._median(lambda r: r["p99_us"] / 1000)

    @property
    def cores(self) -> float:
        secs = sum(r["duration_us"] for r in self.rounds) / 1e6
        return sum(r["cpu_s"] for r in self.rounds) / secs if secs else 0.0

    @property
    def cpu_us_per_req(self) -> float:
        n = sum(r["requests"] for r in self.rounds)
        return sum(r["cpu_s"] for r in self.rounds) / n * 1e6 if n else 0.0

    @property
    def origin(self) -> int:
        return sum(r["origin"] for r in self.rounds)

    @property
    def errors(self) -> int:
        return sum(r["errors"] + r["status_errors"] for r in self.rounds)


@dataclass
class Restart:
    key: str
    label: str
    durable: bool
    ready_s: float
    requests: int
    errors: int
    origin: int
    window_s: float
    timeline: list = field(default_factory=list)  # (seconds since first response possible, origin requests so far)
    others: list = field(default_factory=list)  # blocking work seen at the window's start or end

    @property
    def hit_ratio(self) -> float:
        return max(0.0, 1 - self.origin / self.requests) if self.requests else 0.0


# ------------------------------------------------------------------ tables




def _table(headers: list[str], rows: list[list[str]]) -> str:
    return table(headers, rows, numeric=True) + "\n"


def _times(a: float, b: float | None) -> str:
    return f"{a / b:.2f}×" if b else "–"


def hits_table(rows: list[Hits]) -> str:
    """One row per system and number of connections; ratios against nginx
    and Varnish at the same number of connections."""
    ref = {(r.key, r.conns): r for r in rows if r.rounds}
    out = []
    for r in rows:
        if not r.rounds:
            out.append([r.label, str(r.conns)] + ["not measured"] + ["–"] * 11)
            continue
        ng, va, lim = ref.get(("nginx", r.conns)), ref.get(("varnish", r.conns)), ref.get(("static", r.conns))
        out.append([
            r.label, str(r.conns), f"{r.rps:,.0f}", _times(r.rps, ng and ng.rps), _times(r.rps, va and va.rps), _times(r.rps, lim and lim.rps),
            f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.cores:.2f}", f"{r.cpu_us_per_req:.1f}",
            _times(r.cpu_us_per_req, ng and ng.cpu_us_per_req), _times(r.cpu_us_per_req, va and va.cpu_us_per_req),
            str(r.origin), str(r.errors),
        ])  # fmt: skip
    headers = [
        "system", "connections", "req/s", "÷ nginx", "÷ Varnish", "÷ limit", "p50 ms", "p99 ms", "CPU (cores)", "CPU µs/req",
        "CPU ÷ nginx", "CPU ÷ Varnish", "origin requests", "errors",
    ]  # fmt: skip
    return _table(headers, out)


def misses_table(rows: list[Hits]) -> str:
    """Pass-through: every request reaches the origin, so origin requests
    ÷ requests should be 1 for everyone."""
    ng = next((r for r in rows if r.key == "nginx" and r.rounds), None)
    lim = next((r for r in rows if r.key == ORIGIN.key and r.rounds), None)
    out = []
    for r in rows:
        if not r.rounds:
            out.append([r.label, "not measured"] + ["–"] * 8)
            continue
        n = sum(x["requests"] for x in r.rounds)
        # The limit runs no proxy: no CPU of its own to compare.
        cpu = ["–", "–"] if r.key == ORIGIN.key else [f"{r.cpu_us_per_req:.1f}", _times(r.cpu_us_per_req, ng and ng.cpu_us_per_req)]
        out.append([
            r.label, f"{r.rps:,.0f}", _times(r.rps, ng and ng.rps), _times(r.rps, lim and lim.rps), f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}",
            *cpu, f"{r.origin / n:.2f}" if n else "–", str(r.errors),
        ])  # fmt: skip
    headers = ["system", "req/s", "÷ nginx", "÷ limit", "p50 ms", "p99 ms", "CPU µs/req", "CPU ÷ nginx", "origin requests ÷ requests", "errors"]
    return _table(headers, out)


def restart_table(rows: list[Restart], window_s: int, objects: int) -> str:
    out = [
        [
            r.label, "yes" if r.durable else "no", f"{r.ready_s * 1000:.0f}", f"{r.requests:,}", f"{r.origin:,}",
            f"{r.hit_ratio * 100:.1f} %", f"{r.origin / objects * 100:.1f} %", str(r.errors),
        ]  # fmt: skip
        for r in rows
    ]
    headers = [
        "system", "cache kept on disk", "restart → first response ms", f"requests in first {window_s} s",
        f"origin requests in first {window_s} s", "hit ratio", "origin requests ÷ objects", "errors",
    ]  # fmt: skip
    return _table(headers, out)


def disturbed_note(runs: list[tuple[str, list]], what: str) -> str:
    bad = [(label, others) for label, others in runs if others]
    if not runs:
        return ""
    if not bad:
        return f"No build or forwarding benchmark was running at the start or end of any of the {len(runs)} {what}.\n"
    which = "; ".join(f"{label} ({', '.join(o)})" for label, o in bad)
    return f"**{len(bad)} of {len(runs)} {what} had a build or the forwarding benchmark running at their start or end:** {which}.\n"


def hits_json(h: Hits) -> dict:
    """A row's rounds and, for whoever reads the JSON, their medians."""
    return {**asdict(h), "rps": h.rps, "p50_ms": h.p50_ms, "p99_ms": h.p99_ms, "cpu_us_per_req": h.cpu_us_per_req}


def ab_numbers(record: dict) -> dict[str, list[float]]:
    """For bench.ab: per round, each inband store's hits and misses a
    second ÷ nginx `proxy_cache`'s in the same round (the rounds are
    interleaved), and its CPU per hit or miss ÷ nginx's, at each number of
    connections."""
    out: dict[str, list[float]] = {}
    for case, one in (("hits", "hit"), ("misses", "miss")):
        rows = record["rows"].get(case, [])
        nginx = {h["conns"]: h["rounds"] for h in rows if h["key"] == "nginx"}
        for h in rows:
            if not h["key"].startswith("inband-"):
                continue
            for i, r in enumerate(h["rounds"]):
                what = f"{h['label']}, {h['conns']} connections"
                theirs = nginx.get(h["conns"], [])[i : i + 1]
                if theirs and theirs[0]["requests"]:
                    rate = r["requests"] / r["duration_us"]
                    out.setdefault(f"{what}: {case} ÷ nginx", []).append(rate / (theirs[0]["requests"] / theirs[0]["duration_us"]))
                if theirs and r["requests"] and theirs[0]["cpu_s"]:
                    per = r["cpu_s"] / r["requests"]
                    out.setdefault(f"{what}: CPU per {one} ÷ nginx", []).append(per / (theirs[0]["cpu_s"] / theirs[0]["requests"]))
    return out


TOOLS = {"nginx": ["nginx", "-v"], "varnish": ["varnishd", "-V"], "wrk": ["wrk", "-v"]}


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    rows, m = record["rows"], record["machine"]
    others = ", ".join(record["others"]) or "none seen"
    preamble = (
        "# L7 proxy cache: inband proxy vs nginx proxy_cache vs Varnish\n\n"
        f"{provenance(record)}  \n"
        f"The CPUs are **shared by** wrk (1 thread), the system under test, the origin ({ORIGINS[record.get('origin', 'python')][0]}, idle once the caches are filled), "
        f"the driver and the other systems (started, idle); before measuring: {record['quiet']}; other work seen during the run: {others}.  \n"
        + "; ".join(f"{k}: {m[k]}" for k in ("inband", "nginx", "varnish", "wrk") if k in m) + "\n"
    )
    if record["failed"]:
        preamble += "\n**Failed:** " + "; ".join(record["failed"]) + "\n"
    p = Profile(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in record["profile"].items() if k != "name"})
    return markdown([revive(Hits, h) for h in rows["hits"]], [revive(Hits, h) for h in rows["misses"]], [revive(Restart, r) for r in rows["restart"]], p, preamble,
                    record.get("origin", "python"))


# What each origin a record names was, for its tables: (short, in the
# misses' note). Records before the nginx origin name none: Python.
ORIGINS = {
    "python": ("Python", "The origin is `bench/lib/origin.py` (Python): it bounds every system's rate alike, so the CPU per request is the comparison"),
    "nginx": ("nginx", "The origin is nginx serving the objects as files (`peers.nginx_origin_conf`) on the same two CPUs"),
}


def markdown(hits: list[Hits], misses: list[Hits], restarts: list[Restart], p: Profile, preamble: str, origin: str = "nginx") -> str:
    parts = [preamble]
    if hits:
        conns = ", ".join(str(c) for c in p.connections)
        parts += [
            f"\n## Hits: {p.objects:,} objects of {p.object_bytes:,} bytes, zipf {p.zipf}, wrk 1 thread × {conns} connections, "
            f"median of {p.rounds} × {p.measure_s} s\n",
            hits_table(hits),
            "\nCPU is the system's own processes (utime + stime); origin requests while measured should be 0 (every cache was filled).  \n",
            disturbed_note([(h.label, r["others"]) for h in hits for r in h.rounds], "rounds"),
        ]
    if misses:
        parts += [
            f"\n## Misses: `no-store` paths, every request through to the origin, wrk 1 thread × {p.connections[0]} connections, "
            f"median of {p.rounds} × {p.miss_s} s\n",
            misses_table(misses),
            f"\n{ORIGINS[origin][1]}; the limit, where measured, is what it answers with no proxy in front, in the same rounds.  \n",
        ]
    if restarts:
        parts += [
            f"\n## Restart: the same workload for {p.window_s} s from the first response after a restart\n",
            restart_table(restarts, p.window_s, p.objects),
            "\n" + disturbed_note([(r.label, r.others) for r in restarts], "restart windows"),
        ]
    return "".join(parts)


def write_csv(hits: list[Hits], restarts: list[Restart], path: Path) -> None:
    rest = {r.key: r for r in restarts}
    first = hits[0].conns if hits else 0
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "label", "connections", "rps", "p50_ms", "p99_ms", "cpu_cores", "cpu_us_per_req", "origin_while_measured", "errors",
                    "restart_ready_ms", "restart_requests", "restart_origin", "restart_hit_ratio"])  # fmt: skip
        for h in hits:
            r = rest.get(h.key) if h.conns == first else None
            w.writerow([
                h.key, h.label, h.conns, f"{h.rps:.1f}", f"{h.p50_ms:.3f}", f"{h.p99_ms:.3f}", f"{h.cores:.3f}", f"{h.cpu_us_per_req:.2f}", h.origin, h.errors,
                f"{r.ready_s * 1000:.1f}" if r else "", r.requests if r else "", r.origin if r else "", f"{r.hit_ratio:.4f}" if r else "",
            ])  # fmt: skip


def write_timeline(restarts: list[Restart], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "seconds", "origin_requests"])
        for r in restarts:
            for t, n in r.timeline:
                w.writerow([r.key, f"{t:.3f}", n])


def plot(hits: list[Hits], restarts: list[Restart], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server; must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    # The first number of connections; the table has the others.
    done = [h for h in hits if h.rounds and h.conns == hits[0].conns]
    labels = [h.label.replace(" ", "\n", 1) for h in done]
    ax = axes[0]
    bars = ax.bar(labels, [h.rps for h in done], color="tab:blue")
    for b, h in zip(bars, done):
        ax.annotate(f"p99 {h.p99_ms:.1f} ms", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_title(f"cache hits: requests/s ({hits[0].conns if hits else 0} connections)")
    ax.tick_params(axis="x", labelsize=8)
    ax = axes[1]
    ax.bar(labels, [h.cpu_us_per_req for h in done], color="tab:orange")
    ax.set_title("CPU µs per request (the system's processes)")
    ax.tick_params(axis="x", labelsize=8)
    ax = axes[2]
    for r in restarts:
        if r.timeline:
            # Durable caches lie on top of each other at 0: dashed, totals in the legend.
            ax.step([t for t, _ in r.timeline], [n for _, n in r.timeline], where="post", linestyle="--" if r.durable else "-", label=f"{r.label} ({r.origin:,})")
    ax.set_title("after a restart: origin requests so far")
    ax.set_xlabel("seconds since the first response")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the run


class Bench:
    def __init__(self, args, profile: Profile, out: Path):
        self.args = args
        self.p = profile
        self.out = out
        self.inband = Path(args.inband).resolve()  # the systems run in the temp dir
        self.procs = Procs()
        self.tmp = Path(tempfile.mkdtemp(prefix="inband-bench-proxy-"))
        self.origin_port = free_port()
        self.stats_lock = threading.Lock()  # the restart's sampler asks too
        self.stats_asked = 0
        self.ports = {s.key: free_port() for s in SYSTEMS}
        self.running: dict[str, subprocess.Popen] = {}
        self.others: set[str] = set()
        self.wait_budget_s = args.wait_quiet  # for all waits of the run together
        self.lua = self.tmp / "zipf.lua"
        self.lua.write_text(WRK_LUA)

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def note_others(self) -> set[str]:
        """Other work now; returns the part that disturbs a measurement."""
        seen = others_running()
        self.others |= seen
        return seen & BLOCKING

    def settle(self, hold_s: float = 2) -> str:
        """Before each measurement: builds and the forwarding benchmark come
        and go on this machine; wait them out while the budget lasts."""
        if self.wait_budget_s <= 0:
            return "not waited for"
        t0 = time.monotonic()
        found = wait_quiet(self.wait_budget_s, self.log, hold_s)
        self.wait_budget_s -= time.monotonic() - t0
        return found

    # --- processes

    def start_origin(self) -> None:
        state = self.tmp / "origin"
        root = state / "root"
        write_objects(root, self.p.objects, self.p.object_bytes)
        (root / "pass-body").write_bytes(body_for("/pass/", self.p.object_bytes))
        cfg = self.out / "configs" / "origin.conf"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(peers.nginx_origin_conf(listen=f"{HOST}:{self.origin_port}", root=str(root), prefix=str(state), workers=os.cpu_count() or 1,
                                               as_root=os.geteuid() == 0, max_age=ORIGIN_MAX_AGE_S))
        argv = ["nginx", "-c", str(cfg), "-p", str(state), "-e", str(state / "error.log"), "-g", "daemon off;"]
        log = self.out / "logs" / "origin.log"
        proc = self.procs.spawn("origin", None, argv, log, cwd=self.tmp)
        wait_until("the origin", lambda: self._alive(proc, "origin", log) and self.origin_count() >= 0, 20)

    def origin_count(self) -> int:
        """Requests the origin has answered, its own stats requests not
        counted: stub_status counts every request, the one asking too."""
        with self.stats_lock:
            status, body = http_get(self.origin_port, STATS_PATH)
            if status != 200:
                raise RuntimeError(f"origin stats: {status}")
            # Counted once answered: a connection refused reached no count.
            self.stats_asked += 1
            return stub_status_requests(body.decode()) - self.stats_asked

    def _alive(self, proc, what: str, log: Path) -> bool:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise Fatal(f"{what} exited with {proc.returncode}: {tail}")
        return True

    def config(self, s: Cache) -> list[str]:
        """Writes the system's config (once; a restart reuses it) and returns its argv."""
        cfg_dir = self.out / "configs"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        state = self.tmp / s.key
        state.mkdir(exist_ok=True)
        listen = f"{HOST}:{self.ports[s.key]}"
        origin = f"{HOST}:{self.origin_port}"
        if s.key.startswith("inband-"):
            backend = s.key.removeprefix("inband-")
            cfg = cfg_dir / f"{s.key}.toml"
            cfg.write_text(peers.proxy_toml(listen=listen, origin=origin, backend=backend, path=None if backend == "memory" else str(state / "cache"), capacity_bytes=CAPACITY))
            return [str(self.inband), "proxy", "--config", str(cfg)]
        if s.key == "nginx":
            cfg = cfg_dir / "nginx.conf"
            cfg.write_text(peers.nginx_conf(listen=listen, origin=origin, prefix=str(state), max_size_bytes=CAPACITY, workers=os.cpu_count() or 1, as_root=os.geteuid() == 0))
            return ["nginx", "-c", str(cfg), "-p", str(state), "-e", str(state / "error.log"), "-g", "daemon off;"]
        if s.key == "static":
            root = state / "root"
            write_objects(root, self.p.objects, self.p.object_bytes)
            cfg = cfg_dir / "nginx-static.conf"
            cfg.write_text(peers.nginx_static_conf(listen=listen, root=str(root), prefix=str(state), workers=os.cpu_count() or 1, as_root=os.geteuid() == 0))
            return ["nginx", "-c", str(cfg), "-p", str(state), "-e", str(state / "error.log"), "-g", "daemon off;"]
        vcl = cfg_dir / "varnish.vcl"
        vcl.write_text(peers.varnish_vcl(origin_host=HOST, origin_port=self.origin_port))
        # -j none: no privilege separation (the packaged users' jail is for
        # the service); -T none: no management port; -n: state in our temp dir.
        return ["varnishd", "-F", "-a", listen, "-f", str(vcl), "-s", f"malloc,{CAPACITY}", "-n", str(state / "varnish"), "-T", "none", "-j", "none"]

    def start(self, s: Cache) -> float:
        """Starts the system; returns the seconds until it answered through
        to the origin (a request the origin does not count)."""
        argv = self.config(s)
        env = dict(os.environ, INBAND_LOG="warn")  # no access log: the peers keep none either
        log = self.out / "logs" / f"{s.key}.log"
        t0 = time.monotonic()
        proc = self.procs.spawn(s.key, None, argv, log, env=env, cwd=self.tmp)
        self.running[s.key] = proc
        port = self.ports[s.key]
        wait_until(f"{s.label} to answer", lambda: self._alive(proc, s.label, log) and http_get(port, STATS_PATH, 2.0)[0] == 200, 60, 0.01)
        return time.monotonic() - t0

    def stop(self, s: Cache) -> None:
        proc = self.running.pop(s.key)
        self.procs.stop(proc, grace_s=15)
        # Bounded: a system that keeps its port after its process is gone
        # must not meet its successor there.
        wait_until(f"{s.label} to release its port", lambda: not listening(self.ports[s.key]), 15)

    # --- load

    def wrk(self, s: Cache, seconds: int, conns: int | None = None, passthrough: bool = False) -> dict:
        conns = conns or self.p.connections[0]
        port = self.origin_port if s.key == ORIGIN.key else self.ports[s.key]
        argv = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--timeout", "5s", "-s", str(self.lua), f"http://{HOST}:{port}/"]
        env = dict(os.environ, BENCH_OBJECTS=str(self.p.objects), BENCH_ZIPF=str(self.p.zipf), BENCH_SEED="4", BENCH_PASS="1" if passthrough else "0")
        cp = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds + 30)
        if cp.returncode != 0:
            raise RuntimeError(f"wrk failed ({cp.returncode}): {cp.stderr.strip()[-500:]}")
        return parse_wrk(cp.stdout)

    def fill(self, s: Cache) -> float:
        """Each object once, over a few keep-alive connections; every
        response checked for its size."""
        port = self.ports[s.key]
        workers = 4
        errors: list[str] = []

        def worker(i: int) -> None:
            c = http.client.HTTPConnection(HOST, port, timeout=10)
            try:
                for k in range(1 + i, self.p.objects + 1, workers):
                    c.request("GET", f"/obj/{k}")
                    r = c.getresponse()
                    body = r.read()
                    if r.status != 200 or len(body) != self.p.object_bytes:
                        errors.append(f"/obj/{k}: {r.status}, {len(body)} bytes")
                        return
            except Exception as e:  # noqa: BLE001 - reported by the caller
                errors.append(f"{e.__class__.__name__}: {e}")
            finally:
                c.close()

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"filling {s.label} took over 120 s")
        if errors:
            raise RuntimeError(f"filling {s.label}: {errors[0]}")
        return time.monotonic() - t0

    def measure(self, s: Cache, h: Hits, passthrough: bool = False) -> None:
        self.settle()
        # Its own session: the leader's pid. The limit has no process.
        cpu = (lambda: 0.0) if s.key == ORIGIN.key else (lambda sid=self.running[s.key].pid: session_cpu_s(sid))
        before = self.note_others()
        o0, c0 = self.origin_count(), cpu()
        w = self.wrk(s, self.p.miss_s if passthrough else self.p.measure_s, h.conns, passthrough)
        w["cpu_s"] = cpu() - c0
        w["origin"] = self.origin_count() - o0
        w["others"] = sorted(before | self.note_others())
        h.rounds.append(w)

    def restart(self, s: Cache) -> Restart:
        self.settle()
        before = self.note_others()
        self.stop(s)
        ready_s = self.start(s)
        o0 = self.origin_count()
        timeline = [(0.0, 0)]
        stop = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.wait(0.1):
                try:
                    timeline.append((time.monotonic() - t0, self.origin_count() - o0))
                except Exception:  # noqa: BLE001 - a missed sample leaves a gap, nothing more
                    pass

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            w = self.wrk(s, self.p.window_s)
        finally:
            stop.set()
            sampler.join(timeout=5)
        origin = self.origin_count() - o0
        timeline.append((w["duration_us"] / 1e6, origin))
        others = sorted(before | self.note_others())
        return Restart(s.key, s.label, s.durable, ready_s, w["requests"], w["errors"] + w["status_errors"], origin, w["duration_us"] / 1e6, timeline, others)

    def teardown(self) -> list[int]:
        """Stops everything; returns the ports still listening (none, unless
        something escaped)."""
        self.procs.stop_all()
        self.running.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        ports = [self.origin_port, *self.ports.values()]
        return [p for p in ports if listening(p)]


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the run's raw data: CSV, timeline, figure (created)")
    ap.add_argument("--results", type=Path, default=default_dir("proxy"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and 1-s runs: the test's profile")
    ap.add_argument("--systems", default=",".join(BY_KEY), help="comma-separated subset of " + ", ".join(BY_KEY))
    ap.add_argument("--objects", type=int, help="number of distinct objects (default 5000)")
    ap.add_argument("--object-bytes", type=int, help="size of every object (default 10240)")
    ap.add_argument("--seconds", type=int, help="per measurement round (default 5)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per system (default 3)")
    ap.add_argument("--window", type=int, help="seconds replayed after a restart (default 5)")
    ap.add_argument("--connections", help="comma-separated wrk connection counts, one hits measurement each (default 8,50,500; one thread)")
    preflight.add_wait_quiet(ap, "measurement")
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    args = ap.parse_args(argv)
    preflight.chosen_systems(ap, args.systems, BY_KEY)
    return args


def profile_of(args) -> Profile:
    return profiles.choose(
        PROFILES, "quick" if args.quick else "default", objects=args.objects, object_bytes=args.object_bytes, measure_s=args.seconds,
        rounds=args.rounds, window_s=args.window, connections=tuple(int(c) for c in args.connections.split(",")) if args.connections else None,
    )  # fmt: skip


def problems(args, systems: list[Cache]) -> list[str]:
    keys = {s.key for s in systems}
    need = {"wrk"} | ({"nginx"} if {"nginx", "static"} & keys else set()) | ({"varnishd"} if "varnish" in keys else set())
    inband = args.inband if any(k.startswith("inband-") for k in keys) else None
    return preflight.problems(inband=inband, tools=tuple(sorted(need)), root=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    systems = [BY_KEY[k] for k in args.systems.split(",")]
    refused = preflight.refuse(problems(args, systems))
    if refused:
        return refused
    profile = profile_of(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    this_run = Run("proxy", "bench.proxy", argv)
    stop_signals_interrupt()
    bench = None
    hits = {(s.key, c): Hits(s.key, s.label, c) for c in profile.connections for s in systems}
    misses = {s.key: Hits(s.key, s.label, profile.connections[0]) for s in [*systems, ORIGIN]}
    restarts: list[Restart] = []
    quiet = "not checked"
    leftover: list[int] = []
    outcome = Outcome(lambda line: bench.log(line) if bench else print(line))

    def teardown() -> None:
        nonlocal leftover
        if bench is not None:
            leftover = bench.teardown()

    with outcome.torn_down_after(teardown):
        bench = Bench(args, profile, out)
        quiet = bench.settle(hold_s=5)
        bench.start_origin()
        alive = []
        for s in systems:
            bench.log(f"{s.label}: start, fill {profile.objects} objects, warm up {profile.warm_s} s")

            def fill_and_warm(s=s):
                bench.start(s)
                o0 = bench.origin_count()
                first = hits[(s.key, profile.connections[0])]
                first.fill_s = bench.fill(s)
                o1 = bench.origin_count()
                bench.wrk(s, profile.warm_s)
                first.fill_origin, first.warm_origin = o1 - o0, bench.origin_count() - o1
                return True

            if outcome.attempt(f"{s.label} fill", fill_and_warm):
                alive.append(s)
        for rnd in range(profile.rounds):
            for c in profile.connections:
                for s in alive:
                    bench.log(f"hits, round {rnd + 1}/{profile.rounds}, {c} connections: {s.label}")
                    outcome.attempt(f"{s.label} hits ({c} connections)", lambda s=s, c=c: bench.measure(s, hits[(s.key, c)]))
            for s in [*(s for s in alive if s.key != "static"), ORIGIN]:
                bench.log(f"misses, round {rnd + 1}/{profile.rounds}: {s.label}")
                outcome.attempt(f"{s.label} misses", lambda s=s: bench.measure(s, misses[s.key], passthrough=True))
        for s in (s for s in alive if s.key != "static"):
            bench.log(f"restart: {s.label}")
            outcome.attempt(f"{s.label} restart", lambda s=s: bench.restart(s), restarts)
    if leftover:
        outcome.failed.append(f"still listening after teardown: ports {leftover}")

    hit_rows = [hits[(s.key, c)] for c in profile.connections for s in systems]
    miss_rows = [misses[s.key] for s in [*systems, ORIGIN] if s.key != "static"]
    rows = {"hits": [hits_json(h) for h in hit_rows], "misses": [hits_json(h) for h in miss_rows],
            "restart": [{**asdict(r), "hit_ratio": r.hit_ratio} for r in restarts]}
    record = this_run.record(rows, profile=profiles.as_json("quick" if args.quick else "default", profile), inband=Path(args.inband), tools=TOOLS,
                        quiet=quiet, others=sorted(bench.others) if bench else [], failed=outcome.failed, origin="nginx")
    write_results(args.results, record, render(record))
    write_csv(hit_rows, restarts, out / "results.csv")
    write_timeline(restarts, out / "restart_timeline.csv")
    if any(h.rounds for h in hit_rows) or restarts:
        plot(hit_rows, restarts, out / "proxy.png")
    print(f"raw data in {out}: results.csv, restart_timeline.csv, proxy.png")
    return outcome.exit_code()


if __name__ == "__main__":
    sys.exit(main())

"""KnapsackLB weights combined with in-band scores (issue 13, seed 004), on a
namespace testbed, against round-robin and least-connections in the same run:

    python -m bench.weights --out results/weights [--profile quick|full|tiny]

Four servers (`inband serve`, each with `inband agent`) of 1, 2, 4 and 8
workers, the same exponential service time: their capacities are 1 : 2 :
4 : 8. Open-loop load (`inband bench openloop`, latency from each
request's scheduled send time, a new connection per request) at fixed
fractions of the servers' total capacity, so every row is compared at
the same throughput. Rows, per rate:

1. `rr`: inband dsr-rr, round-robin, every weight 1;
2. `haproxy-leastconn`: HAProxy `balance leastconn`, TCP mode;
3. `dynamic`: inband dsr-dynamic, least-score (in-band scores), weights 1;
4. `weights`: the KnapsackLB controller (`inband weights`) setting inband
   dsr-rr's round-robin weights (the seed's system);
5. `weights+scores`: the same controller on dsr-dynamic, least-score, which
   ranks by (score + 1) / weight (the goal row);
6. `haproxy-weights` (full profile): the controller setting HAProxy
   roundrobin's weights through its runtime API.

The controller learns under the load itself (started after the load,
measured once its status file says "steady"); every other row gets the
same load for one slice before it is measured. Then a capacity change: a
server becomes 3x slower in the middle of a run, reported in 5-s windows
with the time the controller took to re-solve. Last, the solver's time
for 10 to 1,000 synthetic backends (`inband bench ilp`).

Prints Markdown tables and writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/weights),
curves.png (each backend's learned curve and the chosen weight),
latency.png and transition.png into --out, with every process's log and
config per run. Everything it starts is stopped and the testbed removed on
exit, Ctrl-C and SIGTERM included. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .lib import peers, preflight, profiles
from .lib.host import busy_fraction, cpu_jiffies, others_running
from .lib.results import REPO, Run, default_dir, provenance
from .lib.results import write as write_results
from .lib.testbed import TestbedRun, alive, http_get_json, new_auth_key
from .lib.tools import parse_openloop
from .lib.peers import Backend
from .lib.procs import Interrupted, Procs, run, stop_signals_interrupt, uninterruptible, wait_until

SUBNET = 87
VIP_PORT = 80
SERVICE_PORT = 8080
WORKERS = (1, 2, 4, 8)  # s1..s4: "cores" of each server
BODY_BYTES = 1024
HAPROXY_BACKEND = "servers"  # peers.haproxy_cfg's backend section; its servers are s1..sN

# The seed (KnapsackLB): learned weights of its 1/2/4/8-core DIPs, the mean
# latency it saved against round-robin and least-connections, its solver.
SEED_RATIOS = (1.0, 2.0, 3.9, 9.7)
SEED_MEAN_GAIN = {"rr": "up to 45% lower", "haproxy-leastconn": "up to 23% lower"}
SEED_SOLVE = {10: "–", 100: "645 ms (< 100 DIPs)", 1000: "21 s"}
SEED_SOLVE_TESTBED = "about 120 ms per solve in its testbed"


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str  # inband | haproxy
    mode: str | None = None  # inband
    policy: str | None = None  # inband
    balance: str | None = None  # haproxy
    weighted: bool = False  # weights set by the controller
    # inband: the mode and policy the controller learns under (one that
    # follows the weights, docs/weights.md) before the VIP is switched to
    # `mode`/`policy` for the measurement; None = the same.
    learn_mode: str | None = None
    learn_policy: str | None = None


ROWS = (
    Row("rr", "round-robin (inband dsr-rr, weights 1)", "inband", mode="dsr-rr", policy="round-robin"),
    Row("haproxy-leastconn", "HAProxy leastconn (TCP mode)", "haproxy", balance="leastconn"),
    Row("dynamic", "in-band scores (inband dsr-dynamic least-score, weights 1)", "inband", mode="dsr-dynamic", policy="least-score"),
    Row("weights", "KnapsackLB weights (inband dsr-rr round-robin + controller)", "inband", mode="dsr-rr", policy="round-robin",
        weighted=True),
    Row("weights+scores", "weights + in-band scores (inband dsr-dynamic least-score + controller)", "inband", mode="dsr-dynamic",
        policy="least-score", weighted=True, learn_mode="dsr-rr", learn_policy="round-robin"),
    Row("haproxy-weights", "KnapsackLB weights through HAProxy's runtime API (roundrobin, TCP mode)", "haproxy",
        balance="roundrobin", weighted=True),
)
BY_KEY = {r.key: r for r in ROWS}
GOAL = "weights+scores"


@dataclass(frozen=True)
class Profile:
    name: str
    rows: tuple
    rates: tuple  # fractions of the servers' total capacity
    measure_s: float  # one open-loop run per (row, rate)
    service_ms: float  # mean (exponential) service time of every server
    probe_rate: int  # the controller's probes per backend per second
    round_ms: int  # the controller's learning round
    learn_timeout_s: float  # bound on the wait for "steady"
    slice_s: float  # the load's slices while learning or warming up; the transition's windows
    ilp_backends: tuple = ()
    transition_rows: tuple = ()
    transition_rate: float = 0.6
    transition_backend: int = 2  # index into WORKERS: the 4-worker server
    transition_factor: float = 3.0
    transition_at_s: float = 90.0  # controller rows: slowdown this long after the servers start
    transition_before_s: float = 15.0  # windows shown before the slowdown (and, without a controller, its start)
    transition_after_s: float = 30.0
    timeout_ms: int = 5000
    # Requests a server lets wait for a worker; beyond, 503 at once (errors).
    # inband serve's default (1024) makes an overloaded server burn CPU: every
    # completion wakes every waiting thread (see the module's notes).
    queue: int = 64


PROFILES = {
    # The CI test's: seconds, one rate, rows 1, 4 and 5.
    "tiny": Profile("tiny", ("rr", "weights", "weights+scores"), (0.4,), 8, 10.0, 20, 2000, 90, 4, ilp_backends=(10,)),
    # A few minutes: rows 1-5 at three rates, the slowdown with the goal row.
    "quick": Profile("quick", ("rr", "haproxy-leastconn", "dynamic", "weights", "weights+scores"), (0.4, 0.6, 0.8), 15, 10.0, 20, 2000,
                     120, 5, ilp_backends=(10, 100, 1000), transition_rows=("weights", "weights+scores")),
    "full": Profile("full", tuple(BY_KEY), (0.4, 0.6, 0.8), 60, 10.0, 20, 2000, 120, 5, ilp_backends=(10, 100, 1000),
                    transition_rows=("dynamic", "haproxy-leastconn", "weights", "weights+scores"), transition_at_s=130,
                    transition_after_s=90),
}


# ------------------------------------------------------------------ pure helpers


def capacity_rps(service_ms: float, workers=WORKERS) -> float:
    """Requests per second the servers complete at full load."""
    return sum(workers) * 1000.0 / service_ms


def rate_for(frac: float, service_ms: float) -> int:
    return int(round(frac * capacity_rps(service_ms)))


def run_key(row: str, frac: float) -> str:
    return f"{row}@{round(frac * 100)}"


def weights_toml(*, probe_path: str, probe_rate: int, round_ms: int, status_file: str, target: dict, backends: list,
                 extra: tuple = ()) -> str:
    """`inband weights` config. `target`: {"kind": "inband", "socket", "vip"}
    or {"kind": "haproxy", "socket", "backend"}; `backends`: (address,
    name) pairs; `extra`: raw `key = value` lines put first (top-level keys)."""
    if target["kind"] not in ("inband", "haproxy"):
        raise ValueError(f"unknown target kind {target['kind']!r}")
    lines = list(extra) + [
        f'probe_path = "{probe_path}"',
        f"probe_rate = {int(probe_rate)}",
        f"round_ms = {int(round_ms)}",
        f'status_file = "{status_file}"',
        "",
        "[target]",
        f'kind = "{target["kind"]}"',
        f'socket = "{target["socket"]}"',
    ]
    lines.append(f'vip = "{target["vip"]}"' if target["kind"] == "inband" else f'backend = "{target["backend"]}"')
    for address, name in backends:
        lines += ["", "[[backend]]", f'address = "{address}"'] + ([f'name = "{name}"'] if name else [])
    return "\n".join(lines) + "\n"


def haproxy_cfg(*, vip: str, backends: list, balance: str, admin_socket: str | None) -> str:
    """bench.peers' HAProxy (TCP mode, no health checks), with the admin
    stats socket the runtime API needs when `admin_socket` is given."""
    text = peers.haproxy_cfg(vip=vip, vip_port=VIP_PORT, backends=backends, balance=balance, timeout_s=30)
    if admin_socket:
        text = text.replace("global\n", f"global\n    stats socket {admin_socket} mode 600 level admin\n", 1)
    return text


def parse_servers_state(text: str, backend: str) -> dict:
    """Server name -> user weight from HAProxy's `show servers state BACKEND`."""
    cols: list[str] = []
    out = {}
    for line in text.splitlines():
        if line.startswith("# be_id"):
            cols = line[2:].split()
            continue
        f = line.split()
        if not cols or len(f) < len(cols) or line.startswith("#"):
            continue
        rec = dict(zip(cols, f))
        if rec.get("be_name") == backend:
            out[rec["srv_name"]] = int(rec["srv_uweight"])
    return out


def parse_stat_sessions(csv_text: str, backend: str) -> dict:
    """Server name -> sessions so far (`stot`) from HAProxy's `show stat` CSV."""
    lines = csv_text.splitlines()
    head = next((line for line in lines if line.startswith("# pxname")), None)
    if head is None:
        return {}
    cols = head[2:].split(",")
    out = {}
    for line in lines:
        if line.startswith("#") or not line.strip():
            continue
        rec = dict(zip(cols, line.split(",")))
        if rec.get("pxname") == backend and rec.get("svname") not in ("BACKEND", "FRONTEND"):
            out[rec["svname"]] = int(rec.get("stot") or 0)
    return out


def next_boundary(t0: float, slice_s: float, now: float) -> float:
    """The first slice start strictly after `now`."""
    return t0 + (math.floor((now - t0) / slice_s) + 1) * slice_s


def curve_latency(c, w: float) -> float:
    """The status file's curve, forced monotone as the controller does: the
    largest value of c0 + c1·w + c2·w² over [0, w]."""
    raw = lambda x: c[0] + c[1] * x + c[2] * x * x  # noqa: E731
    w = max(w, 0.0)
    best = max(raw(0.0), raw(w))
    if c[2] != 0:
        vertex = -c[1] / (2 * c[2])
        if 0 < vertex < w:
            best = max(best, raw(vertex))
    return best


def backend_weights(status: dict | None) -> list | None:
    """The controller's weights in WORKERS order (the status file lists the config's backends, s1..s4)."""
    if not status or not status.get("backends"):
        return None
    return [float(b["weight"]) for b in status["backends"]]


def ratios_to_first(weights: list) -> list | None:
    if not weights or weights[0] <= 0:
        return None
    return [w / weights[0] for w in weights]


def fmt_ratio_list(xs) -> str:
    return " : ".join(f"{x:.2g}" if x < 10 else f"{x:.0f}" for x in xs) if xs else "–"


def fmt_ms(v) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def change(ours: float | None, ref: float | None) -> str:
    """`ours` against `ref` in words: 'x% lower' or 'x% higher'."""
    if ours is None or ref is None or ref <= 0:
        return "–"
    d = 1 - ours / ref
    return f"{d:.0%} lower" if d >= 0 else f"{-d:.0%} higher"


def measured(run: dict) -> bool:
    ol = run.get("openloop")
    return bool(ol) and ol.get("ok", 0) > 0 and ol.get("mean_ms") is not None


def best_others(runs: list, key: str, frac: float, stat: str) -> tuple[str, float] | None:
    """The lowest `stat` (mean_ms, p99_ms) among the other rows at rate `frac`."""
    cands = [(r["openloop"][stat], r["row"]) for r in runs
             if r["rate_frac"] == frac and r["row"] != key and measured(r) and r["openloop"].get(stat) is not None]
    if not cands:
        return None
    v, row = min(cands)
    return row, v


def verdicts(runs: list, goal: str = GOAL) -> list[dict]:
    """Per rate: did the goal row beat every other row on mean and on p99?"""
    out = []
    for frac in sorted({r["rate_frac"] for r in runs}):
        g = next((r for r in runs if r["rate_frac"] == frac and r["row"] == goal and measured(r)), None)
        if g is None:
            continue
        v = {"rate_frac": frac, "mean_ms": g["openloop"]["mean_ms"], "p99_ms": g["openloop"]["p99_ms"],
             "errors": g["openloop"]["errors"]}
        for stat in ("mean_ms", "p99_ms"):
            best = best_others(runs, goal, frac, stat)
            v[f"best_other_{stat}"] = best
            v[f"beat_{stat}"] = best is None or g["openloop"][stat] < best[1]
        v["beat_all"] = v["beat_mean_ms"] and v["beat_p99_ms"]
        out.append(v)
    return out


def windows(slices: list, t_ref: float) -> list[dict]:
    """The load's slices as windows relative to `t_ref` (the slowdown)."""
    out = []
    for s in sorted(slices, key=lambda s: s["start"]):
        r = s.get("result") or {}
        out.append({"t_s": s["start"] - t_ref, "seconds": s["seconds"], "ok": r.get("ok", 0), "errors": r.get("errors", 0),
                    "mean_ms": r.get("mean_ms"), "p99_ms": r.get("p99_ms"), "achieved_rps": r.get("achieved_rps")})
    return out


def solves_seen(timeline: list, final: dict | None) -> list[dict]:
    """Distinct solves (last_solve records) from the polled timeline and the final status, in time order."""
    seen = {}
    for snap in timeline + ([{"last_solve": final.get("last_solve")}] if final else []):
        ls = snap.get("last_solve")
        if ls and ls.get("unix_ms") is not None:
            seen[ls["unix_ms"]] = ls
    return [seen[k] for k in sorted(seen)]


def first_solve_after(solves: list, t_unix: float) -> dict | None:
    return next((s for s in solves if s["unix_ms"] / 1000.0 >= t_unix), None)


def first_naming(decisions: list, name: str, t_unix: float) -> dict | None:
    """The first decision from `t_unix` on that names backend `name` (e.g. "capacity change of s3")."""
    pat = re.compile(rf"\b{re.escape(name)}\b")
    return next((d for d in decisions if d["unix_ms"] / 1000.0 >= t_unix and pat.search(d["what"])), None)


def solves_per_minute(solves: list, t_from: float | None, t_to: float) -> float | None:
    """Solves in [t_from, t_to) per minute: how often the controller re-solves without a change."""
    if t_from is None or t_to - t_from < 10:
        return None
    return 60.0 * sum(1 for s in solves if t_from <= s["unix_ms"] / 1000.0 < t_to) / (t_to - t_from)


# ------------------------------------------------------------------ the testbed and what runs on it


class Keeper:
    """Open-loop load at one rate in consecutive slices of `slice_s`, each
    an `inband bench openloop` of its own started on schedule (a slice
    still waiting for its last responses does not delay the next one), until
    `stop_at_next_boundary`. Its processes are its own (a Procs of its
    thread), stopped on abort."""

    def __init__(self, bed: "Bed", rate: int, slice_s: float, logdir: Path, t0: float | None = None) -> None:
        self.bed, self.rate, self.slice_s, self.logdir = bed, rate, slice_s, logdir
        self.start_at = t0
        self.procs = Procs()
        self.slices: list[dict] = []
        self.stop_before = math.inf
        self.aborted = threading.Event()
        self.lock = threading.Lock()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = 0.0

    def __enter__(self) -> "Keeper":
        """Starts the first slice now, or at the `t0` given."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.t0 = self.start_at if self.start_at is not None else time.time()
        self.thread.start()
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.stop_at_next_boundary()
            self.join()

    def stop_at_next_boundary(self) -> float:
        with self.lock:
            b = next_boundary(self.t0, self.slice_s, time.time())
            self.stop_before = min(self.stop_before, b)
            return self.stop_before

    def abort(self) -> None:
        self.aborted.set()
        self.thread.join(timeout=10)
        self.procs.stop_all()

    def join(self) -> None:
        self.thread.join(timeout=self.slice_s + self.bed.p.timeout_ms / 1000 + 60)
        if self.thread.is_alive():
            self.abort()
            raise RuntimeError("the load's slices did not end in time")
        if self.error:
            raise RuntimeError(self.error)

    def _run(self) -> None:
        running: list = []
        k = 0
        try:
            while not self.aborted.is_set():
                at = self.t0 + k * self.slice_s
                while time.time() < at and not self.aborted.is_set():
                    time.sleep(min(0.05, max(0.0, at - time.time())))
                with self.lock:
                    if at >= self.stop_before - 1e-6 or self.aborted.is_set():
                        break
                log = self.logdir / f"slice-{k:03d}.log"
                p = self.bed.spawn_openloop(self.procs, self.rate, self.slice_s, log)
                running.append({"k": k, "start": at, "spawned": time.time(), "seconds": self.slice_s, "proc": p, "log": log})
                running = self._reap(running, block=False)
                k += 1
            self._reap(running, block=True)
        except Exception as e:  # noqa: BLE001 - reported by join()
            self.error = f"{e.__class__.__name__}: {e}"
            self.procs.stop_all()

    def _reap(self, running: list, block: bool) -> list:
        left = []
        for s in running:
            p = s["proc"]
            if block and not self.aborted.is_set():
                try:
                    p.wait(timeout=self.slice_s + self.bed.p.timeout_ms / 1000 + 30)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None and not block:
                left.append(s)
                continue
            rc = self.procs.stop(p)
            text = s["log"].read_text(errors="replace") if s["log"].exists() else ""
            rec = {k: s[k] for k in ("k", "start", "spawned", "seconds")} | {"end": time.time(), "returncode": rc}
            try:
                rec["result"] = parse_openloop(text)
            except ValueError:
                rec["result"] = None
                if not self.aborted.is_set() and self.error is None:
                    self.error = f"an open-loop slice exited with {rc} and no result: {' / '.join(text.strip().splitlines()[-3:])}"
            self.slices.append(rec)
        return left


class StatusPoller:
    """Reads the controller's status file every `every_s` and keeps each
    change of phase, solve or weights (with the time it was seen)."""

    def __init__(self, path: Path, every_s: float = 0.5) -> None:
        self.path, self.every_s = path, every_s
        self.timeline: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StatusPoller":
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        last = None
        while not self.stop.is_set():
            try:
                st = json.loads(self.path.read_text())
                sig = (st.get("phase"), json.dumps(st.get("last_solve"), sort_keys=True), json.dumps(backend_weights(st)))
                if sig != last:
                    last = sig
                    self.timeline.append({"t": time.time(), "phase": st.get("phase"), "last_solve": st.get("last_solve"),
                                          "weights": backend_weights(st)})
            except (OSError, ValueError, KeyError, TypeError):
                pass
            self.stop.wait(self.every_s)


class Bed(TestbedRun):
    def __init__(self, args, profile: Profile, out: Path) -> None:
        super().__init__(args.inband, args.name)
        self.args, self.p, self.out = args, profile, out
        self.servers: list = []
        # Where `inband status` finds it (/run/inband/weights-NAME.json).
        self.status_file = Path("/run/inband") / f"weights-{args.name}.json"

    @property
    def backends(self) -> list[Backend]:
        return [Backend(self.tb.addr(f"s{i}"), SERVICE_PORT) for i in range(1, len(WORKERS) + 1)]

    def up(self) -> None:
        run_dir = self.out / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.bring_up(len(WORKERS), subnet=SUBNET)
        # A new connection per request, hundreds per second: reuse ports in
        # TIME_WAIT and use the whole port range (client, and the balancer's
        # namespace, where HAProxy and the controller's probes connect from).
        for node in ("c1", "lb"):
            run(self.ns(node), ["sysctl", "-q", "-w", "net.ipv4.tcp_tw_reuse=1"])
            run(self.ns(node), ["sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=1024 65000"])
        if self.args.no_time_wait:
            # The servers close first and keep each connection 60 s in
            # TIME_WAIT; a balancer port that comes back within that time
            # may be refused (docs/architecture.md, limits). Without
            # TIME_WAIT every row meets fresh ports: what the balancing
            # does apart from that.
            for i in range(1, len(WORKERS) + 1):
                run(self.ns(f"s{i}"), ["sysctl", "-q", "-w", "net.ipv4.tcp_max_tw_buckets=0"])
        if self.args.auth == "siphash":
            self.auth_key = new_auth_key(Path(self.inband), run_dir)
        self.start_agents([f"s{i}" for i in range(1, len(WORKERS) + 1)], run_dir, self.out / "logs", SERVICE_PORT)

    def before_down(self) -> None:
        self.detach_lb()

    def teardown(self) -> None:
        super().teardown()
        self.servers = []
        self.status_file.unlink(missing_ok=True)

    # --- servers

    def serve_argv(self, workers: int, slowdown: tuple | None) -> list[str]:
        argv = [str(self.inband), "serve", "--listen", f"0.0.0.0:{SERVICE_PORT}", "--workers", str(workers),
                "--service-ms", f"{self.p.service_ms:g}", "--service-dist", "exponential", "--body-bytes", str(BODY_BYTES),
                "--queue", str(self.p.queue)]
        if slowdown:
            argv += ["--slowdown", "{:g}:{:g}:{:g}".format(*slowdown)]
        return argv

    def start_servers(self, d: Path, slow: dict | None = None) -> tuple[float, float]:
        """Fresh servers (nothing queued from an earlier row); `slow`: index
        -> (start_s, duration_s, factor). Returns (spawned, all answering), epoch s."""
        self.stop_servers()
        spawned = time.time()
        for i, w in enumerate(WORKERS):
            node = f"s{i + 1}"
            argv = self.serve_argv(w, (slow or {}).get(i))
            self.servers.append(self.procs.spawn(f"serve {node}", self.ns(node), argv, d / f"serve-{node}.log"))
        for i in range(1, len(WORKERS) + 1):
            url = f"http://{self.tb.addr(f's{i}')}:{SERVICE_PORT}/stats"
            wait_until(f"the server on s{i}", lambda url=url: http_get_json(self.ns("lb"), url), 20)
        return spawned, time.time()

    def stop_servers(self) -> None:
        for s in self.servers:
            self.procs.stop(s)
        self.servers = []

    # --- balancers

    @property
    def haproxy_sock(self) -> Path:
        return self.sock_dir / "haproxy.sock"

    def start_balancer(self, row: Row, d: Path):
        lb = self.ns("lb")
        if row.kind == "inband":
            return self.start_lb(d, self.backends, mode=row.learn_mode or row.mode, policy=row.learn_policy or row.policy,
                                 probe_interval=self.args.probe_interval)
        cfg = d / "haproxy.cfg"
        self.haproxy_sock.unlink(missing_ok=True)
        cfg.write_text(haproxy_cfg(vip=self.tb.vip, backends=self.backends, balance=row.balance, admin_socket=str(self.haproxy_sock)))
        log = d / "haproxy.log"
        proc = self.procs.spawn("haproxy", lb, ["haproxy", "-f", str(cfg), "-db"], log)
        wait_until("haproxy to listen", lambda: alive(proc, "haproxy", log) and f"{self.tb.vip}:{VIP_PORT}" in run(lb, ["ss", "-Hltn"]).stdout, 20)
        wait_until("haproxy's admin socket", lambda: self.haproxy_sock.exists(), 10)
        return proc

    def stop_balancer(self, row: Row, proc) -> None:
        if proc is not None:
            self.procs.stop(proc)
        if row.kind == "inband":
            self.detach_lb()

    def switch(self, row: Row) -> None:
        """From the learning mode to the row's, keeping the learned weights."""
        vip = f"{self.tb.vip}:{VIP_PORT}"
        for what, value in (("set-mode", ["--mode", row.mode]), ("set-policy", ["--policy", row.policy])):
            run(self.ns("lb"), [str(self.inband), "lb", "ctl", "--socket", str(self.lb_sock), what, "--vip", vip, *value])
        self.log(f"{row.key}: learned under {row.learn_mode} {row.learn_policy}, now {row.mode} {row.policy}")

    def haproxy_command(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.haproxy_sock))
            s.sendall(f"{command}\n".encode())
            return b"".join(iter(lambda: s.recv(65536), b"")).decode(errors="replace")

    def decisions(self, row: Row) -> list[int] | None:
        """New connections the balancer has sent to each server so far (s1..s4)."""
        try:
            if row.kind == "inband":
                bes = {b["backend"]: b for b in self.lb_backends()}
                return [int(bes[f"{b.address}:{b.port}"]["stats"]["new_conns"]) for b in self.backends]
            stot = parse_stat_sessions(self.haproxy_command("show stat"), HAPROXY_BACKEND)
            return [stot[f"s{i}"] for i in range(1, len(WORKERS) + 1)]
        except Exception:  # noqa: BLE001 - a missing column is a missing number, not a failed run
            return None

    def balancer_weights(self, row: Row) -> list | None:
        """The weights in force at the balancer, s1..s4 (None if it does not say)."""
        if row.kind == "inband":
            bes = {b["backend"]: b for b in self.lb_backends()}
            ws = [bes.get(f"{b.address}:{b.port}", {}).get("weight") for b in self.backends]
            return ws if all(w is not None for w in ws) else None
        if not row.weighted:
            return None
        state = parse_servers_state(self.haproxy_command(f"show servers state {HAPROXY_BACKEND}"), HAPROXY_BACKEND)
        return [state.get(f"s{i}") for i in range(1, len(WORKERS) + 1)]

    # --- the controller

    def start_controller(self, row: Row, d: Path):
        if row.kind == "inband":
            target = {"kind": "inband", "socket": str(self.lb_sock), "vip": f"{self.tb.vip}:{VIP_PORT}"}
        else:
            target = {"kind": "haproxy", "socket": str(self.haproxy_sock), "backend": HAPROXY_BACKEND}
        cfg = d / "weights.toml"
        cfg.write_text(weights_toml(probe_path="/", probe_rate=self.args.probe_rate, round_ms=self.args.round_ms,
                                    status_file=str(self.status_file), target=target,
                                    backends=[(f"{b.address}:{b.port}", f"s{i}") for i, b in enumerate(self.backends, 1)],
                                    extra=tuple(self.args.weights_set)))
        self.status_file.unlink(missing_ok=True)  # an earlier run's "steady" must not count
        log = d / "weights.log"
        return self.procs.spawn("inband weights", self.ns("lb"), [str(self.inband), "weights", "--config", str(cfg)], log), log

    def keep_status(self, d: Path) -> None:
        """The controller's last status file beside the run's logs (also when it died)."""
        if self.status_file.exists():
            shutil.copy(self.status_file, d / "weights-status-last.json")

    def read_status(self) -> dict | None:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return None

    def wait_steady(self, proc, log: Path, timeout_s: float, keeper: Keeper) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            alive(proc, "inband weights", log)
            if keeper.error:  # the controller would be learning without the load
                raise RuntimeError(f"the load failed while the controller learned: {keeper.error}")
            st = self.read_status()
            if st is not None:
                last = st
                if st.get("phase") == "steady":
                    return st
            time.sleep(0.5)
        raise TimeoutError(f"the controller was not steady after {timeout_s:.0f} s; its status file: "
                           + (json.dumps(last)[:6000] if last else "(none written)"))

    # --- load

    def openloop_argv(self, rate: int, seconds: float) -> list[str]:
        return [str(self.inband), "bench", "openloop", "--url", f"http://{self.tb.vip}:{VIP_PORT}/", "--rate", str(rate),
                "--seconds", f"{seconds:g}", "--timeout-ms", str(self.p.timeout_ms)]

    def spawn_openloop(self, procs: Procs, rate: int, seconds: float, log: Path):
        log.unlink(missing_ok=True)
        return procs.spawn("openloop", self.ns("c1"), self.openloop_argv(rate, seconds), log)

    def openloop(self, rate: int, seconds: float, log: Path) -> dict:
        return self.openloop_result(self.spawn_openloop(self.procs, rate, seconds, log), seconds, log)

    def openloop_result(self, p, seconds: float, log: Path) -> dict:
        bound = seconds + self.p.timeout_ms / 1000 + 30
        try:
            p.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            self.procs.stop(p)
            raise RuntimeError(f"openloop did not end within {bound:.0f} s; see {log}") from None
        rc = self.procs.stop(p)
        text = log.read_text(errors="replace")
        if rc != 0:
            raise RuntimeError(f"openloop exited with {rc}: {' / '.join(text.strip().splitlines()[-5:])}")
        return parse_openloop(text)

    # --- one row at one rate

    def run_one(self, row: Row, frac: float) -> dict:
        rate = rate_for(frac, self.p.service_ms)
        key = run_key(row.key, frac)
        d = self.out / key
        d.mkdir(parents=True, exist_ok=True)
        res: dict = {"row": row.key, "label": row.label, "rate_frac": frac, "rate": rate}
        self.log(f"{key}: {row.label}, {rate} req/s")
        proc = self.start_balancer(row, d)
        ctl = None
        poller = None
        keeper = None
        try:
            self.start_servers(d)
            keeper = Keeper(self, rate, self.p.slice_s, d / "before").__enter__()
            if row.weighted:
                ctl, ctl_log = self.start_controller(row, d)
                poller = StatusPoller(self.status_file).__enter__()
                started = time.time()
                st = self.wait_steady(ctl, ctl_log, self.args.learn_timeout, keeper)
                res["learn_s"] = time.time() - started
                res["status_steady"] = st
                self.log(f"{key}: steady after {res['learn_s']:.1f} s, weights {fmt_ratio_list(backend_weights(st))}")
                if row.learn_mode:
                    self.switch(row)
            # The measurement starts where the load's next slice would have:
            # the same rate throughout, no gap, no overlap (the last slice
            # only waits for its own stragglers after that).
            start_at = keeper.stop_at_next_boundary()
            time.sleep(max(0.0, start_at - time.time()))
            t0 = time.time()
            ol = self.spawn_openloop(self.procs, rate, self.p.measure_s, d / "openloop.log")
            cpu0, dec0 = cpu_jiffies(), self.decisions(row)
            res["warmup_s"] = start_at - keeper.t0
            res["openloop"] = self.openloop_result(ol, self.p.measure_s, d / "openloop.log")
            t1, cpu1, dec1 = time.time(), cpu_jiffies(), self.decisions(row)
            keeper.join()
            keeper = None
            res["window"] = [t0, t1]
            res["cpu_busy"] = busy_fraction(cpu0, cpu1)
            res["decisions"] = [b - a for a, b in zip(dec0, dec1)] if dec0 and dec1 else None
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{row.kind} exited during the run (status {proc.returncode}); see {d}")
            if row.weighted:
                alive(ctl, "inband weights", ctl_log)
                st = self.read_status()
                res["status"] = st
                (d / "weights-status.json").write_text(json.dumps(st, indent=1))
                poller.__exit__(None, None, None)
                res["timeline"] = poller.timeline
                res["solves_while_measured"] = sum(1 for s in solves_seen(poller.timeline, st) if t0 <= s["unix_ms"] / 1000 <= t1)
                res["balancer_weights"] = self.balancer_weights(row)
            ol = res["openloop"]
            self.log(f"{key}: ok {ol['ok']}, errors {ol['errors']}, mean {fmt_ms(ol.get('mean_ms'))} ms, p99 {fmt_ms(ol.get('p99_ms'))} ms, "
                     f"CPU busy {res['cpu_busy']:.0%}")
        finally:
            if keeper is not None:
                keeper.abort()
            self.end_row(row, proc, ctl, poller, d)
        return res

    def end_row(self, row: Row, proc, ctl, poller, d: Path) -> None:
        """Stops what a row started (in reverse), keeping the controller's last status."""
        if poller is not None:
            poller.__exit__(None, None, None)
        if ctl is not None:
            self.procs.stop(ctl)
            self.keep_status(d)
        self.stop_balancer(row, proc)
        self.stop_servers()

    # --- capacity change

    def transition(self, row: Row) -> dict:
        p = self.p
        frac = p.transition_rate
        rate = rate_for(frac, p.service_ms)
        d = self.out / f"transition-{row.key}"
        d.mkdir(parents=True, exist_ok=True)
        at = p.transition_at_s if row.weighted else p.transition_before_s + 2 * p.slice_s
        i = p.transition_backend
        res: dict = {"row": row.key, "label": row.label, "rate_frac": frac, "rate": rate, "backend": i, "workers": WORKERS[i],
                     "factor": p.transition_factor, "at_s": at}
        self.log(f"transition, {row.key}: s{i + 1} ({WORKERS[i]} workers) {p.transition_factor:g}x slower {at:g} s after the servers "
                 f"start, {rate} req/s")
        proc = self.start_balancer(row, d)
        ctl = None
        poller = None
        try:
            spawned, ready = self.start_servers(d, {i: (at, 3600, p.transition_factor)})
            # The slowdown counts from each server's own start: between these two.
            res["slowdown_unix"] = [spawned + at, ready + at]
            t_slow = spawned + at
            # Slices start at whole windows from the slowdown (the first within one window from now).
            k0 = math.floor((t_slow - time.time()) / p.slice_s)
            with Keeper(self, rate, p.slice_s, d / "slices", t0=t_slow - k0 * p.slice_s) as keeper:
                time.sleep(max(0.0, keeper.t0 - time.time()))  # the controller starts after the load
                if row.weighted:
                    ctl, ctl_log = self.start_controller(row, d)
                    poller = StatusPoller(self.status_file).__enter__()
                    st = self.wait_steady(ctl, ctl_log, max(1.0, t_slow - p.transition_before_s - time.time()), keeper)
                    res["steady_unix"] = time.time()
                    res["weights_before"] = backend_weights(st)
                    if row.learn_mode:
                        self.switch(row)
                time.sleep(max(0.0, t_slow + p.transition_after_s - time.time()))
                if row.weighted:
                    alive(ctl, "inband weights", ctl_log)
                    res["status"] = self.read_status()
                    res["weights_after"] = backend_weights(res["status"])
                    (d / "weights-status.json").write_text(json.dumps(res["status"], indent=1))
            res["slices"] = keeper.slices
            if poller is not None:
                poller.__exit__(None, None, None)
                res["timeline"] = poller.timeline
                solves = solves_seen(poller.timeline, res.get("status"))
                first = first_solve_after(solves, t_slow)
                res["solves"] = solves
                # The weights in force when the server slowed down (the last seen before it).
                res["weights_before"] = next((s["weights"] for s in reversed(poller.timeline) if s["t"] < t_slow and s["weights"]),
                                             res.get("weights_before"))
                res["first_solve_after"] = first
                res["to_solve_s"] = first["unix_ms"] / 1000 - t_slow if first else None
                decisions = (res.get("status") or {}).get("decisions", [])
                res["decisions_after"] = [x for x in decisions if x["unix_ms"] / 1000 >= t_slow]
                named = first_naming(decisions, f"s{i + 1}", t_slow)
                res["to_named_s"] = named["unix_ms"] / 1000 - t_slow if named else None
                res["named"] = named
                # The re-solve rate while nothing changed (steady state before the slowdown).
                res["solves_per_min_before"] = solves_per_minute(solves, res.get("steady_unix"), t_slow)
            self.log(f"transition, {row.key}: next solve " + (f"{res['to_solve_s']:.1f} s after the slowdown" if res.get("to_solve_s") is not None
                                                              else "none seen" if row.weighted else "(no controller)"))
        finally:
            self.end_row(row, proc, ctl, poller, d)
        return res


def ilp_times(inband: str, backends: tuple) -> list[dict]:
    cp = run(None, [inband, "bench", "ilp", "--backends", ",".join(str(b) for b in backends)], timeout=900)
    return json.loads(cp.stdout)


# ------------------------------------------------------------------ tables


def setup_text(r: dict) -> str:
    p, cfg = r["profile"], r["config"]
    cap = capacity_rps(p["service_ms"])
    rates = ", ".join(f"{f:.0%} ({rate_for(f, p['service_ms'])} req/s)" for f in p["rates"])
    per_server = ", ".join(f"{w * 1000 / p['service_ms']:.0f}" for w in WORKERS)
    lines = [
        f"Servers: {len(WORKERS)} (`inband serve`, each with `inband agent`) of {', '.join(map(str, WORKERS))} workers, exponential "
        f"service time with mean {p['service_ms']:g} ms, {BODY_BYTES}-byte responses, a connection closed after each response: "
        f"capacity {cap:.0f} req/s in all ({per_server}); at most {p['queue']} requests wait for a worker, beyond that 503 at once.  ",
        f"Load: `inband bench openloop` in the client namespace (latency from each request's scheduled send time, "
        f"time-out {p['timeout_ms']} ms, a new connection per request) at {rates}; {p['measure_s']:g} s measured per row and rate, "
        f"after the same load for {p['slice_s']:g} s (rows without the controller) or for the controller's learning.  ",
        f"Controller (`inband weights`): {cfg['probe_rate']} probes per backend per second, {cfg['round_ms']} ms rounds"
        + (f", extra settings {', '.join(cfg['weights_set'])}" if cfg.get("weights_set") else "")
        + f"; it runs beside the balancer (its namespace) and starts after the load.  ",
        f"dsr-dynamic asks for a score every {cfg['probe_interval']}th packet ({cfg['auth']} options); HAProxy 2.6 in TCP mode (an L4 "
        "proxy, both directions through it), no health checks."
        + (" Servers keep no TIME_WAIT (`net.ipv4.tcp_max_tw_buckets=0`), for every row." if cfg.get("no_time_wait") else ""),
    ]
    return "\n".join(lines) + "\n"


def latency_table(runs: list) -> list[str]:
    lines = ["| rate | row | sent | ok | errors | req/s | mean ms | p99 ms | mean / best other | p99 / best other | "
             "shares s1/s2/s3/s4 | CPU busy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {k: i for i, k in enumerate(BY_KEY)}
    for r in sorted(runs, key=lambda r: (r["rate_frac"], order.get(r["row"], 99))):
        ol = r.get("openloop") or {}
        cells = [f"{r['rate_frac']:.0%} ({r['rate']})", f"{r['row']}{' (goal)' if r['row'] == GOAL else ''}"]
        if not ol:
            lines.append("| " + " | ".join(cells + ["failed"] + ["–"] * 9) + " |")
            continue
        ratios = []
        for stat in ("mean_ms", "p99_ms"):
            best = best_others(runs, r["row"], r["rate_frac"], stat)
            ratios.append(f"{ol[stat] / best[1]:.2f}× ({best[0]})" if best and measured(r) and best[1] > 0 else "–")
        dec = r.get("decisions") or []
        shares = "/".join(f"{100 * s / sum(dec):.0f}" for s in dec) if dec and sum(dec) else "–"
        err_pct = 100 * ol["errors"] / ol["sent"] if ol.get("sent") else 0.0
        cpu = f"{r['cpu_busy']:.0%}" if r.get("cpu_busy") is not None else "–"
        cells += [str(ol["sent"]), str(ol["ok"]), f"{ol['errors']} ({err_pct:.1f}%)" + (f", {ol['shed']} shed" if ol.get("shed") else ""), f"{ol.get('achieved_rps', 0):.0f}",
                  fmt_ms(ol.get("mean_ms")), fmt_ms(ol.get("p99_ms")), *ratios, shares, cpu]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict_table(runs: list) -> list[str]:
    lines = [f"| rate | {GOAL} mean ms | best other mean | beat on mean | {GOAL} p99 ms | best other p99 | beat on p99 | beat every row |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts(runs):
        bm, bp = v["best_other_mean_ms"], v["best_other_p99_ms"]
        lines.append(f"| {v['rate_frac']:.0%} | {fmt_ms(v['mean_ms'])} | {fmt_ms(bm[1]) + ' (' + bm[0] + ')' if bm else '–'} | "
                     f"{'yes' if v['beat_mean_ms'] else 'no'} | {fmt_ms(v['p99_ms'])} | {fmt_ms(bp[1]) + ' (' + bp[0] + ')' if bp else '–'} | "
                     f"{'yes' if v['beat_p99_ms'] else 'no'} | {'**yes**' if v['beat_all'] else 'no'} |")
    return lines


def seed_table(runs: list) -> list[str]:
    fracs = sorted({r["rate_frac"] for r in runs})
    by = {(r["row"], r["rate_frac"]): r for r in runs if measured(r)}
    lines = ["| mean latency of | against | seed (KnapsackLB) | " + " | ".join(f"ours at {f:.0%}" for f in fracs) + " |",
             "|---|---|---|" + "---|" * len(fracs)]
    for ours in ("weights", GOAL):
        for ref in ("rr", "haproxy-leastconn"):
            seed = SEED_MEAN_GAIN[ref] if ours == "weights" else "–"
            cells = []
            for f in fracs:
                a, b = by.get((ours, f)), by.get((ref, f))
                cells.append(change(a["openloop"]["mean_ms"], b["openloop"]["mean_ms"]) if a and b else "–")
            if any(c != "–" for c in cells):
                lines.append(f"| {ours} | {ref} | {seed} | " + " | ".join(cells) + " |")
    return lines


def weights_table(runs: list) -> list[str]:
    lines = ["| row | rate | weights s1/s2/s3/s4 (sum 1) | ratio to the 1-worker server | seed's ratio | capacity | "
             "at the balancer | learning s | solves while measured | last solve ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not BY_KEY[r["row"]].weighted or not r.get("status"):
            continue
        w = backend_weights(r["status"])
        ls = r["status"].get("last_solve") or {}
        bw = r.get("balancer_weights")
        lines.append(f"| {r['row']} | {r['rate_frac']:.0%} | {' / '.join(f'{x:.3f}' for x in w)} | {fmt_ratio_list(ratios_to_first(w))} | "
                     f"{fmt_ratio_list(SEED_RATIOS)} | {fmt_ratio_list(WORKERS)} | {' / '.join(map(str, bw)) if bw else '–'} | "
                     f"{r.get('learn_s', 0):.0f} | {r.get('solves_while_measured', '–')} | "
                     f"{ls.get('solve_ms', float('nan')):.1f}{' (fallback: weights follow w_max)' if ls.get('fallback') else ''} |")
    return lines


def transition_tables(ts: list) -> list[str]:
    lines = ["| row | slowed | slowdown → next solve | reason | → first decision naming it | solves/min before (steady) | "
             "weights before | weights after | mean ms before → after | p99 ms before → after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in ts:
        ws = windows(t.get("slices", []), t["slowdown_unix"][0])
        before = [w for w in ws if w["t_s"] + w["seconds"] <= 0 and w["mean_ms"] is not None][-3:]
        after = [w for w in ws if w["t_s"] >= 0 and w["mean_ms"] is not None][-3:]
        avg = lambda xs, k: statistics.mean(x[k] for x in xs) if xs else None  # noqa: E731
        fs = t.get("first_solve_after")
        err = (t["slowdown_unix"][1] - t["slowdown_unix"][0])
        to_solve = f"{t['to_solve_s']:.1f} s (±{err:.2f})" if t.get("to_solve_s") is not None else (
            "no solve seen" if BY_KEY[t["row"]].weighted else "(no controller)")
        named = f"{t['to_named_s']:.1f} s" if t.get("to_named_s") is not None else ("none" if BY_KEY[t["row"]].weighted else "–")
        rate = f"{t['solves_per_min_before']:.1f}" if t.get("solves_per_min_before") is not None else "–"
        lines.append(f"| {t['row']} | s{t['backend'] + 1} ({t['workers']} workers) {t['factor']:g}× slower | {to_solve} | "
                     f"{fs['reason'] if fs else '–'} | {named} | {rate} | {fmt_ratio_list(ratios_to_first(t.get('weights_before')))} | "
                     f"{fmt_ratio_list(ratios_to_first(t.get('weights_after')))} | {fmt_ms(avg(before, 'mean_ms'))} → "
                     f"{fmt_ms(avg(after, 'mean_ms'))} | {fmt_ms(avg(before, 'p99_ms'))} → {fmt_ms(avg(after, 'p99_ms'))} |")
    if not ts:
        return lines
    # Windows side by side: mean / p99 (errors) per row.
    lines += ["", "| window from the slowdown | " + " | ".join(f"{t['row']} mean / p99 ms (errors)" for t in ts) + " |",
              "|---|" + "---|" * len(ts)]
    slice_s = ts[0].get("slice_s", 5)
    per = [{math.floor(w["t_s"] / slice_s + 0.5): w for w in windows(t.get("slices", []), t["slowdown_unix"][0])} for t in ts]
    before = math.ceil(min(t.get("before_s", 15) for t in ts) / slice_s)
    for k in sorted({k for m in per for k in m if k >= -before}):
        cells = []
        for m in per:
            w = m.get(k)
            cells.append(f"{fmt_ms(w['mean_ms'])} / {fmt_ms(w['p99_ms'])} ({w['errors']})" if w else "–")
        lines.append(f"| {k * slice_s:+g} s to {(k + 1) * slice_s:+g} s | " + " | ".join(cells) + " |")
    return lines


def ilp_table(ilp: list, runs: list) -> list[str]:
    lines = ["| backends | solve ms (ours, synthetic curves) | steps | seed (its Table 4) |", "|---|---|---|---|"]
    for x in ilp:
        lines.append(f"| {x['backends']} | {x['solve_ms']:.1f} | {x.get('steps', '–')} | {SEED_SOLVE.get(x['backends'], '–')} |")
    # A fallback (no answer from the program: weights follow w_max) takes no solver time.
    real = [r["status"]["last_solve"]["solve_ms"] for r in runs
            if r.get("status") and r["status"].get("last_solve") and not r["status"]["last_solve"].get("fallback")]
    if real:
        lines += ["", f"In the runs above ({len(WORKERS)} backends): last solve {statistics.median(real):.1f} ms median "
                  f"({min(real):.1f}–{max(real):.1f}, {len(real)} runs); the seed: {SEED_SOLVE_TESTBED}."]
    return lines


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    return provenance(record) + "\n\n" + markdown(record["rows"])


def markdown(r: dict) -> str:
    runs = r.get("runs", [])
    lines = [f"# KnapsackLB weights with in-band scores, profile `{r['profile']['name']}`", "",
             f"Command: `{r.get('command', '')}`  ", setup_text(r)]
    cpu = [x["cpu_busy"] for x in runs if x.get("cpu_busy") is not None]
    if cpu:
        top = max(cpu)
        lines.append(f"CPU (both cores, every namespace) while measured: {statistics.median(cpu):.0%} busy median, {top:.0%} at most: "
                     + ("**not the bottleneck**." if top < 0.75 else "**close to saturation: latencies include CPU contention**."))
    if r.get("busy_beside"):
        lines.append(f"\n**Warning:** running beside the benchmark at its start: {', '.join(r['busy_beside'])}.")
    lines += ["", "### Latency at equal throughput (mean and p99 of the requests that succeeded)", "",
              "Ratio: the row's value over the best other row's at the same rate. Shares: the balancer's new connections to each "
              "server while measured, in % (s1..s4 = 1, 2, 4, 8 workers; the controller's probes go around the balancer).", ""]
    lines += latency_table(runs)
    lines += ["", f"### Did weights + in-band scores ({GOAL}) beat every other row?", ""] + verdict_table(runs)
    lines += ["", "### Against the seed's numbers (mean latency; round-robin = inband dsr-rr, least-connections = HAProxy leastconn)", ""]
    lines += seed_table(runs)
    lines += ["", "### Learned weights (the controller's, at the end of the measurement)", ""] + weights_table(runs)
    if r.get("transitions"):
        t0 = r["transitions"][0]
        lines += ["", f"### Capacity change: one server {t0['factor']:g}× slower mid-run ({t0['rate_frac']:.0%} load, {t0['rate']} req/s, "
                  "5-s windows)", ""] + transition_tables(r["transitions"])
    if r.get("ilp"):
        lines += ["", "### Solver time (`inband bench ilp`)", ""] + ilp_table(r["ilp"], runs)
    if r.get("failed"):
        lines += ["", "**Failed:** " + "; ".join(f"{k}: {e}" for k, e in r["failed"])]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(r: dict, path: Path) -> bool:
    """Each backend's learned points and fitted curve, with the weight chosen
    (like the seed's Fig. 10): the goal row's runs, or any controller's."""
    runs = [x for x in r.get("runs", []) if x.get("status") and x["row"] == GOAL] or [x for x in r.get("runs", []) if x.get("status")]
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(WORKERS), figsize=(4 * len(WORKERS), 3.4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ax in enumerate(axes[0]):
        top = 0.0
        for n, run_ in enumerate(runs):
            b = run_["status"]["backends"][i]
            col = colours[n % len(colours)]
            pts = b.get("points") or []
            good = [(q["weight"], q["latency_ms"]) for q in pts if not q.get("drop")]
            bad = [(q["weight"], q["latency_ms"]) for q in pts if q.get("drop")]
            label = f"{run_['row']} at {run_['rate_frac']:.0%}"
            if good:
                ax.plot(*zip(*good), "o", color=col, ms=4, label=label)
                top = max(top, max(y for _, y in good))
            if bad:
                ax.plot([x for x, _ in bad], [min(y, 3 * max(top, 1)) for _, y in bad], "x", color=col, ms=6)
            c = b.get("curve")
            xmax = max([q["weight"] for q in pts] + [b.get("weight", 0), b.get("w_max") or 0, 0.05])
            if c:
                xs = [xmax * k / 100 for k in range(101)]
                ax.plot(xs, [curve_latency(c, x) for x in xs], "-", color=col, lw=1)
                y = curve_latency(c, b["weight"])
                ax.plot([b["weight"]], [y], "*", color=col, ms=14, mec="black")
                top = max(top, y)
        ax.set_title(f"s{i + 1}: {WORKERS[i]} worker{'s' if WORKERS[i] > 1 else ''}")
        ax.set_xlabel("weight (share of new connections)")
        ax.set_ylim(0, 1.3 * top if top else None)
        if i == 0:
            ax.set_ylabel("probe latency (ms)")
            ax.legend(fontsize=7)
    fig.suptitle("Learned latency curves (o measured, x dropped, line fitted, ★ chosen weight)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_latency(r: dict, path: Path) -> bool:
    runs = [x for x in r.get("runs", []) if measured(x)]
    if not runs:
        return False
    plt = _plt()
    fracs = sorted({x["rate_frac"] for x in runs})
    rows = [k for k in BY_KEY if any(x["row"] == k for x in runs)]
    by = {(x["row"], x["rate_frac"]): x["openloop"] for x in runs}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(rows)
    for ax, stat, title in ((axes[0], "mean_ms", "mean"), (axes[1], "p99_ms", "p99")):
        for j, row in enumerate(rows):
            xs = [n + (j - (len(rows) - 1) / 2) * width for n in range(len(fracs))]
            ys = [(by.get((row, f)) or {}).get(stat) or 0 for f in fracs]
            ax.bar(xs, ys, width, label=row, edgecolor="black" if row == GOAL else None, linewidth=1.5 if row == GOAL else 0)
        ax.set_xticks(range(len(fracs)), [f"{f:.0%} load" for f in fracs])
        ax.set_yscale("log")
        ax.set_ylabel(f"{title} latency (ms)")
        ax.set_title(f"{title} latency per row and rate")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_transition(r: dict, path: Path) -> bool:
    ts = r.get("transitions") or []
    if not ts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for t in ts:
        ws = [w for w in windows(t.get("slices", []), t["slowdown_unix"][0]) if w["mean_ms"] is not None]
        line, = ax.plot([w["t_s"] + w["seconds"] / 2 for w in ws], [w["mean_ms"] for w in ws], "o-", label=f"{t['row']} mean")
        ax.plot([w["t_s"] + w["seconds"] / 2 for w in ws], [w["p99_ms"] for w in ws], "--", color=line.get_color(), label=f"{t['row']} p99")
        if t.get("to_solve_s") is not None:
            ax.axvline(t["to_solve_s"], color=line.get_color(), ls=":", lw=1)
    ax.axvline(0, color="black", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("seconds from the slowdown (dotted: the controller's next solve)")
    ax.set_ylabel("latency (ms)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the run's raw data: configs, logs, figures (created)")
    ap.add_argument("--results", type=Path, default=default_dir("weights"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--profile", choices=PROFILES, default="quick")
    ap.add_argument("--inband", type=Path, default=REPO / "target/debug/inband")
    ap.add_argument("--name", default="wts", help="testbed name (namespaces NAME-c1, NAME-lb, NAME-s1...)")
    ap.add_argument("--rows", help=f"comma-separated subset of: {', '.join(BY_KEY)} (default: the profile's)")
    ap.add_argument("--rates", help="comma-separated fractions of the servers' capacity (default: the profile's)")
    ap.add_argument("--measure-s", type=float, help="seconds measured per row and rate (default: the profile's)")
    ap.add_argument("--service-ms", type=float, help="mean service time (default: the profile's)")
    ap.add_argument("--probe-rate", type=int, help="the controller's probes per backend per second (default: the profile's)")
    ap.add_argument("--round-ms", type=int, help="the controller's learning round (default: the profile's)")
    ap.add_argument("--queue", type=int, help="requests a server lets wait for a worker, beyond which it answers 503 (default: the profile's)")
    ap.add_argument("--learn-timeout", type=float, help="seconds to wait for the controller's steady state (default: the profile's)")
    ap.add_argument("--weights-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra top-level line for weights.toml, e.g. max_rounds=10 (repeatable)")
    ap.add_argument("--probe-interval", type=int, default=8, help="dsr-dynamic: a score request every n-th packet to a backend")
    ap.add_argument("--auth", choices=("siphash", "none"), default="siphash", help="in-band options authenticated with a run's key, or plain")
    ap.add_argument("--no-time-wait", action="store_true",
                    help="servers keep no TIME_WAIT (net.ipv4.tcp_max_tw_buckets=0 in their namespaces), for every row: "
                         "shows the balancing without the SNAT ports' collisions with it")
    ap.add_argument("--no-transition", action="store_true", help="skip the capacity change")
    ap.add_argument("--no-ilp", action="store_true", help="skip the solver timing")
    args = ap.parse_args(argv)
    p = PROFILES[args.profile]
    if args.rows:
        unknown = [k for k in args.rows.split(",") if k not in BY_KEY]
        if unknown:
            ap.error(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
        p = replace(p, rows=tuple(args.rows.split(",")))
    if args.rates:
        p = replace(p, rates=tuple(float(x) for x in args.rates.split(",")))
    for opt, field in (("measure_s", "measure_s"), ("service_ms", "service_ms"), ("probe_rate", "probe_rate"), ("round_ms", "round_ms"),
                       ("learn_timeout", "learn_timeout_s"), ("queue", "queue")):
        if getattr(args, opt) is not None:
            p = replace(p, **{field: getattr(args, opt)})
    if args.no_transition:
        p = replace(p, transition_rows=())
    if args.no_ilp:
        p = replace(p, ilp_backends=())
    args.probe_rate, args.round_ms, args.learn_timeout = p.probe_rate, p.round_ms, p.learn_timeout_s
    for kv in args.weights_set:
        if "=" not in kv:
            ap.error(f"--weights-set {kv!r}: expected KEY=VALUE")
    args.weights_set = [f"{k.strip()} = {v.strip()}" for k, v in (kv.split("=", 1) for kv in args.weights_set)]
    return args, p


def problems(args, p: Profile) -> list[str]:
    haproxy = any(BY_KEY[k].kind == "haproxy" for k in p.rows + p.transition_rows)
    return preflight.problems(inband=str(args.inband), tools=("haproxy",) if haproxy else (), testbed_name=args.name)


def main(argv=None) -> int:
    args, p = parse_args(argv)
    refused = preflight.refuse(problems(args, p))
    if refused:
        return refused
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = out
    this_run = Run("weights", "bench.weights", argv)
    command = this_run.command
    results: dict = {"profile": asdict(p), "command": command, "workers": list(WORKERS), "body_bytes": BODY_BYTES,
                     "config": {"probe_rate": p.probe_rate, "round_ms": p.round_ms, "probe_interval": args.probe_interval, "no_time_wait": args.no_time_wait,
                                "auth": args.auth, "weights_set": args.weights_set},
                     "busy_beside": sorted(others_running()), "runs": [], "transitions": [], "ilp": None, "failed": []}
    if results["busy_beside"]:
        print(f"warning: running beside the benchmark: {', '.join(results['busy_beside'])} (they take the CPU it measures on)", file=sys.stderr)
    stop_signals_interrupt()
    bed = Bed(args, p, out)
    interrupted = None
    started = time.time()
    try:
        bed.up()
        for frac in p.rates:
            for key in p.rows:
                try:
                    results["runs"].append(bed.run_one(BY_KEY[key], frac))
                except (Interrupted, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 - one broken row must not hide the others
                    traceback.print_exc()
                    results["failed"].append((run_key(key, frac), f"{e.__class__.__name__}: {e}"))
                    bed.log(f"{run_key(key, frac)}: FAILED: {e}")
        for key in p.transition_rows:
            try:
                t = bed.transition(BY_KEY[key])
                t["before_s"], t["slice_s"] = p.transition_before_s, p.slice_s
                results["transitions"].append(t)
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                results["failed"].append((f"transition {key}", f"{e.__class__.__name__}: {e}"))
                bed.log(f"transition {key}: FAILED: {e}")
    except (Interrupted, KeyboardInterrupt) as e:
        interrupted = str(e) or "SIGINT"
    except Exception as e:  # noqa: BLE001 - set-up failed: report, tear down
        traceback.print_exc()
        results["failed"].append(("setup", f"{e.__class__.__name__}: {e}"))
    finally:
        with uninterruptible():
            bed.teardown()
        if interrupted is None:
            stop_signals_interrupt()
    if interrupted is None and p.ilp_backends:
        try:
            results["ilp"] = ilp_times(str(args.inband), p.ilp_backends)
        except Exception as e:  # noqa: BLE001
            results["failed"].append(("ilp", f"{e.__class__.__name__}: {e}"))
    results["elapsed_s"] = time.time() - started
    record = this_run.record(results, profile=profiles.as_json(args.profile, p), inband=Path(args.inband), tools={"haproxy": ["haproxy", "-v"]})
    write_results(args.results, record, render(record))
    made = [name for name, fn in (("curves.png", plot_curves), ("latency.png", plot_latency), ("transition.png", plot_transition))
            if fn(results, out / name)]
    print(f"figures in {out}: {', '.join(made) or 'none'}")
    if interrupted:
        print(f"interrupted ({interrupted}); everything torn down", file=sys.stderr)
        return 130
    for k, e in results["failed"]:
        print(f"error: {k}: {e}", file=sys.stderr)
    return 1 if results["failed"] or not results["runs"] else 0


if __name__ == "__main__":
    sys.exit(main())

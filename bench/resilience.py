"""Resilience against the peers, in one run on one namespace testbed
(issue 10 "Benchmarks", issue 9's churn):

    python -m bench.resilience --out results/res

1. flood: a SYN flood from random sources (198.18.0.0/15) at the highest
   rate the attacker's node reaches, while a legitimate client makes
   sequential HTTP requests through the balancer, against inband
   (dsr-dynamic, authenticated options), nftables DNAT and HAProxy
   (mode tcp), each with a no-flood baseline first: success rate and
   latency during the flood against the baseline, requests after it,
   CPU, and each balancer's own counters.
2. churn: many short HTTP connections from distinct client tuples
   (`inband bench churn`, the client closes first) to 2 backends, through
   inband (1,000,000 in the quick profile), nftables and HAProxy, and
   inband again with the server closing first: refusals by error, slow
   connections, connections/s, and inband's drop counters and port reuse.

Prints Markdown tables with ratios, writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/resilience),
and into --out a directory per measurement with its configs,
logs and raw samples. Testbed `res`: legitimate client c1, attacker c2,
balancer lb, servers s1 and s2 (`inband serve`, each with `inband
agent` while inband is measured). Every process, XDP program, nftables table, conntrack entry and
namespace it makes is removed on exit, Ctrl-C and SIGTERM included. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .lib import peers, preflight, profiles
from .lib.host import cpu_busy_s, enable_bpf_stats, others_running, proc_cpu_s, xdp_prog_stats
from .lib.report import times as _ratio
from .lib.results import REPO, Run, default_dir, provenance, revive
from .lib.results import write as write_results
from .lib.stats import percentile as _percentile
from .lib.testbed import TestbedRun, alive, new_auth_key
from .lib.peers import Backend
from .lib.outcome import Outcome
from .lib.procs import run, stop_signals_interrupt, wait_until

VIP_PORT = 80
HTTP_PORT = 8080
SERVERS = 2
# RFC 2544's benchmark range: the flood's random sources. The balancer and
# the servers route it to the attacker's node (a stand-in for the rest of
# the internet), which drops what it gets (not its addresses, no
# forwarding): answers to the flood cost what they would for real, and
# go nowhere.
SPOOF_NET = "198.18.0.0/15"
# Churn source addresses on c1: 10.X.0.130 and up, a block of its own per
# churn measurement, so no run meets another's client tuples (or their
# TIME_WAIT). Each address gives `inband bench churn` 55,000 ports.
CHURN_FIRST_HOST = 130
CHURN_LAST_HOST = 250
PORTS_PER_SOURCE = 55_000
# SNAT ports inband has per backend and balancer address (docs/architecture.md).
SNAT_PORTS_PER_BACKEND = 31_744


@dataclass(frozen=True)
class Profile:
    baseline_s: float  # legitimate requests without a flood, per balancer
    flood_s: float  # the flood's length (the generator's --seconds)
    after_s: float  # legitimate requests after the flood ended
    pause_ms: float  # between one legitimate request's end and the next one's start
    churn: int  # inband's churn connections (client closes first)
    peer_churn: int  # nftables' and HAProxy's churn connections
    server_closes: int  # inband, server closes first (0: not measured)
    concurrency: int  # churn connections in flight
    churn_min_rate: float  # a churn run is cut after connections / this + 30 s
    recovery_max_s: float  # after a flood, a balancer that refuses is followed this long at most


PROFILES = {
    # The documented run: about 12 minutes, most of it inband's million.
    "quick": Profile(10.0, 10.0, 3.0, 10.0, 1_000_000, 250_000, 100_000, 16, 1000.0, 90.0),
    # The test: every table filled, nothing measured well.
    "tiny": Profile(2.0, 2.0, 1.0, 10.0, 8_000, 8_000, 3_000, 16, 500.0, 10.0),
}

LABELS = {
    "inband": "inband dsr-dynamic (authenticated options)",
    "nftables": "nftables DNAT + masquerade",
    "haproxy": "HAProxy 2.6, mode tcp",
}
SERVER_CLOSES_LABEL = "inband dsr-dynamic, server closes first (TIME_WAIT on the server)"

# inband's drops that must stay zero under churn (issue 9).
MUST_BE_ZERO = ("snat_exhausted", "flow_table_full")
# Counters of the balancer host's and the servers' kernels worth showing.
NETSTAT_KEYS = (
    "TcpExt.SyncookiesSent",
    "TcpExt.SyncookiesFailed",
    "TcpExt.ListenOverflows",
    "TcpExt.ListenDrops",
    "TcpExt.TW",
    "Tcp.ActiveOpens",
    "Tcp.AttemptFails",
    "Tcp.PassiveOpens",
)
CONNTRACK_KEYS = ("insert_failed", "drop", "early_drop", "clashres")


# ------------------------------------------------------------------ helpers run inside namespaces

# The legitimate client: sequential HTTP/1.1 requests to the VIP, each on a
# new connection (what a SYN flood threatens), closed by the client once
# the whole response is in; 5 s per request at most. Stops at a deadline,
# after a count, or on SIGTERM (after the request in flight); writes a line
# [start (CLOCK_MONOTONIC s), duration ms, error or ""] per request as it
# ends, so the driver can follow it.
LEGIT_CLIENT = r"""
import json, signal, socket, sys, time
host, port, until, pause_s, limit, timeout, out = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
    float(sys.argv[4]) / 1000, int(sys.argv[5]), float(sys.argv[6]), sys.argv[7])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
req = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

def one():
    deadline = time.monotonic() + timeout
    s = socket.create_connection((host, port), timeout=timeout)
    try:
        s.sendall(req)
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            s.settimeout(left)
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the whole response")
            buf += chunk
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                lines = head.split(b"\r\n")
                length = next(int(l.split(b":", 1)[1]) for l in lines[1:] if l.lower().startswith(b"content-length:"))
                if len(body) >= length:
                    status = lines[0].split()[1].decode()
                    if status != "200":
                        raise ValueError("status " + status)
                    return
    finally:
        s.close()

n = 0
with open(out, "w") as f:
    while not stop and time.monotonic() < until and n < limit:
        t0 = time.monotonic()
        try:
            one()
            err = ""
        except Exception as e:
            err = "timeout" if isinstance(e, (TimeoutError, socket.timeout)) else (str(e) if isinstance(e, ValueError) else type(e).__name__)
        f.write(json.dumps([t0, (time.monotonic() - t0) * 1000, err]) + "\n")
        f.flush()
        n += 1
        if not stop:
            time.sleep(pause_s)
"""

# Flushes the conntrack table of the namespace it runs in (ctnetlink
# IPCTNL_MSG_CT_DELETE without attributes), as `conntrack -F` would; the
# tool is not installed here. Entries a flood left would otherwise stay
# for minutes and weigh on the next measurement.
CT_FLUSH = r"""
import socket, struct
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
s.bind((0, 0))
body = struct.pack("BBH", socket.AF_INET, 0, 0)
s.send(struct.pack("=IHHII", 16 + len(body), (1 << 8) | 2, 1 | 4, 1, 0) + body)
r = s.recv(4096)
err = struct.unpack("=i", r[16:20])[0] if struct.unpack("=H", r[4:6])[0] == 2 else 0
# ENOENT: conntrack never loaded here, nothing to flush.
raise SystemExit(0 if err in (0, -2) else f"conntrack flush: error {err}")
"""


# ------------------------------------------------------------------ pure functions (unit-tested)

MIN_AFTER = 10  # legitimate requests at least, after a flood
LEGIT_TIMEOUT_S = 5  # one legitimate request's bound (connect + response)


def read_samples(path: Path) -> list:
    """The legitimate client's lines so far (a line being written is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank (q in percent), None without values."""
    return _percentile(values, q)


@dataclass
class Legit:
    """Legitimate requests in one window: counts, errors, and the latency of
    the ones that succeeded (failures are counted apart, not averaged in).
    A sequential client with a 5 s timeout makes few requests while a
    balancer refuses, so the window's longest stretch without a response
    is kept too: it shows an outage the request count understates."""

    ok: int = 0
    failed: int = 0
    errors: dict = field(default_factory=dict)
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    slow: int = 0  # succeeded, but took longer than 900 ms (a SYN retransmission)
    longest_gap_s: float | None = None  # longest time in the window without a response completing
    first_ok_s: float | None = None  # window start → the first response completing

    @property
    def total(self) -> int:
        return self.ok + self.failed

    @property
    def success_pct(self) -> float | None:
        return 100.0 * self.ok / self.total if self.total else None

    @classmethod
    def of(cls, samples: list, t0: float = -math.inf, t1: float = math.inf) -> Legit:
        """Requests that started in [t0, t1)."""
        r = cls()
        ms, done, ends = [], [], []
        for start, dur, err in samples:
            if not (t0 <= start < t1):
                continue
            ends.append(start + dur / 1000)
            if err:
                r.failed += 1
                r.errors[err] = r.errors.get(err, 0) + 1
            else:
                r.ok += 1
                ms.append(dur)
                done.append(start + dur / 1000)
        r.p50_ms, r.p99_ms = percentile(ms, 50), percentile(ms, 99)
        r.max_ms = max(ms) if ms else None
        r.slow = sum(1 for x in ms if x > 900)
        if ends:
            # An open window ends with its last request.
            lo = t0 if math.isfinite(t0) else min(s[0] for s in samples if t0 <= s[0] < t1)
            hi = t1 if math.isfinite(t1) else max(ends)
            marks = [lo] + sorted(min(max(e, lo), hi) for e in done) + [hi]
            r.longest_gap_s = max(b - a for a, b in zip(marks, marks[1:]))
            r.first_ok_s = min(done) - lo if done else None
        return r


def counter_delta(before, after):
    """after − before for every number in nested dicts (keys of `after`);
    anything else is taken from `after`."""
    if isinstance(after, dict):
        b = before if isinstance(before, dict) else {}
        return {k: counter_delta(b.get(k), v) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def parse_netstat(*texts: str) -> dict:
    """/proc/net/snmp and /proc/net/netstat (pairs of `Proto: names` and
    `Proto: values` lines) as {"Proto.Name": int}."""
    out = {}
    for text in texts:
        lines = text.splitlines()
        for names, values in zip(lines[0::2], lines[1::2]):
            proto, ns = names.split(":", 1)
            proto2, vs = values.split(":", 1)
            if proto != proto2:
                continue
            for n, v in zip(ns.split(), vs.split()):
                try:
                    out[f"{proto}.{n}"] = int(v)
                except ValueError:
                    pass
    return out


def parse_conntrack_stat(text: str) -> dict:
    """/proc/net/stat/nf_conntrack: a header, then one row of hex counters
    per CPU; summed over CPUs (`entries` is the table size, the same on
    every row, so it is taken once)."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    head, rows = lines[0], lines[1:]
    out = {k: 0 for k in head}
    for row in rows:
        for k, v in zip(head, row):
            out[k] = int(v, 16) if k == "entries" else out[k] + int(v, 16)
    return out




def _f(v: float | None, fmt: str = ".1f", unit: str = "") -> str:
    return "–" if v is None else f"{v:{fmt}}{unit}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} %"


def _errors(e: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(e.items(), key=lambda kv: -kv[1])) or "–"


@dataclass
class Flood:
    kind: str
    label: str
    sent: int  # SYNs the generator put on the wire
    seconds: float  # the flood's length (wall, generator start to end)
    baseline: Legit
    during: Legit
    after: Legit
    machine_cpu_s: float  # busy CPU seconds of the whole machine during the flood
    own_cpu_s: float | None  # HAProxy's process time, inband's XDP program run time; None: no process (nftables)
    baseline_cpu_per_s: float = 0.0  # busy CPU s/s of the whole machine during the baseline
    own_runs: int = 0  # inband: XDP program runs (packets) during the flood
    counters: dict = field(default_factory=dict)  # deltas over the flood, by source

    @property
    def rate(self) -> float:
        return self.sent / self.seconds if self.seconds else 0.0

    @property
    def cpu_per_s(self) -> float:
        return self.machine_cpu_s / self.seconds if self.seconds else 0.0

    @property
    def us_per_syn(self) -> float | None:
        return self.machine_cpu_s / self.sent * 1e6 if self.sent else None

    @property
    def own_per_s(self) -> float | None:
        return self.own_cpu_s / self.seconds if self.own_cpu_s is not None and self.seconds else None


def flood_table(rows: list[Flood]) -> str:
    """One row per balancer: the flood, the legitimate client during it
    against its own no-flood baseline, after it, and CPU against inband's."""
    ib = next((r for r in rows if r.kind == "inband"), None)
    head = (
        "| balancer | flood SYNs sent | flood kpps | ÷ inband's | baseline requests (ok %) | during: ok / failed | success % | ÷ baseline "
        "| slower than 900 ms | longest without a response, s | p50 ms baseline → during | p99 ms baseline → during | p99 ÷ baseline "
        "| after: ok / all | first response after the flood, s | machine busy CPU s/s | CPU µs per flood SYN | ÷ inband's "
        "| balancer's own CPU s/s | ÷ inband's |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    out = []
    for r in rows:
        after = f"{r.after.ok:,} / {r.after.total:,}" + ("" if r.after.failed == 0 and r.after.total else " **(not all)**")
        out.append(
            f"| {r.label} | {r.sent:,} | {r.rate / 1e3:.1f} | {_ratio(r.rate, ib.rate) if ib else '–'} "
            f"| {r.baseline.total:,} ({_pct(r.baseline.success_pct)}) | {r.during.ok:,} / {r.during.failed:,} | {_pct(r.during.success_pct)} "
            f"| {_ratio(r.during.success_pct, r.baseline.success_pct)} | {r.during.slow:,} | {_f(r.during.longest_gap_s, '.2f')} "
            f"| {_f(r.baseline.p50_ms, '.2f')} → {_f(r.during.p50_ms, '.2f')} | {_f(r.baseline.p99_ms, '.2f')} → {_f(r.during.p99_ms, '.2f')} "
            f"| {_ratio(r.during.p99_ms, r.baseline.p99_ms)} | {after} | {_f(r.after.first_ok_s, '.2f') if r.after.first_ok_s is not None else 'none'} "
            f"| {r.cpu_per_s:.2f} | {_f(r.us_per_syn, '.2f')} "
            f"| {_ratio(r.us_per_syn, ib.us_per_syn) if ib else '–'} | {_f(r.own_per_s, '.3f')} "
            f"| {_ratio(r.own_per_s, ib.own_per_s) if ib and r.own_per_s is not None else '–'} |"
        )
    return head + "\n".join(out) + "\n"


def _conntrack_summary(c: dict) -> str:
    ct = c.get("conntrack", {})
    return (
        f"conntrack: {', '.join(f'{k} {ct.get(k, 0):,}' for k in CONNTRACK_KEYS)}; "
        f"entries at the end {c.get('conntrack_count_end', 0):,} (max {c.get('conntrack_max', 0):,})"
    )


def _nonzero(d: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items() if isinstance(v, (int, float)) and v) or "none"


def flood_counters_table(rows: list[Flood]) -> str:
    """What each balancer and the servers' kernels counted over the flood."""
    head = (
        "| balancer | failed requests by error (during) | balancer's own counters over the flood | frames the switch dropped toward the balancer / the servers "
        "| balancer host: SYN cookies sent / listen drops | servers: SYN cookies sent / listen drops |\n|---|---|---|---:|---:|---:|\n"
    )
    out = []
    for r in rows:
        c = r.counters
        if r.kind == "inband":
            ib = c.get("inband", {})
            ev = ib.get("events", {})
            per_run = f"{r.own_cpu_s / r.own_runs * 1e9:,.0f} ns per packet" if r.own_cpu_s and r.own_runs else "–"
            own = (
                f"XDP program: {r.own_runs:,} packets, {per_run}; "
                f"drops: {_nonzero(ib.get('drops', {}))}; snat_preempt_half_open {ev.get('snat_preempt_half_open', 0):,}, "
                f"flows_expired {ev.get('flows_expired', 0):,}; SYNs balanced {ib.get('new_conns', 0):,}; "
                f"half-open flows at the end {ib.get('half_open_end', 0):,}"
            )
        elif r.kind == "nftables":
            own = _conntrack_summary(c)
        else:
            own = "–"
        lb, sv, sw = c.get("lb_netstat", {}), c.get("servers_netstat", {}), c.get("switch_drops", {})
        to_servers = sum(v for k, v in sw.items() if k.startswith("s"))
        out.append(
            f"| {r.label} | {_errors(r.during.errors)} | {own} | {sw.get('lb', 0):,} / {to_servers:,} "
            f"| {lb.get('TcpExt.SyncookiesSent', 0):,} / {lb.get('TcpExt.ListenDrops', 0):,} "
            f"| {sv.get('TcpExt.SyncookiesSent', 0):,} / {sv.get('TcpExt.ListenDrops', 0):,} |"
        )
    return head + "\n".join(out) + "\n"


@dataclass
class Churn:
    kind: str
    label: str
    asked: int
    server_closes: bool
    bound_s: float  # the run is cut after this long
    result: dict  # `inband bench churn`'s JSON
    counters: dict = field(default_factory=dict)  # deltas over the run

    @property
    def refused(self) -> int:
        """Connections asked for that did not complete: failed, or never
        attempted because the time bound ended the run."""
        return self.asked - int(self.result.get("ok", 0))


def churn_table(rows: list[Churn]) -> str:
    ib = next((r for r in rows if r.kind == "inband" and not r.server_closes), None)
    head = (
        "| balancer | connections asked | attempted | ok | failed (by error) | not completed | slower than 900 ms | connections/s | ÷ inband's "
        "| p50 ms | p99 ms | max ms | seconds |\n|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    out = []
    for r in rows:
        x = r.result
        failed = int(x.get("failed", 0))
        errs = f" ({_errors(x.get('errors', {}))})" if failed else ""
        cut = " (time bound)" if int(x.get("attempted", 0)) < r.asked else ""
        out.append(
            f"| {r.label} | {r.asked:,} | {int(x.get('attempted', 0)):,}{cut} | {int(x.get('ok', 0)):,} "
            f"| {failed:,}{errs} "
            f"| {r.refused:,} | {int(x.get('slower_than_900ms', 0)):,} | {float(x.get('per_second', 0)):,.0f} "
            f"| {_ratio(float(x.get('per_second', 0)), float(ib.result.get('per_second', 0))) if ib else '–'} "
            f"| {float(x.get('p50_ms', 0)):.2f} | {float(x.get('p99_ms', 0)):.2f} | {float(x.get('max_ms', 0)):.0f} | {float(x.get('seconds', 0)):.0f} |"
        )
    return head + "\n".join(out) + "\n"


def churn_counters_table(rows: list[Churn]) -> str:
    head = "| balancer | balancer's counters over the run | balancer host: TIME_WAITs entered / connect attempts failed |\n|---|---|---:|\n"
    out = []
    for r in rows:
        c = r.counters
        if r.kind == "inband":
            ib = c.get("inband", {})
            drops, ev = ib.get("drops", {}), ib.get("events", {})
            new = ib.get("new_conns", 0)
            uses = new / (SERVERS * SNAT_PORTS_PER_BACKEND)
            must = ", ".join(f"{k} {drops.get(k, 0):,}" for k in MUST_BE_ZERO)
            others = {k: v for k, v in drops.items() if k not in MUST_BE_ZERO}
            own = (
                f"{must}; other drops: {_nonzero(others)}; new connections {new:,} = {uses:.1f} uses of each of the "
                f"{SERVERS} × {SNAT_PORTS_PER_BACKEND:,} SNAT ports; ports taken over from closing flows "
                f"{ev.get('snat_preempt_closing', 0):,}, from half-open ones {ev.get('snat_preempt_half_open', 0):,}, "
                f"orphans reclaimed {ev.get('snat_orphans_reclaimed', 0):,}; flows closed {ev.get('flows_closed', 0):,}, "
                f"expired {ev.get('flows_expired', 0):,}, promoted {ev.get('flows_promoted', 0):,}"
            )
        elif r.kind == "nftables":
            own = _conntrack_summary(c)
        else:
            own = "–"
        lb = c.get("lb_netstat", {})
        out.append(f"| {r.label} | {own} | {lb.get('TcpExt.TW', 0):,} / {lb.get('Tcp.AttemptFails', 0):,} |")
    return head + "\n".join(out) + "\n"


def churn_sources(subnet_prefix: str, first_host: int, connections: int) -> list[str]:
    """The source addresses a churn of `connections` needs (55,000 tuples
    each), from `first_host` up."""
    n = max(1, math.ceil(connections / PORTS_PER_SOURCE))
    if first_host + n - 1 > CHURN_LAST_HOST:
        raise ValueError(f"{connections:,} connections need {n} source addresses from .{first_host}: past .{CHURN_LAST_HOST}")
    return [f"{subnet_prefix}.{h}" for h in range(first_host, first_host + n)]


def churn_plan(p: Profile) -> list[tuple[str, int, bool]]:
    """(balancer, connections, server closes) per churn measurement, in order."""
    plan = [("inband", p.churn, False), ("nftables", p.peer_churn, False), ("haproxy", p.peer_churn, False)]
    if p.server_closes:
        plan.append(("inband", p.server_closes, True))
    return [x for x in plan if x[1] > 0]


# ------------------------------------------------------------------ the run




class Bench(TestbedRun):
    watch_others = True  # other benchmarks and builds seen while measuring

    def __init__(self, args, profile: Profile, out: Path):
        super().__init__(args.inband, args.name)
        self.args = args
        self.p = profile
        self.out = out
        self.servers: list = []
        self.agents: list = []
        self.ip_forward: str | None = None
        self.churn_next_host = CHURN_FIRST_HOST

    def mac(self, node: str) -> str:
        # `ip`, not /sys/class/net: nsenter keeps the host's sysfs mount.
        return json.loads(run(self.ns(node), ["ip", "-j", "link", "show", "eth0"]).stdout)[0]["address"]

    @property
    def backends(self) -> list[Backend]:
        return [Backend(self.tb.addr(f"s{i}"), HTTP_PORT) for i in range(1, SERVERS + 1)]

    @property
    def subnet_prefix(self) -> str:
        return self.tb.addr("lb").rsplit(".", 1)[0]

    # --- set-up and tear-down

    def setup(self) -> None:
        run_dir = self.out / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.bring_up(SERVERS, clients=2)  # c1 the client, c2 the attacker
        self.auth_key = new_auth_key(self.inband, run_dir)
        attacker = self.tb.addr("c2")
        for node in ["lb"] + [f"s{i}" for i in range(1, SERVERS + 1)]:
            run(self.ns(node), ["ip", "route", "add", SPOOF_NET, "via", attacker])
        # The generator's frames leave c2 with XDP_TX: its bridge port needs
        # the pass program the balancer's has (removed with the namespace).
        run(None, [str(self.inband), "testbed", "xdp-tx", "--name", self.tb.name, "--node", "c2"])
        for i in range(1, SERVERS + 1):
            node = f"s{i}"
            slog = self.out / "logs" / f"serve-{node}.log"
            argv = [
                str(self.inband), "serve", "--listen", f"0.0.0.0:{HTTP_PORT}", "--workers", "64", "--service-ms", "0",
                "--service-dist", "constant", "--body-bytes", "1024", "--keep-alive",
            ]  # fmt: skip
            self.servers.append((node, self.procs.spawn(f"serve {node}", self.ns(node), argv, slog), slog))
        for node, proc, log in self.servers:
            ns = self.ns(node)
            wait_until(
                f"the server on {node}",
                lambda ns=ns, proc=proc, log=log, node=node: alive(proc, f"the server on {node}", log) and f":{HTTP_PORT}" in run(ns, ["ss", "-Hltn"]).stdout,
                20,
            )
        for b in self.backends:
            run(self.ns("lb"), ["ping", "-c", "1", "-W", "2", b.address], check=False)

    def before_down(self) -> None:
        run(self.ns("lb"), ["nft", "delete", "table", "ip", peers.NFT_TABLE], check=False)

    # --- balancers

    def start_server_agents(self, d: Path) -> None:
        """An agent on every server, with empty maps. Only while inband is
        measured: a stopped agent removes its maps, and client tuples that
        a flood's SYNs left there (no socket ever closes them) must not
        meet the peers' connections, which come from the same balancer
        address and ports without a 155 (see docs/benchmarks.md)."""
        self.agents = self.start_agents([f"s{i}" for i in range(1, SERVERS + 1)], d, d, HTTP_PORT)

    def stop_agents(self) -> None:
        for node, proc, _log in self.agents:
            self.procs.stop(proc)
            # A clean stop removes everything; after a kill, detach does.
            run(self.ns(node), [str(self.inband), "agent", "detach", "--interface", "eth0"], check=False)
        self.agents = []

    def start(self, kind: str, d: Path):
        """Starts the balancer `kind`; returns what `stop` needs. What a
        failed start had started is stopped again."""
        started = [kind, None]
        try:
            return self._start(kind, d, started)
        except BaseException:
            self.stop(tuple(started))
            raise

    def _start(self, kind: str, d: Path, started: list):
        d.mkdir(parents=True, exist_ok=True)
        lb = self.ns("lb")
        if kind == "inband":
            self.start_server_agents(d)
            proc = started[1] = self.start_lb(d, self.backends, mode="dsr-dynamic")
            return (kind, proc)
        if kind == "haproxy":
            cfg = d / "haproxy.cfg"
            cfg.write_text(peers.haproxy_cfg(vip=self.tb.vip, vip_port=VIP_PORT, backends=self.backends, balance="roundrobin", timeout_s=30))
            log = d / "haproxy.log"
            proc = started[1] = self.procs.spawn("haproxy", lb, ["haproxy", "-f", str(cfg), "-db"], log)
            wait_until("haproxy to listen", lambda: alive(proc, "haproxy", log) and f"{self.tb.vip}:{VIP_PORT}" in run(lb, ["ss", "-Hltn"]).stdout, 20)
            return (kind, proc)
        if kind == "nftables":
            self.ct_flush()
            self.ip_forward = run(lb, ["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip()
            run(lb, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            text = peers.nft_ruleset(vip=self.tb.vip, vip_port=VIP_PORT, backends=self.backends)
            (d / "nftables.nft").write_text(text)
            run(lb, ["nft", "-f", "-"], input=text)
            return (kind, None)
        raise ValueError(kind)

    def stop(self, handle) -> None:
        kind, proc = handle
        lb = self.ns("lb")
        if proc is not None:
            self.procs.stop(proc)
        if kind == "inband":
            self.detach_lb()
            self.stop_agents()
        if kind == "nftables":
            run(lb, ["nft", "delete", "table", "ip", peers.NFT_TABLE], check=False)
            if self.ip_forward is not None:
                run(lb, ["sysctl", "-q", "-w", f"net.ipv4.ip_forward={self.ip_forward}"], check=False)
                self.ip_forward = None
            self.ct_flush(check=False)

    def ct_flush(self, check: bool = True) -> None:
        run(self.ns("lb"), [sys.executable, "-c", CT_FLUSH], check=check)

    # --- counters

    def netstat(self, node: str) -> dict:
        # Both files are pairs of lines, so one after the other still are.
        allc = parse_netstat(run(self.ns(node), ["cat", "/proc/net/snmp", "/proc/net/netstat"]).stdout)
        return {k: allc.get(k, 0) for k in NETSTAT_KEYS}

    def switch_drops(self) -> dict:
        """Frames each bridge port could not hand to its node (the veth's
        ring was full), by node."""
        links = json.loads(run(self.tb.switch_netns, ["ip", "-s", "-j", "link", "show"]).stdout)
        ports = {self.tb.switch_port(n["node"]): n["node"] for n in self.tb.state["nodes"]}
        return {ports[link["ifname"]]: int(link["stats64"]["tx"]["dropped"]) for link in links if link.get("ifname") in ports}

    def counters(self, kind: str) -> dict:
        c = {"lb_netstat": self.netstat("lb"), "switch_drops": self.switch_drops()}
        sv = {}
        for i in range(1, SERVERS + 1):
            for k, v in self.netstat(f"s{i}").items():
                sv[k] = sv.get(k, 0) + v
        c["servers_netstat"] = sv
        if kind == "inband":
            st = (self.lb_status() or [{}])[0]
            c["inband"] = {
                "drops": st.get("drops", {}),
                "events": st.get("events", {}),
                "new_conns": sum(int(b["stats"]["new_conns"]) for b in st.get("vips", [{}])[0].get("backends", [])),
            }
        if kind == "nftables":
            cp = run(self.ns("lb"), ["cat", "/proc/net/stat/nf_conntrack"], check=False)
            ct = parse_conntrack_stat(cp.stdout) if cp.returncode == 0 else {}
            c["conntrack"] = {k: ct.get(k, 0) for k in CONNTRACK_KEYS}
        return c

    def end_state(self, kind: str) -> dict:
        """Levels (not counters) at the end of a measurement."""
        if kind == "inband":
            st = (self.lb_status() or [{}])[0]
            return {"half_open_end": int(st.get("flow_table", {}).get("half_open", 0)), "flow_table_end": st.get("flow_table", {})}
        if kind == "nftables":
            lb = self.ns("lb")
            count = run(lb, ["cat", "/proc/sys/net/netfilter/nf_conntrack_count"], check=False).stdout.strip()
            cmax = run(lb, ["cat", "/proc/sys/net/netfilter/nf_conntrack_max"], check=False).stdout.strip()
            return {"conntrack_count_end": int(count or 0), "conntrack_max": int(cmax or 0)}
        return {}

    def delta(self, kind: str, before: dict, after: dict, levels: dict) -> dict:
        d = counter_delta(before, after)
        if kind == "inband":
            d["inband"].update({k: v for k, v in levels.items() if k == "half_open_end"})
            d["flow_table_end"] = levels.get("flow_table_end", {})
        else:
            d.update(levels)
        return d

    # --- the flood

    def legit_argv(self, until: float, out: Path, limit: int) -> list[str]:
        return [sys.executable, "-c", LEGIT_CLIENT, self.tb.vip, str(VIP_PORT), f"{until:.3f}", f"{self.p.pause_ms:g}", str(limit), str(LEGIT_TIMEOUT_S), str(out)]

    def legit_baseline(self, d: Path) -> list:
        out = d / "legit-baseline.json"
        until = time.monotonic() + self.p.baseline_s
        run(self.ns("c1"), self.legit_argv(until, out, 100_000), timeout=self.p.baseline_s + 30)
        return read_samples(out)

    def flood(self, kind: str) -> Flood:
        p = self.p
        d = self.out / f"flood-{kind}"
        handle = self.start(kind, d)
        client = None
        try:
            self.log(f"flood, {kind}: baseline, {p.baseline_s:g} s of legitimate requests")
            cpu0, t0 = cpu_busy_s(), time.monotonic()
            base = self.legit_baseline(d)
            base_cpu = (cpu_busy_s() - cpu0) / (time.monotonic() - t0)

            self.log(f"flood, {kind}: {p.flood_s:g} s of SYNs from {SPOOF_NET}, legitimate requests during and {p.after_s:g} s after")
            before = self.counters(kind)
            samples_path = d / "legit-flood.json"
            # The client's own deadline is a bound; it is stopped (SIGTERM)
            # once it has made its requests after the flood. It leaves room
            # for MIN_AFTER requests that each fail at their timeout: a peer
            # whose NAT ports the flood took (nftables' masquerade, until
            # conntrack forgets the flood's unanswered entries) refuses that
            # long, and how many SYNs the flood gets out depends on the
            # machine.
            until = time.monotonic() + p.flood_s + p.after_s + p.recovery_max_s + MIN_AFTER * (LEGIT_TIMEOUT_S + p.pause_ms / 1000) + 10
            client = self.procs.spawn(
                "legitimate client", self.ns("c1"), self.legit_argv(until, samples_path, 1_000_000),
                d / "legit-flood.log",
            )  # fmt: skip
            time.sleep(0.5)
            argv = [
                str(self.inband), "bench", "blast", "--interface", "eth0", "--dst-mac", self.mac("lb"), "--src", "198.18.0.1:1234",
                "--dst", f"{self.tb.vip}:{VIP_PORT}", "--spoof-from", SPOOF_NET, "--packets", "1000000000", "--seconds", f"{p.flood_s:g}",
            ]  # fmt: skip
            own0 = self.own_cpu(handle)  # (CPU s, runs)
            cpu0, t_start = cpu_busy_s(), time.monotonic()
            cp = run(self.ns("c2"), argv, timeout=p.flood_s + 60)
            t_end, cpu1 = time.monotonic(), cpu_busy_s()
            own1 = self.own_cpu(handle)
            levels = self.end_state(kind)
            blast = json.loads(cp.stdout)
            # After the flood: `after_s`, at least MIN_AFTER requests (one
            # the flood held up can take 5 s to fail), and the last one a
            # success — a balancer that refuses after the flood is followed
            # until it answers again, for `recovery_max_s` at most. A peer
            # whose full conntrack table drops SYNs answers each request
            # only after a retransmission, so reaching MIN_AFTER may take
            # longer than that; the client's own deadline bounds the wait.
            deadline = t_end + p.after_s + p.recovery_max_s
            while client.poll() is None:
                after_rows = [x for x in read_samples(samples_path) if x[0] >= t_end]
                now, enough = time.monotonic(), len(after_rows) >= MIN_AFTER
                if enough and (now >= deadline or (now >= t_end + p.after_s and after_rows[-1][2] == "")):
                    break
                time.sleep(0.1)
            self.procs.stop(client, grace_s=10)
            samples = read_samples(samples_path)
            after = self.counters(kind)
            if handle[1] is not None and handle[1].poll() is not None:
                raise RuntimeError(f"{kind} exited during the flood (status {handle[1].returncode}); see {d}")
        finally:
            if client is not None:
                self.procs.stop(client)
            self.stop(handle)
        r = Flood(
            kind, LABELS[kind], int(blast["sent"]), t_end - t_start, Legit.of(base), Legit.of(samples, t_start, t_end),
            Legit.of(samples, t_end), cpu1 - cpu0, None if own0[0] is None else own1[0] - own0[0],
            baseline_cpu_per_s=base_cpu, own_runs=own1[1] - own0[1], counters=self.delta(kind, before, after, levels),
        )  # fmt: skip
        (d / "result.json").write_text(json.dumps(flood_json(r), indent=2))
        self.log(
            f"flood, {kind}: {r.sent:,} SYNs ({r.rate / 1e3:.1f} kpps); legitimate {r.during.ok}/{r.during.total} ok during, "
            f"{r.after.ok}/{r.after.total} after"
        )
        return r

    def own_cpu(self, handle) -> tuple[float | None, int]:
        """The balancer's own CPU seconds so far — HAProxy's process time,
        inband's XDP program run time; None for nftables (no process) —
        and inband's program runs."""
        kind, proc = handle
        if kind == "haproxy":
            return proc_cpu_s(proc.pid), 0
        if kind == "inband":
            ns, runs = xdp_prog_stats(self.ns("lb"), "eth0")
            return ns / 1e9, runs
        return None, 0

    # --- the churn

    def add_sources(self, connections: int) -> list[str]:
        srcs = churn_sources(self.subnet_prefix, self.churn_next_host, connections)
        self.churn_next_host += len(srcs)
        for s in srcs:
            run(self.ns("c1"), ["ip", "addr", "add", f"{s}/24", "dev", "eth0"])
        return srcs

    def churn(self, kind: str, connections: int, server_closes: bool) -> Churn:
        p = self.p
        tag = f"churn-{kind}" + ("-server-closes" if server_closes else "")
        d = self.out / tag
        sources = self.add_sources(connections)
        handle = self.start(kind, d)
        bound = connections / p.churn_min_rate + 30
        try:
            before = self.counters(kind)
            self.log(f"churn, {kind}{' (server closes)' if server_closes else ''}: {connections:,} connections from {len(sources)} addresses, at most {bound:.0f} s")
            argv = [
                str(self.inband), "bench", "churn", "--target", f"{self.tb.vip}:{VIP_PORT}", "--sources", ",".join(sources),
                "--connections", str(connections), "--concurrency", str(p.concurrency), "--seconds", f"{bound:g}",
            ]  # fmt: skip
            if server_closes:
                argv.append("--server-closes")
            cp = run(self.ns("c1"), argv, timeout=bound + 120)
            result = json.loads(cp.stdout)
            after = self.counters(kind)
            levels = self.end_state(kind)
            if handle[1] is not None and handle[1].poll() is not None:
                raise RuntimeError(f"{kind} exited during the churn (status {handle[1].returncode}); see {d}")
        finally:
            self.stop(handle)
        r = Churn(kind, SERVER_CLOSES_LABEL if server_closes else LABELS[kind], connections, server_closes, bound, result, self.delta(kind, before, after, levels))
        (d / "result.json").write_text(json.dumps(asdict(r), indent=2))
        self.log(
            f"churn, {kind}: {result['ok']:,} ok, {result['failed']:,} failed of {result['attempted']:,}, "
            f"{result['per_second']:,.0f}/s, p99 {result['p99_ms']:.1f} ms"
        )
        return r



# ------------------------------------------------------------------ output


def flood_json(r: Flood) -> dict:
    d = asdict(r)
    for k in ("baseline", "during", "after"):
        leg = getattr(r, k)
        d[k]["success_pct"] = leg.success_pct
    d.update(rate=r.rate, cpu_per_s=r.cpu_per_s, us_per_syn=r.us_per_syn, own_per_s=r.own_per_s)
    return d


TOOLS = {"haproxy": ["haproxy", "-v"], "nftables": ["nft", "--version"]}


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    p, m, rows = record["profile"], record["machine"], record["rows"]
    floods = [revive(Flood, {**r, **{k: revive(Legit, r[k]) for k in ("baseline", "during", "after")}}) for r in rows["flood"]]
    churns = [revive(Churn, r) for r in rows["churn"]]
    preamble = (
        "# SYN flood and connection churn against nftables and HAProxy\n\n"
        f"{provenance(record)}  \n"
        "The CPUs are **shared by everything**: attacker, legitimate client, bridge, balancer, servers "
        f"(other work seen running: {', '.join(record['others']) or 'none seen'}). "
        f"Profile {p['name']}: baseline {p['baseline_s']:g} s, flood {p['flood_s']:g} s, after {p['after_s']:g} s "
        f"(followed up to {p['recovery_max_s']:g} s more until a request succeeds), "
        f"{p['pause_ms']:g} ms between legitimate requests; churn {p['churn']:,} (inband), {p['peer_churn']:,} (peers), "
        f"{p['server_closes']:,} (inband, server closes), {p['concurrency']} in flight.  \n"
        f"{m.get('haproxy', '')}; {m.get('nftables', '')}; {m.get('inband', '')}\n"
    )
    for v in verdicts(floods, churns):
        preamble += f"\n- {v}"
    if record["failed"]:
        preamble += "\n\n**Failed:** " + "; ".join(record["failed"])
    preamble += "\n"
    return markdown(floods, churns, preamble)


def markdown(floods: list[Flood], churns: list[Churn], preamble: str) -> str:
    parts = [preamble]
    if floods:
        parts += [
            "## SYN flood from random sources, legitimate client during and after\n",
            flood_table(floods),
            "Failures and counters over the flood:\n",
            flood_counters_table(floods),
        ]
    if churns:
        parts += [
            "## Connection churn: short connections from distinct client tuples, 2 backends\n",
            churn_table(churns),
            "Counters over each churn run:\n",
            churn_counters_table(churns),
        ]
    return "\n".join(parts)


def verdicts(floods: list[Flood], churns: list[Churn]) -> list[str]:
    """The statements the issues ask for, true or not, for the summary."""
    out = []
    for f in floods:
        if f.after.total == 0:
            out.append(f"{f.label}: no legitimate request after the flood was measured")
        elif f.after.failed:
            out.append(f"{f.label}: {f.after.failed} of {f.after.total} legitimate requests after the flood FAILED")
    for c in churns:
        if c.kind == "inband":
            drops = c.counters.get("inband", {}).get("drops", {})
            bad = {k: drops.get(k, 0) for k in MUST_BE_ZERO if drops.get(k, 0)}
            what = f"{c.label}: {c.refused:,} of {c.asked:,} connections not completed"
            out.append(what + (f"; {_nonzero(bad)}" if bad else f"; {', '.join(f'{k} 0' for k in MUST_BE_ZERO)}"))
    return out


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.resilience", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the run's raw data: logs (created)")
    ap.add_argument("--results", default=str(default_dir("resilience")), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--parts", default="flood,churn", help="comma-separated subset of flood, churn")
    ap.add_argument("--name", default="res", help="testbed name (namespaces NAME-lb, NAME-c1, NAME-c2, NAME-s1, NAME-s2, NAME-sw)")
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    ap.add_argument("--churn-connections", type=int, help="inband's churn connections (default: the profile's)")
    ap.add_argument("--peer-connections", type=int, help="nftables' and HAProxy's churn connections (default: the profile's)")
    ap.add_argument("--server-closes-connections", type=int, help="inband with the server closing first; 0 skips (default: the profile's)")
    args = ap.parse_args(argv)
    bad = set(args.parts.split(",")) - {"flood", "churn"}
    if bad:
        ap.error(f"unknown part(s): {', '.join(sorted(bad))}")
    return args


def profile_of(args) -> Profile:
    return profiles.choose(PROFILES, args.profile, churn=args.churn_connections, peer_churn=args.peer_connections,
                           server_closes=args.server_closes_connections)


def problems(args, profile: Profile) -> list[str]:
    problems = preflight.problems(inband=args.inband, tools=("haproxy", "nft", "bpftool"), testbed_name=args.name, bpf_stats=True)
    need = sum(max(1, math.ceil(n / PORTS_PER_SOURCE)) for _, n, _ in churn_plan(profile))
    if CHURN_FIRST_HOST + need - 1 > CHURN_LAST_HOST:
        problems.append(f"the churn runs need {need} client addresses, more than the {CHURN_LAST_HOST - CHURN_FIRST_HOST + 1} set aside")
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    profile = profile_of(args)
    refused = preflight.refuse(problems(args, profile))
    if refused:
        return refused
    parts = args.parts.split(",")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    this_run = Run("resilience", "bench.resilience", argv)
    bench = Bench(args, profile, out)
    stop_signals_interrupt()
    floods: list[Flood] = []
    churns: list[Churn] = []
    outcome = Outcome(bench.log)

    with outcome.torn_down_after(bench.teardown):
        bench.setup()
        if "flood" in parts:
            # Program run times (inband's own CPU) for every flood and
            # baseline alike; they slow every XDP program a little, the
            # generator's too, the same in every run.
            stats = enable_bpf_stats()
            try:
                for kind in ("inband", "nftables", "haproxy"):
                    outcome.attempt(f"flood {kind}", lambda kind=kind: bench.flood(kind), floods)
            finally:
                os.close(stats)
        if "churn" in parts:
            for kind, n, server_closes in churn_plan(profile):
                outcome.attempt(f"churn {kind}{' server-closes' if server_closes else ''}", lambda k=kind, n=n, s=server_closes: bench.churn(k, n, s), churns)

    rows = {"flood": [flood_json(r) for r in floods], "churn": [asdict(r) for r in churns]}
    record = this_run.record(rows, profile=profiles.as_json(args.profile, profile), inband=bench.inband, tools=TOOLS,
                        others=sorted(bench.others), failed=outcome.failed)
    write_results(Path(args.results), record, render(record))
    return outcome.exit_code()


if __name__ == "__main__":
    sys.exit(main())

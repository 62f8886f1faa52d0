"""Data-plane speed and efficiency against the peers, in one run on one
namespace testbed (issue 5, parts 2-4):

    python -m bench.forwarding --out results/fwd

1. Forwarding rate of small TCP packets: raw 64-byte frames (XDP live-frame
   generator, XDP counter-and-drop at the receiver) through inband (native
   XDP), nftables DNAT, the bounce floor and no forwarder at all, on a
   one-armed hairpin and through the testbed's switch to a server; and
   64-byte writes over real TCP connections (HAProxy only forwards what
   its sockets read) through inband, nftables, HAProxy in TCP mode and
   straight to the server.
2. DSR's point: CPU per GB of HTTP response (1 KB, 46 KB, 1 MB) for DSR,
   pass-through and HAProxy, against the direct path.
3. Feedback freshness: time from a server's score change to the balancer's
   map holding it, in-band (probe every n-th packet) and by polling.

Prints Markdown tables with ratios, writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/forwarding),
forwarding.png into --out. Testbed `fwd`: client c1, balancer lb, server s1. Every
process, XDP program, nftables table and namespace is removed on exit,
Ctrl-C and SIGTERM included. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .lib import peers, preflight, profiles
from .lib.host import PinnedMap, c_struct, cpu_busy_s, enable_bpf_stats, others_running, proc_cpu_s, xdp_prog_stats
from .lib.report import times as _ratio
from .lib.results import REPO, Run, default_dir, provenance, revive
from .lib.results import write as write_results
from .lib.stats import percentile as _percentile
from .lib.testbed import TestbedRun, alive, new_auth_key
from .lib.tools import parse_wrk as _parse_wrk
from .lib.peers import Backend
from .lib.outcome import Outcome
from .lib.procs import ns_argv, run, stop_signals_interrupt, wait_until

VIP_PORT = 80
SINK_PORT = 9000  # raw frames and TCP streams
HTTP_PORT = 8080  # `inband serve` and the agent's service
SIZES = {"1 KB": 1024, "46 KB": 47104, "1 MB": 1048576}
SCORE_VALUE, ScoreEntry = c_struct(REPO / "bpf/include/inband/lb/types.h", "inband_backend_score")
# The hairpin: a veth pair client <-> balancer of its own (see setup_hairpin).
HAIRPIN_DEV = "gen0"
HAIRPIN_LB = "10.79.0.2"
HAIRPIN_CLIENT = "10.79.0.11"
HAIRPIN_BACKEND = "10.79.0.21"


@dataclass(frozen=True)
class Profile:
    seconds: float  # per forwarding measurement (round)
    rounds: int  # forwarding rounds per path; the median is kept
    http_seconds: int  # per wrk run (wrk counts whole seconds)
    trials: int  # score changes per freshness setting
    probe_intervals: tuple
    poll_intervals_ms: tuple
    adaptive: tuple  # (probe_interval, probe_interval_max, probe_budget) per row


PROFILES = {
    "quick": Profile(2.0, 3, 3, 15, (10, 100, 1000), (10, 100), ((10, 1000, 0), (10, 1000, 20))),
    # The test: every table filled, nothing measured well.
    "tiny": Profile(0.5, 1, 1, 2, (10,), (10,), ((10, 1000, 100),)),
}
# Score age samples per change, taken at random instants of the pause
# before it: what a connection balanced then would have used.
AGE_SAMPLES = 5



# ------------------------------------------------------------------ results


@dataclass
class Fwd:
    """One forwarding measurement."""

    load: str  # hairpin | switch (raw frames) | stream (TCP connections)
    path: str  # direct | bounce | inband | inband-pt | nftables | haproxy
    label: str
    units: int  # frames received at the sink (raw) / 64-byte writes delivered to the server (stream)
    sent: int
    seconds: float
    server_packets: int
    machine_cpu_s: float
    own_cpu_s: float = 0.0  # stream only: HAProxy's process CPU time, inband's XDP program run time
    thread_ns_per_packet: float = 0.0  # hairpin only: the balancer interface's NAPI thread, per delivered packet
    round_rates: list = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.units / self.seconds if self.seconds > 0 else 0.0



@dataclass
class Http:
    """One wrk run for the CPU-per-GB table."""

    size: str
    path: str
    label: str
    requests: int
    bytes: int
    errors: int
    seconds: float
    machine_cpu_s: float
    prog_ns: int = 0
    prog_runs: int = 0
    proc_cpu_s: float = 0.0

    @property
    def gb(self) -> float:
        return self.bytes / 1e9


@dataclass
class Fresh:
    mechanism: str  # in-band | polling
    interval: str  # "n = 100" | "n = 10..1000, ≤ 100/s" | "100 ms"
    delays_ms: list = field(default_factory=list)
    timeouts: int = 0
    load_rps: float = 0.0
    backend_pps: float = 0.0  # packets the balancer forwarded to the server: what probes count
    ages_ms: list = field(default_factory=list)  # the score's age at random instants
    requests_per_s: float = 0.0  # score requests to the server: 124 options or poll packets
    last_n: int = 0  # in-band: the backend's probe interval at the end


FWD_LABELS = {
    "direct": "direct (no balancer)",
    "inband": "inband, native XDP (dsr-dynamic, n = 100)",
    "inband-pt": "inband, native XDP (passthrough)",
    "nftables": "nftables DNAT + masquerade",
    "haproxy": "HAProxy 2.6, mode tcp",
}
HAIRPIN_LABELS = {
    "generator": "generator alone (frames made and dropped, nothing sent)",
    "direct": "none: frames end at the balancer's interface (generator + sink)",
    "bounce": "bounce floor (swap MACs, XDP_TX)",
    "inband": "inband, native XDP (dsr-dynamic, n = 100)",
    "nftables": "nftables DNAT + masquerade",
}
HTTP_LABELS = {
    "direct": "direct (no balancer)",
    "dsr": "inband DSR (dsr-rr)",
    "passthrough": "inband pass-through",
    "haproxy": "HAProxy 2.6, mode tcp",
}




def fwd_table(rows: list[Fwd], load: str) -> str:
    """Raw frames: one CPU does all the work inline (generator, forwarder,
    sink), so a path costs 1/rate per packet and a forwarder adds
    1/rate − 1/rate of the direct path. On the hairpin, also the CPU time
    per packet of the balancer interface's receive thread alone (see
    Bench.napi_thread_cost), and the rate one core doing only that would
    reach. TCP streams: several processes, so
    only what is the balancer's own (HAProxy's process time, inband's XDP
    program time). Machine-wide CPU counters are in results.json only: the
    machine is shared, and other work lands in them."""
    rows = [r for r in rows if r.load == load]
    by = {r.path: r for r in rows}
    direct = by.get("direct")
    inband = by.get("inband") or by.get("inband-pt")
    raw = load != "stream"
    unit = "frames" if raw else "64 B writes"

    def added(r: Fwd) -> float | None:
        """s per M packets the path adds to the direct path, from rates."""
        if not (raw and direct and r is not direct and r.rate and direct.rate):
            return None
        return (1 / r.rate - 1 / direct.rate) * 1e6

    threaded = any(r.thread_ns_per_packet for r in rows)

    head = (
        f"| path | {unit} sent | {unit} delivered | M{'pps' if raw else ' writes/s'} | ÷ direct | inband ÷ this "
        + ("| CPU s per M over direct (from rate) | ÷ inband's " if raw else "| balancer's own CPU s per M | ÷ inband's ")
        + ("| receive thread CPU ns/packet | one core, Mpps | inband ÷ this " if threaded else "")
        + "| rounds (M/s) |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|---:|" if threaded else "")
        + "---|\n"
    )
    out = []
    for r in rows:
        cost = added(r) if raw else (r.own_cpu_s / r.units * 1e6 if r.own_cpu_s and r.units else None)
        ref = (added(inband) if raw else (inband.own_cpu_s / inband.units * 1e6 if inband.own_cpu_s else None)) if inband else None
        out.append(
            f"| {r.label} | {r.sent:,} | {r.units:,} | {r.rate / 1e6:.3f} | {_ratio(r.rate, direct.rate) if direct else '–'} "
            f"| {_ratio(inband.rate, r.rate) if inband else '–'} | {'–' if cost is None else f'{cost:.3f}'} "
            f"| {_ratio(cost, ref) if cost is not None and cost > 0 and ref and ref > 0 else '–'} "
        )
        if threaded:
            t, ti = r.thread_ns_per_packet, inband.thread_ns_per_packet if inband else 0
            out[-1] += (
                f"| {f'{t:.0f}' if t else '–'} | {f'{1000 / t:.2f}' if t else '–'} | {_ratio(t, ti) if t and ti else '–'} "
            )
        out[-1] += f"| {' / '.join(f'{x / 1e6:.3f}' for x in r.round_rates) or '–'} |"
    return head + "\n".join(out) + "\n"


def http_own_cpu(r: Http) -> float | None:
    """The balancer's own CPU seconds per GB of response: inband's XDP
    program run time, HAProxy's process time (user + system)."""
    if not r.gb:
        return None
    if r.path in ("dsr", "passthrough"):
        return r.prog_ns / 1e9 / r.gb
    if r.path == "haproxy":
        return r.proc_cpu_s / r.gb
    return None


def http_table(rows: list[Http]) -> str:
    head = (
        "| response | path | requests | GB | req/s | balancer's own CPU s/GB | ÷ DSR | balancer's own CPU µs/request | packets through the balancer per request | wrk errors |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    out = []
    for size in dict.fromkeys(r.size for r in rows):
        group = [r for r in rows if r.size == size]
        by = {r.path: r for r in group}
        dsr_own = http_own_cpu(by["dsr"]) if "dsr" in by else None
        for r in group:
            o = http_own_cpu(r)
            per_req = o * r.gb / r.requests * 1e6 if o is not None and r.requests else None
            out.append(
                f"| {size} | {r.label} | {r.requests:,} | {r.gb:.3f} | {r.requests / r.seconds:,.0f} "
                f"| {'–' if o is None else f'{o:.3f}'} | {_ratio(o, dsr_own) if o is not None and dsr_own else '–'} "
                f"| {'–' if per_req is None else f'{per_req:.2f}'} "
                f"| {f'{r.prog_runs / r.requests:.1f}' if r.prog_runs and r.requests else '–'} | {r.errors} |"
            )
    return head + "\n".join(out) + "\n"


def percentile(values: list[float], q: float) -> float:
    """Nearest rank (q a fraction), as every table's."""
    return _percentile(values, q * 100)


def fresh_table(rows: list[Fresh]) -> str:
    """Change → map delays, the score's age at use, and what it cost in
    score requests to the server, against the first row's cost."""
    head = (
        "| mechanism | interval | changes seen | median ms | p90 ms | max ms | not seen in time "
        "| age at use, median ms | age at use, p90 ms | score requests/s to the server | ÷ first row's | n at the end "
        "| request load (req/s) | packets/s to the server |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    out = []
    ref = rows[0].requests_per_s if rows else 0.0
    for r in rows:
        d, a = r.delays_ms, r.ages_ms
        stats = f"{statistics.median(d):.2f} | {percentile(d, 0.9):.2f} | {max(d):.2f}" if d else "– | – | –"
        ages = f"{statistics.median(a):.2f} | {percentile(a, 0.9):.2f}" if a else "– | –"
        out.append(
            f"| {r.mechanism} | {r.interval} | {len(d)} | {stats} | {r.timeouts} | {ages} | {r.requests_per_s:,.1f} "
            f"| {_ratio(r.requests_per_s, ref)} | {r.last_n or '–'} | {r.load_rps:,.0f} | {r.backend_pps:,.0f} |"
        )
    return head + "\n".join(out) + "\n"


# ------------------------------------------------------------------ the run


WRK_LUA = """
local delay_ms = tonumber(os.getenv("INBAND_WRK_DELAY_MS") or "0")
if delay_ms > 0 then
  function delay() return delay_ms end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("INBAND requests=%d bytes=%d errors=%d\\n", summary.requests, summary.bytes,
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def parse_wrk(text: str) -> dict:
    return _parse_wrk(text, "INBAND")




# Ethernet + IPv4 + TCP with timestamps: what a data segment carries
# besides its payload.
SEGMENT_OVERHEAD = 14 + 20 + 32


def delivered_writes(sink: dict, message: int = 64) -> int:
    """64-byte writes that reached the server, from the sink's count of
    frames and bytes: a proxy regroups writes into other segments, so
    neither segments nor the client's own count compare across paths."""
    return max(0, sink["bytes"] - sink["packets"] * SEGMENT_OVERHEAD) // message


class Bench(TestbedRun):
    watch_others = True  # other benchmarks and builds seen while measuring

    def __init__(self, args, profile: Profile, out: Path):
        super().__init__(args.inband, args.name)
        self.args = args
        self.p = profile
        self.out = out

    def mac(self, node: str) -> str:
        return json.loads(run(self.ns(node), ["ip", "-j", "link", "show", "eth0"]).stdout)[0]["address"]

    def setup(self) -> None:
        run_dir = self.out / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.bring_up(1)
        self.auth_key = new_auth_key(self.inband, run_dir)
        self.start_agents(["s1"], run_dir, self.out / "logs", HTTP_PORT)
        run(self.ns("lb"), ["ping", "-c", "1", "-W", "2", self.tb.addr("s1")], check=False)

    def before_down(self) -> None:
        run(self.ns("lb"), ["nft", "delete", "table", "ip", peers.NFT_TABLE], check=False)

    # --- balancers

    def start(
        self,
        kind: str,
        backend_port: int,
        tag: str,
        mode: str = "dsr-dynamic",
        probe: int = 100,
        poll_ms: int = 100,
        hairpin: bool = False,
        probe_max: int | None = None,
        budget: int = 0,
    ):
        """Starts the balancer `kind` (inband | nftables | haproxy | bounce |
        direct) for VIP:80 → s1:backend_port (or, on the hairpin, the
        generator's side); returns what `stop` needs."""
        d = self.out / tag
        d.mkdir(parents=True, exist_ok=True)
        lb = self.ns("lb")
        dev = HAIRPIN_DEV if hairpin else "eth0"
        backends = [Backend(HAIRPIN_BACKEND if hairpin else self.tb.addr("s1"), backend_port)]
        if kind == "bounce":
            log = d / "bounce.log"
            proc = self.procs.spawn("bounce", lb, [str(self.inband), "bench", "bounce", "--interface", dev, "--max-seconds", "120"], log)
            wait_until("the bounce program", lambda: alive(proc, "bounce", log) and "attached" in log.read_text(), 20)
            return (kind, proc, dev)
        if kind == "inband":
            proc = self.start_lb(
                d, backends, address=HAIRPIN_LB if hairpin else None, resolve=not hairpin, mode=mode, probe_interval=probe, poll_interval_ms=poll_ms,
                interface=dev, probe_interval_max=probe_max, probe_budget=budget,
            )  # fmt: skip
            return (kind, proc, dev)
        if kind == "haproxy":
            cfg = d / "haproxy.cfg"
            cfg.write_text(peers.haproxy_cfg(vip=self.tb.vip, vip_port=VIP_PORT, backends=backends, balance="roundrobin", timeout_s=30))
            log = d / "haproxy.log"
            proc = self.procs.spawn("haproxy", lb, ["haproxy", "-f", str(cfg), "-db"], log)
            wait_until(
                "haproxy to listen", lambda: alive(proc, "haproxy", log) and f"{self.tb.vip}:{VIP_PORT}" in run(lb, ["ss", "-Hltn"]).stdout, 20
            )
            return (kind, proc, dev)
        if kind == "nftables":
            run(lb, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            text = peers.nft_ruleset(vip=self.tb.vip, vip_port=VIP_PORT, backends=backends)
            (d / "nftables.nft").write_text(text)
            run(lb, ["nft", "-f", "-"], input=text)
            # The raw generator sends mid-connection segments with no
            # handshake; conntrack picks them up (tcp_loose, the default)
            # and must not refuse the repeated sequence numbers as out of
            # window. (The sysctl exists once the ruleset loaded conntrack.)
            run(lb, ["sysctl", "-q", "-w", "net.netfilter.nf_conntrack_tcp_be_liberal=1"])
            if hairpin:
                # XDP frames from the generator enter a veth only with NAPI
                # on, which an XDP program turns on for inband and bounce
                # and GRO for the kernel's path.
                run(lb, ["ethtool", "-K", dev, "gro", "on"])
            return (kind, None, dev)
        return (kind, None, dev)

    def stop(self, handle) -> None:
        kind, proc, dev = handle
        lb = self.ns("lb")
        if proc is not None:
            self.procs.stop(proc)
        if kind == "inband":
            self.detach_lb(dev)
        if kind == "nftables":
            run(lb, ["nft", "delete", "table", "ip", peers.NFT_TABLE], check=False)
            run(lb, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=0"], check=False)
            run(lb, ["ethtool", "-K", dev, "gro", "off"], check=False)

    def score_requests(self) -> int:
        """Score requests sent to the (one) backend: 124 options and poll
        packets, whichever the mode sends."""
        s = self.lb_status()[0]
        return int(s["vips"][0]["backends"][0]["stats"]["probes_sent"]) + int(s["control"]["polls_sent"])

    def backend_packets(self) -> int:
        """Client packets the balancer has forwarded to the (one) backend."""
        return int(self.lb_status()[0]["vips"][0]["backends"][0]["stats"]["packets"])

    # --- forwarding rate

    def sink(self, tag: str, passing: bool, node: str = "s1", dev: str = "eth0", port: int = SINK_PORT):
        argv = [str(self.inband), "bench", "sink", "--interface", dev, "--port", str(port), "--max-seconds", "120"] + (["--pass"] if passing else [])
        log = self.out / tag / "sink.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        proc = self.procs.spawn("sink", self.ns(node), argv, log)
        wait_until("the sink to attach", lambda: alive(proc, "sink", log) and "attached" in log.read_text(), 20)
        return proc, log

    def sink_result(self, proc, log) -> dict:
        self.procs.stop(proc, grace_s=10)
        return json.loads(log.read_text().strip().splitlines()[-1])

    def forward_switch(self, path: str) -> Fwd:
        tag = f"fwd-switch-{path}"
        handle = self.start(path, SINK_PORT, tag)
        try:
            if path == "direct":
                dst, mac = f"{self.tb.addr('s1')}:{SINK_PORT}", self.mac("s1")
            else:
                dst, mac = f"{self.tb.vip}:{VIP_PORT}", self.mac("lb")
            argv = [
                str(self.inband), "bench", "blast", "--dst-mac", mac, "--src", f"{self.tb.addr('c1')}:40000", "--dst", dst,
                "--seconds", f"{self.p.seconds:g}", "--packets", "20000000",
            ]  # fmt: skip
            if path == "inband":
                argv += ["--syn-first-ms", "50"]
            # The generator's frames leave c1 with XDP_TX; a veth accepts
            # XDP frames only when its peer has NAPI enabled, which GRO
            # turns on. Only for raw frames: GRO would merge a real TCP
            # stream's segments on the bridge.
            run(self.tb.switch_netns, ["ethtool", "-K", self.tb.switch_port("c1"), "gro", "on"])
            return self.blast_rounds("switch", path, FWD_LABELS[path], (self.ns("c1"), argv), lambda: self.sink(tag, passing=False))
        finally:
            run(self.tb.switch_netns, ["ethtool", "-K", self.tb.switch_port("c1"), "gro", "off"], check=False)
            self.stop(handle)

    def setup_hairpin(self) -> None:
        """A second veth pair straight from the client to the balancer:
        the generator's frames reach the forwarder as XDP frames, and what
        it sends back out of the same interface lands in the sink on the
        generator's side. No bridge, no receiving host: the forwarder is
        the only work besides generating and counting."""
        c1, lb = self.ns("c1"), self.ns("lb")
        run(None, ["ip", "link", "add", HAIRPIN_DEV, "netns", c1, "type", "veth", "peer", "name", HAIRPIN_DEV, "netns", lb])
        for ns in (c1, lb):
            run(ns, ["ip", "link", "set", HAIRPIN_DEV, "up"])
        run(lb, ["ip", "addr", "add", f"{HAIRPIN_LB}/24", "dev", HAIRPIN_DEV])
        gen_mac = json.loads(run(c1, ["ip", "-j", "link", "show", HAIRPIN_DEV]).stdout)[0]["address"]
        # The backend is the generator's side: its MAC is where forwarded
        # frames go, whatever the address.
        run(lb, ["ip", "neigh", "replace", HAIRPIN_BACKEND, "lladdr", gen_mac, "dev", HAIRPIN_DEV, "nud", "permanent"])
        for conf in ("all", HAIRPIN_DEV):
            run(lb, ["sysctl", "-q", "-w", f"net.ipv4.conf.{conf}.rp_filter=0"])
            run(lb, ["sysctl", "-q", "-w", f"net.ipv4.conf.{conf}.send_redirects=0"])

    def forward_hairpin(self, path: str) -> Fwd:
        tag = f"fwd-hairpin-{path}"
        handle = self.start(path, SINK_PORT, tag, hairpin=True)
        perf_data = self.out / tag / "perf.data"
        try:
            # The frames are for VIP:80; forwarders send them on to port
            # 9000, bounce reflects them as they are, direct ends them at
            # the balancer's interface, the generator alone never sends them.
            def sink_at():
                if path == "generator":
                    return None
                if path == "direct":
                    return self.sink(tag, passing=False, node="lb", dev=HAIRPIN_DEV, port=VIP_PORT)
                return self.sink(tag, passing=False, node="c1", dev=HAIRPIN_DEV, port=VIP_PORT if path == "bounce" else SINK_PORT)

            lb_mac = json.loads(run(self.ns("lb"), ["ip", "-j", "link", "show", HAIRPIN_DEV]).stdout)[0]["address"]
            argv = [
                str(self.inband), "bench", "blast", "--interface", HAIRPIN_DEV, "--dst-mac", lb_mac, "--src", f"{HAIRPIN_CLIENT}:40000",
                "--dst", f"{self.tb.vip}:{VIP_PORT}", "--seconds", f"{self.p.seconds:g}", "--packets", "50000000",
            ]  # fmt: skip
            if path == "inband":
                argv += ["--syn-first-ms", "50"]
            if path == "generator":
                argv += ["--drop"]
            if self.args.perf:
                # Only the generator's process: the forwarder and the sink
                # run in its context (softirq on its CPU), other engineers'
                # processes do not.
                cmd = (None, ["perf", "record", "-q", "-e", "cpu-clock", "-g", "-o", str(perf_data), "--", *ns_argv(self.ns("c1"), argv)])
            else:
                cmd = (self.ns("c1"), argv)
            r = self.blast_rounds("hairpin", path, HAIRPIN_LABELS[path], cmd, sink_at)
            if path != "generator":
                r.thread_ns_per_packet = self.napi_thread_cost(argv, sink_at)
        finally:
            self.stop(handle)
        if self.args.perf:
            self.perf_report(perf_data, tag)
        return r

    def napi_thread_cost(self, argv: list[str], sink_at) -> float:
        """CPU ns per delivered packet of the balancer interface's receive
        path alone: with threaded NAPI, everything lb:gen0 receives —
        forwarder, XDP_TX or the kernel's forwarding, and the sink's poll it
        schedules — runs in one kernel thread, pinned to the other CPU than
        the generator, whose exact run time (schedstat) is then the
        forwarder's cost, whatever else the machine runs. (Its rate means
        little: the thread's wake-ups lag the generator and the veth ring
        overflows.)"""
        lb = self.ns("lb")
        def threads() -> set[int]:
            rows = (line.split(None, 1) for line in run(None, ["ps", "-eo", "pid=,comm="]).stdout.splitlines())
            return {int(pid) for pid, comm in rows if comm.startswith(f"napi/{HAIRPIN_DEV}-")}

        # The sink first: on the direct path it is what gives lb:gen0 its
        # NAPI, which must exist to be threaded.
        counter = sink_at()
        try:
            run(None, ["ip", "netns", "exec", lb, "sh", "-c", f"echo 1 > /sys/class/net/{HAIRPIN_DEV}/threaded"])
            # Only lb:gen0 is ever threaded, so every such thread is its
            # (one per NAPI instance; one left over from an earlier path
            # stays idle and adds nothing).
            kthreads = wait_until("the NAPI thread of the balancer's interface", threads, 5)
            for k in kthreads:
                run(None, ["taskset", "-p", "-c", "1", str(k)])

            def ran_ns() -> int:
                return sum(int(open(f"/proc/{k}/schedstat").read().split()[0]) for k in kthreads)

            t0 = ran_ns()
            run(self.ns("c1"), ["taskset", "-c", "0", *argv], timeout=self.p.seconds + 30)
            time.sleep(0.05)
            t1 = ran_ns()
        finally:
            # While the NAPI still exists (the sink below may be what keeps
            # it): a device left threaded would thread the next path's
            # inline measurement too.
            run(None, ["ip", "netns", "exec", lb, "sh", "-c", f"echo 0 > /sys/class/net/{HAIRPIN_DEV}/threaded"], check=False)
        got = self.sink_result(*counter)
        return (t1 - t0) / got["packets"] if got["packets"] else 0.0

    def blast_rounds(self, load: str, path: str, label: str, cmd: tuple, sink_at) -> Fwd:
        """The generator `cmd`, counted by a fresh sink each round (`sink_at`
        returns None where there is nothing to count)."""

        def once() -> Fwd:
            counter = sink_at()
            cpu0 = cpu_busy_s()
            cp = run(*cmd, timeout=self.p.seconds + 30)
            cpu1 = cpu_busy_s()
            b = json.loads(cp.stdout)
            if counter is None:  # nothing to count: the generator alone
                return Fwd(load, path, label, b["sent"], b["sent"], b["seconds"], 0, cpu1 - cpu0)
            time.sleep(0.05)  # the last frames are still on their way
            got = self.sink_result(*counter)
            return Fwd(load, path, label, got["packets"], b["sent"], b["seconds"], got["packets"], cpu1 - cpu0)

        return self.median_of_rounds(once)

    def median_of_rounds(self, once) -> Fwd:
        """`once()` `profile.rounds` times; the round with the median rate
        is kept (the machine is shared, so a single round can be hit by
        someone else's burst)."""
        results = sorted((once() for _ in range(self.p.rounds)), key=lambda f: f.rate)
        kept = results[len(results) // 2]
        kept.round_rates = [f.rate for f in results]
        return kept

    def perf_report(self, data: Path, tag: str) -> None:
        """Top symbols of a cpu-clock profile (this VM has no hardware
        counters) into perf-<tag>.txt."""
        cp = run(
            None,
            ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "symbol", "-g", "none", "--percent-limit", "1.5"],
            timeout=120, check=False,
        )  # fmt: skip
        (self.out / f"perf-{tag}.txt").write_text(cp.stdout)
        data.unlink(missing_ok=True)

    def forward_stream(self, path: str) -> Fwd:
        tag = f"fwd-stream-{path}"
        kind = {"inband-pt": "inband"}.get(path, path)
        handle = self.start(kind, SINK_PORT, tag, mode="passthrough")
        server = None
        try:
            server = self.procs.spawn(
                "discard", self.ns("s1"), [str(self.inband), "bench", "discard", "--listen", f"0.0.0.0:{SINK_PORT}"], self.out / tag / "discard.log"
            )
            wait_until("the discard server", lambda: alive(server, "discard", self.out / tag / "discard.log") and "listening" in (self.out / tag / "discard.log").read_text(), 20)
            dst = f"{self.tb.addr('s1')}:{SINK_PORT}" if path == "direct" else f"{self.tb.vip}:{VIP_PORT}"
            argv = [str(self.inband), "bench", "stream", "--connect", dst, "--connections", "2", "--seconds", f"{self.p.seconds:g}"]
            hp = handle[1].pid if kind == "haproxy" else None

            def once() -> Fwd:
                sink, slog = self.sink(tag, passing=True)
                # The client bounds these rates, so program run times
                # (which slow every XDP program, the sink's too) can be
                # counted here.
                stats = enable_bpf_stats()
                try:
                    prog0 = xdp_prog_stats(self.ns("lb"), "eth0") if kind == "inband" else (0, 0)
                    h0 = proc_cpu_s(hp) if hp else 0.0
                    cpu0 = cpu_busy_s()
                    cp = run(self.ns("c1"), argv, timeout=self.p.seconds + 30)
                    cpu1 = cpu_busy_s()
                    h1 = proc_cpu_s(hp) if hp else 0.0
                    prog1 = xdp_prog_stats(self.ns("lb"), "eth0") if kind == "inband" else (0, 0)
                finally:
                    os.close(stats)
                time.sleep(0.05)
                got = self.sink_result(sink, slog)
                s = json.loads(cp.stdout)
                return Fwd(
                    "stream", path, FWD_LABELS[path], delivered_writes(got), s["messages"], s["seconds"], got["packets"], cpu1 - cpu0,
                    own_cpu_s=(h1 - h0) + (prog1[0] - prog0[0]) / 1e9,
                )  # fmt: skip

            return self.median_of_rounds(once)
        finally:
            if server is not None:
                self.procs.stop(server)
            self.stop(handle)

    # --- CPU per GB

    def serve(self, tag: str, body: int):
        log = self.out / tag / "serve.log"
        argv = [
            str(self.inband), "serve", "--listen", f"0.0.0.0:{HTTP_PORT}", "--workers", "16", "--service-ms", "0",
            "--service-dist", "constant", "--body-bytes", str(body), "--keep-alive",
        ]  # fmt: skip
        proc = self.procs.spawn("serve", self.ns("s1"), argv, log)
        wait_until(
            "the server", lambda: alive(proc, "serve", log) and f":{HTTP_PORT}" in run(self.ns("s1"), ["ss", "-Hltn"]).stdout, 20
        )
        return proc

    def wrk(self, url: str, seconds: int, connections: int, tag: str, delay_ms: int = 0, background: bool = False):
        lua = self.out / "run" / "wrk.lua"
        lua.write_text(WRK_LUA)
        argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "5s", "-s", str(lua), url]
        env = dict(os.environ, INBAND_WRK_DELAY_MS=str(delay_ms))
        if background:
            return self.procs.spawn("wrk", self.ns("c1"), argv, self.out / tag / "wrk.log", env=env)
        cp = subprocess_run_env(self.ns("c1"), argv, env, timeout=seconds + 30)
        return parse_wrk(cp)

    def http_cost(self, size: str, path: str) -> Http:
        tag = f"http-{path}-{SIZES[size]}"
        kind = {"dsr": "inband", "passthrough": "inband"}.get(path, path)
        handle = self.start(kind, HTTP_PORT, tag, mode="dsr-rr" if path == "dsr" else "passthrough")
        server = self.serve(tag, SIZES[size])
        stats = None
        try:
            url = f"http://{self.tb.addr('s1')}:{HTTP_PORT}/" if path == "direct" else f"http://{self.tb.vip}:{VIP_PORT}/"
            # Program run times cost two clock reads per program run (a
            # third of a forwarded packet's cost in this VM), so they are
            # counted only here, for every path alike, never while a
            # forwarding rate is measured.
            stats = enable_bpf_stats()
            prog0 = xdp_prog_stats(self.ns("lb"), "eth0") if kind == "inband" else (0, 0)
            hp = handle[1].pid if kind == "haproxy" else None
            h0 = proc_cpu_s(hp) if hp else 0.0
            cpu0, t0 = cpu_busy_s(), time.monotonic()
            w = self.wrk(url, self.p.http_seconds, 4, tag)
            cpu1, t1 = cpu_busy_s(), time.monotonic()
            h1 = proc_cpu_s(hp) if hp else 0.0
            prog1 = xdp_prog_stats(self.ns("lb"), "eth0") if kind == "inband" else (0, 0)
        finally:
            if stats is not None:
                os.close(stats)
            self.procs.stop(server)
            self.stop(handle)
        return Http(
            size, path, HTTP_LABELS[path], w["requests"], w["bytes"], w["errors"], t1 - t0, cpu1 - cpu0,
            prog_ns=prog1[0] - prog0[0], prog_runs=prog1[1] - prog0[1], proc_cpu_s=h1 - h0,
        )  # fmt: skip

    # --- freshness

    def set_score(self, conn: socket.socket, score: int) -> int:
        """Sets s1's score on an open connection to the agent's socket (as
        an application that reports its load would: a new connection waits
        for the agent's accept loop, up to 20 ms); returns the
        CLOCK_MONOTONIC ns just before the command left."""
        t = time.monotonic_ns()
        conn.sendall(f"set {HTTP_PORT} {score}\n".encode())
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                raise RuntimeError("the agent closed the score socket")
            reply += chunk
        if not reply.startswith(b"ok"):
            raise RuntimeError(f"agent refused the score: {reply.decode().strip()}")
        return t

    def freshness(self, mechanism: str, interval: int, interval_max: int | None = None, budget: int = 0) -> Fresh:
        """`interval`: n (in-band) or ms (polling); `interval_max` and
        `budget`: the adaptive n's upper bound and its 124s per second."""
        in_band = mechanism == "in-band"
        tag = f"fresh-{mechanism}-{interval}" + (f"-{interval_max}-{budget}" if interval_max else "")
        mode = "dsr-dynamic" if in_band else "dsr-polling"
        handle = self.start(
            "inband", HTTP_PORT, tag, mode=mode, probe=interval if in_band else 100, poll_ms=interval, probe_max=interval_max, budget=budget
        )
        server = self.serve(tag, 1024)
        label = f"n = {interval}" if in_band else f"{interval} ms"
        if interval_max:
            label = f"n = {interval}..{interval_max} adaptive" + (f", ≤ {budget}/s" if budget else "")
        res = Fresh(mechanism, label)
        wrk = scores = conn = None
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(5)
            conn.connect(str(self.sock_dir / "agent-s1.sock"))
            backend_id = self.lb_status()[0]["vips"][0]["backends"][0]["id"]
            scores = PinnedMap(Path("/sys/fs/bpf/inband/netns") / self.ns("lb") / "lb" / "eth0" / "scores")
            # The longest a change can take is about a poll interval, or n
            # packets at the load's rate; the bound is generous for both.
            limit_s = 2.0 + (interval_max or interval) / 1000 * 3
            budget_s = self.p.trials * (limit_s + 0.1) + 5
            # Steady request load: 4 keep-alive connections, 1 ms pause
            # between a response and the next request on each.
            wrk = self.wrk(f"http://{self.tb.vip}:{VIP_PORT}/", int(budget_s) + 1, 4, tag, delay_ms=1, background=True)
            time.sleep(0.5)
            served0, pkts0, asked0, t_load0 = server_served(self), self.backend_packets(), self.score_requests(), time.monotonic()
            for trial in range(self.p.trials):
                # Every trial is a change, and a large one (1000 <-> 2000): the
                # adaptive n takes a move of an eighth or less for noise.
                score = 1000 * (1 + trial % 2) + trial
                # 20-100 ms in all, off any poll phase.
                for _ in range(AGE_SAMPLES):
                    time.sleep(random.uniform(0.02, 0.1) / AGE_SAMPLES)
                    now = time.monotonic_ns()
                    updated = ScoreEntry(*SCORE_VALUE.unpack(scores.lookup(struct.pack("I", backend_id), SCORE_VALUE.size))).updated_ns
                    if updated:
                        res.ages_ms.append(max(0, now - updated) / 1e6)
                t0 = self.set_score(conn, score)
                deadline = time.monotonic() + limit_s
                seen = None
                while time.monotonic() < deadline:
                    entry = ScoreEntry(*SCORE_VALUE.unpack(scores.lookup(struct.pack("I", backend_id), SCORE_VALUE.size)))
                    if entry.score == score:
                        seen = entry.updated_ns
                        break
                    time.sleep(0.0005)
                if seen is None:
                    res.timeouts += 1
                else:
                    res.delays_ms.append(max(0, seen - t0) / 1e6)
            elapsed = time.monotonic() - t_load0
            res.load_rps = (server_served(self) - served0) / elapsed
            res.backend_pps = (self.backend_packets() - pkts0) / elapsed
            res.requests_per_s = (self.score_requests() - asked0) / elapsed
            if in_band:
                res.last_n = ScoreEntry(*SCORE_VALUE.unpack(scores.lookup(struct.pack("I", backend_id), SCORE_VALUE.size))).interval
        finally:
            if conn is not None:
                conn.close()
            if scores is not None:
                scores.close()
            if wrk is not None:
                self.procs.stop(wrk)
            self.procs.stop(server)
            self.stop(handle)
            run(self.ns("s1"), [str(self.inband), "agent", "score", "clear", "--port", str(HTTP_PORT), "--socket", str(self.sock_dir / "agent-s1.sock")], check=False)
        return res


def server_served(bench: Bench) -> int:
    code = f"import urllib.request;print(urllib.request.urlopen('http://{bench.tb.addr('s1')}:{HTTP_PORT}/stats',timeout=3).read().decode())"
    return int(json.loads(run(bench.ns("c1"), [sys.executable, "-c", code]).stdout)["served"])


def subprocess_run_env(netns: str, argv: list[str], env: dict, timeout: float) -> str:
    cp = subprocess.run(ns_argv(netns, argv), capture_output=True, text=True, timeout=timeout, env=env)
    if cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed with {cp.returncode}: {cp.stderr.strip()}")
    return cp.stdout


# ------------------------------------------------------------------ output


def plot(fwd: list[Fwd], http: list[Http], fresh: list[Fresh], path: Path) -> None:
    """One panel per part that has results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p, rows in (("fwd", fwd), ("http", http), ("fresh", fresh)) if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.8), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    if "fwd" in ax:
        a = ax["fwd"]
        groups = (("hairpin", "64 B frames, hairpin (Mpps)"), ("switch", "64 B frames, via the switch (Mpps)"), ("stream", "64 B writes, TCP (M/s)"))
        # inband's pass-through (streams) shares inband's place.
        place = {"inband-pt": "inband"}
        names = list(dict.fromkeys(place.get(r.path, r.path) for r in fwd))
        for i, (load, label) in enumerate(groups):
            rows = [r for r in fwd if r.load == load]
            if rows:
                xs = [names.index(place.get(r.path, r.path)) + (i - 1) * 0.27 for r in rows]
                a.bar(xs, [r.rate / 1e6 for r in rows], width=0.27, label=label)
        a.set_xticks(range(len(names)), names, rotation=20)
        a.set_ylabel("million per second (2 shared cores)")
        a.set_title("Forwarding rate, small TCP packets")
        a.legend(fontsize=8)
    if "http" in ax:
        a = ax["http"]
        for p in HTTP_LABELS:
            rows = [r for r in http if r.path == p and http_own_cpu(r)]
            if rows:
                a.plot([r.size for r in rows], [http_own_cpu(r) for r in rows], marker="o", label=HTTP_LABELS[p])
        a.set_yscale("log")
        a.set_ylabel("balancer's own CPU s per GB of response")
        a.set_title("CPU per GB of response")
        a.legend(fontsize=8)
    if "fresh" in ax:
        a = ax["fresh"]
        xs = range(len(fresh))
        a.bar(xs, [statistics.median(r.delays_ms) if r.delays_ms else 0 for r in fresh], label="median")
        a.scatter(xs, [percentile(r.delays_ms, 0.9) if r.delays_ms else 0 for r in fresh], color="black", zorder=3, label="p90")
        a.set_xticks(xs, [f"{r.mechanism}\n{r.interval}" for r in fresh], fontsize=8)
        a.set_yscale("log")
        a.set_ylabel("ms from score change to balancer map")
        a.set_title("Feedback freshness")
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TOOLS = {"haproxy": ["haproxy", "-v"], "nftables": ["nft", "--version"], "wrk": ["wrk", "-v"]}


PARTS = ("forwarding", "cost", "freshness")
PART_TITLES = {"forwarding": "Forwarding rates", "cost": "CPU per GB of response", "freshness": "Feedback freshness"}


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    m, rows = record["machine"], record["rows"]
    preamble = (
        "# Data-plane speed and efficiency\n\n"
        f"{provenance(record)}  \n"
        f"The CPUs are **shared by everything**: generator, bridge, balancer, server (other work seen running during the measurements: "
        f"{', '.join(record['others']) or 'none seen'}). "
        "Rates are what the whole testbed sustains; compare ratios measured in this run. "
        "inband's in-band options are authenticated (SipHash, a key made for the run).  \n"
        f"{m.get('haproxy', '')}; {m.get('nftables', '')}; {m.get('wrk', '')}\n"
    )
    for part, made in record.get("kept", {}).items():
        preamble += (f"\n**{PART_TITLES[part]}**: not measured by this run; kept from `{made['command']}`, "
                     f"commit {made['commit']['sha'][:12]}, {made['started_utc']}.\n")
    if record["failed"]:
        preamble += "\n**Failed:** " + "; ".join(record["failed"]) + "\n"
    return markdown([revive(Fwd, r) for r in rows["forwarding"]], [revive(Http, r) for r in rows["cost"]], [revive(Fresh, r) for r in rows["freshness"]], preamble)


def markdown(fwd, http, fresh, preamble: str) -> str:
    parts = [preamble]
    if any(r.load == "hairpin" for r in fwd):
        parts += ["## Forwarding rate: 64-byte TCP frames, one-armed hairpin (the forwarder is the work)\n", fwd_table(fwd, "hairpin")]
    if any(r.load == "switch" for r in fwd):
        parts += ["## Forwarding rate: 64-byte TCP frames, client → switch → balancer → switch → server\n", fwd_table(fwd, "switch")]
    if any(r.load == "stream" for r in fwd):
        parts += ["## Forwarding rate: 64-byte writes on TCP connections (TCP_NODELAY)\n", fwd_table(fwd, "stream")]
    if http:
        parts += ["## CPU per GB of response (wrk, keep-alive)\n", http_table(http)]
    if fresh:
        parts += ["## Feedback freshness (score change → balancer map)\n", fresh_table(fresh)]
    return "\n".join(parts)


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.forwarding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the run's raw data: logs, figure (created)")
    ap.add_argument("--results", default=str(default_dir("forwarding")), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="comma-separated subset of forwarding, cost, freshness; the others' rows are kept from the record in --results")
    ap.add_argument("--name", default="fwd", help="testbed name (namespaces NAME-lb, NAME-c1, NAME-s1, NAME-sw)")
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    ap.add_argument("--perf", action="store_true", help="profile the hairpin runs with perf (cpu-clock), perf-*.txt in --out")
    args = ap.parse_args(argv)
    bad = set(args.parts.split(",")) - set(PARTS)
    if bad:
        ap.error(f"unknown part(s): {', '.join(sorted(bad))}")
    return args


def problems(args) -> list[str]:
    tools = ("haproxy", "nft", "wrk", "bpftool") + (("perf",) if args.perf else ())
    return preflight.problems(inband=args.inband, tools=tools, testbed_name=args.name, bpf_stats=True)


def carried_over(results: Path, parts: list[str], rows: dict) -> dict:
    """A run of some parts keeps the rows of the others from the record in
    `results` (each with what made it), so that rerunning one part leaves
    the others' tables as they were. Returns {part: its provenance}."""
    previous = results / "results.json"
    if set(parts) == set(PARTS) or not previous.exists():
        return {}
    old = json.loads(previous.read_text())
    kept = {}
    for part in PARTS:
        if part not in parts and old["rows"].get(part):
            rows[part] = old["rows"][part]
            kept[part] = old.get("kept", {}).get(part) or {k: old[k] for k in ("command", "commit", "started_utc")}
    return kept


def main(argv=None) -> int:
    args = parse_args(argv)
    refused = preflight.refuse(problems(args))
    if refused:
        return refused
    profile = PROFILES[args.profile]
    parts = args.parts.split(",")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    this_run = Run("forwarding", "bench.forwarding", argv)
    bench = Bench(args, profile, out)
    stop_signals_interrupt()
    fwd: list[Fwd] = []
    http: list[Http] = []
    fresh: list[Fresh] = []
    outcome = Outcome(bench.log)

    with outcome.torn_down_after(bench.teardown):
        bench.setup()
        if "forwarding" in parts:
            bench.setup_hairpin()
            for path in HAIRPIN_LABELS:
                bench.log(f"forwarding, raw frames on the hairpin: {path}")
                outcome.attempt(f"hairpin {path}", lambda path=path: bench.forward_hairpin(path), fwd)
            for path in ("direct", "inband", "nftables"):
                bench.log(f"forwarding, raw frames via the switch: {path}")
                outcome.attempt(f"switch {path}", lambda path=path: bench.forward_switch(path), fwd)
            for path in ("direct", "inband-pt", "nftables", "haproxy"):
                bench.log(f"forwarding, TCP stream: {path}")
                outcome.attempt(f"stream {path}", lambda path=path: bench.forward_stream(path), fwd)
        if "cost" in parts:
            for size in SIZES:
                for path in HTTP_LABELS:
                    bench.log(f"CPU per GB, {size}: {path}")
                    outcome.attempt(f"http {size} {path}", lambda size=size, path=path: bench.http_cost(size, path), http)
        if "freshness" in parts:
            for n in profile.probe_intervals:
                bench.log(f"freshness: in-band, n = {n}")
                outcome.attempt(f"freshness n={n}", lambda n=n: bench.freshness("in-band", n), fresh)
            for lo, hi, budget in profile.adaptive:
                bench.log(f"freshness: in-band, adaptive n = {lo}..{hi}, budget {budget or 'none'}")
                outcome.attempt(
                    f"freshness n={lo}..{hi} budget {budget}", lambda lo=lo, hi=hi, budget=budget: bench.freshness("in-band", lo, hi, budget), fresh
                )
            for ms in profile.poll_intervals_ms:
                bench.log(f"freshness: polling every {ms} ms")
                outcome.attempt(f"freshness poll {ms} ms", lambda ms=ms: bench.freshness("polling", ms), fresh)

    rows = {"forwarding": [asdict(r) for r in fwd], "cost": [asdict(r) for r in http], "freshness": [asdict(r) for r in fresh]}
    kept = carried_over(Path(args.results), parts, rows)
    record = this_run.record(rows, profile=profiles.as_json(args.profile, profile), inband=Path(args.inband), tools=TOOLS,
                        others=sorted(bench.others), failed=outcome.failed, kept=kept)
    write_results(Path(args.results), record, render(record))
    if fwd or http or fresh:
        plot(fwd, http, fresh, out / "forwarding.png")
    return outcome.exit_code()


if __name__ == "__main__":
    sys.exit(main())

"""What a balancer costs while nothing happens: the balancer process's CPU
over an idle window on the testbed, with its backend up and with the
backend's host gone (an address on the servers' subnet that answers no
ARP, as a powered-off host), `inband lb` (dsr-rr) beside HAProxy (mode
tcp), both checking the backend with the same health checks
(peers.HealthChecks, inband's defaults). No client sends anything.

    python -m bench.idle [--profile default|tiny] [--seconds S] [--out DIR] [--results bench/results/idle]

Prints the table and writes the record (results.json: commit, machine,
load average, command, rows) and its table (results.md) into --results
(default bench/results/idle); configs and logs into --out. Everything it
starts is removed at the end, Ctrl-C included. See docs/benchmarks.md,
"An idle balancer".
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from .lib import peers, preflight, results
from .lib.outcome import Outcome
from .lib.peers import Backend, HealthChecks
from .lib.procs import run, stop_signals_interrupt, wait_until
from .lib.report import cell, table, times
from .lib.testbed import TestbedRun, alive, new_auth_key

SERVICE_PORT = 8080
# The gone host's last octet: no node of the testbed has it.
GONE_OCTET = 250
# After the balancer is ready: its start-up work (loading, the first
# passes) is not idle.
SETTLE_S = 2.0
CHECKS = HealthChecks()
SYSTEMS = {"inband": "inband lb, dsr-rr", "haproxy": "HAProxy, mode tcp"}
CASES = {"up": "backend up", "gone": "backend's host gone (no ARP answer)"}
# The idle window per row, by profile (the test's is `tiny`).
PROFILES = {"default": 10.0, "tiny": 1.0}


def cpu_s(pid: int) -> float:
    """The time every thread of `pid` has run, in seconds, from the
    scheduler's nanosecond count (/proc/PID/task/*/schedstat): utime and
    stime come in 10 ms ticks, coarser than an idle HAProxy's second."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between the listing and the read
    return total / 1e9


class Bench(TestbedRun):
    def __init__(self, args, work: Path) -> None:
        super().__init__(args.inband, args.name)
        self.args, self.work = args, work

    def setup(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.auth_key = new_auth_key(self.inband, self.work)
        self.bring_up(1)
        argv = [str(self.inband), "serve", "--listen", f"0.0.0.0:{SERVICE_PORT}", "--workers", "4",
                "--service-ms", "0", "--service-dist", "constant", "--body-bytes", "100"]  # fmt: skip
        self.procs.spawn("serve s1", self.ns("s1"), argv, self.work / "serve-s1.log")
        wait_until("the server on s1 to listen", lambda: bool(run(self.ns("s1"), ["ss", "-Htln", "sport", f"= :{SERVICE_PORT}"]).stdout.strip()), 10)

    def before_down(self) -> None:
        self.detach_lb()

    def backend(self, case: str) -> Backend:
        s1 = self.tb.addr("s1")
        return Backend(s1 if case == "up" else f"{s1.rsplit('.', 1)[0]}.{GONE_OCTET}", SERVICE_PORT)

    def start(self, system: str, case: str, d: Path):
        b = self.backend(case)
        if system == "inband":
            # A gone host never resolves: ready once the balancer lists it.
            ready = None if case == "up" else (lambda bs: bool(bs))
            return self.start_lb(d, [b], ready=ready, resolve=case == "up", mode="dsr-rr", policy="least-score", health=CHECKS)
        cfg = d / "haproxy.cfg"
        cfg.write_text(peers.haproxy_cfg(vip=self.tb.vip, vip_port=self.VIP_PORT, backends=[b], balance="roundrobin", timeout_s=30, checks=CHECKS))
        log = d / "haproxy.log"
        lb = self.ns("lb")
        proc = self.procs.spawn("haproxy", lb, ["haproxy", "-f", str(cfg), "-db"], log)
        wait_until("haproxy to listen", lambda: alive(proc, "haproxy", log) and f"{self.tb.vip}:{self.VIP_PORT}" in run(lb, ["ss", "-Hltn"]).stdout, 20)
        return proc

    def measure(self, system: str, case: str) -> dict:
        d = self.work / f"{system}-{case}"
        d.mkdir(parents=True, exist_ok=True)
        self.log(f"{SYSTEMS[system]}, {CASES[case]}: {self.args.seconds:g} s idle")
        proc = self.start(system, case, d)
        try:
            time.sleep(SETTLE_S)
            c0, t0 = cpu_s(proc.pid), time.monotonic()
            time.sleep(self.args.seconds)
            c1, t1 = cpu_s(proc.pid), time.monotonic()
        finally:
            self.procs.stop(proc)
            if system == "inband":
                self.detach_lb()
        return {"system": system, "case": case, "seconds": t1 - t0, "cpu_s": c1 - c0}


def markdown(record: dict) -> str:
    rows = record["rows"]
    by = {(r["system"], r["case"]): r["cpu_s"] / r["seconds"] * 1000 for r in rows}
    out = []
    for case, label in CASES.items():
        for system, name in SYSTEMS.items():
            ms = by.get((system, case))
            if ms is None:
                continue
            out.append([label, name, cell(ms, fmt=".1f"), times(ms, by.get(("haproxy", case))) if system != "haproxy" else "–"])
    return "\n".join([
        f"{results.provenance(record)}",
        "",
        f"Each balancer alone on the testbed, {record['profile']['seconds']:g} s after {SETTLE_S:g} s to settle; health checks every "
        f"{CHECKS.interval_ms} ms ({CHECKS.fast_interval_ms} ms while a backend changes state), connect timeout {CHECKS.timeout_ms} ms.",
        "",
        table(["backend", "balancer", "CPU ms per second", "÷ HAProxy"], out),
    ]) + "\n"  # fmt: skip


def render(record: dict) -> str:
    return markdown(record)


TOOLS = {"haproxy": ["haproxy", "-v"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default", help="the idle window per row: 10 s, or 1 s (tiny)")
    ap.add_argument("--seconds", type=float, help="the idle window per row, over the profile's")
    ap.add_argument("--results", type=Path, default=results.default_dir("idle"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--out", type=Path, help="configs and logs (default /tmp/inband-idle-NAME)")
    ap.add_argument("--name", default="idl", help="the testbed's name (namespaces NAME-lb, NAME-s1, ...)")
    ap.add_argument("--inband", default=str(results.REPO / "target" / "debug" / "inband"))
    args = ap.parse_args(argv)
    args.seconds = args.seconds or PROFILES[args.profile]
    refused = preflight.refuse(preflight.problems(inband=args.inband, tools=("haproxy", "ss"), testbed_name=args.name))
    if refused:
        return refused
    work = (args.out or Path(f"/tmp/inband-idle-{args.name}")).resolve()
    bench = Bench(args, work)
    this_run = results.Run("idle", "bench.idle", argv)
    stop_signals_interrupt()
    outcome = Outcome(bench.log)
    rows: list[dict] = []
    with outcome.torn_down_after(bench.teardown):
        bench.setup()
        for case in CASES:
            for system in SYSTEMS:
                outcome.attempt(f"{system} {case}", lambda s=system, c=case: bench.measure(s, c), rows)
    record = this_run.record(rows, profile={"seconds": args.seconds}, inband=bench.inband, tools=TOOLS, checks=asdict(CHECKS), failed=outcome.failed)
    results.write(args.results, record, render(record) + outcome.markdown())
    return outcome.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())

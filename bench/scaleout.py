"""Several `inband lb` instances behind an ECMP router (issue 12), in one run:

    python -m bench.scaleout --out results/scaleout [--profile quick|tiny]

On `inband testbed up --ecmp --balancers 4` (a router spreading an IPv6
VIP over the instances by SRv6; every instance in front of the same
servers, dsr-dynamic, each with `[scale_out]`):

1. changes under load: closed-loop clients download files through the
   router, and others send short requests (HEAD, a new connection each),
   while, a third (or a quarter) of the run apart,
   - instances: b3 joins (b1,b2 -> b1,b2,b3), then b1 leaves (-> b2,b3),
     with the shadow table (inband) and without (plain ECMP), and with
     inband again while the client reuses its ports within seconds (100
     ports: a new connection meets the old one's closing flow);
   - daemons: b2's daemon is restarted (SIGTERM), then b1's killed -9
     and started again, on three instances and on a single balancer;
   - backends: s1 drained and put back, s3 removed and added again, on
     every routed instance, on three instances and on a single balancer.
   A request fails unless curl gets status 200 with the whole body.
2. throughput: short requests (1 KB files from nginx, wrk, persistent
   connections) through 1, 2 and 4 instances, and straight to one server
   (the limit: no balancer in the path), in the same run.
3. an instance's host crashes (issue 28): with b1, b2 and b3 routed and
   the same load as in part 1, b1's daemon is killed -9 and its host
   dies in one of three ways (its XDP program gone with the link up; the
   link losing carrier; the interface gone), and 1 s later the router
   routes to b2 and b3 (`inband shadow route`, `liveness = "echo"`). For
   each VIP configuration (dsr-dynamic with each instance's own tuples;
   Maglev with fleet tuples; dsr-dynamic with fleet tuples and announced
   choices), on a testbed of its own. The downloads that broke are split
   by who held them at the crash: b1's own flows and the others' (the
   goal: none); every download is timed (bench.lib.fetch), and the
   longest pause in its body says what a connection that survived the
   crash waited.

The router sends to the client through a token bucket (tc tbf) in part
1 so that downloads last seconds, as in bench.ecmp; part 2 runs without
it. Prints Markdown tables and writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/scaleout),
throughput.png into --out. Every namespace, pin and
process it makes is removed on exit, Ctrl-C included. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .lib.peers import nginx_static_conf
from .lib import preflight, profiles
from .lib.load import closed_loop
from .lib.results import REPO, Run, default_dir, provenance
from .lib.results import write as write_results
from .lib.testbed import Testbed, ipv6_usable, new_auth_key
from .lib.procs import Procs, ns_argv, run, stop_signals_interrupt, wait_until

SUBNET = 85
BALANCERS = 4
SERVERS = 3


@dataclass(frozen=True)
class Profile:
    clients: int  # closed-loop download loops in flight
    short_clients: int  # closed-loop short-request loops beside them
    rate: str  # the router's token bucket toward the client in part 1
    size_mb: int  # download size
    run_s: float  # per (experiment, mode)
    wrk_s: int  # per throughput row
    wrk_connections: int
    # A download that takes longer has failed: a connection that plain ECMP
    # moved hangs until then, and the row waits for it.
    download_max_s: float = 60
    # The reused-ports row: the client's port range. A later connection
    # meets an earlier one's closing flow only when a connection in flight
    # at a change moves to an instance that closed a connection on its
    # tuple within the closing timeout (10 s). The router hashes the IPv6
    # flow label, which each connection draws afresh, so a port's
    # connections spread over the instances: with few ports, each is
    # closed on each instance in the warm-up.
    reused_ports: int = 100
    # Part 3's forms, in order; "interface gone" leaves b1 unusable, so
    # it comes last.
    crash_forms: tuple = ("program gone, link up", "carrier lost", "interface gone")
    # Download loops of the rows where b3 joins and b1 leaves (default:
    # `clients`). Those rows show chaining only if a download is in flight
    # on b1 when it leaves (a third of the hash space) or in the half that
    # moves when b3 joins a hash-threshold group of two: with n downloads
    # spread by the router's hash, neither happens with probability about
    # (1/2 * 2/3)^n: 1% with 4 (a tiny row once saw no chained packet),
    # 2e-6 with 12.
    join_clients: int | None = None
    # Part 3's configurations of the VIP (CRASH_MODES), each on a testbed
    # of its own: "interface gone" leaves b1 unusable.
    crash_modes: tuple = ("dynamic", "maglev-fleet", "dynamic-announced")
    # Part 3's download loops: b1 holds about a third of those in flight
    # at the crash, the sample its columns are about.
    crash_clients: int = 16


@dataclass(frozen=True)
class CrashMode:
    name: str  # as the table shows it
    vip: str  # the [[vip]] lines besides address, port and backends
    fleet: bool  # [scale_out] fleet tuples (and the agents' fleet_prefixes)
    peers: bool  # each instance announces its choices to the others


CRASH_MODES = {
    "dynamic": CrashMode("dsr-dynamic, own tuples", 'mode = "dsr-dynamic"\nprobe_interval = 8\n', False, False),
    "maglev-fleet": CrashMode("dsr-rr Maglev, fleet tuples", 'mode = "dsr-rr"\npolicy = "maglev"\n', True, False),
    "dynamic-announced": CrashMode("dsr-dynamic, fleet tuples, choices announced", 'mode = "dsr-dynamic"\nprobe_interval = 8\n', True, True),
}
FLEET_PREFIX = f"fd00:f1ee:{SUBNET}::/96"


PROFILES = {
    "quick": Profile(8, 2, "160mbit", 5, 21, 10, 64),
    # The test's: seconds; every change still meets downloads in flight.
    "tiny": Profile(4, 1, "200mbit", 2, 9, 3, 16, download_max_s=10, reused_ports=30, join_clients=12, crash_forms=("carrier lost",),
                    crash_modes=("dynamic-announced",), crash_clients=4),
}


class Bed:
    def __init__(self, inband: Path, profile: Profile, workdir: Path, name: str, mode: str = "dynamic") -> None:
        self.inband, self.p, self.dir, self.name = str(inband), profile, workdir, name
        self.mode = CRASH_MODES[mode]
        self.tb = Testbed(Path(inband), name)
        self.procs = Procs()
        self.lbs: dict[int, object] = {}
        self.serves: list = []
        self.saved_ports: str | None = None  # the client's port range before a row narrowed it

    def ns(self, node: str) -> str:
        return f"{self.name}-{node}"

    @property
    def vip(self) -> str:
        return self.tb.vip6

    def addr(self, node: str) -> str:
        return self.tb.addr6(node)

    def sid(self, i: int, kind: str) -> str:
        return f"fd00:{SUBNET}:{0x50 + i:x}::{kind}"

    def up(self) -> None:
        self.tb.up(SERVERS, subnet=SUBNET, ecmp=True, balancers=BALANCERS)
        self.router_cfg = Path(self.tb.state["router_config"])
        key = new_auth_key(Path(self.inband), self.dir)
        auth = f'[auth]\nkeys = [{{ id = 1, file = "{key}" }}]\n'
        addrs = [self.addr(f"b{i}") for i in range(1, BALANCERS + 1)]
        balancers = ", ".join(f'"{a}"' for a in addrs)
        agent_fleet, lb_fleet = "", ""
        if self.mode.fleet:
            fleet_key = self.dir / "fleet.key"
            fleet_key.unlink(missing_ok=True)
            run(None, [self.inband, "keygen", "--out", str(fleet_key)])
            agent_fleet = f'fleet_prefixes = ["{FLEET_PREFIX}"]\n'
            lb_fleet = f'fleet = true\nfleet_prefix = "{FLEET_PREFIX}"\nfleet_key = "{fleet_key}"\n'
            own = self.dir / "router.toml"
            own.write_text(f'fleet_prefix = "{FLEET_PREFIX}"\n' + self.router_cfg.read_text())
            self.router_cfg = own
        for s in range(1, SERVERS + 1):
            cfg = self.dir / f"agent-s{s}.toml"
            cfg.write_text(f'interface = "eth0"\nbalancers = [{balancers}]\n{agent_fleet}score_socket = "{self.dir}/agent-s{s}.sock"\n\n{auth}\n'
                           f'[[service]]\nport = 8080\nvip = "[{self.vip}]:80"\n')
            self.procs.spawn(f"agent-s{s}", self.ns(f"s{s}"), [self.inband, "agent", "--config", str(cfg)], self.dir / f"agent-s{s}.log")
        for i in range(1, BALANCERS + 1):
            peers = ", ".join(f'"{a}"' for j, a in enumerate(addrs, 1) if j != i)
            peers = f"peers = [{peers}]\n" if self.mode.peers else ""
            text = (f'interface = "eth0"\naddress6 = "{self.addr(f"b{i}")}"\ncontrol_socket = "{self.socket(i)}"\n\n'
                    f'[scale_out]\nsid = "{self.sid(i, "b")}"\ndirect_sid = "{self.sid(i, "d")}"\nshadow_sid = "fd00:{SUBNET}:5f::5"\n'
                    f'{lb_fleet}{peers}\n{auth}\n[[vip]]\naddress = "{self.vip}"\nport = 80\n{self.mode.vip}')
            for s in range(1, SERVERS + 1):
                text += f'\n[[vip.backend]]\naddress = "{self.addr(f"s{s}")}"\nport = 8080\n'
            (self.dir / f"lb-b{i}.toml").write_text(text)
            self.start_lb(i)

    def down(self) -> None:
        self.procs.stop_all()
        for i in range(1, BALANCERS + 1):
            run(self.ns(f"b{i}"), [self.inband, "lb", "detach", "--interface", "eth0", "--force"], check=False)
        self.tb.down()

    def socket(self, i: int) -> Path:
        return self.dir / f"lb-b{i}.sock"

    def start_lb(self, i: int) -> None:
        self.lbs[i] = self.procs.spawn(f"lb-b{i}", self.ns(f"b{i}"), [self.inband, "lb", "--config", str(self.dir / f"lb-b{i}.toml")],
                                       self.dir / f"lb-b{i}.log")

        def resolved():
            st = self.status(i)
            return st and all(b["mac"] != "00:00:00:00:00:00" for b in st["vips"][0]["backends"])
        wait_until(f"b{i} to resolve its backends", resolved, 15)

    def stop_lb(self, i: int, kill: bool) -> None:
        p = self.lbs.pop(i)
        if kill:
            p.kill()
            p.wait(timeout=5)
            self.procs.stop(p)
        else:
            self.procs.stop(p)

    def status(self, i: int) -> dict | None:
        cp = run(self.ns(f"b{i}"), [self.inband, "status", "--json", "--netns", self.ns(f"b{i}")], check=False)
        return json.loads(cp.stdout)[0] if cp.returncode == 0 else None

    def counter(self, kind: str, name: str) -> int:
        return sum((self.status(i) or {}).get(kind, {}).get(name, 0) for i in range(1, BALANCERS + 1))

    def ctl(self, instances: list[int], *argv: str) -> None:
        for i in instances:
            run(None, [self.inband, "lb", "ctl", "--socket", str(self.socket(i)), *argv])

    def serve(self, body_bytes: int) -> None:
        """`inband serve` with `body_bytes` on every server."""
        self.serve_with(lambda s: [self.inband, "serve", "--listen", "[::]:8080", "--service-ms", "0", "--body-bytes", str(body_bytes)])

    def serve_static(self, body_bytes: int) -> None:
        """nginx (one worker) with a file of `body_bytes` at /1k on every
        server: the throughput rows measure the path, not a slow server."""
        def argv(s: int) -> list[str]:
            d = self.dir / f"nginx-s{s}"
            (d / "root").mkdir(parents=True, exist_ok=True)
            (d / "root" / "1k").write_bytes(b"x" * body_bytes)
            cfg = d / "nginx.conf"
            cfg.write_text(nginx_static_conf(listen="[::]:8080", root=str(d / "root"), prefix=str(d), workers=1, as_root=True))
            return ["nginx", "-c", str(cfg), "-p", str(d), "-e", str(d / "error.log"), "-g", "daemon off;"]
        self.serve_with(argv)

    def serve_with(self, argv) -> None:
        for p in self.serves:
            self.procs.stop(p)
        wait_until("the old servers to go", lambda: not any(run(self.ns(f"s{s}"), ["ss", "-Htln", "sport", "= :8080"]).stdout
                                                             for s in range(1, SERVERS + 1)), 15)
        self.serves = [self.procs.spawn(f"serve-s{s}", self.ns(f"s{s}"), argv(s), self.dir / f"serve-s{s}.log")
                       for s in range(1, SERVERS + 1)]
        wait_until("the servers", lambda: all(run(self.ns(f"s{s}"), ["ss", "-Htln", "sport", "= :8080"]).stdout
                                                 for s in range(1, SERVERS + 1)), 15)

    def route(self, up: list[int], plain: bool = False) -> None:
        argv = [self.inband, "shadow", "route", "--config", str(self.router_cfg), "--up", ",".join(f"b{i}" for i in up)]
        run(self.ns("r1"), argv + (["--plain"] if plain else []))

    def client_ports(self, ports: str | None) -> None:
        """The client's ephemeral port range ("low high"); None puts back
        the one it had."""
        key = "net.ipv4.ip_local_port_range"
        if ports and self.saved_ports is None:
            self.saved_ports = " ".join(run(self.ns("c1"), ["sysctl", "-n", key]).stdout.split())
        run(self.ns("c1"), ["sysctl", "-qw", f"{key}={ports or self.saved_ports}"])
        if not ports:
            self.saved_ports = None

    def shaped(self, on: bool) -> None:
        run(self.ns("r1"), ["tc", "qdisc", "del", "dev", "c1", "root"], check=False)
        if on:
            run(self.ns("r1"), ["tc", "qdisc", "add", "dev", "c1", "root", "tbf", "rate", self.p.rate, "burst", "64kb", "latency", "400ms"])


def at_fractions(done: list, *steps):
    """A `changes(t0, t1)` for closed_loop: step k runs at (k+1)/(n+1) of
    the run; `done` gets each step's start and end (seconds from t0), to
    set failures against."""
    def changes(t0, t1):
        n = len(steps)
        for k, step in enumerate(steps):
            time.sleep(max(0.0, t0 + (t1 - t0) * (k + 1) / (n + 1) - time.monotonic()))
            start = time.monotonic()
            step()
            done.append([round(start - t0, 3), round(time.monotonic() - t0, 3)])
        time.sleep(max(0.0, t1 - time.monotonic()))
    return changes


class ShortRequests:
    """`bed.p.short_clients` loops of HEAD requests, each on a new
    connection (a handshake, a request, a close: the whole life of a
    connection within a change's reach), for as long as the block runs."""

    def __init__(self, bed: Bed) -> None:
        self.bed, self.ok, self.failed = bed, 0, 0
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(bed.p.short_clients)]

    def loop(self) -> None:
        argv = ns_argv(self.bed.ns("c1"), ["curl", "-sI", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
                                           f"http://[{self.bed.vip}]/"])
        while not self.stop.is_set():
            cp = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            with self.lock:
                if cp.returncode == 0 and cp.stdout == "200":
                    self.ok += 1
                else:
                    self.failed += 1

    def __enter__(self) -> "ShortRequests":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def reused_row(p: Profile) -> str:
    return f"b3 joins, then b1 leaves; the client reuses {p.reused_ports} ports"


def changes_under_load(bed: Bed) -> list[dict]:
    backend = lambda s: f"[{bed.addr(f's{s}')}]:8080"  # noqa: E731
    vip = f"[{bed.vip}]:80"
    rows = []

    def measure(experiment: str, mode: str, routed: list[int], plain: bool, *steps, ports: str | None = None,
                warm_on: list[int] | None = None, clients: int | None = None) -> None:
        """With `ports`, the client's port range for the row; `warm_on`, a
        set the same load runs on first (a third of a row, not counted);
        `clients`, download loops other than the profile's."""
        clients = clients or bed.p.clients
        if ports:
            bed.client_ports(ports)
        try:
            if warm_on:
                bed.route(warm_on, plain)
                with ShortRequests(bed):
                    closed_loop(bed.ns("c1"), bed.vip, clients, bed.p.size_mb, bed.p.run_s / 3, at_fractions([]),
                                bed.p.download_max_s)
            bed.route(routed, plain)
            chained, no_flow = bed.counter("events", "chained"), bed.counter("drops", "chained_no_flow")
            later = bed.counter("events", "later_connection")
            steps_s: list = []
            with ShortRequests(bed) as short:
                loads = closed_loop(bed.ns("c1"), bed.vip, clients, bed.p.size_mb, bed.p.run_s, at_fractions(steps_s, *steps),
                                    bed.p.download_max_s)
        finally:
            if ports:
                bed.client_ports(None)
        rows.append({"experiment": experiment, "mode": mode, "ok": loads.ok, "failed": loads.failed, "failed_pct": loads.failed_pct,
                     "steps_s": steps_s, "failures": loads.failures,
                     "short_ok": short.ok, "short_failed": short.failed,
                     "chained_packets": bed.counter("events", "chained") - chained,
                     "chained_no_flow": bed.counter("drops", "chained_no_flow") - no_flow,
                     "later_connection": bed.counter("events", "later_connection") - later})
        # A download plain ECMP broke ends at curl's timeout, but the
        # server's socket goes on retransmitting to the client for minutes,
        # and each retransmission draws a reset from the client. Those
        # resets fall into the next row, where the shadow table chains them
        # to an instance that never had the connection (chained_no_flow).
        # Each row counts its own connections only: what is left of this
        # row's is closed at both ends before the next (time-wait sockets
        # send nothing and stay).
        live = ["state", "connected", "exclude", "time-wait"]
        closed = [run(bed.ns("c1"), ["ss", "-HK", *live, "dst", f"[{bed.vip}]"])]
        closed += [run(bed.ns(f"s{s}"), ["ss", "-HK", *live, "sport", "= :8080"]) for s in range(1, SERVERS + 1)]
        rows[-1]["left_sockets_closed"] = sum(len(cp.stdout.splitlines()) for cp in closed)
        print(rows[-1], flush=True)

    for plain, mode in ((True, "plain ECMP"), (False, "inband (shadow + chaining)")):
        measure("b3 joins, then b1 leaves", mode, [1, 2], plain, lambda: bed.route([1, 2, 3], plain), lambda: bed.route([2, 3], plain),
                clients=bed.p.join_clients)
    # The client reuses its ports within seconds (a busy client, or many
    # behind one NAT): a connection whose packets move to another instance
    # there meets the closing flow of an earlier one on its tuple. The
    # warm-up leaves such flows on b2 and b3, as a row before would.
    measure(reused_row(bed.p), "inband (shadow + chaining)", [1, 2], False, lambda: bed.route([1, 2, 3]), lambda: bed.route([2, 3]),
            ports=f"40000 {40000 + bed.p.reused_ports - 1}", warm_on=[2, 3], clients=bed.p.join_clients)
    for routed, mode in (([1, 2, 3], "3 instances"), ([1], "single balancer")):
        first, second = routed[-1], routed[0]
        measure("daemon restarted, then one killed -9", mode, routed,
                False, lambda: (bed.stop_lb(first, False), bed.start_lb(first)), lambda: (bed.stop_lb(second, True), bed.start_lb(second)))
        measure("backend drained and back, one removed and re-added", mode, routed, False,
                lambda: bed.ctl(routed, "drain-backend", "--vip", vip, "--backend", backend(1)),
                lambda: bed.ctl(routed, "undrain-backend", "--vip", vip, "--backend", backend(1)),
                lambda: bed.ctl(routed, "remove-backend", "--vip", vip, "--backend", backend(3)),
                lambda: bed.ctl(routed, "add-backend", "--vip", vip, "--backend", backend(3)))
    return rows


def held_ports(bed: Bed, i: int) -> dict[str, set[int]]:
    """The client ports of the flows instance `i` holds, by table:
    established (`flows`) and in their handshake (`half_open`). Both
    pinned tables' keys start with the client's and the VIP's addresses
    (16 bytes each), then the client's port (network order)."""
    ports = {}
    for table in ("flows", "half_open"):
        pin = f"/sys/fs/bpf/inband/netns/{bed.ns(f'b{i}')}/lb/eth0/{table}"
        cp = run(None, ["bpftool", "-j", "map", "dump", "pinned", pin])
        ports[table] = {int(e["key"][32], 16) << 8 | int(e["key"][33], 16) for e in json.loads(cp.stdout)}
    return ports


def pauses(timed: list, crash_s: float, held: set[int]) -> dict:
    """The longest pause (ms) of the downloads that completed: those in
    flight at the crash (their body's first byte before it, the last
    after), b1's and the others', and those that were not (what the path
    gives without a crash). A port b1's tables hold from an earlier
    connection makes no download b1's unless that one was in flight."""
    done = [t for t in timed if t["ok"]]
    spans = [t for t in done if t["first_byte_s"] is not None and t["first_byte_s"] < crash_s < t["last_byte_s"]]
    mine = sorted(t["gap_ms"] for t in spans if t["local_port"].isdigit() and int(t["local_port"]) in held)
    others = sorted(t["gap_ms"] for t in spans if not (t["local_port"].isdigit() and int(t["local_port"]) in held))
    calm = sorted(t["gap_ms"] for t in done if t not in spans)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
    return {"b1_kept": len(mine), "b1_median_ms": pct(mine, 0.5), "b1_max_ms": mine[-1] if mine else None,
            "others_in_flight": len(others), "others_max_ms": others[-1] if others else None,
            "calm": len(calm), "calm_p99_ms": pct(calm, 0.99)}


def crash(bed: Bed, form: str) -> None:
    """b1's host dies as `form` says: nothing of it cleans up. Its daemon
    and its data path go in one shell command, a few milliseconds apart:
    a connection that b1's program opened after its daemon died could not
    be announced, which a real host's death does not allow."""
    p = bed.lbs[1]
    gone = {"program gone, link up": "ip link set dev eth0 xdp off", "carrier lost": "ip link set eth0 down",
            "interface gone": f"ip -n {bed.ns('r1')} link del b1"}
    if form not in gone:
        raise ValueError(f"unknown crash form {form!r}")
    run(bed.ns("b1"), ["sh", "-c", f"kill -KILL {p.pid}; {gone[form]}"])
    bed.stop_lb(1, kill=True)


def revive(bed: Bed, form: str) -> None:
    """b1's host back (its link up again takes IPv6 addresses and routes
    back by hand, as a reboot would), its daemon started, b1 routed."""
    if form == "carrier lost":
        addr = bed.addr("b1")
        run(bed.ns("b1"), ["ip", "link", "set", "eth0", "up"])
        run(bed.ns("b1"), ["ip", "-6", "addr", "replace", f"{addr}/64", "dev", "eth0", "nodad"])
        ipv6_usable(bed.ns("b1"), addr)
        run(bed.ns("b1"), ["ip", "-6", "route", "replace", "default", "via", addr.rsplit(":", 1)[0] + ":1"])
    bed.start_lb(1)
    bed.route([1, 2, 3])


def crashes(bed: Bed) -> list[dict]:
    """Part 3 for the bed's mode: one row per crash form of b1, with b1,
    b2 and b3 routed."""
    echo = bed.dir / "router-echo.toml"
    echo.write_text('liveness = "echo"\n' + bed.router_cfg.read_text())
    rows = []
    for form in bed.p.crash_forms:
        bed.route([1, 2, 3])
        held: dict[str, set[int]] = {}

        def step(form=form, held=held):
            crash(bed, form)
            # Read after the crash: its pinned tables outlive the program,
            # frozen as b1 left them, so a connection b1 took while the
            # tables were being read is still counted as b1's.
            held.update(held_ports(bed, 1))
            time.sleep(1)
            run(bed.ns("r1"), [bed.inband, "shadow", "route", "--config", str(echo), "--up", "b2,b3"])
        no_flow = bed.counter("drops", "chained_no_flow")
        adopted = bed.counter("events", "adopted_maglev") + bed.counter("events", "adopted_announced")
        steps_s: list = []
        with ShortRequests(bed) as short:
            loads = closed_loop(bed.ns("c1"), bed.vip, bed.p.crash_clients, bed.p.size_mb, bed.p.run_s, at_fractions(steps_s, step),
                                bed.p.download_max_s, timed=True)
        b1 = held["flows"] | held["half_open"]
        own = [f for f in loads.failures if f["local_port"].isdigit() and int(f["local_port"]) in b1]
        # Still opening: no byte of the response had come at the crash (the
        # handshake, or the request on its way): what the issue allows a
        # policy other than Maglev to lose.
        first = {(t["local_port"], t["start_s"]): t["first_byte_s"] for t in loads.timed}
        opening = [f for f in own if (first.get((f["local_port"], f["start_s"])) or float("inf")) > steps_s[0][0]]
        rows.append({"mode": bed.mode.name, "form": form, "held": len(b1), "held_half_open": len(held["half_open"]),
                     "ok": loads.ok, "failed": loads.failed, "failed_held": len(own), "failed_held_opening": len(opening),
                     "failed_others": loads.failed - len(own), "steps_s": steps_s, "failures": loads.failures,
                     "short_ok": short.ok, "short_failed": short.failed,
                     "adopted": bed.counter("events", "adopted_maglev") + bed.counter("events", "adopted_announced") - adopted,
                     "chained_no_flow": bed.counter("drops", "chained_no_flow") - no_flow,
                     "pauses": pauses(loads.timed, steps_s[0][0], b1), "timed": loads.timed})
        print({k: v for k, v in rows[-1].items() if k != "timed"}, flush=True)
        if form != "interface gone":
            revive(bed, form)
    return rows


def wrk(bed: Bed, url: str) -> float:
    cp = run(bed.ns("c1"), ["wrk", "-t2", f"-c{bed.p.wrk_connections}", f"-d{bed.p.wrk_s}s", url], timeout=bed.p.wrk_s + 60)
    m = re.search(r"Requests/sec:\s+([\d.]+)", cp.stdout)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: .*", cp.stdout)
    if not m:
        raise RuntimeError(f"wrk printed no rate: {cp.stdout}")
    if errors:
        print(f"wrk against {url}: {errors.group(0)}", flush=True)
    return float(m.group(1))


def throughput(bed: Bed) -> list[dict]:
    rows = [{"path": "straight to one server (no balancer)", "instances": 0, "rps": wrk(bed, f"http://[{bed.addr('s1')}]:8080/1k")}]
    for k in (1, 2, 4):
        bed.route(list(range(1, k + 1)))
        rows.append({"path": f"{k} instance{'s' if k > 1 else ''}", "instances": k, "rps": wrk(bed, f"http://[{bed.vip}]/1k")})
    for r in rows:
        print(r, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the run's raw data: logs, figures (created)")
    ap.add_argument("--results", type=Path, default=default_dir("scaleout"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--profile", choices=PROFILES, default="quick")
    ap.add_argument("--inband", type=Path, default=REPO / "target/debug/inband")
    ap.add_argument("--name", default="scale", help="the testbed's name (namespaces NAME-r1, NAME-b1, ...)")
    args = ap.parse_args(argv)
    refused = preflight.refuse(preflight.problems(inband=str(args.inband), tools=("curl", "wrk", "nginx", "tc", "ss"), testbed_name=args.name))
    if refused:
        return refused
    p = PROFILES[args.profile]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    this_run = Run("scaleout", "bench.scaleout", argv)
    stop_signals_interrupt()
    bed = Bed(args.inband, p, args.out, args.name)
    results: dict = {"profile": asdict(p)}
    try:
        bed.up()
        bed.shaped(True)
        bed.serve(p.size_mb * 1_000_000)
        results["changes"] = changes_under_load(bed)
        bed.shaped(False)
        bed.serve_static(1000)
        results["throughput"] = throughput(bed)
    finally:
        bed.down()
    # Part 3: each mode on a testbed of its own (the last form takes b1's link).
    results["crashes"] = []
    for mode in p.crash_modes:
        bed = Bed(args.inband, p, args.out, args.name, mode)
        try:
            bed.up()
            bed.shaped(True)
            bed.serve(p.size_mb * 1_000_000)
            results["crashes"] += crashes(bed)
        finally:
            bed.down()
    record = this_run.record(results, profile=profiles.as_json(args.profile, p), inband=Path(args.inband))
    write_results(args.results, record, render(record))
    plot(results, args.out / "throughput.png")
    return 0


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    return provenance(record) + "\n\n" + markdown(record["rows"])


def markdown(r: dict) -> str:
    lines = ["### Changes under load: failed downloads (goal: 0 in every planned change)", "",
             "| change | mode | downloads | failed | short requests | failed | chained packets | chained, no owner | later connection |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in r["changes"]:
        lines.append(f"| {c['experiment']} | {c['mode']} | {c['ok'] + c['failed']} | {c['failed_pct']:.2f}% ({c['failed']}) | "
                     f"{c['short_ok'] + c['short_failed']} | {c['short_failed']} | {c['chained_packets']} | {c['chained_no_flow']} | "
                     f"{c['later_connection']} |")
    direct = next(t["rps"] for t in r["throughput"] if t["instances"] == 0)
    one = next(t["rps"] for t in r["throughput"] if t["instances"] == 1)
    lines += ["", "### Throughput: 1 KB requests, persistent connections (wrk)", "",
              "| path | req/s | / straight to a server | / 1 instance |", "|---|---|---|---|"]
    for t in r["throughput"]:
        lines.append(f"| {t['path']} | {t['rps']:.0f} | {t['rps'] / direct:.2f}× | {t['rps'] / one:.2f}× |")
    if r.get("crashes"):
        lines += ["", "### An instance's host crashes: b1 of b1, b2, b3, routed away 1 s later", "",
                  "Routed away after: from the crash to the router's new route (1 s, then the router's echo probe of b1, "
                  "up to 1 s). Still opening: no byte of the response had come at the crash. Longest pause: the longest time between two reads of a completed download's body (ms); "
                  "\"in flight\": downloads whose body had begun and not ended at the crash; \"calm\": the others of the row.", "",
                  "| VIP | b1's host | routed away after | flows b1 held (in handshake) | downloads | failed: b1's (still opening) | failed: the others' (goal 0) | "
                  "adopted | longest pause, b1's kept: median / max | longest pause, the others' in flight: max | calm: p99 | "
                  "short requests | failed | chained, no owner |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        ms = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
        for c in r["crashes"]:
            pz = c.get("pauses") or {}
            kept = f"{ms(pz.get('b1_median_ms'))} / {ms(pz.get('b1_max_ms'))} ({pz.get('b1_kept', 0)})" if pz else "–"
            others = f"{ms(pz.get('others_max_ms'))} ({pz.get('others_in_flight', 0)})" if pz else "–"
            after = f"{c['steps_s'][0][1] - c['steps_s'][0][0]:.1f} s" if c.get("steps_s") else "–"
            lines.append(f"| {c.get('mode', 'dsr-dynamic, own tuples')} | {c['form']} | {after} | {c['held']} ({c.get('held_half_open', '–')}) | "
                         f"{c['ok'] + c['failed']} | {c['failed_held']} ({c.get('failed_held_opening', '–')}) | {c['failed_others']} | {c.get('adopted', '–')} | "
                         f"{kept} | {others} | "
                         f"{ms(pz.get('calm_p99_ms')) if pz else '–'} | {c['short_ok'] + c['short_failed']} | {c['short_failed']} | "
                         f"{c['chained_no_flow']} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["throughput"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([t["path"].replace(" (no balancer)", "\n(no balancer)") for t in rows], [t["rps"] for t in rows], color=["#999"] + ["#2a7"] * (len(rows) - 1))
    ax.set_ylabel("requests/s")
    ax.set_title("1 KB requests through 1, 2, 4 inband instances (2 cores)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

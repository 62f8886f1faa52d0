"""TCPE connection handoff against proxying and L4 DSR (issue 29's
targets), in one run on one namespace testbed:

    python -m bench.handoff --out DIR [--profile quick|tiny] [--quick] [--origin-think-ms MS]

Testbed `handoff` (`inband testbed up --clients 1 --servers 2`): client
c1, balancer lb, servers s1 and s2 on a bridge. On s1 the origin, nginx
serving static files of 1, 10 and 100 MiB (sendfile), `inband tcpe
serve` in front of it (the takeover server: it relays a joined subflow,
or a connection rebuilt by a move, to the origin over loopback) and
`inband agent` (for the DSR rows). One balancer at a time runs, on the
VIP's port 80:

- `inband proxy` with `[tcpe]` in lb (its backend s1's origin, a
  `[[tcpe.server]]` for it): *handed off* when the client is
  `inband tcpe get` (TCPE), *proxied* when it is curl;
- *moved* (the transparent handoff, curl): `inband lb` in lb (dsr-rr,
  `[moves]`) sends the VIP's connections to `inband proxy` on s2 (with
  `[tcpe.transparent]`; s2's agent with `client_address = false`), which
  moves each to s1 at L4 (s1 a backend of the VIP at weight 0); the
  balancer here is both, their CPU and the XDP program's run time;
- faults driven on purpose, in rows made only when --systems names
  them, each counted by its reason:
  - *takeover server stopped* (`handoff-refused`,
    `transparent-refused`): the two moving rows again with `inband tcpe
    serve` stopped, so that every connection's handoff is refused and it
    falls back to proxying; every body must still arrive whole;
  - *option mangled on the path* (`handoff-stripped`): an nft rule on
    the client's host overwrites the experiment ID of every TCP option
    254 it sends (a middlebox that rewrites an option it does not know
    does to TCPE what one that strips it does), so no connection is
    TCPE-capable and each is proxied (`fallback_not_capable`);
  - *takeover server killed* (`handoff-killed`, `transparent-killed`):
    `inband tcpe serve` is killed -9 every `kill_every_s` during the row
    and started again. Sessions it held die with it: a TCPE client
    fetches the rest of a body cut short through the balancer (a range
    request); curl's connection, rebuilt inside the killed process, is
    lost, and the row counts those fetches incomplete;
- `inband lb` in `dsr-rr` (XDP; responses go from s1 to c1 directly);
- nginx (`proxy_pass`, keep-alive to the origin, no buffering to disk)
  and HAProxy (`mode http`, `http-reuse always`) as proxies;
- beside them *direct*: curl from c1 to the origin itself; *direct,
  TCPE client*: `inband tcpe get` from c1 to the origin (no TCPE there:
  it stays on plain TCP), the direct row of the handed-off row's own
  client, which its throughput target is judged against; and the
  *relay reference*: curl from c1 to a user-space TCP relay on s1
  (HAProxy, `mode tcp`) in front of the same origin. A handed-off
  connection is served that way (the takeover server relays the joined
  subflow to its stock origin), so this row is what a standard relay
  makes of the path a handoff leaves, in the same run.

Each row is one client process fetching one size `count` times, one
connection per fetch (only a connection's first request can move; the
curl rows send `Connection: close` so that curl does not reuse one),
one after another. For every row, in rounds (medians and sums over them):

1. **Balancer CPU per GB of response** (body bytes received). Measured
   three ways, because no single counter sees all of a balancer's work
   on a shared kernel:
   - *balancer processes*: every balancer process runs in a cgroup v2
     made for the run (as are the client and the servers, each in one
     of their own), and the row is the delta of its `cpu.stat`
     `usage_usec` (utime + stime of all its threads, exited ones too, in
     µs: the proxies' user-space work and the kernel's TCP work in their
     system calls, plus whatever softirq work the kernel ran in their
     context — this kernel has no IRQ time accounting, so that work is
     charged to the task it interrupted);
   - *BPF*: program run time (BPF_ENABLE_STATS for the whole run, every
     row alike): `inband lb`'s XDP program, which runs in the veth's
     softirq and so is in no balancer process's time; for the inband
     proxy rows its sockops program's (shown only: partly in the
     proxy's time already);
   - *balancer* = processes + XDP run time: the column the targets use;
   - *machine above direct*: whole-machine busy CPU (/proc/stat) minus
     the client's cgroup, per GB, minus the same for the direct row of
     that size: what the path costs everything but the client beyond
     client → origin, kernel work wherever it ran included (the
     bridge's, the balancer's softirqs, and for the handoff the takeover
     server's relay, which the direct row does not have). Other work on
     the machine lands in it too: compare it within one run.
2. **Throughput**: per fetch, body bytes ÷ (connect start → last byte);
   the median per row and its ratio to direct.
3. **First-byte latency**: per fetch, request written → first response
   byte. For a handed-off fetch that byte comes on the new path (the
   balancer writes nothing on the old subflow), so it is the handoff's
   latency from the request (seen by the balancer a one-way veth delay
   after it was written) to the first byte on the new path: the
   HANDOFF and, beside it, the notification, the client's join, the
   server's dial of its origin and the origin's first byte. Timed by the client:
   `inband tcpe get --timing` (CLOCK_MONOTONIC) and curl's
   `time_starttransfer − time_pretransfer`.
4. **The targets** as ratios: handoff ÷ proxied balancer CPU (≤ 0.1),
   handoff ÷ dsr-rr (≤ 1.2), handoff throughput ÷ direct (≥ 0.9), each
   against the direct row of its own client (the TCPE handoff against
   `inband tcpe get`'s, the transparent one against curl's).

Every handoff row is checked from both ends: the proxy's
`inband_proxy_tcpe_handoffs_total{result="handed_off"}` must rise by the
row's requests and the client must report every connection moved. A row
where any did not move says so (the fallbacks by reason, and requests a
proxy rule kept, are a column) and
its ratios are not judged against the targets: proxied numbers are never
reported as handoff numbers.

Prints Markdown tables, writes the record (results.json: commit, machine,
load average, command, rows) and its tables (results.md) into --results
(default bench/results/handoff), handoff.png and every config and log
into --out. Before each row it waits out builds and bench.forwarding (as
bench.proxy does, at most --wait-quiet seconds over the run). Every
process, XDP program, cgroup and namespace is removed at the end, on
Ctrl-C and SIGTERM too. See docs/benchmarks.md ("Connection handoff").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .lib import peers, preflight, profiles
from .lib.host import cpu_busy_s, enable_bpf_stats, xdp_prog_stats
from .lib.outcome import Outcome
from .lib.peers import Backend
from .lib.procs import ns_argv, run, stop_signals_interrupt, wait_until
from .lib.report import cell, table, times
from .lib.results import REPO, Run, default_dir, provenance, revive
from .lib.results import write as write_results
from .lib.stats import percentile, ratio
from .lib.systems import System
from .lib.testbed import TestbedRun, alive, new_auth_key
from .proxy import wait_quiet

VIP_PORT = 80
ORIGIN_PORT = 8080
CONTROL_PORT = 7000
JOIN_PORT = 7001
RELAY_PORT = 7002
METRICS_PORT = 9180
STRIP_TABLE = "inband_bench_strip"
MIB = 1 << 20
TARGETS = {"vs_proxy": 0.1, "vs_dsr": 1.2, "vs_direct": 0.9}


SYSTEMS = [
    System("direct", "direct: client → origin"),
    System("direct-tcpe", "direct: TCPE client → origin"),
    System("relay", "reference: client → a TCP relay on s1 (HAProxy mode tcp) → origin"),
    System("handoff", "inband proxy, handed off (TCPE client)"),
    System("handoff-refused", "inband proxy, TCPE client, takeover server stopped"),
    System("transparent", "inband lb + proxy, moved at L4 (curl)"),
    System("transparent-refused", "inband lb + proxy, curl, takeover server stopped"),
    System("handoff-stripped", "inband proxy, TCPE client, its option mangled on the path (nft)"),
    System("handoff-killed", "inband proxy, TCPE client, takeover server killed -9 again and again"),
    System("transparent-killed", "inband lb + proxy, curl, takeover server killed -9 again and again"),
    System("proxy", "inband proxy, proxied (curl)"),
    System("dsr", "inband lb, dsr-rr (XDP)"),
    System("floor", "limit: nginx on the balancer answers each connection itself (204, no origin)"),
    System("nginx", "nginx, proxy_pass"),
    System("haproxy", "HAProxy, mode http"),
]
BY_KEY = {s.key: s for s in SYSTEMS}
# What each row's balancer is; the two inband proxy rows share one.
BALANCER = {"direct": None, "direct-tcpe": None, "relay": None, "handoff": "inband-proxy", "handoff-refused": "inband-proxy", "transparent": "inband-lb+proxy",
            "transparent-refused": "inband-lb+proxy", "handoff-stripped": "inband-proxy", "handoff-killed": "inband-proxy",
            "transparent-killed": "inband-lb+proxy", "proxy": "inband-proxy", "dsr": "inband-lb", "floor": "nginx-answer", "nginx": "nginx", "haproxy": "haproxy"}
# The rows whose connections move, each by its own mechanism.
MOVING = ("handoff", "transparent")
# The rows that try to move under a fault driven on purpose: how their
# connections try to move, and the fault ("stopped": the takeover server
# is not running; "stripped": the client's TCPE option is mangled on the
# path; "killed": the takeover server is killed -9 during the row).
FAULTS = {
    "handoff-refused": ("handoff", "stopped"),
    "transparent-refused": ("transparent", "stopped"),
    "handoff-stripped": ("handoff", "stripped"),
    "handoff-killed": ("handoff", "killed"),
    "transparent-killed": ("transparent", "killed"),
}
# Rows a run makes unless --systems names others.
DEFAULT_SYSTEMS = [s.key for s in SYSTEMS if s.key not in FAULTS]


def run_clients(argvs: list, tcpe: bool, timeout: float) -> subprocess.CompletedProcess:
    """Runs the clients side by side; one result: the worst exit status,
    their outputs one after the other."""
    procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL if tcpe else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, INBAND_LOG="warn")) for a in argvs]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return subprocess.CompletedProcess([a for a in argvs], max(p.returncode for p in procs),
                                       "".join(o or "" for o, _ in outs), "".join(e or "" for _, e in outs))


def mechanism(system: str) -> str | None:
    """How a row's connections try to move ("handoff": TCPE, "transparent":
    at L4), or None for a row that does not try."""
    return FAULTS[system][0] if system in FAULTS else system if system in MOVING else None


def fault(system: str) -> str | None:
    return FAULTS[system][1] if system in FAULTS else None


def tcpe_client(system: str) -> bool:
    """Whether a row's client is `inband tcpe get` (else curl)."""
    return mechanism(system) == "handoff" or system == "direct-tcpe"


def same_client_direct(cs: dict, system: str, size: int):
    """The direct row of `system`'s own client at `size`: a throughput is
    judged against the client it was measured with. Records made before
    the TCPE client had a direct row of its own have curl's only."""
    return (cs.get(("direct-tcpe", size)) if tcpe_client(system) else None) or cs.get(("direct", size))
MOVES_PORT = 7156


@dataclass(frozen=True)
class Profile:
    counts: tuple  # (MiB, fetches per row) for each response size
    rounds: int
    # The killed rows' period: the takeover server is killed -9 this long
    # after it listens again.
    kill_every_s: float = 2.0


PROFILES = {
    # 200 handoffs of 1 MiB per round: the latency percentiles' sample.
    "default": Profile(counts=((1, 200), (10, 40), (100, 6)), rounds=3),
    "quick": Profile(counts=((1, 50), (10, 10), (100, 2)), rounds=1),
    # The test's: every row, nothing measured well.
    "tiny": Profile(counts=((1, 4), (10, 2), (100, 2)), rounds=1),
    # The test's for the fault rows: fetches long enough (about 0.2 s
    # each here) that a kill every 0.3 s lands in the middle of some.
    "tiny-faults": Profile(counts=((100, 4),), rounds=1, kill_every_s=0.3),
    # With --origin-think-ms: one size, the origin's answer MS late.
    "think": Profile(counts=((1, 200),), rounds=3),
    # Issue 29's 10,000 handoffs without a broken connection: 5,000 for
    # each moving row, of 1 MiB (`--systems direct,handoff,
    # handoff-refused,transparent,transparent-refused`: with the takeover
    # server stopped as well; with handoff-stripped, handoff-killed and
    # transparent-killed, the other faults).
    "soak": Profile(counts=((1, 5000),), rounds=1),
}

TOOLS = {"nginx": ["nginx", "-v"], "haproxy": ["haproxy", "-v"], "curl": ["curl", "--version"]}


@dataclass
class Row:
    """One client process: `requests` fetches of one size through one system."""

    system: str
    size: int  # bytes of each response body
    round: int
    requests: int
    ok: int = 0  # 200 with the whole body
    bytes: int = 0  # body bytes received, all fetches
    seconds: float = 0.0  # the client's run
    balancer_cpu_s: float = 0.0  # the balancer cgroup's usage
    bpf_ns: int = 0  # XDP (dsr, transparent) or the proxy's sockops program (inband proxy rows)
    machine_cpu_s: float = 0.0  # busy CPU of the whole machine
    client_cpu_s: float = 0.0  # the client cgroup's usage
    server_cpu_s: float = 0.0  # the servers' cgroup: the origin and the takeover server
    totals_s: list = field(default_factory=list)  # per fetch: connect start → last byte
    first_ms: list = field(default_factory=list)  # per fetch: request written → first byte
    moved: int = 0  # fetches whose connection the client says moved (transparent: the balancer's count of moves)
    handed_off: int = 0  # the proxy's count over the row (handed_off, or moved)
    fallbacks: dict = field(default_factory=dict)  # the proxy's other handoff counts over the row (its fallbacks)
    kept: dict = field(default_factory=dict)  # the proxy's tcpe_kept_total over the row, by reason
    kills: int = 0  # the killed rows: times the takeover server was killed -9 during the row
    error: str = ""


# ------------------------------------------------------------------ parsing


TIMING = re.compile(r"^timing status=(\d+) bytes=(\d+) moved=(\d+) connect_ns=(\d+) sent_ns=(\d+) first_byte_ns=(\d+) done_ns=(\d+) ")


def parse_timing(text: str) -> list[dict]:
    """`inband tcpe get --timing`'s lines, one per fetch."""
    out = []
    for line in text.splitlines():
        m = TIMING.match(line)
        if m:
            status, nbytes, moved, connect, sent, first, done = (int(x) for x in m.groups())
            out.append({"status": status, "bytes": nbytes, "moved": moved, "total_s": (done - connect) / 1e9, "first_ms": (first - sent) / 1e6})
    return out


CURL_WRITE_OUT = "%{http_code} %{size_download} %{time_pretransfer} %{time_starttransfer} %{time_total}\\n"


def parse_curl(text: str) -> list[dict]:
    """curl's write-out lines (CURL_WRITE_OUT), one per fetch."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) != 5:
            continue
        code, nbytes, pre, start, total = int(f[0]), int(f[1]), float(f[2]), float(f[3]), float(f[4])
        out.append({"status": code, "bytes": nbytes, "moved": 0, "total_s": total, "first_ms": (start - pre) * 1e3})
    return out


METRIC = re.compile(r'^inband_proxy_tcpe_(handoffs|kept)_total\{(?:result|reason)="([a-z_]+)"\} ([0-9.e+]+)$', re.M)


def parse_tcpe_metrics(text: str) -> dict:
    """{("handoffs"|"kept", name): value} from the proxy's /metrics."""
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in METRIC.finditer(text)}


# ------------------------------------------------------------------ cgroups


def cgroup2_mount() -> Path:
    """Where cgroup v2 is mounted (/sys/fs/cgroup/unified on this kind of
    machine, /sys/fs/cgroup on a pure v2 one)."""
    for line in open("/proc/self/mountinfo"):
        pre, _, post = line.partition(" - ")
        if post.split()[:1] == ["cgroup2"]:
            return Path(pre.split()[4])
    raise RuntimeError("no cgroup2 mount (the TCPE programs attach to a cgroup v2)")


def cgroup_usage_s(cg: Path) -> float:
    """utime + stime of every task that ran in `cg` (cpu.stat, µs)."""
    for line in (cg / "cpu.stat").read_text().splitlines():
        k, v = line.split()
        if k == "usage_usec":
            return int(v) / 1e6
    raise RuntimeError(f"{cg}/cpu.stat has no usage_usec")


def in_cgroup(cg: Path, argv: list[str]) -> list[str]:
    """argv run inside cgroup `cg`: the shell moves itself in, then execs
    (same pid, so the driver still stops it by its session)."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg), *argv]


# ------------------------------------------------------------------ configs


def inband_proxy_toml(*, listen: str, origin: str, metrics: str, cgroup: Path, key: Path, control: str, join: str,
                      transparent: tuple[Path, Path] | None = None) -> str:
    """`transparent`: (the agent's pin directory, the balancers' key):
    plain clients moved at L4 through `inband lb`'s [moves]."""
    toml = (f'listen = "{listen}"\nbackends = ["{origin}"]\nmetrics_listen = "{metrics}"\n\n'
            f'[tcpe]\ncgroup = "{cgroup}"\nkey = "{key}"\n\n'
            f'[[tcpe.server]]\nbackend = "{origin}"\ncontrol = "{control}"\njoin = "{join}"\n')
    if transparent:
        pins, auth_key = transparent
        toml += (f'\n[tcpe.transparent]\nagent_pins = "{pins}"\nbalancer_port = {MOVES_PORT}\n'
                 f'\n[auth]\nkeys = [{{ id = 1, file = "{auth_key}" }}]\n')
    return toml


def agent_pins(netns: str) -> Path:
    """Where the agent on eth0 of named namespace `netns` pins its maps."""
    return Path("/sys/fs/bpf/inband/netns") / netns / "agent" / "eth0"


# ------------------------------------------------------------------ the run


class Bench(TestbedRun):
    watch_others = True

    def __init__(self, args, p: Profile, out: Path) -> None:
        super().__init__(args.inband, args.name)
        self.args, self.p, self.out = args, p, out
        self.tmp = Path(tempfile.mkdtemp(prefix="inband-bench-handoff-"))
        self.cgroups: dict[str, Path] = {}
        self.stats_fd: int | None = None
        self.balancer = None  # (kind, [processes])
        self.takeover = None  # the takeover server's process
        self.metrics_at = ("lb", "")  # (node, address) of the running inband proxy's metrics
        self.wait_budget_s = args.wait_quiet
        self.quiet: set[str] = set()

    # --- set-up

    def setup(self) -> None:
        run_dir = self.out / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        (self.out / "configs").mkdir(parents=True, exist_ok=True)
        base = cgroup2_mount()
        for role in ("lb", "c1", "s1"):
            # Named after the testbed too, so that runs side by side can
            # each tell their own.
            cg = base / f"inband-bench-handoff-{self.tb.name}-{os.getpid()}-{role}"
            cg.mkdir()
            self.cgroups[role] = cg
        self.bring_up(2)
        self.auth_key = new_auth_key(self.inband, run_dir)
        self.tcpe_key = run_dir / "tcpe.key"
        self.tcpe_key.unlink(missing_ok=True)
        run(None, [str(self.inband), "keygen", "--out", str(self.tcpe_key)])
        self.start_agents(["s1"], run_dir, self.out / "logs", ORIGIN_PORT)
        # The transparent row's proxy host: the proxy must see the balancer's tuple.
        self.start_agents(["s2"], run_dir, self.out / "logs", ORIGIN_PORT, client_address=False)
        self.start_origin()
        self.start_takeover()
        self.start_relay()
        for ns in (self.ns("c1"), self.ns("lb"), self.ns("s2")):
            run(ns, ["ping", "-c", "1", "-W", "2", self.tb.addr("s1")], check=False)
        self.stats_fd = enable_bpf_stats()

    def start_origin(self) -> None:
        if self.args.origin_think_ms:
            return self.start_thinking_origin()
        root = self.tmp / "root"
        root.mkdir()
        block = os.urandom(MIB)
        for mib, _ in self.p.counts:
            with open(root / f"{mib}M", "wb") as f:
                for _ in range(mib):
                    f.write(block)
        prefix = self.tmp / "origin"
        prefix.mkdir()
        conf = self.out / "configs" / "origin.conf"
        conf.write_text(peers.nginx_static_conf(listen=f"0.0.0.0:{ORIGIN_PORT}", root=str(root), prefix=str(prefix),
                                                workers=os.cpu_count() or 1, as_root=os.geteuid() == 0))
        log = self.out / "logs" / "origin.log"
        argv = ["nginx", "-c", str(conf), "-p", str(prefix), "-e", str(prefix / "error.log"), "-g", "daemon off;"]
        proc = self.procs.spawn("origin", self.ns("s1"), in_cgroup(self.cgroups["s1"], argv), log)
        wait_until("the origin", lambda: alive(proc, "origin nginx", log) and self.listening("s1", ORIGIN_PORT), 20)

    def start_thinking_origin(self) -> None:
        """An origin that answers each request `--origin-think-ms` after it
        came (a slot held, no CPU spent: an application's own time), with a
        body of the profile's one size."""
        ((mib, _),) = self.p.counts
        argv = [str(self.inband), "serve", "--listen", f"0.0.0.0:{ORIGIN_PORT}", "--workers", "64", "--service-dist", "constant",
                "--service-ms", str(self.args.origin_think_ms), "--body-bytes", str(mib * MIB), "--keep-alive"]
        log = self.out / "logs" / "origin.log"
        proc = self.procs.spawn("origin", self.ns("s1"), in_cgroup(self.cgroups["s1"], argv), log, env=dict(os.environ, INBAND_LOG="warn"))
        wait_until("the origin", lambda: alive(proc, "origin inband serve", log) and self.listening("s1", ORIGIN_PORT), 20)

    def start_takeover(self) -> None:
        s1 = self.tb.addr("s1")
        argv = [str(self.inband), "tcpe", "serve", "--control", f"{s1}:{CONTROL_PORT}", "--join", f"{s1}:{JOIN_PORT}",
                "--origin", f"127.0.0.1:{ORIGIN_PORT}", "--key", str(self.tcpe_key), "--agent-pins", str(agent_pins(self.ns("s1")))]
        log = self.out / "logs" / "takeover.log"
        proc = self.procs.spawn("takeover", self.ns("s1"), in_cgroup(self.cgroups["s1"], argv), log, env=dict(os.environ, INBAND_LOG="warn"))
        wait_until("the takeover server", lambda: alive(proc, "inband tcpe serve", log) and self.listening("s1", JOIN_PORT), 20)
        self.takeover = proc

    def stop_takeover(self) -> None:
        """The "stopped" rows' fault: connections to the takeover server
        are refused, and the channels the proxy keeps end."""
        self.procs.stop(self.takeover)
        wait_until("the takeover server gone", lambda: not self.listening("s1", JOIN_PORT), 10)

    def kill_takeover(self) -> None:
        """The "killed" rows' fault, once: -9, nothing of it cleaning up;
        the sessions it relays die with it."""
        os.killpg(self.takeover.pid, signal.SIGKILL)
        self.takeover.wait(timeout=5)
        self.procs.stop(self.takeover)

    def killing_takeover(self, until: threading.Event, row: Row) -> None:
        """Kills the takeover server every `kill_every_s` after it listens
        again, until `until` is set, counting the kills in `row` (and a
        kill or restart that failed in its error)."""
        try:
            while not until.wait(self.p.kill_every_s):
                self.kill_takeover()
                row.kills += 1
                self.start_takeover()
        except Exception as e:  # noqa: BLE001 - the row reports it
            row.error = f"the takeover server's kill or restart failed: {e}"

    def strip_options(self, on: bool) -> None:
        """The "stripped" row's fault: the client's host overwrites the
        experiment ID (bytes 2–3) of every TCP option 254 it sends, as a
        middlebox rewriting an option it does not know would; nft 1.0.6
        cannot remove an option of a raw kind, and to the receiver an
        unknown experiment is no TCPE either way."""
        ns = self.ns("c1")
        if on:
            run(ns, ["nft", f"add table inet {STRIP_TABLE}; add chain inet {STRIP_TABLE} out {{ type filter hook output priority 0; }}; "
                            f"add rule inet {STRIP_TABLE} out tcp option @254,16,16 set 0"])  # fmt: skip
        else:
            run(ns, ["nft", "delete", "table", "inet", STRIP_TABLE], check=False)

    def start_relay(self) -> None:
        """The relay reference's: HAProxy relaying TCP on s1 to the origin
        over loopback, in the servers' cgroup, as the takeover server relays."""
        cfg = self.out / "configs" / "relay.cfg"
        cfg.write_text(peers.haproxy_cfg(vip=self.tb.addr("s1"), vip_port=RELAY_PORT, backends=[Backend("127.0.0.1", ORIGIN_PORT)],
                                         balance="roundrobin", timeout_s=120))
        log = self.out / "logs" / "relay.log"
        proc = self.procs.spawn("relay", self.ns("s1"), in_cgroup(self.cgroups["s1"], ["haproxy", "-db", "-f", str(cfg)]), log)
        wait_until("the relay", lambda: alive(proc, "relay haproxy", log) and self.listening("s1", RELAY_PORT), 20)

    def listening(self, node: str, port: int) -> bool:
        return f":{port} " in run(self.ns(node), ["ss", "-Hltn"]).stdout

    # --- balancers

    def start_balancer(self, kind: str) -> None:
        d = self.out / "configs"
        vip, s1 = self.tb.vip, self.tb.addr("s1")
        origin = f"{s1}:{ORIGIN_PORT}"
        cg = self.cgroups["lb"]
        env = dict(os.environ, INBAND_LOG="warn")  # no access log: the peers keep none either
        log = self.out / "logs" / f"{kind}.log"
        workers = os.cpu_count() or 1
        if kind == "inband-lb":
            # start_lb spawns without the cgroup: run it in one by the
            # same wrapper, through a config written the same way.
            self.balancer = (kind, [self.start_lb_in_cgroup(d, [Backend(s1, ORIGIN_PORT)])])
            return
        node = "lb"
        if kind == "inband-lb+proxy":
            # The proxy on s2 takes every new connection (s1 takes moved ones only).
            s2 = self.tb.addr("s2")
            lb = self.start_lb_in_cgroup(d, [Backend(s2, ORIGIN_PORT), Backend(s1, ORIGIN_PORT, weight=0)], moves=True)
            self.balancer = (kind, [lb])
            node, listen = "s2", f"{s2}:{ORIGIN_PORT}"
            self.metrics_at = (node, s2)
            cfg = d / "inband-proxy-transparent.toml"
            cfg.write_text(inband_proxy_toml(listen=listen, origin=origin, metrics=f"{s2}:{METRICS_PORT}", cgroup=cg, key=self.tcpe_key,
                                             control=f"{s1}:{CONTROL_PORT}", join=f"{s1}:{JOIN_PORT}",
                                             transparent=(agent_pins(self.ns("s2")), self.auth_key)))
            argv = [str(self.inband), "proxy", "--config", str(cfg)]
        elif kind == "inband-proxy":
            self.metrics_at = ("lb", self.tb.addr("lb"))
            cfg = d / "inband-proxy.toml"
            cfg.write_text(inband_proxy_toml(listen=f"{vip}:{VIP_PORT}", origin=origin, metrics=f"{self.tb.addr('lb')}:{METRICS_PORT}",
                                             cgroup=cg, key=self.tcpe_key, control=f"{s1}:{CONTROL_PORT}", join=f"{s1}:{JOIN_PORT}"))
            argv = [str(self.inband), "proxy", "--config", str(cfg)]
        elif kind == "nginx":
            prefix = self.tmp / "nginx"
            prefix.mkdir(exist_ok=True)
            cfg = d / "nginx.conf"
            cfg.write_text(peers.nginx_proxy_conf(listen=f"{vip}:{VIP_PORT}", origin=origin, prefix=str(prefix), workers=workers,
                                                  as_root=os.geteuid() == 0))
            argv = ["nginx", "-c", str(cfg), "-p", str(prefix), "-e", str(prefix / "error.log"), "-g", "daemon off;"]
        elif kind == "nginx-answer":
            prefix = self.tmp / "nginx-answer"
            prefix.mkdir(exist_ok=True)
            cfg = d / "nginx-answer.conf"
            cfg.write_text(peers.nginx_answer_conf(listen=f"{vip}:{VIP_PORT}", prefix=str(prefix), workers=workers, as_root=os.geteuid() == 0))
            argv = ["nginx", "-c", str(cfg), "-p", str(prefix), "-e", str(prefix / "error.log"), "-g", "daemon off;"]
        elif kind == "haproxy":
            cfg = d / "haproxy.cfg"
            cfg.write_text(peers.haproxy_http_cfg(listen=f"{vip}:{VIP_PORT}", origin=origin, threads=workers))
            argv = ["haproxy", "-db", "-f", str(cfg)]
        else:
            raise ValueError(kind)
        proc = self.procs.spawn(kind, self.ns(node), in_cgroup(cg, argv), log, env=env)
        self.balancer = (kind, (self.balancer[1] if self.balancer else []) + [proc])
        port = ORIGIN_PORT if node == "s2" else VIP_PORT
        wait_until(f"{kind} on the VIP", lambda: alive(proc, kind, log) and self.listening(node, port), 30)
        if kind in ("inband-proxy", "inband-lb+proxy"):
            wait_until("the proxy's metrics", lambda: self.metrics() is not None, 10)

    def start_lb_in_cgroup(self, d: Path, backends: list[Backend], moves: bool = False):
        """`moves`: `[moves]` on the balancer's address (the transparent row)."""
        lb = self.ns("lb")
        for b in backends:
            run(lb, ["ping", "-c", "1", "-W", "2", b.address], check=False)
        cfg = d / "lb.toml"
        address = self.tb.addr("lb")
        cfg.write_text(peers.lb_toml(address=address, vip=self.tb.vip, vip_port=VIP_PORT, backends=backends, mode="dsr-rr",
                                     control_socket=str(self.lb_sock), auth_key=str(self.auth_key),
                                     moves_listen=f"{address}:{MOVES_PORT}" if moves else None))
        log = self.out / "logs" / "inband-lb.log"
        proc = self.procs.spawn("inband lb", lb, in_cgroup(self.cgroups["lb"], [str(self.inband), "lb", "--config", str(cfg)]), log)
        wait_until("the balancer's control socket", lambda: alive(proc, "inband lb", log) and self.lb_status() is not None, 30)
        wait_until("the balancer to resolve s1", lambda: alive(proc, "inband lb", log)
                   and all(b["mac"] != "00:00:00:00:00:00" for b in self.lb_backends()) and bool(self.lb_backends()), 30)
        return proc

    def stop_balancer(self) -> None:
        if self.balancer is None:
            return
        kind, procs = self.balancer
        self.balancer = None
        for proc in reversed(procs):
            self.procs.stop(proc)
        if kind.startswith("inband-lb"):
            self.detach_lb()

    def metrics(self) -> dict | None:
        node, address = self.metrics_at
        cp = run(self.ns(node), ["curl", "-s", "--max-time", "3", f"http://{address}:{METRICS_PORT}/metrics"], check=False)
        return parse_tcpe_metrics(cp.stdout) if cp.returncode == 0 and "inband_proxy" in cp.stdout else None

    # --- measuring

    def settle(self) -> None:
        if self.wait_budget_s <= 0:
            self.quiet.add("not waited for (--wait-quiet 0)" if self.args.wait_quiet <= 0 else "not waited for (the --wait-quiet time was used up)")
            return
        t0 = time.monotonic()
        self.quiet.add(wait_quiet(self.wait_budget_s, self.log, hold_s=2))
        self.wait_budget_s -= time.monotonic() - t0

    def settled_metrics(self, m0: dict, n: int) -> dict:
        """The proxy's metrics once each of the row's `n` connections has its
        handoff outcome counted (for at most 2 s): a TCPE client goes on at
        the server's JOIN-OK, so its last fetch can end before the proxy
        hears the server's verdict and counts the handoff."""
        deadline = time.monotonic() + 2.0
        while True:
            m1 = self.metrics() or {}
            outcomes = sum(v - m0.get(k, 0.0) for k, v in m1.items() if k[0] == "handoffs")
            if outcomes >= n or time.monotonic() >= deadline:
                return m1
            time.sleep(0.01)

    def moves(self) -> dict:
        """The balancer's move counters: "moved" and each refusal's."""
        status = self.lb_status()
        return {k: int(v) for k, v in status[0]["control"]["moves"].items()} if status else {}

    def bpf_ns(self, kind: str | None) -> int:
        # The transparent row's proxy has its sockops program too, but
        # only the XDP program's time is in no balancer process's.
        if kind in ("inband-lb", "inband-lb+proxy"):
            return xdp_prog_stats(self.ns("lb"), "eth0")[0]
        if kind == "inband-proxy":
            progs = json.loads(run(None, ["bpftool", "-j", "cgroup", "show", str(self.cgroups["lb"])]).stdout or "[]")
            total = 0
            for p in progs:
                if p.get("attach_type") == "sock_ops":
                    total += int(json.loads(run(None, ["bpftool", "-j", "prog", "show", "id", str(p["id"])]).stdout).get("run_time_ns", 0))
            return total
        return 0

    def client_argv(self, system: str, url: str, n: int, i: int = 0) -> list[str]:
        """Client `i`'s command for `n` fetches of `url`, one after another."""
        if tcpe_client(system):
            return [str(self.inband), "tcpe", "get", "--cgroup", str(self.cgroups["c1"]), "--timing", *([url] * n)]
        cfg = self.tmp / f"curl-{i}.conf"
        cfg.write_text('silent\nheader = "Connection: close"\nmax-time = 120\n'
                       f'write-out = "{CURL_WRITE_OUT}"\n' + f'url = "{url}"\noutput = "/dev/null"\n' * n)
        return ["curl", "-K", str(cfg)]

    def measure(self, system: str, mib: int, n: int, rnd: int) -> Row:
        kind = BALANCER[system]
        size = mib * MIB
        host = self.tb.addr("s1") if system in ("direct", "direct-tcpe", "relay") else self.tb.vip
        port = {"direct": ORIGIN_PORT, "direct-tcpe": ORIGIN_PORT, "relay": RELAY_PORT}.get(system, VIP_PORT)
        url = f"http://{host}:{port}/{mib}M"
        # --clients side by side share the row's fetches, each one after another.
        clients = max(1, min(self.args.clients, n))
        shares = [n // clients + (i < n % clients) for i in range(clients)]
        argvs = [ns_argv(self.ns("c1"), in_cgroup(self.cgroups["c1"], self.client_argv(system, url, k, i))) for i, k in enumerate(shares)]
        row = Row(system, size, rnd, n)
        m0 = self.metrics() if kind in ("inband-proxy", "inband-lb+proxy") else None
        moves0 = self.moves() if mechanism(system) == "transparent" else {}
        lb0, c0, s0 = (cgroup_usage_s(self.cgroups[r]) for r in ("lb", "c1", "s1"))
        bpf0 = self.bpf_ns(kind)
        busy0, t0 = cpu_busy_s(), time.monotonic()
        tcpe = tcpe_client(system)
        done = threading.Event()
        killer = threading.Thread(target=self.killing_takeover, args=(done, row)) if fault(system) == "killed" else None
        if killer:
            killer.start()
        try:
            cp = run_clients(argvs, tcpe, timeout=60 + n * (5 + mib / 20))
        finally:
            done.set()
            if killer:
                killer.join()
        row.seconds = time.monotonic() - t0
        row.machine_cpu_s = cpu_busy_s() - busy0
        row.balancer_cpu_s = cgroup_usage_s(self.cgroups["lb"]) - lb0
        row.client_cpu_s = cgroup_usage_s(self.cgroups["c1"]) - c0
        row.server_cpu_s = cgroup_usage_s(self.cgroups["s1"]) - s0
        row.bpf_ns = self.bpf_ns(kind) - bpf0
        fetches = parse_timing(cp.stderr) if tcpe else parse_curl(cp.stdout)
        # The floor's answer is empty: its connections stand for ones of this size.
        expected = (204, 0) if system == "floor" else (200, size)
        for f in fetches:
            row.bytes += f["bytes"]
            if (f["status"], f["bytes"]) == expected:
                row.ok += 1
                row.totals_s.append(f["total_s"])
                row.first_ms.append(f["first_ms"])
            row.moved += f["moved"]
        if cp.returncode != 0 or row.ok != n:
            row.error = "; ".join(filter(None, [row.error, f"client exit {cp.returncode}, {row.ok} of {n} complete: {cp.stderr.strip()[-300:]}"]))
        if m0 is not None:
            m1 = self.settled_metrics(m0, n) if mechanism(system) == "handoff" else self.metrics() or {}
            delta = {k: m1.get(k, 0.0) - v for k, v in m0.items()}
            done = "moved" if mechanism(system) == "transparent" else "handed_off"
            row.handed_off = int(delta.get(("handoffs", done), 0))
            row.fallbacks = {k[1]: int(v) for k, v in delta.items() if k[0] == "handoffs" and k[1] != done and v}
            row.kept = {k[1]: int(v) for k, v in delta.items() if k[0] == "kept" and v}
        if mechanism(system) == "transparent":
            # curl cannot tell a moved connection: the other end that
            # counts the moves is the balancer, which also says why it
            # refused any.
            moves1 = self.moves()
            delta = {k: v - moves0.get(k, 0) for k, v in moves1.items()}
            row.moved = delta.pop("moved", 0)
            row.fallbacks.update({f"balancer {k}": v for k, v in delta.items() if v})
        return row

    def teardown(self) -> None:
        if self.stats_fd is not None:
            os.close(self.stats_fd)
            self.stats_fd = None
        try:
            self.stop_balancer()
        finally:
            super().teardown()
            for cg in self.cgroups.values():
                remove_cgroup(cg)
            shutil.rmtree(self.tmp, ignore_errors=True)


def remove_cgroup(cg: Path) -> None:
    """rmdir once its processes (all stopped by now) are reaped."""
    for _ in range(50):
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: cgroup {cg} could not be removed: {(cg / 'cgroup.procs').read_text().split()}", file=sys.stderr)


# ------------------------------------------------------------------ tables


def mib_label(size: int) -> str:
    return f"{size // MIB} MiB"


@dataclass
class Cell:
    """A (system, size)'s rows over the rounds, summed."""

    system: str
    size: int
    requests: int = 0
    ok: int = 0
    bytes: int = 0
    balancer_cpu_s: float = 0.0
    bpf_ns: int = 0
    machine_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    totals_s: list = field(default_factory=list)
    first_ms: list = field(default_factory=list)
    moved: int = 0
    handed_off: int = 0
    fallbacks: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)
    kills: int = 0
    errors: list = field(default_factory=list)

    @property
    def gb(self) -> float:
        """The floor carries no body: its cost per connection is set
        against the bytes a connection of this size carries."""
        return (self.ok * self.size if self.system == "floor" else self.bytes) / 1e9

    def per_gb(self, seconds: float) -> float | None:
        return seconds / self.gb if self.gb else None

    @property
    def balancer_s_gb(self) -> float | None:
        """Processes + XDP run time (the sockops program is partly in the
        proxy's time already)."""
        xdp = self.bpf_ns / 1e9 if self.system in ("dsr", "transparent") else 0.0
        return self.per_gb(self.balancer_cpu_s + xdp)

    @property
    def others_s_gb(self) -> float | None:
        """The whole machine's busy CPU but the client's, per GB."""
        return self.per_gb(self.machine_cpu_s - self.client_cpu_s)

    @property
    def mb_s(self) -> float | None:
        """The median fetch's body bytes per second, in MB/s."""
        if self.system == "floor":
            return None
        rates = [self.size / t / 1e6 for t in self.totals_s if t > 0]
        return percentile(rates, 50)

    @property
    def not_moved(self) -> int:
        """Fetches of a handoff row that did not move, by the smaller of the
        two ends' counts (fallbacks, and fetches a failed client never made)."""
        return self.requests - min(self.moved, self.handed_off) if mechanism(self.system) else 0


def cells(rows: list[Row]) -> dict:
    """{(system, size): Cell} over every round."""
    out: dict = {}
    for r in rows:
        c = out.setdefault((r.system, r.size), Cell(r.system, r.size))
        c.requests += r.requests
        c.ok += r.ok
        c.bytes += r.bytes
        c.balancer_cpu_s += r.balancer_cpu_s
        c.bpf_ns += r.bpf_ns
        c.machine_cpu_s += r.machine_cpu_s
        c.client_cpu_s += r.client_cpu_s
        c.server_cpu_s += r.server_cpu_s
        c.totals_s += r.totals_s
        c.first_ms += r.first_ms
        c.moved += r.moved
        c.handed_off += r.handed_off
        c.kills += r.kills
        for k, v in r.fallbacks.items():
            c.fallbacks[k] = c.fallbacks.get(k, 0) + v
        for k, v in r.kept.items():
            c.kept[k] = c.kept.get(k, 0) + v
        if r.error:
            c.errors.append(f"round {r.round + 1}: {r.error}")
    return out


def fmt(v: float | None, digits: int = 3) -> str:
    return cell(v, fmt=f".{digits}f")


def moved_cell(c: Cell) -> str:
    if not mechanism(c.system):
        return "–"
    other = "client" if mechanism(c.system) == "handoff" else "balancer"
    return f"{c.handed_off}/{c.requests}" + ("" if c.moved == c.handed_off else f" ({other}: {c.moved})")


def fallback_cell(c: Cell) -> str:
    if not mechanism(c.system):
        return "–"
    # A request one of the proxy's rules kept never tried to move: said too.
    said = [f"{k} {v}" for k, v in sorted(c.fallbacks.items())] + [f"kept ({k}) {v}" for k, v in sorted(c.kept.items())]
    if fault(c.system) == "killed":
        said.append(f"takeover server killed {c.kills}×")
    return ", ".join(said) or "0"


def cpu_table(cs: dict) -> str:
    sizes = sorted({s for _, s in cs})
    rows = []
    for size in sizes:
        direct = cs.get(("direct", size))
        ref_proxy, ref_dsr = cs.get(("proxy", size)), cs.get(("dsr", size))
        for s in SYSTEMS:
            c = cs.get((s.key, size))
            if c is None:
                continue
            own = c.balancer_s_gb if BALANCER[s.key] else None
            # The floor moves no bytes: the machine's CPU per its GB says nothing.
            above = above_direct(c, direct) if c is not direct and s.key != "floor" else None
            rows.append([
                mib_label(size), s.label, f"{c.ok}/{c.requests}", moved_cell(c), fallback_cell(c), f"{c.gb:.3f}",
                fmt(c.per_gb(c.balancer_cpu_s)) if BALANCER[s.key] else "–",
                fmt(c.per_gb(c.bpf_ns / 1e9), 4) if c.bpf_ns else "–",
                fmt(own), times(own, ref_proxy.balancer_s_gb if ref_proxy else None) if own is not None else "–",
                times(own, ref_dsr.balancer_s_gb if ref_dsr else None) if own is not None else "–",
                fmt(above), fmt(c.per_gb(c.server_cpu_s)),
            ])  # fmt: skip
    return table(["response", "system", "complete", "handed off", "fallbacks", "GB", "balancer processes s/GB", "BPF run time s/GB",
                  "balancer s/GB", "÷ proxied", "÷ dsr-rr", "machine above direct s/GB", "server processes s/GB"], rows)


def throughput_table(cs: dict) -> str:
    rows = []
    for size in sorted({s for _, s in cs}):
        direct = cs.get(("direct", size))
        for s in SYSTEMS:
            c = cs.get((s.key, size))
            if c is None or c.mb_s is None:
                continue
            rates = [c.size / t / 1e6 for t in c.totals_s if t > 0]
            rows.append([mib_label(size), s.label, len(rates), fmt(c.mb_s, 0), fmt(min(rates) if rates else None, 0),
                         times(c.mb_s, direct.mb_s if direct else None) if s.key != "direct" else "–"])
    return table(["response", "system", "fetches", "median MB/s", "slowest MB/s", "÷ direct"], rows)


def latency_table(cs: dict) -> str:
    rows = []
    for s in SYSTEMS:
        ms = [x for (k, _), c in cs.items() if k == s.key and k != "floor" for x in c.first_ms]
        if not ms:
            continue
        rows.append([s.label, len(ms), fmt(percentile(ms, 50), 2), fmt(percentile(ms, 99), 2), fmt(max(ms), 2)])
    return table(["system", "fetches", "p50 ms", "p99 ms", "max ms"], rows)


def verdict(x: float | None, target: float, below: bool) -> str:
    if x is None:
        return "–"
    return "met" if (x <= target if below else x >= target) else "**not met**"


def above_direct(c: Cell | None, direct: Cell | None) -> float | None:
    """The machine's CPU per GB but the client's, above the direct row's."""
    if c is None or direct is None or c.others_s_gb is None or direct.others_s_gb is None:
        return None
    return c.others_s_gb - direct.others_s_gb


def positive_ratio(a: float | None, b: float | None) -> float | None:
    """a ÷ b where both are costs above zero (a differential can come out
    at or below zero in the noise, and a ratio to it means nothing)."""
    return ratio(a, b) if a is not None and b is not None and a > 0 and b > 0 else None


def round_range(rows: list[Row], system: str, ref: str, size: int, value) -> str:
    """`value(cell) ÷ value(ref's cell)` in each round alone, as "lo–hi":
    how far the rounds of one run spread around the whole run's ratio."""
    per = []
    for rnd in sorted({r.round for r in rows}):
        cs = cells([r for r in rows if r.round == rnd and r.size == size and r.system in (system, ref)])
        a, b = cs.get((system, size)), cs.get((ref, size))
        x = ratio(value(a), value(b)) if a and b else None
        if x is not None:
            per.append(x)
    return f"{min(per):.3f}–{max(per):.3f}" if len(per) > 1 else "–"


def targets_table(cs: dict, rows: list[Row] = ()) -> str:
    table_rows = []
    for size, system in [(size, system) for size in sorted({s for _, s in cs}) for system in MOVING]:
        h = cs.get((system, size))
        if h is None:
            continue
        variant = {"handoff": "TCPE", "transparent": "transparent"}[system]
        p, d, direct, relay = cs.get(("proxy", size)), cs.get(("dsr", size)), cs.get(("direct", size)), cs.get(("relay", size))
        floor = cs.get(("floor", size))
        vs_p = ratio(h.balancer_s_gb, p.balancer_s_gb) if p else None
        vs_d = ratio(h.balancer_s_gb, d.balancer_s_gb) if d else None
        own = same_client_direct(cs, system, size)
        vs_direct = ratio(h.mb_s, own.mb_s) if own else None
        # What a standard relay on the server makes of the same path, and the handoff against it.
        limit = [fmt(ratio(relay.mb_s, direct.mb_s) if relay and direct else None, 2), fmt(ratio(h.mb_s, relay.mb_s) if relay else None, 2)]
        # The least any balancer that reads the request spends per connection, against dsr-rr's cost, and the handoff against it.
        limit += [fmt(ratio(floor.balancer_s_gb, d.balancer_s_gb) if floor and d else None, 2),
                  fmt(ratio(h.balancer_s_gb, floor.balancer_s_gb) if floor else None, 2)]
        # The same two ratios on the machine's CPU above direct: beside
        # them, not judged (other work on the machine lands in it).
        m = above_direct(h, direct)
        machine = [fmt(positive_ratio(m, above_direct(p, direct)), 3), fmt(positive_ratio(m, above_direct(d, direct)), 2)]
        # The CPU ratio's rounds alone: a handoff's cost is small beside
        # the machine's scheduling, and moves from round to round.
        spread = round_range(list(rows), system, "proxy", size, lambda c: c.balancer_s_gb)
        if h.not_moved:
            judged = f"not judged: {h.not_moved} of {h.requests} did not move"
            table_rows.append([mib_label(size), variant, fmt(vs_p, 3), spread, judged, fmt(vs_d, 2), judged, fmt(vs_direct, 2), judged, *limit,
                               *machine])
            continue
        table_rows.append([mib_label(size), variant, fmt(vs_p, 3), spread, verdict(vs_p, TARGETS["vs_proxy"], True), fmt(vs_d, 2),
                           verdict(vs_d, TARGETS["vs_dsr"], True), fmt(vs_direct, 2), verdict(vs_direct, TARGETS["vs_direct"], False), *limit,
                           *machine])
    own_client = any(system == "direct-tcpe" for system, _ in cs)
    return table(["response", "handoff", f"÷ proxied, balancer CPU (≤ {TARGETS['vs_proxy']})", "rounds alone", "",
                  f"÷ dsr-rr (≤ {TARGETS['vs_dsr']})", "",
                  f"÷ direct{' with its own client' if own_client else ''}, throughput (≥ {TARGETS['vs_direct']})", "", "HAProxy relay ÷ direct", "handoff ÷ HAProxy relay",
                  "L7 floor ÷ dsr-rr, balancer CPU", "handoff ÷ L7 floor",
                  "machine above direct: handoff ÷ proxied", "÷ dsr-rr"], table_rows)


def side_by_side(clients: int) -> str:
    return "one connection at a time" if clients <= 1 else f"{clients} clients side by side, each one connection at a time"


def markdown(rows: list[Row], profile: dict, quiet: list[str], failed: list[str], others: list[str] = (), think_ms: float = 0.0,
             clients: int = 1) -> str:
    cs = cells(rows)
    n = ", ".join(f"{mib} MiB × {k}" for mib, k in profile["counts"])
    origin = f"; the origin (`inband serve`) answers each request {think_ms:g} ms after it came" if think_ms else ""
    parts = [
        f"#### The targets (issue 29), {profile['rounds']} round(s) of {n} fetches per row{origin}", "", targets_table(cs, rows), "",
        "#### Balancer CPU per GB of response", "", cpu_table(cs), "",
        f"#### Throughput: {side_by_side(clients)}, connect → last byte", "", throughput_table(cs), "",
        "#### First-byte latency: request written → first response byte (handed off: on the new path)", "", latency_table(cs),
    ]  # fmt: skip
    errors = [f"{BY_KEY[c.system].label}, {mib_label(c.size)}: {e}" for c in cs.values() for e in c.errors]
    if errors:
        parts += ["", "**Incomplete rows:** " + "; ".join(errors)]
    if quiet:
        parts += ["", f"Before each row: {'; '.join(quiet)}."]
    parts += ["", f"Other work seen running during the rows (it lands in the machine's CPU): {', '.join(others) or 'none seen'}."]
    if failed:
        parts += ["", "**Failed:** " + "; ".join(failed)]
    return "\n".join(parts) + "\n"


def render(record: dict) -> str:
    rows = [revive(Row, r) for r in record["rows"]]
    return provenance(record) + "\n\n" + markdown(rows, record["profile"], record.get("quiet", []), record.get("failed", []), record.get("others", []),
                                                 record.get("origin_think_ms", 0.0), record.get("clients", 1))


def ab_numbers(record: dict) -> dict[str, list[float]]:
    """For bench.ab: per round, each moving row's balancer CPU per GB and its
    ratio to the proxied row of the same round and size, its server's CPU
    per GB, its median fetch's rate ÷ the direct row's, its median
    first-byte latency, and its slowest fetch (where a stall of tens of
    milliseconds in a few fetches shows, which no median does)."""
    rows = [revive(Row, r) for r in record["rows"]]
    slowest = {(r.system, r.size, r.round): max(r.totals_s) for r in rows if r.totals_s}
    # One cell per round: the round's own numbers.
    by = {(r.system, r.size, r.round): cells([r])[(r.system, r.size)] for r in rows}
    out: dict[str, list[float]] = {}
    for (system, size, rnd), c in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        if not mechanism(system) or fault(system) or c.balancer_s_gb is None:
            continue
        what = f"{BY_KEY[system].label}, {mib_label(size)}"
        out.setdefault(f"{what}: balancer s/GB", []).append(c.balancer_s_gb)
        proxied = by.get(("proxy", size, rnd))
        if proxied is not None and proxied.balancer_s_gb:
            out.setdefault(f"{what}: ÷ proxied", []).append(c.balancer_s_gb / proxied.balancer_s_gb)
        if (server := c.per_gb(c.server_cpu_s)) is not None:
            out.setdefault(f"{what}: server s/GB", []).append(server)
        direct = same_client_direct({(s, z): x for (s, z, r), x in by.items() if r == rnd}, system, size)
        if direct is not None and direct.mb_s and c.mb_s is not None:
            out.setdefault(f"{what}: throughput ÷ direct", []).append(c.mb_s / direct.mb_s)
        if c.first_ms:
            out.setdefault(f"{what}: first byte p50 ms", []).append(percentile(c.first_ms, 50))
        if (system, size, rnd) in slowest:
            out.setdefault(f"{what}: slowest fetch ms", []).append(slowest[(system, size, rnd)] * 1e3)
    return out


def plot(rows: list[Row], path: Path, clients: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = cells(rows)
    sizes = sorted({s for _, s in cs})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, s in enumerate(SYSTEMS):
        xs = [size // MIB for size in sizes if (s.key, size) in cs]
        style = dict(marker="o", label=s.label, color=f"C{i}")  # one colour per system in both panels
        if BALANCER[s.key]:
            a.plot(xs, [cs[(s.key, size)].balancer_s_gb or 0 for size in sizes if (s.key, size) in cs], **style)
        if s.key != "floor":
            b.plot(xs, [cs[(s.key, size)].mb_s or 0 for size in sizes if (s.key, size) in cs], **style)
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xticks([size // MIB for size in sizes], [mib_label(size) for size in sizes])
        ax.set_xlabel("response size")
        ax.legend(fontsize=7)
    a.set_yscale("log")
    a.set_ylabel("balancer CPU s per GB (processes + XDP)")
    a.set_title("Balancer CPU per GB of response")
    b.set_ylabel("MB/s, median fetch")
    b.set_title(f"Throughput, {side_by_side(clients)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the run's configs, logs and figure (created)")
    ap.add_argument("--results", type=Path, default=default_dir("handoff"), help="results.json and results.md (default: bench/results/handoff)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default")
    ap.add_argument("--quick", action="store_true", help="the profile `quick`: one round, fewer fetches")
    ap.add_argument("--rounds", type=int, help="override the profile's rounds")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated subset of " + ", ".join(BY_KEY))
    ap.add_argument("--name", default="handoff", help="testbed name (namespaces NAME-c1, NAME-lb, NAME-s1, NAME-sw)")
    preflight.add_wait_quiet(ap, "row")
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    ap.add_argument("--clients", type=int, default=1,
                    help="clients side by side sharing each row's fetches (default 1: one connection at a time)")
    ap.add_argument("--origin-think-ms", type=float, default=0.0,
                    help="the origin is `inband serve`, answering each request this late (one response size: the profile `think`)")
    args = ap.parse_args(argv)
    wanted = preflight.chosen_systems(ap, args.systems, BY_KEY)
    systems = [s for s in SYSTEMS if s.key in wanted]
    name = "quick" if args.quick else args.profile
    p = profiles.choose(PROFILES, name, rounds=args.rounds)
    if args.origin_think_ms and len(p.counts) != 1:
        ap.error(f"--origin-think-ms serves one response size: the profile {name} has {len(p.counts)} (use --profile think)")
    if args.origin_think_ms and "floor" in wanted:
        ap.error("--origin-think-ms: the L7 floor's row stands for the static origin's connections; leave it out")
    refused = preflight.refuse(preflight.problems(inband=args.inband, tools=("curl", "nginx", "haproxy", "bpftool", "ss"), testbed_name=args.name,
                                                  bpf_stats=True))
    if refused:
        return refused
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    this_run = Run("handoff", "bench.handoff", argv)
    stop_signals_interrupt()
    bench = Bench(args, p, out)
    outcome = Outcome(bench.log)
    rows: list[Row] = []
    with outcome.torn_down_after(bench.teardown):
        bench.setup()
        for rnd in range(p.rounds):
            started = None
            for s in systems:
                kind = BALANCER[s.key]
                if kind != started:
                    bench.stop_balancer()
                    if kind is not None:
                        bench.log(f"round {rnd + 1}/{p.rounds}: start {kind}")
                        outcome.attempt(f"round {rnd + 1} start {kind}", lambda kind=kind: bench.start_balancer(kind))
                    started = kind
                if kind is not None and bench.balancer is None:
                    continue  # its start failed, recorded
                if fault(s.key) == "stopped":
                    bench.stop_takeover()
                if fault(s.key) == "stripped":
                    bench.strip_options(True)
                for mib, n in p.counts:
                    bench.settle()
                    bench.log(f"round {rnd + 1}/{p.rounds}: {s.label}, {n} × {mib} MiB")
                    outcome.attempt(f"round {rnd + 1} {s.key} {mib} MiB", lambda s=s, mib=mib, n=n: bench.measure(s.key, mib, n, rnd), rows)
                if fault(s.key) == "stopped":
                    outcome.attempt(f"round {rnd + 1} restart the takeover server", bench.start_takeover)
                if fault(s.key) == "stripped":
                    bench.strip_options(False)
            bench.stop_balancer()
    record = this_run.record([asdict(r) for r in rows], profile=profiles.as_json(name, p), inband=Path(args.inband), tools=TOOLS,
                             quiet=sorted(bench.quiet), others=sorted(bench.others), failed=outcome.failed,
                             origin_think_ms=args.origin_think_ms, clients=args.clients)
    write_results(args.results, record, render(record))
    if rows:
        plot(rows, out / "handoff.png", args.clients)
    return outcome.exit_code()


if __name__ == "__main__":
    sys.exit(main())

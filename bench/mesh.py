"""Socket-layer L7 balancing (issue 14, seed 001's XLB), in one run:

    python -m bench.mesh --out results/mesh

One client host (a network namespace) and two backend hosts (nginx, one
worker, a 64-byte answer) behind veths. On the client host, in one cgroup,
wrk (one thread, closed loop, HTTP/1.1 persistent connections, as the
seed's Fortio) calls a service through, in turn:

- direct: no balancer; half the connections to each backend (two wrk);
- inband mesh: `inband mesh run`, no proxy in the data path;
- HAProxy (http mode, one thread) as a per-host sidecar;
- nginx (one worker, keep-alive upstream) as a per-host sidecar;
- inband proxy (one worker, no cache) as a per-host sidecar.

For 1 to 128 connections: req/s, p50/p99 latency, and CPU per request of
the whole host (every process and the kernel's work on their behalf, from
/proc/stat: the mesh's work runs in the client's, the backends' and
kernel threads' time, so no per-process count would be fair), with the
CPU each system adds over direct. Then the seed's chain: nine services,
each an nginx process that calls the next through the system, at 1 and 8
connections. Then where the mesh's time goes: its two programs' run time
per request (bpf_stats) against the CPU it adds over direct.

Then the seed's message-size sweep: at one connection count, responses of
64 B to 1 MiB (GET of a file of that size) and requests of 64 B to 1 MiB
(a POST body the backend reads and answers with 64 bytes), through every
system.

Prints Markdown tables, writes
the record (results.json: commit, machine, load average, command, rows)
and its tables (results.md) into --results (default bench/results/mesh),
mesh.png into --out; removes its namespaces, cgroup and processes at
the end, on Ctrl-C and SIGTERM too. See docs/benchmarks.md ("Socket-layer
L7 balancing").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .lib import preflight
from .lib.host import cpu_busy_s
from .lib.results import REPO, Run, default_dir, provenance, revive
from .lib.results import write as write_results
from .lib.tools import WRK_SUMMARY_LUA, parse_wrk
from .lib.procs import Procs, ns_argv, run, stop_signals_interrupt, uninterruptible, wait_until

INBAND = REPO / "target" / "debug" / "inband"
HOST_NS = "mb-host"
BACKEND_NS = ["mb-b1", "mb-b2"]
CGROUP = Path("/sys/fs/cgroup/unified/inband-bench-mesh")
VIP = "10.96.0.10"
BACKEND_PORT = 8080
BODY = "x" * 63 + "\n"
HOPS = 9
# The message-size sweep's sizes (the seed's Figure 6 swept payloads from
# zero up past where its NIC saturated; the issue asks for 64 B to 1 MB).
SIZES = [64, 1024, 16384, 262144, 1048576]
# Where a backend's /upload passes its bodyless request, on its own loopback.
ANSWER_PORT = 8090
DIRECTIONS = {"response": "responses of N bytes (GET)", "request": "requests of N bytes (POST body)"}

SYSTEMS = {
    "direct": "direct (no balancer)",
    "mesh": "inband mesh",
    "haproxy": "HAProxy sidecar",
    "nginx": "nginx sidecar",
    "proxy": "inband proxy sidecar",
}
SIDECAR_PORT = {"haproxy": 15100, "nginx": 15200, "proxy": 15300}


@dataclass(frozen=True)
class Profile:
    conns: list[int]
    seconds: int
    chain_conns: list[int]
    chain_seconds: int
    systems: list[str]
    # Every system is measured once per round, rounds one after another,
    # so a drift of the machine spreads over all of them; the tables give
    # the mean of the rounds.
    rounds: int = 1
    # The message-size sweep: sizes, at one connection count, seconds per cell.
    sizes: tuple = tuple(SIZES)
    size_conns: int = 32
    size_seconds: int = 3


PROFILES = {
    "default": Profile([1, 8, 32, 128], 5, [1, 8], 4, list(SYSTEMS), rounds=3),
    "quick": Profile([1, 32, 128], 3, [1], 3, list(SYSTEMS)),
    "tiny": Profile([1, 8], 1, [1], 1, list(SYSTEMS), sizes=(64, 1048576), size_conns=4, size_seconds=1),
}



def backend_ip(i: int) -> str:
    return f"10.77.{i + 1}.2"


# ------------------------------------------------------------ configurations


def _nginx(prefix: str, name: str, connections: int, http_body: str) -> str:
    """One worker, no logs, keep-alive without limit; files under prefix."""
    return f"""\
worker_processes 1;
pid {prefix}/{name}.pid;
error_log {prefix}/{name}-error.log warn;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    keepalive_requests 10000000;
{http_body}}}
"""


def nginx_backend_conf(prefix: str, listen: str) -> str:
    """The 64-byte answer at /, the sweep's files under /size/ (prefix/size/N)
    and /upload, which reads a whole request body (in memory, any size the
    sweep sends) before it answers with the 64 bytes: nginx buffers the
    body for proxy_pass and passes on a bodyless request to a local server
    that answers. A bare `return` would answer before the body is read."""
    return _nginx(
        prefix,
        "nginx",
        4096,
        f"    upstream answer {{ server 127.0.0.1:{ANSWER_PORT}; keepalive 64; }}\n"
        f'    server {{ listen 127.0.0.1:{ANSWER_PORT}; location / {{ return 200 "{BODY.strip()}\\n"; }} }}\n'
        f"    server {{\n        listen {listen};\n"
        f'        location / {{ return 200 "{BODY.strip()}\\n"; }}\n'
        f"        location /size/ {{ root {prefix}; }}\n"
        f"        location = /upload {{\n            client_max_body_size 2m;\n            client_body_buffer_size 2m;\n"
        f"            proxy_pass http://answer;\n            proxy_pass_request_body off;\n"
        f'            proxy_set_header Content-Length "";\n            proxy_http_version 1.1;\n'
        f'            proxy_set_header Connection "";\n        }}\n    }}\n',
    )


def post_lua(size: int) -> str:
    """wrk sending every request as a POST of `size` bytes, with the summary line."""
    return f'wrk.method = "POST"\nwrk.body = string.rep("x", {int(size)})\nwrk.headers["Content-Type"] = "application/octet-stream"\n' + WRK_SUMMARY_LUA


def nginx_sidecar_conf(prefix: str, fronts: list[tuple[int, list[str]]]) -> str:
    """One worker, keep-alive to the upstreams: a sidecar set up for speed."""
    blocks = []
    for n, (port, upstreams) in enumerate(fronts):
        servers = "".join(f"        server {u};\n" for u in upstreams)
        blocks.append(
            f"    upstream u{n} {{\n{servers}        keepalive 256;\n    }}\n"
            f"    server {{\n        listen 127.0.0.1:{port};\n        location / {{\n"
            f"            proxy_pass http://u{n};\n            proxy_http_version 1.1;\n"
            f'            proxy_set_header Connection "";\n        }}\n    }}\n'
        )
    return _nginx(prefix, "sidecar", 8192, "".join(blocks))


def haproxy_http_cfg(fronts: list[tuple[int, list[str]]]) -> str:
    """http mode (it parses and balances each request, as the mesh does),
    one thread, connections to the backends reused across requests."""
    lines = [
        "global",
        "    maxconn 4000",
        "    nbthread 1",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 30s",
        "    timeout server 30s",
        "    http-reuse always",
    ]
    for n, (port, upstreams) in enumerate(fronts):
        lines += [f"frontend f{n}", f"    bind 127.0.0.1:{port}", f"    default_backend b{n}", f"backend b{n}", "    balance roundrobin"]
        lines += [f"    server s{k} {u}" for k, u in enumerate(upstreams)]
    return "\n".join(lines) + "\n"


def proxy_toml(listen: str, upstreams: list[str]) -> str:
    ups = ", ".join(f'"{u}"' for u in upstreams)
    return f'listen = "{listen}"\nbackends = [{ups}]\nworkers = 1\n'


def mesh_toml(services: list[tuple[str, list[str]]], pool: int) -> str:
    lines = [f'cgroup = "{CGROUP}"', f"pool = {pool}", 'name = "bench"', ""]
    for n, (address, upstreams) in enumerate(services):
        ups = ", ".join(f'"{u}"' for u in upstreams)
        lines += ["[[service]]", f'name = "s{n}"', f'address = "{address}"', f"backends = [{ups}]", ""]
    return "\n".join(lines)


def hop_conf(prefix: str, system: str, k: int) -> str:
    """Service k of the seed's nine-service chain: an nginx process of its
    own (services are separate programs) that calls service k + 1, the
    last one answering. Where it sends its call depends on the system:
    straight to the next hop, to the next service's address (the mesh), or
    to the sidecar's front for it."""
    port = 17000 + k
    blocks = []
    if k == HOPS - 1:
        body = f'return 200 "{BODY.strip()}\\n";'
    else:
        nxt = {
            "direct": f"127.0.0.1:{17000 + k + 1}",
            "mesh": f"10.96.1.{k + 1}:80",
            "haproxy": f"127.0.0.1:{16000 + k + 1}",
            "nginx": f"127.0.0.1:{18000 + k + 1}",
        }[system]
        blocks.append(f"    upstream next {{\n        server {nxt};\n        keepalive 32;\n    }}\n")
        body = 'proxy_pass http://next; proxy_http_version 1.1; proxy_set_header Connection "";'
    blocks.append(f"    server {{ listen 127.0.0.1:{port}; location / {{ {body} }} }}\n")
    return _nginx(prefix, f"hop{k}", 4096, "".join(blocks))


def chain_entry(system: str) -> str:
    return {"direct": "127.0.0.1:17000", "mesh": "10.96.1.0:80", "haproxy": "127.0.0.1:16000", "nginx": "127.0.0.1:18000"}[system]


def chain_fronts(first_port: int) -> list[tuple[int, list[str]]]:
    return [(first_port + k, [f"127.0.0.1:{17000 + k}"]) for k in range(HOPS)]


# ------------------------------------------------------------ measurement




def in_cgroup(argv: list[str]) -> list[str]:
    """argv in the client cgroup and the client host's namespace."""
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *ns_argv(HOST_NS, argv)]


@dataclass
class Point:
    system: str
    conns: int
    rps: float
    p50_us: int
    p99_us: int
    errors: int
    cpu_us: float  # whole host, per request
    added_us: float | None = None  # over direct at the same connections
    # The message-size sweep's points: which way the N bytes went, and N.
    direction: str = ""
    size: int = 0


@dataclass
class Results:
    profile: str
    points: list[Point] = field(default_factory=list)  # the mean of the rounds
    rounds: list[Point] = field(default_factory=list)  # every measurement
    chain: list[Point] = field(default_factory=list)
    sizes: list[Point] = field(default_factory=list)
    breakdown: dict = field(default_factory=dict)
    # The mesh's counters after each of its runs: its fallbacks and
    # user-space relays, which should be none for this workload.
    mesh_counters: dict = field(default_factory=dict)
    # µs per request by perf group, for direct, the mesh and HAProxy.
    profiles: dict = field(default_factory=dict)
    # The same at the sweep's largest response, for every system run:
    # where a large response's time goes, the mesh's paid per segment.
    size_profiles: dict = field(default_factory=dict)


class Bench:
    def __init__(self, profile: Profile, work: Path, perf: bool = False) -> None:
        self.p = profile
        self.perf = perf
        self.work = work
        self.procs = Procs()
        self.lua = work / "bench.lua"
        self.lua.write_text(WRK_SUMMARY_LUA)

    # --- testbed

    def setup(self) -> None:
        self.teardown_testbed()
        # The backends' workers (nginx's unprivileged user) read the
        # sweep's files from here.
        self.work.chmod(0o755)
        run(None, ["ip", "netns", "add", HOST_NS])
        run(HOST_NS, ["ip", "link", "set", "lo", "up"])
        for i, ns in enumerate(BACKEND_NS):
            run(None, ["ip", "netns", "add", ns])
            run(ns, ["ip", "link", "set", "lo", "up"])
            run(None, ["ip", "link", "add", f"mbh{i}", "netns", HOST_NS, "type", "veth", "peer", "name", f"mbb{i}", "netns", ns])
            run(HOST_NS, ["ip", "addr", "add", f"10.77.{i + 1}.1/24", "dev", f"mbh{i}"])
            run(ns, ["ip", "addr", "add", f"{backend_ip(i)}/24", "dev", f"mbb{i}"])
            run(HOST_NS, ["ip", "link", "set", f"mbh{i}", "up"])
            run(ns, ["ip", "link", "set", f"mbb{i}", "up"])
            d = self.work / ns
            (d / "size").mkdir(parents=True, exist_ok=True)
            for n in self.p.sizes:
                (d / "size" / str(n)).write_bytes(b"x" * n)
            (d / "nginx.conf").write_text(nginx_backend_conf(str(d), f"0.0.0.0:{BACKEND_PORT}"))
            self.procs.spawn(ns, ns, ["nginx", "-c", str(d / "nginx.conf"), "-g", "daemon off;"], d / "log")
        CGROUP.mkdir(exist_ok=True)
        for i in range(len(BACKEND_NS)):
            wait_until(f"backend {i}", lambda i=i: self.curl(f"http://{backend_ip(i)}:{BACKEND_PORT}/") == BODY, 10)

    def teardown_testbed(self) -> None:
        for ns in [HOST_NS, *BACKEND_NS]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if CGROUP.exists():
            for pid in (CGROUP / "cgroup.procs").read_text().split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            for _ in range(50):
                try:
                    CGROUP.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    def curl(self, url: str) -> str:
        cp = subprocess.run(in_cgroup(["curl", "-sS", "-m", "3", url]), capture_output=True, text=True, timeout=10)
        return cp.stdout

    # --- systems

    def start(self, system: str, fronts: list[tuple[int, list[str]]], services: list[tuple[str, list[str]]], pool: int) -> None:
        d = self.work / system
        d.mkdir(exist_ok=True)
        if system == "haproxy":
            (d / "haproxy.cfg").write_text(haproxy_http_cfg(fronts))
            self.procs.spawn(system, HOST_NS, ["haproxy", "-db", "-f", str(d / "haproxy.cfg")], d / "log")
        elif system == "nginx":
            (d / "sidecar.conf").write_text(nginx_sidecar_conf(str(d), fronts))
            self.procs.spawn(system, HOST_NS, ["nginx", "-c", str(d / "sidecar.conf"), "-g", "daemon off;"], d / "log")
        elif system == "proxy":
            for n, (port, ups) in enumerate(fronts):
                (d / f"proxy{n}.toml").write_text(proxy_toml(f"127.0.0.1:{port}", ups))
                self.procs.spawn(f"proxy{n}", HOST_NS, [str(INBAND), "proxy", "--config", str(d / f"proxy{n}.toml")], d / "log")
        elif system == "mesh":
            (d / "mesh.toml").write_text(mesh_toml(services, pool))
            self.procs.spawn(system, HOST_NS, [str(INBAND), "mesh", "run", "--config", str(d / "mesh.toml")], d / "log")

    def stop(self) -> None:
        """Everything but the backends."""
        self.procs.stop_except(set(BACKEND_NS))

    def measure(self, system: str, urls: list[str], conns: int, seconds: int, lua: Path | None = None) -> Point:
        """Closed-loop load for `seconds`; several urls split the connections
        (direct's two backends). `lua`: wrk's script (default: GET, summary)."""
        split = [max(1, conns // len(urls))] * len(urls) if conns >= len(urls) else [conns]
        urls = urls[: len(split)]
        c0, t0 = cpu_busy_s(), time.monotonic()
        procs = [
            subprocess.Popen(
                in_cgroup(["wrk", "-t1", f"-c{c}", f"-d{seconds}s", "--timeout", "5s", "-s", str(lua or self.lua), u]),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for u, c in zip(urls, split)
        ]
        outs = [p.communicate(timeout=seconds + 30) for p in procs]
        cpu = cpu_busy_s() - c0
        elapsed = time.monotonic() - t0
        ws = []
        for p, (o, e) in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"wrk failed ({p.returncode}): {e.strip()[-400:]}")
            ws.append(parse_wrk(o))
        requests = sum(w["requests"] for w in ws)
        duration = max(w["duration_us"] for w in ws) / 1e6 or elapsed
        return Point(
            system=system,
            conns=conns,
            rps=requests / duration,
            p50_us=int(sum(w["p50_us"] for w in ws) / len(ws)),
            p99_us=max(w["p99_us"] for w in ws),
            errors=sum(w["errors"] + w["status_errors"] for w in ws),
            cpu_us=cpu / max(requests, 1) * 1e6,
        )

    def settle(self) -> None:
        time.sleep(0.5)

    # --- runs

    def balance(self, res: Results) -> None:
        backends = [f"{backend_ip(i)}:{BACKEND_PORT}" for i in range(len(BACKEND_NS))]
        pool = max(self.p.conns)
        for r in range(self.p.rounds):
            for system in self.p.systems:
                port = SIDECAR_PORT.get(system)
                self.start(system, [(port, backends)] if port else [], [(f"{VIP}:80", backends)], pool)
                entry = {"direct": None, "mesh": f"{VIP}:80"}.get(system, f"127.0.0.1:{port}")
                urls = [f"http://{b}/" for b in backends] if entry is None else [f"http://{entry}/"]
                wait_until(f"{SYSTEMS[system]} to answer", lambda: self.curl(urls[0]) == BODY, 15)
                if system == "mesh":
                    self.mesh_ready()
                for conns in self.p.conns:
                    self.settle()
                    pt = self.measure(system, urls, conns, self.p.seconds)
                    res.rounds.append(pt)
                    print(
                        f"  round {r + 1} {SYSTEMS[system]:<24} c={conns:<4} {pt.rps:>9.0f} req/s  p99 {pt.p99_us} us  "
                        f"{pt.cpu_us:.1f} us CPU/req",
                        flush=True,
                    )
                if system == "mesh" and r == 0:
                    res.breakdown = self.breakdown(urls)
                    res.mesh_counters["balance"] = mesh_counters()
                if self.perf and r == 0 and system in ("direct", "mesh", "haproxy"):
                    res.profiles[system] = self.profile(system, urls, self.p.conns[len(self.p.conns) // 2], self.p.seconds)
                self.stop()
        res.points = mean_points(res.rounds)
        direct = {p.conns: p for p in res.points if p.system == "direct"}
        for p in res.points:
            if p.conns in direct:
                p.added_us = p.cpu_us - direct[p.conns].cpu_us

    def profile(self, system: str, urls: list[str], conns: int, seconds: int) -> dict[str, float]:
        """µs per request by perf group, `conns` connections on `urls` for
        `seconds`."""
        data = self.work / f"perf-{system}.data"
        rec = subprocess.Popen(
            ["perf", "record", "-a", "-F", "1999", "-o", str(data), "--", "sleep", str(seconds)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        pt = self.measure(system, urls, conns, seconds)
        rec.wait(timeout=60)
        cp = subprocess.run(
            ["perf", "report", "-i", str(data), "--stdio", "-n", "--no-children", "-g", "none", "--sort", "sym"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        data.unlink(missing_ok=True)
        requests = pt.rps * seconds
        out = {g: ns / 1e3 / max(requests, 1) for g, ns in parse_perf_report(cp.stdout).items() if g != "idle"}
        out["conns"] = conns
        out["rps"] = pt.rps
        return out

    def mesh_ready(self) -> None:
        def ready() -> bool:
            cp = run(HOST_NS, [str(INBAND), "mesh", "status", "--name", "bench", "--json"], check=False)
            st = json.loads(cp.stdout) if cp.returncode == 0 else {}
            return bool(st.get("backends")) and all(b["up"] and b["free"] == b["pool"] for b in st["backends"])

        wait_until("the mesh's pools", ready, 15)

    def breakdown(self, urls: list[str]) -> dict:
        """The mesh's two programs' run time per request (bpf_stats) at the
        middle connection count."""
        conns = self.p.conns[len(self.p.conns) // 2]
        subprocess.run(["sysctl", "-qw", "kernel.bpf_stats_enabled=1"], check=True)
        try:
            before = prog_stats()
            pt = self.measure("mesh", urls, conns, self.p.seconds)
            after = prog_stats()
        finally:
            subprocess.run(["sysctl", "-qw", "kernel.bpf_stats_enabled=0"], check=True)
        requests = pt.rps * self.p.seconds
        out = {"conns": conns, "rps": pt.rps, "cpu_us": pt.cpu_us}
        for name in ("mesh_request", "mesh_response"):
            ns = after.get(name, (0, 0))[0] - before.get(name, (0, 0))[0]
            runs = after.get(name, (0, 0))[1] - before.get(name, (0, 0))[1]
            out[name] = {"us_per_request": ns / 1e3 / max(requests, 1), "runs": runs}
        return out

    def sizes(self, res: Results) -> None:
        """The seed's message-size sweep: every system at `size_conns`
        connections, for each size one way and the other."""
        backends = [f"{backend_ip(i)}:{BACKEND_PORT}" for i in range(len(BACKEND_NS))]
        conns = self.p.size_conns
        for system in self.p.systems:
            port = SIDECAR_PORT.get(system)
            self.start(system, [(port, backends)] if port else [], [(f"{VIP}:80", backends)], conns)
            entries = backends if system == "direct" else [f"{VIP}:80" if system == "mesh" else f"127.0.0.1:{port}"]
            wait_until(f"{SYSTEMS[system]} to answer", lambda: self.curl(f"http://{entries[0]}/") == BODY, 15)
            if system == "mesh":
                self.mesh_ready()
            for direction in DIRECTIONS:
                for n in self.p.sizes:
                    lua = None
                    if direction == "request":
                        lua = self.work / f"post-{n}.lua"
                        lua.write_text(post_lua(n))
                    path = f"/size/{n}" if direction == "response" else "/upload"
                    self.settle()
                    pt = self.measure(system, [f"http://{e}{path}" for e in entries], conns, self.p.size_seconds, lua)
                    pt.direction, pt.size = direction, n
                    res.sizes.append(pt)
                    print(f"  size {SYSTEMS[system]:<24} {direction:<8} {n:>8} B {pt.rps:>9.0f} req/s  p99 {pt.p99_us} us", flush=True)
            if self.perf:
                n = max(self.p.sizes)
                res.size_profiles[system] = {**self.profile(system, [f"http://{e}/size/{n}" for e in entries], conns, self.p.size_seconds), "size": n}
            if system == "mesh":
                res.mesh_counters["sizes"] = mesh_counters()
            self.stop()

    def chain(self, res: Results) -> None:
        for system in [s for s in self.p.systems if s != "proxy"]:
            d = self.work / f"chain-{system}"
            d.mkdir(exist_ok=True)
            services = [(f"10.96.1.{k}:80", [f"127.0.0.1:{17000 + k}"]) for k in range(HOPS)]
            fronts = {"haproxy": chain_fronts(16000), "nginx": chain_fronts(18000)}.get(system, [])
            self.start(system, fronts, services, max(self.p.chain_conns) * 2)
            # In the cgroup: the hops are the applications whose calls the mesh balances.
            for k in range(HOPS):
                (d / f"hop{k}.conf").write_text(hop_conf(str(d), system, k))
                self.procs.spawn(f"hop{k}", None, in_cgroup(["nginx", "-c", str(d / f"hop{k}.conf"), "-g", "daemon off;"]), d / "log")
            url = f"http://{chain_entry(system)}/"
            wait_until(f"the chain through {SYSTEMS[system]}", lambda: self.curl(url) == BODY, 15)
            for conns in self.p.chain_conns:
                self.settle()
                pt = self.measure(system, [url], conns, self.p.chain_seconds)
                res.chain.append(pt)
                print(f"  chain {SYSTEMS[system]:<20} c={conns:<3} p50 {pt.p50_us} us  p99 {pt.p99_us} us", flush=True)
            if system == "mesh":
                res.mesh_counters["chain"] = mesh_counters()
            self.stop()


# Where CPU time goes, by kernel symbol (first matching group wins): the
# seed's breakdown (parsing, balancing, splicing, socket, kernel stack) as
# far as symbol names tell it.
PERF_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("idle", ("pv_native_safe_halt", "default_idle", "cpu_idle", "do_idle", "native_safe_halt", "acpi_idle", "intel_idle")),
    ("BPF programs and their helpers", ("bpf_", "__bpf", "htab_", "__htab", "array_map", "percpu_array", "jhash")),
    (
        "sockmap redirection: psock queues, work items",
        ("sk_psock", "sk_msg", "tcp_bpf", "sock_map", "sock_hash", "skb_to_sgvec", "__skb_to_sgvec", "queue_delayed_work",
         "__queue_work", "process_one_work", "worker_thread", "insert_work", "tcp_eat_skb", "tcp_read_skb", "sk_skb"),
    ),
    (
        "scheduling and wake-ups",
        ("finish_task_switch", "__schedule", "schedule", "try_to_wake_up", "ttwu", "_raw_spin_unlock_irq", "enqueue_",
         "dequeue_", "pick_next", "update_curr", "update_load", "select_task_rq", "__wake_up", "autoremove_wake", "psi_",
         "sched_", "set_next_entity", "put_prev", "raw_spin_rq", "wake_up", "prepare_task_switch", "__switch_to",
         "switch_mm", "native_sched_clock", "read_tsc", "__raw_callee_save"),
    ),
    (
        "TCP/IP stack and veth",
        ("tcp", "__tcp", "ip_", "__ip", "inet", "__inet", "veth", "net_rx", "__netif", "netif", "napi", "__napi", "dev_",
         "__dev", "skb_", "__skb", "kfree_skb", "__kfree_skb", "sk_", "__sk", "sock_", "__sock", "lock_sock",
         "release_sock", "bbr", "nf_", "ipv4", "__alloc_skb", "alloc_skb", "consume_skb", "__local_bh", "do_softirq",
         "__do_softirq", "process_backlog", "__release_sock", "security_sock", "eth_", "ktime_get", "__napi"),
    ),
    (
        "system calls, epoll, copies",
        ("do_syscall", "entry_SYSCALL", "syscall_", "__x64_sys", "ksys_", "do_epoll", "ep_", "__fget", "fdget", "fput",
         "copy_", "_copy", "__check_object_size", "rw_verify", "vfs_", "new_sync", "__sys_", "exit_to_user_mode",
         "import_", "iov_iter", "rep_movs", "memcpy", "memset", "clear_", "fsnotify", "__fsnotify", "security_file",
         "apparmor", "aa_", "__fdget", "__x86_return", "entry_", "__rcu", "rcu_"),
    ),
]


def perf_group(sym: str) -> str:
    if sym.startswith("[.]"):
        return "user space: load generator, backends, sidecar"
    name = sym.removeprefix("[k] ").strip()
    for group, prefixes in PERF_GROUPS:
        if name.startswith(prefixes):
            return group
    return "other kernel"


def parse_perf_report(text: str) -> dict[str, float]:
    """Nanoseconds per group from `perf report --stdio -n --sort sym` of a
    cpu-clock recording (its event count is in ns)."""
    total_ns = 0.0
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# Event count (approx.):"):
            total_ns = float(line.split(":")[1])
            continue
        f = line.split(None, 2)
        if len(f) == 3 and f[0].endswith("%") and not line.startswith("#"):
            share = float(f[0].rstrip("%")) / 100
            g = perf_group(f[2])
            out[g] = out.get(g, 0.0) + share * total_ns
    return out


def mean_points(rounds: list[Point]) -> list[Point]:
    """One point per (system, connections): the mean of its rounds (errors summed)."""
    keys = list(dict.fromkeys((p.system, p.conns) for p in rounds))
    out = []
    for system, conns in keys:
        ps = [p for p in rounds if p.system == system and p.conns == conns]
        n = len(ps)
        out.append(
            Point(
                system=system,
                conns=conns,
                rps=sum(p.rps for p in ps) / n,
                p50_us=round(sum(p.p50_us for p in ps) / n),
                p99_us=round(sum(p.p99_us for p in ps) / n),
                errors=sum(p.errors for p in ps),
                cpu_us=sum(p.cpu_us for p in ps) / n,
            )
        )
    return out


def mesh_counters() -> dict[str, int]:
    cp = run(HOST_NS, [str(INBAND), "mesh", "status", "--name", "bench", "--json"], check=False)
    return dict(json.loads(cp.stdout)["counters"]) if cp.returncode == 0 else {}


def prog_stats() -> dict[str, tuple[int, int]]:
    cp = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True)
    out = {}
    for p in json.loads(cp.stdout):
        if p.get("name") in ("mesh_request", "mesh_response"):
            ns, n = out.get(p["name"], (0, 0))
            out[p["name"]] = (ns + p.get("run_time_ns", 0), n + p.get("run_cnt", 0))
    return out


# ------------------------------------------------------------ report


TOOLS = {"wrk": ["wrk", "-v"], "haproxy": ["haproxy", "-v"], "nginx": ["nginx", "-v"]}


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    r = dict(record["rows"])
    for k in ("points", "rounds", "chain", "sizes"):
        r[k] = [revive(Point, x) for x in r.get(k, [])]
    return provenance(record) + "\n\n" + report(revive(Results, r))


def report(res: Results) -> str:
    rounds = max((sum(1 for q in res.rounds if (q.system, q.conns) == (p.system, p.conns)) for p in res.points), default=0) or 1
    md = []
    if res.points:
        md = [f"## Socket-layer L7 balancing: req/s, latency, CPU per request (profile {res.profile}, mean of {rounds} rounds)", ""]
        md.append("| system | connections | req/s | ×direct | ×best sidecar | p50 µs | p99 µs | errors | host CPU µs/req | added over direct µs/req |")
        md.append("|---|---|---|---|---|---|---|---|---|---|")
    by = {(p.system, p.conns): p for p in res.points}
    conns = sorted({p.conns for p in res.points})
    for c in conns:
        sidecars = [by[(s, c)] for s in ("haproxy", "nginx", "proxy") if (s, c) in by]
        best = max(sidecars, key=lambda p: p.rps) if sidecars else None
        d = by.get(("direct", c))
        for s in SYSTEMS:
            p = by.get((s, c))
            if not p:
                continue
            xd = f"{p.rps / d.rps:.2f}×" if d else "-"
            xb = f"{p.rps / best.rps:.2f}×" if best else "-"
            added = f"{p.added_us:.1f}" if p.added_us is not None else "-"
            md.append(
                f"| {SYSTEMS[s]} | {c} | {p.rps:,.0f} | {xd} | {xb} | {p.p50_us} | {p.p99_us} | {p.errors} | {p.cpu_us:.1f} | {added} |"
            )
    if res.chain:
        md += ["", f"## Nine-service chain (profile {res.profile})", ""]
        md.append("| system | connections | req/s | p50 µs | p99 µs | p50 vs best sidecar | errors |")
        md.append("|---|---|---|---|---|---|---|")
        cby = {(p.system, p.conns): p for p in res.chain}
        for c in sorted({p.conns for p in res.chain}):
            sides = [cby[(s, c)] for s in ("haproxy", "nginx") if (s, c) in cby]
            best = min(sides, key=lambda p: p.p50_us) if sides else None
            for s in SYSTEMS:
                p = cby.get((s, c))
                if not p:
                    continue
                vs = f"{(p.p50_us / best.p50_us - 1) * 100:+.0f}%" if best else "-"
                md.append(f"| {SYSTEMS[s]} | {c} | {p.rps:,.0f} | {p.p50_us} | {p.p99_us} | {vs} | {p.errors} |")
    if res.sizes:
        md += ["", sizes_table(res), ""]
    b = res.breakdown
    if b:
        d = by.get(("direct", b["conns"]))
        md += ["", f"## Where the mesh's time goes ({b['conns']} connections, bpf_stats on)", ""]
        md.append("| part | µs per request |")
        md.append("|---|---|")
        md.append(f"| request program: parse, route, balance, claim a slot | {b['mesh_request']['us_per_request']:.2f} |")
        md.append(f"| response program: frame, release, redirect | {b['mesh_response']['us_per_request']:.2f} |")
        if d:
            md.append(f"| host CPU per request in this run: mesh / direct (the perf table below splits it) | {b['cpu_us']:.1f} / {d.cpu_us:.1f} |")
    if res.profiles:
        conns = next(iter(res.profiles.values()))["conns"]
        md += profile_table(f"Where every system's time goes ({conns} connections, perf, µs of CPU per request)", res.profiles, ("direct", "mesh", "haproxy"), 2)
    if res.size_profiles:
        first = next(iter(res.size_profiles.values()))
        heading = f"Where a {size_label(first['size'])} response's time goes ({first['conns']} connections, perf, µs of CPU per response)"
        md += profile_table(heading, res.size_profiles, tuple(SYSTEMS), 1)
        systems = [s for s in SYSTEMS if s in res.size_profiles]
        md.append("| responses a second while profiled | " + " | ".join(f"{res.size_profiles[s]['rps']:,.0f}" for s in systems) + " |")
    for part, counters in res.mesh_counters.items():
        moved = {k: v for k, v in counters.items() if v and (k.startswith("fallback_") or k == "response_user")}
        md.append(
            f"\nThe mesh in the {part} runs: {counters.get('request_kernel', 0):,} requests by the kernel path, "
            + (", ".join(f"{k} {v:,}" for k, v in moved.items()) if moved else "none handed to the daemon")
            + "."
        )
    return "\n".join(md) + "\n"


def profile_table(heading: str, profiles: dict, order: tuple, digits: int) -> list[str]:
    """A perf profile per system (µs by perf group, as `Bench.profile`
    gives them), as a table with a column per system of `order` profiled,
    and the total."""
    systems = [s for s in order if s in profiles]
    groups = [g for g, _ in PERF_GROUPS if g != "idle"] + ["other kernel", "user space: load generator, backends, sidecar"]
    md = ["", f"## {heading}", "", "| part | " + " | ".join(SYSTEMS[s] for s in systems) + " |", "|---|" + "---|" * len(systems)]
    for g in groups:
        md.append(f"| {g} | " + " | ".join(f"{profiles[s].get(g, 0.0):.{digits}f}" for s in systems) + " |")
    total = {s: sum(v for k, v in profiles[s].items() if k not in ("conns", "rps", "size")) for s in systems}
    md.append("| total | " + " | ".join(f"{total[s]:.{digits}f}" for s in systems) + " |")
    return md


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def sizes_table(res: Results) -> str:
    """The sweep: req/s of every system per direction and size, the mesh's
    ratios to direct and to the best sidecar, and the payload rate."""
    conns = res.sizes[0].conns
    by = {(p.system, p.direction, p.size): p for p in res.sizes}
    systems = [s for s in SYSTEMS if any(p.system == s for p in res.sizes)]
    md = [f"## Message sizes ({conns} connections, req/s)", ""]
    md.append("| way | size | " + " | ".join(SYSTEMS[s] for s in systems) + " | mesh ÷ direct | mesh ÷ best sidecar | mesh MB/s | mesh p99 µs | best sidecar p99 µs |")
    md.append("|---|---|" + "---|" * (len(systems) + 5))
    for direction in DIRECTIONS:
        for n in sorted({p.size for p in res.sizes if p.direction == direction}):
            row = {s: by.get((s, direction, n)) for s in systems}
            sidecars = [p for s, p in row.items() if p and s in SIDECAR_PORT]
            best = max(sidecars, key=lambda p: p.rps) if sidecars else None
            mesh, direct = row.get("mesh"), row.get("direct")
            cells = [f"{p.rps:,.0f}" + (f" ({p.errors} errors)" if p.errors else "") if p else "-" for p in row.values()]
            md.append(
                f"| {direction} | {size_label(n)} | " + " | ".join(cells)
                + f" | {f'{mesh.rps / direct.rps:.2f}×' if mesh and direct else '-'}"
                + f" | {f'{mesh.rps / best.rps:.2f}×' if mesh and best else '-'}"
                + f" | {f'{mesh.rps * n / 1e6:,.1f}' if mesh else '-'}"
                + f" | {mesh.p99_us if mesh else '-'} | {best.p99_us if best else '-'} |"
            )
    return "\n".join(md)


def plot(res: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s, label in SYSTEMS.items():
        pts = sorted((p for p in res.points if p.system == s), key=lambda p: p.conns)
        if not pts:
            continue
        a.plot([p.conns for p in pts], [p.rps for p in pts], marker="o", label=label)
        b.plot([p.conns for p in pts], [p.p99_us / 1000 for p in pts], marker="o", label=label)
    for ax, t in ((a, "req/s"), (b, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("connections")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    if not res.sizes:
        return
    fig, axes = plt.subplots(1, len(DIRECTIONS), figsize=(11, 4))
    for ax, (direction, what) in zip(axes, DIRECTIONS.items()):
        for s, label in SYSTEMS.items():
            pts = sorted((p for p in res.sizes if p.system == s and p.direction == direction), key=lambda p: p.size)
            if pts:
                ax.plot([p.size for p in pts], [p.rps for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_title(f"req/s, {what}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_name("mesh-sizes.png"), dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the run's figure (created)")
    ap.add_argument("--results", type=Path, default=default_dir("mesh"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--profile", choices=list(PROFILES), default="default")
    ap.add_argument("--systems", help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--parts", default="balance,chain,sizes", help="balance, chain, sizes, or several (comma-separated)")
    ap.add_argument("--no-perf", action="store_true", help="skip the perf profiles of direct, the mesh and HAProxy")
    args = ap.parse_args(argv)
    refused = preflight.refuse(preflight.problems(inband=str(INBAND), tools=("wrk", "haproxy", "nginx")))
    if refused:
        return refused
    if not Path("/sys/fs/cgroup/unified/cgroup.procs").exists():
        print("no cgroup v2 at /sys/fs/cgroup/unified: the mesh attaches to a cgroup v2", file=sys.stderr)
        return 2
    profile = PROFILES[args.profile]
    if args.systems:
        chosen = args.systems.split(",")
        unknown = [s for s in chosen if s not in SYSTEMS]
        if unknown:
            print(f"unknown systems {unknown}: choose from {','.join(SYSTEMS)}", file=sys.stderr)
            return 2
        profile = replace(profile, systems=chosen)
    args.out.mkdir(parents=True, exist_ok=True)
    this_run = Run("mesh", "bench.mesh", argv)
    res = Results(profile=args.profile)
    stop_signals_interrupt()
    with tempfile.TemporaryDirectory(prefix="bench-mesh-") as tmp:
        perf = not args.no_perf and shutil.which("perf") is not None
        b = Bench(profile, Path(tmp), perf=perf)
        try:
            b.setup()
            parts = args.parts.split(",")
            if "balance" in parts:
                b.balance(res)
            if "chain" in parts:
                b.chain(res)
            if "sizes" in parts:
                b.sizes(res)
        finally:
            with uninterruptible():
                b.procs.stop_all()
                b.teardown_testbed()
    record = this_run.record(asdict(res), profile={"name": args.profile, **asdict(profile)}, inband=INBAND, tools=TOOLS)
    write_results(args.results, record, render(record))
    plot(res, args.out / "mesh.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

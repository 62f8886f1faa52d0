"""`inband proxy` at the front door: TLS and HTTP/2 against nginx and
HAProxy (issue 33's targets), in one run:

    python -m bench.frontdoor --out DIR [--quick]

In front of one origin (bench/lib/origin.py, 10 KiB objects that
say `max-age`): inband proxy (LMDB cache, its TLS listener), nginx
(`proxy_cache`, `ssl`, `http2`) and HAProxy (its cache, `ssl`, ALPN
h2), configured alike: one ECDSA P-256 certificate made for the run, TLS
1.2 and 1.3, a session cache and tickets, as many workers (threads) as
CPUs. Beside them the limit: nginx serving the same objects as files
over the same TLS, no proxy and no cache. Each cache is filled first
(every object once, over HTTPS), then each system in turn, for
`--rounds` interleaved rounds:

1. TLS handshakes per second: `openssl s_time` (one client, a new
   connection each time, no request), full (`-new`) and resumed
   (`-reuse`); that a session does resume is checked once per system
   with `openssl s_client -sess_out/-sess_in`;
2. HTTPS hits: wrk (one thread, 50 keep-alive connections) over TLS,
   the zipfian paths of bench.proxy;
3. HTTP/2 hits: h2load (8 connections x 10 streams) over TLS with ALPN
   h2, the same zipfian paths from a list.

Medians of the rounds; ratios to nginx and to the limit; CPU per
request of each system's own processes (utime + stime of its session).
Before each measurement it waits out builds and bench.forwarding (as
bench.proxy does, at most --wait-quiet seconds over the whole run) and
records what it found.
Prints Markdown tables and writes the record (results.json) and its
tables (results.md) into --results (default bench/results/frontdoor).
Everything it starts is stopped at the end, on Ctrl-C too. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .lib import peers, preflight, profiles
from .lib.host import session_cpu_s
from .lib.origin import STATS_PATH, body_for
from .lib.procs import Procs, stop_signals_interrupt, wait_until
from .lib.results import REPO, Run, default_dir, provenance
from .lib.results import write as write_results
from .lib.systems import System
from .lib.tools import parse_wrk
from .proxy import HOST, WRK_LUA, free_port, wait_quiet

CAPACITY = 1 << 30  # far above the data set: nothing is evicted
TICKET_WAIT_S = 10.0  # bound on the wait for a TLS 1.3 ticket


SYSTEMS = [
    System("inband", "inband proxy (LMDB)"),
    System("nginx", "nginx proxy_cache"),
    System("haproxy", "HAProxy cache"),
    System("static", "limit: nginx static files"),
]
BY_KEY = {s.key: s for s in SYSTEMS}


@dataclass(frozen=True)
class Profile:
    objects: int
    object_bytes: int
    zipf: float
    rounds: int
    seconds: int  # per measurement
    wrk_connections: int
    h2_connections: int
    h2_streams: int


PROFILES = {
    "default": Profile(objects=5000, object_bytes=10240, zipf=0.99, rounds=3, seconds=5, wrk_connections=50, h2_connections=8, h2_streams=10),
    # The test's: every part runs, nothing is measured well.
    "quick": Profile(objects=50, object_bytes=10240, zipf=0.99, rounds=1, seconds=1, wrk_connections=8, h2_connections=2, h2_streams=4),
}

TOOLS = {
    "nginx": ["nginx", "-v"],
    "haproxy": ["haproxy", "-v"],
    "openssl": ["openssl", "version"],
    "wrk": ["wrk", "-v"],
    "h2load": ["h2load", "--version"],
}


@dataclass
class Cell:
    """One system's measurements, a list per round."""

    key: str
    label: str
    full_hs: list = field(default_factory=list)  # handshakes/s
    resumed_hs: list = field(default_factory=list)
    resumed_share: list = field(default_factory=list)  # of the resumed run's connections, those that did
    resumes: bool | None = None  # a TLS 1.3 ticket resumes a session
    https: list = field(default_factory=list)  # {"rps", "p99_ms", "cpu_us"}
    h2: list = field(default_factory=list)  # {"rps", "mean_ms", "cpu_us", "failed"}


def median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2] if s else 0.0


# ------------------------------------------------------------------ configs


def make_certificate(d: Path) -> tuple[Path, Path]:
    """An ECDSA P-256 certificate for 127.0.0.1, valid for two days."""
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=bench.test",
                    "-addext", "subjectAltName=DNS:bench.test,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def inband_toml(*, plain: str, tls: str, origin: str, cache: str, cert: Path, key: Path) -> str:
    return (f'listen = "{plain}"\nbackends = ["{origin}"]\n\n[tls]\nlisten = "{tls}"\n[[tls.certificate]]\n'
            f'cert = "{cert}"\nkey = "{key}"\n\n[cache]\nbackend = "lmdb"\npath = "{cache}"\ncapacity_bytes = {CAPACITY}\n')


NGINX_TLS = """\
        listen {listen} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:TLS:16m;
        ssl_session_tickets on;
"""


def nginx_tls_conf(*, listen: str, origin: str, prefix: str, cert: Path, key: Path, workers: int, as_root: bool) -> str:
    """bench.proxy's nginx `proxy_cache`, its server over TLS and HTTP/2."""
    plain = peers.nginx_conf(listen=listen, origin=origin, prefix=prefix, max_size_bytes=CAPACITY, workers=workers, as_root=as_root)
    return plain.replace(f"        listen {listen};\n", NGINX_TLS.format(listen=listen, cert=cert, key=key))


def nginx_static_tls_conf(*, listen: str, root: str, prefix: str, cert: Path, key: Path, workers: int, as_root: bool) -> str:
    plain = peers.nginx_static_conf(listen=listen, root=root, prefix=prefix, workers=workers, as_root=as_root)
    return plain.replace(f"        listen {listen};\n", NGINX_TLS.format(listen=listen, cert=cert, key=key))


def haproxy_cfg(*, listen: str, origin: str, pem: Path, threads: int) -> str:
    """HAProxy's own cache (objects up to 1 MiB, 256 MiB in all, an hour
    at most: the origin's max-age decides below that), TLS with ALPN h2."""
    host, port = listen.rsplit(":", 1)
    return f"""\
global
    nbthread {int(threads)}
    maxconn 4096
    tune.ssl.cachesize 100000
    ssl-default-bind-options ssl-min-ver TLSv1.2

defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
    timeout http-keep-alive 30s

cache bench
    total-max-size 256
    max-object-size 1048576
    max-age 3600

frontend tls
    bind {host}:{int(port)} ssl crt {pem} alpn h2,http/1.1
    http-request cache-use bench
    http-response cache-store bench
    default_backend origin

backend origin
    http-reuse always
    server o {origin}
"""


# ------------------------------------------------------------------ the run


class Bench:
    def __init__(self, args, p: Profile, out: Path) -> None:
        self.args, self.p, self.out = args, p, out
        self.inband = Path(args.inband).resolve()
        self.procs = Procs()
        self.tmp = Path(tempfile.mkdtemp(prefix="inband-bench-frontdoor-"))
        self.cert, self.key = make_certificate(self.tmp)
        self.pem = self.tmp / "haproxy.pem"
        self.pem.write_bytes(self.cert.read_bytes() + self.key.read_bytes())
        self.origin_port = free_port()
        self.ports = {s.key: free_port() for s in SYSTEMS}
        self.plain_port = free_port()  # inband's plaintext listener, which it always has
        self.running: dict[str, subprocess.Popen] = {}
        self.lua = self.tmp / "zipf.lua"
        self.lua.write_text(WRK_LUA)
        self.uris = self.tmp / "uris"
        rng = random.Random(4)
        weights = [1 / k ** p.zipf for k in range(1, p.objects + 1)]
        paths = rng.choices(range(1, p.objects + 1), weights, k=20000)
        self.paths = [f"/obj/{k}" for k in paths]
        self.wait_budget_s = args.wait_quiet  # for all waits of the run together
        self.quiet: set[str] = set()  # what the waits found

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def settle(self) -> None:
        if self.wait_budget_s <= 0:
            self.quiet.add("not waited for (--wait-quiet 0)" if self.args.wait_quiet <= 0 else "not waited for (the --wait-quiet time was used up)")
            return
        t0 = time.monotonic()
        self.quiet.add(wait_quiet(self.wait_budget_s, self.log, hold_s=2))
        self.wait_budget_s -= time.monotonic() - t0

    def url(self, s: System) -> str:
        return f"https://{HOST}:{self.ports[s.key]}"

    def start_origin(self) -> None:
        argv = [sys.executable, "-m", "bench.lib.origin", "--listen", f"{HOST}:{self.origin_port}", "--object-bytes", str(self.p.object_bytes)]
        self.procs.spawn("origin", None, argv, self.out / "logs" / "origin.log", cwd=REPO)
        wait_until("the origin", lambda: self.get(f"http://{HOST}:{self.origin_port}{STATS_PATH}") == 200, 20)

    def get(self, url: str) -> int:
        cp = subprocess.run(["curl", "-sk", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "3", url], capture_output=True, text=True)
        return int(cp.stdout or 0)

    def argv(self, s: System) -> list[str]:
        state = self.tmp / s.key
        state.mkdir(exist_ok=True)
        listen = f"{HOST}:{self.ports[s.key]}"
        origin = f"{HOST}:{self.origin_port}"
        cfg = self.out / "configs"
        cfg.mkdir(parents=True, exist_ok=True)
        workers, root = os.cpu_count() or 1, os.geteuid() == 0
        if s.key == "inband":
            (cfg / "inband.toml").write_text(inband_toml(plain=f"{HOST}:{self.plain_port}", tls=listen, origin=origin, cache=str(state / "cache"),
                                                         cert=self.cert, key=self.key))
            return [str(self.inband), "proxy", "--config", str(cfg / "inband.toml")]
        if s.key == "haproxy":
            (cfg / "haproxy.cfg").write_text(haproxy_cfg(listen=listen, origin=origin, pem=self.pem, threads=workers))
            return ["haproxy", "-db", "-f", str(cfg / "haproxy.cfg")]
        if s.key == "nginx":
            text = nginx_tls_conf(listen=listen, origin=origin, prefix=str(state), cert=self.cert, key=self.key, workers=workers, as_root=root)
        else:
            files = state / "root" / "obj"
            files.mkdir(parents=True, exist_ok=True)
            for k in range(1, self.p.objects + 1):
                (files / str(k)).write_bytes(body_for(f"/obj/{k}", self.p.object_bytes))
            text = nginx_static_tls_conf(listen=listen, root=str(state / "root"), prefix=str(state), cert=self.cert, key=self.key,
                                         workers=workers, as_root=root)
        (cfg / f"{s.key}.conf").write_text(text)
        return ["nginx", "-c", str(cfg / f"{s.key}.conf"), "-p", str(state), "-e", str(state / "error.log"), "-g", "daemon off;"]

    def start(self, s: System) -> None:
        env = dict(os.environ, INBAND_LOG="warn")  # no access log: the peers keep none either
        self.running[s.key] = self.procs.spawn(s.key, None, self.argv(s), self.out / "logs" / f"{s.key}.log", env=env, cwd=self.tmp)
        wait_until(f"{s.label} over TLS", lambda: self.running[s.key].poll() is None and self.get(self.url(s) + STATS_PATH) == 200, 30)

    def fill(self, s: System) -> None:
        """Every object once over HTTPS, each response checked for its size."""
        cfg = self.tmp / f"fill-{s.key}"
        cfg.write_text("".join(f'url = "{self.url(s)}/obj/{k}"\noutput = "/dev/null"\nwrite-out = "%{{http_code}} %{{size_download}}\\n"\n'
                               for k in range(1, self.p.objects + 1)))
        cp = subprocess.run(["curl", "-sk", "--parallel", "--parallel-max", "4", "-K", str(cfg)], capture_output=True, text=True, timeout=300)
        bad = [line for line in cp.stdout.splitlines() if line != f"200 {self.p.object_bytes}"]
        if cp.returncode != 0 or bad or len(cp.stdout.splitlines()) != self.p.objects:
            raise RuntimeError(f"filling {s.label}: curl {cp.returncode}, {len(bad)} bad answers, e.g. {bad[:1]}")

    def handshakes(self, s: System, resumed: bool) -> tuple[float, float]:
        """Handshakes per second, and the share of them that resumed.
        Full ones in TLS 1.3; resumed ones in TLS 1.2, since `s_time`
        reads nothing after a handshake and so never gets a TLS 1.3
        ticket (every `-reuse` connection would be a full one)."""
        argv = ["openssl", "s_time", "-connect", f"{HOST}:{self.ports[s.key]}", "-time", str(self.p.seconds)]
        argv += ["-reuse", "-tls1_2"] if resumed else ["-new", "-tls1_3"]
        t0 = time.monotonic()
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=self.p.seconds + 30)
        wall = time.monotonic() - t0
        m = re.search(r"(\d+) connections in [\d.]+s;", cp.stdout)
        if cp.returncode != 0 or not m:
            raise RuntimeError(f"openssl s_time against {s.label}: {cp.returncode} {cp.stdout[-300:]} {cp.stderr[-300:]}")
        # One mark a connection: `r` resumed, `*` full.
        marks = cp.stdout.count("r") - cp.stdout.count("reuse") - cp.stdout.count("starting"), cp.stdout.count("*")
        return int(m.group(1)) / wall, marks[0] / max(1, sum(marks))

    def resumes(self, s: System) -> bool:
        """Whether a TLS 1.3 session resumes from a ticket. Tickets come
        after the handshake, and s_client writes -sess_out only when one
        arrives: the first client stays until the file is there (on a busy
        machine that can take longer than any fixed pause), or a bound
        passes for a server that sends none."""
        sess = self.tmp / f"{s.key}.sess"
        sess.unlink(missing_ok=True)
        base = ["openssl", "s_client", "-connect", f"{HOST}:{self.ports[s.key]}", "-servername", "bench.test", "-tls1_3"]
        first = subprocess.Popen(base + ["-sess_out", str(sess)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TICKET_WAIT_S
        while not (sess.exists() and sess.stat().st_size > 0) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        first.communicate(b"", timeout=10)
        cp = subprocess.run(base + ["-sess_in", str(sess)], input="", capture_output=True, text=True, timeout=10)
        return "Reused, TLSv1.3" in cp.stdout

    def https(self, s: System) -> dict:
        sid = self.running[s.key].pid
        c0 = session_cpu_s(sid)
        argv = ["wrk", "-t1", f"-c{self.p.wrk_connections}", f"-d{self.p.seconds}s", "--timeout", "5s", "-s", str(self.lua), self.url(s) + "/"]
        env = dict(os.environ, BENCH_OBJECTS=str(self.p.objects), BENCH_ZIPF=str(self.p.zipf), BENCH_SEED="4", BENCH_PASS="0")
        cp = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=self.p.seconds + 30)
        if cp.returncode != 0:
            raise RuntimeError(f"wrk against {s.label}: {cp.stderr[-300:]}")
        w = parse_wrk(cp.stdout)
        rps = w["requests"] / (w["duration_us"] / 1e6)
        return {"rps": rps, "p99_ms": w["p99_us"] / 1e3, "cpu_us": (session_cpu_s(sid) - c0) * 1e6 / max(1, w["requests"]),
                "errors": w["errors"] + w["status_errors"]}

    def h2(self, s: System) -> dict:
        sid = self.running[s.key].pid
        self.uris.write_text("".join(f"{self.url(s)}{p}\n" for p in self.paths))
        c0 = session_cpu_s(sid)
        argv = ["h2load", "-c", str(self.p.h2_connections), "-m", str(self.p.h2_streams), "-t", "1", "-D", str(self.p.seconds),
                "-i", str(self.uris)]
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=self.p.seconds + 60)
        rps = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", cp.stdout)
        done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", cp.stdout)
        mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", cp.stdout)
        if cp.returncode != 0 or not rps or not done:
            raise RuntimeError(f"h2load against {s.label}: {cp.returncode} {cp.stdout[-500:]} {cp.stderr[-300:]}")
        if "h2" not in cp.stdout:
            raise RuntimeError(f"h2load against {s.label} did not negotiate h2: {cp.stdout[-300:]}")
        ok = int(done.group(2))
        return {"rps": float(rps.group(1)), "mean_ms": to_ms(mean.group(1)) if mean else 0.0,
                "cpu_us": (session_cpu_s(sid) - c0) * 1e6 / max(1, ok), "failed": int(done.group(3)) + int(done.group(4))}

    def teardown(self) -> None:
        self.procs.stop_all()
        shutil.rmtree(self.tmp, ignore_errors=True)


def to_ms(v: str) -> float:
    """h2load's times: 1.23ms, 456us, 1.2s."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", v)
    if not m:
        return 0.0
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


# ------------------------------------------------------------------ tables


def summary(c: dict) -> dict:
    """A cell's medians."""
    pick = lambda rows, k: median([r[k] for r in rows])  # noqa: E731
    return {"full_hs": median(c["full_hs"]), "resumed_hs": median(c["resumed_hs"]), "resumed_share": median(c["resumed_share"]),
            "resumes": c["resumes"],
            "https_rps": pick(c["https"], "rps"), "https_p99_ms": pick(c["https"], "p99_ms"), "https_cpu_us": pick(c["https"], "cpu_us"),
            "h2_rps": pick(c["h2"], "rps"), "h2_mean_ms": pick(c["h2"], "mean_ms"), "h2_cpu_us": pick(c["h2"], "cpu_us"),
            "errors": sum(r.get("errors", 0) for r in c["https"]) + sum(r.get("failed", 0) for r in c["h2"])}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def markdown(r: dict) -> str:
    cells = {c["key"]: (c, summary(c)) for c in r["cells"]}
    nginx = cells.get("nginx", (None, {}))[1]
    limit = cells.get("static", (None, {}))[1]
    p = r["profile"]
    lines = [f"#### TLS handshakes per second (`openssl s_time`, one client, {p['seconds']} s, median of {p['rounds']})", "",
             "| system | full (TLS 1.3) | ÷ nginx | resumed (TLS 1.2) | ÷ nginx | of those, resumed | a TLS 1.3 ticket resumes |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for c, s in cells.values():
        lines.append(f"| {c['label']} | {s['full_hs']:.0f} | {ratio(s['full_hs'], nginx.get('full_hs'))} | {s['resumed_hs']:.0f} | "
                     f"{ratio(s['resumed_hs'], nginx.get('resumed_hs'))} | {100 * s['resumed_share']:.0f}% | {'yes' if s['resumes'] else 'no'} |")
    lines += ["", f"#### Cached hits over HTTPS (wrk, 1 thread × {p['wrk_connections']} connections) and HTTP/2 (h2load, "
              f"{p['h2_connections']} connections × {p['h2_streams']} streams): {p['objects']:,} objects of {p['object_bytes']:,} bytes, zipf {p['zipf']}", "",
              "| system | HTTPS req/s | ÷ nginx | ÷ limit | p99 ms | CPU µs/req | h2 req/s | ÷ nginx | ÷ limit | mean ms | CPU µs/req | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c, s in cells.values():
        lines.append(f"| {c['label']} | {s['https_rps']:.0f} | {ratio(s['https_rps'], nginx.get('https_rps'))} | "
                     f"{ratio(s['https_rps'], limit.get('https_rps'))} | {s['https_p99_ms']:.2f} | {s['https_cpu_us']:.1f} | "
                     f"{s['h2_rps']:.0f} | {ratio(s['h2_rps'], nginx.get('h2_rps'))} | {ratio(s['h2_rps'], limit.get('h2_rps'))} | "
                     f"{s['h2_mean_ms']:.2f} | {s['h2_cpu_us']:.1f} | {s['errors']} |")
    if r.get("quiet"):
        lines += ["", f"Before each measurement: {'; '.join(r['quiet'])}."]
    return "\n".join(lines) + "\n"


def render(record: dict) -> str:
    return provenance(record) + "\n\n" + markdown(record["rows"])


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.frontdoor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the run's configs and logs (created)")
    ap.add_argument("--results", type=Path, default=default_dir("frontdoor"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and 1-s runs: the test's profile")
    ap.add_argument("--systems", default=",".join(BY_KEY), help="comma-separated subset of " + ", ".join(BY_KEY))
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3)")
    ap.add_argument("--seconds", type=int, help="per measurement (default 5)")
    preflight.add_wait_quiet(ap, "measurement")
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    args = ap.parse_args(argv)
    systems = [BY_KEY[k] for k in preflight.chosen_systems(ap, args.systems, BY_KEY)]
    refused = preflight.refuse(preflight.problems(inband=args.inband, tools=("curl", "openssl", "wrk", "h2load", "nginx", "haproxy"), root=False))
    if refused:
        return refused
    name = "quick" if args.quick else "default"
    p = profiles.choose(PROFILES, name, rounds=args.rounds, seconds=args.seconds)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    this_run = Run("frontdoor", "bench.frontdoor", argv)
    stop_signals_interrupt()
    cells = {s.key: Cell(s.key, s.label) for s in systems}
    bench = Bench(args, p, out)
    try:
        bench.start_origin()
        for s in systems:
            bench.log(f"{s.label}: start, fill {p.objects} objects over HTTPS")
            bench.start(s)
            bench.fill(s)
            cells[s.key].resumes = bench.resumes(s)
        for rnd in range(p.rounds):
            for s in systems:
                bench.log(f"round {rnd + 1}/{p.rounds}: {s.label}")
                c = cells[s.key]
                bench.settle()
                c.full_hs.append(bench.handshakes(s, resumed=False)[0])
                bench.settle()
                rate, share = bench.handshakes(s, resumed=True)
                c.resumed_hs.append(rate)
                c.resumed_share.append(share)
                bench.settle()
                c.https.append(bench.https(s))
                bench.settle()
                c.h2.append(bench.h2(s))
    finally:
        bench.teardown()
    rows = {"profile": asdict(p), "cells": [asdict(c) for c in cells.values()], "quiet": sorted(bench.quiet)}
    record = this_run.record(rows, profile=profiles.as_json(name, p), inband=Path(args.inband), tools=TOOLS)
    md = render(record)
    write_results(args.results, record, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

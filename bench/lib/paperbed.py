"""The paper's testbed (Table 3, Fig. 3, Fig. 4): one client (Locust), one
balancer and a server set (`inband serve`, each with `inband agent`), and
the configurations under test (inband's modes, HAProxy, nftables). The
paper study runs every configuration on it; the regimes study runs the
same configurations under other loads and poll intervals."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import locust, peers, profiles
from . import preflight as checks
from .locust import Overhead, RunResult
from .peers import Backend
from .procs import Interrupted, Procs, run, stop_signals_interrupt, uninterruptible, wait_until
from . import results
from .results import REPO
from .testbed import TestbedRun, alive, http_get_json, new_auth_key

VIP_PORT = 80
SERVICE_PORT = 8080


# ------------------------------------------------------------------ model


@dataclass(frozen=True)
class ServerSpec:
    """One real server: relative speed and slowdown windows, each given as
    fractions of the run (start, length) and a factor."""

    speed: float
    slowdowns: tuple = ()

    def describe(self) -> str:
        return "".join(f", {f:g}× slower from {a:.0%} to {a + n:.0%} of the run" for a, n, f in self.slowdowns)


SERVER_SETS = {
    # Heterogeneous on purpose: the paper's point is that load-aware
    # placement wins when servers differ and change. s1 is the fastest until
    # it slows down 3x for the middle third of the run, which a static
    # weighting cannot anticipate.
    "ours": (
        ServerSpec(1.0, ((1 / 3, 1 / 3, 3.0),)),
        ServerSpec(0.6),
        ServerSpec(0.35),
    ),
    # The paper's testbed: two real servers of the same hardware (i7-9750H,
    # "identical servers"); what varies is only each request's service time.
    "paper": (ServerSpec(1.0), ServerSpec(1.0)),
}


@dataclass(frozen=True)
class Profile:
    name: str
    users: int
    spawn_rate: int
    duration_s: int
    service_ms: float  # mean service time of an idle server at speed 1
    service_dist: str
    workers: int  # requests one server processes concurrently
    time_scale: float  # multiplies every server-side duration
    timeout_s: float  # per request
    body_bytes: int


PROFILES = {
    # The paper: 150 users, 10 minutes, 0.5 s to a few s per request.
    "full": Profile("full", 150, 150, 600, 1000.0, "lognormal", 32, 1.0, 120.0, 46 * 1024),
    # The same servers four times faster, 45 s per configuration (the
    # README's demo, under 15 minutes from a fresh clone including the
    # build): 4x the requests per second keeps run-to-run noise below the
    # differences measured, and load now changes faster than a 1 s poll
    # (docs/benchmarks.md, paper evaluation, "Reading it": two regimes).
    "quick": Profile("quick", 150, 150, 45, 1000.0, "lognormal", 32, 0.25, 60.0, 46 * 1024),
    # Seconds per configuration, for the end-to-end test: checks that
    # everything runs, not what wins.
    "tiny": Profile("tiny", 20, 20, 5, 1000.0, "lognormal", 8, 0.1, 20.0, 46 * 1024),
}


@dataclass(frozen=True)
class Configuration:
    key: str
    label: str
    kind: str  # inband | haproxy | nftables
    mode: str | None = None
    balance: str | None = None
    # dsr-polling only: overrides --poll-interval-ms for this row.
    poll_interval_ms: int | None = None
    # dsr-dynamic only: overrides --probe-interval for this row; with a max,
    # the adaptive n between the two.
    probe_interval: int | None = None
    probe_interval_max: int | None = None
    # dsr-dynamic only: a SYN that finds every score stale waits for a query.
    query_when_stale: bool = False
    # inband only: the VIP's policy (lb.toml's default, least-score, when None).
    policy: str | None = None


CONFIGURATIONS = (
    Configuration("passthrough", "Pass through (inband, round-robin, no DSR)", "inband", mode="passthrough"),
    Configuration("dsr-rr", "DSR round-robin (inband)", "inband", mode="dsr-rr"),
    Configuration("dsr-polling", "DSR request busyness (inband, UDP polling, default interval)", "inband", mode="dsr-polling"),
    # The same baseline polled 10x as often: shows what freshness costs when
    # it is bought with packets instead of carried in-band.
    Configuration(
        "dsr-polling-100ms", "DSR request busyness (inband, UDP polling every 100 ms)", "inband", mode="dsr-polling", poll_interval_ms=100
    ),
    Configuration(
        "dsr-query",
        "DSR request busyness, as the paper's baseline: query before forwarding (inband dsr-query)",
        "inband",
        mode="dsr-query",
    ),
    Configuration("dsr-dynamic", "Dynamic DSR (inband, in-band scores)", "inband", mode="dsr-dynamic"),
    Configuration("haproxy-roundrobin", "HAProxy 2.6 TCP roundrobin", "haproxy", balance="roundrobin"),
    Configuration("haproxy-leastconn", "HAProxy 2.6 TCP leastconn", "haproxy", balance="leastconn"),
    Configuration("nftables-numgen", "nftables DNAT numgen round-robin", "nftables"),
)
BY_KEY = {c.key: c for c in CONFIGURATIONS}
# The configurations with a row in the paper's Table 3.
PAPER_ROWS = tuple(key for _name, key, *_ in locust.PAPER_TABLE3)



# ------------------------------------------------------------------ the run


class Bench(TestbedRun):
    def __init__(self, args, profile: Profile, out: Path, specs: tuple = SERVER_SETS["ours"]):
        super().__init__(args.inband, args.name)
        self.args = args
        self.p = profile
        self.out = out
        self.specs = specs
        self.run_dir = out / "run"  # the agents' configs and the run's auth key
        self.servers: list = []  # Popen per server
        self.lb_ip_forward: str | None = None
        self.slowdown_offsets: list[float] = []  # load start - server start, per configuration
        # What bench.regimes varies on this testbed (bench.paper keeps the
        # defaults): flags appended to every `inband serve`, the agents'
        # score source (read at set-up), the locustfile's other loads
        # (its INBAND_BENCH_* settings) and the users they add to -u.
        self.serve_extra: tuple = ()
        self.agent_score: str | None = None
        self.locust_env: dict = {}
        self.extra_users = 0

    # --- set-up shared by every configuration

    @property
    def backends(self) -> list[Backend]:
        return [Backend(self.tb.addr(f"s{i}"), SERVICE_PORT) for i in range(1, len(self.specs) + 1)]

    def backend_labels(self) -> dict:
        labels = {}
        for i, spec in enumerate(self.specs, 1):
            extra = "".join(f", {f:g}× slower {a:.0%}–{a + n:.0%}" for a, n, f in spec.slowdowns)
            labels[f"{self.tb.addr(f's{i}')}:{SERVICE_PORT}"] = f"s{i} (speed {spec.speed:g}{extra})"
        return labels

    def setup(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.args.auth == "siphash":
            self.auth_key = new_auth_key(self.inband, self.run_dir)
        self.bring_up(len(self.specs))
        # One TCP connection per request: let the client reuse ports in
        # TIME_WAIT so long runs cannot run out of them.
        run(self.ns("c1"), ["sysctl", "-q", "-w", "net.ipv4.tcp_tw_reuse=1"])
        self.apply_tbf()
        self.start_agents([f"s{i}" for i in range(1, len(self.specs) + 1)], self.run_dir, self.out / "logs", SERVICE_PORT, score=self.agent_score)

    def apply_tbf(self) -> None:
        a = self.args
        port = self.tb.switch_port("lb")
        run(self.tb.switch_netns, peers.tbf_args(port, a.tbf_rate_mbit, a.tbf_burst_kb, a.tbf_latency_ms))
        self.log(f"balancer link: TBF {a.tbf_rate_mbit:g} Mbit/s on {port} (switch side, toward the balancer)")

    def tbf_stats(self) -> dict:
        cp = run(self.tb.switch_netns, ["tc", "-s", "-j", "qdisc", "show", "dev", self.tb.switch_port("lb")])
        return peers.parse_tbf_stats(cp.stdout)

    # --- servers

    @property
    def probe_netns(self) -> str:
        """Where the servers' counters are read from: a node that reaches them all."""
        return self.tb.netns("lb")

    def serve_argv(self, spec: ServerSpec) -> list[str]:
        p = self.p
        argv = [
            str(self.inband), "serve",
            "--listen", f"0.0.0.0:{SERVICE_PORT}",
            "--workers", str(p.workers),
            "--service-ms", f"{p.service_ms:g}",
            "--service-dist", p.service_dist,
            "--speed", f"{spec.speed:g}",
            "--time-scale", f"{p.time_scale:g}",
            "--body-bytes", str(p.body_bytes),
        ]  # fmt: skip
        # Seconds since the server started, which is just before the load
        # starts (the offset is measured and reported).
        for start_f, len_f, factor in spec.slowdowns:
            argv += ["--slowdown", f"{start_f * self.duration_s:g}:{len_f * self.duration_s:g}:{factor:g}"]
        return argv + list(self.serve_extra)

    def start_servers(self, cfg_dir: Path) -> float:
        """Starts fresh servers; returns when they started (epoch s)."""
        self.stop_servers()
        started = time.time()
        for i, spec in enumerate(self.specs, 1):
            node = f"s{i}"
            self.servers.append(
                self.procs.spawn(f"serve {node}", self.tb.netns(node), self.serve_argv(spec), cfg_dir / f"serve-{node}.log")
            )
        for i in range(1, len(self.specs) + 1):
            url = f"http://{self.tb.addr(f's{i}')}:{SERVICE_PORT}/stats"
            wait_until(f"the server on s{i}", lambda url=url: http_get_json(self.probe_netns, url), 20)
        return started

    def server_stats(self) -> dict:
        """`/stats` of every server (served, rejected, ...), by backend."""
        out = {}
        for i in range(1, len(self.specs) + 1):
            url = f"http://{self.tb.addr(f's{i}')}:{SERVICE_PORT}/stats"
            out[f"{self.tb.addr(f's{i}')}:{SERVICE_PORT}"] = http_get_json(self.probe_netns, url)
        return out

    def stop_servers(self) -> None:
        for s in self.servers:
            self.procs.stop(s)
        self.servers = []

    # --- balancers under test

    def start_balancer(self, c: Configuration, cfg_dir: Path):
        lb = self.tb.netns("lb")
        if c.kind == "inband":
            return self.start_lb(
                cfg_dir, self.backends, mode=c.mode, probe_interval=c.probe_interval or self.args.probe_interval,
                probe_interval_max=c.probe_interval_max, poll_interval_ms=c.poll_interval_ms or self.args.poll_interval_ms,
                query_when_stale=c.query_when_stale, **({"policy": c.policy} if c.policy else {}),
            )  # fmt: skip
        if c.kind == "haproxy":
            cfg = cfg_dir / "haproxy.cfg"
            cfg.write_text(
                peers.haproxy_cfg(
                    vip=self.tb.vip, vip_port=VIP_PORT, backends=self.backends, balance=c.balance, timeout_s=int(self.p.timeout_s) + 30
                )
            )
            log = cfg_dir / "haproxy.log"
            proc = self.procs.spawn("haproxy", lb, ["haproxy", "-f", str(cfg), "-db"], log)
            wait_until(
                "haproxy to listen",
                lambda: alive(proc, "haproxy", log) and f"{self.tb.vip}:{VIP_PORT}" in run(lb, ["ss", "-Hltn"]).stdout,
                20,
            )
            return proc
        if c.kind == "nftables":
            self.lb_ip_forward = run(lb, ["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip()
            run(lb, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            text = peers.nft_ruleset(vip=self.tb.vip, vip_port=VIP_PORT, backends=self.backends)
            (cfg_dir / "nftables.nft").write_text(text)
            run(lb, ["nft", "-f", "-"], input=text)
            return None
        raise ValueError(c.kind)

    def stop_balancer(self, c: Configuration, proc) -> None:
        lb = self.tb.netns("lb")
        if proc is not None:
            self.procs.stop(proc)
        if c.kind == "inband":
            self.detach_lb()
        if c.kind == "nftables":
            run(lb, ["nft", "delete", "table", "ip", peers.NFT_TABLE], check=False)
            if self.lb_ip_forward is not None:
                run(lb, ["sysctl", "-q", "-w", f"net.ipv4.ip_forward={self.lb_ip_forward}"], check=False)
                self.lb_ip_forward = None

    # --- one configuration

    @property
    def duration_s(self) -> int:
        return self.args.duration or self.p.duration_s

    def run_config(self, c: Configuration) -> RunResult:
        d = self.out / c.key
        d.mkdir(parents=True, exist_ok=True)
        self.log(f"{c.key}: starting {c.kind} and the servers")
        proc = self.start_balancer(c, d)
        # From here its pollers run: a start slowed by a loaded machine
        # (program loads, the instances one after another) is no time
        # they could poll in (bench.regimes divides polls by it).
        lb_started = time.time()
        try:
            # Servers last, right before the load: their slowdown windows
            # count from their start.
            served_from = self.start_servers(d)
            before = self.tbf_stats()
            self.log(f"{c.key}: {self.args.users or self.p.users} users for {self.duration_s} s")
            self.run_locust(d)
            after = self.tbf_stats()
            status = self.lb_status() if c.kind == "inband" else None
            status_read = time.time()
            if status is not None:
                (d / "lb-status.json").write_text(json.dumps(status, indent=2))
            sstats = self.server_stats()
            (d / "server-stats.json").write_text(json.dumps(sstats, indent=2))
            window = locust.read_window(d / "window.json")
            (d / "meta.json").write_text(
                json.dumps(
                    {
                        "balancer_started": lb_started,
                        "servers_started": served_from,
                        "load_started": window[0],
                        "offset_s": window[0] - served_from,
                        "status_read": status_read,
                    }
                )
            )
            self.slowdown_offsets.append(window[0] - served_from)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{c.kind} exited during the run (status {proc.returncode}); see {d}")
        finally:
            self.stop_balancer(c, proc)
            self.stop_servers()
        requests = locust.read_requests(d / "requests.csv")
        shares = {b: int(v["served"]) for b, v in sstats.items()}
        res = RunResult(
            key=c.key,
            label=c.label,
            window=window,
            requests=requests,
            overhead=overhead(c, status, before, after, authenticated=self.auth_key is not None),
            locust=locust.read_locust_aggregated(d / "locust_stats.csv"),
            shares=shares,
            at_balancer=locust.backends_at_balancer(status),
        )
        s = res.summary()
        self.log(f"{c.key}: {s.requests} requests, {s.rps:.2f} req/s, median {locust.fmt_time(s.median_ms)}, {s.failures} failures")
        return res

    def run_locust(self, d: Path) -> None:
        users = (self.args.users or self.p.users) + self.extra_users
        spawn = (self.args.spawn_rate or min(self.p.spawn_rate, users)) + self.extra_users
        env = dict(os.environ)
        env.update(
            INBAND_BENCH_REQUESTS=str(d / "requests.csv"),
            INBAND_BENCH_WINDOW=str(d / "window.json"),
            INBAND_BENCH_TIMEOUT_S=f"{self.p.timeout_s:g}",
            INBAND_BENCH_RUN_S=str(self.duration_s),
            **self.locust_env,
        )
        argv = [
            sys.executable, "-m", "locust",
            "-f", str(REPO / "bench" / "locustfile.py"),
            "--headless", "--only-summary",
            "-u", str(users), "-r", str(spawn),
            "--host", f"http://{self.tb.vip}:{VIP_PORT}",
            "--csv", str(d / "locust"), "--csv-full-history",
            "--loglevel", "WARNING",
        ]  # fmt: skip
        (d / "locust-command.txt").write_text(f"INBAND_BENCH_RUN_S={self.duration_s} {shlex.join(argv)}\n")
        p = self.procs.spawn("locust", self.tb.netns("c1"), argv, d / "locust.log", env=env, cwd=REPO)
        # The locustfile stops Locust after the run; the bound covers a hung shutdown.
        try:
            p.wait(timeout=self.duration_s + 60)
        except subprocess.TimeoutExpired:
            self.procs.stop(p)
            raise RuntimeError(f"locust did not finish within {self.duration_s + 60} s; see {d / 'locust.log'}") from None
        self.procs.stop(p)
        if not (d / "window.json").exists():
            raise RuntimeError(f"locust ended (status {p.returncode}) without a measurement window; see {d / 'locust.log'}")

    # --- tear-down

    def teardown(self) -> None:
        super().teardown()
        self.servers = []


def option_bytes(authenticated: bool) -> int:
    """What one 124 (score request) or one 125 (score) adds to a packet,
    as bpf/include/inband/wire.h defines them: INBAND_OPT_AUTH_SCORE_REQUEST_LEN
    and INBAND_OPT_AUTH_SCORE_LEN (kind, length, key id or score, nonce,
    MAC) with a key; the seed's INBAND_OPT_SCORE_REQUEST_LEN and
    INBAND_OPT_SCORE_LEN without."""
    return 16 if authenticated else 4


def overhead(c: Configuration, status, before: dict, after: dict, *, authenticated: bool) -> Overhead:
    o = Overhead(
        mechanism={
            "passthrough": "none",
            "dsr-rr": "none",
            "dsr-polling": "UDP polls to every agent",
            "dsr-query": "a UDP query round to every agent per batch of held SYNs",
            "dsr-dynamic": "IPv4 options on packets already sent",
            "roundrobin": "none",
            "leastconn": "own connection counts",
        }.get("leastconn" if c.policy == "least-connections" else c.mode or c.balance or "", "none"),
        lb_in_bytes=after["bytes"] - before["bytes"],
        lb_in_packets=after["packets"] - before["packets"],
        lb_in_drops=after["drops"] - before["drops"],
    )
    if status:
        ctl = status[0]["control"]
        bes = status[0]["vips"][0]["backends"]
        o.probes = sum(b["stats"]["probes_sent"] for b in bes)
        o.scores = sum(b["stats"]["scores_received"] for b in bes)
        # Polling and querying: each request and reply is a packet of its
        # own. In-band: no packet of its own, one option per probe and per score.
        o.polls = int(ctl["polls_sent"])
        o.extra_packets = o.polls + int(ctl["poll_replies"])
        o.queries, o.query_timeouts, o.query_mean_us = int(ctl["queries"]), int(ctl["query_timeouts"]), int(ctl["query_mean_us"])
        o.extra_bytes = int(ctl["poll_bytes"]) + option_bytes(authenticated) * (o.probes + o.scores)
    return o


def parse_args(argv, description: str | None = None):
    ap = argparse.ArgumentParser(prog="python -m bench.paper", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--out", required=True, help="the run's raw data: logs, every request, CSV, figures (created)")
    ap.add_argument("--results", default=str(results.default_dir("paper")), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--configs", default=",".join(BY_KEY), help=f"comma-separated subset of: {', '.join(BY_KEY)}")
    ap.add_argument(
        "--servers",
        choices=(*SERVER_SETS, "both"),
        default="ours",
        help="our three heterogeneous servers, the paper's two identical ones, or both (a results directory per set)",
    )
    ap.add_argument(
        "--paper-configs",
        default=",".join(PAPER_ROWS),
        help="with --servers both: the configurations run on the paper's two servers (default: the rows of the paper's Table 3)",
    )
    ap.add_argument("--name", default="paper", help="testbed name (namespaces NAME-lb, NAME-c1, ...)")
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"), help="the inband binary")
    ap.add_argument(
        "--tbf-rate-mbit", type=float, help="balancer link rate (traffic into the balancer); default 10 Mbit/s ÷ the time scale"
    )
    ap.add_argument("--tbf-burst-kb", type=int, help="default 16 KB ÷ the time scale")
    ap.add_argument("--tbf-latency-ms", type=int, default=100, help="TBF queue, as the longest a packet may wait")
    ap.add_argument("--probe-interval", type=int, default=100, help="dsr-dynamic: score request on every n-th packet")
    ap.add_argument(
        "--poll-interval-ms", type=int, default=1000, help="dsr-polling: how often each agent is asked (the balancer's default; dsr-polling-100ms keeps 100)"
    )
    ap.add_argument(
        "--auth",
        choices=("siphash", "none"),
        default="siphash",
        help="in-band options: authenticated with a key made for the run (16-byte 124/125), or the seed paper's plain ones (4 bytes)",
    )
    ap.add_argument("--users", type=int, help="override the profile's user count")
    ap.add_argument("--spawn-rate", type=int, help="override the profile's spawn rate")
    ap.add_argument("--duration", type=int, help="override the profile's seconds per configuration")
    ap.add_argument("--time-scale", type=float, help="override the profile's server-side time scale (0.25: four times faster service)")
    args = ap.parse_args(argv)
    unknown = [k for k in f"{args.configs},{args.paper_configs}".split(",") if k not in BY_KEY]
    if unknown:
        ap.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    return args


def problems(args) -> list[str]:
    kinds = {BY_KEY[k].kind for k in args.configs.split(",")}
    tools = tuple(t for kind, t in (("haproxy", "haproxy"), ("nftables", "nft")) if kind in kinds)
    return checks.problems(inband=args.inband, tools=tools, testbed_name=args.name)


def resolve_profile(args) -> Profile:
    """The profile with the command line's overrides, and the balancer
    link's defaults for its time scale filled into `args`."""
    profile = profiles.choose(PROFILES, args.profile, time_scale=args.time_scale or None)
    # Faster servers get a proportionally faster balancer link, so that the
    # balancer's capacity relative to the servers' stays what it is at
    # time scale 1 (pass-through bound below round-robin, as in the paper).
    if args.tbf_rate_mbit is None:
        args.tbf_rate_mbit = 10.0 / profile.time_scale
    if args.tbf_burst_kb is None:
        args.tbf_burst_kb = round(16 / profile.time_scale)
    return profile


def run_configs(bench: Bench, configs: list) -> tuple[list, list, str | None, float]:
    """Every configuration on one testbed, torn down at the end however it
    ends: (results, failures, what interrupted it or None, seconds)."""
    started = time.time()
    results: list[RunResult] = []
    failed: list[tuple[str, str]] = []
    interrupted = None
    try:
        bench.setup()
        for c in configs:
            try:
                results.append(bench.run_config(c))
            except (Interrupted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - one broken configuration must not hide the others
                traceback.print_exc()
                failed.append((c.key, f"{e.__class__.__name__}: {e}"))
                bench.log(f"{c.key}: FAILED: {e}")
    except (Interrupted, KeyboardInterrupt) as e:
        interrupted = str(e) or "SIGINT"
    except Exception as e:  # noqa: BLE001 - set-up failed: report, tear down
        traceback.print_exc()
        failed.append(("setup", f"{e.__class__.__name__}: {e}"))
    finally:
        with uninterruptible():
            bench.teardown()
        if interrupted is None:
            stop_signals_interrupt()
    return results, failed, interrupted, time.time() - started



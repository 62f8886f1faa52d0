"""bench.paper's testbed with several real balancers: `inband testbed up
--ecmp --balancers B` (a router r1 spreading the IPv4 VIP over B `inband
lb` instances, each with `[scale_out]`, all in front of the same servers),
the client on the router's far side. Each instance sees only the
connections the router hands it, so its own counts miss the others'
placements, which is what the regimes study's fleet regimes measure; the
servers' agents trust every instance and answer each one's score requests
and polls.

What differs from the one-balancer testbed: no token bucket on a
balancer link (each instance has a link of its own; the DSR rows send
nothing large through one), the servers are asked for their counters
from the router, and the balancer's counters are every instance's,
summed per backend."""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path

from . import peers
from .paperbed import SERVICE_PORT, VIP_PORT, Bench, Configuration
from .procs import run, wait_until
from .testbed import alive, new_auth_key


class Instances:
    """The balancer processes of one configuration, as run_config checks a
    balancer: `poll()` is the first exit status among them, if any."""

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self.returncode = None

    def poll(self):
        for p in self.procs:
            if p.poll() is not None:
                self.returncode = p.returncode
                return p.returncode
        return None


def merged_status(statuses: list) -> list:
    """One `inband status --json` (first interface, first VIP) with every
    instance's counters added: the control plane's (queries' mean time
    weighted by their count) and each backend's. The last score shown is
    the first instance's."""
    out = copy.deepcopy(statuses[0])
    ctl = out[0]["control"]
    queries = sum(int(s[0]["control"]["queries"]) for s in statuses)
    for key, value in ctl.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "query_mean_us":
            ctl[key] = sum(s[0]["control"][key] for s in statuses)
    ctl["query_mean_us"] = (
        round(sum(int(s[0]["control"]["query_mean_us"]) * int(s[0]["control"]["queries"]) for s in statuses) / queries) if queries else 0
    )
    by_backend = {b["backend"]: b for b in out[0]["vips"][0]["backends"]}
    for s in statuses[1:]:
        for b in s[0]["vips"][0]["backends"]:
            mine = by_backend[b["backend"]]["stats"]
            for key, value in b["stats"].items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    mine[key] += value
    return out


class FleetBench(Bench):
    """Bench on the ECMP testbed with `balancers` inband instances."""

    def __init__(self, args, profile, out: Path, specs: tuple, balancers: int) -> None:
        super().__init__(args, profile, out, specs)
        self.balancers = balancers
        self.router_cfg: Path | None = None
        self.sids: dict = {}  # instance -> (sid, direct_sid), from the router's config
        self.shadow_sid = ""
        self.statuses: dict = {}  # instance -> its last `inband status --json`

    @property
    def instances(self) -> list[str]:
        return [f"b{i}" for i in range(1, self.balancers + 1)]

    @property
    def balancer_addresses(self) -> list[str]:
        return [self.tb.addr(b) for b in self.instances]

    @property
    def probe_netns(self) -> str:
        return self.ns("r1")

    def setup(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.args.auth == "siphash":
            self.auth_key = new_auth_key(self.inband, self.run_dir)
        self.bring_up(len(self.specs), ecmp=True, balancers=self.balancers)
        run(self.ns("c1"), ["sysctl", "-q", "-w", "net.ipv4.tcp_tw_reuse=1"])
        text = Path(self.tb.state["router_config"]).read_text()
        router = tomllib.loads(text)
        self.sids = {s["name"]: (s["sid"], s["direct_sid"]) for s in router["server"]}
        self.shadow_sid = router["shadow_sid"]
        # The testbed's router.toml routes the IPv6 VIP; this study's is
        # the IPv4 one (the same data path as the one-balancer regimes).
        self.router_cfg = self.run_dir / "router.toml"
        self.router_cfg.write_text(text.replace(f'vip = "{self.tb.vip6}"', f'vip = "{self.tb.vip}"'))
        run(self.ns("r1"), [str(self.inband), "shadow", "route", "--config", str(self.router_cfg), "--up", ",".join(self.instances)])
        self.log(f"router: the VIP {self.tb.vip} over {', '.join(self.instances)} (ECMP)")
        servers = [f"s{i}" for i in range(1, len(self.specs) + 1)]
        self.start_agents(servers, self.run_dir, self.out / "logs", SERVICE_PORT, score=self.agent_score)

    def apply_tbf(self) -> None:
        pass

    def tbf_stats(self) -> dict:
        return {"bytes": 0, "packets": 0, "drops": 0}

    def instance_sock(self, node: str) -> Path:
        return self.sock_dir / f"lb-{node}.sock"

    def start_balancer(self, c: Configuration, cfg_dir: Path):
        if c.kind != "inband":
            raise ValueError(f"{c.key}: only inband balancers run as a fleet here (the router's SIDs lead to XDP)")
        procs = []
        for node in self.instances:
            for b in self.backends:
                run(self.ns(node), ["ping", "-c", "1", "-W", "2", b.address], check=False)
            sid, direct_sid = self.sids[node]
            cfg = cfg_dir / f"lb-{node}.toml"
            cfg.write_text(
                peers.lb_toml(
                    address=self.tb.addr(node), vip=self.tb.vip, vip_port=VIP_PORT, backends=self.backends, mode=c.mode,
                    control_socket=str(self.instance_sock(node)), auth_key=str(self.auth_key) if self.auth_key else None,
                    probe_interval=c.probe_interval or self.args.probe_interval, probe_interval_max=c.probe_interval_max,
                    poll_interval_ms=c.poll_interval_ms or self.args.poll_interval_ms, query_when_stale=c.query_when_stale,
                    scale_out=peers.ScaleOut(self.tb.addr6(node), sid, direct_sid, self.shadow_sid),
                    **({"policy": c.policy} if c.policy else {}),
                )
            )  # fmt: skip
            log = cfg_dir / f"lb-{node}.log"
            procs.append(self.procs.spawn(f"inband lb {node}", self.ns(node), [str(self.inband), "lb", "--config", str(cfg)], log))
        for node, proc in zip(self.instances, procs):
            log = cfg_dir / f"lb-{node}.log"
            wait_until(
                f"{node} to be ready (every backend resolved)",
                lambda node=node, proc=proc, log=log: alive(proc, f"inband lb on {node}", log)
                and bool(bs := self.instance_backends(node))
                and all(b["mac"] != "00:00:00:00:00:00" for b in bs),
                30,
            )
        return Instances(procs)

    def stop_balancer(self, c: Configuration, proc) -> None:
        # What each instance placed, beside the merged lb-status.json.
        for node, status in self.statuses.items():
            (self.out / c.key / f"lb-status-{node}.json").write_text(json.dumps(status, indent=2))
        self.statuses = {}
        for p in proc.procs if proc is not None else ():
            self.procs.stop(p)
        for node in self.instances:
            run(self.ns(node), [str(self.inband), "lb", "detach", "--interface", "eth0", "--force"], check=False)

    def instance_status(self, node: str):
        ns = self.ns(node)
        cp = run(ns, [str(self.inband), "status", "--json", "--netns", ns], check=False)
        return json.loads(cp.stdout) if cp.returncode == 0 else None

    def instance_backends(self, node: str) -> list:
        status = self.instance_status(node)
        return status[0]["vips"][0]["backends"] if status else []

    def lb_status(self):
        self.statuses = {node: self.instance_status(node) for node in self.instances}
        return merged_status(list(self.statuses.values())) if all(self.statuses.values()) else None

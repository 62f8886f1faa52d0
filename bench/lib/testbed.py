"""An `inband testbed` (network namespaces: clients, a balancer or an ECMP
router, servers) as the drivers use it, and the steps every run on one
repeats: waiting on a process it started, a GET from inside a namespace,
a key of the run's own."""

from __future__ import annotations

import ipaddress
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import peers
from .host import others_running
from .procs import Fatal, Procs, run, wait_until

STATE_DIR = Path("/run/inband/testbed")


@dataclass
class Testbed:
    """An `inband testbed` and what its state file says about it."""

    inband: Path
    name: str
    state: dict = field(default_factory=dict)

    @property
    def state_path(self) -> Path:
        return STATE_DIR / f"{self.name}.json"

    def up(self, servers: int, clients: int = 1, subnet: int | None = None, ecmp: bool = False, balancers: int | None = None) -> None:
        argv = [str(self.inband), "testbed", "up", "--name", self.name, "--clients", str(clients), "--servers", str(servers)]
        argv += ["--ecmp"] if ecmp else []
        argv += ["--subnet", str(subnet)] if subnet is not None else []
        argv += ["--balancers", str(balancers)] if balancers is not None else []
        run(None, argv, timeout=120)
        self.state = json.loads(self.state_path.read_text())

    def down(self) -> None:
        run(None, [str(self.inband), "testbed", "down", "--name", self.name], timeout=120, check=False)

    def node(self, node: str) -> dict:
        for n in self.state["nodes"]:
            if n["node"] == node:
                return n
        raise KeyError(f"testbed {self.name} has no node {node}")

    def netns(self, node: str) -> str:
        return self.node(node)["netns"]

    def addr(self, node: str) -> str:
        return self.node(node)["address"]

    def addr6(self, node: str) -> str:
        return self.node(node)["address6"]

    @property
    def vip(self) -> str:
        return self.state["vip"]

    @property
    def vip6(self) -> str:
        return self.state["vip6"]

    @property
    def switch_netns(self) -> str:
        return self.state["switch"]

    def switch_port(self, node: str) -> str:
        """The bridge-side veth toward `node`, in the switch namespace."""
        return self.node(node)["bridge_port"]


def exists(name: str) -> bool:
    return (STATE_DIR / f"{name}.json").exists()


class ProcessDied(Fatal):
    pass


def alive(proc, what: str, log: Path) -> bool:
    """True while `proc` runs; raises (ending any wait at once) with the
    end of its log when it has exited."""
    if proc.poll() is None:
        return True
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
    raise ProcessDied(f"{what} exited with status {proc.returncode}: " + " / ".join(tail))


def ipv6_usable(netns: str, addr: str) -> None:
    """Returns once IPv6 `addr` in `netns` has its local route: `ip addr
    add` lists the address at once, the kernel's DAD work item inserts
    the route later, and until then connections to or from it fail
    (`netns::wait_ipv6_usable` in the testkit says more)."""
    want = ipaddress.ip_address(addr)

    def routed():
        out = run(netns, ["ip", "-j", "-6", "route", "show", "table", "local", "type", "local"]).stdout
        return any(ipaddress.ip_address(r["dst"]) == want for r in json.loads(out or "[]") if "dst" in r)
    wait_until(f"{addr}'s local route in {netns}", routed, timeout_s=10, interval_s=0.002)


def http_get_json(netns: str, url: str, timeout_s: float = 3.0):
    """GET from inside a namespace with this Python (no curl needed)."""
    code = f"import json,sys,urllib.request;r=urllib.request.urlopen({url!r},timeout={timeout_s});sys.stdout.write(r.read().decode())"
    cp = run(netns, [sys.executable, "-c", code], timeout=timeout_s + 5)
    return json.loads(cp.stdout)


def new_auth_key(inband: Path, run_dir: Path) -> Path:
    """A key of its own for this run's balancer and agents. `inband keygen`
    never overwrites one, and the directory may hold an earlier run's."""
    key = run_dir / "auth.key"
    key.unlink(missing_ok=True)
    run(None, [str(inband), "keygen", "--out", str(key)])
    return key


class TestbedRun:
    """What a driver's run on an inband testbed holds and repeats: the
    testbed and the processes in it, a socket directory of its own, the
    run's key, agents on the servers, an inband balancer started and
    stopped, and the tear-down that removes it all however the run ends.
    The drivers' benches are this plus their study."""

    VIP_PORT = 80
    # Log lines also note what else runs on the machine (the drivers that
    # measure CPU report it).
    watch_others = False

    def __init__(self, inband, name: str) -> None:
        self.inband = Path(inband)
        self.tb = Testbed(self.inband, name)
        self.procs = Procs()
        self.tb_is_up = False
        # Unix sockets: a short path of their own (sun_path holds 108
        # bytes, and the run's directory may be long).
        self.sock_dir = Path("/run/inband/bench") / name
        self.auth_key: Path | None = None
        self.others: set[str] = set()

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
        if self.watch_others:
            self.others |= others_running()

    def ns(self, node: str) -> str:
        return self.tb.netns(node)

    def bring_up(self, servers: int, clients: int = 1, **kw) -> None:
        self.sock_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"testbed {self.tb.name}: up ({clients} client(s), balancer, {servers} server(s))")
        self.tb_is_up = True  # from here on, tear-down must run even if `up` fails half-way
        self.tb.up(servers, clients=clients, **kw)

    def start_agents(self, nodes: list[str], cfg_dir: Path, log_dir: Path, service_port: int, score: str | None = None,
                     client_address: bool = True) -> list:
        """`inband agent` on each node, returned once every one has attached:
        [(node, process, log)]. `score`: the agents' score source;
        `client_address`: as peers.agent_toml's."""
        cfg_dir.mkdir(parents=True, exist_ok=True)
        agents = []
        for node in nodes:
            cfg = cfg_dir / f"agent-{node}.toml"
            cfg.write_text(
                peers.agent_toml(
                    balancers=self.balancer_addresses, vip=self.tb.vip, vip_port=self.VIP_PORT, service_port=service_port,
                    score_socket=str(self.sock_dir / f"agent-{node}.sock"), auth_key=str(self.auth_key) if self.auth_key else None,
                    score=score, client_address=client_address,
                )
            )  # fmt: skip
            log = log_dir / f"agent-{node}.log"
            agents.append((node, self.procs.spawn(f"agent {node}", self.ns(node), [str(self.inband), "agent", "--config", str(cfg)], log), log))
        for node, proc, log in agents:
            ns = self.ns(node)
            wait_until(
                f"the agent on {node} to attach",
                lambda ns=ns, proc=proc, log=log, node=node: (
                    alive(proc, f"the agent on {node}", log)
                    and "agent_egress" in run(ns, ["tc", "filter", "show", "dev", "eth0", "egress"], check=False).stdout
                ),
                30,
            )
        return agents

    @property
    def balancer_addresses(self) -> list[str]:
        """The addresses the agents trust: the testbed's one balancer."""
        return [self.tb.addr("lb")]

    @property
    def lb_sock(self) -> Path:
        return self.sock_dir / "lb.sock"

    def start_lb(self, cfg_dir: Path, backends: list, ready=None, address: str | None = None, resolve: bool = True, **options):
        """`inband lb` for VIP:80 over `backends`, with the run's key and
        `options` (peers.lb_toml's); returns its process once its control
        socket answers and `ready(backends as it reports them)` holds
        (default: it has every backend's MAC). `resolve`: ping the backends
        first (not for one that answers no ping)."""
        lb = self.ns("lb")
        # The balancer forwards to MACs from the kernel's neighbour table:
        # make sure every backend has an entry before the first SYN.
        for b in backends if resolve else ():
            run(lb, ["ping", "-c", "1", "-W", "2", b.address], check=False)
        cfg = cfg_dir / "lb.toml"
        cfg.write_text(
            peers.lb_toml(
                address=address or self.tb.addr("lb"), vip=self.tb.vip, vip_port=self.VIP_PORT, backends=backends,
                control_socket=str(self.lb_sock), auth_key=str(self.auth_key) if self.auth_key else None, **options,
            )
        )  # fmt: skip
        log = cfg_dir / "lb.log"
        proc = self.procs.spawn("inband lb", lb, [str(self.inband), "lb", "--config", str(cfg)], log)
        wait_until("the balancer's control socket", lambda: alive(proc, "inband lb", log) and self.lb_status() is not None, 30)
        ready = ready or (lambda bs: all(b["mac"] != "00:00:00:00:00:00" for b in bs))
        wait_until(
            "the balancer to be ready (every backend resolved)",
            lambda: alive(proc, "inband lb", log) and bool(bs := self.lb_backends()) and ready(bs),
            30,
        )
        return proc

    def detach_lb(self, dev: str = "eth0") -> None:
        """Stopping the daemon keeps XDP and the maps (traffic keeps
        flowing): detach removes both, so the next run starts clean."""
        run(self.ns("lb"), [str(self.inband), "lb", "detach", "--interface", dev, "--force"], check=False)

    def lb_status(self):
        ns = self.ns("lb")
        cp = run(ns, [str(self.inband), "status", "--json", "--netns", ns], check=False)
        return json.loads(cp.stdout) if cp.returncode == 0 else None

    def lb_backends(self) -> list:
        """The backends of the balancer's first VIP, as `inband status` gives them."""
        status = self.lb_status()
        return status[0]["vips"][0]["backends"] if status else []

    def before_down(self) -> None:
        """What a driver undoes in the testbed before it goes (left to the
        drivers that change more than the namespaces hold)."""

    def teardown(self) -> None:
        self.procs.stop_all()
        if self.tb_is_up:
            try:
                self.before_down()
            except Exception as e:  # noqa: BLE001 - the testbed goes anyway, and with it what was in it
                self.log(f"before tear-down: {e}")
            self.log(f"testbed {self.tb.name}: down")
            self.tb.down()
            self.tb_is_up = False
        shutil.rmtree(self.sock_dir, ignore_errors=True)

"""An `inband testbed` (network namespaces: clients, a balancer or an ECMP
router, servers) as the drivers use it, and the steps every run on one
repeats: waiting on a process it started, a GET from inside a namespace,
a key of the run's own."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .procs import Fatal, run

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

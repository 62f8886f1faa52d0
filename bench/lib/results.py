"""A run's record, written so that every number in docs/benchmarks.md can be
traced to the run that measured it: the commit (and whether the tree had
uncommitted changes), the machine, the load average at the start and at
the end, the command line, the date, and the rows. Each driver writes its
record to bench/results/<study>/results.json (committed) beside the
tables rendered from it (results.md); `python -m bench.docs` puts the
same tables into docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def tool_version(argv: list[str]) -> str:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (cp.stdout or cp.stderr).strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001 - a missing tool is a fact too
        return f"unavailable ({e.__class__.__name__})"


def commit() -> dict:
    """HEAD and whether tracked files differ from it: a dirty tree's numbers
    were measured on code no commit holds."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    return {"sha": head or "unknown", "dirty": bool(dirty.strip())}


def _first(path: str, key: str) -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open(path) if line.startswith(key))
    except (OSError, StopIteration):
        return "?"


def machine(inband: Path | None = None, tools: dict | None = None) -> dict:
    """The machine and the versions of what ran. `tools`: name -> argv
    printing a version, for the peers a driver starts."""
    facts = {
        "cpu": _first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory": _first("/proc/meminfo", "MemTotal"),
        "kernel": platform.release(),
        "os": tool_version(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "python": platform.python_version(),
    }
    if inband is not None:
        facts["inband"] = tool_version([str(inband), "--version"])
    for name, argv in (tools or {}).items():
        facts[name] = tool_version(argv)
    return facts


def command_line(module: str, argv: list[str] | None) -> str:
    return shlex.join(["python", "-m", module, *(argv if argv is not None else sys.argv[1:])])


class Run:
    """Started when the driver starts measuring; `record` when it ends."""

    def __init__(self, study: str, module: str, argv: list[str] | None) -> None:
        self.study = study
        self.command = command_line(module, argv)
        self.started = time.time()
        self.load_start = list(os.getloadavg())
        # The code that runs is the tree at the start: a commit made during
        # a long run must not be named as what made it.
        self.commit = commit()

    def record(self, rows, *, profile: dict | None = None, inband: Path | None = None, tools: dict | None = None, **extra) -> dict:
        return {
            "study": self.study,
            "command": self.command,
            "commit": self.commit if commit() == self.commit else {**self.commit, "changed_during_run": True},
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "wall_s": round(time.time() - self.started),
            "machine": machine(inband, tools),
            "load_average": {"start": self.load_start, "end": list(os.getloadavg())},
            "profile": profile,
            **extra,
            "rows": rows,
        }


def provenance(r: dict) -> str:
    """The line every generated table starts with: what made it."""
    sha = r["commit"]["sha"][:12] + (" with uncommitted changes" if r["commit"]["dirty"] else "")
    if r["commit"].get("changed_during_run"):
        sha += " (the tree changed during the run)"
    load = r["load_average"]
    return (
        f"Command: `{r['command']}`, commit {sha}, {r['started_utc']}, {r['wall_s']} s; "
        f"{r['machine']['cores']} CPUs ({r['machine']['cpu']}), kernel {r['machine']['kernel']}, "
        f"load average {load['start'][0]:.2f} at the start and {load['end'][0]:.2f} at the end."
    )


def default_dir(study: str) -> Path:
    return RESULTS / study


def write(out: Path, record: dict, md: str) -> None:
    """results.json (the record) and results.md (the tables rendered from
    it) in `out`; the tables also on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    print(md)
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "results.md").write_text(md)


def load(study: str, base: Path = RESULTS) -> dict:
    return json.loads((base / study / "results.json").read_text())


def revive(cls, d: dict):
    """A dataclass back from its record: the fields it has, not the derived
    values written beside them for whoever reads the JSON."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})

"""What the drivers' tests share: reading the markdown tables a driver
prints, and running a driver's tiny profile on its own namespace testbed,
cleaning up whatever it leaves behind (and saying so, for the test to
fail on)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INBAND = REPO / "target" / "debug" / "inband"


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(md: str, header_start: str) -> list[list[str]]:
    lines = md.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return rows


def namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def run_tiny(
    module: str, name: str, out: Path, timeout_s: float, extra: tuple = (), profile: str = "tiny"
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`python -m module --profile tiny [extra...]` (or the driver's
    smallest `profile` by another name) on testbed `name`: its completed
    process and the namespaces it left behind (removed here)."""
    cmd = [sys.executable, "-m", module, "--profile", profile, "--out", str(out), "--results", str(out), "--name", name, *extra]
    try:
        cp = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    finally:
        left = namespaces(f"{name}-")
        if left:
            subprocess.run([str(INBAND), "testbed", "down", "--name", name], capture_output=True, timeout=60)
    assert cp.returncode == 0, f"driver failed ({cp.returncode}):\n{cp.stdout[-4000:]}\n{cp.stderr[-4000:]}"
    return cp, left

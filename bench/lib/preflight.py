"""The checks before a run, which every driver makes the same way."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import testbed
from .host import SYS_BPF
from .results import REPO

# The binary every driver runs unless told another.
DEFAULT_INBAND = REPO / "target" / "debug" / "inband"


def dev_build_problem() -> str | None:
    """Builds the default binary with the dev profile, or says why not.
    `cargo test` leaves its own build of the binary at the same path, with
    the test profile's opt-level 0 for our hot crates (Cargo.toml): a
    handoff cost 60% more CPU in it. `cargo build` puts the dev build back
    (a relink at most) before anything is measured with it.
    INBAND_BENCH_BUILD=0 runs the file as it is: the test command's smoke
    runs of the drivers check what they do, not their numbers, and take
    the build `cargo test` made rather than build our crates again."""
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).is_file():
        return None  # nothing to build with: the file is checked below
    cp = subprocess.run([cargo, "build", "-q", "-p", "inband", "--bin", "inband"], cwd=REPO, capture_output=True, text=True)
    if cp.returncode != 0:
        return f"building {DEFAULT_INBAND} failed: {cp.stderr.strip()[-500:]}"
    return None


def problems(*, inband: str | None = None, tools: tuple = (), testbed_name: str | None = None, root: bool = True,
             bpf_stats: bool = False) -> list[str]:
    """What stops the run before it starts; empty when nothing does.
    `inband`: the binary the run needs; `tools`: programs it runs;
    `testbed_name`: the testbed it creates (1 to 8 of a-z, 0-9: the
    namespaces' and interfaces' names hold it); `bpf_stats`: it reads
    programs' run time through the bpf syscall."""
    out = []
    if root and os.geteuid() != 0:
        out.append("must run as root (it creates network namespaces and attaches XDP/tc programs)")
    if inband is not None and Path(inband).resolve() == DEFAULT_INBAND.resolve() and os.environ.get("INBAND_BENCH_BUILD") != "0":
        if (problem := dev_build_problem()) is not None:
            out.append(problem)
    if inband is not None and not Path(inband).is_file():
        out.append(f"{inband} is missing: run scripts/setup.sh (it installs what is needed and builds inband)")
    for tool in tools:
        if shutil.which(tool) is None:
            out.append(f"{tool} is not installed: run scripts/setup.sh")
    if bpf_stats and SYS_BPF is None:
        out.append("the bpf syscall's number on this architecture is unknown")
    if testbed_name is not None:
        if not re.fullmatch(r"[a-z0-9]{1,8}", testbed_name):
            out.append(f"testbed name {testbed_name!r}: use 1-8 characters of a-z and 0-9")
        elif testbed.exists(testbed_name):
            out.append(f"a testbed named {testbed_name!r} exists already: `{inband or 'inband'} testbed down --name {testbed_name}` "
                       "or pick another --name")
    return out


def add_wait_quiet(ap, before: str) -> None:
    """`--wait-quiet`: how long, over the whole run, a driver may wait for
    builds and bench.forwarding to end `before` each measurement."""
    ap.add_argument(
        "--wait-quiet", type=float, default=600,
        help=f"seconds to wait at most, over the whole run, for builds and bench.forwarding to end before each {before} (0: do not wait)",
    )  # fmt: skip


def chosen_systems(ap, systems: str, known) -> list[str]:
    """The comma-separated `--systems` value as a list; an unknown name is
    the parser's error (exit 2, naming it)."""
    wanted = systems.split(",")
    bad = set(wanted) - set(known)
    if bad:
        ap.error(f"unknown system(s): {', '.join(sorted(bad))}")
    return wanted


def installed_systems(systems: list[str], tools: dict[str, str]) -> list[str]:
    """`systems` without the peers whose program (`tools[system]`) is not
    installed, each skipped with a line saying so."""
    missing = [s for s in systems if s in tools and shutil.which(tools[s]) is None]
    for s in missing:
        print(f"skipping {s}: {tools[s]} is not installed (scripts/setup.sh installs it)", file=sys.stderr)
    return [s for s in systems if s not in missing]


def refuse(found: list[str]) -> int | None:
    """Prints the problems; 2 (the drivers' exit code for it) if any."""
    for p in found:
        print(f"error: {p}", file=sys.stderr)
    return 2 if found else None

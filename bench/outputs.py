"""Where a driver's run goes, for the drivers whose outputs are just these:
the command that made it, its tables (printed and written as Markdown)
and its raw numbers (JSON), all in the run's --out directory."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def record_command(out: Path, module: str, argv: list[str] | None) -> None:
    """command.txt: the exact command line, to re-run it (docs/benchmarks.md quotes these)."""
    words = [sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])]
    (out / "command.txt").write_text(" ".join(shlex.quote(a) for a in words) + "\n")


def publish(out: Path, md: str, results: dict) -> None:
    """The tables on stdout and in results.md; the numbers in results.json."""
    print(md)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(results, indent=1))

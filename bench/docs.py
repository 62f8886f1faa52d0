"""Regenerates the results tables in docs/benchmarks.md from the committed
records under bench/results/<study>/results.json:

    python -m bench.docs            # rewrite the generated sections
    python -m bench.docs --check    # exit 1 if any differs (what the test runs)

A generated section lies between `<!-- results:STUDY -->` and
`<!-- /results:STUDY -->`; it holds exactly what the study's driver
renders from its record (the same tables it printed when it ran), its
headings moved two levels down to sit under the docs' own.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import ab, cache, cachestudy, cachetests, conformance, dataplane, ecmp, forwarding, frontdoor, handoff, health, idle, mesh, paper, proxy, regimes, resilience, scaleout, scores, traceoverhead, upgrade, weights
from .lib import results

DOCS = results.REPO / "docs" / "benchmarks.md"

# Each study's renderer: its record in, its tables out.
RENDER = {
    "cache": cache.render,
    "cachestudy": cachestudy.render,
    "cachetests": cachetests.render,
    "conformance": conformance.render,
    "dataplane": dataplane.render,
    "ecmp": ecmp.render,
    "fleet": regimes.render,
    "fleet-load": regimes.render,
    "hidden-open": regimes.render,
    "bursts": regimes.render,
    "bursts-seed2": regimes.render,
    "mesh-sizes-profile": mesh.render,
    "mesh-sizes-rcvbuf": mesh.render,
    "forwarding": forwarding.render,
    "frontdoor": frontdoor.render,
    "handoff": handoff.render,
    "handoff-soak": handoff.render,
    "handoff-soak-de1cc0b": handoff.render,
    "handoff-de1cc0b": handoff.render,
    "handoff-93b1ade": handoff.render,
    "handoff-4901294": handoff.render,
    "handoff-ab": ab.render,
    "handoff-ab-fold": ab.render,
    "handoff-ab-splice": ab.render,
    "handoff-ab-build": ab.render,
    "handoff-ab-early-static": ab.render,
    "handoff-ab-early-think": ab.render,
    "handoff-ab-spare": ab.render,
    "handoff-ab-steer": ab.render,
    "handoff-ab-quickack": ab.render,
    "handoff-ab-quickack-sizes": ab.render,
    "handoff-ab-join": ab.render,
    "handoff-ab-moveok": ab.render,
    "handoff-ab-moveok-clients4": ab.render,
    "handoff-ab-joinok-data": ab.render,
    "proxy-ab-codegen": ab.render,
    "proxy-ab-inline": ab.render,
    "proxy-python-origin": proxy.render,
    "handoff-ab1-6aab144": handoff.render,
    "handoff-ab1-713cd87": handoff.render,
    "handoff-ab2-713cd87": handoff.render,
    "handoff-ab2-6aab144": handoff.render,
    "moves-ab-bf525b9": handoff.render,
    "moves-ab-f706b59": handoff.render,
    "health": health.render,
    "idle": idle.render,
    "idle-before": idle.render,
    "keepalive": regimes.render,
    "keepalive-both": regimes.render,
    "mesh": mesh.render,
    "openloop": regimes.render,
    "paper": paper.render,
    "proxy": proxy.render,
    "regimes": regimes.render,
    "resilience": resilience.render,
    "scaleout": scaleout.render,
    "scores": scores.render,
    "traceoverhead": traceoverhead.render,
    "upgrade": upgrade.render,
    "weights": weights.render,
}

SECTION = re.compile(r"(<!-- results:([a-z][a-z0-9-]*) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def generated(study: str, base: Path = results.RESULTS) -> str:
    md = RENDER[study](results.load(study, base))
    # Two levels down, and no heading deeper than Markdown has.
    md = re.sub(r"^(#{1,4}) ", lambda m: "#" * min(6, len(m.group(1)) + 2) + " ", md, flags=re.M)
    return md.strip() + "\n"


def regenerate(text: str, base: Path = results.RESULTS) -> str:
    return SECTION.sub(lambda m: m.group(1) + generated(m.group(2), base) + m.group(4), text)


def studies_in(text: str) -> list[str]:
    return [m.group(2) for m in SECTION.finditer(text)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.docs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated section differs")
    args = ap.parse_args(argv)
    text = DOCS.read_text()
    new = regenerate(text)
    if args.check:
        if new != text:
            print(f"{DOCS}: generated sections differ from bench/results; run `python -m bench.docs`", file=sys.stderr)
            return 1
        return 0
    DOCS.write_text(new)
    print(f"{DOCS}: {', '.join(studies_in(new))} regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())

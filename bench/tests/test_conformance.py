"""The HTTP caching conformance suite: inband passes every case (must and
should), the cases fail where a cache would misbehave (run against the
bare origin, which caches nothing), and the table is rendered from known
results."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import conformance as cf
from driver_runs import INBAND, REPO


@pytest.mark.skipif(not INBAND.is_file(), reason="needs target/debug/inband (scripts/setup.sh)")
def test_inband_passes_every_case(tmp_path):
    """Over HTTP/1.1 and over HTTP/2 (h2c)."""
    cmd = [sys.executable, "-m", "bench.conformance", "--systems", "inband", "--http2", "--inband", str(INBAND), "--results", str(tmp_path)]
    cp = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert cp.returncode == 0, f"{cp.stdout[-4000:]}\n{cp.stderr[-2000:]}"
    md = (tmp_path / "results.md").read_text()
    assert "| inband proxy (memory) | inband proxy (memory), HTTP/2 |" in md
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert len(rows) == len(cf.CASES)
    assert all(r.count("| pass") == 2 for r in rows), "\n".join(r for r in rows if "FAIL" in r)
    assert subprocess.run(["pgrep", "-af", "inband-conformance-"], capture_output=True, text=True).stdout == ""


def test_cases_fail_without_a_cache():
    """Pointed at the origin itself, which stores nothing, the cases that
    need a cache fail and say why; those that need a proxy's own answers
    (400, 504, Via) fail too. (The origin speaks HTTP/1.1 only: the
    HTTP/2 client is checked by the run against inband.)"""
    origin = cf.Origin()
    try:
        want_fail = ["freshness-max-age", "vary-two-variants", "age-on-hit", "only-if-cached-hit", "client-conditional-hit", "via", "host-missing-400"]
        by_id = {c.id: c for c in cf.CASES}
        for case_id in want_fail:
            case = by_id.get(case_id) or by_id[f"cc-req-{case_id}"]
            r = cf.run_case(case, origin, origin.port)
            assert not r["pass"] and r["why"], (case.id, r)
        # And the ones a non-cache satisfies pass: nothing stored, nothing wrong.
        for case_id in ["cc-resp-private-mixed-case", "freshness-expires-past", "set-cookie-not-replayed"]:
            assert cf.run_case(by_id[case_id], origin, origin.port)["pass"], case_id
    finally:
        origin.close()


def test_table_and_must_failures_from_known_results():
    ids = [c.id for c in cf.CASES]
    results = {
        "inband": {i: {"pass": True, "why": ""} for i in ids},
        "nginx": {i: {"pass": i != "via", "why": "no Via toward the client" if i == "via" else ""} for i in ids},
    }
    results["inband"]["freshness-max-age"] = {"pass": False, "why": "origin saw 2 requests, expected 1"}
    md = cf.markdown(results)
    line = next(x for x in md.splitlines() if x.startswith("| `freshness-max-age`"))
    assert line.endswith("| **FAIL**: origin saw 2 requests, expected 1 | pass |"), line
    assert "| `via` | should | 9110 §7.6.3 | pass | **FAIL**: no Via toward the client |" in md
    musts = sum(c.kind == "must" for c in cf.CASES)
    assert f"inband proxy (memory): {musts - 1}/{musts} must" in md
    assert cf.inband_must_failures(results) == ["freshness-max-age"]
    results["inband" + cf.H2] = {i: {"pass": i != "via" and i != "vary-star", "why": ""} for i in ids}
    assert cf.inband_must_failures(results) == ["freshness-max-age", "vary-star/h2"]
    assert "| inband proxy (memory) | nginx proxy_cache | inband proxy (memory), HTTP/2 |" in cf.markdown(results)

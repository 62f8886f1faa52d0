"""bench.idle: its table from a known record, and a tiny run on a testbed."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bench import idle
from driver_runs import INBAND, run_tiny, table_rows


def record(rows: list[dict]) -> dict:
    return {"commit": {"sha": "0" * 40, "dirty": False}, "command": "python -m bench.idle", "started_utc": "2026-11-30T00:00:00Z",
            "wall_s": 30, "machine": {"cores": 2, "cpu": "x", "kernel": "k"}, "load_average": {"start": [0, 0, 0], "end": [0, 0, 0]},
            "profile": {"seconds": 10.0}, "rows": rows}


def test_the_table_gives_ms_per_second_and_the_ratio_to_haproxy():
    rows = [{"system": "inband", "case": "up", "seconds": 10.0, "cpu_s": 0.18}, {"system": "haproxy", "case": "up", "seconds": 10.0, "cpu_s": 0.09},
            {"system": "inband", "case": "gone", "seconds": 10.0, "cpu_s": 0.21}]
    t = {(r[0], r[1]): r[2:] for r in table_rows(idle.render(record(rows)), "| backend | balancer |")}
    assert t[("backend up", "inband lb, dsr-rr")] == ["18.0", "2.00×"]
    assert t[("backend up", "HAProxy, mode tcp")] == ["9.0", "–"]
    # A row that failed is left out, and its ratio with it.
    assert t[("backend's host gone (no ARP answer)", "inband lb, dsr-rr")] == ["21.0", "–"]
    assert ("backend's host gone (no ARP answer)", "HAProxy, mode tcp") not in t


@pytest.mark.skipif(os.geteuid() != 0 or not INBAND.exists() or not shutil.which("haproxy"), reason="needs root, target/debug/inband and haproxy")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"id{os.getpid() % 100000}"
    cp, left = run_tiny("bench.idle", name, tmp_path, 120)
    assert left == [], f"namespaces left behind: {left}"
    rec = json.loads((tmp_path / "results.json").read_text())
    assert rec["failed"] == []
    got = {(r["system"], r["case"]): r for r in rec["rows"]}
    assert sorted(got) == sorted((s, c) for s in idle.SYSTEMS for c in idle.CASES)
    for r in got.values():
        assert r["seconds"] >= 1.0 and r["cpu_s"] >= 0, r
    # The balancer ran its workers through the window: some CPU was spent.
    assert got[("inband", "up")]["cpu_s"] > 0 and got[("inband", "gone")]["cpu_s"] > 0
    assert len(table_rows(cp.stdout, "| backend | balancer |")) == 4

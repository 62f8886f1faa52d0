"""Seed 002's driver: its tables from known numbers, and its tiny profile
end to end (flaps slower than a download: shadowing must lose nothing;
the namespaces gone afterwards)."""

from __future__ import annotations

import json
import os

import pytest

from bench import ecmp
from driver_runs import run_tiny, table_rows


def test_tables_put_ecmp_beside_shadowing_with_a_ratio():
    r = {
        "flapping": [
            {"size_mb": 5, "interval_s": 1, "mode": "ECMP", "ok": 60, "failed": 40, "failed_pct": 40.0, "redirected_pct": 0.0},
            {"size_mb": 5, "interval_s": 1, "mode": "shadowing", "ok": 96, "failed": 4, "failed_pct": 4.0, "redirected_pct": 7.5},
            {"size_mb": 5, "interval_s": 1, "mode": "shadowing, 2 generations", "ok": 98, "failed": 2, "failed_pct": 2.0, "redirected_pct": 8.5},
            {"size_mb": 5, "interval_s": 1, "mode": "shadowing, 4 generations", "ok": 99, "failed": 1, "failed_pct": 1.0, "redirected_pct": 9.5},
            {"size_mb": 5, "interval_s": 1, "mode": "shadowing, 8 generations", "ok": 99, "failed": 1, "failed_pct": 1.0, "redirected_pct": 9.0},
            {"size_mb": 5, "interval_s": 5, "mode": "ECMP", "ok": 90, "failed": 10, "failed_pct": 10.0, "redirected_pct": 0.0},
            {"size_mb": 5, "interval_s": 5, "mode": "shadowing", "ok": 100, "failed": 0, "failed_pct": 0.0, "redirected_pct": 1.0},
            {"size_mb": 5, "interval_s": 5, "mode": "shadowing, 2 generations", "ok": 100, "failed": 0, "failed_pct": 0.0, "redirected_pct": 1.0},
            {"size_mb": 5, "interval_s": 5, "mode": "shadowing, 4 generations", "ok": 100, "failed": 0, "failed_pct": 0.0, "redirected_pct": 1.0},
            {"size_mb": 5, "interval_s": 5, "mode": "shadowing, 8 generations", "ok": 100, "failed": 0, "failed_pct": 0.0, "redirected_pct": 1.0},
        ],
        "planned": [{"mode": "ECMP", "ok": 9, "failed": 1, "failed_pct": 10.0}, {"mode": "shadowing", "ok": 10, "failed": 0, "failed_pct": 0.0}],
        "latency": {"without the program": [10.0] * 9 + [50.0], "with the program": [12.0] * 10, "chained": [40.0] * 10},
    }
    md = ecmp.markdown(r)
    rows = table_rows(md, "| size | flap every |")
    # The ratio is against the best shadowing row: 4 and 8 generations here.
    assert rows[0][:8] == ["5 MB", "1 s", "40.00% (40)", "4.00% (4)", "2.00% (2)", "1.00% (1)", "1.00% (1)", "40.0×"]
    assert rows[0][8:] == ["100, 100, 100, 100, 100", "7.50%, 8.50%, 9.50%, 9.00%"]
    assert rows[1][7] == "∞" and rows[1][9] == "1.00%, 1.00%, 1.00%, 1.00%"
    planned = table_rows(md, "| mode | requests | failed |")
    assert planned == [["ECMP", "10", "10.00% (1)"], ["shadowing", "10", "0.00% (0)"]]
    lat = {r[0]: r for r in table_rows(md, "| case | median µs |")}
    assert lat["with the program"][3] == "+2.0" and lat["chained"][3] == "+30.0" and lat["without the program"][2] == "50.0"


def test_a_goal_run_tables_the_one_mode_it_ran():
    r = {"flapping": [{"size_mb": 5, "interval_s": 1, "mode": "shadowing, 8 generations", "ok": 3800, "failed": 0, "failed_pct": 0.0,
                       "redirected_pct": 5.0}], "planned": [], "latency": {}}
    md = ecmp.markdown(r)
    assert "| size | flap every | shadowing, 8 generations failed | ECMP / best | requests (8 generations) |" in md
    assert table_rows(md, "| size | flap every |") == [["5 MB", "1 s", "0.00% (0)", "–", "3800", "5.00%"]]
    assert ecmp.PROFILES["goal"].flap_modes == ("shadowing, 8 generations",)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and attaches tc programs")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"ec{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.ecmp", name, out, 300)
    assert left == [], f"namespaces left behind: {left}"
    data = json.loads((out / "results.json").read_text())["rows"]
    flaps = {x["mode"]: x for x in data["flapping"]}
    # Flaps every 2 s, downloads of well under a second: no connection
    # sees two changes, so shadowing keeps every one.
    for mode, plain, _ in ecmp.FLAP_MODES[1:]:
        assert flaps[mode]["failed"] == 0 and flaps[mode]["ok"] >= 8, flaps
    assert flaps["ECMP"]["ok"] + flaps["ECMP"]["failed"] >= 8, flaps
    planned = {x["mode"]: x for x in data["planned"]}
    assert planned["shadowing"]["failed"] == 0 and planned["shadowing"]["ok"] >= 4, planned
    lat = data["latency"]
    assert set(lat) == {"without the program", "with the program", "chained"}
    assert all(len(v) == ecmp.PROFILES["tiny"].echoes and min(v) > 0 for v in lat.values())
    # Every echo of the chained case went through the shadow table.
    assert data["echoes_chained"] >= ecmp.PROFILES["tiny"].echoes, data["echoes_chained"]
    assert (out / "flapping.png").stat().st_size > 1000
    assert "| size | flap every |" in cp.stdout

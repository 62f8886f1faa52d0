"""The scale-out driver: its tables from known numbers, and its tiny
profile end to end (every planned change with inband loses nothing, a
client reusing its ports included; an instance whose host loses its
carrier breaks none of the others' downloads; the namespaces gone
afterwards)."""

from __future__ import annotations

import json
import os

import pytest

from bench import scaleout
from driver_runs import run_tiny, table_rows


def test_tables_give_failures_and_throughput_ratios():
    r = {
        "changes": [
            {"experiment": "b3 joins, then b1 leaves", "mode": "plain ECMP", "ok": 30, "failed": 10, "failed_pct": 25.0,
             "short_ok": 90, "short_failed": 3, "chained_packets": 500, "chained_no_flow": 0, "later_connection": 0},
            {"experiment": "b3 joins, then b1 leaves", "mode": "inband (shadow + chaining)", "ok": 40, "failed": 0, "failed_pct": 0.0,
             "short_ok": 95, "short_failed": 0, "chained_packets": 900, "chained_no_flow": 0, "later_connection": 1200},
        ],
        "throughput": [
            {"path": "straight to one server (no balancer)", "instances": 0, "rps": 10000.0},
            {"path": "1 instance", "instances": 1, "rps": 5000.0},
            {"path": "2 instances", "instances": 2, "rps": 6000.0},
        ],
    }
    md = scaleout.markdown(r)
    rows = table_rows(md, "| change | mode |")
    assert rows[0] == ["b3 joins, then b1 leaves", "plain ECMP", "40", "25.00% (10)", "93", "3", "500", "0", "0"]
    assert rows[1][3] == "0.00% (0)" and rows[1][8] == "1200"
    r["crashes"] = [{"mode": "dsr-rr Maglev, fleet tuples", "form": "carrier lost", "held": 5, "held_half_open": 1, "ok": 20, "failed": 2,
                     "failed_held": 2, "failed_held_opening": 1, "failed_others": 0, "adopted": 4, "steps_s": [[5.0, 7.25]], "short_ok": 40, "short_failed": 3, "chained_no_flow": 7,
                     "pauses": scaleout.pauses([
                         {"first_byte_s": 1.0, "last_byte_s": 9.0, "local_port": "4001", "ok": True, "gap_ms": 1200.0},
                         {"first_byte_s": 2.0, "last_byte_s": 8.0, "local_port": "4002", "ok": True, "gap_ms": 1800.0},
                         {"first_byte_s": 2.0, "last_byte_s": 9.0, "local_port": "4003", "ok": True, "gap_ms": 30.0},
                         {"first_byte_s": 3.0, "last_byte_s": 70.0, "local_port": "4004", "ok": False, "gap_ms": 0.0},
                         {"first_byte_s": 0.0, "last_byte_s": 4.99, "local_port": "4005", "ok": True, "gap_ms": 12.0},
                     ], 5.0, {4001, 4002, 4004})}]
    crash = table_rows(scaleout.markdown(r), "| VIP | b1's host |")
    assert crash == [["dsr-rr Maglev, fleet tuples", "carrier lost", "2.2 s", "5 (1)", "22", "2 (1)", "0", "4", "1800 / 1800 (2)", "30 (1)", "12",
                      "43", "3", "7"]]
    tp = {t[0]: t for t in table_rows(md, "| path | req/s |")}
    assert tp["2 instances"][1:] == ["6000", "0.60×", "1.20×"]
    assert tp["straight to one server (no balancer)"][2] == "1.00×"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and attaches XDP programs")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"sc{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.scaleout", name, out, 400)
    assert left == [], f"namespaces left behind: {left}"
    data = json.loads((out / "results.json").read_text())["rows"]
    for c in data["changes"]:
        assert c["ok"] + c["failed"] >= 4 and c["short_ok"] + c["short_failed"] >= 10, c
        if c["mode"] != "plain ECMP":
            assert c["failed"] == 0 and c["short_failed"] == 0 and c["chained_no_flow"] == 0, json.dumps(c)
    joins = {(c["experiment"], c["mode"]): c for c in data["changes"] if c["experiment"].startswith("b3 joins")}
    # Connections did move when b3 joined and b1 left: chaining carried them.
    assert joins[("b3 joins, then b1 leaves", "inband (shadow + chaining)")]["chained_packets"] > 0, joins
    # With the client's ports reused, later connections did meet closing
    # flows on other instances (the regime happened) and none was lost.
    reused = joins[(scaleout.reused_row(scaleout.PROFILES["tiny"]), "inband (shadow + chaining)")]
    assert reused["later_connection"] > 0 and reused["failed"] == 0, reused
    # b1's host lost its carrier: whatever b1 held may break, nothing the
    # others held did.
    (crash,) = data["crashes"]
    assert crash["form"] == "carrier lost" and crash["ok"] + crash["failed"] >= 4, crash
    assert crash["mode"] == scaleout.CRASH_MODES["dynamic-announced"].name, crash
    assert crash["failed_others"] == 0, json.dumps(crash)
    assert crash["failed_held"] <= crash["held"], crash
    # Every download was timed, and each completed one paused at least
    # once for the token bucket; those in flight at the crash are counted.
    assert len(crash["timed"]) == crash["ok"] + crash["failed"], crash
    assert all(t["gap_ms"] > 0 for t in crash["timed"] if t["ok"]), crash["timed"]
    pz = crash["pauses"]
    assert pz["b1_kept"] + pz["others_in_flight"] + pz["calm"] == crash["ok"], pz
    tp = {t["instances"]: t["rps"] for t in data["throughput"]}
    assert set(tp) == {0, 1, 2, 4} and min(tp.values()) > 100, tp
    assert (out / "throughput.png").stat().st_size > 1000
    assert "| change | mode |" in cp.stdout

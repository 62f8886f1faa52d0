"""The health-check driver: its numbers from known requests, its tables,
the open-loop generator against a local server, and the quick profile end
to end (every row and scenario in the table, inband within the issue's
targets, the namespaces gone afterwards)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import sys
import threading

import pytest

from bench import health
from bench.openloop import main as openloop
from driver_runs import run_tiny, table_rows

V = health.body_bytes(health.VICTIM)  # the victim's body length
OTHER = health.body_bytes(1)


def test_analyse_times_failures_from_the_fault_and_service_from_the_recovery():
    t0, t_rec = 100.0, 108.0
    samples = [
        [99.0, 99.01, "", V],
        [99.9, 99.91, "", OTHER],
        [100.1, 100.1, "refused", None],
        [100.6, 100.6, "refused", None],
        [100.3, 100.31, "", OTHER],
        [99.95, 101.95, "connect timeout", None],  # in flight at t0
        [105.0, 105.01, "", OTHER],
        [108.05, 108.06, "", OTHER],
        [108.4, 108.41, "", V],
        [108.5, 108.51, "", V],
    ]
    changes = [(100.45, "down", "checks", None), (108.3, "up", "checks", None)]
    r = health.analyse(samples, t0, t_rec, V, changes, FLOORS)
    assert (r["requests"], r["failed"]) == (10, 3)
    assert r["kinds"] == {"refused": 2, "connect timeout": 1}
    assert (r["first_failed_ms"], r["last_failed_ms"], r["failing_ms"]) == (-50, 600, 600)
    assert r["failed_after_recovery"] == 0
    assert (r["back_ms"], r["marked_down_ms"], r["marked_up_ms"]) == (400, 450, 300)
    assert (r["changes"], r["shortest_gap_ms"], r["served_by_victim"]) == (2, 7850, 3)
    assert (r["passive_downs"], r["passive_early"], r["gaps_below_floor"]) == (0, 0, 0)
    assert r["failures"][0] == [-50, "connect timeout"]
    # Nothing failed: failing for 0; the victim never back: None.
    r = health.analyse([[101.0, 101.1, "", OTHER]], t0, t_rec, V, [])
    assert (r["failed"], r["failing_ms"], r["first_failed_ms"], r["back_ms"], r["marked_down_ms"]) == (0, 0, None, None, None)


FLOORS = (180, 90)  # after a change the checks made, after a passive ejection


def test_a_passive_ejection_is_judged_by_the_refusals_before_it():
    t0, t_rec, V = 100.0, 101.0, 1002
    refused = [[100.05 + i / 100, 100.06 + i / 100, "refused", None] for i in range(3)]
    # Up, then 3 refusals, then a passive ejection for them 80 ms after the
    # return (sooner than checks could move it, and sound), then back 100
    # ms later (a check in flight passed at once, the next one 100 ms on).
    changes = [(99.5, "down", "checks", None), (100.0, "up", "checks", None), (100.08, "down", "passive", 3), (100.18, "up", "checks", None)]
    r = health.analyse(refused, t0, t_rec, V, changes, FLOORS)
    assert (r["passive_downs"], r["passive_early"], r["shortest_gap_ms"], r["gaps_below_floor"]) == (1, 0, 100, 0)
    assert health.verdict("flap", r) == "met"
    # Ejected for 3 refusals, the clients saw 2 since it came back: the
    # balancer counted some from before.
    r = health.analyse(refused[1:], t0, t_rec, V, changes, FLOORS)
    assert r["passive_early"] == 1
    assert health.verdict("flap", r) == "missed: 1 passive ejections on refusals the clients did not see"
    # Ejected for unanswered handshakes (a silent host): no refusal to see.
    r = health.analyse([], t0, t_rec, V, [(100.0, "up", "checks", None), (100.08, "down", "passive", 0)], FLOORS)
    assert (r["passive_downs"], r["passive_early"]) == (1, 0)


def test_changes_the_checks_made_keep_their_floor():
    t0, t_rec, V = 100.0, 101.0, 1002
    def gaps(*changes):
        return health.analyse([], t0, t_rec, V, list(changes), FLOORS)["gaps_below_floor"]
    assert gaps((100.0, "down", "checks", None), (100.175, "up", "checks", None)) == 0  # within the resolution
    assert gaps((100.0, "down", "checks", None), (100.12, "up", "checks", None)) == 1
    # A backend ejected by its checks right after it came back flaps too.
    assert gaps((100.0, "up", "checks", None), (100.06, "down", "checks", None)) == 1
    # Back sooner than one fast interval after a passive ejection.
    assert gaps((100.0, "down", "passive", 3), (100.06, "up", "checks", None)) == 1
    assert gaps((100.0, "down", "passive", 3), (100.085, "up", "checks", None)) == 0


def test_verdict_holds_the_issues_targets():
    ok = {"failing_ms": 900, "failed_after_recovery": 0, "back_ms": 500, "shortest_gap_ms": None}
    assert health.verdict("app", ok) == "met"
    assert health.verdict("app", {**ok, "failing_ms": 1001}) == "missed: failures for 1001 ms > 1000"
    assert health.verdict("host", {**ok, "failing_ms": 2999}) == "met"
    assert health.verdict("host", {**ok, "failing_ms": 3001, "failed_after_recovery": 2, "back_ms": None}) == (
        "missed: failures for 3001 ms > 3000; 2 failed after recovery; not back"
    )
    assert health.verdict("app", {**ok, "back_ms": 3500}) == "missed: back after 3500 ms > 3000"
    assert health.verdict("flap", {**ok, "gaps_below_floor": 0}) == "met"
    assert health.verdict("host", {**ok, "gaps_below_floor": 2}) == "missed: 2 changes sooner than rise/fall allow"


def test_floors_are_fast_intervals_less_jitter():
    assert health.BY_KEY["dsr-rr"].fast_floor_ms() == 180
    assert health.BY_KEY["haproxy"].fast_floor_ms() == 200
    assert health.BY_KEY["dsr-rr"].return_floor_ms() == 90


def _scenario(failed, failing, **kw):
    base = {"requests": 100, "failed": failed, "kinds": {"refused": failed} if failed else {}, "first_failed_ms": 10 if failed else None,
            "last_failed_ms": failing if failed else None, "failing_ms": failing, "failed_after_recovery": 0, "marked_down_ms": 400,
            "back_ms": 300, "marked_up_ms": 250, "changes": 2, "shortest_gap_ms": 900, "counter": 2, "toggles": 6, "verdict": "met"}
    return {**base, **kw}


def test_tables_give_every_row_with_ratios_against_haproxy():
    rows = [
        {"key": "dsr-rr", "label": "inband dsr-rr", "floor_ms": 180.0, "profile_flap_every_ms": 300,
         "scenarios": {"app": _scenario(2, 200), "host": _scenario(10, 1500), "flap": _scenario(5, 0)}},
        {"key": "haproxy", "label": "HAProxy", "floor_ms": 200.0, "profile_flap_every_ms": 300,
         "scenarios": {"app": _scenario(4, 400), "host": _scenario(0, 0), "flap": _scenario(1, 0, counter=0, changes=0, shortest_gap_ms=None)}},
    ]  # fmt: skip
    md = health.markdown(rows)
    t = table_rows(md, "| balancer | scenario |")
    assert [r[:2] for r in t] == [["inband dsr-rr", "application down"], ["inband dsr-rr", "host down"],
                                  ["HAProxy", "application down"], ["HAProxy", "host down"]]  # fmt: skip
    assert t[0][3:8] == ["2", "2 refused", "10 → 200", "200", "0"]
    assert t[0][11:] == ["2 (900 ms)", "0.50×", "0.50×", "met"]
    assert t[1][12:14] == ["∞", "∞"] and t[3][3:6] == ["0", "–", "–"]
    f = table_rows(md, "| balancer | toggles |")
    assert f[0] == ["inband dsr-rr", "6", "2", "2", "900", "180", "100", "5", "5 refused", "met"]
    assert f[1][2:5] == ["0", "0", "–"]


class _Body(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Length", "7")
        self.end_headers()
        self.wfile.write(b"x" * 7)

    def log_message(self, *_):
        pass


def test_openloop_records_each_request_and_how_it_failed(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Body)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "ok.jsonl"
        assert openloop(["127.0.0.1", str(server.server_address[1]), "20", "0.5", "2", str(out)]) == 0
        samples = health.read_samples(out)
        assert len(samples) == 10 and all(s[2] == "" and s[3] == 7 for s in samples), samples
        starts = sorted(s[0] for s in samples)
        # Open loop: one start every 50 ms, not one after another's end.
        assert 0.4 <= starts[-1] - starts[0] <= 0.6, starts
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "refused.jsonl"
    openloop(["127.0.0.1", str(port), "20", "0.2", "1", str(out)])
    assert [s[2] for s in health.read_samples(out)] == ["refused"] * 4


@pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("haproxy", "nft")),
    reason="needs root (network namespaces, XDP), haproxy and nft",
)
def test_quick_profile_end_to_end(tmp_path):
    name = f"hb{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.health", name, out, 400, profile="quick")
    assert left == [], f"namespaces left behind: {left}"
    data = json.loads((out / "results.json").read_text())
    assert data["failed"] == [] and data["commit"] and data["machine"]["cores"], data["failed"]
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == list(health.PROFILES["quick"].rows)
    md = (out / "results.md").read_text()
    table = table_rows(md, "| balancer | scenario |")
    assert {(r[0], r[1]) for r in table} == {(row["label"], health.SCENARIO_LABELS[sc]) for row in rows.values() for sc in ("app", "host")}
    assert [r[0] for r in table_rows(md, "| balancer | toggles |")] == [row["label"] for row in rows.values()]
    for key, row in rows.items():
        for sc in health.SCENARIOS:
            s = row["scenarios"][sc]
            # Load went through the whole run, and the faults did happen:
            # the victim served before and after, the balancer saw it go.
            # As a string: pytest cuts a tuple's repr before the values that
            # say why.
            why = json.dumps([key, sc, s])
            assert s["requests"] >= 40 and s["served_by_victim"] > 0, why
            if sc != "flap":
                assert s["marked_down_ms"] is not None and s["back_ms"] is not None, why
        if row["kind"] == "inband":
            for sc in ("app", "host"):
                s = row["scenarios"][sc]
                assert s["failing_ms"] <= health.TARGET_MS[sc] and s["failed_after_recovery"] == 0, (key, sc, json.dumps(s))
                assert s["back_ms"] <= health.TARGET_BACK_MS, (key, sc, s)
                # Down once, up once: no second ejection on the way back.
                assert s["changes"] == 2 and s["verdict"] == "met", (key, sc, s["verdict"], s["changes"])
            flap = row["scenarios"]["flap"]
            assert flap["toggles"] >= 4
            # No change the checks made sooner than rise/fall allow (timed
            # by the log lines' own clock). A passive ejection may come
            # sooner (the application killed just after its return), for
            # refusals the clients saw since.
            assert flap["gaps_below_floor"] == 0 and flap["passive_early"] == 0, (key, flap)
    assert "| balancer | scenario |" in cp.stdout, cp.stdout[-2000:]
    print(md, file=sys.stderr)

"""The regime study's driver: its budget arithmetic and schedules without a
testbed, and its tiny grid end to end (rows, columns, matched budgets)."""

from __future__ import annotations

import json
import os
import random

import pytest

from bench import regimes
from driver_runs import run_tiny, table_rows

CONFIG_ROWS = [
    "dsr-dynamic (in-band)",
    "dsr-polling, equal budget",
    "dsr-polling, best poller",
    "dsr-query (ask before forwarding)",
    "DSR least-connections (own counts, no feedback)",
    "DSR round-robin",
]


def test_equal_poll_interval_sends_as_many_requests():
    # 3 servers, 600 probes in 20 s = 30/s; polling 3 per round: every 100 ms.
    assert regimes.equal_poll_ms(3, 600, 20.0) == 100
    assert regimes.equal_poll_ms(2, 10**9, 1.0) == 1
    with pytest.raises(RuntimeError):
        regimes.equal_poll_ms(3, 0, 20.0)


def test_slowdown_windows_are_in_the_run_and_the_same_per_regime():
    for seed in range(50):
        for start, length, factor in regimes.slowdown_windows(random.Random(seed), 20):
            assert 0 <= start and start + length <= 1 and 2 / 20 <= length <= 4 / 20 and factor == 5.0
    r = regimes.BY_KEY["servers-4"]
    a, b = regimes.specs_for(r, 20, 1), regimes.specs_for(r, 20, 1)
    assert a == b and len(a) == 4 and all(s.speed == 1.0 and len(s.slowdowns) == 2 for s in a)
    assert len({s.slowdowns for s in a}) == 4  # each server slowed at its own times
    assert all(s.slowdowns == () for s in regimes.specs_for(regimes.BY_KEY["heavy-tail"], 20, 1))


def test_verdict_uses_the_issue_bar():
    assert regimes.verdict(1.3, 1.0, 1.0, 1.0) == "beats the equal-budget poller"
    assert regimes.verdict(1.0, 1.0, 1.0, 0.7) == "beats the best poller"
    assert regimes.verdict(1.29, 0.71, 1.29, 0.71).startswith("no win")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and attaches XDP/tc programs")
def test_tiny_grid_end_to_end(tmp_path):
    name = f"rg{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.regimes", name, out, 420)
    assert left == [], f"namespaces left behind: {left}"
    md = (out / "results.md").read_text()
    keys = list(regimes.PROFILES["tiny"].regimes)

    summary = table_rows(md, "| regime | dynamic RPS | equal poll interval |")
    assert [r[0] for r in summary] == keys
    for r in summary:
        assert len(r) == 14, r
        # The equal-budget poller sent as many requests to the servers as
        # dynamic's score requests, within a quarter.
        assert 0.75 <= float(r[3]) <= 1.25, r
        assert all(c.endswith("×") for c in r[4:13]), r

    for key in keys:
        section = md[md.index(f"## {key}:") :]
        rows = table_rows(section, "| configuration | interval | RPS |")
        assert [r[0] for r in rows] == CONFIG_ROWS, rows
        for r in rows:
            assert len(r) == 10 and float(r[2]) > 0, r
        by = {r[0]: r for r in rows}
        assert by["dsr-dynamic (in-band)"][8] == "1.00×"
        assert by["dsr-dynamic (in-band)"][7] == "0.000"  # no packet of its own
        assert float(by["dsr-polling, best poller"][7]) > 0
        assert by["dsr-polling, best poller"][1] == f"{regimes.BEST_POLL_MS} ms"
        # The control asks the servers nothing: it counts its own connections.
        lc = by["DSR least-connections (own counts, no feedback)"]
        assert (lc[6], lc[7]) == ("0.000", "0.000"), lc
        lb_toml = (out / key / "dsr-leastconn" / "lb.toml").read_text()
        assert 'mode = "dsr-rr"' in lb_toml and 'policy = "least-connections"' in lb_toml, lb_toml

    # Two modelled balancers: dynamic asks every 200th packet.
    data = json.loads((out / "results.json").read_text())
    first = {}
    for r in data["rows"]:
        first.setdefault(r["regime"], r)
    assert first["balancers-2"]["interval"] == "n = 200"
    assert first["slowdowns"]["interval"] == "n = 100"
    assert "| regime | dynamic RPS |" in cp.stdout

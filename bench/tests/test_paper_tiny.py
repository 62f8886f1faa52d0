"""End to end: the paper driver's tiny profile on a real namespace testbed,
every configuration (inband's five modes and the 100 ms poller, HAProxy,
nftables) on our servers, and the paper's rows on the paper's two."""

from __future__ import annotations

import csv
import json
import os

import pytest

from bench.lib.paperbed import BY_KEY, PAPER_ROWS
from driver_runs import run_tiny, table_rows


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and attaches XDP/tc programs")


def test_tiny_profile_end_to_end(tmp_path):
    name = f"pt{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.paper", name, out, 240)
    assert left == [], f"namespaces left behind: {left}"

    # CSV: one row per configuration, in order, every one with traffic.
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["key"] for r in rows] == list(BY_KEY)
    for r in rows:
        assert int(r["requests"]) > 0, r
        assert float(r["rps"]) > 0, r
        assert int(r["failures"]) < int(r["requests"]), r
        assert 0 < float(r["median_ms"]) <= float(r["p99_ms"]) <= float(r["max_ms"]), r
        assert int(r["lb_in_bytes"]) > 0, r  # every configuration sent traffic through the shaped port

    # In-band feedback sends no packet of its own; polling and querying do.
    by = {r["key"]: r for r in rows}
    assert int(by["dsr-dynamic"]["extra_packets"]) == 0
    assert int(by["dsr-polling"]["extra_packets"]) > 0
    assert int(by["dsr-query"]["extra_packets"]) > 0
    # Ten times the poll rate costs (about) ten times the packets.
    assert int(by["dsr-polling-100ms"]["extra_packets"]) > 5 * int(by["dsr-polling"]["extra_packets"]), by
    for k in ("passthrough", "dsr-rr", "haproxy-roundrobin", "nftables-numgen"):
        assert int(by[k]["extra_packets"]) == 0 and int(by[k]["extra_bytes"]) == 0, by[k]

    # By default the options are authenticated and the agents hold the
    # balancer's key: scores signed with any other would be dropped.
    dynamic = by["dsr-dynamic"]
    assert json.loads((out / "dsr-dynamic" / "lb-status.json").read_text())[0]["auth"] == "siphash"
    assert int(dynamic["scores"]) > 0, dynamic
    assert int(dynamic["extra_bytes"]) == 16 * (int(dynamic["probes"]) + int(dynamic["scores"])), dynamic

    # The Markdown table has the paper's columns and one well-formed row per configuration.
    md = (out / "results.md").read_text().splitlines()
    i = md.index("| Configuration | Median | Average | RPS | 90% | 95% | 98% | 99% | Requests | Failures |")
    assert md[i + 1] == "|" + "|".join(["---"] * 10) + "|"
    table = md[i + 2 : i + 2 + len(BY_KEY)]
    assert [line.split(" | ")[0].lstrip("| ") for line in table] == [c.label for c in BY_KEY.values()]
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 10, line
        assert float(cells[3]) > 0, line
        assert cells[1].endswith(("ms", " s")) and cells[2].endswith(" ms"), line

    # The same table on stdout.
    assert "| Configuration | Median | Average | RPS |" in cp.stdout

    for png in ("fig3_rps.png", "fig4_ccdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "results.json").read_text())
    assert record["command"].startswith("python -m bench.paper --profile tiny"), record["command"]
    facts = record["machine"]
    assert facts["cores"] and facts["kernel"] and facts["memory"] and facts["haproxy"].startswith("HAProxy version"), facts
    assert facts["locust"].startswith("locust 2.33.2"), facts

    # dsr-query held SYNs for its query rounds, and says so.
    held = table_rows((out / "results.md").read_text(), "| Configuration | SYNs held |")
    assert [r[0] for r in held] == [BY_KEY["dsr-query"].label]
    assert int(held[0][1]) > 0, held


def test_tiny_profile_on_the_papers_two_servers(tmp_path):
    name = f"pp{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.paper", name, out, 180, ("--servers", "paper", "--configs", ",".join((*PAPER_ROWS, "dsr-polling"))))
    assert left == [], f"namespaces left behind: {left}"
    md = (out / "results.md").read_text()
    assert "servers `paper`" in md.splitlines()[0]

    # Two backends, both used, in every configuration.
    shares = table_rows(md, "| Configuration | s1 (speed 1) | s2 (speed 1) |")
    assert len(shares) == len(PAPER_ROWS) + 1
    for row in shares:
        assert len(row) == 3 and all(int(c.split("(")[1].rstrip(")")) > 0 for c in row[1:]), row

    # Our ratios beside the paper's for each row the paper has (not for
    # dsr-polling), ours filled in since the query baseline ran.
    ratios = table_rows(md, "| Configuration | paper's row | RPS ÷ dsr-query | paper |")
    assert [r[1] for r in ratios] == ["Pass Through", "DSR Round-Robin", "DSR Request Busyness", "Dynamic DSR"]
    dyn = ratios[3]
    assert dyn[3] == "1.48×" and dyn[9] == "2.82×", dyn  # the paper's +47.6% and 2.8x
    assert all(c.endswith("×") for c in dyn[2:]), dyn
    assert ratios[2][2] == "1.00×", ratios[2]
    assert "| Configuration | paper's row |" in cp.stdout

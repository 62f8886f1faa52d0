"""The resilience benchmark (SYN flood, connection churn): its tables and
ratios from known numbers, and its tiny profile end to end on a real
namespace testbed, so it cannot silently rot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from bench import resilience as rs
from driver_runs import run_tiny, table_rows


def samples(start: float, n: int, ms: float, err: str = "", step: float = 0.01) -> list:
    return [[start + i * step, ms, err] for i in range(n)]


# ------------------------------------------------------------------ pure functions


def test_legit_windows_count_failures_apart_from_latency():
    s = samples(0.0, 90, 2.0) + samples(10.0, 9, 4.0) + [[10.5, 5000.0, "timeout"]] + samples(20.0, 5, 1.0)
    during = rs.Legit.of(s, 10.0, 20.0)
    assert (during.ok, during.failed, during.errors) == (9, 1, {"timeout": 1})
    assert during.success_pct == 90.0
    # Latency of the requests that succeeded only: the timeout is not in it.
    assert during.p50_ms == 4.0 and during.p99_ms == 4.0 and during.max_ms == 4.0 and during.slow == 0
    # The last success ended at 10.084 s; the window ends at 20 s.
    assert during.longest_gap_s == pytest.approx(20.0 - 10.084)
    assert during.first_ok_s == pytest.approx(0.004)
    assert rs.Legit.of(s, 20.0).total == 5
    assert rs.Legit.of(s).total == 105
    empty = rs.Legit.of(s, 30.0, 40.0)
    assert empty.total == 0 and empty.success_pct is None and empty.p99_ms is None and empty.longest_gap_s is None


def test_legit_after_a_flood_outage_and_recovery():
    # Open window from 100 s: three timeouts (5 s each), then answers.
    s = [[100.0, 5000.0, "timeout"], [105.0, 5000.0, "timeout"], [110.0, 5000.0, "timeout"]] + samples(115.0, 5, 1000.0, step=1.0)
    after = rs.Legit.of(s, 100.0)
    assert (after.ok, after.failed, after.slow) == (5, 3, 5)
    assert after.first_ok_s == pytest.approx(16.0)  # 115 s + 1 s
    assert after.longest_gap_s == pytest.approx(16.0)
    none_yet = rs.Legit.of(s[:3], 100.0)
    assert none_yet.first_ok_s is None and none_yet.longest_gap_s == pytest.approx(15.0)


def test_percentile_is_nearest_rank():
    assert rs.percentile([5, 1, 4, 2, 3, 6, 7, 8, 9, 10], 90) == 9
    assert rs.percentile([], 50) is None


def test_counter_delta_nested():
    before = {"drops": {"a": 1, "b": 5}, "n": 10, "name": "x"}
    after = {"drops": {"a": 1, "b": 7, "c": 3}, "n": 15, "name": "y"}
    assert rs.counter_delta(before, after) == {"drops": {"a": 0, "b": 2, "c": 3}, "n": 5, "name": "y"}


def test_parse_netstat_and_conntrack_stat():
    snmp = "Tcp: RtoAlgorithm ActiveOpens AttemptFails\nTcp: 1 12 3\n"
    netstat = "TcpExt: SyncookiesSent TW\nTcpExt: 400 7\nIpExt: InNoRoutes\nIpExt: 0\n"
    got = rs.parse_netstat(snmp, netstat)
    assert got["Tcp.ActiveOpens"] == 12 and got["TcpExt.SyncookiesSent"] == 400 and got["TcpExt.TW"] == 7 and got["IpExt.InNoRoutes"] == 0
    ct = "entries  clashres found insert_failed drop\n0000000a 00000000 00000001 00000010 00000002\n0000000a 00000001 00000000 00000001 00000000\n"
    assert rs.parse_conntrack_stat(ct) == {"entries": 10, "clashres": 1, "found": 1, "insert_failed": 17, "drop": 2}
    assert rs.parse_conntrack_stat("") == {}


def test_churn_sources_and_plan():
    assert rs.churn_sources("10.1.0", 130, 1_000_000) == [f"10.1.0.{h}" for h in range(130, 149)]  # 19 × 55,000
    assert rs.churn_sources("10.1.0", 130, 5) == ["10.1.0.130"]
    with pytest.raises(ValueError):
        rs.churn_sources("10.1.0", 240, 1_000_000)
    quick = rs.PROFILES["quick"]
    assert quick.churn >= 1_000_000
    assert [(k, s) for k, _, s in rs.churn_plan(quick)] == [("inband", False), ("nftables", False), ("haproxy", False), ("inband", True)]
    no_variant = rs.Profile(**{**rs.asdict(quick), "server_closes": 0})
    assert [k for k, _, _ in rs.churn_plan(no_variant)] == ["inband", "nftables", "haproxy"]


def flood(kind: str, sent: int, base_p99: float, during: list, after_ok: int, after_failed: int, cpu: float, own: float | None, counters=None) -> rs.Flood:
    base = rs.Legit.of(samples(0.0, 98, 1.0) + samples(1.0, 2, base_p99))
    after = rs.Legit.of(samples(0.0, after_ok, 1.0) + samples(1.0, after_failed, 5000.0, "timeout"))
    return rs.Flood(kind, rs.LABELS[kind], sent, 10.0, base, rs.Legit.of(during), after, cpu, own, counters=counters or {})


def test_flood_table_ratios_against_baseline_and_inband():
    rows = [
        flood("inband", 1_000_000, 2.0, samples(0, 100, 4.0), 20, 0, 10.0, 2.0),
        flood("nftables", 500_000, 2.0, samples(0, 50, 8.0) + samples(1, 50, 5000.0, "timeout"), 19, 1, 10.0, None),
        flood("haproxy", 2_000_000, 4.0, samples(0, 100, 4.0), 20, 0, 10.0, 0.5),
    ]
    t = table_rows(rs.flood_table(rows), "| balancer |")
    assert [r[0] for r in t] == [rs.LABELS[k] for k in ("inband", "nftables", "haproxy")]
    ib, nft, hap = t
    # SYNs, kpps, ÷ inband's
    assert ib[1:4] == ["1,000,000", "100.0", "1.00×"]
    assert nft[1:4] == ["500,000", "50.0", "0.50×"]
    # baseline, during ok/failed, success %, ÷ baseline
    assert ib[4:8] == ["100 (100.0 %)", "100 / 0", "100.0 %", "1.00×"]
    assert nft[5:8] == ["50 / 50", "50.0 %", "0.50×"]
    # slower than 900 ms, longest stretch without a response (the window is
    # the samples' own here: from the first start to the last end)
    assert ib[8:10] == ["0", "0.01"]
    assert nft[8:10] == ["0", "5.99"]  # last success ends at 0.498 s, the last timeout at 6.49 s
    # p99 baseline → during, and ÷ baseline
    assert ib[11:13] == ["2.00 → 4.00", "2.00×"]
    assert hap[11:13] == ["4.00 → 4.00", "1.00×"]
    # after: all succeeded, or flagged; time to the first response
    assert ib[13:15] == ["20 / 20", "0.00"] and "not all" in nft[13]
    # machine CPU s/s, µs per SYN and ÷ inband's: 10 s over 1 M SYNs = 10 µs
    assert ib[15:18] == ["1.00", "10.00", "1.00×"]
    assert nft[16:18] == ["20.00", "2.00×"]
    assert hap[16:18] == ["5.00", "0.50×"]
    # own CPU s/s and ÷ inband's; nftables has no process of its own
    assert ib[18:20] == ["0.200", "1.00×"]
    assert hap[18:20] == ["0.050", "0.25×"]
    assert nft[18:20] == ["–", "–"]


def test_flood_counters_table():
    rows = [
        flood(
            "inband", 1, 1.0, samples(0, 3, 1.0), 1, 0, 1.0, 1.0,
            {"inband": {"drops": {"no_flow": 2, "snat_exhausted": 0}, "events": {"snat_preempt_half_open": 7, "flows_expired": 3}, "new_conns": 9, "half_open_end": 5},
             "switch_drops": {"lb": 11, "s1": 1, "s2": 2, "c1": 100}, "servers_netstat": {"TcpExt.SyncookiesSent": 8}},
        ),  # fmt: skip
        flood("nftables", 1, 1.0, [[0, 1.0, "timeout"]], 1, 0, 1.0, None, {"conntrack": {"insert_failed": 4}, "conntrack_count_end": 6, "conntrack_max": 9}),
    ]
    rows[0].own_runs = 4
    t = table_rows(rs.flood_counters_table(rows), "| balancer |")
    assert "4 packets, 250,000,000 ns per packet" in t[0][2]
    assert "no_flow 2" in t[0][2] and "snat_exhausted" not in t[0][2]
    assert "snat_preempt_half_open 7" in t[0][2] and "flows_expired 3" in t[0][2] and "SYNs balanced 9" in t[0][2]
    assert t[0][3] == "11 / 3" and t[0][5] == "8 / 0"
    assert t[1][1] == "timeout 1" and "insert_failed 4" in t[1][2] and "entries at the end 6 (max 9)" in t[1][2]


def churn(kind: str, asked: int, ok: int, errors: dict, per_s: float, server_closes: bool = False, counters=None) -> rs.Churn:
    failed = sum(errors.values())
    result = {
        "attempted": ok + failed, "ok": ok, "failed": failed, "errors": errors, "slower_than_900ms": 3, "p50_ms": 1.5, "p99_ms": 9.25,
        "max_ms": 1200.0, "seconds": (ok + failed) / per_s, "per_second": per_s,
    }  # fmt: skip
    label = rs.SERVER_CLOSES_LABEL if server_closes else rs.LABELS[kind]
    return rs.Churn(kind, label, asked, server_closes, 100.0, result, counters or {})


def test_churn_table_refusals_and_ratios():
    rows = [
        churn("inband", 1000, 1000, {}, 100.0),
        churn("nftables", 1000, 600, {"connect: timed out": 300}, 50.0),
        churn("haproxy", 1000, 900, {"short response": 100}, 200.0),
        churn("inband", 500, 500, {}, 80.0, server_closes=True),
    ]
    t = table_rows(rs.churn_table(rows), "| balancer |")
    assert t[0][1:8] == ["1,000", "1,000", "1,000", "0", "0", "3", "100"]
    assert t[0][8] == "1.00×"
    # nftables was cut by the time bound: 900 attempted of 1,000 asked, 400 not completed
    assert t[1][2] == "900 (time bound)" and t[1][4] == "300 (connect: timed out 300)" and t[1][5] == "400" and t[1][8] == "0.50×"
    assert t[2][4] == "100 (short response 100)" and t[2][8] == "2.00×"
    # The server-closes variant is compared with inband's own first row.
    assert t[3][0] == rs.SERVER_CLOSES_LABEL and t[3][8] == "0.80×"
    assert t[0][9:12] == ["1.50", "9.25", "1200"]


def test_churn_counters_and_verdicts():
    ok = {"inband": {"drops": {"snat_exhausted": 0, "flow_table_full": 0, "no_flow": 0}, "events": {"snat_preempt_closing": 12}, "new_conns": 126_976}}
    bad = {"inband": {"drops": {"snat_exhausted": 4, "flow_table_full": 0}, "events": {}, "new_conns": 10}}
    rows = [churn("inband", 1000, 1000, {}, 100.0, counters=ok), churn("inband", 10, 6, {"x": 4}, 1.0, server_closes=True, counters=bad)]
    t = table_rows(rs.churn_counters_table(rows), "| balancer |")
    assert "snat_exhausted 0, flow_table_full 0" in t[0][1] and "other drops: none" in t[0][1]
    assert "2.0 uses of each" in t[0][1] and "closing flows 12" in t[0][1]
    assert "snat_exhausted 4" in t[1][1]
    v = rs.verdicts([], rows)
    assert v[0].endswith("0 of 1,000 connections not completed; snat_exhausted 0, flow_table_full 0")
    assert "4 of 10 connections not completed; snat_exhausted 4" in v[1]
    fl = flood("inband", 1, 1.0, samples(0, 3, 1.0), 9, 1, 1.0, 1.0)
    assert "1 of 10 legitimate requests after the flood FAILED" in rs.verdicts([fl], [])[0]


def test_read_samples_skips_a_line_being_written(tmp_path):
    p = tmp_path / "s.json"
    p.write_text('[1.0, 2.0, ""]\n[2.0, 3.0, "timeout"]\n[3.0, 4')
    assert rs.read_samples(p) == [[1.0, 2.0, ""], [2.0, 3.0, "timeout"]]
    assert rs.read_samples(tmp_path / "missing") == []


# ------------------------------------------------------------------ end to end


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces, attaches XDP and tc programs")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"rt{os.getpid() % 100000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.resilience", name, out, 300)
    assert left == [], f"namespaces left behind: {left}"
    assert not any(Path("/sys/fs/bpf/inband/netns").glob(f"{name}-*")), "pins left behind"
    assert not Path(f"/run/inband/bench/{name}").exists(), "socket directory left behind"

    record = json.loads((out / "results.json").read_text())
    res = record["rows"]
    assert [f["kind"] for f in res["flood"]] == ["inband", "nftables", "haproxy"]
    for f in res["flood"]:
        assert f["sent"] > 0 and f["seconds"] > 0, f
        assert f["baseline"]["ok"] > 0 and f["during"]["ok"] + f["during"]["failed"] > 0, f
        assert f["after"]["ok"] + f["after"]["failed"] >= rs.MIN_AFTER, f
        assert f["machine_cpu_s"] > 0, f
    ib = res["flood"][0]
    assert isinstance(ib["during"]["success_pct"], float) and not math.isnan(ib["during"]["success_pct"])
    assert ib["own_cpu_s"] > 0 and ib["own_runs"] > 0  # the XDP program's run time and runs
    assert ib["counters"]["inband"]["new_conns"] > 0  # the flood's SYNs were balanced
    assert res["flood"][2]["own_cpu_s"] is not None  # HAProxy's process time
    # The flood reached HAProxy's host, which answered it with SYN cookies.
    assert res["flood"][2]["counters"]["lb_netstat"]["TcpExt.SyncookiesSent"] > 0

    assert [(c["kind"], c["server_closes"]) for c in res["churn"]] == [("inband", False), ("nftables", False), ("haproxy", False), ("inband", True)]
    for c in res["churn"]:
        r = c["result"]
        assert isinstance(r["failed"], int) and isinstance(r["attempted"], int) and r["ok"] > 0, c
    for c in (res["churn"][0], res["churn"][3]):
        drops = c["counters"]["inband"]["drops"]
        for reason in rs.MUST_BE_ZERO:
            assert isinstance(drops[reason], int), reason
        assert c["counters"]["inband"]["new_conns"] > 0

    md = (out / "results.md").read_text()
    assert "## SYN flood" in md and "## Connection churn" in md
    fl = {row[0]: row for row in table_rows(md, "| balancer | flood SYNs sent")}
    assert sorted(fl) == sorted(rs.LABELS.values())
    for row in fl.values():
        assert row[6].endswith("%") and row[7].endswith("×"), row  # success % and its ratio to the baseline
        float(row[9])  # the longest stretch without a response
        assert row[17].endswith("×"), row  # CPU per SYN ÷ inband's
    ch = {row[0]: row for row in table_rows(md, "| balancer | connections asked")}
    assert sorted(ch) == sorted([*rs.LABELS.values(), rs.SERVER_CLOSES_LABEL])
    for row in ch.values():
        int(row[5].replace(",", ""))  # not completed: a number
        assert row[8].endswith("×"), row
    assert record["command"].startswith("python -m bench.resilience --profile tiny")
    assert "| balancer | flood SYNs sent" in cp.stdout

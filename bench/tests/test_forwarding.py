"""The forwarding benchmark: its tables from known numbers, and its tiny
profile end to end on a real namespace testbed, so it cannot silently rot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench import forwarding as fw
from driver_runs import run_tiny, table_rows


def test_hairpin_table_ratios_and_costs_from_rates():
    rows = [
        fw.Fwd("hairpin", "direct", "direct", 1_000_000, 1_000_000, 1.0, 1_000_000, 1.0),
        fw.Fwd("hairpin", "inband", "inband", 500_000, 500_000, 1.0, 500_000, 1.0),
        fw.Fwd("hairpin", "nftables", "nft", 100_000, 100_000, 1.0, 100_000, 1.0),
    ]
    t = table_rows(fw.fwd_table(rows, "hairpin"), "| path |")
    assert [r[0] for r in t] == ["direct", "inband", "nft"]
    # Mpps, ÷ direct, inband ÷ this
    assert t[1][3:6] == ["0.500", "0.50×", "1.00×"]
    assert t[2][3:6] == ["0.100", "0.10×", "5.00×"]
    # What a path adds to the direct path's 1 µs: inband 1 µs, nftables 9 µs.
    assert t[1][6:8] == ["1.000", "1.00×"]
    assert t[2][6:8] == ["9.000", "9.00×"]
    assert t[0][6] == "–"


def test_no_cost_ratio_against_a_negative_cost():
    # Noise can make a cheap path look faster than the direct one.
    rows = [
        fw.Fwd("hairpin", "direct", "direct", 1_000_000, 1_000_000, 1.0, 1_000_000, 1.0),
        fw.Fwd("hairpin", "inband", "inband", 1_010_000, 1_010_000, 1.0, 1_010_000, 1.0),
        fw.Fwd("hairpin", "nftables", "nft", 500_000, 500_000, 1.0, 500_000, 1.0),
    ]
    t = table_rows(fw.fwd_table(rows, "hairpin"), "| path |")
    assert t[1][6] == "-0.010" and t[1][7] == "–"
    assert t[2][6] == "1.000" and t[2][7] == "–"


def test_hairpin_receive_thread_columns():
    rows = [
        fw.Fwd("hairpin", "direct", "direct", 1_000_000, 1_000_000, 1.0, 1_000_000, 1.0, thread_ns_per_packet=100.0),
        fw.Fwd("hairpin", "inband", "inband", 500_000, 500_000, 1.0, 500_000, 1.0, thread_ns_per_packet=400.0),
        fw.Fwd("hairpin", "nftables", "nft", 100_000, 100_000, 1.0, 100_000, 1.0, thread_ns_per_packet=2000.0),
    ]
    t = table_rows(fw.fwd_table(rows, "hairpin"), "| path |")
    # ns per packet, one core's rate (1000 / ns), inband's one-core rate ÷ this one's
    assert t[0][8:11] == ["100", "10.00", "0.25×"]
    assert t[1][8:11] == ["400", "2.50", "1.00×"]
    assert t[2][8:11] == ["2000", "0.50", "5.00×"]


def test_stream_table_counts_the_balancers_own_cpu():
    rows = [
        fw.Fwd("stream", "direct", "direct", 200_000, 200_000, 2.0, 1000, 2.0),
        fw.Fwd("stream", "inband-pt", "inband", 100_000, 100_000, 2.0, 1000, 2.0, own_cpu_s=0.05),
        fw.Fwd("stream", "haproxy", "haproxy", 100_000, 100_000, 2.0, 1000, 2.0, own_cpu_s=0.5),
    ]
    t = table_rows(fw.fwd_table(rows, "stream"), "| path |")
    assert t[2][3:5] == ["0.050", "0.50×"]
    assert t[2][6:8] == ["5.000", "10.00×"]  # 0.5 s for 0.1 M writes, 10× inband's
    assert t[0][6] == "–"


def test_delivered_writes_from_sink_bytes():
    # 10 segments of 4 writes each: 10 × (66 + 256) bytes on the wire.
    assert fw.delivered_writes({"packets": 10, "bytes": 10 * (fw.SEGMENT_OVERHEAD + 256)}) == 40


def test_http_table_per_gb_and_against_dsr():
    rows = [
        fw.Http("1 MB", "direct", "direct", 1000, 2_000_000_000, 0, 1.0, 4.0),
        fw.Http("1 MB", "dsr", "dsr", 1000, 2_000_000_000, 0, 1.0, 4.2, prog_ns=20_000_000, prog_runs=10_000),
        fw.Http("1 MB", "haproxy", "haproxy", 1000, 2_000_000_000, 0, 1.0, 6.0, proc_cpu_s=1.0),
    ]
    t = table_rows(fw.http_table(rows), "| response |")
    assert t[0][5:] == ["–", "–", "–", "–", "0"]
    assert t[1][5:] == ["0.010", "1.00×", "20.00", "10.0", "0"]
    assert t[2][5:8] == ["0.500", "50.00×", "1000.00"]


def test_fresh_table_and_percentile():
    assert fw.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9) == 9
    rows = [
        fw.Fresh("in-band", "n = 10", [1.0, 2.0, 3.0], 1, 500.0, 1500.0, [0.5, 1.5, 1.0], 150.0, 10),
        fw.Fresh("in-band", "n = 10..1000 adaptive, ≤ 100/s", [4.0], 0, 500.0, 1500.0, [], 30.0, 640),
        fw.Fresh("polling", "10 ms", [5.0], 0, 400.0, 1200.0, [5.0], 100.0),
    ]
    t = table_rows(fw.fresh_table(rows), "| mechanism |")
    assert t[0] == ["in-band", "n = 10", "3", "2.00", "3.00", "3.00", "1", "1.00", "1.50", "150.0", "1.00×", "10", "500", "1,500"]
    assert t[1][7:12] == ["–", "–", "30.0", "0.20×", "640"]
    assert t[2][9:12] == ["100.0", "0.67×", "–"]


def test_parse_wrk_summary():
    assert fw.parse_wrk("Running 1s test\nINBAND requests=12 bytes=3456 errors=0\n") == {"requests": 12, "bytes": 3456, "errors": 0}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and attaches XDP programs")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"ft{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.forwarding", name, out, 300)
    assert left == [], f"namespaces left behind: {left}"
    assert not any(Path("/sys/fs/bpf/inband/netns").glob(f"{name}-*")), "pins left behind"

    res = json.loads((out / "results.json").read_text())["rows"]
    fwd = {(r["load"], r["path"]): r for r in res["forwarding"]}
    expected = [("hairpin", p) for p in ("generator", "direct", "bounce", "inband", "nftables")]
    expected += [("switch", p) for p in ("direct", "inband", "nftables")]
    expected += [("stream", p) for p in ("direct", "inband-pt", "nftables", "haproxy")]
    assert sorted(fwd) == sorted(expected)
    for key, r in fwd.items():
        assert r["units"] > 0 and r["seconds"] > 0, key
        if key[0] != "stream":
            # Raw frames mostly arrive (a loaded machine drops a few on
            # the kernel's paths); a generator whose frames a forwarder
            # garbles delivers a small fraction.
            assert r["units"] >= 0.5 * r["sent"], key
    for p in ("direct", "bounce", "inband", "nftables"):  # the receive thread's CPU per packet
        assert fwd[("hairpin", p)]["thread_ns_per_packet"] > 0, p
    assert fwd[("stream", "haproxy")]["own_cpu_s"] > 0
    assert fwd[("stream", "inband-pt")]["own_cpu_s"] > 0  # the XDP program's run time

    cost = res["cost"]
    assert sorted({(r["size"], r["path"]) for r in cost}) == sorted((s, p) for s in fw.SIZES for p in fw.HTTP_LABELS)
    for r in cost:
        assert r["requests"] > 0 and r["bytes"] >= r["requests"] * fw.SIZES[r["size"]], r
    for r in cost:
        if r["path"] in ("dsr", "passthrough"):
            assert r["prog_ns"] > 0 and r["prog_runs"] > 0, r
    # DSR: responses bypass the balancer, so it sees fewer packets per request.
    by = {(r["size"], r["path"]): r for r in cost}
    for s in fw.SIZES:
        dsr, pt = by[(s, "dsr")], by[(s, "passthrough")]
        assert dsr["prog_runs"] / dsr["requests"] < pt["prog_runs"] / pt["requests"], s

    fresh = res["freshness"]
    assert [(f["mechanism"], f["interval"]) for f in fresh] == [
        ("in-band", "n = 10"),
        ("in-band", "n = 10..1000 adaptive, ≤ 100/s"),
        ("polling", "10 ms"),
    ]
    for f in fresh:
        assert f["delays_ms"] and f["load_rps"] > 0 and f["backend_pps"] > 0, f
        assert f["ages_ms"] and f["requests_per_s"] > 0, f
    # The adaptive n stays within its bounds; the fixed one is the fixed n.
    assert fresh[0]["last_n"] == 10 and 10 <= fresh[1]["last_n"] <= 1000, fresh

    md = (out / "results.md").read_text()
    for heading in ("one-armed hairpin", "switch → balancer", "64-byte writes", "CPU per GB", "Feedback freshness"):
        assert heading in md, heading
    # Ratios computed for every non-direct raw path, in every ratio column.
    raw_tables = [b for b in md.split("\n\n") if b.startswith("| path | frames sent")]
    assert len(raw_tables) == 2
    for block in raw_tables:
        for row in table_rows(block, "| path |"):
            if not row[0].startswith(("direct", "none")):
                assert row[4].endswith("×") and row[5].endswith("×"), row
                float(row[6])  # the cost over direct is computed (its ratio only when both costs are positive)
    # The balancer's own CPU, and its ratio to inband's, for inband and HAProxy.
    stream = next(b for b in md.split("\n\n") if b.startswith("| path | 64 B writes sent"))
    own = {row[0]: row for row in table_rows(stream, "| path |")}
    for label in (fw.FWD_LABELS["inband-pt"], fw.FWD_LABELS["haproxy"]):
        assert float(own[label][6]) > 0 and own[label][7].endswith("×"), own[label]
    for row in table_rows(md, "| response |"):
        if row[1] != fw.HTTP_LABELS["direct"]:
            assert float(row[5]) > 0 and row[6].endswith("×"), row
    assert "| path | frames sent" in cp.stdout
    assert (out / "forwarding.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_of_some_parts_keeps_the_others_rows_with_their_provenance(tmp_path):
    earlier = {"command": "python -m bench.forwarding --out x", "commit": {"sha": "a" * 40, "dirty": False},
               "started_utc": "2026-11-01T00:00:00Z",
               "rows": {"forwarding": [{"load": "hairpin"}], "cost": [{"size": "1 KB"}], "freshness": [{"old": True}]}}
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    rows = {"forwarding": [], "cost": [], "freshness": [{"new": True}]}
    kept = fw.carried_over(tmp_path, ["freshness"], rows)
    assert rows == {"forwarding": [{"load": "hairpin"}], "cost": [{"size": "1 KB"}], "freshness": [{"new": True}]}
    assert kept["forwarding"]["commit"]["sha"] == "a" * 40 and set(kept) == {"forwarding", "cost"}
    # Kept once, kept again with the provenance of the run that made them.
    again = dict(earlier, command="python -m bench.forwarding --parts freshness", kept=kept, rows=rows)
    (tmp_path / "results.json").write_text(json.dumps(again))
    rows = {"forwarding": [], "cost": [], "freshness": [{"newer": True}]}
    assert fw.carried_over(tmp_path, ["freshness"], rows)["cost"]["command"] == "python -m bench.forwarding --out x"
    # A run of every part keeps nothing.
    assert fw.carried_over(tmp_path, list(fw.PARTS), {"forwarding": [], "cost": [], "freshness": []}) == {}

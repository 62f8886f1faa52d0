"""Report and plot code on synthetic data: exact numbers in, exact table out."""

from __future__ import annotations

import csv
import json
import math

import pytest

from bench.lib import locust as report
from bench.lib import plots, stats
from bench.lib.locust import Overhead, Request, RunResult

T0 = 1_700_000_000.0


def reqs(latencies_ms, *, start=T0, gap=0.01, ok=None):
    out = []
    for i, ms in enumerate(latencies_ms):
        out.append(Request(start + i * gap, float(ms), True if ok is None else ok[i], 46 * 1024))
    return out


def test_percentile_nearest_rank():
    xs = list(range(1, 101))  # 1..100
    assert stats.percentile(xs, 50) == 50
    assert stats.percentile(xs, 90) == 90
    assert stats.percentile(xs, 99) == 99
    assert stats.percentile(xs, 99.9) == 100
    assert stats.percentile([7.0], 50) == 7.0
    assert stats.percentile([], 50) is None
    # 10 values: p95 -> rank ceil(9.5) = 10
    assert stats.percentile(list(range(10)), 95) == 9


def test_summarize_counts_window_and_failures():
    # 100 requests, 1..100 ms, all completing within 10 s; two failures.
    ok = [True] * 100
    ok[3] = ok[50] = False
    rs = reqs(range(1, 101), ok=ok)
    # One request that finished after the window closes, one that started before.
    late = Request(T0 + 9.99, 500.0, True, 10)
    early = Request(T0 - 1.0, 10.0, True, 10)
    s = report.summarize(rs + [late, early], T0, T0 + 10.0)
    assert s.requests == 100
    assert s.failures == 2
    assert s.median_ms == 50.0
    assert s.avg_ms == pytest.approx(50.5)
    assert s.rps == pytest.approx(10.0)
    assert s.pct_ms[90] == 90.0 and s.pct_ms[99] == 99.0 and s.pct_ms[98] == 98.0
    assert s.max_ms == 100.0


def test_summarize_rejects_empty_window():
    with pytest.raises(ValueError):
        report.summarize([], T0, T0)


def test_rps_series_bins_by_completion():
    rs = [Request(T0 + 0.1, 100.0, True, 1), Request(T0 + 0.5, 800.0, True, 1), Request(T0 + 2.0, 10.0, True, 1)]
    # completions at 0.2, 1.3, 2.01
    assert report.rps_series(rs, T0, T0 + 3.0) == [(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)]
    assert report.rps_series(rs, T0, T0 + 3.0, bin_s=1.5) == [(1.5, 2 / 1.5), (3.0, 1 / 1.5)]


def test_ccdf_exact_points():
    xs, ys = report.ccdf([1, 2, 2, 3])
    assert xs == [1, 2]
    assert ys == [0.75, 0.25]
    assert report.ccdf([]) == ([], [])
    assert report.ccdf([5, 5]) == ([], [])


def test_request_log_round_trip(tmp_path):
    p = tmp_path / "requests.csv"
    p.write_text("start,rt_ms,ok,bytes\n1700000000.500000,12.500,1,47104\n1700000001.000000,3.000,0,0\n")
    got = report.read_requests(p)
    assert got == [Request(1700000000.5, 12.5, True, 47104), Request(1700000001.0, 3.0, False, 0)]
    w = tmp_path / "window.json"
    w.write_text(json.dumps({"t0": 1.5, "t1": 61.5}))
    assert report.read_window(w) == (1.5, 61.5)


def _locust_stats(path, rows):
    cols = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
            "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s",
            "50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow(r)


def test_locust_csv_parsing(tmp_path):
    stats = tmp_path / "locust_stats.csv"
    _locust_stats(stats, [
        ["GET", "/", 10, 1, 120, 130.5, 5, 900, 47104, 2.5, 0.1] + [0] * 11,
        ["", "Aggregated", 10, 1, 120, 130.5, 5, 900, 47104, 2.5, 0.1] + [0] * 11,
    ])  # fmt: skip
    agg = report.read_locust_aggregated(stats)
    assert agg["Request Count"] == "10" and agg["Requests/s"] == "2.5"
    hist = tmp_path / "locust_stats_history.csv"
    hist.write_text(
        "Timestamp,User Count,Type,Name,Requests/s,Failures/s\n"
        "1700000001,150,GET,/,3.0,0\n1700000001,150,,Aggregated,3.0,0\n1700000002,150,,Aggregated,4.0,0\n"
    )
    assert [r["Requests/s"] for r in report.read_locust_history(hist)] == ["3.0", "4.0"]


def _result(key, label, latencies, window_s=10.0, shares=None):
    rs = reqs(latencies)
    return RunResult(
        key=key,
        label=label,
        window=(T0, T0 + window_s),
        requests=rs,
        overhead=Overhead(mechanism="none", lb_in_bytes=1000 * len(rs), lb_in_packets=10, lb_in_drops=1),
        shares=shares or {},
    )


def test_tables_and_ratios():
    pt = _result("passthrough", "Pass through", [4000] * 20)  # 2 rps, 4 s
    pol = _result("dsr-polling", "DSR polling", [2000] * 40)  # 4 rps, 2 s
    dyn = _result("dsr-dynamic", "Dynamic DSR", [1000] * 60, shares={"a": 45, "b": 15})  # 6 rps, 1 s
    results = [pt, pol, dyn]
    t = report.table3(results).splitlines()
    assert t[0] == "| Configuration | Median | Average | RPS | 90% | 95% | 98% | 99% | Requests | Failures |"
    assert t[2] == "| Pass through | 4 s | 4000 ms | 2.00 | 4 s | 4 s | 4 s | 4 s | 20 | 0 |"
    assert t[4] == "| Dynamic DSR | 1 s | 1000 ms | 6.00 | 1 s | 1 s | 1 s | 1 s | 60 | 0 |"
    r = report.ratios(results).splitlines()
    assert r[0].startswith("| Configuration | RPS ÷ dsr-polling | dsr-polling avg ÷ avg |")
    # dynamic vs polling: 1.5x RPS, 2x faster on average; vs passthrough 3x RPS, 4x faster
    assert r[4] == "| Dynamic DSR | 1.50× | 2.00× | 2.00× | 2.00× | 3.00× | 4.00× | 4.00× | 4.00× |"
    s = report.shares_table(results, {"a": "s1", "b": "s2"}).splitlines()
    assert s[0] == "| Configuration | s1 | s2 |"
    assert s[4] == "| Dynamic DSR | 75.0% (45) | 25.0% (15) |"
    assert s[2] == "| Pass through | – | – |"
    o = report.overhead_table(results).splitlines()
    assert o[2] == "| Pass through | none | 0 | 0 | 0 | 0 | 20000 | 10 | 1 | 1000 |"
    md = report.markdown(results, {"a": "s1", "b": "s2"}, preamble="# run")
    assert md.startswith("# run\n")
    assert "## Table 3, this run" in md and "65.45" in md


def test_paper_ratios_beside_ours():
    pt = _result("passthrough", "Pass through", [4000] * 20)  # 2 rps
    q = _result("dsr-query", "Query", [2000] * 40)  # 4 rps
    dyn = _result("dsr-dynamic", "Dynamic", [1000] * 60)  # 6 rps
    pol = _result("dsr-polling", "Polling", [1000] * 60)  # no row of the paper's
    lines = report.paper_ratios([pt, q, dyn, pol]).splitlines()
    assert lines[0].startswith("| Configuration | paper's row | RPS ÷ dsr-query | paper | dsr-query avg ÷ avg | paper |")
    assert len(lines) == 2 + 3
    # Ours: 1.5x the query baseline's RPS, 2x its average and p99; the
    # paper's 65.45 / 44.33 RPS, 1945 / 1611 ms average, 5 / 5.5 s p99.
    assert lines[4] == "| Dynamic | Dynamic DSR | 1.50× | 1.48× | 2.00× | 1.21× | 2.00× | 0.91× | 3.00× | 2.82× | 4.00× | 3.22× | 4.00× | 4.91× |"
    # Without the baseline in the run, only the paper's side of its ratios.
    lines = report.paper_ratios([pt, dyn]).splitlines()
    assert lines[3].startswith("| Dynamic | Dynamic DSR | – | 1.48× | – | 1.21× | – | 0.91× | 3.00× |")


def test_query_table_lists_only_runs_that_held_syns():
    q = _result("dsr-query", "Query", [10] * 3)
    q.overhead.queries, q.overhead.query_timeouts, q.overhead.query_mean_us, q.overhead.extra_packets = 40, 2, 1500, 120
    lines = report.query_table([q, _result("dsr-rr", "RR", [10] * 3)]).splitlines()
    assert lines[2:] == ["| Query | 40 | 1.50 ms | 2 | 120 |"]
    assert "## Held SYNs (dsr-query)" in report.markdown([q], {})


def test_ratios_without_references_has_only_labels():
    r = report.ratios([_result("haproxy-roundrobin", "HAProxy", [5] * 3)]).splitlines()
    assert r[0] == "| Configuration |"
    assert r[2] == "| HAProxy |"


def test_fmt_time():
    assert report.fmt_time(3812.0) == "3.81 s"
    assert report.fmt_time(12000.0) == "12 s"
    assert report.fmt_time(250.4) == "250 ms"
    assert report.fmt_time(123456.0) == "123 s"
    assert report.fmt_time(math.nan) == "–"


def test_csv_outputs(tmp_path):
    results = [_result("dsr-rr", "DSR RR", [100, 200, 300, 400], window_s=2.0, shares={"a": 4})]
    p = tmp_path / "results.csv"
    report.write_csv(results, p)
    rows = list(csv.DictReader(open(p)))
    assert len(rows) == 1
    row = rows[0]
    assert row["key"] == "dsr-rr" and row["requests"] == "4" and row["rps"] == "2.000"
    assert row["median_ms"] == "200.0" and row["avg_ms"] == "250.0" and row["p99_ms"] == "400.0"
    assert row["shares"] == "a=4" and row["lb_in_bytes"] == "4000"
    ts = tmp_path / "ts.csv"
    report.write_timeseries_csv(results, ts)
    lines = open(ts).read().splitlines()
    assert lines == ["key,t_s,rps", "dsr-rr,1,4.000", "dsr-rr,2,0.000"]


def test_plots_write_pngs(tmp_path):
    results = [
        _result("passthrough", "Pass through", [4000, 100, 2500] * 5),
        _result("dsr-dynamic", "Dynamic DSR", [50, 60, 70, 2000] * 10),
    ]
    f3, f4 = tmp_path / "fig3.png", tmp_path / "fig4.png"
    plots.fig3_rps(results, f3)
    plots.fig4_ccdf(results, f4)
    for f in (f3, f4):
        data = f.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_moving_average():
    assert plots.moving_average([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert plots.moving_average([], 3) == []


def test_balancer_view_lists_each_backend_from_inband_status():
    status = [
        {
            "vips": [
                {
                    "backends": [
                        {
                            "backend": "10.77.0.22:8080",
                            "score": None,
                            "stats": {"new_conns": 5, "return_bytes": 0, "probes_sent": 0, "scores_received": 0},
                        },
                        {
                            "backend": "10.77.0.21:8080",
                            "score": 3,
                            "stats": {"new_conns": 7, "return_bytes": 480, "probes_sent": 9, "scores_received": 8},
                        },
                    ]
                }
            ]
        }
    ]
    view = report.backends_at_balancer(status)
    assert view["10.77.0.21:8080"] == {
        "connections": 7,
        "bytes_back_through_lb": 480,
        "probes": 9,
        "scores": 8,
        "last_score": 3,
    }
    assert report.backends_at_balancer(None) == {}
    r = report.RunResult(key="dsr-dynamic", label="Dynamic", window=(0.0, 1.0), requests=[], overhead=report.Overhead("x"))
    r.at_balancer = view
    lines = report.balancer_view_table([r]).splitlines()
    assert lines[2] == "| Dynamic | 10.77.0.21:8080 | 7 | 480 | 9 | 8 | 3 |"
    assert lines[3] == "| Dynamic | 10.77.0.22:8080 | 5 | 0 | 0 | 0 | – |"

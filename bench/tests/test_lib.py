"""bench/lib without a testbed: statistics, cells, parsers, checks and the
run's record, from known inputs."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from bench.lib import preflight, profiles, results, stats, tools
from bench.lib.host import c_struct, others_running
from bench.lib import report as rp
from bench.lib.locust import Overhead, Request, RunResult
from bench.lib.peers import Backend


def test_percentile_is_nearest_rank_on_unsorted_values():
    assert stats.percentile([3, 1, 2], 50) == 2
    assert stats.percentile(list(range(100, 0, -1)), 99) == 99
    assert stats.percentile(range(10), 95) == 9  # rank ceil(9.5) = 10
    assert stats.percentile([5.0], 0) == 5.0
    assert stats.percentile([], 50) is None


def test_ratio():
    assert stats.ratio(3, 2) == 1.5
    assert stats.ratio(1, 0) is None and stats.ratio(None, 1) is None and stats.ratio(math.nan, 1) is None


def test_cells_and_tables():
    assert rp.times(3, 2) == "1.50×" and rp.times(0, 0) == "–" and rp.times(1, 0) == "∞" and rp.times(None, 2) == "–"
    assert rp.cell(None) == "–" and rp.cell(5, " ms") == "5 ms" and rp.cell(1.234, fmt=".1f") == "1.2"
    assert rp.fmt_ratio(math.nan) == "–" and rp.fmt_ratio(2) == "2.00×"
    assert rp.fmt_time(1500) == "1.5 s" and rp.fmt_time(250) == "250 ms" and rp.fmt_time(None) == "–"
    assert rp.table(["a", "b"], [[1, 2]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
    assert rp.table(["a", "b"], [[1, 2]], numeric=True).splitlines()[1] == "|---|---:|"


def test_wrk_summary_by_tag():
    text = "Running 1s test\nBENCH requests=10 errors=0\nINBAND requests=7 duration_us=100\n"
    assert tools.parse_wrk(text) == {"requests": 10, "errors": 0}
    assert tools.parse_wrk(text, "INBAND") == {"requests": 7, "duration_us": 100}
    with pytest.raises(ValueError):
        tools.parse_wrk("no summary here")


def test_openloop_result_among_other_lines():
    text = 'warning {not json\n{"sent": 1, "ok": 1, "errors": 0}\nnoise {"x": 1}\n{"sent": 5, "ok": 4, "errors": 1}\n'
    assert tools.parse_openloop(text) == {"sent": 5, "ok": 4, "errors": 1}
    with pytest.raises(ValueError):
        tools.parse_openloop('{"sent": 1}')


def test_preflight_builds_the_default_binary_and_no_other(tmp_path, monkeypatch):
    """The default binary is built with the dev profile before a run (a
    `cargo test` leaves its unoptimised build there); a binary named on the
    command line is run as it is."""
    built = []
    monkeypatch.setattr(preflight, "dev_build_problem", lambda: built.append(1) or "building it failed: x")
    monkeypatch.setenv("INBAND_BENCH_BUILD", "1")
    assert preflight.problems(inband=str(preflight.DEFAULT_INBAND), root=False)[0] == "building it failed: x"
    other = tmp_path / "inband"
    other.write_text("")
    assert preflight.problems(inband=str(other), root=False) == [] and built == [1]
    # The test command's smoke runs take what cargo test built.
    monkeypatch.setenv("INBAND_BENCH_BUILD", "0")
    assert "building it failed: x" not in preflight.problems(inband=str(preflight.DEFAULT_INBAND), root=False) and built == [1]


def test_preflight_names_each_problem(tmp_path):
    found = preflight.problems(inband=str(tmp_path / "inband"), tools=("surely-not-a-tool-x",), testbed_name="Bad_Name", root=False)
    assert any("inband is missing" in p for p in found)
    assert any("surely-not-a-tool-x is not installed" in p for p in found)
    assert any("1-8 characters" in p for p in found)
    assert preflight.problems(tools=("sh",), testbed_name="ok1", root=False) == []
    assert preflight.problems(testbed_name="ninechars", root=False)


def test_map_layouts_come_from_the_header(tmp_path):
    layout, Entry = c_struct(results.REPO / "bpf/include/inband/lb/types.h", "inband_backend_score")
    # What the freshness driver reads, by name, wherever the header puts it.
    for name in ("score", "interval", "updated_ns"):
        assert name in Entry._fields
    entry = Entry(*layout.unpack(bytes(range(layout.size))))
    assert entry.score == int.from_bytes(bytes(range(4)), "little")
    odd = tmp_path / "odd.h"
    odd.write_text("struct odd {\n\t__u32 a; /* x */\n\tstruct inband_addr b;\n};\n")
    with pytest.raises(RuntimeError, match="cannot read field"):
        c_struct(odd, "odd")
    with pytest.raises(RuntimeError, match="no struct"):
        c_struct(odd, "even")


def test_others_running_sees_a_benchmark_but_not_itself():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "bench.somestudy"])
    try:
        seen = set()
        for _ in range(50):  # until the child has exec'd
            seen = others_running()
            if "bench.somestudy" in seen:
                break
            subprocess.run(["sleep", "0.05"])
        assert "bench.somestudy" in seen
    finally:
        p.kill()
        p.wait()
    assert "bench.somestudy" not in others_running()


def test_profile_overrides():
    from bench.health import PROFILES

    p = profiles.choose(PROFILES, "quick", rate=7.0, after_s=None)
    assert p.rate == 7.0 and p.after_s == PROFILES["quick"].after_s
    assert profiles.as_json("quick", p)["name"] == "quick"


def test_record_says_what_made_it():
    run = results.Run("study", "bench.study", ["--profile", "tiny"])
    r = run.record([{"x": 1}], profile={"name": "tiny"}, extra_key=3)
    assert r["command"] == "python -m bench.study --profile tiny" and r["rows"] == [{"x": 1}] and r["extra_key"] == 3
    assert len(r["commit"]["sha"]) == 40 and isinstance(r["commit"]["dirty"], bool)
    assert r["machine"]["cores"] >= 1 and r["machine"]["kernel"]
    assert len(r["load_average"]["start"]) == 3 and len(r["load_average"]["end"]) == 3
    line = results.provenance(r)
    assert "`python -m bench.study --profile tiny`" in line and r["commit"]["sha"][:12] in line and r["started_utc"] in line
    assert "changed during the run" not in line
    # A commit made while a run measures: the record names the tree the
    # run started on, and says it changed.
    before = {"sha": "a" * 40, "dirty": False}
    run.commit = before
    r = run.record([])
    assert r["commit"] == {**before, "changed_during_run": True}
    assert "aaaaaaaaaaaa (the tree changed during the run)" in results.provenance(r)


def test_revive_keeps_only_the_fields():
    assert results.revive(Backend, {"address": "10.0.0.1", "port": 80, "derived": 1}) == Backend("10.0.0.1", 80)


def test_a_locust_run_survives_its_record():
    reqs = [Request(100.0 + i * 0.1, 50.0 + i, i % 7 != 0, 10) for i in range(60)]
    r = RunResult("dsr-rr", "DSR", (100.0, 106.0), reqs, Overhead("none", probes=3), shares={"a": 1})
    back = RunResult.from_json(results.json.loads(results.json.dumps(r.to_json())))
    assert back.summary() == r.summary() and back.overhead == r.overhead and back.shares == r.shares

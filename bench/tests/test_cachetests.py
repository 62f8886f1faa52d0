"""The public cache-tests driver's scoring and tables. The suite itself needs
its checkout and an npm install, which CI does not do, so the run is not
repeated here: the scoring is checked on results made up to hit each rule
of the suite's own classification, and the committed record is rendered."""

from __future__ import annotations

from bench import cachetests as ct
from bench.lib import results
from driver_runs import table_rows


def _tests() -> dict:
    made = [
        ("base", "required", []),
        ("needs-base", "required", ["base"]),
        ("setup", "required", []),
        ("retried", "required", []),
        ("opt", "optimal", ["base"]),
        ("survey", "check", []),
        ("browser", "required", []),
    ]
    return {i: {"id": i, "name": f"name of {i}", "kind": k, "depends_on": d, "browser_only": i == "browser"} for i, k, d in made}


RESULTS = {
    "base": ["Assertion", "Response 2 does not come from cache"],
    "needs-base": True,
    "setup": ["Setup", "Response 1 status is 503, not 200"],
    "retried": ["Setup", "retry"],
    "opt": True,
    "survey": True,
}


def test_outcomes_follow_the_suites_classification():
    t = _tests()
    assert ct.outcome(t, RESULTS, "base", deps=True) == "fail"
    assert ct.outcome(t, RESULTS, "needs-base", deps=False) == "pass"
    assert ct.outcome(t, RESULTS, "needs-base", deps=True) == "dependency_fail"
    assert ct.outcome(t, RESULTS, "setup", deps=True) == "setup_fail"
    assert ct.outcome(t, RESULTS, "retried", deps=True) == "retry"
    assert ct.outcome(t, RESULTS, "opt", deps=True) == "dependency_fail"
    assert ct.outcome(t, RESULTS, "survey", deps=True) == "yes"
    assert ct.outcome(t, RESULTS, "browser", deps=True) == "untested"


def test_scores_leave_browser_tests_out_and_count_prerequisites_apart():
    s = ct.scored(_tests(), RESULTS)
    assert s["required"] == {"own": 1, "with_deps": 0, "total": 4}
    assert s["optimal"] == {"own": 1, "with_deps": 0, "total": 1}
    assert s["check"] == {"own": 1, "with_deps": 1, "total": 1}
    failing = ct.required_failures(_tests(), RESULTS)
    assert [f[0] for f in failing] == ["base", "needs-base", "setup", "retried"]
    assert failing[0][2] == "fail: Response 2 does not come from cache"
    assert failing[1][2] == "passes, but its prerequisite `base` does not"


def test_render_from_a_made_up_record():
    record = {
        "command": "python -m bench.cachetests", "commit": {"sha": "0" * 40, "dirty": False}, "started_utc": "2026-01-01T00:00:00Z",
        "wall_s": 1, "machine": {"cores": 2, "cpu": "x", "kernel": "k"}, "load_average": {"start": [0.0], "end": [0.0]},
        "suite_commit": ct.SUITE_COMMIT,
        "rows": {"tests": list(_tests().values()), "systems": {"inband": {"results": RESULTS}, "nginx": {"error": "RuntimeError: gone"}},
                 "published": {"squid": ct.scored(_tests(), {i: True for i in RESULTS})}},
    }
    md = ct.render(record)
    rows = {r[0]: r for r in table_rows(md, "| system |")}
    assert rows["inband proxy (LMDB)"][1:] == ["1/4", "1/1", "1/1", "0/4", "0/1"]
    assert rows["nginx proxy_cache"][1] == "did not run: RuntimeError: gone"
    assert rows["squid (published)"][1:] == ["4/4", "1/1", "1/1", "4/4", "1/1"]
    assert "## Required tests inband proxy (LMDB) does not pass (4)" in md
    record["rows"]["systems"]["inband" + ct.H2] = {"results": {i: True for i in RESULTS}, "alpn": {"h2": 3, "http/1.1": 1}}
    md = ct.render(record)
    rows = {r[0]: r for r in table_rows(md, "| system |")}
    assert rows["inband proxy (LMDB), HTTP/2 (TLS)"][1:] == ["4/4", "1/1", "1/1", "4/4", "1/1"]
    assert "inband proxy (LMDB), HTTP/2 (TLS): the client's connections by the protocol ALPN chose: h2 3, http/1.1 1." in md
    assert "## Required tests inband proxy (LMDB), HTTP/2 (TLS) does not pass (0)" in md


def test_the_committed_record_renders_with_every_system():
    record = results.load("cachetests")
    assert record["suite_commit"] == ct.SUITE_COMMIT
    md = ct.render(record)
    rows = {r[0]: r for r in table_rows(md, "| system |")}
    for name in ct.SYSTEMS.values():
        assert name in rows, name
    required, total = rows["inband proxy (LMDB)"][1].split("/")
    assert int(total) == 160 and int(required) >= 154
    # Over HTTP/2 as well, and every connection of that run did speak h2.
    assert rows["inband proxy (LMDB), HTTP/2 (TLS)"][1:] == rows["inband proxy (LMDB)"][1:]
    alpn = record["rows"]["systems"]["inband" + ct.H2]["alpn"]
    assert set(alpn) == {"h2"} and alpn["h2"] > 0, alpn

"""The paper driver's pieces that need no testbed."""

from __future__ import annotations

import stat
import string
from pathlib import Path

import pytest

from bench.lib import paperbed as paper
from bench.lib.testbed import new_auth_key

REPO = Path(__file__).resolve().parents[2]
INBAND = REPO / "target" / "debug" / "inband"

STATUS = [
    {
        "control": {"polls_sent": 3, "poll_replies": 2, "poll_bytes": 100, "queries": 7, "query_timeouts": 1, "query_mean_us": 900},
        "vips": [{"backends": [{"stats": {"probes_sent": 10, "scores_received": 9}}, {"stats": {"probes_sent": 5, "scores_received": 5}}]}],
    }
]
TBF = {"bytes": 0, "packets": 0, "drops": 0}


@pytest.mark.parametrize(("authenticated", "per_option"), [(True, 16), (False, 4)])
def test_in_band_bytes_follow_the_option_format(authenticated, per_option):
    o = paper.overhead(paper.BY_KEY["dsr-dynamic"], STATUS, TBF, TBF, authenticated=authenticated)
    assert (o.probes, o.scores, o.polls, o.extra_packets) == (15, 14, 3, 5)
    assert o.extra_bytes == 100 + per_option * (15 + 14)
    assert (o.queries, o.query_timeouts, o.query_mean_us) == (7, 1, 900)


@pytest.mark.skipif(not INBAND.is_file(), reason="needs target/debug/inband (cargo build)")
def test_each_run_gets_a_new_private_key(tmp_path):
    first = new_auth_key(INBAND, tmp_path)
    assert first == tmp_path / "auth.key"
    old = first.read_text()
    assert len(old.strip()) == 32 and all(c in string.hexdigits for c in old.strip())
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    # A second run into the same directory replaces the first run's key.
    assert new_auth_key(INBAND, tmp_path).read_text() != old


def test_auth_defaults_to_siphash():
    assert paper.parse_args(["--out", "x"]).auth == "siphash"
    assert paper.parse_args(["--out", "x", "--auth", "none"]).auth == "none"


def test_server_sets():
    # The paper's testbed: two servers of the same hardware, nothing slowed.
    assert paper.SERVER_SETS["paper"] == (paper.ServerSpec(1.0), paper.ServerSpec(1.0))
    ours = paper.SERVER_SETS["ours"]
    assert len(ours) == 3 and len({s.speed for s in ours}) == 3
    assert paper.parse_args(["--out", "x"]).servers == "ours"
    assert paper.parse_args(["--out", "x", "--servers", "both"]).servers == "both"
    with pytest.raises(SystemExit):
        paper.parse_args(["--out", "x", "--servers", "four"])
    # With both sets the paper's servers run the paper's Table 3 rows only.
    assert paper.parse_args(["--out", "x"]).paper_configs == "passthrough,dsr-rr,dsr-query,dsr-dynamic"
    with pytest.raises(SystemExit):
        paper.parse_args(["--out", "x", "--paper-configs", "dsr-rr,dsr-magic"])


def test_every_slowdown_window_reaches_the_server():
    args = paper.parse_args(["--out", "x", "--duration", "20"])
    spec = paper.ServerSpec(0.5, ((0.1, 0.2, 5.0), (0.5, 0.25, 3.0)))
    argv = paper.Bench(args, paper.PROFILES["tiny"], Path("x"), (spec,)).serve_argv(spec)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--slowdown"] == ["2:4:5", "10:5:3"]
    assert argv[argv.index("--speed") + 1] == "0.5"

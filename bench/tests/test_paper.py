"""The paper driver's pieces that need no testbed."""

from __future__ import annotations

import stat
import string
from pathlib import Path

import pytest

from bench import paper

REPO = Path(__file__).resolve().parents[2]
INBAND = REPO / "target" / "debug" / "inband"

STATUS = [
    {
        "control": {"polls_sent": 3, "poll_replies": 2, "poll_bytes": 100},
        "vips": [{"backends": [{"stats": {"probes_sent": 10, "scores_received": 9}}, {"stats": {"probes_sent": 5, "scores_received": 5}}]}],
    }
]
TBF = {"bytes": 0, "packets": 0, "drops": 0}


@pytest.mark.parametrize(("authenticated", "per_option"), [(True, 16), (False, 4)])
def test_in_band_bytes_follow_the_option_format(authenticated, per_option):
    o = paper.overhead(paper.BY_KEY["dsr-dynamic"], STATUS, TBF, TBF, authenticated=authenticated)
    assert (o.probes, o.scores, o.extra_packets) == (15, 14, 5)
    assert o.extra_bytes == 100 + per_option * (15 + 14)


@pytest.mark.skipif(not INBAND.is_file(), reason="needs target/debug/inband (cargo build)")
def test_each_run_gets_a_new_private_key(tmp_path):
    first = paper.new_auth_key(INBAND, tmp_path)
    assert first == tmp_path / "auth.key"
    old = first.read_text()
    assert len(old.strip()) == 32 and all(c in string.hexdigits for c in old.strip())
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    # A second run into the same directory replaces the first run's key.
    assert paper.new_auth_key(INBAND, tmp_path).read_text() != old


def test_auth_defaults_to_siphash():
    assert paper.parse_args(["--out", "x"]).auth == "siphash"
    assert paper.parse_args(["--out", "x", "--auth", "none"]).auth == "none"

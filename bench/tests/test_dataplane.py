"""The data path driver end to end on a short run: the record holds every
path with the floor last at 1.0×, the flood, churn and sweep rows, and the
tables render from the record alone."""

from __future__ import annotations

import json

from bench import dataplane
from driver_runs import table_rows


def test_a_short_run_records_every_path_and_renders_it(tmp_path):
    assert dataplane.main(["--samples", "50", "--flood", "3000", "--churn", "3000", "--sweep", "2000", "--results", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    paths = data["rows"]
    assert paths[-1]["path"].startswith("floor") and paths[-1]["ratio_to_floor"] == 1.0, paths[-1]
    assert {r["traffic"] for r in paths} >= {"IPv4", "IPv6", "UDP (QUIC)"}
    assert all(r["ns_per_packet"] > 0 for r in paths)
    # Every SYN forwarded, none dropped; the churn refused nothing.
    assert (data["flood"]["syns"], data["flood"]["forwarded"], data["flood"]["dropped"]) == (3000, 3000, 0), data["flood"]
    assert (data["churn"]["connections"], data["churn"]["refused"]) == (3000, 0), data["churn"]
    assert data["sweep"]["flows"] == 2000
    md = (tmp_path / "results.md").read_text()
    assert md == dataplane.render(data)
    assert [r[0] for r in table_rows(md, "| path |")] == [r["path"] for r in paths]
    assert table_rows(md, "| SYNs, never completed |")[0][4] == "0 (none)"

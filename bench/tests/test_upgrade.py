"""The upgrade driver end to end on a short run: every flow carried over
into the new, bigger tables, the merges after the switch at least the
50 ms wait for the old program, and the table renders from the record
alone."""

from __future__ import annotations

import json

from bench import upgrade
from driver_runs import table_rows


def test_a_short_run_carries_every_flow_and_renders_it(tmp_path):
    assert upgrade.main(["--flows", "3000", "--results", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    [row] = data["rows"]
    assert (row["flows"], row["flows_carried"]) == (3000, 3000), row
    assert {"flows", "half_open", "half_open_ports", "snat"} <= set(row["maps"]), row
    assert row["after_switch_ms"] >= 50 and row["before_switch_s"] > 0, row
    md = (tmp_path / "results.md").read_text()
    assert md == upgrade.render(data)
    assert table_rows(md, "| live flows |")[0][0] == "3,000"

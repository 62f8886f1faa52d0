"""The data path driver end to end on a short run: the record holds every
path with the floor last at 1.0×, the flood, churn and sweep rows, the
growth sweep and the control plane's times, and the tables render from
the record alone."""

from __future__ import annotations

import json

from bench import dataplane
from driver_runs import table_rows


def test_a_short_run_records_every_path_and_renders_it(tmp_path):
    assert dataplane.main(["--samples", "50", "--flood", "3000", "--churn", "3000", "--sweep", "2000",
                           "--scale-flows", "3000", "--scale-backends", "8,64", "--results", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    paths = data["rows"]
    assert paths[-1]["path"].startswith("floor") and paths[-1]["ratio_to_floor"] == 1.0, paths[-1]
    assert {r["traffic"] for r in paths} >= {"IPv4", "IPv6", "UDP (QUIC)"}
    assert all(r["ns_per_packet"] > 0 for r in paths)
    # Every SYN forwarded, none dropped; the churn refused nothing.
    assert (data["flood"]["syns"], data["flood"]["forwarded"], data["flood"]["dropped"]) == (3000, 3000, 0), data["flood"]
    assert (data["churn"]["connections"], data["churn"]["refused"]) == (3000, 0), data["churn"]
    assert data["sweep"]["flows"] == 2000
    # One cell per backend count, every flow written still in the table,
    # measured against this run's floor; the default table's maps as the
    # kernel accounts them.
    scale = data["scale"]
    assert scale["floor_ns"] == paths[-1]["ns_per_packet"]
    assert [(c["flow_table_size"], c["flows_in_table"], c["backends"]) for c in scale["cells"]] == [(262144, 3000, 8), (262144, 3000, 64)]
    assert all(c["syn_ns"] > 0 and c["established_ns"] > 0 and c["established_one_flow_ns"] > 0 for c in scale["cells"])
    # The cells share the flows out: none meets a flow another met.
    assert [c["established_samples"] for c in scale["cells"]] == [50, 50]
    [mem] = scale["memory"]
    assert sorted(n for n, _ in mem["maps"]) == ["flows", "half_open", "half_open_ports", "snat"]
    # Preallocated: at least one key and value per entry of each table.
    assert dict(mem["maps"])["flows"] > 262144 * 100 and mem["all_maps_bytes"] > mem["flow_tables_bytes"], mem
    assert mem["sweep_ms"] > 0, mem
    steps = {s["step"]: s for s in data["control_plane"]["steps"]}
    assert (steps["add 4,096 backends to a VIP"]["vips"], steps["add 4,096 backends to a VIP"]["backends"]) == (1, 4096)
    assert (steps["full configuration onto empty tables"]["vips"], steps["full configuration onto empty tables"]["backends"]) == (1024, 16384)
    md = (tmp_path / "results.md").read_text()
    assert md == dataplane.render(data)
    assert [r[0] for r in table_rows(md, "| path |")] == [r["path"] for r in paths]
    assert table_rows(md, "| SYNs, never completed |")[0][4] == "0 (none)"
    assert [r[2] for r in table_rows(md, "| flow table | live flows |")] == ["8", "64"]


def test_the_growth_tables_render_from_the_record_alone():
    cell = {"flow_table_size": 4194304, "flows": 4000000, "flows_in_table": 3999990, "backends": 4096, "syn_ns": 2300.4,
            "syn_ratio": 52.28, "established_ns": 1210.0, "established_samples": 20000, "established_ratio": 27.5,
            "established_one_flow_ns": 101.0}
    memory = {"flow_table_size": 4194304, "flows": 4000000, "fill_s": 14.51, "sweep_ms": 1012.34, "flow_tables_bytes": 2097155824, "all_maps_bytes": 2123491048,
              "maps": [["half_open_ports", 142607232], ["half_open", 176161664], ["flows", 704643968], ["snat", 1073742960]]}
    steps = [{"step": "add 4,096 backends to a VIP", "vips": 1, "backends": 4096, "parse_ms": 18.74, "apply_ms": 24.66}]
    md = "\n".join(dataplane.render_scale({"floor_ns": 44.0, "cells": [cell], "memory": [memory]}) + dataplane.render_control({"steps": steps}))
    assert "floor 44 ns" in md and "20,000 to 20,000 flows a cell" in md
    # The live flows are the ones counted in the table, not the ones written.
    assert table_rows(md, "| flow table | live flows |") == [["4,194,304", "3,999,990", "4,096", "2300", "52.3", "1210", "27.5", "101"]]
    assert table_rows(md, "| flow table | flows MiB |") == [["4,194,304", "672.0", "168.0", "136.0", "1024.0", "2000.0", "2025.1", "4,000,000", "14.5", "1012.3"]]
    assert table_rows(md, "| control plane |") == [["add 4,096 backends to a VIP", "1", "4,096", "18.7", "24.7"]]

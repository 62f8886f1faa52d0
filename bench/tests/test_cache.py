"""The cache storage driver end to end on a tiny store: a row per backend,
workload and thread count, ratios against LMDB, a fill row per backend,
and the figure."""

from __future__ import annotations

import json

from bench import cache
from driver_runs import table_rows


def test_a_tiny_run_records_every_cell_and_renders_it(tmp_path):
    out = tmp_path / "out"
    argv = ["--out", str(out), "--records", "500", "--seconds", "0.1", "--threads", "1", "--dir", str(tmp_path), "--results", str(tmp_path)]
    assert cache.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    cells = {(r["backend"], r["workload"]) for r in data["rows"]}
    assert cells == {(b, w) for b in ("lmdb", "rocksdb", "memory", "files") for w in ("read-only", "99/1", "95/5", "90/10")}
    assert all(r["ops"] > 0 and r["threads"] == 1 for r in data["rows"])
    assert [f["backend"] for f in data["fills"]] == ["lmdb", "rocksdb", "memory", "files"]
    md = (tmp_path / "results.md").read_text()
    assert md == cache.render(data)
    rows = table_rows(md, "| backend | workload |")
    assert len(rows) == 16 and all(r[4] == "1.00" for r in rows if r[0] == "lmdb"), rows
    assert (out / "cache.png").stat().st_size > 0

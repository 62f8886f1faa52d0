"""bench.cache_plot on a synthetic `inband bench cache` report."""

from __future__ import annotations

import json

from bench import cache_plot


def test_plot_writes_png(tmp_path):
    rows = [
        {"backend": b, "workload": w, "threads": t, "ops_per_s": 1000.0 * (i + 1), "cpu_us_per_op": 5.0}
        for i, b in enumerate(cache_plot.BACKENDS)
        for w in cache_plot.WORKLOADS
        for t in (1, 2)
    ]
    src = tmp_path / "cache.json"
    src.write_text(json.dumps({"records": 10, "value_bytes": 10240, "zipf": 0.99, "rows": rows}))
    out = tmp_path / "cache.png"
    assert cache_plot.main(["cache_plot", str(src), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

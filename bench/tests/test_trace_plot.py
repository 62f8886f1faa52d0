"""bench.trace_plot on synthetic `inband trace --out` lines."""

from __future__ import annotations

import json

from bench import trace_plot


def section(read_ns: int, hits: int, allocs: int) -> dict:
    cats = {c: {"count": 0, "ns": 0} for c in trace_plot.CATEGORIES}
    cats["io_read"] = {"count": 1, "ns": read_ns}
    return {
        "categories": cats,
        "phases": {"none": {"hits": 0}, "load": {"hits": hits}, "idle": {"hits": 0}},
        "memory": {"allocs": {"malloc": {"count": allocs}, "free": {"count": 99}}, "pages": {"count": 3}},
    }


def test_series_and_png(tmp_path):
    lines = [
        {"pid": 7, "elapsed_ms": 1000, "phase": None, "interval": section(2_000_000, 0, 5), "total": section(0, 0, 0)},
        {"pid": 7, "elapsed_ms": 2000, "phase": {"name": "load"}, "interval": section(4_000_000, 3, 6), "total": section(0, 3, 0)},
    ]
    src = tmp_path / "trace.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    s = trace_plot.series(trace_plot.read(src))
    assert s["t_s"] == [1.0, 2.0]
    assert s["ms"]["io_read"] == [2.0, 4.0]
    # Phases never hit are left out; free is not an allocation.
    assert s["hits"] == {"load": [0, 3]}
    assert s["phase"] == [None, "load"]
    assert s["allocs"] == [5, 6]
    assert s["pages"] == [3, 3]
    out = tmp_path / "trace.png"
    assert trace_plot.main(["trace_plot", str(src), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

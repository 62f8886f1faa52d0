"""The front-door driver: its tables from known numbers, and its quick
profile end to end (every system filled over HTTPS, every part measured,
sessions resumed, no request failed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from bench import frontdoor
from driver_runs import INBAND, REPO, table_rows


def cell(key: str, label: str, full: float, resumed: float, https: float, h2: float) -> dict:
    return {"key": key, "label": label, "full_hs": [full], "resumed_hs": [resumed], "resumed_share": [1.0], "resumes": True,
            "https": [{"rps": https, "p99_ms": 1.5, "cpu_us": 12.0, "errors": 0}],
            "h2": [{"rps": h2, "mean_ms": 0.2, "cpu_us": 10.0, "failed": 0}]}


def test_tables_give_ratios_to_nginx_and_the_limit():
    rows = {"profile": {"seconds": 5, "rounds": 1, "wrk_connections": 50, "h2_connections": 8, "h2_streams": 10,
                        "objects": 5000, "object_bytes": 10240, "zipf": 0.99},
            "cells": [cell("inband", "inband proxy (LMDB)", 1200, 6000, 45000, 30000),
                      cell("nginx", "nginx proxy_cache", 1000, 4000, 30000, 40000),
                      cell("static", "limit: nginx static files", 1100, 5000, 60000, 60000)]}
    md = frontdoor.markdown(rows)
    hs = {r[0]: r for r in table_rows(md, "| system | full (TLS 1.3) |")}
    assert hs["inband proxy (LMDB)"][1:] == ["1200", "1.20×", "6000", "1.50×", "100%", "yes"]
    hits = {r[0]: r for r in table_rows(md, "| system | HTTPS req/s |")}
    assert hits["inband proxy (LMDB)"][1:4] == ["45000", "1.50×", "0.75×"]
    assert hits["inband proxy (LMDB)"][6:9] == ["30000", "0.75×", "0.50×"]
    assert hits["nginx proxy_cache"][2] == "1.00×"


@pytest.mark.skipif(not all(shutil.which(t) for t in ("nginx", "haproxy", "h2load", "openssl", "wrk")) or not INBAND.exists(),
                    reason="needs nginx, haproxy, h2load, openssl, wrk and a built inband")
def test_quick_profile_end_to_end(tmp_path):
    cp = subprocess.run([sys.executable, "-m", "bench.frontdoor", "--quick", "--wait-quiet", "0", "--out", str(tmp_path / "out"),
                         "--results", str(tmp_path / "res"), "--inband", str(INBAND)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    cells = {c["key"]: frontdoor.summary(c) for c in json.loads((tmp_path / "res" / "results.json").read_text())["rows"]["cells"]}
    assert set(cells) == {"inband", "nginx", "haproxy", "static"}
    for key, s in cells.items():
        assert s["full_hs"] > 0 and s["resumed_hs"] > 0 and s["https_rps"] > 0 and s["h2_rps"] > 0, (key, s)
        # Every system resumes TLS 1.2 sessions and TLS 1.3 tickets, and
        # answered every request with the whole object.
        assert s["resumed_share"] == 1.0 and s["resumes"], (key, s)
        assert s["errors"] == 0, (key, s)
    assert "| system | HTTPS req/s |" in cp.stdout
    assert "Before each measurement: not waited for (--wait-quiet 0)." in cp.stdout
    # Nothing it started is left running (every system's argv names its
    # config under --out).
    assert str(tmp_path) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout

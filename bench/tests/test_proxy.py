"""The L7 cache benchmark: its configurations checked by nginx and Varnish
themselves, its tables from known numbers, and its quick profile end to end
on loopback, so it cannot silently rot."""

from __future__ import annotations

import os
import shutil
import subprocess
import json
import sys
import tomllib

import pytest

from bench.lib import peers
from bench import proxy as px
from driver_runs import INBAND, REPO, table_rows


def table(md: str, header_start: str) -> dict[str, list[str]]:
    return {c[0]: c for c in table_rows(md, header_start)}


def number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("×% "))


def test_proxy_toml_memory_has_no_path_durable_needs_one():
    t = tomllib.loads(peers.proxy_toml(listen="127.0.0.1:1", origin="127.0.0.1:2", backend="memory", path=None, capacity_bytes=10))
    assert t == {"listen": "127.0.0.1:1", "backends": ["127.0.0.1:2"], "cache": {"backend": "memory", "capacity_bytes": 10}}
    t = tomllib.loads(peers.proxy_toml(listen="127.0.0.1:1", origin="127.0.0.1:2", backend="lmdb", path="/x", capacity_bytes=10))
    assert t["cache"]["path"] == "/x"
    with pytest.raises(ValueError):
        peers.proxy_toml(listen="127.0.0.1:1", origin="127.0.0.1:2", backend="files", path=None, capacity_bytes=10)


@pytest.mark.skipif(not shutil.which("nginx"), reason="nginx is not installed")
def test_nginx_conf_passes_nginx_t(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(peers.nginx_conf(listen="127.0.0.1:1", origin="127.0.0.1:2", prefix=str(tmp_path), max_size_bytes=1 << 20, workers=2, as_root=os.geteuid() == 0))
    cp = subprocess.run(["nginx", "-t", "-c", str(conf), "-p", str(tmp_path), "-e", str(tmp_path / "error.log")], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    conf.write_text(peers.nginx_static_conf(listen="127.0.0.1:1", root=str(tmp_path), prefix=str(tmp_path), workers=2, as_root=os.geteuid() == 0))
    cp = subprocess.run(["nginx", "-t", "-c", str(conf), "-p", str(tmp_path), "-e", str(tmp_path / "error.log")], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr


@pytest.mark.skipif(not shutil.which("varnishd"), reason="varnish is not installed")
def test_varnish_vcl_compiles(tmp_path):
    vcl = tmp_path / "v.vcl"
    vcl.write_text(peers.varnish_vcl(origin_host="127.0.0.1", origin_port=2))
    cp = subprocess.run(["varnishd", "-C", "-f", str(vcl), "-n", str(tmp_path / "v"), "-j", "none"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr


def test_tables_ratios_from_known_numbers():
    def hits(key, requests, cpu_s, conns=8, origin=0):
        h = px.Hits(key, (px.ORIGIN if key == px.ORIGIN.key else px.BY_KEY[key]).label, conns)
        h.rounds = [{"requests": requests, "duration_us": 1_000_000, "p50_us": 100, "p99_us": 1000, "cpu_s": cpu_s, "origin": origin, "errors": 0, "status_errors": 0}]
        return h

    rows = [hits("inband-lmdb", 10_000, 0.5), hits("nginx", 20_000, 0.5), hits("varnish", 40_000, 1.0), hits("static", 50_000, 0.5),
            hits("inband-lmdb", 30_000, 0.5, 500), hits("nginx", 20_000, 0.5, 500)]  # fmt: skip
    t = {(r[0], r[1]): r for r in table_rows(px.hits_table(rows), "| system |")}
    # req/s, ÷ nginx, ÷ Varnish, ÷ limit; CPU µs/req 50 vs 25 and 25 — each against its own connection count
    assert t[("inband LMDB", "8")][2:6] == ["10,000", "0.50×", "0.25×", "0.20×"]
    assert t[("inband LMDB", "8")][9:12] == ["50.0", "2.00×", "2.00×"]
    assert t[("inband LMDB", "500")][2:6] == ["30,000", "1.50×", "–", "–"]
    m = table(px.misses_table([hits("inband-lmdb", 1000, 0.05, origin=1000), hits("nginx", 500, 0.05, origin=500),
                               hits("origin", 1250, 0.0, origin=1250)]), "| system |")
    assert m["inband LMDB"][1:4] == ["1,000", "2.00×", "0.80×"]
    assert m["inband LMDB"][6:9] == ["50.0", "0.50×", "1.00"]
    # The limit: its rate against the others', and no CPU of its own.
    assert m["limit: wrk straight to the origin"][1:4] == ["1,250", "2.50×", "1.00×"]
    assert m["limit: wrk straight to the origin"][6:8] == ["–", "–"]
    r = px.Restart("varnish", "Varnish (malloc)", False, 0.5, 1000, 0, 250, 5.0)
    t = table(px.restart_table([r], 5, 500), "| system |")
    assert t["Varnish (malloc)"][4:7] == ["250", "75.0 %", "50.0 %"]


@pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("varnishd") and shutil.which("wrk") and INBAND.is_file()), reason="needs nginx, varnish, wrk and target/debug/inband (scripts/setup.sh)")
def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.proxy", "--quick", "--wait-quiet", "0", "--out", str(out), "--results", str(out), "--inband", str(INBAND)]
    cp = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert cp.returncode == 0, f"driver failed ({cp.returncode}):\n{cp.stdout[-4000:]}\n{cp.stderr[-4000:]}"
    md = (out / "results.md").read_text()
    assert md in cp.stdout

    hits = table_rows(md, "| system | connections |")
    assert [(r[0], r[1]) for r in hits] == [(s.label, str(c)) for c in px.PROFILES["quick"].connections for s in px.SYSTEMS]
    for row in hits:
        assert number(row[2]) > 0, row
        assert number(row[12]) == 0 and number(row[13]) == 0, row  # every cache filled, no errors
    misses = table(md, "| system | req/s | ÷ nginx | ÷ limit |")
    assert list(misses) == [s.label for s in [*px.SYSTEMS, px.ORIGIN] if s.key != "static"]
    for label, row in misses.items():
        assert number(row[1]) > 0 and number(row[9]) == 0, row
        assert number(row[8]) >= 0.99, row  # every miss reached the origin

    rs = table(md, "| system | cache kept on disk |")
    origin = {label: number(row[4]) for label, row in rs.items()}
    assert origin["inband memory"] > 0 and origin["Varnish (malloc)"] > 0, origin
    assert origin["inband LMDB"] < origin["inband memory"] and origin["inband LMDB"] < origin["Varnish (malloc)"], origin
    assert "limit: nginx static files" not in origin, "the limit is not restarted"

    assert (out / "proxy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    facts = json.loads((out / "results.json").read_text())["machine"]
    assert facts["nginx"].startswith("nginx version: nginx/") and facts["varnish"].startswith("varnishd (varnish-") and facts["wrk"], facts
    # Nothing left running (the driver itself fails when a port is still
    # listening): the systems' command lines name --out or the driver's temp dir.
    left = subprocess.run(["pgrep", "-af", f"{out}|inband-bench-proxy-"], capture_output=True, text=True).stdout
    assert left == "", left


def test_disturbed_rounds_are_named():
    assert px.disturbed_note([("a", []), ("b", [])], "rounds").startswith("No build")
    assert px.disturbed_note([], "rounds") == ""
    note = px.disturbed_note([("a", []), ("nginx proxy_cache", ["bench.forwarding"])], "rounds")
    assert "1 of 2 rounds" in note and "nginx proxy_cache (bench.forwarding)" in note


def test_the_origins_request_count_is_read_from_stub_status():
    page = "Active connections: 3 \nserver accepts handled requests\n 12 12 4057 \nReading: 0 Writing: 1 Waiting: 2 \n"
    assert px.stub_status_requests(page) == 4057
    with pytest.raises(RuntimeError, match="not a stub_status page"):
        px.stub_status_requests('{"requests": 4057}')

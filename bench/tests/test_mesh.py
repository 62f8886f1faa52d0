"""The socket-layer L7 benchmark: its peers' configurations checked by
HAProxy and nginx themselves, the mesh's by inband, its report from known
numbers, and its tiny profile end to end, so it cannot silently rot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from bench import mesh as mb
from driver_runs import INBAND, REPO, table_rows


def test_peer_configs_pass_their_own_checks(tmp_path):
    fronts = [(15100, ["10.77.1.2:8080", "10.77.2.2:8080"])]
    if shutil.which("haproxy"):
        cfg = tmp_path / "h.cfg"
        cfg.write_text(mb.haproxy_http_cfg(fronts))
        cp = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert cp.returncode == 0, cp.stdout + cp.stderr
    if shutil.which("nginx"):
        for name, text in [
            ("sidecar.conf", mb.nginx_sidecar_conf(str(tmp_path), fronts)),
            ("backend.conf", mb.nginx_backend_conf(str(tmp_path), "127.0.0.1:8080")),
            *[(f"hop{k}-{s}.conf", mb.hop_conf(str(tmp_path), s, k)) for s in ("direct", "mesh", "haproxy", "nginx") for k in (0, 8)],
        ]:
            conf = tmp_path / name
            conf.write_text(text)
            cp = subprocess.run(["nginx", "-t", "-c", str(conf)], capture_output=True, text=True)
            assert cp.returncode == 0, name + ": " + cp.stderr


def test_mesh_and_proxy_configs_are_what_inband_reads():
    t = tomllib.loads(mb.mesh_toml([("10.96.0.10:80", ["10.77.1.2:8080"])], 64))
    assert t["pool"] == 64 and t["service"][0]["backends"] == ["10.77.1.2:8080"]
    t = tomllib.loads(mb.proxy_toml("127.0.0.1:15300", ["a:1", "b:2"]))
    assert t == {"listen": "127.0.0.1:15300", "backends": ["a:1", "b:2"], "workers": 1}


def test_report_gives_ratios_to_direct_and_the_best_sidecar():
    res = mb.Results(profile="x")
    for system, rps, cpu in [("direct", 100.0, 10.0), ("mesh", 80.0, 14.0), ("haproxy", 40.0, 20.0), ("nginx", 50.0, 22.0)]:
        res.points.append(mb.Point(system, 8, rps, 100, 200, 0, cpu, cpu - 10.0))
    md = mb.report(res)
    rows = {r[0]: r for r in table_rows(md, "| system | connections |")}
    assert rows["inband mesh"][3] == "0.80×"
    assert rows["inband mesh"][4] == "1.60×"
    assert rows["inband mesh"][9] == "4.0"


def test_sizes_table_gives_the_mesh_against_direct_and_the_best_sidecar():
    res = mb.Results(profile="x")
    for system, rps in [("direct", 1000.0), ("mesh", 900.0), ("haproxy", 300.0), ("nginx", 450.0)]:
        for direction in mb.DIRECTIONS:
            res.sizes.append(mb.Point(system, 32, rps, 100, 200 if system == "mesh" else 300, 0, 1.0, direction=direction, size=1 << 20))
    rows = table_rows(mb.sizes_table(res), "| way | size |")
    assert [(r[0], r[1]) for r in rows] == [("response", "1 MiB"), ("request", "1 MiB")]
    # direct, mesh, HAProxy, nginx; mesh ÷ direct, ÷ best sidecar (nginx); MB/s; p99s
    assert rows[0][2:] == ["1,000", "900", "300", "450", "0.90×", "2.00×", "943.7", "200", "300"]


def test_report_splits_a_large_responses_cpu_by_part():
    res = mb.Results(profile="x")
    sock, tcp = "sockmap redirection: psock queues, work items", "TCP/IP stack and veth"
    res.size_profiles = {
        "mesh": {sock: 120.0, tcp: 300.0, "conns": 32, "rps": 650.0, "size": 1 << 20},
        "proxy": {tcp: 250.0, "conns": 32, "rps": 1300.0, "size": 1 << 20},
    }
    md = mb.report(res)
    assert "Where a 1 MiB response's time goes (32 connections, perf, µs of CPU per response)" in md
    rows = {r[0]: r[1:] for r in table_rows(md, "| part | inband mesh |")}
    assert rows[sock] == ["120.0", "0.0"] and rows[tcp] == ["300.0", "250.0"]
    assert rows["total"] == ["420.0", "250.0"], "conns, rps and size are not parts"
    assert rows["responses a second while profiled"] == ["650", "1,300"]


@pytest.mark.skipif(os.geteuid() != 0 or not INBAND.exists(), reason="needs root and target/debug/inband")
def test_tiny_profile_end_to_end(tmp_path):
    cp = subprocess.run(
        [sys.executable, "-m", "bench.mesh", "--out", str(tmp_path), "--results", str(tmp_path), "--profile", "tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    md = (tmp_path / "results.md").read_text()
    rows = table_rows(md, "| system | connections |")
    assert {r[0] for r in rows} == set(mb.SYSTEMS.values())
    for r in rows:
        assert float(r[2].replace(",", "")) > 0, r
        assert r[7] == "0", r  # no errors
    chain = table_rows(md, "| system | connections | req/s | p50")
    assert len(chain) == 4
    assert "request program" in md
    # The sweep: both ways, both sizes, every system answered without errors.
    sizes = table_rows(md, "| way | size |")
    assert [(r[0], r[1]) for r in sizes] == [("response", "64 B"), ("response", "1 MiB"), ("request", "64 B"), ("request", "1 MiB")]
    for r in sizes:
        assert all(c != "-" and "errors" not in c and float(c.replace(",", "")) > 0 for c in r[2:7]), r
    assert (tmp_path / "mesh.png").exists() and (tmp_path / "mesh-sizes.png").exists()
    if shutil.which("perf"):
        header = "| part | " + " | ".join(mb.SYSTEMS.values()) + " |"
        parts = {r[0]: r[1:] for r in table_rows(md, header)}
        assert len(parts["total"]) == len(mb.SYSTEMS) and "Where a 1 MiB response's time goes" in md
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mb-" not in out
    assert not mb.CGROUP.exists()


def test_perf_symbols_fall_into_the_seeds_parts():
    assert mb.perf_group("[k] bpf_prog_123_mesh_request") == "BPF programs and their helpers"
    assert mb.perf_group("[k] sk_psock_backlog") == "sockmap redirection: psock queues, work items"
    assert mb.perf_group("[k] sk_msg_recvmsg") == "sockmap redirection: psock queues, work items"
    assert mb.perf_group("[k] tcp_sendmsg_locked") == "TCP/IP stack and veth"
    assert mb.perf_group("[k] finish_task_switch.isra.0") == "scheduling and wake-ups"
    assert mb.perf_group("[.] http_parser_execute") == "user space: load generator, backends, sidecar"
    text = "# Event count (approx.): 1000000\n#\n    50.00%   10  [k] tcp_ack\n    25.00%   5  [k] pv_native_safe_halt\n    25.00%  5  [.] main\n"
    got = mb.parse_perf_report(text)
    assert got == {"TCP/IP stack and veth": 500000.0, "idle": 250000.0, "user space: load generator, backends, sidecar": 250000.0}

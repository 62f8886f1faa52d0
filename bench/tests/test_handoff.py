"""The handoff driver: what it reads off its clients and the proxy, its
tables from known numbers (ratios, targets, a row that fell back said
so), and its tiny profile end to end on a namespace testbed (every row
has numbers, every handoff moved, no transfer failed, nothing left)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench import handoff as ho
from driver_runs import INBAND, run_tiny, table_rows

MIB = ho.MIB


def test_the_clients_lines_are_parsed():
    t = ho.parse_timing("some warning\ntiming status=200 bytes=1048576 moved=1 connect_ns=1000000000 sent_ns=1001000000 "
                        "first_byte_ns=1004000000 done_ns=1011000000 url=http://10.1.0.100/1M\n")
    assert t == [{"status": 200, "bytes": MIB, "moved": 1, "total_s": 0.011, "first_ms": 3.0}]
    c = ho.parse_curl("200 1048576 0.000500 0.002500 0.010000\n000 0 0 0 0.001\n")
    assert c[0] == {"status": 200, "bytes": MIB, "moved": 0, "total_s": 0.01, "first_ms": pytest.approx(2.0)}
    assert c[1]["status"] == 0


def test_the_proxys_tcpe_counters_are_parsed():
    m = ho.parse_tcpe_metrics('# HELP x\ninband_proxy_tcpe_handoffs_total{result="handed_off"} 12\n'
                              'inband_proxy_tcpe_handoffs_total{result="fallback_no_ack"} 1\n'
                              'inband_proxy_tcpe_kept_total{reason="cached"} 0\ninband_proxy_requests_total 3\n')
    assert m == {("handoffs", "handed_off"): 12.0, ("handoffs", "fallback_no_ack"): 1.0, ("kept", "cached"): 0.0}


def row(system: str, *, cpu: float, machine: float, total_s: float, n: int = 10, moved: int = 0, handed_off: int = 0,
        fallbacks: dict | None = None, bpf_ns: int = 0, first_ms: float = 1.0) -> ho.Row:
    """n fetches of 1 MiB; `cpu` and `machine` in seconds for the row."""
    return ho.Row(system, MIB, 0, n, ok=n, bytes=n * MIB, seconds=1.0, balancer_cpu_s=cpu, bpf_ns=bpf_ns, machine_cpu_s=machine,
                  client_cpu_s=0.0, totals_s=[total_s] * n, first_ms=[first_ms] * n, moved=moved, handed_off=handed_off,
                  fallbacks=fallbacks or {})


def known_rows(handoff: ho.Row) -> list[ho.Row]:
    gb = 10 * MIB / 1e9
    return [
        row("direct", cpu=0.0, machine=1.0 * gb, total_s=0.010),
        row("relay", cpu=0.0, machine=1.3 * gb, total_s=0.020),
        handoff,
        row("proxy", cpu=2.0 * gb, machine=3.0 * gb, total_s=0.020),
        # 0.1 s/GB of the daemon and 0.1 s/GB of XDP run time.
        row("dsr", cpu=0.1 * gb, machine=1.2 * gb, total_s=0.010, bpf_ns=int(0.1 * gb * 1e9)),
        row("nginx", cpu=1.0 * gb, machine=2.0 * gb, total_s=0.015),
        # Empty answers: its 10 connections stand for 10 MiB.
        ho.Row("floor", MIB, 0, 10, ok=10, bytes=0, seconds=1.0, balancer_cpu_s=0.05 * gb, machine_cpu_s=0.5 * gb, totals_s=[0.001] * 10,
               first_ms=[0.5] * 10),
    ]


def test_tables_give_the_targets_as_ratios():
    gb = 10 * MIB / 1e9
    h = row("handoff", cpu=0.1 * gb, machine=1.5 * gb, total_s=0.0125, moved=10, handed_off=10, first_ms=4.0)
    md = ho.markdown(known_rows(h), {"counts": [[1, 10]], "rounds": 1}, [], [])
    targets = table_rows(md, "| response | handoff | ÷ proxied")
    # 0.1 ÷ 2.0 = 0.05 (≤ 0.1); 0.1 ÷ (0.1 + 0.1) = 0.5 (≤ 1.2); 10 ms ÷ 12.5 ms = 0.8 (< 0.9).
    # On the machine above direct: 0.5 ÷ 2.0 and 0.5 ÷ 0.2 (beside, not judged).
    # The relay reference (20 ms a fetch) is 0.5× direct's rate; the handoff's 0.8 is 1.60× it.
    # The floor, 0.05 s/GB, is 0.25× dsr-rr's 0.2, and the handoff 2× it.
    assert targets == [["1 MiB", "TCPE", "0.050", "–", "met", "0.50", "met", "0.80", "**not met**", "0.50", "1.60", "0.25", "2.00", "0.250", "2.50"]]
    # A second round at twice the handoff's CPU: the rounds alone give 0.050 and 0.100.
    h2 = replace(h, round=1, balancer_cpu_s=0.2 * gb)
    two = ho.markdown(known_rows(h) + [replace(r, round=1) for r in known_rows(h2)], {"counts": [[1, 10]], "rounds": 2}, [], [])
    assert table_rows(two, "| response | handoff | ÷ proxied")[0][2:5] == ["0.075", "0.050–0.100", "met"]
    cpu = {r[1]: r for r in table_rows(md, "| response | system | complete |")}
    hr = cpu["inband proxy, handed off (TCPE client)"]
    assert hr[2:5] == ["10/10", "10/10", "0"]
    assert hr[8:12] == ["0.100", "0.05×", "0.50×", "0.500"]  # machine above direct: 1.5 − 1.0
    assert cpu["inband lb, dsr-rr (XDP)"][7:9] == ["0.1000", "0.200"]
    assert cpu["direct: client → origin"][8] == "–"
    assert cpu["limit: nginx on the balancer answers each connection itself (204, no origin)"][2:12] == ["10/10", "–", "–", "0.010", "0.050", "–", "0.050", "0.03×", "0.25×", "–"]
    tp = {r[1]: r for r in table_rows(md, "| response | system | fetches |")}
    assert tp["inband proxy, handed off (TCPE client)"][3:] == ["84", "84", "0.80×"]
    assert not any(r[1].startswith("limit") for r in table_rows(md, "| response | system | fetches |"))
    lat = {r[0]: r for r in table_rows(md, "| system | fetches | p50 ms |")}
    assert not any(k.startswith("limit") for k in lat)
    assert lat["inband proxy, handed off (TCPE client)"][1:3] == ["10", "4.00"]


def test_a_handoff_is_judged_against_the_direct_row_of_its_own_client():
    gb = 10 * MIB / 1e9
    h = row("handoff", cpu=0.1 * gb, machine=1.5 * gb, total_s=0.0125, moved=10, handed_off=10)
    t = row("transparent", cpu=0.1 * gb, machine=1.5 * gb, total_s=0.0125, moved=10, handed_off=10)
    # The TCPE client straight to the origin takes 11.25 ms a fetch, curl 10.
    own = row("direct-tcpe", cpu=0.0, machine=1.0 * gb, total_s=0.01125)
    md = ho.markdown(known_rows(h) + [t, own], {"counts": [[1, 10]], "rounds": 1}, [], [])
    targets = {r[1]: r for r in table_rows(md, "| response | handoff | ÷ proxied")}
    assert "÷ direct with its own client, throughput (≥ 0.9)" in md
    # 11.25 ÷ 12.5 = 0.90 against its own client; curl's 10 ÷ 12.5 for the transparent row.
    assert targets["TCPE"][7:9] == ["0.90", "met"]
    assert targets["transparent"][7:9] == ["0.80", "**not met**"]
    tp = {r[1]: r for r in table_rows(md, "| response | system | fetches |")}
    assert tp["direct: TCPE client → origin"][5] == "0.89×"
    ab = ho.ab_numbers({"rows": [asdict(r) for r in known_rows(h) + [own]]})
    assert ab["inband proxy, handed off (TCPE client), 1 MiB: throughput ÷ direct"] == [pytest.approx(0.9)]
    # A record without the TCPE client's direct row judges against curl's, under the old heading.
    assert "÷ direct, throughput (≥ 0.9)" in ho.markdown(known_rows(h), {"counts": [[1, 10]], "rounds": 1}, [], [])


def test_a_handoff_row_that_fell_back_says_so_and_is_not_judged():
    gb = 10 * MIB / 1e9
    h = row("handoff", cpu=0.1 * gb, machine=1.5 * gb, total_s=0.010, moved=8, handed_off=8, fallbacks={"fallback_no_ack": 2})
    md = ho.markdown(known_rows(h), {"counts": [[1, 10]], "rounds": 1}, [], [])
    targets = table_rows(md, "| response | handoff | ÷ proxied")[0]
    assert targets[4] == targets[6] == targets[8] == "not judged: 2 of 10 did not move"
    hr = {r[1]: r for r in table_rows(md, "| response | system | complete |")}["inband proxy, handed off (TCPE client)"]
    assert hr[3:5] == ["8/10", "fallback_no_ack 2"]
    # A request a proxy rule kept is said too.
    h.kept = {"not_simple": 1}
    hr = {r[1]: r for r in table_rows(ho.markdown(known_rows(h), {"counts": [[1, 10]], "rounds": 1}, [], []), "| response | system | complete |")}
    assert hr["inband proxy, handed off (TCPE client)"][4] == "fallback_no_ack 2, kept (not_simple) 1"
    # The two ends disagreeing is shown, and the smaller count decides.
    h.moved = 7
    assert ho.cells([h])[("handoff", MIB)].not_moved == 3
    md = ho.markdown(known_rows(h), {"counts": [[1, 10]], "rounds": 1}, [], [])
    assert "8/10 (client: 7)" in md


def test_a_transparent_row_is_judged_beside_the_tcpe_one_and_counts_xdp():
    gb = 10 * MIB / 1e9
    h = row("handoff", cpu=0.1 * gb, machine=1.5 * gb, total_s=0.0125, moved=10, handed_off=10)
    # 0.02 s/GB of the proxy's and the daemon's, 0.08 s/GB of XDP run time.
    t = row("transparent", cpu=0.02 * gb, machine=1.1 * gb, total_s=0.010, moved=10, handed_off=10, bpf_ns=int(0.08 * gb * 1e9))
    md = ho.markdown(known_rows(h) + [t], {"counts": [[1, 10]], "rounds": 1}, [], [])
    targets = {r[1]: r for r in table_rows(md, "| response | handoff | ÷ proxied")}
    # (0.02 + 0.08) ÷ 2.0 = 0.05; ÷ (0.1 + 0.1) = 0.5; 10 ms ÷ 10 ms = 1.0.
    assert targets["transparent"][2:9] == ["0.050", "–", "met", "0.50", "met", "1.00", "met"]
    cpu = {r[1]: r for r in table_rows(md, "| response | system | complete |")}
    assert cpu["inband lb + proxy, moved at L4 (curl)"][3:5] == ["10/10", "0"]
    # The balancer's count disagreeing with the proxy's is shown, and decides.
    t.moved = 9
    assert "10/10 (balancer: 9)" in ho.markdown(known_rows(h) + [t], {"counts": [[1, 10]], "rounds": 1}, [], [])
    assert ho.cells([t])[("transparent", MIB)].not_moved == 1


def test_the_peers_configs():
    n = ho.peers.nginx_proxy_conf(listen="10.1.0.100:80", origin="10.1.0.21:8080", prefix="/tmp/x", workers=2, as_root=True)
    assert "proxy_max_temp_file_size 0;" in n and "server 10.1.0.21:8080;" in n and "proxy_cache" not in n
    h = ho.peers.haproxy_http_cfg(listen="10.1.0.100:80", origin="10.1.0.21:8080", threads=2)
    assert "mode http" in h and "bind 10.1.0.100:80" in h and "server o 10.1.0.21:8080" in h
    t = ho.inband_proxy_toml(listen="10.1.0.100:80", origin="10.1.0.21:8080", metrics="10.1.0.2:9180", cgroup=Path("/cg"), key=Path("/k"),
                             control="10.1.0.21:7000", join="10.1.0.21:7001")
    assert '[[tcpe.server]]\nbackend = "10.1.0.21:8080"\ncontrol = "10.1.0.21:7000"\njoin = "10.1.0.21:7001"' in t
    assert "[tcpe.transparent]" not in t
    t = ho.inband_proxy_toml(listen="10.1.0.22:8080", origin="10.1.0.21:8080", metrics="10.1.0.22:9180", cgroup=Path("/cg"), key=Path("/k"),
                             control="10.1.0.21:7000", join="10.1.0.21:7001", transparent=(Path("/pins"), Path("/a")))
    assert '[tcpe.transparent]\nagent_pins = "/pins"\nbalancer_port = 7156\n' in t and 'keys = [{ id = 1, file = "/a" }]' in t
    lb = ho.peers.lb_toml(address="10.1.0.2", vip="10.1.0.100", vip_port=80, backends=[ho.Backend("10.1.0.22", 8080), ho.Backend("10.1.0.21", 8080, weight=0)],
                          mode="dsr-rr", control_socket="/s", auth_key="/a", moves_listen="10.1.0.2:7156")
    assert '[moves]\nlisten = ["10.1.0.2:7156"]' in lb and 'address = "10.1.0.21"\nport = 8080\nweight = 0' in lb


def test_a_thinking_origin_serves_one_size_and_the_tables_say_how_late(tmp_path, capsys):
    # Refused before anything is started: several sizes, or the floor's row.
    for extra in ([], ["--profile", "think", "--systems", "direct,floor"]):
        with pytest.raises(SystemExit) as e:
            ho.main(["--out", str(tmp_path), "--origin-think-ms", "2", *extra])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "serves one response size: the profile default has 3" in err and "leave it out" in err
    md = ho.markdown(known_rows(row("handoff", cpu=0.1, machine=1.0, total_s=0.01)), {"counts": [[1, 10]], "rounds": 1}, [], [], think_ms=2.5)
    assert "1 round(s) of 1 MiB × 10 fetches per row; the origin (`inband serve`) answers each request 2.5 ms after it came" in md


@pytest.mark.skipif(os.geteuid() != 0 or not INBAND.exists() or not all(shutil.which(t) for t in ("nginx", "haproxy", "curl", "bpftool")),
                    reason="needs root, target/debug/inband, nginx, haproxy, curl and bpftool")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"ho{os.getpid() % 100000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.handoff", name, out, 120, extra=("--wait-quiet", "0"))
    assert left == [], f"namespaces left behind: {left}"
    record = json.loads((out / "results.json").read_text())
    assert record["failed"] == []
    cs = ho.cells([ho.revive(ho.Row, r) for r in record["rows"]])
    sizes = [mib * MIB for mib, _ in ho.PROFILES["tiny"].counts]
    assert sorted(cs) == sorted((s, size) for s in ho.DEFAULT_SYSTEMS for size in sizes)
    for (system, size), c in cs.items():
        # Every fetch complete, timed, and the balancer's CPU counted.
        assert c.ok == c.requests > 0 and not c.errors, (system, size, c.errors)
        assert len(c.totals_s) == len(c.first_ms) == c.requests and (system == "floor" or c.mb_s > 0), (system, size)
        assert c.machine_cpu_s > 0, (system, size)
        if ho.BALANCER[system]:
            assert c.balancer_s_gb > 0, (system, size)
    for size in sizes:
        h = cs[("handoff", size)]
        # Both ends count the same moves, and every fetch is either moved
        # or a counted fallback. The one fallback allowed is the
        # documented busy-machine case (routing the request and sending
        # the HANDOFF outlasted the delayed-ACK timer, `fallback_no_ack`): tests run
        # side by side on two cores. At least one fetch of each size moved,
        # and a size with a fallback is not judged.
        assert h.handed_off == h.moved >= 1, (size, h.handed_off, h.moved, h.fallbacks)
        assert set(h.fallbacks) <= {"fallback_no_ack"} and h.handed_off + sum(h.fallbacks.values()) == h.requests, (size, h.fallbacks)
        assert h.kept == {}, (size, h.kept)
        if h.fallbacks:
            assert f"not judged: {h.not_moved} of {h.requests} did not move" in cp.stdout
        # The plain client through the same proxy was proxied, each of its
        # connections counted as not capable of TCPE.
        p = cs[("proxy", size)]
        assert p.handed_off == 0 and p.fallbacks == {"fallback_not_capable": p.requests}, (size, p.fallbacks)
        assert cs[("dsr", size)].bpf_ns > 0  # the XDP program ran
        # Moved at L4: the proxy and the balancer count every fetch moved,
        # none fell back, and the XDP program carried the client's packets.
        t = cs[("transparent", size)]
        assert t.handed_off == t.moved == t.requests and t.fallbacks == {} and t.kept == {}, (size, t.handed_off, t.moved, t.fallbacks, t.kept)
        assert t.bpf_ns > 0
    # The relay reference's columns are filled at every size, for both variants.
    targets = table_rows(cp.stdout, "| response | handoff | ÷ proxied")
    assert [r[1] for r in targets] == ["TCPE", "transparent"] * len(sizes), cp.stdout
    assert all(r[9] != "–" and r[10] != "–" for r in targets), cp.stdout
    assert (out / "handoff.png").exists()
    # Nothing it started is left running, and its cgroups are gone (those
    # of a run beside it, on another testbed, are not this run's).
    assert str(out) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert list(ho.cgroup2_mount().glob(f"inband-bench-handoff-{name}-*")) == []


@pytest.mark.skipif(os.geteuid() != 0 or not INBAND.exists() or not all(shutil.which(t) for t in ("nginx", "haproxy", "curl", "bpftool", "nft")),
                    reason="needs root, target/debug/inband, nginx, haproxy, curl, bpftool and nft")
def test_fault_rows_fall_back_or_lose_only_what_the_fault_takes(tmp_path):
    name = f"hf{os.getpid() % 100000}"
    out = tmp_path / "out"
    systems = ",".join(ho.FAULTS)
    cp, left = run_tiny("bench.handoff", name, out, 120, extra=("--wait-quiet", "0", "--systems", systems), profile="tiny-faults")
    assert left == [], f"namespaces left behind: {left}"
    record = json.loads((out / "results.json").read_text())
    assert record["failed"] == []
    cs = {system: c for (system, _), c in ho.cells([ho.revive(ho.Row, r) for r in record["rows"]]).items()}
    assert sorted(cs) == sorted(ho.FAULTS)
    # Refused or not capable: every connection proxied instead, counted by
    # its reason at the proxy (or the balancer), every body whole.
    expected = {"handoff-refused": {"fallback_channel": 4}, "transparent-refused": {"move_fallback_channel": 4},
                "handoff-stripped": {"fallback_not_capable": 4}}
    for system, fallbacks in expected.items():
        c = cs[system]
        assert c.ok == c.requests == 4 and not c.errors and c.handed_off == 0 and c.fallbacks == fallbacks, (system, c.fallbacks, c.errors)
    # Killed -9 under the row: a TCPE client gets every body whole (the
    # rest of a cut one through the balancer); curl's connections moved
    # into the killed process may be lost, and the row says how many.
    for system in ("handoff-killed", "transparent-killed"):
        assert cs[system].kills >= 1, (system, cs[system])
    k = cs["handoff-killed"]
    assert k.ok == k.requests and not k.errors, (k.fallbacks, k.errors)
    t = cs["transparent-killed"]
    assert t.ok == t.requests or any(f"{t.ok} of {t.requests} complete" in e for e in t.errors), t.errors
    assert "takeover server killed" in cp.stdout
    # Nothing it started is left running.
    assert str(out) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_clients_side_by_side_share_one_result():
    cp = ho.run_clients([["sh", "-c", "echo a; echo e >&2"], ["sh", "-c", "echo b; exit 3"]], tcpe=False, timeout=10)
    assert (cp.returncode, cp.stdout, cp.stderr) == (3, "a\nb\n", "e\n")
    # A TCPE client's output is its stderr (--timing); stdout is dropped.
    cp = ho.run_clients([["sh", "-c", "echo body; echo t1 >&2"], ["sh", "-c", "echo t2 >&2"]], tcpe=True, timeout=10)
    assert (cp.returncode, cp.stdout, cp.stderr) == (0, "", "t1\nt2\n")
    assert ho.side_by_side(1) == "one connection at a time"
    assert ho.side_by_side(4) == "4 clients side by side, each one connection at a time"

"""bench.ab: the order of its runs, its arguments, and its table from
known handoff records (each build's rounds pooled, each run's median)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

import pytest

from bench import ab
from bench import handoff as ho
from bench import proxy
from test_handoff import MIB, row


def test_each_build_runs_first_as_often_as_second():
    assert ab.order(2) == ["a", "b", "b", "a"]
    assert ab.order(4) == ["a", "b", "b", "a"] * 2
    assert ab.order(3).count("a") == ab.order(3).count("b") == 3


def test_a_build_is_a_name_and_a_binary(tmp_path):
    binary = tmp_path / "inband"
    binary.write_text("")
    assert ab.build(f"old={binary}") == ("old", str(binary))
    for bad in (str(binary), f"={binary}", "old=", f"old={tmp_path / 'none'}"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab.build(bad)


def handoff_record(rounds: list[tuple[float, float]]) -> dict:
    """A handoff record of 1 MiB rows: per round, (handoff, proxied) balancer
    seconds for 10 fetches."""
    rows = []
    for i, (handoff, proxied) in enumerate(rounds):
        # The server's CPU: 0.5 s/GB; each fetch takes twice direct's time.
        server = 0.5 * 10 * MIB / 1e9
        # One fetch of the ten stalls: the medians do not see it, the
        # slowest fetch does.
        rows.append(replace(row("handoff", cpu=handoff, machine=1.0, total_s=0.02, moved=10, handed_off=10, first_ms=0.7), round=i,
                            server_cpu_s=server, totals_s=[0.02] * 9 + [0.045]))
        rows.append(replace(row("proxy", cpu=proxied, machine=1.0, total_s=0.01), round=i))
        rows.append(replace(row("direct", cpu=0.0, machine=1.0, total_s=0.01), round=i))
    return {"rows": [asdict(r) for r in rows]}


def test_the_numbers_pool_each_builds_rounds():
    gb = 10 * MIB / 1e9
    runs = [
        {"build": "old", "record": handoff_record([(0.3 * gb, 3.0 * gb), (0.4 * gb, 2.0 * gb)])},
        {"build": "new", "record": handoff_record([(0.2 * gb, 2.0 * gb), (0.2 * gb, 4.0 * gb)])},
        {"build": "new", "record": handoff_record([(0.6 * gb, 3.0 * gb)])},
        {"build": "old", "record": handoff_record([(0.5 * gb, 5.0 * gb)])},
    ]
    n = ho.ab_numbers(runs[0]["record"])
    assert n == {"inband proxy, handed off (TCPE client), 1 MiB: balancer s/GB": [pytest.approx(0.3), pytest.approx(0.4)],
                 "inband proxy, handed off (TCPE client), 1 MiB: ÷ proxied": [pytest.approx(0.1), pytest.approx(0.2)],
                 "inband proxy, handed off (TCPE client), 1 MiB: server s/GB": [pytest.approx(0.5), pytest.approx(0.5)],
                 "inband proxy, handed off (TCPE client), 1 MiB: throughput ÷ direct": [pytest.approx(0.5), pytest.approx(0.5)],
                 "inband proxy, handed off (TCPE client), 1 MiB: first byte p50 ms": [pytest.approx(0.7), pytest.approx(0.7)],
                 "inband proxy, handed off (TCPE client), 1 MiB: slowest fetch ms": [pytest.approx(45.0), pytest.approx(45.0)]}  # fmt: skip
    record = {"command": "python -m bench.ab", "commit": {"sha": "0" * 40, "dirty": False}, "started_utc": "2026-11-30T00:00:00Z", "wall_s": 1,
              "machine": {"cores": 2, "cpu": "x", "kernel": "k"}, "load_average": {"start": [0.0], "end": [0.0]},
              "ab_of": "handoff", "builds": {"old": "/a", "new": "/b"}, "runs": runs}  # fmt: skip
    md = ab.render(record)
    assert "runs in this order: old, new, new, old" in md
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in md.splitlines() if line.startswith("| inband")}
    old = lines[("inband proxy, handed off (TCPE client), 1 MiB: balancer s/GB", "old")]
    # Rounds 0.3, 0.4, 0.5 pooled: median 0.4; the runs' medians (the
    # nearest rank, as every table here) 0.3 and 0.5.
    assert "| 2 | 3 | 0.400 | 0.300–0.500 | 0.300, 0.500 |" in old
    new = lines[("inband proxy, handed off (TCPE client), 1 MiB: ÷ proxied", "new")]
    assert "| 2 | 3 | 0.100 | 0.050–0.200 | 0.050, 0.200 |" in new


def test_the_proxy_numbers_pair_each_round_with_nginx_in_the_same_round():
    def hits(key, label, conns, rounds):
        return {"key": key, "label": label, "conns": conns,
                "rounds": [{"requests": n, "duration_us": 1_000_000, "cpu_s": cpu} for n, cpu in rounds]}  # fmt: skip

    record = {"rows": {"hits": [
        hits("inband-lmdb", "inband LMDB", 8, [(1200, 0.6), (900, 0.9)]),
        hits("nginx", "nginx proxy_cache", 8, [(1000, 0.5), (1000, 0.5)]),
        hits("static", "limit", 8, [(2000, 0.4), (2000, 0.4)]),
    ], "misses": [
        hits("inband-memory", "inband memory", 8, [(500, 0.5), (400, 0.2)]),
        hits("nginx", "nginx proxy_cache", 8, [(1000, 0.5), (800, 0.4)]),
    ]}}  # fmt: skip
    n = proxy.ab_numbers(record)
    assert n == {"inband LMDB, 8 connections: hits ÷ nginx": [pytest.approx(1.2), pytest.approx(0.9)],
                 "inband LMDB, 8 connections: CPU per hit ÷ nginx": [pytest.approx(1.0), pytest.approx(2.0)],
                 "inband memory, 8 connections: misses ÷ nginx": [pytest.approx(0.5), pytest.approx(0.5)],
                 "inband memory, 8 connections: CPU per miss ÷ nginx": [pytest.approx(2.0), pytest.approx(1.0)]}  # fmt: skip

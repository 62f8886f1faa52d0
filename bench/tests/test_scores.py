"""bench.scores without a testbed: the burst schedule and the rendering."""

import datetime

from bench import scores


def test_schedule_is_seeded_bounded_and_covers_every_server():
    p = scores.PROFILES["default"]
    a = scores.schedule(1000, 3, 60, p)
    assert a == scores.schedule(1000, 3, 60, p)
    assert a != scores.schedule(1001, 3, 60, p)
    assert {s for _, _, s in a} == {1, 2, 3}
    for start, dur, _ in a:
        assert 0 <= start < 60 and 0 < dur <= p.burst_on_s[1] and start + dur <= 60 + 1e-9
    assert scores.schedule(1000, 3, 60, scores.PROFILES["calm"]) == []


def row(policy, rep, p99, hedges=0, won=0):
    return {"policy": policy, "repetition": rep, "requests": 100, "rps": 10.0, "p50_ms": 5.0, "p99_ms": p99, "errors": 0,
            "share": [0.4, 0.4, 0.2], "stale": 0, "bursts": 3, "score_max": [None] * 3, "score_busy": [None] * 3,
            "hedges": hedges, "hedges_won": won, "tail": {"n": 10, "met_burst": 7, "min_ms": 40.0}}  # fmt: skip


def record(rows):
    return {
        "command": "python -m bench.scores", "commit": {"sha": "0" * 40, "dirty": False}, "started_utc": "2026-11-29T00:00:00Z", "wall_s": 1,
        "machine": {"cores": 2, "cpu": "x", "kernel": "6"}, "load_average": {"start": [1, 1, 1], "end": [1, 1, 1]},
        "profile": scores.profiles.as_json("default", scores.PROFILES["default"]), "rows": rows,
    }  # fmt: skip


def test_render_gives_the_ratio_and_the_verdict():
    md = scores.render(record([row("least-score", 0, 7.0, 2, 1), row("least-request", 0, 10.0), row("round-robin", 0, 20.0)]))
    # 2 of 100 requests hedged, 1 answered from the second backend.
    assert "| `least-score` | 10.0 (10.0–10.0) | 5.0 (5.0–5.0) | 7.0 (7.0–7.0) | 0.40 / 0.40 / 0.20 | 2.00 % (1) | 7 of 10 | 0 |" in md
    assert "| `least-request` | 10.0 (10.0–10.0) | 5.0 (5.0–5.0) | 10.0 (10.0–10.0) | 0.40 / 0.40 / 0.20 | 0.00 % (0) | 7 of 10 | 0 |" in md
    assert "per repetition: 0.70; mean 0.70, which meets the target" in md
    md = scores.render(record([row("least-score", 0, 9.0), row("least-request", 0, 10.0)]))
    assert "which does not meet the target" in md
    assert "busy_margin = 0" not in md
    # The control without hedging: its own row and ratio.
    md = scores.render(record([row("least-score", 0, 7.0, 2, 1), row("least-score-unhedged", 0, 9.0), row("least-request", 0, 10.0)]))
    assert "| `least-score`, `busy_margin = 0` (plain two choices, no hedging) | 10.0 (10.0–10.0) | 5.0 (5.0–5.0) | 9.0 (9.0–9.0) | 0.40 / 0.40 / 0.20 | 0.00 % (0) | 7 of 10 | 0 |" in md
    assert "With `busy_margin = 0`: 0.90; mean 0.90." in md
    # The floor: the same bursts outside the pool.
    md = scores.render(record([row("least-score", 0, 7.0), row("least-request", 0, 10.0), row("floor", 0, 6.0)]))
    assert "| floor: the bursts on a server outside the pool |" in md
    assert "(the least any placement could reach with these bursts on this machine): 0.60; mean 0.60." in md


def test_the_slowest_requests_are_matched_to_bursts_on_their_backend(tmp_path):
    log = tmp_path / "proxy.log"
    wall0 = 1_700_000_000.0

    def line(end: float, ms: float, upstream: str) -> str:
        stamp = datetime.datetime.fromtimestamp(end, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return f"{stamp}  INFO inband_proxy::access: client=10.0.0.1:5 method=GET uri=/ status=200 cache=- upstream={upstream} head_ms=1 ms={ms} bytes=1 complete=true"

    # 200 requests: two slow ones, one at s1 during its burst (1.0-2.0 s
    # after the start), one at s2 outside any burst; the rest fast.
    lines = [line(wall0 + 1.5, 60.0, "10.0.0.11:8080"), line(wall0 + 3.5, 55.0, "10.0.0.12:8080")]
    lines += [line(wall0 + 0.01 * k, 5.0, "10.0.0.13:8080") for k in range(198)]
    lines.append(line(wall0 - 5, 500.0, "10.0.0.11:8080"))  # an earlier run's
    log.write_text("\n".join(lines) + "\n")
    servers = {"10.0.0.11:8080": 1, "10.0.0.12:8080": 2, "10.0.0.13:8080": 3}
    bursts = [(1.0, 0.6, 1), (3.0, 1.4, 3)]
    assert scores.slowest_met_bursts(log, wall0, bursts, servers) == {"n": 2, "met_burst": 1, "min_ms": 55.0}
    assert scores.slowest_met_bursts(log, wall0, bursts, servers, elsewhere=True)["met_burst"] == 0

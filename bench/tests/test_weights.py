"""The weights driver (issue 13): its configs, parsers, tables, verdicts and
plots from known numbers, and its tiny profile end to end (every row
served, the controller steady, the learned weights in capacity order, the
namespaces gone afterwards)."""

from __future__ import annotations

import json
import os

import pytest

from bench import weights as W
from driver_runs import run_tiny, table_rows


def ol(mean, p99, ok=1000, errors=0, sent=None):
    return {"rate": 300.0, "seconds": 10.0, "sent": sent if sent is not None else ok + errors, "ok": ok, "errors": errors,
            "mean_ms": mean, "p50_ms": mean, "p90_ms": p99, "p99_ms": p99, "achieved_rps": 300.0}


def status(ws, phase="steady", solve_ms=3.5, unix_ms=1_000_000):
    return {"phase": phase, "last_solve": {"unix_ms": unix_ms, "reason": "learned", "solve_ms": solve_ms},
            "backends": [{"address": f"10.87.0.{10 + i}:8080", "name": f"s{i + 1}", "state": "ready", "weight": w, "l0_ms": 20.0,
                          "w_max": 2 * w, "curve": [20.0, 10.0, 100.0],
                          "points": [{"weight": w / 2, "latency_ms": 22.0, "drop": False}, {"weight": 3 * w, "latency_ms": 200.0, "drop": True}],
                          "latency_ms": 25.0} for i, w in enumerate(ws)],
            "decisions": [{"unix_ms": unix_ms, "what": "solved"}]}


def results(goal_mean=20.0, goal_p99=60.0):
    runs = [
        {"row": "rr", "rate_frac": 0.4, "rate": 300, "openloop": ol(900.0, 4000.0, ok=900, errors=100), "decisions": [25, 25, 25, 25],
         "cpu_busy": 0.3},
        {"row": "haproxy-leastconn", "rate_frac": 0.4, "rate": 300, "openloop": ol(30.0, 90.0), "decisions": [10, 20, 30, 40], "cpu_busy": 0.35},
        {"row": "dynamic", "rate_frac": 0.4, "rate": 300, "openloop": ol(28.0, 100.0), "cpu_busy": 0.3},
        {"row": "weights", "rate_frac": 0.4, "rate": 300, "openloop": ol(25.0, 80.0), "status": status([0.06, 0.13, 0.27, 0.54]),
         "learn_s": 31.0, "solves_while_measured": 0, "balancer_weights": [600, 1300, 2700, 5400], "cpu_busy": 0.3},
        {"row": "weights+scores", "rate_frac": 0.4, "rate": 300, "openloop": ol(goal_mean, goal_p99),
         "status": status([0.05, 0.1, 0.25, 0.6]), "learn_s": 29.0, "solves_while_measured": 1, "cpu_busy": 0.31},
        # A second rate where the goal row loses on p99 to HAProxy.
        {"row": "rr", "rate_frac": 0.8, "rate": 600, "openloop": ol(2000.0, 5000.0), "cpu_busy": 0.5},
        {"row": "haproxy-leastconn", "rate_frac": 0.8, "rate": 600, "openloop": ol(60.0, 150.0), "cpu_busy": 0.55},
        {"row": "weights+scores", "rate_frac": 0.8, "rate": 600, "openloop": ol(50.0, 180.0), "status": status([0.05, 0.1, 0.25, 0.6]),
         "cpu_busy": 0.5},
        # A row that failed to measure anything is listed, never a best peer.
        {"row": "dynamic", "rate_frac": 0.8, "rate": 600, "openloop": ol(None, None, ok=0, errors=10)},
    ]
    return {"profile": W.asdict(W.PROFILES["quick"]), "command": "python -m bench.weights --out x", "config":
            {"probe_rate": 10, "round_ms": 2000, "probe_interval": 8, "auth": "siphash", "weights_set": []}, "runs": runs,
            "transitions": [], "ilp": [{"backends": 10, "solve_ms": 30.6, "steps": 2}, {"backends": 1000, "solve_ms": 900.0, "steps": 3}],
            "failed": [], "busy_beside": []}


def test_capacity_and_rates_follow_the_workers_and_service_time():
    assert W.capacity_rps(10.0) == 1500.0 and W.capacity_rps(20.0) == 750.0
    assert W.capacity_rps(50.0) == 300.0
    assert [W.rate_for(f, 20.0) for f in (0.4, 0.6, 0.8)] == [300, 450, 600]
    assert W.run_key("weights+scores", 0.6) == "weights+scores@60"


def test_weights_toml_for_inband_and_haproxy():
    text = W.weights_toml(probe_path="/", probe_rate=10, round_ms=2000, status_file="/run/inband/weights-x.json",
                          target={"kind": "inband", "socket": "/run/lb.sock", "vip": "10.87.0.100:80"},
                          backends=[("10.87.0.3:8080", "s1"), ("10.87.0.4:8080", None)], extra=("max_rounds = 8",))
    assert text.startswith("max_rounds = 8\n")  # top-level keys before the first table
    assert 'probe_rate = 10\nround_ms = 2000\nstatus_file = "/run/inband/weights-x.json"' in text
    assert '[target]\nkind = "inband"\nsocket = "/run/lb.sock"\nvip = "10.87.0.100:80"\n' in text
    assert text.count("[[backend]]") == 2 and 'name = "s1"' in text and text.count("name =") == 1
    h = W.weights_toml(probe_path="/", probe_rate=20, round_ms=1000, status_file="/s.json",
                       target={"kind": "haproxy", "socket": "/h.sock", "backend": "servers"}, backends=[("10.87.0.3:8080", "s1")])
    assert 'backend = "servers"' in h and "vip" not in h
    with pytest.raises(ValueError):
        W.weights_toml(probe_path="/", probe_rate=1, round_ms=1, status_file="/s", target={"kind": "nginx", "socket": "/x"}, backends=[])


def test_haproxy_gets_an_admin_socket_only_when_asked():
    be = [W.Backend("10.87.0.3", 8080), W.Backend("10.87.0.4", 8080)]
    with_sock = W.haproxy_cfg(vip="10.87.0.100", backends=be, balance="roundrobin", admin_socket="/run/h.sock")
    assert with_sock.startswith("global\n    stats socket /run/h.sock mode 600 level admin\n")
    assert "mode tcp" in with_sock and "balance roundrobin" in with_sock and "server s2 10.87.0.4:8080" in with_sock
    assert "stats socket" not in W.haproxy_cfg(vip="10.87.0.100", backends=be, balance="leastconn", admin_socket=None)


def test_haproxy_servers_state_gives_the_user_weights():
    text = ("1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight srv_time_since_last_change\n"
            "3 servers 1 s1 10.87.0.3 2 0 37 1 12\n3 servers 2 s2 10.87.0.4 2 0 256 1 12\n4 other 1 s1 10.0.0.1 2 0 9 1 1\n")
    assert W.parse_servers_state(text, "servers") == {"s1": 37, "s2": 256}


def test_haproxy_stat_gives_sessions_per_server():
    text = ("# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin\n"
            "vip,FRONTEND,,,0,5,4096,900,100\n"
            "servers,s1,0,0,0,2,,120,10\nservers,s2,0,0,1,3,,780,20\nservers,BACKEND,0,0,1,5,410,900,30\n")
    assert W.parse_stat_sessions(text, "servers") == {"s1": 120, "s2": 780}
    assert W.parse_stat_sessions("no header\n", "servers") == {}


def test_openloop_output_is_found_among_other_lines():
    obj = ol(21.5, 70.0)
    text = "warning: something on stderr {not json}\n" + json.dumps(obj) + "\nbye\n"
    assert W.parse_openloop(text) == obj
    pretty = json.dumps(obj, indent=2)
    assert W.parse_openloop("x\n" + pretty)["p99_ms"] == 70.0
    with pytest.raises(ValueError):
        W.parse_openloop('{"rate": 1}\n')


def test_slices_start_on_boundaries_after_now():
    assert W.next_boundary(100.0, 5.0, 100.0) == 105.0
    assert W.next_boundary(100.0, 5.0, 104.9) == 105.0
    assert W.next_boundary(100.0, 5.0, 105.0) == 110.0
    assert W.busy_fraction((10, 100), (60, 200)) == 0.5
    assert W.busy_fraction((10, 100), (10, 100)) is None


def test_curve_is_forced_monotone_like_the_controller():
    assert W.curve_latency([5.0, 2.0, 30.0], 0.2) == pytest.approx(5.0 + 0.4 + 1.2)
    dip = [10.0, -20.0, 40.0]  # a dip fitted from noise: never below the value at 0
    assert W.curve_latency(dip, 0.2) == 10.0
    hump = [10.0, 20.0, -40.0]  # a maximum inside: held after it
    assert W.curve_latency(hump, 0.5) == pytest.approx(12.5) and W.curve_latency(hump, 0.9) == pytest.approx(12.5)
    xs = [i / 50 for i in range(51)]
    for c in (dip, hump, [1.0, -3.0, 2.0]):
        ys = [W.curve_latency(c, x) for x in xs]
        assert all(b >= a for a, b in zip(ys, ys[1:])), c


def test_weights_as_ratios_to_the_smallest_server():
    assert W.backend_weights(status([0.05, 0.1, 0.25, 0.6])) == [0.05, 0.1, 0.25, 0.6]
    assert W.ratios_to_first([0.05, 0.1, 0.25, 0.6]) == pytest.approx([1, 2, 5, 12])
    assert W.fmt_ratio_list([1, 2, 3.9, 9.7]) == "1 : 2 : 3.9 : 9.7"
    assert W.fmt_ratio_list(W.ratios_to_first([0.05, 0.1, 0.25, 0.6])) == "1 : 2 : 5 : 12"
    assert W.ratios_to_first([0.0, 1.0]) is None and W.backend_weights(None) is None


def test_verdict_says_per_rate_whether_the_goal_row_beat_every_other_row():
    r = results()
    v = {x["rate_frac"]: x for x in W.verdicts(r["runs"])}
    assert v[0.4]["beat_all"] and v[0.4]["best_other_mean_ms"] == ("weights", 25.0) and v[0.4]["best_other_p99_ms"] == ("weights", 80.0)
    # At 80% it has the lowest mean but HAProxy's p99 is lower: not a win.
    assert v[0.8]["beat_mean_ms"] and not v[0.8]["beat_p99_ms"] and not v[0.8]["beat_all"]
    assert v[0.8]["best_other_p99_ms"] == ("haproxy-leastconn", 150.0)
    # Worse on the mean by a hair is a loss too.
    lose = {x["rate_frac"]: x for x in W.verdicts(results(goal_mean=25.5)["runs"])}
    assert not lose[0.4]["beat_mean_ms"] and not lose[0.4]["beat_all"]


def test_tables_give_ratios_to_the_best_other_row_and_the_seeds_numbers():
    md = W.markdown(results())
    rows = {(c[0], c[1]): c for c in table_rows(md, "| rate | row | sent |")}
    goal = rows[("40% (300)", "weights+scores (goal)")]
    assert goal[6:10] == ["20.0", "60.0", "0.80× (weights)", "0.75× (weights)"]
    rr = rows[("40% (300)", "rr")]
    assert rr[4] == "100 (10.0%)" and rr[6] == "900" and rr[8] == "45.00× (weights+scores)" and rr[10] == "25/25/25/25"
    assert rows[("80% (600)", "dynamic")][6] == "–"  # nothing measured: no ratio, and never the best other
    assert rows[("80% (600)", "haproxy-leastconn")][9] == "0.83× (weights+scores)"
    verdict = {c[0]: c for c in table_rows(md, "| rate | weights+scores mean ms |")}
    assert verdict["40%"][-1] == "**yes**" and verdict["80%"][-1] == "no" and verdict["80%"][5] == "150 (haproxy-leastconn)"
    seed = {(c[0], c[1]): c for c in table_rows(md, "| mean latency of | against |")}
    assert seed[("weights", "rr")][2:] == ["up to 45% lower", "97% lower", "–"]
    assert seed[("weights", "haproxy-leastconn")][2:4] == ["up to 23% lower", "17% lower"]
    assert seed[("weights+scores", "haproxy-leastconn")][3:] == ["33% lower", "17% lower"]
    learned = table_rows(md, "| row | rate | weights s1/s2/s3/s4")
    assert learned[0][:7] == ["weights", "40%", "0.060 / 0.130 / 0.270 / 0.540", "1 : 2.2 : 4.5 : 9", "1 : 2 : 3.9 : 9.7", "1 : 2 : 4 : 8",
                              "600 / 1300 / 2700 / 5400"]
    assert len(learned) == 3 and learned[1][6] == "–" and learned[0][9] == "3.5"
    fallback = results()
    fallback["runs"][3]["status"]["last_solve"].update(solve_ms=0.0, fallback="the learned capacities add up to 0.9")
    md2 = W.markdown(fallback)
    assert table_rows(md2, "| row | rate | weights s1/s2/s3/s4")[0][9] == "0.0 (fallback: weights follow w_max)"
    assert "last solve 3.5 ms median (3.5–3.5, 2 runs)" in md2  # the fallback is not a solve time
    ilp = table_rows(md, "| backends | solve ms")
    assert ilp == [["10", "30.6", "2", "–"], ["1000", "900.0", "3", "21 s"]]
    assert "CPU (both cores, every namespace) while measured" in md and "not the bottleneck" in md


def test_the_transition_is_tabled_in_windows_from_the_slowdown():
    t_slow = 1000.0
    slices = [{"start": t_slow + k * 5, "seconds": 5, "result": ol(20.0 + (30 if 0 <= k < 2 else 0), 70.0, errors=int(k == 0))}
              for k in range(-3, 4)]
    timeline = [{"t": 990.0, "last_solve": {"unix_ms": 985_000, "reason": "learned", "solve_ms": 2.0}, "weights": [0.05, 0.1, 0.25, 0.6]},
                {"t": 1008.0, "last_solve": {"unix_ms": 1_007_500, "reason": "s3 off its curve", "solve_ms": 2.5},
                 "weights": [0.07, 0.14, 0.12, 0.67]}]
    solves = W.solves_seen(timeline, {"last_solve": timeline[-1]["last_solve"]})
    assert [s["unix_ms"] for s in solves] == [985_000, 1_007_500]
    decisions = [{"unix_ms": 1_002_000, "what": "traffic change: 4 of 4 backends off their curves"},
                 {"unix_ms": 1_003_000, "what": "capacity change of s13: x"},
                 {"unix_ms": 1_007_400, "what": "capacity change of s3: 60 ms measured"}]
    assert W.first_naming(decisions, "s3", t_slow)["unix_ms"] == 1_007_400  # not "s13", not an unnamed change
    assert W.first_naming(decisions, "s3", 1008.0) is None
    # One solve (at 985 s) in the 100 s of steady state before the slowdown.
    assert W.solves_per_minute(solves, 900.0, t_slow) == pytest.approx(0.6)
    assert W.solves_per_minute(solves, 995.0, t_slow) is None  # too short to say
    first = W.first_solve_after(solves, t_slow)
    assert first["reason"] == "s3 off its curve" and W.first_solve_after(solves, 1010.0) is None
    t = {"row": "weights+scores", "rate_frac": 0.6, "rate": 450, "backend": 2, "workers": 4, "factor": 3.0, "slowdown_unix": [t_slow, t_slow + 0.04],
         "slices": slices, "first_solve_after": first, "to_solve_s": first["unix_ms"] / 1000 - t_slow,
         "weights_before": [0.05, 0.1, 0.25, 0.6], "weights_after": [0.07, 0.14, 0.12, 0.67], "before_s": 15, "slice_s": 5,
         "to_named_s": 7.5, "solves_per_min_before": W.solves_per_minute(solves, 900.0, t_slow)}
    r = results()
    r["transitions"] = [t]
    md = W.markdown(r)
    summary = table_rows(md, "| row | slowed |")[0]
    assert summary[1:6] == ["s3 (4 workers) 3× slower", "7.5 s (±0.04)", "s3 off its curve", "7.5 s", "0.6"]
    assert summary[6:8] == ["1 : 2 : 5 : 12", "1 : 2 : 1.7 : 9.6"]
    assert summary[8] == "20.0 → 30.0"  # the last three windows on each side
    wins = table_rows(md, "| window from the slowdown |")
    assert [w[0] for w in wins] == ["-15 s to -10 s", "-10 s to -5 s", "-5 s to +0 s", "+0 s to +5 s", "+5 s to +10 s", "+10 s to +15 s",
                                    "+15 s to +20 s"]
    assert wins[3][1] == "50.0 / 70.0 (1)" and wins[0][1] == "20.0 / 70.0 (0)"


def test_plots_are_written(tmp_path):
    r = results()
    r["transitions"] = [{"row": "weights+scores", "slowdown_unix": [1000.0, 1000.0], "to_solve_s": 7.0,
                         "slices": [{"start": 1000.0 + k * 5, "seconds": 5, "result": ol(20.0 + k, 70.0)} for k in range(-2, 3)]}]
    for name, fn in (("curves.png", W.plot_curves), ("latency.png", W.plot_latency), ("transition.png", W.plot_transition)):
        assert fn(r, tmp_path / name), name
        assert (tmp_path / name).stat().st_size > 5000, name
    assert not W.plot_curves({"runs": []}, tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_profiles_name_known_rows_and_a_tiny_one_for_ci():
    for p in W.PROFILES.values():
        assert set(p.rows) <= set(W.BY_KEY) and set(p.transition_rows) <= set(W.BY_KEY)
        assert all(0 < f < 1 for f in p.rates)
        # The controller's config check: at least 4 probes per round.
        assert p.probe_rate * p.round_ms >= 4000
    tiny = W.PROFILES["tiny"]
    assert {"rr", "weights", "weights+scores"} <= set(tiny.rows) and len(tiny.rates) == 1
    assert W.PROFILES["full"].rows == tuple(W.BY_KEY) and "haproxy-weights" not in W.PROFILES["quick"].rows


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces and attaches XDP/tc programs")
def test_tiny_profile_end_to_end(tmp_path):
    name = f"wt{os.getpid() % 10000}"
    out = tmp_path / "out"
    cp, left = run_tiny("bench.weights", name, out, 900)
    assert left == [], f"namespaces left behind: {left}"
    data = json.loads((out / "results.json").read_text())["rows"]
    assert data["failed"] == []
    runs = {r["row"]: r for r in data["runs"]}
    assert set(runs) == set(W.PROFILES["tiny"].rows)
    for r in runs.values():
        o = r["openloop"]
        # Round-robin overloads the 1-worker server at any rate above 27% of
        # the total (its queue's overflow is answered 503): a looser bound.
        bound = 0.25 if r["row"] == "rr" else 0.1
        # A string, so that pytest prints it whole: the breakdown of the
        # errors, the weights given and the controller's last decisions.
        why = json.dumps({"row": r["row"], "openloop": o, "balancer_weights": r.get("balancer_weights"),
                          "learn_s": r.get("learn_s"), "cpu_busy": r.get("cpu_busy"),
                          "decisions": (r.get("status") or {}).get("decisions", [])[-8:]})
        assert o["ok"] > 0 and o["errors"] <= bound * o["sent"], why
        assert o["mean_ms"] > 0 and o["p99_ms"] >= o["mean_ms"] * 0.5, (r["row"], o)
    learned = {}
    for key in ("weights", "weights+scores"):
        st = runs[key]["status"]
        assert st["phase"] == "steady", st
        w = learned[key] = W.backend_weights(st)
        # More for the 8-worker server than for the 1-worker one, in each
        # learning.
        assert w[3] > w[0], (key, w)
        assert abs(sum(w) - 1) < 0.01, w
        assert all(b["curve"] and len(b["curve"]) == 3 for b in st["backends"]), st
    # More for the 4-worker server than for the 1-worker one, over the two
    # learnings. In one learning of a few seconds a single slow round on
    # this 2-core machine can cut the 4-worker server's search short: CI
    # once saw [0.181, 0.328, 0.164, 0.328]. tests/weights.rs asserts the
    # full order of the learned capacities and weights on 1/2/4 workers.
    both = [a + b for a, b in zip(*learned.values())]
    assert both[2] > both[0], learned
    # The solver's program ran (two steps), not its fallback.
    assert data["ilp"] and data["ilp"][0]["solve_ms"] > 0 and data["ilp"][0]["steps"] == 2, data["ilp"]
    for png in ("curves.png", "latency.png"):
        assert (out / png).stat().st_size > 5000
    assert "| rate | row | sent |" in cp.stdout and "| row | rate | weights s1/s2/s3/s4" in cp.stdout

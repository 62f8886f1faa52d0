"""Turns the raw output of one benchmark run into the paper's Table 3, the
comparisons the paper makes, and CSV.

Input per configuration: the per-request log the locustfile writes
(`requests.csv`: start time, response time, outcome, size)
and the measurement window (`window.json`). Percentiles are computed over
the complete set of requests with no binning, as in the paper; Locust's own
CSV rounds response times into buckets, so it is kept only as a cross-check.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .report import fmt_ratio, fmt_time, table
from .stats import percentile, ratio

PERCENTILES = (50, 90, 95, 98, 99, 99.9)

# The paper's Table 3 (Raspberry Pi 4 balancer, 2 servers, 10 min runs):
# printed beside ours for the shape of the result, never to compare
# absolute numbers across such different testbeds. The key is our
# configuration that does what the paper's row does: its request busyness
# queries the servers before forwarding, which is dsr-query (dsr-polling,
# asynchronous, has no row of the paper's).
PAPER_TABLE3 = [
    ("Pass Through", "passthrough", "3.8 s", "5184 ms", 23.24, "8.6 s", "12 s", "18 s", "27 s"),
    ("DSR Round-Robin", "dsr-rr", "1.9 s", "2693 ms", 40.55, "4.4 s", "5.9 s", "8.9 s", "13 s"),
    ("DSR Request Busyness", "dsr-query", "1.7 s", "1945 ms", 44.33, "2.8 s", "3.3 s", "4.1 s", "5 s"),
    ("Dynamic DSR", "dsr-dynamic", "1.2 s", "1611 ms", 65.45, "2.7 s", "3.4 s", "4.5 s", "5.5 s"),
]


@dataclass(frozen=True)
class Request:
    start: float  # epoch seconds
    rt_ms: float
    ok: bool
    length: int

    @property
    def end(self) -> float:
        return self.start + self.rt_ms / 1000.0


@dataclass(frozen=True)
class Summary:
    requests: int
    failures: int
    median_ms: float
    avg_ms: float
    rps: float
    pct_ms: dict  # percentile (float) -> ms
    max_ms: float


@dataclass
class Overhead:
    """What it cost to keep the balancer informed about server load, and how
    much traffic the balancer's (shaped) link carried."""

    mechanism: str
    extra_packets: int = 0
    extra_bytes: int = 0
    probes: int = 0  # option 124 sent (in-band)
    scores: int = 0  # option 125 received (in-band)
    lb_in_bytes: int = 0  # into the balancer, through the shaped port
    lb_in_packets: int = 0
    lb_in_drops: int = 0
    polls: int = 0  # poll or query requests sent, each a packet to a server
    queries: int = 0  # dsr-query: SYNs held for a query round
    query_timeouts: int = 0
    query_mean_us: int = 0


@dataclass
class RunResult:
    key: str
    label: str
    window: tuple  # (t0, t1) epoch seconds
    requests: list
    overhead: Overhead
    locust: dict = field(default_factory=dict)  # Locust's "Aggregated" row
    shares: dict = field(default_factory=dict)  # backend -> requests it served (its own counter)
    # backend "addr:port" -> the balancer's view (inband modes only), from `inband status --json`
    at_balancer: dict = field(default_factory=dict)
    # A result read back from a results.json: its requests are not kept
    # there, their summary is.
    summarized: Summary | None = None

    def summary(self) -> Summary:
        return self.summarized or summarize(self.requests, *self.window)

    def to_json(self) -> dict:
        s = asdict(self.summary())
        s["pct_ms"] = {str(p): v for p, v in s["pct_ms"].items()}
        return {"key": self.key, "label": self.label, "window": list(self.window), "summary": s,
                "overhead": asdict(self.overhead), "locust": self.locust, "shares": self.shares, "at_balancer": self.at_balancer}

    @classmethod
    def from_json(cls, d: dict) -> "RunResult":
        s = dict(d["summary"])
        s["pct_ms"] = {float(p): v for p, v in s["pct_ms"].items()}
        return cls(key=d["key"], label=d["label"], window=tuple(d["window"]), requests=[], overhead=Overhead(**d["overhead"]),
                   locust=d["locust"], shares=d["shares"], at_balancer=d["at_balancer"], summarized=Summary(**s))


def read_requests(path: Path) -> list[Request]:
    out = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0] == "start":
                continue
            start, rt, ok, length = row
            out.append(Request(float(start), float(rt), ok == "1", int(length)))
    return out


def read_window(path: Path) -> tuple:
    w = json.loads(Path(path).read_text())
    return float(w["t0"]), float(w["t1"])


def in_window(requests: list[Request], t0: float, t1: float) -> list[Request]:
    """Requests that completed inside the measurement window; Locust drops
    the ones still in flight when the run time ends, and so do we."""
    return [r for r in requests if r.start >= t0 and r.end <= t1]



def _nan_if_none(v):
    # The summaries are arithmetic (ratios of them): NaN, not None, marks
    # an empty window.
    return math.nan if v is None else v


def summarize(requests: list[Request], t0: float, t1: float) -> Summary:
    if t1 <= t0:
        raise ValueError(f"empty measurement window {t0}..{t1}")
    rs = in_window(requests, t0, t1)
    # Like Locust (and so the paper), failed requests count in the latency
    # statistics with the time they took to fail.
    lat = sorted(r.rt_ms for r in rs)
    n = len(lat)
    return Summary(
        requests=n,
        failures=sum(1 for r in rs if not r.ok),
        median_ms=_nan_if_none(percentile(lat, 50)),
        avg_ms=(sum(lat) / n) if n else math.nan,
        rps=n / (t1 - t0),
        pct_ms={p: _nan_if_none(percentile(lat, p)) for p in PERCENTILES},
        max_ms=lat[-1] if lat else math.nan,
    )


def rps_series(requests: list[Request], t0: float, t1: float, bin_s: float = 1.0) -> list[tuple]:
    """(seconds since start, completed requests per second) per bin."""
    bins = max(1, math.ceil((t1 - t0) / bin_s))
    counts = [0] * bins
    for r in in_window(requests, t0, t1):
        i = min(bins - 1, int((r.end - t0) / bin_s))
        counts[i] += 1
    return [((i + 1) * bin_s, c / bin_s) for i, c in enumerate(counts)]


def ccdf(latencies_ms: list[float]) -> tuple[list[float], list[float]]:
    """Points (t, fraction of requests slower than t) at every distinct
    latency, the last one excluded (its fraction is 0, invisible on a log
    axis)."""
    xs = sorted(latencies_ms)
    n = len(xs)
    out_x, out_y = [], []
    for i, x in enumerate(xs):
        if i + 1 < n and xs[i + 1] == x:
            continue
        slower = n - (i + 1)
        if slower == 0:
            break
        out_x.append(x)
        out_y.append(slower / n)
    return out_x, out_y


def read_locust_aggregated(stats_csv: Path) -> dict:
    """The "Aggregated" row of Locust's `<prefix>_stats.csv`."""
    with open(stats_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("Name") == "Aggregated":
                return row
    return {}


def read_locust_history(history_csv: Path) -> list[dict]:
    """Aggregated rows of `<prefix>_stats_history.csv` (one per second)."""
    with open(history_csv, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("Name") == "Aggregated"]




def table3(results: list[RunResult]) -> str:
    headers = ["Configuration", "Median", "Average", "RPS", "90%", "95%", "98%", "99%", "Requests", "Failures"]
    rows = []
    for r in results:
        s = r.summary()
        rows.append(
            [
                r.label,
                fmt_time(s.median_ms),
                "–" if math.isnan(s.avg_ms) else f"{s.avg_ms:.0f} ms",
                f"{s.rps:.2f}",
                fmt_time(s.pct_ms[90]),
                fmt_time(s.pct_ms[95]),
                fmt_time(s.pct_ms[98]),
                fmt_time(s.pct_ms[99]),
                str(s.requests),
                str(s.failures),
            ]
        )
    return table(headers, rows)


def ratios(results: list[RunResult], refs=("dsr-query", "dsr-polling", "passthrough")) -> str:
    """RPS and average/median response-time gains against the reference
    configurations, the comparisons the paper states (+47.6% RPS over
    polling, 2.8× RPS and 3.2× average over pass-through)."""
    by_key = {r.key: r.summary() for r in results}
    present = [k for k in refs if k in by_key]
    headers = ["Configuration"]
    for k in present:
        headers += [f"RPS ÷ {k}", f"{k} avg ÷ avg", f"{k} median ÷ median", f"{k} p99 ÷ p99"]
    rows = []
    for r in results:
        s = by_key[r.key]
        row = [r.label]
        for k in present:
            ref = by_key[k]
            row += [
                fmt_ratio(ratio(s.rps, ref.rps)),
                fmt_ratio(ratio(ref.avg_ms, s.avg_ms)),
                fmt_ratio(ratio(ref.median_ms, s.median_ms)),
                fmt_ratio(ratio(ref.pct_ms[99], s.pct_ms[99])),
            ]
        rows.append(row)
    return table(headers, rows)


def overhead_table(results: list[RunResult]) -> str:
    headers = [
        "Configuration",
        "Load information",
        "Extra packets",
        "Extra bytes",
        "Probes (opt 124)",
        "Scores (opt 125)",
        "Bytes into balancer",
        "Packets into balancer",
        "Dropped at balancer link",
        "Bytes into balancer per request",
    ]
    rows = []
    for r in results:
        o = r.overhead
        n = r.summary().requests
        rows.append(
            [
                r.label,
                o.mechanism,
                str(o.extra_packets),
                str(o.extra_bytes),
                str(o.probes),
                str(o.scores),
                str(o.lb_in_bytes),
                str(o.lb_in_packets),
                str(o.lb_in_drops),
                f"{o.lb_in_bytes / n:.0f}" if n else "–",
            ]
        )
    return table(headers, rows)


def shares_table(results: list[RunResult], backend_labels: dict) -> str:
    """Share of the requests each backend served, by the servers' own
    counters (they also count requests still in service when Locust
    stopped, so the sum can exceed the table's request count slightly)."""
    backends = list(backend_labels)
    headers = ["Configuration"] + [backend_labels[b] for b in backends]
    rows = []
    for r in results:
        total = sum(r.shares.values())
        row = [r.label]
        for b in backends:
            c = r.shares.get(b, 0)
            row.append(f"{100.0 * c / total:.1f}% ({c})" if total else "–")
        rows.append(row)
    return table(headers, rows)


def backends_at_balancer(status) -> dict:
    """Per-backend counters of the balancer's first VIP from `inband status --json`."""
    if not status:
        return {}
    out = {}
    for b in status[0]["vips"][0]["backends"]:
        st = b["stats"]
        out[b["backend"]] = {
            "connections": st["new_conns"],
            "bytes_back_through_lb": st["return_bytes"],
            "probes": st["probes_sent"],
            "scores": st["scores_received"],
            "last_score": b["score"],
        }
    return out


def balancer_view_table(results: list[RunResult]) -> str:
    """What the balancer saw per backend: connections it placed, response
    bytes that came back through it (all of them in pass-through, only score
    carriers in DSR), score requests sent and scores received."""
    headers = ["Configuration", "Backend", "Connections", "Bytes back through balancer", "Probes (124)", "Scores (125)", "Last score"]
    rows = []
    for r in results:
        for backend, v in sorted(r.at_balancer.items()):
            last = v["last_score"]
            rows.append(
                [
                    r.label,
                    backend,
                    str(v["connections"]),
                    str(v["bytes_back_through_lb"]),
                    str(v["probes"]),
                    str(v["scores"]),
                    "–" if last is None else str(last),
                ]
            )
    return table(headers, rows)


def _paper_ms(cell: str) -> float:
    """The paper's "3.8 s" / "5184 ms" in ms."""
    value, unit = cell.split()
    return float(value) * (1000.0 if unit == "s" else 1.0)


def paper_ratios(results: list[RunResult], base="dsr-query", floor="passthrough") -> str:
    """Our ratios beside the paper's, for each of our rows that has a row
    of the paper's: against its request-busyness baseline (`base`) and
    against pass-through (`floor`). A ratio whose reference did not run
    here is "–"."""
    ours = {r.key: r.summary() for r in results}
    paper = {k: (name, _paper_ms(avg), rps, _paper_ms(p99)) for name, k, _med, avg, rps, _p90, _p95, _p98, p99 in PAPER_TABLE3}
    headers = ["Configuration", "paper's row"]
    for ref in (base, floor):
        headers += [f"RPS ÷ {ref}", "paper", f"{ref} avg ÷ avg", "paper", f"{ref} p99 ÷ p99", "paper"]
    rows = []
    for r in results:
        if r.key not in paper:
            continue
        s, (name, avg, rps, p99) = ours[r.key], paper[r.key]
        row = [r.label, name]
        for ref in (base, floor):
            o, (_n, ref_avg, ref_rps, ref_p99) = ours.get(ref), paper[ref]
            row += [
                fmt_ratio(ratio(s.rps, o.rps) if o else math.nan),
                fmt_ratio(rps / ref_rps),
                fmt_ratio(ratio(o.avg_ms, s.avg_ms) if o else math.nan),
                fmt_ratio(ref_avg / avg),
                fmt_ratio(ratio(o.pct_ms[99], s.pct_ms[99]) if o else math.nan),
                fmt_ratio(ref_p99 / p99),
            ]
        rows.append(row)
    return table(headers, rows)


def query_table(results: list[RunResult]) -> str:
    """What holding SYNs cost dsr-query: how many were held, how long on
    average, and how many rounds ended without every answer."""
    headers = ["Configuration", "SYNs held", "mean hold", "rounds timed out", "query packets (requests + replies)"]
    rows = [
        [r.label, str(r.overhead.queries), f"{r.overhead.query_mean_us / 1000:.2f} ms", str(r.overhead.query_timeouts), str(r.overhead.extra_packets)]
        for r in results
        if r.overhead.queries
    ]
    return table(headers, rows)


def paper_table() -> str:
    headers = ["Configuration (paper)", "Median", "Average", "RPS", "90%", "95%", "98%", "99%"]
    rows = [[name, med, avg, f"{rps:.2f}", p90, p95, p98, p99] for name, _k, med, avg, rps, p90, p95, p98, p99 in PAPER_TABLE3]
    return table(headers, rows)


CSV_COLUMNS = [
    "key",
    "label",
    "requests",
    "failures",
    "rps",
    "median_ms",
    "avg_ms",
    "p90_ms",
    "p95_ms",
    "p98_ms",
    "p99_ms",
    "p99.9_ms",
    "max_ms",
    "window_s",
    "locust_requests",
    "locust_failures",
    "locust_rps",
    "locust_median_ms",
    "locust_avg_ms",
    "mechanism",
    "extra_packets",
    "extra_bytes",
    "probes",
    "scores",
    "lb_in_bytes",
    "lb_in_packets",
    "lb_in_drops",
    "shares",
]


def csv_rows(results: list[RunResult]) -> list[dict]:
    rows = []
    for r in results:
        s = r.summary()
        o = r.overhead
        rows.append(
            {
                "key": r.key,
                "label": r.label,
                "requests": s.requests,
                "failures": s.failures,
                "rps": f"{s.rps:.3f}",
                "median_ms": f"{s.median_ms:.1f}",
                "avg_ms": f"{s.avg_ms:.1f}",
                "p90_ms": f"{s.pct_ms[90]:.1f}",
                "p95_ms": f"{s.pct_ms[95]:.1f}",
                "p98_ms": f"{s.pct_ms[98]:.1f}",
                "p99_ms": f"{s.pct_ms[99]:.1f}",
                "p99.9_ms": f"{s.pct_ms[99.9]:.1f}",
                "max_ms": f"{s.max_ms:.1f}",
                "window_s": f"{r.window[1] - r.window[0]:.3f}",
                "locust_requests": r.locust.get("Request Count", ""),
                "locust_failures": r.locust.get("Failure Count", ""),
                "locust_rps": r.locust.get("Requests/s", ""),
                "locust_median_ms": r.locust.get("Median Response Time", ""),
                "locust_avg_ms": r.locust.get("Average Response Time", ""),
                "mechanism": o.mechanism,
                "extra_packets": o.extra_packets,
                "extra_bytes": o.extra_bytes,
                "probes": o.probes,
                "scores": o.scores,
                "lb_in_bytes": o.lb_in_bytes,
                "lb_in_packets": o.lb_in_packets,
                "lb_in_drops": o.lb_in_drops,
                "shares": ";".join(f"{k}={v}" for k, v in r.shares.items()),
            }
        )
    return rows


def write_csv(results: list[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(csv_rows(results))


def write_timeseries_csv(results: list[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "t_s", "rps"])
        for r in results:
            for t, v in rps_series(r.requests, *r.window):
                w.writerow([r.key, f"{t:.0f}", f"{v:.3f}"])


def markdown(results: list[RunResult], backend_labels: dict, preamble: str = "") -> str:
    parts = []
    if preamble:
        parts.append(preamble.rstrip() + "\n")
    parts += [
        "## Table 3, this run\n",
        table3(results) + "\n",
        "## Ratios (the paper's comparisons)\n",
        "RPS ÷ X > 1: more throughput than X; X avg ÷ avg > 1: faster on average than X.\n",
        ratios(results) + "\n",
        "## Ratios beside the paper's\n",
        "The paper's request busyness queries the servers before forwarding: our dsr-query. "
        "Paper: its Table 3 (Raspberry Pi 4 balancer, two identical servers, 10 min); the shape, not the numbers, compares.\n",
        paper_ratios(results) + "\n",
        "## Cost of load information and traffic through the balancer\n",
        overhead_table(results) + "\n",
        *(["## Held SYNs (dsr-query)\n", query_table(results) + "\n"] if any(r.overhead.queries for r in results) else []),
        "## Share of requests per backend\n",
        shares_table(results, backend_labels) + "\n",
        "## Per backend, as the balancer saw it (inband modes)\n",
        balancer_view_table(results) + "\n",
        "## The paper's Table 3 (their testbed; for the shape only)\n",
        paper_table() + "\n",
    ]
    return "\n".join(parts)

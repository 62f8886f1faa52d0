"""The paper's Fig. 3 (requests per second over time) and Fig. 4 (CCDF of
latency), one line per configuration, from the per-request logs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a server; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from .locust import RunResult, ccdf, in_window, rps_series  # noqa: E402

# The paper's colours for its four configurations; peers get their own.
STYLE = {
    "passthrough": dict(color="tab:blue"),
    "dsr-rr": dict(color="tab:green"),
    "dsr-polling": dict(color="tab:red"),
    "dsr-polling-100ms": dict(color="tab:pink"),
    "dsr-dynamic": dict(color="black", linewidth=2),
    "haproxy-roundrobin": dict(color="tab:orange", linestyle="--"),
    "haproxy-leastconn": dict(color="tab:purple", linestyle="--"),
    "nftables-numgen": dict(color="tab:brown", linestyle=":"),
}


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _legend_below(ax) -> None:
    # Below the axes: inside, seven labels hide the lines they name.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize="small", frameon=False)


def fig3_rps(results: list[RunResult], path: Path, smooth_s: int = 5, title_suffix: str = "") -> None:
    fig, ax = plt.subplots(figsize=(9, 6.5))
    for r in results:
        series = rps_series(r.requests, *r.window, bin_s=1.0)
        ts = [t for t, _ in series]
        ys = moving_average([v for _, v in series], smooth_s)
        ax.plot(ts, ys, label=r.label, **STYLE.get(r.key, {}))
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"completed requests/s ({smooth_s} s moving average)")
    ax.set_title("Request rate over the run (paper Fig. 3)" + title_suffix)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    _legend_below(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fig4_ccdf(results: list[RunResult], path: Path, title_suffix: str = "") -> None:
    fig, ax = plt.subplots(figsize=(9, 6.5))
    for r in results:
        lat = [q.rt_ms / 1000.0 for q in in_window(r.requests, *r.window)]
        xs, ys = ccdf(lat)
        if xs:
            ax.step(xs, ys, where="post", label=r.label, **STYLE.get(r.key, {}))
    ax.set_yscale("log")
    ax.set_xlabel("response time t (s)")
    ax.set_ylabel("fraction of requests slower than t")
    ax.set_title("CCDF of response time (paper Fig. 4)" + title_suffix)
    ax.grid(True, which="both", alpha=0.3)
    _legend_below(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""The summaries the load generators print, parsed one way: wrk through
the Lua script each driver gives it (a line `TAG key=value ...` of
integers), and the open-loop generator's JSON line."""

from __future__ import annotations

import json


# A wrk script that prints the summary `parse_wrk` reads (requests, errors,
# p50/p99, duration), for drivers whose requests are plain GETs of one URL.
WRK_SUMMARY_LUA = """
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH requests=%d errors=%d status_errors=%d p50_us=%d p99_us=%d duration_us=%d\\n",
    summary.requests, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), summary.duration))
end
"""


def parse_wrk(text: str, tag: str = "BENCH") -> dict:
    """The `TAG k=v ...` line a driver's wrk script prints at its end."""
    for line in text.splitlines():
        if line.startswith(tag + " "):
            return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    raise ValueError(f"no {tag} summary in wrk output: {text[-500:]}")


def parse_openloop(text: str) -> dict:
    """The last JSON object with sent/ok/errors in a log (stderr may be mixed in)."""
    dec = json.JSONDecoder()
    found = None
    i = text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and {"sent", "ok", "errors"} <= obj.keys():
            found = obj
        i = text.find("{", end)
    if found is None:
        raise ValueError("no open-loop result (a JSON object with sent, ok, errors) in the output")
    return found

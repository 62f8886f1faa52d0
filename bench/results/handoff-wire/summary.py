"""Medians and p10/p90 of each step of timeline.csv, from the request;
with `--client CLIENT_ERR OFFSET_S`, also the client's own first byte
(`inband tcpe get --timing`, CLOCK_MONOTONIC + OFFSET_S = the capture's
clock), matched to the connections in order.

    python summary.py timeline.csv [--client client.err OFFSET_S]
"""
import csv
import re
import sys


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * p))]


rows = list(csv.DictReader(open(sys.argv[1])))
series = {
    "request -> notification": [float(r["notif_ms"]) - float(r["req_ms"]) for r in rows],
    "notification -> join SYN": [float(r["jsyn_ms"]) - float(r["notif_ms"]) for r in rows],
    "join SYN -> JOIN": [float(r["join_ms"]) - float(r["jsyn_ms"]) for r in rows],
    "JOIN -> JOIN-OK": [float(r["ok_ms"]) - float(r["join_ms"]) for r in rows],
    "JOIN-OK -> first byte": [float(r["data_ms"]) - float(r["ok_ms"]) for r in rows],
    "request -> first byte": [float(r["data_ms"]) - float(r["req_ms"]) for r in rows],
    "request -> balancer's FIN": [float(r["fin_ms"]) - float(r["req_ms"]) for r in rows],
}
if "--client" in sys.argv:
    i = sys.argv.index("--client")
    offset = float(sys.argv[i + 2])
    client = [dict(re.findall(r"(\w+_ns)=(\d+)", line)) for line in open(sys.argv[i + 1]) if "first_byte_ns=" in line]
    app = []
    for r, c in zip(rows, client):
        sent = int(c["sent_ns"]) / 1e9 + offset
        syn = float(r["syn_epoch_s"])
        wire = max(float(r["data_ms"]), float(r["fin_ms"])) / 1e3 + syn
        series["request (client's clock) -> first byte read by the client"] = series.get("request (client's clock) -> first byte read by the client", []) + [(int(c["first_byte_ns"]) / 1e9 + offset - sent) * 1e3]
        app.append((int(c["first_byte_ns"]) / 1e9 + offset - wire) * 1e3)
    series["first byte and FIN on the wire -> read by the client"] = app
print(f"{len(rows)} handed-off connections")
print("| step | p10 ms | median ms | p90 ms |\n|---|---|---|---|")
for k, v in series.items():
    print(f"| {k} | {pct(v, 0.1):.3f} | {pct(v, 0.5):.3f} | {pct(v, 0.9):.3f} |")

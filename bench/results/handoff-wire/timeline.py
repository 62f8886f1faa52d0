"""One row per handed-off connection from `tcpdump -r CAPTURE -n -tt 'tcp
port 80 or tcp port 7001'` taken in the client's namespace (c1) during
bench.handoff: when, after the client's SYN to the VIP, the request left,
the notification (an ACK with option exp-058a) came, the join's SYN and
JOIN (20 bytes) left, JOIN-OK (20 bytes) came, the first response byte came
on the joined subflow, and the balancer's FIN came.

    python timeline.py TCPDUMP_TEXT > timeline.csv   # then summary.py
"""
import csv
import re
import sys

STEPS = ("req", "notif", "jsyn", "join", "ok", "data", "fin")


def connections(lines):
    conns, cur = [], None
    for line in lines:
        f = line.split()
        t, d, src, dst = float(f[0]), f[2], f[4], f[6].rstrip(":")
        n = int(re.search(r"length (\d+)", line).group(1))
        if d == "Out" and dst.endswith(".80") and "Flags [S]," in line:
            cur = {"syn": t}
            conns.append(cur)
            continue
        if cur is None:
            continue
        seen = [("req", d == "Out" and dst.endswith(".80") and n > 0),
                ("notif", d == "In" and src.endswith(".80") and "exp-058a" in line),
                ("jsyn", d == "Out" and dst.endswith(".7001") and "Flags [S]," in line),
                ("join", d == "Out" and dst.endswith(".7001") and n == 20),
                ("ok", d == "In" and src.endswith(".7001") and n == 20),
                ("data", d == "In" and src.endswith(".7001") and n > 20),
                ("fin", d == "In" and src.endswith(".80") and "F" in f[8])]
        for k, hit in seen:
            if hit and k not in cur:
                cur[k] = t
    return conns


if __name__ == "__main__":
    w = csv.writer(sys.stdout)
    w.writerow(["syn_epoch_s", *[f"{k}_ms" for k in STEPS]])
    for c in connections(open(sys.argv[1])):
        if all(k in c for k in STEPS):
            w.writerow([f"{c['syn']:.6f}", *[f"{(c[k] - c['syn']) * 1e3:.3f}" for k in STEPS]])

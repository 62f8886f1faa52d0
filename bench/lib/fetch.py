"""One HTTP/1.1 GET that reports the longest pause in its body:

    python -m bench.lib.fetch URL MAX_S

prints `status body_bytes local_port longest_gap_ms first_byte last_byte`
on one line (the two times on CLOCK_MONOTONIC, which every process of
the host shares, so a driver can set them against its own events) and
exits 0 when the whole body (Content-Length) arrived within MAX_S
seconds, 1 otherwise. The gap is the longest time between two reads that
returned bytes, from the first byte of the response on: a connection
that moved to another balancer instance shows the time it waited. curl
reports no such figure, and its trace output costs more than the
transfer, so this stays a few lines of stdlib; only the bench.scaleout
crash rows use it.
"""

from __future__ import annotations

import socket
import sys
import time
from urllib.parse import urlsplit


def fetch(url: str, max_s: float) -> tuple[int, int, int, float, float, float, bool]:
    u = urlsplit(url)
    deadline = time.monotonic() + max_s
    status, body, port, gap, complete = 0, 0, 0, 0.0, False
    first = last = 0.0
    try:
        with socket.create_connection((u.hostname, u.port or 80), timeout=max_s) as s:
            port = s.getsockname()[1]
            s.sendall(f"GET {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc}\r\nConnection: close\r\n\r\n".encode())
            head, length = b"", None
            while time.monotonic() < deadline:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = s.recv(1 << 16)
                now = time.monotonic()
                if not chunk:
                    break
                if first:
                    gap = max(gap, now - last)
                else:
                    first = now
                last = now
                if length is None:
                    head += chunk
                    end = head.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    lines = head[:end].decode("latin-1").split("\r\n")
                    status = int(lines[0].split()[1])
                    length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                                   if k.strip().lower() == "content-length"), -1)
                    body = len(head) - end - 4
                else:
                    body += len(chunk)
                if length is not None and length >= 0 and body >= length:
                    complete = body == length
                    break
    except (OSError, ValueError, IndexError):
        pass
    return status, body, port, gap * 1000, first, last, complete


def main() -> int:
    status, body, port, gap_ms, first, last, complete = fetch(sys.argv[1], float(sys.argv[2]))
    print(f"{status} {body} {port} {gap_ms:.1f} {first:.4f} {last:.4f}", flush=True)
    return 0 if complete and status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())

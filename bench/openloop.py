"""An open-loop generator of new connections, run inside the client's
namespace by bench.health:

    python -m bench.openloop HOST PORT RATE SECONDS TIMEOUT_S OUT

Starts one HTTP/1.1 GET, on a connection of its own, every 1/RATE s for
SECONDS, whatever the earlier ones are doing (a closed loop would slow
down exactly when a backend fails, and hide the failures it should
count), each bounded by TIMEOUT_S from its start. Writes a JSON line per
request as it ends: [start, end (CLOCK_MONOTONIC s, the driver's clock
too), error or "", the response's Content-Length or null]. The servers
answer bodies of different lengths, so the length says which one served
the request. Returns once every request has ended (at most TIMEOUT_S
after the last start).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time


def classify(e: BaseException, connected: bool) -> str:
    """The failure as the client saw it."""
    if isinstance(e, (TimeoutError, socket.timeout)):
        return "read timeout" if connected else "connect timeout"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, ConnectionResetError):
        return "reset"
    if isinstance(e, ValueError):
        return str(e)
    return type(e).__name__


def get(host: str, port: int, timeout_s: float, progress: list) -> int:
    """One GET; the Content-Length of a complete 200 response, else raises
    (with "connected" in `progress` once the handshake is done)."""
    deadline = time.monotonic() + timeout_s
    s = socket.create_connection((host, port), timeout=timeout_s)
    progress.append("connected")
    try:
        s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            s.settimeout(left)
            chunk = s.recv(65536)
            if not chunk:
                raise ValueError("closed early" if buf else "closed")
            buf += chunk
            head, sep, body = buf.partition(b"\r\n\r\n")
            if not sep:
                continue
            lines = head.split(b"\r\n")
            status = lines[0].split()[1].decode() if len(lines[0].split()) > 1 else "?"
            if status != "200":
                raise ValueError(f"status {status}")
            length = next((int(h.split(b":", 1)[1]) for h in lines[1:] if h.lower().startswith(b"content-length:")), None)
            if length is None:
                raise ValueError("no length")
            if len(body) >= length:
                return length
    finally:
        s.close()


def main(argv: list[str]) -> int:
    host, port, rate, seconds, timeout_s, out = argv[0], int(argv[1]), float(argv[2]), float(argv[3]), float(argv[4]), argv[5]
    lock = threading.Lock()
    with open(out, "w") as f:

        def one(start: float) -> None:
            progress: list = []
            try:
                length = get(host, port, timeout_s, progress)
                err = ""
            except Exception as e:  # noqa: BLE001 - every failure is a sample
                err, length = classify(e, bool(progress)), None
            line = json.dumps([start, time.monotonic(), err, length])
            with lock:
                f.write(line + "\n")
                f.flush()

        threads = []
        t0 = time.monotonic()
        n = int(seconds * rate)
        for k in range(n):
            time.sleep(max(0.0, t0 + k / rate - time.monotonic()))
            t = threading.Thread(target=one, args=(time.monotonic(),), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(timeout_s + 5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

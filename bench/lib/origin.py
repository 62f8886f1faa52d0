"""The origin behind the proxies in bench/proxy.py: every path is an object
of a fixed size, cacheable for an hour, and the origin counts what reaches
it, so origin requests are counted the same way for every system.

    python -m bench.lib.origin --listen 127.0.0.1:18080 --object-bytes 10240

`GET /__stats` (not counted) answers `{"requests": N}`; `/pass/...` paths
are `no-store` (counted), for measuring pass-through.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATS_PATH = "/__stats"


def body_for(path: str, size: int) -> bytes:
    """Deterministic bytes per path, so a response served from a cache can be
    told apart from another path's."""
    seed = hashlib.sha256(path.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def make_handler(size: int, max_age: int):
    lock = threading.Lock()
    counts = {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the proxies pool their connections
        # Head and body go out in two writes: without TCP_NODELAY the body
        # waits for the peer's delayed ACK (40 ms a response).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == STATS_PATH:
                with lock:
                    payload = json.dumps(counts).encode()
                self._send(payload, "application/json", "no-store")
                return
            with lock:
                counts["requests"] += 1
            if self.path.startswith("/pass/"):
                # bench.proxy's misses: nothing may store it.
                self._send(body_for(self.path, size), "application/octet-stream", "no-store")
                return
            etag = '"' + hashlib.sha256(self.path.encode()).hexdigest()[:16] + '"'
            self._send(body_for(self.path, size), "application/octet-stream", f"public, max-age={max_age}", etag)

        def _send(self, payload: bytes, ctype: str, cache_control: str, etag: str | None = None) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", cache_control)
            if etag:
                self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_args) -> None:
            pass

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lib.origin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:18080")
    ap.add_argument("--object-bytes", type=int, default=10240)
    ap.add_argument("--max-age", type=int, default=3600)
    args = ap.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer((host, int(port)), make_handler(args.object_bytes, args.max_age))
    # SIGTERM from the driver: leave serve_forever, close the socket, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HTTP caching conformance of a shared cache, case by case, organised like
the public cache-tests suite (cache-tests.fyi): one case per requirement of
RFC 9111 (and RFC 9110/9112 where a proxy must act), each asserting how
many requests reached the origin and what the client got.

    python -m bench.conformance --systems inband,nginx,varnish [--http2] --out DIR

Every system (inband proxy with a memory cache, nginx `proxy_cache`,
Varnish with its built-in VCL, each as bench/peers.py configures it for
bench.proxy) runs in front of one scriptable origin on 127.0.0.1: a case
says what the origin answers on its own paths, sends requests through the
system, and checks origin request counts, status codes and headers.
Whether a response came from the cache is told by the origin's count, not
by a header, since the peers mark hits differently. With --http2 every
system runs every case a second time with its clients speaking HTTP/2
(h2c, by prior knowledge), a column of its own.

Prints a Markdown table (one row per case, one column per system) and
writes the record (results.json) and its table (results.md) into --results
(default bench/results/conformance). Exit code 0 when every
"must" case passes for inband; the peers' results are reported, not
judged. Every process is stopped and every temporary directory removed at
the end, on failures and Ctrl-C too. CI runs it against inband only, over
both protocols (bench/tests/test_conformance.py); docs/proxy.md has the
three-way table.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from .lib import peers, preflight
from .lib.results import REPO, Run, default_dir, provenance
from .lib.results import write as write_results
from .lib.procs import Fatal, Procs, stop_signals_interrupt, wait_until

HOST = "127.0.0.1"
TIMEOUT_S = 5  # every socket operation of a case
# After max-age=1: nginx keeps whole-second expiry times, so a response
# stored late in one second is fresh until the end of the next.
STALE_WAIT_S = 2.2

# --------------------------------------------------------------- the origin


@dataclass
class Reply:
    status: int = 200
    headers: list = field(default_factory=list)  # (name, value)
    body: bytes = b""


class Origin:
    """Answers each path from its script: a list of replies (the last one
    repeats) or a function of (request headers, how many came before).
    Records every request per path."""

    def __init__(self) -> None:
        self.scripts: dict[str, list | Callable] = {}
        self.seen: dict[str, list[dict]] = {}
        self.lock = threading.Lock()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                if n:
                    self.rfile.read(n)
                path = self.path.split("?")[0]
                headers = {k.lower(): v for k, v in self.headers.items()}
                with origin.lock:
                    done = origin.seen.setdefault(path, [])
                    done.append({"method": self.command, "headers": headers})
                    script = origin.scripts.get(path, [Reply(404, [("Cache-Control", "no-store")], b"no script\n")])
                reply = script(headers, len(done) - 1) if callable(script) else script[min(len(done) - 1, len(script) - 1)]
                self.send_response_only(reply.status)  # its Date is the script's, or the one added below
                names = {k.lower() for k, _ in reply.headers}
                if "date" not in names:
                    self.send_header("Date", formatdate(usegmt=True))
                for k, v in reply.headers:
                    self.send_header(k, v)
                bodiless = reply.status in (204, 304) or self.command == "HEAD"
                if not bodiless:
                    self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                if not bodiless:
                    self.wfile.write(reply.body)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _any  # noqa: N815 - http.server's naming

            def log_message(self, *_args) -> None:
                pass

        # An extension method (UPnP's), whose name is no identifier.
        setattr(Handler, "do_M-SEARCH", Handler._any)

        ThreadingHTTPServer.daemon_threads = True
        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def script(self, path: str, *replies: Reply | Callable) -> None:
        with self.lock:
            self.scripts[path] = replies[0] if len(replies) == 1 and callable(replies[0]) else list(replies)

    def count(self, path: str) -> int:
        with self.lock:
            return len(self.seen.get(path, []))

    def requests(self, path: str) -> list[dict]:
        with self.lock:
            return list(self.seen.get(path, []))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------- the client


@dataclass
class Resp:
    status: int
    headers: dict  # lower-case name -> list of values
    body: bytes

    def header(self, name: str) -> str | None:
        v = self.headers.get(name.lower())
        return ", ".join(v) if v else None


def request(port: int, method: str, path: str, headers: dict | None = None, host: bool = True, body: bytes | None = None) -> Resp:
    """One request on its own connection; `host=False` sends none (an
    HTTP/1.1 request without Host, which http.client would otherwise add)."""
    c = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host:
            c.putheader("Host", "conformance.test")
        for k, v in (headers or {}).items():
            c.putheader(k, v)
        if body is not None:
            c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        data = r.read()
        out: dict[str, list[str]] = {}
        for k, v in r.getheaders():
            out.setdefault(k.lower(), []).append(v)
        return Resp(r.status, out, data)
    finally:
        c.close()


def request_h2(port: int, method: str, path: str, headers: dict | None = None, host: bool = True, body: bytes | None = None) -> Resp:
    """As `request`, over HTTP/2 with prior knowledge (h2c): the host is
    `:authority`, and `host=False` sends neither it nor Host."""
    sock = socket.create_connection((HOST, port), timeout=TIMEOUT_S)
    try:
        # Unchecked: host-missing-400 sends a request h2 would refuse to.
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8", validate_outbound_headers=False))
        conn.initiate_connection()
        fields = [(":method", method), (":scheme", "http"), (":path", path)]
        if host:
            fields.append((":authority", "conformance.test"))
        fields += [(k.lower(), v) for k, v in (headers or {}).items()]
        if body is not None:
            fields.append(("content-length", str(len(body))))
        conn.send_headers(1, fields, end_stream=body is None)
        if body is not None:
            conn.send_data(1, body, end_stream=True)
        status, out, data = 0, {}, bytearray()
        ended = False
        while not ended:
            sock.sendall(conn.data_to_send())
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the response ended")
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    for k, v in ev.headers:
                        if k == ":status":
                            status = int(v)
                        else:
                            out.setdefault(k, []).append(v)
                elif isinstance(ev, h2.events.DataReceived):
                    data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    ended = True
                elif isinstance(ev, h2.events.StreamReset):
                    raise ConnectionError(f"stream reset: {ev.error_code!r}")
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    raise ConnectionError(f"GOAWAY: {ev.error_code!r}")
        return Resp(status, out, bytes(data))
    finally:
        sock.close()


# --------------------------------------------------------------- the cases


class Failed(Exception):
    pass


def check(ok: bool, why: str) -> None:
    if not ok:
        raise Failed(why)


class Ctx:
    """One case on one system: its own paths under /c/<case>/ (under
    /c2/ over HTTP/2, so the two runs share no entry)."""

    def __init__(self, origin: Origin, port: int, case: str, http2: bool = False) -> None:
        self.origin, self.port, self.base = origin, port, f"/c2/{case}" if http2 else f"/c/{case}"
        self.send = request_h2 if http2 else request

    def path(self, name: str = "r") -> str:
        return f"{self.base}/{name}"

    def script(self, *replies, name: str = "r") -> None:
        self.origin.script(self.path(name), *replies)

    def get(self, name: str = "r", headers: dict | None = None, method: str = "GET", host: bool = True, body: bytes | None = None) -> Resp:
        return self.send(self.port, method, self.path(name), headers, host, body)

    def hits(self, name: str = "r") -> int:
        return self.origin.count(self.path(name))

    def seen(self, name: str = "r") -> list[dict]:
        return self.origin.requests(self.path(name))


def http_date(offset_s: float) -> str:
    return formatdate(time.time() + offset_s, usegmt=True)


def ok(cc: str | None = None, body: bytes = b"", extra: list | None = None, status: int = 200) -> Reply:
    headers = [("Content-Type", "text/plain")] + ([("Cache-Control", cc)] if cc else []) + (extra or [])
    return Reply(status, headers, body)


def numbered(cc: str | None, extra: list | None = None, status: int = 200) -> Callable:
    """A reply whose body says how many requests came before it, so a
    cached body is told apart from a fresh one."""
    return lambda _h, n: ok(cc, f"response {n}".encode(), extra, status)


def twice_hits(c: Ctx, reply, want_hits: int, headers2: dict | None = None) -> tuple[Resp, Resp]:
    c.script(reply)
    a = c.get()
    b = c.get(headers=headers2)
    check(c.hits() == want_hits, f"origin saw {c.hits()} requests, expected {want_hits}")
    return a, b


def case_stored(cc, **kw):
    def run(c: Ctx) -> None:
        a, b = twice_hits(c, numbered(cc, **kw), 1)
        check(a.body == b.body, "second response has another body")

    return run


def case_not_stored(cc, **kw):
    def run(c: Ctx) -> None:
        a, b = twice_hits(c, numbered(cc, **kw), 2)
        check(a.body != b.body, "second response served the first one's body")

    return run


def stale_after(cc: str):
    def run(c: Ctx) -> None:
        c.script(numbered(cc))
        c.get()
        time.sleep(STALE_WAIT_S)
        c.get()
        check(c.hits() == 2, f"origin saw {c.hits()} requests after the entry went stale, expected 2")

    return run


def expires(offset_s: float, want_hits: int):
    def run(c: Ctx) -> None:
        twice_hits(c, lambda _h, n: ok(None, f"response {n}".encode(), [("Expires", http_date(offset_s))]), want_hits)

    return run


def heuristic(c: Ctx) -> None:
    twice_hits(c, numbered(None, [("Last-Modified", http_date(-10 * 86400))]), 1)


def age_on_hit(c: Ctx) -> None:
    c.script(ok("max-age=600", b"aged", [("Age", "30")]))
    c.get()
    b = c.get()
    check(c.hits() == 1, f"origin saw {c.hits()} requests, expected 1")
    age = b.header("age")
    check(age is not None and age.isdigit() and int(age) >= 30, f"Age on the hit: {age!r}, expected >= 30")


def request_directive(directive: str):
    def run(c: Ctx) -> None:
        twice_hits(c, numbered("max-age=600"), 2, {"Cache-Control": directive})

    return run


def only_if_cached_miss(c: Ctx) -> None:
    c.script(numbered("max-age=600"))
    r = c.get(headers={"Cache-Control": "only-if-cached"})
    check(r.status == 504, f"status {r.status}, expected 504")
    check(c.hits() == 0, f"origin saw {c.hits()} requests, expected 0")


def only_if_cached_hit(c: Ctx) -> None:
    c.script(numbered("max-age=600"))
    a = c.get()
    r = c.get(headers={"Cache-Control": "only-if-cached"})
    check(r.status == 200 and r.body == a.body, f"status {r.status}, expected the stored 200")
    check(c.hits() == 1, f"origin saw {c.hits()} requests, expected 1")


def request_no_store(c: Ctx) -> None:
    c.script(numbered("max-age=600"))
    c.get(headers={"Cache-Control": "no-store"})
    c.get()
    check(c.hits() == 2, f"origin saw {c.hits()} requests: a response to a no-store request was stored")


def vary_two(c: Ctx) -> None:
    # Accept-Language, not Accept-Encoding: Varnish rewrites the latter
    # itself (it compresses), which would test that instead.
    c.script(lambda h, n: ok("max-age=600", f"{h.get('accept-language', '-')} {n}".encode(), [("Vary", "Accept-Language")]))
    got = {lang: c.get(headers={"Accept-Language": lang}).body for lang in ("en", "de")}
    again = {lang: c.get(headers={"Accept-Language": lang}).body for lang in ("en", "de")}
    check(all(again[lang].startswith(lang.encode()) for lang in again), f"a variant served to the wrong client: {again}")
    check(c.hits() == 2, f"origin saw {c.hits()} requests, expected 2 (one per variant)")
    check(again == got, "a variant was not served from the cache")


def vary_star(c: Ctx) -> None:
    twice_hits(c, numbered("max-age=600", [("Vary", "*")]), 2)


def validate_etag(c: Ctx) -> None:
    def reply(h, n):
        if h.get("if-none-match") == '"v1"':
            return Reply(304, [("ETag", '"v1"'), ("Cache-Control", "max-age=1")])
        return ok("max-age=1", b"stored body", [("ETag", '"v1"')])

    c.script(reply)
    c.get()
    time.sleep(STALE_WAIT_S)
    b = c.get()
    seen = c.seen()
    check(len(seen) == 2, f"origin saw {len(seen)} requests, expected 2")
    check(seen[1]["headers"].get("if-none-match") == '"v1"', f"revalidation without If-None-Match: {seen[1]['headers']}")
    check(b.status == 200 and b.body == b"stored body", f"client got {b.status} {b.body[:40]!r}, expected the stored 200")


def validate_last_modified(c: Ctx) -> None:
    lm = http_date(-3600)

    def reply(h, n):
        if h.get("if-modified-since"):
            return Reply(304, [("Last-Modified", lm), ("Cache-Control", "max-age=1")])
        return ok("max-age=1", b"stored body", [("Last-Modified", lm)])

    c.script(reply)
    c.get()
    time.sleep(STALE_WAIT_S)
    b = c.get()
    seen = c.seen()
    check(len(seen) == 2 and "if-modified-since" in seen[-1]["headers"], "revalidation without If-Modified-Since")
    check(b.status == 200 and b.body == b"stored body", f"client got {b.status}, expected the stored 200")


def client_conditional(c: Ctx) -> None:
    c.script(ok("max-age=600", b"body", [("ETag", '"e1"')]))
    c.get()
    r = c.get(headers={"If-None-Match": '"e1"'})
    check(r.status == 304, f"status {r.status}, expected 304")
    check(c.hits() == 1, f"origin saw {c.hits()} requests, expected 1")


def invalidated_by(method: str):
    def run(c: Ctx) -> None:
        c.script(lambda h, n: ok("max-age=600", f"response {n}".encode()) if n != 1 else ok("no-store", b"done"))
        a = c.get()
        r = c.get(method=method, body=b"x" if method in ("POST", "PUT") else None)
        check(r.status == 200, f"{method}: {r.status}")
        b = c.get()
        check(c.hits() == 3, f"origin saw {c.hits()} requests, expected 3: the {method} did not invalidate")
        check(a.body != b.body, "the stored response survived")

    return run


def fields_as_sent(c: Ctx) -> None:
    cc = "MAX-AGE=600, Public, x-Ext=\"A=B\""
    a, b = twice_hits(c, numbered(cc), 1)
    for r in (a, b):
        check(r.header("cache-control") == cc, f"Cache-Control reached the client as {r.header('cache-control')!r}, sent as {cc!r}")


def date_kept_on_hit(c: Ctx) -> None:
    c.script(numbered("max-age=600"))
    a = c.get()
    time.sleep(1.1)  # HTTP-dates have whole seconds
    b = c.get()
    check(c.hits() == 1, f"origin saw {c.hits()} requests, expected 1")
    check(b.header("date") == a.header("date"), f"the hit's Date is {b.header('date')!r}, the origin's {a.header('date')!r}")


def validate_304(without_validators: bool):
    """A stale entry with an ETag revalidated: the 304 either carries no
    validator (many origins send none) or brings a field the stored
    response lacked, which the client and later hits must get."""

    def run(c: Ctx) -> None:
        def reply(h, n):
            if h.get("if-none-match") == '"v1"':
                extra = [] if without_validators else [("ETag", '"v1"'), ("X-Added", "by the 304")]
                return Reply(304, [("Cache-Control", "max-age=600")] + extra)
            return ok("max-age=1", b"stored body", [("ETag", '"v1"')])

        c.script(reply)
        c.get()
        time.sleep(STALE_WAIT_S)
        b = c.get()
        hit = c.get()
        check(c.hits() == 2, f"origin saw {c.hits()} requests, expected 2 (the fill and one revalidation)")
        check(b.status == 200 and b.body == b"stored body" and hit.body == b"stored body", f"client got {b.status} {b.body[:40]!r}, expected the stored 200")
        if not without_validators:
            check(b.header("x-added") == "by the 304" and hit.header("x-added") == "by the 304",
                  f"X-Added of the 304: {b.header('x-added')!r} on the revalidated response, {hit.header('x-added')!r} on the next hit")

    return run


def status_stored(status: int):
    def run(c: Ctx) -> None:
        extra = [("Location", "/elsewhere")] if status in (301, 302) else None
        twice_hits(c, numbered("max-age=600", extra, status), 1)

    return run


def status_not_heuristic(status: int):
    def run(c: Ctx) -> None:
        extra = [("Last-Modified", http_date(-10 * 86400))] + ([("Location", "/elsewhere")] if status in (301, 302) else [])
        twice_hits(c, numbered(None, extra, status), 2)

    return run


def set_cookie(c: Ctx) -> None:
    c.script(lambda h, n: ok("public, max-age=600", f"response {n}".encode(), [("Set-Cookie", f"session=user{n}")]))
    c.get()
    b = c.get()
    check(b.header("set-cookie") in (None, "session=user1"), f"second client got {b.header('set-cookie')!r}: the first client's cookie")


def authorization(public: bool, want_hits: int):
    def run(c: Ctx) -> None:
        c.script(numbered("public, max-age=600" if public else "max-age=600"))
        c.get(headers={"Authorization": "Bearer secret"})
        c.get()
        check(c.hits() == want_hits, f"origin saw {c.hits()} requests, expected {want_hits}")

    return run


def no_transform(c: Ctx) -> None:
    body = bytes(range(256)) * 8
    c.script(Reply(200, [("Content-Type", "application/x-inband-test"), ("Cache-Control", "no-transform, max-age=600")], body))
    for r in (c.get(headers={"Accept-Encoding": "gzip"}), c.get(headers={"Accept-Encoding": "gzip"})):
        check(r.body == body, "body changed")
        check(r.header("content-type") == "application/x-inband-test", f"Content-Type {r.header('content-type')!r}")
        check(r.header("content-encoding") is None, f"Content-Encoding {r.header('content-encoding')!r} added")


def via(c: Ctx) -> None:
    c.script(ok("no-store", b"x"))
    r = c.get()
    check(r.header("via") is not None, "no Via toward the client")
    seen = c.seen()
    check(bool(seen) and "via" in seen[0]["headers"], "no Via toward the origin")


def missing_host(c: Ctx) -> None:
    c.script(ok("no-store", b"x"))
    r = c.get(host=False)
    check(r.status == 400, f"status {r.status}, expected 400")
    check(c.hits() == 0, f"origin saw {c.hits()} requests, expected 0")


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "must" or "should"
    rfc: str
    what: str
    run: Callable


CASES = [
    Case("freshness-max-age", "must", "9111 §4.2.1", "max-age=600: the second request is a hit", case_stored("max-age=600")),
    Case("freshness-s-maxage", "must", "9111 §5.2.2.10", "max-age=0, s-maxage=600: a shared cache uses s-maxage", case_stored("max-age=0, s-maxage=600")),
    Case("freshness-expires", "must", "9111 §5.3", "Expires a minute ahead: a hit", expires(60, 1)),
    Case("freshness-expires-past", "must", "9111 §5.3", "Expires in the past: not served from the cache", expires(-60, 2)),
    Case("freshness-max-age-0", "must", "9111 §4.2.1", "max-age=0: not served without validation", case_not_stored("max-age=0")),
    Case("freshness-stale", "must", "9111 §4.2", "max-age=1, 2.2 s later: the origin is asked", stale_after("max-age=1")),
    Case("freshness-heuristic", "should", "9111 §4.2.2", "a 200 with Last-Modified 10 days ago, no Cache-Control: heuristically fresh", heuristic),
    Case("age-on-hit", "must", "9111 §5.1", "a hit carries Age, at least the origin's", age_on_hit),
    Case("age-list-first-member", "must", "9111 §5.1", "`Age: 7200, 0` with max-age=3600: the first member counts, stale", case_not_stored("max-age=3600", extra=[("Age", "7200, 0")])),
    Case("expires-invalid-spaces", "must", "9111 §5.3, 9110 §5.6.7", "`Expires: Thu, 18  Aug  2050 …` (two spaces) is invalid: already expired",
         case_not_stored(None, extra=[("Expires", "Thu, 18  Aug  2050 02:01:18 GMT")])),
    Case("date-on-hit", "must", "9110 §6.6.1", "a hit carries the origin's Date, not the time of the hit", date_kept_on_hit),
    Case("cc-resp-private-mixed-case", "must", "9111 §5.2.2.7, §5.2", "`Private, max-age=600`: not stored by a shared cache", case_not_stored("Private, max-age=600")),
    Case("cc-resp-no-store-mixed-case", "must", "9111 §5.2.2.5, §5.2", "`No-Store, max-age=600`: not stored", case_not_stored("No-Store, max-age=600")),
    Case("cc-resp-max-age-upper-case", "must", "9111 §5.2", "`MAX-AGE=600`: directive names are case-insensitive", case_stored("MAX-AGE=600")),
    Case("cc-resp-fields-as-sent", "must", "9111 §5.2, 9110 §7.6", "`MAX-AGE=600, Public, x-Ext=\"A=B\"` reaches the client as sent, on the miss and on the hit", fields_as_sent),
    Case("cc-resp-no-cache", "must", "9111 §5.2.2.4", "`no-cache, max-age=600`: never served without the origin", case_not_stored("no-cache, max-age=600")),
    Case("cc-resp-must-revalidate", "must", "9111 §5.2.2.2", "`max-age=1, must-revalidate`: stale means the origin", stale_after("max-age=1, must-revalidate")),
    Case("cc-req-no-cache-upper-case", "must", "9111 §5.2.1.4, §5.2", "request `NO-CACHE`: the origin is asked", request_directive("NO-CACHE")),
    Case("cc-req-max-age-0", "must", "9111 §5.2.1.1", "request `max-age=0`: the origin is asked", request_directive("max-age=0")),
    Case("cc-req-only-if-cached-miss", "should", "9111 §5.2.1.7", "`only-if-cached` with nothing stored: 504, no origin request", only_if_cached_miss),
    Case("cc-req-only-if-cached-hit", "should", "9111 §5.2.1.7", "`only-if-cached` with a stored response: served", only_if_cached_hit),
    Case("cc-req-no-store", "must", "9111 §5.2.1.5", "request `no-store`: its response is not stored", request_no_store),
    Case("vary-two-variants", "must", "9111 §4.1", "Vary: Accept-Language, two variants, each served to its own clients", vary_two),
    Case("vary-star", "must", "9111 §4.1", "Vary: * never matches", vary_star),
    Case("validate-etag", "must", "9111 §4.3.1, §4.3.4", "stale with ETag: If-None-Match to the origin, 304, client gets the stored 200", validate_etag),
    Case("validate-304-without-validators", "must", "9111 §4.3.3, §4.3.4", "a 304 without ETag to the cache's If-None-Match freshens the entry, no second fetch",
         validate_304(True)),
    Case("validate-304-adds-fields", "must", "9111 §4.3.4", "a field the 304 brings reaches the client and later hits", validate_304(False)),
    Case("validate-last-modified", "should", "9111 §4.3.1", "stale with Last-Modified: If-Modified-Since to the origin", validate_last_modified),
    Case("client-conditional-hit", "should", "9111 §4.3.2", "client If-None-Match matching a stored ETag: 304 from the cache", client_conditional),
    Case("invalidate-post", "must", "9111 §4.4", "a successful POST invalidates the stored GET", invalidated_by("POST")),
    Case("invalidate-put", "must", "9111 §4.4", "a successful PUT invalidates the stored GET", invalidated_by("PUT")),
    Case("invalidate-delete", "must", "9111 §4.4", "a successful DELETE invalidates the stored GET", invalidated_by("DELETE")),
    Case("invalidate-extension-method", "must", "9111 §4.4, 9110 §9.2.1", "a successful `M-SEARCH` (not known to be safe) invalidates the stored GET", invalidated_by("M-SEARCH")),
    Case("status-404-max-age", "should", "9111 §3, 9110 §15.1", "404 with max-age=600 is stored", status_stored(404)),
    Case("status-301-max-age", "should", "9111 §3, 9110 §15.1", "301 with max-age=600 is stored", status_stored(301)),
    Case("status-410-max-age", "should", "9111 §3, 9110 §15.1", "410 with max-age=600 is stored", status_stored(410)),
    Case("status-500-max-age", "should", "9111 §3", "500 with max-age=600 is stored: any final status with explicit freshness may be", status_stored(500)),
    Case("cdn-cc-over-cache-control", "should", "9213 §2.2", "`CDN-Cache-Control: max-age=600` over `Cache-Control: no-store`: stored",
         case_stored("no-store", extra=[("CDN-Cache-Control", "max-age=600")])),
    Case("cdn-cc-no-store", "should", "9213 §2.2", "`CDN-Cache-Control: no-store` over `Cache-Control: max-age=600`: not stored",
         case_not_stored("max-age=600", extra=[("CDN-Cache-Control", "no-store")])),
    Case("status-500-no-heuristic", "must", "9111 §4.2.2", "500 with only Last-Modified: not heuristically cacheable", status_not_heuristic(500)),
    Case("status-302-no-heuristic", "must", "9111 §4.2.2", "302 with only Last-Modified: not heuristically cacheable", status_not_heuristic(302)),
    Case("set-cookie-not-replayed", "must", "9111 §7.3 (privacy)", "public response with Set-Cookie: no client gets another's cookie", set_cookie),
    Case("authorization-not-shared", "must", "9111 §3.5", "response to a request with Authorization (max-age only): not served to others", authorization(False, 2)),
    Case("authorization-public", "should", "9111 §3.5", "with `public` it may be served to others", authorization(True, 1)),
    Case("no-transform", "must", "9111 §5.2.2.6, 9110 §7.7", "body, Content-Type and Content-Encoding unchanged", no_transform),
    Case("via", "should", "9110 §7.6.3", "Via added toward the origin and the client", via),
    Case("host-missing-400", "must", "9112 §3.2", "a request without Host (over HTTP/2, nor `:authority`): 400, never forwarded", missing_host),
]


def run_case(case: Case, origin: Origin, port: int, http2: bool = False) -> dict:
    try:
        case.run(Ctx(origin, port, case.id, http2))
        return {"pass": True, "why": ""}
    except Failed as e:
        return {"pass": False, "why": str(e)}
    except (OSError, http.client.HTTPException, h2.exceptions.H2Error) as e:
        return {"pass": False, "why": f"{e.__class__.__name__}: {e}"}


# --------------------------------------------------------------- systems

SYSTEMS = {"inband": "inband proxy (memory)", "nginx": "nginx proxy_cache", "varnish": "Varnish (malloc)"}
TOOLS = {"nginx": "nginx", "varnish": "varnishd"}
# A system's results over HTTP/2 are under its key with this suffix.
H2 = "/h2"


def label(key: str) -> str:
    base = key.removesuffix(H2)
    return SYSTEMS[base] + (", HTTP/2" if key.endswith(H2) else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_system(key: str, procs: Procs, tmp: Path, origin_port: int, inband: Path, inband_backend: str = "memory", http2: bool = False) -> tuple[int, object]:
    """Starts one system in front of the origin and waits until it
    answers; `inband_backend` as peers.proxy_toml takes it
    (bench.cachetests runs LMDB); `http2`: its clients speak h2c (inband
    takes both on one port; nginx's `http2` port and Varnish's
    `+http2` take prior knowledge)."""
    port = free_port()
    listen, origin = f"{HOST}:{port}", f"{HOST}:{origin_port}"
    state = tmp / (key + ("-h2" if http2 else ""))
    state.mkdir()
    if key == "inband":
        cfg = state / "proxy.toml"
        path = None if inband_backend == "memory" else str(state / "cache")
        cfg.write_text(peers.proxy_toml(listen=listen, origin=origin, backend=inband_backend, path=path, capacity_bytes=64 << 20))
        argv = [str(inband), "proxy", "--config", str(cfg)]
    elif key == "nginx":
        cfg = state / "nginx.conf"
        conf = peers.nginx_conf(listen=listen, origin=origin, prefix=str(state), max_size_bytes=64 << 20, workers=1, as_root=os.geteuid() == 0)
        cfg.write_text(conf.replace(f"listen {listen};", f"listen {listen} http2;") if http2 else conf)
        argv = ["nginx", "-c", str(cfg), "-p", str(state), "-e", str(state / "error.log"), "-g", "daemon off;"]
    else:
        vcl = state / "varnish.vcl"
        vcl.write_text(peers.varnish_vcl(origin_host=HOST, origin_port=origin_port))
        argv = ["varnishd", "-F", "-a", listen, "-f", str(vcl), "-s", "malloc,64m", "-n", str(state / "varnish"), "-T", "none", "-j", "none"]
        argv += ["-p", "feature=+http2"] if http2 else []
    proc = procs.spawn(key, None, argv, state / "log", env=dict(os.environ, INBAND_LOG="warn"), cwd=state)

    def answering() -> bool:
        if proc.poll() is not None:
            raise Fatal(f"{key} exited with {proc.returncode}: {(state / 'log').read_text(errors='replace')[-1500:]}")
        try:
            (request_h2 if http2 else request)(port, "GET", "/ready", {"Cache-Control": "no-cache"})
            return True
        except OSError:
            return False

    wait_until(f"{key} to answer", answering, 60, 0.05)
    return port, proc


def run_suite(systems: list[str], inband: Path, log=print, http2: bool = False) -> dict:
    """{system: {case id: {"pass", "why"}}}, and with `http2` each
    system's results over HTTP/2 under system + H2; a system that cannot
    start has every case failed with the reason."""
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="inband-conformance-"))
    origin = Origin()
    results: dict[str, dict] = {}
    try:
        for key, over_h2 in [(k, h) for k in systems for h in ([False, True] if http2 else [False])]:
            column = key + (H2 if over_h2 else "")
            log(f"{label(column)}: {len(CASES)} cases")
            try:
                port, proc = start_system(key, procs, tmp, origin.port, inband, http2=over_h2)
            except Exception as e:  # noqa: BLE001 - reported in the table
                results[column] = {c.id: {"pass": False, "why": f"did not start: {e}"} for c in CASES}
                continue
            results[column] = {c.id: run_case(c, origin, port, over_h2) for c in CASES}
            procs.stop(proc, grace_s=10)
            origin.seen.clear()  # the next system starts from zero
    finally:
        procs.stop_all()
        origin.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


# --------------------------------------------------------------- report


def render(record: dict) -> str:
    """The table of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    return f"# HTTP caching conformance\n\n{provenance(record)}\n\n" + markdown(record["rows"])


def markdown(results: dict) -> str:
    keys = list(results)
    head = ["case", "kind", "RFC"] + [label(k) for k in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for c in CASES:
        cells = []
        for k in keys:
            r = results[k].get(c.id, {"pass": False, "why": "not run"})
            cells.append("pass" if r["pass"] else f"**FAIL**: {r['why']}")
        lines.append("| " + " | ".join([f"`{c.id}`", c.kind, c.rfc] + cells) + " |")
    totals = []
    for k in keys:
        must = [c for c in CASES if c.kind == "must"]
        passed = sum(results[k][c.id]["pass"] for c in must)
        should = [c for c in CASES if c.kind == "should"]
        totals.append(f"{label(k)}: {passed}/{len(must)} must, {sum(results[k][c.id]['pass'] for c in should)}/{len(should)} should")
    return "\n".join(lines) + "\n\n" + "; ".join(totals) + ".\n"


def inband_must_failures(results: dict) -> list[str]:
    """Over HTTP/2 named with the suffix."""
    return [
        c.id + key.removeprefix("inband")
        for key in ("inband", "inband" + H2)
        if key in results
        for c in CASES
        if c.kind == "must" and not results[key].get(c.id, {}).get("pass")
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.conformance", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="inband,nginx,varnish", help="comma-separated subset of " + ", ".join(SYSTEMS))
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    ap.add_argument("--results", type=Path, default=default_dir("conformance"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--http2", action="store_true", help="run every case over HTTP/2 (h2c, prior knowledge) as well")
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s): {', '.join(bad)}")
    systems = preflight.installed_systems(systems, TOOLS)
    if "inband" in systems and (code := preflight.refuse(preflight.problems(inband=args.inband, root=False))):
        return code
    stop_signals_interrupt()
    this_run = Run("conformance", "bench.conformance", argv)
    results = run_suite(systems, Path(args.inband).resolve(), http2=args.http2)
    record = this_run.record(results, inband=Path(args.inband), tools={"nginx": ["nginx", "-v"], "varnish": ["varnishd", "-V"]},
                        cases=[c.id for c in CASES])
    write_results(args.results, record, render(record))
    failing = inband_must_failures(results) if "inband" in systems else []
    if failing:
        print(f"inband fails must cases: {', '.join(failing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Configuration of everything the driver runs besides its own load: the
inband balancer and agents, the peers (HAProxy, nftables DNAT), and the
TBF qdisc that models the balancer's limited link. Pure functions: text in,
text out, so they are unit-tested without a testbed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address


@dataclass(frozen=True)
class Backend:
    address: str
    port: int
    # `inband lb`'s weight (None: the default, 1); 0 takes no new
    # connections, only moved ones.
    weight: int | None = None


def _check_ip(a: str) -> str:
    return str(IPv4Address(a))


@dataclass(frozen=True)
class HealthChecks:
    """Active TCP connect checks with the same timings for inband
    (`[vip.health]`) and HAProxy (`check inter fastinter rise fall`). The
    defaults are inband's (docs/configuration.md). `jitter_pct` and
    `passive_fall` are inband's only: HAProxy's checks keep their interval,
    and it is given no passive detection."""

    interval_ms: int = 500
    fast_interval_ms: int = 100
    timeout_ms: int = 1000
    rise: int = 2
    fall: int = 2
    jitter_pct: int = 10
    passive_fall: int = 3

    def toml_lines(self) -> list[str]:
        return [
            "[vip.health]",
            'check = "tcp"',
            f"interval_ms = {int(self.interval_ms)}",
            f"fast_interval_ms = {int(self.fast_interval_ms)}",
            f"timeout_ms = {int(self.timeout_ms)}",
            f"rise = {int(self.rise)}",
            f"fall = {int(self.fall)}",
            f"jitter_pct = {int(self.jitter_pct)}",
            f"passive_fall = {int(self.passive_fall)}",
        ]

    def haproxy_server_args(self) -> str:
        return f"check inter {int(self.interval_ms)} fastinter {int(self.fast_interval_ms)} rise {int(self.rise)} fall {int(self.fall)}"


@dataclass(frozen=True)
class ScaleOut:
    """One `inband lb` instance of several behind an ECMP router
    (`[scale_out]`, docs/configuration.md): its IPv6 address, which the
    router's SIDs are routed to, and the three SIDs."""

    address6: str
    sid: str
    direct_sid: str
    shadow_sid: str

    def toml_lines(self) -> list[str]:
        return [
            f'address6 = "{IPv6Address(self.address6)}"',
            "",
            "[scale_out]",
            f'sid = "{IPv6Address(self.sid)}"',
            f'direct_sid = "{IPv6Address(self.direct_sid)}"',
            f'shadow_sid = "{IPv6Address(self.shadow_sid)}"',
        ]


def lb_toml(
    *,
    address: str,
    vip: str,
    vip_port: int,
    backends: list[Backend],
    mode: str,
    control_socket: str,
    auth_key: str | None,
    policy: str = "least-score",
    probe_interval: int = 100,
    probe_interval_max: int | None = None,
    probe_budget: int = 0,
    poll_interval_ms: int = 100,
    score_max_age_ms: int = 2000,
    query_when_stale: bool = False,
    interface: str = "eth0",
    health: HealthChecks | None = None,
    scale_out: ScaleOut | None = None,
    moves_listen: str | None = None,
) -> str:
    """`inband lb` config for one VIP in one mode (docs/configuration.md).
    `auth_key`: the key file shared with the agents, or None for the seed
    paper's unauthenticated options. `probe_interval_max` and
    `probe_budget`: the adaptive n's upper bound and the 124s per second a
    backend may get (both omitted: the balancer's fixed n, no budget).
    `query_when_stale`: dsr-dynamic asks before a SYN that finds every
    score stale (after a pause).
    `health`: the VIP's checks written out (omitted: the defaults).
    `scale_out`: this instance's place behind an ECMP router.
    `moves_listen`: `[moves] listen` (flow moves taken there; none when
    absent)."""
    lines = [
        f'interface = "{interface}"',
        f'address = "{_check_ip(address)}"',
        f'control_socket = "{control_socket}"',
        *(scale_out.toml_lines() if scale_out is not None else []),
        *(["", "[moves]", f'listen = ["{moves_listen}"]'] if moves_listen else []),
        "",
        *_auth_lines(auth_key, balancer=True),
        "",
        "[[vip]]",
        f'address = "{_check_ip(vip)}"',
        f"port = {int(vip_port)}",
        f'mode = "{mode}"',
        f'policy = "{policy}"',
        f"probe_interval = {int(probe_interval)}",
        *([f"probe_interval_max = {int(probe_interval_max)}"] if probe_interval_max is not None else []),
        *([f"probe_budget = {int(probe_budget)}"] if probe_budget else []),
        f"score_max_age_ms = {int(score_max_age_ms)}",
        *(["query_when_stale = true"] if query_when_stale else []),
        f"poll_interval_ms = {int(poll_interval_ms)}",
        *(["", *health.toml_lines()] if health is not None else []),
    ]
    for b in backends:
        lines += ["", "[[vip.backend]]", f'address = "{_check_ip(b.address)}"', f"port = {int(b.port)}"]
        if b.weight is not None:
            lines.append(f"weight = {int(b.weight)}")
    return "\n".join(lines) + "\n"


def agent_toml(
    *, balancers: list[str], vip: str, vip_port: int, service_port: int, score_socket: str, auth_key: str | None, interface: str = "eth0",
    score: str | None = None, client_address: bool = True,
) -> str:
    """`inband agent` config: one service, the balancers it trusts, and
    their key (`auth_key`, as in `lb_toml`); `score`: its score source
    (docs/agent.md "Score sources"), absent: the agent's default;
    `client_address = False`: applications see the balancer's tuple (a
    proxy that moves connections must)."""
    trusted = ", ".join(f'"{_check_ip(b)}"' for b in balancers)
    lines = [
        f'interface = "{interface}"',
        f"balancers = [{trusted}]",
        *([f'score = "{score}"'] if score else []),
        *([] if client_address else ["client_address = false"]),
        f'score_socket = "{score_socket}"',
        "",
        *_auth_lines(auth_key, balancer=False),
        "",
        "[[service]]",
        f"port = {int(service_port)}",
        f'vip = "{_check_ip(vip)}:{int(vip_port)}"',
    ]
    return "\n".join(lines) + "\n"


def _auth_lines(key_file: str | None, *, balancer: bool) -> list[str]:
    """`[auth]` with a run's one key as id 1. Only the balancer names the
    key it signs with: an agent answers each 124 with that 124's key and
    refuses `sign_with`."""
    if key_file is None:
        return ["[auth]", 'mode = "none"']
    lines = ["[auth]", 'mode = "siphash"', f'keys = [{{ id = 1, file = "{key_file}" }}]']
    if balancer:
        lines.append("sign_with = 1")
    return lines


def haproxy_cfg(
    *,
    vip: str,
    vip_port: int,
    backends: list[Backend],
    balance: str,
    timeout_s: int,
    checks: HealthChecks | None = None,
    connect_timeout_s: int = 5,
    redispatch: bool = False,
    stats_socket: str | None = None,
) -> str:
    """HAProxy in TCP mode (an L4 proxy like inband, not an HTTP one).
    Without `checks` it sends no packets of its own: its `leastconn` uses
    only the connection counts it sees itself. `redispatch`: a connection
    whose server refused or timed out makes its last retry on another
    server. `stats_socket`: the admin socket (`show stat`)."""
    if balance not in ("roundrobin", "leastconn"):
        raise ValueError(f"unsupported balance {balance!r}")
    lines = [
        "global",
        "    maxconn 4096",
        *([f"    stats socket {stats_socket} mode 600 level admin"] if stats_socket else []),
        "",
        "defaults",
        "    mode tcp",
        f"    timeout connect {int(connect_timeout_s)}s",
        f"    timeout client {int(timeout_s)}s",
        f"    timeout server {int(timeout_s)}s",
        "",
        "frontend vip",
        f"    bind {_check_ip(vip)}:{int(vip_port)}",
        "    default_backend servers",
        "",
        "backend servers",
        f"    balance {balance}",
        *(["    option redispatch"] if redispatch else []),
    ]
    for i, b in enumerate(backends, 1):
        check = f" {checks.haproxy_server_args()}" if checks else ""
        lines.append(f"    server s{i} {_check_ip(b.address)}:{int(b.port)}{check}")
    return "\n".join(lines) + "\n"


NFT_TABLE = "inband_bench"


def nft_ruleset(*, vip: str, vip_port: int, backends: list[Backend]) -> str:
    """Kernel NAT balancing as kube-proxy's nftables mode does it: DNAT the
    first packet of each connection to `numgen inc mod N` (round-robin;
    conntrack keeps the rest of the connection), masquerade so replies come
    back through the balancer."""
    ports = {b.port for b in backends}
    if len(ports) != 1:
        raise ValueError("nftables numgen DNAT here needs one port for all backends")
    port = ports.pop()
    mapping = ", ".join(f"{i} : {_check_ip(b.address)}" for i, b in enumerate(backends))
    addrs = ", ".join(_check_ip(b.address) for b in backends)
    return (
        f"table ip {NFT_TABLE} {{\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        f"    ip daddr {_check_ip(vip)} tcp dport {int(vip_port)} "
        f"dnat to numgen inc mod {len(backends)} map {{ {mapping} }} : {int(port)}\n"
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f"    ip daddr {{ {addrs} }} tcp dport {int(port)} masquerade\n"
        "  }\n"
        "}\n"
    )


def tbf_args(dev: str, rate_mbit: float, burst_kb: int, latency_ms: int) -> list[str]:
    """`tc` arguments that shape what a port sends. The rate is in kbit so
    that fractional Mbit/s values are exact."""
    return [
        "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{int(round(rate_mbit * 1000))}kbit",
        "burst", f"{int(burst_kb)}kb",
        "latency", f"{int(latency_ms)}ms",
    ]  # fmt: skip


def parse_tbf_stats(tc_json: str) -> dict:
    """bytes/packets/drops of the root TBF from `tc -s -j qdisc show dev X`."""
    for q in json.loads(tc_json):
        if q.get("kind") == "tbf" and q.get("root"):
            return {"bytes": int(q["bytes"]), "packets": int(q["packets"]), "drops": int(q["drops"])}
    raise ValueError("no root tbf qdisc in tc output")


# ------------------------------------------------- L7 caches (bench/proxy.py)


def proxy_toml(*, listen: str, origin: str, backend: str, path: str | None, capacity_bytes: int) -> str:
    """`inband proxy` with its cache (docs/proxy.md), nothing else that the
    peers do not do either: no health checks, one backend."""
    if backend not in ("lmdb", "rocksdb", "memory", "files"):
        raise ValueError(f"unknown cache backend {backend!r}")
    if (path is None) != (backend == "memory"):
        raise ValueError("a path is needed for a durable backend and only for one")
    lines = [
        f'listen = "{listen}"',
        f'backends = ["{origin}"]',
        "",
        "[cache]",
        f'backend = "{backend}"',
    ]
    if path is not None:
        lines.append(f'path = "{path}"')
    lines.append(f"capacity_bytes = {int(capacity_bytes)}")
    return "\n".join(lines) + "\n"


def _nginx_http_head(prefix: str, workers: int, as_root: bool) -> str:
    """Up to the inside of `http {`: every path nginx writes under
    `prefix`, so the packaged instance and /var are never touched."""
    user = "user root;\n" if as_root else ""  # workers must write the cache the master created
    return f"""\
{user}worker_processes {int(workers)};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy_temp;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
"""


def _nginx_upstream(origin: str) -> str:
    """The origin, with keep-alive connections to it (both nginx proxies)."""
    return f"""\
    upstream origin {{
        server {origin};
        keepalive 32;
    }}
"""


def nginx_conf(*, listen: str, origin: str, prefix: str, max_size_bytes: int, workers: int, as_root: bool) -> str:
    """nginx `proxy_cache` as a reverse-proxy cache is usually set up: one
    worker per core, levels=1:2 files, `proxy_cache_lock` (coalescing, as
    inband does), keep-alive to the origin."""
    return f"""\
{_nginx_http_head(prefix, workers, as_root)}    proxy_cache_path {prefix}/cache levels=1:2 keys_zone=bench:64m max_size={int(max_size_bytes)} inactive=1d use_temp_path=off;
{_nginx_upstream(origin)}    server {{
        listen {listen};
        location / {{
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache bench;
            proxy_cache_lock on;
            add_header X-Cache $upstream_cache_status;
        }}
    }}
}}
"""


def nginx_static_conf(*, listen: str, root: str, prefix: str, workers: int, as_root: bool) -> str:
    """nginx serving the objects as files, no proxy and no cache logic:
    the most a server can do for these requests on this machine, with the
    same load generator, so the caches can be read against it."""
    return _nginx_files(listen=listen, root=root, prefix=prefix, workers=workers, as_root=as_root,
                        locations='location = /__stats { return 200 "{}"; }')


def _nginx_files(*, listen: str, root: str, prefix: str, workers: int, as_root: bool, locations: str) -> str:
    """nginx serving files under `root`, `locations` inside its server."""
    return f"""\
{_nginx_http_head(prefix, workers, as_root)}    open_file_cache max=10000 inactive=60s;
    default_type application/octet-stream;
    server {{
        listen {listen};
        root {root};
        {locations}
    }}
}}
"""


def nginx_origin_conf(*, listen: str, root: str, prefix: str, workers: int, as_root: bool, max_age: int) -> str:
    """The origin behind the caches (bench.proxy): `/obj/N` from files,
    cacheable for `max_age` seconds (with nginx's own ETag and
    Last-Modified); any `/pass/...` path the file `pass-body`, `no-store`;
    `/__stats` its request count (stub_status), never stored. A native
    origin, so that what a proxy adds to a miss shows in the rate, not
    what a slow origin makes of the proxy's connections."""
    return _nginx_files(listen=listen, root=root, prefix=prefix, workers=workers, as_root=as_root, locations=f"""\
location /obj/ {{ add_header Cache-Control "public, max-age={int(max_age)}"; }}
        location /pass/ {{ add_header Cache-Control "no-store" always; try_files /pass-body =500; }}
        location = /__stats {{ add_header Cache-Control "no-store" always; stub_status; }}""")


def nginx_proxy_conf(*, listen: str, origin: str, prefix: str, workers: int, as_root: bool) -> str:
    """nginx as a plain reverse proxy for large responses (bench.handoff):
    no cache, keep-alive to the origin, and nothing buffered to disk
    (`proxy_max_temp_file_size 0`: a response larger than the buffers is
    read from the origin as fast as the client takes it, not spooled to a
    temporary file, which would add disk writes no other proxy does)."""
    return f"""\
{_nginx_http_head(prefix, workers, as_root)}{_nginx_upstream(origin)}    server {{
        listen {listen};
        location / {{
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_max_temp_file_size 0;
        }}
    }}
}}
"""


def nginx_answer_conf(*, listen: str, prefix: str, workers: int, as_root: bool) -> str:
    """nginx answering every request itself with an empty 204
    (bench.handoff's L7 floor): what an L7 element spends on a connection
    that it accepts, reads a request from, answers and closes, with no
    origin behind it."""
    return f"""\
{_nginx_http_head(prefix, workers, as_root)}    server {{
        listen {listen};
        location / {{
            return 204;
        }}
    }}
}}
"""


def haproxy_http_cfg(*, listen: str, origin: str, threads: int) -> str:
    """HAProxy as an HTTP proxy (bench.handoff): one server, connections
    to it reused across clients, no cache."""
    host, port = listen.rsplit(":", 1)
    return f"""\
global
    nbthread {int(threads)}
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 30s

frontend vip
    bind {_check_ip(host)}:{int(port)}
    default_backend origin

backend origin
    http-reuse always
    server o {origin}
"""


def varnish_vcl(*, origin_host: str, origin_port: int) -> str:
    """Varnish's built-in VCL does the caching (Cache-Control max-age);
    this only names the origin and marks hits like the others do."""
    return f"""\
vcl 4.1;

backend origin {{
    .host = "{_check_ip(origin_host)}";
    .port = "{int(origin_port)}";
}}

sub vcl_deliver {{
    if (obj.hits > 0) {{
        set resp.http.X-Cache = "HIT";
    }} else {{
        set resp.http.X-Cache = "MISS";
    }}
}}
"""

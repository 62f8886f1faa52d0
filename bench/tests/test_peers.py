"""Generated configurations, checked exactly; where the real tool is
installed, also checked by the tool itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
import uuid

import pytest

from bench.lib import peers
from bench.lib.peers import Backend

BACKENDS = [Backend("10.77.0.21", 8080), Backend("10.77.0.22", 8080), Backend("10.77.0.23", 8080)]


LB_HEAD = 'interface = "eth0"\naddress = "10.77.0.2"\ncontrol_socket = "/tmp/x/lb.sock"\n\n'
LB_VIP = (
    '[[vip]]\naddress = "10.77.0.100"\nport = 80\nmode = "dsr-dynamic"\npolicy = "least-score"\n'
    "probe_interval = 50\nscore_max_age_ms = 2000\npoll_interval_ms = 200\n"
    + "".join(f'\n[[vip.backend]]\naddress = "{b.address}"\nport = 8080\n' for b in BACKENDS)
)


def lb(auth_key):
    return peers.lb_toml(
        address="10.77.0.2", vip="10.77.0.100", vip_port=80, backends=BACKENDS, mode="dsr-dynamic",
        control_socket="/tmp/x/lb.sock", auth_key=auth_key, probe_interval=50, poll_interval_ms=200,
    )  # fmt: skip


def test_lb_toml_with_a_key_exact():
    text = lb("/tmp/x/auth.key")
    assert text == (
        LB_HEAD
        + '[auth]\nmode = "siphash"\nkeys = [{ id = 1, file = "/tmp/x/auth.key" }]\nsign_with = 1\n\n'
        + LB_VIP
    )
    cfg = tomllib.loads(text)
    assert cfg == {
        "interface": "eth0",
        "address": "10.77.0.2",
        "control_socket": "/tmp/x/lb.sock",
        "auth": {"mode": "siphash", "keys": [{"id": 1, "file": "/tmp/x/auth.key"}], "sign_with": 1},
        "vip": [
            {
                "address": "10.77.0.100",
                "port": 80,
                "mode": "dsr-dynamic",
                "policy": "least-score",
                "probe_interval": 50,
                "score_max_age_ms": 2000,
                "poll_interval_ms": 200,
                "backend": [{"address": b.address, "port": 8080} for b in BACKENDS],
            }
        ],
    }


def test_lb_toml_without_a_key_sends_seed_options():
    text = lb(None)
    assert text == LB_HEAD + '[auth]\nmode = "none"\n\n' + LB_VIP
    assert tomllib.loads(text)["auth"] == {"mode": "none"}


def test_lb_toml_rejects_bad_address():
    with pytest.raises(ValueError):
        peers.lb_toml(
            address="10.77.0", vip="10.77.0.100", vip_port=80, backends=BACKENDS, mode="dsr-rr", control_socket="s", auth_key=None
        )


def test_lb_toml_needs_an_auth_decision():
    with pytest.raises(TypeError):
        peers.lb_toml(address="10.77.0.2", vip="10.77.0.100", vip_port=80, backends=BACKENDS, mode="dsr-rr", control_socket="s")
    with pytest.raises(TypeError):
        peers.agent_toml(balancers=["10.77.0.2"], vip="10.77.0.100", vip_port=80, service_port=8080, score_socket="/tmp/a.sock")


def agent(auth_key):
    return peers.agent_toml(
        balancers=["10.77.0.2"], vip="10.77.0.100", vip_port=80, service_port=8080, score_socket="/tmp/a.sock", auth_key=auth_key
    )


AGENT_HEAD = 'interface = "eth0"\nbalancers = ["10.77.0.2"]\nscore_socket = "/tmp/a.sock"\n\n'
AGENT_SERVICE = '[[service]]\nport = 8080\nvip = "10.77.0.100:80"\n'


def test_agent_toml_with_a_key_exact():
    text = agent("/tmp/x/auth.key")
    assert text == AGENT_HEAD + '[auth]\nmode = "siphash"\nkeys = [{ id = 1, file = "/tmp/x/auth.key" }]\n\n' + AGENT_SERVICE
    assert tomllib.loads(text) == {
        "interface": "eth0",
        "balancers": ["10.77.0.2"],
        "score_socket": "/tmp/a.sock",
        "auth": {"mode": "siphash", "keys": [{"id": 1, "file": "/tmp/x/auth.key"}]},
        "service": [{"port": 8080, "vip": "10.77.0.100:80"}],
    }


def test_agent_toml_without_a_key_exact():
    assert agent(None) == AGENT_HEAD + '[auth]\nmode = "none"\n\n' + AGENT_SERVICE


def test_haproxy_cfg_exact():
    text = peers.haproxy_cfg(vip="10.77.0.100", vip_port=80, backends=BACKENDS[:2], balance="leastconn", timeout_s=90)
    assert text == (
        "global\n    maxconn 4096\n\n"
        "defaults\n    mode tcp\n    timeout connect 5s\n    timeout client 90s\n    timeout server 90s\n\n"
        "frontend vip\n    bind 10.77.0.100:80\n    default_backend servers\n\n"
        "backend servers\n    balance leastconn\n"
        "    server s1 10.77.0.21:8080\n    server s2 10.77.0.22:8080\n"
    )
    assert "check" not in text  # health checks would be load-information packets
    with pytest.raises(ValueError):
        peers.haproxy_cfg(vip="10.77.0.100", vip_port=80, backends=BACKENDS, balance="source", timeout_s=1)


def test_lb_toml_with_health_checks_exact():
    checks = peers.HealthChecks(interval_ms=500, fast_interval_ms=100, timeout_ms=700, rise=3, fall=2)
    text = peers.lb_toml(
        address="10.77.0.2", vip="10.77.0.100", vip_port=80, backends=BACKENDS[:1], mode="dsr-rr",
        control_socket="/tmp/x/lb.sock", auth_key=None, health=checks,
    )  # fmt: skip
    assert (
        'poll_interval_ms = 100\n\n[vip.health]\ncheck = "tcp"\ninterval_ms = 500\nfast_interval_ms = 100\n'
        "timeout_ms = 700\nrise = 3\nfall = 2\njitter_pct = 10\npassive_fall = 3\n\n[[vip.backend]]\n"
    ) in text
    vip = tomllib.loads(text)["vip"][0]
    assert vip["health"] == {
        "check": "tcp", "interval_ms": 500, "fast_interval_ms": 100, "timeout_ms": 700, "rise": 3, "fall": 2, "jitter_pct": 10,
        "passive_fall": 3,
    }  # fmt: skip
    assert vip["backend"] == [{"address": "10.77.0.21", "port": 8080}]


def test_haproxy_cfg_with_checks_exact():
    text = peers.haproxy_cfg(
        vip="10.77.0.100", vip_port=80, backends=BACKENDS[:2], balance="roundrobin", timeout_s=10,
        checks=peers.HealthChecks(), connect_timeout_s=1, redispatch=True, stats_socket="/tmp/x/ha.sock",
    )  # fmt: skip
    assert text == (
        "global\n    maxconn 4096\n    stats socket /tmp/x/ha.sock mode 600 level admin\n\n"
        "defaults\n    mode tcp\n    timeout connect 1s\n    timeout client 10s\n    timeout server 10s\n\n"
        "frontend vip\n    bind 10.77.0.100:80\n    default_backend servers\n\n"
        "backend servers\n    balance roundrobin\n    option redispatch\n"
        "    server s1 10.77.0.21:8080 check inter 500 fastinter 100 rise 2 fall 2\n"
        "    server s2 10.77.0.22:8080 check inter 500 fastinter 100 rise 2 fall 2\n"
    )


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/setup.sh installs it)")
def test_haproxy_accepts_config(tmp_path):
    for balance in ("roundrobin", "leastconn"):
        cfg = tmp_path / f"{balance}.cfg"
        cfg.write_text(peers.haproxy_cfg(vip="10.77.0.100", vip_port=80, backends=BACKENDS, balance=balance, timeout_s=60))
        out = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    cfg = tmp_path / "checks.cfg"
    cfg.write_text(peers.haproxy_cfg(vip="10.77.0.100", vip_port=80, backends=BACKENDS, balance="roundrobin", timeout_s=60,
                                     checks=peers.HealthChecks(), connect_timeout_s=1, redispatch=True, stats_socket=str(tmp_path / "s")))
    out = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_nft_ruleset_exact():
    assert peers.nft_ruleset(vip="10.77.0.100", vip_port=80, backends=BACKENDS) == (
        "table ip inband_bench {\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        "    ip daddr 10.77.0.100 tcp dport 80 dnat to numgen inc mod 3 map "
        "{ 0 : 10.77.0.21, 1 : 10.77.0.22, 2 : 10.77.0.23 } : 8080\n"
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        "    ip daddr { 10.77.0.21, 10.77.0.22, 10.77.0.23 } tcp dport 8080 masquerade\n"
        "  }\n"
        "}\n"
    )
    with pytest.raises(ValueError):
        peers.nft_ruleset(vip="10.77.0.100", vip_port=80, backends=[Backend("10.77.0.21", 1), Backend("10.77.0.22", 2)])


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft to load a ruleset into a scratch netns")
def test_nft_accepts_ruleset():
    ns = f"ibt-nft{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        text = peers.nft_ruleset(vip="10.77.0.100", vip_port=80, backends=BACKENDS)
        out = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        listed = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "list", "table", "ip", "inband_bench"], capture_output=True, text=True, check=True
        ).stdout
        assert "numgen inc mod 3" in listed and "masquerade" in listed
    finally:
        subprocess.run(["ip", "netns", "del", ns])


def test_tbf_args():
    assert peers.tbf_args("lb-sw", 12.5, 32, 100) == [
        "tc", "qdisc", "replace", "dev", "lb-sw", "root", "tbf", "rate", "12500kbit", "burst", "32kb", "latency", "100ms",
    ]  # fmt: skip


def test_parse_tbf_stats():
    out = '[{"kind":"tbf","handle":"8001:","root":true,"bytes":90,"packets":1,"drops":3,"overlimits":0}]'
    assert peers.parse_tbf_stats(out) == {"bytes": 90, "packets": 1, "drops": 3}
    with pytest.raises(ValueError):
        peers.parse_tbf_stats('[{"kind":"noqueue","root":true}]')

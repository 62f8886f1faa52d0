"""The public HTTP cache test suite (http-tests/cache-tests, the one
cache-tests.fyi publishes) against `inband proxy` and its peers:

    python -m bench.cachetests --systems inband,nginx,varnish [--http2] [--git SOURCE]

The suite is checked out at one pinned commit (SUITE_COMMIT; `--git`
names where to clone it from: its public repository by default, or a
local copy) into --suite (kept between runs, so the checkout and `npm
install` happen once), and its one npm dependency the proxy tests use
(undici, for interim responses) installed there. Its origin server (`npm
run server`'s program) listens on 127.0.0.1; each system in turn runs in
front of it, configured as bench.conformance starts it (inband proxy with
an LMDB store and its defaults, nginx `proxy_cache`, Varnish with its
built-in VCL), and the
suite's command-line client runs every test through it (`npm run cli
--base=<the system's URL>`) and prints its results as JSON. With --http2
inband runs the suite a second time, its client speaking HTTP/2 to the
proxy's TLS listener: the client is Node's fetch, whose undici speaks h2
only over TLS (by ALPN, with `allowH2`), so a preloaded module makes an
`allowH2` agent the global dispatcher and counts the protocols its
connections negotiated, recorded beside the results. The tests that
collect interim (1xx) responses bring an agent of their own, without
`allowH2`: those run over HTTP/1.1 (on TLS).

A test's kind decides what a failure means: `required` (RFC 9111
conformance), `optimal` (the cache did not use a stored response it
could have) and `check` (behaviour surveyed, no verdict). Tests only a
browser can run are left out. Two counts per kind: the test's own result
(how the issue and most comparisons count) and the one cache-tests.fyi
shows, where a test whose prerequisite failed counts as not passed. The
published results the suite ships (results/*.json: Apache, nginx, Squid,
Traffic Server, Varnish, ...) are scored the same way, against these
tests, for comparison.

Prints the tables and writes the record (results.json: the raw results
of each system and the tests' metadata, so the tables can be rendered
from it alone) and results.md into --results (default
bench/results/cachetests). Exit code 0 when every system ran. Every
process is stopped and every temporary directory removed at the end, on
Ctrl-C too. See docs/proxy.md ("Conformance") and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .conformance import free_port, request, start_system
from .frontdoor import make_certificate
from .lib import peers, preflight
from .lib.procs import Fatal, Procs, stop_signals_interrupt, wait_until
from .lib.report import table
from .lib.results import REPO, Run, default_dir, provenance
from .lib.results import write as write_results

SUITE_REPO = "https://github.com/http-tests/cache-tests"
SUITE_COMMIT = "b55b8bda3dbb8c927c04e85bd8d496a8caa3e4ba"
HOST = "127.0.0.1"
SYSTEMS = {"inband": "inband proxy (LMDB)", "nginx": "nginx proxy_cache", "varnish": "Varnish (malloc)"}
TOOLS = {"nginx": "nginx", "varnish": "varnishd"}
KINDS = ("required", "optimal", "check")
CLI_TIMEOUT_S = 900  # the whole suite, about a minute on a quiet machine

# The suite's server listens on every address (it takes only a port);
# this makes its one listen() take 127.0.0.1, so nothing outside the
# machine reaches it while it runs.
LOOPBACK_ONLY = (
    "data:text/javascript,import net from 'node:net';"
    "const listen = net.Server.prototype.listen;"
    "net.Server.prototype.listen = function (port, ...rest) { return listen.call(this, port, '127.0.0.1', ...rest) }"
)

# The tests as the suite defines them: id, name, kind and prerequisites.
LIST_TESTS = (
    "import tests from './tests/index.mjs';"
    "const out = [];"
    "for (const s of tests) for (const t of s.tests) out.push({id: t.id, name: t.name, kind: t.kind || 'required',"
    " depends_on: t.depends_on || [], browser_only: t.browser_only === true});"
    "console.log(JSON.stringify(out))"
)

# Before the suite's client: every fetch through an undici agent that
# offers h2 by ALPN; at exit, how many connections negotiated what (on
# stderr, one line the driver reads). undici is the suite's copy, named by
# INBAND_UNDICI (a data: module can import only absolute URLs).
ALLOW_H2 = (
    "data:text/javascript,const u = await import(process.env.INBAND_UNDICI);"
    "const alpn = {};"
    "const tls = u.buildConnector({allowH2: true});"
    "const connect = (opts, cb) => tls(opts, (err, sock) => {"
    " if (!err) { const p = sock.alpnProtocol || 'none'; alpn[p] = (alpn[p] || 0) + 1 } cb(err, sock) });"
    "u.setGlobalDispatcher(new u.Agent({allowH2: true, connect}));"
    "process.on('exit', () => process.stderr.write('alpn ' + JSON.stringify(alpn) + '\\n'))"
)
# A system's run over HTTP/2 is recorded under its key with this suffix.
H2 = "/h2"


def label(key: str) -> str:
    base = key.removesuffix(H2)
    return SYSTEMS.get(base, base) + (", HTTP/2 (TLS)" if key.endswith(H2) else "")


# ------------------------------------------------------------ the suite


def default_suite_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "inband-bench" / f"cache-tests-{SUITE_COMMIT[:12]}"


def prepare_suite(suite: Path, source: str, log=print) -> None:
    """The suite at SUITE_COMMIT in `suite`, with its npm dependencies; a
    directory already there at another commit is refused, not changed."""
    if not (suite / ".git").is_dir():
        log(f"cloning the suite from {source} into {suite}")
        suite.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "-q", "--no-checkout", source, str(suite)], check=True, timeout=600)
        subprocess.run(["git", "-C", str(suite), "-c", "advice.detachedHead=false", "checkout", "-q", SUITE_COMMIT], check=True, timeout=120)
    head = subprocess.run(["git", "-C", str(suite), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    if head != SUITE_COMMIT:
        raise SystemExit(f"error: {suite} is at {head}, not {SUITE_COMMIT}: remove it or pass another --suite")
    if not (suite / "node_modules" / "undici").is_dir():
        log("npm install (once per checkout)")
        subprocess.run(["npm", "install", "--omit=dev", "--no-audit", "--no-fund", "--loglevel=error"], cwd=suite, check=True, timeout=600)


def list_tests(suite: Path) -> list[dict]:
    cp = subprocess.run(["node", "--input-type=module", "-e", LIST_TESTS], cwd=suite, capture_output=True, text=True, check=True, timeout=60)
    return json.loads(cp.stdout)


def start_origin(procs: Procs, suite: Path, tmp: Path) -> tuple[int, object]:
    port = free_port()
    env = dict(os.environ, npm_config_port=str(port), npm_config_protocol="http", npm_config_pidfile=str(tmp / "origin.pid"))
    log = tmp / "origin.log"
    proc = procs.spawn("origin", None, ["node", "--import", LOOPBACK_ONLY, "test-engine/server/server.mjs"], log, env=env, cwd=suite)

    def listening() -> bool:
        if proc.poll() is not None:
            raise Fatal(f"the suite's server exited with {proc.returncode}: {log.read_text(errors='replace')[-1500:]}")
        return "Listening on" in log.read_text(errors="replace")

    wait_until("the suite's server to listen", listening, 30, 0.05)
    return port, proc


def run_cli(suite: Path, port: int, ca: Path | None = None) -> dict:
    """The suite's client against http://127.0.0.1:port: {"results": {test
    id: true, or [error name, message]}}; with `ca` (the certificate the
    system's TLS listener shows) against https://127.0.0.1:port over
    HTTP/2, and "alpn": {protocol: connections}."""
    env = dict(os.environ, npm_config_base=f"http://{HOST}:{port}", npm_package_config_id="")
    argv = ["node", "--no-warnings", "test-engine/cli.mjs"]
    if ca is not None:
        env.update(npm_config_base=f"https://{HOST}:{port}", NODE_EXTRA_CA_CERTS=str(ca),
                   INBAND_UNDICI=(suite / "node_modules" / "undici" / "index.js").as_uri())
        argv[1:1] = ["--import", ALLOW_H2]
    cp = subprocess.run(argv, cwd=suite, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    if cp.returncode != 0:
        raise RuntimeError(f"the suite's client exited with {cp.returncode}: {cp.stderr[-1500:]}")
    out = {"results": json.loads(cp.stdout)}
    if ca is not None:
        lines = [x for x in cp.stderr.splitlines() if x.startswith("alpn ")]
        out["alpn"] = json.loads(lines[-1][5:]) if lines else {}
    return out


def start_inband_tls(procs: Procs, tmp: Path, origin_port: int, inband: Path) -> tuple[int, Path, object]:
    """inband as start_system runs it (LMDB), with a TLS listener beside
    its plaintext one: (the TLS port, its certificate, the process)."""
    state = tmp / "inband-tls"
    state.mkdir()
    cert, key = make_certificate(state)
    port, tls_port = free_port(), free_port()
    cfg = state / "proxy.toml"
    cfg.write_text(peers.proxy_toml(listen=f"{HOST}:{port}", origin=f"{HOST}:{origin_port}", backend="lmdb", path=str(state / "cache"), capacity_bytes=64 << 20)
                   + f'\n[tls]\nlisten = "{HOST}:{tls_port}"\n[[tls.certificate]]\ncert = "{cert}"\nkey = "{key}"\n')
    proc = procs.spawn("inband-tls", None, [str(inband), "proxy", "--config", str(cfg)], state / "log", env=dict(os.environ, INBAND_LOG="warn"), cwd=state)

    def answering() -> bool:
        if proc.poll() is not None:
            raise Fatal(f"inband exited with {proc.returncode}: {(state / 'log').read_text(errors='replace')[-1500:]}")
        try:
            request(port, "GET", "/ready", {"Cache-Control": "no-cache"})
            return True
        except OSError:
            return False

    wait_until("inband to answer", answering, 60, 0.05)
    return tls_port, cert, proc


def run_suite(systems: list[str], inband: Path, suite: Path, log=print, http2: bool = False) -> dict:
    """{system: raw results}, and with `http2` inband's over HTTP/2 under
    "inband" + H2; a system that cannot start or run has the reason
    instead ({"error": ...})."""
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="inband-cachetests-"))
    out: dict[str, dict] = {}
    try:
        origin_port, _ = start_origin(procs, suite, tmp)
        for key in systems:
            log(f"{SYSTEMS[key]}: the suite's client through it")
            try:
                port, proc = start_system(key, procs, tmp, origin_port, inband, inband_backend="lmdb")
                out[key] = run_cli(suite, port)
                procs.stop(proc, grace_s=10)
            except Exception as e:  # noqa: BLE001 - reported in the table
                out[key] = {"error": f"{e.__class__.__name__}: {e}"}
        if http2 and "inband" in systems:
            log(f"{label('inband' + H2)}: the suite's client through it")
            try:
                port, cert, proc = start_inband_tls(procs, tmp, origin_port, inband)
                out["inband" + H2] = run_cli(suite, port, ca=cert)
                procs.stop(proc, grace_s=10)
            except Exception as e:  # noqa: BLE001 - reported in the table
                out["inband" + H2] = {"error": f"{e.__class__.__name__}: {e}"}
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def published(suite: Path, tests: dict) -> dict:
    """The results the suite ships, scored against `tests`, by
    implementation: {file stem: scored()}. Only the scores go into the
    record, not the suite's data."""
    found = {}
    for f in sorted((suite / "results").glob("*.json")):
        try:
            found[f.stem] = scored(tests, json.loads(f.read_text()))
        except ValueError:
            continue
    return found


# ------------------------------------------------------------ scoring


def outcome(tests: dict, results: dict, test_id: str, deps: bool) -> str:
    """One test's result as the suite's own determineTestResult
    (test-engine/lib/results.mjs) classes it: pass, fail, optional_fail,
    yes, no, setup_fail, retry, harness_fail, dependency_fail, untested."""
    r = results.get(test_id)
    if r is None:
        return "untested"
    if deps:
        for d in tests[test_id]["depends_on"]:
            if d in tests and outcome(tests, results, d, deps) not in ("pass", "yes"):
                return "dependency_fail"
    if isinstance(r, list) and r and r[0] == "Setup":
        return "retry" if r[1:2] == ["retry"] else "setup_fail"
    if isinstance(r, list) and r and r[0] == "AbortError":
        return "harness_fail"
    kind = tests[test_id]["kind"]
    if kind == "required":
        return "pass" if r is True else "fail"
    if kind == "optimal":
        return "pass" if r is True else "optional_fail"
    return "yes" if r is True else "no"


def scored(tests: dict, results: dict) -> dict:
    """Per kind: passes by the test's own result and with prerequisites,
    out of the tests a proxy runs."""
    out = {}
    for kind in KINDS:
        ids = [i for i, t in tests.items() if t["kind"] == kind and not t["browser_only"]]
        own = sum(outcome(tests, results, i, False) in ("pass", "yes") for i in ids)
        with_deps = sum(outcome(tests, results, i, True) in ("pass", "yes") for i in ids)
        out[kind] = {"own": own, "with_deps": with_deps, "total": len(ids)}
    return out


def required_failures(tests: dict, results: dict) -> list[tuple[str, str, str]]:
    """(id, name, why) of every required test not passed, by its own
    result or for want of a prerequisite."""
    out = []
    for i, t in tests.items():
        if t["kind"] != "required" or t["browser_only"]:
            continue
        own = outcome(tests, results, i, False)
        if own != "pass":
            r = results.get(i)
            why = f"{own}: {r[1]}" if isinstance(r, list) and len(r) > 1 else own
        elif outcome(tests, results, i, True) == "dependency_fail":
            failed = [d for d in t["depends_on"] if d in tests and outcome(tests, results, d, True) not in ("pass", "yes")]
            why = "passes, but its prerequisite " + ", ".join(f"`{d}`" for d in failed) + " does not"
        else:
            continue
        out.append((i, t["name"], why))
    return out


# ------------------------------------------------------------ report


def _cell(s: dict, kind: str, key: str) -> str:
    return f"{s[kind][key]}/{s[kind]['total']}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(record: dict) -> str:
    """The tables of a run, from its record alone (bench.docs renders the
    committed one the same way)."""
    rows = record["rows"]
    tests = {t["id"]: t for t in rows["tests"]}
    head = ["system", "required", "optimal", "check", "required (with prerequisites)", "optimal (with prerequisites)"]
    lines = []
    for key, got in rows["systems"].items():
        name = label(key)
        if "error" in got:
            lines.append([name, f"did not run: {_md(got['error'])}", "–", "–", "–", "–"])
            continue
        s = scored(tests, got["results"])
        lines.append([name, _cell(s, "required", "own"), _cell(s, "optimal", "own"), _cell(s, "check", "own"),
                      _cell(s, "required", "with_deps"), _cell(s, "optimal", "with_deps")])
    for impl, s in rows.get("published", {}).items():
        lines.append([f"{impl} (published)", _cell(s, "required", "own"), _cell(s, "optimal", "own"), _cell(s, "check", "own"),
                      _cell(s, "required", "with_deps"), _cell(s, "optimal", "with_deps")])
    md = [
        "# HTTP cache-tests (cache-tests.fyi)",
        "",
        provenance(record),
        "",
        f"Suite: http-tests/cache-tests at commit {record['suite_commit'][:12]}, its tests a reverse proxy runs "
        f"(browser-only ones left out). Passes by kind: `check` counts the tests answered yes. The first three columns count "
        f"each test's own result; the last two count a test whose prerequisite failed as not passed, as cache-tests.fyi shows "
        f"them. Published rows are the results the suite ships, scored against the same tests.",
        "",
        table(head, lines),
    ]
    h2 = rows["systems"].get("inband" + H2, {})
    if "alpn" in h2:
        by = ", ".join(f"{p} {n}" for p, n in sorted(h2["alpn"].items()))
        md += ["", f"{label('inband' + H2)}: the client's connections by the protocol ALPN chose: {by or 'none'}."]
    for key in ("inband", "inband" + H2):
        got = rows["systems"].get(key, {})
        if "results" in got:
            failing = required_failures(tests, got["results"])
            md += ["", f"## Required tests {label(key)} does not pass ({len(failing)})", ""]
            md.append(table(["test", "name", "result"], [[f"`{i}`", _md(n), _md(w)] for i, n, w in failing]) if failing else "None.")
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cachetests", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="inband,nginx,varnish", help="comma-separated subset of " + ", ".join(SYSTEMS))
    ap.add_argument("--inband", default=str(REPO / "target" / "debug" / "inband"))
    ap.add_argument("--suite", type=Path, default=default_suite_dir(), help="where the suite is checked out (default: %(default)s)")
    ap.add_argument("--git", default=SUITE_REPO, help="where to clone the suite from when --suite has no checkout (default: %(default)s)")
    ap.add_argument("--results", type=Path, default=default_dir("cachetests"), help="results.json and results.md (default: the committed ones)")
    ap.add_argument("--http2", action="store_true", help="run inband a second time over HTTP/2, on its TLS listener")
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s): {', '.join(bad)}")
    for tool in ("node", "npm", "git"):
        if not shutil.which(tool):
            print(f"error: {tool} is not installed (the suite needs Node.js 14.8 or later, npm and git)", file=sys.stderr)
            return 2
    systems = preflight.installed_systems(systems, TOOLS)
    if "inband" in systems and (code := preflight.refuse(preflight.problems(inband=args.inband, root=False))):
        return code
    stop_signals_interrupt()
    prepare_suite(args.suite, args.git)
    this_run = Run("cachetests", "bench.cachetests", argv)
    tests = list_tests(args.suite)
    systems_run = run_suite(systems, Path(args.inband).resolve(), args.suite, http2=args.http2)
    rows = {"tests": tests, "systems": systems_run, "published": published(args.suite, {t["id"]: t for t in tests})}
    record = this_run.record(rows, inband=Path(args.inband), tools={"node": ["node", "--version"], "nginx": ["nginx", "-v"], "varnish": ["varnishd", "-V"]},
                             suite_commit=SUITE_COMMIT)
    write_results(args.results, record, render(record))
    return 1 if any("error" in v for v in systems_run.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

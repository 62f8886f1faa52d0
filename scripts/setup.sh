#!/usr/bin/env bash
# Installs and prepares everything inband needs on a fresh Debian 12 machine.
# Idempotent: each step checks before it acts. Run as root.
# --packages: only the system packages (scripts/test.sh, before it has
# the tree it builds in).
# --no-build: everything but building `inband` (scripts/test.sh: its test
# build makes the binary too, with the features cargo unifies for the
# tests; a plain build first compiled every crate of ours a second time,
# under the plain build's features: 86 s of CI).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '== %s\n' "$*" >&2; }

APT_PACKAGES=(
  clang llvm libelf-dev zlib1g-dev pkg-config make gcc libbpf-dev linux-libc-dev bpftool
  iproute2 iputils-ping netcat-openbsd tcpdump ethtool curl util-linux procps  # procps: sysctl in test and bench namespaces
  jq  # scripts/rust-tests.sh reads cargo's list of test binaries
  rsync  # scripts/test.sh brings its fixed build tree to the clone's content
  nftables haproxy wrk python3-venv linux-perf
  librocksdb-dev  # inband-cache links it instead of building RocksDB (.cargo/config.toml)
  nginx varnish  # peers of `inband proxy` in bench/proxy.py, run only with the benchmark's own configs
  nghttp2-client  # h2load: HTTP/2 hits in bench/frontdoor.py
  openssl  # the proxy's TLS tests: s_client (SNI, ALPN, resumption, OCSP) and the test CA, OCSP responses
  cmake g++  # build HiGHS, the weights controller's ILP solver (highs-sys, once per target dir)
  bird2  # BGP between the ECMP testbed's router and the balancer instances, run with the testbed's own configs
  prometheus  # crates/inband/tests/dashboard.rs scrapes a testbed to check deploy/grafana/inband.json's queries, with its own config
)
# The peers' Debian services must never run: they would listen on :80,
# :6081 and :9090 and take CPU from the benchmarks. No policy-rc.d keeps postinst from
# starting them (one that exists, e.g. Docker's, is left alone); systemd
# units are disabled and stopped below.
SERVICES=(nginx varnish varnishncsa bird prometheus)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ -d /run/systemd/system ]; then
  for s in "${SERVICES[@]}"; do
    systemctl disable -q --now "$s" 2>/dev/null || true
  done
fi
[ "${1:-}" != "--packages" ] || exit 0

if ! command -v cargo >/dev/null; then
  [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null || { echo "cargo (Rust stable) is required: install it with rustup" >&2; exit 1; }

# bpffs for pinned maps; tracefs for the agent's tracepoint.
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true

# The build lives outside the clone (target -> /var/cache/inband/target, or
# INBAND_BUILD_CACHE), so a fresh clone on a machine that built before
# reuses every compiled dependency; the Python environment beside it
# (.venv -> <build>-venv), so a fresh clone creates and fills none.
cache=${INBAND_BUILD_CACHE:-/var/cache/inband/target}
cache=${cache%/}

# Python for the benchmark drivers, pinned in bench/requirements.txt.
if [ -f bench/requirements.txt ]; then
  if [ ! -e .venv ] && [ ! -L .venv ]; then
    mkdir -p "$(dirname "$cache")" && ln -s "$cache-venv" .venv
  fi
  if [ ! -x .venv/bin/python ]; then
    log "python: creating .venv"
    python3 -m venv "$(readlink -f .venv)"
  fi
  if ! cmp -s bench/requirements.txt .venv/.installed-requirements 2>/dev/null; then
    log "python: installing bench/requirements.txt"
    .venv/bin/pip install -q --disable-pip-version-check -r bench/requirements.txt
    cp bench/requirements.txt .venv/.installed-requirements
  fi
fi

[ -e target ] || [ -L target ] || ln -s "$cache" target
# A target directory made before setup (cargo run by hand first) is the
# build directory then, and carries the stamp below; a link whose
# directory is gone gets it again.
cache=$(readlink -m target)
mkdir -p "$cache"
# A clone's own crates are rebuilt in every clone (their sources are new to
# cargo), under artifact names of that clone: when the build directory last
# served another clone, drop the workspace's artifacts, so it holds the
# dependencies and one clone's build rather than one build per clone ever run.
here=$(pwd -P)
if [ "$(cat "$cache/.clone" 2>/dev/null)" != "$here" ]; then
  # Test binaries: tests/NAME.rs, or tests/NAME/main.rs for one made of modules.
  tests=$( (find crates/*/tests -maxdepth 1 -name '*.rs'; find crates/*/tests -mindepth 2 -maxdepth 2 -name main.rs) | sed 's|/main\.rs$||; s|\.rs$||; s|.*/||')
  for n in $( (sed -n 's/^name = "\(.*\)"/\1/p' crates/*/Cargo.toml; echo "$tests") | tr - _ | sort -u); do
    rm -rf "$cache"/debug/deps/"$n"-* "$cache"/debug/deps/lib"$n"-* "$cache"/debug/incremental/"$n"-* \
      "$cache"/debug/.fingerprint/"${n//_/-}"-* "$cache"/debug/build/"${n//_/-}"-*
  done
  echo "$here" >"$cache/.clone"
fi

if [ "${1:-}" != "--no-build" ]; then
  log "building inband"
  cargo build -q -p inband --bin inband
fi

#!/usr/bin/env bash
# Runs every test: C wire vectors, Rust unit tests, BPF packet fixtures,
# namespace integration tests, and the benchmark driver's smoke test.
# Installs what it needs first (scripts/setup.sh). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's seconds are printed as it ends: where CI's minutes go.
phase() { echo "== $1 ($((SECONDS - start)) s)"; start=$SECONDS; }
start=$SECONDS
./scripts/setup.sh --no-build
export PATH="$HOME/.cargo/bin:$PATH"
phase "setup done"

echo "== C: wire format vectors"
make -s -C tests/c
phase "C done"

echo "== Rust: unit, fixture and integration tests of every crate"
./scripts/rust-tests.sh
phase "Rust done"

if [ -d bench/tests ]; then
  echo "== Python: benchmark driver"
  # The drivers' smoke runs check what they do, not their numbers: they
  # run the binary cargo test built (bench/lib/preflight.py).
  INBAND_BENCH_BUILD=0 .venv/bin/python -m pytest -q bench/tests
  phase "Python done"
fi

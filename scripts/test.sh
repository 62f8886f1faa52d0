#!/usr/bin/env bash
# Runs every test: C wire vectors, Rust unit tests, BPF packet fixtures,
# namespace integration tests, and the benchmark driver's smoke test.
# Installs what it needs first (scripts/setup.sh). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"

echo "== C: wire format vectors"
make -s -C tests/c

echo "== Rust: unit, fixture and integration tests of every crate"
./scripts/rust-tests.sh

if [ -d bench/tests ]; then
  echo "== Python: benchmark driver"
  .venv/bin/python -m pytest -q bench/tests
fi

#!/usr/bin/env bash
# Runs every test: C wire vectors, Rust unit tests, BPF packet fixtures,
# namespace integration tests, and the benchmark driver's smoke test.
# Installs what it needs first (scripts/setup.sh). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build and test in one fixed tree beside the build directory, brought to
# this tree's content first. cargo decides what to rebuild by file times,
# and a fresh clone's files are all new: building there recompiled every
# crate of ours on each run (93-132 s of CI). Copying by content
# (rsync --checksum, times not kept) rewrites only the files that differ,
# so only what changed since the last run is rebuilt, and a file that
# changed is always newer than what was built from it. What git ignores
# is not copied, and stays in the tree (its target and .venv links).
# One run at a time holds the tree and the build directory it shares;
# flock -o keeps the lock out of the daemons the tests start.
#
# The build directory is shared with every clone, and cargo names a
# crate's artifacts the same from any directory: a build of ours from
# another directory since setup.sh last took the build directory for
# this tree (stamp .clone) may be newer than the tree's files, and would
# be taken as fresh. Its dep-info files name that directory; if there is
# one, the stamp is dropped, and setup.sh drops our crates' artifacts as
# it does for a build directory that served another clone.
cache=${INBAND_BUILD_CACHE:-/var/cache/inband/target}
tree=${cache%/}-tree
mkdir -p "$tree" && tree=$(cd "$tree" && pwd -P)
if [ "$(pwd -P)" != "$tree" ]; then
  command -v rsync >/dev/null || ./scripts/setup.sh --packages
  rc=0
  flock -o -w 3600 -E 75 "$tree.lock" bash -c '
    rsync -r --links --perms --checksum --delete --filter=":- .gitignore" ./ "$0/" &&
      exec "$0/scripts/test.sh"' "$tree" || rc=$?
  [ "$rc" != 75 ] || echo "another test run has held $tree for an hour" >&2
  exit "$rc"
fi

stamp=target/.clone
foreign=$(find target/debug/deps -maxdepth 1 -name '*.d' -newer "$stamp" -exec grep -L -e "^$tree/target/" {} + 2>/dev/null || true)
[ -z "$foreign" ] || rm -f "$stamp"

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

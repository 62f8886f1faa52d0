#!/usr/bin/env bash
# Runs every Rust test binary of the workspace: first the ones that assert
# only on bytes, counters and maps, several binaries at once; then, one at a
# time, the ones that assert on latencies, rates and timeouts (MEASURING),
# which must not measure their neighbours' load. Each binary still runs its
# own tests on its threads; binaries side by side are safe because every
# test names its network namespaces, pins and testbeds after its process id
# and holds every port it uses. In the parallel phase the slowest binaries
# of the previous run start first (their times are kept beside the build).
# Prints each failing binary's output and exits non-zero if any failed.
#
# Written here rather than taken from cargo-nextest: nextest has no Debian
# package and building it from source would add minutes to every fresh
# machine; what we need is binary-level parallelism, which is these lines.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${INBAND_TEST_JOBS:-3}
MEASURING=" e2e health lifecycle regimes scale_out security weights bench_dataplane "
# Test threads per binary where the default (one per core) leaves the
# cores idle: scale_out's tests spend their minute each waiting on
# downloads held to 64 Mbit/s and on route changes: four side by side
# take 80 s for the binary instead of 120 s.
THREADS=" scale_out=4 "
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
times=target/rust-test-times.txt

# Every test executable with the package directory cargo would run it in.
if ! cargo test --workspace --no-run --message-format=json >"$logs/build.json" 2>"$logs/build.err"; then
  cat "$logs/build.err" >&2
  jq -r 'select(.reason == "compiler-message") | .message.rendered' "$logs/build.json" >&2
  exit 1
fi
echo "built the test binaries in $SECONDS s"
jq -r 'select(.reason == "compiler-artifact" and .profile.test and .executable != null)
       | "\(.executable) \(.manifest_path | rtrimstr("/Cargo.toml"))"' "$logs/build.json" >"$logs/list"
[ -s "$logs/list" ] || { echo "no test binaries found" >&2; exit 1; }

# Slowest first, by the last run's seconds (unknown ones first of all).
while read -r exe dir; do
  name=$(basename "$exe")
  secs=$( (cat "$times" 2>/dev/null || true) | awk -v n="${name%-*}" '$1 == n { s = $2 } END { print s }')
  echo "${secs:-9999} $exe $dir"
done <"$logs/list" | sort -rn >"$logs/order"

run_one() {
  local exe=$1 dir=$2 logs=$3 name start rc threads
  name=$(basename "$exe")
  start=$(date +%s)
  rc=0
  threads=$(tr ' ' '\n' <<<"$THREADS" | sed -n "s/^${name%-*}=//p")
  (cd "$dir" && env ${threads:+RUST_TEST_THREADS=$threads} "$exe") >"$logs/$name.log" 2>&1 || rc=$?
  echo "${name%-*} $(($(date +%s) - start)) $rc" >>"$logs/results"
  printf '%-28s %4ss %s\n' "${name%-*}" "$(($(date +%s) - start))" "$([ $rc = 0 ] && echo ok || echo FAILED)"
}
export -f run_one
export THREADS
measuring() { local n; n=$(basename "$1"); [[ $MEASURING == *" ${n%-*} "* ]]; }
while read -r _ exe dir; do measuring "$exe" || echo "$exe $dir"; done <"$logs/order" \
  | xargs -P "$jobs" -L 1 bash -c 'run_one "$0" "$1" '"$logs"
while read -r _ exe dir; do
  if measuring "$exe"; then run_one "$exe" "$dir" "$logs"; fi
done <"$logs/order"

awk '{ print $1, $2 }' "$logs/results" >"$times"
failed=$(awk '$3 != 0 { print $1 }' "$logs/results")
total=$(awk '{ n += 1 } END { print n }' "$logs/results")
tests=$(cat "$logs"/*.log | awk '/^test result:/ { p += $4; f += $6 } END { print p + 0, "passed,", f + 0, "failed" }')
if [ -n "$failed" ]; then
  for n in $failed; do
    echo "==== $n"
    cat "$logs/$n"-*.log
  done
  echo "Rust tests: $tests; failing binaries: $failed" >&2
  exit 1
fi
echo "Rust tests: $total binaries, $tests"

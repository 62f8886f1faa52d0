#!/usr/bin/env bash
# The main job: installs what is needed, builds, brings up a namespace
# testbed (client, balancer, three heterogeneous servers), runs every mode
# and the peers (HAProxy, nftables) under the same HTTP load (the quick
# profile, 45 s each), then the paper's setup (two identical servers) with
# the paper's four rows, prints Table 3 beside the paper's ratios for both,
# and tears everything down.
# The record and its tables land in results/demo-<time>/ (not in the committed
# bench/results/paper), CSV and plots in results/demo-<time>/{ours,paper}/.
# Run as root. Extra arguments go to the driver (python -m bench.paper --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
out="results/demo-$(date +%Y%m%d-%H%M%S)"
exec .venv/bin/python -m bench.paper --profile quick --servers both --out "$out" --results "$out" "$@"

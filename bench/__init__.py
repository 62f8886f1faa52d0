"""Benchmark drivers for inband.

`python -m bench.paper` reproduces the paper's evaluation (Table 3, Fig. 3,
Fig. 4) on a network-namespace testbed, side by side with HAProxy and
nftables. See docs/benchmarks.md.
"""

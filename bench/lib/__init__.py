"""What every benchmark driver shares, so that each driver (bench/<study>.py)
holds only its study and imports nothing but this package:

- procs: processes in namespaces, started, stopped, bounded in time;
- testbed: an `inband testbed` (bring up, tear down, its nodes' names
  and addresses) and the steps every testbed run repeats;
- peers: the configuration files of inband, HAProxy, nftables, nginx and
  Varnish that the drivers start;
- profiles: choosing a driver's profile by name, with overrides;
- preflight: the checks before a run (root, binaries, a free testbed
  name) and what else is running on the machine;
- stats: percentiles and ratios;
- host: CPU time of the machine and of processes, BPF program counters;
- tools: the output of the load generators (wrk, the open loop);
- locust: the per-request records of Locust runs and their summaries;
- paperbed: the Locust testbed the paper and regimes studies share;
- report: Markdown tables and cell formats;
- results: a run's record (commit, machine, load average, command, date,
  rows), written under bench/results/<study>/;
- outcome: what a run's failures come to;
- origin, the proxy benchmark's origin server (a program of its own).
"""

"""The cache study's tables from a record (the run itself needs root and
BPF: crates/inband/tests/trace.rs runs it): shares of the workers' wall
time, an unsupported cell with its reason, the top calls those the
operations make, the store's threads apart."""

from __future__ import annotations

from bench import cachestudy
from driver_runs import table_rows


def part(wall, user, sys, calls, threads=1):
    return {"threads": threads, "wall_s": wall, "user_s": user, "sys_s": sys, "minor_faults": 30, "major_faults": 2,
            "voluntary_switches": 0, "involuntary_switches": 10, "calls": calls}


def record():
    workers = part(2.0, 0.5, 0.5, {"io_read": {"count": 1000, "ns": 400_000_000}, "io_write": {"count": 0, "ns": 0}})
    store = part(2.0, 0.1, 0.2, {"io_write": {"count": 10, "ns": 50_000_000}})
    run = {"backend": "rocksdb", "mix": "C", "about": "reads only", "threads": 1, "ops": 1000, "ops_per_s": 500.0, "p50_us": 10.0,
           "p99_us": 900.0, "user_s": 0.6, "sys_s": 0.7, "minor_faults": 30, "major_faults": 2, "scanned": 0,
           "workers": workers, "store": store, "main": part(2.0, 0, 0, {}),
           "by_thread": [{"tid": 1, "name": "worker-0", "role": "worker", **workers}, {"tid": 2, "name": "rocksdb:low", "role": "store", **store}],
           "top_calls": [{"name": "clock_nanosleep", "category": "sync", "count": 1, "ns": 2_000_000_000},
                         {"name": "futex", "category": "sync", "count": 1000, "ns": 900_000_000},
                         {"name": "pread64", "category": "io_read", "count": 1000, "ns": 400_000_000}],
           "tracer_lost": {}}
    unsupported = {"backend": "files", "mix": "E", "about": "scans", "threads": 1, "unsupported": "mix E scans, and the files store keeps no order"}
    return {"study": "cachestudy", "command": "python -m bench.cachestudy", "commit": {"sha": "0" * 40, "dirty": False},
            "started_utc": "2026-11-29T05:00:00Z", "wall_s": 60, "machine": {"cores": 2, "cpu": "x", "kernel": "6.18"},
            "load_average": {"start": [0.5, 0, 0], "end": [0.7, 0, 0]},
            "profile": {"records": 1000, "value_bytes": 10240, "zipf": 0.99, "threads": 1, "seconds": 2.0, "scan_max": 100,
                        "machine_shared": "2 vCPUs shared"},
            "fills": [{"backend": "rocksdb", "load_s": 1.5}, {"backend": "files", "load_s": 2.5}], "rows": [run, unsupported]}


def test_cells_render_as_shares_of_the_workers_time():
    md = cachestudy.render(record())
    rows = table_rows(md, "| store | mix |")
    assert rows[0][:15] == ["rocksdb", "C", "500", "10.0", "900.0", "25.0", "25.0", "50.0", "20.0", "0.0", "0.0", "0.0", "0.0", "5", "1.00"]
    assert rows[0][15:19] == ["0.03", "2", "300", "50"]
    # Neither the futex waits of a store thread (as often as the reads)
    # nor the main thread's one long sleep are the operations' calls.
    assert rows[0][19] == "pread64 400 µs"
    assert rows[1][:3] == ["files", "E", "not supported: mix E scans, and the files store keeps no order"]
    threads = table_rows(md, "| store | mix | thread |")
    assert threads == [["rocksdb", "C", "rocksdb:low", "300", "0.0", "50.0", "0.0", "0.0", "0.0"]]
    assert "allocations/op" not in md


def test_the_memory_pass_has_its_own_table():
    r = record()
    r["rows"][0]["memory"] = {"ops": 100, "allocs_per_op": 7.0, "alloc_bytes_per_op": 20480.0, "frees_per_op": 6.5, "pages_per_op": 0.25}
    rows = table_rows(cachestudy.render(r), "| store | mix | allocations/op |")
    assert rows == [["rocksdb", "C", "7.00", "20.0", "6.50", "0.25"]]

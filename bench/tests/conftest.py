"""The drivers' end-to-end runs, spread over the workers that pytest.ini
starts: each in one of four groups of about the same length (seconds
each took on the 2-CPU machine, beside one another), the longest group
work first; the tests without a testbed fill in around them."""

from __future__ import annotations

import pytest

GROUPS = (
    # 320-395 s each: the official CI's seconds of each test (four workers
    # on two CPUs); the longest group sets the phase's length (there the
    # first group was 438 s, with both fault-driving runs in it).
    {"test_weights.py::test_tiny_profile_end_to_end": 185, "test_health.py::test_quick_profile_end_to_end": 139},
    {"test_scaleout.py::test_tiny_profile_end_to_end": 179, "test_paper_tiny.py::test_tiny_profile_end_to_end": 122,
     "test_proxy.py::test_quick_run_end_to_end": 56, "test_frontdoor.py::test_quick_profile_end_to_end": 37},
    {"test_regimes.py::test_tiny_grid_end_to_end": 163, "test_mesh.py::test_tiny_profile_end_to_end": 94,
     "test_resilience.py::test_tiny_profile_end_to_end": 57, "test_handoff.py::test_tiny_profile_end_to_end": 48},
    {"test_handoff.py::test_fault_rows_fall_back_or_lose_only_what_the_fault_takes": 114,
     "test_paper_tiny.py::test_tiny_profile_on_the_papers_two_servers": 73, "test_forwarding.py::test_tiny_profile_end_to_end": 70,
     "test_ecmp.py::test_tiny_profile_end_to_end": 57, "test_regimes.py::test_fleet_regime_runs_real_instances_each_placing_its_share": 46,
     "test_conformance.py::test_inband_passes_every_case": 31},
)
GROUP_OF = {test: g for g, tests in enumerate(GROUPS) for test in tests}
SECONDS = {test: s for tests in GROUPS for test, s in tests.items()}


def pytest_collection_modifyitems(config, items):
    for item in items:
        g = GROUP_OF.get(f"{item.path.name}::{item.name}")
        if g is not None:
            item.add_marker(pytest.mark.xdist_group(f"testbed{g}"))
    # Grouped runs first (a worker takes a group whole), longest first.
    items.sort(key=lambda item: (GROUP_OF.get(f"{item.path.name}::{item.name}", len(GROUPS)),
                                 -SECONDS.get(f"{item.path.name}::{item.name}", 0)))

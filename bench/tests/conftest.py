"""The longest tests start first (measured on the 2-CPU machine: the
drivers' end-to-end runs, seconds each), so that with several workers
(pytest.ini) the last test to start is a short one."""

from __future__ import annotations

SECONDS = {
    "test_scaleout.py::test_tiny_profile_end_to_end": 154,
    "test_weights.py::test_tiny_profile_end_to_end": 122,
    "test_regimes.py::test_tiny_grid_end_to_end": 83,
    "test_health.py::test_quick_profile_end_to_end": 78,
    "test_paper_tiny.py::test_tiny_profile_end_to_end": 70,
    "test_ecmp.py::test_tiny_profile_end_to_end": 47,
    "test_forwarding.py::test_tiny_profile_end_to_end": 46,
    "test_resilience.py::test_tiny_profile_end_to_end": 40,
    "test_proxy.py::test_quick_run_end_to_end": 40,
    "test_paper_tiny.py::test_tiny_profile_on_the_papers_two_servers": 37,
    "test_mesh.py::test_tiny_profile_end_to_end": 34,
    "test_conformance.py::test_inband_passes_every_case": 9,
}


def pytest_collection_modifyitems(config, items):
    def key(item):
        return -SECONDS.get(f"{item.path.name}::{item.name}", 0)

    items.sort(key=key)  # stable: the rest keep their order

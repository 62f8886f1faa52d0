"""What a benchmark compares: each system under test by the name
`--systems` takes and the label its rows carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    key: str
    label: str

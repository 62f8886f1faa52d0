"""A driver's profiles: named, frozen dataclasses of the numbers that size a
run (how long, how many, how fast). `choose` picks one and applies the
command line's overrides, so that the record of a run holds the profile
it really ran with."""

from __future__ import annotations

import dataclasses


def choose(profiles: dict, name: str, **overrides):
    """The profile `name`, with every override that is not None."""
    p = profiles[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(p, **given) if given else p


def as_json(name: str, profile) -> dict:
    return {"name": name, **dataclasses.asdict(profile)}

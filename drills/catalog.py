"""Every drill, in the issue's numbering."""

from __future__ import annotations

from drills import (
    answers,
    brokers,
    crashes,
    database,
    failover,
    intake,
    operations,
    partitions,
    regions,
    slowness,
)
from drills.base import Drill

DRILLS: list[Drill] = sorted(
    [*crashes.DRILLS, *answers.DRILLS, *operations.DRILLS, *database.DRILLS,
     *intake.DRILLS, *failover.DRILLS, *partitions.DRILLS, *slowness.DRILLS,
     *brokers.DRILLS, *regions.DRILLS],
    key=lambda d: d.number)


def find(name: str) -> Drill | None:
    """A drill by name or number."""
    for drill in DRILLS:
        if name in (drill.name, str(drill.number)):
            return drill
    return None

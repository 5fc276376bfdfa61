"""How a drill's outcome becomes a verdict: pass with facts, fail with the reason on one
line, skip with why, and an unexpected error is a failure, never a pass."""

from __future__ import annotations

from typing import Any

import pytest

from drills.base import Drill, DrillSkipped, Facts, check
from drills.catalog import DRILLS, find
from drills.runner import run_drill


def drill(run: Any) -> Drill:
    return Drill(99, "example", "setup", "fault", "assertion", run)


async def test_pass_carries_the_facts() -> None:
    async def run(_stage: Any) -> Facts:
        return {"calls": 2, "recovery_s": 1.234}

    verdict = await run_drill(drill(run), "postgresql://unused")
    assert verdict.status == "pass" and verdict.passed
    assert "calls=2 recovery_s=1.23" in verdict.line()


async def test_a_failed_check_is_one_line_with_its_reason() -> None:
    async def run(_stage: Any) -> Facts:
        check(1 + 1 == 3, "arithmetic is off")
        return {}

    verdict = await run_drill(drill(run), "postgresql://unused")
    assert verdict.status == "fail"
    assert "\n" not in verdict.line() and "arithmetic is off" in verdict.line()
    assert verdict.as_json()["status"] == "fail"


@pytest.mark.parametrize(("error", "status"), [(DrillSkipped("no binaries"), "skip"),
                                               (RuntimeError("boom"), "fail")])
async def test_skips_and_crashes(error: Exception, status: str) -> None:
    async def run(_stage: Any) -> Facts:
        raise error

    verdict = await run_drill(drill(run), "postgresql://unused")
    assert verdict.status == status
    assert str(error) in verdict.line()


def test_the_catalog_names_each_drill_once() -> None:
    numbers = [d.number for d in DRILLS]
    assert numbers == sorted(set(numbers))
    # the first issue's twenty drills, then failover and the network (#49), then broker
    # mode (#48)
    assert set(range(1, 40)) == set(numbers)
    assert all(find(str(d.number)) is d and find(d.name) is d for d in DRILLS)

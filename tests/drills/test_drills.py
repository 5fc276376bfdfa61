"""The release suite: every drill against a fresh database, real `sweeper` processes and the
fake upstream. A drill that cannot run here (no root for a network namespace, no RabbitMQ
installation for broker mode's nodes) skips, and fails under SWEEPER_REQUIRE_TOOLS, as CI
runs it: it never skips in CI."""

from __future__ import annotations

import os

import pytest

from drills.catalog import DRILLS, Drill
from drills.runner import run_drill


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("drill", DRILLS, ids=[f"{d.number:02d}-{d.name}" for d in DRILLS])
async def test_drill(drill: Drill, db_url: str) -> None:
    verdict = await run_drill(drill, db_url)
    print(verdict.line())
    if verdict.status == "skip" and not os.environ.get("SWEEPER_REQUIRE_TOOLS"):
        pytest.skip(verdict.line())
    assert verdict.status == "pass", f"{verdict.line()}\n{verdict.details()}"

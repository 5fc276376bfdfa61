"""Which database errors mean "busy, retry later" (503) rather than a bug (500)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from sqlalchemy import exc as sa_exc

from service.db.engine import is_busy
from service.observability.failures import repeat
from service.observability.metrics import REGISTRY


class _DriverError(Exception):
    def __init__(self, pgcode: str) -> None:
        super().__init__(pgcode)
        self.pgcode = pgcode


@pytest.mark.parametrize(("sqlstate", "busy"), [
    ("57014", True),   # statement timeout, e.g. behind an idle-in-transaction lock holder
    ("55P03", True),   # lock timeout
    ("40P01", True),   # deadlock victim
    ("40001", True),   # serialization failure
    ("53300", True),   # too many connections
    ("53200", True),   # out of memory
    ("23505", False),  # unique violation: a bug or a conflict, not load
    ("42P01", False),  # undefined table
])
def test_busy_sqlstates(sqlstate: str, busy: bool) -> None:
    error = sa_exc.DBAPIError("INSERT ...", {}, _DriverError(sqlstate))
    assert is_busy(error) is busy


def test_other_errors_are_not_busy() -> None:
    assert not is_busy(RuntimeError("boom"))


async def test_a_background_loop_outlives_every_failure_but_its_cancellation(
        caplog: pytest.LogCaptureFixture) -> None:
    """`repeat` (retention, hold maintenance): an unreachable database is a warning, any
    other failure an internal error (its class logged, counted), and both are tried again
    next time."""
    counted = REGISTRY.get_sample_value("sweeper_internal_errors_total",
                                        {"where": "maintenance"}) or 0.0
    failures: list[BaseException] = [ConnectionRefusedError(), ValueError("bug")]
    turns = 0
    stop = asyncio.Event()

    async def step() -> None:
        nonlocal turns
        turns += 1
        if failures:
            raise failures.pop(0)
        stop.set()

    logger = logging.getLogger("tests.repeat")
    with caplog.at_level(logging.WARNING, logger="tests.repeat"):
        loop = asyncio.create_task(repeat(step, every_s=0, what="chores", logger=logger))
        await asyncio.wait_for(stop.wait(), timeout=5)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
    assert turns >= 3  # it went on after the two failures (until cancelled)
    assert [(r.levelno, r.getMessage(), getattr(r, "error_type", None))
            for r in caplog.records] == [
        (logging.WARNING, "chores: database unavailable or busy", None),
        (logging.ERROR, "internal error", "ValueError")]
    assert "bug" not in caplog.text  # the class, never the text
    assert REGISTRY.get_sample_value("sweeper_internal_errors_total",
                                     {"where": "maintenance"}) == counted + 1

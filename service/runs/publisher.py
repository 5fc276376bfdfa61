"""The publisher: the leader's duty that publishes the runs left in state `publishing` (new
ones, or ones a crash interrupted), one pass of `publication.publish_pending` at a time.

The leader (service/cluster/leader.py) starts it with its term: each chunk commits only
while that term's lease holds, and the loop ends at the first pass that finds the term
over. A pass starts as soon as a run is created on this replica (`wake`, set by
`Runtime.wake_publisher`), and otherwise every POLL_INTERVAL_S.

A run's own error is handled inside `publish_pending` (a retry, or the run marked failed
and logged once); one that reaches the loop came from listing the runs, and the next pass
lists them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.errors import NotLeader
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where
from service.runs import publication
from service.runs.discovery import Discovery

log = logging.getLogger(__name__)

POLL_INTERVAL_S: Final = 1.0  # between passes when no new run wakes the publisher


@dataclass(frozen=True)
class Publisher:
    """Publication as the leader of `term`: `run()` until the term ends, `run_once()` one
    pass."""

    engine: AsyncEngine
    discovery: Discovery
    batch_size: int
    term: int
    wake: asyncio.Event
    poll_interval_s: float = POLL_INTERVAL_S
    errors: InternalErrors = field(default_factory=lambda: InternalErrors(log))

    async def run_once(self) -> bool:
        """One pass over the runs being published; False once the term has ended."""
        try:
            await publication.publish_pending(self.engine, batch_size=self.batch_size,
                                              discovery=self.discovery, term=self.term)
        except NotLeader:
            log.warning("publisher: the leader's term ended; publication stops here",
                        extra={"term": self.term})
            return False
        except Exception as exc:
            if expected(exc):
                log.warning("publisher: database unavailable or busy",
                            extra={"error_type": type(exc).__name__})
            else:
                self.errors.caught(Where.PUBLISHER, exc)
        return True

    async def run(self) -> None:
        """Pass after pass, each after a wake-up or the poll interval, until the term ends."""
        while True:
            # cleared before the pass: a run created while it lists runs wakes the next one
            self.wake.clear()
            if not await self.run_once():
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval_s):
                    await self.wake.wait()

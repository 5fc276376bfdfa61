"""How a pool learns of legal holds for its send gate (hold_gate.py): at once when the
wake-up port reports one placed, else every HOLD_POLL_S; each hold learned revokes the
covered calls not started yet and is acknowledged in the database, naming them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where
from service.worker.hold_gate import HoldGate
from service.worker.ports import Clock, HoldPort

log = logging.getLogger("service.worker")

# How often a process looks for new legal holds without a notification (a hold placed while
# it holds a covered lease answers within about this long when notifications are lost).
HOLD_POLL_S: Final = 1.0


class HoldWatch:
    """Learns the holds `port` reports into `gate`; `placed` is set when one is placed."""

    def __init__(self, port: HoldPort, gate: HoldGate, clock: Clock,
                 errors: InternalErrors) -> None:
        self._port = port
        self._gate = gate
        self._clock = clock
        self._errors = errors
        self.placed = asyncio.Event()
        self._unacked: dict[int, list[int]] = {}  # revoked calls by hold, not yet acknowledged

    async def learn(self) -> None:
        """Learn of the holds placed since the last one learned: revoke the calls they
        cover that have not started, then acknowledge them (with those calls)."""
        latest = await self._port.latest_hold()
        known = self._gate.known
        if known is None or latest > known:
            # not read at the start (the database was away): every hold in force
            covers = await self._port.holds_since(known or 0)
            for hold_id, revoked in self._gate.learn(covers, self._clock.monotonic()).items():
                self._unacked.setdefault(hold_id, []).extend(revoked)
        if self._unacked:
            await self._port.acknowledge(self._unacked)
            self._unacked = {}
        self._gate.known = max(latest, known or 0)

    async def watch(self) -> None:
        """Learn at each placement or poll, until cancelled; survives outages."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_POLL_S):
                    await self.placed.wait()
            self.placed.clear()
            try:
                await self.learn()
            except Exception as exc:
                if expected(exc):
                    log.warning("workers: holds could not be read; trying again")
                else:
                    self._errors.caught(Where.HOLDS_WATCH, exc)

"""The pool's writes waiting for the database, each kind in a bounded buffer of its own
(flush_buffer.py), so that none holds back another: the outcomes of calls made
(completions), the leases of calls never made (handed back with their tokens), and scope
signals (signals.py). A flush writes them in that order, each in its own statements; what a
write could not take waits for the next flush, and a buffer whose write failed rests
FLUSH_RETRY_S. Why writes are grouped: bench/reports/design-notes.md, "The worker pool".

Beside them, the tally of what this process saw (service/history/tally.py) is added to the
ledger's minutes every WRITE_EVERY_S: for the console's charts, never an obligation, so its
failure holds nothing else back and a flush is written without it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Final

from service.history.tally import WRITE_EVERY_S, Tally
from service.ledger.completions import Completion
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import LeaseReturn, Where
from service.worker.call_traces import CallTraces
from service.worker.calls import Call
from service.worker.flush_buffer import FlushBuffer
from service.worker.pipeline_metrics import PipelineCounts
from service.worker.ports import Clock, CompletionPort, MinutesPort, ScopeSignalPort
from service.worker.signals import SignalBuffer

log = logging.getLogger("service.worker")

WRITES_PER_FLUSH: Final = 1_000  # completions (or hand-backs) in one statement
FLUSH_RETRY_S: Final = 0.5  # after a write failed, before that buffer tries again


class PendingWrites:
    """Outcomes, hand-backs and scope signals waiting to be written through the ports;
    `completed` and `fenced` count the outcomes written so far."""

    def __init__(self, completion: CompletionPort, signals: ScopeSignalPort,
                 counts: PipelineCounts, errors: InternalErrors, clock: Clock,
                 traces: CallTraces, minutes: MinutesPort) -> None:
        self._port = completion
        self._minutes = minutes
        self._errors = errors
        self.tally = Tally()
        self._tally_at = clock.monotonic() + WRITE_EVERY_S  # its next write
        self._traces = traces
        self._counts = counts
        self._clock = clock
        self.outcomes: FlushBuffer[Completion] = FlushBuffer(
            self._complete, max_batch=WRITES_PER_FLUSH, where=Where.COMPLETIONS,
            errors=errors, logger=log)
        self.unstarted: FlushBuffer[tuple[Call, LeaseReturn]] = FlushBuffer(
            self._hand_back, max_batch=WRITES_PER_FLUSH, where=Where.HAND_BACK,
            errors=errors, logger=log)
        self.signals = SignalBuffer(signals, errors, self.tally, clock)
        self._retry_at: dict[Where, float] = {}  # a failed buffer's next try (monotonic)
        self.completed = 0
        self.fenced = 0

    async def flush(self, force: bool = False) -> bool:
        """Commit the outcomes gathered so far first, then hand back leases that were never
        called, then apply scope signals: each in its own statements, a failure of one
        never keeping the others back, and what fails kept for the next flush. A buffer
        whose write failed rests FLUSH_RETRY_S unless `force`. True when all are written."""
        written = True
        for buffer in (self.outcomes, self.unstarted, self.signals.buffer):
            if force or self._clock.monotonic() >= self._retry_at.get(buffer.where, 0.0):
                if await buffer.flush():
                    self._retry_at.pop(buffer.where, None)
                else:
                    self._retry_at[buffer.where] = self._clock.monotonic() + FLUSH_RETRY_S
            written = written and not len(buffer)
        if force or self._clock.monotonic() >= self._tally_at:
            await self._write_tally()
        return written

    async def _write_tally(self) -> None:
        """Add the tally to the ledger's minutes; on failure it is kept for the next try."""
        self._tally_at = self._clock.monotonic() + WRITE_EVERY_S
        if not self.tally:
            return
        taken = self.tally.take()
        try:
            await self._minutes.add_minutes(taken)
        except Exception as exc:
            self.tally.merge(taken)
            if expected(exc):
                log.warning("minutes: database unavailable or busy; kept for the next flush")
            else:
                self._errors.caught(Where.MINUTES, exc)

    async def _complete(self, batch: list[Completion]) -> None:
        with self._traces.flush(len(batch)) as flush:
            fenced = await self._port.complete(batch)
        self._traces.completed(batch, fenced, flush)
        self.completed += len(batch) - len(fenced)
        self.fenced += len(fenced)
        self._counts.completed(batch, set(fenced))
        self.tally.completed(batch, set(fenced))

    async def _hand_back(self, calls: list[tuple[Call, LeaseReturn]]) -> None:
        """Return the leases of calls that were never made, without an attempt, in one
        statement for the whole list (under CPU starvation whole rounds come due late), and
        the token of each, except a late one: refunded, the refill it stood for would be
        granted again beside the tokens due after it, and a second could exceed rate +
        burst (at a start, the refill from the first grant to the first call)."""
        leases = [lease for call, _ in calls for lease in call]
        tokens = [1 if i == 0 and reason not in (LeaseReturn.LATE_START,
                                                 LeaseReturn.LEASE_ENDING) else 0
                  for call, reason in calls for i in range(len(call))]
        await self._port.hand_back(leases, tokens)
        reasons: Counter[LeaseReturn] = Counter()
        for call, reason in calls:
            reasons[reason] += len(call)
        self._counts.returned(reasons, tokens=sum(tokens))

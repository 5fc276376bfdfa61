"""Scope effects gathered between flushes, applied for every replica in a few statements.

Each effect waits as one `Signal` (a closure, a pause, a refund, a cap, a recovery) in a
`FlushBuffer`; a flush merges them per scope and applies each kind in its own statement.
A kind whose statement fails keeps its signals for the next flush, whichever kind it is:
a refund, a cap or a recovery is not lost to an outage any more than a closure is. Why
merged: bench/reports/design-notes.md, "The worker pool".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

from service.budget import answer_effects
from service.budget.answer_effects import ScopeEffects
from service.budget.rules import Closure
from service.history.tally import Tally
from service.observability.failures import InternalErrors
from service.observability.metrics import SCOPE_SIGNALS, Where
from service.worker.flush_buffer import FlushBuffer, Unwritten
from service.worker.ports import Clock, ScopeSignalPort

log = logging.getLogger("service.worker")

_PAUSED = {answer_effects.UNAUTHORIZED: "scope paused: the upstream refused our credentials",
           answer_effects.NO_CREDENTIAL: "scope paused: its tenant has no credential for the "
                                        "upstream; it resumes when one arrives"}
SIGNALS_PER_FLUSH: Final = 1_000  # signals merged into one flush's statements


class Kind(Enum):
    CLOSE = "close"
    PAUSE = "pause"
    REFUND = "refund"
    CAP = "cap"
    RECOVERED = "recovered"


@dataclass(frozen=True)
class Signal:
    """One scope effect waiting to be applied."""

    kind: Kind
    scope: str
    closure: Closure | None = None
    reason: str = ""
    amount: float = 0.0


class SignalBuffer:
    """Closures, pauses, refunds, caps and recoveries waiting to be applied through
    `port`; what fails to apply is kept for the next attempt."""

    def __init__(self, port: ScopeSignalPort, errors: InternalErrors, tally: Tally,
                 clock: Clock) -> None:
        self._port = port
        self._tally, self._clock = tally, clock
        self._backed_off: set[str] = set()  # scopes this process saw back off
        self.buffer: FlushBuffer[Signal] = FlushBuffer(
            self._apply, max_batch=SIGNALS_PER_FLUSH, where=Where.SIGNALS, errors=errors,
            logger=log)

    @property
    def urgent(self) -> bool:
        """A closure or pause waits: it must reach every replica's next round now."""
        return any(s.kind in (Kind.CLOSE, Kind.PAUSE) for s in self.buffer.waiting)

    def note(self, policy: str, scope: str, effects: ScopeEffects) -> None:
        """`policy`'s answer had these effects on `scope`."""
        if effects.closure is not None:
            self._tally.closed(policy, scope, self._clock.now())
        for signal in effects.signals:
            SCOPE_SIGNALS.labels(signal).inc()
        noted: list[Signal] = []
        if effects.closure is not None:
            noted.append(Signal(Kind.CLOSE, scope, closure=effects.closure))
        if effects.pause is not None:
            noted.append(Signal(Kind.PAUSE, scope, reason=effects.pause))
        if effects.refund:
            noted.append(Signal(Kind.REFUND, scope, amount=effects.refund))
        if effects.cap is not None:
            noted.append(Signal(Kind.CAP, scope, amount=effects.cap))
        if effects.backs_off:
            self._backed_off.add(scope)
        elif effects.succeeded and scope in self._backed_off:
            # only scopes this process saw back off need their level reset
            self._backed_off.discard(scope)
            noted.append(Signal(Kind.RECOVERED, scope))
        self.buffer.add(noted)

    async def flush(self, where: Where | None = None) -> bool:
        """Apply what waits; True when no write failed."""
        return await self.buffer.flush(where)

    async def _apply(self, batch: list[Signal]) -> None:
        """Merge per scope and apply each kind in turn; a kind that fails is kept (Unwritten)
        while the kinds after it are still tried."""
        closures: dict[str, Closure] = {}
        pauses: dict[str, str] = {}
        refunds: dict[str, float] = {}
        caps: dict[str, float] = {}
        for s in batch:
            if s.kind is Kind.CLOSE and s.closure is not None:
                closures[s.scope] = answer_effects.merged(closures.get(s.scope), s.closure)
            elif s.kind is Kind.PAUSE:
                pauses[s.scope] = s.reason
            elif s.kind is Kind.REFUND:
                refunds[s.scope] = refunds.get(s.scope, 0.0) + s.amount
            elif s.kind is Kind.CAP:
                caps[s.scope] = min(s.amount, caps.get(s.scope, s.amount))
        recovered = sorted({s.scope for s in batch if s.kind is Kind.RECOVERED}
                           - set(closures) - set(pauses))
        left: list[Signal] = []
        failure: Exception | None = None

        async def step(kinds: Sequence[Kind], apply: Awaitable[object]) -> None:
            nonlocal failure
            try:
                await apply
            except Exception as exc:
                failure = failure or exc
                left.extend(s for s in batch if s.kind in kinds)

        await step([Kind.CLOSE], self._port.close(closures))
        # a closed scope's bucket restarts empty when it reopens: nothing to adjust
        await step([Kind.REFUND, Kind.CAP], self._port.adjust(
            {s: r for s, r in refunds.items() if s not in closures},
            {s: c for s, c in caps.items() if s not in closures}))
        await step([Kind.PAUSE], self._pause(pauses))
        await step([Kind.RECOVERED], self._port.recovered(recovered))
        if failure is not None:
            raise Unwritten(left) from failure

    async def _pause(self, pauses: dict[str, str]) -> None:
        for reason in sorted(set(pauses.values())):
            scopes = sorted(scope for scope, why in pauses.items() if why == reason)
            for scope in await self._port.pause(scopes, reason):
                log.warning(_PAUSED.get(reason, "scope paused"), extra={"scope": scope})

"""Scope effects gathered between flushes, applied for every replica in a few statements."""

from __future__ import annotations

import logging

from service import scope_signals
from service.limiter import Closure
from service.metrics import SCOPE_SIGNALS
from service.scope_signals import ScopeEffects
from service.worker.ports import ScopeSignalPort

log = logging.getLogger("service.worker")

_PAUSED = {scope_signals.UNAUTHORIZED: "scope paused: the upstream refused our credentials",
           scope_signals.NO_CREDENTIAL: "scope paused: its tenant has no credential for the "
                                        "upstream; it resumes when one arrives"}


class SignalBuffer:
    """Closures, pauses and recoveries waiting to be applied. A closure is never lost to an
    outage: what fails to apply is kept for the next attempt."""

    def __init__(self) -> None:
        self._closures: dict[str, Closure] = {}
        self._pauses: dict[str, str] = {}  # scope -> reason
        self._recovered: set[str] = set()
        self._backed_off: set[str] = set()  # scopes this process saw back off
        self._refunds: dict[str, float] = {}  # calls' worth of tokens to give back
        self._caps: dict[str, float] = {}  # the least the upstream said a bucket holds

    @property
    def urgent(self) -> bool:
        """A closure or pause waits: it must reach every replica's next round now."""
        return bool(self._closures or self._pauses)

    def note(self, scope: str, effects: ScopeEffects) -> None:
        for signal in effects.signals:
            SCOPE_SIGNALS.labels(signal).inc()
        if effects.closure is not None:
            self._closures[scope] = scope_signals.merged(self._closures.get(scope),
                                                         effects.closure)
        if effects.pause is not None:
            self._pauses[scope] = effects.pause
        if effects.refund:
            self._refunds[scope] = self._refunds.get(scope, 0.0) + effects.refund
        if effects.cap is not None:
            self._caps[scope] = min(effects.cap, self._caps.get(scope, effects.cap))
        if effects.backs_off:
            self._backed_off.add(scope)
        elif effects.succeeded and scope in self._backed_off:
            # only scopes this process saw back off need their level reset
            self._backed_off.discard(scope)
            self._recovered.add(scope)

    async def apply(self, port: ScopeSignalPort) -> None:
        closures, self._closures = self._closures, {}
        pauses, self._pauses = self._pauses, {}
        recovered, self._recovered = self._recovered - set(closures) - set(pauses), set()
        refunds, self._refunds = self._refunds, {}
        caps, self._caps = self._caps, {}
        try:
            await port.close(closures)
            # a closed scope's bucket restarts empty when it reopens: nothing to adjust
            await port.adjust({s: r for s, r in refunds.items() if s not in closures},
                              {s: c for s, c in caps.items() if s not in closures})
            for reason in sorted(set(pauses.values())):
                scopes = sorted(scope for scope, why in pauses.items() if why == reason)
                for scope in await port.pause(scopes, reason):
                    log.warning(_PAUSED.get(reason, "scope paused"), extra={"scope": scope})
            await port.recovered(sorted(recovered))
        except Exception:
            for scope, closure in closures.items():
                self._closures.setdefault(scope, closure)
            self._pauses = {**pauses, **self._pauses}
            raise

"""What the fake saw: each deletion call (`Call`), and the counters tests read back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """One deletion call as the fake saw it; ``outcome`` is "ok", "throttled" or a fault name,
    ``body`` the request body as text (UTF-8, undecodable bytes replaced). ``wall_time``
    (epoch) and ``received_at`` (monotonic) are when the request arrived, by the kernel's
    stamp (drills/upstream/arrivals.py), not when the fake's loop got to it."""

    method: str
    path: str
    query: str
    idempotency_key: str | None
    scope: str
    headers: dict[str, str]
    received_at: float
    wall_time: float
    outcome: str
    body: str = ""


class CallLog:
    """The recorded calls, throttled calls per scope, and calls in flight (overall and per
    idempotency key) with their high-water marks. Not locked itself: its owner holds a lock.
    With `keep` false only the counters are kept, not the calls (a benchmark's hundreds of
    thousands of calls would otherwise hold hundreds of MB in the fake)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.count = 0  # calls recorded, kept or not
        self.calls: list[Call] = []
        self.throttled: dict[str, int] = {}
        self._inflight, self._max_inflight = 0, 0
        self._inflight_key: dict[str, int] = {}
        self._max_key: dict[str, int] = {}
        self._overlapped: dict[str, int] = {}  # keys once in flight more than once at a time

    def record(self, call: Call) -> None:
        self.count += 1
        if self.keep:
            self.calls.append(call)
        if call.outcome == "throttled":
            self.throttled[call.scope] = self.throttled.get(call.scope, 0) + 1

    def enter(self, key: str | None, delta: int) -> None:
        """A call of `key` starts (+1) or ends (-1)."""
        self._inflight += delta
        self._max_inflight = max(self._max_inflight, self._inflight)
        if key is not None:
            n = self._inflight_key[key] = self._inflight_key.get(key, 0) + delta
            self._max_key[key] = max(self._max_key.get(key, 0), n)
            if n > 1:
                self._overlapped[key] = self._max_key[key]
            if n <= 0:
                del self._inflight_key[key]

    def max_in_flight(self, key: str | None = None) -> int:
        return self._max_inflight if key is None else self._max_key.get(key, 0)

    def stats(self) -> dict[str, Any]:
        """Counters whose size does not grow with the calls: a benchmark polls this every
        second through a million calls (bench/reports/design-notes.md, HTTP and
        statements)."""
        return {"calls": self.count, "throttled": dict(self.throttled),
                "max_in_flight": self._max_inflight,
                "keys_in_flight_together": dict(self._overlapped)}

    def reset(self) -> None:
        """Forget calls and throttled counts; the high-water marks restart from the calls
        still in flight."""
        self.calls.clear()
        self.count = 0
        self.throttled.clear()
        self._max_inflight = self._inflight
        self._max_key = dict(self._inflight_key)
        self._overlapped = {k: n for k, n in self._inflight_key.items() if n > 1}

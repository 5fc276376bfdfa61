"""Rate limits per scope, and the ``Retry-After`` of a throttled call.

A scope is what `scope_fn` names for a call (by default its ``X-Scope`` header, else
"default"). A scope is limited by an explicit `RateLimits.set`, else by the default limit,
else not at all. A limit is a token bucket (``per_second`` refill, ``burst`` capacity); with
``default_window`` the default limit is instead at most N accepted calls in any trailing
second (a sliding window). A throttled call is answered ``429`` with an integer
``Retry-After`` of at least 1.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ScopeFn = Callable[[str, str, Mapping[str, str]], str]


def default_scope(method: str, path: str, headers: Mapping[str, str]) -> str:
    return headers.get("x-scope", "default")


@dataclass
class Bucket:
    rate: float
    capacity: float
    tokens: float
    stamp: float


class RateLimits:
    """The limits, buckets and windows of every scope. Not locked itself: its owner holds a
    lock."""

    def __init__(self, default_limit: float | None, default_burst: int,
                 default_window: bool) -> None:
        if (default_limit is not None and default_limit <= 0) or default_burst < 1:
            raise ValueError("the default limit must be > 0 and its burst >= 1")
        if default_window and (default_limit is None or default_limit < 1
                               or default_limit != int(default_limit)):
            raise ValueError("a window limit counts whole calls per second: give a default "
                             "limit of at least 1, a whole number")
        self._default_limit, self._default_burst = default_limit, default_burst
        # the default limit as "at most N calls in any trailing second" instead of a bucket
        self._default_window = default_window
        self._limits: dict[str, tuple[float, int] | None] = {}
        self._buckets: dict[str, Bucket] = {}
        self._windows: dict[str, collections.deque[float]] = {}

    def set(self, scope: str, per_second: float | None, burst: int | None = None) -> None:
        """Limit `scope` to `per_second` (token bucket of `burst`); None makes it unlimited."""
        if per_second is not None and (per_second <= 0 or (burst is not None and burst < 1)):
            raise ValueError("per_second must be > 0 and burst >= 1")
        self._limits[scope] = None if per_second is None else (
            float(per_second), self._default_burst if burst is None else burst)
        self._buckets.pop(scope, None)

    def clear(self) -> None:
        """Forget explicit limits, buckets and windows (the default limit stays)."""
        self._limits.clear()
        self._buckets.clear()
        self._windows.clear()

    def take(self, scope: str, now: float) -> int | None:
        """Consume a token of `scope`; None if allowed, else the Retry-After seconds."""
        default = None if self._default_limit is None else (self._default_limit,
                                                            self._default_burst)
        cfg = self._limits.get(scope, default)  # an explicit None means unlimited
        if cfg is None:
            return None
        if self._default_window and scope not in self._limits:
            return self._window_slot(scope, now, int(cfg[0]))
        b = self._buckets.get(scope)
        if b is None:
            b = self._buckets[scope] = Bucket(cfg[0], float(cfg[1]), float(cfg[1]), now)
        b.tokens = min(b.capacity, b.tokens + (now - b.stamp) * b.rate)
        b.stamp = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - b.tokens) / b.rate))

    def _window_slot(self, scope: str, now: float, limit: int) -> int | None:
        """At most `limit` accepted calls in any trailing second of `scope`."""
        accepted = self._windows.setdefault(scope, collections.deque())
        while accepted and accepted[0] <= now - 1.0:
            accepted.popleft()
        if len(accepted) < limit:
            accepted.append(now)
            return None
        return max(1, math.ceil(accepted[0] + 1.0 - now))

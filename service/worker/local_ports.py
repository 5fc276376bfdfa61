"""The ports this process answers by itself: the system's clocks (`SystemClock`), and no
release notifications or legal holds to learn of (`NoWakeups`: the pool polls alone;
`NoHolds`: the in-memory ports of the pool's unit tests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

from service.worker.hold_gate import HoldCover


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class NoWakeups:
    """No release notifications: the pool polls (with backoff) alone."""

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None:
        await asyncio.Event().wait()


class NoHolds:
    """No legal holds to learn of."""

    async def latest_hold(self) -> int:
        return 0

    async def holds_since(self, after: int) -> list[HoldCover]:
        return []

    async def acknowledge(self, revoked: Mapping[int, Sequence[int]]) -> None:
        return None

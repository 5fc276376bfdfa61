"""The overall deadline of an upstream call, without a timer per call.

`asyncio.timeout()` schedules a timer and cancels it for every call: about 4.5 µs of CPU a
call here, a tenth of what a worker spends on an item. A call's deadline needs no finer
grain than TICK_S: each call joins the set of calls whose deadline falls in the same tick,
one timer per tick cancels those still running, and leaving the block just leaves the set.
A call therefore times out at its deadline or up to TICK_S after it, never before.

Semantics are asyncio.timeout's: the body's task is cancelled when the deadline passes, and
the CancelledError that results leaves the block as TimeoutError; a cancellation from
anywhere else (a shutdown) passes through as it came.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from types import TracebackType
from typing import Final

TICK_S: Final = 0.05


class _Call:
    """One call inside its deadline: the context manager `Deadlines.within` returns."""

    __slots__ = ("_calls", "cancelling", "expired", "task")

    def __init__(self, task: asyncio.Task[object], calls: set[_Call]) -> None:
        self.task = task
        self.cancelling = task.cancelling()
        self.expired = False
        self._calls = calls

    def __enter__(self) -> None:
        self._calls.add(self)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._calls.discard(self)
        # the expiry's cancellation is taken back whatever the body did with it; only a
        # cancellation no one else asked for becomes the TimeoutError
        if self.expired and self.task.uncancel() <= self.cancelling \
                and isinstance(exc, asyncio.CancelledError):
            raise TimeoutError from exc


class Deadlines:
    """The calls of one event loop, grouped by the tick their deadline falls in."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ticks: dict[int, set[_Call]] = {}

    def within(self, seconds: float) -> _Call:
        """`with deadlines().within(s):` cancels the current task if the block is still
        running `seconds` from now (up to TICK_S later), and raises TimeoutError in place
        of that cancellation."""
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("a deadline needs a running task")
        tick = math.ceil((self._loop.time() + seconds) / TICK_S)
        calls = self._ticks.get(tick)
        if calls is None:
            calls = self._ticks[tick] = set()
            self._loop.call_at(tick * TICK_S, self._expire, tick)
        return _Call(task, calls)

    def _expire(self, tick: int) -> None:
        for call in self._ticks.pop(tick, ()):
            call.expired = True
            call.task.cancel()


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = \
    weakref.WeakKeyDictionary()


def deadlines() -> Deadlines:
    """The running loop's deadlines."""
    loop = asyncio.get_running_loop()
    found = _BY_LOOP.get(loop)
    if found is None:
        found = _BY_LOOP[loop] = Deadlines(loop)
    return found

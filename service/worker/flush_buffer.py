"""A bounded buffer of writes waiting for the database, flushed in batches.

The shape of PgQueuer's `TimedOverflowBuffer` (janbjorge/pgqueuer `pgqueuer/buffers.py`):
items gather between flushes, a flush writes at most `max_batch` of them in one call, and
what a write could not take stays, in order, for the next flush instead of being dropped.
The pool keeps one for each kind of write (completions, hand-backs, scope signals), so
each fails on its own: a bug in one never holds back another.

A write that raises keeps all its items; one of several statements that wrote some raises
`Unwritten` with the rest, chained to the error. An outage (the database unavailable or busy) is a
warning; anything else is an internal error (service/observability/failures.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Generic, TypeVar

from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where

T = TypeVar("T")

# A write of a batch; it raises when it could not write them all.
Write = Callable[[list[T]], Awaitable[None]]


class Unwritten(Exception, Generic[T]):
    """A write took part of its batch: `left` is the rest (raised `from` the error)."""

    def __init__(self, left: Sequence[T]) -> None:
        super().__init__(f"{len(left)} items not written")
        self.left = list(left)


class FlushBuffer(Generic[T]):
    """Items waiting for `write`, at most `max_batch` to a call; `full` says a flush should
    not wait for the next tick (the overflow half of a timed overflow buffer)."""

    def __init__(self, write: Write[T], *, max_batch: int, where: Where,
                 errors: InternalErrors, logger: logging.Logger) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._write = write
        self.max_batch = max_batch
        self.where = where
        self._errors = errors
        self._log = logger
        self._items: list[T] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def waiting(self) -> tuple[T, ...]:
        """The items not written yet, oldest first."""
        return tuple(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.max_batch

    def add(self, items: Iterable[T]) -> None:
        self._items.extend(items)

    async def flush(self, where: Where | None = None) -> bool:
        """Write what waited when the flush began, a batch at a time, until it is written or
        a write fails (what that write did not take goes back in front, and the failure is
        reported as at `where`, default the buffer's). Items added during the writes wait
        for the next flush: taking them too would turn the flush into a stream of small
        statements, each a transaction (and an evidence entry) of its own. True when no
        write failed."""
        owed = len(self._items)
        while owed > 0 and self._items:
            size = min(self.max_batch, owed)
            batch, self._items = self._items[:size], self._items[size:]
            owed -= size
            try:
                await self._write(batch)
            except Exception as exc:
                cause: BaseException = exc
                if isinstance(exc, Unwritten):
                    self._items = exc.left + self._items
                    cause = exc.__cause__ or exc
                else:
                    self._items = batch + self._items
                if expected(cause):
                    self._log.warning("%s: database unavailable or busy; kept for the next "
                                      "flush", self.where.value,
                                      extra={"waiting": len(self._items)})
                else:
                    self._errors.caught(where or self.where, cause, waiting=len(self._items))
                return False
        return True

"""The pool's flush buffer: a flush writes what waited when it began, in batches of at most
`max_batch`, and leaves what arrives meanwhile for the next flush (one statement per tick,
not a stream of small ones); a failed write keeps its items in front, in order."""

from __future__ import annotations

import asyncio
import logging

from service.observability.failures import InternalErrors
from service.observability.metrics import Where
from service.worker.flush_buffer import FlushBuffer, Unwritten

log = logging.getLogger("tests.flush_buffer")


class Writes:
    """Records each batch; a write waits on `gate` when one is set."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()
        self.fail_next: Exception | None = None

    async def __call__(self, batch: list[int]) -> None:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        self.batches.append(batch)


def buffer_of(writes: Writes, max_batch: int = 1_000) -> FlushBuffer[int]:
    return FlushBuffer(writes, max_batch=max_batch, where=Where.COMPLETIONS,
                       errors=InternalErrors(log), logger=log)


async def test_items_added_during_a_write_wait_for_the_next_flush() -> None:
    writes = Writes()
    buffer = buffer_of(writes)
    buffer.add(range(5))
    writes.gate = asyncio.Event()
    flushing = asyncio.create_task(buffer.flush())
    await writes.started.wait()
    buffer.add(range(5, 8))  # outcomes that arrive while the statement is in flight
    writes.gate.set()
    assert await flushing
    assert writes.batches == [[0, 1, 2, 3, 4]]
    assert buffer.waiting == (5, 6, 7)
    writes.gate = None
    assert await buffer.flush()
    assert writes.batches[1:] == [[5, 6, 7]] and not buffer.waiting


async def test_a_flush_writes_what_waited_in_batches_of_at_most_max_batch() -> None:
    writes = Writes()
    buffer = buffer_of(writes, max_batch=4)
    buffer.add(range(10))
    assert buffer.full
    assert await buffer.flush()
    assert writes.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert not buffer.waiting


async def test_a_failed_write_keeps_its_items_in_front_in_order() -> None:
    writes = Writes()
    buffer = buffer_of(writes, max_batch=3)
    buffer.add(range(7))
    writes.fail_next = ConnectionRefusedError("database down")
    assert not await buffer.flush()
    assert buffer.waiting == tuple(range(7)) and writes.batches == []
    # a write that took part of its batch gives back the rest, which goes first next time
    writes.fail_next = Unwritten([1, 2])
    assert not await buffer.flush()
    assert buffer.waiting == (1, 2, 3, 4, 5, 6)
    assert await buffer.flush()
    assert writes.batches == [[1, 2, 3], [4, 5, 6]]

"""The relay: the leader's duty that hands the outbox to the broker, and ends in the ledger
what the broker gave up on.

A pass reads what waits (outbox.py), publishes each row's pending items as `Work` messages
(its origin, `batch:<id>`, `receipt:<id>`, `hold:<id>` or `requeue:<id>`, is the message
id) to the queues of each item's region, waits for the broker's confirms, then marks the
rows enqueued. A crash or a lost connection between the
confirm and the mark publishes the same rows again on the next pass: the same message
twice, which consumers fence in the ledger (a finished item is never called again, a
leased one waits for its lease). Nothing is lost: a row is marked only once confirmed.

Messages dead-lettered by the broker (delivered more times than its limit: every consumer
that held them died), in any region's queues, end here: their items that no running lease
holds go `dead` with the reason `broker_delivery_limit`, those a lease holds are handed
back to the broker to come back after it, and only then is the dead letter settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.execution import outbox
from service.execution.ports import Broker, Delivery, DeliveryGone
from service.execution.work import Work
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import BROKER_MESSAGES, BrokerEvent, Where

log = logging.getLogger("service.execution")

POLL_S: Final = 0.1  # between passes that found nothing (a pass on an empty outbox is an
#                      index probe of two empty partial indexes)
ERROR_BACKOFF_MAX_S: Final = 5.0
# Items per message: a batch (500 by default) goes as several, so the consumers share it
# and one that stalls holds back few items; far fewer messages than items all the same.
IDS_PER_MESSAGE: Final = 100
DEAD_REASON: Final = "broker_delivery_limit"
LEASE_RECHECK_S: Final = 30.0  # a dead letter's leased items come back after this
DEAD_TRIES: Final = 30  # then the dead letter is left unsettled, delivered again later


def works_of(kind: str, row_id: int, item_ids: list[int]) -> list[Work]:
    """An outbox row's messages: its pending items, IDS_PER_MESSAGE at most per message
    (none when none is pending: the row is marked all the same)."""
    return [Work.of(f"{kind}:{row_id}", item_ids[i:i + IDS_PER_MESSAGE])
            for i in range(0, len(item_ids), IDS_PER_MESSAGE)]


async def relay_once(engine: AsyncEngine, broker: Broker) -> int:
    """One pass: publish what waits, each row confirmed and then marked, so a failure part
    way publishes again only what was not marked. The rows handed over."""
    rows = await outbox.waiting(engine)
    for row in rows:
        published = 0
        for region, ids in row.by_region.items():
            works = works_of(row.kind, row.row_id, ids)
            await broker.routed(region).publish(works)
            published += len(works)
        await outbox.mark(engine, [(row.kind, row.row_id)])
        BROKER_MESSAGES.labels(BrokerEvent.PUBLISHED).inc(published)
    return len(rows)


async def end_dead_letter(engine: AsyncEngine, broker: Broker, delivery: Delivery) -> None:
    """End a dead letter's items in the ledger (or defer those a lease holds, in `broker`'s
    region, whose dead queue delivered it), then settle."""
    leased = await outbox.end_dead(engine, delivery.work.item_ids, DEAD_REASON)
    if leased:
        await broker.defer([delivery.work.part(leased)], LEASE_RECHECK_S)
    log.warning("broker: a message reached its delivery limit; its items end dead",
                extra={"origin": delivery.work.origin,
                       "items": len(delivery.work.item_ids) - len(leased)})
    await delivery.settle()
    BROKER_MESSAGES.labels(BrokerEvent.DEAD).inc()


class Relay:
    """The duty: `run()` passes until cancelled, and ends dead letters as they come, from
    the dead queues of `regions` (the policies file's, and None: the unpinned tenants')."""

    def __init__(self, engine: AsyncEngine, broker: Broker, *,
                 regions: Iterable[str | None] = (None,), poll_s: float = POLL_S) -> None:
        self.engine, self.broker, self.poll_s = engine, broker, poll_s
        self.regions = list(dict.fromkeys(regions))
        self._dead: asyncio.Queue[tuple[Broker, Delivery]] = asyncio.Queue()
        self._errors = InternalErrors(log)

    async def run(self) -> None:
        consumers = [asyncio.create_task(self._consume_dead(self.broker.routed(region)))
                     for region in self.regions]
        ender = asyncio.create_task(self._end_dead())
        try:
            await self._relay()
        finally:
            for task in (*consumers, ender):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _relay(self) -> None:
        backoff = 0.1
        while True:
            try:
                handed = await relay_once(self.engine, self.broker)
                backoff = 0.1
            except Exception as exc:
                self._failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(ERROR_BACKOFF_MAX_S, backoff * 2)
                continue
            if not handed:
                await asyncio.sleep(self.poll_s)

    async def _consume_dead(self, broker: Broker) -> None:
        await broker.consume_dead(lambda delivery: self._dead.put_nowait((broker, delivery)))

    async def _end_dead(self) -> None:
        while True:
            broker, delivery = await self._dead.get()
            for _ in range(DEAD_TRIES):
                try:
                    await end_dead_letter(self.engine, broker, delivery)
                    break
                except DeliveryGone:
                    break  # the broker delivers it again: ended then
                except Exception as exc:
                    self._failed(exc)
                    await asyncio.sleep(1.0)

    def _failed(self, exc: Exception) -> None:
        if expected(exc) or isinstance(exc, (ConnectionError, OSError, TimeoutError)):
            log.warning("relay: database or broker unavailable; retrying",
                        extra={"error_type": type(exc).__name__})
        else:
            self._errors.caught(Where.RELAY, exc)

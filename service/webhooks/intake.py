"""Webhook intake: how verified deliveries reach the ledger, per process.

`Intake` holds the in-flight limit, a small asyncpg pool of its own, the group commit that
applies the deliveries waiting at the same moment in one statement, and the NOTIFY that
wakes workers after releases. What one statement records of a delivery, exactly once per
(source, webhook id), is service/webhooks/receipts.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import asyncpg
from sqlalchemy.engine import URL

from service.config.settings import Settings, plain_url
from service.db.engine import CONNECT_TIMEOUT_SECONDS
from service.db.wakeups import WAKE_WORKERS
from service.webhooks.deliveries import Delivery, DeliveryRejected
from service.webhooks.receipts import Receipt, delivery_params, record, record_group

log = logging.getLogger(__name__)

INTAKE_APPLICATION_NAME: Final = "sweeper-webhooks"
MAX_GROUP: Final = 64  # deliveries in one statement at most
# Idle workers are woken after releases (service/db/wakeups.py), not in the receipt: a
# transaction that notifies holds a database-wide lock from its commit until its WAL flush,
# so deliveries that notified would commit one at a time, each waiting out the previous
# one's flush; one notification, sent after the commits, serves every delivery in flight
# (workers poll anyway).
NOTIFY_COALESCE_S: Final = 0.005  # releases within this window share one NOTIFY


class Intake:
    """A process's webhook intake: the in-flight limit, a small connection pool of its own
    (asyncpg, opened on first use) and the group commit. A delivery over the limit is
    refused at once (503 + Retry-After) instead of queueing without bound. The own pool
    means busy workers never starve intake nor intake the workers, and costs no pre-ping,
    BEGIN or COMMIT (a connection gone stale fails its statement, the sender gets a 503 and
    retries, and the pool replaces the connection).

    Group commit: verified deliveries wait in one FIFO queue; up to
    `webhook_db_pool_size` statements run at once, each on its own connection, and each
    takes every delivery waiting when it starts (up to MAX_GROUP). Alone, a delivery costs
    one round trip, as before; under load, the deliveries that queued behind a busy pool
    share one statement, one commit and one WAL flush instead of queueing for connections
    one by one. Every answer still waits for the commit that made its delivery durable.
    A group never holds two deliveries of one webhook id or two hints at one item, and
    never a webhook id another running statement holds (`_take`), so it is exactly the
    deliveries applied one after another. If its statement fails, nothing of it was
    written and each of its deliveries goes again alone, so one bad delivery fails only
    itself."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._pool: Any = None
        self._opening = asyncio.Lock()
        self._queue: deque[_Waiting] = deque()
        self._applying: set[tuple[str, str]] = set()  # (source, webhook id) in a statement
        self._statements: set[asyncio.Task[None]] = set()
        self._max_statements = 1
        self._wait_s = 5.0
        self._wake_wanted = False
        self._waker: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        """Verified deliveries waiting for a statement to take them."""
        return len(self._queue)

    def try_enter(self, limit: int) -> bool:
        if self.in_flight >= limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1

    async def pool(self, url: URL, settings: Settings) -> Any:
        """The intake's asyncpg pool on the database `url` names (any driver suffix)."""
        if self._pool is None:
            async with self._opening:
                if self._pool is None:
                    self._max_statements = settings.webhook_db_pool_size
                    self._wait_s = settings.db_pool_timeout_seconds
                    self._pool = await asyncpg.create_pool(
                        plain_url(url), min_size=0, max_size=settings.webhook_db_pool_size,
                        timeout=CONNECT_TIMEOUT_SECONDS, reset=_keep_session,
                        server_settings={
                            "application_name": INTAKE_APPLICATION_NAME,
                            "statement_timeout": str(settings.db_statement_timeout_ms),
                            "jit": "off"})  # as the ledger's (service/db/engine.py)
        return self._pool

    async def apply(self, url: URL, settings: Settings, delivery: Delivery) -> Receipt:
        """Apply a verified delivery exactly once per (source, webhook id), in the next
        statement that has room for it, and return its receipt: committed when this
        returns. DeliveryRejected("overloaded") when no statement took it within
        `db_pool_timeout_seconds`; a statement's error (the database unreachable) as
        `receipts.record` raises it."""
        await self.pool(url, settings)
        loop = asyncio.get_running_loop()
        params = delivery_params(delivery)
        waiting = _Waiting(delivery, params, loop.create_future())
        waiting.expiry = loop.call_later(self._wait_s, self._expire, waiting)
        self._queue.append(waiting)
        self._dispatch()
        try:
            return await waiting.future
        except asyncio.CancelledError:
            self._withdraw(waiting)  # still queued: never sent
            raise

    def _expire(self, waiting: _Waiting) -> None:
        if self._withdraw(waiting):
            waiting.fail(DeliveryRejected("overloaded", "no database connection free; "
                                                        "retry later"))

    def _withdraw(self, waiting: _Waiting) -> bool:
        """Take a delivery no statement has taken out of the queue; False if one has."""
        if waiting.expiry is not None:
            waiting.expiry.cancel()
            waiting.expiry = None
        try:
            self._queue.remove(waiting)
        except ValueError:
            return False
        return True

    def _dispatch(self) -> None:
        """Start a statement for the waiting deliveries while the pool has room for one."""
        while len(self._statements) < self._max_statements:
            group = self._take()
            if not group:
                return
            task = asyncio.create_task(self._commit(group), name="webhook-commit")
            self._statements.add(task)
            task.add_done_callback(self._committed)

    def _committed(self, task: asyncio.Task[None]) -> None:
        self._statements.discard(task)
        self._dispatch()

    def _take(self) -> list[_Waiting]:
        """The next group, oldest first: deliveries that may share one statement. One that
        may not (its webhook id in this group or a running statement, an item in this group,
        or marked to go alone) keeps its place for a later statement."""
        group: list[_Waiting] = []
        ids: set[tuple[str, str]] = set()
        items: set[str] = set()
        kept: list[_Waiting] = []
        while self._queue and len(group) < MAX_GROUP:
            waiting = self._queue.popleft()
            key = waiting.key
            if (key in self._applying or key in ids or not items.isdisjoint(waiting.items)
                    or (waiting.alone and group)):
                kept.append(waiting)
                continue
            if waiting.expiry is not None:
                waiting.expiry.cancel()
                waiting.expiry = None
            group.append(waiting)
            ids.add(key)
            items.update(waiting.items)
            if waiting.alone:
                break
        self._queue.extendleft(reversed(kept))
        self._applying.update(ids)
        return group

    async def _commit(self, group: list[_Waiting]) -> None:
        """Apply one group on a connection of its own and answer each delivery in it."""
        released = 0
        try:
            async with self._pool.acquire(timeout=self._wait_s) as conn:
                if len(group) == 1:  # alone: the single-delivery statement
                    receipt = await record(conn, group[0].params)
                    group[0].resolve(receipt)
                    released = receipt.released
                else:
                    try:
                        receipts = await record_group(conn, [w.params for w in group])
                    except asyncpg.PostgresError:
                        # the server refused the statement (nothing of it was written): one
                        # delivery's fault, or a conflict with another process, must not
                        # fail the others, so each goes again alone, first in line
                        for waiting in group:
                            waiting.alone = True
                        self._queue.extendleft(reversed(group))
                    else:
                        for waiting, receipt in zip(group, receipts, strict=True):
                            waiting.resolve(receipt)
                            released += receipt.released
        except Exception as exc:  # alone, its own error; else no connection, or it broke
            for waiting in group:
                waiting.fail(exc)
        finally:
            self._applying.difference_update(w.key for w in group)
        if released:
            self.wake_workers()

    def wake_workers(self) -> None:
        """Ask for a NOTIFY to the workers, sent after this delivery's commit and shared
        with every other delivery that asks meanwhile (they poll anyway: this only makes
        them take a hint at once)."""
        self._wake_wanted = True
        if self._waker is None or self._waker.done():
            self._waker = asyncio.create_task(self._notify(), name="webhook-wake")

    async def _notify(self) -> None:
        while self._wake_wanted and self._pool is not None:
            await asyncio.sleep(NOTIFY_COALESCE_S)
            self._wake_wanted = False
            try:
                async with self._pool.acquire(timeout=1.0) as conn:
                    await conn.execute(WAKE_WORKERS.text)
            except Exception as exc:
                log.warning("webhooks: could not notify workers (they will poll)",
                            extra={"error": type(exc).__name__})
                return

    async def aclose(self) -> None:
        if self._statements:
            await asyncio.gather(*self._statements, return_exceptions=True)
        if self._waker is not None:
            self._waker.cancel()
            await asyncio.gather(self._waker, return_exceptions=True)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()


@dataclass(eq=False)
class _Waiting:
    """A verified delivery waiting for the statement that applies it, and its answer."""

    delivery: Delivery
    params: dict[str, Any]  # `delivery_params(delivery)`
    future: asyncio.Future[Receipt]
    expiry: asyncio.TimerHandle | None = None  # while queued: when it gives up (503)
    alone: bool = False  # its group's statement failed: it goes in a statement of its own
    key: tuple[str, str] = field(init=False)
    items: frozenset[str] = field(init=False)  # operation keys of the items its hints name

    def __post_init__(self) -> None:
        self.key = (self.delivery.source, self.delivery.webhook_id)
        self.items = frozenset(self.params["keys"])

    def resolve(self, receipt: Receipt) -> None:
        if not self.future.done():  # done: its request was cancelled meanwhile
            self.future.set_result(receipt)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


async def _keep_session(_conn: Any) -> None:
    """Release without asyncpg's default session reset (advisory unlock, CLOSE ALL,
    UNLISTEN, RESET ALL: one more round trip per delivery): intake connections take no
    locks, cursors, listeners or settings. asyncpg still rolls back a transaction left
    open."""

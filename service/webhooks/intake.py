"""Webhook intake: how verified deliveries reach the ledger.

    Intake          per process: the in-flight limit, a small asyncpg pool of its own, the
                    group commit that applies deliveries waiting at the same moment in one
                    statement, and the NOTIFY that wakes workers after releases
    _RECORD         one statement per delivery: its receipt and its hints' effect on items,
                    exactly once per (source, webhook id)
    _RECORD_GROUP   the same for several deliveries at once, in one transaction: one round
                    trip and one commit (one WAL flush) for all of them

The statements are named `Statement`s like every other module's, but run on the intake's
own asyncpg pool, so they take asyncpg's positional `$n` parameters and are sent as their
`.text` (service/db/statements.py: why intake does not go through `fetch` or `run`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import asyncpg
from sqlalchemy.engine import URL

from service.budget.rules import budget_of
from service.config.settings import Settings, plain_url
from service.db.engine import CONNECT_TIMEOUT_SECONDS
from service.db.statements import Statement, covering_hold
from service.ledger import registration
from service.ledger.wakeups import WAKE_WORKERS
from service.webhooks.deliveries import Delivery, DeliveryRejected, Hint

log = logging.getLogger(__name__)

Result = Literal["applied", "ignored"]
INTAKE_APPLICATION_NAME: Final = "sweeper-webhooks"


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
                            "statement_timeout": str(settings.db_statement_timeout_ms)})
        return self._pool

    async def apply(self, url: URL, settings: Settings, delivery: Delivery) -> Receipt:
        """Apply a verified delivery exactly once per (source, webhook id), in the next
        statement that has room for it, and return its receipt: committed when this
        returns. DeliveryRejected("overloaded") when no statement took it within
        `db_pool_timeout_seconds`; a statement's error (the database unreachable) as
        `_record` raises it."""
        await self.pool(url, settings)
        loop = asyncio.get_running_loop()
        params = _params(delivery)
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
                    receipt = await _record(conn, group[0].delivery, group[0].params)
                    group[0].resolve(receipt)
                    released = receipt.released
                else:
                    try:
                        receipts = await _record_group(conn, group)
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
    params: dict[str, Any]  # `_params(delivery)`
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


@dataclass(frozen=True)
class Receipt:
    """What a delivery did (or, for a duplicate, what the original did)."""

    result: Result
    item_ids: tuple[int, ...]
    duplicate: bool
    released: int = 0  # items this delivery made claimable now


# Each delivery's hints: insert the items they name, or make pending ones due sooner and
# release them (a hint never postpones, finished items are left alone), in one lock order
# for every statement (no deadlocks). Shared by _RECORD and _RECORD_GROUP.
_TOUCH_ITEMS_SQL: Final = f"""touched AS (
        INSERT INTO items AS i (tenant_id, object_id, policy, policy_version, operation_key,
                                scope, due_at, released_at, hold_id)
        SELECT tenant_id, object_id, policy, policy_version, operation_key, scope, due_at,
               CASE WHEN due_at <= now() THEN now() END, {covering_hold("hints")}
        FROM hints
        ORDER BY operation_key  -- one lock order for every delivery (no deadlocks)
        ON CONFLICT (tenant_id, object_id, policy, policy_version) DO UPDATE
            SET due_at = least(i.due_at, EXCLUDED.due_at),
                released_at = coalesce(i.released_at, EXCLUDED.released_at),
                next_attempt_at = CASE WHEN i.released_at IS NULL
                                       THEN least(i.next_attempt_at, now())
                                       ELSE i.next_attempt_at END,
                updated_at = now()
            WHERE i.status = 'pending'
              AND (EXCLUDED.due_at < i.due_at
                   OR (i.released_at IS NULL AND EXCLUDED.released_at IS NOT NULL))
        RETURNING i.id, i.operation_key, i.released_at IS NOT NULL AS released
    ),"""  # noqa: S608 - only a constant fragment is interpolated

# One statement, outside an explicit transaction: atomic by itself, in one round trip.
#  1. `existing`: the receipt of an earlier delivery with this webhook id. If there is one,
#     nothing below writes anything and the caller answers with the original result.
#  2. `new_scopes`: a budget row for each scope that has none yet (never an update: that
#     would lock a row every worker takes tokens from).
#  3. `touched`: insert each hinted item, or advance its due_at (never postpone) and release
#     it when it is due now; only pending items change. Released without a batch, so claims
#     take them first. A released item keeps its next_attempt_at (a backoff the upstream
#     asked for stands). Rows that would not change are not touched and not returned.
#  4. `receipt`: the receipt with the ids of the items touched. A concurrent delivery of
#     the same id that also found no receipt fails here on webhook_receipts_once, and its
#     whole statement (its effect included) rolls back: one effect per webhook id.
_RECORD = Statement("intake.record", (
    "Apply one webhook delivery once per (source, webhook id): its receipt, new bucket rows, "
    "and its hints' inserts and releases, or the original's receipt."), f"""
    WITH existing AS (
        SELECT result, item_ids FROM webhook_receipts
        WHERE source = $1 AND webhook_id = $2
    ),
    hints AS (
        SELECT h.*,
               CASE WHEN h.delay IS NULL THEN now()
                    ELSE coalesce(to_timestamp(CAST($4 AS double precision)), now())
                         + make_interval(secs => h.delay) END AS due_at
        FROM unnest(CAST($6 AS text[]), CAST($7 AS text[]),
                    CAST($8 AS text[]), CAST($9 AS integer[]),
                    CAST($10 AS text[]), CAST($11 AS text[]),
                    CAST($12 AS double precision[]))
             AS h(tenant_id, object_id, policy, policy_version, operation_key, scope, delay)
        WHERE NOT EXISTS (SELECT 1 FROM existing)
    ),
    new_scopes AS (
        INSERT INTO scopes (name, rate_per_second, burst, tokens, objects_per_call)
        SELECT b.name, b.rate, b.burst, b.burst, b.per_call
        FROM unnest(CAST($13 AS text[]), CAST($14 AS double precision[]),
                    CAST($15 AS integer[]), CAST($16 AS integer[]))
             AS b(name, rate, burst, per_call)
        WHERE NOT EXISTS (SELECT 1 FROM existing)
          AND NOT EXISTS (SELECT 1 FROM scopes s WHERE s.name = b.name)
        ORDER BY b.name
        ON CONFLICT (name) DO NOTHING
    ),
    {_TOUCH_ITEMS_SQL}
    receipt AS (
        INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids)
        SELECT $1, $2, $3, $5,
               coalesce((SELECT array_agg(id ORDER BY id) FROM touched), '{{}}')
        WHERE NOT EXISTS (SELECT 1 FROM existing)
        RETURNING item_ids
    )
    SELECT (SELECT item_ids FROM receipt) AS item_ids,
           (SELECT result FROM existing) AS original_result,
           (SELECT item_ids FROM existing) AS original_item_ids,
           (SELECT count(*) FROM touched WHERE released) AS released
""")  # noqa: S608 - only a constant fragment is interpolated
# `_params`' keys in the statements' parameter order: a delivery's, its hints', its budgets'
_DELIVERY_COLUMNS: Final = ("source", "webhook_id", "event_type", "event_at", "result")
_HINT_COLUMNS: Final = ("tenants", "objects", "policies", "versions", "keys", "scopes",
                        "delays")
_BUDGET_COLUMNS: Final = ("budget_scopes", "rates", "bursts", "per_call")
_RECORD_PARAMS: Final = (*_DELIVERY_COLUMNS, *_HINT_COLUMNS, *_BUDGET_COLUMNS)

# The same for a group of deliveries (Intake's group commit), in one statement and so one
# transaction and one commit. Each delivery's rows are what `_RECORD` would make of it
# alone, because `_take` never groups two deliveries of one webhook id nor two hints at one
# item: the group is the same as its deliveries applied one after another.
#  1. `deliveries` (one row each, numbered `n`) and `existing`: those whose webhook id has a
#     receipt already change nothing, and answer with it.
#  2. `new_scopes`: as in `_RECORD`, for the new deliveries' hints; a scope two deliveries
#     name gets the budget of the first (as it would applied in order).
#  3. `touched`: as in `_RECORD`, over every new delivery's hints, in one lock order.
#  4. `receipts`: one per new delivery, with the ids of the items its own hints touched. A
#     concurrent statement elsewhere that committed one of these webhook ids fails this whole
#     statement on webhook_receipts_once; nothing of it is written, and the caller applies
#     each delivery again alone.
_RECORD_GROUP = Statement("intake.record_group", (
    "Apply several webhook deliveries in one transaction, each as intake.record would alone: "
    "receipts, new bucket rows, inserts and releases, or the originals' receipts."), f"""
    WITH deliveries AS (
        SELECT * FROM unnest(CAST($1 AS integer[]), CAST($2 AS text[]), CAST($3 AS text[]),
                             CAST($4 AS text[]), CAST($5 AS double precision[]),
                             CAST($6 AS text[]))
             AS d(n, source, webhook_id, event_type, event_at, result)
    ),
    existing AS (
        SELECT d.n, r.result, r.item_ids
        FROM deliveries d
        JOIN webhook_receipts r ON r.source = d.source AND r.webhook_id = d.webhook_id
    ),
    hints AS (
        SELECT h.*,
               CASE WHEN h.delay IS NULL THEN now()
                    ELSE coalesce(to_timestamp(d.event_at), now())
                         + make_interval(secs => h.delay) END AS due_at
        FROM unnest(CAST($7 AS integer[]), CAST($8 AS text[]), CAST($9 AS text[]),
                    CAST($10 AS text[]), CAST($11 AS integer[]),
                    CAST($12 AS text[]), CAST($13 AS text[]),
                    CAST($14 AS double precision[]))
             AS h(n, tenant_id, object_id, policy, policy_version, operation_key, scope, delay)
        JOIN deliveries d ON d.n = h.n
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.n = h.n)
    ),
    new_scopes AS (
        INSERT INTO scopes (name, rate_per_second, burst, tokens, objects_per_call)
        SELECT DISTINCT ON (b.name) b.name, b.rate, b.burst, b.burst, b.per_call
        FROM unnest(CAST($15 AS integer[]), CAST($16 AS text[]),
                    CAST($17 AS double precision[]), CAST($18 AS integer[]),
                    CAST($19 AS integer[]))
             AS b(n, name, rate, burst, per_call)
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.n = b.n)
          AND NOT EXISTS (SELECT 1 FROM scopes s WHERE s.name = b.name)
        ORDER BY b.name, b.n
        ON CONFLICT (name) DO NOTHING
    ),
    {_TOUCH_ITEMS_SQL}
    mine AS (
        SELECT h.n, t.id, t.released FROM hints h JOIN touched t USING (operation_key)
    ),
    receipts AS (
        INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids)
        SELECT d.source, d.webhook_id, d.event_type, d.result,
               coalesce((SELECT array_agg(m.id ORDER BY m.id) FROM mine m WHERE m.n = d.n),
                        '{{}}')
        FROM deliveries d
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.n = d.n)
        ORDER BY d.source, d.webhook_id  -- one lock order here too
        RETURNING source, webhook_id, item_ids
    )
    SELECT d.n, r.item_ids, e.result AS original_result, e.item_ids AS original_item_ids,
           (SELECT count(*) FROM mine m WHERE m.n = d.n AND m.released) AS released
    FROM deliveries d
    LEFT JOIN receipts r ON r.source = d.source AND r.webhook_id = d.webhook_id
    LEFT JOIN existing e ON e.n = d.n
""")  # noqa: S608 - only a constant fragment is interpolated
# the group's: each column numbered by its delivery (`n`), hints and budgets by theirs
_GROUP_PARAMS: Final = ("n", *_DELIVERY_COLUMNS, "hint_n", *_HINT_COLUMNS, "budget_n",
                        *_BUDGET_COLUMNS)
MAX_GROUP: Final = 64  # deliveries in one statement at most

# Idle workers are woken after releases (service/ledger/wakeups.py), not inside _RECORD: a
# transaction that notifies holds a database-wide lock from its commit until its WAL flush,
# so deliveries that notified would commit one at a time, each waiting out the previous
# one's flush; one notification, sent after the commits, serves every delivery in flight
# (workers poll anyway).
NOTIFY_COALESCE_S: Final = 0.005  # releases within this window share one NOTIFY

_ORIGINAL = Statement("intake.original", (
    "The receipt of the delivery that won a race for the same webhook id, to answer as a "
    "duplicate."),
    "SELECT result, item_ids FROM webhook_receipts WHERE source = $1 AND webhook_id = $2")

RECEIPT_CONSTRAINT: Final = "webhook_receipts_once"


def _delay(hint: Hint) -> float:
    return -1.0 if hint.delay_seconds is None else hint.delay_seconds


def _earliest(hints: tuple[Hint, ...]) -> list[Hint]:
    """One hint per obligation (a row can change only once per statement): the soonest."""
    kept: dict[tuple[str, str, str], Hint] = {}
    for hint in hints:
        key = (hint.tenant_id, hint.object_id, hint.policy.name)
        other = kept.get(key)
        if other is None or _delay(hint) < _delay(other):
            kept[key] = hint
    return sorted(kept.values(), key=lambda h: (h.tenant_id, h.object_id, h.policy.name))


def _params(delivery: Delivery) -> dict[str, Any]:
    hints = _earliest(delivery.hints)
    hint_scopes = [h.policy.scope_for(h.tenant_id) for h in hints]
    budgets = {scope: budget_of(h.policy)
               for scope, h in zip(hint_scopes, hints, strict=True)}
    scopes = sorted(budgets)
    return {
        "source": delivery.source, "webhook_id": delivery.webhook_id,
        "event_type": delivery.event_type, "event_at": delivery.event_at,
        "result": "applied" if hints else "ignored",
        "tenants": [h.tenant_id for h in hints], "objects": [h.object_id for h in hints],
        "policies": [h.policy.name for h in hints],
        "versions": [h.policy.version for h in hints],
        "keys": [registration.operation_key(h.tenant_id, h.object_id, h.policy.name,
                                      h.policy.version) for h in hints],
        "scopes": hint_scopes,
        "delays": [h.delay_seconds for h in hints],
        "budget_scopes": scopes, "rates": [budgets[s][0] for s in scopes],
        "bursts": [budgets[s][1] for s in scopes],
        "per_call": [budgets[s][2] for s in scopes],
    }


async def _record(conn: Any, delivery: Delivery, params: dict[str, Any]) -> Receipt:
    """Apply one delivery exactly once per (source, webhook id) on `conn` (`_RECORD`) and
    return its receipt; a duplicate changes nothing and returns the original's."""
    try:
        row = await conn.fetchrow(_RECORD.text, *(params[name] for name in _RECORD_PARAMS))
    except asyncpg.CheckViolationError:
        # an id read_delivery let through but a ledger constraint refuses (e.g. a tenant
        # whose limiter scope passes 512 bytes): bad input, a 422
        raise DeliveryRejected("unmappable", "a tenant or object id the ledger refuses "
                                             "(e.g. too long for its limiter scope)") from None
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name != RECEIPT_CONSTRAINT:
            raise
        # lost a race with a concurrent delivery of the same id, whose receipt is committed
        # by now (the unique index waited for it)
        original = await conn.fetchrow(_ORIGINAL.text, delivery.source, delivery.webhook_id)
        return Receipt(result=original["result"], item_ids=tuple(original["item_ids"]),
                       duplicate=True)
    return _receipt(params, row)


def _receipt(params: dict[str, Any], row: Any) -> Receipt:
    if row["original_result"] is not None:
        return Receipt(result=row["original_result"],
                       item_ids=tuple(row["original_item_ids"]), duplicate=True)
    return Receipt(result=params["result"], item_ids=tuple(row["item_ids"]), duplicate=False,
                   released=row["released"])


async def _record_group(conn: Any, group: list[_Waiting]) -> list[Receipt]:
    """Apply several deliveries in one statement (`_RECORD_GROUP`); their receipts in order.
    `_take` made the group: distinct webhook ids, no item named by two of them."""
    columns: dict[str, list[Any]] = {name: [] for name in _GROUP_PARAMS}
    for n, waiting in enumerate(group):
        params = waiting.params
        for name in _DELIVERY_COLUMNS:
            columns[name].append(params[name])
        columns["n"].append(n)
        columns["hint_n"].extend([n] * len(params["keys"]))
        for name in _HINT_COLUMNS:
            columns[name].extend(params[name])
        columns["budget_n"].extend([n] * len(params["budget_scopes"]))
        for name in _BUDGET_COLUMNS:
            columns[name].extend(params[name])
    rows = await conn.fetch(_RECORD_GROUP.text, *(columns[name] for name in _GROUP_PARAMS))
    by_n = {row["n"]: row for row in rows}
    return [_receipt(waiting.params, by_n[n]) for n, waiting in enumerate(group)]

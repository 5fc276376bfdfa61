"""Webhook intake: how verified deliveries reach the ledger.

    Intake          per process: the in-flight limit, a small asyncpg pool of its own, and
                    the NOTIFY that wakes workers after releases
    record          one statement per delivery: its receipt and its hints' effect on items,
                    exactly once per (source, webhook id)

The statements are named `Statement`s like every other module's, but run on the intake's
own asyncpg pool, so they take asyncpg's positional `$n` parameters and are sent as their
`.text` (service/db/statements.py: why intake does not go through `fetch` or `run`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Final, Literal

import asyncpg
from sqlalchemy.engine import URL

from service import ledger, limiter
from service.claims import NOTIFY_CHANNEL
from service.db.engine import CONNECT_TIMEOUT_SECONDS
from service.db.statements import Statement
from service.settings import Settings, plain_url
from service.webhooks import Delivery, DeliveryRejected, Hint

log = logging.getLogger(__name__)

Result = Literal["applied", "ignored"]
INTAKE_APPLICATION_NAME: Final = "sweeper-webhooks"


class Intake:
    """A process's webhook intake: the in-flight limit, and a small connection pool of its
    own (asyncpg, opened on first use). A delivery over the limit is refused at once (503 +
    Retry-After) instead of queueing without bound. The own pool means busy workers never
    starve intake nor intake the workers, and a delivery costs one round trip: no pre-ping,
    no BEGIN or COMMIT (a connection gone stale fails its statement, the sender gets a 503
    and retries, and the pool replaces the connection)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._pool: Any = None
        self._opening = asyncio.Lock()
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
                    self._pool = await asyncpg.create_pool(
                        plain_url(url), min_size=0, max_size=settings.webhook_db_pool_size,
                        timeout=CONNECT_TIMEOUT_SECONDS, reset=_keep_session,
                        server_settings={
                            "application_name": INTAKE_APPLICATION_NAME,
                            "statement_timeout": str(settings.db_statement_timeout_ms)})
        return self._pool

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
                    await conn.execute(_NOTIFY.text)
            except Exception as exc:
                log.warning("webhooks: could not notify workers (they will poll)",
                            extra={"error": type(exc).__name__})
                return

    async def aclose(self) -> None:
        if self._waker is not None:
            self._waker.cancel()
            await asyncio.gather(self._waker, return_exceptions=True)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()


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
    "and its hints' inserts and releases, or the original's receipt."), """
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
    touched AS (
        INSERT INTO items AS i (tenant_id, object_id, policy, policy_version, operation_key,
                                scope, due_at, released_at)
        SELECT tenant_id, object_id, policy, policy_version, operation_key, scope, due_at,
               CASE WHEN due_at <= now() THEN now() END
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
        RETURNING i.id, i.released_at IS NOT NULL AS released
    ),
    receipt AS (
        INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids)
        SELECT $1, $2, $3, $5,
               coalesce((SELECT array_agg(id ORDER BY id) FROM touched), '{}')
        WHERE NOT EXISTS (SELECT 1 FROM existing)
        RETURNING item_ids
    )
    SELECT (SELECT item_ids FROM receipt) AS item_ids,
           (SELECT result FROM existing) AS original_result,
           (SELECT item_ids FROM existing) AS original_item_ids,
           (SELECT count(*) FROM touched WHERE released) AS released
""")
_RECORD_PARAMS: Final = ("source", "webhook_id", "event_type", "event_at", "result", "tenants",
                         "objects", "policies", "versions", "keys", "scopes", "delays",
                         "budget_scopes", "rates", "bursts", "per_call")

# Wakes idle workers after releases. Not part of _RECORD: a transaction that notifies holds
# a database-wide lock from its commit until its WAL flush, so deliveries that notified
# would commit one at a time, each waiting out the previous one's flush; one notification,
# sent after the commits, serves every delivery in flight (workers poll anyway).
_NOTIFY = Statement("intake.notify_released", (
    "Wake idle workers after deliveries released items (one for every delivery in a short "
    "window)."), f"NOTIFY {NOTIFY_CHANNEL}")
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
    budgets = {scope: limiter.budget_of(h.policy)
               for scope, h in zip(hint_scopes, hints, strict=True)}
    scopes = sorted(budgets)
    return {
        "source": delivery.source, "webhook_id": delivery.webhook_id,
        "event_type": delivery.event_type, "event_at": delivery.event_at,
        "result": "applied" if hints else "ignored",
        "tenants": [h.tenant_id for h in hints], "objects": [h.object_id for h in hints],
        "policies": [h.policy.name for h in hints],
        "versions": [h.policy.version for h in hints],
        "keys": [ledger.operation_key(h.tenant_id, h.object_id, h.policy.name,
                                      h.policy.version) for h in hints],
        "scopes": hint_scopes,
        "delays": [h.delay_seconds for h in hints],
        "budget_scopes": scopes, "rates": [budgets[s][0] for s in scopes],
        "bursts": [budgets[s][1] for s in scopes],
        "per_call": [budgets[s][2] for s in scopes],
    }


async def record(pool: Any, delivery: Delivery, *, acquire_timeout_s: float = 5.0
                 ) -> Receipt:
    """Apply a delivery exactly once per (source, webhook id) and return its receipt; a
    duplicate changes nothing and returns the original's. Committed when this returns.
    `pool` is an asyncpg pool (the intake's); TimeoutError when no connection frees up
    within `acquire_timeout_s`."""
    params = _params(delivery)
    async with pool.acquire(timeout=acquire_timeout_s) as conn:
        try:
            row = await conn.fetchrow(_RECORD.text,
                                      *(params[name] for name in _RECORD_PARAMS))
        except asyncpg.CheckViolationError:
            # an id read_delivery let through but a ledger constraint refuses (e.g. a
            # tenant whose limiter scope passes 512 bytes): bad input, a 422
            raise DeliveryRejected("unmappable", "a tenant or object id the ledger refuses "
                                                 "(e.g. too long for its limiter scope)"
                                   ) from None
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != RECEIPT_CONSTRAINT:
                raise
            # lost a race with a concurrent delivery of the same id, whose receipt is
            # committed by now (the unique index waited for it)
            original = await conn.fetchrow(_ORIGINAL.text, delivery.source,
                                           delivery.webhook_id)
            return Receipt(result=original["result"], item_ids=tuple(original["item_ids"]),
                           duplicate=True)
    if row["original_result"] is not None:
        return Receipt(result=row["original_result"],
                       item_ids=tuple(row["original_item_ids"]), duplicate=True)
    return Receipt(result=params["result"], item_ids=tuple(row["item_ids"]), duplicate=False,
                   released=row["released"])

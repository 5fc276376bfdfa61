"""The items an operator selects: by ids, operation keys, or a filter over one status
(`ItemFilter`), listed a keyset page at a time, redriven (dead back to pending) or cancelled
(pending withdrawn). Each change is bounded by a limit and made in one transaction with its
audit row. What operators read of one item is service/ledger/operator_reads.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch_filtered, item_status, run
from service.evidence import audit_trail


@dataclass(frozen=True)
class ItemFilter:
    """Which items an operator means: explicit ids, or a filter over one status."""

    ids: list[int] | None = None
    operation_keys: list[str] | None = None
    policy: str | None = None
    tenant_id: str | None = None
    reason: str | None = None
    object_id: str | None = None  # with tenant_id: the obligation index finds it


# An operator's filter states `id > 0`, true of every row (ids are an identity from 1), and
# no other statement does: the index of pending items by id (`items_listed`, migration 0018)
# is partial on it, so only operators' reads can be planned on it. The claim, the pick and
# the waits have ordered indexes of their own, which stale statistics once lost them.
FILTER_SQL = """
      AND id > 0
      -- explicit ids and identities add up; the other fields narrow
      AND ((CAST(:ids AS bigint[]) IS NULL AND CAST(:keys AS text[]) IS NULL)
           OR id = ANY(CAST(:ids AS bigint[]))
           OR operation_key = ANY(CAST(:keys AS text[])))
      AND (CAST(:policy AS text) IS NULL OR policy = :policy)
      AND (CAST(:tenant AS text) IS NULL OR tenant_id = :tenant)
      AND (CAST(:object AS text) IS NULL OR object_id = :object)
      AND (CAST(:reason AS text) IS NULL OR dead_reason = :reason OR last_error = :reason)
"""


def filter_params(f: ItemFilter) -> dict[str, object]:
    """The parameters of FILTER_SQL for one filter."""
    return {"ids": f.ids, "keys": f.operation_keys, "policy": f.policy,
            "tenant": f.tenant_id, "object": f.object_id, "reason": f.reason}


def status_is(status: str) -> str:
    """SQL: the item's status as operators read it (`item_status`) is `status`, a text
    parameter. Written on the stored status, so a constant `pending` still matches the
    partial indexes of pending items (a leased item is pending in status: migration 0024)."""
    return (f"(status = CASE WHEN {status} = 'leased' THEN 'pending' ELSE {status} END"
            f" AND (lease_token IS NOT NULL) = ({status} = 'leased'))")


# next_attempt_at is '-infinity' until a first retry is planned: answered as "none" (null)
ITEM_COLUMNS = ("id, tenant_id, object_id, policy, policy_version, operation_key, scope, "
                f"{item_status('items')} AS status, due_at, "
                "nullif(next_attempt_at, '-infinity') AS next_attempt_at, "
                "attempts, released_at, batch_id, "
                "last_outcome, last_status_code, last_started_at, last_error, dead_reason, "
                "created_at, "
                "updated_at, completed_at, hold_id, region")


_LIST = Statement("item_selection.list_items", (
    "Items of one status (or any) matching an operator's filter, by id after a keyset "
    "cursor."), f"""
        SELECT {ITEM_COLUMNS} FROM items
        WHERE (CAST(:status AS text) IS NULL OR {status_is("CAST(:status AS text)")})
          AND (CAST(:after AS bigint) IS NULL OR id > :after)
          {FILTER_SQL}
        ORDER BY id LIMIT :limit
    """)  # noqa: S608 - only constant fragments are interpolated


async def list_items(engine: AsyncEngine, *, status: str | None, item_filter: ItemFilter,
                     after: int | None, limit: int) -> list[dict[str, object]]:
    """Items by id (keyset pagination: pass the last id seen as `after`)."""
    params = {"status": status, "after": after, "limit": limit, **filter_params(item_filter)}
    return [dict(r._mapping) for r in await fetch_filtered(engine, _LIST, params)]


# Operator changes: bounded by :limit, each in one transaction together with its audit row.
# A re-drive is also a row of the broker's outbox (`requeues`): in broker mode the leader's
# relay hands the items over (their messages were settled when they died).
_REDRIVE = Statement("item_selection.redrive", (
    "Dead items matching an operator's filter back to pending with their attempts reset, "
    "at most :limit, skipping rows another change holds; queued for the broker."), f"""
    WITH chosen AS (
        SELECT id FROM items WHERE status = 'dead' {FILTER_SQL}
        ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
    ),
    redriven AS (
        UPDATE items i
        SET status = 'pending', attempts = 0, dead_reason = NULL, completed_at = NULL,
            next_attempt_at = now(), updated_at = now()
        FROM chosen WHERE i.id = chosen.id
        RETURNING i.id
    ),
    queued AS (
        INSERT INTO requeues (item_ids)
        SELECT array_agg(id ORDER BY id) FROM redriven HAVING count(*) > 0
    )
    SELECT id FROM redriven
""")  # noqa: S608 - only constant fragments are interpolated

_CANCEL = Statement("item_selection.cancel", (
    "Withdraw pending items matching an operator's filter, at most :limit, skipping rows "
    "another change holds."), f"""
    WITH chosen AS (
        SELECT id FROM items WHERE status = 'pending' AND lease_token IS NULL {FILTER_SQL}
        ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    UPDATE items i
    SET status = 'cancelled', completed_at = now(), updated_at = now()
    FROM chosen WHERE i.id = chosen.id
    RETURNING i.id
""")  # noqa: S608 - only constant fragments are interpolated


async def redrive(engine: AsyncEngine, item_filter: ItemFilter, *, actor: str, reason: str,
                  limit: int) -> list[int]:
    """Dead items back to pending with their attempts reset (released items stay released,
    so workers take them at once); the audit trail records who and why."""
    return await _operator_change(engine, _REDRIVE, "redrive", item_filter, actor, reason, limit)


async def cancel(engine: AsyncEngine, item_filter: ItemFilter, *, actor: str, reason: str,
                 limit: int) -> list[int]:
    """Withdraw pending items (leased ones are in flight and cannot be withdrawn)."""
    return await _operator_change(engine, _CANCEL, "cancel", item_filter, actor, reason, limit)


async def _operator_change(engine: AsyncEngine, statement: Statement, action: str,
                           item_filter: ItemFilter, actor: str, reason: str, limit: int
                           ) -> list[int]:
    async with engine.begin() as conn:
        ids = [int(r.id) for r in await run(
            conn, statement, {**filter_params(item_filter), "limit": limit})]
        details = {"filter": {k: v for k, v in asdict(item_filter).items() if v is not None},
                   "count": len(ids), "item_ids": ids}  # all of them (at most `limit`)
        await audit_trail.record(conn, actor=actor, action=action, reason=reason, details=details)
    return ids

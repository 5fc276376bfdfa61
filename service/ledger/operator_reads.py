"""What operators read that no other module does: one item with its attempts, how many
items a selection would change, the webhook receipts, the operator audit trail, and the
figures of the console's overview (succeeded per second, scopes closed or paused).

Every read here is bounded: a primary-key or index lookup, a keyset page, or a count capped
at the most one operator change may touch."""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import CLOSURE_OVER, Statement, fetch, fetch_filtered
from service.ledger.item_selection import (
    FILTER_SQL,
    ITEM_COLUMNS,
    ItemFilter,
    filter_params,
    status_is,
)

# how far back the overview's throughput looks: long enough to smooth a drain's rounds
THROUGHPUT_WINDOW_S: Final = 10

_ITEM = Statement("operator_reads.item", "One item by id, as the items list shows it.",
                  f"SELECT {ITEM_COLUMNS} FROM items WHERE id = :id")  # noqa: S608

_ATTEMPTS = Statement("operator_reads.attempts", (
    "An item's attempts in order (their index), the newest 500 at most."), """
    SELECT attempt_no, worker, started_at, finished_at, outcome, http_status,
           retry_after_seconds, latency_ms, error_code, fenced
    FROM (SELECT * FROM attempts WHERE item_id = :id
          ORDER BY attempt_no DESC, id DESC LIMIT 500) a
    ORDER BY attempt_no, started_at
""")


async def item(engine: AsyncEngine, item_id: int) -> dict[str, Any] | None:
    """One item, or None."""
    rows = await fetch(engine, _ITEM, {"id": item_id})
    return dict(rows[0]._mapping) if rows else None


async def attempts(engine: AsyncEngine, item_id: int) -> list[dict[str, Any]]:
    """An item's attempts, oldest first (the newest 500 when it has more)."""
    return [dict(r._mapping) for r in await fetch(engine, _ATTEMPTS, {"id": item_id})]


_SELECTION_SIZE = Statement("operator_reads.selection_size", (
    "How many items of one status an operator's filter selects, counted up to a cap (what "
    "one change may touch)."), f"""
    SELECT count(*) AS n FROM (
        SELECT 1 FROM items WHERE {status_is("CAST(:status AS text)")} {FILTER_SQL}
        LIMIT :cap
    ) s
""")  # noqa: S608 - only a constant fragment is interpolated


async def selection_size(engine: AsyncEngine, status: str, item_filter: ItemFilter, *,
                         cap: int) -> int:
    """Items of `status` the filter selects, at most `cap` (a change takes at most that)."""
    rows = await fetch_filtered(engine, _SELECTION_SIZE,
                                {"status": status, "cap": cap, **filter_params(item_filter)})
    return int(rows[0].n)


_RECEIPTS = Statement("operator_reads.receipts", (
    "Webhook receipts newest first, by source and result, before a keyset cursor."), """
    SELECT id, source, webhook_id, event_type, result, cardinality(item_ids) AS items,
           received_at
    FROM webhook_receipts
    WHERE (CAST(:source AS text) IS NULL OR source = :source)
      AND (CAST(:result AS text) IS NULL OR result = :result)
      AND (CAST(:before AS bigint) IS NULL OR id < :before)
    ORDER BY id DESC LIMIT :limit
""")
_RECEIPT_COUNTS = Statement("operator_reads.receipt_counts", (
    "Webhook receipts of the last day per source and result (their received_at index)."), """
    SELECT source, result, count(*) AS n, max(received_at) AS latest
    FROM webhook_receipts WHERE received_at > now() - interval '1 day'
    GROUP BY source, result ORDER BY source, result
""")


async def receipts(engine: AsyncEngine, *, source: str | None, result: str | None,
                   before: int | None, limit: int) -> list[dict[str, Any]]:
    """Receipts newest first (keyset: pass the last id seen as `before`)."""
    rows = await fetch(engine, _RECEIPTS, {"source": source, "result": result,
                                            "before": before, "limit": limit})
    return [dict(r._mapping) for r in rows]


async def receipt_counts(engine: AsyncEngine) -> list[dict[str, Any]]:
    """The last day's receipts per source and result, with the latest of each."""
    return [dict(r._mapping) for r in await fetch(engine, _RECEIPT_COUNTS, {})]


_ACTIONS = Statement("operator_reads.actions", (
    "Operator actions newest first, before a keyset cursor."), """
    SELECT id, at, actor, action, reason, details FROM operator_actions
    WHERE (CAST(:before AS bigint) IS NULL OR id < :before)
    ORDER BY id DESC LIMIT :limit
""")


async def actions(engine: AsyncEngine, *, before: int | None, limit: int
                  ) -> list[dict[str, Any]]:
    """The audit trail newest first (keyset: pass the last id seen as `before`)."""
    rows = await fetch(engine, _ACTIONS, {"before": before, "limit": limit})
    return [dict(r._mapping) for r in rows]


_ACTION = Statement("operator_reads.action", (
    "One operator action, with its details."),
    "SELECT id, at, actor, action, reason, details FROM operator_actions WHERE id = :id")


async def action(engine: AsyncEngine, action_id: int) -> dict[str, Any] | None:
    """One action of the audit trail; None when there is none with that id."""
    rows = await fetch(engine, _ACTION, {"id": action_id})
    return dict(rows[0]._mapping) if rows else None


_SUCCEEDED_RECENTLY = Statement("operator_reads.succeeded_recently", (
    "Items per policy that succeeded within the throughput window (the finished-items "
    "index, a range as long as the window)."), """
    SELECT policy, count(*) AS n FROM items
    WHERE status = 'succeeded' AND completed_at > now() - make_interval(secs => :window)
    GROUP BY policy
""")
_TROUBLED_SCOPES = Statement("operator_reads.troubled_scopes", (
    "Scopes closed by the upstream or paused, with why and until when (the first 100 by "
    "name)."), f"""
    SELECT s.name, s.paused, s.paused_reason,
           CASE WHEN NOT {CLOSURE_OVER} THEN s.closed_until END AS closed_until,
           CASE WHEN NOT {CLOSURE_OVER} THEN s.closed_reason END AS closed_reason
    FROM scopes s WHERE s.paused OR NOT {CLOSURE_OVER}
    ORDER BY s.name LIMIT 100
""")  # noqa: S608 - only a constant fragment is interpolated


async def succeeded_per_second(engine: AsyncEngine) -> dict[str, float]:
    """Items succeeded per second per policy, over the last THROUGHPUT_WINDOW_S."""
    rows = await fetch(engine, _SUCCEEDED_RECENTLY, {"window": THROUGHPUT_WINDOW_S})
    return {r.policy: r.n / THROUGHPUT_WINDOW_S for r in rows}


async def troubled_scopes(engine: AsyncEngine) -> list[dict[str, Any]]:
    """Scopes closed or paused, with their reasons."""
    return [dict(r._mapping) for r in await fetch(engine, _TROUBLED_SCOPES, {})]

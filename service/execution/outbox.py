"""The ledger's side of the broker: the outbox the relay hands over (batches, webhook
deliveries that released items, released legal holds and operators' re-drives, not yet
`enqueued_at`: migration 0028), and the items of a message the broker gave up on, ended
here as dead.

A held item's message is deferred for minutes at a time (service/execution/deliveries.py);
the hold's release hands its tenant's claimable items over at once, as database mode makes
them claimable at once (copies of items already in the broker are fenced).

Every statement is one short transaction of its own: none is open while the broker is
called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from service.db.statements import LEASED, Database, Statement, expired_lease, fetch, fetch_none


# What is waiting, oldest first: each row's items that are still pending (the rest finished
# in database mode, or by an earlier delivery, and need no message), by region (each goes
# to its region's queues; one row with no region and no ids when none is pending). A
# batch's items come by items_batch_cover; a receipt lists its own; a released hold's are
# its tenant's (and policy's) released items no hold marks (by items_obligation, which
# leads with the tenant).
def _by_region(rows: str, alias: str, items: str) -> str:
    """One outbox branch: the `rows` waiting (as `alias`), each with its `items` by region."""
    return f"""(SELECT {alias}.kind, {alias}.id, g.region, g.item_ids
     FROM ({rows}) {alias}
     LEFT JOIN LATERAL (
         SELECT i.region, array_agg(i.id ORDER BY i.id) AS item_ids FROM items i
         WHERE {items} GROUP BY i.region
     ) g ON true
     ORDER BY {alias}.id, g.region NULLS FIRST)"""  # noqa: S608 - constant fragments only


_WAITING = Statement("outbox.waiting", (
    "Batches, webhook deliveries, released holds and re-drives not yet handed to the "
    "broker, with their pending items by region."), "\n    UNION ALL\n    ".join((
        _by_region("SELECT 'batch' AS kind, id FROM batches WHERE enqueued_at IS NULL "
                   "ORDER BY id LIMIT :limit", "b",
                   "i.batch_id = b.id AND i.status = 'pending'"),
        _by_region("SELECT 'receipt' AS kind, id, item_ids FROM webhook_receipts "
                   "WHERE enqueued_at IS NULL ORDER BY id LIMIT :limit", "r",
                   "i.id = ANY(r.item_ids) AND i.status = 'pending' "
                   "AND i.released_at IS NOT NULL"),
        _by_region("SELECT 'hold' AS kind, id, tenant_id, policy FROM holds "
                   "WHERE released_at IS NOT NULL AND enqueued_at IS NULL "
                   "ORDER BY id LIMIT :limit", "h",
                   "i.tenant_id = h.tenant_id AND (h.policy IS NULL OR i.policy = h.policy) "
                   "AND i.status = 'pending' AND i.released_at IS NOT NULL "
                   "AND i.hold_id IS NULL"),
        _by_region("SELECT 'requeue' AS kind, id, item_ids FROM requeues "
                   "WHERE enqueued_at IS NULL ORDER BY id LIMIT :limit", "q",
                   "i.id = ANY(q.item_ids) AND i.status = 'pending' "
                   "AND i.released_at IS NOT NULL"),
    )))

_MARK = Statement("outbox.mark", (
    "Record that the broker confirmed these batches, webhook deliveries, holds and "
    "re-drives."), """
    WITH b AS (
        UPDATE batches SET enqueued_at = now()
        WHERE id = ANY(CAST(:batches AS bigint[])) AND enqueued_at IS NULL
    ), h AS (
        UPDATE holds SET enqueued_at = now()
        WHERE id = ANY(CAST(:holds AS bigint[])) AND enqueued_at IS NULL
    ), q AS (
        UPDATE requeues SET enqueued_at = now()
        WHERE id = ANY(CAST(:requeues AS bigint[])) AND enqueued_at IS NULL
    )
    UPDATE webhook_receipts SET enqueued_at = now()
    WHERE id = ANY(CAST(:receipts AS bigint[])) AND enqueued_at IS NULL
""")

# A message the broker delivered too many times (every consumer holding it died or lost
# its channel): its items that are pending and not under a running lease end dead with the
# reason; the ids returned are those under a running lease, which its holder completes.
_END_DEAD = Statement("outbox.end_dead", (
    "End a poison message's pending items as dead with a reason, unless a lease runs."), f"""
    WITH ended AS (
        UPDATE items i
        SET status = 'dead', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
            last_outcome = 'unknown', last_status_code = NULL, last_error = :reason,
            dead_reason = :reason, completed_at = now(), updated_at = now()
        WHERE i.id = ANY(CAST(:ids AS bigint[])) AND i.status = 'pending'
          AND (NOT {LEASED} OR {expired_lease()})
        RETURNING i.id
    )
    SELECT i.id FROM items i
    WHERE i.id = ANY(CAST(:ids AS bigint[])) AND i.status = 'pending'
      AND i.lease_token IS NOT NULL AND i.lease_expires_at > now()
      AND i.id NOT IN (SELECT id FROM ended)
""")  # noqa: S608 - only constant fragments are interpolated

# Items delivered to a worker of another region (re-pinned after they were published): a
# re-drive of its own, which the relay publishes to each item's region's queues.
_REROUTE = Statement("outbox.reroute", (
    "Hand items delivered to the wrong region's queues back to the relay, to publish to "
    "their own region's."), """
    INSERT INTO requeues (item_ids) VALUES (CAST(:ids AS bigint[]))
""")

WAITING_LIMIT: Final = 64  # outbox rows per pass, of each kind


@dataclass(frozen=True)
class Waiting:
    """An outbox row waiting: its kind and id, and its pending items by region (None: the
    tenants pinned nowhere); none when no item is pending (the row is marked all the same)."""

    kind: str
    row_id: int
    by_region: dict[str | None, list[int]] = field(default_factory=dict)


async def waiting(db: Database, limit: int = WAITING_LIMIT) -> list[Waiting]:
    """Each outbox row waiting: batches, then webhook deliveries (`receipt`), released
    holds (`hold`) and re-drives (`requeue`), oldest first."""
    rows: dict[tuple[str, int], Waiting] = {}
    for r in await fetch(db, _WAITING, {"limit": limit}):
        row = rows.setdefault((r.kind, int(r.id)), Waiting(r.kind, int(r.id)))
        if r.item_ids is not None:
            row.by_region[r.region] = list(r.item_ids)
    return list(rows.values())


async def mark(db: Database, rows: Sequence[tuple[str, int]]) -> None:
    """Mark these (kind, id) outbox rows enqueued."""
    await fetch_none(db, _MARK, {param: [i for k, i in rows if k == kind] for kind, param in (
        ("batch", "batches"), ("receipt", "receipts"), ("hold", "holds"),
        ("requeue", "requeues"))})


async def end_dead(db: Database, item_ids: Sequence[int], reason: str) -> list[int]:
    """End the pending items among `item_ids` as dead (`reason`); the ids left pending
    because a lease on them still runs."""
    return [int(r.id) for r in await fetch(db, _END_DEAD, {"ids": list(item_ids),
                                                         "reason": reason})]


async def reroute(db: Database, item_ids: Sequence[int]) -> None:
    """Hand `item_ids` to the relay again: it publishes them to their region's queues."""
    if item_ids:
        await fetch_none(db, _REROUTE, {"ids": sorted(item_ids)})

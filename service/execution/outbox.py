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
from typing import Final

from service.db.statements import LEASED, Database, Statement, expired_lease, fetch, fetch_none

# What is waiting, oldest first: each row's items that are still pending (the rest finished
# in database mode, or by an earlier delivery, and need no message). A batch's items come by
# items_batch_cover; a receipt lists its own; a released hold's are its tenant's (and
# policy's) released items no hold marks (by items_obligation, which leads with the tenant).
_WAITING = Statement("outbox.waiting", (
    "Batches and webhook deliveries not yet handed to the broker, with their pending "
    "items."), """
    (SELECT 'batch' AS kind, b.id, ARRAY(
         SELECT i.id FROM items i WHERE i.batch_id = b.id AND i.status = 'pending'
         ORDER BY i.id) AS item_ids
     FROM batches b WHERE b.enqueued_at IS NULL ORDER BY b.id LIMIT :limit)
    UNION ALL
    (SELECT 'receipt', r.id, ARRAY(
         SELECT i.id FROM items i
         WHERE i.id = ANY(r.item_ids) AND i.status = 'pending'
           AND i.released_at IS NOT NULL ORDER BY i.id)
     FROM webhook_receipts r WHERE r.enqueued_at IS NULL ORDER BY r.id LIMIT :limit)
    UNION ALL
    (SELECT 'hold', h.id, ARRAY(
         SELECT i.id FROM items i
         WHERE i.tenant_id = h.tenant_id AND (h.policy IS NULL OR i.policy = h.policy)
           AND i.status = 'pending' AND i.released_at IS NOT NULL AND i.hold_id IS NULL
         ORDER BY i.id)
     FROM holds h WHERE h.released_at IS NOT NULL AND h.enqueued_at IS NULL
     ORDER BY h.id LIMIT :limit)
    UNION ALL
    (SELECT 'requeue', q.id, ARRAY(
         SELECT i.id FROM items i
         WHERE i.id = ANY(q.item_ids) AND i.status = 'pending'
           AND i.released_at IS NOT NULL ORDER BY i.id)
     FROM requeues q WHERE q.enqueued_at IS NULL ORDER BY q.id LIMIT :limit)
""")

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

WAITING_LIMIT: Final = 64  # outbox rows per pass, of each kind


async def waiting(db: Database, limit: int = WAITING_LIMIT
                  ) -> list[tuple[str, int, list[int]]]:
    """(kind, id, pending item ids) of each outbox row waiting: batches, then webhook
    deliveries (`receipt`), released holds (`hold`) and re-drives (`requeue`)."""
    return [(r.kind, int(r.id), list(r.item_ids))
            for r in await fetch(db, _WAITING, {"limit": limit})]


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

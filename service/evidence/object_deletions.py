"""An object's deletions, as `GET /v1/evidence` answers: its succeeded items in the ledger and
the evidence kept of pruned ones."""

from __future__ import annotations

import logging
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch

log = logging.getLogger(__name__)


_RECORD_COLUMNS: Final = ("item_id, tenant_id, object_id, policy, policy_version, "
                          "operation_key, outcome, upstream_status, attempts, completed_at")

# An object's deletions: its succeeded items (any policy and version) and the evidence kept
# of pruned ones, oldest first; both through an index led by (tenant_id, object_id).
_LOOKUP = Statement("object_deletions.lookup", (
    "Whether an object was deleted, when and under which policy: its succeeded items and the "
    "evidence kept of pruned ones."), f"""
    SELECT 'ledger' AS kept_in, b.run_id, i.id AS item_id, i.tenant_id, i.object_id, i.policy,
           i.policy_version, i.operation_key, i.last_outcome AS outcome,
           i.last_status_code AS upstream_status, i.attempts, i.completed_at
    FROM items i LEFT JOIN batches b ON b.id = i.batch_id
    WHERE i.tenant_id = :tenant AND i.object_id = :object AND i.status = 'succeeded'
    UNION ALL
    SELECT 'evidence', run_id, {_RECORD_COLUMNS} FROM evidence
    WHERE tenant_id = :tenant AND object_id = :object
    ORDER BY completed_at, item_id
    LIMIT :limit
""")  # noqa: S608 - only a constant is interpolated


async def lookup(engine: AsyncEngine, tenant_id: str, object_id: str, *, limit: int
                 ) -> list[dict[str, Any]]:
    """An object's deletions, oldest first: from the ledger and from kept evidence."""
    rows = await fetch(engine, _LOOKUP, {"tenant": tenant_id, "object": object_id,
                                         "limit": limit})
    return [dict(r._mapping) for r in rows]

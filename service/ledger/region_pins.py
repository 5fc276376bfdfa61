"""Items kept in the regions the policies file pins their tenants to (service/config/
regions.py), whatever wrote them and whenever the file changed.

- At start-up (every process that runs workers, before its first claim) each item of a
  tenant whose region changed since the pins last applied is moved (`reconcile`), whatever
  its status, so a later re-drive or re-arm keeps to the pins too; skipped when the pins
  are those applied last (their digest is in `region_pins`). Moved items that were
  released go to their new region's queues in broker mode: their messages wait in the old
  region's, which no worker may read any more.
- At every claim the worker compares each lease's tenant with its own file
  (`service/worker/postgres.py`): an item written by a process with another file (a
  rollout in progress), or moved since it was claimed, is never called outside its
  tenant's region: its lease is handed back and its region corrected (`correct`).

A lease running on a moved item finishes where it started, once: that worker's file
pinned the tenant to its region when it claimed it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.regions import Regions
from service.db.statements import Database, Statement, fetch, fetch_none
from service.ledger.claims import Lease

log = logging.getLogger(__name__)

HAND_OVER_CHUNK: Final = 10_000  # item ids per re-drive row the relay publishes
MOVE_CHUNK: Final = 10_000  # items moved per statement: each well inside the statement timeout
MISPLACED_DELAY_S: Final = 5  # an item corrected at its claim waits this long (a rollout)

def _distinct_tenants(where: str) -> str:
    """SQL for the distinct tenant ids of the items matching `where` (on `i`), one index
    probe each (a loose index scan: PostgreSQL 15 has no skip scan of its own)."""
    return f"""
    WITH RECURSIVE t AS (
        (SELECT i.tenant_id FROM items i WHERE {where} ORDER BY i.tenant_id LIMIT 1)
        UNION ALL
        SELECT (SELECT i.tenant_id FROM items i
                WHERE {where} AND i.tenant_id > t.tenant_id
                ORDER BY i.tenant_id LIMIT 1)
        FROM t WHERE t.tenant_id IS NOT NULL
    )
    SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL
"""  # noqa: S608 - only constant fragments are interpolated


# Every tenant id the ledger holds (by items_obligation, which leads with the tenant), and
# those with items in some region (by items_pinned).
_TENANTS = Statement("region_pins.tenants", (
    "Every distinct tenant id in the ledger, by a loose scan of items_obligation."),
    _distinct_tenants("true"))
_PINNED_TENANTS = Statement("region_pins.pinned_tenants", (
    "Every distinct tenant id with items in a region, by a loose scan of items_pinned."),
    _distinct_tenants("i.region IS NOT NULL"))

# The moved items that were released and are pending, handed to the relay as re-drives of
# HAND_OVER_CHUNK ids at most (:hand_over: broker mode; none: no row).
_HAND_OVER: Final = f"""
    handed AS (
        INSERT INTO requeues (item_ids)
        SELECT array_agg(id ORDER BY id) FROM (
            SELECT id, (row_number() OVER (ORDER BY id) - 1) / {HAND_OVER_CHUNK} AS chunk
            FROM moved
            WHERE CAST(:hand_over AS boolean) AND status = 'pending'
              AND released_at IS NOT NULL
        ) c
        GROUP BY chunk
    )
    SELECT count(*) AS n FROM moved"""  # noqa: S608 - only a constant is interpolated

# Up to MOVE_CHUNK items of these tenant spellings (all pinned to :region, or to none)
# not in it yet; the caller repeats it until it moves fewer.
_MOVE = Statement("region_pins.move", (
    "Move items of these tenants into a region (or none), a chunk at a time, and hand the "
    "released pending ones to the relay."), f"""
    WITH chunk AS (
        SELECT id FROM items
        WHERE tenant_id = ANY(CAST(:tenants AS text[]))
          AND region IS DISTINCT FROM CAST(:region AS text)
        LIMIT {MOVE_CHUNK}
    ),
    moved AS (
        UPDATE items i SET region = CAST(:region AS text), updated_at = now()
        FROM chunk WHERE i.id = chunk.id
        RETURNING i.id, i.status, i.released_at
    ),{_HAND_OVER}
""")  # noqa: S608 - only constant fragments are interpolated

_APPLIED = Statement("region_pins.applied", (
    "The digest of the pins the ledger's items were last moved to."),
    "SELECT digest FROM region_pins WHERE id = 1")
_RECORD = Statement("region_pins.record", "Record the pins the items were moved to.", """
    INSERT INTO region_pins (id, digest, applied_at) VALUES (1, :digest, now())
    ON CONFLICT (id) DO UPDATE SET digest = EXCLUDED.digest, applied_at = EXCLUDED.applied_at
""")

# Leases claimed by a worker whose file pins their tenant elsewhere: the item takes that
# region (fenced on the lease; the caller hands the lease back) and waits a little, so two
# files that disagree during a rollout pass it back and forth slowly, never call it.
_CORRECT = Statement("region_pins.correct", (
    "Give items claimed outside their tenant's region that region, fenced on the lease."),
    f"""
    UPDATE items i
    SET region = r.region, updated_at = now(),
        next_attempt_at = greatest(i.next_attempt_at,
                                   now() + interval '{MISPLACED_DELAY_S} seconds')
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[]), CAST(:regions AS text[]))
         AS r(id, token, region)
    WHERE i.id = r.id AND i.lease_token = r.token
""")  # noqa: S608 - only a constant is interpolated


async def reconcile(engine: AsyncEngine, regions: Regions, *, hand_over: bool) -> int:
    """Move every item into its tenant's region as `regions` pins it, unless these pins
    were applied last; released pending items moved are handed to the relay when
    `hand_over` (broker mode). The number of items moved."""
    applied = await fetch(engine, _APPLIED, {})
    if applied and applied[0].digest == regions.digest:
        return 0
    by_region: defaultdict[str | None, list[str]] = defaultdict(list)
    if regions.pins:
        for row in await fetch(engine, _TENANTS, {}):
            if (region := regions.of_tenant(row.tenant_id)) is not None:
                by_region[region].append(row.tenant_id)
    # unpinned by name, never as "not seen above": a tenant first written since is written
    # with its region already, and must keep it
    for row in await fetch(engine, _PINNED_TENANTS, {}):
        if regions.of_tenant(row.tenant_id) is None:
            by_region[None].append(row.tenant_id)
    moved = 0
    for region, tenants in sorted(by_region.items(), key=lambda r: r[0] or ""):
        moved += await _move(engine, region, tenants, hand_over=hand_over)
    await fetch_none(engine, _RECORD, {"digest": regions.digest})
    if moved:
        log.warning("items moved to the regions their tenants are pinned to now",
                    extra={"items": moved})
    return moved


async def _move(engine: AsyncEngine, region: str | None, tenants: list[str], *,
                hand_over: bool) -> int:
    """Move the items of `tenants` into `region`, a chunk per statement; how many."""
    moved = 0
    while True:
        [row] = await fetch(engine, _MOVE, {"region": region, "tenants": tenants,
                                            "hand_over": hand_over})
        moved += int(row.n)
        if int(row.n) < MOVE_CHUNK:
            return moved


async def correct(db: Database, misplaced: Sequence[tuple[Lease, str | None]]) -> None:
    """Give each leased item the region its tenant is pinned to (`(lease, region)`), if
    its lease is still this one; the caller hands the leases back."""
    if misplaced:
        await fetch_none(db, _CORRECT, {"ids": [lease.item_id for lease, _ in misplaced],
                                        "tokens": [lease.lease_token for lease, _ in misplaced],
                                        "regions": [region for _, region in misplaced]})
        log.warning("items claimed outside their tenants' regions were handed back (the "
                    "processes' policies files disagree on [regions])",
                    extra={"items": len(misplaced)})

"""Items re-pinned when the policies file's regions change, at start-up (every process that
runs workers, before its first claim), so an item registered before its tenant was pinned
is never processed outside the region it is pinned to now.

Items are written with their tenant's region (registration, webhooks); what changes later
is the file. The open items (pending, or skipped and so re-armable) of each tenant whose
region differs from its items' are moved, found by the spellings of tenant ids the ledger
holds (a pin covers every spelling a host name shares: service/config/regions.py). A lease
running on a moved item finishes where it started, once; its next claim is the region's.
In broker mode the moved items that were released go to their new region's queues: each
statement writes them to the outbox as a re-drive (`requeues`), since their messages wait
in the old region's queues, which no worker may read any more (in database mode the row
waits unread, as an operator's re-drive does).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.regions import Regions
from service.db.statements import Statement, fetch

log = logging.getLogger(__name__)

_OPEN: Final = "i.status IN ('pending', 'skipped')"  # items_pinned's predicate, with region

# Every tenant id the ledger holds, one index probe each on items_obligation (which leads
# with the tenant): a loose index scan, as PostgreSQL 15 has no skip scan of its own.
_TENANTS = Statement("region_pins.tenants", (
    "Every distinct tenant id in the ledger, by a loose scan of items_obligation."), """
    WITH RECURSIVE t AS (
        (SELECT tenant_id FROM items ORDER BY tenant_id LIMIT 1)
        UNION ALL
        SELECT (SELECT i.tenant_id FROM items i WHERE i.tenant_id > t.tenant_id
                ORDER BY i.tenant_id LIMIT 1)
        FROM t WHERE t.tenant_id IS NOT NULL
    )
    SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL
""")

# The moved items that were released, handed to the relay as one re-drive (none: no row).
_HAND_OVER: Final = """
    handed AS (
        INSERT INTO requeues (item_ids)
        SELECT array_agg(id ORDER BY id) FROM moved
        WHERE status = 'pending' AND released_at IS NOT NULL
        HAVING count(*) > 0
    )
    SELECT count(*) AS n FROM moved"""

# The open items of these tenant spellings (all pinned to :region) not in it yet.
_PIN = Statement("region_pins.pin", (
    "Move the open items of tenants pinned to a region into it, and hand the released "
    "ones to the relay."), f"""
    WITH moved AS (
        UPDATE items i SET region = :region, updated_at = now()
        WHERE i.tenant_id = ANY(CAST(:tenants AS text[])) AND {_OPEN}
          AND i.region IS DISTINCT FROM CAST(:region AS text)
        RETURNING i.id, i.status, i.released_at
    ),{_HAND_OVER}
""")  # noqa: S608 - only constant fragments are interpolated

# The open items pinned to a region whose tenant is pinned nowhere now (by items_pinned).
_UNPIN = Statement("region_pins.unpin", (
    "Release the open items of tenants no longer pinned to any region, and hand the "
    "released ones to the relay."), f"""
    WITH moved AS (
        UPDATE items i SET region = NULL, updated_at = now()
        WHERE i.region IS NOT NULL AND {_OPEN}
          AND NOT (i.tenant_id = ANY(CAST(:pinned AS text[])))
        RETURNING i.id, i.status, i.released_at
    ),{_HAND_OVER}
""")  # noqa: S608 - only constant fragments are interpolated


async def reconcile(engine: AsyncEngine, regions: Regions) -> int:
    """Move each open item into its tenant's region as `regions` pins it now; the number
    of items moved."""
    by_region: defaultdict[str, list[str]] = defaultdict(list)
    if regions.pins:
        for row in await fetch(engine, _TENANTS, {}):
            region = regions.of_tenant(row.tenant_id)
            if region is not None:
                by_region[region].append(row.tenant_id)
    moved = 0
    for region, tenants in sorted(by_region.items()):
        [row] = await fetch(engine, _PIN, {"region": region, "tenants": tenants})
        moved += int(row.n)
    pinned = [tenant for tenants in by_region.values() for tenant in tenants]
    [row] = await fetch(engine, _UNPIN, {"pinned": pinned})
    moved += int(row.n)
    if moved:
        log.warning("open items moved to the regions their tenants are pinned to now",
                    extra={"items": moved})
    return moved

"""Step 3 of placing a legal hold (service/ledger/holds.py says why the steps are safe), and
the workers' side of it: each worker process learns the holds in force (`latest`, `since`),
acknowledges them with the covered calls it took back unstarted (`acknowledge`; it starts
none from then on: service/worker/hold_gate.py), and a placement answers once every worker
holding a covered lease has acknowledged it, or that lease has run out (`settle`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Database, Statement, active_hold, fetch, fetch_none

# Step 3: the hold answers once no covered call can start any more (the module docstring).
_UNSETTLED = Statement("hold_acks.unsettled", (
    "The hold's covered leases whose worker has not acknowledged it and that have not run "
    "out, and when the last of them does."), """
    SELECT count(*) AS waiting, max(i.lease_expires_at) AS until,
           clock_timestamp() AS now
    FROM items i
    WHERE i.hold_id = :id AND i.lease_expires_at > clock_timestamp()
      AND NOT EXISTS (SELECT FROM hold_acks a WHERE a.hold_id = :id
                      AND a.worker = i.lease_owner)
""")
# The calls the workers took back before they started were not in flight after all.
_SETTLE = Statement("hold_acks.settle", (
    "Take the calls the workers revoked unstarted off the hold's calls in flight."), """
    WITH revoked AS (
        SELECT DISTINCT r.id FROM hold_acks a, unnest(a.revoked) AS r(id)
        WHERE a.hold_id = :id
    ),
    listed AS (
        SELECT count(*) AS n FROM holds hx, unnest(hx.in_flight_item_ids) AS f(id)
        WHERE hx.id = :id AND f.id IN (SELECT id FROM revoked)
    )
    UPDATE holds hx
    SET in_flight = hx.in_flight - (SELECT n FROM listed),
        in_flight_item_ids = ARRAY(SELECT f.id FROM unnest(hx.in_flight_item_ids) AS f(id)
                                   WHERE f.id NOT IN (SELECT id FROM revoked) ORDER BY f.id)
    WHERE hx.id = :id
""")
_LATEST = Statement("hold_acks.latest", "The newest hold's id (0: none yet).",
                    "SELECT coalesce(max(id), 0) AS id FROM holds")
_SINCE = Statement("hold_acks.since", (
    "The holds in force placed after the one a worker learned last, with what they cover."),
    f"""
    SELECT id, tenant_id, policy, object_ids, object_id_prefix FROM holds hx
    WHERE id > :after AND {active_hold()}
    ORDER BY id
""")  # noqa: S608 - only a constant fragment is interpolated
_ACK = Statement("hold_acks.ack", (
    "A worker knows these holds: it starts no call they cover, and took these back."), """
    INSERT INTO hold_acks (hold_id, worker, revoked)
    SELECT u.hold_id, :worker, CAST(u.revoked AS bigint[])
    FROM unnest(CAST(:holds AS bigint[]), CAST(:revoked AS text[])) AS u(hold_id, revoked)
    ON CONFLICT (hold_id, worker) DO NOTHING
""")

SETTLE_POLL_S: Final = 0.02
# Past a lease's end, the margin for the worker's estimate of the database's clock (it
# stops LEASE_END_MARGIN_S before the end by that estimate: service/worker/hold_gate.py).
SETTLE_MARGIN_S: Final = 1.0


async def settle(engine: AsyncEngine, hold_id: int) -> None:
    """Step 3: wait until no call the hold covers can start any more (every worker holding
    a covered lease has acknowledged the hold, or the lease has run out), then take the
    calls those workers revoked off `in_flight`."""
    while True:
        [row] = await fetch(engine, _UNSETTLED, {"id": hold_id})
        if not row.waiting:
            break
        if row.now > row.until + timedelta(seconds=SETTLE_MARGIN_S):
            break
        await asyncio.sleep(SETTLE_POLL_S)
    await fetch_none(engine, _SETTLE, {"id": hold_id})


async def latest(db: Database) -> int:
    """The newest hold's id (0: none)."""
    [row] = await fetch(db, _LATEST, {})
    return int(row.id)


async def since(db: Database, after: int) -> list[dict[str, Any]]:
    """The holds in force placed after hold `after`, oldest first."""
    return [dict(r._mapping) for r in await fetch(db, _SINCE, {"after": after})]


async def acknowledge(db: Database, worker: str, revoked: Mapping[int, Sequence[int]]
                      ) -> None:
    """Worker `worker` knows these holds; `revoked` names, per hold, the calls it took back
    unstarted."""
    if revoked:
        await fetch_none(db, _ACK, {
            "worker": worker, "holds": list(revoked),
            "revoked": ["{" + ",".join(map(str, ids)) + "}" for ids in revoked.values()]})

"""Step 2 of placing a legal hold (service/ledger/holds.py says why the steps are safe):
the items a placed hold covers marked with its id, a chunk at a time, then the moment it
took effect recorded, with the calls that were in flight when it was placed.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.engine import is_busy
from service.db.statements import LEASED, Statement, active_hold, fetch, hold_covers

log = logging.getLogger(__name__)

MARK_RETRIES: Final = 5
IN_FLIGHT_IDS_KEPT: Final = 1000  # ids of in-flight calls stored on a hold (the count is exact)

# Step 2 (see the module docstring), a chunk at a time so a hold over millions of items
# never needs one long statement: each chunk takes the next covered rows' locks in id order
# (waiting for admissions that hold them) and marks them; the ones it finds leased are
# calls in flight, noted on the hold. The hold's row is locked in each chunk, so a release
# or another marking of the same hold waits for it.
MARK_CHUNK: Final = 10_000
# CTE `target`: the hold, while it is neither released nor in effect, its row locked (each
# step-2 statement starts with it).
_UNFINISHED_HOLD: Final = """target AS (
        SELECT * FROM holds WHERE id = :id AND released_at IS NULL AND effective_at IS NULL
        FOR UPDATE
    )"""
_MARK_CHUNK = Statement("hold_marking.mark_chunk", (
    "Mark the next chunk of the items a hold covers (pending, leased or not) with its id, "
    "and note the leased ones on the hold as calls in flight."), f"""
    WITH {_UNFINISHED_HOLD},
    chunk AS (
        SELECT i.id FROM items i, target hx
        WHERE {hold_covers()} AND i.status = 'pending' AND i.hold_id IS NULL
        ORDER BY i.id
        LIMIT :chunk
        FOR UPDATE OF i
    ),
    marked AS (
        UPDATE items i SET hold_id = :id
        FROM chunk WHERE i.id = chunk.id
        RETURNING i.id, {LEASED} AS leased
    ),
    noted AS (
        UPDATE holds hx
        SET in_flight = hx.in_flight + (SELECT count(*) FROM marked WHERE leased),
            in_flight_item_ids = (hx.in_flight_item_ids || ARRAY(
                SELECT id FROM marked WHERE leased ORDER BY id
            ))[1:{IN_FLIGHT_IDS_KEPT}]
        FROM target WHERE hx.id = target.id
    )
    SELECT count(*) AS marked FROM marked
""")  # noqa: S608 - only constant fragments are interpolated

# The end of step 2: the hold takes effect. Covered items that finished since step 1
# without being marked by it were in flight too; a marked item that finished since was
# noted when its chunk found it leased. Items another hold marked first count as held.
_TAKE_EFFECT = Statement("hold_marking.take_effect", (
    "Record that a hold's items are marked: when, how many it holds, and the calls that "
    "finished in flight since it was recorded."), f"""
    WITH {_UNFINISHED_HOLD},
    held AS (
        SELECT count(*) AS n FROM items i, target hx
        WHERE {hold_covers()} AND i.status = 'pending' AND i.hold_id IS NOT NULL
    ),
    finished AS (
        SELECT i.id FROM items i, target hx
        WHERE {hold_covers()} AND i.status IN ('succeeded', 'dead')
          AND i.completed_at >= hx.placed_at AND i.hold_id IS DISTINCT FROM hx.id
    )
    UPDATE holds hx
    SET effective_at = clock_timestamp(),
        items_held = (SELECT n FROM held),
        in_flight = hx.in_flight + (SELECT count(*) FROM finished),
        in_flight_item_ids = (hx.in_flight_item_ids || ARRAY(
            SELECT id FROM finished ORDER BY id))[1:{IN_FLIGHT_IDS_KEPT}]
    FROM target WHERE hx.id = target.id
    RETURNING hx.*, {active_hold()} AS active
""")  # noqa: S608 - only constant fragments are interpolated


async def mark_items(engine: AsyncEngine, hold_id: int, *, chunk: int = MARK_CHUNK) -> None:
    """Mark the hold's items chunk by chunk (nothing when it is marked or released already).
    A chunk the database refused as busy (a deadlock with a completion, a lock or statement
    timeout) goes again, up to MARK_RETRIES times in a row."""
    retries = 0
    while True:
        try:
            [row] = await fetch(engine, _MARK_CHUNK, {"id": hold_id, "chunk": chunk})
        except DBAPIError as exc:
            retries += 1
            if not is_busy(exc) or retries > MARK_RETRIES:
                raise
            log.warning("holds: marking chunk retried", extra={"hold_id": hold_id,
                                                               "retry": retries})
            continue
        retries = 0
        if row.marked < chunk:
            return


async def take_effect(engine: AsyncEngine, hold_id: int) -> dict[str, Any] | None:
    """Record that the hold's items are marked, with the calls that were in flight; the hold
    as stored, or None when it had taken effect already (or was released)."""
    rows = await fetch(engine, _TAKE_EFFECT, {"id": hold_id})
    if not rows:
        return None
    hold = dict(rows[0]._mapping)
    if hold["in_flight"]:
        log.warning("hold placed while calls were in flight", extra={
            "hold_id": hold_id, "in_flight": hold["in_flight"]})
    return hold

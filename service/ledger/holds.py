"""Legal holds: while a hold is active, no item it covers is leased, so no upstream call
starts for it on any replica.

A hold covers a tenant's items, optionally of one policy, optionally only some object ids
or the ids with a prefix; it covers items registered later too. It ends when an operator
releases it or its expiry passes (the maintenance pass releases expired holds; until then
the items it marked stay held, the safe side).

Enforcement, and why it cannot be raced. Claims run at READ COMMITTED: an admission reads
items as of its statement's start and re-reads only the rows it locks. So a hold is placed
in two transactions:
  1. `_PLACE` commits the hold row. Every statement that starts afterwards sees it: an
     admission skips what it covers (`statements.not_held`), a registration marks what it
     writes (`statements.covering_hold`).
  2. service/ledger/hold_marking.py: `_MARK_CHUNK` sets `items.hold_id` on the covered
     pending and leased items, a chunk at a time, then `_TAKE_EFFECT` records the moment
     (`effective_at`). An admission that began before step 1 committed cannot see the
     hold, but every item it can see was written before the marking began, so a chunk
     marks it, and a claim that locks a marked row re-reads it and finds `hold_id` set (a
     row such a claim locked first, the chunk waits for and then finds leased). An item
     written between the two steps by a registration that did not see the hold is visible
     only to admissions that do.
Once the hold has taken effect, no claim leases a covered item. A call leased before it
may still be waiting in a worker for its token's moment, a slot or a connection, so:
  3. service/ledger/hold_acks.py: `settle` waits until every worker holding a covered
     lease has acknowledged the hold (it learned of the hold from the notification
     `_PLACE` sends, or its poll, revoked the covered calls it had not started, and starts
     none from then on: service/worker/hold_gate.py) or that lease has run out (a worker
     starts no call in its lease's last LEASE_END_MARGIN_S). Only then does `place`
     answer: no call the hold covers starts after its answer, on any replica.
Items a chunk found leased, and covered items that finished after step 1, are the calls
that were in flight, less those their workers revoked unstarted: they are reported on the
hold (`in_flight`, with up to `hold_marking.IN_FLIGHT_IDS_KEPT` of their ids). A hold
whose step 2 never finished (the process died, the database went away) is still enforced
by the admission's check, and the maintenance pass finishes its marking.

A marked item stays pending (or finishes the call in flight) with its hold's id, never
punished: it is not claimable, so no attempt is spent. Releasing a hold moves its items to
another active hold that covers them, or frees them: released items that are due are
claimable at once (workers are woken), the others wait for the next run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.db.statements import Statement, active_hold, covering_hold, fetch, run
from service.db.wakeups import HOLDS_CHANNEL, wake_workers
from service.evidence import audit_trail
from service.ledger import hold_acks, hold_marking
from service.ledger.hold_marking import MARK_CHUNK
from service.observability.failures import repeat

log = logging.getLogger(__name__)

MAINTENANCE_INTERVAL_S: Final = 10.0
# A hold placed this long ago with step 2 not committed was interrupted: mark its items.
UNFINISHED_AFTER_S: Final = 60.0
SYSTEM_ACTOR: Final = "sweeper"


class HoldNotFound(LookupError):
    """No hold with that id."""


class HoldAlreadyReleased(Exception):
    """The hold was released before (by an operator or at its expiry)."""

    def __init__(self, hold: dict[str, Any]) -> None:
        super().__init__(f"hold {hold['id']} was released at {hold['released_at']}")
        self.hold = hold


@dataclass(frozen=True)
class HoldSpec:
    """What a hold covers, why, and until when (None: until released)."""

    tenant_id: str
    reason: str
    reference: str
    policy: str | None = None
    object_ids: list[str] | None = None
    object_id_prefix: str | None = None
    expires_at: datetime | None = None


_PLACE = Statement("holds.place", (
    "Record a legal hold: from its commit on, every admission skips what it covers and "
    "every registration marks it."), """
    WITH placed AS (
        INSERT INTO holds (tenant_id, policy, object_ids, object_id_prefix, reason, reference,
                           expires_at, placed_by)
        VALUES (:tenant_id, :policy, CAST(:object_ids AS text[]), :object_id_prefix, :reason,
                :reference, :expires_at, :actor)
        RETURNING id, tenant_id, object_ids
    ),
    indexed AS (  -- its object ids, where the item-side checks look them up (0020)
        INSERT INTO hold_objects (tenant_id, object_id, hold_id)
        SELECT DISTINCT placed.tenant_id, o.object_id, placed.id
        FROM placed, unnest(placed.object_ids) AS o(object_id)
    )
    -- delivered at the commit: every worker process learns of the hold now, not at its
    -- next poll (service/worker/hold_gate.py)
    SELECT id, pg_notify(:channel, CAST(id AS text)) FROM placed
""")

_RELEASE = Statement("holds.release", (
    "End a hold (once): who, when and why; its object ids leave the item-side index."), """
    WITH released AS (
        UPDATE holds
        SET released_at = now(), released_by = :actor, release_why = :why
        WHERE id = :id AND released_at IS NULL
        RETURNING *, false AS active
    ),
    unindexed AS (
        DELETE FROM hold_objects ho USING released WHERE ho.hold_id = released.id
    )
    SELECT * FROM released
""")

# After _RELEASE in the same transaction, so the released hold no longer covers anything.
_UNMARK = Statement("holds.unmark", (
    "Move a released hold's items to another active hold covering them, or free them."),
    f"""
    WITH moved AS (
        UPDATE items i SET hold_id = {covering_hold("i")}
        WHERE i.hold_id = :id
        RETURNING i.hold_id, i.status = 'pending' AS open
    ),
    counted AS (  -- a finished item (a call in flight at the placement) keeps no hold
        SELECT count(*) FILTER (WHERE open AND hold_id IS NULL) AS freed,
               count(*) FILTER (WHERE open AND hold_id IS NOT NULL) AS still_held
        FROM moved
    )
    SELECT freed, still_held FROM counted
""")  # noqa: S608 - only constant fragments are interpolated

_GET = Statement("holds.get", "One hold by id.",
                 f"SELECT *, {active_hold()} AS active FROM holds hx WHERE id = :id")  # noqa: S608

_LIST = Statement("holds.list", (
    "Holds newest first before a keyset cursor, of one tenant or all, active or not."), f"""
    SELECT *, {active_hold()} AS active FROM holds hx
    WHERE (CAST(:before AS bigint) IS NULL OR hx.id < :before)
      AND (CAST(:tenant AS text) IS NULL OR hx.tenant_id = :tenant)
      AND (CAST(:active AS boolean) IS NULL
           OR ({active_hold()}) = CAST(:active AS boolean))
    ORDER BY hx.id DESC LIMIT :limit
""")  # noqa: S608 - only a constant fragment is interpolated

_DUE_FOR_MAINTENANCE = Statement("holds.due_for_maintenance", (
    "Holds past their expiry and not released, and holds whose marking never committed."),
    f"""
    SELECT id, coalesce(expires_at <= now(), false) AS expired
    FROM holds
    WHERE released_at IS NULL
      AND (expires_at <= now()
           OR (effective_at IS NULL
               AND placed_at < now() - interval '{UNFINISHED_AFTER_S} s'))
    ORDER BY id
""")  # noqa: S608 - only a constant is interpolated


def _public(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


async def place(engine: AsyncEngine, spec: HoldSpec, *, actor: str) -> dict[str, Any]:
    """Place a hold and mark what it covers (the two steps of the module docstring); returns
    the hold as stored, with the calls that were in flight."""
    async with engine.begin() as conn:
        hold_id = (await run(conn, _PLACE, {
            "tenant_id": spec.tenant_id, "policy": spec.policy, "object_ids": spec.object_ids,
            "object_id_prefix": spec.object_id_prefix, "reason": spec.reason,
            "reference": spec.reference, "expires_at": spec.expires_at, "actor": actor,
            "channel": HOLDS_CHANNEL})).one().id
        await audit_trail.record(conn, actor=actor, action="hold.place", reason=spec.reason,
                                 details={
            "hold_id": hold_id, "tenant_id": spec.tenant_id, "policy": spec.policy,
            "object_ids": spec.object_ids, "object_id_prefix": spec.object_id_prefix,
            "reference": spec.reference,
            "expires_at": spec.expires_at.isoformat() if spec.expires_at else None})
    await mark(engine, hold_id)
    await hold_acks.settle(engine, hold_id)
    return await _stored(engine, hold_id)


async def mark(engine: AsyncEngine, hold_id: int, *, chunk: int = MARK_CHUNK
               ) -> dict[str, Any]:
    """Step 2 for a placed hold (service/ledger/hold_marking.py): mark its items chunk by
    chunk, then record that it took effect, with the calls that were in flight. A hold
    already marked (or released) is returned as it is."""
    await hold_marking.mark_items(engine, hold_id, chunk=chunk)
    return await hold_marking.take_effect(engine, hold_id) or await _stored(engine, hold_id)


async def _stored(engine: AsyncEngine, hold_id: int) -> dict[str, Any]:
    hold = await get(engine, hold_id)
    if hold is None:
        raise HoldNotFound(hold_id)
    return hold


async def get(engine: AsyncEngine, hold_id: int) -> dict[str, Any] | None:
    """One hold, or None."""
    rows = await fetch(engine, _GET, {"id": hold_id})
    return _public(rows[0]) if rows else None


async def list_holds(engine: AsyncEngine, *, tenant_id: str | None, active: bool | None,
                     before: int | None, limit: int) -> list[dict[str, Any]]:
    """Newest first; `before` is the keyset cursor (a hold id)."""
    rows = await fetch(engine, _LIST, {"before": before, "tenant": tenant_id,
                                       "active": active, "limit": limit})
    return [_public(r) for r in rows]


async def _release(conn: AsyncConnection, hold_id: int, *, why: str, actor: str
                   ) -> dict[str, Any] | None:
    row = (await run(conn, _RELEASE, {"id": hold_id, "why": why, "actor": actor})).first()
    if row is None:
        return None
    hold = _public(row)
    counts = (await run(conn, _UNMARK, {"id": hold_id})).one()
    if counts.freed:
        await wake_workers(conn)  # inside the release's transaction: sent at its commit
    await audit_trail.record(conn, actor=actor, action="hold.release", reason=why, details={
        "hold_id": hold_id, "tenant_id": hold["tenant_id"], "reference": hold["reference"],
        "items_freed": counts.freed, "items_still_held": counts.still_held})
    return {**hold, "items_freed": counts.freed, "items_still_held": counts.still_held}


async def release(engine: AsyncEngine, hold_id: int, *, why: str, actor: str
                  ) -> dict[str, Any]:
    """Release a hold: its items go to another active hold covering them, or are free
    (those already released and due are claimable at once). HoldNotFound, or
    HoldAlreadyReleased when it was released before."""
    async with engine.begin() as conn:
        released = await _release(conn, hold_id, why=why, actor=actor)
    if released is not None:
        return released
    stored = await get(engine, hold_id)
    if stored is None:
        raise HoldNotFound(hold_id)
    raise HoldAlreadyReleased(stored)


async def maintain(engine: AsyncEngine) -> tuple[int, int]:
    """Release holds past their expiry and mark the items of holds whose placement was
    interrupted. Returns (released, marked) counts of holds."""
    released = marked = 0
    for row in await fetch(engine, _DUE_FOR_MAINTENANCE, {}):
        if row.expired:
            async with engine.begin() as conn:
                if await _release(conn, row.id, why="expired", actor=SYSTEM_ACTOR):
                    released += 1
        else:
            await mark(engine, row.id)
            marked += 1
    if released or marked:
        log.info("holds maintained", extra={"expired_released": released,
                                            "placements_finished": marked})
    return released, marked


async def maintenance_loop(engine: AsyncEngine, *,
                           interval_s: float = MAINTENANCE_INTERVAL_S) -> None:
    """`maintain` every `interval_s` until cancelled; database outages are retried."""
    await repeat(lambda: maintain(engine), every_s=interval_s, what="holds maintenance",
                 logger=log)

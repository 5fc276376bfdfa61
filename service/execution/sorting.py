"""Where each delivered item stands in the ledger, read when its message arrives: the one
read a delivery costs before its items are admitted (claims.admit_delivered), and what
decides whether a delivery waits, is deferred, or is done with an item.

Times come from the database clock, as a claim's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from service.db.statements import IN_REGION, Database, Statement, fetch_records, not_held
from service.values import value


class Standing(StrEnum):
    READY = "ready"            # claimable now: admitted with its scope's tokens
    LEASED = "leased"          # a running lease: back when it may have ended
    LATER = "later"            # its next attempt is not due yet (a backoff)
    HELD = "held"              # under a legal hold: looked at again later, never called
    DONE = "done"              # finished, unreleased or gone: nothing to call for it
    ELSEWHERE = "elsewhere"    # pinned to another region: handed to that region's queues


@value
class Sorted:
    item_id: int
    scope: str
    weight: int
    standing: Standing
    wait_s: float  # until its lease ends or its attempt is due (0 otherwise)


_SORT = Statement("sorting.standings", (
    "Where each delivered item stands: ready, leased, not yet due, held, done, or pinned "
    "to another region."), f"""
    SELECT i.id, i.scope, s.weight,
           CASE WHEN i.status <> 'pending' OR i.released_at IS NULL THEN 'done'
                WHEN NOT ({IN_REGION}) THEN 'elsewhere'
                WHEN NOT ({not_held()}) THEN 'held'
                WHEN i.lease_token IS NOT NULL AND i.lease_expires_at > now() THEN 'leased'
                WHEN i.next_attempt_at > now() THEN 'later'
                ELSE 'ready' END AS standing,
           -- epochs, not an interval: next_attempt_at may be -infinity (due at once)
           least(86400.0, greatest(0.0, CASE
                WHEN i.lease_token IS NOT NULL AND i.lease_expires_at > now()
                THEN extract(epoch FROM i.lease_expires_at)
                ELSE extract(epoch FROM i.next_attempt_at) END
                - extract(epoch FROM now())))::double precision AS wait_s
    FROM items i JOIN scopes s ON s.name = i.scope
    WHERE i.id = ANY(CAST(:ids AS bigint[]))
""")  # noqa: S608 - only a constant fragment is interpolated


async def sort(db: Database, item_ids: Sequence[int], region: str | None = None
               ) -> dict[int, Sorted]:
    """Each item's standing by id, for a worker of `region`; an id missing was pruned
    (done)."""
    if not item_ids:
        return {}
    return {r["id"]: Sorted(r["id"], r["scope"], int(r["weight"]), Standing(r["standing"]),
                            float(r["wait_s"]))
            for r in await fetch_records(db, _SORT, {"ids": list(item_ids),
                                                     "region": region})}

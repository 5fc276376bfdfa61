"""service.claims.claim around its `now` boundaries, as properties over a real database.

An item is claimable iff it is pending, released and next_attempt_at <= now, or leased with
lease_expires_at <= now. Nothing else (unreleased, succeeded, dead, cancelled, a live lease)
is ever claimed, whatever its due time. A claimed lease expires at now + the policy's lease
length, and `limit` bounds both what is returned and what is locked.

Hypothesis runs many examples inside one test (one fresh database from the `engine`
fixture), so every example starts by truncating the ledger.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.claims import Claimed, claim

# microseconds on purpose: the boundaries are checked at full timestamptz precision
SCOPE = "tenant:all"  # claims are per scope; these properties are about one scope
NOW = datetime(2026, 3, 1, 12, 0, 0, 500_000, tzinfo=UTC)
LEASES = {"carts": 30, "fast": 5}
DEFAULT_LEASE = 47  # "other" is not in LEASES: it gets the default
POLICIES = ("carts", "fast", "other")
TERMINAL = ("succeeded", "dead", "cancelled")
KINDS = ("ready", "unreleased", "leased", *TERMINAL)

PROPERTY_SETTINGS = settings(max_examples=35, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                    HealthCheck.too_slow])

_offset = st.one_of(
    st.sampled_from([-1, 0, 1]),                    # the microsecond boundary itself
    st.integers(-3_000_000, 3_000_000),             # within a few seconds
    st.integers(-10**12, 10**12),                   # within ~ +-11 days
).map(lambda us: timedelta(microseconds=us))


@dataclass(frozen=True)
class Row:
    kind: str                       # ready | unreleased | leased | succeeded | dead | cancelled
    policy: str
    due: timedelta
    next_attempt: timedelta | None  # None: the column default, -infinity
    lease_expires: timedelta        # used by leased rows only
    attempts: int

    def claimable(self) -> bool:
        if self.kind == "ready":
            return self.next_attempt is None or NOW + self.next_attempt <= NOW
        if self.kind == "leased":
            return NOW + self.lease_expires <= NOW
        return False


_row = st.builds(Row, kind=st.sampled_from(KINDS), policy=st.sampled_from(POLICIES),
                 due=_offset, next_attempt=st.none() | _offset, lease_expires=_offset,
                 attempts=st.integers(0, 5))

_INSERT = text("""
    INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, scope,
                       status, due_at, next_attempt_at, released_at, attempts, lease_owner,
                       lease_token, lease_expires_at, completed_at, dead_reason)
    VALUES (:tenant_id, :object_id, :policy, 1, :operation_key, :scope, :status, :due_at,
            coalesce(CAST(:next_attempt_at AS timestamptz), '-infinity'), :released_at,
            :attempts, :lease_owner, :lease_token, :lease_expires_at, :completed_at,
            :dead_reason)
    RETURNING id
""")

_SNAPSHOT = text("""
    SELECT id, status, attempts, lease_owner, lease_token, lease_expires_at, next_attempt_at,
           updated_at
    FROM items ORDER BY id
""")


async def reset(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE items, batches, runs, attempts RESTART IDENTITY "
                                "CASCADE"))


async def insert(engine: AsyncEngine, rows: list[Row]) -> list[int]:
    ids = []
    async with engine.begin() as conn:
        for n, row in enumerate(rows):
            leased = row.kind == "leased"
            released = None if row.kind == "unreleased" else NOW - timedelta(hours=1)
            params: dict[str, Any] = {
                "tenant_id": f"tenant-{n % 3}", "object_id": f"obj-{n}", "policy": row.policy,
                "operation_key": hashlib.sha256(f"key-{n}".encode()).hexdigest(),
                "scope": SCOPE, "status": row.kind if row.kind not in
                ("ready", "unreleased") else "pending",
                "due_at": NOW + row.due,
                "next_attempt_at": None if row.next_attempt is None else NOW + row.next_attempt,
                "released_at": released, "attempts": row.attempts,
                "lease_owner": "crashed-worker" if leased else None,
                "lease_token": uuid.uuid4() if leased else None,
                "lease_expires_at": NOW + row.lease_expires if leased else None,
                "completed_at": NOW - timedelta(minutes=1) if row.kind in TERMINAL else None,
                "dead_reason": "http_400" if row.kind == "dead" else None,
            }
            ids.append((await conn.execute(_INSERT, params)).scalar_one())
    return ids


async def snapshot(engine: AsyncEngine) -> dict[int, Any]:
    async with engine.connect() as conn:
        return {r.id: r for r in (await conn.execute(_SNAPSHOT)).all()}


async def claim_at_now(engine: Any, limit: int = 1000, owner: str = "w1") -> Claimed:
    return await claim(engine, owner=owner, grants={SCOPE: limit}, lease_seconds=LEASES,
                       default_lease_seconds=DEFAULT_LEASE, now=NOW)


# -- which rows, at the boundary ------------------------------------------------------------

@PROPERTY_SETTINGS
@given(rows=st.lists(_row, max_size=14))
async def test_claim_takes_exactly_the_claimable_rows(engine: AsyncEngine, rows: list[Row]
                                                      ) -> None:
    await reset(engine)
    ids = await insert(engine, rows)
    by_id = dict(zip(ids, rows, strict=True))
    before = await snapshot(engine)

    claimed = await claim_at_now(engine)

    got = {lease.item_id for lease in claimed.leases}
    assert len(got) == len(claimed.leases)
    assert got == {i for i, r in by_id.items() if r.claimable()}
    assert claimed.reclaimed == sum(1 for i in got if by_id[i].kind == "leased")
    after = await snapshot(engine)
    for lease in claimed.leases:
        row = by_id[lease.item_id]
        assert lease.lease_expires_at == NOW + timedelta(
            seconds=LEASES.get(row.policy, DEFAULT_LEASE))
        assert lease.attempt == row.attempts + 1
        assert lease.policy == row.policy
        db = after[lease.item_id]
        assert (db.status, db.lease_owner, db.lease_token, db.lease_expires_at, db.attempts) == (
            "leased", "w1", lease.lease_token, lease.lease_expires_at, lease.attempt)
        assert lease.lease_token != before[lease.item_id].lease_token
    for item_id in set(ids) - got:
        assert after[item_id] == before[item_id]  # untouched, not even updated_at


@PROPERTY_SETTINGS
@given(kind=st.sampled_from(("unreleased", *TERMINAL)), next_attempt=st.none() | _offset,
       due=_offset, n=st.integers(1, 6))
async def test_unreleased_and_terminal_items_are_never_claimed(
        engine: AsyncEngine, kind: str, next_attempt: timedelta | None, due: timedelta,
        n: int) -> None:
    await reset(engine)
    await insert(engine, [Row(kind, "carts", due, next_attempt, timedelta(0), 0)] * n)
    assert (await claim_at_now(engine)).leases == []
    # nor later: even far in the future there is nothing to take
    far = await claim(engine, owner="w", grants={SCOPE: 100}, lease_seconds=LEASES,
                      now=NOW + timedelta(days=3650))
    assert far.leases == []


@PROPERTY_SETTINGS
@given(offset_us=st.integers(-2, 2), kind=st.sampled_from(("ready", "leased")))
async def test_the_boundary_is_inclusive_at_the_microsecond(
        engine: AsyncEngine, offset_us: int, kind: str) -> None:
    await reset(engine)
    off = timedelta(microseconds=offset_us)
    [item_id] = await insert(engine, [Row(kind, "carts", -off, off, off, 0)])
    got = [lease.item_id for lease in (await claim_at_now(engine)).leases]
    assert got == ([item_id] if offset_us <= 0 else [])


@PROPERTY_SETTINGS
@given(rows=st.lists(_row, max_size=14), limit=st.integers(1, 4))
async def test_limit_bounds_each_claim_and_repeated_claims_take_each_row_once(
        engine: AsyncEngine, rows: list[Row], limit: int) -> None:
    await reset(engine)
    ids = await insert(engine, rows)
    expected = {i for i, r in zip(ids, rows, strict=True) if r.claimable()}
    taken: list[int] = []
    for round_no in range(len(rows) + 2):
        claimed = await claim_at_now(engine, limit=limit, owner=f"w{round_no}")
        assert len(claimed.leases) == min(limit, len(expected) - len(taken))
        taken += [lease.item_id for lease in claimed.leases]
        if not claimed.leases:
            break
    assert len(taken) == len(set(taken))
    assert set(taken) == expected


# -- limit and locking ---------------------------------------------------------------------

class HeldTransaction:
    """Duck-types the engine for `claim`: its statement runs inside a transaction that the
    test keeps open, so the row locks it took can be observed from another session."""

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        yield self.conn


async def locked_count(engine: AsyncEngine) -> int:
    """Rows some other transaction holds a lock on, seen by SKIP LOCKED from a new one."""
    async with engine.connect() as conn, conn.begin() as tx:
        total = (await conn.execute(text("SELECT count(*) FROM items"))).scalar_one()
        free = (await conn.execute(text(
            "SELECT count(*) FROM (SELECT id FROM items FOR UPDATE SKIP LOCKED) f"))
        ).scalar_one()
        await tx.rollback()
    return int(total - free)


def mix(expired: int, ready: int) -> list[Row]:
    lease = Row("leased", "carts", timedelta(0), None, timedelta(seconds=-5), 1)
    pending = Row("ready", "fast", timedelta(0), timedelta(microseconds=-1), timedelta(0), 0)
    return [lease] * expired + [pending] * ready


@pytest.mark.parametrize(("k", "expired", "ready"), [
    (4, 0, 12),      # only released pending rows
    (4, 12, 0),      # only expired leases
    (4, 4, 8),       # the expired leases fill the first claim exactly
    (4, 3, 9),       # both parts of the claim contribute
    (4, 8, 4),       # more expired leases than the limit
    (1, 2, 1),
    (7, 5, 16),
])
async def test_a_claim_locks_no_more_than_its_limit(engine: AsyncEngine, k: int, expired: int,
                                                    ready: int) -> None:
    assert expired + ready == 3 * k
    await insert(engine, mix(expired, ready))
    async with engine.connect() as conn:
        tx = await conn.begin()
        first = await claim_at_now(HeldTransaction(conn), limit=k, owner="held")
        assert len(first.leases) == k
        assert await locked_count(engine) == k
        # concurrent claimers skip the held rows and take disjoint sets of their own
        second = await claim_at_now(engine, limit=k, owner="second")
        third = await claim_at_now(engine, limit=k, owner="third")
        assert await locked_count(engine) == k
        await tx.commit()
    sets = [{lease.item_id for lease in c.leases} for c in (first, second, third)]
    assert [len(s) for s in sets] == [k, k, k]
    assert set.union(*sets) == set(range(1, 3 * k + 1))
    assert (await claim_at_now(engine, limit=k)).leases == []
    async with engine.connect() as conn:
        owners = dict((await conn.execute(text(
            "SELECT lease_owner, count(*) FROM items WHERE status = 'leased' "
            "GROUP BY lease_owner"))).all())
    assert owners == {"held": k, "second": k, "third": k}


@pytest.mark.parametrize(("k", "claimers", "expired"), [(5, 2, 0), (5, 2, 7), (3, 6, 4),
                                                        (10, 4, 10)])
async def test_concurrent_claims_are_disjoint_and_bounded(engine: AsyncEngine, k: int,
                                                          claimers: int, expired: int) -> None:
    await insert(engine, mix(expired, 3 * k - expired))
    results = await asyncio.gather(*(claim_at_now(engine, limit=k, owner=f"c{n}")
                                     for n in range(claimers)))
    sets = [{lease.item_id for lease in r.leases} for r in results]
    assert all(len(s) <= k for s in sets)
    assert sum(len(s) for s in sets) == len(set.union(*sets))  # disjoint
    if claimers * k <= 3 * k:
        assert all(len(s) == k for s in sets)
    async with engine.connect() as conn:
        leased = dict((await conn.execute(text(
            "SELECT id, lease_token FROM items WHERE status = 'leased' "
            "AND lease_expires_at > :now"), {"now": NOW})).all())
    mine = {lease.item_id: lease.lease_token for r in results for lease in r.leases}
    assert leased == mine

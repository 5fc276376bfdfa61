"""service.ledger.claims.admit around its `now` boundaries and its claim position, as properties
over a real database.

An item is claimable iff it is pending, released, next_attempt_at <= now, and under no lease
or one with lease_expires_at <= now (a leased item stays pending: migration 0024). Nothing
else (unreleased, succeeded, dead, cancelled, a live lease) is ever claimed, whatever its due
time. An admission reads claimable items after its scope's claim position in index order,
or from the front (position (0, 0), never read from the front, or the last front read
FRONT_SCAN_EVERY_S or longer ago); an expired lease is taken over where the walk finds it,
and one on its policy's last allowed attempt goes dead instead, taking its place in the
walk. A claimed lease expires at now + the policy's lease length; the tokens granted bound
what is returned and what is locked, and the bucket is charged for exactly the leases.

The admission reads the database's clock: `now()`, its transaction's start. Each property
example runs in one transaction (`at_database_now`) that the admission joins, so the rows are
written relative to the very instant the claim reads them at, to the microsecond, and the
product takes no clock from the test. Hypothesis runs many examples inside one test (one
fresh database from the `engine` fixture), so every example starts by truncating the ledger
and recreating the scope, inside its transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.ledger import claims
from service.ledger.claims import Admission
from tests.conftest import wait_for_lock_waits
from tests.integration import db_clock

SCOPE = "tenant:all"  # claims are per scope; these properties are about one scope
LEASES = {"carts": 30, "fast": 5}
DEFAULT_LEASE = 47  # "other" is not in LEASES: it gets the default
MAX_ATTEMPTS = {"carts": 3, "fast": 5}  # "other" has no limit
POLICIES = ("carts", "fast", "other")
TERMINAL = ("succeeded", "dead", "cancelled")
KINDS = ("ready", "unreleased", "leased", *TERMINAL)
BATCHES = 3
# A budget that never runs dry here and barely refills while a test runs, so the tokens
# an admission leaves are known to a hundredth.
BURST = 1_000_000
SPENDABLE = BURST - 1  # buckets.SPENDABLE_BURST_SQL at a rate below 50/s
RATE = 0.001
FRONT_EVERY = timedelta(seconds=claims.FRONT_SCAN_EVERY_S)
ZERO = timedelta(0)

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
    batch: int | None = None        # None: released by a webhook, without a batch

    def walked(self) -> bool:
        """A claim's walk takes it: claimable, or an expired lease on its last attempt."""
        due = self.next_attempt is None or self.next_attempt <= ZERO
        if self.kind == "ready":
            return due
        return self.kind == "leased" and due and self.lease_expires <= ZERO

    def claimable(self) -> bool:
        return self.walked() and not self.exhausted()

    def exhausted(self) -> bool:
        return self.kind == "leased" and self.attempts >= MAX_ATTEMPTS.get(self.policy,
                                                                            math.inf)


@dataclass(frozen=True)
class Position:
    """A scope's claim position: after (batch key, item id), and its last front read (from
    the example's now; None: never)."""

    after: tuple[int, int]
    front_scanned: timedelta | None


# mostly rows an admission can take, so that claims fill their tokens and pass each other
_kind = st.sampled_from(("ready", "ready", "ready", "leased", "leased", *KINDS[1:]))
_row = st.builds(Row, kind=_kind, policy=st.sampled_from(POLICIES),
                 due=_offset, next_attempt=st.none() | _offset, lease_expires=_offset,
                 attempts=st.integers(0, 5), batch=st.none() | st.integers(1, BATCHES))
# the front-read interval and the microsecond around it, or anywhere else
_scanned = st.one_of(st.sampled_from([-1, 0, 1]), st.integers(-3_000_000, 3_000_000)).map(
    lambda us: -FRONT_EVERY + timedelta(microseconds=us))


def key_of(n: int, row: Row) -> tuple[int, int]:
    """Row n's key in items_ready once inserted (ids restart at 1 in every example)."""
    return ((row.batch or 0) if row.kind != "unreleased" else 0, n + 1)


@st.composite
def rows_and_position(draw: st.DrawFn, min_size: int = 0) -> tuple[list[Row], Position]:
    """Rows, and a claim position anywhere, or on a row's key or next to it."""
    rows = draw(st.lists(_row, min_size=min_size, max_size=14))
    anywhere = st.tuples(st.integers(0, BATCHES + 1), st.integers(0, len(rows) + 2))
    near = (st.tuples(st.sampled_from([key_of(n, r) for n, r in enumerate(rows)]),
                      st.sampled_from([-1, 0, 1])).map(lambda k: (k[0][0], k[0][1] + k[1]))
            if rows else anywhere)
    after = draw(st.one_of(st.just((0, 0)), anywhere, near))
    # never read from the front, read from it a moment ago (the usual case), or about
    # FRONT_SCAN_EVERY_S ago
    return rows, Position(after, draw(st.none() | st.just(ZERO) | _scanned))

_INSERT = text("""
    INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, scope,
                       status, due_at, next_attempt_at, released_at, batch_id, attempts,
                       lease_owner, lease_token, lease_expires_at, completed_at, dead_reason)
    VALUES (:tenant_id, :object_id, :policy, 1, :operation_key, :scope, :status, :due_at,
            coalesce(CAST(:next_attempt_at AS timestamptz), '-infinity'), :released_at,
            :batch_id, :attempts, :lease_owner, :lease_token, :lease_expires_at,
            :completed_at, :dead_reason)
    RETURNING id
""")

_SNAPSHOT = text("""
    SELECT id, status, attempts, policy, coalesce(batch_id, 0) AS batch_key, lease_owner,
           lease_token, lease_expires_at, next_attempt_at, updated_at, dead_reason,
           status = 'pending' AND released_at IS NOT NULL AND next_attempt_at <= :now
               AND (lease_token IS NULL OR lease_expires_at <= :now) AS ready
    FROM items ORDER BY id
""")


class HeldTransaction:
    """Duck-types the engine for `admit`: its statement runs inside a transaction that the
    test keeps open (it reads that transaction's `now()`, and the row locks it took can be
    observed from another session)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        yield self.conn


async def database_now(conn: AsyncConnection) -> datetime:
    """The database's clock as the statements of `conn`'s transaction read it (`now()`)."""
    now: datetime = (await conn.execute(text("SELECT now()"))).scalar_one()
    return now


@asynccontextmanager
async def at_database_now(engine: AsyncEngine) -> AsyncIterator[tuple[HeldTransaction,
                                                                      datetime]]:
    """One example's transaction, rolled back at its end, and its `now()`: the instant every
    statement in it, the admission included, reads as the database's clock."""
    async with engine.connect() as conn:
        tx = await conn.begin()
        try:
            yield HeldTransaction(conn), await database_now(conn)
        finally:
            await tx.rollback()


async def reset(conn: AsyncConnection, now: datetime, position: Position | None = None
                ) -> None:
    pos = position or Position((0, 0), None)
    await conn.execute(text("TRUNCATE items, batches, runs, attempts, scopes "
                            "RESTART IDENTITY CASCADE"))
    await conn.execute(text(
        "INSERT INTO scopes (name, rate_per_second, burst, tokens, budget_from_policy, "
        "ready_after_batch, ready_after_id, front_scanned_at) "
        "VALUES (:s, :rate, :burst, :tokens, false, :b, :i, :at)"),
        {"s": SCOPE, "rate": RATE, "burst": BURST, "tokens": SPENDABLE,
         "b": pos.after[0], "i": pos.after[1],
         "at": None if pos.front_scanned is None else now + pos.front_scanned})


async def insert(conn: AsyncConnection, now: datetime, rows: list[Row]) -> list[int]:
    ids = []
    for n, row in enumerate(rows):
        leased = row.kind == "leased"
        released = None if row.kind == "unreleased" else now - timedelta(hours=1)
        params: dict[str, Any] = {
            "tenant_id": f"tenant-{n % 3}", "object_id": f"obj-{n}", "policy": row.policy,
            "operation_key": hashlib.sha256(f"key-{n}".encode()).hexdigest(),
            "scope": SCOPE, "status": row.kind if row.kind in TERMINAL else "pending",
            "due_at": now + row.due,
            "next_attempt_at": None if row.next_attempt is None else now + row.next_attempt,
            "released_at": released, "batch_id": row.batch if released else None,
            "attempts": row.attempts,
            "lease_owner": "crashed-worker" if leased else None,
            "lease_token": uuid.uuid4() if leased else None,
            "lease_expires_at": now + row.lease_expires if leased else None,
            "completed_at": now - timedelta(minutes=1) if row.kind in TERMINAL else None,
            "dead_reason": "http_400" if row.kind == "dead" else None,
        }
        ids.append((await conn.execute(_INSERT, params)).scalar_one())
    return ids


async def snapshot(conn: AsyncConnection, now: datetime) -> dict[int, Any]:
    return {r.id: r for r in (await conn.execute(_SNAPSHOT, {"now": now})).all()}


async def scope_state(conn: AsyncConnection, now: datetime) -> tuple[Position, float]:
    r = (await conn.execute(text(
        "SELECT ready_after_batch, ready_after_id, front_scanned_at, tokens FROM scopes "
        "WHERE name = :s"), {"s": SCOPE})).one()
    return Position((int(r[0]), int(r[1])), None if r[2] is None else r[2] - now), float(r[3])


async def admit(db: Any, limit: int = 1000, owner: str = "w1") -> Admission:
    """One admission of the scope, on the database's clock."""
    return await claims.admit(db, owner=owner, wants={SCOPE: limit}, lease_seconds=LEASES,
                              default_lease_seconds=DEFAULT_LEASE, max_attempts=MAX_ATTEMPTS)


# -- the claim rules, as a reference -------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """What an admission can see of one item."""

    item_id: int
    key: tuple[int, int]              # (batch id or 0, item id): the order of items_ready
    ready: bool                       # pending, released, its next attempt due, no live lease
    lease_expires: datetime | None    # leased: when its lease ends
    exhausted: bool                   # leased on its policy's last allowed attempt


def candidates(rows: Iterable[Any], max_attempts: dict[str, int]) -> list[Candidate]:
    """The candidates in snapshot rows (id, status, attempts, policy, batch_key,
    lease_expires_at, ready)."""
    return [Candidate(r.id, (r.batch_key, r.id), r.ready, r.lease_expires_at,
                      r.lease_token is not None
                      and r.attempts >= max_attempts.get(r.policy, math.inf))
            for r in rows]


def reads_the_front(position: Position) -> bool:
    return (position.after[1] == 0 or position.front_scanned is None
            or position.front_scanned <= -FRONT_EVERY)


def verify_admission(seen: Sequence[Candidate], position: Position, now: datetime,
                     granted: int, leases: Sequence[claims.Lease], dead: set[int]
                     ) -> Position:
    """Assert that an admission granted `granted` tokens took what the claim rules allow
    (leases, and `dead`: expired leases it dead-lettered); the position it must leave."""
    if granted == 0:
        assert (list(leases), dead) == ([], set())
        return position
    front = reads_the_front(position)
    start = (0, 0) if front else position.after
    # the claimable items after the start, in index order, up to the tokens; an expired
    # lease on its last allowed attempt among them goes dead, the others are leased
    walk = sorted((c for c in seen if c.ready and c.key > start), key=lambda c: c.key)
    taken = walk[:granted]
    assert dead == {c.item_id for c in taken if c.exhausted}
    assert sorted(x.item_id for x in leases) == sorted(
        c.item_id for c in taken if not c.exhausted)
    assert {x.item_id for x in leases if x.reclaimed} == {
        c.item_id for c in taken if c.lease_expires is not None and not c.exhausted}
    # one that came up short sends the next claim to the front
    after = (0, 0) if len(leases) < granted else taken[-1].key if taken else start
    return Position(after, ZERO if front else position.front_scanned)


async def admit_and_verify(db: HeldTransaction, now: datetime, limit: int, owner: str
                           ) -> Admission:
    """One admission in the example's transaction, checked against the claim rules and the
    position it left."""
    before = await snapshot(db.conn, now)
    position, _ = await scope_state(db.conn, now)
    admission = await admit(db, limit=limit, owner=owner)
    after = await snapshot(db.conn, now)
    dead = {i for i, r in after.items() if r.status == "dead" and before[i].status != "dead"}
    [grant] = admission.grants
    assert grant.granted == limit
    expected = verify_admission(candidates(before.values(), MAX_ATTEMPTS), position, now,
                                grant.granted, admission.leases, dead)
    assert (await scope_state(db.conn, now))[0] == expected
    return admission


# -- which rows, at the boundary ------------------------------------------------------------

@pytest.mark.slow
@PROPERTY_SETTINGS
@given(drawn=rows_and_position())
async def test_an_admission_takes_exactly_the_claimable_rows(
        engine: AsyncEngine, drawn: tuple[list[Row], Position]) -> None:
    rows, position = drawn
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now, position)
        ids = await insert(db.conn, now, rows)
        before = await snapshot(db.conn, now)
        admission = await admit(db)
        after = await snapshot(db.conn, now)
        position_after, tokens = await scope_state(db.conn, now)
    by_id = dict(zip(ids, rows, strict=True))
    front = reads_the_front(position)
    start = (0, 0) if front else position.after
    got = {lease.item_id for lease in admission.leases}
    assert len(got) == len(admission.leases)
    behind = {i for i, r in by_id.items() if ((r.batch or 0), i) <= start}
    assert got == {i for i, r in by_id.items() if r.claimable() and i not in behind}
    assert admission.reclaimed == sum(1 for i in got if by_id[i].kind == "leased")
    for lease in admission.leases:
        row = by_id[lease.item_id]
        assert lease.lease_expires_at == now + timedelta(
            seconds=LEASES.get(row.policy, DEFAULT_LEASE))
        assert lease.attempt == row.attempts + 1
        assert lease.policy == row.policy
        item = after[lease.item_id]
        assert (item.status, item.lease_owner, item.lease_token, item.lease_expires_at,
                item.attempts) == ("pending", "w1", lease.lease_token,
                                   lease.lease_expires_at, lease.attempt)
        assert lease.lease_token != before[lease.item_id].lease_token
    # an expired lease on its last allowed attempt goes dead, its attempts as they were
    dead = {i for i, r in by_id.items() if r.walked() and r.exhausted() and i not in behind}
    for item_id in dead:
        item = after[item_id]
        assert (item.status, item.dead_reason, item.lease_token, item.attempts) == (
            "dead", "max_attempts:lease_expired", None, by_id[item_id].attempts)
    for item_id in set(ids) - got - dead:
        assert after[item_id] == before[item_id]  # untouched, not even updated_at
    # the bucket is charged for the leases, and no more; the position is the front again
    # (the claim came up short) and records a front read
    assert SPENDABLE - len(got) <= tokens < SPENDABLE - len(got) + 0.01
    assert position_after == Position((0, 0), ZERO if front else position.front_scanned)


@PROPERTY_SETTINGS
@given(kind=st.sampled_from(("unreleased", *TERMINAL)), next_attempt=st.none() | _offset,
       due=_offset, n=st.integers(1, 6))
@pytest.mark.slow
async def test_unreleased_and_terminal_items_are_never_claimed(
        engine: AsyncEngine, kind: str, next_attempt: timedelta | None, due: timedelta,
        n: int) -> None:
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now)
        await insert(db.conn, now, [Row(kind, "carts", due, next_attempt, ZERO, 0)] * n)
        assert (await admit(db)).leases == []
        # nor later: even ten years on there is nothing to take
        await db_clock.advance(db, 3650 * 86_400)
        assert (await admit(db, owner="w")).leases == []


@PROPERTY_SETTINGS
@given(offset_us=st.integers(-2, 2), kind=st.sampled_from(("ready", "leased")))
async def test_the_boundary_is_inclusive_at_the_microsecond(
        engine: AsyncEngine, offset_us: int, kind: str) -> None:
    off = timedelta(microseconds=offset_us)
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now)
        [item_id] = await insert(db.conn, now, [Row(kind, "carts", -off, off, off, 0)])
        got = [lease.item_id for lease in (await admit(db)).leases]
    assert got == ([item_id] if offset_us <= 0 else [])


@PROPERTY_SETTINGS
@given(offset_us=st.integers(-2, 2), kind=st.sampled_from(("ready", "leased")))
async def test_the_front_read_is_due_at_the_interval_to_the_microsecond(
        engine: AsyncEngine, offset_us: int, kind: str) -> None:
    # an item behind the position (released ready, or an expired lease) is taken exactly
    # when the last front read is FRONT_SCAN_EVERY_S old; after the position, one always is
    scanned = -FRONT_EVERY + timedelta(microseconds=offset_us)
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now, Position((2, 2), scanned))
        behind, ahead = await insert(db.conn, now, [
            Row(kind, "carts", ZERO, None, timedelta(seconds=-1), 0, batch=1),
            Row("ready", "carts", ZERO, None, ZERO, 0, batch=3)])
        got = {lease.item_id for lease in (await admit(db)).leases}
    assert got == ({behind, ahead} if offset_us <= 0 else {ahead})


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(drawn=rows_and_position(min_size=2), limit=st.integers(1, 4))
async def test_repeated_admissions_take_every_claimable_row_once_within_their_tokens(
        engine: AsyncEngine, drawn: tuple[list[Row], Position], limit: int) -> None:
    # items behind the starting position, expired leases, exhausted leases and webhook
    # releases (batch key 0) all come due: every claimable row is leased exactly once, each
    # admission within its tokens, and an admission that finds nothing past the position
    # makes the next one read from the front
    rows, position = drawn
    expected = {n + 1 for n, r in enumerate(rows) if r.claimable()}
    exhausted = {n + 1 for n, r in enumerate(rows) if r.walked() and r.exhausted()}
    taken: list[int] = []
    rounds = 0
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now, position)
        ids = await insert(db.conn, now, rows)
        while any(c.ready for c in candidates((await snapshot(db.conn, now)).values(),
                                              MAX_ATTEMPTS)):
            rounds += 1
            # each round takes something, or came up short and sends the next one to the
            # front
            assert rounds <= 2 * len(rows) + 1, (rounds, taken)
            admission = await admit_and_verify(db, now, limit, owner=f"w{rounds}")
            assert len(admission.leases) <= limit
            taken += [lease.item_id for lease in admission.leases]
        final = await snapshot(db.conn, now)
        _, tokens = await scope_state(db.conn, now)
    assert ids == list(range(1, len(rows) + 1))
    assert len(taken) == len(set(taken))
    assert set(taken) == expected
    assert {i for i in ids if final[i].dead_reason == "max_attempts:lease_expired"} == exhausted
    assert SPENDABLE - len(taken) <= tokens < SPENDABLE - len(taken) + 0.01


@PROPERTY_SETTINGS
@given(batches=st.lists(st.none() | st.integers(1, BATCHES), min_size=1, max_size=8),
       at=st.integers(0, 7), delta=st.sampled_from([-1, 0, 1]), limit=st.integers(1, 8))
@pytest.mark.slow
async def test_a_claim_reads_strictly_after_its_position(
        engine: AsyncEngine, batches: list[int | None], at: int, delta: int,
        limit: int) -> None:
    # released items on, just before and just after the position, in batches and without
    rows = [Row("ready", "carts", ZERO, None, ZERO, 0, batch=b) for b in batches]
    batch, item_id = key_of(at % len(rows), rows[at % len(rows)])
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now, Position((batch, item_id + delta), ZERO))
        await insert(db.conn, now, rows)
        await admit_and_verify(db, now, limit, owner="w")


_expiry = st.sampled_from([-3_000_000, -2, -1, 0, 1]).map(lambda us: timedelta(microseconds=us))


@PROPERTY_SETTINGS
@given(leases=st.lists(st.tuples(_expiry, st.integers(0, 5), st.sampled_from(POLICIES)),
                       min_size=1, max_size=8),
       ready=st.integers(0, 3), limit=st.integers(1, 5))
@pytest.mark.slow
async def test_expired_leases_are_taken_over_in_the_claim_order(
        engine: AsyncEngine, leases: list[tuple[timedelta, int, str]], ready: int,
        limit: int) -> None:
    # expired leases are claimed where the walk finds them, beside released items; a lease
    # on its policy's last allowed attempt takes its place in the walk but goes dead, not to
    # a worker; a live one is passed over
    async with at_database_now(engine) as (db, now):
        await reset(db.conn, now)
        await insert(db.conn, now, [Row("leased", policy, ZERO, None, expires, attempts)
                                    for expires, attempts, policy in leases]
                     + [Row("ready", "fast", ZERO, None, ZERO, 0)] * ready)
        await admit_and_verify(db, now, limit, owner="w")


# -- limit and locking ---------------------------------------------------------------------

async def committed(engine: AsyncEngine, rows: list[Row]) -> datetime:
    """The scope and `rows` written and committed, relative to the database's clock when
    they were (later admissions read a later one); that moment."""
    async with engine.begin() as conn:
        now = await database_now(conn)
        await reset(conn, now)
        await insert(conn, now, rows)
    return now


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
    await committed(engine, mix(expired, ready))
    async with engine.connect() as conn:
        tx = await conn.begin()
        first = await admit(HeldTransaction(conn), limit=k, owner="held")
        assert len(first.leases) == k
        assert await locked_count(engine) == k
        # concurrent admitters of the scope wait for its bucket row, holding no item rows
        second = asyncio.create_task(admit(engine, limit=k, owner="second"))
        third = asyncio.create_task(admit(engine, limit=k, owner="third"))
        await wait_for_lock_waits(engine, 2)
        assert await locked_count(engine) == k
        assert not second.done() and not third.done()
        await tx.commit()
    results = (first, await second, await third)
    sets = [{lease.item_id for lease in c.leases} for c in results]
    assert [len(s) for s in sets] == [k, k, k]
    assert set.union(*sets) == set(range(1, 3 * k + 1))
    assert (await admit(engine, limit=k)).leases == []
    async with engine.connect() as conn:
        owners = dict((await conn.execute(text(
            "SELECT lease_owner, count(*) FROM items WHERE lease_token IS NOT NULL "
            "GROUP BY lease_owner"))).all())
    assert owners == {"held": k, "second": k, "third": k}


@pytest.mark.parametrize(("k", "claimers", "expired"), [(5, 2, 0), (5, 2, 7), (3, 6, 4),
                                                        (10, 4, 10)])
async def test_concurrent_claims_are_disjoint_and_bounded(engine: AsyncEngine, k: int,
                                                          claimers: int, expired: int) -> None:
    written = await committed(engine, mix(expired, 3 * k - expired))
    results = await asyncio.gather(*(admit(engine, limit=k, owner=f"c{n}")
                                     for n in range(claimers)))
    sets = [{lease.item_id for lease in r.leases} for r in results]
    assert all(len(s) <= k for s in sets)
    assert sum(len(s) for s in sets) == len(set.union(*sets))  # disjoint
    # nothing is left behind: together they took all they had tokens for
    assert len(set.union(*sets)) == min(claimers * k, 3 * k)
    if claimers * k <= 3 * k:
        assert all(len(s) == k for s in sets)
    async with engine.connect() as conn:
        leased = dict((await conn.execute(text(
            "SELECT id, lease_token FROM items WHERE lease_token IS NOT NULL "
            "AND lease_expires_at > :now"), {"now": written})).all())
        _, tokens = await scope_state(conn, written)
    mine = {lease.item_id: lease.lease_token for r in results for lease in r.leases}
    assert leased == mine
    assert SPENDABLE - len(mine) <= tokens < SPENDABLE - len(mine) + 0.01

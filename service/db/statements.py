"""SQL statements: how they are written and run, and the predicates they share.

Where statements live: beside their domain module (claims, buckets, scopes, metrics, runs,
ledger, retention, intake, audit, the readiness check, the migration lock), each a
module-level `Statement` constant next to the function that binds its parameters and reads
its rows. The SQL is that module's algorithm (the admission statement *is* the claim
rules); moving it here would split every change across two files. No module builds
`text()` or runs SQL of its own (tests/unit/test_statements.py holds every module under
service/ to that). This module holds only what they share:

- `Statement`: a name (`module.what`) and a one-line summary (what it does and why) for
  every statement. The name is also sent to the server as a leading comment, so
  pg_stat_activity, pg_stat_statements and auto_explain say which statement is which.
- One way to run them: `fetch` and `fetch_none` run a statement as its own transaction,
  on an engine or on a held connection (`Database`); `run` runs one inside a transaction
  the caller holds (registration, an operator change and its audit row, one reading).
  `fetch_records` is `fetch` for the worker's two statements of every round (admission
  and completion): the same statement, compiled once to asyncpg's `$n` form and sent on
  the connection's asyncpg connection, its rows asyncpg's records, read by column name
  (SQLAlchemy's per-row processing was the larger part of their process CPU).
  Two exceptions, both on plain asyncpg connections with no SQLAlchemy in between, whose
  statements take asyncpg's positional `$n` parameters and are sent as their `.text`:
  webhook intake (service/webhooks/intake.py: its own pool, one round trip per delivery, no BEGIN or
  COMMIT) and the embedded server's bootstrap (service/db/embedded.py: the admin database,
  before Sweeper's exists). A statement whose text depends on a value no parameter can
  carry (CREATE DATABASE's identifier) is a function returning a `Statement`, named like
  the constants.
- The predicates several modules' statements compose, defined once so no copy drifts:
  `ready_item` (an item a worker may claim now, an expired lease included), `LEASED`,
  `expired_lease`, `item_status`, `not_held` (no legal hold stops it), `CLOSURE_OVER` and
  `OPEN_SCOPE`. They are SQL text interpolated when a module loads, not views or functions:
  the server receives the SQL a hand-written copy would be, so the planner still finds
  `status = 'pending' AND released_at IS NOT NULL AND hold_id IS NULL` to match the partial
  index `items_ready` and the admission's plan is what it was
  (bench/reports/design-notes.md). Each fragment reads items as `i`, scopes as `s` and holds
  as `hx`.

Times are the database's (now(), clock_timestamp()), never a worker's. Tests that need
time to pass move the stored instants back instead (tests/integration/db_clock.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import asyncpg
from sqlalchemy import CursorResult, Row, TextClause
from sqlalchemy import text as sql_text
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

_NAME = re.compile(r"[a-z_]+(\.[a-z_]+)+")
# compiles `:name` parameters to asyncpg's `$n`
_ASYNCPG: Final = asyncpg_dialect()  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Statement:
    """One SQL statement with `:name` parameters, its `name` ("module.what") and a one-line
    `summary` of what it does and why."""

    name: str
    summary: str
    sql: str
    clause: TextClause = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"statement name {self.name!r} is not module.what")
        if not self.summary.strip() or "\n" in self.summary:
            raise ValueError(f"statement {self.name}: the summary is one line")
        object.__setattr__(self, "clause", sql_text(f"/* {self.name} */ {self.sql.strip()}"))

    @property
    def text(self) -> str:
        """The SQL as sent, its name first (EXPLAIN it by prefixing this)."""
        return self.clause.text

    @functools.cached_property
    def positional(self) -> tuple[str, tuple[str, ...]]:
        """The SQL in asyncpg's form (`$1`, `$2`, ...; a name used twice is one number)
        and the parameter names in number order: what `fetch_records` sends."""
        compiled = self.clause.compile(dialect=_ASYNCPG)
        return compiled.string, tuple(compiled.positiontup or ())


# -- the predicates -------------------------------------------------------------------------

def active_hold(now: str = "now()") -> str:
    """Hold `hx` is in force at `now`: not released, and not expired."""
    return f"hx.released_at IS NULL AND (hx.expires_at IS NULL OR hx.expires_at > {now})"


def hold_covers(item: str = "i") -> str:
    """Hold `hx` covers the item whose columns `item` names: its tenant, its policy if the
    hold names one, and its object ids or object-id prefix if it names them. For walking
    one hold's items; a check from the item's side is `_whole_holds` or `_object_holds`."""
    return f"""hx.tenant_id = {item}.tenant_id
        AND (hx.policy IS NULL OR hx.policy = {item}.policy)
        AND (hx.object_ids IS NULL OR {item}.object_id = ANY(hx.object_ids))
        AND (hx.object_id_prefix IS NULL
             OR starts_with({item}.object_id, hx.object_id_prefix))"""


# An item's covering holds, looked up from the item's side in two halves that each take an
# index probe, whatever the number of holds and ids (migration 0020): the holds naming no
# object ids (`holds_whole`: by tenant), and those naming the item's object id
# (`hold_objects`' primary key). `{item}` names the item's columns; the holds are `hx`.
def _whole_holds(item: str, now: str) -> str:
    return f"""FROM holds hx
        WHERE {active_hold(now)} AND hx.object_ids IS NULL AND hx.tenant_id = {item}.tenant_id
          AND (hx.policy IS NULL OR hx.policy = {item}.policy)
          AND (hx.object_id_prefix IS NULL
               OR starts_with({item}.object_id, hx.object_id_prefix))"""


def _object_holds(item: str, now: str) -> str:
    # the hold is probed by its key per entry found (nearly always none); OFFSET 0 keeps
    # the planner from turning the EXISTS into a join that scans every hold once per item
    return f"""FROM hold_objects ho
        WHERE ho.tenant_id = {item}.tenant_id AND ho.object_id = {item}.object_id
          AND EXISTS (SELECT FROM holds hx WHERE hx.id = ho.hold_id AND {active_hold(now)}
                      AND (hx.policy IS NULL OR hx.policy = {item}.policy) OFFSET 0)"""


def covering_hold(item: str, now: str = "now()") -> str:
    """A scalar subquery: the oldest active hold covering the item `item` names, or NULL.
    What an item is marked with when it is written (registration, webhook hints). With no
    hold in force (nearly always) an uncorrelated EXISTS, run once per statement, spares a
    look-up per item; it sees the statement's snapshot as the look-up would."""
    return (f"(CASE WHEN EXISTS (SELECT FROM holds hx WHERE {active_hold(now)}) "
            f"THEN LEAST((SELECT min(hx.id) {_whole_holds(item, now)}), "
            f"(SELECT min(ho.hold_id) {_object_holds(item, now)})) END)")


def not_held(now: str = "now()") -> str:
    """Item `i` is under no legal hold at `now`: not marked with one (`hold_id`, which a
    claim re-reads from the row it locks) and covered by no active hold (which a hold
    placed after the item was written may not have marked yet): service/ledger/holds.py says why
    both. With no hold in force (nearly always) an uncorrelated EXISTS, evaluated once per
    statement, spares every row its checks. Each check stays a filter on the row (inside
    the OR, and OFFSET 0: never turned into a join), so a claim reading the claimable
    index in order stops at its LIMIT: as joins, a generic plan sorts the scope's whole
    backlog on every claim (bench/reports/design-notes.md, HTTP and statements)."""
    return (f"i.hold_id IS NULL AND (NOT EXISTS (SELECT FROM holds hx WHERE {active_hold(now)})"
            f" OR (NOT EXISTS (SELECT 1 {_whole_holds('i', now)} OFFSET 0)"
            f" AND NOT EXISTS (SELECT 1 {_object_holds('i', now)} OFFSET 0)))")


def ready_item(now: str = "now()") -> str:
    """Item `i` may be claimed at `now`: pending, released, under no hold, its next attempt
    due, and not under a lease that still runs (an expired one is taken over). The workers
    claim exactly these; `sweeper_items_eligible` and the scopes' `eligible` count them. Its
    first three terms are items_ready's WHERE."""
    return (f"i.status = 'pending' AND i.released_at IS NOT NULL AND {not_held(now)}"
            f" AND i.next_attempt_at <= {now}"
            f" AND (i.lease_token IS NULL OR i.lease_expires_at <= {now})")


# Item `i` may be processed by the claimer: its region (service/config/regions.py) is the
# claimer's, :region (NULL for both: a tenant pinned nowhere, a worker without a region).
IN_REGION: Final = "i.region IS NOT DISTINCT FROM CAST(:region AS text)"
# The same for a claimer of no region, as the claims that walk a scope's items in index
# order spell it: the planner estimates `IS NULL` from the column's statistics, where it
# takes `IS NOT DISTINCT FROM NULL` to match no row and sorts a scope's whole backlog.
UNPINNED: Final = "i.region IS NULL"


# Item `i` is under a lease (its worker's call may be in flight, or its lease ran out and
# no claim took it over yet). A leased item stays `pending`: a claim writes only columns no
# index reads, so its update can be HOT (migration 0024).
LEASED: Final = "i.lease_token IS NOT NULL"


def expired_lease(now: str = "now()") -> str:
    """Item `i` is under a lease that has run out at `now`: its worker died or stalled, and
    the next claim that reads it takes it over."""
    return f"{LEASED} AND i.lease_expires_at <= {now}"


def item_status(i: str = "i") -> str:
    """Item `i`'s status as operators read it: `leased` for a pending item under a lease."""
    return f"CASE WHEN {i}.lease_token IS NOT NULL THEN 'leased' ELSE {i}.status END"


# Scope `s`'s closure, if it has one, is over: a throttling signal closes a scope until
# `closed_until`, a moment on the database's clock. clock_timestamp(), not now(): a
# transaction may have waited for the row's lock. (NOT this: the scope is closed.)
CLOSURE_OVER: Final = "(s.closed_until IS NULL OR s.closed_until <= clock_timestamp())"

# Scope `s`'s bucket may grant tokens: neither paused nor closed. (A workers-wide pause,
# `control.workers_paused`, stops every scope; statements read it beside this.)
OPEN_SCOPE: Final = f"NOT s.paused AND {CLOSURE_OVER}"


# -- running them ---------------------------------------------------------------------------

# Where a statement runs: an engine (a pooled connection and a transaction of its own), or a
# connection the caller holds. The worker holds AUTOCOMMIT connections across rounds, so a
# hot statement costs one round trip instead of six (the pool's pre-ping is BEGIN, `;`,
# ROLLBACK, then BEGIN, the statement, COMMIT); each such statement is atomic on its own.
Database = AsyncEngine | AsyncConnection


async def fetch(db: Database, statement: Statement, params: Mapping[str, Any]
                ) -> Sequence[Row[Any]]:
    """Run one statement and commit it before returning (no transaction stays open)."""
    if isinstance(db, AsyncConnection):
        rows = (await db.execute(statement.clause, params)).all()
        await db.commit()
        return rows
    async with db.begin() as conn:
        return (await conn.execute(statement.clause, params)).all()


# Planned with the values of this call: see `fetch_filtered`.
_CUSTOM_PLANS = Statement("statements.custom_plans", (
    "Plan this transaction's statements with their parameters' values."),
    "SET LOCAL plan_cache_mode = force_custom_plan")


async def fetch_filtered(engine: AsyncEngine, statement: Statement, params: Mapping[str, Any]
                         ) -> Sequence[Row[Any]]:
    """Run one statement of optional filters (`CAST(:x AS text) IS NULL OR col = :x`) as
    `fetch` does, planned with this call's values. A prepared statement's generic plan
    cannot know which filters are given, so it can use neither a partial index for a status
    nor an index on a filtered column, and PostgreSQL may settle on it after five calls:
    an operator's page of pending items would then walk the primary key past every
    finished row. One SET LOCAL more per call; hot paths never take this."""
    async with engine.begin() as conn:
        await conn.execute(_CUSTOM_PLANS.clause)
        return (await conn.execute(statement.clause, params)).all()


async def fetch_records(db: Database, statement: Statement, params: Mapping[str, Any]
                        ) -> list[asyncpg.Record]:
    """`fetch` on the driver's own connection: committed before returning in the same way
    (a held AUTOCOMMIT connection's statement is its own transaction; on an engine, the
    transaction SQLAlchemy opens around it), its rows asyncpg's records (`row["column"]`).
    Errors are asyncpg's own, which service/db/engine.py reads as it reads SQLAlchemy's."""
    if isinstance(db, AsyncConnection):
        rows = await _on_driver(db, statement, params)
        await db.commit()
        return rows
    async with db.begin() as conn:
        return await _on_driver(conn, statement, params)


async def _on_driver(conn: AsyncConnection, statement: Statement, params: Mapping[str, Any]
                     ) -> list[asyncpg.Record]:
    sql, names = statement.positional
    driver: asyncpg.Connection = (await conn.get_raw_connection()).driver_connection
    options = conn.sync_connection.get_execution_options() if conn.sync_connection else {}
    if options.get("isolation_level") != "AUTOCOMMIT" \
            and not driver.is_in_transaction():
        # SQLAlchemy opens its transaction with the first statement it runs itself: one
        # runs through it first, so this one joins that transaction (which SQLAlchemy
        # then commits or rolls back) instead of committing alone. Never on a held
        # AUTOCOMMIT connection, the worker's hot path.
        await conn.execute(_JOIN.clause)
    try:
        rows: list[asyncpg.Record] = await driver.fetch(sql, *[params[n] for n in names])
    except asyncpg.InternalClientError as exc:
        # asyncpg leaves a connection whose server sent an error outside any operation (a
        # session ended while idle: the FATAL that precedes the close) in a state that
        # fails the next operation this way: the connection is lost, as SQLAlchemy's own
        # path reports it (the caller drops it either way)
        raise asyncpg.ConnectionDoesNotExistError(f"connection lost: {exc}") from exc
    return rows


_JOIN = Statement("statements.join", "Open the caller's transaction on the driver.", "SELECT 1")


async def fetch_none(db: Database, statement: Statement, params: Mapping[str, Any]) -> None:
    """Run one statement that returns no rows, committed before returning."""
    if isinstance(db, AsyncConnection):
        await db.execute(statement.clause, params)
        await db.commit()
        return
    async with db.begin() as conn:
        await conn.execute(statement.clause, params)


async def run(conn: AsyncConnection, statement: Statement,
              params: Mapping[str, Any] | None = None) -> CursorResult[Any]:
    """Run one statement inside the caller's transaction (nothing is committed here)."""
    return await conn.execute(statement.clause, params or {})


class HeldConnection:
    """A pooled connection kept across statements in AUTOCOMMIT mode (see `Database`):
    taken on first use, dropped after any error so the next use takes, and pings, a fresh
    one. Uses are serialized."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._conn: AsyncConnection | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[AsyncConnection]:
        async with self._lock:
            if self._conn is None:
                self._conn = await self._engine.connect()
            try:
                yield self._conn
            except BaseException:
                await self.close(invalidate=True)
                raise

    async def close(self, *, invalidate: bool = False) -> None:
        """Give the connection back; `invalidate`: discard it instead (after an error its
        state is unknown: a statement sent on the driver's connection (`fetch_records`)
        fails on a dead one without SQLAlchemy learning it is dead)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                if invalidate:
                    await conn.invalidate()
                await conn.close()

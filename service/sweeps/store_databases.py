"""The store's own PostgreSQL databases: connections, the source query's pages, guards, and
what a store's errors mean. What start-up asks a store of the policies' statements is
service/sweeps/store_checks.py.

Each store has its own small pool, opened on first use (a store that cannot be reached at
start-up pauses the scopes that need it, not the process). Every statement runs in its own
short transaction with its own timeouts; a source page is read in a READ ONLY transaction,
so a query that would write is refused by PostgreSQL itself whatever its text says.

The source query is wrapped, never edited: its rows are read in pages by keyset on
(age, tenant_id, object_id), the page after the last row of the previous one (never OFFSET:
a page costs the same at the millionth row as at the first). With an index on the age
column the planner walks it in order and stops at the page's end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from service.config.policies import Store
from service.config.policy_file import GuardConfig, SourceConfig, TargetConfig
from service.config.settings import async_url
from service.config.store_statements import typed, without_final_semicolon
from service.db.engine import APPLICATION_NAME, UNAVAILABLE_ERRORS, sqlstate
from service.db.statements import Statement, run
from service.outcomes import Failure

log = logging.getLogger(__name__)

SOURCE_COLUMNS: Final = ("tenant_id", "object_id", "age")
EARLIEST: Final = datetime.min.replace(tzinfo=UTC)
GUARD_TIMEOUT_MS: Final = 2000

# SQLSTATEs a store's statement fails with, by what they mean for the item
_BUSY: Final = frozenset({"55P03", "40001", "40P01", "57014"})  # undone: try again later
_PERMISSION: Final = frozenset({"42501", "25006"})  # no privilege; a read-only replica
_LOST: Final = ("08", "57P01", "57P02")  # the connection went while it ran


# What a store's driver raises: the rest is a bug of ours, which the worker's call records as
# `unknown` (retried with the same batch identity) with its traceback, never as the store's
STORE_ERRORS: Final = (sa_exc.DBAPIError, asyncpg.PostgresError, *UNAVAILABLE_ERRORS)


class StoreError(Exception):
    """A store could not answer: `failure` says how, for the scope and the run's report."""

    def __init__(self, store: str, failure: Failure, detail: str) -> None:
        super().__init__(f"store {store!r}: {failure.value}: {detail}")
        self.store = store
        self.failure = failure
        self.detail = detail


def failure_of(exc: BaseException, *, connected: bool) -> Failure:
    """What a store's exception means. Before a connection was had (`connected` False)
    every failure is the store being out of reach; after it, the SQLSTATE tells."""
    code = sqlstate(exc)
    if not connected:
        return Failure.STORE_PERMISSION if code in _PERMISSION else Failure.STORE_UNREACHABLE
    if code in _BUSY or (code or "").startswith("53"):
        return Failure.STORE_BUSY
    if code in _PERMISSION:
        return Failure.STORE_PERMISSION
    if code is not None and code.startswith(_LOST):
        return Failure.STORE_LOST
    if code is None and _unreachable(exc):
        return Failure.STORE_LOST
    return Failure.STORE_REFUSED


def _unreachable(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.DBAPIError):
        orig = getattr(exc.orig, "__cause__", None) or exc.orig
        return exc.connection_invalidated or isinstance(orig, UNAVAILABLE_ERRORS)
    return isinstance(exc, UNAVAILABLE_ERRORS)


def describe(exc: BaseException) -> str:
    """An error's kind and SQLSTATE, never its text (which may quote the store's values)."""
    cause = getattr(exc, "orig", None) or exc
    cause = getattr(cause, "__cause__", None) or cause
    code = sqlstate(exc)
    return f"{type(cause).__name__}" + (f" (SQLSTATE {code})" if code else "")


@dataclass(frozen=True)
class Cursor:
    """Where the next page starts: after this row (all None: from the first)."""

    age: datetime | None = None
    tenant_id: str | None = None
    object_id: str | None = None

    @property
    def start(self) -> bool:
        return self.age is None


@dataclass(frozen=True)
class SourceRows:
    """One page of a source's rows, column by column, in keyset order (a page of 5,000
    rows travels as three arrays, not 5,000 row objects)."""

    tenant_ids: Sequence[str | None]
    object_ids: Sequence[str | None]
    ages: Sequence[datetime | None]

    def __len__(self) -> int:
        return len(self.tenant_ids)

    @property
    def last(self) -> Cursor:
        """The cursor after this page: its last row (the keyset's largest)."""
        if not self.tenant_ids:
            return Cursor()
        return Cursor(self.ages[-1], self.tenant_ids[-1], self.object_ids[-1])


def page_statement(source: SourceConfig, *, after: bool, tenant: bool) -> Statement:
    """The source query wrapped to read one page in keyset order, after a cursor and for
    one tenant when asked. The columns are cast to what the ledger holds; the keyset
    compares the query's own age column, so an index on it still serves the range."""
    where = []
    if after:
        # (age, tenant, object) > the cursor, written so the age bound is a plain range
        where.append("q.age >= CAST(:after_age AS timestamptz) AND (q.age > CAST(:after_age "
                     "AS timestamptz) OR (CAST(q.tenant_id AS text), CAST(q.object_id AS "
                     "text)) > (CAST(:after_tenant AS text), CAST(:after_object AS text)))")
    if tenant:
        where.append("CAST(q.tenant_id AS text) = CAST(:tenant AS text)")
    columns = ("CAST(q.tenant_id AS text) AS tenant_id, CAST(q.object_id AS text) AS "
               "object_id, CAST(q.age AS timestamptz) AS age")
    condition = f" WHERE {' AND '.join(where)}" if where else ""
    order = "q.age, CAST(q.tenant_id AS text), CAST(q.object_id AS text)"
    page = f"SELECT {columns} FROM ({source_query(source)}) AS q{condition} ORDER BY {order} LIMIT :page_rows"  # noqa: E501, S608 - the policy's own query, wrapped
    # the page as one row of three arrays, each in keyset order (an aggregate's ORDER BY
    # is what guarantees its order; the last elements are the next cursor)
    keyset = "p.age, p.tenant_id, p.object_id"
    sql = (f"SELECT array_agg(p.tenant_id ORDER BY {keyset}) AS tenant_ids, "  # noqa: S608
           f"array_agg(p.object_id ORDER BY {keyset}) AS object_ids, "
           f"array_agg(p.age ORDER BY {keyset}) AS ages FROM ({page}) AS p")
    return Statement("store_databases.source_page", "One page of a policy's source query on the "
                     "store, in keyset order after a cursor, as three arrays.", sql)


def source_query(source: SourceConfig) -> str:
    """The source query as it is embedded, `:cutoff` typed."""
    return typed(without_final_semicolon(source.query), {"cutoff": "timestamptz"})


def columns_statement(source: SourceConfig) -> Statement:
    """No row of the source query: what its columns are called."""
    return Statement("store_databases.source_columns",
                     "The source query's columns, reading no row.",
                     f"SELECT * FROM ({source_query(source)}) AS q LIMIT 0")  # noqa: S608


def explain_statement(statement: Statement, *, as_json: bool) -> Statement:
    """The plan of `statement` (planned, not run)."""
    return Statement("store_databases.explain", "The plan of a store statement, as the store would "
                     "run it.", f"EXPLAIN {'(FORMAT JSON) ' if as_json else ''}{statement.sql}")


GUARD_QUERIES: Final = {
    # the replay lag of one replica as the primary sees it; no such replica: NULL (over)
    "replica_lag": "SELECT (SELECT coalesce(extract(epoch FROM replay_lag), 0) FROM "
                   "pg_stat_replication WHERE application_name = :replica ORDER BY 1 DESC "
                   "LIMIT 1)",
    "active_backends": "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                       "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
}


def guard_statement(guard: GuardConfig) -> Statement:
    """The number a guard compares with its threshold."""
    sql = (without_final_semicolon(guard.query) if guard.query is not None else
           GUARD_QUERIES["replica_lag" if guard.replica_lag is not None else "active_backends"])
    return Statement("store_databases.guard", "The number a store's guard compares with its "
                     "threshold.", sql)


_READ_ONLY = Statement("store_databases.read_only", (
    "Make this transaction on the store read-only: PostgreSQL refuses any write in it."),
    "SET TRANSACTION READ ONLY")
_TIMEOUTS = Statement("store_databases.timeouts", (
    "Bound each statement and each lock wait of this transaction on the store."),
    "SELECT set_config('statement_timeout', CAST(:statement_ms AS text), true), "
    "set_config('lock_timeout', CAST(:lock_ms AS text), true)")


async def limit_transaction(conn: AsyncConnection, *, statement_ms: int,
                            lock_ms: int | None = None) -> None:
    """The timeouts of the transaction `conn` is in (a lock wait: the statement's, unless
    `lock_ms` is shorter)."""
    await run(conn, _TIMEOUTS, {"statement_ms": str(int(statement_ms)),
                                "lock_ms": str(int(statement_ms if lock_ms is None
                                                   else lock_ms))})


async def read_only(conn: AsyncConnection, *, statement_ms: int) -> None:
    """Make the transaction `conn` is in read-only, each statement bounded by
    `statement_ms`: how every read of a store (a source page, a guard, a check) starts."""
    await run(conn, _READ_ONLY)
    await limit_transaction(conn, statement_ms=statement_ms)


@dataclass
class _GuardReading:
    at: float
    value: float | None
    pending: asyncio.Task[float | None] | None = None


class Stores:
    """One small pool per store, opened on first use and closed together."""

    def __init__(self, stores: Mapping[str, Store]) -> None:
        self.stores = dict(stores)
        self._engines: dict[str, AsyncEngine] = {}
        self._guards: dict[tuple[str, str], _GuardReading] = {}
        # each source's page statements, built once (the config objects live as long)
        self._pages: dict[tuple[int, bool, bool], Statement] = {}

    def engine(self, name: str) -> AsyncEngine:
        engine = self._engines.get(name)
        if engine is None:
            store = self.stores[name]
            engine = self._engines[name] = create_async_engine(
                async_url(store.dsn), pool_size=store.config.max_connections, max_overflow=0,
                pool_timeout=30, pool_pre_ping=True, pool_recycle=1800, hide_parameters=True,
                connect_args={"timeout": store.config.connect_timeout_seconds,
                              "server_settings": {"application_name": APPLICATION_NAME,
                                                  "TimeZone": "UTC",
                                                  # never pin the store's locks when idle
                                                  "idle_in_transaction_session_timeout":
                                                      "30000"}})
        return engine

    async def aclose(self) -> None:
        for engine in self._engines.values():
            await engine.dispose()
        self._engines.clear()

    async def connect(self, name: str) -> AsyncConnection:
        """A connection to the store; StoreError (unreachable) when none can be had."""
        try:
            return await self.engine(name).connect()
        except Exception as exc:
            raise StoreError(name, failure_of(exc, connected=False), describe(exc)) from None

    async def read_page(self, source: SourceConfig, cutoff: datetime, cursor: Cursor, *,
                        tenant: str | None = None) -> SourceRows:
        """One page of the source query after `cursor`, in its own READ ONLY transaction
        with the source's statement timeout."""
        params: dict[str, Any] = {"cutoff": cutoff, "page_rows": source.page}
        if not cursor.start:
            params.update(after_age=cursor.age, after_tenant=cursor.tenant_id,
                          after_object=cursor.object_id)
        if tenant is not None:
            params["tenant"] = tenant
        statement = self._pages.get((id(source), not cursor.start, tenant is not None))
        if statement is None:
            statement = page_statement(source, after=not cursor.start, tenant=tenant is not None)
            self._pages[id(source), not cursor.start, tenant is not None] = statement
        conn = await self.connect(source.store)
        try:
            async with conn.begin():
                await read_only(conn, statement_ms=source.statement_timeout_ms)
                page = (await run(conn, statement, params)).one()
                return SourceRows(page.tenant_ids or [], page.object_ids or [], page.ages or [])
        except Exception as exc:
            raise StoreError(source.store, failure_of(exc, connected=True),
                             describe(exc)) from None
        finally:
            await conn.close()

    async def guard_value(self, guard: GuardConfig) -> float | None:
        """The guard's number, read at most once per `every_seconds` by this process (the
        callers in between share the last reading, or wait for the one in progress). None
        when it could not be read or was not a number: that counts as over the
        threshold."""
        key = (guard.store, guard_statement(guard).sql)
        now = time.monotonic()
        reading = self._guards.get(key)
        if reading is not None and reading.pending is None and \
                now - reading.at < guard.every_seconds:
            return reading.value
        if reading is None or reading.pending is None:
            task = asyncio.ensure_future(self._read_guard(guard))
            reading = self._guards[key] = _GuardReading(now, None, task)
        assert reading.pending is not None
        pending = reading.pending
        value = await asyncio.shield(pending)
        if reading.pending is pending:
            reading.pending, reading.value, reading.at = None, value, time.monotonic()
        return value

    async def _read_guard(self, guard: GuardConfig) -> float | None:
        try:
            conn = await self.connect(guard.store)
        except StoreError:
            return None
        try:
            async with conn.begin():
                await read_only(conn, statement_ms=GUARD_TIMEOUT_MS)
                params = {"replica": guard.replica_lag} if guard.replica_lag else {}
                value = (await run(conn, guard_statement(guard), params)).scalar()
        except Exception as exc:
            log.warning("store guard could not be read",
                        extra={"store": guard.store, "error": describe(exc)})
            return None
        finally:
            await conn.close()
        try:
            number = float(value) if value is not None else None
        except (TypeError, ValueError):
            return None
        return number


def target_statement(target: TargetConfig) -> Statement:
    """A target's statement with its parameters typed: `:object_ids` is a text[] and
    `:cutoff` a timestamptz, whatever the statement casts them to next."""
    return Statement("store_databases.target", "A policy's deletion statement on the store, for a "
                     "batch of object ids under one cutoff.",
                     typed(without_final_semicolon(target.statement),
                           {"object_ids": "text[]", "cutoff": "timestamptz"}))

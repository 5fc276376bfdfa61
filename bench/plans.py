"""EXPLAIN (ANALYZE, BUFFERS) of the statements the service really sends, as it sends them.

A `PlanCatcher` listens on an engine's `before_cursor_execute` and on asyncpg's
`Connection.fetch`. Armed for a kind of statement (recognised by substrings), it explains
the next matching statement with its real bound parameters on the same connection, inside
the same transaction within a SAVEPOINT (or a transaction of its own on an AUTOCOMMIT
connection) that is rolled back, then lets the statement run as usual. Two plans per capture:

  custom   EXPLAIN with the bound values (what the first five executions of a prepared
           statement get);
  generic  the statement PREPAREd and EXECUTEd under plan_cache_mode = force_generic_plan
           (what a prepared statement settles on after five runs when it is not costlier;
           asyncpg prepares every statement and SQLAlchemy caches them per connection).

Nothing here depends on the service's Python signatures, only on its SQL text, so it keeps
working while the code around the statements changes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import await_only

SAVEPOINT = "bench_explain"
PREPARED = "bench_generic_plan"


@dataclass(frozen=True)
class StatementKind:
    """A statement recognised by substrings that must all occur in its text."""

    name: str
    needles: tuple[str, ...]

    def matches(self, statement: str) -> bool:
        return all(n in statement for n in self.needles)


def _text_of(value: Any) -> str:
    """PostgreSQL's text input form of a bound value (for an untyped literal)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return f"{value.total_seconds()} seconds"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        parts = []
        for v in value:
            if v is None:
                parts.append("NULL")
            else:
                escaped = _text_of(v).replace("\\", "\\\\").replace('"', '\\"')
                parts.append(f'"{escaped}"')
        return "{" + ",".join(parts) + "}"
    raise TypeError(f"no literal form for {type(value).__name__}")


def literal(value: Any) -> str:
    """An untyped SQL literal: PostgreSQL coerces it to the prepared parameter's type."""
    if value is None:
        return "NULL"
    return "'" + _text_of(value).replace("'", "''") + "'"


@dataclass
class PlanCatcher:
    """Explain the next statement of an armed kind; results land in `plans[label]`.

    Statements reach it two ways: SQLAlchemy's `before_cursor_execute`, and asyncpg's
    `Connection.fetch`, which the worker's two hot statements take directly
    (service/db/statements.py `fetch_records`); both are wrapped while `listening`."""

    kinds: Sequence[StatementKind]
    armed: dict[str, str] = field(default_factory=dict)
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    # kind -> {variant name: statement rewrite}: also explain rewritten statements with the
    # same parameters (a way to try a SQL change without touching the service)
    variants: dict[str, dict[str, Callable[[str], str]]] = field(default_factory=dict)

    def arm(self, kind: str, label: str) -> None:
        if kind not in {k.name for k in self.kinds}:
            raise ValueError(f"unknown statement kind {kind!r}")
        self.armed[kind] = label

    @contextlib.contextmanager
    def listening(self, engine: AsyncEngine) -> Iterator[PlanCatcher]:
        target = engine.sync_engine
        event.listen(target, "before_cursor_execute", self._before)
        original = asyncpg.Connection.fetch
        catcher = self

        async def fetch(conn: asyncpg.Connection, query: str, *args: Any, **kw: Any) -> Any:
            await catcher._capture(conn, query, args)
            return await original(conn, query, *args, **kw)

        asyncpg.Connection.fetch = fetch
        try:
            yield self
        finally:
            event.remove(target, "before_cursor_execute", self._before)
            asyncpg.Connection.fetch = original

    def _before(self, conn: Any, _cursor: Any, statement: str, parameters: Any,
                _context: Any, executemany: bool) -> None:
        if self.armed and not executemany:
            values = list(parameters.values()) if isinstance(parameters, Mapping) else list(
                parameters or ())
            # (inside SQLAlchemy's greenlet: its asyncpg connection is awaited from here)
            await_only(self._capture(conn.connection.driver_connection, statement, values))

    async def _capture(self, driver: asyncpg.Connection, statement: str,
                       values: Sequence[Any]) -> None:
        if not self.armed or statement.lstrip().upper().startswith("EXPLAIN"):
            return
        kind = next((k.name for k in self.kinds
                     if k.name in self.armed and k.matches(statement)), None)
        if kind is None:
            return
        label = self.armed.pop(kind)
        doc: dict[str, Any] = {"kind": kind, "statement": statement.strip()}
        try:
            doc["custom"] = await _explain_custom(driver, statement, values)
            doc["generic"] = await _explain_generic(driver, statement, values)
            for name, rewrite in self.variants.get(kind, {}).items():
                changed = rewrite(statement)
                doc.setdefault("variants", {})[name] = {
                    "statement": changed.strip(),
                    "custom": await _explain_custom(driver, changed, values),
                    "generic": await _explain_generic(driver, changed, values)}
        except Exception as exc:  # a plan is evidence, never a reason to fail the run
            doc["error"] = f"{type(exc).__name__}: {exc}"
        doc["parameters"] = _describe(values)
        self.plans[label] = doc


# The explains go through the original `fetch`: the wrapped one would look at them too.
_FETCH = asyncpg.Connection.fetch


@contextlib.asynccontextmanager
async def _scratch(driver: asyncpg.Connection) -> AsyncIterator[None]:
    """Whatever runs inside is rolled back: a transaction of its own on an AUTOCOMMIT
    connection (the worker's), a savepoint inside one SQLAlchemy holds open."""
    inside = driver.is_in_transaction()
    await driver.execute(f"SAVEPOINT {SAVEPOINT}" if inside else "BEGIN")
    try:
        yield
    finally:
        if inside:
            await driver.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
            await driver.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")
        else:
            await driver.execute("ROLLBACK")


async def _explain_custom(driver: asyncpg.Connection, statement: str, values: Sequence[Any]
                          ) -> list[str]:
    async with _scratch(driver):
        return [str(r[0]) for r in await _FETCH(
            driver, "EXPLAIN (ANALYZE, BUFFERS) " + statement, *values)]


async def _explain_generic(driver: asyncpg.Connection, statement: str, values: Sequence[Any]
                           ) -> list[str]:
    try:
        async with _scratch(driver):
            await driver.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await driver.execute(f"PREPARE {PREPARED} AS {statement}")
            args = ", ".join(literal(v) for v in values)
            return [str(r[0]) for r in await _FETCH(
                driver, f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE {PREPARED}"
                + (f"({args})" if values else ""))]
    finally:
        if await driver.fetchval("SELECT count(*) FROM pg_prepared_statements WHERE name = "
                                 f"'{PREPARED}'"):
            await driver.execute(f"DEALLOCATE {PREPARED}")


def _describe(parameters: Any) -> list[str]:
    """Bound values, arrays summarised (a completion carries hundreds of ids)."""
    values = list(parameters.values()) if isinstance(parameters, Mapping) else list(
        parameters or ())
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            head = ", ".join(repr(x) for x in list(v)[:3])
            out.append(f"[{head}{', ...' if len(v) > 3 else ''}] ({len(v)} values)")
        else:
            out.append(repr(v))
    return out

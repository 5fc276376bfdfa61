"""EXPLAIN (ANALYZE, BUFFERS) of the statements the service really sends, as it sends them.

A `PlanCatcher` listens on an engine's `before_cursor_execute`. Armed for a kind of statement
(recognised by substrings), it explains the next matching statement with its real bound
parameters on the same connection, inside the same transaction, within a SAVEPOINT that is
rolled back, then lets the statement run as usual. Two plans per capture:

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

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


def _rows(cursor: Any) -> list[str]:
    return [str(r[0]) for r in cursor.fetchall()]


@dataclass
class PlanCatcher:
    """Explain the next statement of an armed kind; results land in `plans[label]`."""

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
        try:
            yield self
        finally:
            event.remove(target, "before_cursor_execute", self._before)

    def _before(self, _conn: Any, cursor: Any, statement: str, parameters: Any,
                _context: Any, executemany: bool) -> None:
        if not self.armed or executemany or statement.lstrip().upper().startswith("EXPLAIN"):
            return
        kind = next((k.name for k in self.kinds
                     if k.name in self.armed and k.matches(statement)), None)
        if kind is None:
            return
        label = self.armed.pop(kind)
        doc: dict[str, Any] = {"kind": kind, "statement": statement.strip()}
        # the worker runs its hot statements on AUTOCOMMIT connections: no transaction to
        # hold a savepoint, so the explain gets a transaction of its own, rolled back
        autocommit = _conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
        try:
            doc["custom"] = self._explain_custom(cursor, statement, parameters, autocommit)
            doc["generic"] = self._explain_generic(cursor, statement, parameters, autocommit)
            for name, rewrite in self.variants.get(kind, {}).items():
                changed = rewrite(statement)
                doc.setdefault("variants", {})[name] = {
                    "statement": changed.strip(),
                    "custom": self._explain_custom(cursor, changed, parameters, autocommit),
                    "generic": self._explain_generic(cursor, changed, parameters,
                                                     autocommit)}
        except Exception as exc:  # a plan is evidence, never a reason to fail the run
            doc["error"] = f"{type(exc).__name__}: {exc}"
        doc["parameters"] = _describe(parameters)
        self.plans[label] = doc

    @staticmethod
    @contextlib.contextmanager
    def _scratch(cursor: Any, autocommit: bool) -> Iterator[None]:
        """Whatever runs inside is rolled back."""
        cursor.execute("BEGIN" if autocommit else f"SAVEPOINT {SAVEPOINT}")
        try:
            yield
        finally:
            if autocommit:
                cursor.execute("ROLLBACK")
            else:
                cursor.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
                cursor.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")

    @staticmethod
    def _explain_custom(cursor: Any, statement: str, parameters: Any, autocommit: bool
                        ) -> list[str]:
        with PlanCatcher._scratch(cursor, autocommit):
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters)
            return _rows(cursor)

    @staticmethod
    def _explain_generic(cursor: Any, statement: str, parameters: Any, autocommit: bool
                         ) -> list[str]:
        values = list(parameters.values()) if isinstance(parameters, Mapping) else list(
            parameters or ())
        try:
            with PlanCatcher._scratch(cursor, autocommit):
                cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                cursor.execute(f"PREPARE {PREPARED} AS {statement}")
                args = ", ".join(literal(v) for v in values)
                cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE {PREPARED}"
                               + (f"({args})" if values else ""))
                return _rows(cursor)
        finally:
            cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = "
                           f"'{PREPARED}'")
            if cursor.fetchall()[0][0]:
                cursor.execute(f"DEALLOCATE {PREPARED}")


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

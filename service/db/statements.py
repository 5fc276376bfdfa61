"""Running one hot statement on an engine or on a connection the caller holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Row, TextClause
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

# Where a statement runs: an engine (a pooled connection and a transaction of its own), or a
# connection the caller holds. The worker holds AUTOCOMMIT connections across rounds, so a
# hot statement costs one round trip instead of six (the pool's pre-ping is BEGIN, `;`,
# ROLLBACK, then BEGIN, the statement, COMMIT); each such statement is atomic on its own.
Database = AsyncEngine | AsyncConnection


async def fetch(db: Database, statement: TextClause, params: Mapping[str, Any]
                ) -> Sequence[Row[Any]]:
    """Run one statement and commit it before returning (no transaction stays open)."""
    if isinstance(db, AsyncConnection):
        rows = (await db.execute(statement, params)).all()
        await db.commit()
        return rows
    async with db.begin() as conn:
        return (await conn.execute(statement, params)).all()


async def fetch_none(db: Database, statement: TextClause, params: Mapping[str, Any]) -> None:
    """Run one statement that returns no rows, committed before returning."""
    if isinstance(db, AsyncConnection):
        await db.execute(statement, params)
        await db.commit()
        return
    async with db.begin() as conn:
        await conn.execute(statement, params)


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
                await self.close()
                raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

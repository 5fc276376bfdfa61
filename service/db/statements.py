"""Running one hot statement on an engine or on a connection the caller holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

"""Alembic environment (async). Sweeper passes an open connection in
``config.attributes["connection"]`` (it holds the migration advisory lock on it); a developer
running ``alembic`` by hand gets a fresh asyncpg engine from SWEEPER_DATABASE_URL."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from service.config.settings import async_url

config = context.config


def _run(connection: Connection) -> None:
    context.configure(connection=connection, transaction_per_migration=False)
    with context.begin_transaction():
        context.run_migrations()


async def _run_standalone() -> None:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("SWEEPER_DATABASE_URL")
    if not url:
        raise SystemExit("set SWEEPER_DATABASE_URL to run alembic by hand")
    engine = create_async_engine(async_url(url))
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")

connection = config.attributes.get("connection")
if connection is None:
    asyncio.run(_run_standalone())
else:
    _run(connection)

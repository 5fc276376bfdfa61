"""Scratch databases for drills, created, migrated and dropped on a PostgreSQL server."""

from __future__ import annotations

import asyncpg
from sqlalchemy.engine import make_url

from service.config.settings import Settings, async_url
from service.db.engine import is_unavailable, make_engine
from service.errors import DatabaseUnavailable


async def _connect(server_url: str) -> asyncpg.Connection:
    """A connection to the server; DatabaseUnavailable (exit 3) when it cannot be reached."""
    try:
        return await asyncpg.connect(server_url)
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        where = make_url(server_url).render_as_string(hide_password=True)
        raise DatabaseUnavailable(f"cannot reach PostgreSQL at {where}: "
                                  f"{str(exc) or type(exc).__name__}") from None


async def create_database(server_url: str, name: str) -> str:
    """Create database `name` on the server of `server_url` and migrate it to head; its URL.
    Drills never run in an existing database: workers claim any scope with work, so items
    of a drill and of a real deployment sharing one database would be each other's poison."""
    from service.db import migrate

    conn = await _connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    url = str(make_url(server_url).set(database=name).render_as_string(hide_password=False))
    engine = make_engine(async_url(url), Settings(database_url=url, workers=0))
    try:
        await migrate.upgrade(engine)
    finally:
        await engine.dispose()
    return url


async def drop_database(server_url: str, name: str) -> None:
    """Drop a drill's database, cutting any connection left."""
    conn = await _connect(server_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()

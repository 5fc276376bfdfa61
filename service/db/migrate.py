"""Schema migrations: Alembic driven in code, serialised across replicas by an advisory lock."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import cache
from pathlib import Path
from typing import Final, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection
from sqlalchemy.ext.asyncio import AsyncEngine

import service
from service.config.settings import Settings
from service.db.engine import is_unavailable, make_engine
from service.db.statements import Statement, run
from service.errors import DatabaseUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# pg_advisory_lock key: replicas starting together take turns; the later ones find the
# schema at head and do nothing. (ASCII "SWEEPMIG" as a signed 64-bit integer.)
MIGRATION_LOCK_KEY: Final = 0x535745_45504D4947

_LOCK = Statement("migrate.lock", (
    "Wait for the migration lock (a session advisory lock): replicas migrate one at a "
    "time."), "SELECT pg_advisory_lock(:key)")
_UNLOCK = Statement("migrate.unlock", (
    "Release the migration lock for the next replica."), "SELECT pg_advisory_unlock(:key)")


def script_location() -> Path:
    """The migrations folder: inside the installed wheel, else beside the source package."""
    package = Path(service.__file__).parent
    for candidate in (package / "_migrations", package.parent / "migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise FileNotFoundError("the migrations folder is missing from this installation")


def alembic_config() -> Config:
    """An Alembic config built in code (no alembic.ini needed at run time)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    return cfg


@cache
def head_revision() -> str:
    """The newest revision this build knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships revisions
        raise RuntimeError("no migrations found")
    return head


def is_known(revision: str) -> bool:
    """True when this build ships `revision` (so a database at it is behind or at head)."""
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except Exception:  # alembic raises several types for unknown ids
        return False


def _upgrade(connection: Connection, target: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, target)


def _downgrade(connection: Connection, target: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.downgrade(cfg, target)


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def upgrade(engine: AsyncEngine, target: str = "head") -> None:
    """Bring the schema to `target` under the migration lock, in one transaction."""
    async with engine.connect() as conn:
        await run(conn, _LOCK, {"key": MIGRATION_LOCK_KEY})
        try:
            before = await conn.run_sync(_current)
            await conn.run_sync(_upgrade, target)
            await conn.commit()
            after = await conn.run_sync(_current)
        finally:
            await run(conn, _UNLOCK, {"key": MIGRATION_LOCK_KEY})
            await conn.commit()
    if before != after:
        log.info("schema migrated", extra={"from_revision": before, "to_revision": after})


async def downgrade(engine: AsyncEngine, target: str) -> None:
    """Step the schema back to `target` ("base" removes everything) under the lock."""
    async with engine.connect() as conn:
        await run(conn, _LOCK, {"key": MIGRATION_LOCK_KEY})
        try:
            await conn.run_sync(_downgrade, target)
            await conn.commit()
        finally:
            await run(conn, _UNLOCK, {"key": MIGRATION_LOCK_KEY})
            await conn.commit()


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at (None before the first migration)."""
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


def unreachable(url: URL, exc: Exception) -> DatabaseUnavailable:
    """'Cannot connect' said once: where (no password) and why."""
    where = url.set(drivername="postgresql").render_as_string(hide_password=True)
    reason = str(getattr(exc, "orig", None) or exc) or type(exc).__name__
    return DatabaseUnavailable(f"cannot reach PostgreSQL at {where}: {reason}")


async def on_database(url: URL, settings: Settings,
                      work: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """`work` on an engine of its own, disposed after; 'cannot connect' raised as
    DatabaseUnavailable with a clear message (what a command does once, at its start)."""
    engine = make_engine(url, settings)
    try:
        return await work(engine)
    except Exception as exc:
        if is_unavailable(exc):
            raise unreachable(url, exc) from None
        raise
    finally:
        await engine.dispose()


async def migrate_database(url: URL, settings: Settings, target: str = "head") -> None:
    """Run migrations, mapping 'cannot connect' to DatabaseUnavailable with a clear message."""
    await on_database(url, settings, lambda engine: upgrade(engine, target))


async def schema_revision(url: URL, settings: Settings) -> str | None:
    """The revision the database's schema is at (None: not migrated yet), reached as
    `serve` reaches it; DatabaseUnavailable when it cannot be."""
    return await on_database(url, settings, current_revision)

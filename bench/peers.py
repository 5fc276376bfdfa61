"""A peer in the same run: Sweeper's drain against PgQueuer draining as many no-op jobs.

PgQueuer (https://github.com/janbjorge/pgqueuer) is the Python PostgreSQL queue a user would
pick instead. Both sides run in this process and event loop, on the same server, one after
the other and never at once, in an order that alternates with each repetition (Sweeper
first, then every PgQueuer configuration; then the reverse) so a shared machine's drift
hits both. Each drain gets a fresh database, its work enqueued before the clock starts, and
the clock runs until every one of the N items is committed as done. CPU per item is given
twice: this process's (time.process_time), the client side; and the database's, the CPU
its backends for the drain's database used over that time (from /proc, so only when the
server runs on this machine). Their sum is what an item costs the machine.

What each side does per item:

  Sweeper  bench/drain.py's mock mode, one WorkerPool: an admission statement takes tokens
           from the scope's budget bucket and leases items under a fresh lease token, in one
           statement per batch; the DELETE is built and serialized as the service's own
           transport writes it, then answered in-process (an empty 204, no socket); a
           fenced completion (the item changes only while it is still leased under that
           token) marks it succeeded and appends the deletion to the evidence log, in one
           statement per batch; at INFO (the default, as deployed) two JSON log
           lines per attempt go to /dev/null.
  PgQueuer QueueManager.run with a no-op async entrypoint: a dequeue statement per batch
           (FOR UPDATE SKIP LOCKED on the queued rows, UPDATE them to `picked` with this
           manager's id and a heartbeat, INSERT one `picked` row each into pgqueuer_log);
           each job runs in its own asyncio task beside a heartbeat task; completions are
           buffered and flushed every batch_size jobs or 0.1 s: one statement DELETEs the
           jobs from the queue table by id (not fenced on the picking manager) and INSERTs
           a `successful` row each into pgqueuer_log. A statement-level trigger on the
           queue table sends a NOTIFY for every statement that changes it. No budget or
           rate limit; entrypoint concurrency_limit 0 (unlimited, its default: a limit adds
           slot bookkeeping to every dequeue). Tables as installed by default (`durable`:
           all logged, as Sweeper's are).

PgQueuer's configuration space is swept (`--pgqueuer`, default 1x10,1x100,1x1000,5x10,
5x100,5x1000): MxB[xT] is M QueueManagers in this process, each on its own asyncpg
connection (AsyncpgDriver, as PgQueuer's own drain benchmark does), dequeuing B jobs at a
time, each holding at most T jobs at once (max_concurrent_tasks; unlimited by default).
PgQueuer's SchedulerManager (the `PgQueuer` wrapper runs one beside the QueueManager) is
left out: it has nothing to schedule here. Separate processes were not a clear gain on the
2-core machine (the drain is bound by PostgreSQL there), so both sides run in one process.

PgQueuer's drain is done when its completion statements committed N `successful` jobs
(counted in-process, as Sweeper's completions are); afterwards every enqueued job must have
run exactly once and the queue table must be empty.

Around every drain, each side's database is counted as bench/counts.py does it (the same
window on both sides: opened once no connection to the drain's database is left, closed
once the drain's connections have all closed): transactions, rows written per table, the
HOT share of the main table's updates (items; PgQueuer's queue table), WAL bytes, and, where
pg_stat_statements is preloaded, statements and buffers dirtied, per item.

    python -m bench peers --items 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import importlib.metadata
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from pgqueuer import AsyncpgDriver, Queries, QueueManager
from pgqueuer.models import Job, TracebackRecord
from pgqueuer.types import JOB_STATUS
from sqlalchemy.engine import make_url

from bench import counts, drain
from bench.celery_peer import (
    DEFAULT_BROKER,
    DEFAULT_CELERY,
    CeleryConfig,
    celery_configs,
    celery_repetition,
)
from bench.common import (
    DATABASE_PREFIX,
    BenchContext,
    Benchmark,
    admin,
    backend_cpu,
    configure_service_logging,
    cpu_spent,
    int_list,
    progress,
    summarize,
    with_database,
)
from service.commands.startup import settle_heap

TARGET_RATIO = 1.0
DEFAULT_CONCURRENCY = (64,)
DEFAULT_PGQUEUER = "1x10,1x100,1x1000,5x10,5x100,5x1000"
ENTRYPOINT = "noop"
ENQUEUE_CHUNK = 10_000
QUEUE_TABLE, LOG_TABLE = "pgqueuer", "pgqueuer_log"  # as `Queries.install()` names them


# -- options -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PgqConfig:
    """M QueueManagers dequeuing B jobs at a time, each holding at most T (None: no cap)."""

    managers: int
    batch_size: int
    max_tasks: int | None = None

    @property
    def label(self) -> str:
        cap = f"x{self.max_tasks}" if self.max_tasks else ""
        return f"{self.managers}x{self.batch_size}{cap}"


def _pgq_configs(value: str) -> list[PgqConfig]:
    configs = []
    for spec in (v.strip() for v in value.split(",") if v.strip()):
        try:
            numbers = [int(n) for n in spec.split("x")]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3) or any(n < 1 for n in numbers):
            raise argparse.ArgumentTypeError(
                f"{spec!r}: expected MANAGERSxBATCH[xMAX_TASKS] like 5x100 or 1x100x200")
        config = PgqConfig(*numbers)
        # QueueManager.run raises on a cap under twice the batch: say so before any drain
        if config.max_tasks is not None and config.max_tasks < 2 * config.batch_size:
            raise argparse.ArgumentTypeError(f"{spec!r}: MAX_TASKS must be at least 2 x BATCH")
        configs.append(config)
    if not configs:
        raise argparse.ArgumentTypeError(f"{value!r}: no configuration")
    return configs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=20_000,
                        help="items (jobs) drained per repetition by each side (default 20000)")
    parser.add_argument("--concurrency", type=int_list, default=list(DEFAULT_CONCURRENCY),
                        help="Sweeper WorkerPool concurrency, comma-separated; the best "
                             "median is compared (default 64)")
    parser.add_argument("--pgqueuer", type=_pgq_configs, default=_pgq_configs(DEFAULT_PGQUEUER),
                        help="PgQueuer configurations MANAGERSxBATCH[xMAX_TASKS], "
                             f"comma-separated (default {DEFAULT_PGQUEUER})")
    parser.add_argument("--celery", type=celery_configs, default=celery_configs(DEFAULT_CELERY),
                        help="Celery configurations POOL:CONCURRENCY:PREFETCH on RabbitMQ, "
                             f"comma-separated (default {DEFAULT_CELERY}; bench/celery_peer.py)")
    parser.add_argument("--no-celery", dest="celery", action="store_const", const=[],
                        help="leave Celery out")
    parser.add_argument("--broker-url", default=os.environ.get("SWEEPER_BENCH_AMQP_URL",
                                                               DEFAULT_BROKER),
                        help="Celery's RabbitMQ (default SWEEPER_BENCH_AMQP_URL, else "
                             f"{DEFAULT_BROKER})")
    parser.add_argument("--sweeper-broker", action="store_true",
                        help="also drain Sweeper in broker mode (SWEEPER_EXECUTION=rabbitmq) "
                             "on --broker-url at each --concurrency: the ratio to Celery on "
                             "the same RabbitMQ")
    parser.add_argument("--log-level", choices=("INFO", "WARNING"), default="INFO",
                        help="service log level (JSON to /dev/null; default INFO, as "
                             "deployed); PgQueuer logs nothing per job at either")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="give up on one drain after this many seconds (default 300)")


# -- PgQueuer ------------------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    """Jobs whose completion committed, over every QueueManager; `done` is set at `target`."""

    target: int
    acked: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclasses.dataclass
class CountingQueries(Queries):
    """PgQueuer's queries, counting the jobs each completion statement committed (the
    statement that deletes them from the queue and logs them): the end of the clock."""

    tally: Tally = dataclasses.field(kw_only=True)

    async def log_jobs(self, job_status: list[tuple[Job, JOB_STATUS, TracebackRecord | None]]
                       ) -> None:
        await super().log_jobs(job_status)
        self.tally.acked.update(status for _job, status, _tb in job_status)
        if self.tally.acked.total() >= self.tally.target:  # any other status fails the check
            self.tally.done.set()


@contextlib.asynccontextmanager
async def pgqueuer_database(server_url: str) -> AsyncIterator[str]:
    """CREATE DATABASE sweeper_bench_peers_<random> with PgQueuer's schema installed (and
    none of Sweeper's); dropped after. Yields its URL."""
    name = f"{DATABASE_PREFIX}peers_{uuid.uuid4().hex[:8]}"
    await admin(server_url, f'CREATE DATABASE "{name}"')
    try:
        url = with_database(server_url, name)
        conn = await asyncpg.connect(url)
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()
        yield url
    finally:
        await admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def enqueue(url: str, n: int) -> set[int]:
    """N no-op jobs in bulk, then VACUUM (ANALYZE) as Sweeper's items get; their ids."""
    conn = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        ids: set[int] = set()
        for start in range(0, n, ENQUEUE_CHUNK):
            k = min(n, start + ENQUEUE_CHUNK) - start
            ids.update(await queries.enqueue([ENTRYPOINT] * k, [None] * k, [0] * k))
        await conn.execute(f"VACUUM (ANALYZE) {QUEUE_TABLE}")
    finally:
        await conn.close()
    if len(ids) != n:
        raise RuntimeError(f"enqueued {n} jobs but got {len(ids)} ids")
    return ids


async def pgqueuer_drain(server_url: str, url: str, config: PgqConfig, target: int,
                         deadline_s: float
                         ) -> tuple[dict[str, Any], collections.Counter[int]]:
    """Run config.managers QueueManagers until `target` jobs completed, then stop them.
    Returns the timings, the counts of bench/counts.py around the whole drain (connections
    opened to closed), and how often each job id reached the entrypoint."""
    tally = Tally(target)
    window = counts.Window(server_url, url, QUEUE_TABLE)
    await window.open()
    calls: collections.Counter[int] = collections.Counter()

    async def noop(job: Job) -> None:
        calls[job.id] += 1

    connections = [await asyncpg.connect(url) for _ in range(config.managers)]
    managers = []
    for conn in connections:
        qm = QueueManager(CountingQueries(AsyncpgDriver(conn), tally=tally))
        qm.entrypoint(ENTRYPOINT)(noop)
        managers.append(qm)
    try:
        settle_heap()  # as Sweeper's drain does: neither side's full collections walk setup
        # read from the maintenance database: not a transaction of the drain's
        db_before = await backend_cpu(server_url, make_url(url).database or "")
        load = os.getloadavg()[0]
        cpu_started = time.process_time()
        started = time.perf_counter()
        runs = [asyncio.create_task(qm.run(batch_size=config.batch_size,
                                           max_concurrent_tasks=config.max_tasks))
                for qm in managers]
        finished = asyncio.create_task(tally.done.wait())
        try:
            over, _ = await asyncio.wait({finished, *runs}, timeout=deadline_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            db_cpu = cpu_spent(db_before, await backend_cpu(server_url,
                                                            make_url(url).database or ""))
            if finished not in over:
                for task in over:
                    task.result()  # a manager that failed says why
                raise RuntimeError(f"PgQueuer {config.label} stopped early or timed out "
                                   f"after {elapsed:.0f}s ({tally.acked} of {target})")
        finally:
            finished.cancel()
            for qm in managers:
                qm.shutdown.set()
            await asyncio.wait_for(asyncio.gather(*runs), 60)
    finally:
        for conn in connections:
            await conn.close()
    measured = await window.close(target)
    return {"seconds": round(elapsed, 4), "jobs_per_s": round(target / elapsed, 1),
            "process_cpu_seconds": round(cpu, 3), "process_cpu_share": round(cpu / elapsed, 3),
            "cpu_us_per_job": round(1e6 * cpu / target, 1),
            "database_cpu_us_per_job": None if db_cpu is None else round(1e6 * db_cpu / target, 1),
            "load_average_1m_at_start": load,
            "completions_by_status": dict(tally.acked), "counts": measured}, calls


async def pgqueuer_repetition(ctx: BenchContext, config: PgqConfig, items: int,
                              deadline_s: float, label: str) -> dict[str, Any]:
    """Fresh database, enqueue, drain once, verify."""
    started = time.perf_counter()
    async with pgqueuer_database(ctx.server_url) as url:
        created = time.perf_counter()
        ids = await enqueue(url, items)
        enqueued = time.perf_counter()
        result, calls = await pgqueuer_drain(ctx.server_url, url, config, items, deadline_s)
        conn = await asyncpg.connect(url)
        try:
            left = await conn.fetchval(f"SELECT count(*) FROM {QUEUE_TABLE}")
            logged = {r["status"]: r["n"] for r in await conn.fetch(
                f"SELECT status::text, count(*) AS n FROM {LOG_TABLE} GROUP BY 1 ORDER BY 1")}
        finally:
            await conn.close()
    ran_once = set(calls) == ids and set(calls.values()) == {1}
    ok = ran_once and left == 0 and result["completions_by_status"] == {"successful": items}
    doc = {"config": config.label, "managers": config.managers,
           "batch_size": config.batch_size, "max_concurrent_tasks": config.max_tasks,
           "items": items, **result, "entrypoint_calls": calls.total(),
           "jobs_run_more_than_once": sum(1 for n in calls.values() if n > 1),
           "each_job_ran_once": ran_once, "left_in_queue": left,
           # PgQueuer's own log: a `queued` row per job from the enqueue (before the
           # clock), then `picked` and `successful`
           "log_rows_by_status": logged, "all_done": ok,
           "setup": {"create_and_install_seconds": round(created - started, 3),
                     "enqueue_and_vacuum_seconds": round(enqueued - created, 3)}}
    progress(f"{label}: pgqueuer {config.label:10} {doc['jobs_per_s']:>8.0f} jobs/s  "
             f"({doc['seconds']:.2f}s, cpu {doc['process_cpu_share']:.0%}, "
             f"{'ok' if ok else 'MISMATCH'})")
    if not ok:
        raise RuntimeError(f"PgQueuer {config.label} left {left} jobs, completions "
                           f"{result['completions_by_status']}, each ran once: {ran_once}")
    return doc


# -- the benchmark -------------------------------------------------------------------------


def _cell(rows: list[dict[str, Any]], per_s: str, cpu: str, db_cpu: str) -> dict[str, Any]:
    return {"jobs_per_s": summarize([r[per_s] for r in rows]),
            "cpu_us_per_job": summarize([r[cpu] for r in rows]),
            "database_cpu_us_per_job": summarize([r[db_cpu] for r in rows
                                                  if r[db_cpu] is not None]),
            "seconds": summarize([r["seconds"] for r in rows]),
            "counts_per_item": counts.summarize_counts([r["counts"] for r in rows]),
            "repetitions": rows}


def _best(cells: dict[str, dict[str, Any]]) -> str:
    return max(cells, key=lambda k: cells[k]["jobs_per_s"]["median"])


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    version = importlib.metadata.version("pgqueuer")
    concurrency = sorted(set(args.concurrency))
    configs: list[PgqConfig] = list(dict.fromkeys(args.pgqueuer))
    celeries: list[CeleryConfig] = list(dict.fromkeys(args.celery))
    # drain.repetition takes its options as a namespace; the mock upstream needs no fake one
    drain_args = argparse.Namespace(drain_timeout=args.drain_timeout, fake_upstream="inline",
                                    broker_url=args.broker_url)
    brokered = list(concurrency) if args.sweeper_broker else []
    parameters = {
        "items": args.items, "repeat": args.repeat, "event_loop": args.loop,
        "sweeper": {"mode": "mock", "concurrency": concurrency, "log_level": args.log_level,
                    "per_item": "lease + budget token, a no-op call built and serialized as "
                                "the service's transport writes it, fenced completion + "
                                "evidence record"},
        "celery": {"configurations": [c.label for c in celeries],
                   "configuration_format": "POOL:CONCURRENCY:PREFETCH_MULTIPLIER",
                   "per_item": "a persistent message on a durable queue, a no-op task, "
                               "acked after it ran (late acks), no result backend"},
        "pgqueuer": {"version": version, "configurations": [c.label for c in configs],
                     "configuration_format": "MANAGERSxBATCH[xMAX_CONCURRENT_TASKS]",
                     "queue_managers": "in this process, one asyncpg connection each "
                                       "(AsyncpgDriver), no SchedulerManager",
                     "entrypoint_concurrency_limit": 0, "run_mode": "continuous",
                     "per_item": "dequeue (pick + log row), no-op task, buffered completion "
                                 "(delete + log row)"},
        "order": "per repetition: Sweeper, every PgQueuer then every Celery configuration "
                 "(then Sweeper in broker mode, with --sweeper-broker), reversed on odd "
                 "repetitions",
        "sweeper_broker": {"concurrency": brokered, "broker_url": "the Celery side's",
                           "prefetch": drain.BROKER_PREFETCH} if brokered else None,
    }
    configure_service_logging(args.log_level)  # also for PgQueuer drains that come first
    sweeper: dict[str, list[dict[str, Any]]] = {str(c): [] for c in concurrency}
    pgqueuer: dict[str, list[dict[str, Any]]] = {c.label: [] for c in configs}
    celery: dict[str, list[dict[str, Any]]] = {c.label: [] for c in celeries}
    sweeper_broker: dict[str, list[dict[str, Any]]] = {str(c): [] for c in brokered}
    for rep in range(args.repeat):
        label = f"rep {rep + 1}/{args.repeat}"
        sides: list[int | str | PgqConfig | CeleryConfig] = [
            *concurrency, *configs, *celeries, *(f"{c}+rabbitmq" for c in brokered)]
        for side in sides if rep % 2 == 0 else reversed(sides):
            if isinstance(side, str):  # Sweeper in broker mode
                c = int(side.split("+")[0])
                sweeper_broker[str(c)].append(await drain.repetition(
                    ctx, drain_args, mode="mock", items=args.items, concurrency=c,
                    log_level=args.log_level, label=label, execution="rabbitmq"))
            elif isinstance(side, CeleryConfig):
                celery[side.label].append(await celery_repetition(
                    args.broker_url, side, args.items, args.drain_timeout, label))
            elif isinstance(side, PgqConfig):
                pgqueuer[side.label].append(await pgqueuer_repetition(
                    ctx, side, args.items, args.drain_timeout, label))
            else:
                sweeper[str(side)].append(await drain.repetition(
                    ctx, drain_args, mode="mock", items=args.items, concurrency=side,
                    log_level=args.log_level, label=label))
    sweeper_cells = {c: _cell(rows, "items_per_s", "cpu_us_per_item",
                            "database_cpu_us_per_item")
                     for c, rows in sweeper.items()}
    pgqueuer_cells = {c: _cell(rows, "jobs_per_s", "cpu_us_per_job",
                             "database_cpu_us_per_job")
                      for c, rows in pgqueuer.items()}
    best_s, best_p = _best(sweeper_cells), _best(pgqueuer_cells)
    s_median = sweeper_cells[best_s]["jobs_per_s"]["median"]
    p_median = pgqueuer_cells[best_p]["jobs_per_s"]["median"]
    ratio = round(s_median / p_median, 3)
    doc: dict[str, Any] = {
        "parameters": parameters, "pgqueuer_version": version,
        "sweeper": sweeper_cells, "pgqueuer": pgqueuer_cells,
        "best": {"sweeper_concurrency": int(best_s), "sweeper_jobs_per_s": s_median,
                 "pgqueuer_configuration": best_p, "pgqueuer_jobs_per_s": p_median},
        "ratio": {
            "sweeper_over_best_pgqueuer": ratio,
            # the same two cells, repetition by repetition (run next to each other)
            "per_repetition": [round(s["items_per_s"] / p["jobs_per_s"], 3) for s, p in zip(
                sweeper[best_s], pgqueuer[best_p], strict=True)],
            "target": TARGET_RATIO, "met": ratio >= TARGET_RATIO},
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }
    if celeries:
        cells: dict[str, dict[str, Any]] = {
                 c: {"jobs_per_s": summarize([r["jobs_per_s"] for r in rows]),
                     "cpu_us_per_job": summarize([r["cpu_us_per_job"] for r in rows]),
                     "broker_cpu_us_per_job": summarize(
                         [r["broker_cpu_us_per_job"] for r in rows
                          if r["broker_cpu_us_per_job"] is not None]),
                     "repetitions": rows} for c, rows in celery.items()}
        best_c = _best(cells)
        doc["celery"], doc["best"]["celery_configuration"] = cells, best_c
        doc["ratio"]["sweeper_over_best_celery"] = round(
            s_median / cells[best_c]["jobs_per_s"]["median"], 3)
    if sweeper_broker:
        broker_cells = {c: _cell(rows, "items_per_s", "cpu_us_per_item",
                                 "database_cpu_us_per_item") for c, rows in sweeper_broker.items()}
        best_b = _best(broker_cells)
        doc["sweeper_broker"] = broker_cells
        doc["best"]["sweeper_broker_concurrency"] = int(best_b)
        if celeries:
            doc["ratio"]["sweeper_broker_over_best_celery"] = round(
                broker_cells[best_b]["jobs_per_s"]["median"]
                / doc["celery"][doc["best"]["celery_configuration"]]["jobs_per_s"]["median"], 3)
    print_summary(doc)
    return doc


def print_summary(doc: dict[str, Any]) -> None:
    lines = ["peers: median jobs/s (min-max), CPU us/job of this process and of the database"]
    for side in ("sweeper", "pgqueuer", "sweeper_broker"):
        for key, cell in doc.get(side, {}).items():
            s, cpu = cell["jobs_per_s"], cell["cpu_us_per_job"]
            name = key if side == "pgqueuer" else f"c={key}"
            shown = "sweeper+rabbitmq" if side == "sweeper_broker" else side
            lines.append(f"  {shown:8} {name:10} {s['median']:>9.1f}  ({s['min']:.0f}-"
                         f"{s['max']:.0f})  cpu {cpu['median']} us/job, database "
                         f"{cell['database_cpu_us_per_job']['median']}")
            lines.append(f"  {'':8} {'':10} {counts.summary_line(cell['counts_per_item'])}")
    for key, cell in doc.get("celery", {}).items():
        s, cpu = cell["jobs_per_s"], cell["cpu_us_per_job"]
        lines.append(f"  {'celery':8} {key:10} {s['median']:>9.1f}  ({s['min']:.0f}-"
                     f"{s['max']:.0f})  cpu {cpu['median']} us/job, broker "
                     f"{cell['broker_cpu_us_per_job']['median']}")
    best, ratio = doc["best"], doc["ratio"]
    lines.append(f"  ratio Sweeper c={best['sweeper_concurrency']} / PgQueuer "
                 f"{best['pgqueuer_configuration']} (best): "
                 f"{ratio['sweeper_over_best_pgqueuer']} (per repetition "
                 f"{', '.join(map(str, ratio['per_repetition']))}); target >= "
                 f"{ratio['target']}: {'met' if ratio['met'] else 'NOT met'}")
    if "sweeper_over_best_celery" in ratio:
        lines.append(f"  ratio Sweeper / Celery {best['celery_configuration']} (best): "
                     f"{ratio['sweeper_over_best_celery']}")
    if "sweeper_broker_over_best_celery" in ratio:
        lines.append(f"  ratio Sweeper in broker mode c={best['sweeper_broker_concurrency']} "
                     f"/ Celery {best['celery_configuration']} (best), one RabbitMQ: "
                     f"{ratio['sweeper_broker_over_best_celery']}")
    progress("\n".join(lines))


BENCHMARK = Benchmark(name="peers",
                      help="Sweeper's drain vs PgQueuer's on the same server, interleaved",
                      add_arguments=add_arguments, run=run)

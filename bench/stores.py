"""The store's own database as source and target (docs/stores.md), at scale.

A store database with a `carts` table of --rows rows (--expired of them untouched for weeks,
the rest active), indexed on `updated_at`, and the worked example's `expired-carts` policy
(policies.example.toml's `store` block, its SQL as written; page, batch and budget from the
options). Per repetition, on a fresh ledger:

  discovery, report-only   a dry run's walk of the real predicate over the whole table:
                           candidate rows/s, and the longest page read on the store and the
                           longest ledger transaction (each page is one of each)
  discovery, registering   the real run's walk, each page's items registered in the
                           transaction that moves the cursor: candidate rows/s, likewise
  deletion beside shoppers a pgbench shopper workload (reads and writes of active carts, new
                           carts) at a fixed rate, in alternating windows: alone for
                           --alone-window seconds, then beside one worker pool deleting
                           expired rows under the rows budget for --window seconds, until
                           every expired row is gone. The shoppers' p50/p99 over all windows
                           alone and over all windows beside the cleanup (alternating
                           windows share whatever else the machine does), their ratio, the
                           ratio of the windows alone split in two halves (the measurement's
                           own noise), and the cleanup's rows/s

With --store-server the store is made on another PostgreSQL server than the ledger, as in a
deployment (the ledger's writes then share neither the store's WAL nor its backends); with
--pin besides, the store's server and pgbench run on CPU 0 and this process and the ledger's
server on CPU 1, as if the store had its own machine (affinities are restored after).

The expired rows are put back between repetitions (new ids), so every repetition deletes as
many. pgbench (PostgreSQL's client tools) must be on PATH; its per-transaction log gives the
latencies.

    python -m bench stores --rows 10000000 --expired 0.1 --repeat 3
    python -m bench stores --store-server postgresql://postgres@127.0.0.1:5432/postgres --pin
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import text

from bench.common import (
    BenchContext,
    Benchmark,
    admin,
    fresh_database,
    plain_url,
    progress,
    summarize,
    with_database,
)
from drills.vendors import example_block
from service.config.policies import Policies, resolve_policies
from service.runs import publication, trigger
from service.runs.discovery import Discovery
from service.runs.page_sorting import Page
from service.sweeps.store_databases import Cursor, SourceRows, Stores
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool

SHOPS = 100
POLICY = "expired-carts"
SHOPPER_SCRIPT = """\\set id random(1, :active)
BEGIN;
SELECT id, shop, updated_at FROM carts WHERE id = :id;
UPDATE carts SET updated_at = now() WHERE id = :id;
END;
INSERT INTO carts (shop) VALUES ('shop-new');
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=10_000_000,
                        help="rows in the store's carts table (default 10,000,000)")
    parser.add_argument("--expired", type=float, default=0.1,
                        help="the share of them expired (default 0.1: 1,000,000 candidates)")
    parser.add_argument("--page", type=int, default=5000, help="source page (default 5000)")
    parser.add_argument("--batch", type=int, default=50,
                        help="rows per deletion statement (default 50, the example's)")
    parser.add_argument("--rows-per-second", type=float, default=500,
                        help="the deletion's budget in rows (default 500, the example's)")
    parser.add_argument("--workers", type=int, default=4,
                        help="the worker pool's concurrency (default 4)")
    parser.add_argument("--shopper-rate", type=int, default=300,
                        help="shopper transactions per second, pgbench -R (default 300)")
    parser.add_argument("--shopper-clients", type=int, default=4,
                        help="pgbench clients (default 4)")
    parser.add_argument("--window", type=int, default=10,
                        help="seconds of each window of shoppers beside the cleanup "
                        "(default 10)")
    parser.add_argument("--alone-window", type=int,
                        help="seconds of each window of shoppers alone (default: --window)")
    parser.add_argument("--layout", choices=sorted(AGES), default="aged",
                        help="where the expired rows lie: `aged`, oldest first as in a real "
                        "table (default), or `random`, scattered (each deleted row on a "
                        "page of its own)")
    parser.add_argument("--no-deletion", action="store_true",
                        help="the two walks only, no deletion beside shoppers")
    parser.add_argument("--store-server",
                        help="a PostgreSQL server URL to make the store database on (default: "
                        "the ledger's server)")
    parser.add_argument("--pin", action="store_true",
                        help="with --store-server: the store's server and pgbench on CPU 0, "
                        "this process and the ledger's server on CPU 1")


def policies_for(store_url: str, args: argparse.Namespace) -> Policies:
    doc = tomllib.loads(example_block(Path(__file__).resolve().parent.parent
                                      / "policies.example.toml", "store"))
    policy = doc["policies"][POLICY]
    policy["source"].update(page=args.page)
    policy["source"].pop("rows_per_second", None)
    policy["batch"] = {"max_objects": args.batch}
    policy["rate"] = {"per_second": args.rows_per_second,
                      "burst": max(args.batch, int(args.rows_per_second // 10)),
                      "unit": "rows"}
    policy.pop("guard", None)
    return resolve_policies({"stores": doc["stores"], "policies": {POLICY: policy}},
                            {"SHOP_DATABASE_URL": store_url}, source="bench")


async def create_store(conn: asyncpg.Connection, rows: int, expired: int, layout: str
                       ) -> None:
    """Active carts first (ids 1..active: the shoppers' range), then the expired ones."""
    await conn.execute("""
        CREATE TABLE carts (
            id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            shop       text NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now()
        )""")
    await conn.execute(
        "INSERT INTO carts (shop, updated_at) SELECT 'shop-' || (i % $2), "
        "now() - random() * interval '6 days' FROM generate_series(1, $1) i",
        rows - expired, SHOPS)
    await put_back_expired(conn, expired, layout)
    await conn.execute("CREATE INDEX carts_updated_at ON carts (updated_at)")
    await conn.execute("VACUUM (ANALYZE) carts")


# The expired carts' ages, 8 to 60 days old: `random` scatters them over their rows (each
# deleted row on a page of its own: the worst case), `aged` lays them out oldest first with
# a few minutes' jitter, as carts written and then left alone lie in a real table
AGES = {
    "random": "now() - interval '8 days' - random() * interval '52 days'",
    "aged": "now() - interval '60 days' + (i::float8 / $1) * interval '52 days' "
            "+ random() * interval '10 minutes'",
}


async def put_back_expired(conn: asyncpg.Connection, expired: int, layout: str) -> None:
    await conn.execute(
        f"INSERT INTO carts (shop, updated_at) SELECT 'shop-' || (i % $2), {AGES[layout]} "
        "FROM generate_series(1, $1) i", expired, SHOPS)


class TimedStores(Stores):
    """Stores whose page reads are timed (each is one transaction on the store)."""

    longest = 0.0

    async def read_page(self, *args: Any, **kwargs: Any) -> SourceRows:
        started = time.perf_counter()
        try:
            return await super().read_page(*args, **kwargs)
        finally:
            self.longest = max(self.longest, time.perf_counter() - started)


class TimedDiscovery(Discovery):
    """Discovery whose ledger transactions (one per page) are timed."""

    longest = 0.0

    async def _apply(self, engine: Any, run: Mapping[str, Any], policy: Any, state: Any,
                     page: Page, done: bool, last: Cursor, read: int = 1) -> Any:
        started = time.perf_counter()
        try:
            return await super()._apply(engine, run, policy, state, page, done, last, read)
        finally:
            self.longest = max(self.longest, time.perf_counter() - started)


async def discover(engine: Any, policies: Policies, dry_run: bool) -> dict[str, Any]:
    """One run's discovery of the whole table, timed; the run is left unpublished."""
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(POLICY, None, None,
                                                                    dry_run,
                                                                    None), None)
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT * FROM runs WHERE id = :id"), {"id": run_id})
               ).mappings().one()
    stores = TimedStores(policies.stores)
    walk = TimedDiscovery(policies, stores)
    try:
        started = time.perf_counter()
        await walk.discover(engine, row)
        elapsed = time.perf_counter() - started
    finally:
        await stores.aclose()
    async with engine.connect() as conn:
        found = (await conn.execute(text(
            "SELECT candidates, pages FROM discoveries WHERE run_id = :id"), {"id": run_id})
                 ).one()
    return {"run_id": run_id, "candidates": found.candidates, "pages": found.pages,
            "seconds": round(elapsed, 2),
            "candidate_rows_per_second": round(found.candidates / elapsed, 1),
            "longest_store_transaction_s": round(stores.longest, 3),
            "longest_ledger_transaction_s": round(walk.longest, 3)}


@contextlib.asynccontextmanager
async def shoppers(store_url: str, args: argparse.Namespace, active: int, seconds: int
                   ) -> AsyncIterator[list[tuple[float, float]]]:
    """pgbench shoppers for `seconds`, started on entry; once the block and pgbench have
    both ended, the yielded list holds each transaction's (end time, latency ms)."""
    folder = Path(tempfile.mkdtemp(prefix="sweeper-shoppers-"))
    script = folder / "shopper.sql"
    script.write_text(SHOPPER_SCRIPT)
    pin = ["taskset", "-c", str(STORE_CPU)] if args.pin else []
    proc = await asyncio.create_subprocess_exec(
        *pin, "pgbench", "-n", "-f", str(script), "-D", f"active={active}", "-R",
        str(args.shopper_rate), "-c", str(args.shopper_clients), "-j", "1", "-T",
        str(seconds), "-l", "--log-prefix", str(folder / "log"), plain_url(store_url),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=folder)
    samples: list[tuple[float, float]] = []
    try:
        yield samples
    finally:
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench failed ({proc.returncode}): {err.decode()[-500:]}")
        samples.extend(read_logs(folder))
        shutil.rmtree(folder, ignore_errors=True)


# -- CPU pinning: the store as if on its own machine -----------------------------------------

STORE_CPU = 0
SWEEPER_CPU = 1


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def server_processes(url: str) -> list[int]:
    """The local PostgreSQL server's postmaster (a backend's parent) and its children."""
    conn = await asyncpg.connect(plain_url(url))
    try:
        # while this backend lives (its /proc entry goes with the connection)
        return _family(await conn.fetchval("SELECT pg_backend_pid()"))
    finally:
        await conn.close()


def _family(backend: int) -> list[int]:
    if not Path(f"/proc/{backend}").exists():
        raise RuntimeError("--pin needs the servers on this machine")
    postmaster = _parent(backend)
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if _parent(int(entry.name)) == postmaster:
                    children.append(int(entry.name))
    return [postmaster, *children]


def _set_affinity(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a backend that ended meanwhile
            os.sched_setaffinity(pid, cpus)


@contextlib.asynccontextmanager
async def pinned(store_server: str, ledger_server: str) -> AsyncIterator[None]:
    """The store's server on STORE_CPU (new backends inherit the postmaster's affinity);
    this process and the ledger's server on SWEEPER_CPU; every CPU again after."""
    everything = os.sched_getaffinity(0)
    if not {STORE_CPU, SWEEPER_CPU} <= everything:
        raise RuntimeError(f"--pin needs CPUs {STORE_CPU} and {SWEEPER_CPU}")
    _set_affinity(await server_processes(store_server), {STORE_CPU})
    _set_affinity([*await server_processes(ledger_server), os.getpid()], {SWEEPER_CPU})
    try:
        yield
    finally:
        for server in (store_server, ledger_server):
            _set_affinity(await server_processes(server), everything)
        os.sched_setaffinity(0, everything)


def read_logs(folder: Path) -> list[tuple[float, float]]:
    """pgbench's per-transaction logs: (end time, latency ms) of each transaction."""
    samples = []
    # client_id transaction_no latency_us script_no epoch_s epoch_us [lag_us]
    for log in folder.glob("log*"):
        for line in log.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6:
                samples.append((int(fields[4]) + int(fields[5]) / 1e6, int(fields[2]) / 1000))
    return samples


def latencies(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """p50 and p99 of the transactions' latencies."""
    found = sorted(ms for _, ms in samples)
    if not found:
        return {"transactions": 0, "p50_ms": None, "p99_ms": None}
    return {"transactions": len(found), "p50_ms": round(statistics.median(found), 2),
            "p99_ms": round(found[int(0.99 * (len(found) - 1))], 2)}


def p99_ratio(over: dict[str, Any], under: dict[str, Any]) -> float | None:
    """The ratio of two `latencies` p99s, or None when either window had none."""
    if not over["p99_ms"] or not under["p99_ms"]:
        return None
    return float(over["p99_ms"] / under["p99_ms"])


def rounded(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio, 3)


async def remaining(engine: Any) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(
            "SELECT count(*) FROM items WHERE status = 'pending'"))).scalar_one())


async def delete_beside_shoppers(engine: Any, policies: Policies, store_url: str,
                                 args: argparse.Namespace, active: int, run_id: int
                                 ) -> dict[str, Any]:
    """Publish the registered run, then windows of shoppers alone and beside the drain in
    turn until it is done: the shoppers' figures alone and beside it over all windows of
    each kind, and the median of each pair's p99 ratio."""
    assert await publication.publish(engine, run_id, batch_size=args.batch)
    # the setup's bulk writes flushed first, so that its checkpoint does not land on the
    # first windows
    conn = await asyncpg.connect(plain_url(store_url))
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    alone: list[tuple[float, float]] = []
    beside: list[tuple[float, float]] = []
    # the windows alone in two interleaved halves: their p99 ratio is the measurement's
    # own noise, the floor any ratio beside the cleanup is read against
    halves: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
    pairs: list[float] = []
    windows = 0
    draining = 0.0
    stores = Stores(policies.stores)
    try:
        while await remaining(engine):
            windows += 1
            async with shoppers(store_url, args, active,
                                args.alone_window or args.window) as samples:
                pass
            alone.extend(samples)
            halves[windows % 2].extend(samples)
            pool = database_pool(engine, policies, Upstreams({}), concurrency=args.workers,
                                 stores=stores)
            task = asyncio.create_task(pool.run())
            started = time.perf_counter()
            try:
                async with shoppers(store_url, args, active, args.window) as drained:
                    pass
            finally:
                pool.stop()
                await task
            draining += time.perf_counter() - started
            beside.extend(drained)
            one_alone, one_beside = latencies(samples), latencies(drained)
            ratio = p99_ratio(one_beside, one_alone)
            if ratio is not None:
                pairs.append(ratio)
            progress(f"stores: window pair {windows}: p99 {one_alone['p99_ms']} ms alone, "
                     f"{one_beside['p99_ms']} ms beside; {await remaining(engine):,} left")
    finally:
        await stores.aclose()
    async with engine.connect() as conn:
        counts = dict((await conn.execute(text(
            "SELECT status, count(*) FROM items GROUP BY status"))).all())
    shoppers_alone, shoppers_beside = latencies(alone), latencies(beside)
    return {"items": counts, "cleanup_seconds": round(draining, 2),
            "cleanup_rows_per_second": round(counts.get("succeeded", 0) / draining, 1),
            "window_pairs": windows, "shoppers_alone": shoppers_alone,
            "shoppers_beside_cleanup": shoppers_beside,
            "p99_ratio": rounded(p99_ratio(shoppers_beside, shoppers_alone)),
            "p99_ratio_median_of_pairs": round(statistics.median(pairs), 3) if pairs else None,
            "p99_ratio_alone_halves": rounded(p99_ratio(latencies(halves[1]),
                                                        latencies(halves[0])))}


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("pgbench") is None:
        raise RuntimeError("pgbench is not on PATH (PostgreSQL's client tools)")
    if args.pin and not args.store_server:
        raise RuntimeError("--pin needs --store-server (the store on a server of its own)")
    expired = int(args.rows * args.expired)
    store_server = args.store_server or ctx.server_url
    store_name = f"sweeper_bench_store_{uuid.uuid4().hex[:8]}"
    await admin(store_server, f'CREATE DATABASE "{store_name}"')
    store_url = with_database(store_server, store_name)
    reps: list[dict[str, Any]] = []
    try:
        conn = await asyncpg.connect(plain_url(store_url))
        try:
            progress(f"stores: a carts table of {args.rows:,} rows, {expired:,} expired")
            started = time.perf_counter()
            await create_store(conn, args.rows, expired, args.layout)
            setup_s = time.perf_counter() - started
            policies = policies_for(store_url, args)
            for rep in range(args.repeat):
                if rep and not args.no_deletion:  # the last repetition deleted them
                    await put_back_expired(conn, expired, args.layout)
                    await conn.execute("VACUUM (ANALYZE) carts")
                async with fresh_database(ctx.server_url, "stores") as db:
                    progress(f"stores: repetition {rep + 1}/{args.repeat}: report-only walk")
                    dry = await discover(db.engine, policies, dry_run=True)
                    progress(f"stores: repetition {rep + 1}/{args.repeat}: registering walk")
                    real = await discover(db.engine, policies, dry_run=False)
                    deletion: dict[str, Any] = {}
                    if not args.no_deletion:
                        progress(f"stores: repetition {rep + 1}/{args.repeat}: deleting "
                                 f"{expired:,} rows beside shoppers")
                        async with pinned(store_server, ctx.server_url) if args.pin \
                                else contextlib.nullcontext():
                            deletion = await delete_beside_shoppers(
                                db.engine, policies, store_url, args, args.rows - expired,
                                real["run_id"])
                    real.pop("run_id")
                dry.pop("run_id")
                reps.append({"report_only": dry, "registering": real, "deletion": deletion,
                             "load_average_1m_at_start": os.getloadavg()[0]})
        finally:
            await conn.close()
    finally:
        await admin(store_server, f'DROP DATABASE IF EXISTS "{store_name}" WITH (FORCE)')

    def figure(part: str, key: str) -> dict[str, float | None]:
        return summarize([r[part][key] for r in reps if r[part].get(key) is not None])

    def shopper(which: str, key: str) -> dict[str, float | None]:
        return summarize([r["deletion"][which][key] for r in reps
                          if r["deletion"].get(which, {}).get(key) is not None])

    return {
        "parameters": {k: v for k, v in vars(args).items()
                       if k in ("rows", "expired", "page", "batch", "rows_per_second",
                                "workers", "shopper_rate", "shopper_clients", "window",
                                "alone_window", "layout", "no_deletion",
                                "pin", "repeat")},
        "store_server": "the ledger's" if not args.store_server else "separate",
        "setup_seconds": round(setup_s, 1),
        "repetitions": reps,
        "medians": {
            "report_only_candidate_rows_per_second": figure("report_only",
                                                            "candidate_rows_per_second"),
            "registering_candidate_rows_per_second": figure("registering",
                                                            "candidate_rows_per_second"),
            "longest_store_transaction_s": summarize(
                [max(r["report_only"]["longest_store_transaction_s"],
                     r["registering"]["longest_store_transaction_s"]) for r in reps]),
            "longest_ledger_transaction_s": summarize(
                [max(r["report_only"]["longest_ledger_transaction_s"],
                     r["registering"]["longest_ledger_transaction_s"]) for r in reps]),
            "cleanup_rows_per_second": figure("deletion", "cleanup_rows_per_second"),
            "shopper_p99_alone_ms": shopper("shoppers_alone", "p99_ms"),
            "shopper_p99_beside_cleanup_ms": shopper("shoppers_beside_cleanup", "p99_ms"),
            "shopper_p99_ratio": figure("deletion", "p99_ratio"),
            "shopper_p99_ratio_median_of_window_pairs": figure(
                "deletion", "p99_ratio_median_of_pairs"),
            "shopper_p99_ratio_alone_halves": figure("deletion", "p99_ratio_alone_halves"),
        },
    }


BENCHMARK = Benchmark("stores", "the store's database as source and target: discovery "
                      "rows/s over a large table, deletion beside a shopper workload",
                      add_arguments, run)


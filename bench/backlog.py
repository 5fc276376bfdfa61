"""Backlog: does one long drain keep its pace from the first item to the last?

The drain benchmark drains 20,000 items; a real backlog is a million. Every completion moves
an item out of the claim index (`items_ready`: pending, leased or not), but its old index
entry stays until VACUUM removes it, at the index's front. A claim that read from the front
walked every entry left there by the items already drained, so it read more index pages the
further a drain had gone since the table's last VACUUM, and the drain slowed down (0.43 of
its first tenth's pace by the last tenth). Claims now read after their scope's claim
position and from the front once a second (migration 0008); this benchmark is how that was
measured, and guards it.

Each repetition: a fresh database, `--items` items over four tenants registered and
published as the drain benchmark does (then VACUUM (ANALYZE)), and one WorkerPool with
`--concurrency` workers against the in-process no-op upstream draining all of them.
Every `--sample-seconds` it records the items completed, the index pages each scan of
`items_ready` read since the last sample (pg_statio), and how often
`items` was vacuumed. Autovacuum runs or not as the server is configured (reported).

Reported per repetition: throughput over the first and the last tenth of the items and
their ratio, the claim index's pages per scan at the end, and that every item succeeded.
Throughput on a shared machine moves with its neighbours, so each tenth is also priced
per item on both sides: the database's statement time (pg_stat_database.active_time, all
its sessions) and this process's CPU time (the worker pool). A cost that grows with the
drain shows there, whichever side it is on.

    python -m bench backlog --items 1000000 --repeat 3

Target: the last tenth at least 90% of the first tenth's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common import (
    BenchContext,
    Benchmark,
    configure_service_logging,
    fresh_database,
    progress,
    summarize,
)
from bench.drain import (
    MOCK_BASE_URL,
    POLICY,
    InProcessUpstream,
    bench_policies,
    no_op_answer,
    seed,
    status_counts,
)
from service.upstreams.deletion_api import Upstreams
from service.worker import WorkerPool, database_pool

TARGET_RATIO = 0.9
TENTH = 0.1

_CLAIM_INDEXES = ("items_ready",)
# Index pages read and scans of the claim indexes so far, and the table's vacuums.
_INDEX_STATS = text("""
    SELECT s.indexrelname AS name, s.idx_scan AS scans,
           io.idx_blks_hit + io.idx_blks_read AS pages,
           (SELECT coalesce(t.vacuum_count, 0) + coalesce(t.autovacuum_count, 0)
            FROM pg_stat_user_tables t WHERE t.relname = 'items') AS vacuums
    FROM pg_stat_user_indexes s JOIN pg_statio_user_indexes io USING (indexrelid)
    WHERE s.relname = 'items' AND s.indexrelname = ANY(CAST(:indexes AS name[]))
""")
# Milliseconds the database's sessions have spent executing statements (PostgreSQL 14+).
_ACTIVE_TIME = text("SELECT active_time FROM pg_stat_database "
                    "WHERE datname = current_database()")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=1_000_000,
                        help="released items drained in one go (default 1000000)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="worker pool concurrency (default 64)")
    parser.add_argument("--sample-seconds", type=float, default=5.0,
                        help="how often progress and index reads are sampled (default 5)")
    parser.add_argument("--drain-timeout", type=float, default=1800.0,
                        help="give up on one drain after this many seconds (default 1800)")


async def index_reads(engine: AsyncEngine) -> dict[str, Any]:
    """{index: (scans, pages)} of the claim indexes, the table's vacuum count, and the
    database's statement time so far. pg_stat counters reach a new snapshot only after the
    transaction that reads them."""
    async with engine.connect() as conn:
        rows = (await conn.execute(_INDEX_STATS, {"indexes": list(_CLAIM_INDEXES)})).all()
        active = (await conn.execute(_ACTIVE_TIME)).scalar_one()
    return {"indexes": {r.name: (int(r.scans), int(r.pages)) for r in rows},
            "vacuums": int(rows[0].vacuums) if rows else 0,
            "db_active_ms": float(active or 0.0)}


def pages_per_scan(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in _CLAIM_INDEXES:
        scans0, pages0 = before["indexes"].get(name, (0, 0))
        scans1, pages1 = after["indexes"].get(name, (0, 0))
        out[name] = round((pages1 - pages0) / (scans1 - scans0), 1) if scans1 > scans0 else None
    return out


def last_reading(samples: list[dict[str, Any]], index: str) -> float | None:
    """An index's latest pages per scan (the final sample may have seen no scan)."""
    readings = [s["pages_per_scan"].get(index) for s in samples]
    return next((r for r in reversed(readings) if r is not None), None)


def reading_at(samples: list[dict[str, Any]], completed: float, key: str = "seconds"
               ) -> float:
    """A cumulative reading (`key`: the time by default) when the drain reached `completed`
    items, interpolated between samples."""
    previous = samples[0]
    for sample in samples[1:]:
        if sample["completed"] >= completed:
            span = sample["completed"] - previous["completed"]
            share = (completed - previous["completed"]) / span if span else 1.0
            return float(previous[key] + share * (sample[key] - previous[key]))
        previous = sample
    return float(samples[-1][key])


def tenth_spans(samples: list[dict[str, Any]], items: int, key: str) -> tuple[float, float]:
    """How much a cumulative reading grew over the first and over the last tenth."""
    n = TENTH * items
    return (reading_at(samples, n, key) - samples[0][key],
            reading_at(samples, items, key) - reading_at(samples, items - n, key))


def tenths(samples: list[dict[str, Any]], items: int) -> dict[str, float | None]:
    """Throughput over the first and the last tenth of the items, and their ratio."""
    first_s, last_s = tenth_spans(samples, items, "seconds")
    first = TENTH * items / first_s if first_s > 0 else None
    last = TENTH * items / last_s if last_s > 0 else None
    return {"first_tenth_items_per_s": round(first, 1) if first else None,
            "last_tenth_items_per_s": round(last, 1) if last else None,
            "last_to_first": round(last / first, 3) if first and last else None}


# Cumulative readings of each sample, priced per item over a tenth: (key, unit per item).
_COSTS = {"db_ms_per_item": ("db_active_ms", 1.0),
          "worker_cpu_us_per_item": ("worker_cpu_s", 1e6)}


def tenth_costs(samples: list[dict[str, Any]], items: int) -> dict[str, dict[str, Any]]:
    """What an item cost over the first and the last tenth, on each side, and the ratio
    (last / first: above 1 is a cost that grew with the drain)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (key, unit) in _COSTS.items():
        first, last = (span * unit / (TENTH * items)
                       for span in tenth_spans(samples, items, key))
        out[name] = {"first_tenth": round(first, 4), "last_tenth": round(last, 4),
                     "last_to_first": round(last / first, 3) if first > 0 else None}
    return out


async def drain_sampled(engine: AsyncEngine, pool: WorkerPool, items: int,
                        args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the pool until every item completed, sampling as it goes."""
    reads = await index_reads(engine)
    started = time.perf_counter()
    samples: list[dict[str, Any]] = [{"seconds": 0.0, "completed": 0, "items_per_s": None,
                                      "pages_per_scan": {}, "vacuums": reads["vacuums"],
                                      "db_active_ms": reads["db_active_ms"],
                                      "worker_cpu_s": time.process_time()}]
    task = asyncio.create_task(pool.run())
    try:
        while True:
            deadline = time.perf_counter() + args.sample_seconds
            while pool.completed < items and time.perf_counter() < deadline:
                if task.done():
                    task.result()
                    raise RuntimeError("the worker pool stopped early")
                await asyncio.sleep(0.005)
            now = time.perf_counter() - started
            done = min(pool.completed, items)
            latest = await index_reads(engine)
            previous = samples[-1]
            samples.append({
                "seconds": round(now, 3), "completed": done,
                "items_per_s": round((done - previous["completed"])
                                     / max(1e-9, now - previous["seconds"]), 1),
                "pages_per_scan": pages_per_scan(reads, latest),
                "vacuums": latest["vacuums"], "db_active_ms": latest["db_active_ms"],
                "worker_cpu_s": time.process_time()})
            reads = latest
            if done >= items:
                return samples
            if now > args.drain_timeout:
                raise TimeoutError(f"drain timed out after {now:.0f}s ({done}/{items})")
            if len(samples) % 6 == 0:
                progress(f"backlog: {done:,}/{items:,} after {now:.0f}s, "
                         f"{samples[-1]['items_per_s']:.0f} items/s, claim index "
                         f"{samples[-1]['pages_per_scan'].get('items_ready')} pages/scan")
    finally:
        pool.stop()
        await asyncio.wait_for(task, 60)


async def one_run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    async with fresh_database(ctx.server_url, "backlog") as db:
        policies = bench_policies(MOCK_BASE_URL, max(100, args.concurrency))
        seeding = await seed(db.engine, policies.policies[POLICY], args.items)
        async with db.engine.connect() as conn:
            autovacuum = (await conn.execute(text("SHOW autovacuum"))).scalar_one()
        upstreams = Upstreams(policies.upstreams,
                              transport=InProcessUpstream(no_op_answer))
        pool = database_pool(db.engine, policies, upstreams, concurrency=args.concurrency,
                          name="bench-backlog", rng=random.Random(7))
        try:
            samples = await drain_sampled(db.engine, pool, args.items, args)
        finally:
            await upstreams.aclose()
        statuses = await status_counts(db.engine)
    if statuses != {"succeeded": args.items}:
        raise RuntimeError(f"the drain left {statuses}")
    elapsed = samples[-1]["seconds"]
    final = {name: last_reading(samples, name) for name in _CLAIM_INDEXES}
    return {"items": args.items, "seconds": elapsed,
            "items_per_s": round(args.items / elapsed, 1) if elapsed else None,
            **tenths(samples, args.items), **tenth_costs(samples, args.items),
            "claim_index_pages_per_scan_at_end": final.get("items_ready"),
            "vacuums_during_drain": samples[-1]["vacuums"] - samples[0]["vacuums"],
            "server_autovacuum": autovacuum, "db_status": statuses,
            "setup": seeding, "samples": samples}


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    configure_service_logging("WARNING")
    runs = []
    for rep in range(args.repeat):
        progress(f"backlog: {args.items:,} items, repetition {rep + 1}/{args.repeat}")
        result = await one_run(ctx, args)
        progress(f"backlog: {result['items_per_s']:.0f} items/s overall; first tenth "
                 f"{result['first_tenth_items_per_s']}/s, last tenth "
                 f"{result['last_tenth_items_per_s']}/s (ratio {result['last_to_first']}); "
                 f"per item, last / first tenth: database "
                 f"{result['db_ms_per_item']['last_to_first']}, worker CPU "
                 f"{result['worker_cpu_us_per_item']['last_to_first']}; "
                 f"claim index {result['claim_index_pages_per_scan_at_end']} pages/scan "
                 f"at the end, {result['vacuums_during_drain']} vacuum(s)")
        runs.append(result)
    ratio = summarize([r["last_to_first"] for r in runs if r["last_to_first"] is not None])
    return {
        "parameters": {"items": args.items, "concurrency": args.concurrency,
                       "sample_seconds": args.sample_seconds, "repeat": args.repeat,
                       "upstream": "in-process no-op (the drain benchmark's mock mode)"},
        "runs": runs,
        "items_per_s": summarize([r["items_per_s"] for r in runs]),
        "last_to_first": ratio,
        "cost_last_to_first": {
            name: summarize([r[name]["last_to_first"] for r in runs
                             if r[name]["last_to_first"] is not None]) for name in _COSTS},
        "target": {"last_to_first_min": TARGET_RATIO,
                   "met": ratio["median"] is not None and ratio["median"] >= TARGET_RATIO},
    }


BENCHMARK = Benchmark(
    name="backlog",
    help="one long drain: throughput of its first vs last tenth, claim index reads",
    add_arguments=add_arguments,
    run=run,
)

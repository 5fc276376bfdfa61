"""Publication at scale: `POST /v1/runs` over a large backlog of due items.

The items are seeded in SQL (one INSERT ... SELECT over generate_series, the fastest way to
get a million rows in), then one run is triggered over HTTP against a `sweeper serve`
process (API only, so released items stay put). Reported per repetition: the trigger's
answer time (target < 1 s whatever the backlog), the time until the run is `published`
(target < 30 s for 1,000,000 items on 2 cores), and the distribution of the publication's
transactions, read from its batches' creation times (a chunk is one transaction that creates
one or more batches, all stamped with the transaction's now(): the gap between consecutive
stamps is one chunk's duration plus the publisher's turn-around).

    python -m bench publication --items 1000000 --batch-size 500 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import Any

import asyncpg
import httpx

from bench.common import (
    BenchContext,
    Benchmark,
    fresh_database,
    plain_url,
    progress,
    summarize,
    vacuum_analyze,
)
from bench.server import sweeper_server

SEED_SQL = """
    INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, scope,
                       due_at)
    SELECT 'tenant-' || (g % 50), 'cart-' || g, 'carts', 1,
           encode(sha256(('bench:' || g)::bytea), 'hex'), 'tenant:tenant-' || (g % 50),
           now() - interval '2 days' + (g % 86400) * interval '1 second'
    FROM generate_series(1, $1) g
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=1_000_000,
                        help="due items in the backlog (default 1000000)")
    parser.add_argument("--batch-size", type=int, default=500,
                        help="SWEEPER_BATCH_SIZE of the server (default 500, the default)")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_run(ctx: BenchContext, items: int, batch_size: int) -> dict[str, Any]:
    async with fresh_database(ctx.server_url, "publication") as db:
        seed_started = time.perf_counter()
        conn = await asyncpg.connect(plain_url(db.url))
        try:
            await conn.execute(SEED_SQL, items)
        finally:
            await conn.close()
        await vacuum_analyze(db.engine, "items")
        seed_s = time.perf_counter() - seed_started
        async with (sweeper_server(db.url, batch_size=batch_size) as server,
                    httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                      timeout=60) as client):
            started = time.perf_counter()
            response = await client.post("/v1/runs", json={})
            answer_s = time.perf_counter() - started
            if response.status_code != 202:
                raise RuntimeError(f"POST /v1/runs answered {response.status_code}")
            run_id = response.json()["id"]
            # poll the run row itself: GET /v1/runs/{id} counts the run's items by status
            # and its attempts by outcome, and ten of those a second over a million
            # released rows took CPU from the publication they were watching (41 s vs 29 s)
            watcher = await asyncpg.connect(plain_url(db.url))
            try:
                while True:
                    state = await watcher.fetchval("SELECT state FROM runs WHERE id = $1",
                                                   run_id)
                    if state == "published":
                        break
                    await asyncio.sleep(0.1)
            finally:
                await watcher.close()
            published_s = time.perf_counter() - started
        conn = await asyncpg.connect(plain_url(db.url))
        try:
            created = [r["created_at"] for r in await conn.fetch(
                "SELECT created_at FROM batches WHERE run_id = $1 ORDER BY seq", run_id)]
            released = await conn.fetchval(
                "SELECT count(*) FROM items WHERE released_at IS NOT NULL")
        finally:
            await conn.close()
    # batches made in one transaction share its now(): distinct values are transactions
    starts = sorted(set(created))
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    return {
        "items": items, "released": released, "batches": len(created),
        "transactions": len(starts),
        "seed_seconds": round(seed_s, 2), "trigger_answer_seconds": round(answer_s, 4),
        "published_seconds": round(published_s, 2),
        "items_per_second": round(released / published_s, 1),
        "transaction_seconds": {
            "p50": round(statistics.median(gaps), 4) if gaps else None,
            "p99": round(quantile(gaps, 0.99), 4) if gaps else None,
            "max": round(max(gaps), 4) if gaps else None},
    }


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    reps = []
    for rep in range(args.repeat):
        progress(f"publication: {args.items} items, repetition {rep + 1}/{args.repeat}")
        reps.append(await one_run(ctx, args.items, args.batch_size))
        progress(f"publication: answered in {reps[-1]['trigger_answer_seconds']} s, "
                 f"published in {reps[-1]['published_seconds']} s")
    return {"items": args.items, "batch_size": args.batch_size, "runs": reps,
            "trigger_answer_seconds": summarize([r["trigger_answer_seconds"] for r in reps]),
            "published_seconds": summarize([r["published_seconds"] for r in reps]),
            "max_transaction_seconds": summarize(
                [r["transaction_seconds"]["max"] or 0 for r in reps]),
            "targets": {"trigger_answer_seconds": 1.0, "published_seconds": 30.0,
                        "max_transaction_seconds": 1.0}}


BENCHMARK = Benchmark("publication", "POST /v1/runs over a large due backlog",
                      add_arguments, run)

"""Claim cost against history, and pruning while claims run.

The claim path must not care how much finished history the ledger holds: its statements
walk partial indexes over claimable rows only. For each `--history` size H (ascending):

1. a fresh database gets H finished items (98% succeeded, 2% dead, spread over the drain's
   tenants and scopes, completed `--history-age-days` ago) and one attempt row each,
   written by INSERT ... SELECT in chunks, then VACUUM (ANALYZE);
2. each repetition registers and publishes `--items` live items, drains them with one
   WorkerPool against the in-process no-op upstream (the drain benchmark's mock mode), then
   deletes them again, so every repetition sees exactly H finished rows;
3. EXPLAIN (ANALYZE, BUFFERS) of the worker's admission statement with the live items
   released (rolled back), and whether it kept to the claimable-row indexes.

Then, on the largest history (unless `--no-prune`): retention prunes the whole history
(older than 30 days) in batches of `--prune-batch` while drains keep running back to back;
reported are the drains' throughput during pruning and the pruning rate.

    python -m bench history --history 10000,10000000 --items 20000 --repeat 3

Targets: drain throughput with the largest history at least 90% of the smallest; drains
during pruning at least 90% of the same history without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common import (
    BenchContext,
    Benchmark,
    configure_service_logging,
    fresh_database,
    int_list,
    progress,
    summarize,
    vacuum_analyze,
)
from bench.drain import (
    MOCK_BASE_URL,
    POLICY,
    TENANTS,
    InProcessUpstream,
    bench_policies,
    drain,
    no_op_answer,
    seed,
)
from service.budget.rules import LOOKAHEAD_S
from service.cluster import retention
from service.ledger import claims
from service.upstreams.deletion_api import Upstreams

SEED_CHUNK = 1_000_000
TARGET_RATIO = 0.9
RETENTION_DAYS = 30

# Finished history as a busy ledger accumulates it: rows :lo..:hi of it, in the drain's
# tenants and scopes (the claim statements must skip them there, not elsewhere).
_SEED_ITEMS = text("""
    INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, scope,
                       status, due_at, next_attempt_at, attempts, released_at, last_outcome,
                       last_status_code, dead_reason, completed_at, created_at, updated_at)
    SELECT t.tenant, 'hist-' || g, :policy, 1, encode(sha256(('hist-' || g)::bytea), 'hex'),
           'tenant:' || t.tenant,
           CASE WHEN g % 50 = 0 THEN 'dead' ELSE 'succeeded' END,
           d.done - interval '1 hour', d.done - interval '1 minute', 1,
           d.done - interval '30 minutes',
           CASE WHEN g % 50 = 0 THEN 'permanent' ELSE 'succeeded' END,
           CASE WHEN g % 50 = 0 THEN 410 ELSE 204 END,
           CASE WHEN g % 50 = 0 THEN 'permanent:410' END,
           d.done, d.done - interval '1 hour', d.done
    FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g
    CROSS JOIN LATERAL (SELECT (CAST(:tenants AS text[]))[1 + g % :n_tenants] AS tenant) t
    CROSS JOIN LATERAL (
        SELECT now() - make_interval(days => :age_days) + g * interval '1 millisecond' AS done
    ) d
""")

# One attempt per history item (what the completion wrote), by id range.
_SEED_ATTEMPTS = text("""
    INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at, finished_at,
                          outcome, http_status, latency_ms)
    SELECT id, 1, 'history', gen_random_uuid(), completed_at - interval '5 milliseconds',
           completed_at, last_outcome, last_status_code, 5.0
    FROM items WHERE id >= :first AND object_id LIKE 'hist-%'
""")

_SIZES = text("""
    SELECT c.relname, pg_relation_size(c.oid) AS bytes
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'i')
      AND (c.relname LIKE 'items%' OR c.relname LIKE 'attempts%')
    ORDER BY c.relname
""")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--history", type=int_list, default="10000,10000000",
                        help="finished rows in the ledger, comma-separated "
                             "(default 10000,10000000)")
    parser.add_argument("--items", type=int, default=20_000,
                        help="live items drained per repetition (default 20000)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="worker pool concurrency (default 64)")
    parser.add_argument("--history-age-days", type=int, default=60,
                        help="how long ago the history finished (default 60: all prunable)")
    parser.add_argument("--no-prune", dest="prune", action="store_false",
                        help="skip pruning the largest history while drains run")
    parser.add_argument("--prune-batch", type=int, default=5_000,
                        help="rows per pruning transaction (default 5000)")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="give up on one drain after this many seconds (default 300)")


async def seed_history(engine: AsyncEngine, rows: int, age_days: int) -> dict[str, Any]:
    """`rows` finished items with one attempt each, in transactions of SEED_CHUNK rows."""
    started = time.perf_counter()
    for lo in range(1, rows + 1, SEED_CHUNK):
        hi = min(rows, lo + SEED_CHUNK - 1)
        async with engine.begin() as conn:
            first = (await conn.execute(text("SELECT coalesce(max(id), 0) + 1 FROM items"))
                     ).scalar_one()
            await conn.execute(_SEED_ITEMS, {"lo": lo, "hi": hi, "policy": POLICY,
                                             "tenants": list(TENANTS),
                                             "n_tenants": len(TENANTS),
                                             "age_days": age_days})
            await conn.execute(_SEED_ATTEMPTS, {"first": first})
        if rows > SEED_CHUNK:
            progress(f"history: seeded {hi:,} of {rows:,} finished rows")
    inserted = time.perf_counter()
    await vacuum_analyze(engine, "items")
    await vacuum_analyze(engine, "attempts")
    return {"rows": rows, "insert_seconds": round(inserted - started, 1),
            "vacuum_analyze_seconds": round(time.perf_counter() - inserted, 1),
            "relation_bytes": await relation_sizes(engine)}


async def relation_sizes(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {str(r.relname): int(r.bytes) for r in await conn.execute(_SIZES)}


async def forget_live_items(engine: AsyncEngine) -> None:
    """Delete the drained live items (and their attempts) so the history stays at H: the
    only items finished today, found through the retention index."""
    async with engine.begin() as conn:
        await conn.execute(text(
            "DELETE FROM items WHERE status IN ('succeeded', 'cancelled') "
            "AND completed_at > now() - interval '1 day'"))
    await vacuum_analyze(engine, "items")


async def explain_admission(engine: AsyncEngine, concurrency: int) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the worker's admission statement over every scope with
    released work, executed and rolled back (nothing is claimed)."""
    scopes = [f"tenant:{t}" for t in TENANTS]
    share = max(1, concurrency // len(scopes))
    params = {"names": scopes, "wants": [share] * len(scopes),
              "owner": "explain", "lookahead": LOOKAHEAD_S,
              "policy_names": [POLICY], "lease_seconds": [60], "default_lease": 60,
              "limit_policies": [POLICY], "limit_attempts": [8]}
    async with engine.connect() as conn:
        trans = await conn.begin()
        try:
            rows = await conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) "
                                           + str(claims._ADMIT.text)), params)
            plan = [str(r[0]) for r in rows]
        finally:
            await trans.rollback()
    joined = "\n".join(plan)
    return {"plan": plan,
            "uses_claimable_indexes": ("items_ready" in joined
                                       and "Seq Scan on items" not in joined),
            "execution_ms": next((float(line.split(":")[1].split()[0]) for line in plan
                                  if line.startswith("Execution Time")), None)}


async def one_drain(engine: AsyncEngine, items: int, concurrency: int, deadline_s: float
                    ) -> dict[str, Any]:
    policies = bench_policies(MOCK_BASE_URL, max(100, concurrency))
    await seed(engine, policies.policies[POLICY], items)
    upstreams = Upstreams(policies.upstreams, transport=InProcessUpstream(no_op_answer))
    try:
        result = await drain(engine, policies, upstreams, target=items,
                             concurrency=concurrency, deadline_s=deadline_s)
    finally:
        await upstreams.aclose()
    await forget_live_items(engine)
    return {k: result[k] for k in ("items_per_s", "seconds", "cpu_us_per_item",
                                   "load_average_1m_at_start")} | {
        "admission_wall_ms_mean": result["claim"].get("wall_ms_mean")}


async def prune_while_draining(engine: AsyncEngine, args: argparse.Namespace, rows: int
                               ) -> dict[str, Any]:
    """Prune the whole history while drains run back to back; both rates."""
    started = time.perf_counter()
    pruner = asyncio.create_task(retention.prune(
        engine, keep_seconds=RETENTION_DAYS * 86_400.0, batch_size=args.prune_batch,
        evidence_keep_seconds=0))
    drains: list[dict[str, Any]] = []
    try:
        while not pruner.done():
            drains.append(await one_drain(engine, args.items, args.concurrency,
                                          args.drain_timeout))
            left = await remaining_history(engine)
            progress(f"history: drain during pruning {drains[-1]['items_per_s']:.0f} items/s,"
                     f" {rows - left:,} of {rows:,} pruned")
        pruned = await pruner
    finally:
        if not pruner.done():
            pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pruner
    seconds = time.perf_counter() - started
    return {"rows": rows, "pruned_items": pruned.items, "seconds": round(seconds, 1),
            "rows_per_second": round(pruned.items / seconds, 1),
            "batch_size": args.prune_batch, "drains_during_pruning": drains,
            "items_per_s": summarize([d["items_per_s"] for d in drains]),
            "left_after": await remaining_history(engine)}


async def remaining_history(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(
            "SELECT count(*) FROM items WHERE status = 'succeeded' "
            "AND completed_at < now() - make_interval(days => :days)"),
            {"days": RETENTION_DAYS})).scalar_one())


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    configure_service_logging("WARNING")
    sizes = sorted(set(args.history))
    results: list[dict[str, Any]] = []
    pruning: dict[str, Any] | None = None
    for rows in sizes:
        async with fresh_database(ctx.server_url, "history") as db:
            progress(f"history: seeding {rows:,} finished rows")
            seeding = await seed_history(db.engine, rows, args.history_age_days)
            reps = []
            for rep in range(args.repeat):
                reps.append(await one_drain(db.engine, args.items, args.concurrency,
                                            args.drain_timeout))
                progress(f"history: {rows:,} finished rows, repetition {rep + 1}/"
                         f"{args.repeat}: {reps[-1]['items_per_s']:.0f} items/s")
            policies = bench_policies(MOCK_BASE_URL, max(100, args.concurrency))
            await seed(db.engine, policies.policies[POLICY], args.items)
            explain = await explain_admission(db.engine, args.concurrency)
            await forget_live_items(db.engine)
            results.append({"history_rows": rows, "seeding": seeding, "runs": reps,
                            "items_per_s": summarize([r["items_per_s"] for r in reps]),
                            "admission_explain": explain})
            if args.prune and rows == sizes[-1]:
                pruning = await prune_while_draining(db.engine, args, rows)
                pruning["ratio_to_no_pruning"] = ratio(
                    pruning["items_per_s"]["median"], results[-1]["items_per_s"]["median"])
    doc: dict[str, Any] = {
        "parameters": {"items": args.items, "concurrency": args.concurrency,
                       "repeat": args.repeat, "prune_batch": args.prune_batch},
        "configurations": results, "pruning": pruning,
        "ratio_largest_to_smallest": ratio(results[-1]["items_per_s"]["median"],
                                           results[0]["items_per_s"]["median"]),
        "targets": {"ratio_largest_to_smallest_min": TARGET_RATIO,
                    "pruning_ratio_min": TARGET_RATIO}}
    progress(f"history: {sizes[-1]:,} vs {sizes[0]:,} finished rows: ratio "
             f"{doc['ratio_largest_to_smallest']}"
             + (f"; during pruning {pruning['ratio_to_no_pruning']}, pruned "
                f"{pruning['rows_per_second']:.0f} rows/s" if pruning else ""))
    return doc


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


BENCHMARK = Benchmark("history", "claim cost against finished history, and pruning",
                      add_arguments, run)

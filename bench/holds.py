"""``python -m bench holds``: what many object-id holds on one tenant cost the statements
that check holds item by item: registration (which marks a new item with its covering hold),
the scopes view and the metrics' ledger reading (which count the items a claim could take,
under no hold), and a claim round.

    python -m bench holds --holds 300 --ids 1000 --items 10000 --repeat 3

Each repetition: a fresh database; `--holds` holds of `--ids` object ids each on tenant
`acme` (none of them the ids registered, so every check must look and find nothing), then
`--items` items of `acme` registered in requests of at most 10,000, released by a run; then
the scopes view, the metrics' ledger reading and one admission are timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from bench.common import BenchContext, Benchmark, fresh_database, progress
from service.budget import scope_controls
from service.config.policies import Policies, resolve_policies
from service.db.engine import is_busy
from service.ledger import gauges, holds, registration
from service.runs import publication, trigger

TENANT = "acme"
PAST = datetime(2026, 1, 1, tzinfo=UTC)
REQUEST_ITEMS = 10_000  # the API's bound on one registration request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--holds", type=int, default=300, help="active holds on the tenant")
    parser.add_argument("--ids", type=int, default=1000, help="object ids per hold (max 1000)")
    parser.add_argument("--items", type=int, default=10_000, help="items of the tenant")


def bench_policies() -> Policies:
    return resolve_policies({
        "upstreams": {"shop": {"base_url": "http://127.0.0.1:9"}},
        "policies": {"carts": {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                               "scope": "tenant:{tenant_id}",
                               "rate": {"per_second": 1000, "burst": 1000}}}},
        {}, source="<bench>")


async def timed(step: Awaitable[object]) -> float | None:
    """Seconds `step` took, or None when the database gave up on it (a statement timeout:
    the API answers 503 then, the metrics read their figures as unavailable)."""
    started = time.perf_counter()
    try:
        await step
    except DBAPIError as exc:
        if not is_busy(exc):
            raise
        progress(f"holds: gave up after {time.perf_counter() - started:.1f} s ({exc.orig})")
        return None
    return time.perf_counter() - started


async def once(ctx: BenchContext, args: argparse.Namespace) -> dict[str, float | None]:
    policies = bench_policies()
    policy = policies.policies["carts"]
    async with fresh_database(ctx.server_url, "holds") as db:
        for n in range(args.holds):
            await holds.place(db.engine, holds.HoldSpec(
                tenant_id=TENANT, object_ids=[f"held-{n}-{i}" for i in range(args.ids)],
                reason="bench", reference=f"CASE-{n}"), actor="bench")
        async def register() -> None:
            for first in range(0, args.items, REQUEST_ITEMS):
                count = min(REQUEST_ITEMS, args.items - first)
                await registration.register(db.engine, registration.Obligations(
                    [TENANT] * count, [f"cart-{first + i}" for i in range(count)],
                    ["carts"] * count, [PAST] * count, {"carts": policy}))

        registered = await timed(register())
        run_id, _ = await trigger.create_run(db.engine, trigger.RunRequest(None, None,
                                                                           None, False,
                                                                           None), None)
        while not await publication.publish(db.engine, run_id, batch_size=1000):
            pass
        async with db.engine.begin() as conn:
            await conn.execute(text("ANALYZE"))
        scopes_view = await timed(scope_controls.list_scopes(db.engine, after=None, limit=100))
        ledger_reading = await timed(gauges.read_ledger(db.engine))
    return {"register_s": registered, "scopes_view_s": scopes_view,
            "metrics_ledger_s": ledger_reading}


def median(values: list[float | None]) -> float | None:
    """The median in seconds, or None when any repetition gave up."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if len(known) == len(values) else None


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for n in range(args.repeat):
        progress(f"holds: repetition {n + 1}/{args.repeat}")
        results.append(await once(ctx, args))
    return {"holds": args.holds, "ids_per_hold": args.ids, "items": args.items,
            "repetitions": results,
            "median": {key: median([r[key] for r in results]) for key in results[0]}}


BENCHMARK = Benchmark("holds", "many object-id holds on one tenant: registration, the "
                      "scopes view and the metrics' reading", add_arguments, run)

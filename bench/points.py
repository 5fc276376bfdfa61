"""A budget in cost points: N replicas against the Shopify fake's leaky bucket.

The policy is policies.example.toml's Shopify block as written (its base URL pointed at the
fake on loopback, one shop at 127.0.0.2): 100 points/s, burst 1,000, customerDelete
requesting 10 points, the actual cost refunded and the shop's currentlyAvailable lowering
the shared bucket. The fake (drills/vendors/shopify.py, in a thread of this process)
restores `--restore` points a second into a bucket of 2,000 and charges `--actual` points a
deletion. N `sweeper worker` processes share the scope's bucket in PostgreSQL; items are
released once all are connected. From the fake's own record, over `--seconds` after the
first second of calls:

  points_percent          points spent per second / the restore rate (target >= 98)
  throttled_after_first   THROTTLED answers after the first second (target 0)
  calls_per_second        deletions a second (restore / actual cost, when refunds work)

    python -m bench points --replicas 3 --seconds 60 --actual 10,4 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.budget import release_everything, worker_processes
from bench.common import BenchContext, Benchmark, fresh_database, int_list, progress, summarize
from drills.vendors import example_block
from drills.vendors.serve import serve_in_thread
from drills.vendors.shopify import FakeShopify
from service.config.policies import load_policies
from service.ledger import registration

SHOP = "127.0.0.2"
TOKEN = "shpat_bench"  # noqa: S105 - the fake shop's token, on loopback
BUCKET = 2000.0
REGISTER_CHUNK = 10_000


def shopify_policies(example: Path, port: int, secrets_dir: Path) -> str:
    """The example file's Shopify block, uncommented, on loopback."""
    toml = example_block(example, "shopify").replace('"https://{tenant_id}/admin/api/2025-10"',
                        f'"http://{{tenant_id}}:{port}/admin/api/2025-10"')
    toml = toml.replace("'[a-z0-9][a-z0-9-]*\\.myshopify\\.com'",
                        "'127\\.0\\.0\\.[0-9]+'\nallow_private_addresses = true")
    return toml.replace('"/var/run/secrets/shopify"', f'"{secrets_dir}"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="measured period after the first second (default 60)")
    parser.add_argument("--restore", type=float, default=100.0,
                        help="the shop's restore rate, points/s (default 100)")
    parser.add_argument("--actual", type=int_list, default="10,4",
                        help="comma-separated actual costs of a deletion (default 10,4)")
    parser.add_argument("--workers", type=int, default=8,
                        help="concurrent calls per process (default 8)")


async def one_run(ctx: BenchContext, args: argparse.Namespace, actual: int) -> dict[str, Any]:
    fake = FakeShopify(maximum_available=BUCKET, restore_rate=args.restore,
                       actual_cost=actual, record_calls=False)
    fake.add_shop(SHOP, TOKEN)
    calls = math.ceil(args.restore / actual * (args.seconds + 10) * 1.3) + 200
    fake.add_customers(SHOP, range(1, calls + 1))
    with (serve_in_thread(fake, hosts=(SHOP,)) as port,
          tempfile.TemporaryDirectory(prefix="sweeper-bench-points-") as tmp):
        secrets_dir = Path(tmp) / "secrets"
        secrets_dir.mkdir()
        (secrets_dir / SHOP).write_text(TOKEN)
        policies_file = Path(tmp) / "policies.toml"
        policies_file.write_text(shopify_policies(ctx.repo_root / "policies.example.toml",
                                                  port, secrets_dir))
        policy = load_policies(policies_file).policies["shopify-customer-redact"]
        async with fresh_database(ctx.server_url, "points") as db:
            due = datetime.now(UTC) - timedelta(days=1)
            for start in range(1, calls + 1, REGISTER_CHUNK):
                await registration.register(db.engine, [
                    registration.Registration(SHOP, str(i), policy, due)
                    for i in range(start, min(calls + 1, start + REGISTER_CHUNK))])
            async with worker_processes(db.url, policies_file, args.workers, args.replicas):
                await release_everything(db.engine)
                await asyncio.sleep(args.seconds + 3.0)
        spent = list(fake.spent)
        throttled = list(fake.throttled_at)
    if not spent:
        raise RuntimeError("the fake saw no deletion")
    t0 = min([s.at for s in spent] + throttled)
    begin, end = t0 + 1.0, t0 + 1.0 + args.seconds
    points = sum(s.points for s in spent if begin <= s.at < end)
    deletions = sum(1 for s in spent if begin <= s.at < end)
    return {"actual_cost": actual, "replicas": args.replicas, "seconds": args.seconds,
            "points_per_second": round(points / args.seconds, 2),
            "points_percent": round(100 * points / args.seconds / args.restore, 2),
            "calls_per_second": round(deletions / args.seconds, 2),
            "throttled": len(throttled),
            "throttled_after_first": sum(1 for t in throttled if t >= begin)}


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for actual in args.actual:
        reps = []
        for rep in range(args.repeat):
            progress(f"points: actual cost {actual}, {args.replicas} replicas, "
                     f"repetition {rep + 1}/{args.repeat}")
            reps.append(await one_run(ctx, args, actual))
            progress(f"points: {reps[-1]['points_percent']}% of the restore rate, "
                     f"{reps[-1]['throttled_after_first']} THROTTLED after the first second")
        results.append({
            "actual_cost": actual, "runs": reps,
            "points_percent": summarize([r["points_percent"] for r in reps]),
            "calls_per_second": summarize([r["calls_per_second"] for r in reps]),
            "throttled_after_first": summarize([r["throttled_after_first"] for r in reps])})
    return {"configurations": results, "restore_rate": args.restore,
            "targets": {"points_percent_min": 98, "throttled_after_first": 0}}


BENCHMARK = Benchmark("points", "a budget in cost points against the Shopify fake",
                      add_arguments, run)

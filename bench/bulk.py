"""Many objects per call against the BigCommerce fake: a store's customers deleted 250 a call.

The policy is policies.example.toml's BigCommerce block as written (250 ids a call in
`id:in`, 5 calls/s with a burst of 5, the store's X-Rate-Limit-* headers read), pointed at
the fake on loopback with the store's token in a credentials directory. The fake
(drills/vendors/bigcommerce.py, in a thread of this process) allows `--quota` calls per
`--window` seconds (Standard plans: 150 per 30 s). N `sweeper worker` processes drain
`--customers` items of one store. Reported per repetition and as medians:

  calls                  delete calls the fake accepted (one-per-call would need one per
                         customer: `calls_ratio` is calls / customers, target <= 1/200)
  drain_seconds          from the first call to the last customer deleted
  allowed_seconds        what the fake's budget allows for those calls as a rate: `quota`
                         calls per `window` (150 per 30 s: 5 a second)
  over_allowed_percent   drain_seconds over allowed_seconds (target <= 5)
  bursting_seconds       the shortest drain the fake's fixed windows allow a client that
                         spends each window's whole quota at its start (the policy's
                         bucket, 5 a second with a burst of 5, does not)
  throttled              429s the fake sent

    python -m bench bulk --customers 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench.budget import release_everything, worker_processes
from bench.common import BenchContext, Benchmark, fresh_database, progress, summarize
from drills.vendors import example_block
from drills.vendors.bigcommerce import FakeBigCommerce
from drills.vendors.serve import serve_in_thread
from service.config.policies import load_policies
from service.ledger import registration

STORE = "abc123"
TOKEN = "bc_bench_token"  # noqa: S105 - the fake store's token, on loopback
REGISTER_CHUNK = 10_000


def bigcommerce_policies(example: Path, port: int, secrets_dir: Path,
                         burst: int | None = None) -> str:
    """The example file's BigCommerce block, uncommented, on loopback, its tokens in a
    directory (the API's store needs a key the worker processes would share); `burst`
    replaces the block's burst of 5."""
    toml = example_block(example, "bigcommerce").replace('"https://api.bigcommerce.com/stores"',
                        f'"http://127.0.0.1:{port}/stores"')
    if burst is not None:
        block_rate = "rate = { per_second = 5, burst = 5 }"
        if block_rate not in toml:
            raise RuntimeError(f"the BigCommerce block no longer says {block_rate!r}")
        toml = toml.replace(block_rate, f"rate = {{ per_second = 5, burst = {burst} }}")
    return toml.replace("credentials = { api = true }",
                        f'credentials = {{ directory = "{secrets_dir}" }}')


def allowed_seconds(calls: int, quota: int, window: float) -> float:
    """The drain the fake's budget allows as a rate: `quota` calls per `window`."""
    return calls * window / quota


def bursting_seconds(calls: int, quota: int, window: float) -> float:
    """The shortest drain the fake's fixed windows allow: `quota` calls at the start of
    each window."""
    return max(0, math.ceil(calls / quota) - 1) * window


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--customers", type=int, default=100_000,
                        help="customers of one store to delete (default 100000)")
    parser.add_argument("--quota", type=int, default=150,
                        help="calls the fake allows per window (default 150)")
    parser.add_argument("--window", type=float, default=30.0,
                        help="the fake's window, seconds (default 30)")
    parser.add_argument("--replicas", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--workers", type=int, default=4,
                        help="concurrent calls per process (default 4)")
    parser.add_argument("--burst", type=int, default=None,
                        help="the policy's burst instead of the example's 5 (150 spends a "
                             "window's whole quota at its start)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="give up a repetition after this many seconds (default 900)")


async def one_run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    fake = FakeBigCommerce(quota=args.quota, window_s=args.window, record_calls=False)
    fake.add_store(STORE, TOKEN)
    fake.add_customers(STORE, range(1, args.customers + 1))
    with (serve_in_thread(fake) as port,
          tempfile.TemporaryDirectory(prefix="sweeper-bench-bulk-") as tmp):
        secrets_dir = Path(tmp) / "secrets"
        secrets_dir.mkdir()
        (secrets_dir / STORE).write_text(TOKEN)
        policies_file = Path(tmp) / "policies.toml"
        policies_file.write_text(bigcommerce_policies(ctx.repo_root / "policies.example.toml",
                                                      port, secrets_dir, args.burst))
        policy = load_policies(policies_file).policies["bigcommerce-customers"]
        async with fresh_database(ctx.server_url, "bulk") as db:
            due = datetime.now(UTC) - timedelta(days=1)
            for start in range(1, args.customers + 1, REGISTER_CHUNK):
                await registration.register(db.engine, [
                    registration.Registration(STORE, str(i), policy, due)
                    for i in range(start, min(args.customers + 1, start + REGISTER_CHUNK))])
            async with worker_processes(db.url, policies_file, args.workers, args.replicas):
                await release_everything(db.engine)
                give_up = time.monotonic() + args.timeout
                # the fake runs in another thread: its state is polled
                while fake.customers(STORE) and time.monotonic() < give_up:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
                finished = time.monotonic()
                await asyncio.sleep(2.0)  # let the last completions commit
                async with db.engine.connect() as conn:
                    statuses: dict[str, int] = dict((await conn.execute(text(
                        "SELECT status, count(*) FROM items GROUP BY status"))).all())
        deletions = list(fake.deletions)
        left = len(fake.customers(STORE))
    if not deletions:
        raise RuntimeError("the fake saw no deletion")
    first = min(d.at for d in deletions)
    last = max(d.at for d in deletions)
    calls = len(deletions)
    drain = (last if not left else finished) - first
    allowed = allowed_seconds(calls, args.quota, args.window)
    return {"customers": args.customers, "left": left, "statuses": statuses,
            "calls": calls, "calls_ratio": round(calls / args.customers, 6),
            "largest_call": max(len(d.requested) for d in deletions),
            "drain_seconds": round(drain, 2), "allowed_seconds": round(allowed, 2),
            "over_allowed_percent": round(100 * (drain - allowed) / allowed, 2)
            if allowed else None,
            "bursting_seconds": bursting_seconds(calls, args.quota, args.window),
            "throttled": len(fake.throttled_at)}


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    reps = []
    for rep in range(args.repeat):
        progress(f"bulk: {args.customers} customers, repetition {rep + 1}/{args.repeat}")
        reps.append(await one_run(ctx, args))
        r = reps[-1]
        progress(f"bulk: {r['calls']} calls, {r['drain_seconds']} s "
                 f"(budget allows {r['allowed_seconds']} s), {r['throttled']} throttled")
    return {"runs": reps, "quota": args.quota, "window_seconds": args.window,
            "calls": summarize([r["calls"] for r in reps]),
            "drain_seconds": summarize([r["drain_seconds"] for r in reps]),
            "over_allowed_percent": summarize([r["over_allowed_percent"] or 0 for r in reps]),
            "targets": {"calls_ratio_max": 1 / 200, "over_allowed_percent_max": 5}}


BENCHMARK = Benchmark("bulk", "many objects per call against the BigCommerce fake",
                      add_arguments, run)

"""Budget precision: how closely N replicas together hold one scope's shared rate budget.

For each (replicas, budget) pair: a fresh database holding more due items than the budget
can drain in the measured period; a fake upstream in its own process that enforces the same
rate (429 above it); N `sweeper worker` OS processes sharing the scope's bucket in
PostgreSQL. Items are released once every process is connected, and the upstream's own
arrival log is read after `--seconds` of calls. Reported per repetition and as medians:

  achieved_percent   calls answered 2xx in the measured period / what the budget allows
                     in it (burst + budget x seconds), from the first call on
  worst_window       most calls in any 1-second window, and the same over (rate + burst)
  throttled          429s the upstream sent (the target is zero)
  startup            seconds from release to the first call

    python -m bench budget --replicas 1,2,4 --budgets 10,100,1000 --seconds 60 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.common import (
    BenchContext,
    Benchmark,
    fresh_database,
    int_list,
    plain_url,
    progress,
    summarize,
)
from bench.drain import fake_upstream_process
from service import ledger, runs
from service.drills.stage import worst_window
from service.policies import load_policies

SCOPE_TENANT = "acme"
REGISTER_CHUNK = 10_000
# The upstream allows a little more burst than Sweeper's bucket holds, as a real API whose
# published limit a client configures would; Sweeper must never need it.
UPSTREAM_EXTRA_BURST = 2

POLICIES = """
[upstreams.shop]
base_url = "{base_url}"
timeout_seconds = 5

[policies.carts]
version = 1
upstream = "shop"
path = "/carts/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = {rate}, burst = {burst} }}
lease_seconds = 30
max_attempts = 5
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int_list, default="1,2,4",
                        help="comma-separated worker process counts (default 1,2,4)")
    parser.add_argument("--budgets", type=int_list, default="10,100,1000",
                        help="comma-separated budgets in calls/s (default 10,100,1000)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="measured period per configuration (default 60)")
    parser.add_argument("--burst-fraction", type=float, default=0.05,
                        help="Sweeper's burst as a fraction of the rate, at least 1 "
                             "(default 0.05)")


def concurrency_for(budget: int, replicas: int) -> int:
    """Workers per process: enough calls in flight for the budget at ~20 ms per call."""
    return max(4, min(256, math.ceil(budget / replicas / 25)))


async def start_worker(url: str, policies_file: Path, workers: int
                       ) -> asyncio.subprocess.Process:
    """`sweeper worker` as its own process; its warnings go to a file beside the policies
    (a pipe nobody reads could fill up and stall the worker mid-measurement)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": url, "SWEEPER_POLICIES_FILE": str(policies_file),
                "SWEEPER_WORKERS": str(workers), "SWEEPER_LOG_FORMAT": "json",
                "SWEEPER_LOG_LEVEL": "WARNING", "SWEEPER_MIGRATE_ON_START": "false",
                "SWEEPER_DB_POOL_SIZE": "10"})
    with (policies_file.parent / f"worker-{secrets.token_hex(4)}.log").open("wb") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "worker", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=log)


async def connected_workers(url: str) -> int:
    conn = await asyncpg.connect(plain_url(url))
    try:
        return int(await conn.fetchval(
            "SELECT count(DISTINCT pid) FROM pg_stat_activity "
            "WHERE application_name = 'sweeper' AND datname = current_database()"))
    finally:
        await conn.close()


async def one_configuration(ctx: BenchContext, replicas: int, budget: int, seconds: float,
                            burst_fraction: float) -> dict[str, Any]:
    burst = max(1, round(budget * burst_fraction))
    items = math.ceil(budget * (seconds + 10) * 1.2)
    async with (fake_upstream_process(ctx.repo_root, "--default-limit", str(budget),
                                      "--default-burst", str(burst + UPSTREAM_EXTRA_BURST)
                                      ) as base_url,
                fresh_database(ctx.server_url, "budget") as db):
        with tempfile.TemporaryDirectory(prefix="sweeper-bench-budget-") as tmp:
            policies_file = Path(tmp) / "policies.toml"
            policies_file.write_text(POLICIES.format(base_url=base_url, rate=budget,
                                                     burst=burst))
            policy = load_policies(policies_file).policies["carts"]
            due = datetime.now(UTC) - timedelta(days=1)
            for start in range(0, items, REGISTER_CHUNK):
                await ledger.register(db.engine, [
                    ledger.Registration(SCOPE_TENANT, f"cart-{i:08d}", policy, due)
                    for i in range(start, min(items, start + REGISTER_CHUNK))])
            workers = concurrency_for(budget, replicas)
            procs = [await start_worker(db.url, policies_file, workers)
                     for _ in range(replicas)]
            try:
                deadline = time.monotonic() + 60
                while await connected_workers(db.url) < replicas:
                    if time.monotonic() > deadline:
                        raise RuntimeError("worker processes did not connect within 60 s")
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # let their start-up CPU settle
                released_at = time.monotonic()
                run_id, _ = await runs.create_run(
                    db.engine, runs.RunRequest(None, None, None, False, None), None)
                await runs.publish(db.engine, run_id, batch_size=5_000)
                publish_s = time.monotonic() - released_at
                await asyncio.sleep(seconds + 2.0 + publish_s)
            finally:
                for proc in procs:
                    if proc.returncode is None:
                        proc.send_signal(signal.SIGTERM)
                for proc in procs:
                    try:
                        await asyncio.wait_for(proc.wait(), 30)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                calls = (await client.get("/_control/calls")).json()
    if not calls:
        raise RuntimeError("the upstream saw no call")
    t0 = min(c["received_at"] for c in calls)
    window = [c for c in calls if t0 <= c["received_at"] < t0 + seconds]
    ok = [c["received_at"] for c in window if c["outcome"] == "ok"]
    throttled = sum(1 for c in calls if c["outcome"] == "throttled")
    worst = worst_window([c["received_at"] for c in window])
    allowed = budget * seconds + burst  # a full bucket at the start, then the rate
    return {
        "replicas": replicas, "budget_per_second": budget, "burst": burst,
        "workers_per_process": workers, "items": items, "seconds": seconds,
        "calls_ok": len(ok), "achieved_percent": round(100 * len(ok) / allowed, 2),
        "worst_window": worst, "worst_window_over_rate_plus_burst":
            round(worst / (budget + burst), 4),
        "throttled": throttled, "throttled_first_second": sum(
            1 for c in calls if c["outcome"] == "throttled" and c["received_at"] < t0 + 1),
    }


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for budget in args.budgets:
        for replicas in args.replicas:
            reps = []
            for rep in range(args.repeat):
                progress(f"budget: {replicas} replica(s) at {budget}/s, "
                         f"repetition {rep + 1}/{args.repeat}")
                reps.append(await one_configuration(ctx, replicas, budget, args.seconds,
                                                    args.burst_fraction))
            results.append({
                "replicas": replicas, "budget_per_second": budget, "runs": reps,
                "achieved_percent": summarize([r["achieved_percent"] for r in reps]),
                "worst_window": summarize([r["worst_window"] for r in reps]),
                "worst_window_over_rate_plus_burst": summarize(
                    [r["worst_window_over_rate_plus_burst"] for r in reps]),
                "throttled": summarize([r["throttled"] for r in reps]),
            })
            last = results[-1]
            progress(f"budget: {replicas}x{budget}/s achieved "
                     f"{last['achieved_percent']['median']}%, worst window "
                     f"{last['worst_window']['median']}, 429s {last['throttled']['median']}")
    return {"configurations": results,
            "targets": {"achieved_percent_min": 95, "throttled": 0,
                        "worst_window_max": "rate + burst"}}


BENCHMARK = Benchmark("budget", "shared rate budget precision across replicas",
                      add_arguments, run)

"""Memory: one replica's resident set while it drains a large backlog.

A fresh database gets `--items` released items (seeded in SQL: INSERT ... SELECT over
generate_series, released at once, over 50 tenants and scopes); one `sweeper worker` OS
process, as deployed, with `--workers` concurrent calls drains them against the fake
upstream in its own process over loopback (no rate limit). Every `--sample-seconds` this
process reads the worker's VmRSS and VmHWM from /proc and the upstream's call count.

Reported: peak RSS (VmHWM), RSS at 10/25/50/75/100% of the drain, the growth from 25% to
100% (a leak shows as growth proportional to items drained), throughput, and that every
item ended `succeeded`.

    python -m bench memory --items 1000000 --repeat 1

Target: peak RSS under 200 MB, and flat.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.budget import start_worker
from bench.common import (
    BenchContext,
    Benchmark,
    fresh_database,
    plain_url,
    progress,
    summarize,
)
from bench.drain import fake_upstream_process

TARGET_PEAK_MB = 200.0
TENANTS = 50
MARKS = (0.10, 0.25, 0.50, 0.75, 1.00)

POLICIES = """
[upstreams.shop]
base_url = "{base_url}"
timeout_seconds = 10
max_connections = {connections}

[policies.carts]
version = 1
upstream = "shop"
path = "/carts/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = 100000, burst = 100000 }}
lease_seconds = 120
max_attempts = 5
"""

_SEED = """
    INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, scope,
                       due_at, released_at)
    SELECT 'tenant-' || (g % $2), 'cart-' || g, 'carts', 1,
           encode(sha256(('memory:' || g)::bytea), 'hex'), 'tenant:tenant-' || (g % $2),
           now() - interval '1 day', now()
    FROM generate_series(1, $1) g
"""

_SCOPES = """
    INSERT INTO scopes (name, rate_per_second, burst, tokens)
    SELECT 'tenant:tenant-' || g, 100000, 100000, 100000 FROM generate_series(0, $1 - 1) g
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=1_000_000,
                        help="released items to drain (default 1000000)")
    parser.add_argument("--workers", type=int, default=64,
                        help="SWEEPER_WORKERS of the replica (default 64)")
    parser.add_argument("--sample-seconds", type=float, default=1.0,
                        help="how often RSS is read (default 1)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="give up after this many seconds (default 3600)")


def memory_of(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields["VmHWM"]


async def one_run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    async with (fake_upstream_process(ctx.repo_root) as (base_url, _pid),
                fresh_database(ctx.server_url, "memory") as db):
        conn = await asyncpg.connect(plain_url(db.url))
        try:
            await conn.execute(_SCOPES, TENANTS)
            await conn.execute(_SEED, args.items, TENANTS)
            await conn.execute("VACUUM (ANALYZE) items")
        finally:
            await conn.close()
        with tempfile.TemporaryDirectory(prefix="sweeper-bench-memory-") as tmp:
            policies = Path(tmp) / "policies.toml"
            policies.write_text(POLICIES.format(base_url=base_url,
                                                connections=max(16, args.workers)))
            log_path = Path(tmp) / "worker.log"
            proc = await start_worker(db.url, policies, args.workers, log_path=log_path)
            try:
                samples = await sample_until_drained(proc, base_url, args)
            except RuntimeError as exc:
                tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(f"{exc}; its log ends:\n{tail}") from None
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        await asyncio.wait_for(proc.wait(), 60)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()
        conn = await asyncpg.connect(plain_url(db.url))
        try:
            statuses = {r["status"]: r["n"] for r in await conn.fetch(
                "SELECT status, count(*) AS n FROM items GROUP BY status")}
        finally:
            await conn.close()
    return summarize_samples(samples, args.items) | {"db_status": statuses}


async def sample_until_drained(proc: asyncio.subprocess.Process, base_url: str,
                               args: argparse.Namespace) -> list[dict[str, float]]:
    """(seconds, calls, rss, hwm) every --sample-seconds until the upstream has seen every
    item called."""
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"the worker exited with {proc.returncode}")
            rss, hwm = memory_of(proc.pid)
            calls = int((await client.get("/_control/stats")).json()["calls"])
            elapsed = time.monotonic() - started
            samples.append({"seconds": round(elapsed, 2), "calls": calls,
                            "rss_mb": round(rss, 1), "hwm_mb": round(hwm, 1)})
            if len(samples) % 60 == 0:
                progress(f"memory: {calls:,}/{args.items:,} called, RSS {rss:.0f} MB")
            if calls >= args.items:
                await asyncio.sleep(2.0)  # the last outcomes commit
                rss, hwm = memory_of(proc.pid)
                samples.append({"seconds": round(time.monotonic() - started, 2),
                                "calls": calls, "rss_mb": round(rss, 1),
                                "hwm_mb": round(hwm, 1)})
                return samples
            if elapsed > args.timeout:
                raise TimeoutError(f"{calls}/{args.items} called after {elapsed:.0f} s")
            await asyncio.sleep(args.sample_seconds)


def summarize_samples(samples: list[dict[str, float]], items: int) -> dict[str, Any]:
    def rss_at(share: float) -> float:
        return next(s["rss_mb"] for s in samples if s["calls"] >= share * items)

    at = {f"{round(100 * m)}%": rss_at(m) for m in MARKS}
    first = next(s for s in samples if s["calls"] > 0)
    drain_s = samples[-1]["seconds"] - first["seconds"]
    return {"items": items, "peak_rss_mb": samples[-1]["hwm_mb"], "rss_mb_at": at,
            "growth_mb_25_to_100": round(at["100%"] - at["25%"], 1),
            "items_per_s": round(items / drain_s, 1) if drain_s > 0 else None,
            "samples": samples}


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for rep in range(args.repeat):
        progress(f"memory: draining {args.items:,} items, repetition {rep + 1}/{args.repeat}")
        runs.append(await one_run(ctx, args))
        last = runs[-1]
        progress(f"memory: peak {last['peak_rss_mb']} MB, at 25/100% "
                 f"{last['rss_mb_at']['25%']}/{last['rss_mb_at']['100%']} MB, "
                 f"{last['items_per_s']} items/s")
        if last["db_status"] != {"succeeded": args.items}:
            raise RuntimeError(f"the drain left {last['db_status']}")
    return {"parameters": {"items": args.items, "workers": args.workers},
            "runs": runs, "peak_rss_mb": summarize([r["peak_rss_mb"] for r in runs]),
            "growth_mb_25_to_100": summarize([r["growth_mb_25_to_100"] for r in runs]),
            "target_peak_rss_mb": TARGET_PEAK_MB}


BENCHMARK = Benchmark("memory", "peak RSS of one replica draining a large backlog",
                      add_arguments, run)

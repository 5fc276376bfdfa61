"""Registration throughput: bulk `POST /v1/items` of 10,000 items per request against one
`sweeper serve` process (API only), each request committed before its answer.

Bodies are encoded before the clock starts, so the figure is the server's (the client
still shares the machine's two cores). Reported: items/s over the whole run and request
latency percentiles, for fresh items and for registering the same items again (the
idempotent path: nothing inserted, nothing postponed).

    python -m bench registration --requests 20 --batch 10000 --clients 1,2 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.common import (
    BenchContext,
    Benchmark,
    backend_cpu,
    cpu_seconds,
    cpu_spent,
    fresh_database,
    int_list,
    progress,
    summarize,
)
from bench.server import sweeper_server

TENANTS = ("acme", "globex", "initech", "umbrella")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20, help="requests per run (default 20)")
    parser.add_argument("--batch", type=int, default=10_000,
                        help="items per request (default 10000, the API's maximum)")
    parser.add_argument("--clients", type=int_list, default="1,2",
                        help="comma-separated concurrent clients (default 1,2)")


def bodies(requests: int, batch: int) -> list[bytes]:
    out = []
    for r in range(requests):
        items = [{"tenant_id": TENANTS[i % len(TENANTS)], "object_id": f"cart-{r:04d}-{i:06d}",
                  "policy": "carts", "due_at": "2026-01-01T00:00:00Z"} for i in range(batch)]
        out.append(json.dumps({"items": items}).encode())
    return out


async def send_all(base_url: str, headers: dict[str, str], payloads: list[bytes],
                   clients: int) -> tuple[float, list[float]]:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in payloads:
        queue.put_nowait(body)
    latencies: list[float] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                     headers={**headers, "Content-Type": "application/json"}
                                     ) as http:
            while not queue.empty():
                body = queue.get_nowait()
                started = time.perf_counter()
                response = await http.post("/v1/items", content=body)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    raise RuntimeError(f"POST /v1/items answered {response.status_code}: "
                                       f"{response.text[:300]}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - started, latencies


def cpu_per_request(before: tuple[float, dict[int, float] | None],
                    after: tuple[float, dict[int, float] | None], requests: int
                    ) -> dict[str, float | None]:
    """API process and PostgreSQL backends' CPU between two readings, per request (ms)."""
    database = cpu_spent(before[1], after[1])
    return {"api": round(1000 * (after[0] - before[0]) / requests, 1),
            "postgres": None if database is None else round(1000 * database / requests, 1)}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    payloads = bodies(args.requests, args.batch)
    total = args.requests * args.batch
    results = []
    for clients in args.clients:
        reps = []
        for rep in range(args.repeat):
            progress(f"registration: {clients} client(s), repetition {rep + 1}/{args.repeat}")
            async with (fresh_database(ctx.server_url, "registration") as db,
                        sweeper_server(db.url) as server):
                cpu = [(cpu_seconds(server.pid), await backend_cpu(db.url, db.name))]
                fresh_s, fresh_lat = await send_all(server.base_url, server.headers, payloads,
                                                    clients)
                cpu.append((cpu_seconds(server.pid), await backend_cpu(db.url, db.name)))
                again_s, again_lat = await send_all(server.base_url, server.headers, payloads,
                                                    clients)
                cpu.append((cpu_seconds(server.pid), await backend_cpu(db.url, db.name)))
            reps.append({
                "items": total, "fresh_items_per_second": round(total / fresh_s, 1),
                "fresh_latency_ms": {"p50": round(1000 * statistics.median(fresh_lat), 1),
                                     "p99": round(1000 * pct(fresh_lat, 0.99), 1)},
                "again_items_per_second": round(total / again_s, 1),
                "again_latency_ms": {"p50": round(1000 * statistics.median(again_lat), 1),
                                     "p99": round(1000 * pct(again_lat, 0.99), 1)},
                # CPU per request, which a shared machine distorts less than items/s: where
                # the time goes (None for PostgreSQL on another machine)
                "fresh_cpu_ms_per_request": cpu_per_request(cpu[0], cpu[1], args.requests),
                "again_cpu_ms_per_request": cpu_per_request(cpu[1], cpu[2], args.requests),
            })
        results.append({"clients": clients, "runs": reps,
                        "fresh_items_per_second": summarize(
                            [r["fresh_items_per_second"] for r in reps]),
                        "fresh_api_cpu_ms_per_request": summarize(
                            [r["fresh_cpu_ms_per_request"]["api"] for r in reps]),
                        "fresh_postgres_cpu_ms_per_request": summarize(
                            [r["fresh_cpu_ms_per_request"]["postgres"] for r in reps
                             if r["fresh_cpu_ms_per_request"]["postgres"] is not None]),
                        "again_items_per_second": summarize(
                            [r["again_items_per_second"] for r in reps])})
        progress(f"registration: {clients} client(s): "
                 f"{results[-1]['fresh_items_per_second']['median']} items/s fresh, "
                 f"{results[-1]['again_items_per_second']['median']} items/s again; CPU per "
                 f"fresh request: API {results[-1]['fresh_api_cpu_ms_per_request']['median']}"
                 f" ms, PostgreSQL "
                 f"{results[-1]['fresh_postgres_cpu_ms_per_request']['median']} ms")
    return {"batch": args.batch, "requests": args.requests, "configurations": results,
            "target_items_per_second": 50_000}


BENCHMARK = Benchmark("registration", "bulk POST /v1/items throughput", add_arguments, run)

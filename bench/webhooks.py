"""Webhook intake: sustained signed deliveries against ONE `sweeper serve` process.

Each repetition: a fresh migrated database; `python -m service serve --api-only` in its own
OS process (uvicorn as deployed, JSON logs at --log-level to /dev/null); a policies file
with one source (Standard Webhooks or Shopify signatures) whose rule makes each delivery's
item due now, so every delivery inserts an item, releases it, notifies workers and writes
its receipt, all committed before the answer. The load generator (this process) keeps
`concurrency` keep-alive connections busy for --seconds, each sending a new signed delivery
(unique webhook id and object id) as soon as the previous answer arrives, over raw asyncio
streams so that the client's own CPU stays small on a shared 2-core machine. Deliveries are
signed before the clock starts. Afterwards the database must hold one receipt and one item
per 202 answer.

Reported per concurrency: accepted/s, latency p50/p90/p99/max (ms, send to full answer),
answers by status, the server process's CPU per delivery, medians over repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg

from bench.common import (
    BenchContext,
    Benchmark,
    backend_cpu,
    cpu_seconds,
    cpu_spent,
    fresh_database,
    int_list,
    plain_url,
    progress,
    summarize,
)

TARGET_PER_S = 1000.0
TARGET_P99_MS = 50.0
SOURCE = "store"
SECRET_ENV = "BENCH_WEBHOOK_SECRET"  # noqa: S105 - a variable name
STANDARD_SECRET = "whsec_" + base64.b64encode(b"bench-secret-0123456789abcdefghij").decode()
SHOPIFY_SECRET = "shpss_bench_secret"  # noqa: S105 - a benchmark-only secret
TENANTS = 16
SERVER_START_TIMEOUT_S = 60.0
DEFAULT_CONCURRENCY = (8, 32, 64)

POLICIES_TOML = """
[upstreams.store]
base_url = "http://127.0.0.1:9"

[policies.carts]
version = 1
upstream = "store"
path = "/carts/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = 100.0, burst = 100 }}

[webhooks.{source}]
scheme = "{scheme}"
secret_env = "{secret_env}"

[[webhooks.{source}.rules]]
topic = "orders/cancelled"
policy = "carts"
tenant = "{tenant}"
object_id = "body:id"
due = "now"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="sustained load per repetition and concurrency (default 10)")
    parser.add_argument("--warmup-seconds", type=float, default=1.0,
                        help="load before the clock starts (default 1)")
    parser.add_argument("--concurrency", type=int_list, default=list(DEFAULT_CONCURRENCY),
                        help="connections kept busy, comma-separated (default 8,32,64)")
    parser.add_argument("--scheme", choices=("standard", "shopify"), default="standard",
                        help="signature scheme of the source (default standard)")
    parser.add_argument("--log-level", choices=("INFO", "WARNING"), default="INFO",
                        help="server log level (JSON to /dev/null; default INFO, as deployed)")
    parser.add_argument("--max-rate", type=float, default=4000.0,
                        help="deliveries signed per second of load: the ceiling the run can "
                             "show (default 4000)")


# -- deliveries ------------------------------------------------------------------------------


def signed_request(scheme: str, n: int, port: int) -> bytes:
    """One complete HTTP/1.1 request: a new webhook id and object id, signed."""
    tenant = f"shop-{n % TENANTS}.example.com"
    if scheme == "standard":
        body = json.dumps({"type": "orders/cancelled", "id": f"order-{n}",
                           "data": {"shop": tenant}}).encode()
        msg_id, stamp = f"msg_{uuid.uuid4().hex}", str(int(time.time()))
        key = base64.b64decode(STANDARD_SECRET.removeprefix("whsec_"))
        sig = base64.b64encode(hmac.new(key, f"{msg_id}.{stamp}.".encode() + body,
                                        hashlib.sha256).digest()).decode()
        headers = {"webhook-id": msg_id, "webhook-timestamp": stamp,
                   "webhook-signature": f"v1,{sig}"}
    else:
        body = json.dumps({"id": f"order-{n}", "cancel_reason": "customer"}).encode()
        sig = base64.b64encode(hmac.new(SHOPIFY_SECRET.encode(), body,
                                        hashlib.sha256).digest()).decode()
        headers = {"X-Shopify-Hmac-Sha256": sig, "X-Shopify-Topic": "orders/cancelled",
                   "X-Shopify-Shop-Domain": tenant, "X-Shopify-Webhook-Id": str(uuid.uuid4())}
    lines = [f"POST /v1/webhooks/{SOURCE} HTTP/1.1", f"Host: 127.0.0.1:{port}",
             "Content-Type: application/json", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 answer (Content-Length framed, as uvicorn sends JSON); its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


# -- the server process ------------------------------------------------------------------------


@asynccontextmanager
async def serve(db_url: str, scheme: str, log_level: str, workdir: Path
                ) -> AsyncIterator[tuple[int, int]]:
    """`sweeper serve --api-only` on a free port in its own process; yields (port, pid)."""
    tenant = "body:data.shop" if scheme == "standard" else "header:X-Shopify-Shop-Domain"
    policies = workdir / "policies.toml"
    policies.write_text(POLICIES_TOML.format(source=SOURCE, scheme=scheme, tenant=tenant,
                                             secret_env=SECRET_ENV), encoding="utf-8")
    port_probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = port_probe.sockets[0].getsockname()[1]
    port_probe.close()
    await port_probe.wait_closed()
    env = {**os.environ, "SWEEPER_DATABASE_URL": db_url, "SWEEPER_POLICIES_FILE": str(policies),
           "SWEEPER_MIGRATE_ON_START": "false", "SWEEPER_LOG_LEVEL": log_level,
           "SWEEPER_LOG_FORMAT": "json", "SWEEPER_ENVIRONMENT": "development",
           SECRET_ENV: STANDARD_SECRET if scheme == "standard" else SHOPIFY_SECRET}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "serve", "--api-only", "--host", "127.0.0.1",
        "--port", str(port), env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"sweeper serve exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("sweeper serve did not become ready")
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                             "Connection: close\r\n\r\n".encode())
                status = await read_answer(reader)
                writer.close()
                if status == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.1)
        yield port, proc.pid
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


# -- one measurement ------------------------------------------------------------------------


async def load(port: int, requests: list[bytes], concurrency: int, seconds: float,
               warmup_s: float) -> dict[str, Any]:
    """Keep `concurrency` connections busy; measure answers that start after the warm-up."""
    pending = iter(requests)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    started = time.perf_counter()
    measure_from = started + warmup_s
    stop_at = measure_from + seconds
    exhausted = False

    async def connection() -> None:
        nonlocal exhausted
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                request = next(pending, None)
                if request is None:
                    exhausted = True
                    return
                sent = time.perf_counter()
                writer.write(request)
                status = await read_answer(reader)
                done = time.perf_counter()
                if sent >= measure_from and done <= stop_at:
                    latencies.append(done - sent)
                    statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    elapsed = min(time.perf_counter(), stop_at) - measure_from
    accepted = statuses.get(202, 0)
    ms = sorted(x * 1000 for x in latencies)

    def pct(p: float) -> float | None:
        return round(ms[min(len(ms) - 1, int(p * len(ms)))], 2) if ms else None

    return {"seconds": round(elapsed, 3), "answers": len(ms),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "accepted_per_s": round(accepted / elapsed, 1) if elapsed > 0 else 0.0,
            "latency_ms": {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99),
                           "max": round(ms[-1], 2) if ms else None,
                           "mean": round(statistics.fmean(ms), 2) if ms else None},
            "ran_out_of_deliveries": exhausted}


async def repetition(ctx: BenchContext, args: argparse.Namespace, concurrency: int,
                     label: str) -> dict[str, Any]:
    async with fresh_database(ctx.server_url, "webhooks") as db:
        with tempfile.TemporaryDirectory(prefix="sweeper-bench-webhooks-") as tmp:
            async with serve(db.url, args.scheme, args.log_level, Path(tmp)) as (port, pid):
                n = int((args.seconds + args.warmup_seconds) * args.max_rate)
                requests = [signed_request(args.scheme, i, port) for i in range(n)]
                load_avg = os.getloadavg()[0]
                cpu_before = cpu_seconds(pid)
                result = await load(port, requests, concurrency, args.seconds,
                                    args.warmup_seconds)
                server_cpu = cpu_seconds(pid) - cpu_before
                # the intake pool's backends connected for this run: all their CPU counts
                intake_cpu = cpu_spent({}, await backend_cpu(db.url, db.name,
                                                             "sweeper-webhooks"))
        conn = await asyncpg.connect(plain_url(db.url))
        try:
            receipts = await conn.fetchval("SELECT count(*) FROM webhook_receipts")
            items = await conn.fetchval(
                "SELECT count(*) FROM items WHERE released_at IS NOT NULL")
        finally:
            await conn.close()
    total_sent = sum(result["statuses"].values())
    result.update({
        "concurrency": concurrency, "load_average_1m_at_start": round(load_avg, 2),
        # the server's CPU covers the warm-up too: per delivery over every answer it sent
        "server_cpu_seconds": round(server_cpu, 3),
        # CPU per delivery is what a busy shared machine distorts least: the server process,
        # and the PostgreSQL backends of its intake pool (since they connected)
        "server_cpu_us_per_delivery": round(server_cpu / receipts * 1e6) if receipts else None,
        "postgres_intake_cpu_us_per_delivery": (round(intake_cpu / receipts * 1e6)
                                                if receipts and intake_cpu else None),
        "db_receipts": receipts, "db_released_items": items,
        # every 202 left exactly one receipt and one released item behind (warm-up included)
        "db_consistent": receipts == items and receipts >= result["statuses"].get("202", 0),
    })
    progress(f"webhooks {label} c={concurrency}: {result['accepted_per_s']}/s, "
             f"p50 {result['latency_ms']['p50']} ms, p99 {result['latency_ms']['p99']} ms, "
             f"statuses {result['statuses']} ({total_sent} measured)")
    return result


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    sweep = sorted(set(args.concurrency))
    reps: dict[str, list[dict[str, Any]]] = {str(c): [] for c in sweep}
    for rep in range(args.repeat):
        for c in sweep:
            reps[str(c)].append(await repetition(ctx, args, c, f"rep {rep + 1}/{args.repeat}"))
    results: dict[str, dict[str, Any]] = {
        c: {"accepted_per_s": summarize([r["accepted_per_s"] for r in rows]),
            "p50_ms": summarize([r["latency_ms"]["p50"] or 0 for r in rows]),
            "p99_ms": summarize([r["latency_ms"]["p99"] or 0 for r in rows]),
            "server_cpu_us_per_delivery": summarize(
                [r["server_cpu_us_per_delivery"] or 0 for r in rows]),
            "postgres_intake_cpu_us_per_delivery": summarize(
                [r["postgres_intake_cpu_us_per_delivery"] or 0 for r in rows]),
            "repetitions": rows} for c, rows in reps.items()}
    met = [(cell["accepted_per_s"]["median"] or 0, int(c)) for c, cell in results.items()
           if (cell["accepted_per_s"]["median"] or 0) >= TARGET_PER_S
           and (cell["p99_ms"]["median"] or 1e9) < TARGET_P99_MS]
    best = max((cell["accepted_per_s"]["median"] or 0, int(c)) for c, cell in results.items())
    doc: dict[str, Any] = {
        "parameters": {"seconds": args.seconds, "warmup_seconds": args.warmup_seconds,
                       "concurrency": sweep, "repeat": args.repeat, "scheme": args.scheme,
                       "server": "python -m service serve --api-only (one uvicorn process)",
                       "log_level": args.log_level, "rule": "due now: insert + release + "
                       "NOTIFY + receipt per delivery", "tenants": TENANTS,
                       "client": "raw asyncio streams, keep-alive, pre-signed deliveries"},
        "results": results,
        "target": {"accepted_per_s": TARGET_PER_S, "p99_ms_below": TARGET_P99_MS,
                   "best_median_accepted_per_s": best[0], "at_concurrency": best[1],
                   "met": bool(met),
                   "met_at_concurrency": sorted(c for _, c in met)},
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }
    lines = ["webhooks: median accepted/s, p50/p99 ms (min-max accepted/s)"]
    for c, cell in results.items():
        a = cell["accepted_per_s"]
        lines.append(f"  c={c:<4} {a['median']:>8.1f}/s  p50 {cell['p50_ms']['median']} ms"
                     f"  p99 {cell['p99_ms']['median']} ms  ({a['min']}-{a['max']})  cpu/delivery"
                     f" server {cell['server_cpu_us_per_delivery']['median']} us, postgres "
                     f"{cell['postgres_intake_cpu_us_per_delivery']['median']} us")
    lines.append(f"  target >= {TARGET_PER_S:.0f}/s with p99 < {TARGET_P99_MS:.0f} ms: "
                 f"{'met at c=' + str(doc['target']['met_at_concurrency']) if met else 'NOT met'}")
    progress("\n".join(lines))
    return doc


BENCHMARK = Benchmark(name="webhooks",
                      help="sustained signed webhook intake against one sweeper serve process",
                      add_arguments=add_arguments, run=run)

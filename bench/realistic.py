"""Realistic drain: one `sweeper worker` process, over TLS, to an upstream answering in
50-200 ms, with thousands of tenants each its own scope and budget (issue #45).

Seeded once per sitting into a template database: `--tenants` tenants, tenant i's scope
budgeted (as an operator's `set_budget` does) at `--budget-max / i^--zipf` calls/s, at least
`--budget-min` (a few large shops, many small ones: 2,000 tenants at 2-100/s sum to about
4,350/s), with `--burst-fraction` of it as burst; each tenant holds its budget times
`warmup + seconds + BACKLOG_MARGIN_S` due items, released by one run, then VACUUM (ANALYZE). So
no tenant runs out of work during the measured window, even at its full budget.

Each run: a database copied from the template; the fake upstream (drills/upstream) in its
own process, HTTPS with a certificate made at start, answering each call after a time drawn
uniformly from `--latency-ms`, no rate limit of its own; one worker process as deployed
(`python -m bench.realistic_worker`, which is `sweeper worker` with the rules named by
`--off` switched off), `SWEEPER_WORKERS=--concurrency`, the upstream's `max_connections`
as many, trusting the certificate as its `ca_file`. After the first completion and
`--warmup` seconds, a window of `--seconds` is measured:

  items_per_s                 items whose success committed in the window, per second
  budget_used_percent         items/s over the summed budget; also per budget class
  worker_cpu_us_per_item      the worker process's CPU (/proc) over the items
  database_cpu_us_per_item    the database's backends' CPU (/proc; null if not local)
  upstream_cpu_us_per_item    the fake upstream's process
  latency_ms p50 / p99        a success's call start (items.last_started_at) to its
                              committed completion: connection wait, TLS handshake and
                              the completion's flush included
  worker_counters             tokens granted and returned, leases handed back by reason

`--variants` lists what to compare: `on` (every rule as the product has it) and the names of
bench/realistic_worker.py's switches, each run with that one rule off. Every repetition runs
every variant once, the order rotated by one each repetition (interleaved), and each off
variant is also reported as its ratio to the `on` run of the same repetition.

    python -m bench realistic --tenants 2000 --latency-ms 50-200 --seconds 20 --repeat 3 \
        --variants on,claim-ahead,scope-reuse
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import asyncpg
from sqlalchemy import text

from bench.budget import connected_workers, worker_counters
from bench.common import (
    DATABASE_PREFIX,
    BenchContext,
    Benchmark,
    admin,
    backend_cpu,
    cpu_seconds,
    cpu_spent,
    fresh_database,
    plain_url,
    progress,
    summarize,
    vacuum_analyze,
    with_database,
)
from bench.realistic_worker import SWITCHES
from drills.stage import free_port
from service.config.policies import load_policies
from service.ledger import registration
from service.runs import publication, trigger

POLICY = "carts"
REGISTER_CHUNK = 10_000
PUBLISH_BATCH = 500
BACKLOG_MARGIN_S = 20.0  # work beyond the window, at each tenant's full budget
FIRST_COMPLETION_WAIT_S = 60.0
STOP_WAIT_S = 30.0
# budget classes reported apart: (name, lowest rate, highest rate), calls/s
CLASSES = (("2/s", 0.0, 2.0), ("2-10/s", 2.0, 10.0), ("10-100/s", 10.0, math.inf))

POLICIES = """
[upstreams.shop]
base_url = "{base_url}"
timeout_seconds = 10
max_connections = {max_connections}
{ca_line}

[policies.carts]
version = 1
upstream = "shop"
method = "DELETE"
path = "/tenants/{{tenant_id}}/carts/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = 2, burst = 1 }}
lease_seconds = 60
max_attempts = 5
"""


def _variants(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(set(names) - {"on", *SWITCHES})
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"variants are on and {', '.join(sorted(SWITCHES))}; unknown: {unknown}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=int, default=2000,
                        help="tenants, each its own scope (default 2000)")
    parser.add_argument("--budget-max", type=float, default=100.0,
                        help="the largest tenant's budget, calls/s (default 100)")
    parser.add_argument("--budget-min", type=float, default=2.0,
                        help="the smallest budget, calls/s (default 2)")
    parser.add_argument("--zipf", type=float, default=1.0,
                        help="tenant i's budget is budget-max / i^zipf, at least budget-min "
                             "(default 1.0)")
    parser.add_argument("--burst-fraction", type=float, default=0.05,
                        help="each scope's burst as a fraction of its budget, at least 1 "
                             "(default 0.05)")
    parser.add_argument("--latency-ms", default="50-200",
                        help="the upstream's answer time, LOW-HIGH ms, uniform (default "
                             "50-200)")
    parser.add_argument("--no-tls", dest="tls", action="store_false",
                        help="plain HTTP to the upstream (default: HTTPS)")
    parser.add_argument("--concurrency", type=int, default=1024,
                        help="SWEEPER_WORKERS of the worker process, and the upstream's "
                             "max_connections (default 1024)")
    parser.add_argument("--warmup", type=float, default=8.0,
                        help="seconds after the first completion before the window "
                             "(default 8)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="the measured window, seconds (default 20)")
    parser.add_argument("--variants", type=_variants, default=["on"],
                        help="comma-separated: on, and rules to switch off one at a time: "
                             f"{', '.join(SWITCHES)} (default on)")
    parser.add_argument("--worker-log-level", choices=("INFO", "WARNING"), default="INFO",
                        help="the worker's log level (JSON to a file; default INFO, as "
                             "deployed)")


# -- the tenants and the template ------------------------------------------------------------


def budgets(args: argparse.Namespace) -> list[float]:
    """Tenant i's budget (calls/s), largest first."""
    return [round(max(args.budget_min, args.budget_max / (i + 1) ** args.zipf), 3)
            for i in range(args.tenants)]


def tenant(i: int) -> str:
    return f"shop-{i:05d}"


def burst_of(rate: float, fraction: float) -> int:
    return max(1, round(rate * fraction))


async def seed_template(db_engine: Any, policies_file: Path, args: argparse.Namespace,
                        rates: list[float]) -> dict[str, Any]:
    """Register every tenant's backlog, set its scope's budget, release all, VACUUM."""
    started = time.perf_counter()
    policy = load_policies(policies_file).policies[POLICY]
    due = datetime.now(UTC) - timedelta(days=1)
    backlog_s = args.warmup + args.seconds + BACKLOG_MARGIN_S
    chunk: list[registration.Registration] = []
    items = 0
    for i, rate in enumerate(rates):
        for n in range(math.ceil(rate * backlog_s)):
            chunk.append(registration.Registration(tenant(i), f"cart-{n:06d}", policy, due))
            if len(chunk) == REGISTER_CHUNK:
                await registration.register(db_engine, chunk)
                items += len(chunk)
                chunk = []
    if chunk:
        await registration.register(db_engine, chunk)
        items += len(chunk)
    registered = time.perf_counter()
    async with db_engine.begin() as conn:
        updated = (await conn.execute(text(
            "UPDATE scopes s SET rate_per_second = b.rate, burst = b.burst, tokens = b.burst, "
            "budget_from_policy = false FROM unnest(CAST(:names AS text[]), "
            "CAST(:rates AS double precision[]), CAST(:bursts AS integer[])) "
            "AS b(name, rate, burst) WHERE s.name = b.name"),
            {"names": [f"tenant:{tenant(i)}" for i in range(len(rates))], "rates": rates,
             "bursts": [burst_of(r, args.burst_fraction) for r in rates]})).rowcount
    if updated != len(rates):
        raise RuntimeError(f"budgeted {updated} scopes of {len(rates)}")
    run_id, _ = await trigger.create_run(db_engine, trigger.RunRequest(None, None, None,
                                                                       False, None), None)
    if not await publication.publish(db_engine, run_id, batch_size=PUBLISH_BATCH):
        raise RuntimeError("publication was taken by another publisher")
    published = time.perf_counter()
    await vacuum_analyze(db_engine, "items")
    await vacuum_analyze(db_engine, "scopes")
    return {"items": items, "register_seconds": round(registered - started, 1),
            "publish_seconds": round(published - registered, 1),
            "seconds": round(time.perf_counter() - started, 1)}


@contextlib.asynccontextmanager
async def copy_of(server_url: str, template: str) -> AsyncIterator[str]:
    """A database copied from `template` (retried while a straggling session is on it);
    its URL, dropped after."""
    name = f"{DATABASE_PREFIX}realistic_{uuid.uuid4().hex[:8]}"
    for attempt in range(20):
        try:
            await admin(server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
            break
        except asyncpg.ObjectInUseError:
            if attempt == 19:
                raise
            await asyncio.sleep(0.5)
    try:
        yield with_database(server_url, name)
    finally:
        await admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the processes ---------------------------------------------------------------------------


class Upstream(NamedTuple):
    base_url: str
    pid: int
    ca_file: Path | None


@contextlib.asynccontextmanager
async def fake_upstream(repo_root: Path, folder: Path, latency_ms: str, tls: bool
                        ) -> AsyncIterator[Upstream]:
    """`python -m drills.upstream` over HTTPS (or HTTP), counting calls only."""
    ca_file = folder / "upstream.pem" if tls else None
    options = ["--latency-ms", latency_ms, "--count-only"]
    if ca_file is not None:
        options += ["--tls-cert-out", str(ca_file)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "drills.upstream", "--port", "0", *options,
        cwd=str(repo_root), stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        base_url = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        if not base_url.startswith(("http://", "https://")):
            raise RuntimeError(f"fake upstream did not start (said {base_url!r})")
        yield Upstream(base_url, proc.pid, ca_file)
    finally:
        await _stop(proc, 5)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


async def _stop(proc: asyncio.subprocess.Process, wait_s: float) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), wait_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()


@contextlib.asynccontextmanager
async def worker(repo_root: Path, url: str, policies_file: Path, off: list[str],
                 concurrency: int, metrics_port: int, log_path: Path, log_level: str
                 ) -> AsyncIterator[int]:
    """One `sweeper worker` process (with `off` rules switched off); yields its pid once
    connected. SIGTERM on the way out (its calls in flight finish and are committed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": url, "SWEEPER_POLICIES_FILE": str(policies_file),
                "SWEEPER_WORKERS": str(concurrency), "SWEEPER_LOG_FORMAT": "json",
                "SWEEPER_LOG_LEVEL": log_level, "SWEEPER_MIGRATE_ON_START": "false",
                "SWEEPER_DB_POOL_SIZE": "10", "SWEEPER_METRICS_PORT": str(metrics_port)})
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.realistic_worker",
            *[a for name in off for a in ("--off", name)],
            cwd=str(repo_root), env=env, stdout=asyncio.subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while await connected_workers(url) < 1:
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not connect; its log ends: "
                                   + _tail(log_path))
            await asyncio.sleep(0.1)
        yield proc.pid
    finally:
        await _stop(proc, STOP_WAIT_S)


# -- one run ---------------------------------------------------------------------------------


@dataclass
class Reading:
    """Where the counters stood at one moment."""

    at: float
    db_at: float  # the database's clock (epoch seconds): successes are read by completed_at
    last_attempt: int
    worker_cpu: float
    upstream_cpu: float
    database_cpu: dict[int, float] | None


async def read_now(conn: asyncpg.Connection, url: str, name: str, worker_pid: int,
                   upstream_pid: int) -> Reading:
    last = int(await conn.fetchval("SELECT coalesce(max(id), 0) FROM attempts"))
    db_at = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())"))
    return Reading(time.monotonic(), db_at, last, cpu_seconds(worker_pid),
                   cpu_seconds(upstream_pid), await backend_cpu(url, name))


async def window_figures(conn: asyncpg.Connection, a: Reading, b: Reading,
                         rates: list[float]) -> dict[str, Any]:
    """What was committed between two readings says: the successes from their items (a
    success has no attempt row), every other outcome from its attempt row."""
    elapsed = b.at - a.at
    rows = await conn.fetch(
        "SELECT outcome, count(*) AS n FROM attempts WHERE id > $1 AND id <= $2 GROUP BY 1",
        a.last_attempt, b.last_attempt)
    outcomes = {str(r["outcome"]): int(r["n"]) for r in rows}
    per_scope = {str(r["scope"]): int(r["n"]) for r in await conn.fetch(
        "SELECT scope, count(*) AS n FROM items WHERE status = 'succeeded' "
        "AND completed_at > to_timestamp($1) AND completed_at <= to_timestamp($2) GROUP BY 1",
        a.db_at, b.db_at)}
    ok = sum(per_scope.values())
    outcomes["succeeded"] = outcomes.get("succeeded", 0) + ok
    # a success's call start to its committed completion (the flush wait included)
    p50, p99 = await conn.fetchval(
        "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY 1000 * extract("
        "epoch FROM completed_at - last_started_at)) FROM items WHERE status = 'succeeded' "
        "AND completed_at > to_timestamp($1) AND completed_at <= to_timestamp($2)",
        a.db_at, b.db_at) or (None, None)
    classes = {}
    for label, low, high in CLASSES:
        members = [i for i, r in enumerate(rates) if low < r <= high]
        budget = sum(rates[i] for i in members)
        done = sum(per_scope.get(f"tenant:{tenant(i)}", 0) for i in members)
        classes[label] = {"tenants": len(members), "budget_per_s": round(budget, 1),
                          "items_per_s": round(done / elapsed, 1),
                          "budget_used_percent": round(100 * done / elapsed / budget, 1)
                          if budget else None}
    db_cpu = cpu_spent(a.database_cpu, b.database_cpu)
    per_item = 1e6 / ok if ok else math.nan
    return {
        "seconds": round(elapsed, 2), "items": ok, "attempts_by_outcome": outcomes,
        "items_per_s": round(ok / elapsed, 1),
        "budget_used_percent": round(100 * ok / elapsed / sum(rates), 2),
        "budget_classes": classes,
        "worker_cpu_us_per_item": round((b.worker_cpu - a.worker_cpu) * per_item, 1),
        "worker_cpu_share": round((b.worker_cpu - a.worker_cpu) / elapsed, 3),
        "database_cpu_us_per_item": None if db_cpu is None else round(db_cpu * per_item, 1),
        "upstream_cpu_us_per_item": round((b.upstream_cpu - a.upstream_cpu) * per_item, 1),
        "latency_ms": {"p50": None if p50 is None else round(p50, 1),
                       "p99": None if p99 is None else round(p99, 1)},
    }


async def one_run(ctx: BenchContext, args: argparse.Namespace, template: str, variant: str,
                  rates: list[float], folder: Path) -> dict[str, Any]:
    off = [] if variant == "on" else [variant]
    load = os.getloadavg()[0]
    async with (copy_of(ctx.server_url, template) as url,
                fake_upstream(ctx.repo_root, folder, args.latency_ms, args.tls) as up):
        policies_file = folder / f"policies-{variant}.toml"
        policies_file.write_text(POLICIES.format(
            base_url=up.base_url, max_connections=args.concurrency,
            ca_line=f'ca_file = "{up.ca_file}"' if up.ca_file else ""))
        name = urlsplit(url).path.lstrip("/")  # without a query (the embedded server's socket)
        port = free_port()
        conn = await asyncpg.connect(plain_url(url))
        try:
            async with worker(ctx.repo_root, url, policies_file, off, args.concurrency, port,
                              folder / f"worker-{variant}.log", args.worker_log_level) as pid:
                deadline = time.monotonic() + FIRST_COMPLETION_WAIT_S
                while not await conn.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM items WHERE completed_at IS NOT NULL)"):
                    if time.monotonic() > deadline:
                        raise RuntimeError("no call completed within a minute")
                    await asyncio.sleep(0.1)
                await asyncio.sleep(args.warmup)
                a = await read_now(conn, url, name, pid, up.pid)
                await asyncio.sleep(args.seconds)
                b = await read_now(conn, url, name, pid, up.pid)
                counters = await worker_counters([port])
            figures = await window_figures(conn, a, b, rates)
        finally:
            await conn.close()
    figures.update({"variant": variant, "load_average_1m_at_start": load,
                    "worker_counters": counters})
    progress(f"realistic {variant:16} {figures['items_per_s']:>7.0f} items/s "
             f"({figures['budget_used_percent']:.1f}% of budget), worker "
             f"{figures['worker_cpu_us_per_item']} us/item, db "
             f"{figures['database_cpu_us_per_item']} us/item, p50/p99 "
             f"{figures['latency_ms']['p50']}/{figures['latency_ms']['p99']} ms, load {load:.1f}")
    return figures


# -- the sitting -----------------------------------------------------------------------------

MEDIANS = ("items_per_s", "budget_used_percent", "worker_cpu_us_per_item",
           "database_cpu_us_per_item", "upstream_cpu_us_per_item", "worker_cpu_share")


def _median_of(runs: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    return summarize([r[key] for r in runs if r.get(key) is not None])


def summary(variants: list[str], reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: medians of its runs; for an off variant, the medians of its ratios to
    the `on` run of the same repetition."""
    out: dict[str, Any] = {}
    for variant in variants:
        runs = [rep[variant] for rep in reps]
        doc: dict[str, Any] = {key: _median_of(runs, key) for key in MEDIANS}
        doc["latency_p50_ms"] = summarize([r["latency_ms"]["p50"] for r in runs
                                           if r["latency_ms"]["p50"] is not None])
        doc["latency_p99_ms"] = summarize([r["latency_ms"]["p99"] for r in runs
                                           if r["latency_ms"]["p99"] is not None])
        if variant != "on" and "on" in variants:
            doc["over_on"] = {key: round(statistics.median(
                [rep[variant][key] / rep["on"][key] for rep in reps
                 if rep[variant].get(key) and rep["on"].get(key)] or [math.nan]), 3)
                for key in ("items_per_s", "worker_cpu_us_per_item",
                            "database_cpu_us_per_item")}
        out[variant] = doc
    return out


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    rates = budgets(args)
    progress(f"realistic: {args.tenants} tenants, budgets {rates[-1]}-{rates[0]}/s summing "
             f"to {sum(rates):.0f}/s, latency {args.latency_ms} ms, "
             f"{'TLS' if args.tls else 'plain HTTP'}")
    reps: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="sweeper-bench-realistic-") as tmp:
        folder = Path(tmp)
        seed_policies = folder / "seed.toml"
        seed_policies.write_text(POLICIES.format(base_url="https://upstream.invalid",
                                                 max_connections=args.concurrency,
                                                 ca_line=""))
        async with fresh_database(ctx.server_url, "realistic_template") as tmpl:
            seeding = await seed_template(tmpl.engine, seed_policies, args, rates)
            await tmpl.engine.dispose()  # a template copies only with no session on it
            progress(f"realistic: seeded {seeding['items']} items in {seeding['seconds']} s")
            for rep in range(args.repeat):
                shift = rep % len(args.variants)
                order = args.variants[shift:] + args.variants[:shift]
                reps.append({})
                for variant in order:
                    progress(f"realistic: repetition {rep + 1}/{args.repeat}, {variant}")
                    reps[-1][variant] = await one_run(ctx, args, tmpl.name, variant, rates,
                                                      folder)
    return {
        "parameters": {"tenants": args.tenants, "budget_min": args.budget_min,
                       "budget_max": args.budget_max, "zipf": args.zipf,
                       "budget_sum_per_s": round(sum(rates), 1),
                       "burst_fraction": args.burst_fraction, "latency_ms": args.latency_ms,
                       "tls": args.tls, "concurrency": args.concurrency,
                       "warmup_s": args.warmup, "seconds": args.seconds,
                       "variants": args.variants, "repeat": args.repeat,
                       "worker_log_level": args.worker_log_level},
        "switches": {name: SWITCHES[name][0] for name in args.variants if name != "on"},
        "seeding": seeding,
        "summary": summary(args.variants, reps),
        "repetitions": reps,
    }


BENCHMARK = Benchmark("realistic", "one worker process over TLS to a 50-200 ms upstream, "
                      "thousands of tenants at 2-100 calls/s each; rules switched off one at "
                      "a time", add_arguments, run)
